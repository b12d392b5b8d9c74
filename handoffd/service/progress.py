"""The progress watchdog ([daemon] stall_seconds): due work, a free slot, and nothing dispatched
for that long means the scheduler's bookkeeping is wrong; it is logged loudly, reset and rebuilt
from the truth (the files and the tasks actually in flight)."""
from __future__ import annotations

import logging
import time
from collections import Counter

from ..core import recurring
from ..core.engine import Engine
from ..core.errors import is_shortage
from ..core.states import State
from .attempts import Attempts
from .hooks import Hooks
from .report import BatchReport
from .scheduler import Scheduler

log = logging.getLogger("handoffd")
STALL_SAMPLE = 64  # pending documents the watchdog reads to decide whether work is due
CHECKING = "the progress check"  # the kind of its shortages (core.recurring)


class ProgressWatch:
    """Checks, from the daemon's loop, that a daemon with due work and a free slot dispatches."""

    def __init__(self, engine: Engine, scheduler: Scheduler, attempts: Attempts, hooks: Hooks,
                 report: BatchReport, *, stall_seconds: float) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.attempts = attempts
        self.hooks = hooks
        self.report = report
        self.stall_seconds = stall_seconds
        self.next_progress_check = scheduler.last_dispatch + stall_seconds
        # a shortage of descriptors or memory met by the check: one WARNING while it lasts
        self.shortages = recurring.Recurring(quiet=recurring.QUIET_SECONDS)

    def wake_at(self) -> float:
        """When the loop, idle with a free slot, must wake for the next check."""
        return max(self.next_progress_check, self.scheduler.last_dispatch + self.stall_seconds)

    def check(self, now: float) -> None:
        """Due work, a free slot, and nothing dispatched for ``stall_seconds``: the bookkeeping
        is wrong somewhere. Say so loudly, rebuild it from the truth and rescan."""
        since = now - self.scheduler.last_dispatch
        if now < self.next_progress_check or since < self.stall_seconds:
            return
        if self.attempts.saturated():  # nothing is dispatched on purpose: answers wait for a
            self.next_progress_check = now + self.stall_seconds  # disk that refuses them
            return
        self.next_progress_check = now + max(self.stall_seconds / 2, 0.05)
        try:
            stuck = self.due_with_free_slot()
        except Exception as exc:  # the watchdog itself must not take the loop down
            self._failed(exc, now)
            return
        if self.shortages.active:  # (a shortage said before: one line says it cleared)
            with recurring.sweeping(self.shortages, lambda: now):
                recurring.ok(CHECKING)
        if stuck is None:
            self.next_progress_check = now + self.stall_seconds
            return
        self.reset(f"handoff {stuck} is due and a slot is free, but nothing was "
                   f"dispatched for {now - self.scheduler.last_dispatch:.1f}s")

    def _failed(self, exc: Exception, now: float) -> None:
        """The check failed: a bug keeps its traceback. A passing shortage (listing pending/
        with no descriptor left: it was an ERROR with a traceback at every check) is one
        WARNING naming the limit, and another OSError (a PostgreSQL store away: it was a
        traceback too) one ERROR line, each held back while it recurs, and its end said
        (core.recurring); ``now`` is the loop's monotonic clock."""
        if not is_shortage(exc) and not isinstance(exc, OSError):
            log.exception("progress check failed; will check again")
            return
        with recurring.sweeping(self.shortages, lambda: now):
            recurring.error(CHECKING, exc, "progress check: cannot look for due work for now: "
                            "%s; will check again", exc)

    def due_with_free_slot(self) -> str | None:
        """A pending id that could be dispatched right now, judged from the files and the tasks
        actually in flight (not from the scheduling bookkeeping); None when there is none."""
        scheduler, engine = self.scheduler, self.engine
        with scheduler.cv:
            real = Counter(agent for agent, _ in scheduler.inflight.values())
            mine = set(self.attempts.active)
            doubtful = set(scheduler.waiting) | set(scheduler.unroutable)
            # held off for a passing reason (a claim or a start short of descriptors is put
            # back as it came, no due_at in its document): not a stall, nor until it has been
            # due for stall_seconds (the loop wakes for its floor and for this check at once,
            # and checks first: a back-off as long as stall_seconds read as a stall)
            since = time.monotonic() - self.stall_seconds
            mine.update(hid for hid, floor in scheduler.not_before.items() if floor > since)
        if len(scheduler.inflight) >= scheduler.workers:
            return None
        ids = [hid for hid in engine.backend.ids(State.PENDING) if hid not in mine]
        ids.sort(key=lambda hid: hid in doubtful)  # likely candidates first; bounded sample
        for handoff_id in ids[:STALL_SAMPLE]:
            peek = engine.peek(handoff_id)
            if peek is None:
                continue
            if not peek.readable:
                problem = peek.problem
                if problem is not None and not problem.transient:
                    return handoff_id  # due to be set aside
                continue
            if self.hooks.message_handler(peek.doc) is not None:
                return handoff_id
            if peek.due_at is not None and peek.due_at > engine.clock():
                continue
            spec = engine.registry.get(peek.target or "")
            if spec is None or real[spec.agent] >= scheduler.limit(spec):
                continue
            if scheduler.rate_until.get(spec.agent, 0.0) > time.monotonic():
                continue  # its rate limit holds it back: not a stall (asking would take a token)
            try:
                verdict = engine.gate(peek)
            except Exception:
                continue
            if verdict is not None and verdict.action == "wait":
                continue
            return handoff_id
        return None

    def reset(self, reason: str) -> None:
        """Throw away the scheduling bookkeeping, rebuild the slot counts from the tasks in
        flight and rescan pending/ (what the watchdog does on a stall)."""
        log.error("scheduler stalled: %s; resetting its bookkeeping and rescanning", reason)
        with self.scheduler.cv:
            self.report.stalls += 1
            self.scheduler.reset()
