"""The files backend's claim, lease and recovery path (:class:`Claimer`): claim-next over
pending/, a claim's checks for other copies of its id, lease renewal and the lease watch, the
claims that ride on a lost owner lock, and the take-over of claims whose owner is gone.

Claim-next lists pending/ and reads only documents it has not read before (a cache keyed by
inode, mtime and size: every handoffd write makes a new inode), so a claim costs one directory
listing plus the reads of new arrivals. :class:`~handoffd.backends.files.backend.FilesBackend`
makes one Claimer when it first claims (one-shot commands never load this module) and its
claim methods call the Claimer's of the same names.
"""
from __future__ import annotations

import builtins
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Collection

from ...core import recurring
from ...core.documents import book, book_int, hostname
from ...core.errors import (
    DocumentNotReady,
    ErrorCode,
    HandoffdError,
    InvalidDocument,
    UnreadableDocument,
)
from ...core.liveness import owner_may_live
from ...core.logs import log
from ...core.storage import GIVEN_UP, GIVEN_UP_UNRUN, LEASE_EXPIRED
from ...core.states import State
from ...core.timeutil import parse_iso
from ..base import (
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    Meta,
    due_of,
    safe_describe,
)
from . import fsio, unrun
from .leases import (
    CLOCK_TOLERANCE_SECONDS,
    OWNER_LOCK_NAME,
    lease,
    lock_name,
    release_lock,
    try_lock,
)
from .problems import read_error
from .reading import read_pending
from .repair import is_leftover, recover_guard
from .store import Claim as StoreClaim
from .store import Store

if TYPE_CHECKING:
    from filelock import FileLock


@dataclass(frozen=True)
class _Pending:
    """What claim-next needs of one pending file, cached by ``key`` (inode, mtime, size)."""

    key: tuple[int, int, int]
    meta: Meta
    due_at: datetime


def _owner_lock_of(claim: Claim) -> str | None:
    """The owner lock (see :meth:`Store.owner_lock`) ``claim``'s lease names; None for a claim on
    its own lock file (a recovered one)."""
    held = book(claim.doc).get("lease")
    named = held.get("lock") if isinstance(held, dict) else None
    return named if isinstance(named, str) and OWNER_LOCK_NAME.fullmatch(named) else None


