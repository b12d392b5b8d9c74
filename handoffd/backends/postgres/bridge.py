"""Files keep working on every host: the bridge between one workspace's handoffs/ folders and the
shared PostgreSQL store.

Agents that only write files drop documents into their host's ``handoffs/pending/``. With a
PostgreSQL store the host's daemon ingests each one into the database (a *raw* handoff: admission
validates it, as it would a file) under its file name as id, then removes the file; ingesting
again is a no-op (idempotent by id). When a handoff this workspace ingested reaches a terminal
state, wherever it ran, the bridge writes the terminal document (in its own format) into this
workspace's ``completed/`` or ``failed/``, so a file-only agent sees no difference; one that a
daemon sets aside after it was ingested (an unknown format, an id that is not its file name...)
comes back as its failure stub (the document stays in the database's quarantine table).

A file that can never be ingested (unreadable, not a JSON object, an unsafe name, an id another
workspace's handoff holds, or a different document under an id this workspace ingested before)
is quarantined locally with its reason, and a failure stub is filed in the local ``failed/``
when its name is a safe id and the id is free, as the files backend does.

A ``handoffd`` bookkeeping block in a dropped file is not ours unless this workspace's seal says
handoffd wrote it there (a document moved in by ``handoffd db import``): any other is dropped
before the document is stored, so a forged ``next_attempt_at``, ``awaiting`` or
``waiting_children`` neither holds nor parks it (the files backend ignores it the same way). A
sealed block is kept, and the handoff stored as handoffd's own rather than raw: its attempts,
retry time and parking hold in the database too.

Ids read back from the database become file names here: each passes
:func:`~handoffd.core.documents.check_id` first (the backend sets aside a row whose id does not).
"""
from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Any, Callable

from ...core.documents import BOOK, check_id
from ...core.errors import ErrorCode, InvalidDocument
from ...core.states import State
from ...core.timeutil import utc_now
from ..files import fsio
from ..files.problems import read_error
from ..files.store import Store
from .backend import PostgresBackend
from .records import file_digest

log = logging.getLogger("handoffd")
HALF_WRITTEN = (ErrorCode.MALFORMED_JSON, ErrorCode.EMPTY_DOCUMENT, ErrorCode.NOT_UTF8)
Stub = Callable[[str, str, str], dict[str, Any]]  # (handoff id, code, message) -> a failure document


