"""The files backend: the :class:`Backend` interface over the file store (handoffs/ state folders).

Every mechanism of the file protocol stays inside :class:`handoffd.backends.files.store.Store` and this module:
atomic non-overwriting writes, claims by ``rename(RENAME_NOREPLACE)``, a flock per claim, leases
fenced by the in-progress file's inode, seals, the settle window for half-written files and the
seen-ids record. What the engine gets back is neutral: a :class:`Claim` whose ``handle`` is the
store's claim (with its lock).

Claim-next lists pending/ and reads only documents it has not read before (a cache keyed by
inode, mtime and size: every handoffd write makes a new inode), so a claim costs one directory
listing plus the reads of new arrivals.
"""
from __future__ import annotations

import builtins
import copy
import heapq
import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator

from ...core.documents import book, book_int, hostname, revision
from ...core.errors import (
    DocumentNotReady,
    DuplicateHandoff,
    ErrorCode,
    InvalidDocument,
    InvalidTransition,
    NotFound,
    UnreadableDocument,
)
from ...core.logs import log
from ...core.states import State
from ...core.storage import LOST, Wakeup, trusted_doc
from ...core.timeutil import parse_iso
from ...core.workspace import Workspace
from ..base import (
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    FencedFiling,
    Meta,
    Order,
    Row,
    Rows,
    Subscribers,
    WakeupCallback,
    Where,
    describe_native,
    due_of,
    lease_block,
    matches,
    safe_describe,
    select,
    updated_of,
    wait_via_feed,
)
from . import fsio, repair, seals
from .problems import read_error
from .records import FileRecords
from .store import Claim as StoreClaim
from .store import OWNER_LOCK_NAME, Store, lock_name, release_lock, try_lock
from .watch import FolderWatch

if TYPE_CHECKING:
    from filelock import FileLock

# How far another host's clock may run behind ours before its live lease looks expired to us.
CLOCK_TOLERANCE_SECONDS = 30.0
MAX_RECORD_BYTES = 1 << 20  # a cancel marker or other small record of .meta/, read whole


@dataclass(frozen=True)
class _Pending:
    """What claim-next needs of one pending file, cached by ``key`` (inode, mtime, size)."""

    key: tuple[int, int, int]
    meta: Meta
    due_at: datetime


def _in_order(stamped: builtins.list[tuple[float, State, str]], limit: int | None, *,
              newest: bool) -> Iterator[tuple[float, State, str]]:
    """``stamped`` by (mtime, id), newest or oldest first. A listing usually shows its first
    ``limit`` rows: those are picked with a heap first (sorting 100,000 entries to show 50 took
    a sixth of ``handoff ls``), and the whole list is sorted only if filters skipped too many."""
    def key(s: tuple[float, State, str]) -> tuple[float, str]:
        return s[0], s[2]
    first = 4 * limit + 16 if limit is not None else len(stamped)
    if first >= len(stamped):
        yield from sorted(stamped, key=key, reverse=newest)
        return
    pick = heapq.nlargest if newest else heapq.nsmallest
    yield from pick(first, stamped, key=key)  # the same as the sorted list's head
    yield from sorted(stamped, key=key, reverse=newest)[first:]


def _owner_lock_of(claim: Claim) -> str | None:
    """The owner lock (see :meth:`Store.owner_lock`) ``claim``'s lease names; None for a claim on
    its own lock file (a recovered one)."""
    held = book(claim.doc).get("lease")
    named = held.get("lock") if isinstance(held, dict) else None
    return named if isinstance(named, str) and OWNER_LOCK_NAME.fullmatch(named) else None


