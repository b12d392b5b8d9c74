"""Files keep working on every host: the bridge between one workspace's handoffs/ folders and the
shared PostgreSQL store.

Agents that only write files drop documents into their host's ``handoffs/pending/``. With a
PostgreSQL store the host's daemon ingests each one into the database (a *raw* handoff: admission
validates it, as it would a file) under its file name as id, then removes the file; ingesting
again is a no-op (idempotent by id). When a handoff this workspace ingested reaches a terminal
state, wherever it ran, the bridge writes the terminal document (in its own format) into this
workspace's ``completed/`` or ``failed/``, so a file-only agent sees no difference; one that a
daemon sets aside after it was ingested (an unknown format, an id that is not its file name...)
comes back as its failure stub (the document stays in the database's quarantine table). One
that is parked (waiting for its requester's answer) is written into ``pending/`` while it waits,
as the files store keeps it there, sealed as a parked copy (see :meth:`FileBridge.park`).

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

A terminal file written here stops answering once its row is purged or archived (retention,
``handoff purge``/``archive``) or retried: the process that does so leaves a *recheck* record for
the origin workspace (:meth:`~handoffd.backends.postgres.records.FileOrigins.rechecks`), and the
bridge then removes its file, if the file is still the one it wrote for that row (sealed here,
and not the newer result of a handoff that reused the id). A document dropped under an id whose
terminal file is still here, while the database holds no such handoff, is set aside as
``DUPLICATE_HANDOFF_ID``, as the files store does: an old result never answers a new request.

Every failure stub the bridge files goes through the store as admission's do
(``create_failed``: the event log records it) and is announced (``announce``: a daemon counts
it); each local set-aside is told to ``noted`` (the event log's ``set_aside`` event).

Ids read back from the database become file names here: each passes
:func:`~handoffd.core.documents.check_id` first (the backend sets aside a row whose id does not).
"""
from __future__ import annotations

import logging
import os
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ...core.admission import used
from ...core.documents import BOOK, check_id, is_safe_id, revision
from ...core.errors import ErrorCode, InvalidDocument
from ...core.events import last_entry
from ...core.states import State
from ...core.timeutil import utc_now
from ..files import fsio, seals
from ..files.leases import lock_document
from ..files.problems import read_error
from ..files.store import Store
from .backend import PostgresBackend
from .parked import ParkedCopies
from .records import file_digest, ingested_kind

log = logging.getLogger("handoffd")
HALF_WRITTEN = (ErrorCode.MALFORMED_JSON, ErrorCode.EMPTY_DOCUMENT, ErrorCode.NOT_UTF8)
Stub = Callable[[str, str, str], dict[str, Any]]  # (handoff id, code, message) -> a failure document
Announce = Callable[[str, State], None]  # (handoff id, where it was filed): the on_filed listeners
Noted = Callable[[str, str, str], None]  # (handoff id, code, message) of a file set aside here
TERMINAL = (State.COMPLETED, State.FAILED)
# ids another process ingested from here that a bridge watches for at most (one told of more,
# say by NOTIFYs sent past handoffd, leaves the rest to its scans, which miss nothing)
MAX_HEARD = 10_000
# how often one ingest locks pending/ID.json again when the file it locked is no longer there
# (another process ingested it and a new one was dropped between its open and its lock)
TAKE_TRIES = 3


