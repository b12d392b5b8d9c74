"""Running one attempt on a worker, and what its outcome or failure does.

A worker's task (:mod:`.dispatch` submits it) is one of: :meth:`Attempts.work` (claim, run, file),
:meth:`~Attempts.reject` (a gate said fail), :meth:`~Attempts.aside` (a message a feature files,
e.g. a cancellation) or :meth:`~Attempts.set_aside` (a document that cannot be read). None of them
raises for a handoff's fault: each error is filed, or logged and the handoff looked at again
later through the scheduler. Python handlers that run on past their ended attempt hold back
that handoff's next attempt until they return (``late`` in this daemon; in every other process
by keeping the claim), and an answer whose filing failed for a passing reason is kept and filed
again: both in :mod:`.held`.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

from ..core import recurring
from ..core.documents import Outcome
from ..core.engine import Engine, Job
from ..core.errors import (ClaimShortage, DocumentNotReady, ErrorCode, HandoffdError, NotDue,
                           is_shortage, shortage_words)
from ..core.runner import cancel
from ..core.starts import not_started
from ..core.states import State
from ..core.watchdog import TakenOver
from . import handbacks
from .held import HeldOutcomes
from .leases import broken_reason
from .report import BatchReport
from .scheduler import RETRY_LOOK_SECONDS, Scheduler
from .shortclaims import GAVE_UP, KeptClaims

log = logging.getLogger("handoffd")
LATE_LOOK_SECONDS = 1.0  # a handoff whose last Python handler still runs is looked at this late
UNEXPECTED_MAX_SECONDS = 60.0  # the longest back-off after unexpected errors about one handoff
# a run's end checks at most this many of its shortage hand-backs against the store, giving
# up on a store that does not answer within this long (settle_handed_back)
SETTLE_AT_MOST, SETTLE_GRACE_SECONDS = 1_000, 2.0
RETRY_SHORT_AT_ONCE = 4  # claims given up for a shortage looked at again as a task ends
MAX_TRACKED = 10_000  # handoffs whose unexpected errors are counted before the count starts over


class Attempts(HeldOutcomes):
    """The attempts one daemon runs: ``active`` (handoff id -> its running job, guarded by the
    scheduler's ``cv``), the handlers running late, and unexpected errors in a row."""

    def __init__(self, engine: Engine, scheduler: Scheduler, report: BatchReport) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.scheduler = scheduler
        self.cv = scheduler.cv
        self.lock = scheduler.lock  # (cv's lock: see Scheduler.lock)
        self.report = report
        self.active: dict[str, Job] = {}
        # handoff id -> Python handlers still running past their ended attempts (timed out,
        # cancelled, fenced): a thread cannot be stopped, so no new attempt starts beside them
        self.late: Counter[str] = Counter()
        self.late_said: dict[str, int] = {}  # (said once per late handler)
        self.unexpected_in_a_row: dict[str, int] = {}  # handoff id -> unexpected errors in a row
        self.slot = threading.local()  # a worker's current task token (``slot.token``)
        self.refiles: dict[str, threading.Timer] = {}  # kept outcomes' next refile (under cv)
        self.closing = False  # a stop files what is kept: a failure then gives the claim up
        # failed filings for a passing shortage: one WARNING while they last (service.held)
        self.filing_shortages = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
        # handlers not started for a passing shortage: one WARNING while they last (handbacks)
        self.start_shortages = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
        # handed back for a start shortage, counted in report.handed_back until claimed again
        # here (a batch that waits its back-off out does not end saying it handed it back);
        # report.backed_off lists them for a batch of several processes (service.spread)
        self.backed_off: set[str] = set()
        # handoff id -> claims given up in a row for a passing shortage (ClaimShortage)
        self.claim_shortages: dict[str, int] = {}
        # claims whose admission and hand-back both ran short: handed back on a timer
        self.kept_claims = KeptClaims(engine, self.cv, scheduler.release)

    def work(self, handoff_id: str, due_only: bool = True) -> None:
        """Claim ``handoff_id``, run its specialist and file the outcome (a worker's task).
        ``due_only``: the claim is refused (NotDue: nothing run, counted nor written) when
        the document claimed has a retry time still to come, whatever the scheduler's read of
        it said (another process may have rewritten it since); False for a claim that lets
        admission answer it unrun (past its deadline, or unreadable)."""
        job: Job | None = None
        short = False  # it ended in a claim shortage
        if self.late:  # (almost always empty: no lock taken per claim then)
            with self.cv:
                if self._held_by_late(handoff_id):
                    return
        if self.saturated():  # (a worker chaining on: the main loop dispatches nothing then)
            self.scheduler.notify(handoff_id, RETRY_LOOK_SECONDS)
            return
        try:
            job = self.engine.take(handoff_id, arrived=self.scheduler.first_seen.get(handoff_id),
                                   keep_short=True,  # (_claim_short hands it back)
                                   due_only=due_only)
            if self.claim_shortages:  # (almost always empty) claimed, or not ours to claim
                self.claim_shortages.pop(handoff_id, None)  # (taken, filed, gated): row ends
            if job is None:
                return
            with self.lock:
                self.active[handoff_id] = job
                if handoff_id in self.backed_off:  # handed back for a shortage, taken again
                    self.backed_off.discard(handoff_id)
                    self.report.handed_back -= 1
            if log.isEnabledFor(logging.INFO):  # (its arguments cost more than the check)
                agent = job.specialist.agent
                log.info("%s -> in-progress (attempt %d, %s)", handoff_id, job.claim.attempt,
                         agent, extra={"event": "claimed", "handoff_id": handoff_id,
                                       "attempt": job.claim.attempt, "agent": agent})
            if self.scheduler.stopping:
                job.ending = True
                self.engine.handback(job.claim, job.dialect, reason="daemon stopping")
                self.report.handed_back += 1
                return
            token = getattr(self.slot, "token", None)  # None: called outside a worker's task
            if token is not None:  # its Python handler runs here, ended on time by the watchdog
                taken = job
                job.takeover = lambda rest: self._taken_over(token, taken, rest)
            if self._end_attempt(job, self.engine.run(job)):
                job = None  # its filing failed and is tried again: the job stays active
        except TakenOver:
            if job is not None:  # (always: only run() raises it) its handler returned at last
                self._late_handler_returned(job)
            job = None  # _taken_over ended the attempt: the job and the slot are its to give back
            raise
        except Exception as exc:
            short = isinstance(exc, ClaimShortage)  # (it freed nothing others wait for)
            self._work_failed(handoff_id, exc)
        finally:
            # only our own entry: a second dispatch of the same id (a late hint read it before
            # our claim) finds it taken and returns here; popping then would hide the running
            # job from lease renewal, the sweep's skip list and cancel requests
            if job is not None:
                self._forget_job(job)
            if self.claim_shortages and not short and handoff_id not in self.claim_shortages:
                self._retry_short_claims()

    def _retry_short_claims(self) -> None:
        """A task ended (what it held of descriptors and memory is free): the claims given up
        for a shortage are looked at again now, a few at a time, not at the end of their
        back-offs (all doubling together while one handler held the descriptors, they left
        the daemon idle for up to a minute once it was done)."""
        due = list(self.claim_shortages)[:RETRY_SHORT_AT_ONCE]  # (one copy, under the GIL)
        for handoff_id in due:  # (to the end of the line: the next task's end takes others)
            count = self.claim_shortages.pop(handoff_id, None)
            if count is not None:
                self.claim_shortages[handoff_id] = count
                self.scheduler.release(handoff_id)

    def _end_attempt(self, job: Job, outcome: Outcome) -> bool:
        """File a run's outcome, or hand the attempt back if the daemon stopped it. True when
        the filing failed for a passing reason and the outcome is kept to be filed again (the
        job stays active: :meth:`_keep_to_refile`)."""
        job.ending = True
        shortage = not_started(job.context)
        if shortage is not None:  # its handler could not start for now (descriptors, processes)
            delay = handbacks.shortage_delay(job.claim.doc)
            where = handbacks.hand_back_unstarted(self.engine, job, shortage, outcome,
                                                  self.start_shortages)
            if isinstance(where, Outcome):  # a shortage too long in a row: counted
                return self._file(job, where)
            if where is State.PENDING:
                self._backed_off(job.handoff_id, delay)  # a batch may wait for it
            return False
        if self.start_shortages.active:  # (a shortage said before: one line says it cleared)
            handbacks.started_again(self.start_shortages, self.engine)
        if job.context.handback:  # counted once a stop interrupted it too often in a row
            where = handbacks.hand_back(self.engine, job, outcome)
            if where is State.PENDING:
                self.report.handed_back += 1
            elif where is State.IN_PROGRESS:
                log.warning("handoff %s: stopping: its claim was taken over meanwhile; nothing "
                            "was handed back here", job.handoff_id)
            return False
        if job.fenced:  # stopped by the lease keeper: retried by the policy, not cancelled
            reason = job.context.cancel_reason
            advice = "" if reason == broken_reason(self.engine.backend) else (
                "; if the store was reachable, the daemon was too busy to renew its leases in "
                "time: raise [daemon] lease_seconds")
            outcome = self.engine.failure(
                outcome.started_at or self.engine.clock(), ErrorCode.PROCESSING_ERROR,
                f"handoff {job.handoff_id}: stopped: {reason}{advice}", retryable=True)
        return self._file(job, outcome)

    def _taken_over(self, token: int, job: Job, rest: Callable[[], Outcome]) -> None:
        """On the watchdog's thread: end ``job``'s attempt, whose handler overran or was
        cancelled while it still runs on its worker, and give its slot back. Until that handler
        returns, this daemon claims the handoff for no other attempt (:attr:`late`)."""
        with self.cv:
            # the handler may have returned already (it stopped at ctx.cancelled, which the
            # watchdog sets before this thread starts): its return counted -1, and this +1
            # settles it, or the count stayed 1 for good and the handoff never ran here again
            self.late[job.handoff_id] += 1
            if self.late[job.handoff_id] == 0:
                self._settle_late(job.handoff_id)
        kept = False
        try:
            outcome = rest()
            kept = self._hold(job, outcome) or self._end_attempt(job, outcome)
        except Exception as exc:
            self._work_failed(job.handoff_id, exc)
        finally:
            if not kept:  # (a kept job stays active: its lease renewed, a batch waits for it)
                self._forget_job(job)
            with self.cv:
                self.scheduler.finished(token)
                self.cv.notify_all()

    def _forget_job(self, job: Job) -> None:
        with self.lock:
            if self.active.get(job.handoff_id) is job:
                del self.active[job.handoff_id]
        job.let_go()  # (its document freed now, not at the collector's next pass)

    def _late_returned(self, handoff_id: str) -> None:
        """A handler that ran on past its ended attempt returned (called under ``cv``; before
        :meth:`_taken_over` counted it, the count goes to -1 and that settles it)."""
        self.late[handoff_id] -= 1
        if self.late[handoff_id] == 0:
            self._settle_late(handoff_id)

    def _settle_late(self, handoff_id: str) -> None:
        """No handler of ``handoff_id`` runs late any more (called under ``cv``)."""
        del self.late[handoff_id]
        self.late_said.pop(handoff_id, None)
        self.scheduler.notify(handoff_id)  # a retry held back for it may start now

    def _held_by_late(self, handoff_id: str) -> bool:
        """True (and looked at again later) while the Python handler of ``handoff_id``'s last
        attempt still runs in this daemon: no attempt starts beside it (called under ``cv``)."""
        if self.late.get(handoff_id, 0) <= 0:  # (-1: returned before it was counted)
            return False
        if self.late_said.get(handoff_id) != self.late[handoff_id]:
            self.late_said[handoff_id] = self.late[handoff_id]
            log.warning("handoff %s: its next attempt waits until the Python handler of its last "
                        "one returns (a thread cannot be stopped)", handoff_id)
        self.scheduler.notify(handoff_id, LATE_LOOK_SECONDS)
        return True

    def hand_back_all(self) -> None:
        """Stop every running handler now; its attempt is handed back to pending/ (one that
        ended already and whose outcome is held keeps it: :meth:`file_all_held` files it)."""
        with self.cv:
            running = [job for job in self.active.values() if job.held is None and not job.ending]
        for job in running:
            job.context.handback = True
            cancel(job.context, "daemon stopping")

    # ------------------------------------------------------------ failures
    def _work_failed(self, handoff_id: str, exc: Exception) -> None:
        """What a worker does when handling ``handoff_id`` raised ``exc`` (in an except block)."""
        if not isinstance(exc, ClaimShortage) and self.claim_shortages:
            self.claim_shortages.pop(handoff_id, None)  # (another problem: its own back-off)
        if isinstance(exc, ClaimShortage):
            self._claim_short(handoff_id, exc)
        elif isinstance(exc, NotDue):  # read afresh now: the dispatch rules queue it for its
            # retry time (or its deadline, should that come first: answered TIMEOUT then)
            log.info("%s", exc)
            self.scheduler.notify(handoff_id)
        elif isinstance(exc, DocumentNotReady):
            self.scheduler.notify(handoff_id, self.settings.settle_seconds)
        elif isinstance(exc, HandoffdError):
            log.error("%s", exc)
            self.scheduler.notify(handoff_id, 1.0)
        elif isinstance(exc, OSError):  # disk full, permissions: report, and try again later
            # (held off, doubling to a minute: a document this process cannot write, larger
            # than its `ulimit -f`, was claimed again ~100 times a second, its own put-back's
            # folder event cutting the wait short)
            counts = self.unexpected_in_a_row
            tries = counts[handoff_id] = counts.get(handoff_id, 0) + 1
            delay = min(UNEXPECTED_MAX_SECONDS, RETRY_LOOK_SECONDS * 2.0 ** (tries - 1))
            if is_shortage(exc):  # (a shortage met outside the paths that say it as one:
                # a WARNING naming the limit, not an ERROR with a bare [Errno 24])
                log.warning("handoff %s: %s; will retry in %gs", handoff_id,
                            shortage_words(exc), delay)
            else:
                log.error("handoff %s: %s; will retry in %gs", handoff_id, exc, delay)
            self.report.errors += 1  # (a batch that ends meanwhile exits non-zero, and says so)
            if len(counts) > MAX_TRACKED:
                counts.clear()
            self.scheduler.hold_off(handoff_id, delay)
        else:  # a bug must not kill the worker or lose the handoff
            self.unexpected(handoff_id, "unexpected error; it stays where it is for recovery")

    def _claim_short(self, handoff_id: str, exc: ClaimShortage) -> None:
        """A claim given up for a passing shortage (descriptors, memory) before its lease: the
        document is in pending/ as it came, uncounted. One warning line, and it is claimed again
        after a back-off (the memory back-off for a MemoryError; else 1 s doubling to a
        minute while the shortage lasts), no sooner whatever wakes the daemon meanwhile (its
        own put-back's folder event); a batch waits for it as for a start shortage, and counts
        it handed back if it ends first. It once stayed in in-progress/, an error, until the
        sweep's grace. One met admitting it carries its claim, handed back here; when that
        write runs short too, the claim is kept and handed back after the back-off
        (:mod:`.shortclaims`), no later than its lease allows (counted from the claim)."""
        if exc.reason == "MemoryError" and exc.delay:
            # the memory back-off is a time to wait, not a resource a task's end frees: not
            # released early with the descriptor ones (:meth:`_retry_short_claims`), which
            # once let a batch with other work end before it, the handoff left pending (nor
            # under an earlier descriptor shortage's row)
            self.claim_shortages.pop(handoff_id, None)
            delay = exc.delay
        else:
            counts = self.claim_shortages
            tries = counts[handoff_id] = counts.get(handoff_id, 0) + 1
            if len(counts) > MAX_TRACKED:
                counts.clear()
            delay = exc.delay or handbacks.shortage_backoff(tries)
        try:
            kept = None if exc.claim is None else self.kept_claims.hand_back(exc, delay)
        except Exception as again:  # (given up: the sweep hands it back)
            self._work_failed(handoff_id, again)
            return
        if kept == GAVE_UP:  # (said, and counted an error of the run: not back in pending/)
            return
        extra = {"event": "claim_shortage", "handoff_id": handoff_id, "reason": exc.reason}
        if kept is not None:  # (its lease may have capped the delay)
            delay = kept
            log.warning("handoff %s: cannot be admitted for now (%s), nor handed back to "
                        "pending/ for now: its claim is kept, uncounted, and handed back in "
                        "%.3gs", handoff_id, exc.reason, delay, extra=extra)
        else:
            log.warning("%s; claimed again in %.3gs", exc, delay, extra=extra)
        self._backed_off(handoff_id, delay)

    def put_off(self, handoff_id: str, delay: float) -> None:
        """``handoff_id`` could not be read or scheduled for a passing shortage and stays in
        pending/, looked at again in ``delay`` s: a hand-back as a claim shortage's is, counted
        handed back until it is claimed (a batch that ended with it there once said nothing,
        exit 0), and waited for by a batch whose end is near (:meth:`_backed_off`)."""
        self._backed_off(handoff_id, delay)

    def _backed_off(self, handoff_id: str, delay: float) -> None:
        """``handoff_id`` is back in pending/ for a passing shortage, due in ``delay`` s:
        counted handed back (once: a claim put back again was not claimed since) until it
        is claimed here again, and a batch may wait for it."""
        with self.cv:  # (no longer handed back once it is claimed again here)
            if handoff_id not in self.backed_off:
                self.report.handed_back += 1
                if len(self.backed_off) >= MAX_TRACKED:  # (a daemon that serves for long)
                    self.backed_off.clear()
                self.backed_off.add(handoff_id)
        self.scheduler.back_off(handoff_id, delay)

    def settle_handed_back(self) -> None:
        """At the end of a run: a handoff handed back here for a shortage that is no longer
        pending (another process claimed or filed it, a cancel filed it) is no hand-back of
        this run's (the summary's "handed back" is what a shortage left in pending/). A store
        that does not answer ends it at once, the count as seen: a run's end never waits out
        a PostgreSQL reconnection window per id (nor past its --max-seconds)."""
        ids = list(self.backed_off)[:SETTLE_AT_MOST]
        interrupt = getattr(self.engine.backend, "interrupt", None)
        if ids and callable(interrupt):
            interrupt(SETTLE_GRACE_SECONDS)  # (the run is over: nothing waits for the store)
        for handoff_id in ids:
            try:
                found = self.engine.backend.get(handoff_id)
            except (HandoffdError, OSError):  # unreachable or unreadable now: as seen
                break
            if found is not None and found[0] is State.PENDING:
                continue
            with self.cv:
                if handoff_id in self.backed_off:
                    self.backed_off.discard(handoff_id)
                    self.report.handed_back = max(self.report.handed_back - 1, 0)
        with self.cv:  # (what the report carries to a batch's other processes: service.spread)
            self.report.backed_off = sorted(self.backed_off)

    def unexpected(self, handoff_id: str, what: str) -> None:
        """Log an unexpected error about ``handoff_id`` (its traceback the first time) and look
        at it again only after a back-off doubling from 1 s to a minute: one document a bug
        cannot handle (a row no reader can load) once made a batch loop on it for ever, a
        traceback a millisecond. Counted in the report (a batch that ends meanwhile exits
        non-zero, and says so: one whose claim a bug stranded once said "completed 0, failed 0"
        and exited 0). The claim is not handed back: the handler may have run (the error may
        come from its filing), and an uncounted hand-back would run it again at once, for ever;
        recovery, after the lease, counts the attempt under its retry policy."""
        self.report.errors += 1
        counts = self.unexpected_in_a_row
        tries = counts[handoff_id] = counts.get(handoff_id, 0) + 1
        delay = min(UNEXPECTED_MAX_SECONDS, 2.0 ** (tries - 1))
        if tries == 1:
            log.exception("handoff %s: %s", handoff_id, what)
        else:
            log.error("handoff %s: %s (%d times; looked at again in %gs)", handoff_id, what, tries,
                      delay)
        if len(counts) > MAX_TRACKED:
            counts.clear()
        self.scheduler.hold_off(handoff_id, delay)

    # ------------------------------------------------------------ tasks that run no specialist
    def reject(self, handoff_id: str, code: str, message: str,
               recovery: tuple[str, ...] = ()) -> None:
        """File ``handoff_id`` as failed with ``code`` unrun: a gate said so (``recovery``: its
        own advice, see :meth:`Engine.reject`). A claim given up
        for a passing shortage, or a document still being written, is met as :meth:`aside`
        meets it (one warning line, looked at again after its back-off)."""
        try:
            self.engine.reject(handoff_id, code, message, recovery)  # counted by Daemon._count
        except DocumentNotReady as exc:  # (ClaimShortage among them): still in pending/
            self._work_failed(handoff_id, exc)
        except Exception:  # never lose the loop to one handoff; it stays pending
            log.exception("handoff %s: could not file gate failure", handoff_id)
        else:
            self._claimed_again(handoff_id)

    def aside(self, handoff_id: str, func: Callable[[Engine, str], State | None]) -> None:
        """File ``handoff_id`` with ``func`` instead of a specialist (cancellation messages).
        A claim given up for a passing shortage (ClaimShortage), or a message still being
        written, is what it is for :meth:`work`: one warning line, the message left in
        pending/ and looked at again after its back-off (it once logged a traceback and waited
        for the next rescan)."""
        try:
            func(self.engine, handoff_id)  # counted by Daemon._count
        except DocumentNotReady as exc:  # (ClaimShortage among them): still in pending/
            self._work_failed(handoff_id, exc)
        except Exception:  # never lose the loop to one handoff; it stays where it is
            log.exception("handoff %s: could not be handled", handoff_id)
        else:
            self._claimed_again(handoff_id)

    def _claimed_again(self, handoff_id: str) -> None:
        """``handoff_id``, given up for a shortage before, was handled since: its row of
        shortages ends, and it is no hand-back of this run's any more."""
        if self.claim_shortages:  # (almost always empty)
            self.claim_shortages.pop(handoff_id, None)
        if handoff_id in self.backed_off:
            with self.cv:
                if handoff_id in self.backed_off:
                    self.backed_off.discard(handoff_id)
                    self.report.handed_back -= 1

    def set_aside(self, handoff_id: str, code: str, message: str) -> None:
        """Set a pending document aside with ``code`` (the engine logs one line and files a
        failure under the id when it is a safe, free one)."""
        try:
            self.engine.set_aside(handoff_id, State.PENDING, code, message)
        except OSError as exc:
            log.error("handoff %s: cannot set it aside (%s: %s): %s; will try again in %ss",
                      handoff_id, code, message, exc, RETRY_LOOK_SECONDS)
            self.scheduler.notify(handoff_id, RETRY_LOOK_SECONDS)
