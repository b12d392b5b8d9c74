"""Hand-backs of attempts a stop interrupted: free a few times in a row, then counted.

A daemon that stops (SIGTERM, ``--max-seconds``) hands back what still runs after
``grace_seconds``, uncounted: an operator's stop must not cost a handoff its retries. But a
handler that signals its own daemon (``os.kill(os.getpid(), SIGTERM)``, a careless
``os.killpg(0, ...)``) and outlasts the grace was handed back at every start, for ever: its
attempt never counted, it was never dead-lettered, its history grew without end.

So the first :data:`FREE_HANDBACKS` hand-backs in a row of a handoff whose handler was running
are free; from the next one on, each such stop counts as a failed attempt under its retry
policy (``PROCESSING_ERROR``, "interrupted by stops N times in a row"), so it is eventually
dead-lettered. The count is read from the handoff's own history, so it holds across processes
and restarts: a ``handed_back`` event with ``interrupted: true`` (its handler ran) or a retry
scheduled for such a stop counts; claims, and hand-backs of attempts that never started, are
skipped; any other event (it finished, failed, was recovered, retried by hand) ends the run.

The sweep's recovery keeps the same count for the claims it hands back uncounted
(:func:`handoffd.service.sweeper.free_handback`: one whose filing failed in its own process,
a parent claimed to aggregate its children when its daemon died): a ``recovered`` event
followed by such a hand-back (or by a retry it counted, with :data:`STOPS`) is part of that
interrupted attempt and does not end the run, so a parent whose aggregation ends its daemon
at every start is counted after :data:`FREE_HANDBACKS` and dead-lettered after its retries.

An attempt whose handler could not be started at all for a passing shortage (descriptors,
processes, memory) is handed back too, with a back-off, by :func:`hand_back_unstarted`: never a
stop (it ran nothing), counted only once such shortages outlast :data:`FREE_SHORTAGES` in a row.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core import recurring
from ..core.documents import Outcome, book
from ..core.errors import ErrorCode
from ..core.states import State

if TYPE_CHECKING:
    from ..core.engine import Engine, Job
    from ..core.starts import NotStarted

# stops in a row that hand a running attempt back for free: an operator's restarts (deploys,
# a sibling process of `serve --processes` stopped after a crash) never cost a retry; a handler
# that ends its own daemon at every start is failed after FREE_HANDBACKS + max_retries + 1 starts
FREE_HANDBACKS = 10
# detail of a ``handed_back`` event: the attempt's work was under way (its handler ran, or a
# parent's aggregation the sweep recovered)
INTERRUPTED = "interrupted"
STOPS = "stops_in_a_row"  # detail of an error filed for a counted stop (or counted recovery)

# An attempt whose handler could not be started for a passing shortage (descriptors, processes,
# memory: :func:`handoffd.core.starts.not_started`) is handed back uncounted, due again after a
# back-off doubling from SHORTAGE_FIRST_SECONDS to SHORTAGE_MAX_SECONDS; its ``handed_back``
# event says why (NOT_STARTED: the errno's name). A shortage that outlasts FREE_SHORTAGES such
# hand-backs in a row (about half an hour) counts each further one as a failed attempt
# (``PROCESSING_ERROR``, detail SHORTAGE_RUN) under the retry policy: the history stays bounded.
NOT_STARTED = "not_started"
# what a handed_back event says instead when the handler had started and was stopped for the
# shortage (its document's feed to its stdin ran out of memory): uncounted, and counted in the
# same run of shortages in a row, but not said "not started" of a child that may have run a while
STDIN_SHORT = "stdin_short"
SHORTAGE_RUN = "shortages_in_a_row"
FREE_SHORTAGES = 30
SHORTAGE_FIRST_SECONDS = 1.0
SHORTAGE_MAX_SECONDS = 60.0
# the kind of a start shortage in a daemon's book of them (core.recurring): one WARNING while
# handlers cannot be started, whichever handoff meets it (it was one line per hand-back of
# each handoff: 16 in 10 s under `ulimit -n 12`), and "starting a handler works again"
STARTING = "starting a handler"
log = logging.getLogger("handoffd")


def interrupted(entry: dict[str, Any]) -> bool:
    """True when history ``entry`` ended an attempt whose work a stop (or a crash the sweep
    hands back for free) interrupted: a free hand-back, or one counted as an attempt."""
    detail = entry.get("detail")
    if not isinstance(detail, dict):
        return False
    if entry.get("event") == "handed_back":
        return detail.get(INTERRUPTED) is True
    if entry.get("event") == "retry_scheduled":
        error = detail.get("error")
        details = error.get("details") if isinstance(error, dict) else None
        return isinstance(details, dict) and STOPS in details
    return False


def stops_in_a_row(doc: dict[str, Any]) -> int:
    """How many interrupted attempts the handoff's history ends with (see the module)."""
    history = book(doc).get("history")
    count = 0
    ended = False  # the entry read before (the next one in time) ended an interrupted attempt
    for entry in reversed(history if isinstance(history, list) else []):
        if not isinstance(entry, dict):
            break
        if interrupted(entry):
            count, ended = count + 1, True
            continue
        event = entry.get("event")
        if event == "recovered" and ended:  # the recovery that handed it back (or counted it)
            ended = False
        elif event in ("claimed", "handed_back"):  # (never started: skipped)
            ended = False
        else:
            break
    return count


