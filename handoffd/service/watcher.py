"""Filesystem events as hints: watchdog tells the daemon a pending file may be ready.

Events are never trusted to be complete; the daemon also rescans. An inotify queue overflow
(which watchdog only logs) and a dead observer thread both trigger a full rescan.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

Notify = Callable[[str, float], None]
OVERFLOW_LOGGER = "watchdog.observers.inotify_c"


class _PendingHandler(FileSystemEventHandler):
    def __init__(self, notify: Notify, created_delay: float) -> None:
        self.notify = notify
        self.created_delay = created_delay

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        if isinstance(event, FileMovedEvent):
            path, delay = event.dest_path, 0.0  # renamed into place: complete
        elif isinstance(event, FileClosedEvent):
            path, delay = event.src_path, 0.0  # writer closed it: complete
        else:
            path, delay = event.src_path, self.created_delay  # may still be written
        name = Path(str(path)).name
        if name.endswith(".json"):
            self.notify(name[:-5], delay)


class _OverflowHook(logging.Handler):
    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.on_overflow = on_overflow

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.on_overflow()


class PendingWatcher:
    """Watches ``pending/`` and calls ``notify(handoff_id, delay_seconds)`` on likely arrivals."""

    def __init__(self, folder: Path, notify: Notify, on_lost_events: Callable[[], None],
                 *, created_delay: float = 0.05) -> None:
        self.folder = folder
        self.notify = notify
        self.on_lost_events = on_lost_events
        self.created_delay = created_delay
        self.observer: BaseObserver | None = None
        self.hook = _OverflowHook(on_lost_events)

    def start(self) -> None:
        """Start (or restart) the observer thread."""
        self.stop()
        observer = Observer()
        observer.schedule(_PendingHandler(self.notify, self.created_delay), str(self.folder),
                          recursive=False,
                          event_filter=[FileCreatedEvent, FileMovedEvent, FileClosedEvent])
        observer.daemon = True
        observer.start()
        self.observer = observer
        logging.getLogger(OVERFLOW_LOGGER).addHandler(self.hook)

    def healthy(self) -> bool:
        """False when the observer or one of its emitter threads has died."""
        if self.observer is None or not self.observer.is_alive():
            return False
        return all(e.is_alive() for e in self.observer.emitters)

    def stop(self) -> None:
        """Stop the observer thread if running."""
        logging.getLogger(OVERFLOW_LOGGER).removeHandler(self.hook)
        if self.observer is not None:
            self.observer.stop()
            self.observer.join(timeout=2)
            self.observer = None
