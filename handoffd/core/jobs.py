"""What the engine hands its callers about one handoff: a :class:`Job` (claimed, admitted, ready
to run) and a :class:`Peek` (a pending document read without a claim, for the scheduler)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from .documents import Envelope, Outcome
from .errors import ErrorCode, InvalidDocument, UnreadableDocument
from .formats import Dialect
from .specialists import HandlerContext, Specialist
from .storage import Claim
from .timeutil import utc_now


@dataclass
class Job:
    """A claimed, admitted handoff ready to run."""

    claim: Claim
    dialect: Dialect
    envelope: Envelope
    specialist: Specialist
    context: HandlerContext
    started_at: datetime = field(default_factory=utc_now)
    deadline: datetime | None = None  # when a hard timeout (Envelope.hard_timeout) runs out
    warnings: list[str] = field(default_factory=list)  # unmet expectations, when advisory
    # set when the attempt is being filed or handed back: a lease renewal that fails from then
    # on met the filing (the claim is finished), not another process's takeover
    ending: bool = False
    # when its lease was last extended (time.monotonic(): the claim, then each renewal's start),
    # and whether a daemon stopped its handler for a lease it could not keep (service.leases)
    renewed_at: float = field(default_factory=time.monotonic)
    fenced: bool = False
    # set by a daemon's worker: how an attempt whose Python handler overran (or was cancelled)
    # is finished by another thread while the handler still runs (core.watchdog). It is given
    # the rest of run() as a function returning the outcome to file. Unset, the handler runs in
    # a thread of its own and run() waits for it
    takeover: Callable[[Callable[[], Outcome]], None] | None = None
    # the outcome of an attempt ended while its Python handler runs on, kept with the claim
    # (still renewed) while filing it would start another attempt, in any process, beside that
    # handler: filed when it returns, is cancelled, or the daemon stops (service.attempts)
    held: Outcome | None = None
    returned: bool = False  # that late handler has returned (both set under the daemon's cv)
    # seconds until the outcome in ``held`` is filed again, its filing having failed for a
    # passing reason (a full disk) with the claim kept; 0.0: never failed (service.attempts)
    refile_after: float = 0.0

    @property
    def handoff_id(self) -> str:
        return self.claim.id


@dataclass
class Peek:
    """What the scheduler learns from a pending document without claiming it."""

    handoff_id: str
    target: str | None = None
    priority: int = 2
    due_at: datetime | None = None
    readable: bool = True
    envelope: Envelope | None = None
    doc: dict[str, Any] | None = None
    problem: UnreadableDocument | None = None  # why it is not readable


def unreadable(handoff_id: str, exc: BaseException) -> UnreadableDocument:
    """A routing failure (a :class:`Peek`'s ``problem``) as the daemon acts on it: an invalid
    document is set aside by claiming it; running out of memory is looked at again later
    (:func:`out_of_memory`); anything else a reader chokes on is set aside where it lies."""
    if isinstance(exc, InvalidDocument):
        return UnreadableDocument(str(exc), handoff_id=handoff_id, code=exc.code, claimable=True)
    if isinstance(exc, MemoryError):
        return out_of_memory(handoff_id, f"pending/{handoff_id}.json")
    hint = " (it nests too deeply)" if isinstance(exc, RecursionError) else ""
    return UnreadableDocument(f"pending/{handoff_id}.json could not be processed{hint}: "
                              f"{type(exc).__name__}: {str(exc)[:200]}", handoff_id=handoff_id,
                              code=ErrorCode.UNPROCESSABLE_DOCUMENT)


def out_of_reach(handoff_id: str, exc: OSError) -> UnreadableDocument:
    """A pending document the store could not hand over (a :class:`Peek`'s ``problem``): an
    OSError a backend raised itself rather than describing the document (PostgreSQL's
    StoreUnavailable, the database away past its reconnect window). Transient: the handoff
    stays where it is and is looked at again; setting it aside failed a valid handoff for
    good because the database was restarting."""
    return UnreadableDocument(f"pending/{handoff_id}.json cannot be read now (the store is "
                              f"unreachable: {type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})", handoff_id=handoff_id,
                              code=ErrorCode.STORE_UNAVAILABLE, transient=True)


# ------------------------------------------------------------ running out of memory reading one
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


class MemoryStrikes:
    """The MemoryErrors in a row met reading each document, by (handoff id, stage): ``read``
    (reading pending/ to route it) or ``admit`` (validating a claimed one). One per process:
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
            wait = min(MEMORY_BACKOFF_SECONDS * 2 ** min(count - 1, 16), MEMORY_BACKOFF_MAX_SECONDS)
            self._rows[key] = (count, first, now + wait)
            while len(self._rows) > MEMORY_TRACKED:
                self._rows.popitem(last=False)
        return count, now - first, wait

    def clear(self, handoff_id: str, stage: str) -> None:
        """``handoff_id`` was read (``stage``) without running out of memory: a new row."""
        if self._rows:  # (almost always empty: no lock taken per read then)
            with self._lock:
                self._rows.pop((handoff_id, stage), None)

    def backoff(self, handoff_id: str) -> float:
        """Seconds until ``handoff_id``, which ran out of memory, is read again (0: now)."""
        if not self._rows:
            return 0.0
        now = self.clock()
        with self._lock:
            until = max((self._rows[key][2] for key in ((handoff_id, "read"),
                                                        (handoff_id, "admit"))
                         if key in self._rows), default=now)
        return max(until - now, 0.0)


memory_strikes = MemoryStrikes()


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


def memory_backoff(handoff_id: str) -> float:
    """Seconds until ``handoff_id``, whose reading ran out of memory, is read again (0: now)."""
    return memory_strikes.backoff(handoff_id)
