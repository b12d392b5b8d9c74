"""When a batch process may end: nothing of its own left to run, and nothing the other
processes of its batch (``handoffd run --processes N``) are at work on that its waiters wait
for. What they file reaches its waiters through their shared :mod:`.board`, as its own filings
do (a dependant of a handoff another process completed ran in the next batch, or never).

:class:`BatchEnd` is part of :class:`~handoffd.service.daemon.Daemon` (mixed into it); its
methods run under the scheduler's ``cv``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from ..core.states import State

if TYPE_CHECKING:
    from ..core.engine import Engine
    from .report import BatchReport
    from .scheduler import Scheduler

__all__ = ["BATCH_POLL_SECONDS", "BatchEnd", "Siblings"]

log = logging.getLogger("handoffd")

# a batch process waiting for the others of its batch looks at their board this often
BATCH_POLL_SECONDS = 0.05
# a batch's end that cannot list pending/ looks again every second for this long, then ends
UNLISTED_PATIENCE_SECONDS = 5.0
# a batch that waits longer than this to take abandoned claims over says so in one line
TAKEOVER_QUIET_SECONDS = 1.0
# how much later than the grace (or the lease) it watches for still counts (its timers' slack)
TAKEOVER_SLACK_SECONDS = 0.5


class Siblings(Protocol):
    """The other processes of this one's batch (:class:`.spread.Seat`): what they filed, and
    whether they are at work."""

    def filed(self, handoff_id: str, where: State) -> None:
        """Tell the others of a filing of this process."""

    def news(self) -> list[tuple[str, State]] | None:
        """What the others filed since the last call (None: more than was kept)."""

    def busy(self) -> None:
        """This process is at work (said again at each turn of its loop)."""

    def idle(self) -> None:
        """This process has nothing to run: it waits for the others, or ends."""

    def others_busy(self) -> bool:
        """Another process of the batch is at work (and alive)."""


class BatchEnd:
    """The end of a batch process (mixed into the daemon, which sets what it uses)."""

    engine: "Engine"
    scheduler: "Scheduler"
    siblings: Siblings | None
    report: "BatchReport"
    _idle: bool
    _unlisted_since: float | None = None  # (monotonic) since when its end cannot list pending/
    # (monotonic) since when its end waits to take claims over (None: it does not), when it
    # last swept for them, and whether the main loop is to sweep now (outside ``cv``)
    _takeover_since: float | None = None
    _takeover_swept: float = float("-inf")
    _takeover_said: bool = False  # its wait's line said
    takeover_sweep_due: bool = False
    # its wait ended at its bound with claims due that its sweeps did not take over, or the
    # batch ended at --max-seconds (whatever it was at): the main loop says which, if any, as
    # the batch ends (:meth:`say_takeovers_left`, outside ``cv``)
    takeovers_left_due: bool = False

    def scan(self, *, recheck_waiting: bool = True) -> int:
        """The daemon's listing of pending/ (see :meth:`.daemon.Daemon.scan`)."""
        raise NotImplementedError

    def _batch_end(self, now: float) -> float | None:
        """A batch process with nothing running or due (under ``cv``): None when it may end,
        ``now`` when it found work, else until when it waits for the other processes of its
        batch (:attr:`siblings`).

        Coming from work, it lists pending/ (what arrived meanwhile), as a batch always did. It
        waits on while another process of the batch is at work and a waiter here waits for a
        filing (a pause or a question does not): what the others file wakes the waiters here
        (:meth:`_hear_siblings`), as its own filings do. What nobody in the batch runs (a paused
        dependency, one due later, another daemon's) is left waiting: the batch is bounded by
        its own work (and ``--max-seconds``)."""
        scheduler, seat = self.scheduler, self.siblings
        if not self._idle:
            found = self.scan(recheck_waiting=False)
            if found < 0:  # pending/ could not be listed: not "nothing is pending"
                return self._unlisted(now)
            self._unlisted_since = None
            if found == 0:
                return None  # nothing is pending
            if scheduler.due_soon():
                return now
        if seat is None or not self._awaits_filing():
            return None
        seat.idle()
        self._idle = True
        if seat.others_busy():
            return now + BATCH_POLL_SECONDS
        # what they filed before they fell idle: heard now, or not at all
        return now if self._hear_siblings() else None

    def _takeover_wait(self, now: float) -> float | None:
        """A batch process that may end otherwise (under ``cv``): until when it waits to take
        over the claims its sweeps watch toward a takeover (a PostgreSQL store's: an owner gone,
        or a live owner's lease stale); ``now`` when the main loop is to sweep now
        (:attr:`takeover_sweep_due`); None when it may end. Only a process that watched a claim
        for a whole ``claim_grace_seconds`` on its own clock may take it over, which a batch
        that ended at once never did: every batch left a dead claimer's claim for the next,
        which started watching anew. What it takes over is queued by the sweep and run as any
        other. Bounded: from its first wait, the grace, and ``--max-seconds`` (the main loop's
        deadline)."""
        watch = getattr(self.engine.backend, "takeover_watch", None)
        settings = self.engine.settings
        dues: list[float] = watch(settings.lease_seconds) if callable(watch) else []
        if not dues:
            self._takeover_since = None
            return None
        if self._takeover_since is None:
            self._takeover_since, self._takeover_said = now, False
        bound = self._takeover_since + settings.claim_grace_seconds + TAKEOVER_SLACK_SECONDS
        due = min(dues)
        # swept every sweep period meanwhile, as a serve's sweeps look: an owner whose key is
        # seen held at any of them is watched afresh (R56: a batch that looked only at the
        # first sighting and at the due time took over a live serve whose presence session kept
        # dropping, each look landing on a gap); one already due and still there (its row
        # locked by another claimer, a memory back-off) is looked at a sweep period later
        at = min(due, self._takeover_swept + settings.sweep_seconds, bound)
        if now >= bound and self._takeover_swept >= bound:  # (the last sweep was at the bound)
            self._takeover_since = None
            self.takeovers_left_due = due <= now  # (watched a whole grace, still not taken)
            return None
        if at <= now:
            self.takeover_sweep_due = True
            self._takeover_swept = now
            return now
        wait = min(due, bound, self.scheduler.batch_deadline) - now
        if wait > TAKEOVER_QUIET_SECONDS and not self._takeover_said:
            self._takeover_said = True  # (once a wait)
            log.warning("waiting up to %.0fs to take over %d claim(s) whose owner is gone (a "
                        "claim is taken over only after this process watched it for "
                        "claim_grace_seconds)", wait, len(dues))
        return at

    def say_takeovers_left(self) -> None:
        """A batch that waited for claims to take over ends without some (outside ``cv``):
        one line for each, naming it and why (a row locked by another database session is
        skipped by the takeover), and who takes it over. It ended without a word of them.
        Said once a batch: only PostgreSQL's store has them, which forked processes cannot
        share (no ``forkable``), so its batch runs on one process whatever ``--processes``
        asks (:func:`.spread.processes_for`)."""
        self.takeovers_left_due = False
        left = getattr(self.engine.backend, "takeovers_left", None)
        if not callable(left):
            return
        try:
            claims: list[tuple[str, str]] = left()
        except Exception as exc:  # (only a report: the store away meanwhile, a refusal)
            log.warning("cannot tell which abandoned claims were left for a later batch: %s",
                        exc)
            return
        for handoff_id, why in claims:
            log.warning("handoff %s: its owner is gone but its claim could not be taken over: "
                        "%s; a later batch or `handoffd serve` takes it over", handoff_id, why)

    def _unlisted(self, now: float) -> float | None:
        """pending/ could not be listed at a batch's end: look again in a second, for at most
        :data:`UNLISTED_PATIENCE_SECONDS` in a row (work started meanwhile begins them afresh:
        the main loop clears ``_unlisted_since`` as it dispatches); then end, counted an error (exit 1: what may have
        arrived is not known to be pending or not). It once ended at once, exit 0, as if
        nothing were pending."""
        if self._unlisted_since is None:
            self._unlisted_since = now
        if now - self._unlisted_since < UNLISTED_PATIENCE_SECONDS:
            return now + 1.0
        self._unlisted_since = None
        self.report.errors += 1
        return None

    def _hear_siblings(self) -> bool:
        """Wake the waiters here whose wait what the other processes of the batch filed may
        end, as this process's own filings do (under ``cv``); when more was filed than the
        board keeps, a rescan looks at every waiter again. True when there was news."""
        news = self.siblings.news() if self.siblings is not None else []
        if news is None:
            log.info("more filings of the other processes than their board keeps: rescanning")
            self.scheduler.request_rescan()
            self._idle = False
            return True
        for handoff_id, where in news:
            if where.terminal:
                self.scheduler.ended(handoff_id, failed=where is State.FAILED)
            else:  # (a retry, a parked parent: its attempt ended, what it held is free)
                self.scheduler.wake(handoff_id)
        if news and self.scheduler.due_soon():
            self._idle = False
        return bool(news)

    def _awaits_filing(self) -> bool:
        """A handoff waits here for something a filing may end: not only for a resume or an
        answer (``on=()``), which no process of the batch brings."""
        waits_on = self.scheduler.waits_on
        return any(waits_on.get(hid, True) for hid in self.scheduler.waiting)
