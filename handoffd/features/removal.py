"""The workspace's removal lock: finished handoffs are removed (retention: purge, archive) only
under it, and a create that names dependencies checks and stores under it too.

A purge between such a create's check ("the dependency exists") and its write (the new pending
document) once removed a completed dependency that the purge's look at live work could not yet
see, and the dependent failed ``DEPENDENCY_MISSING``. The turn file makes the two take turns: a
create waiting for it gets in between two passes. The lock files live in ``handoffs/.meta`` (not
``.locks``: the sweep removes the lock files there that no claim uses). A store that processes
of several workspaces share (PostgreSQL: several hosts) has a lock of its own
(:meth:`~handoffd.core.storage.Backend.removal_lock`), which is taken instead: the files of one
workspace order the processes of its own host only (a purge on host B removed what a create on
host A had just checked, and two hosts' archive passes each archived every document).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..core.errors import HandoffdError

if TYPE_CHECKING:
    from ..core.documents import Envelope
    from ..core.engine import Engine
    from ..core.storage import RemovalLock

REMOVAL_LOCK = "retention.lock"
REMOVAL_TURN = "retention.turn"
DEPENDENT_WAIT_SECONDS = 60.0  # how long a create with dependencies waits for a retention pass


@contextmanager
def removal_lock(meta: Path, wait: float) -> Iterator[bool]:
    """Hold the workspace's removal lock (``handoffs/.meta/retention.lock``: a retention pass,
    or a create that names dependencies); yields False when another process holds it past
    ``wait`` seconds. Whoever waits first goes next: each takes the turn file, then the lock, and
    gives the turn back, so a create waiting for a purge's pass gets in before its next pass.
    (Not in ``.locks``: the sweep removes the lock files there that no claim uses.)"""
    from filelock import FileLock, Timeout

    from ..backends.files.quarantine import clear_planted
    meta.mkdir(parents=True, exist_ok=True)
    for name in (REMOVAL_TURN, REMOVAL_LOCK):  # a folder or link planted there failed every
        clear_planted(meta / name)              # pass and every create with dependencies
    # flock only: filelock's fallback on a filesystem without it is a marker file, which a
    # kill -9 leaves behind (from another host, never judged stale): every later pass and
    # every create with dependencies would wait out its minute and give up, for ever. Without
    # flock, each fails at once with one line (ENOSYS) instead.
    turn, lock = (FileLock(str(meta / name), fallback_to_soft=False)
                  for name in (REMOVAL_TURN, REMOVAL_LOCK))
    deadline = time.monotonic() + wait
    try:
        turn.acquire(timeout=wait, poll_interval=0.01)
    except Timeout:
        yield False
        return
    try:
        lock.acquire(timeout=max(deadline - time.monotonic(), 0.0), poll_interval=0.01)
    except Timeout:
        turn.release()
        yield False
        return
    turn.release()
    try:
        yield True
    finally:
        lock.release()


class FileRemovalLock:
    """The workspace's removal lock: its files in ``handoffs/.meta`` (:func:`removal_lock`)."""

    name = f"handoffs/.meta/{REMOVAL_LOCK}"

    def __init__(self, meta: Path) -> None:
        self.meta = meta

    def hold(self, wait: float) -> AbstractContextManager[bool]:
        """See :func:`removal_lock`."""
        return removal_lock(self.meta, wait)

    def waited_for(self) -> bool:
        """Another process waits for the lock: it holds the turn file while it waits (see
        :func:`removal_lock`), so the turn cannot be taken now."""
        from filelock import FileLock, Timeout
        turn = FileLock(str(self.meta / REMOVAL_TURN), fallback_to_soft=False)
        try:
            turn.acquire(timeout=0)
        except Timeout:
            return True
        except OSError:  # (something planted there: the next removal_lock clears it)
            return False
        turn.release()
        return False


def store_lock(engine: Engine) -> RemovalLock:
    """The removal lock every process working ``engine``'s store shares: the store's own
    (PostgreSQL: one for every host), else the workspace's files."""
    own = engine.backend.removal_lock()
    return own if own is not None else FileRemovalLock(engine.ws.meta)


@contextmanager
def dependents_guard(engine: Engine, envelope: Envelope) -> Iterator[None]:
    """Engine ``submit_guards`` hook: a create that names dependencies checks and stores under
    the removal lock (HandoffdError, nothing created, when a pass holds it past
    :data:`DEPENDENT_WAIT_SECONDS`); any other create takes no lock."""
    if not envelope.depends_on:
        yield
        return
    lock = store_lock(engine)
    with lock.hold(DEPENDENT_WAIT_SECONDS) as mine:
        if not mine:
            raise HandoffdError(f"a retention pass held {lock.name} for over "
                                f"{DEPENDENT_WAIT_SECONDS:.0f} s; nothing was created: try again",
                                handoff_id=envelope.handoff_id)
        yield
