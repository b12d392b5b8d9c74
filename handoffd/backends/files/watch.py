"""Watchdog hints for the files backend's wake-up feed: a document appearing in a watched folder
(created, linked or renamed in, by any process) becomes ``fire(handoff_id, kind)``. Hints only:
events can be lost, so readers keep looking now and then regardless."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

Fire = Callable[[str, str], None]


class _Handler(FileSystemEventHandler):
    def __init__(self, kinds: dict[str, str], fire: Fire) -> None:
        self.kinds, self.fire = kinds, fire

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type in ("deleted", "opened", "closed_no_write"):
            return
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            path = Path(raw if isinstance(raw, str) else raw.decode(errors="replace"))
            kind = self.kinds.get(str(path.parent))
            if kind is not None and path.name.endswith(".json"):
                self.fire(path.name[:-5], kind)


class FolderWatch:
    """Watch ``folders`` (path -> kind) once started; start and stop are idempotent."""

    def __init__(self, folders: dict[Path, str], fire: Fire) -> None:
        self.folders = folders
        self.fire = fire
        self._lock = threading.Lock()
        self._observer: BaseObserver | None = None

    def start(self) -> None:
        """Start watching (a daemon thread); a folder that cannot be watched is skipped."""
        with self._lock:
            if self._observer is not None:
                return
            observer = Observer()
            handler = _Handler({str(p): k for p, k in self.folders.items()}, self.fire)
            for folder in self.folders:
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    observer.schedule(handler, str(folder), recursive=False)
                except OSError:
                    continue  # the periodic rechecks still see its changes
            observer.daemon = True
            observer.start()
            self._observer = observer

    def stop(self) -> None:
        """Stop watching and wait briefly for the thread."""
        with self._lock:
            observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=2)