class Claimer:
    """The claims of ``backend`` on ``store``. ``monotonic`` judges how long this process has
    watched another owner's lease go unrenewed (a clock that never steps)."""

    def __init__(self, backend: Backend, store: Store, *, describe: Describe,
                 monotonic: Callable[[], float]) -> None:
        self.backend = backend
        self.store = store
        self.describe = describe
        self.monotonic = monotonic
        self._mutex = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._lease_watch: dict[str, tuple[str, float]] = {}  # id -> (lease mark, first seen)

    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        """See :meth:`Backend.claim_next`: the most urgent due pending handoff, claimed."""
        for handoff_id in self._due(set(targets), now, exclude):
            try:
                claim = self.claim(handoff_id, now, lease_seconds, prepare=prepare)
            except DocumentNotReady:
                continue
            if claim is not None:
                return claim
        return None

    def _due(self, targets: set[str], now: datetime, exclude: Collection[str]) -> builtins.list[str]:
        """Ids of due pending documents for ``targets``, most urgent first."""
        found: builtins.list[tuple[int, datetime, str]] = []
        listed: set[str] = set()
        for entry in self.store.entries(State.PENDING):
            if not entry.name.endswith(".json") or (handoff_id := entry.name[:-5]) in exclude:
                continue
            listed.add(handoff_id)
            info = self._pending_info(handoff_id, entry)
            if info is not None and info.meta.target in targets and info.due_at <= now:
                found.append((info.meta.priority, info.due_at, handoff_id))
        with self._mutex:  # forget what left pending/
            for gone in set(self._pending) - listed - set(exclude):
                del self._pending[gone]
        return [handoff_id for _, _, handoff_id in sorted(found)]

    def _pending_info(self, handoff_id: str, entry: os.DirEntry[str]) -> _Pending | None:
        """What claim-next needs of one pending file, read only when it changed."""
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            return None
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        with self._mutex:
            cached = self._pending.get(handoff_id)
        if cached is not None and cached.key == key:
            return cached
        try:
            doc = read_pending(self.backend, self.store, handoff_id)
        except Exception:  # unreadable, half-written or gone: not a candidate (admission says why)
            return None
        fresh = _Pending(key, safe_describe(self.describe, doc),
                         due_of(doc, datetime.fromtimestamp(info.st_mtime, timezone.utc)))
        with self._mutex:
            self._pending[handoff_id] = fresh
        return fresh

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        """See :meth:`FilesBackend.claim <handoffd.backends.files.backend.FilesBackend.claim>`:
        as :meth:`Backend.claim`. Files may also raise what :meth:`Store.claim` raises:
        DocumentNotReady (still being written; put back), DuplicateHandoff (an in-progress copy
        exists) and InvalidDocument (unreadable; left in in-progress/ for the caller to set
        aside)."""
        try:
            handle = self.store.claim(handoff_id, lease_seconds=lease_seconds, now=now,
                                      on_claim=prepare, due_only=due_only)
        except OSError as exc:  # renamed, then unreadable (a socket, EACCES): say why, once
            problem = self._in_progress_problem(handoff_id, exc)
            if problem is None:
                raise
            raise problem from exc
        if handle is None or handle.token is None:
            return None
        try:
            runs = self._resolve_copies(handle)
        except BaseException:
            release_lock(handle.lock)
            self.store.give_up(handle.token)
            raise
        if not runs:
            return None
        self._watched(handoff_id, handle.doc)
        return Claim(handoff_id, handle.doc, handle.token, handle.attempt, handle,
                     raw=handle.prior_revision == 0)

    def _in_progress_problem(self, handoff_id: str, exc: OSError) -> UnreadableDocument | None:
        """After a claim failed with an OSError: if it is the just-renamed in-progress copy that
        cannot be read (a socket, EACCES), why; None when the error lies elsewhere."""
        try:
            self.store.read(State.IN_PROGRESS, handoff_id)
        except (FileNotFoundError, InvalidDocument):
            return None
        except Exception as err:
            problem = read_error(self.store.path(State.IN_PROGRESS, handoff_id), err, handoff_id)
            return None if problem.transient or problem.claimable else problem
        return None

    def _resolve_copies(self, claim: StoreClaim) -> bool:
        """Another copy of this id elsewhere? The higher trusted revision wins, and a completed
        copy always does (nothing leaves completed/). True: ours runs."""
        handoff_id, previous = claim.handoff_id, claim.prior_revision
        for state in (State.COMPLETED, State.FAILED, State.PENDING):
            try:  # the usual answer, in one lstat (a failed open raises: 5x dearer), of a str
                os.lstat(self.store.file(state, handoff_id))  # path: no Path built for it
            except OSError:  # (as os.path.lexists: absent, or not to be looked at)
                continue
            try:
                other = self.store.read(state, handoff_id)
            except FileNotFoundError:
                continue
            except InvalidDocument:
                other = {}
            theirs = self.store.trusted_revision(other, state, handoff_id)
            if state is State.PENDING and theirs == 0:
                continue  # a raw duplicate: its own claim will set it aside
            if previous == 0 and state is not State.PENDING:  # a raw document reusing an id
                self.quarantine(State.IN_PROGRESS, handoff_id, ErrorCode.DUPLICATE_HANDOFF_ID,
                                 f"handoff {handoff_id} already exists in {state.value}/; a "
                                 "second document with the same id is never run")
                release_lock(claim.lock)
                return False
            if state is State.COMPLETED or theirs > previous:  # ours is a leftover
                self.store.path(State.IN_PROGRESS, handoff_id).unlink(missing_ok=True)
                release_lock(claim.lock)
                return False
            self.store.path(state, handoff_id).unlink(missing_ok=True)
        return True

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        """See :meth:`Backend.renew`: False when the claim was lost."""
        handle: StoreClaim = claim.handle
        if handle.finished:
            return False
        if not self.store.renew(handle, lease_seconds=lease_seconds, now=now):
            return False
        self._watched(claim.id, handle.doc)
        return True

    def broken_claims(self, claims: Collection[Claim]) -> builtins.list[Claim]:
        """Those of ``claims`` (this process's running ones) that ride on an owner lock this
        process no longer holds for sure: a handler closed its descriptor (see
        :meth:`Store.check_owner_lock`, which takes a new one). Another process may have taken
        the lock meanwhile and judged them abandoned, so the caller fences them: stopped, their
        attempts retried, their results never filed over another owner's claim. Raises OSError
        when no new owner lock can be taken (then every claim on the old one is returned by the
        next call, which tries again)."""
        current = self.store.check_owner_lock()
        named = {name for claim in claims if (name := _owner_lock_of(claim)) is not None}
        self.store.keep_shields(named)  # a lost lock held again until its claims have ended
        return [claim for claim in claims if _owner_lock_of(claim) not in (None, current)]

    # ------------------------------------------------------------ recovery
    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        """See :meth:`Backend.expired_claims`: new claims on handoffs whose owner is gone."""
        taken: Claims = []
        for handoff_id in self.store.ids(State.IN_PROGRESS):
            # each handoff on its own: one whose lock cannot be had (EISDIR, ELOOP, EACCES...)
            # or whose file cannot be rewritten is logged and left for the next sweep, and the
            # others are recovered (an OSError here once dropped the whole list, every sweep)
            try:
                claim = self._recover_one(handoff_id, now, lease_seconds)
            except (OSError, HandoffdError, MemoryError) as exc:  # (said once while it
                # lasts: recurring; a MemoryError, a shortage, was a traceback at every sweep)
                code = getattr(exc, "code", None)
                recurring.error(recurring.RECOVERY, exc, "sweep: recovering %s failed: %s%s; "
                                "the next sweep tries again", handoff_id, exc,
                                f" [{code}]" if code else "")
                continue
            except Exception:  # a bug must not stop the recovery of the others either
                log.exception("sweep: recovering %s failed; the next sweep tries again",
                              handoff_id)
                continue
            if claim is not None:
                taken.append(claim)
        return taken

    def _recover_one(self, handoff_id: str, now: datetime, lease_seconds: float) -> Claim | None:
        """A new claim on ``handoff_id`` if its owner is gone, under its recovery guard."""
        # one recoverer at a time per handoff (the sweeper takes the same guard)
        guard = recover_guard(self.store, handoff_id)
        if guard is None:
            return None
        try:
            return self._take_over(handoff_id, now, lease_seconds)
        finally:
            release_lock(guard)

    def _take_over(self, handoff_id: str, now: datetime, lease_seconds: float) -> Claim | None:
        """A new claim on ``handoff_id`` if its owner is gone: the in-progress file is rewritten
        with a fresh token (and inode), which fences the old owner out."""
        try:
            doc = self.store.read(State.IN_PROGRESS, handoff_id)
        except (OSError, InvalidDocument):  # no lease to judge: an entry that stays unreadable
            return None  # past the claim grace is set aside by the sweep (repair.set_aside_junk)
        held = book(doc).get("lease")
        if self.store.trusted_revision(doc, State.IN_PROGRESS, handoff_id) == 0 \
                or not isinstance(held, dict) or not isinstance(held.get("token"), str):
            return None  # no lease written by handoffd (yet): the sweeper's claim grace applies
        verdict = self._judge(handoff_id, held, now)
        if verdict is None:
            return None
        old_lock, reason = verdict
        try:
            current = self.store.read(State.IN_PROGRESS, handoff_id)
        except (OSError, InvalidDocument):
            current = {}
        mine = self.store.trusted_revision(current, State.IN_PROGRESS, handoff_id)
        if book(current).get("lease") != held or is_leftover(self.store, handoff_id, mine):
            if current and book(current).get("lease") == held:  # the owner filed, then died
                self.store.path(State.IN_PROGRESS, handoff_id).unlink(missing_ok=True)
                log.warning("recovering %s: a newer copy exists; removed the in-progress one",
                            handoff_id)
            if old_lock is not None:
                release_lock(old_lock)
            return None
        given_up_unrun = unrun.marked(self.store.ws, handoff_id, held["token"])
        if given_up_unrun:  # its process gave it up before its handler ran: no crash
            reason = GIVEN_UP_UNRUN
        token = os.urandom(16).hex()
        from filelock import FileLock
        lock = FileLock(str(self.store.ws.locks / f"{handoff_id}.{token}.lock"), timeout=0)
        lock.acquire()
        book(doc)["lease"] = lease(token, now, lease_seconds)
        try:
            inode = fsio.replace(self.store.path(State.IN_PROGRESS, handoff_id),
                                 self.store.encode(doc, State.IN_PROGRESS, handoff_id),
                                 self.store.tmp, durable=self.store.durable, sync_dir=False)
        except BaseException:
            release_lock(lock)
            raise
        finally:
            if old_lock is not None:
                release_lock(old_lock)
        self._watched(handoff_id, doc)
        if given_up_unrun:  # (its lease is no one's now: the mark has said what it had to)
            unrun.clear(self.store.ws, handoff_id, held["token"])
        attempt = book_int(doc, "attempt", 1)
        handle = StoreClaim(handoff_id, doc, token, lock, attempt, inode,
                            self.store.trusted_revision(doc, State.IN_PROGRESS, handoff_id))
        return Claim(handoff_id, doc, token, attempt, handle, recovered=reason)

    def _judge(self, handoff_id: str, held: Doc, now: datetime) -> tuple[FileLock | None, str] | None:
        """Is the lease's owner gone? None: alive. Else (its claim lock if we took it, why).
        On this host a free claim lock proves the owner died; otherwise only an expiry (beyond
        the clock tolerance for another host) that this process itself watched for a whole lease
        period on its monotonic clock counts, so a stepped wall clock never ends a live claim."""
        owner: Doc = given if isinstance(given := held.get("owner"), dict) else {}
        same_host = owner.get("host") == hostname()
        if same_host:
            if self.store.gave_up(held["token"]):
                return None, GIVEN_UP
            lock = try_lock(self.store.ws.locks / lock_name(handoff_id, held))
            if lock is not None and owner_may_live(owner):
                # its owner lives: a handler closed the daemon's lock under a running claim.
                # Let go without removing the file (the owner holds it again if it can, and
                # fences the claim otherwise); only the lease's expiry can end it from here.
                lock.release(force=True)
            elif lock is not None:
                return lock, "owner process is gone (its claim lock is free)"
        tolerance = 0.0 if same_host else CLOCK_TOLERANCE_SECONDS
        if not self._unrenewed(handoff_id, held, now, tolerance):
            return None
        who = f"{owner.get('host')}:{owner.get('pid')}"
        return None, f"{LEASE_EXPIRED} at {held.get('expires_at')} (owner {who} stalled)"

    def _unrenewed(self, handoff_id: str, held: Doc, now: datetime, tolerance: float) -> bool:
        """True once this process has watched the lease ``held`` unrenewed past its expiry
        (beyond ``tolerance``) for a whole lease period on its monotonic clock."""
        try:
            expires = parse_iso(str(held.get("expires_at")))
            period = max((expires - parse_iso(str(held.get("acquired_at")))).total_seconds(), 0.0)
        except ValueError:
            expires, period = now, 0.0  # unreadable times: only the watch can tell
        mark = f"{held.get('token')}/{held.get('expires_at')}"
        tick = self.monotonic()
        with self._mutex:
            seen_as, since = self._lease_watch.get(handoff_id, (None, tick))
            if seen_as != mark:
                self._lease_watch[handoff_id] = (mark, tick)
                since = tick
        return (now - expires).total_seconds() >= tolerance and tick - since >= period

    def _watched(self, handoff_id: str, doc: Doc) -> None:
        """This process wrote the lease now: it has watched it since."""
        held = book(doc).get("lease")
        if isinstance(held, dict):
            with self._mutex:
                self._lease_watch[handoff_id] = (f"{held.get('token')}/{held.get('expires_at')}",
                                                 self.monotonic())

    def released(self, handoff_id: str) -> None:
        """A claim of ``handoff_id`` was filed: its lease is no longer watched."""
        with self._mutex:
            self._lease_watch.pop(handoff_id, None)

    def quarantine(self, state: State, handoff_id: str, code: str, message: str) -> bool:
        """Move ``handoff_id``'s file in ``state`` to quarantine; False when it is gone."""
        try:
            self.store.quarantine(self.store.path(state, handoff_id), code, message)
        except FileNotFoundError:
            return False
        with self._mutex:
            self._pending.pop(handoff_id, None)
        return True

