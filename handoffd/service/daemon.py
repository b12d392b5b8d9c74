"""The daemon: schedule due handoffs, run them on a worker pool, keep leases alive, sweep.

One dispatcher loop (level-triggered: "while something is due, claim it") fed by the backend's wake-up hints,
a start-up scan, periodic rescans, and its own wake-ups. Workers are threads; command handlers
are child processes. The loop never dies of a handoff's fault: every error is filed or logged.

The rooms: this module holds :class:`Daemon` (the plugin API, serving and batches, the main
loop, stopping); :mod:`.scheduler` the scheduling books (queues, slots, gate waits,
deadlines; :mod:`.lines` parking and rate limits, :mod:`.quiet` waits that only their own
document's change ends); :mod:`.dispatch` the rules for a due handoff and the workers' chaining;
:mod:`.attempts` running an attempt and what its outcome or failure does; :mod:`.batchend` when
a batch process may end (the others of its batch: :mod:`.board`); :mod:`.progress` the
stall watchdog; :mod:`.wakeups` the backend's wake-up hints; :mod:`.hooks` what features
registered; :mod:`.warmup` what serving loads first; :mod:`.report` the run's counts.
"""
from __future__ import annotations

import logging
import math
import signal
import time
from typing import Any, Callable, Collection

from ..core import recurring
from ..core.documents import last_events, throttles_in_a_row
from ..core.engine import Engine, Job
from ..core.procs import STOP_SIGNALS
from ..core.runner import cancel
from ..core.specialists import Specialist
from ..core.states import TERMINAL, State
from ..core.storage import Wakeup
from . import allocator
from .attempts import Attempts
from .batchend import BatchEnd, Siblings
from .daemon_records import ServingRecord
from .dispatch import Dispatcher
from .hooks import Hooks, MessageHandler
from .leases import LeaseKeeper
from .progress import ProgressWatch
from .report import RECOVERED_IDS_KEPT, BatchReport
from .scheduler import SPIN_UP_SECONDS, Scheduler
from .sweeper import ConfigWatch, SweepReport, sweep
from .wakeups import WakeupFeed
from .warmup import WARM_SCHEMAS, build_schemas, warm_up, warm_up_to_fork
from .workers import WorkerPool

# what callers import from here, wherever it lives now
__all__ = ["BatchReport", "Daemon", "SPIN_UP_SECONDS", "WARM_SCHEMAS", "build_schemas",
           "warm_up", "warm_up_to_fork"]

log = logging.getLogger("handoffd")
# the ids of taken-over claims a run's report keeps, to say which are still pending as it ends
LISTING = "listing pending/"  # (the listing's kind of problem: core.recurring)
IDLE_WAKE_SECONDS = 10.0  # the main loop looks around at least this often with nothing to do
# a serving daemon that falls idle gives the heap pages its handoffs freed back to the system
# (malloc_trim: a few ms), at most this often
IDLE_TRIM_SECONDS = 1.0