class FileBridge:
    """Moves ``store``'s pending files into ``backend`` and brings back the terminal documents
    of what it moved (``origin`` names the workspace in the database)."""

    def __init__(self, backend: PostgresBackend, store: Store, origin: str, *,
                 stub: Stub | None = None, clock: Callable[[], datetime] = utc_now) -> None:
        self.backend = backend
        self.store = store
        self.origin = origin
        self.stub = stub
        self.clock = clock
        # ids this process ingested and not yet exported: a wake-up for any other id (most of
        # them, with several hosts) costs no query; a scan exports whatever else is owed
        self._ours: set[str] = set()

    # ------------------------------------------------------------ files -> database
    def ingest_all(self) -> int:
        """Ingest every document in pending/; returns how many were new to the database."""
        count = 0
        for entry in list(self.store.entries(State.PENDING)):
            if entry.name.endswith(".json") and not entry.name.startswith("."):
                count += self.ingest(entry.name[:-5]) == "ingested"
        return count

    def ingest(self, handoff_id: str) -> str:
        """Ingest pending/``handoff_id``.json. Returns what happened: ``ingested``, ``known``
        (the database had it from us already: the file is removed), ``gone``, ``later`` (still
        being written, or a transient error) or ``set aside``."""
        path = self.store.path(State.PENDING, handoff_id)
        try:
            check_id(handoff_id)
        except InvalidDocument as exc:
            return self._set_aside(handoff_id, ErrorCode.UNSAFE_ID, str(exc), stub=False)
        try:
            doc, sealed = self._read(handoff_id)
        except FileNotFoundError:
            return "gone"
        except Exception as exc:  # an invalid document, a socket, EACCES...: say why, once
            problem = read_error(path, exc, handoff_id)
            if problem.transient or (problem.code in HALF_WRITTEN and self._young(path)):
                return "later"
            return self._set_aside(handoff_id, problem.code, str(problem))
        try:
            fresh = self.backend.ingest(doc, handoff_id, self.clock(), self.origin,
                                        trusted=sealed)
        except InvalidDocument as exc:  # e.g. NUL characters, which the store refuses
            return self._set_aside(handoff_id, exc.code, f"pending/{handoff_id}.json: {exc}")
        if not fresh:
            found = self.backend.ingested(handoff_id)
            if found is None:  # freed since (purged): the next pass ingests it afresh
                return "later"
            duplicate = self._duplicate(handoff_id, doc, *found)
            if duplicate is not None:
                return self._set_aside(handoff_id, ErrorCode.DUPLICATE_HANDOFF_ID, duplicate,
                                       stub=False)
        self._ours.add(handoff_id)
        fsio.unlink(path, durable=False)  # in the database now (a crash before: re-ingested)
        if fresh:
            log.info("ingested pending/%s.json into the shared store", handoff_id,
                     extra={"event": "ingested", "handoff_id": handoff_id})
        return "ingested" if fresh else "known"

    def _read(self, handoff_id: str) -> tuple[dict[str, Any], bool]:
        """pending/``handoff_id``.json, without a ``handoffd`` block that handoffd did not seal
        there (see the module docstring; without a seal key no block can be trusted), and
        whether it kept a sealed block (the database then keeps it too, as handoffd's own)."""
        doc = self.store.read(State.PENDING, handoff_id)
        if BOOK not in doc:
            return doc, False
        if self.store.key is None or not self.store.trusted_revision(doc, State.PENDING,
                                                                     handoff_id):
            del doc[BOOK]
            return doc, False
        return doc, True

    def _duplicate(self, handoff_id: str, doc: dict[str, Any], origin: str | None,
                   digest: str | None) -> str | None:
        """Why pending/``handoff_id``.json is not the document the database holds under that id,
        ingested by ``origin`` as ``digest`` (None: it is that very document, left behind by a
        crash between ingesting and removing it, so removing it now loses nothing)."""
        if origin != self.origin:
            return (f"handoff {handoff_id} already exists in the shared store; a second "
                    "document with the same id is never run")
        if digest != file_digest(doc):
            return (f"handoff {handoff_id} was ingested from this workspace before, as a "
                    "different document; a second document with the same id is never run")
        return None

    def _young(self, path: os.PathLike[str]) -> bool:
        try:
            return self.clock().timestamp() - os.stat(path).st_mtime < self.store.settle_seconds
        except OSError:
            return False

    def _set_aside(self, handoff_id: str, code: str, message: str, *, stub: bool = True) -> str:
        try:
            self.store.quarantine(self.store.path(State.PENDING, handoff_id), code, message)
        except FileNotFoundError:
            return "gone"
        log.warning("set aside pending/%s.json: %s: %s", handoff_id, code, message)
        if stub and self.stub is not None and not self.store.locate(handoff_id):
            answer = self.stub(handoff_id, code, message)
            # `handoff wait` on it ends too (no origin: it is written here, never ingested)
            self.backend.import_finished(handoff_id, State.FAILED, answer, self.clock())
            self._write(handoff_id, State.FAILED, answer)
        return "set aside"

    # ------------------------------------------------------------ database -> files
    def export(self, ids: list[str] | None = None) -> int:
        """Write the terminal documents of the handoffs this workspace ingested that finished
        since (``ids``: only those); returns how many were written."""
        if ids is not None:
            ids = [i for i in ids if i in self._ours]
            if not ids:
                return 0
        written = 0
        for handoff_id, state, doc in self.backend.unexported(self.origin, ids=ids):
            try:
                self._write(handoff_id, state, doc)
            except OSError as exc:  # disk full, permissions: the next scan tries again
                log.error("cannot write %s/%s.json: %s; will try again", state.value,
                          handoff_id, exc)
                continue
            except InvalidDocument as exc:  # (the backend sets such rows aside before)
                log.error("not writing the result of a handoff: %s", exc)
                continue
            self.backend.mark_exported(handoff_id, state)
            self._ours.discard(handoff_id)
            written += 1
        return written

    def _write(self, handoff_id: str, state: State, doc: dict[str, Any]) -> None:
        check_id(handoff_id)  # an id becomes a path: never one outside the state folders
        other = State.FAILED if state is State.COMPLETED else State.COMPLETED
        # a failed handoff retried by hand may end completed: one terminal file, the latest
        fsio.unlink(self.store.path(other, handoff_id), durable=False)
        self.store.path(state, handoff_id).parent.mkdir(parents=True, exist_ok=True)
        fsio.replace(self.store.path(state, handoff_id),
                     self.store.encode(dict(doc), state, handoff_id), self.store.tmp,
                     durable=self.store.durable)

    def sync(self) -> None:
        """One pass both ways (at every daemon scan)."""
        self.ingest_all()
        self.export()


__all__ = ["FileBridge"]
