"""The daemon: schedule due handoffs, run them on a worker pool, keep leases alive, sweep.

One dispatcher loop (level-triggered: "while something is due, claim it") fed by the backend's wake-up hints,
a start-up scan, periodic rescans, and its own wake-ups. Workers are threads; command handlers
are child processes. The loop never dies of a handoff's fault: every error is filed or logged.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import signal
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Collection

from ..core.documents import Outcome
from ..core.engine import Engine, Job, Peek
from ..core.errors import DocumentNotReady, ErrorCode, HandoffdError
from ..core.runner import cancel
from ..core.specialists import Specialist
from ..core.states import State
from ..core.storage import LOST, Wakeup
from ..core.validation import SchemaCache
from ..core.watchdog import TakenOver
from . import allocator, handbacks
from .leases import LOST_LOCK_REASON, LeaseKeeper
from .sweeper import SweepReport, sweep
from .workers import WorkerPool

log = logging.getLogger("handoffd")
READY_WINDOW = 64  # due handoffs read ahead to order by priority
# built when a daemon starts serving (the native format's request and answers)
WARM_SCHEMAS = ("native.request.schema.json", "native.response.schema.json",
                "native.failure.schema.json")
CHAIN_LOOKS = 4  # due handoffs a finishing worker looks at for its next task (_chain)
# With durability "fast", another worker starts only once every running task is this old: a
# task about to finish chains to the next due handoff itself (_chain), and short handoffs drain
# fastest on one thread (2,000 no-op handoffs: 1 worker 516-552/s, 4 side by side 380-395/s,
# lost to the GIL's hand-overs and the folders' locks). Slow handlers still run side by side,
# this much later. With fsync, a handoff mostly waits for the disk, which overlaps: no delay.
SPIN_UP_SECONDS = 0.005
# the progress watchdog ([daemon] stall_seconds): due work, a free slot, and nothing dispatched
# for that long means the bookkeeping is wrong; it is logged loudly, reset and rebuilt
CREATED_DELAY = 0.05  # seconds before a document that may still be written is read
STALL_SAMPLE = 64  # pending documents the watchdog reads to decide whether work is due
# a task a worker runs: (pool token, function, handoff id, more arguments)
Task = tuple[int, Callable[..., Any], str, tuple[Any, ...]]
RETRY_LOOK_SECONDS = 5.0  # an item the scheduler could not handle is looked at again this late
LATE_LOOK_SECONDS = 1.0  # a handoff whose last Python handler still runs is looked at this late
UNEXPECTED_MAX_SECONDS = 60.0  # the longest back-off after unexpected errors about one handoff
MAX_TRACKED = 10_000  # handoffs whose unexpected errors are counted before the count starts over
IDLE_WAKE_SECONDS = 10.0  # the main loop looks around at least this often with nothing to do
# a serving daemon that falls idle gives the heap pages its handoffs freed back to the system
# (malloc_trim: a few ms), at most this often
IDLE_TRIM_SECONDS = 1.0


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
    error: str | None = None  # set when the main loop died (the exit code is then non-zero)
    stalls: int = 0  # times the progress watchdog had to reset the scheduler
    # forked processes of this run (service.spread) that ended without a report, or were
    # stopped for running too long past its end, and how
    lost: list[str] = field(default_factory=list)

    def needs_a_look(self) -> bool:
        """Something an operator should hear of even from a quiet cron batch."""
        return bool(self.failed or self.handed_back or self.error or self.stalls or self.lost)

    def line(self) -> str:
        """The one-line summary ``handoffd run`` and ``serve`` print."""
        text = (f"completed {self.completed}, failed {self.failed}, retry scheduled "
                f"{self.retrying}")
        if self.handed_back:
            text += f", handed back {self.handed_back}"
        if self.unroutable:
            text += f", left pending with no specialist {len(self.unroutable)}"
        if self.waiting:
            text += f", waiting {len(self.waiting)}"
        if self.lost:
            text += f"; {len(self.lost)} process(es) ended without a report or were stopped"
        if self.error:
            text += f"; main loop died: {self.error}"
        return text


class Daemon:
    """Serves one workspace. ``serve()`` until stopped, or ``run_batch()`` once.

    Scheduling bookkeeping, all guarded by ``cv``:

    * ``heap``/``queued``: when to look at an id next; ``ready``/``readied``: ids read and waiting
      for a worker, most urgent first.
    * ``parked[agent]``: an ordered, de-duplicated set of due ids waiting for one of the agent's
      concurrency slots (``parked_ids`` maps each back to its agent). On every loop iteration
      :meth:`_release_parked` lets out as many as the agent has free slots, minus releases still
      in flight (``released``/``releasing``); a released id leaves that set when it is dispatched
      again or turns out gone, so a release is never lost on a dead entry.
    * ``inflight``: one entry per task submitted to the pool (its agent, when it started: see
      :meth:`_spin_up_at`); ``busy`` and ``running``
      are counts of it, kept in step by :meth:`_submit` and :meth:`_finished` only.

    A watchdog (:meth:`_check_progress`) guards the whole: due work, a free slot and nothing
    dispatched for ``stall_seconds`` is logged as an error and the bookkeeping is rebuilt.
    """

    def __init__(self, engine: Engine, *, workers: int | None = None, watch: bool = True,
                 stall_seconds: float | None = None, stripe: tuple[int, int] = (0, 1)) -> None:
        self.engine = engine
        # (index, count) when this is one of ``count`` processes of one batch (service.spread):
        # each starts on its own stretch of the pending list instead of all racing for the head
        self.stripe = stripe
        self.settings = engine.settings
        self.workers = workers or self.settings.workers
        self.watch = watch
        self.stall_seconds = float(stall_seconds if stall_seconds is not None
                                   else self.settings.stall_seconds)
        self.cv = threading.Condition()
        self.heap: list[tuple[float, int, int, str]] = []  # (due, _, seq, id): when to look
        self.ready: list[tuple[int, float, int, str, Peek]] = []  # (priority, due, seq, id, peek)
        self.readied: set[str] = set()
        self.queued: dict[str, float] = {}
        self.seq = itertools.count()
        self.parked: dict[str, OrderedDict[str, None]] = {}  # agent -> ids waiting for a slot
        self.parked_ids: dict[str, str] = {}  # id -> agent, for every parked id
        self.released: dict[str, str] = {}  # id -> agent: let out of parking, not yet re-dispatched
        self.releasing: Counter[str] = Counter()  # agent -> len of its entries in released
        # pool task token -> (agent ("" for set-aside work), monotonic time it started)
        self.inflight: dict[int, tuple[str, float]] = {}
        self.spin_up = 0.0 if self.settings.durable else SPIN_UP_SECONDS
        self.busy: Counter[str] = Counter()  # agent -> tasks in flight (a count of inflight)
        self.active: dict[str, Job] = {}
        self.running = 0  # len(inflight)
        self.chained: list[Task] | None = None  # set while a worker picks its next task (_chain)
        self.stopping = False
        self.hard_stop = False
        self.batch_deadline = math.inf  # run_batch(max_seconds=): hand back and stop then
        self.batch = False  # run_batch: one pass for cron
        self.first_seen: dict[str, datetime] = {}  # hard-timeout handoffs seen pending, by id
        self.rate_until: dict[str, float] = {}  # agent -> monotonic time its next start is due
        self.unexpected: dict[str, int] = {}  # handoff id -> unexpected errors in a row
        # handoff id -> Python handlers still running past their ended attempts (timed out,
        # cancelled, fenced): a thread cannot be stopped, so no new attempt starts beside them
        self.late: Counter[str] = Counter()
        self.late_said: dict[str, int] = {}  # (said once per late handler)
        self.report = BatchReport()
        self.waiting = self.report.waiting  # handoff id -> why a gate holds it back
        # handoff id -> the ids whose filing may end its wait (absent: any filing may); a chain
        # of 1,000 dependents is then re-checked one handoff per filing, not 1,000
        self.waits_on: dict[str, frozenset[str]] = {}
        engine.on_filed.append(self._count)
        self.rescan_requested = True
        self.last_dispatch = time.monotonic()
        self.next_progress_check = self.last_dispatch + self.stall_seconds
        self.pool = WorkerPool(keep=self.workers)
        self.leases = LeaseKeeper(engine, lambda: list(self.active.values()), self._fence)
        self.slot = threading.local()  # a worker's current task token (``slot.token``)
        self.on_filed: Callable[[str, State], None] | None = None
        # the plugin API's registrations (features add to them through the add_* methods)
        self.scan_hooks: list[Callable[[], None]] = []
        self.message_handlers: list[tuple[Callable[[dict[str, Any] | None], bool],
                                          Callable[[Engine, str], State | None]]] = []
        self.filed_hooks: list[Callable[[str, State], None]] = []
        self.parked_checks: list[Callable[[str], bool]] = []
        self.wakeup_hooks: list[Callable[[Wakeup], None]] = []
        self.wakeup_kinds: set[str] | None = set()  # what the hooks need (None: everything)
        self.stop_hooks: list[Callable[[], None]] = []
        self._unsubscribe: Callable[[], None] | None = None
        for plugin in engine.daemon_plugins:  # features register through the methods below
            plugin(self)

    # ------------------------------------------------------------ plugin API
    def add_scan_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at every scan of pending/ (it must not raise; it is logged if it does)."""
        self.scan_hooks.append(hook)

    def add_message_handler(self, predicate: Callable[[dict[str, Any] | None], bool],
                            handler: Callable[[Engine, str], State | None]) -> None:
        """A pending document for which ``predicate(doc)`` is true is not routed to a specialist:
        ``handler(engine, id)`` claims and files it (e.g. a cancellation message)."""
        self.message_handlers.append((predicate, handler))

    def add_filed_hook(self, hook: Callable[[str, State], None]) -> None:
        """Call ``hook(id, where)`` whenever this daemon's engine files a handoff."""
        self.filed_hooks.append(hook)

    def add_parked_check(self, check: Callable[[str], bool]) -> None:
        """``check(id)`` true: a handoff filed back to pending/ waits by design (not a retry)."""
        self.parked_checks.append(check)

    def add_wakeup_hook(self, hook: Callable[[Wakeup], None], *,
                        kinds: Collection[str] | None = None) -> None:
        """Call ``hook(wakeup)`` for hints of the backend's wake-up feed while this daemon runs
        (e.g. a new cancel request); on any thread, so it must be quick and not raise.
        ``kinds``: the hints it needs (None: every kind). A batch subscribes to just those."""
        self.wakeup_hooks.append(hook)
        self.wakeup_kinds = None if kinds is None or self.wakeup_kinds is None \
            else self.wakeup_kinds | set(kinds)

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once when this daemon stops (serve or batch), after its work is filed
        or handed back: e.g. to deliver what is still queued. It must bound its own time."""
        self.stop_hooks.append(hook)

    def limit(self, spec: Specialist) -> int:
        """How many handoffs of ``spec`` this daemon runs at once: its ``concurrency``, else as
        many as there are workers (children of one fan-out run side by side, as seed 000 has it)."""
        return spec.config.concurrency or self.workers

    def limits(self) -> str:
        """The effective limits, for the start-up line: ``@a 2, @b 4``."""
        return ", ".join(f"{spec.agent} {self.limit(spec)}"
                         for _, spec in sorted(self.engine.registry.specialists.items()))

    def running_job(self, handoff_id: str) -> Job | None:
        """The job this daemon is running for ``handoff_id``, if any."""
        return self.active.get(handoff_id)

    def queue(self, handoff_id: str) -> None:
        """Look at a pending handoff again now, even if a gate held it back."""
        with self.cv:
            self.waiting.pop(handoff_id, None)
            self.notify(handoff_id)

    def _message_handler(self, doc: dict[str, Any] | None) -> Callable[[Engine, str], State | None] | None:
        for predicate, handler in self.message_handlers:
            if predicate(doc):
                return handler
        return None

    def _subscribe(self) -> None:
        """Listen to the backend's wake-up feed: always when watching (arrivals in pending are
        dispatched at once), in a batch only when a feature asked for it (cancel requests)."""
        if not (self.watch or self.wakeup_hooks) or self._unsubscribe is not None:
            return
        # a batch listens only for what its hooks need: watching every folder would wake it
        # for each file it writes itself
        kinds = None if self.watch else self.wakeup_kinds
        try:
            self._unsubscribe = self.engine.backend.subscribe(self._on_wakeup, kinds=kinds)
        except OSError as exc:  # e.g. no inotify left: rescans still see what changed
            log.warning("cannot subscribe to wake-ups (%s); changes are seen at rescans", exc)

    def _on_wakeup(self, wakeup: Wakeup) -> None:
        if wakeup.kind == LOST:
            self.request_rescan()
        elif wakeup.kind == State.PENDING.value and self.watch and wakeup.handoff_id:
            # a document still being written is looked at a moment later (it is re-read anyway)
            self.notify(wakeup.handoff_id, 0.0 if wakeup.settled else CREATED_DELAY)
        for hook in self.wakeup_hooks:
            try:
                hook(wakeup)
            except Exception:  # a feature's hook must not break the feed
                log.exception("wake-up hook %r failed", hook)

    def _unsubscribe_all(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

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
        re-checks them only when something is filed). Parked ids that are no longer pending
        (filed or removed by someone else) are dropped from parking."""
        for hook in self.scan_hooks:  # e.g. cancel requests: stop our handlers, queue pending
            try:
                hook()
            except Exception:  # a feature's hook must not stop the scan
                log.exception("scan hook %r failed", hook)
        try:
            ids = self.engine.backend.ids(State.PENDING)
        except OSError as exc:  # e.g. EIO, ENOMEM: the next rescan tries again
            log.error("cannot list the pending handoffs: %s; will rescan", exc)
            return 0
        index, count = self.stripe
        if count > 1:  # queued in this order: start at this process's share of the list
            cut = index * len(ids) // count
            ids = ids[cut:] + ids[:cut]
        with self.cv:
            if self.parked_ids or self.first_seen or self.report.unroutable or self.waiting:
                present = set(ids)
                for gone in [hid for hid in self.waiting if hid not in present]:
                    self.waiting.pop(gone, None)  # claimed or filed elsewhere
                    self.waits_on.pop(gone, None)
                for gone in [hid for hid in self.parked_ids if hid not in present]:
                    self._unpark(gone)
                for gone in [hid for hid in self.first_seen if hid not in present]:
                    del self.first_seen[gone]  # claimed or filed elsewhere
                # with a shared store, other hosts run what we have no specialist for: forget
                # those once they leave pending (the set would otherwise grow for ever)
                self.report.unroutable &= present
            for handoff_id in ids:
                if handoff_id in self.active or handoff_id in self.queued or handoff_id in self.readied \
                        or handoff_id in self.parked_ids or handoff_id in self.released \
                        or handoff_id in self.report.unroutable \
                        or (not recheck_waiting and handoff_id in self.waiting):
                    continue
                self.notify(handoff_id)
        return len(ids)

    def _park(self, agent: str, handoff_id: str, *, front: bool = False) -> None:
        """Hold a due ``handoff_id`` until ``agent`` has a free slot (idempotent). ``front``:
        it was already let out once and lost its slot to a newcomer, so it goes first."""
        self._unpark(handoff_id)
        waiting = self.parked.setdefault(agent, OrderedDict())
        waiting[handoff_id] = None
        if front:
            waiting.move_to_end(handoff_id, last=False)
        self.parked_ids[handoff_id] = agent

    def _unpark(self, handoff_id: str) -> None:
        """Forget ``handoff_id`` in parking, and free its release if one is in flight."""
        agent = self.parked_ids.pop(handoff_id, None)
        if agent is not None:
            waiting = self.parked.get(agent)
            if waiting is not None:
                waiting.pop(handoff_id, None)
                if not waiting:
                    del self.parked[agent]
        agent = self.released.pop(handoff_id, None)
        if agent is not None:
            self.releasing[agent] -= 1
            if self.releasing[agent] <= 0:
                del self.releasing[agent]

    def _release_parked(self) -> None:
        """Let out as many parked ids as each agent has free slots (level-triggered: runs on
        every loop iteration, so a free slot never waits for an event)."""
        for agent in list(self.parked):
            waiting = self.parked[agent]
            spec = self.engine.registry.get(agent)
            limit = self.limit(spec) if spec is not None else len(waiting)
            free = limit - self.busy.get(agent, 0) - self.releasing.get(agent, 0)
            while free > 0 and waiting:
                handoff_id, _ = waiting.popitem(last=False)
                del self.parked_ids[handoff_id]
                self.released[handoff_id] = agent
                self.releasing[agent] += 1
                self.notify(handoff_id)
                free -= 1
            if not waiting:
                del self.parked[agent]

    def _next_ready(self, now: float) -> tuple[str, Peek | None] | None:
        """The most urgent due handoff. Due ids move from the time heap into a bounded ready
        window (read once each to learn their priority); the window hands out the lowest
        (priority, due time) first, so a critical handoff overtakes a backlog of low ones."""
        while self.heap and self.heap[0][0] <= now and len(self.ready) < READY_WINDOW:
            due, _, _, handoff_id = heapq.heappop(self.heap)
            if self.queued.get(handoff_id) != due:
                continue  # superseded by an earlier notification
            del self.queued[handoff_id]
            try:
                peek = self.engine.peek(handoff_id)
            except Exception:  # peek never raises; if it ever does, the file is set aside
                log.exception("handoff %s: cannot be read", handoff_id)
                peek = Peek(handoff_id, readable=False)
            if peek is None:
                self._unpark(handoff_id)  # gone: claimed elsewhere, or filed
                continue
            rank = peek.priority if peek.readable else -1  # set unreadable files aside first
            heapq.heappush(self.ready, (rank, due, next(self.seq), handoff_id, peek))
            self.readied.add(handoff_id)
        if not self.ready:
            return None
        _, _, _, handoff_id, peek = heapq.heappop(self.ready)
        self.readied.discard(handoff_id)
        return handoff_id, peek

    # ------------------------------------------------------------ dispatch
    def _submit(self, agent: str, func: Callable[..., Any], handoff_id: str, *args: Any) -> int:
        """Run ``func(handoff_id, *args)`` on the pool, counted against ``agent``'s slots (or
        next on the worker that asked for it: see :meth:`_chain`); returns its task token."""
        token = next(self.seq)
        self.last_dispatch = time.monotonic()
        self.inflight[token] = (agent, self.last_dispatch)
        self.busy[agent] += 1
        self.running += 1
        if self.chained == []:  # the first task a finishing worker's look finds: its own next
            self.chained.append((token, func, handoff_id, args))
            return token
        try:
            self.pool.submit(self._run_task, token, func, handoff_id, *args)
        except BaseException:  # e.g. the pool is shut down: the slot is not taken
            self._finished(token)
            raise
        return token

    def _run_task(self, token: int, func: Callable[..., Any], handoff_id: str, *args: Any) -> None:
        task: Task | None = (token, func, handoff_id, args)
        while task is not None:
            token, func, handoff_id, args = task
            self.slot.token = token
            try:
                func(handoff_id, *args)
            except TakenOver:  # its attempt was ended and its slot given back by _taken_over
                return  # no chaining: the scheduler has handed the slot's next task out
            except Exception:  # the task functions catch their own; this is the last resort
                self._unexpected(handoff_id, "unexpected error in a worker")
            except BaseException:  # leaving the worker: give the slot back, take nothing more
                with self.cv:
                    self._finished(token)
                    self.cv.notify_all()
                raise
            with self.cv:
                self._finished(token)
                task = self._chain()
                if task is None:
                    self.cv.notify_all()

    def _chain(self) -> Task | None:
        """A worker that just finished takes the most urgent due handoff itself (called under
        ``cv``). Handing it to the scheduler thread, which hands it to the pool, moved each
        handoff across three threads; the two wake-ups cost more than a no-op handler runs.
        The dispatch rules are the scheduler's own (:meth:`_dispatch`); only a handoff they
        send to a worker is taken, anything else (parked, waiting) is left as they leave it."""
        now = time.monotonic()
        if self.stopping or now >= self.batch_deadline or now < self._spin_up_at():
            return None  # (the last: another worker runs a short task and will chain itself)
        taken: list[Task] = []
        self.chained = taken  # _submit puts the first task dispatched here (any more: the pool)
        try:
            for _ in range(CHAIN_LOOKS):
                if taken or self.running >= self.workers:
                    break
                self._release_parked()
                ready = self._next_ready(time.monotonic())
                if ready is None:
                    break
                self._dispatch_safely(*ready)
        except BaseException:
            for token, *_ in taken:
                self._finished(token)
            raise
        finally:
            self.chained = None
        return taken[0] if taken else None

    def _finished(self, token: int) -> None:
        task = self.inflight.pop(token, None)
        if task is None:
            return
        agent = task[0]
        self.busy[agent] -= 1
        if self.busy[agent] <= 0:
            del self.busy[agent]
        self.running = max(self.running - 1, 0)

    def _spin_up_at(self) -> float:
        """When the scheduler may start another worker: at once when none runs, else when the
        youngest running task is ``spin_up`` seconds old (called under ``cv``)."""
        return max((started for _, started in self.inflight.values()), default=-math.inf) \
            + self.spin_up

    def _dispatch_safely(self, handoff_id: str, peek: Peek | None) -> None:
        """Per-item isolation: a handoff the scheduler chokes on is logged and looked at again
        later; it never takes the loop down."""
        try:
            self._dispatch(handoff_id, peek)
        except Exception:
            log.exception("handoff %s: could not be scheduled; will look again in %ss",
                          handoff_id, RETRY_LOOK_SECONDS)
            self.notify(handoff_id, RETRY_LOOK_SECONDS)

    def _dispatch(self, handoff_id: str, peek: Peek | None) -> None:
        was_released = handoff_id in self.released
        self._unpark(handoff_id)  # whatever happens next, an old parking spot or release ends
        if peek is None:
            return
        if not peek.readable:
            self._dispatch_unreadable(handoff_id)
            return
        handler = self._message_handler(peek.doc)
        if handler is not None:  # e.g. a seed 000 CancellationPayload message
            self._submit("", self._aside, handoff_id, handler)
            return
        if peek.due_at is not None:
            wait = (peek.due_at - self.engine.clock()).total_seconds()
            if wait > 0:
                self.notify(handoff_id, wait)
                return
        deadline = self._deadline(handoff_id, peek)
        if deadline is not None and deadline <= self.engine.clock():
            self._submit("", self._work, handoff_id)  # admission answers it TIMEOUT, unrun
            return
        spec = self.engine.registry.get(peek.target or "")
        if spec is None:
            self._look_again_at(handoff_id, deadline)
            if handoff_id not in self.report.unroutable:
                # a warning for a daemon; for a cron batch it would be mail on every run (it
                # stays in the summary line and in `handoff ls`)
                # (with a store shared by several hosts it is usually another host's work)
                log.log(logging.INFO if self.batch or getattr(self.engine.backend, "shared", False)
                        else logging.WARNING,
                        "handoff %s waits in pending/: no specialist registered for %s",
                        handoff_id, peek.target)
            self.report.unroutable.add(handoff_id)
            return
        self.report.unroutable.discard(handoff_id)
        verdict = self.engine.gate(peek)
        if verdict is not None and verdict.action == "wait":
            self.waiting[handoff_id] = verdict.reason
            if verdict.on is None:
                self.waits_on.pop(handoff_id, None)
            else:
                self.waits_on[handoff_id] = verdict.on
            self._look_again_at(handoff_id, deadline)
            return
        self.waiting.pop(handoff_id, None)
        self.waits_on.pop(handoff_id, None)
        if verdict is not None:  # a gate said fail: file it without running the handler
            self._submit(spec.agent, self._reject, handoff_id, verdict.code, verdict.reason)
            return
        if self.busy.get(spec.agent, 0) >= self.limit(spec):
            self._park(spec.agent, handoff_id, front=was_released)
            self._look_again_at(handoff_id, deadline)
            return
        if self._rate_limited(spec, handoff_id, deadline):
            return
        self._submit(spec.agent, self._work, handoff_id)

    def _rate_limited(self, spec: Specialist, handoff_id: str, deadline: datetime | None) -> bool:
        """True when ``spec``'s rate limit holds ``handoff_id`` back: it is looked at again
        when the next start is due (or at its deadline). The bucket is shared by every process
        of the workspace; ``rate_until`` spares it while this process already knows the
        answer."""
        if not spec.config.rate:
            return False
        now = time.monotonic()
        until = self.rate_until.get(spec.agent, 0.0)
        wait = until - now if until > now else self.engine.start_wait(spec)
        if wait <= 0:
            return False
        self.rate_until[spec.agent] = now + wait
        self.notify(handoff_id, min(wait, self._seconds_to(deadline)))
        return True

    def _seconds_to(self, when: datetime | None) -> float:
        return math.inf if when is None else max((when - self.engine.clock()).total_seconds(), 0.0)

    def _deadline(self, handoff_id: str, peek: Peek) -> datetime | None:
        """When a pending handoff must be answered unrun: its ``expires_at``, or its hard
        deadline counted from when this daemon first saw it (a document's own history is
        trusted only once it is claimed: admission uses that). None without either."""
        env = peek.envelope
        if env is None:
            return None
        hard = None
        if env.hard_timeout:
            arrived = self.first_seen.setdefault(handoff_id, self.engine.clock())
            hard = self.engine.deadline(env, self.engine.specialist_for(env), arrived)
        return min(filter(None, (hard, env.expires_at)), default=None)

    def _look_again_at(self, handoff_id: str, deadline: datetime | None) -> None:
        """A handoff that cannot start now but has a hard deadline is looked at again then: if
        it is still pending it is answered TIMEOUT (seed 000: the sender stops waiting)."""
        if deadline is not None:
            self.notify(handoff_id, (deadline - self.engine.clock()).total_seconds())

    def _dispatch_unreadable(self, handoff_id: str) -> None:
        """A pending document that cannot be read or routed: claim it when claiming sets it aside
        (an invalid document), look again later when the error is transient, else set it aside
        where it lies (a socket, a file we may not read, a reader crashing on it)."""
        peek = self.engine.peek(handoff_id)  # look again: it may have been rewritten meanwhile
        if peek is None:
            return
        if peek.readable or peek.problem is None:  # readable by now: look again shortly
            self.notify(handoff_id, self.settings.settle_seconds)
            return
        problem = peek.problem
        if problem.transient:
            log.warning("handoff %s: %s; will look again in %ss", handoff_id, problem,
                        RETRY_LOOK_SECONDS)
            self.notify(handoff_id, RETRY_LOOK_SECONDS)
            return
        if problem.claimable:
            self._submit("", self._work, handoff_id)  # take() sets it aside with its code
            return
        self._submit("", self._set_aside, handoff_id, problem.code, str(problem))

    def _set_aside(self, handoff_id: str, code: str, message: str) -> None:
        """Set a pending document aside with ``code`` (the engine logs one line and files a
        failure under the id when it is a safe, free one)."""
        try:
            self.engine.set_aside(handoff_id, State.PENDING, code, message)
        except OSError as exc:
            log.error("handoff %s: cannot set it aside (%s: %s): %s; will try again in %ss",
                      handoff_id, code, message, exc, RETRY_LOOK_SECONDS)
            self.notify(handoff_id, RETRY_LOOK_SECONDS)

    def _late_returned(self, handoff_id: str) -> None:
        """A handler that ran on past its ended attempt returned (called under ``cv``)."""
        self.late[handoff_id] -= 1
        if self.late[handoff_id] <= 0:
            del self.late[handoff_id]
            self.late_said.pop(handoff_id, None)
            self.notify(handoff_id)  # a retry held back for it may start now

    def _held_by_late(self, handoff_id: str) -> bool:
        """True (and looked at again later) while the Python handler of ``handoff_id``'s last
        attempt still runs in this daemon: no attempt starts beside it (called under ``cv``)."""
        if not self.late.get(handoff_id):
            return False
        if self.late_said.get(handoff_id) != self.late[handoff_id]:
            self.late_said[handoff_id] = self.late[handoff_id]
            log.warning("handoff %s: its next attempt waits until the Python handler of its last "
                        "one returns (a thread cannot be stopped)", handoff_id)
        self.notify(handoff_id, LATE_LOOK_SECONDS)
        return True

    def _work(self, handoff_id: str) -> None:
        job: Job | None = None
        if self.late:  # (almost always empty: no lock taken per claim then)
            with self.cv:
                if self._held_by_late(handoff_id):
                    return
        try:
            job = self.engine.take(handoff_id, arrived=self.first_seen.get(handoff_id))
            if job is None:
                return
            with self.cv:
                self.active[handoff_id] = job
            log.info("%s -> in-progress (attempt %d, %s)", handoff_id, job.claim.attempt,
                     job.specialist.agent, extra={"event": "claimed", "handoff_id": handoff_id,
                                                  "attempt": job.claim.attempt,
                                                  "agent": job.specialist.agent})
            if self.stopping:
                job.ending = True
                self.engine.handback(job.claim, job.dialect, reason="daemon stopping")
                self.report.handed_back += 1
                return
            token = getattr(self.slot, "token", None)  # None: called outside a worker's task
            if token is not None:  # its Python handler runs here, ended on time by the watchdog
                taken = job
                job.takeover = lambda rest: self._taken_over(token, taken, rest)
            self._end_attempt(job, self.engine.run(job))
        except TakenOver:
            job = None  # _taken_over ended the attempt: the job and the slot are its to give back
            with self.cv:  # and its handler, which ran on past it, has returned at last
                self._late_returned(handoff_id)
            raise
        except Exception as exc:
            self._work_failed(handoff_id, exc)
        finally:
            # only our own entry: a second dispatch of the same id (a late hint read it before
            # our claim) finds it taken and returns here; popping then would hide the running
            # job from lease renewal, the sweep's skip list and cancel requests
            if job is not None:
                self._forget_job(job)

    def _end_attempt(self, job: Job, outcome: Outcome) -> None:
        """File a run's outcome, or hand the attempt back if the daemon stopped it."""
        job.ending = True
        if job.context.handback:  # counted once a stop interrupted it too often in a row
            if handbacks.hand_back(self.engine, job, outcome):
                self.report.handed_back += 1
            return
        if job.fenced:  # stopped by the lease keeper: retried by the policy, not cancelled
            reason = job.context.cancel_reason
            advice = "" if reason == LOST_LOCK_REASON else (
                "; if the store was reachable, the daemon was too busy to renew its leases in "
                "time: raise [daemon] lease_seconds")
            outcome = self.engine.failure(
                outcome.started_at or self.engine.clock(), ErrorCode.PROCESSING_ERROR,
                f"handoff {job.handoff_id}: stopped: {reason}{advice}", retryable=True)
        self.engine.file(job.claim, job.dialect, job.specialist, outcome)  # counted by _count

    def _taken_over(self, token: int, job: Job, rest: Callable[[], Outcome]) -> None:
        """On the watchdog's thread: end ``job``'s attempt, whose handler overran or was
        cancelled while it still runs on its worker, and give its slot back. Until that handler
        returns, this daemon claims the handoff for no other attempt (:attr:`late`)."""
        with self.cv:
            self.late[job.handoff_id] += 1
        try:
            self._end_attempt(job, rest())
        except Exception as exc:
            self._work_failed(job.handoff_id, exc)
        finally:
            self._forget_job(job)
            with self.cv:
                self._finished(token)
                self.cv.notify_all()

    def _forget_job(self, job: Job) -> None:
        with self.cv:
            if self.active.get(job.handoff_id) is job:
                del self.active[job.handoff_id]

    def _work_failed(self, handoff_id: str, exc: Exception) -> None:
        """What a worker does when handling ``handoff_id`` raised ``exc`` (in an except block)."""
        if isinstance(exc, DocumentNotReady):
            self.notify(handoff_id, self.settings.settle_seconds)
        elif isinstance(exc, HandoffdError):
            log.error("%s", exc)
            self.notify(handoff_id, 1.0)
        elif isinstance(exc, OSError):  # disk full, permissions: report, and try again later
            log.error("handoff %s: %s; will retry in %ss", handoff_id, exc, RETRY_LOOK_SECONDS)
            self.notify(handoff_id, RETRY_LOOK_SECONDS)
        else:  # a bug must not kill the worker or lose the handoff
            self._unexpected(handoff_id, "unexpected error; it stays where it is for recovery")

    def _unexpected(self, handoff_id: str, what: str) -> None:
        """Log an unexpected error about ``handoff_id`` (its traceback the first time) and look
        at it again only after a back-off doubling from 1 s to a minute: one document a bug
        cannot handle (a row no reader can load) once made a batch loop on it for ever, a
        traceback a millisecond."""
        tries = self.unexpected[handoff_id] = self.unexpected.get(handoff_id, 0) + 1
        delay = min(UNEXPECTED_MAX_SECONDS, 2.0 ** (tries - 1))
        if tries == 1:
            log.exception("handoff %s: %s", handoff_id, what)
        else:
            log.error("handoff %s: %s (%d times; looked at again in %gs)", handoff_id, what, tries,
                      delay)
        if len(self.unexpected) > MAX_TRACKED:
            self.unexpected.clear()
        self.notify(handoff_id, delay)

    def _reject(self, handoff_id: str, code: str, message: str) -> None:
        try:
            self.engine.reject(handoff_id, code, message)  # counted by _count
        except Exception:  # never lose the loop to one handoff; it stays pending
            log.exception("handoff %s: could not file gate failure", handoff_id)

    def _aside(self, handoff_id: str, func: Callable[[Engine, str], State | None]) -> None:
        """File ``handoff_id`` with ``func`` instead of a specialist (cancellation messages)."""
        try:
            func(self.engine, handoff_id)  # counted by _count
        except Exception:  # never lose the loop to one handoff; it stays where it is
            log.exception("handoff %s: could not be handled", handoff_id)

    # ------------------------------------------------------------ progress watchdog
    def _check_progress(self, now: float) -> None:
        """Due work, a free slot, and nothing dispatched for ``stall_seconds``: the bookkeeping
        is wrong somewhere. Say so loudly, rebuild it from the truth and rescan."""
        if now < self.next_progress_check or now - self.last_dispatch < self.stall_seconds:
            return
        self.next_progress_check = now + max(self.stall_seconds / 2, 0.05)
        try:
            stuck = self._due_with_free_slot()
        except Exception:  # the watchdog itself must not take the loop down
            log.exception("progress check failed; will check again")
            return
        if stuck is None:
            self.next_progress_check = now + self.stall_seconds
            return
        self.reset_scheduler(f"handoff {stuck} is due and a slot is free, but nothing was "
                             f"dispatched for {now - self.last_dispatch:.1f}s")

    def _due_with_free_slot(self) -> str | None:
        """A pending id that could be dispatched right now, judged from the files and the tasks
        actually in flight (not from the scheduling bookkeeping); None when there is none."""
        with self.cv:
            real = Counter(agent for agent, _ in self.inflight.values())
            mine = set(self.active)
            doubtful = set(self.waiting) | set(self.report.unroutable)
        if len(self.inflight) >= self.workers:
            return None
        ids = [hid for hid in self.engine.backend.ids(State.PENDING) if hid not in mine]
        ids.sort(key=lambda hid: hid in doubtful)  # likely candidates first; bounded sample
        for handoff_id in ids[:STALL_SAMPLE]:
            peek = self.engine.peek(handoff_id)
            if peek is None:
                continue
            if not peek.readable:
                problem = peek.problem
                if problem is not None and not problem.transient:
                    return handoff_id  # due to be set aside
                continue
            if self._message_handler(peek.doc) is not None:
                return handoff_id
            if peek.due_at is not None and peek.due_at > self.engine.clock():
                continue
            spec = self.engine.registry.get(peek.target or "")
            if spec is None or real[spec.agent] >= self.limit(spec):
                continue
            try:
                verdict = self.engine.gate(peek)
            except Exception:
                continue
            if verdict is not None and verdict.action == "wait":
                continue
            return handoff_id
        return None

    def reset_scheduler(self, reason: str) -> None:
        """Throw away the scheduling bookkeeping, rebuild the slot counts from the tasks in
        flight and rescan pending/ (what the progress watchdog does on a stall)."""
        log.error("scheduler stalled: %s; resetting its bookkeeping and rescanning", reason)
        with self.cv:
            self.report.stalls += 1
            self.heap.clear()
            self.ready.clear()
            self.readied.clear()
            self.queued.clear()
            self.parked.clear()
            self.parked_ids.clear()
            self.released.clear()
            self.releasing.clear()
            self.busy = Counter(agent for agent, _ in self.inflight.values())
            self.running = len(self.inflight)
            self.waiting.clear()
            self.waits_on.clear()
            self.report.unroutable.clear()
            self.rescan_requested = True
            self.last_dispatch = time.monotonic()
            self.cv.notify_all()

    def _count(self, handoff_id: str, where: State) -> None:
        """Engine listener: count every filing (including rejections at admission) and wake
        whatever it may unblock."""
        for hook in self.filed_hooks:  # e.g. drop a finished handoff's cancel request
            try:
                hook(handoff_id, where)
            except Exception:  # a feature's hook must not lose the count
                log.exception("handoff %s: filed hook %r failed", handoff_id, hook)
        with self.cv:
            if where is State.COMPLETED:
                self.report.completed += 1
            elif where is State.FAILED:
                self.report.failed += 1
            elif where is State.PENDING:
                if not any(parked(handoff_id) for parked in self.parked_checks):  # a retry
                    self.report.retrying += 1
                self.notify(handoff_id)  # _dispatch reads its next_attempt_at
            if where.terminal:
                self.first_seen.pop(handoff_id, None)
                self.unexpected.pop(handoff_id, None)
                for waiter in list(self.waiting):  # a dependency may have been met
                    on = self.waits_on.get(waiter)
                    if on is not None and handoff_id not in on:
                        continue  # only other handoffs' filing can end this wait
                    self.waiting.pop(waiter, None)
                    self.waits_on.pop(waiter, None)
                    self.notify(waiter)
        if self.on_filed:
            self.on_filed(handoff_id, where)

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
        """Run until SIGTERM/SIGINT (or :meth:`stop`); returns the exit code: 0, or 1 when the
        main loop died of an unexpected error (logged with its traceback; in-flight work is
        handed back) so that a supervisor restarts the daemon."""
        self.engine.ws.ensure()
        self.engine.backend.prepare()  # e.g. an unusable seal key: one line now, not per handoff
        if install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self.report.sweep = self.sweep()
        warm_up(self.engine.schemas)
        self._subscribe()
        if ready:
            ready()
        self._guarded_loop(batch=False)
        return 1 if self.report.error else 0

    def run_batch(self, *, install_signals: bool = False,
                  max_seconds: float | None = None) -> BatchReport:
        """One batch for cron: sweep, process everything due now, wait for it, return counts
        (``report.error`` is set when the main loop died).

        With ``install_signals``, SIGTERM/SIGINT stop it as they stop :meth:`serve` (no new
        claims, running work gets ``grace_seconds``, a second signal hands it back at once), so
        cron's ``timeout`` never leaves a claim behind with its specialist still running. After
        ``max_seconds`` it stops claiming and hands back what still runs, to end on time."""
        self.engine.ws.ensure()
        self.engine.backend.prepare()
        self.batch = True
        if install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        if max_seconds is not None:
            self.batch_deadline = time.monotonic() + max_seconds
        self.report.sweep = self.sweep()
        self._subscribe()
        self._guarded_loop(batch=True)
        return self.report

    def _guarded_loop(self, *, batch: bool) -> None:
        resume = getattr(self.engine.backend, "resume", None)
        if callable(resume):  # an earlier daemon's stop cut the store's retries short
            resume()
        self.leases.start()  # renewals and the fence run until the last job has ended
        try:
            self._loop(batch=batch)
        except Exception as exc:  # a scheduler bug: log it, hand work back, exit non-zero
            self.report.error = f"{type(exc).__name__}: {exc}"
            log.critical("main loop died: %s; handing back in-flight work and exiting",
                         self.report.error, exc_info=True)
            self.stop(hard=True)
        finally:
            self._shutdown()

    def _loop(self, *, batch: bool) -> None:
        next_rescan = next_sweep = time.monotonic()
        trimmed = -math.inf  # when the heap was last trimmed
        while True:
            now = time.monotonic()
            if not batch and now >= next_sweep and not self.stopping:
                self.sweep()
                allocator.trim()  # what the handoffs since the last sweep freed goes back
                trimmed = time.monotonic()
                next_sweep = now + self.settings.sweep_seconds
            elif not batch and self._idle_after_work(trimmed, now):
                allocator.trim()  # a burst is over: what it freed goes back, not at the sweep
                trimmed = time.monotonic()
            if now >= self.batch_deadline and not self.stopping:
                log.warning("--max-seconds reached: handing back %d running handoff(s)",
                            self.running)
                self.stop(hard=True)
            if not self.stopping:
                self._check_progress(now)
            if (self.rescan_requested or (not batch and now >= next_rescan)) and not self.stopping:
                self.rescan_requested = False
                self.scan()
                next_rescan = now + self.settings.rescan_seconds
            with self.cv:
                if self.stopping:
                    return
                self._release_parked()
                now, spin_up_at = time.monotonic(), self._spin_up_at()
                ready = self._next_ready(now) \
                    if self.running < self.workers and now >= spin_up_at else None
                if ready is not None:
                    self._dispatch_safely(*ready)
                    continue
                if batch and self.running == 0 and not self._due_soon():
                    if self.scan(recheck_waiting=False) == 0 or not self._due_soon():
                        return
                    continue
                idle = now + IDLE_WAKE_SECONDS
                timers = [idle, next_rescan if not batch else idle, self.batch_deadline]
                if not batch:
                    timers.append(next_sweep)
                    if self.running < self.workers:
                        timers.append(max(self.next_progress_check,
                                          self.last_dispatch + self.stall_seconds))
                if (self.heap or self.ready) and self.running < self.workers:
                    timers.append(max(self.heap[0][0] if self.heap else now, spin_up_at))
                self.cv.wait(max(min(timers) - time.monotonic(), 0.0))

    def _idle_after_work(self, trimmed: float, now: float) -> bool:
        """Nothing runs or waits to run, something was dispatched since the heap was last
        trimmed, and that was at least IDLE_TRIM_SECONDS ago."""
        return (self.running == 0 and not self.ready and self.last_dispatch > trimmed
                and now - trimmed >= IDLE_TRIM_SECONDS)

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
        # a store that is away (PostgreSQL down) must not hold the stop past its grace: its
        # operations give up retrying then (the lock it takes is re-entrant: signal-safe)
        interrupt = getattr(self.engine.backend, "interrupt", None)
        if callable(interrupt):
            interrupt(0.0 if hard else self.settings.grace_seconds)
        if hard:
            self._hand_back_all()

    def _hand_back_all(self) -> None:
        for job in list(self.active.values()):
            job.context.handback = True
            cancel(job.context, "daemon stopping")

    def _shutdown(self) -> None:
        self._unsubscribe_all()
        deadline = time.monotonic() + self.settings.grace_seconds
        with self.cv:
            while self.running and time.monotonic() < deadline and not self.hard_stop:
                self.cv.wait(max(deadline - time.monotonic(), 0.0))
        if self.running:
            self._hand_back_all()
        with self.cv:  # every task ends: handed back, or ended by _taken_over if its handler hangs
            while self.running:
                self.cv.wait(1.0)
        self.leases.stop()
        self.pool.shutdown()
        if self._count in self.engine.on_filed:
            self.engine.on_filed.remove(self._count)
        for hook in self.stop_hooks:
            try:
                hook()
            except Exception:  # a feature's stop must not turn a clean stop into a crash
                log.exception("stop hook %r failed", hook)


