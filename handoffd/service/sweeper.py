"""Recovery: repair every half-finished state a crash can leave.

* an in-progress handoff whose claim lock is free (its owner died) or whose lease expired
  (its owner stalled) is retried or failed per its retry policy;
* a handoff present in two folders keeps the copy the state machine picks (``states.winner``);
* orphaned temp files and lock files of finished claims are removed;
* the seen-ids record is compacted to its TTL.

Sweeping is idempotent and safe to run from several processes at once.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from filelock import FileLock

from .. import dialects
from ..backends.files import fsio
from ..backends.files.store import Claim, NullLock, release_lock, try_lock
from ..core import procs
from ..core.documents import book, book_int, record
from ..core.engine import Engine
from ..core.errors import DuplicateHandoff, ErrorCode, InvalidDocument
from ..core.states import State, winner
from ..core.timeutil import parse_iso

TMP_MAX_AGE_SECONDS = 300.0
# How far another host's clock may run behind ours before its live lease looks expired to us.
CLOCK_TOLERANCE_SECONDS = 30.0
log = logging.getLogger("handoffd")


@dataclass
class SweepReport:
    """What one sweep did (counts plus the ids concerned)."""

    recovered: list[str] = field(default_factory=list)
    duplicates_resolved: list[str] = field(default_factory=list)
    temp_files_removed: int = 0
    locks_removed: int = 0

    def summary(self) -> str:
        return (f"recovered {len(self.recovered)} abandoned claim(s), resolved "
                f"{len(self.duplicates_resolved)} duplicate copies, removed "
                f"{self.temp_files_removed} temp file(s) and {self.locks_removed} stale lock(s)")


def sweep(engine: Engine, *, skip: set[str] | None = None) -> SweepReport:
    """Run every repair once. ``skip``: ids this process is working on right now.

    Each step, and each handoff within a step, is isolated: a document that defeats one repair
    is logged and left for the next sweep, and never stops the repairs of the others."""
    report = SweepReport()
    skip = skip or set()
    now = engine.clock()
    _step("resolving duplicate copies", resolve_duplicates, engine, report)
    try:
        in_progress = engine.store.ids(State.IN_PROGRESS)
    except OSError as exc:
        log.error("sweep: cannot list in-progress/: %s", exc)
        in_progress = []
    for handoff_id in in_progress:
        if handoff_id in skip:
            continue
        _step(f"recovering {handoff_id}", _recover_guarded, engine, handoff_id, now, report)
    for repair in engine.on_sweep:  # features' own repairs (contracts: file reservations)
        _step(_describe(repair), repair, engine)
    _step("removing orphaned files", remove_orphans, engine, report)
    _step("compacting the seen-ids record", lambda: engine.store.seen.compact(now))
    _step("pruning process records of finished attempts", procs.prune_records, engine.ws)
    return report


def _describe(repair: Any) -> str:
    """A feature repair's name for the log (e.g. ``running handoffd.features.contracts.feature.prune``)."""
    name = getattr(repair, "__qualname__", None) or repr(repair)
    module = getattr(repair, "__module__", None)
    return f"running {module}.{name}" if module else f"running {name}"


def _step(what: str, func: Any, *args: Any) -> None:
    """Run one repair; a failure is one log line (with the traceback for bugs), never the sweep."""
    try:
        func(*args)
    except OSError as exc:
        log.error("sweep: %s failed: %s; the next sweep tries again", what, exc)
    except Exception:  # a repair bug must not stop the other repairs
        log.exception("sweep: %s failed; the next sweep tries again", what)


def _recover_guarded(engine: Engine, handoff_id: str, now: datetime, report: SweepReport) -> None:
    # one sweeper at a time per handoff: several daemons sweep the same workspace, and a
    # claim without a lock to take (no lease yet, or a stalled owner) has no other guard
    guard = try_lock(engine.ws.locks / f"{handoff_id}.recover.lock")
    if guard is None:
        return
    try:
        recover_one(engine, handoff_id, now, report)
    except DuplicateHandoff as exc:  # a copy appeared in the target folder meanwhile
        log.warning("recovering %s: %s; the next sweep resolves the copies", handoff_id, exc)
    finally:
        release_lock(guard)


