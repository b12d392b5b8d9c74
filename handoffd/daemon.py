"""The daemon: schedule due handoffs, run them on a worker pool, keep leases alive, sweep.

One dispatcher loop (level-triggered: "while something is due, claim it") fed by watchdog hints,
a start-up scan, periodic rescans, and its own wake-ups. Workers are threads; command handlers
are child processes. The loop never dies of a handoff's fault: every error is filed or logged.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from . import cancellation, orchestration
from .errors import DocumentNotReady, HandoffdError
from .lifecycle import Engine, Job, Peek
from .runner import cancel
from .states import State
from .sweeper import SweepReport, sweep
from .watcher import PendingWatcher

log = logging.getLogger("handoffd")
READY_WINDOW = 64  # due handoffs read ahead to order by priority


@dataclass
class BatchReport:
    """Counts of what a run (batch or serve) filed, for the summary line and exit code."""

    completed: int = 0
    failed: int = 0
    retrying: int = 0
    handed_back: int = 0
    unroutable: set[str] = field(default_factory=set)
    waiting: dict[str, str] = field(default_factory=dict)
    sweep: SweepReport | None = None

    def line(self) -> str:
        text = (f"completed {self.completed}, failed {self.failed}, retry scheduled "
                f"{self.retrying}")
        if self.handed_back:
            text += f", handed back {self.handed_back}"
        if self.unroutable:
            text += f", left pending with no specialist {len(self.unroutable)}"
        if self.waiting:
            text += f", waiting {len(self.waiting)}"
        return text


class Daemon:
    """Serves one workspace. ``serve()`` until stopped, or ``run_batch()`` once."""

    def __init__(self, engine: Engine, *, workers: int | None = None, watch: bool = True) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.workers = workers or self.settings.workers
        self.watch = watch
        self.cv = threading.Condition()
        self.heap: list[tuple[float, int, int, str]] = []  # (due, _, seq, id): when to look
        self.ready: list[tuple[int, float, int, str, Peek]] = []  # (priority, due, seq, id, peek)
        self.readied: set[str] = set()
        self.queued: dict[str, float] = {}
        self.seq = itertools.count()
        self.parked: dict[str, list[str]] = {}
        self.parked_ids: set[str] = set()
        self.busy: dict[str, int] = {}
        self.active: dict[str, Job] = {}
        self.running = 0
        self.stopping = False
        self.hard_stop = False
        self.report = BatchReport()
        self.waiting = self.report.waiting  # handoff id -> why a gate holds it back
        engine.on_filed.append(self._count)
        self.rescan_requested = True
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="handoffd-worker")
        self.watcher: PendingWatcher | None = None
        self.on_filed: Callable[[str, State], None] | None = None

    # ------------------------------------------------------------ queue
    def notify(self, handoff_id: str, delay: float = 0.0) -> None:
        """Hint that ``handoff_id`` may be due in ``delay`` seconds (watchdog, scans, retries)."""
        due = time.monotonic() + delay
        with self.cv:
            if handoff_id in self.readied and delay == 0:
                return  # already read and waiting its turn in the ready window
            current = self.queued.get(handoff_id)
            if current is not None and current <= due:
                return
            self.queued[handoff_id] = due
            heapq.heappush(self.heap, (due, 2, next(self.seq), handoff_id))
            self.cv.notify()

    def request_rescan(self) -> None:
        """Ask the loop to list pending/ again (events may have been lost)."""
        with self.cv:
            self.rescan_requested = True
            self.cv.notify()

    def scan(self, *, recheck_waiting: bool = True) -> int:
        """List pending/ once and queue everything not already known; returns the count found.
        Waiting handoffs are re-checked too unless ``recheck_waiting`` is False (batch mode
        re-checks them only when something is filed)."""
        cancellation.poll(self)  # cancel requests (.meta/cancel/): stop our handlers, queue pending
        ids = self.engine.store.ids(State.PENDING)
        for handoff_id in ids:
            if handoff_id in self.active or handoff_id in self.queued or handoff_id in self.readied \
                    or handoff_id in self.parked_ids or handoff_id in self.report.unroutable \
                    or (not recheck_waiting and handoff_id in self.waiting):
                continue
            self.notify(handoff_id)
        return len(ids)

    def _next_ready(self, now: float) -> tuple[str, Peek | None] | None:
        """The most urgent due handoff. Due ids move from the time heap into a bounded ready
        window (read once each to learn their priority); the window hands out the lowest
        (priority, due time) first, so a critical handoff overtakes a backlog of low ones."""
        while self.heap and self.heap[0][0] <= now and len(self.ready) < READY_WINDOW:
            due, _, _, handoff_id = heapq.heappop(self.heap)
            if self.queued.get(handoff_id) != due:
                continue  # superseded by an earlier notification
            del self.queued[handoff_id]
            peek = self.engine.peek(handoff_id)
            if peek is None:
                continue  # gone: claimed elsewhere, or filed
            rank = peek.priority if peek.readable else -1  # set unreadable files aside first
            heapq.heappush(self.ready, (rank, due, next(self.seq), handoff_id, peek))
            self.readied.add(handoff_id)
        if not self.ready:
            return None
        _, _, _, handoff_id, peek = heapq.heappop(self.ready)
        self.readied.discard(handoff_id)
        return handoff_id, peek

    # ------------------------------------------------------------ dispatch
    def _dispatch(self, handoff_id: str, peek: Peek | None) -> None:
        if peek is None:
            return
        if peek.readable:
            if cancellation.is_cancel_message(peek.doc):  # seed 000 CancellationPayload
                self.busy[""] = self.busy.get("", 0) + 1
                self.running += 1
                self.pool.submit(self._aside, handoff_id, "", cancellation.handle_message)
                return
            if peek.due_at is not None:
                wait = (peek.due_at - self.engine.clock()).total_seconds()
                if wait > 0:
                    self.notify(handoff_id, wait)
                    return
            spec = self.engine.registry.get(peek.target or "")
            if spec is None:
                if handoff_id not in self.report.unroutable:
                    log.warning("handoff %s waits in pending/: no specialist registered for %s",
                                handoff_id, peek.target)
                self.report.unroutable.add(handoff_id)
                return
            self.report.unroutable.discard(handoff_id)
            verdict = self.engine.gate(peek)
            if verdict is not None and verdict.action == "wait":
                self.waiting[handoff_id] = verdict.reason
                return
            self.waiting.pop(handoff_id, None)
            if verdict is not None:  # a gate said fail: file it without running the handler
                self.busy[spec.agent] = self.busy.get(spec.agent, 0) + 1
                self.running += 1
                self.pool.submit(self._reject, handoff_id, spec.agent, verdict.code, verdict.reason)
                return
            if self.busy.get(spec.agent, 0) >= spec.config.concurrency:
                self.parked.setdefault(spec.agent, []).append(handoff_id)
                self.parked_ids.add(handoff_id)
                return
            agent = spec.agent
        else:
            agent = ""  # unreadable: take() sets it aside
        self.busy[agent] = self.busy.get(agent, 0) + 1
        self.running += 1
        self.pool.submit(self._work, handoff_id, agent)

    def _work(self, handoff_id: str, agent: str) -> None:
        job: Job | None = None
        try:
            job = self.engine.take(handoff_id)
            if job is None:
                return
            with self.cv:
                self.active[handoff_id] = job
            log.info("%s -> in-progress (attempt %d, %s)", handoff_id, job.claim.attempt,
                     job.specialist.agent)
            if self.stopping:
                self.engine.handback(job.claim, job.dialect, reason="daemon stopping")
                self.report.handed_back += 1
                return
            outcome = self.engine.run(job)
            if job.context.extra.get("handback"):
                self.engine.handback(job.claim, job.dialect, reason="daemon stopping")
                self.report.handed_back += 1
                return
            self.engine.file(job.claim, job.dialect, job.specialist, outcome)  # counted by _count
        except DocumentNotReady:
            self.notify(handoff_id, self.settings.settle_seconds)
        except HandoffdError as exc:
            log.error("%s", exc)
            self.notify(handoff_id, 1.0)
        except OSError as exc:  # disk full, permissions: report, and try again later
            log.error("handoff %s: %s; will retry in 5s", handoff_id, exc)
            self.notify(handoff_id, 5.0)
        except Exception:  # a bug must not kill the worker or lose the handoff
            log.exception("handoff %s: unexpected error; it stays where it is for recovery", handoff_id)
        finally:
            with self.cv:
                self.active.pop(handoff_id, None)
                self.busy[agent] -= 1
                self.running -= 1
                waiting = self.parked.get(agent)
                if waiting:
                    released = waiting.pop(0)
                    self.parked_ids.discard(released)
                    self.notify(released)
                self.cv.notify_all()

    def _reject(self, handoff_id: str, agent: str, code: str, message: str) -> None:
        try:
            self.engine.reject(handoff_id, code, message)  # counted by _count
        except Exception:  # never lose the loop to one handoff; it stays pending
            log.exception("handoff %s: could not file gate failure", handoff_id)
        finally:
            with self.cv:
                self.busy[agent] -= 1
                self.running -= 1
                self.cv.notify_all()

    def _aside(self, handoff_id: str, agent: str, func: Callable[[Engine, str], State | None]) -> None:
        """File ``handoff_id`` with ``func`` instead of a specialist (cancellation messages)."""
        try:
            func(self.engine, handoff_id)  # counted by _count
        except Exception:  # never lose the loop to one handoff; it stays where it is
            log.exception("handoff %s: could not be handled", handoff_id)
        finally:
            with self.cv:
                self.busy[agent] -= 1
                self.running -= 1
                self.cv.notify_all()

    def _count(self, handoff_id: str, where: State) -> None:
        """Engine listener: count every filing (including rejections at admission) and wake
        whatever it may unblock."""
        if where.terminal:
            cancellation.clear_request(self.engine.ws, handoff_id)
        with self.cv:
            if where is State.COMPLETED:
                self.report.completed += 1
            elif where is State.FAILED:
                self.report.failed += 1
            elif where is State.PENDING:
                if not orchestration.is_parked(self.engine, handoff_id):  # not delegating/asking
                    self.report.retrying += 1
                self.notify(handoff_id)  # _dispatch reads its next_attempt_at
            if where.terminal:
                for waiter in list(self.waiting):  # a dependency may have been met
                    self.waiting.pop(waiter, None)
                    self.notify(waiter)
        if self.on_filed:
            self.on_filed(handoff_id, where)

    # ------------------------------------------------------------ housekeeping
    def renew_leases(self) -> None:
        """Extend the lease of every job this process is running."""
        for job in list(self.active.values()):
            try:
                if not self.engine.store.renew(job.claim, lease_seconds=self.settings.lease_seconds,
                                               now=self.engine.clock()):
                    log.warning("handoff %s: claim was recovered by another process; its "
                                "result will be discarded", job.handoff_id)
            except OSError as exc:
                log.error("handoff %s: cannot renew lease: %s", job.handoff_id, exc)

    def sweep(self) -> SweepReport:
        """Recover abandoned claims (skipping our own) and queue what came back."""
        try:
            report = sweep(self.engine, skip=set(self.active))
        except OSError as exc:
            log.error("sweep failed: %s; will try again", exc)
            return SweepReport()
        except Exception:  # a repair bug must not stop the daemon; the next sweep tries again
            log.exception("sweep failed; will try again")
            return SweepReport()
        if report.recovered:
            log.warning("recovered %d abandoned handoff(s): %s", len(report.recovered),
                        ", ".join(report.recovered[:10]))
            for handoff_id in report.recovered:
                self.notify(handoff_id)
        return report

    # ------------------------------------------------------------ running
    def serve(self, *, install_signals: bool = True, ready: Callable[[], None] | None = None) -> int:
        """Run until SIGTERM/SIGINT (or :meth:`stop`); returns the exit code (0)."""
        self.engine.ws.ensure()
        if install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self.report.sweep = self.sweep()
        if self.watch:
            self.watcher = PendingWatcher(self.engine.ws.state_dir(State.PENDING), self.notify,
                                          self.request_rescan)
            self.watcher.start()
        cancellation.watch(self)
        if ready:
            ready()
        try:
            self._loop(batch=False)
        finally:
            self._shutdown()
        return 0

    def run_batch(self) -> BatchReport:
        """One batch for cron: sweep, process everything due now, wait for it, return counts."""
        self.engine.ws.ensure()
        self.report.sweep = self.sweep()
        cancellation.watch(self)
        self._loop(batch=True)
        self._shutdown()
        return self.report

    def _loop(self, *, batch: bool) -> None:
        next_rescan = next_sweep = next_renew = time.monotonic()
        renew_every = max(self.settings.lease_seconds / 3, 0.5)
        while True:
            now = time.monotonic()
            if not batch and now >= next_sweep and not self.stopping:
                self.sweep()
                next_sweep = now + self.settings.sweep_seconds
            if now >= next_renew:
                self.renew_leases()
                next_renew = now + renew_every
            if self.watcher and not self.watcher.healthy() and not self.stopping:
                log.warning("file watcher died; restarting it and rescanning")
                self.watcher.start()
                self.rescan_requested = True
            if (self.rescan_requested or (not batch and now >= next_rescan)) and not self.stopping:
                self.rescan_requested = False
                self.scan()
                next_rescan = now + self.settings.rescan_seconds
            with self.cv:
                if self.stopping:
                    return
                ready = self._next_ready(time.monotonic()) if self.running < self.workers else None
                if ready is not None:
                    self._dispatch(*ready)
                    continue
                if batch and self.running == 0 and not self._due_soon():
                    if self.scan(recheck_waiting=False) == 0 or not self._due_soon():
                        return
                    continue
                timers = [next_renew, next_rescan if not batch else next_renew]
                if not batch:
                    timers.append(next_sweep)
                if self.heap and self.running < self.workers:
                    timers.append(self.heap[0][0])
                self.cv.wait(max(min(timers) - time.monotonic(), 0.0))

    def _due_soon(self) -> bool:
        """Batch mode: something queued that is due now (or within a settle window)."""
        limit = time.monotonic() + self.settings.settle_seconds + 0.05
        return bool(self.ready) or any(due <= limit for due in self.queued.values())

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop(hard=self.stopping)

    def stop(self, *, hard: bool = False) -> None:
        """First call: stop claiming, let work finish for ``grace_seconds``. Second (or
        ``hard``): hand running work back to pending/ now."""
        with self.cv:
            self.hard_stop = self.hard_stop or hard
            self.stopping = True
            self.cv.notify_all()
        if hard:
            self._hand_back_all()

    def _hand_back_all(self) -> None:
        for job in list(self.active.values()):
            job.context.extra["handback"] = True
            cancel(job.context, "daemon stopping")

    def _shutdown(self) -> None:
        if self.watcher:
            self.watcher.stop()
        cancellation.unwatch(self)
        deadline = time.monotonic() + self.settings.grace_seconds
        with self.cv:
            while self.running and time.monotonic() < deadline and not self.hard_stop:
                self.cv.wait(max(deadline - time.monotonic(), 0.0))
        if self.running:
            self._hand_back_all()
        self.pool.shutdown(wait=True)
        if self._count in self.engine.on_filed:
            self.engine.on_filed.remove(self._count)
