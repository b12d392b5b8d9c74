"""Block until a handoff is terminal, woken by the backend's wake-up feed (not a polling sleep)."""
from __future__ import annotations

from typing import Any

from ..backends.base import wait_via_feed
from ..core.states import State
from ..core.storage import Backend


def wait_terminal(backend: Backend, handoff_id: str, timeout: float | None = None,
                  *, grace_not_found: float = 0.0) -> tuple[State, dict[str, Any]]:
    """Return ``(state, document)`` once ``handoff_id`` is completed or failed.

    Raises WaitTimeout after ``timeout`` seconds, NotFound if the id does not exist (after
    ``grace_not_found`` seconds, for a document a producer is about to drop).
    """
    return wait_via_feed(backend, handoff_id, timeout, grace_not_found=grace_not_found)