def recover_one(engine: Engine, handoff_id: str, now: datetime, report: SweepReport) -> None:
    """Recover one in-progress handoff if its owner is gone or its lease has expired."""
    store = engine.store
    path = store.path(State.IN_PROGRESS, handoff_id)
    try:
        doc = store.read(State.IN_PROGRESS, handoff_id)
        ctime = path.stat().st_ctime
    except FileNotFoundError:
        return
    except InvalidDocument:
        return  # unreadable in-progress files are never claims of ours; the daemon sets them aside
    # a claim's own rewrite seals it for in-progress/; a claimer that died right after its rename
    # leaves the pending seal (or none, for a raw document)
    ours = store.trusted_revision(doc, State.IN_PROGRESS, handoff_id) > 0
    held = book(doc).get("lease") if ours else None
    if not isinstance(held, dict) or not isinstance(held.get("token"), str):
        # moved in by a claimer that died before recording its lease (or is recording it now)
        if time.time() - ctime < engine.settings.claim_grace_seconds:
            return
        if store.trusted_revision(doc, State.PENDING, handoff_id, State.IN_PROGRESS) == 0:
            _undo_claim(engine, handoff_id, report)  # raw: put it back exactly as it came
            return
        lock = None
        reason = "claimer died before recording its lease"
    else:
        verdict = judge_lease(engine, handoff_id, held, now)
        if verdict is None:
            return  # owner alive (and renewing)
        lock, reason = verdict
    # confirm nothing moved while we looked
    try:
        current = store.read(State.IN_PROGRESS, handoff_id)
    except (FileNotFoundError, InvalidDocument):
        if lock is not None:
            release_lock(lock)
        return
    if book(current).get("lease") != held:
        if lock is not None:
            release_lock(lock)
        return
    engine.lease_watch.pop(handoff_id, None)
    _kill_leftovers(engine, handoff_id, book_int(current, "attempt", 1))
    mine = store.trusted_revision(current, State.IN_PROGRESS, handoff_id, State.PENDING)
    newer = [s for s in (State.COMPLETED, State.FAILED, State.PENDING)
             if _revision_at(store, s, handoff_id) > mine
             or (s is State.COMPLETED and _revision_at(store, s, handoff_id) >= 0)]
    if newer:  # the owner died after writing its next copy: the in-progress one is a leftover
        store.path(State.IN_PROGRESS, handoff_id).unlink(missing_ok=True)
        if lock is not None:
            release_lock(lock)
        report.duplicates_resolved.append(handoff_id)
        return
    token = held["token"] if isinstance(held, dict) else None
    orphan = Claim(handoff_id, current, token, lock or NullLock(), book_int(current, "attempt", 1),
                   prior_revision=mine)
    try:
        dialect = dialects.detect(current)
    except InvalidDocument:  # an unrecognised format: fail it in the native shape
        dialect = dialects.by_name("native")
    try:
        env = dialect.envelope(current)
        spec = engine.registry.get(env.target)
    except InvalidDocument:
        spec = None
    if token is None:  # the handler never started: hand it back without spending a retry
        engine.handback(orphan, dialect, reason=reason)
        report.recovered.append(handoff_id)
        return
    record(current, "recovered", now, reason=reason)
    outcome = engine.failure(now, ErrorCode.PROCESSING_ERROR,
                             f"handoff {handoff_id}: attempt {orphan.attempt} was interrupted: {reason}",
                             retryable=True)
    engine.file(orphan, dialect, spec, outcome)
    report.recovered.append(handoff_id)


def _kill_leftovers(engine: Engine, handoff_id: str, attempt: int) -> None:
    """Before an abandoned claim is handed back, kill what its attempt left running on this host
    (a background child, a grandchild that called setsid), so that the retry never overlaps it."""
    try:
        procs.kill_leftovers(engine.ws, handoff_id, attempt=attempt)
    except OSError as exc:
        log.warning("recovering %s: cannot check for leftover processes: %s", handoff_id, exc)


