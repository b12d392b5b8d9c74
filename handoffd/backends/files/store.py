"""The file store: documents in state folders, moved only by atomic, non-overwriting operations.

The store knows the mechanics (create, claim, move, quarantine, lock, lease) and nothing of policy:
what to do with a failure is decided by :mod:`handoffd.core.engine`. This module holds the
Store's state, its seals and its claim's transitions (claim, renew, move, finish: the hot path,
with the crash points recovery tests stop at, :mod:`.crashpoints`); beside it, as plain
functions its methods call: :mod:`.claiming` (a locked claim's rename, read and lease write),
:mod:`.reading` (where a handoff is, its current copy, folder listings), :mod:`.writes`
(create, a purge's compare-and-delete, quarantine) and :mod:`.leases` (the lease block, claim
locks and the process's owner lock).
"""
from __future__ import annotations

import errno
import os
import stat
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from ...core import jsontext
from ...core.documents import (
    book,
    check_request_depth,
    check_request_size,
    revision,
)
from ...core.errors import (
    ConfigError,
    DuplicateHandoff,
    InvalidDocument,
    InvalidTransition,
    is_shortage,
    shortage_words,
)
from ...core.states import State, allowed
from ...core.timeutil import utc_now
from ...core.workspace import Workspace
from ..base import NotFiled, refiled_copy, restore
from . import aside, claiming, fsio, reading, seals, spares, writes
from .crashpoints import CRASH_POINTS, crash_point, inject_crash_at
from .leases import (
    OWNER_LOCK_NAME,
    Claim,
    NullLock,
    OwnerLocks,
    lease,
    lock_document,
    lock_name,
    release_lock,
    try_lock,
)
from .quarantine import FolderGuard
from .reading import MAX_REASON_BYTES
from .seen import SeenIds

__all__ = [
    "Store", "Claim", "NullLock", "OWNER_LOCK_NAME", "CRASH_POINTS", "MAX_REASON_BYTES",
    "FILED_MARGIN_BYTES", "BOOKKEEPING_MARGIN_BYTES", "crash_point", "inject_crash_at", "lease",
    "lock_name", "release_lock", "try_lock",
]

