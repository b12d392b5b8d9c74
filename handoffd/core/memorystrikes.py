"""Running out of memory reading one document: "not now", not "never".

A MemoryError while reading (or admitting) a document within max_document_bytes says the
daemon's memory is short (a ``ulimit -v``), not that the document is bad: it stays where it is
and is read again after a back-off; only a document that runs out of memory again and again is
set aside. Kept apart from :mod:`.jobs` so that the files backend's diagnosis
(:mod:`handoffd.backends.files.problems`) loads no more than it needs on a command's quick path.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from .errors import ClaimShortage, ErrorCode, UnreadableDocument

__all__ = ["MemoryStrikes", "claim_out_of_memory", "memory_backoff", "memory_strikes",
           "memory_wait", "out_of_memory"]

# A MemoryError while reading (or admitting) a document within max_document_bytes says "not
# now" (the daemon's memory is short, e.g. under a ulimit -v), not "never": the document stays
# where it is and is read again after a back-off doubling from MEMORY_BACKOFF_SECONDS to
# MEMORY_BACKOFF_MAX_SECONDS. Only when it has run out of memory MEMORY_STRIKES times in a row,
# over MEMORY_PATIENCE_SECONDS at least, is it set aside (UNPROCESSABLE_DOCUMENT): a document
# this daemon can never hold (a hostile one) must not be read for ever. While it backs off, the
# scheduler skips it unread (:func:`memory_backoff`): the others proceed.
MEMORY_STRIKES = 5
MEMORY_PATIENCE_SECONDS = 300.0
MEMORY_BACKOFF_SECONDS = 5.0
MEMORY_BACKOFF_MAX_SECONDS = 60.0
MEMORY_FORGET_SECONDS = 900.0  # a strike this long after the last one starts a new row
MEMORY_TRACKED = 10_000  # documents whose strikes are kept (the oldest forgotten first)
# the stages of a pending document's reading, whose back-off the scheduler waits out (a store's
# recovery, taking an abandoned claim over, has a stage of its own: "recover")
PENDING_STAGES = ("read", "claim", "admit")


class MemoryStrikes:
    """The MemoryErrors in a row met reading each document, by (handoff id, stage): ``read``
    (reading pending/ to route it), ``claim`` (reading it as it is claimed: the claim is put
    back), ``admit`` (validating a claimed one) or ``recover`` (a store's sweep taking an
    abandoned claim over: left for a later sweep). One per process:
    the readers that meet them (a backend's, the engine's) share nothing else. Thread-safe."""

    def __init__(self) -> None:
        self.clock = time.monotonic  # (a test moves it by hand)
        self._lock = threading.Lock()
        # (id, stage) -> (strikes in a row, when the first came, when it may be read again)
        self._rows: OrderedDict[tuple[str, str], tuple[int, float, float]] = OrderedDict()

    def strike(self, handoff_id: str, stage: str) -> tuple[int, float, float]:
        """Count a MemoryError: (strikes in a row, seconds since the first, back-off)."""
        now = self.clock()
        key = (handoff_id, stage)
        with self._lock:
            count, first, until = self._rows.pop(key, (0, now, now))
            if now - until > MEMORY_FORGET_SECONDS:  # (until: the last strike's back-off end)
                count, first = 0, now
            count += 1
            wait = memory_wait(count)
            self._rows[key] = (count, first, now + wait)
            while len(self._rows) > MEMORY_TRACKED:
                self._rows.popitem(last=False)
        return count, now - first, wait

    def clear(self, handoff_id: str, stage: str) -> None:
        """``handoff_id`` was read (``stage``) without running out of memory: a new row."""
        if self._rows:  # (almost always empty: no lock taken per read then)
            with self._lock:
                self._rows.pop((handoff_id, stage), None)

    def backoff(self, handoff_id: str, stages: tuple[str, ...] = PENDING_STAGES) -> float:
        """Seconds until ``handoff_id``, which ran out of memory (at one of ``stages``), is
        read again (0: now)."""
        if not self._rows:
            return 0.0
        now = self.clock()
        with self._lock:
            until = max((self._rows[key][2] for key in ((handoff_id, stage) for stage in stages)
                         if key in self._rows), default=now)
        return max(until - now, 0.0)


memory_strikes = MemoryStrikes()


def memory_wait(count: int) -> float:
    """The memory back-off after ``count`` MemoryErrors in a row: MEMORY_BACKOFF_SECONDS,
    doubling to MEMORY_BACKOFF_MAX_SECONDS."""
    return min(MEMORY_BACKOFF_SECONDS * 2.0 ** min(max(count, 1) - 1, 16),
               MEMORY_BACKOFF_MAX_SECONDS)


def out_of_memory(handoff_id: str, where: str, stage: str = "read") -> UnreadableDocument:
    """The problem of a document (at ``where``) whose reading ran out of memory (a MemoryError
    at ``stage``): transient, read again after a back-off, until it has done so
    MEMORY_STRIKES times in a row over MEMORY_PATIENCE_SECONDS; then set aside for good."""
    count, span, wait = memory_strikes.strike(handoff_id, stage)
    if count >= MEMORY_STRIKES and span >= MEMORY_PATIENCE_SECONDS:
        return UnreadableDocument(
            f"{where} could not be processed: this daemon ran out of memory (MemoryError) "
            f"reading it {count} times in a row over {span / 60:.1f} minutes",
            handoff_id=handoff_id, code=ErrorCode.UNPROCESSABLE_DOCUMENT)
    times = "once" if count == 1 else f"{count} times in a row, backing off {wait:g}s"
    return UnreadableDocument(f"{where} cannot be read now: out of memory (MemoryError, {times})",
                              handoff_id=handoff_id, code=ErrorCode.UNPROCESSABLE_DOCUMENT,
                              transient=True)


def claim_out_of_memory(handoff_id: str, where: str | None = None
                        ) -> ClaimShortage | UnreadableDocument:
    """A MemoryError claiming ``handoff_id`` (reading, copying, marking or encoding it), counted
    as a strike in the ``claim`` stage (:func:`out_of_memory`): the ClaimShortage to raise once
    the store has undone the claim (the document in pending/ as it came, uncounted, claimed again
    after the memory back-off); only at the strikes' bound the UnreadableDocument that sets it
    aside. Every store's claim says it so (the file store's, the memory and PostgreSQL ones': a
    MemoryError there once reached the worker's "unexpected error", with a traceback)."""
    problem = out_of_memory(handoff_id, where or f"pending/{handoff_id}.json", "claim")
    if not problem.transient:
        return problem
    return ClaimShortage(f"handoff {handoff_id}: cannot be claimed for now: {problem}; it "
                         "stays in pending/, uncounted", handoff_id=handoff_id,
                         reason="MemoryError", delay=memory_strikes.backoff(handoff_id))


# seconds until a handoff whose reading ran out of memory is read again (0: now): the strikes'
# own method (asked for every pending id a scheduler reads, so no call of its own around it)
memory_backoff = memory_strikes.backoff