def judge_lease(engine: Engine, handoff_id: str, held: dict[str, Any],
                now: datetime) -> tuple[FileLock | None, str] | None:
    """Is the owner of a lease gone? None: it is alive. Else (its claim lock, if we took it; why).

    * Owner on this host: its claim lock says it all. Free: the owner died (recover now, holding
      the lock). Held: the owner is alive; it counts as stalled only when the lease has expired
      *and* this process has itself watched the lease go unrenewed for a whole lease period on a
      clock that never steps (``engine.monotonic``), so a wall clock that is ahead or jumps can
      never make a live claim look abandoned.
    * Owner on another host (a shared filesystem, where flock is local or emulated): the lock
      proves nothing; only an expiry older than ``CLOCK_TOLERANCE_SECONDS`` that this process has
      watched for a whole lease period counts.
    """
    owner = given if isinstance(given := held.get("owner"), dict) else {}
    same_host = owner.get("host") == socket.gethostname()
    if same_host:
        lock = try_lock(engine.store.ws.locks / f"{handoff_id}.{held['token']}.lock")
        if lock is not None:
            return lock, "owner process is gone (its claim lock is free)"
    tolerance = 0.0 if same_host else CLOCK_TOLERANCE_SECONDS
    if not _unrenewed_for_a_lease(engine, handoff_id, held, now, tolerance):
        return None
    who = f"{owner.get('host')}:{owner.get('pid')}"
    return None, f"lease expired at {held.get('expires_at')} (owner {who} stalled)"


def _unrenewed_for_a_lease(engine: Engine, handoff_id: str, held: dict[str, Any], now: datetime,
                           tolerance: float) -> bool:
    """True when the lease expired (by ``now`` minus ``tolerance``) and this process has seen the
    same lease, unrenewed, for at least one lease period of its monotonic clock."""
    try:
        acquired = parse_iso(str(held.get("expires_at")))
        period = max((acquired - parse_iso(str(held.get("acquired_at")))).total_seconds(), 0.0)
    except ValueError:
        acquired, period = now, 0.0  # unreadable times: only the watch below can tell
    seen_as, since = engine.lease_watch.get(handoff_id, (None, 0.0))
    mark = f"{held.get('token')}/{held.get('expires_at')}"
    tick = engine.monotonic()
    if seen_as != mark:
        engine.lease_watch[handoff_id] = (mark, tick)
        since = tick
    expired = (now - acquired).total_seconds() >= tolerance
    return expired and tick - since >= period


def _undo_claim(engine: Engine, handoff_id: str, report: SweepReport) -> None:
    """A raw document whose claimer died before admitting it goes back to pending/ untouched
    (its bookkeeping is not ours to rewrite; admission will treat it as new)."""
    store = engine.store
    try:
        fsio.rename_noreplace(store.path(State.IN_PROGRESS, handoff_id),
                              store.path(State.PENDING, handoff_id))
    except FileNotFoundError:
        return
    except FileExistsError:  # a pending copy appeared meanwhile: keep one, quarantine the other
        store.quarantine(store.path(State.IN_PROGRESS, handoff_id), ErrorCode.DUPLICATE_HANDOFF_ID,
                         f"handoff {handoff_id} was pending twice; a second document is never run")
    report.recovered.append(handoff_id)


def _revision_at(store: Any, state: State, handoff_id: str) -> int:
    """Trusted revision of the copy in ``state``: -1 absent, 0 unsealed or unreadable."""
    try:
        return store.trusted_revision(store.read(state, handoff_id), state, handoff_id)
    except FileNotFoundError:
        return -1
    except InvalidDocument:
        return 0


