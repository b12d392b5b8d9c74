"""How the JSON the database holds becomes Python, whoever wrote it.

PostgreSQL accepts JSON that Python cannot load (an integer of 5,000 digits, ``1e400``, nesting
thousands deep) and any JSON value where a document should be an object; a writer with access
to the database may put such a row beside handoffd's own. psycopg's own loader raises while a
result is fetched, so one such row would fail every query that reads it (a whole listing, every
claim, every sweep). :class:`SafeJsonLoader` reads json and jsonb with handoffd's own reader
instead and never raises: a value it refuses becomes an :class:`Unloadable` that says why, and
:func:`document` turns what a handoff row holds into a document or an InvalidDocument with its
code, which the backend answers as the files backend answers an unreadable file.

Timestamps likewise: a ``timestamptz`` column may hold ``infinity``, ``-infinity`` or a year
Python cannot represent (before 1, after 9999), and psycopg raises DataError while fetching it,
so one such row stopped every sweep, claim and listing that read it.
:class:`SafeTimestamptzLoader` clamps them to :data:`UTC_MIN` / :data:`UTC_MAX` instead; the
code that reads a column where such a value means "no value" asks :func:`finite`.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format

from ...core.documents import MAX_DEPTH, check_id, nesting_depth
from ...core.errors import ErrorCode, InvalidDocument, UnreadableDocument
from ...core.jsontext import load_json

Doc = dict[str, Any]


@dataclass(frozen=True)
class Unloadable:
    """A json/jsonb value that handoffd's reader refuses: its error ``code`` and ``reason``."""

    code: str
    reason: str
    memory: bool = False  # the loader ran out of memory: "not now" (see :func:`loaded`)


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
                              f"the stored JSON could not be loaded: {type(exc).__name__}",
                              memory=isinstance(exc, MemoryError))


UTC_MIN = datetime.min.replace(tzinfo=timezone.utc)
UTC_MAX = datetime.max.replace(tzinfo=timezone.utc)
TIMESTAMPTZ = "timestamptz"


def _clamped(data: Buffer, format: Format) -> datetime:
    """The end of Python's calendar that the timestamp ``data`` (which Python cannot hold) lies
    beyond: ``-infinity``, a year BC or a negative binary value is before it, else after."""
    raw = bytes(data)
    if format == Format.BINARY:  # microseconds since 2000-01-01, signed 64-bit
        return UTC_MIN if int.from_bytes(raw[:8], "big", signed=True) < 0 else UTC_MAX
    text = raw.strip().lower()
    return UTC_MIN if text.startswith(b"-") or text.endswith(b"bc") else UTC_MAX


class SafeTimestamptzLoader(Loader):
    """Loads timestamptz with psycopg's own loader; a value Python's datetime cannot hold
    (``infinity``, ``-infinity``, a year outside 1 to 9999, in UTC too) is :data:`UTC_MIN` or
    :data:`UTC_MAX` instead of a DataError in the middle of a fetch."""

    def __init__(self, oid: int, context: AdaptContext | None = None):
        super().__init__(oid, context)
        self._inner = psycopg.adapters.get_loader(oid, self.format)(oid, context)  # type: ignore[misc]

    def load(self, data: Buffer) -> datetime:
        """The timestamp, in UTC when it can be, else the end of the calendar it lies past."""
        try:
            value = self._inner.load(data)
            return value.astimezone(timezone.utc)  # (psycopg returns 9999-12-31 23:00-05 as is)
        except (psycopg.DataError, OverflowError, ValueError):
            return _clamped(data, self.format)


class SafeTimestamptzBinaryLoader(SafeTimestamptzLoader):
    """:class:`SafeTimestamptzLoader` for results fetched in binary."""

    format = Format.BINARY


def finite(value: datetime | None) -> datetime | None:
    """``value``, or None when it is a clamped infinity (:class:`SafeTimestamptzLoader`): a
    column where "never" or "always" means no usable time."""
    return None if value is None or value in (UTC_MIN, UTC_MAX) else value


def configure(conn: Any) -> None:
    """Make ``conn`` load json and jsonb with :class:`SafeJsonLoader` and timestamptz with
    :class:`SafeTimestamptzLoader` (a pool's ``configure``)."""
    for name in ("json", "jsonb"):
        conn.adapters.register_loader(name, SafeJsonLoader)
    conn.adapters.register_loader(TIMESTAMPTZ, SafeTimestamptzLoader)
    conn.adapters.register_loader(TIMESTAMPTZ, SafeTimestamptzBinaryLoader)


def capped(open_bytes: int, filed_bytes: int) -> tuple[str, str]:
    """Two result columns for a row's document: the document, or NULL when its text is over
    ``open_bytes`` (pending, in progress) or ``filed_bytes`` (finished), and that text's size.
    A document over the limit is never sent to this process (a 100 MB row written by hand was
    claimed, run and rewritten at every lease renewal)."""
    return (f"CASE WHEN octet_length(doc::text) <= CASE WHEN state IN ('completed', 'failed') "
            f"THEN {int(filed_bytes)} ELSE {int(open_bytes)} END THEN doc END",
            "octet_length(doc::text)")


def document(value: Any, handoff_id: Any, state: str, size: int | None = None) -> Doc:
    """What the row ``handoff_id`` (in ``state``) holds, as a document. InvalidDocument with its
    code when it is none: an id that is no safe file name (UNSAFE_ID: ids become file names in
    every workspace of the store), JSON Python cannot load, a value that is not an object, a
    pending document nesting deeper than the files backend reads (DOCUMENT_TOO_DEEP), or (a
    NULL ``value`` with its ``size``, see :func:`capped`) one over the size this store reads
    (DOCUMENT_TOO_LARGE)."""
    check_id(handoff_id)
    where = f"handoff {handoff_id} ({state})"
    if value is None and size is not None:
        raise InvalidDocument(f"{where}: the stored document is {size} bytes, over the limit "
                              "this store reads (raise daemon.max_document_bytes in handoffd.toml "
                              "if this is intended)", handoff_id=handoff_id,
                              code=ErrorCode.DOCUMENT_TOO_LARGE)
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


def loaded(value: Any) -> Any:
    """``value`` as fetched, raising the MemoryError its loader met (an :class:`Unloadable`
    saying so): a pending row read to claim or route it is then "not now", a memory strike
    (:mod:`handoffd.core.memorystrikes`), never a document set aside as unprocessable."""
    if isinstance(value, Unloadable) and value.memory:
        raise MemoryError(value.reason)
    return value


def unreadable(exc: InvalidDocument, handoff_id: str) -> UnreadableDocument:
    """``exc`` as :meth:`Backend.peek` reports a stored document that cannot be used: set aside
    where it lies (a database row is never half-written: looking again changes nothing)."""
    return UnreadableDocument(str(exc), handoff_id=handoff_id, code=exc.code)


def plain(value: Any) -> Any:
    """``value``, or None for an :class:`Unloadable` (records and requests that are not JSON
    Python can hold read as absent)."""
    return None if isinstance(value, Unloadable) else value