class FileBridge(ParkedCopies):
    """Moves ``store``'s pending files into ``backend`` and brings back the terminal documents
    of what it moved (``origin`` names the workspace in the database)."""

    def __init__(self, backend: PostgresBackend, store: Store, origin: str, *,
                 stub: Stub | None = None, clock: Callable[[], datetime] = utc_now,
                 announce: Announce | None = None, noted: Noted | None = None,
                 quiet: bool = False) -> None:
        self.backend = backend
        self.store = store
        self.origin = origin
        self.stub = stub
        self.clock = clock
        self.announce = announce
        self.noted = noted
        # a command's ingest logs no line per file (no log of a daemon's there: what became of
        # each file is in its quarantine reason, the event log and `handoff ls`)
        self.quiet = quiet
        # a terminal file is written (export) and judged stale (recheck) one at a time: a
        # recheck must not remove the newer result an export just wrote under the same id
        self._files = threading.Lock()
        # ids this process ingested and not yet exported: a wake-up for any other id (most of
        # them, with several hosts) costs no query; a scan exports whatever else is owed
        self._ours: set[str] = set()
        #: the wake-up kind saying that another process ingested a file of this workspace
        self.heard_kind = ingested_kind(origin)
        self._adopted = False  # the ids ingested before this bridge started are in _ours

    # ------------------------------------------------------------ files -> database
    def ingest_all(self) -> int:
        """Ingest every document in pending/; returns how many were new to the database."""
        count = 0
        for entry in list(self.store.entries(State.PENDING)):
            if entry.name.endswith(".json") and not entry.name.startswith("."):
                count += self.ingest(entry.name[:-5]) == "ingested"
        self.backend.prune_receipts(self.origin, self._receipt_gone)
        return count

    def _receipt_gone(self, handoff_id: str, stamp: str) -> bool:
        """Whether the file an ingest receipt names (pending/``handoff_id``.json as ``stamp``,
        see :func:`file_stamp`) is gone: none there now, or another file."""
        try:
            check_id(handoff_id)  # (a key from the database becomes a path)
            return file_stamp(os.stat(self.store.path(State.PENDING, handoff_id))) != stamp
        except FileNotFoundError:
            return True
        except InvalidDocument:  # no file of ours can have that name
            return True
        except OSError:  # cannot tell now: kept (the next pass looks again)
            return False

    def ingest(self, handoff_id: str) -> str:
        """Ingest pending/``handoff_id``.json. Returns what happened: ``ingested``, ``known``
        (the database had it from us already: the file is removed; or it is the parked copy
        this bridge wrote, still the row's: kept), ``gone`` (a parked copy the row moved on
        from is removed; or another process ingested it), ``later`` (still being written,
        another process is ingesting it, or a transient error) or ``set aside``.

        One process ingests a file at a time: it holds an exclusive ``flock`` on the file (the
        files store's claim lock, :func:`~handoffd.backends.files.leases.lock_document`) from
        before its read until after its removal, so a second ingester of this workspace (its
        daemon and a ``handoff`` command) meets the lock or no file, never a copy it would
        insert again after the first's row was set aside or purged. The kernel drops the lock
        of a process that dies: its file stays in pending/ for the next ingest."""
        path = self.store.path(State.PENDING, handoff_id)
        try:
            check_id(handoff_id)
        except InvalidDocument as exc:
            return self._set_aside(handoff_id, ErrorCode.UNSAFE_ID, str(exc), stub=False)
        for _ in range(TAKE_TRIES):
            try:
                held = lock_document(path)
            except FileNotFoundError:
                return "gone"
            except BlockingIOError:  # another ingester has it (or its producer, still writing)
                return "later"
            try:
                outcome = self._ingest_held(handoff_id, path, held)
            finally:
                if held is not None:
                    os.close(held)  # (releases the lock: after the removal)
            if outcome is not None:
                return outcome
        return "later"  # replaced again and again while we looked: the next pass judges it

    def _ingest_held(self, handoff_id: str, path: Path, held: int | None) -> str | None:
        """:meth:`ingest` of pending/``handoff_id``.json under its lock ``held`` (None: it
        cannot be locked here, not a regular file or no ``flock``: read as before, which says
        what it is). None: the file at ``path`` is not the one locked (another process
        ingested it, then a new one was dropped): lock it again."""
        try:
            before = os.stat(path)
            if not _holds(held, before):
                return None
            doc, sealed = self._read(handoff_id)
            if not _holds(held, os.stat(path)):  # (the read opened the path again)
                return None
        except FileNotFoundError:
            return "gone"
        except Exception as exc:  # an invalid document, a socket, EACCES...: say why, once
            problem = read_error(path, exc, handoff_id)
            if problem.transient or (problem.code in HALF_WRITTEN and self._young(path)):
                return "later"
            return self._set_aside(handoff_id, problem.code, str(problem))
        if sealed is None:  # the parked copy written here: never a new drop, nor a duplicate
            return "known" if self._parked_current(handoff_id, doc, before) else "gone"
        finished = self._answered_here(handoff_id)
        if finished is not None:
            return self._set_aside(handoff_id, ErrorCode.DUPLICATE_HANDOFF_ID, finished,
                                   stub=False)
        stamp = file_stamp(before)
        try:
            fresh = self.backend.ingest(doc, handoff_id, self.clock(), self.origin,
                                        trusted=sealed, stamp=stamp)
        except InvalidDocument as exc:  # e.g. NUL characters, which the store refuses
            return self._set_aside(handoff_id, exc.code, f"pending/{handoff_id}.json: {exc}")
        if not fresh and self.backend.receipted(self.origin, handoff_id, doc, stamp):
            # this very file was ingested, and its ingester died before removing it: whatever
            # became of its row since (set aside, purged), it is never ingested (run) again
            self._remove_if_same(path, before, inode_only=True)
            return "known"
        if not fresh:
            found = self.backend.ingested(handoff_id)
            if found is None:  # freed since (purged): the next pass ingests it afresh
                return "later"
            duplicate = self._duplicate(handoff_id, doc, *found)
            if duplicate is not None:
                return self._set_aside(handoff_id, ErrorCode.DUPLICATE_HANDOFF_ID, duplicate,
                                       stub=False)
        self._ours.add(handoff_id)
        # in the database now (a crash before: re-ingested, "known"); the file read, never a
        # new drop renamed over it meanwhile (the next pass judges that one)
        self._remove_if_same(path, before, inode_only=True)
        if fresh:
            log.info("ingested pending/%s.json into the shared store", handoff_id,
                     extra={"event": "ingested", "handoff_id": handoff_id})
        return "ingested" if fresh else "known"

    def heard(self, handoff_id: str) -> None:
        """Another process (a ``handoff`` command, the client) ingested ``handoff_id`` from this
        workspace (:attr:`heard_kind`): its result and its parked copy are written back as soon
        as its wake-up comes, as for one this process ingested, not at the next scan. Only a
        hint: what is written is still only what the database says is owed to this workspace."""
        if is_safe_id(handoff_id) and len(self._ours) < MAX_HEARD:
            self._ours.add(handoff_id)

    def _read(self, handoff_id: str) -> tuple[dict[str, Any], bool | None]:
        """pending/``handoff_id``.json, without a ``handoffd`` block that handoffd did not seal
        there (see the module docstring; without a seal key no block can be trusted), and
        whether it kept a sealed block (the database then keeps it too, as handoffd's own);
        None: it is the copy of a parked handoff this bridge wrote there (:meth:`park`)."""
        doc = self.store.read(State.PENDING, handoff_id)
        if BOOK not in doc:
            return doc, False
        if self._is_parked_copy(handoff_id, doc):
            return doc, None
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

    def _answered_here(self, handoff_id: str) -> str | None:
        """Why a new pending/``handoff_id``.json must not be ingested: a terminal file of that
        id is in this workspace and the database holds no such handoff (it was purged: its
        recheck is made first, which removes the file if it is the purged one's). None: no
        such file, or its handoff is in the database (``ingest`` then judges the document)."""
        for attempt in range(2):
            held = [s for s in TERMINAL if self.store.path(s, handoff_id).exists()]
            if not held or self.backend.ingested(handoff_id) is not None:
                return None
            if attempt == 0:
                self.recheck()
        return (f"handoff {handoff_id} already exists in {held[0].value}/ (an earlier handoff's "
                "result); a second document is never run")

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
        if not self.quiet:
            log.warning("set aside pending/%s.json: %s: %s", handoff_id, code, message)
        if self.noted is not None:
            self.noted(handoff_id, code, message)
        if stub:  # its own document under a safe id (never an unsafe name, nor another's id)
            # recorded as used, as admission's stubs are (core.admission.used): a dependant
            # looked at before its stub was told it "does not exist; create it first"
            used(self.backend, handoff_id, self.clock())
        if stub and self.stub is not None and not self.store.locate(handoff_id):
            answer = self.stub(handoff_id, code, message)
            # `handoff wait` on it ends too; filed as admission files its stubs (the event log
            # records it), and only under a free id: another's handoff is never answered here
            if self.backend.create_failed(handoff_id, answer):
                with self._files:
                    self._write(handoff_id, State.FAILED, answer)
                self.backend.adopt(handoff_id, self.origin)  # (its purge removes the file)
                if self.announce is not None:  # (a daemon counts it: `handoffd run` exits 1)
                    self.announce(handoff_id, State.FAILED)
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
                with self._files:
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
        self._unpark(handoff_id)  # (finished: its parked copy in pending/ answers no more)
        self.store.path(state, handoff_id).parent.mkdir(parents=True, exist_ok=True)
        fsio.replace(self.store.path(state, handoff_id),
                     self.store.encode(dict(doc), state, handoff_id), self.store.tmp,
                     durable=self.store.durable)

    # ------------------------------------------------------------ stale terminal files
    def recheck(self) -> int:
        """Remove the terminal files written here whose rows were purged, archived or retried
        since (the records :meth:`StoreBase._recheck` left for this workspace); returns how
        many were removed. A file handoffd did not write here, or the result of the row that
        holds the id now, is kept; one that cannot be read now is looked at again next time."""
        removed = 0
        for handoff_id, token in self.backend.rechecks(self.origin):
            try:
                check_id(handoff_id)  # (a key from the database becomes a path)
                with self._files:
                    for state in TERMINAL:
                        if self._remove_stale(state, handoff_id):
                            removed += 1
                            log.info("removed %s/%s.json: its handoff was purged or retried",
                                     state.value, handoff_id)
            except InvalidDocument:
                pass  # no file of ours can have that name
            except OSError as exc:  # EACCES, EIO: the next pass looks again
                if not self.quiet:
                    log.error("cannot look at the result files of %s: %s; will try again",
                              handoff_id, exc)
                continue
            self.backend.recheck_done(self.origin, handoff_id, token)
        return removed

    def _remove_stale(self, state: State, handoff_id: str) -> bool:
        """Remove ``state``/``handoff_id``.json here if it is a file this bridge wrote (sealed
        for that folder) that the database's row no longer stands behind: there is no row, or
        it is in another state, or its newest history entry is not the file's (a newer handoff
        under the same id). True when it was removed; OSError when it cannot be read now."""
        path = self.store.path(state, handoff_id)
        try:
            before = os.stat(path)
            doc = self.store.read(state, handoff_id)
        except FileNotFoundError:
            return False
        except InvalidDocument:  # not a document handoffd wrote: never removed
            return False
        if not seals.sealed(self.store.key, doc, handoff_id, revision(doc), (state.value,)):
            return False  # another consumer's file, or one copied in: not ours to remove
        held = self.backend.finished_entry(handoff_id)
        if held is not None and held[0] == state.value and held[1] == last_entry(doc):
            return False
        # the file judged, not one another process's export put in its place meanwhile (a
        # replace is a new inode): the newer result is never removed with the old one
        return self._remove_if_same(path, before)

    def retracted(self, handoff_id: str) -> int:
        """``handoff_id`` went back to pending (a retry, on any host): remove its terminal file
        here, if there is one (two stats when there is none); returns how many were removed."""
        if not is_safe_id(handoff_id):  # (an id another host announced: no file here has it)
            return 0
        if not any(self.store.path(s, handoff_id).exists() for s in TERMINAL):
            return 0
        return self.recheck()

    def sync(self) -> None:
        """One pass both ways (at every daemon scan): stale files out first, so that a drop
        reusing a purged handoff's id is judged without its old result (ingesting removes the
        parked copies whose rows moved on), then the results and the parked copies out. The
        first pass also watches for the handoffs ingested from here before this bridge started
        (by a command, while no daemon ran): their results are written back at once too."""
        if not self._adopted:
            for handoff_id in self.backend.unfinished(self.origin, MAX_HEARD):
                self.heard(handoff_id)
            self._adopted = True
        self.recheck()
        self.ingest_all()
        self.export()
        self.park()


def file_stamp(seen: os.stat_result) -> str:
    """What tells one file from any other that ever stands under its name (the receipt of an
    ingest, :data:`~handoffd.backends.postgres.records.RECEIPT`): a new drop is a new inode, or
    at least a new change time, which no writer can set back."""
    return f"{seen.st_dev}:{seen.st_ino}:{seen.st_ctime_ns}:{seen.st_mtime_ns}:{seen.st_size}"


def _holds(held: int | None, seen: os.stat_result) -> bool:
    """Whether ``seen`` (a stat of the path) is the file locked through ``held`` (True when
    none could be locked: there is nothing to compare)."""
    if held is None:
        return True
    mine = os.fstat(held)
    return (mine.st_dev, mine.st_ino) == (seen.st_dev, seen.st_ino)


__all__ = ["FileBridge"]
