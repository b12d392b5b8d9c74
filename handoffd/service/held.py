"""Outcomes kept with their claim instead of filed at once (:class:`HeldOutcomes`, part of
:class:`.attempts.Attempts`).

A Python handler that runs on past its ended attempt (timed out, cancelled, fenced: a thread
cannot be stopped) holds back that handoff's next attempt until it returns. In its daemon
through ``Attempts.late``; in every other process (another daemon, a batch, another host) by
keeping the claim: an outcome that would put the handoff back in pending/ (a retry, a hand-back)
is kept with it (``Job.held``, the lease still renewed, the job still ``active``) and filed the
moment the handler returns, or when the handoff is cancelled (filed cancelled: nothing runs
again), or when this daemon stops (:meth:`HeldOutcomes.file_all_held`, the last thing it does:
the handler's thread ends with the process). A finished outcome (the last retry failing, a
cancellation) is filed at once. Command handlers and isolated ones are killed on time: nothing
is held for them.

An answer whose filing failed for a passing reason (a full disk) before anything was written is
kept the same way (``Job.held``, :class:`~handoffd.backends.base.NotFiled`): the handler does not
run again; the same outcome is filed again after ``RETRY_LOOK_SECONDS``, then with a back-off up
to :data:`REFILE_MAX_SECONDS` (:meth:`HeldOutcomes._refile`, on a timer), or cancelled, or
filed last at a stop, where a failure hands it back to pending/ as a stop's interrupted attempt.
While as many answers wait as there are workers, nothing new starts (:meth:`saturated`).
An answer too large to write (EFBIG) is not kept: a small failure is filed in its place.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from ..backends.base import SHRINKABLE_ERRNOS, NotFiled, refiling
from ..core import recurring
from ..core.documents import Outcome
from ..core.engine import Engine, Job
from ..core.errors import ErrorCode, is_shortage
from ..core.filing import runs_again
from ..core.results import conclude
from ..core.states import State
from ..core.watchdog import cancelled
from . import handbacks
from .leases import FENCE_FRACTION
from .report import BatchReport
from .scheduler import RETRY_LOOK_SECONDS, Scheduler

if TYPE_CHECKING:
    from ..core.settings import DaemonSettings

log = logging.getLogger("handoffd")
# the longest a stop waits for held outcomes being filed by other threads (a late handler that
# just returned, a cancellation): a filing is one write, and a store that is away gives up
HELD_FILING_SECONDS = 10.0
REFILE_MAX_SECONDS = 60.0  # the longest wait between two tries to file a kept outcome
FILING = "filing an answer"  # the kind of the filings' shortages (core.recurring)


class HeldOutcomes:
    """The held outcomes of one daemon's attempts (a part of :class:`.attempts.Attempts`, which
    sets these attributes and defines the four methods below them)."""

    engine: Engine
    settings: DaemonSettings
    scheduler: Scheduler
    cv: threading.Condition
    report: BatchReport
    active: dict[str, Job]
    refiles: dict[str, threading.Timer]  # kept outcomes' next refile (under cv)
    closing: bool  # a stop files what is kept: a failure then hands the claim back
    filing_shortages: recurring.Recurring  # filings failed for a passing shortage

    def _end_attempt(self, job: Job, outcome: Outcome) -> bool:
        raise NotImplementedError  # (Attempts)

    def _forget_job(self, job: Job) -> None:
        raise NotImplementedError  # (Attempts)

    def _late_returned(self, handoff_id: str) -> None:
        raise NotImplementedError  # (Attempts)

    def _work_failed(self, handoff_id: str, exc: Exception) -> None:
        raise NotImplementedError  # (Attempts)

    def saturated(self) -> bool:
        """True while as many answers as there are workers wait to be filed again (a disk that
        refuses them): claiming on would run the whole backlog into kept claims, a timer and a
        claim each, so nothing new starts until one is filed."""
        # counted by the jobs that keep an answer, not by the armed timers: a refile under way
        # has taken its timer down, and a claim slipped in meanwhile (one beyond the bound)
        # (a loop, not sum() of a generator: asked before every claim, that was a call more)
        kept = 0
        for job in list(self.active.values()):
            if job.refile_after:
                kept += 1
        return kept > 0 and kept >= self.scheduler.workers

    def _file(self, job: Job, outcome: Outcome) -> bool:
        """File ``outcome`` (counted: Daemon._count); True when it is kept to be filed again.

        Only the filing of the answer itself is kept and tried again. A feature's filer (a
        delegation parking its parent among its new children) is not: its refile would plan
        again what the failed try made, so its claim is given up as before and the sweep hands
        it back free (the replay adopts the children). Nor is a failure before the answer (an
        artifact a format writes first): the claim is given up the same way, never left to
        lapse and be recovered as a crash."""
        try:
            if outcome.status in self.engine.hooks.filers:
                where = self.engine.file(job.claim, job.dialect, job.specialist, outcome)
            else:
                with refiling(job.claim):
                    where = self.engine.file(job.claim, job.dialect, job.specialist, outcome)
        except NotFiled as exc:
            if exc.errno in SHRINKABLE_ERRNOS:  # too large for this process to write
                return self._file_too_large(job, outcome, exc)
            return self._keep_to_refile(job, outcome, exc)
        except OSError:
            self.engine.backend.abandon(job.claim)  # (given up already when finish failed)
            raise
        if self.filing_shortages.active:  # (a shortage said before: one line says it cleared)
            with recurring.sweeping(self.filing_shortages, self._seconds):
                recurring.ok(FILING)
        if job.refile_after and where is not State.IN_PROGRESS:  # filed at last: no error
            self.report.errors -= 1  # left for a batch's exit code to report
            log.info("handoff %s: filed after its filing failed (its handler ran once)",
                     job.handoff_id)
        elif job.refile_after:
            log.error("handoff %s: its claim was taken over while its filing waited; nothing "
                      "was filed here", job.handoff_id)
        return False

    def _file_too_large(self, job: Job, outcome: Outcome, exc: NotFiled) -> bool:
        """``outcome`` is larger than this process may write (EFBIG: its file size limit,
        ``ulimit -f``), and the claim is still ours: file a small failure in its place
        (PROCESSING_ERROR, not retried: the handler, which ran, would answer as large again).
        Given up and handed back by the sweep, as before, it ran again and again and the
        failure it ended with never said why. When even that failure cannot be written, what
        any failed filing does (:meth:`_file`: kept to refile, or given up)."""
        size = _answer_bytes(outcome)
        message = (f"handoff {job.handoff_id}: the answer ({size} bytes) could not be written: "
                   f"{os.strerror(exc.errno or errno.EFBIG)} (beyond this process's file size "
                   "limit, ulimit -f)")
        log.error("%s; filed as failed instead (its handler does not run again)", message)
        small = self.engine.failure(outcome.started_at or self.engine.clock(),
                                    ErrorCode.PROCESSING_ERROR, message, retryable=False)
        small.executed_by = outcome.executed_by
        try:
            with refiling(job.claim):
                self.engine.file(job.claim, job.dialect, job.specialist, small)
        except NotFiled as again:
            if again.errno in SHRINKABLE_ERRNOS:  # even that: given up, as any failed filing
                self.engine.backend.abandon(job.claim)
                raise
            return self._keep_to_refile(job, small, again)
        except OSError:
            self.engine.backend.abandon(job.claim)  # (given up already when finish failed)
            raise
        return False

    # ------------------------------------------------------------ held outcomes
    def _hold(self, job: Job, outcome: Outcome) -> bool:
        """Keep ``outcome`` and the claim instead of filing it now (True), when filing it would
        put the handoff back in pending/ (a retry, a hand-back), where any process could start
        it beside the handler that still runs. Not when that handler has returned already, nor
        for a claim that is lost (fenced), nor for a finished outcome (the last retry)."""
        if job.fenced or not (job.context.handback or runs_again(
                self.engine, job.claim, job.specialist, outcome)):
            return False
        with self.cv:
            if job.returned:  # it stopped at ctx.cancelled before this thread got here
                return False
            job.held = outcome
        log.warning("handoff %s: stays claimed until its Python handler returns (a thread "
                    "cannot be stopped), so that no process starts its next attempt beside it",
                    job.handoff_id)
        # a cancellation (or a fence) files it at once, not when the handler returns: nothing
        # runs after a cancellation, and a fenced claim protects nothing any more
        job.context.wake_on_cancel(_Release(self, job))
        if job.context.stop_requested:  # (stopped before the line above: nothing woke it)
            self.release(job)
        return True

    def _late_handler_returned(self, job: Job) -> None:
        """On the worker: the handler of ``job``, which ran on past its ended attempt, returned
        at last. The next attempt may start: in this daemon (``late``), and anywhere once the
        outcome kept for it is filed, here and now."""
        with self.cv:
            self._late_returned(job.handoff_id)
            job.returned = True
            outcome = self._take_held(job)
        if outcome is not None:
            log.info("handoff %s: its late Python handler returned; its attempt is filed now",
                     job.handoff_id)
            self._file_held(job, outcome)

    def release(self, job: Job) -> None:
        """``job``'s handler was stopped (a cancel request, a fence) while its outcome is held:
        file it now, on a thread of its own (this is the canceller's or the lease guard's), as
        a cancellation (or, fenced, as a failure the policy retries). A hand-back waits."""
        if job.context.handback:
            return
        with self.cv:
            held = self._take_held(job)
        if held is None:  # (filed already, or being filed)
            return
        outcome = held if job.fenced else self._cancellation(job, held)
        try:
            threading.Thread(target=self._file_held, args=(job, outcome), daemon=True,
                             name=f"release-{job.handoff_id}").start()
        except RuntimeError:  # no thread to spare: file it here
            self._file_held(job, outcome)

    def _cancellation(self, job: Job, held: Outcome) -> Outcome:
        """The CANCELLED outcome of a held attempt (its handler still runs) that was cancelled."""
        started = held.started_at or self.engine.clock()
        error = cancelled(job.context)  # (what the watchdog files for a running one)
        outcome = self.engine.failure(started, error.code, str(error), retryable=False)
        return conclude(job, outcome, started, self.engine.hooks.after_run)

    def _take_held(self, job: Job) -> Outcome | None:
        """``job``'s held outcome, taken to be filed by the caller (once: whoever takes it
        first), or None (called under ``cv``)."""
        outcome, job.held = job.held, None
        if outcome is not None:
            job.ending = True  # being filed: no hand-back, no fence from here on
        return outcome

    def _file_held(self, job: Job, outcome: Outcome) -> None:
        """File the outcome taken from ``job.held`` (once: whoever took it), then forget the job
        (unless its filing failed and it is kept again). An outcome kept after a failed filing
        is filed as it is (what ended the attempt was applied to it already)."""
        kept = False
        try:
            kept = self._file(job, outcome) if job.refile_after else \
                self._end_attempt(job, outcome)
        except Exception as exc:
            self._work_failed(job.handoff_id, exc)
        finally:
            if not kept:
                self._forget_job(job)
            with self.cv:  # a batch, or a stop, may wait for the last held one (not per job:
                self.cv.notify_all()  # waking the main loop for every filing cost a drain 10%)

    def file_all_held(self, wait: float = HELD_FILING_SECONDS) -> None:
        """File every kept outcome, as this daemon stops (its handlers' threads end with the
        process), and wait up to ``wait`` seconds for those being filed on other threads: once
        every task has ended, the jobs still active are exactly those. A failed filing hands
        its claim back now (:meth:`_keep_to_refile`)."""
        with self.cv:
            self.closing = True
            for timer in self.refiles.values():
                timer.cancel()
            self.refiles.clear()
            kept = [(job, self._take_held(job)) for job in list(self.active.values())]
        for job, outcome in kept:
            if outcome is not None:
                self._file_held(job, outcome)
        deadline = time.monotonic() + wait
        with self.cv:
            while self.active and time.monotonic() < deadline:
                self.cv.wait(max(min(deadline - time.monotonic(), 1.0), 0.0))
            left = sorted(self.active)
            self.closing = False  # (a daemon may run another batch)
        if left:
            log.error("stopping with %d handoff(s) still being filed: %s; the sweep recovers "
                      "them", len(left), ", ".join(left[:10]))

    # ------------------------------------------------------------ refiling
    def _keep_to_refile(self, job: Job, outcome: Outcome, exc: NotFiled) -> bool:
        """``outcome``'s filing failed for a passing reason (a full disk) before anything was
        written; the claim is still ours. Keep it (True: the job stays active, its lease renewed)
        and file the same outcome again on a timer, after ``RETRY_LOOK_SECONDS`` and then twice
        as long each time, up to a minute: the handler, which has run, does not run again. When
        this daemon stops (False), hand it back (:meth:`_hand_back_unfiled`)."""
        with self.cv:
            closing = self.closing
            first = not job.refile_after
            if not closing:
                job.held = outcome
                job.refile_after = RETRY_LOOK_SECONDS if first else \
                    min(job.refile_after * 2, REFILE_MAX_SECONDS)
                self._start_refile(job)
        if first:  # (a batch that ends with it unfiled exits non-zero, and says so)
            self.report.errors += 1
        if closing:
            self._hand_back_unfiled(job, outcome, exc)
            return False
        self._say_kept(job, exc)
        if first:  # a cancellation files it cancelled at once (the handler is done anyway)
            job.context.wake_on_cancel(_Release(self, job))
        if job.context.stop_requested and not job.fenced and not job.context.handback \
                and (outcome.error or {}).get("code") != ErrorCode.CANCELLED:
            # cancelled while this try was under way (its waker found nothing held then, and
            # fires once): file the cancellation now, or the next try files the answer
            self.release(job)
        return True

    def _say_kept(self, job: Job, exc: NotFiled) -> None:
        """Say that ``job``'s filing failed and its answer is kept: an ERROR at each try (a full
        disk). A passing shortage of descriptors or memory is one WARNING naming the limit, for
        every kept answer, held back while filings run short, and a "filing an answer works
        again" line once one is filed (it was an ERROR with a bare "[Errno 24]" at every try
        of every kept answer)."""
        msg = "handoff %s: %s; its claim is kept and the filing tried again in %gs (the " \
              "handler does not run again)"
        if not is_shortage(exc):
            log.error(msg, job.handoff_id, exc, job.refile_after)
            return
        with recurring.sweeping(self.filing_shortages, self._seconds):
            recurring.error(FILING, exc, msg, job.handoff_id, _not_filed(exc), job.refile_after)

    def _seconds(self) -> float:
        """The engine's clock, in seconds (what the filings' shortages are timed by)."""
        return self.engine.clock().timestamp()

    def _hand_back_unfiled(self, job: Job, outcome: Outcome, exc: OSError) -> None:
        """As this daemon stops, ``job``'s kept ``outcome`` failed its last try: hand the claim
        back to pending/ now (its handler runs again) as a stop hands back an interrupted
        attempt: uncounted, then counted after ten in a row (:func:`.handbacks.hand_back`: a
        disk that refuses every answer must not rerun a handler at every batch for ever).
        Left given up, another process's recovery would take it for a crash (an attempt
        charged, the specialist a suspect). When the disk refuses that too, given up."""
        try:
            returned = handbacks.hand_back(self.engine, job, outcome)
        except Exception as again:  # (the requeue gave the claim up already on an OSError)
            self.engine.backend.abandon(job.claim)
            log.error("handoff %s: %s; stopping, and it cannot be handed back either (%s): "
                      "the next sweep recovers it", job.handoff_id, _not_filed(exc), again)
            return
        if returned is State.IN_PROGRESS:
            log.error("handoff %s: %s; stopping: its claim was taken over meanwhile; nothing "
                      "was handed back here", job.handoff_id, _not_filed(exc))
            return
        if returned is State.PENDING:
            self.report.handed_back += 1
        log.error("handoff %s: %s; stopping: %s (its handler runs again)", job.handoff_id,
                  _not_filed(exc),
                  "handed back to pending/" if returned is State.PENDING else "counted as an "
                  "attempt, as a stop in a run of them is")

    def _start_refile(self, job: Job) -> None:
        """Arm ``job``'s next refile (called under ``cv``)."""
        armed = self.refiles.get(job.handoff_id)
        if armed is not None:  # (a cancellation's filing failed too: one timer is enough)
            armed.cancel()
        timer = threading.Timer(job.refile_after, self._refile, args=(job,))
        timer.daemon = True
        timer.name = f"refile-{job.handoff_id}"
        self.refiles[job.handoff_id] = timer
        timer.start()

    def _refile(self, job: Job) -> None:
        """On a timer: file the outcome kept for ``job`` again (unless a cancellation, a late
        handler's return or a stop took it meanwhile: whoever takes it files it, once). A claim
        whose lease could not be renewed for most of a lease (the disk is full for its lease
        writes too) is given up before it lapses: handed back free, not recovered as a crash."""
        with self.cv:
            if self.refiles.get(job.handoff_id) is threading.current_thread():
                del self.refiles[job.handoff_id]
            outcome = self._take_held(job)
        if outcome is None:
            return
        unrenewed = time.monotonic() - job.renewed_at
        if unrenewed > FENCE_FRACTION * self.settings.lease_seconds:
            log.error("handoff %s: its lease could not be renewed for %.1fs while its filing "
                      "waited; given up: the sweep hands it back to pending/ (its handler runs "
                      "again)", job.handoff_id, unrenewed)
            try:
                self.engine.backend.abandon(job.claim)
            finally:
                self._forget_job(job)
                with self.cv:
                    self.cv.notify_all()
            return
        self._file_held(job, outcome)


class _Release:
    """Woken when a held attempt's context is stopped (:meth:`HandlerContext.stop`): files it
    (:meth:`HeldOutcomes.release`)."""

    def __init__(self, attempts: HeldOutcomes, job: Job) -> None:
        self.attempts = attempts
        self.job = job

    def set(self) -> None:
        """The attempt was stopped: a cancel request, a fence, or the daemon stopping."""
        self.attempts.release(self.job)


def _not_filed(exc: OSError) -> str | OSError:
    """A failed filing as its lines say it: a passing shortage by its message alone, which
    names the limit (its "[Errno 24]" said nothing more); anything else as it was."""
    return exc.strerror if is_shortage(exc) and exc.strerror else exc


def _answer_bytes(outcome: Outcome) -> int:
    """About how many bytes ``outcome``'s answer takes (its JSON text, without the request)."""
    parts = [outcome.output, outcome.artifacts, outcome.validation, outcome.metadata,
             outcome.next_steps, outcome.warnings, outcome.error, outcome.fields]
    try:
        return len(json.dumps(parts, default=str, ensure_ascii=False).encode("utf-8", "replace"))
    except (TypeError, ValueError, RecursionError):  # (a handler's output was checked already)
        return 0
