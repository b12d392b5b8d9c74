"""What a daemon run (batch or serve) filed: the summary line and the exit code come from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backends.files.repair import UNLEASED_REASON
from ..core.documents import book
from ..core.states import State
from .sweeper import SweepReport

if TYPE_CHECKING:
    from ..core.storage import Backend

# how long the end-of-batch count of takeovers still pending may wait for a store that is away
SETTLE_GRACE_SECONDS = 2.0
# the ids of taken-over claims a run's report keeps, to say which are still pending as it ends
# (one read each: a spread batch's processes' lists merged are cut to it too)
RECOVERED_IDS_KEPT = 1_000


@dataclass
class BatchReport:
    """Counts of what a run (batch or serve) filed, for the summary line and exit code."""

    completed: int = 0
    failed: int = 0
    retrying: int = 0
    # requeued by seed 000's THROTTLED (the specialist too busy to start): no attempt, no
    # retry; still pending, tried again later
    throttled: int = 0
    # claims this run's sweeps took over from a dead (or stalled) claimer: their retry is not
    # counted in ``retrying`` (it is no failed attempt of this run's; what it ends as is counted
    # where it is filed: completed, failed, or pending again for a retry still to come)
    recovered: int = 0
    # the ids of those claims (merged from a spread batch's processes), and how many of them
    # are still pending as the run ends with no attempt since their takeover: a retry still to
    # come (its retry delay not over, or the batch's end came first), set by
    # :meth:`settle_recovered`. Said in ``recovered N``'s parentheses: counted there alone, a
    # takeover whose retry was still to come read as one that finished
    recovered_ids: list[str] = field(default_factory=list)
    recovered_pending: int | None = 0  # (None: the store could not be read to tell)
    handed_back: int = 0
    unroutable: set[str] = field(default_factory=set)
    waiting: dict[str, str] = field(default_factory=dict)
    sweep: SweepReport | None = None
    error: str | None = None  # set when the main loop died (the exit code is then non-zero)
    stalls: int = 0  # times the progress watchdog had to reset the scheduler
    # handoffs a worker could not handle for a passing reason (a full disk, EACCES), left where
    # they were for the next look (a batch exits non-zero: they wait for the next run)
    errors: int = 0
    # forked processes of this run (service.spread) that ended without a report, or were
    # stopped for running too long past its end, and how
    lost: list[str] = field(default_factory=list)
    # unreadable leftovers the run's sweeps moved to the quarantine (files: junk, or a document
    # over the size bound, left in in-progress/), the first sweep's and every later one's
    set_aside: int = 0
    # ids counted in handed_back for a shortage and still pending when the run ended (set by
    # Attempts.settle_handed_back; merged, an id handed back by two processes of a batch is
    # here twice): a batch's end counts again those a sibling took since (service.spread)
    backed_off: list[str] = field(default_factory=list)

    def needs_a_look(self) -> bool:
        """Something an operator should hear of even from a quiet cron batch."""
        return bool(self.failed or self.handed_back or self.error or self.stalls or self.lost
                    or self.errors or self.set_aside)

    def line(self) -> str:
        """The one-line summary ``handoffd run`` and ``serve`` print."""
        text = (f"completed {self.completed}, failed {self.failed}, retry scheduled "
                f"{self.retrying}")
        if self.throttled:
            text += f", throttled {self.throttled} (deferred, no attempt counted)"
        if self.recovered:
            text += f", recovered {self.recovered} (taken over from a dead or stalled claimer"
            if self.recovered_pending is None:
                text += "; whether it ran again is unknown: the store could not be read"
            elif self.recovered_pending:
                # (only the first RECOVERED_IDS_KEPT takeovers are looked at)
                least = "at least " if len(self.recovered_ids) < self.recovered else ""
                text += f"; {least}{self.recovered_pending} back in pending/, not run again yet"
            text += ")"
        if self.handed_back:
            text += f", handed back {self.handed_back}"
        if self.unroutable:
            text += f", left pending with no specialist {len(self.unroutable)}"
        if self.waiting:
            text += f", waiting {len(self.waiting)}"
        if self.errors:
            text += f", {self.errors} error(s) (left where they were, for the next look)"
        if self.set_aside:
            text += (f", set aside {self.set_aside} unreadable document(s) (handoff ls --state "
                     "quarantined)")
        if self.stalls:
            text += f", scheduler reset {self.stalls} time(s)"
        if self.lost:
            text += f"; {len(self.lost)} process(es) ended without a report or were stopped"
        if self.error:
            text += f"; main loop died: {self.error}"
        return text

    def settle_recovered(self, backend: "Backend") -> None:
        """Count in :attr:`recovered_pending` the claims taken over (:attr:`recovered_ids`)
        that are still pending with no attempt since their takeover (a retry delay, a
        hand-back), as read from ``backend`` now (once, as a batch ends: a sibling process of a
        spread batch may have run one). A takeover run again in this run is counted where it
        was filed instead. Bounded, for a count in a summary line: a store that must be waited
        for (a PostgreSQL outage) is given :data:`SETTLE_GRACE_SECONDS` (``interrupt``: the
        batch is over, and its store closes next), and one that cannot be read makes the count
        unknown (None), said so."""
        interrupt = getattr(backend, "interrupt", None)
        if self.recovered_ids and callable(interrupt):
            interrupt(SETTLE_GRACE_SECONDS)
        pending = 0
        for handoff_id in dict.fromkeys(self.recovered_ids):
            try:
                found = backend.get(handoff_id)
            except Exception:  # (only a count: unknown, said so)
                self.recovered_pending = None
                return
            if found is not None and found[0] is State.PENDING and _untried_since_recovery(
                    found[1]):
                pending += 1
        self.recovered_pending = pending


def _untried_since_recovery(doc: dict[str, Any]) -> bool:
    """True when ``doc`` (a claim this batch recovered) began no attempt since: its history's
    last ``recovered`` event, or the files store's hand-back of a claim whose claimer died
    before its lease (:data:`~handoffd.backends.files.repair.UNLEASED_REASON`: no attempt
    began, and no ``recovered`` is recorded), has no ``claimed`` after it; or it has no history
    at all (a document from outside so handed back, untouched: its bookkeeping is not ours to
    write). Any other hand-back may end an attempt that ran (a stop's, ``interrupted``): the
    ``claimed`` before it decides."""
    history = book(doc).get("history")
    if not isinstance(history, list) or not history:
        return True
    for entry in reversed(history):
        if not isinstance(entry, dict):
            continue
        event = entry.get("event")
        if event == "claimed":
            return False
        if event == "recovered":
            return True
        if event == "handed_back":
            detail = entry.get("detail")
            if isinstance(detail, dict) and detail.get("reason") == UNLEASED_REASON:
                return True
    return False
