"""What becomes of a due handoff, and the workers that run it.

:meth:`Dispatcher.dispatch` applies the rules to one due handoff: run it now (which task, see
:mod:`.attempts`), park it until its specialist has a free slot, or look at it again later (not
yet due, held by a gate, rate-limited, no specialist here). A task goes to the worker pool, or,
when a finishing worker asks (:meth:`Dispatcher.chain`), straight to that worker as its next.
"""
from __future__ import annotations

import errno
import logging
import time
from datetime import datetime
from typing import Any, Callable

from ..core.engine import Engine, Peek
from ..core.errors import ErrorCode, is_shortage, shortage_words
from ..core.memorystrikes import memory_backoff, memory_wait
from ..core.timeutil import iso
from ..core.watchdog import TakenOver
from .attempts import Attempts
from .handbacks import shortage_backoff
from .hooks import Hooks
from .scheduler import RETRY_LOOK_SECONDS, Scheduler
from .workers import WorkerPool

log = logging.getLogger("handoffd")
CHAIN_LOOKS = 4  # due handoffs a finishing worker looks at for its next task (chain)
MAX_SHORTAGES = 10_000  # handoffs whose shortages in a row are counted (then the count starts over)
# a task a worker runs: (pool token, function, handoff id, more arguments)
Task = tuple[int, Callable[..., Any], str, tuple[Any, ...]]


