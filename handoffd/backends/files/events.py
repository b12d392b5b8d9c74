"""The event log on disk: ``handoffs/.meta/events.jsonl``, one JSON object per line.

Every process of the workspace appends to the same file with a single ``O_APPEND`` write per
event, so lines from concurrent writers never interleave. Past ``max_bytes`` the file is rotated
(``events.jsonl.1`` ... ``.N``, the oldest dropped) under a lock, so two writers never rotate
twice. Readers skip a line they cannot parse (a torn last line after a crash, one nested deeper
than any event: :func:`~handoffd.backends.files.fsio.parse_line`) and follow the file across
rotations by its inode (:meth:`FileEventLog.tail`).
"""
from __future__ import annotations

import json
import os
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from ...core.config import MAX_EVENTS_KEEP
from ...core.events import START, Event, after
from ...core.workspace import Workspace
from . import fsio
from .fsio import locked

NAME = "events.jsonl"
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 4
MAX_LINE = 64 * 1024  # a line longer than this is not ours: skipped when read


class FileEventLog:
    """The workspace's event log (see the module docstring)."""

    def __init__(self, workspace: Workspace, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep: int = DEFAULT_KEEP) -> None:
        self.path = workspace.meta / NAME
        self.max_bytes = max(int(max_bytes), 4096)
        # bounded: the rotation walks keep names ([daemon] events_keep = 1e10 once stalled it)
        self.keep = min(max(int(keep), 1), MAX_EVENTS_KEEP)
        self._mutex = threading.Lock()  # the threads of a process share one descriptor
        self._out = fsio.Appender(self.path)  # kept open (see append)

    def rotated(self, n: int) -> Path:
        """The ``n``-th rotated file (1: the newest)."""
        return self.path.with_name(f"{NAME}.{n}")

    # ------------------------------------------------------------ writing
    def append(self, event: Event) -> None:
        """One ``O_APPEND`` write of one line; rotates the file when it grew past max_bytes.

        The file stays open between events (a handoff writes two; opening and closing each
        time doubled the system calls). A stat of the path before each write finds a rotation
        by another process, and the file is reopened; a rotation landing between that stat and
        the write puts the line at the end of the rotated file, as a rotation between an open
        and its write always did (tail() finishes the rotated file first)."""
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode("utf-8")
        with self._mutex:
            info = self._out.ready()
            # not write_line: without a lock across processes a stat can see another writer's
            # line half-way (a size updated page by page), and a torn line would be "mended"
            # with a blank one; the log is a view, and a crash's torn line costs one event
            os.write(self._out.fd, line)
        if info.st_size + len(line) > self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        with locked(self.path.with_name(".events.lock")):
            try:
                if self.path.stat().st_size <= self.max_bytes:
                    return  # another writer rotated it while we waited
            except FileNotFoundError:
                return
            for n in range(self.keep - 1, 0, -1):
                if self.rotated(n).exists():
                    os.replace(self.rotated(n), self.rotated(n + 1))
            os.replace(self.path, self.rotated(1))

    # ------------------------------------------------------------ reading
    def files(self) -> list[Path]:
        """The files kept, oldest first."""
        older = [self.rotated(n) for n in range(self.keep, 0, -1)]
        return [p for p in older if p.exists()] + [self.path]

    def read(self, since: datetime | None = None) -> Iterator[Event]:
        """Every event kept, oldest first (those at or after ``since``)."""
        for path in self.files():
            try:
                with fsio.open_reading(path) as fh:
                    data = fh.read()
            except FileNotFoundError:
                continue  # rotated away while we read the others
            for event in _parse(data):
                if since is None or after(event, since):
                    yield event

    def tail(self, cursor: Any = None) -> tuple[list[Event], Any]:
        """Events appended since ``cursor`` (``(inode, offset)``; None: from now on)."""
        ino, size = _stat(self.path)
        if cursor is None:
            return [], (ino, size)
        if cursor == START:  # every rotated file, then the current one from its start
            older = [e for p in self.files()[:-1] for e in self._read_from(p, 0)[0]]
            more, offset = self._read_from(self.path, 0)
            return older + more, (ino, offset)
        old_ino, offset = cursor
        events: list[Event] = []
        if old_ino != ino and old_ino:  # rotated: finish the file we were reading first
            for n in range(1, self.keep + 1):
                if _stat(self.rotated(n))[0] == old_ino:
                    events += self._read_from(self.rotated(n), offset)[0]
                    break
            offset = 0
        more, offset = self._read_from(self.path, offset)
        return events + more, (ino, offset)

    def _read_from(self, path: Path, offset: int) -> tuple[list[Event], int]:
        """Complete lines of ``path`` from ``offset``, and the offset after the last one."""
        try:
            with fsio.open_reading(path) as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        return list(_parse(data[:end])), offset + end


def _stat(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except FileNotFoundError:
        return 0, 0
    return info.st_ino, info.st_size


def _parse(data: bytes) -> Iterator[Event]:
    for line in data.splitlines():
        if not line.strip() or len(line) > MAX_LINE:
            continue
        event = fsio.parse_line(line)  # None: a torn line (a crash mid-write) or not ours
        if isinstance(event, dict):
            yield event