def hand_back(engine: Engine, job: Job, outcome: Outcome) -> State:
    """End ``job``'s attempt, which a stopping daemon interrupted while its handler ran:
    handed back uncounted (PENDING), or, after :data:`FREE_HANDBACKS` such stops in a row,
    filed as a failed attempt under its retry policy (where it was filed; the engine's
    listeners hear of it). IN_PROGRESS: the claim was lost meanwhile (its lease lapsed and
    another process took the handoff over), so nothing was written and nothing is to count."""
    streak = stops_in_a_row(job.claim.doc) + 1
    if streak <= FREE_HANDBACKS:
        return engine.requeue(job.claim, job.dialect, "handed_back", reason="daemon stopping",
                              interrupted=True)  # (INTERRUPTED)
    failure = engine.failure(
        outcome.started_at or engine.clock(), ErrorCode.PROCESSING_ERROR,
        f"handoff {job.handoff_id}: interrupted by stops {streak} times in a row: its handler "
        "was still running each time its daemon stopped (a signal, or a batch's --max-seconds; "
        f"after {FREE_HANDBACKS} hand-backs in a row each such stop counts as an attempt); a "
        "handler that signals its own daemon, or always outlasts [daemon] grace_seconds or "
        "--max-seconds, is failed this way",
        retryable=True, details={STOPS: streak})
    return engine.file(job.claim, job.dialect, job.specialist, failure)


def shortages_in_a_row(doc: dict[str, Any]) -> int:
    """How many attempts in a row, at the end of the handoff's history, could not start their
    handler for a passing shortage (handed back, or counted: see :data:`SHORTAGE_RUN`); claims are
    skipped, any other event ends the run."""
    history = book(doc).get("history")
    count = 0
    for entry in reversed(history if isinstance(history, list) else []):
        event = entry.get("event") if isinstance(entry, dict) else None
        detail = entry.get("detail") if isinstance(entry, dict) else None
        if event == "claimed":
            continue
        if not isinstance(detail, dict):
            break
        error = detail.get("error")
        details = error.get("details") if isinstance(error, dict) else None
        counted = isinstance(details, dict) and SHORTAGE_RUN in details
        short = detail.get(NOT_STARTED, detail.get(STDIN_SHORT))
        if (event == "handed_back" and isinstance(short, str)) or (
                event == "retry_scheduled" and counted):
            count += 1
            continue
        break
    return count


def shortage_delay(doc: dict[str, Any]) -> float:
    """The back-off of the next start-shortage hand-back of the claimed document ``doc``
    (:func:`shortage_backoff` of its run of them)."""
    return shortage_backoff(shortages_in_a_row(doc) + 1)


def shortage_backoff(streak: int) -> float:
    """The back-off after the ``streak``-th shortage in a row: doubling from
    SHORTAGE_FIRST_SECONDS, SHORTAGE_MAX_SECONDS at most."""
    return min(SHORTAGE_MAX_SECONDS, SHORTAGE_FIRST_SECONDS * 2.0 ** min(max(streak, 1) - 1, 16))


def hand_back_unstarted(engine: Engine, job: Job, shortage: NotStarted, outcome: Outcome,
                        shortages: recurring.Recurring | None = None) -> State | Outcome:
    """End ``job``'s attempt, whose handler could not be started for a passing ``shortage``:
    handed back uncounted, due again after a back-off (one line naming the limit, held back
    in ``shortages``, the daemon's book of them, while it recurs), and where it went returned
    (IN_PROGRESS: the claim was lost meanwhile, nothing written); after
    :data:`FREE_SHORTAGES` in a row, the failed attempt to file instead (counted)."""
    streak = shortages_in_a_row(job.claim.doc) + 1
    if streak > FREE_SHORTAGES:
        return engine.failure(
            outcome.started_at or engine.clock(), ErrorCode.PROCESSING_ERROR,
            f"{shortage.message}; {streak} times in a row (after {FREE_SHORTAGES} uncounted "
            "hand-backs each counts as an attempt)", retryable=True,
            details={SHORTAGE_RUN: streak, "cannot_start": shortage.reason})
    delay = shortage_delay(job.claim.doc)
    said: dict[str, Any] = {STDIN_SHORT if shortage.after_start else NOT_STARTED: shortage.reason}
    where = engine.requeue(job.claim, job.dialect, "handed_back",
                           due_at=engine.clock() + timedelta(seconds=delay),
                           reason=shortage.message, **said)
    if where is State.PENDING:
        msg = "%s; handed back uncounted, started again in %gs"
        if shortages is None:
            log.warning(msg, shortage.message, delay)
        else:  # the first handoff named; the others are held back with it
            with recurring.sweeping(shortages, lambda: engine.clock().timestamp()):
                shortages.error((STARTING, shortage.reason), engine.clock().timestamp(),
                                msg + "; others short the same way are handed back too",
                                (shortage.message, delay), recurring.WARNING,
                                f"{STARTING}: {shortage.words or shortage.reason}")
    return where


def started_again(shortages: recurring.Recurring, engine: Engine) -> None:
    """A handler started (or failed as its own fault, not for a shortage): the start shortages
    ``shortages`` holds are said cleared once they have stayed away its quiet period."""
    if shortages.active:  # (a shortage said before: one line says it cleared)
        with recurring.sweeping(shortages, lambda: engine.clock().timestamp()):
            recurring.ok(STARTING)
