"""What a claim holds and how: the store's :class:`Claim`, the lease block, a claim's own lock
file, and the process's owner lock (:class:`OwnerLocks`) that every claim made here rides on.

The store (:class:`.store.Store`) holds one :class:`OwnerLocks` and asks it at every claim for
the lock name to write in the lease; recovery (:mod:`.claims`, :mod:`.repair`) reads a lease's
lock name back with :func:`lock_name` and tries that lock with :func:`try_lock`.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ...core.errors import SHORTAGE_ERRNOS
from ...core.documents import actor
from ...core.ownfiles import plain_folder
from ...core.timeutil import iso
from .quarantine import planted, set_aside_planted

if TYPE_CHECKING:  # both are imported where a lock is taken (one-shot commands take none)
    from filelock import FileLock

    from .ownerlock import OwnerLock

# the name of a store's owner lock (see OwnerLocks.name); a lease naming anything else is judged
# by its per-claim lock file
OWNER_LOCK_NAME = re.compile(r"owner\.[0-9a-f]{32}\.lock")
# a new owner lock is made and flocked under its name with this suffix, then renamed (see
# OwnerLocks._take): the sweep takes no such name for a claim's or an owner's lock, and removes
# one only once it is older than its temp age and free (its process died before the rename)
STAGED_SUFFIX = ".new"
STAGED_OWNER_LOCK_NAME = re.compile(r"owner\.[0-9a-f]{32}\.lock\.new")
# How far another host's clock may run behind ours before its live lease looks expired to us.
CLOCK_TOLERANCE_SECONDS = 30.0


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


def lease(token: str | None, now: datetime, seconds: float, *,
          lock: str | None = None) -> dict[str, Any]:
    """A lease block: who holds the claim and until when (``token`` is None only when renewing a
    recovered claim whose owner never wrote a lease). ``lock``: the owner lock file it rides on
    (None: the claim's own ``<id>.<token>.lock``)."""
    from ...core.liveness import own_mark  # (the claiming process has it loaded already)
    owner = actor()
    known = own_mark()
    if known is not None:  # a free lock is its owner's death only if no process bears this
        owner["proc"], owner["ns"] = known
    block = {"token": token, "owner": owner, "acquired_at": iso(now),
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
    """Acquire ``path`` without waiting; None if another process (or claim) holds it.

    ``path`` is a lock file of a workspace's ``handoffs/.locks``. An entry planted under its
    name that is no regular file (a folder: EISDIR; a symlink: ELOOP, the lock is opened
    without following one; a FIFO, which would be "locked") is moved to the quarantine first
    (:func:`set_aside_planted`), so that it never keeps the lock from being had for good: a
    folder planted at one handoff's ``.recover.lock`` once stopped the recovery of every
    abandoned claim. OSError when the lock still cannot be had (the caller's handoff's
    problem alone)."""
    from filelock import FileLock, Timeout
    for last in (False, True):
        if planted(path):
            set_aside_planted(path)
        lock = FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return None
        except OSError:
            if last or not planted(path):  # planted between our look and the open: once more
                raise
            continue
        return lock
    raise AssertionError("unreachable")


def lock_document(path: Path | str) -> int | None:
    """A descriptor of the document at ``path`` (pending/) holding an exclusive ``flock`` on
    it: a claim takes it before its rename into in-progress/ and holds it until its lease is
    written. The sweep hands back no unleased in-progress file whose lock is held
    (:func:`unclaimed`), so a claimer stalled in between (SIGSTOP, a stalled disk under
    ``fsync``) keeps its claim however long it stalls, and no other claimer can take the
    handoff from under it. No lock file is made: the document's own inode carries it.

    Raises FileNotFoundError when ``path`` is gone and BlockingIOError when another claimer
    holds it (both: someone else is taking it; a producer that flocks its own file is taken
    for one still writing it, and the file is claimed once it lets go). None when it cannot be locked here (no regular
    file, not readable, a filesystem whose ``flock`` wants a descriptor open for writing, as
    NFS's emulation does): the claim goes on unlocked, guarded by the claim grace alone.
    OSError (SHORTAGE_ERRNOS) when no descriptor (or memory) is to spare for now: the
    claim is put off before its rename, nothing moved (unlocked, it failed one step later,
    in in-progress/)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # a symlink, a socket, EACCES: the claim's read says what it is
        if exc.errno in SHORTAGE_ERRNOS:
            raise
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:  # EBADF, ENOLCK: no such lock on this filesystem
        os.close(fd)
        return None
    return fd


@contextmanager
def unclaimed(path: Path) -> Iterator[bool]:
    """For the block: False when a claimer holds the lock of the in-progress file at ``path``
    (:func:`lock_document`: it renamed it in and is writing its lease, however long that takes);
    else True, with a shared lock held on it for the block, so that the file judged is the file
    the block moves. True also when it cannot be told (gone, not a regular file, no ``flock``
    here): the claim grace judges it, as before."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield True
        return
    free = True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            free = False
        except OSError:
            pass
        yield free
    finally:
        os.close(fd)


class OwnerLocks:
    """This process's owner lock in ``folder`` (``handoffs/.locks``), the lost ones it holds
    again while their claims are fenced (``shields``), and the claims it gave up."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.held: OwnerLock | None = None  # see name
        # owner locks lost (a handler closed their descriptor) and held again under a new one
        # while the attempts that rode on them wind down (see _replace_lost)
        self.shields: list[OwnerLock] = []
        self._mutex = threading.Lock()
        self._given_up: set[str] = set()  # lease tokens of claims ended here without being filed
        _LIVE.add(self)

    def forget_in_child(self) -> None:
        """Right after a fork, in the child: close the inherited descriptors of the parent's
        owner locks. A Python handler that forks without exec (``multiprocessing``'s default
        start) left its children holding the lock through them: a daemon killed while such a
        child lived kept its claims looking alive, unrecovered until the child exited. Closing
        a child's copy never frees the parent's lock. No mutex is taken: another thread of the
        parent may have held it at the fork."""
        for lock in (self.held, *self.shields):
            if lock is not None and lock.fd_ours():
                try:
                    os.close(lock.fd)
                except OSError:
                    pass
        self.held, self.shields = None, []
        self._mutex = threading.Lock()

    def name(self) -> str:
        """The name of the lock file this process holds while it lives: every claim's lease
        names it, so a recoverer on this host that can take it knows the owner process died.
        One lock for all claims instead of one lock file per claim: creating a file is the
        dearest step of a claim on a journaling filesystem.

        A handler running in this process may have closed the lock's descriptor (a careless
        "close inherited fds" helper): then the lock is free for any other process to take, and
        a claim naming it would look abandoned. So each call checks the descriptor with one
        ``fstat`` and, if it is gone, takes a new lock first (see :meth:`check`)."""
        with self._mutex:
            owner = self.held
            if owner is None or owner.pid != os.getpid():  # (a forked process takes its own)
                return self._take().name
            if owner.fd_intact():
                return owner.name
            why = owner.problem(self.folder) or "its descriptor was closed"
            fresh = self._replace_lost(owner, why)
        from .ownerlock import say_lost
        say_lost(owner, why, fresh)
        return fresh.name

    def check(self) -> str | None:
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
        with self._mutex:
            # a shield closed by a handler is forgotten, never closed (nor a forked parent's)
            self.shields = [s for s in self.shields if s.pid == os.getpid() and s.fd_ours()]
            owner = self.held
            if owner is None or owner.pid != os.getpid():
                return None
            why = owner.problem(self.folder)
            if why is None:
                return owner.name
            self.held = None  # (if no new lock can be taken, the next claim tries again)
            fresh = self._replace_lost(owner, why)
        from .ownerlock import say_lost
        say_lost(owner, why, fresh)
        return fresh.name

    def keep_shields(self, named: set[str]) -> None:
        """Release the lost owner locks held again (see :meth:`check`) that no claim in
        ``named`` (the lock names the running claims' leases give) rides on any more: their
        attempts have ended, and a claim given up midway is then recoverable by others, as when
        a process dies."""
        with self._mutex:
            done = [s for s in self.shields if s.name not in named and s.pid == os.getpid()]
            self.shields = [s for s in self.shields if s not in done]
        if done:
            from .ownerlock import drop_lock
            for shield in done:
                drop_lock(shield, self.folder)

    def _take(self) -> OwnerLock:
        """Create and lock a new owner lock file and make it this process's (under the mutex).

        The file is made and flocked under a staging name (``STAGED_SUFFIX``) and only then
        renamed to its own: any process's sweep removes a lock file in ``.locks`` that it can
        lock (its owner died), and one created under its own name was once found between its
        creation and its flock, removed, and the new owner's running claims fenced at its next
        check. It is staged in ``.locks`` itself: staged in ``.tmp``, the rename failed with
        EXDEV at every claim where ``.locks`` is a mount of its own.

        OSError (ENOTDIR) when ``.locks`` is not a plain folder of the workspace (the claim
        fails with that one line): through a symlink the lock would live outside it."""
        import fcntl

        from .ownerlock import OwnerLock, close_quietly, unlink_quietly
        name = f"owner.{os.urandom(16).hex()}.lock"  # never reused: a stale file is never ours
        staged = self.folder / f"{name}{STAGED_SUFFIX}"
        self._plain_folder()
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else holds it
            lock = OwnerLock.mark_open(name, fd)
            os.rename(staged, self.folder / name)  # (a random name: nothing there is replaced)
        except BaseException:
            close_quietly(fd)
            unlink_quietly(staged)
            raise
        self.held = lock
        return lock

    def _plain_folder(self) -> None:
        """Make ``.locks`` if it is missing; OSError when it is no plain folder of the workspace
        (a symlink planted there would put the lock, and the sweep's removals, outside it)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # a file or a dangling symlink: refused just below
        if not plain_folder(self.folder):
            raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?); no owner "
                          "lock is made there, so nothing can be claimed", str(self.folder))

    def _replace_lost(self, lost: OwnerLock, why: str) -> OwnerLock:
        """``lost`` is no longer surely held (``why``): keep it from being taken over while its
        claims are fenced if nobody took it meanwhile, and take a new owner lock (under the
        mutex)."""
        from .ownerlock import close_quietly, hold_again
        if lost.fd_ours():  # still our descriptor, but its file was removed or replaced
            close_quietly(lost.fd)
        else:  # never closed here: the number may already be another file's descriptor
            shield = hold_again(lost, self.folder)
            if shield is not None:
                self.shields.append(shield)
        self.held = None
        return self._take()

    def give_up(self, token: str | None) -> None:
        """Note that this process ended the claim with lease ``token`` without filing it (it
        failed midway): its lease still names the owner lock, which stays held, so recovery in
        this process asks :meth:`gave_up` instead of waiting for the lease to run out."""
        if token is not None:
            with self._mutex:
                self._given_up.add(token)

    def gave_up(self, token: str | None) -> bool:
        """True when this process gave up the claim with lease ``token`` (see :meth:`give_up`)."""
        with self._mutex:
            return token in self._given_up

    def close(self) -> None:
        """Drop the owner lock (claims still open become recoverable, as if this process died),
        and any lost one held again. Never raises for a descriptor a handler closed: one that is
        no longer ours is left alone (its number may be another file's now)."""
        with self._mutex:
            locks = [self.held, *self.shields]
            self.held, self.shields = None, []
        mine = [lock for lock in locks if lock is not None and lock.pid == os.getpid()]
        if mine:
            from .ownerlock import drop_lock
            for lock in mine:
                drop_lock(lock, self.folder)


# every OwnerLocks of this process, for the fork hook below (weakly: a closed store's goes)
_LIVE: "weakref.WeakSet[OwnerLocks]" = weakref.WeakSet()


def _forget_owner_locks() -> None:
    for owners in list(_LIVE):
        owners.forget_in_child()


os.register_at_fork(after_in_child=_forget_owner_locks)
