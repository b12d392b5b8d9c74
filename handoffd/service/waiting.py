"""Block until a handoff is terminal, woken by filesystem events (not a polling sleep)."""
from __future__ import annotations

import threading
import time
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from ..backends.files.store import Store
from ..core.errors import InvalidDocument, NotFound, WaitTimeout
from ..core.states import State

SAFETY_RECHECK_SECONDS = 2.0  # events are hints: look again now and then regardless


class _Wake(FileSystemEventHandler):
    def __init__(self, name: str, event: threading.Event) -> None:
        self.name, self.event = name, event

    def on_any_event(self, event: FileSystemEvent) -> None:
        for path in (event.src_path, getattr(event, "dest_path", "")):
            if str(path).endswith(self.name):
                self.event.set()


def wait_terminal(store: Store, handoff_id: str, timeout: float | None = None,
                  *, grace_not_found: float = 0.0) -> tuple[State, dict[str, Any]]:
    """Return ``(state, document)`` once ``handoff_id`` is completed or failed.

    Raises WaitTimeout after ``timeout`` seconds, NotFound if the id does not exist (after
    ``grace_not_found`` seconds, for a document a producer is about to drop).
    """
    wake = threading.Event()
    observer = Observer()
    handler = _Wake(f"{handoff_id}.json", wake)
    for state in (State.COMPLETED, State.FAILED):
        observer.schedule(handler, str(store.ws.state_dir(state)), recursive=False)
    observer.daemon = True
    observer.start()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    try:
        while True:
            wake.clear()
            try:
                state, doc = store.get(handoff_id)
                if state.terminal:
                    return state, doc
            except NotFound:
                if time.monotonic() - start >= grace_not_found:
                    raise
            except InvalidDocument:
                pass  # a producer is still writing it into pending/: keep waiting
            remaining = SAFETY_RECHECK_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"handoff {handoff_id} is still not finished after {timeout:g}s; "
                                  "wait again or check `handoff show`", handoff_id=handoff_id)
            wake.wait(min(remaining, SAFETY_RECHECK_SECONDS))
    finally:
        observer.stop()
        observer.join(timeout=2)