def warm_up(schemas: SchemaCache | None = None) -> None:
    """Load before serving what the first handoff (or sweep) would otherwise load: the schema
    checks (jsonschema and RE2, ~120 ms), the seals' hash and the claim locks. One-shot commands keep these lazy; a
    serving daemon pays them before it says it is serving, not on a handoff's clock. The native
    format's own schemas (a few ms each to compile) are built by a thread in the background: a
    handoff that needs one first waits for that build rather than starting its own."""
    from ..core import jsonschema_re2  # noqa: F401
    _import_quick_checks()
    # the sweeps' claim locks: filelock loads hmac and with it OpenSSL (~4 MB resident), which
    # a serving daemon would otherwise map at its first recovery, hours in
    import filelock  # noqa: F401
    if schemas is not None:
        threading.Thread(target=build_schemas, args=(schemas, WARM_SCHEMAS), daemon=True,
                         name="handoffd-warm-up").start()


def warm_up_to_fork(schemas: SchemaCache) -> None:
    """Before a batch forks (:mod:`.spread`): the quick checks' imports and the native format's
    quick checks, built once and shared by every process. Not jsonschema (~50 ms): the quick
    checks answer for valid documents, and a process imports it when one fails them."""
    _import_quick_checks()
    build_schemas(schemas, WARM_SCHEMAS)


def _import_quick_checks() -> None:
    """The seals' hash and the compiled quick checks (RE2 with them)."""
    from ..core import fastschema, hashing  # noqa: F401

    hashing.load()


def build_schemas(schemas: SchemaCache, names: tuple[str, ...]) -> None:
    """Build the quick checks of schemas ``names`` now (a schema that cannot be built is left
    to the handoff that needs it, which says why)."""
    for name in names:
        try:
            schemas.quick(name)
        except Exception:  # an unusable override in schemas/: the handoff that needs it says so
            log.debug("schema %s: not built at start", name, exc_info=True)
