"""Block until a handoff is terminal, woken by the backend's wake-up feed (not a polling sleep).

Wake-ups are hints: the wait looks again every :data:`SAFETY_RECHECK_SECONDS` regardless, so a
watch lost while it waits (a folder moved away, no inotify watches left) costs that much at most,
never a hang; and a feed that cannot be set up at all (no inotify instance or descriptor left:
OSError) is one warning line, and the wait goes on by looking at that interval alone.

Every wait on a workspace (``handoff wait``, the Python client's, MCP's ``wait_handoff``) reads a
shared store through :func:`dropped_here`: a file still being written into the workspace's
pending/ is a handoff on its way, as the files store reads it, not one that does not exist."""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Collection, cast

from ..backends.base import SAFETY_RECHECK_SECONDS, WaitStop, wait_via_feed
from ..core.documents import is_safe_id
from ..core.logs import log  # (deferred: `handoff wait` on a finished handoff logs nothing)
from ..core.states import State
from ..core.storage import Backend, Doc, WakeupCallback

if TYPE_CHECKING:
    from ..core.workspace import Workspace

__all__ = ["DroppedHere", "WaitStop", "awaiting_answer", "dropped_here", "wait_terminal"]


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
        return wait_via_feed(cast(Backend, _PolledWithoutFeed(backend)), handoff_id, timeout,
                             grace_not_found=grace_not_found,
                             until=awaiting_answer if or_awaiting else None, stop=stop)


class _PolledWithoutFeed:
    """``backend`` as :func:`wait_via_feed` uses it (``get``, ``subscribe``), except that a
    wake-up feed that cannot be set up is one warning line and no feed: the wait then looks
    every SAFETY_RECHECK_SECONDS and still ends on time (``handoff wait`` exited with the
    error, and an MCP wait failed, when a machine had no inotify instance left)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)  # (whatever else the wait comes to use)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        """The backend's ``get``."""
        return self._backend.get(handoff_id)

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        """The backend's ``subscribe``; nothing (polling) when it raises OSError."""
        try:
            return self._backend.subscribe(callback, kinds=kinds)
        except OSError as exc:
            log.warning("cannot watch for the handoff's changes (%s); the wait looks again "
                        "every %g s instead", exc.strerror or exc, SAFETY_RECHECK_SECONDS)
            return _nothing


def _nothing() -> None:
    """The unsubscribe of no subscription."""


def dropped_here(store: Backend, ws: "Workspace") -> Backend:
    """``store`` as a wait on the workspace ``ws`` reads it: a :class:`DroppedHere` over a
    shared store (PostgreSQL), ``store`` itself otherwise (a files store's pending/ is the
    workspace's: it sees a file being written there already)."""
    return cast(Backend, DroppedHere(store, ws)) if getattr(store, "shared", False) else store


class DroppedHere:
    """A shared store as a wait reads it: a handoff the database does not hold yet whose file
    is still in this workspace's pending/ (being written, or settling: the bridge's ingest left
    it for later) reads as pending with no document yet, as the files store reads a copy in
    pending/ it cannot read yet. The wait goes on until a daemon's bridge ingests it (or sets it
    aside: its failure stub ends the wait, exit 1), the file goes (not found), or the wait's
    timeout; it ended at once with "not found" (``handoff wait`` exit 3, the client's and MCP's
    waits NotFound)."""

    def __init__(self, store: Backend, ws: "Workspace") -> None:
        self._store = store
        self._ws = ws

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)  # (subscribe, waiting...: the store's own)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        """The store's ``get``; (pending, an empty document) for an id the store does not hold
        while pending/ holds an entry of that name (one lstat)."""
        found = self._store.get(handoff_id)
        if found is None and is_safe_id(handoff_id) \
                and os.path.lexists(self._ws.doc_path(State.PENDING, handoff_id)):
            return State.PENDING, {}
        return found


def awaiting_answer(state: State, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The ``handoffd.awaiting`` block of a handoff parked until its requester answers. ``doc``
    is a trusted view (what ``Backend.get`` returns): a pending document dropped with a forged
    ``awaiting`` asks nobody anything."""
    block = doc.get("handoffd")
    awaiting = block.get("awaiting") if isinstance(block, dict) else None
    return awaiting if state is State.PENDING and isinstance(awaiting, dict) else None