FILED_MARGIN_BYTES = 1 << 20  # a finished document's bookkeeping besides request and answer
# a pending or running document's own bookkeeping (history of at most 200 entries, a lease, a
# parked report of at most 64 KB) on top of a request of up to max_document_bytes
BOOKKEEPING_MARGIN_BYTES = 512 * 1024
class Store:
    """Documents of one workspace. ``durable=False`` is the ``fast`` durability mode (no fsync)."""

    def __init__(self, workspace: Workspace, *, durable: bool = True,
                 max_document_bytes: int = 4 * 1024 * 1024, settle_seconds: float = 0.5,
                 seen_ttl_seconds: float = 3600.0, max_output_bytes: int = 16 * 1024 * 1024) -> None:
        self.ws = workspace
        # file(state, id): :meth:`path` as a str (Workspace.doc_file, bound here: one call),
        # what the claim's path hands to ``os``, where a Path would be built for nothing
        self.file: Callable[[State, str], str] = workspace.doc_file
        self.durable = durable
        self.max_bytes = max_document_bytes
        # a finished document holds the request and the specialist's answer (up to
        # max_output_bytes): read with the input's bound, a large result could not be shown
        self.max_filed_bytes = max_document_bytes + max_output_bytes + FILED_MARGIN_BYTES
        # a request of max_document_bytes grows with our bookkeeping as it is claimed and
        # retried: read with the input's bound, a handoff create had accepted was set aside as
        # DOCUMENT_TOO_LARGE at its first retry. The request itself is still held to the bound.
        self.max_open_bytes = max_document_bytes + BOOKKEEPING_MARGIN_BYTES
        self.settle_seconds = settle_seconds
        self.seen = SeenIds(workspace.meta / "seen-ids.jsonl", seen_ttl_seconds)
        self._key: bytes | None = None
        self._key_loaded = False
        # the owner lock every claim's lease names (staged and renamed within .locks)
        self.owners = OwnerLocks(workspace.locks)
        self._own_tmp: Path | None = None  # see use_own_tmp
        self._tmp_checked = False  # see _check_tmp
        self._tmp_text: str | None = None  # see tmp_text
        # the folders of handoffs/ swapped for a link while this process runs: put right before
        # each claim, renewal, filing, move and removal (one stat of handoffs/ when unchanged)
        self.folders = FolderGuard(workspace)

    # ---------------------------------------------------------------- the owner lock
    def owner_lock(self) -> str:
        """The owner lock every claim's lease names (see :meth:`.leases.OwnerLocks.name`)."""
        return self.owners.name()

    def check_owner_lock(self) -> str | None:
        """See :meth:`.leases.OwnerLocks.check` (a lost owner lock is replaced)."""
        return self.owners.check()

    def keep_shields(self, named: set[str]) -> None:
        """See :meth:`.leases.OwnerLocks.keep_shields`."""
        self.owners.keep_shields(named)

    def give_up(self, token: str | None) -> None:
        """See :meth:`.leases.OwnerLocks.give_up`."""
        self.owners.give_up(token)

    def gave_up(self, token: str | None) -> bool:
        """True when this process gave up the claim with lease ``token``."""
        return self.owners.gave_up(token)

    def close(self) -> None:
        """Drop the owner locks (see :meth:`.leases.OwnerLocks.close`)."""
        self.owners.close()

    # ---------------------------------------------------------------- temp files
    @property
    def tmp(self) -> Path:
        """Where this store writes its temp files: ``handoffs/.tmp/``, or the folder of this
        process's own under it (:meth:`use_own_tmp`)."""
        if self._own_tmp is not None:
            return self._own_tmp
        if not self._tmp_checked:
            self._check_tmp()
        return self.ws.tmp

    @property
    def tmp_text(self) -> str:
        """:attr:`tmp` as text, for the filing's system calls (a Path given to one costs two
        Python calls). Kept once the folder was checked (:meth:`_check_tmp`)."""
        if self._tmp_text is not None:
            return self._tmp_text
        text = os.fspath(self.tmp)
        if self._own_tmp is not None or self._tmp_checked:
            self._tmp_text = text
        return text

    def _check_tmp(self) -> None:
        """OSError (ENOTDIR) when ``handoffs/.tmp`` exists but is no plain folder of the
        workspace: a symlink planted there would have every temp file written outside it.
        Checked at the first use (a missing folder is made by the first write, and checked
        again then)."""
        try:
            mode = os.lstat(self.ws.tmp).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?); no temp "
                          "file is written there, so nothing can be written", str(self.ws.tmp))
        self._tmp_checked = True

    def use_own_tmp(self) -> None:
        """Write temp files in a folder of this process's own (a forked daemon process does):
        processes sharing one temp folder wait on its lock at every file they create (see
        :func:`spares.own_folder`); a drain on two processes is about 10% faster without that."""
        self._check_tmp()
        self._own_tmp = spares.own_folder(self.ws.tmp)
        self._tmp_text = None

    # ---------------------------------------------------------------- seals
    @property
    def key(self) -> bytes | None:
        """The workspace's seal key (see :mod:`handoffd.backends.files.seals`), loaded or created once."""
        if not self._key_loaded:
            self._key = seals.load_or_create_key(self.ws.meta, self.tmp)
            self._key_loaded = self._key is not None
            self.folders.seal_key = self._key  # (written again into a .meta made again)
        return self._key

    def encode(self, doc: dict[str, Any], state: State, handoff_id: str) -> bytes:
        """Seal ``doc`` for ``state`` and serialise it: every document this store writes."""
        block = book(doc)
        key = self.key
        if key is None:  # unsealed, every document written would be taken for a foreign one
            raise ConfigError(f"cannot write handoffs: the workspace's seal key "
                              f"{self.ws.meta / seals.KEY_NAME} does not exist and cannot be made")
        # (the folder's name as the enum keeps it, _value_: ``value`` is a property, two
        # Python calls, and every document written and read asks it)
        block["seal"] = seals.seal_for(key, handoff_id, revision(doc), state._value_)
        return fsio.dump_json(doc)

    def trusted_revision(self, doc: dict[str, Any], state: State, handoff_id: str,
                         *also: State) -> int:
        """The document's revision if handoffd wrote it (its seal matches ``state`` or one of
        ``also``), else 0: bookkeeping that arrived from outside never outranks ours."""
        rev = revision(doc)
        if not rev:  # never written by a handoffd (a raw document): no seal to check
            return 0
        folders = (state._value_,) if not also else tuple(s.value for s in (state, *also))
        return rev if seals.sealed(self.key, doc, handoff_id, rev, folders) else 0

    # ---------------------------------------------------------------- reading
    def path(self, state: State, handoff_id: str) -> Path:
        """Path of ``handoff_id``'s document in ``state``."""
        return self.ws.doc_path(state, handoff_id)

    def locate(self, handoff_id: str) -> list[State]:
        """Every state folder holding a file for ``handoff_id`` (normally exactly one)."""
        return reading.locate(self, handoff_id)

    def read(self, state: State, handoff_id: str) -> dict[str, Any]:
        """Read and parse one document; FileNotFoundError if absent, InvalidDocument if bad."""
        name = f"{handoff_id}.json"  # (a str path: no Path built for each read)
        terminal = state.terminal
        data, _ = fsio.read_bytes_safely(self.file(state, handoff_id),
                                         self.max_filed_bytes if terminal
                                         else self.max_open_bytes)
        doc = jsontext.parse_document(data, f"{state._value_}/{name}")
        if not terminal:
            self.check_request_size(doc, data, name)
        return doc

    def check_request_size(self, doc: dict[str, Any], data: bytes, name: str) -> None:
        """InvalidDocument (DOCUMENT_TOO_LARGE) when the request in ``doc`` (all but its
        ``handoffd`` block) is over ``max_document_bytes``; the block may add up to
        :data:`BOOKKEEPING_MARGIN_BYTES` (:func:`~handoffd.core.documents.check_request_size`).
        DOCUMENT_TOO_DEEP when it nests too deep for its copies to be filed
        (:func:`~handoffd.core.documents.check_request_depth`)."""
        check_request_size(doc, len(data), self.max_bytes, name)
        check_request_depth(doc, data.count(b"{") + data.count(b"["), name)

    def get(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        """The current state and document of ``handoff_id``; NotFound if it exists nowhere."""
        return reading.get(self, handoff_id)

    def ids(self, state: State) -> list[str]:
        """Ids of the documents in one state folder (one directory listing)."""
        return reading.ids(self.ws, state)

    def iter_ids(self, state: State) -> Iterator[str]:
        """The ids of :meth:`ids`, read as the listing goes (see :func:`.reading.iter_ids`)."""
        return reading.iter_ids(self.ws, state)

    def entries(self, state: State) -> Iterator[os.DirEntry[str]]:
        """Raw directory entries of a state folder, including files that are not documents."""
        return reading.entries(self.ws, state)

    def quarantined(self) -> list[dict[str, Any]]:
        """The reasons recorded for quarantined files, oldest first."""
        return reading.quarantined(self.ws)

    # ---------------------------------------------------------------- writing
    def write_new(self, state: State, doc: dict[str, Any]) -> None:
        """Publish ``doc`` in ``state`` atomically; DuplicateHandoff if that name is taken."""
        self.folders.check()
        writes.write_new(self, state, doc)

    def create(self, doc: dict[str, Any], handoff_id: str, *, now: datetime | None = None,
               due_at: datetime | None = None) -> str:
        """Submit a new document to pending/; DuplicateHandoff naming the existing copy if taken."""
        self.folders.check()
        return writes.create(self, doc, handoff_id, now=now, due_at=due_at)

    def remove_if(self, state: State, handoff_id: str, expect: dict[str, Any]) -> bool:
        """Delete ``handoff_id``'s document in the finished ``state`` if it still is ``expect``
        (see :func:`.writes.remove_if`)."""
        self.folders.check()
        return writes.remove_if(self, state, handoff_id, expect)

    def quarantine(self, path: Path, code: str, message: str, *, now: datetime | None = None) -> Path:
        """Move an unusable file out of the state folders, with a ``.reason.json`` beside it."""
        self.folders.check()
        return writes.quarantine(self, path, code, message, now=now)

    # ---------------------------------------------------------------- claims and moves
    def claim(self, handoff_id: str, *, lease_seconds: float, now: datetime | None = None,
              on_claim: Callable[[dict[str, Any]], None] | None = None,
              due_only: bool = False) -> Claim | None:
        """Take ``handoff_id`` from pending/ into in-progress/ and lock it.

        Returns None when another process won the race. Raises DuplicateHandoff if an in-progress
        copy already exists (DocumentNotReady when the pending copy is a newer one being moved
        back), DocumentNotReady if the file is still being written (it is put back),
        ClaimShortage (a DocumentNotReady) if descriptors or memory ran short meanwhile (it is
        put back, or never moved: :mod:`.claiming`), NotDue (a DocumentNotReady) with
        ``due_only`` when its trusted ``next_attempt_at`` is still to come (put back as it
        came), and InvalidDocument if it is unreadable (it stays in in-progress/ for the
        caller to file).

        The document is locked (:func:`.leases.lock_document`) from before its rename until its
        lease is written, so that no sweep hands it back meanwhile however long this process
        stalls there; and the lease write replaces only the very file the rename put in
        in-progress/ (:func:`.fsio.replace_exact`), never one someone else put there since.
        """
        now = now or utc_now()
        src = self.file(State.PENDING, handoff_id)
        try:
            held = lock_document(src)
        except (FileNotFoundError, BlockingIOError):
            return None  # claimed, or being claimed right now, by another process
        except OSError as exc:  # (SHORT_ERRNOS: no descriptor to spare) nothing moved yet
            raise claiming.short_of(handoff_id, exc) from None
        displaced: str | None = None
        try:
            self.folders.check()  # never renamed into (or out of) a folder swapped for a link
            claim, displaced = claiming.claim_held(self, handoff_id, held, lease_seconds, now,
                                                   on_claim, due_only)
        finally:
            if held is not None:
                os.close(held)  # (before the adoption: it wants nobody to have the file open)
        if displaced is not None:
            # the producer's inode, which the leased copy replaced, becomes a spare if nobody
            # else can ever write it (see spares.adopt): then no inode is freed, nor created
            spares.keep_displaced(displaced, self.tmp)
        if claim is not None:
            crash_point("after-claim-lease")
        return claim

    def owns(self, claim: Claim) -> bool:
        """True while the in-progress document still carries this claim's lease token.

        Every write of the in-progress file makes a new inode, so an unchanged inode proves
        nobody (a sweeper) replaced or moved it since this claim wrote it; no read needed."""
        if claim.inode is not None:
            try:
                return os.stat(self.file(State.IN_PROGRESS, claim.handoff_id)).st_ino == claim.inode
            except FileNotFoundError:
                return self._readopt(claim)
        try:
            doc = self.read(State.IN_PROGRESS, claim.handoff_id)
        except (FileNotFoundError, InvalidDocument):
            return False
        held = book(doc).get("lease")
        if claim.token is None:  # recovering a claim whose owner never wrote a lease
            return not isinstance(held, dict)
        return isinstance(held, dict) and held.get("token") == claim.token

    def _readopt(self, claim: Claim) -> bool:
        """A running claim whose in-progress copy went with an in-progress/ folder swapped for
        a link while it ran (this process made the folder again: :class:`.quarantine.FolderGuard`)
        and of which no state folder holds a copy: its document written again into the new
        in-progress/ (never over a file there), so that it is renewed and filed as usual. False
        otherwise: the claim was lost."""
        if not self.folders.remade.get(State.IN_PROGRESS.value) or self.locate(claim.handoff_id):
            return False
        path = self.path(State.IN_PROGRESS, claim.handoff_id)
        try:
            fsio.create_exclusive(path, self.encode(claim.doc, State.IN_PROGRESS, claim.handoff_id),
                                  self.tmp, durable=self.durable)
            claim.inode = os.lstat(path).st_ino
        except (OSError, DuplicateHandoff):
            return False
        return True

    def renew(self, claim: Claim, *, lease_seconds: float, now: datetime | None = None) -> bool:
        """Extend the lease; False if the claim was lost (recovered by a sweeper)."""
        self.folders.check()
        with claim.mutex:
            if claim.finished:
                return True
            if not self.owns(claim):
                return False
            held = book(claim.doc).get("lease")
            named = held.get("lock") if isinstance(held, dict) else None
            book(claim.doc)["lease"] = lease(claim.token, now or utc_now(), lease_seconds,
                                             lock=named if isinstance(named, str) else None)
            claim.inode = fsio.replace(self.path(State.IN_PROGRESS, claim.handoff_id),
                                       self.encode(claim.doc, State.IN_PROGRESS, claim.handoff_id),
                                       self.tmp,
                                       durable=self.durable, sync_dir=False)
            return True

    def move(self, handoff_id: str, src: State, dst: State, doc: dict[str, Any], *,
             ours: bool = False, replaces: int | None = None) -> None:
        """Write ``doc`` into ``dst`` (never overwriting), then remove the ``src`` copy.
        ``ours``: the ``src`` file is one this process wrote (a claim's in-progress copy): its
        inode is kept as a spare temp file rather than freed (see :mod:`.spares`)."""
        self.folders.check()
        data = self._encode_moved(handoff_id, src, dst, doc)
        if ours:
            self._move_ours(handoff_id, src, dst, data)
            return
        # not a file of ours: it is taken aside first, so that what is removed is the copy this
        # move replaces, never one written in its place meanwhile (see :mod:`.aside`)
        taken = aside.take(self, src, handoff_id)
        try:
            if replaces is not None \
                    and reading.revision_at(taken, self.max_filed_bytes) != replaces:
                # filed again since the caller read it (two retries at once): not this move's
                raise FileExistsError(f"{src.value}/{handoff_id}.json changed meanwhile")
            fsio.create_exclusive(self.path(dst, handoff_id), data, self.tmp, durable=self.durable)
        except BaseException:
            aside.put_back(self, taken, src)
            raise
        crash_point("after-move-write")
        os.unlink(taken)
        crash_point("after-move-unlink")

    def _move_ours(self, handoff_id: str, src: State, dst: State, data: bytes,
                   unwritten: Callable[[OSError], None] | None = None) -> None:
        """:meth:`move` of a file this process wrote. ``unwritten`` is told of an OSError that
        came before anything was written in ``dst`` (it may raise another instead)."""
        target = self.file(dst, handoff_id)
        try:
            tmp = self.tmp_text  # (once for both: a property; a planted .tmp/ is "unwritten" too)
            fsio.create_exclusive(target, data, tmp, durable=self.durable)
        except OSError as exc:
            if unwritten is not None and not _exists(target):  # (there: its dir fsync failed)
                unwritten(exc)
            raise
        crash_point("after-move-write")
        # no directory fsync: if a crash undoes this unlink, the two copies are told apart
        # by revision (states.winner) and recovery removes the older one
        spares.retire(self.file(src, handoff_id), tmp)
        crash_point("after-move-unlink")

    def finish(self, claim: Claim, dst: State, doc: dict[str, Any]) -> bool:
        """File a claimed handoff in ``dst``. False (nothing written) if the claim was lost.
        Under :func:`..base.refiling`, a failure for a passing reason (a full disk) before
        anything was written in ``dst`` raises :class:`..base.NotFiled`: the claim stays ours,
        its document as before the filing. Any other failure gives the claim up: recovery in
        this process hands it back (a failure after ``dst`` was written: recovery keeps that
        copy, newer by revision, and removes the in-progress one; nothing runs again)."""
        with claim.mutex:
            moved = kept = False
            lease_now = book(claim.doc).get("lease")  # (the answer may share the block)

            def keep(exc: OSError) -> None:
                nonlocal kept
                saved = refiled_copy(claim.token, exc)
                if saved is not None:
                    restore(claim.doc, saved, lease_now)
                    kept = True
                    why = shortage_words(exc) if is_shortage(exc) else exc.strerror or exc
                    raise NotFiled(exc.errno, f"{claim.handoff_id} could not be filed in "
                                   f"{dst.value}/: {why}") from exc  # (a shortage: its limit)

            try:
                self.folders.check()  # (a failure here gives the claim up, as any below)
                if claim.finished or not self.owns(claim):
                    return False
                book(doc).pop("lease", None)
                if claim.inode is not None:  # owns(): still the inode we wrote
                    data = self._encode_moved(claim.handoff_id, State.IN_PROGRESS, dst, doc)
                    self._move_ours(claim.handoff_id, State.IN_PROGRESS, dst, data, keep)
                else:
                    self.move(claim.handoff_id, State.IN_PROGRESS, dst, doc)
                moved = True
                return True
            finally:
                if not kept:
                    if not moved and not claim.finished:  # e.g. disk full: recovery takes it over
                        self.give_up(claim.token)
                    claim.finished = True
                    release_lock(claim.lock)

    def _encode_moved(self, handoff_id: str, src: State, dst: State,
                      doc: dict[str, Any]) -> bytes:
        """``doc`` encoded for ``dst``; InvalidTransition unless a move from ``src`` may go
        there."""
        if not allowed(src, dst):
            raise InvalidTransition(f"handoff {handoff_id} cannot go from {src.value} to "
                                    f"{dst.value}", handoff_id=handoff_id)
        return self.encode(doc, dst, handoff_id)


def _exists(path: str | Path) -> bool:
    """True when ``path`` exists, or cannot be told (an I/O error: taken as written)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True
