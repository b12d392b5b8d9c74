"""The files backend's wake-up hints: a document appearing in, changing in or leaving a watched
folder (written, linked or renamed by any process) becomes ``fire(handoff_id, kind, settled)``;
lost events become ``fire("", "lost")``. Hints only: events can be lost, so readers keep looking
now and then regardless.

Linux reads inotify directly (:mod:`.inotify`: no delay between the kernel's event and the hint);
other systems use a watchdog observer."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...core.storage import LOST

if TYPE_CHECKING:
    from . import inotify

Fire = Callable[[str, str, bool], None]
RENAMED_OR_CLOSED = ("moved", "closed")  # watchdog event types after which a file is complete


class FolderWatch:
    """Watch ``folders`` (path -> kind) once started; start and stop are idempotent."""

    def __init__(self, folders: dict[Path, str], fire: Fire) -> None:
        self.folders = folders
        self.fire = fire
        self._lock = threading.Lock()
        self._source: Any = None  # inotify.FolderEvents or a watchdog observer

    def start(self) -> None:
        """Start watching (one daemon thread); a folder that cannot be watched is skipped."""
        with self._lock:
            if self._source is not None:
                return
            for folder in self.folders:
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError:
                    continue  # the periodic rechecks still see its changes
            from . import inotify  # loaded by the processes that watch
            self._source = self._inotify() if inotify.available() else self._watchdog()

    def alive(self) -> bool:
        """False when the watch was started and its thread has died, or a folder it needs is
        not watched (a failed add, a folder moved away or removed): see :meth:`rewatch`."""
        with self._lock:
            source = self._source
        if source is None:
            return True
        if hasattr(source, "alive"):  # our inotify reader (a watchdog observer has is_alive)
            return bool(source.alive() and not source.unwatched)
        return bool(source.is_alive() and all(e.is_alive() for e in source.emitters))

    def rewatch(self) -> int | None:
        """Repair a watch that is not :meth:`alive`: None when its thread died (restart it);
        else the folders it watches again now (each failure is said once; ask for a rescan
        when not 0)."""
        with self._lock:
            source = self._source
        if source is None or not hasattr(source, "alive") or not source.alive():
            return None
        again = source.rewatch()
        return None if again is None else int(again)

    def stop(self) -> None:
        """Stop watching and wait briefly for the thread."""
        with self._lock:
            source, self._source = self._source, None
        if hasattr(source, "alive"):
            source.stop()
        elif source is not None:
            source.stop()
            source.join(timeout=2)

    def _on_event(self, kind: str, name: str, settled: bool) -> None:
        if name.endswith(".json"):
            self.fire(name[:-5], kind, settled)

    def _inotify(self) -> "inotify.FolderEvents":
        from . import inotify
        events = inotify.FolderEvents(self.folders, self._on_event,
                                      lambda: self.fire("", LOST, True))
        events.start()
        return events

    def _watchdog(self) -> Any:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        kinds = {str(p): k for p, k in self.folders.items()}
        on_event = self._on_event

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.is_directory or event.event_type in ("deleted", "opened", "closed_no_write"):
                    return
                settled = event.event_type in RENAMED_OR_CLOSED
                for raw in (event.src_path, getattr(event, "dest_path", "")):
                    path = Path(raw if isinstance(raw, str) else raw.decode(errors="replace"))
                    kind = kinds.get(str(path.parent))
                    if kind is not None:
                        on_event(kind, path.name, settled)

        observer = Observer(timeout=0.05)
        for folder in self.folders:
            try:
                observer.schedule(Handler(), str(folder), recursive=False)
            except OSError:
                continue
        observer.daemon = True
        observer.start()
        return observer
