"""Block until a handoff is terminal, woken by the backend's wake-up feed (not a polling sleep)."""
from __future__ import annotations

import contextlib
from typing import Any

from ..backends.base import WaitStop, wait_via_feed
from ..core.states import State
from ..core.storage import Backend

__all__ = ["WaitStop", "awaiting_answer", "wait_terminal"]


def wait_terminal(backend: Backend, handoff_id: str, timeout: float | None = None,
                  *, grace_not_found: float = 0.0,
                  or_awaiting: bool = False,
                  stop: WaitStop | None = None) -> tuple[State, dict[str, Any]]:
    """Return ``(state, document)`` once ``handoff_id`` is completed or failed, or (with
    ``or_awaiting``) once it waits in pending/ for its requester's answer (needs_clarification
    or blocked: seed 000 reports those up at once). The state is its folder's; the document is
    the store's trusted view (a foreign filing's block is not handoffd's).

    Raises WaitTimeout after ``timeout`` seconds (or once ``stop`` is set), NotFound if the id
    does not exist (after ``grace_not_found`` seconds, for a document a producer is about to
    drop).
    """
    # a store that can be away (PostgreSQL) holds the wait to its timeout even then: its
    # reconnect window (a minute) must not outlast `handoff wait --timeout 5`
    waiting = getattr(backend, "waiting", None)
    within = waiting(handoff_id, timeout) if callable(waiting) else contextlib.nullcontext()
    with within:
        return wait_via_feed(backend, handoff_id, timeout, grace_not_found=grace_not_found,
                             until=awaiting_answer if or_awaiting else None, stop=stop)


def awaiting_answer(state: State, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The ``handoffd.awaiting`` block of a handoff parked until its requester answers. ``doc``
    is a trusted view (what ``Backend.get`` returns): a pending document dropped with a forged
    ``awaiting`` asks nobody anything."""
    block = doc.get("handoffd")
    awaiting = block.get("awaiting") if isinstance(block, dict) else None
    return awaiting if state is State.PENDING and isinstance(awaiting, dict) else None
