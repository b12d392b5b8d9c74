"""How the JSON the database holds becomes Python, whoever wrote it.

PostgreSQL accepts JSON that Python cannot load (an integer of 5,000 digits, ``1e400``, nesting
thousands deep) and any JSON value where a document should be an object; a writer with access
to the database may put such a row beside handoffd's own. psycopg's own loader raises while a
result is fetched, so one such row would fail every query that reads it (a whole listing, every
claim, every sweep). :class:`SafeJsonLoader` reads json and jsonb with handoffd's own reader
instead and never raises: a value it refuses becomes an :class:`Unloadable` that says why, and
:func:`document` turns what a handoff row holds into a document or an InvalidDocument with its
code, which the backend answers as the files backend answers an unreadable file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg.abc import Buffer
from psycopg.adapt import Loader

from ...core.documents import MAX_DEPTH, check_id, nesting_depth
from ...core.errors import ErrorCode, InvalidDocument, UnreadableDocument
from ...core.jsontext import load_json

Doc = dict[str, Any]


@dataclass(frozen=True)
class Unloadable:
    """A json/jsonb value that handoffd's reader refuses: its error ``code`` and ``reason``."""

    code: str
    reason: str


class SafeJsonLoader(Loader):
    """Loads json and jsonb text as :func:`handoffd.core.jsontext.load_json` does (no NaN,
    no overflowing number, no integer past Python's digit limit, no runaway nesting); a value it
    refuses is an :class:`Unloadable`, never an exception in the middle of a fetch."""

    def load(self, data: Buffer) -> Any:
        """The value, or an Unloadable saying why it cannot be one."""
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError:  # the server sends UTF-8; a client encoding may not
            return Unloadable(ErrorCode.NOT_UTF8, "the stored JSON is not UTF-8")
        try:
            return load_json(text, "the stored JSON")
        except InvalidDocument as exc:
            return Unloadable(exc.code, str(exc))
        except Exception as exc:  # a reader choking in a way load_json does not foresee
            return Unloadable(ErrorCode.UNPROCESSABLE_DOCUMENT,
                              f"the stored JSON could not be loaded: {type(exc).__name__}")


def configure(conn: Any) -> None:
    """Make ``conn`` load json and jsonb with :class:`SafeJsonLoader` (a pool's ``configure``)."""
    for name in ("json", "jsonb"):
        conn.adapters.register_loader(name, SafeJsonLoader)


def document(value: Any, handoff_id: Any, state: str) -> Doc:
    """What the row ``handoff_id`` (in ``state``) holds, as a document. InvalidDocument with its
    code when it is none: an id that is no safe file name (UNSAFE_ID: ids become file names in
    every workspace of the store), JSON Python cannot load, a value that is not an object, or a
    pending document nesting deeper than the files backend reads (DOCUMENT_TOO_DEEP)."""
    check_id(handoff_id)
    where = f"handoff {handoff_id} ({state})"
    if isinstance(value, Unloadable):
        raise InvalidDocument(f"{where}: {value.reason}", handoff_id=handoff_id, code=value.code)
    if not isinstance(value, dict):
        raise InvalidDocument(f"{where}: the stored document is a JSON {type(value).__name__}, "
                              "not an object", handoff_id=handoff_id, code=ErrorCode.NOT_AN_OBJECT)
    # what admission and every recursive reader will walk: as deep as a file may be, no deeper
    if state == "pending" and nesting_depth(value, MAX_DEPTH) > MAX_DEPTH:
        raise InvalidDocument(f"{where}: the stored document nests more than {MAX_DEPTH} levels "
                              "deep", handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_DEEP)
    return value


def unreadable(exc: InvalidDocument, handoff_id: str) -> UnreadableDocument:
    """``exc`` as :meth:`Backend.peek` reports a stored document that cannot be used: set aside
    where it lies (a database row is never half-written: looking again changes nothing)."""
    return UnreadableDocument(str(exc), handoff_id=handoff_id, code=exc.code)


def plain(value: Any) -> Any:
    """``value``, or None for an :class:`Unloadable` (records and requests that are not JSON
    Python can hold read as absent)."""
    return None if isinstance(value, Unloadable) else value
