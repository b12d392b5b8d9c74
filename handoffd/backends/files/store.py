"""The file store: documents in state folders, moved only by atomic, non-overwriting operations.

The store knows the mechanics (create, claim, move, quarantine, lock, lease) and nothing of policy:
what to do with a failure is decided by :mod:`handoffd.core.engine`.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ...core.documents import BOOK, actor, book, book_int, check_id, record, revision
from ...core.errors import (
    ConfigError,
    DocumentNotReady,
    DuplicateHandoff,
    ErrorCode,
    InvalidDocument,
    InvalidTransition,
    NotFound,
)
from ...core.states import State, allowed, winner
from ...core.timeutil import iso, utc_now
from ...core.workspace import Workspace
from ..base import stamp_created
from . import aside, fsio, seals, spares
from .ownerlock import (
    OwnerLock,
    close_quietly,
    drop_lock,
    hold_again,
    say_lost,
    unlink_quietly,
)
from .seen import SeenIds

if TYPE_CHECKING:  # filelock is imported where a lock is taken (one-shot commands skip it)
    from filelock import FileLock

# the name of a store's owner lock (see Store.owner_lock); a lease naming anything else is judged
# by its per-claim lock file
OWNER_LOCK_NAME = re.compile(r"owner\.[0-9a-f]{32}\.lock")
MAX_REASON_BYTES = 1 << 20  # a quarantine reason, read whole
FILED_MARGIN_BYTES = 1 << 20  # a finished document's bookkeeping besides request and answer
# a pending or running document's own bookkeeping (history of at most 200 entries, a lease, a
# parked report of at most 64 KB) on top of a request of up to max_document_bytes
BOOKKEEPING_MARGIN_BYTES = 512 * 1024
CRASH_POINTS = ("after-claim-rename", "after-claim-lease", "after-move-write", "after-move-unlink")
# A test seam for fault injection: called with the name of each crash point as it is passed. None
# (the default) costs one comparison; recovery tests install a hook with inject_crash_at().
crash_hook: Callable[[str], None] | None = None


def crash_point(name: str) -> None:
    """Mark a step of claim or finish where a crash must be repairable (see CRASH_POINTS)."""
    if crash_hook is not None:
        crash_hook(name)


def inject_crash_at(point: str) -> None:
    """Make this process die on the spot (exit 99, no cleanup, like kill -9) when it reaches
    ``point``; an empty ``point`` removes the injection. The ``handoffd`` command calls this for
    ``$HANDOFFD_CRASH_AT`` so that tests can crash a real daemon at each step."""
    global crash_hook

    def die_there(name: str) -> None:
        if name == point:
            os._exit(99)

    crash_hook = die_there if point else None


@dataclass
class Claim:
    """A handoff this process owns: its in-progress document, lease token and held lock."""

    handoff_id: str
    doc: dict[str, Any]
    token: str | None
    lock: "FileLock | NullLock"
    attempt: int
    inode: int | None = None  # of the in-progress file as this claim last wrote it
    prior_revision: int = 0  # trusted (sealed) revision it had in pending/; 0: a raw document
    finished: bool = False
    # serialises lease renewal (heartbeat thread) with finishing (worker thread)
    mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Store:
    """Documents of one workspace. ``durable=False`` is the ``fast`` durability mode (no fsync)."""

    def __init__(self, workspace: Workspace, *, durable: bool = True,
                 max_document_bytes: int = 4 * 1024 * 1024, settle_seconds: float = 0.5,
                 seen_ttl_seconds: float = 3600.0, max_output_bytes: int = 16 * 1024 * 1024) -> None:
        self.ws = workspace
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
        self._owner: OwnerLock | None = None  # see owner_lock
        # owner locks lost (a handler closed their descriptor) and held again under a new one
        # while the attempts that rode on them wind down (see _replace_lost)
        self._shields: list[OwnerLock] = []
        self._owner_mutex = threading.Lock()
        self._given_up: set[str] = set()  # lease tokens of claims ended here without being filed
        self._own_tmp: Path | None = None  # see use_own_tmp

    # ---------------------------------------------------------------- the owner lock
    def owner_lock(self) -> str:
        """The name of the lock file (in ``handoffs/.locks``) this store holds while it lives:
        every claim's lease names it, so a recoverer on this host that can take it knows the
        owner process died. One lock for all claims instead of one lock file per claim: creating
        a file is the dearest step of a claim on a journaling filesystem.

        A handler running in this process may have closed the lock's descriptor (a careless
        "close inherited fds" helper): then the lock is free for any other process to take, and
        a claim naming it would look abandoned. So each call checks the descriptor with one
        ``fstat`` and, if it is gone, takes a new lock first (see :meth:`check_owner_lock`)."""
        with self._owner_mutex:
            owner = self._owner
            if owner is None or owner.pid != os.getpid():  # (a forked process takes its own)
                return self._take_owner_lock().name
            if owner.fd_intact():
                return owner.name
            why = owner.problem(self.ws.locks) or "its descriptor was closed"
            fresh = self._replace_lost(owner, why)
        say_lost(owner, why, fresh)
        return fresh.name

    def check_owner_lock(self) -> str | None:
        """Make sure this process still holds its owner lock, and return its name (None while
        this process has not taken one).

        The lock is lost when its descriptor was closed (by a handler running in this process),
        now refers to another file or to another opening of the lock file, or the file was
        removed or replaced. Then another process may already have taken it and judged our
        claims abandoned: a new lock is taken (under a new name, which later claims name), and
        the old one is held again under a new descriptor if nobody took it meanwhile, to keep
        the claims that name it from being recovered while they are stopped; whether or not,
        those claims must be fenced by the caller (see :meth:`FilesBackend.broken_claims`). One
        warning is logged. Raises OSError when a new lock cannot be taken (the next claim tries
        again)."""
        with self._owner_mutex:
            # a shield closed by a handler is forgotten, never closed (nor a forked parent's)
            self._shields = [s for s in self._shields if s.pid == os.getpid() and s.fd_ours()]
            owner = self._owner
            if owner is None or owner.pid != os.getpid():
                return None
            why = owner.problem(self.ws.locks)
            if why is None:
                return owner.name
            self._owner = None  # (if no new lock can be taken, the next claim tries again)
            fresh = self._replace_lost(owner, why)
        say_lost(owner, why, fresh)
        return fresh.name

    def keep_shields(self, named: set[str]) -> None:
        """Release the lost owner locks held again (see :meth:`check_owner_lock`) that no claim
        in ``named`` (the lock names the running claims' leases give) rides on any more: their
        attempts have ended, and a claim given up midway is then recoverable by others, as when
        a process dies."""
        with self._owner_mutex:
            done = [s for s in self._shields if s.name not in named and s.pid == os.getpid()]
            self._shields = [s for s in self._shields if s not in done]
        for shield in done:
            drop_lock(shield, self.ws.locks)

    def _take_owner_lock(self) -> OwnerLock:
        """Create and lock a new owner lock file and make it this store's (under the mutex)."""
        name = f"owner.{os.urandom(16).hex()}.lock"  # never reused: a stale file is never ours
        path = self.ws.locks / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
            lock = OwnerLock.mark_open(name, fd)
        except BaseException:
            close_quietly(fd)
            unlink_quietly(path)
            raise
        self._owner = lock
        return lock

    def _replace_lost(self, lost: OwnerLock, why: str) -> OwnerLock:
        """``lost`` is no longer surely held (``why``): keep it from being taken over while its
        claims are fenced if nobody took it meanwhile, and take a new owner lock (under the
        mutex)."""
        if lost.fd_ours():  # still our descriptor, but its file was removed or replaced
            close_quietly(lost.fd)
        else:  # never closed here: the number may already be another file's descriptor
            shield = hold_again(lost, self.ws.locks)
            if shield is not None:
                self._shields.append(shield)
        self._owner = None
        return self._take_owner_lock()

    def give_up(self, token: str | None) -> None:
        """Note that this process ended the claim with lease ``token`` without filing it (it
        failed midway): its lease still names the owner lock, which stays held, so recovery in
        this process asks :meth:`gave_up` instead of waiting for the lease to run out."""
        if token is not None:
            with self._owner_mutex:
                self._given_up.add(token)

    def gave_up(self, token: str | None) -> bool:
        """True when this process gave up the claim with lease ``token`` (see :meth:`give_up`)."""
        with self._owner_mutex:
            return token in self._given_up

    def close(self) -> None:
        """Drop the owner lock (claims still open become recoverable, as if this process died),
        and any lost one held again. Never raises for a descriptor a handler closed: one that is
        no longer ours is left alone (its number may be another file's now)."""
        with self._owner_mutex:
            locks = [self._owner, *self._shields]
            self._owner, self._shields = None, []
        for lock in locks:
            if lock is not None and lock.pid == os.getpid():
                drop_lock(lock, self.ws.locks)

    # ---------------------------------------------------------------- temp files
    @property
    def tmp(self) -> Path:
        """Where this store writes its temp files: ``handoffs/.tmp/``, or the folder of this
        process's own under it (:meth:`use_own_tmp`)."""
        return self._own_tmp or self.ws.tmp

    def use_own_tmp(self) -> None:
        """Write temp files in a folder of this process's own (a forked daemon process does):
        processes sharing one temp folder wait on its lock at every file they create (see
        :func:`spares.own_folder`); a drain on two processes is about 10% faster without that."""
        self._own_tmp = spares.own_folder(self.ws.tmp)

    # ---------------------------------------------------------------- seals
    @property
    def key(self) -> bytes | None:
        """The workspace's seal key (see :mod:`handoffd.backends.files.seals`), loaded or created once."""
        if not self._key_loaded:
            self._key = seals.load_or_create_key(self.ws.meta, self.tmp)
            self._key_loaded = self._key is not None
        return self._key

    def encode(self, doc: dict[str, Any], state: State, handoff_id: str) -> bytes:
        """Seal ``doc`` for ``state`` and serialise it: every document this store writes."""
        block = book(doc)
        key = self.key
        if key is None:  # unsealed, every document written would be taken for a foreign one
            raise ConfigError(f"cannot write handoffs: the workspace's seal key "
                              f"{self.ws.meta / seals.KEY_NAME} does not exist and cannot be made")
        block["seal"] = seals.seal_for(key, handoff_id, revision(doc), state.value)
        return fsio.dump_json(doc)

    def trusted_revision(self, doc: dict[str, Any], state: State, handoff_id: str,
                         *also: State) -> int:
        """The document's revision if handoffd wrote it (its seal matches ``state`` or one of
        ``also``), else 0: bookkeeping that arrived from outside never outranks ours."""
        rev = revision(doc)
        folders = tuple(s.value for s in (state, *also))
        return rev if rev and seals.sealed(self.key, doc, handoff_id, rev, folders) else 0

    # ---------------------------------------------------------------- reading
    def path(self, state: State, handoff_id: str) -> Path:
        """Path of ``handoff_id``'s document in ``state``."""
        return self.ws.doc_path(state, handoff_id)

    def locate(self, handoff_id: str) -> list[State]:
        """Every state folder holding a file for ``handoff_id`` (normally exactly one)."""
        return [s for s in State if os.path.lexists(self.path(s, handoff_id))]

    def read(self, state: State, handoff_id: str) -> dict[str, Any]:
        """Read and parse one document; FileNotFoundError if absent, InvalidDocument if bad."""
        path = self.path(state, handoff_id)
        data, _ = fsio.read_bytes_safely(path, self.max_filed_bytes if state.terminal
                                         else self.max_open_bytes)
        doc = fsio.parse_document(data, f"{state.value}/{path.name}")
        if not state.terminal:
            self._check_request_size(doc, data, path.name)
        return doc

    def _check_request_size(self, doc: dict[str, Any], data: bytes, name: str) -> None:
        """InvalidDocument (DOCUMENT_TOO_LARGE) when the request in ``doc`` (all but its
        ``handoffd`` block) is over ``max_document_bytes``; the block may add up to
        :data:`BOOKKEEPING_MARGIN_BYTES`."""
        if len(data) <= self.max_bytes:
            return
        request = {k: v for k, v in doc.items() if k != BOOK}
        size = len(json.dumps(request, ensure_ascii=False, separators=(",", ":"))
                   .encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise InvalidDocument(
                f"{name} holds a {size}-byte request, over the {self.max_bytes}-byte limit "
                "(raise daemon.max_document_bytes in handoffd.toml if this is intended)",
                code=ErrorCode.DOCUMENT_TOO_LARGE)

    def get(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        """The current state and document of ``handoff_id``; NotFound if it exists nowhere."""
        check_id(handoff_id)
        for _ in range(5):  # a move between our listing and our read is retried
            copies: list[tuple[State, dict[str, Any]]] = []
            for state in self.locate(handoff_id):
                try:
                    copies.append((state, self.read(state, handoff_id)))
                except FileNotFoundError:
                    continue
            if copies:
                best = winner([(s, self.trusted_revision(d, s, handoff_id)) for s, d in copies])
                return copies[best]
            if not self.locate(handoff_id):
                break
        held = self._aside_copy(handoff_id)
        if held is not None:  # a retry or purge holds it aside for an instant: still there
            return held
        raise NotFound(f"no handoff {handoff_id} in {self.ws.handoffs}; `handoff ls` lists them",
                       handoff_id=handoff_id)

    def _aside_copy(self, handoff_id: str) -> tuple[State, dict[str, Any]] | None:
        """(state it was taken from, document) of ``handoff_id`` set aside by a move or purge
        under way (``handoff show`` and ``wait`` said "no handoff" in that instant)."""
        for state in State:
            path = self.ws.meta / aside.NAME / state.value / f"{handoff_id}.json"
            try:
                data, _ = fsio.read_bytes_safely(path, self.max_filed_bytes)
                return state, fsio.parse_document(data, f"{state.value}/{handoff_id}.json")
            except (OSError, InvalidDocument):
                continue
        return None

    def ids(self, state: State) -> list[str]:
        """Ids of the documents in one state folder (one directory listing)."""
        try:
            with os.scandir(self.ws.state_dir(state)) as entries:
                return [e.name[:-5] for e in entries if e.name.endswith(".json")]
        except FileNotFoundError:
            return []

    def iter_ids(self, state: State) -> Iterator[str]:
        """The ids of :meth:`ids`, read as the listing goes (a folder of 100,000 finished
        documents is never a list in memory)."""
        try:
            with os.scandir(self.ws.state_dir(state)) as entries:
                for entry in entries:
                    if entry.name.endswith(".json"):
                        yield entry.name[:-5]
        except FileNotFoundError:
            return

    def entries(self, state: State) -> Iterator[os.DirEntry[str]]:
        """Raw directory entries of a state folder, including files that are not documents."""
        try:
            with os.scandir(self.ws.state_dir(state)) as entries:
                yield from list(entries)
        except FileNotFoundError:
            return

    # ---------------------------------------------------------------- writing
    def write_new(self, state: State, doc: dict[str, Any]) -> None:
        """Publish ``doc`` in ``state`` atomically; DuplicateHandoff if that name is taken."""
        handoff_id = check_id(_doc_id(doc))
        fsio.create_exclusive(self.path(state, handoff_id), self.encode(doc, state, handoff_id),
                              self.tmp, durable=self.durable)

    def create(self, doc: dict[str, Any], handoff_id: str, *, now: datetime | None = None,
               due_at: datetime | None = None) -> str:
        """Submit a new document to pending/; DuplicateHandoff naming the existing copy if taken."""
        now = now or utc_now()
        check_id(handoff_id)
        existing = self.locate(handoff_id)
        if existing:
            raise DuplicateHandoff(
                f"handoff {handoff_id} already exists in {existing[0].value}/; choose another id "
                "or `handoff retry` the existing one", handoff_id=handoff_id)
        if self.seen.contains(handoff_id, now):
            raise DuplicateHandoff(f"handoff id {handoff_id} was used within the last "
                                   f"{int(self.seen.ttl)}s; choose another id",
                                   handoff_id=handoff_id)
        if aside.holds(self, handoff_id):  # a retry or purge of it is under way: still taken
            raise DuplicateHandoff(f"handoff {handoff_id} is being moved; choose another id",
                                   handoff_id=handoff_id)
        stamp_created(doc, handoff_id, now, due_at)  # bookkeeping a document brings is not ours
        data = self.encode(doc, State.PENDING, handoff_id)
        if len(data) > self.max_bytes:  # the daemon would set it aside unread: refuse it now
            raise InvalidDocument(
                f"handoff {handoff_id} would be {len(data)} bytes, over the {self.max_bytes}-byte "
                "limit (raise daemon.max_document_bytes in handoffd.toml if this is intended)",
                handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)
        try:
            fsio.create_exclusive(self.path(State.PENDING, handoff_id), data,
                                  self.tmp, durable=self.durable)
        except DuplicateHandoff:
            raise DuplicateHandoff(f"handoff {handoff_id} already exists in pending/",
                                   handoff_id=handoff_id) from None
        self.seen.add(handoff_id, now)
        return handoff_id

    def claim(self, handoff_id: str, *, lease_seconds: float, now: datetime | None = None,
              on_claim: Callable[[dict[str, Any]], None] | None = None) -> Claim | None:
        """Take ``handoff_id`` from pending/ into in-progress/ and lock it.

        Returns None when another process won the race. Raises DuplicateHandoff if an in-progress
        copy already exists (DocumentNotReady when the pending copy is a newer one being moved
        back), DocumentNotReady if the file is still being written (it is put back),
        and InvalidDocument if it is unreadable (it stays in in-progress/ for the caller to file).
        """
        now = now or utc_now()
        src, dst = self.path(State.PENDING, handoff_id), self.path(State.IN_PROGRESS, handoff_id)
        try:
            fsio.rename_noreplace(src, dst)
        except FileNotFoundError:
            return None
        except FileExistsError:
            if self._moving_back(handoff_id):
                # a move back to pending/ (a retry, an answer, a hand-back) writes the pending
                # copy a moment before it removes the in-progress one: not a duplicate to set
                # aside (that would lose the handoff), just not claimable for a moment
                raise DocumentNotReady(f"{handoff_id} is being put back in pending/",
                                       handoff_id=handoff_id) from None
            raise DuplicateHandoff(f"handoff {handoff_id} is already in progress",
                                   handoff_id=handoff_id) from None
        crash_point("after-claim-rename")
        try:
            data, info = fsio.read_bytes_safely(dst, self.max_open_bytes)
            doc = fsio.parse_document(data, f"pending/{handoff_id}.json")
            self._check_request_size(doc, data, f"pending/{handoff_id}.json")
        except InvalidDocument as exc:
            if exc.code in (ErrorCode.MALFORMED_JSON, ErrorCode.EMPTY_DOCUMENT, ErrorCode.NOT_UTF8) \
                    and self._young(dst, now):
                self._put_back(dst, src)
                raise DocumentNotReady(f"{handoff_id} is still being written",
                                       handoff_id=handoff_id) from None
            raise
        prior = self.trusted_revision(doc, State.PENDING, handoff_id)
        if prior == 0:  # raw: whatever `handoffd` block it carries came from outside
            doc[BOOK] = {}
        token = os.urandom(16).hex()
        lock = NullLock()  # the claim rides on the store's owner lock, named in its lease
        block = book(doc)
        block["attempt"] = book_int(doc, "attempt", 0) + 1
        block["lease"] = lease(token, now, lease_seconds, lock=self.owner_lock())
        block.pop("next_attempt_at", None)
        record(doc, "claimed", now, attempt=block["attempt"])
        try:
            if on_claim is not None:
                on_claim(doc)  # format-specific marks, e.g. seed 001's status/started_at
            # the rename into in-progress/ need not be durable: if a crash undoes it, the handoff
            # is simply pending again, or in-progress without a lease, which recovery hands back
            data = self.encode(doc, State.IN_PROGRESS, handoff_id)
            # the producer's inode, which the leased copy replaces, becomes a spare if nobody
            # else can ever write it (see spares.adopt): then no inode is freed, nor created
            kept = spares.keep_link(dst, self.tmp)
            try:
                inode = fsio.replace(dst, data, self.tmp, durable=self.durable, sync_dir=False)
            except BaseException:
                if kept is not None:
                    spares.remove_quietly(kept)
                raise
            if kept is not None:
                spares.adopt(kept, self.tmp)
        except BaseException:
            release_lock(lock)
            raise
        crash_point("after-claim-lease")
        return Claim(handoff_id, doc, token, lock, block["attempt"], inode, prior)

    def _moving_back(self, handoff_id: str) -> bool:
        """True when the pending copy is one handoffd wrote after the in-progress copy (a newer
        sealed revision, or the in-progress copy is already gone): a move back in flight. A raw
        pending document beside a running one is a duplicate."""
        try:
            back = self.trusted_revision(self.read(State.PENDING, handoff_id), State.PENDING,
                                         handoff_id)
            if back == 0:
                return False
            running = self.read(State.IN_PROGRESS, handoff_id)
        except FileNotFoundError:  # one copy is gone: the move (or a claim) just finished
            return True
        except InvalidDocument:
            return False
        return back > self.trusted_revision(running, State.IN_PROGRESS, handoff_id)

    def _young(self, path: Path, now: datetime) -> bool:
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return False
        return now.timestamp() - mtime < self.settle_seconds

    def _put_back(self, dst: Path, src: Path) -> None:
        try:
            fsio.rename_noreplace(dst, src)
        except FileExistsError:
            pass  # a newer pending copy appeared; recovery resolves the pair

    def owns(self, claim: Claim) -> bool:
        """True while the in-progress document still carries this claim's lease token.

        Every write of the in-progress file makes a new inode, so an unchanged inode proves
        nobody (a sweeper) replaced or moved it since this claim wrote it; no read needed."""
        if claim.inode is not None:
            try:
                return os.stat(self.path(State.IN_PROGRESS, claim.handoff_id)).st_ino == claim.inode
            except FileNotFoundError:
                return False
        try:
            doc = self.read(State.IN_PROGRESS, claim.handoff_id)
        except (FileNotFoundError, InvalidDocument):
            return False
        held = book(doc).get("lease")
        if claim.token is None:  # recovering a claim whose owner never wrote a lease
            return not isinstance(held, dict)
        return isinstance(held, dict) and held.get("token") == claim.token

    def renew(self, claim: Claim, *, lease_seconds: float, now: datetime | None = None) -> bool:
        """Extend the lease; False if the claim was lost (recovered by a sweeper)."""
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
        if not allowed(src, dst):
            raise InvalidTransition(f"handoff {handoff_id} cannot go from {src.value} to {dst.value}",
                                    handoff_id=handoff_id)
        data = self.encode(doc, dst, handoff_id)
        if ours:
            fsio.create_exclusive(self.path(dst, handoff_id), data, self.tmp, durable=self.durable)
            crash_point("after-move-write")
            # no directory fsync: if a crash undoes this unlink, the two copies are told apart
            # by revision (states.winner) and recovery removes the older one
            spares.retire(self.path(src, handoff_id), self.tmp)
            crash_point("after-move-unlink")
            return
        # not a file of ours: it is taken aside first, so that what is removed is the copy this
        # move replaces, never one written in its place meanwhile (see :mod:`.aside`)
        taken = aside.take(self, src, handoff_id)
        try:
            if replaces is not None and self._revision_at(taken) != replaces:
                # filed again since the caller read it (two retries at once): not this move's
                raise FileExistsError(f"{src.value}/{handoff_id}.json changed meanwhile")
            fsio.create_exclusive(self.path(dst, handoff_id), data, self.tmp, durable=self.durable)
        except BaseException:
            aside.put_back(self, taken, src)
            raise
        crash_point("after-move-write")
        os.unlink(taken)
        crash_point("after-move-unlink")

    def _revision_at(self, path: Path) -> int | None:
        """The revision the document at ``path`` says it has (None: unreadable)."""
        try:
            data, _ = fsio.read_bytes_safely(path, self.max_filed_bytes)
            return revision(fsio.parse_document(data, path.name))
        except (OSError, InvalidDocument):
            return None

    def finish(self, claim: Claim, dst: State, doc: dict[str, Any]) -> bool:
        """File a claimed handoff in ``dst``. False (nothing written) if the claim was lost."""
        with claim.mutex:
            moved = False
            try:
                if claim.finished or not self.owns(claim):
                    return False
                book(doc).pop("lease", None)
                self.move(claim.handoff_id, State.IN_PROGRESS, dst, doc,
                          ours=claim.inode is not None)  # owns(): still the inode we wrote
                moved = True
                return True
            finally:
                if not moved and not claim.finished:  # e.g. disk full: recovery takes it over
                    self.give_up(claim.token)
                claim.finished = True
                release_lock(claim.lock)

    def remove_if(self, state: State, handoff_id: str, expect: dict[str, Any]) -> bool:
        """Delete ``handoff_id``'s document in the finished ``state`` if it still is ``expect``.

        The file is first set aside (:mod:`.aside`), so what is compared is what is deleted:
        a document filed in its place meanwhile (a retry that failed again) is never the one
        removed. One that differs is put back."""
        try:
            taken = aside.take(self, state, handoff_id)
        except (FileNotFoundError, FileExistsError):  # gone, or another process has it aside
            return False
        try:
            data, _ = fsio.read_bytes_safely(taken, self.max_filed_bytes)
            same = fsio.parse_document(data, f"{state.value}/{taken.name}") == expect
        except (OSError, InvalidDocument):
            same = False
        if same:
            os.unlink(taken)
            return True
        aside.put_back(self, taken, state)
        return False

    def quarantine(self, path: Path, code: str, message: str, *, now: datetime | None = None) -> Path:
        """Move an unusable file out of the state folders, with a ``.reason.json`` beside it."""
        now = now or utc_now()
        self.ws.quarantine.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.name)[:100] or "file"
        name = f"{now.strftime('%Y%m%dT%H%M%S')}-{os.urandom(4).hex()}-{safe}"
        target = self.ws.quarantine / name
        os.rename(path, target)  # works for symlinks and fifos too: the entry moves, not its target
        reason = {"file": _readable(path.name), "from": path.parent.name, "code": code,
                  "message": _readable(message), "at": iso(now), "actor": actor()}
        fsio.replace(self.ws.quarantine / f"{name}.reason.json", fsio.dump_json(reason),
                     self.tmp, durable=self.durable)
        return target

    def quarantined(self) -> list[dict[str, Any]]:
        """The reasons recorded for quarantined files, oldest first."""
        out = []
        for entry in sorted(self.ws.quarantine.glob("*.reason.json")):
            try:
                item = fsio.parse_document(fsio.read_regular(entry, MAX_REASON_BYTES), entry.name)
            except (OSError, InvalidDocument):
                continue
            item["stored_as"] = entry.name[: -len(".reason.json")]
            out.append(item)
        return out


def _readable(text: str) -> str:
    """``text`` as UTF-8 can hold it: the bytes of a file name that is not UTF-8 (and any lone
    surrogate) written as ``\\x`` escapes, so that a reason naming it can be filed."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte stands for
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")


def _doc_id(doc: dict[str, Any]) -> str:
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("id"), str):
        return block["id"]
    return str(doc.get("handoff_id"))


def lease(token: str | None, now: datetime, seconds: float, *,
          lock: str | None = None) -> dict[str, Any]:
    """A lease block: who holds the claim and until when (``token`` is None only when renewing a
    recovered claim whose owner never wrote a lease). ``lock``: the owner lock file it rides on
    (None: the claim's own ``<id>.<token>.lock``)."""
    block = {"token": token, "owner": actor(), "acquired_at": iso(now),
             "expires_at": iso(now + timedelta(seconds=seconds))}
    if lock is not None:
        block["lock"] = lock
    return block


def lock_name(handoff_id: str, held: dict[str, Any]) -> str:
    """The lock file whose holder owns the lease ``held``: the owner lock it names, else the
    claim's own lock file."""
    named = held.get("lock")
    if isinstance(named, str) and OWNER_LOCK_NAME.fullmatch(named):
        return named
    return f"{handoff_id}.{held.get('token')}.lock"


class NullLock:
    """Stands in for a claim lock that is not the claim's own to release: a stalled owner holds
    it, none exists, or the claim rides on the store's owner lock."""

    def release(self, force: bool = False) -> None:
        """Nothing to release."""


def release_lock(lock: "FileLock | NullLock") -> None:
    """Release a claim lock and remove its file (its name is unique to the claim)."""
    if isinstance(lock, NullLock):
        return
    try:
        lock.release(force=True)
    finally:
        try:
            os.unlink(lock.lock_file)
        except FileNotFoundError:
            pass


def try_lock(path: Path) -> FileLock | None:
    """Acquire ``path`` without waiting; None if another process (or claim) holds it."""
    from filelock import FileLock, Timeout
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return None
    return lock