class FilesBackend(FencedFiling, Backend):
    """One workspace's handoffs/ folders. ``monotonic`` judges how long this process has watched
    another owner's lease go unrenewed (a clock that never steps); ``watch`` enables watchdog
    hints of other processes' writes for subscribers."""

    # processes forked after it was opened may each use it (handoffd.service.spread): it opens
    # its files when first used, and forgets inherited spares and folder handles after a fork
    forkable = True

    def __init__(self, store: Store, *, describe: Describe = describe_native,
                 monotonic: Callable[[], float] = time.monotonic, watch: bool = True,
                 claim_grace_seconds: float = 10.0) -> None:
        self.store = store
        self.claim_grace_seconds = claim_grace_seconds
        self.ws = store.ws
        self.describe = describe
        self.monotonic = monotonic
        self._mutex = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._lease_watch: dict[str, tuple[str, float]] = {}  # id -> (lease mark, first seen)
        self._subscribers = Subscribers()
        self._watch = FolderWatch(self._folders(), self._subscribers.fire) if watch else None
        self._records = FileRecords(self.ws.meta)  # pauses, rate buckets: .meta/<kind>.json

    @classmethod
    def open(cls, workspace: Workspace, *, describe: Describe = describe_native,
             monotonic: Callable[[], float] = time.monotonic, watch: bool = True,
             claim_grace_seconds: float = 10.0, ensure: bool = True,
             **store_options: Any) -> "FilesBackend":
        """A backend on ``workspace`` (its folders are created unless ``ensure`` is False);
        ``store_options`` go to Store."""
        if ensure:
            workspace.ensure()
        return cls(Store(workspace, **store_options), describe=describe, monotonic=monotonic,
                   watch=watch, claim_grace_seconds=claim_grace_seconds)

    def _folders(self) -> dict[Path, str]:
        return {self.ws.state_dir(State.PENDING): State.PENDING.value,
                self.ws.state_dir(State.COMPLETED): State.COMPLETED.value,
                self.ws.state_dir(State.FAILED): State.FAILED.value,
                self._cancel_dir(): "cancel"}

    # ------------------------------------------------------------ creating and reading
    def prepare(self) -> None:
        """See Backend.prepare: the rename that publishes a new document needs renameat2, and
        every write the seal key (ConfigError, one line, when it is unusable)."""
        fsio.load_renameat2()
        _ = self.store.key

    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        self.store.create(copy.deepcopy(doc), handoff_id, now=now, due_at=due_at)
        self._subscribers.fire(handoff_id, State.PENDING.value)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        try:
            state, doc = self.store.get(handoff_id)
        except NotFound:
            return None
        return state, trusted_doc(self, state, handoff_id, doc)

    def trusted_book(self, state: State, handoff_id: str, doc: Doc) -> Doc | None:
        """See Backend.trusted_book: the block when its seal matches the folder it was read
        from. A claim renames a pending document into in-progress/ before it writes its lease
        (and seed 001's own consumer claims by that rename alone), so in-progress/ also takes a
        document sealed for pending/, as the sweep's recovery does. A document in completed/ or
        failed/ is handoffd's only when handoffd filed it there. Without a seal key no document
        here was ever sealed, and no block is vouched for."""
        folders = (state.value, State.PENDING.value) if state is State.IN_PROGRESS \
            else (state.value,)
        return seals.own_block(self.store.key, doc, handoff_id, folders)

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest", where: Where | None = None,
             unreadable: bool = False, before: datetime | None = None) -> Rows:
        filters: dict[str, Any] = {"state": state, "target": target, "conversation": conversation,
                                   "parent": parent, "since": since, "where": where,
                                   "before": before}
        if order == "due":  # by what the documents say: every one is read
            every = [row for _, st, hid in self._stamped(state)
                     if (row := self._row(hid, st, unreadable)) is not None]
            return select([r for r in every if r.problem is None], limit=limit, order=order,
                          **filters)
        # newest/oldest: by modification time, so that only what is shown is read (a listing of
        # a few rows stays cheap with 100,000 finished documents)
        rows: Rows = []
        # a finished document is updated no earlier than its file was written (see _row): one
        # written at or after ``before`` need not be read (retention then reads only old ones)
        cut = before.timestamp() if before is not None else None
        for mtime, st, handoff_id in _in_order(self._stamped(state), limit,
                                               newest=order == "newest"):
            if limit is not None and len(rows) >= limit:
                break
            if cut is not None and st.terminal and mtime >= cut:
                continue
            row = self._row(handoff_id, st, unreadable)
            if row is not None and (row.problem is not None or matches(row, **filters)):
                rows.append(row)
        return rows

    def _stamped(self, state: State | None) -> builtins.list[tuple[float, State, str]]:
        """(mtime, state, id) of every document file in ``state`` (all states: None)."""
        found: builtins.list[tuple[float, State, str]] = []
        append = found.append  # (a loop run once per finished document: kept lean)
        for st in ([state] if state is not None else State):
            for entry in self.store.entries(st):
                name = entry.name
                if name[-5:] != ".json":
                    continue
                try:
                    append((entry.stat(follow_symlinks=False).st_mtime, st, name[:-5]))
                except OSError:  # gone since the listing (or unstattable): nothing to show
                    continue
        return found

    def _row(self, handoff_id: str, state: State, unreadable: bool) -> Row | None:
        path = self.store.path(state, handoff_id)
        try:
            stamp = datetime.fromtimestamp(os.stat(path, follow_symlinks=False).st_mtime,
                                           timezone.utc)
            doc = self._read_pending(handoff_id) if state is State.PENDING \
                else self.store.read(state, handoff_id)
        except FileNotFoundError:
            return None
        except Exception as exc:  # a socket, EACCES, invalid JSON...: a row only when asked
            if not unreadable:
                return None
            now = datetime.now(timezone.utc)
            return Row(handoff_id, state, {}, Meta(None), now, now,
                       problem=read_error(path, exc, handoff_id))
        # the row keeps the document as stored (retention archives it and deletes only that);
        # what is derived from it (routing, parent, times) comes from its trusted view: a
        # forged history must not make a filing look new for ever, nor a forged parent keep it
        view = doc if state is State.PENDING else trusted_doc(self, state, handoff_id, doc)
        updated = updated_of(view, stamp)
        if state.terminal and stamp > updated:
            # filed after our last event (a foreign filing has none of ours: seed 001's own
            # consumer writes completed/ itself): retention ages it from its filing
            updated = stamp
        return Row(handoff_id, state, doc, safe_describe(self.describe, view),
                   due_of(view, stamp), updated)

    def _read_pending(self, handoff_id: str) -> Doc:
        """A pending document as the scheduler and the listing see it (its trusted view): a
        ``handoffd`` block that handoffd did not write there (no valid seal for pending/) is
        only a foreign document's claim to bookkeeping, so it is left out, as the claim leaves
        it out; otherwise a forged ``next_attempt_at``, ``awaiting`` or ``waiting_children``
        would hold or park it."""
        return trusted_doc(self, State.PENDING, handoff_id,
                           self.store.read(State.PENDING, handoff_id))

    # ------------------------------------------------------------ claims
    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
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
            doc = self._read_pending(handoff_id)
        except Exception:  # unreadable, half-written or gone: not a candidate (admission says why)
            return None
        fresh = _Pending(key, safe_describe(self.describe, doc),
                         due_of(doc, datetime.fromtimestamp(info.st_mtime, timezone.utc)))
        with self._mutex:
            self._pending[handoff_id] = fresh
        return fresh

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        """As :meth:`Backend.claim`. Files may also raise what :meth:`Store.claim` raises:
        DocumentNotReady (still being written; put back), DuplicateHandoff (an in-progress copy
        exists) and InvalidDocument (unreadable; left in in-progress/ for the caller to set
        aside)."""
        try:
            handle = self.store.claim(handoff_id, lease_seconds=lease_seconds, now=now,
                                      on_claim=prepare)
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
            if not os.path.lexists(self.store.path(state, handoff_id)):
                continue  # the usual answer, in one lstat (a failed open raises: 5x dearer)
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
                self._quarantine(State.IN_PROGRESS, handoff_id, ErrorCode.DUPLICATE_HANDOFF_ID,
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

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        if not self.store.finish(claim.handle, state, doc):
            return False
        with self._mutex:
            self._lease_watch.pop(claim.id, None)
        self._subscribers.fire(claim.id, state.value)
        return True

    # ------------------------------------------------------------ recovery
    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        taken: Claims = []
        for handoff_id in self.store.ids(State.IN_PROGRESS):
            # one recoverer at a time per handoff (the sweeper takes the same guard)
            guard = repair.recover_guard(self.store, handoff_id)
            if guard is None:
                continue
            try:
                claim = self._take_over(handoff_id, now, lease_seconds)
            finally:
                release_lock(guard)
            if claim is not None:
                taken.append(claim)
        return taken

    def _take_over(self, handoff_id: str, now: datetime, lease_seconds: float) -> Claim | None:
        """A new claim on ``handoff_id`` if its owner is gone: the in-progress file is rewritten
        with a fresh token (and inode), which fences the old owner out."""
        try:
            doc = self.store.read(State.IN_PROGRESS, handoff_id)
        except (OSError, InvalidDocument):
            return None
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
        if book(current).get("lease") != held or repair.is_leftover(self.store, handoff_id, mine):
            if current and book(current).get("lease") == held:  # the owner filed, then died
                self.store.path(State.IN_PROGRESS, handoff_id).unlink(missing_ok=True)
                log.warning("recovering %s: a newer copy exists; removed the in-progress one",
                            handoff_id)
            if old_lock is not None:
                release_lock(old_lock)
            return None
        token = os.urandom(16).hex()
        from filelock import FileLock
        lock = FileLock(str(self.ws.locks / f"{handoff_id}.{token}.lock"), timeout=0)
        lock.acquire()
        book(doc)["lease"] = lease_block(token, now, lease_seconds)
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
                return None, "given up by this process"
            lock = try_lock(self.ws.locks / lock_name(handoff_id, held))
            if lock is not None:
                return lock, "owner process is gone (its claim lock is free)"
        tolerance = 0.0 if same_host else CLOCK_TOLERANCE_SECONDS
        if not self._unrenewed(handoff_id, held, now, tolerance):
            return None
        who = f"{owner.get('host')}:{owner.get('pid')}"
        return None, f"lease expired at {held.get('expires_at')} (owner {who} stalled)"

    def _unrenewed(self, handoff_id: str, held: Doc, now: datetime, tolerance: float) -> bool:
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

    # ------------------------------------------------------------ what the engine and sweeper add
    def ids(self, state: State) -> builtins.list[str]:
        return self.store.ids(state)

    def peek(self, handoff_id: str) -> Doc | None:
        try:
            return self._read_pending(handoff_id)
        except FileNotFoundError:
            return None
        except Exception as exc:  # one bad file must never stop the scheduler or `handoff ls`
            raise read_error(self.store.path(State.PENDING, handoff_id), exc, handoff_id) from exc

    def abandon(self, claim: Claim) -> None:
        release_lock(claim.handle.lock)
        self.store.give_up(claim.token)  # its lease names our owner lock, which stays held

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        try:
            return self._quarantine(state, handoff_id, code, message)
        finally:
            if claim is not None:
                claim.handle.finished = True
                release_lock(claim.handle.lock)

    def _quarantine(self, state: State, handoff_id: str, code: str, message: str) -> bool:
        try:
            self.store.quarantine(self.store.path(state, handoff_id), code, message)
        except FileNotFoundError:
            return False
        with self._mutex:
            self._pending.pop(handoff_id, None)
        return True

    def quarantined(self) -> builtins.list[Doc]:
        return self.store.quarantined()

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        if self.store.locate(handoff_id):
            return False
        try:
            self.store.write_new(State.FAILED, doc)
        except DuplicateHandoff:
            return False
        self._subscribers.fire(handoff_id, State.FAILED.value)
        return True

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        if not os.path.lexists(self.store.path(State.FAILED, handoff_id)):
            return False
        try:
            # only the failure the caller read: one filed again meanwhile is not this retry's
            self.store.move(handoff_id, State.FAILED, State.PENDING, doc,
                            replaces=revision(doc) - 1)
        except (FileNotFoundError, FileExistsError):  # gone, or moved or filed again meanwhile
            return False
        self._subscribers.fire(handoff_id, State.PENDING.value)
        return True

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        if not state.terminal:
            raise InvalidTransition(f"handoff {handoff_id}: only finished handoffs are purged",
                                    handoff_id=handoff_id)
        self.store.seen.add(handoff_id, now)  # first: dedup must outlive the document
        if expect is not None:
            return self.store.remove_if(state, handoff_id, expect)
        try:
            os.unlink(self.store.path(state, handoff_id))
        except FileNotFoundError:
            return False
        return True

    def records(self) -> FileRecords:
        return self._records

    def maintain(self, now: datetime, *,
                 skip: Collection[str] = ()) -> dict[str, builtins.list[str]]:
        if self._watch is not None and len(self._subscribers) and not self._watch.alive():
            log.warning("the file watch died; restarting it (and rescanning)")
            self._watch.stop()
            try:
                self._watch.start()
            except OSError as exc:  # e.g. no inotify instances left: rescans still see files
                log.error("cannot restart the file watch: %s; relying on rescans", exc)
            self._subscribers.fire("", LOST)
        return repair.repair(self.store, now, claim_grace_seconds=self.claim_grace_seconds,
                             skip=skip)

    # ------------------------------------------------------------ cancel requests
    def _cancel_dir(self) -> Path:
        return self.ws.meta / "cancel"  # where handoffd.features.cancellation keeps them too

    @cached_property
    def _cancel_folder(self) -> str:
        return str(self._cancel_dir())

    def request_cancel(self, handoff_id: str, request: Doc) -> None:
        folder = self._cancel_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fsio.replace(folder / f"{handoff_id}.json", fsio.dump_json(request), self.store.tmp,
                     durable=self.store.durable)
        self._subscribers.fire(handoff_id, "cancel")

    def cancel_request(self, handoff_id: str) -> Doc | None:
        path = os.path.join(self._cancel_folder, f"{handoff_id}.json")
        if not os.path.lexists(path):  # the usual answer, asked twice per handoff: one lstat
            return None
        try:  # a FIFO or a symlink to /dev/zero there must neither block nor run on
            data = fsio.read_regular(path, MAX_RECORD_BYTES)
        except OSError:
            return None
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            body = None
        return body if isinstance(body, dict) else {"reason": "cancellation requested"}

    def cancel_requests(self) -> dict[str, Doc]:
        try:
            names = [n[:-5] for n in os.listdir(self._cancel_dir()) if n.endswith(".json")]
        except FileNotFoundError:
            return {}
        return {n: body for n in names if (body := self.cancel_request(n)) is not None}

    def clear_cancel(self, handoff_id: str) -> None:
        try:
            os.unlink(os.path.join(self._cancel_folder, f"{handoff_id}.json"))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ dedup, waiting, wake-ups
    def seen_add(self, handoff_id: str, now: datetime) -> None:
        self.store.seen.add(handoff_id, now)

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        return self.store.seen.contains(handoff_id, now)

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        return wait_via_feed(self, handoff_id, timeout)

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        if kinds is not None and self._watch is not None:
            return self._subscribe_to(callback, set(kinds))
        remove = self._subscribers.add(callback)
        if self._watch is not None:
            self._watch.start()

        def unsubscribe() -> None:
            remove()
            if self._watch is not None and not len(self._subscribers):
                self._watch.stop()  # nobody listens: no watch thread left behind
        return unsubscribe

    def _subscribe_to(self, callback: WakeupCallback, kinds: set[str]) -> Callable[[], None]:
        """A watch of its own over only the folders of ``kinds``: a batch that listens for
        cancel requests must not wake for every file the batch itself writes."""
        folders = {path: kind for path, kind in self._folders().items() if kind in kinds}
        watch = FolderWatch(folders, lambda handoff_id, kind, settled:
                            callback(Wakeup(handoff_id, kind, settled)))
        watch.start()
        return watch.stop

    def after_fork(self) -> None:
        """In a process forked to share the work (``--processes``): temp files go to a folder
        of this process's own (see :meth:`Store.use_own_tmp`)."""
        self.store.use_own_tmp()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        self.store.close()
