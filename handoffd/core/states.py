"""The handoff state machine: four folders, the moves allowed between them, and who wins a tie.

The folder a document is in is the truth about its state. A crash between the two steps of a move
(write the new copy, remove the old) can leave a handoff in two folders; :func:`winner` decides which
copy is real: a completed copy, else the higher trusted ``handoffd.revision`` (every transition
increments it; see :mod:`handoffd.backends.files.seals`), and on equal revisions the state further along.
"""
from __future__ import annotations

from enum import Enum


class State(str, Enum):
    """A handoff state; ``value`` is the folder name under ``handoffs/``."""

    PENDING = "pending"
    IN_PROGRESS = "in-progress"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def status(self) -> str:
        """The document ``status`` value seed 001 uses for this state."""
        return {"in-progress": "in_progress"}.get(self.value, self.value)

    @property
    def terminal(self) -> bool:
        """Completed and failed handoffs are finished (failed ones may be retried by hand)."""
        return self in (State.COMPLETED, State.FAILED)


# each state's value (its folder's name) by a lookup: Enum's ``value`` is a property, two Python
# calls in CPython 3.11, and the filing of every handoff asks for several
FOLDER_NAMES: dict[State, str] = {state: state.value for state in State}
# the finished states, as ``State.terminal`` says (a set to look in: no property to call)
TERMINAL: frozenset[State] = frozenset({State.COMPLETED, State.FAILED})

ORDER = {State.PENDING: 0, State.IN_PROGRESS: 1, State.FAILED: 2, State.COMPLETED: 3}

TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.IN_PROGRESS, State.FAILED}),
    State.IN_PROGRESS: frozenset({State.COMPLETED, State.FAILED, State.PENDING}),
    State.FAILED: frozenset({State.PENDING}),
    State.COMPLETED: frozenset(),
}


def allowed(src: State, dst: State) -> bool:
    """True when the lifecycle permits moving a handoff from ``src`` to ``dst``."""
    return dst in TRANSITIONS[src]


def winner(copies: list[tuple[State, int]]) -> int:
    """Index of the copy that is real among ``(state, revision)`` pairs of one handoff.

    A completed copy always wins: nothing leaves completed/, so any other copy beside it is a
    leftover or an intruder, whatever revision it claims."""
    return max(range(len(copies)), key=lambda i: (copies[i][0] is State.COMPLETED, copies[i][1],
                                                  ORDER[copies[i][0]]))


class Status(str, Enum):
    """An outcome's ``status``: what a handler reports (the first six) and what the engine
    files. Defined once; the sets below say which ones mean what."""

    COMPLETED = "completed"
    PARTIAL = "partial"
    FAILED = "failed"
    BLOCKED = "blocked"
    NEEDS_CLARIFICATION = "needs_clarification"
    DELEGATED = "delegated"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    THROTTLED = "throttled"  # seed 000: the receiver is overloaded, try later

    def __str__(self) -> str:
        return self.value


# filed in completed/ (the rest in failed/, or parked back in pending by orchestration)
SUCCEEDED: frozenset[str] = frozenset({Status.COMPLETED, Status.PARTIAL})
# what a handler's result may say (timeout and cancelled are the engine's verdicts)
RESULT_STATUSES: frozenset[str] = frozenset({
    Status.COMPLETED, Status.PARTIAL, Status.FAILED, Status.BLOCKED, Status.NEEDS_CLARIFICATION,
    Status.DELEGATED, Status.THROTTLED})
# results that park the handoff until someone answers or its children finish (orchestration)
PARKED: tuple[Status, ...] = (Status.DELEGATED, Status.NEEDS_CLARIFICATION, Status.BLOCKED)
# an outcome status a dialect can show as it is (every other failure is "failed" with a code)
REPORTED: frozenset[str] = frozenset({
    Status.COMPLETED, Status.PARTIAL, Status.TIMEOUT, Status.CANCELLED, Status.BLOCKED,
    Status.NEEDS_CLARIFICATION})