def resolve_duplicates(engine: Engine, report: SweepReport) -> None:
    """Where one id has files in several folders, keep the winner and remove the others.
    A raw (never-handled) duplicate in pending/ is quarantined rather than deleted."""
    store = engine.store
    where: dict[str, list[State]] = {}
    for state in State:
        for handoff_id in store.ids(state):
            where.setdefault(handoff_id, []).append(state)
    for handoff_id, states in where.items():
        if len(states) < 2:
            continue
        copies: list[tuple[State, dict[str, Any]]] = []
        for state in states:
            try:
                copies.append((state, store.read(state, handoff_id)))
            except FileNotFoundError:
                continue
            except InvalidDocument:
                copies.append((state, {}))
        if len(copies) < 2:
            continue
        if any(s is State.IN_PROGRESS for s, _ in copies):
            continue  # settled by recover_one, which first makes sure the owner is gone
        best = winner([(s, store.trusted_revision(d, s, handoff_id)) for s, d in copies])
        for index, (state, doc) in enumerate(copies):
            if index == best:
                continue
            path = store.path(state, handoff_id)
            try:
                if state is State.PENDING and store.trusted_revision(doc, state, handoff_id) == 0:
                    store.quarantine(path, ErrorCode.DUPLICATE_HANDOFF_ID,
                                     f"handoff {handoff_id} already exists in "
                                     f"{copies[best][0].value}/; a second document is never run")
                else:
                    path.unlink()
            except FileNotFoundError:
                continue
        report.duplicates_resolved.append(handoff_id)


def remove_orphans(engine: Engine, report: SweepReport) -> None:
    """Delete temp files older than a few minutes and lock files no claim uses."""
    ws = engine.ws
    cutoff = time.time() - TMP_MAX_AGE_SECONDS
    for entry in _scan(ws.tmp):
        try:
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                report.temp_files_removed += 1
        except FileNotFoundError:
            continue
    active = set(engine.store.ids(State.IN_PROGRESS))
    for entry in _scan(ws.locks):
        handoff_id = entry.name.rsplit(".", 2)[0] if entry.name.endswith(".lock") else None
        if handoff_id is None or handoff_id in active:
            continue
        lock = try_lock(ws.locks / entry.name)
        if lock is not None:
            release_lock(lock)
            report.locks_removed += 1


def _scan(path: Any) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def requeue_failed(engine: Engine, handoff_id: str, *, force: bool = False,
                   reason: str = "manual retry") -> None:
    """``handoff retry``: move a failed handoff back to pending/ with retry_count + 1."""
    from ..core.errors import InvalidTransition, NotFound

    store = engine.store
    state, doc = store.get(handoff_id)
    if state is not State.FAILED:
        raise InvalidTransition(f"handoff {handoff_id} is {state.value}, not failed; only failed "
                                "handoffs can be retried", handoff_id=handoff_id)
    block = book(doc)
    error = (block.get("final_error") or (given if isinstance(given := doc.get("error"), dict) else None)
             or block.get("last_error") or {})
    if block.get("retry_available", doc.get("retry_available")) is False and not force:
        raise InvalidTransition(
            f"handoff {handoff_id} failed with a permanent error ({error.get('code', 'unknown')}); "
            "fix the cause, then retry with --force", handoff_id=handoff_id)
    block["retries"] = book_int(doc, "retries", 0) + 1
    block["last_error"] = error or None
    block.pop("final_error", None)
    block.pop("retry_available", None)
    block.pop("next_attempt_at", None)
    block.pop("lease", None)
    if "retry_count" in doc:
        doc["retry_count"] = block["retries"]
    record(doc, "retried", engine.clock(), reason=reason, forced=force, previous_error=error or None)
    dialect = dialects.detect(doc)
    restore_request(doc)
    dialect.mark_pending(doc)
    try:
        store.move(handoff_id, State.FAILED, State.PENDING, doc)
    except DuplicateHandoff:
        raise InvalidTransition(f"handoff {handoff_id} is already pending again",
                                handoff_id=handoff_id) from None
    except FileNotFoundError:
        raise NotFound(f"handoff {handoff_id} moved while retrying; look again with `handoff show`",
                       handoff_id=handoff_id) from None


ANSWER_KEYS = ("aggregated_outcome", "children", "error", "errors", "failed_at", "timestamp_failed",
               "retry_available",
               "recovery_actions", "execution_time_seconds", "completed_at", "timestamp_completed",
               "started_at")


def restore_request(doc: dict[str, Any]) -> None:
    """Strip native answer fields so a requeued document reads as a request again."""
    for key in ANSWER_KEYS:
        doc.pop(key, None)
    block = book(doc)
    if isinstance(block.get("request_snapshot"), dict):
        snapshot = block["request_snapshot"]
        for key in list(doc):
            if key != "handoffd":
                del doc[key]
        doc.update(snapshot)
