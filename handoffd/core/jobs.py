"""What the engine hands its callers about one handoff: a :class:`Job` (claimed, admitted, ready
to run) and a :class:`Peek` (a pending document read without a claim, for the scheduler)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from .documents import Envelope, Outcome
from .errors import ErrorCode, InvalidDocument, UnreadableDocument
from .formats import Dialect
from .memorystrikes import out_of_memory
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
    # its claim's id (a job keeps its claim): asked about ten times a handoff, a call each as a
    # property
    handoff_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.handoff_id = self.claim.id

    def let_go(self) -> None:
        """This process is done with the attempt: drop what refers back to the job (its
        :attr:`takeover`, and what its context wakes at a cancellation: the watchdog's watch, a
        held outcome's release), so that reference counting frees it and its document at once.
        Each made a reference cycle, for every attempt a daemon's worker ran, that only CPython's
        cyclic collector freed (at its next pass: a serving daemon held 165-520 MB with a lazier
        collector while its handlers failed)."""
        self.takeover = None
        self.context.forget_wakers()


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
