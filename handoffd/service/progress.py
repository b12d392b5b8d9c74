"""The progress watchdog ([daemon] stall_seconds): due work, a free slot, and nothing dispatched
for that long means the scheduler's bookkeeping is wrong; it is logged loudly, reset and rebuilt
from the truth (the files and the tasks actually in flight)."""
from __future__ import annotations

import logging
import time
from collections import Counter

from ..core.engine import Engine
from ..core.states import State
from .attempts import Attempts
from .hooks import Hooks
from .report import BatchReport
from .scheduler import Scheduler

log = logging.getLogger("handoffd")
STALL_SAMPLE = 64  # pending documents the watchdog reads to decide whether work is due


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
        except Exception:  # the watchdog itself must not take the loop down
            log.exception("progress check failed; will check again")
            return
        if stuck is None:
            self.next_progress_check = now + self.stall_seconds
            return
        self.reset(f"handoff {stuck} is due and a slot is free, but nothing was "
                   f"dispatched for {now - self.scheduler.last_dispatch:.1f}s")

    def due_with_free_slot(self) -> str | None:
        """A pending id that could be dispatched right now, judged from the files and the tasks
        actually in flight (not from the scheduling bookkeeping); None when there is none."""
        scheduler, engine = self.scheduler, self.engine
        with scheduler.cv:
            real = Counter(agent for agent, _ in scheduler.inflight.values())
            mine = set(self.attempts.active)
            doubtful = set(scheduler.waiting) | set(scheduler.unroutable)
            now = time.monotonic()  # (held off for a passing reason: a claim short of
            # descriptors is put back as it came, no due_at in its document; not a stall)
            mine.update(hid for hid, floor in scheduler.not_before.items() if floor > now)
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