class Daemon(BatchEnd):
    """Serves one workspace. ``serve()`` until stopped, or ``run_batch()`` once.

    Its collaborators, built here and sharing the scheduler's condition variable ``cv``:
    ``scheduler`` (the books), ``dispatcher`` (due handoff -> worker), ``attempts`` (the running
    jobs and their outcomes), ``progress`` (the stall watchdog), ``feed`` (wake-up hints),
    ``hooks`` (features' registrations), ``leases`` (renewal and fencing) and ``pool`` (the
    worker threads).
    """

    def __init__(self, engine: Engine, *, workers: int | None = None, watch: bool = True,
                 stall_seconds: float | None = None, stripe: tuple[int, int] = (0, 1)) -> None:
        self.engine = engine
        # (index, count) when this is one of ``count`` processes of one batch (service.spread):
        # each starts on its own stretch of the pending list instead of all racing for the head
        self.stripe = stripe
        # the listing's failures (a shortage at every rescan was an ERROR each time)
        self._listing = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
        self._listing_clock: Callable[[], float] = time.monotonic  # (tests move it)
        # where this run begins among the problems the books hold back (core.recurring): a
        # batch's end says those it met and still holds (its last word was their first line)
        self._problems_since = recurring.mark()
        self.settings = engine.settings
        self.workers = workers or self.settings.workers
        self.hard_stop = False
        self._store_bounded = False  # the store's retries bounded by the batch's deadline
        self._stop_began: float | None = None  # (monotonic) the first stop asked
        # a sweep already made for this run (see _start_sweep), and when the run began if that
        # was before run_batch (spread: a batch's --max-seconds counts from the process's start)
        self.first_sweep: SweepReport | None = None
        self.started: float | None = None
        # set by spread's parent: its stop files what late Python handlers kept only once its
        # children have ended (:meth:`release_held`), or they would claim the retry beside them
        self.defer_held = False
        self._late_since: float | None = None  # (a batch waiting for late handlers: since when)
        # the other processes of this batch (set by spread); whether this one waits for them
        self.siblings: Siblings | None = None
        self._idle = False
        self.report = BatchReport()
        self.hooks = Hooks()
        self.scheduler = Scheduler(engine, self.report, workers=self.workers)
        self.cv = self.scheduler.cv
        self.attempts = Attempts(engine, self.scheduler, self.report)
        self.pool = WorkerPool(keep=self.workers)
        self.dispatcher = Dispatcher(engine, self.scheduler, self.attempts, self.hooks, self.pool)
        self.progress = ProgressWatch(
            engine, self.scheduler, self.attempts, self.hooks, self.report,
            stall_seconds=float(stall_seconds if stall_seconds is not None
                                else self.settings.stall_seconds))
        self.leases = LeaseKeeper(engine, lambda: list(self.attempts.active.values()), self._fence)
        self.feed = WakeupFeed(engine, self.scheduler, self.hooks, watch=watch)
        self.on_filed: Callable[[str, State], None] | None = None
        # serving reads handoffd.toml once: its sweeps say when it changed (the first process
        # of a spread one alone: one line a change)
        self.config_watch = ConfigWatch(engine.ws.config_path) if stripe[0] == 0 else None
        # its record for `handoff ls` while it serves, renewed by the main loop
        self.serving_record: ServingRecord | None = None
        engine.on_filed.append(self._count)
        for plugin in engine.daemon_plugins:  # features register through the methods below
            plugin(self)

    # ------------------------------------------------------------ what others read
    @property
    def running(self) -> int:
        """Tasks in flight on the worker pool."""
        return self.scheduler.running

    @property
    def active(self) -> dict[str, Job]:
        """Handoff id -> the job this daemon runs for it."""
        return self.attempts.active

    @property
    def stopping(self) -> bool:
        """True once a stop was asked for: nothing more is claimed."""
        return self.scheduler.stopping

    @property
    def batch_deadline(self) -> float:
        """``run_batch(max_seconds=)``'s end (monotonic; infinite without one)."""
        return self.scheduler.batch_deadline

    @property
    def stop_hooks(self) -> list[Callable[[], None]]:
        """What features asked to have called when this daemon stops."""
        return self.hooks.stop_hooks

    # ------------------------------------------------------------ plugin API
    def add_scan_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at every scan of pending/ (it must not raise; it is logged if it does)."""
        self.hooks.scan_hooks.append(hook)

    def add_message_handler(self, predicate: Callable[[dict[str, Any] | None], bool],
                            handler: MessageHandler) -> None:
        """A pending document for which ``predicate(doc)`` is true is not routed to a specialist:
        ``handler(engine, id)`` claims and files it (e.g. a cancellation message)."""
        self.hooks.message_handlers.append((predicate, handler))

    def add_filed_hook(self, hook: Callable[[str, State], None]) -> None:
        """Call ``hook(id, where)`` whenever this daemon's engine files a handoff."""
        self.hooks.filed_hooks.append(hook)

    def add_parked_check(self, check: Callable[[str], bool]) -> None:
        """``check(id)`` true: a handoff filed back to pending/ waits by design (not a retry)."""
        self.hooks.parked_checks.append(check)

    def add_wakeup_hook(self, hook: Callable[[Wakeup], None], *,
                        kinds: Collection[str] | None = None) -> None:
        """Call ``hook(wakeup)`` for hints of the backend's wake-up feed while this daemon runs
        (e.g. a new cancel request); on any thread, so it must be quick and not raise.
        ``kinds``: the hints it needs (None: every kind). A batch subscribes to just those."""
        hooks = self.hooks
        hooks.wakeup_hooks.append(hook)
        hooks.wakeup_kinds = None if kinds is None or hooks.wakeup_kinds is None \
            else hooks.wakeup_kinds | set(kinds)

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once when this daemon stops (serve or batch), after its work is filed
        or handed back: e.g. to deliver what is still queued. It must bound its own time."""
        self.hooks.stop_hooks.append(hook)

    def limit(self, spec: Specialist) -> int:
        """How many handoffs of ``spec`` this daemon runs at once: its ``concurrency``, else as
        many as there are workers (children of one fan-out run side by side, as seed 000 has it)."""
        return self.scheduler.limit(spec)

    def limits(self) -> str:
        """The effective limits, for the start-up line: ``@a 2, @b 4``."""
        return ", ".join(f"{spec.agent} {self.limit(spec)}"
                         for _, spec in sorted(self.engine.registry.specialists.items()))

    def running_job(self, handoff_id: str) -> Job | None:
        """The job this daemon is running for ``handoff_id``, if any."""
        return self.attempts.active.get(handoff_id)

    def queue(self, handoff_id: str) -> None:
        """Look at a pending handoff again now, even if a gate held it back."""
        with self.cv:
            self.scheduler.unhold(handoff_id)  # (all of its wait: what may end it too)
            self.scheduler.notify(handoff_id)

    def notify(self, handoff_id: str, delay: float = 0.0) -> None:
        """Hint that ``handoff_id`` may be due in ``delay`` seconds (watchdog, scans, retries)."""
        self.scheduler.notify(handoff_id, delay)

    def request_rescan(self) -> None:
        """Ask the loop to list pending/ again (events may have been lost)."""
        self.scheduler.request_rescan()

    # ------------------------------------------------------------ looking at pending/
    def scan(self, *, recheck_waiting: bool = True) -> int:
        """List pending/ once and queue everything not already known; returns the count found,
        or -1 when pending/ could not be listed. Waiting handoffs are re-checked too unless
        ``recheck_waiting`` is False (batch mode re-checks them only when something is filed).
        Parked ids that are no longer pending (filed or removed by someone else) are dropped
        from parking."""
        self.hooks.scanning()  # e.g. cancel requests: stop our handlers, queue pending
        try:
            ids = self.engine.backend.ids(State.PENDING)
        except (OSError, MemoryError) as exc:  # e.g. EIO, EMFILE: the next rescan tries
            # again; said once, then at most once a minute while it lasts (a WARNING naming
            # the limit for a shortage: core.recurring), not at every rescan (a MemoryError
            # once ended the main loop)
            with recurring.sweeping(self._listing, self._listing_clock):
                recurring.error(LISTING, exc, "cannot list the pending handoffs: %s; will "
                                "rescan", exc)
            return -1
        if self._listing.active:  # (a failure said before: one line says it cleared)
            with recurring.sweeping(self._listing, self._listing_clock):
                recurring.ok(LISTING)
        index, count = self.stripe
        if count > 1:  # queued in this order: start at this process's share of the list
            cut = index * len(ids) // count
            ids = ids[cut:] + ids[:cut]
        self.scheduler.listed(ids, self.attempts.active, recheck_waiting=recheck_waiting)
        return len(ids)

    def _count(self, handoff_id: str, where: State) -> None:
        """Engine listener: count every filing (including rejections at admission) and wake
        whatever it may unblock."""
        self.hooks.filed(handoff_id, where)  # e.g. drop a finished handoff's cancel request
        report = self.report
        with self.cv:
            if self.siblings is not None:  # (another process's waiters may wait for it)
                self.siblings.filed(handoff_id, where)
            if where is State.COMPLETED:
                report.completed += 1
            elif where is State.FAILED:
                report.failed += 1
            elif where is State.PENDING:
                if not self.hooks.parked(handoff_id):  # a retry, or a throttle
                    if self._throttled(handoff_id):  # not attempted: no retry to count
                        report.throttled += 1
                    elif not self._recovery(handoff_id):  # (a recovery's: counted as
                        report.retrying += 1  # recovered, by the sweep that made it)
                    self.scheduler.notify(handoff_id)  # dispatch reads its next_attempt_at
                else:  # its gate holds it (e.g. for its children) before they run: their
                    self.scheduler.look_first(handoff_id)  # filings wake it then
                self.scheduler.wake(handoff_id)  # its attempt ended: what it held is free
            if where in TERMINAL:
                self.attempts.unexpected_in_a_row.pop(handoff_id, None)
                self.scheduler.ended(handoff_id, failed=where is State.FAILED)
        if self.on_filed:
            self.on_filed(handoff_id, where)

    def _throttled(self, handoff_id: str) -> bool:
        """True when the requeue just announced for ``handoff_id`` is a throttle (seed 000's
        THROTTLED: its specialist was too busy to start, no attempt was made), not a retry."""
        just = self.engine.hooks.just_filed(handoff_id)
        return just is not None and throttles_in_a_row(just[1]) > 0

    def _recovery(self, handoff_id: str) -> bool:
        """True when the retry just announced for ``handoff_id`` is a sweep's recovery of an
        abandoned claim (its history ends ``recovered``, ``retry_scheduled``), counted in
        ``report.recovered``. Counted as a retry, a batch that took a dead claimer's claim over
        and completed it said ``completed 1, ... retry scheduled 1``: a retry still to come."""
        just = self.engine.hooks.just_filed(handoff_id)
        return just is not None and last_events(just[1], 2) == ["recovered", "retry_scheduled"]

    # ------------------------------------------------------------ housekeeping
    def renew_leases(self) -> None:
        """Extend the lease of every job this process is running (the lease keeper's thread
        does so every lease_seconds / 3; a job whose claim is gone is fenced)."""
        self.leases.renew_all()

    def _fence(self, job: Job, reason: str) -> None:
        """The lease keeper's fence: stop ``job``'s handler now (its lease is lapsing, or gone:
        another process may run the handoff). The attempt ends as a retryable failure, counted:
        handed back uncounted, a daemon too busy to renew its leases in time fenced the same
        handoffs again and again, for ever (fourth session's crash hunt)."""
        cancel(job.context, reason)

    def sweep(self) -> SweepReport:
        """Recover abandoned claims (skipping our own) and queue what came back; say when
        handoffd.toml changed since the start (:class:`.sweeper.ConfigWatch`)."""
        if self.config_watch is not None:
            self.config_watch.check()
        try:
            report = sweep(self.engine, skip=set(self.attempts.active))
        except OSError as exc:
            log.error("sweep failed: %s; will try again", exc)
            return SweepReport()
        except Exception:  # a repair bug must not stop the daemon; the next sweep tries again
            log.exception("sweep failed; will try again")
            return SweepReport()
        self.report.set_aside += len(report.set_aside)
        self.report.recovered += len(report.recovered)
        # (which of them are still pending at the end: report.settle_recovered; bounded, as a
        # serve's life may see any number of takeovers)
        room = RECOVERED_IDS_KEPT - len(self.report.recovered_ids)
        self.report.recovered_ids.extend(report.recovered[:max(room, 0)])
        if report.recovered:
            log.warning("recovered %d abandoned handoff(s): %s", len(report.recovered),
                        ", ".join(report.recovered[:10]))
            for handoff_id in report.recovered:
                self.scheduler.notify(handoff_id)
        return report

    # ------------------------------------------------------------ running
    def _start_sweep(self) -> SweepReport:
        """The sweep a run starts with: :attr:`first_sweep` when one was made before (by
        :func:`.spread.spread`, before the other processes start), else one now."""
        done, self.first_sweep = self.first_sweep, None
        return done if done is not None else self.sweep()

    def serve(self, *, install_signals: bool = True, ready: Callable[[], None] | None = None,
              early: list[int] | None = None) -> int:
        """Run until SIGTERM/SIGINT (or :meth:`stop`); returns the exit code: 0, or 1 when the
        main loop died of an unexpected error (logged with its traceback; in-flight work is
        handed back) so that a supervisor restarts the daemon. ``early``: stop signals that
        came before its handlers (:meth:`take_signals`)."""
        self.engine.ws.ensure()
        self.engine.backend.prepare()  # e.g. an unusable seal key: one line now, not per handoff
        # who serves, with which handoffd.toml: `handoff ls` says when the file changed since
        # (the first process of a spread one alone, as for the log's warning)
        record = (ServingRecord(self.engine.ws, self.config_watch.started)
                  if self.config_watch is not None else None)
        if record is not None:
            record.write()
            self.serving_record = record
        try:
            if install_signals:
                self.take_signals(early)
            self.report.sweep = self._start_sweep()
            if not self.stopping:  # a stop during the start-up sweep: it ends as any stop
                warm_up(self.engine.schemas)
            self.feed.subscribe()
            if ready and not self.stopping:  # ("serving" after a stop was a claim it never kept)
                ready()
            self._guarded_loop(batch=False)
        finally:
            self.serving_record = None
            if record is not None:
                record.remove()
        return 1 if self.report.error else 0

    def run_batch(self, *, install_signals: bool = False, max_seconds: float | None = None,
                  early: list[int] | None = None) -> BatchReport:
        """One batch for cron: sweep, process everything due now, wait for it, return counts
        (``report.error`` is set when the main loop died).

        With ``install_signals``, SIGTERM/SIGINT stop it as they stop :meth:`serve` (no new
        claims, running work gets ``grace_seconds``, a second signal hands it back at once), so
        cron's ``timeout`` never leaves a claim behind with its specialist still running. After
        ``max_seconds`` it stops claiming and hands back what still runs, to end on time.
        ``early``: stop signals that came before its handlers (:meth:`take_signals`)."""
        self.engine.ws.ensure()
        self.engine.backend.prepare()
        self.dispatcher.batch = True
        if install_signals:
            self.take_signals(early)
        if max_seconds is not None:
            began = self.started if self.started is not None else time.monotonic()
            self.scheduler.batch_deadline = began + max_seconds
        if self.first_sweep is None:  # (one made ahead, by spread, is this batch's: its
            # mark, taken as this daemon was built, stands) a batch says only what it met: a
            # second one of this daemon repeated the first one's problems at its end
            self._problems_since = recurring.mark()
        self._bound_store()  # (its first sweep too)
        self.report.sweep = self._start_sweep()
        self.feed.subscribe()
        self._guarded_loop(batch=True)
        return self.report

    def _bound_store(self) -> None:
        """A batch with ``--max-seconds``: a store that is away (PostgreSQL down) makes none of
        its operations retry past the batch's end (:meth:`stop`'s ``interrupt``, set ahead).
        Each operation retried a lost connection for a whole ``reconnect_seconds`` window of its
        own, one after the other, on every thread: the main loop, stuck in them, never reached
        its deadline (483 s for a batch of ``--max-seconds 10``). What it holds claimed stays
        in-progress, recovered as a dead claimer's: a hand-back that cannot reach the store
        gives up as at any stop."""
        deadline = self.scheduler.batch_deadline
        interrupt = getattr(self.engine.backend, "interrupt", None)
        if math.isfinite(deadline) and callable(interrupt):
            interrupt(max(deadline - time.monotonic(), 0.0))
            self._store_bounded = True

    def _guarded_loop(self, *, batch: bool) -> None:
        resume = getattr(self.engine.backend, "resume", None)
        if callable(resume) and not self.stopping:  # an earlier daemon's stop cut them short
            resume()  # (not this one's: a stop that came during its start keeps them short)
            self._bound_store()  # (resume lifted the batch's bound too)
        self.leases.start()  # renewals and the fence run until the last job has ended
        try:
            self._loop(batch=batch)
            if self.takeovers_left_due:  # (its end waited for claims it could not take)
                self.say_takeovers_left()
        except Exception as exc:  # a scheduler bug: log it, hand work back, exit non-zero
            self.report.error = f"{type(exc).__name__}: {exc}"
            log.critical("main loop died: %s; handing back in-flight work and exiting",
                         self.report.error, exc_info=True)
            self.stop(hard=True)
        finally:
            if self.siblings is not None:  # the others of the batch wait for it no more
                self.siblings.idle()
            self._shutdown()
            self.attempts.settle_handed_back()  # (what another took since is no hand-back)
            # what it still holds back is said once as it ends: a batch's end, or a serve's stop
            recurring.batch_end(self._problems_since,
                                recurring.BATCH_END if batch else recurring.SERVE_END)

    def _loop(self, *, batch: bool) -> None:
        scheduler = self.scheduler
        next_rescan = next_sweep = time.monotonic()
        trimmed = -math.inf  # when the heap was last trimmed
        while True:
            now = time.monotonic()
            if self.siblings is not None and not self._idle:
                self.siblings.busy()  # (its beat: the others of the batch wait for its filings)
            if self.serving_record is not None:  # (every RENEW_SECONDS: other hosts see it live)
                self.serving_record.renew()
            if not batch and now >= next_sweep and not scheduler.stopping:
                self.sweep()
                allocator.trim()  # what the handoffs since the last sweep freed goes back
                trimmed = time.monotonic()
                next_sweep = now + self.settings.sweep_seconds
            elif not batch and self._idle_after_work(trimmed, now):
                allocator.trim()  # a burst is over: what it freed goes back, not at the sweep
                trimmed = time.monotonic()
            elif batch and self.takeover_sweep_due and not scheduler.stopping:
                self.takeover_sweep_due = False  # (its end waited for claims to take over)
                self.sweep()
            if now >= scheduler.batch_deadline and not scheduler.stopping:
                log.warning("--max-seconds reached: handing back %d running handoff(s)",
                            scheduler.running)
                self.stop(hard=True)
                # claims watched for a whole grace and still not taken over (a row another
                # database session holds locked) are said as it ends, as at its takeover wait's
                # own bound: ended by --max-seconds, the batch said nothing of them
                self.takeovers_left_due = True
            if not scheduler.stopping:
                self.progress.check(now)
            if (scheduler.rescan_requested or (not batch and now >= next_rescan)) \
                    and not scheduler.stopping:
                scheduler.rescan_requested = False
                self.scan()
                next_rescan = now + self.settings.rescan_seconds
            with self.cv:
                if scheduler.stopping:
                    return
                if self.siblings is not None:
                    self._hear_siblings()
                scheduler.release_parked()
                now, spin_up_at = time.monotonic(), scheduler.spin_up_at()
                # as many answers as workers wait for a disk that refuses them: nothing new
                # starts (each would end kept too) until one is filed (that wakes this loop)
                saturated = self.attempts.saturated()
                free = scheduler.running < self.workers and not saturated
                ready = scheduler.next_ready(now) if free and now >= spin_up_at else None
                if not free and not saturated:  # (seed 000: answered at a hard deadline)
                    for handoff_id, deadline in scheduler.look_ahead(now):
                        self.dispatcher.answer_overdue(handoff_id, deadline)
                if ready is not None:
                    self._late_since = None  # (work goes on: a later wait counts afresh)
                    self._unlisted_since = None  # (a later failure to list: its own 5 s)
                    self._idle = False
                    self.dispatcher.dispatch_safely(*ready)
                    continue
                late_until = -math.inf
                if batch and scheduler.running == 0 and (saturated or not scheduler.due_soon()):
                    late_until = self._late_wait(now)
                    if late_until <= now:  # (saturated: what is due waits for the next run)
                        ends = None if saturated else self._batch_end(now)
                        if ends is None and not saturated:  # claims it watches to take over
                            ends = self._takeover_wait(now)
                        if ends is None:
                            return
                        if ends <= now:
                            continue
                        late_until = ends  # (it waits for the other processes of its batch)
                idle = now + IDLE_WAKE_SECONDS
                timers = [idle, next_rescan if not batch else idle, scheduler.batch_deadline]
                if late_until > now:
                    timers.append(late_until)
                if not batch:
                    timers.append(next_sweep)
                    if free:
                        timers.append(self.progress.wake_at())
                if (scheduler.heap or scheduler.behind or scheduler.ready or scheduler.rechecks) \
                        and free:
                    timers.append(max(scheduler.first_due(now), spin_up_at))
                elif not free and not saturated and (ahead := scheduler.ahead_at(now)) is not None:
                    timers.append(ahead)
                self.cv.wait(max(min(timers) - time.monotonic(), 0.0))

    def _late_wait(self, now: float) -> float:
        """A batch with nothing running or due: until when it waits for the Python handlers
        still running past attempts whose outcome is held (work under way: when one returns,
        its retry runs in this batch), and for claims kept for a hand-back that ran short
        (:mod:`.shortclaims`: once back in pending/, run in this batch). At most
        ``grace_seconds``, what a stop gives running work: a handler that never returns must
        not hold a cron batch for ever; the batch's stop then files what they kept. ``now``
        or earlier: none is held, it may end."""
        if not self.attempts.active and not self.attempts.kept_claims:
            self._late_since = None
            return now
        if self._late_since is None:
            self._late_since = now
        return self._late_since + self.settings.grace_seconds

    def _idle_after_work(self, trimmed: float, now: float) -> bool:
        """Nothing runs or waits to run, something was dispatched since the heap was last
        trimmed, and that was at least IDLE_TRIM_SECONDS ago."""
        scheduler = self.scheduler
        return (scheduler.running == 0 and not scheduler.ready
                and scheduler.last_dispatch > trimmed and now - trimmed >= IDLE_TRIM_SECONDS)

    def take_signals(self, early: list[int] | None = None) -> None:
        """SIGTERM, SIGINT and SIGHUP stop this daemon from now on (a second one hands back at
        once), and each signal in ``early`` (those that came while the process started, held
        by :func:`handoffd.cli.daemon_commands.hold_stop_signals`) acts now, in order, and is
        taken out: a stop asked for before the daemon could hear it claims nothing and ends
        with 0, as any first stop (it killed the process, exit -15, 7 of 113 restarts)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        while early:  # (what came before: the handlers above hear what comes now)
            self._on_signal(early.pop(0), None)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop(hard=self.scheduler.stopping)

    def stop(self, *, hard: bool = False) -> None:
        """First call: stop claiming, let work finish for ``grace_seconds``. Second (or
        ``hard``): hand running work back to pending/ now."""
        with self.cv:
            self.hard_stop = self.hard_stop or hard
            self.scheduler.stopping = True
            if self._stop_began is None:
                self._stop_began = time.monotonic()
            self.cv.notify_all()
        # a store that is away (PostgreSQL down) must not hold the stop past its grace: its
        # operations give up retrying then (the lock it takes is re-entrant: signal-safe)
        interrupt = getattr(self.engine.backend, "interrupt", None)
        if callable(interrupt):
            resume = getattr(self.engine.backend, "resume", None)
            if self._store_bounded and not self.hard_stop and callable(resume):
                # a graceful stop gives running work its grace, past the batch's bound: bound
                # to it, a filing after it that met a dead pooled connection gave up at once
                # (R59: the result lost, the handler run again, an attempt charged)
                self._store_bounded = False
                resume()
            interrupt(0.0 if self.hard_stop else self.settings.grace_seconds)
        if hard:
            self.attempts.hand_back_all()

    def _shutdown(self) -> None:
        self.feed.unsubscribe()
        scheduler = self.scheduler
        # the grace counts from the stop, not from when the main loop got out (of a store
        # operation retried through an outage, itself bounded by the grace: R63 measured a
        # stop that took two graces)
        began = self._stop_began if self._stop_began is not None else time.monotonic()
        deadline = began + self.settings.grace_seconds
        with self.cv:
            while scheduler.running and time.monotonic() < deadline and not self.hard_stop:
                self.cv.wait(max(deadline - time.monotonic(), 0.0))
        if scheduler.running:
            self.attempts.hand_back_all()
        with self.cv:  # every task ends: handed back, or ended by _taken_over if its handler hangs
            while scheduler.running:
                self.cv.wait(1.0)
        self.pool.shutdown()
        if not self.defer_held:
            self.release_held()

    def release_held(self) -> None:
        """The last of a stop, its claims still renewed until then: file what attempts whose
        Python handler still runs kept (their retry would start beside that handler: the
        nearer the process's end, the better), wait for those a handler that returned is
        filing, then stop renewing leases. Claims kept for a hand-back that ran short are
        handed back first (:meth:`.shortclaims.KeptClaims.release_all`)."""
        self.report.errors += self.attempts.kept_claims.release_all()
        self.attempts.file_all_held()
        self.leases.stop()
        if self._count in self.engine.on_filed:
            self.engine.on_filed.remove(self._count)
        self.hooks.stopped()  # (after the last filings: the metrics and notices count them)