class Dispatcher:
    """Hands due handoffs to workers by the scheduler's books (called under its ``cv``)."""

    def __init__(self, engine: Engine, scheduler: Scheduler, attempts: Attempts, hooks: Hooks,
                 pool: WorkerPool) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.scheduler = scheduler
        self.cv = scheduler.cv
        self.lock = scheduler.lock  # (cv's lock: see Scheduler.lock)
        self.attempts = attempts
        self.hooks = hooks
        self.pool = pool
        self.slot = attempts.slot  # the worker's current task token, for its attempt's watchdog
        self.chained: list[Task] | None = None  # set while a worker picks its next task (chain)
        self.batch = False  # a cron batch: no specialist for a handoff is not worth a warning
        self.transient_quiet_until = 0.0  # (say_transient: monotonic time of the next warning)
        self.transient_unsaid = 0
        # handoff id -> passing shortages in a row reading or scheduling it (:meth:`short_of`)
        self.shortages: dict[str, int] = {}

    # ------------------------------------------------------------ workers
    def submit(self, agent: str, func: Callable[..., Any], handoff_id: str, *args: Any) -> int:
        """Run ``func(handoff_id, *args)`` on the pool, counted against ``agent``'s slots (or
        next on the worker that asked for it: see :meth:`chain`); returns its task token."""
        token = self.scheduler.start(agent)
        if self.chained == []:  # the first task a finishing worker's look finds: its own next
            self.chained.append((token, func, handoff_id, args))
            return token
        try:
            self.pool.submit(self.run_task, token, func, handoff_id, *args)
        except BaseException:  # e.g. the pool is shut down: the slot is not taken
            self.scheduler.finished(token)
            raise
        return token

    def run_task(self, token: int, func: Callable[..., Any], handoff_id: str, *args: Any) -> None:
        """A worker: run the task, then the next it finds due (:meth:`chain`), until none is."""
        task: Task | None = (token, func, handoff_id, args)
        while task is not None:
            token, func, handoff_id, args = task
            self.slot.token = token
            try:
                func(handoff_id, *args)
            except TakenOver:  # its attempt was ended and its slot given back by _taken_over
                return  # no chaining: the scheduler has handed the slot's next task out
            except Exception:  # the task functions catch their own; this is the last resort
                self.attempts.unexpected(handoff_id, "unexpected error in a worker")
            except BaseException:  # leaving the worker: give the slot back, take nothing more
                with self.cv:
                    self.scheduler.finished(token)
                    self.cv.notify_all()
                raise
            with self.lock:
                self.scheduler.finished(token)
                task = self.chain()
                if task is None:
                    self.cv.notify_all()

    def chain(self) -> Task | None:
        """A worker that just finished takes the most urgent due handoff itself (called under
        ``cv``). Handing it to the scheduler thread, which hands it to the pool, moved each
        handoff across three threads; the two wake-ups cost more than a no-op handler runs.
        The dispatch rules are the scheduler's own (:meth:`dispatch`); only a handoff they
        send to a worker is taken, anything else (parked, waiting) is left as they leave it."""
        scheduler = self.scheduler
        now = time.monotonic()
        if scheduler.stopping or now >= scheduler.batch_deadline or now < scheduler.spin_up_at():
            return None  # (the last: another worker runs a short task and will chain itself)
        taken: list[Task] = []
        self.chained = taken  # submit puts the first task dispatched here (any more: the pool)
        try:
            for _ in range(CHAIN_LOOKS):
                if taken or scheduler.running >= scheduler.workers:
                    break
                if scheduler.parked or scheduler.rate_held:  # (none in the usual drain)
                    scheduler.release_parked()
                ready = scheduler.next_ready(time.monotonic())
                if ready is None:
                    break
                self.dispatch_safely(*ready)
        except BaseException:
            for token, *_ in taken:
                scheduler.finished(token)
            raise
        finally:
            self.chained = None
        return taken[0] if taken else None

    # ------------------------------------------------------------ the rules
    def dispatch_safely(self, handoff_id: str, peek: Peek | None) -> None:
        """Per-item isolation: a handoff the scheduler chokes on is logged and looked at again
        later; it never takes the loop down. A passing shortage of descriptors or memory (a
        gate reading a file, a worker's thread) is one warning line naming the limit, and the
        shortage back-off; it once logged a traceback and "will look again in 5s"."""
        try:
            self.dispatch(handoff_id, peek)
        except Exception as exc:
            if is_shortage(exc) or (isinstance(exc, OSError) and exc.errno == errno.EAGAIN):
                # (EAGAIN: no worker thread could be started, the pool's word for it)
                self.short_of(handoff_id, f"cannot be scheduled for now: {shortage_words(exc)}",
                              memory=isinstance(exc, MemoryError))
                return
            if isinstance(exc, OSError):  # (the store away, an I/O error: no bug, no traceback)
                log.error("handoff %s: could not be scheduled: %s; will look again in %ss",
                          handoff_id, exc, RETRY_LOOK_SECONDS)
            else:
                log.exception("handoff %s: could not be scheduled; will look again in %ss",
                              handoff_id, RETRY_LOOK_SECONDS)
            self.scheduler.notify(handoff_id, RETRY_LOOK_SECONDS)
            return
        if self.shortages and peek is not None and peek.readable:  # (almost always empty)
            self.shortages.pop(handoff_id, None)  # read and scheduled: the row ends

    def short_of(self, handoff_id: str, problem: str, *, memory: bool) -> None:
        """``handoff_id`` could not be read or scheduled for a passing shortage (``problem``
        says so, in :func:`~handoffd.core.errors.shortage_words`' words): one warning line
        (:meth:`say_transient`), and it is looked at again after the shortage back-off (1 s
        doubling to a minute; the memory one for a MemoryError), no sooner whatever wakes the
        daemon meanwhile; a batch waits it out as it does a claim shortage's. It stays in
        pending/, no attempt counted; a batch that ends first counts it handed back, as a
        claim shortage's (:meth:`.attempts.Attempts.put_off`)."""
        tries = self.shortages[handoff_id] = self.shortages.get(handoff_id, 0) + 1
        if len(self.shortages) > MAX_SHORTAGES:
            self.shortages.clear()
        delay = memory_wait(tries) if memory else shortage_backoff(tries)
        delay = max(delay, memory_backoff(handoff_id))
        self.say_transient(handoff_id, f"{problem}; it stays in pending/", delay)
        self.attempts.put_off(handoff_id, delay)

    def dispatch(self, handoff_id: str, peek: Peek | None) -> None:
        """Start, park or put off the due ``handoff_id`` (``peek``: what it was read as)."""
        scheduler = self.scheduler
        was_released = handoff_id in scheduler.released
        scheduler.unpark(handoff_id)  # whatever happens next, an old parking spot or release ends
        if peek is None:
            return
        if not peek.readable:
            self.dispatch_unreadable(handoff_id, peek)
            return
        handler = self.hooks.message_handler(peek.doc)
        if handler is not None:  # e.g. a seed 000 CancellationPayload message
            self.submit("", self.attempts.aside, handoff_id, handler)
            return
        deadline = scheduler.deadline(handoff_id, peek)
        # (the clock is read only for a time to compare: the usual handoff has none)
        now = self.engine.clock() if deadline is not None or peek.due_at is not None else None
        if deadline is not None and now is not None and deadline <= now:
            # admission answers it TIMEOUT (or EXPIRED), unrun: also when a retry or a throttle
            # put it off past its deadline (seed 000: answered before it), whatever its retry time
            self.submit("", self.attempts.work, handoff_id, False)
            return
        if peek.due_at is not None and now is not None:
            wait = (peek.due_at - now).total_seconds()
            if wait > 0:
                if deadline is not None:
                    wait = min(wait, (deadline - now).total_seconds())
                scheduler.notify(handoff_id, wait)
                return
        spec = self.engine.registry.get(peek.target or "")
        if spec is None:
            scheduler.look_again_at(handoff_id, deadline)
            if handoff_id not in scheduler.unroutable:
                # a warning for a daemon; for a cron batch it would be mail on every run (it
                # stays in the summary line and in `handoff ls`)
                # (with a store shared by several hosts it is usually another host's work, and
                # it waits in the database, not in a pending/ folder)
                shared = getattr(self.engine.backend, "shared", False)
                log.log(logging.INFO if self.batch or shared else logging.WARNING,
                        "handoff %s waits: no specialist registered for %s here (it may be "
                        "another host's work)" if shared else
                        "handoff %s waits in pending/: no specialist registered for %s",
                        handoff_id, peek.target)
            scheduler.unroutable.add(handoff_id)
            return
        scheduler.unroutable.discard(handoff_id)
        verdict = self.engine.gate(peek)
        if verdict is not None and verdict.action == "wait":
            scheduler.hold(handoff_id, verdict.reason, verdict.on, verdict.fails_on)
            scheduler.look_again_at(handoff_id, deadline)
            return
        scheduler.unhold(handoff_id)
        if verdict is not None:  # a gate said fail: file it without running the handler
            self.submit(spec.agent, self.attempts.reject, handoff_id, verdict.code, verdict.reason,
                        verdict.recovery)
            return
        agent = spec.agent
        if scheduler.busy.get(agent, 0) >= scheduler.limit(spec):
            scheduler.park(agent, handoff_id, front=was_released)
            scheduler.look_again_at(handoff_id, deadline)
            return
        if scheduler.rate_limited(spec, handoff_id, deadline):
            return
        self.submit(agent, self.attempts.work, handoff_id)

    def answer_overdue(self, handoff_id: str, deadline: datetime) -> None:
        """Answer ``handoff_id`` TIMEOUT unrun past its hard ``deadline`` while every worker is
        busy (:meth:`.scheduler.Scheduler.look_ahead`; called under ``cv``): seed 000's
        receiver must answer before it, not once a slot frees. The task takes a thread beyond
        ``workers`` for a moment and never runs a handler: it is :meth:`.attempts.Attempts.
        reject`'s, which claims, lets admission answer it (TIMEOUT, EXPIRED, or a hand-back
        when nobody here serves it) and, only if admission would run it after all (its
        document rewritten meanwhile), files this answer instead of running it."""
        message = (f"handoff {handoff_id} was not started before its deadline {iso(deadline)} "
                   "(a hard timeout counts from its arrival)")
        try:
            self.submit("", self.attempts.reject, handoff_id, ErrorCode.TIMEOUT, message)
        except Exception as exc:  # (a thread that cannot start: looked at again, as dispatch's)
            log.warning("handoff %s: past its deadline, cannot be answered for now: %s; will "
                        "look again in %ss", handoff_id, exc, RETRY_LOOK_SECONDS)
            self.scheduler.notify(handoff_id, RETRY_LOOK_SECONDS)

    def dispatch_unreadable(self, handoff_id: str, seen: Peek | None = None) -> None:
        """A pending document that cannot be read or routed: claim it when claiming sets it aside
        (an invalid document), look again later when the error is transient (``seen``, the
        scheduler's read, already said so: the store out of reach, where a second read would
        only wait out the reconnect window again), else set it aside where it lies (a socket, a
        file we may not read, a reader crashing on it)."""
        problem = seen.problem if seen is not None else None
        if problem is None or not problem.transient:
            peek = self.engine.peek(handoff_id)  # look again: it may have been rewritten meanwhile
            if peek is None:
                return
            if peek.readable or peek.problem is None:  # readable by now: look again shortly
                self.scheduler.notify(handoff_id, self.settings.settle_seconds)
                return
            problem = peek.problem
        if problem.shortage:  # (no descriptor to spare reading it): the limit's back-off
            self.short_of(handoff_id, str(problem), memory=False)
            return
        if problem.transient:  # never set aside: a valid handoff must not fail for an outage
            # (out of memory: not before its back-off ends, which the scheduler would wait for)
            delay = max(RETRY_LOOK_SECONDS, memory_backoff(handoff_id))
            self.say_transient(handoff_id, str(problem), delay)
            self.scheduler.notify(handoff_id, delay)
            return
        if problem.claimable:
            # take() sets it aside with its code (its retry time, if any, is no reason to wait)
            self.submit("", self.attempts.work, handoff_id, False)
            return
        self.submit("", self.attempts.set_aside, handoff_id, problem.code, str(problem))

    def say_transient(self, handoff_id: str, problem: str,
                      delay: float = RETRY_LOOK_SECONDS) -> None:
        """One warning per RETRY_LOOK_SECONDS for handoffs put off by a passing error: with the
        store away, every pending handoff meets it (3,000 pending: 3,000 lines a round).
        ``delay``: when ``handoff_id`` is looked at again (what the line says)."""
        now = time.monotonic()
        if now < self.transient_quiet_until:
            self.transient_unsaid += 1
            return
        more = f" ({self.transient_unsaid} more put off since)" if self.transient_unsaid else ""
        log.warning("handoff %s: %s; will look again in %.3gs%s", handoff_id, problem,
                    delay, more)
        self.transient_quiet_until, self.transient_unsaid = now + RETRY_LOOK_SECONDS, 0
