"""Group commit for directory fsyncs: one fsync of a folder covers every rename made before it.

In ``durability = "fsync"`` each filing renames its answer into ``completed/`` (or ``failed/``)
and must fsync that folder before it reports the handoff filed. Workers filing at the same time
each paid a folder fsync of their own, though one fsync makes every rename done before it durable.
Here a caller waits for the first fsync of the folder that *starts* after it asked (one already
running may have begun before its rename), and whoever finds none running starts it: while one
fsync runs, the callers that arrive meanwhile queue up, and the next one covers them all. Nobody
returns before an fsync that began after its own rename has finished, so nothing is reported filed
before it is durable. A failing fsync raises in the caller that ran it; those waiting on it run
their own.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path


class _Folder:
    """Sync generations of one folder: ``started`` counts fsyncs begun, ``done`` the highest
    generation known complete; ``running`` while one is in flight."""

    __slots__ = ("started", "done", "running")

    def __init__(self) -> None:
        self.started = 0
        self.done = 0
        self.running = False


_cv = threading.Condition()
_folders: dict[str, _Folder] = {}


def fsync_dir(path: str | Path) -> None:
    """Make every rename, link and unlink done in ``path`` before this call durable."""
    key = os.fspath(path)
    with _cv:
        folder = _folders.get(key)
        if folder is None:
            folder = _folders[key] = _Folder()
        wanted = folder.started + 1  # the next fsync to start covers our rename; a running one may not
        while folder.done < wanted:
            if folder.running:
                _cv.wait()
                continue
            folder.running = True
            folder.started += 1
            generation = folder.started
            _cv.release()
            try:
                _fsync(key)
            except BaseException:
                _cv.acquire()
                folder.running = False
                _cv.notify_all()
                raise
            _cv.acquire()
            folder.running = False
            folder.done = max(folder.done, generation)
            _cv.notify_all()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def forget() -> None:
    """Drop the state (a forked child starts afresh: no fsync of its parent is its own). Runs in
    the child right after fork: fresh objects, never an acquire of what a parent thread held."""
    global _cv, _folders
    _cv = threading.Condition()
    _folders = {}


os.register_at_fork(after_in_child=forget)
