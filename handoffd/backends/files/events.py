"""The event log on disk: ``handoffs/.meta/events.jsonl``, one JSON object per line.

Every process of the workspace appends to the same file with a single ``O_APPEND`` write per
event, so lines from concurrent writers never interleave. Past ``max_bytes`` the file is rotated
(``events.jsonl.1`` ... ``.N``, the oldest dropped) under a lock, so two writers never rotate
twice. The lock is waited for briefly (:data:`ROTATE_LOCK_WAIT_SECONDS`): a process holding it
for good (stopped, or not handoffd's) costs a rotation put off, never a stalled writer; the line
is written either way. A rotation that fails is one warning line and is tried again later (with
back-off), and a rotated file's name taken by something that is no regular file (a folder...)
is moved to the quarantine so that the log can rotate.

Readers skip a line they cannot parse (a torn last line after a crash, one nested deeper than any
event: :func:`~handoffd.backends.files.jsontext.parse_line`), read a file a block at a time (a line
over :data:`MAX_LINE` is skipped unread, never held whole) and at most :data:`max_bytes` +
:data:`MAX_LINE` bytes of each (a file larger than that is not what a rotation leaves: only its
last part is read). They follow the file across rotations by its inode, and from its start again
when it was truncated in place (logrotate's ``copytruncate``, ``: >``): shorter than where they
were, or its first bytes or the bytes just before where they were no longer those they read
(:class:`_Print`; a newline just before the cursor alone missed a log truncated and written past
the cursor again, and the reader went on from the middle of the new content).
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from ...core import jsontext, ownfiles
from ...core.config import MAX_EVENTS_KEEP
from ...core.errors import ErrorCode
from ...core.events import START, Event, after
from ...core.logs import log
from ...core.workspace import Workspace
from . import logfiles

NAME = "events.jsonl"
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 4
MAX_LINE = 64 * 1024  # a line longer than this is not ours: skipped when read
LOCK_NAME = ".events.lock"
# a follower's cursor keeps the file's first HEAD_PRINT bytes and the BEFORE_PRINT bytes before
# where it stopped (a line or two of ours: a time to the millisecond, an id) and compares them at
# each poll, two small reads, to tell the file it read from one truncated and written again
HEAD_PRINT, BEFORE_PRINT = 64, 256
# how long a writer waits for another's rotation: a rotation holds the lock for a few renames,
# so a lock held longer is held by a stopped or foreign process (the rotation is put off)
ROTATE_LOCK_WAIT_SECONDS = 0.25
# after a rotation failed, none is tried for this long, doubled at each failure up to the last
FIRST_RETRY_SECONDS, LAST_RETRY_SECONDS = 1.0, 60.0


class FileEventLog:
    """The workspace's event log (see the module docstring)."""

    def __init__(self, workspace: Workspace, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep: int = DEFAULT_KEEP) -> None:
        self.path = workspace.meta / NAME
        self.max_bytes = max(int(max_bytes), 4096)
        # bounded: the rotation walks keep names ([daemon] events_keep = 1e10 once stalled it)
        self.keep = min(max(int(keep), 1), MAX_EVENTS_KEEP)
        self.quarantine = workspace.quarantine  # where a rotated file's name taken is moved
        self._mutex = threading.Lock()  # the threads of a process share one descriptor
        self._out = logfiles.Appender(self.path)  # kept open (see append)
        self._rotating = threading.Lock()  # one rotation at a time in this process
        self._retry_at = 0.0  # (monotonic) no rotation is tried before this, after a failure
        self._backoff = 0.0
        self._warned = False  # a failed rotation was said (once, until one succeeds)

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
        and its write always did (tail() finishes the rotated file first). A rotation that
        cannot be done now is never this append's failure (see :meth:`_rotate_or_say`)."""
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode("utf-8")
        with self._mutex:
            info = self._out.ready()
            # not write_line: without a lock across processes a stat can see another writer's
            # line half-way (a size updated page by page), and a torn line would be "mended"
            # with a blank one; the log is a view, and a crash's torn line costs one event
            os.write(self._out.fd, line)
        if info.st_size + len(line) > self.max_bytes:
            self._rotate_or_say()

    def _rotate_or_say(self) -> None:
        """Rotate the file, unless a rotation failed a moment ago (back-off) or another thread
        of this process is at it. A failure (the lock held past its wait, a rename refused) is
        one warning line until a rotation succeeds again; the file grows meanwhile."""
        if time.monotonic() < self._retry_at or not self._rotating.acquire(blocking=False):
            return
        try:
            try:
                self._rotate()
            except OSError as exc:
                self._backoff = min(max(self._backoff * 2, FIRST_RETRY_SECONDS),
                                    LAST_RETRY_SECONDS)
                self._retry_at = time.monotonic() + self._backoff
                if not self._warned:
                    self._warned = True
                    log.warning("cannot rotate the event log %s (%s); events are still written "
                                "and it grows past events_max_bytes until a later rotation "
                                "succeeds", _shown(self.path), _why(exc))
                return
            self._backoff, self._retry_at, self._warned = 0.0, 0.0, False
        finally:
            self._rotating.release()

    def _rotate(self) -> None:
        """Shift the rotated files by one and make the file the newest of them, under the
        rotation's lock (waited for :data:`ROTATE_LOCK_WAIT_SECONDS` at most: LockHeld)."""
        from .quarantine import (
            clear_planted,  # (a folder at the lock's name: it never rotated)
        )
        clear_planted(self.path.with_name(LOCK_NAME))
        with logfiles.locked(self.path.with_name(LOCK_NAME), wait=ROTATE_LOCK_WAIT_SECONDS):
            try:
                if os.stat(self.path).st_size <= self.max_bytes:
                    return  # another writer rotated it while we waited
            except FileNotFoundError:
                return
            for n in range(1, self.keep + 1):
                self._clear_slot(self.rotated(n))
            for n in range(self.keep - 1, 0, -1):
                if os.path.lexists(self.rotated(n)):
                    os.replace(self.rotated(n), self.rotated(n + 1))
            os.replace(self.path, self.rotated(1))

    def _clear_slot(self, slot: Path) -> None:
        """Move what is at ``slot`` to the quarantine if it is no regular file (a folder there
        made every rename onto it fail, and the log grew without bound): under the rotation's
        lock, so no other rotation moves it too. OSError when it cannot be moved."""
        try:
            if stat.S_ISREG(os.lstat(slot).st_mode):
                return
        except FileNotFoundError:
            return
        from .quarantine import move_to_quarantine, publish_reason
        what = "is not a regular file"
        target = move_to_quarantine(self.quarantine, slot, str(ErrorCode.NOT_A_REGULAR_FILE),
                                    f"{slot.name} {what} (a rotated event log's name)",
                                    publish_reason)
        log.warning("%s %s: moved to %s so that the event log can rotate [%s]", _shown(slot),
                    what, _shown(target), ErrorCode.NOT_A_REGULAR_FILE)

    # ------------------------------------------------------------ reading
    def files(self) -> list[Path]:
        """The files kept, oldest first."""
        older = [self.rotated(n) for n in range(self.keep, 0, -1)]
        return [p for p in older if os.path.lexists(p)] + [self.path]

    def read(self, since: datetime | None = None) -> Iterator[Event]:
        """Every event kept, oldest first (those at or after ``since``), read as it is given:
        a file at a time, a block at a time."""
        for path in self.files():
            for event in self._scan(path, 0, _Mark(), partial=True):
                if since is None or after(event, since):
                    yield event

    def tail(self, cursor: Any = None) -> tuple[list[Event], Any]:
        """Events appended since ``cursor`` (``(inode, offset, at a line's start, first bytes,
        bytes before the offset)``, the last two to tell a truncation; None: from now on)."""
        events: list[Event] = []
        return events, self.tail_into(cursor, events.append)

    def tail_into(self, cursor: Any, take: Callable[[Event], None]) -> Any:
        """:meth:`tail`, each event handed to ``take`` as it is read instead of gathered in a
        list (a first look from :data:`START` reads every file kept: a list of them all took
        hundreds of MB); the cursor to pass next time."""
        if cursor is None:
            return _now_cursor(self.path)
        ino, _ = _stat(self.path)
        mark = _Mark()
        if cursor == START:  # every rotated file, then the current one from its start
            for path in self.files()[:-1]:
                for event in self._scan(path, 0, _Mark()):
                    take(event)
            for event in self._scan(self.path, 0, mark):
                take(event)
            return mark.cursor(ino)
        old_ino, offset, *rest = cursor
        whole = bool(rest[0]) if rest else True
        # (a cursor of an older handoffd, without them: the newline before it is all there is)
        seen = _Print(*rest[1:3]) if len(rest) >= 3 else None
        if old_ino != ino and old_ino:  # rotated: finish the file we were reading first
            for n in range(1, self.keep + 1):
                if _stat(self.rotated(n))[0] == old_ino:
                    for event in self._scan(self.rotated(n), offset, _Mark(), whole=whole,
                                            seen=seen):
                        take(event)
                    break
            offset, whole, seen = 0, True, None
        for event in self._scan(self.path, offset, mark, whole=whole, seen=seen):
            take(event)
        return mark.cursor(ino)

    def _scan(self, path: Path, offset: int, mark: "_Mark", *, whole: bool = True,
              partial: bool = False, seen: "_Print | None" = None) -> Iterator[Event]:
        """The events of ``path``'s complete lines from ``offset``, at most ``max_bytes`` +
        MAX_LINE bytes of it (a file longer than that: its last part), a block at a time.
        ``mark``, once exhausted: the file read, the offset after what was settled, whether
        that is a line's start, and the file's bytes there (:class:`_Print`). ``partial``: an
        unterminated last line too (a torn one).

        ``whole``: ``offset`` was a line's start. The file is read from its start when it was
        truncated in place (logrotate's ``copytruncate``, ``: >``), then maybe written past the
        offset again: it is shorter than ``offset``, its bytes differ from ``seen`` (those read
        last time), or (no ``seen``) it has no newline just before ``offset`` any more. Not
        ``whole`` (inside a line over MAX_LINE being skipped): on to that line's end."""
        try:
            fh = ownfiles.open_reading(path)
        except OSError:  # gone (rotated away meanwhile), or no regular file: nothing of ours
            return
        with fh:
            info = os.fstat(fh.fileno())
            skip = False
            if info.st_size < offset or (offset and seen is not None
                                         and _Print.of(fh.fileno(), offset) != seen):
                offset, seen = 0, None  # truncated (and maybe written past the offset again)
            elif offset:
                if os.pread(fh.fileno(), 1, offset - 1) != b"\n":
                    offset, skip = (0, False) if whole else (offset, True)
                    seen = seen if skip else None
            bound = self.max_bytes + MAX_LINE
            start = max(offset, info.st_size - bound)
            if start > offset:  # into the middle of a line: the rest of it is dropped
                start, skip = start - 1, True  # (from the byte before: a line starting there)
            fh.seek(start)
            lines = logfiles.LineReader(fh, MAX_LINE, limit=bound + 1, skip_first=skip,
                                    partial=partial)
            mark.ino, mark.offset, mark.whole = info.st_ino, start, not skip
            for line in lines:
                if not line.strip():
                    continue
                event = jsontext.parse_line(line)  # None: a torn line or not ours
                if isinstance(event, dict):
                    yield event
            mark.offset, mark.whole = start + lines.consumed, not lines.skipping
            # (nothing new: the print just compared is still the one; else two small reads)
            mark.print = (seen if seen is not None and mark.offset == offset
                          else _Print.of(fh.fileno(), mark.offset))


class _Print(NamedTuple):
    """What a follower read of a file around its cursor: the file's first :data:`HEAD_PRINT`
    bytes and the :data:`BEFORE_PRINT` bytes before the cursor. A file truncated in place and
    written again (to past the cursor or not) has other bytes there: new events, another time
    and id. Two reads of a few hundred bytes at most, whatever the file's size."""

    head: Any = b""  # (Any: read back from a cursor given by the caller)
    before: Any = b""

    @classmethod
    def of(cls, fd: int, offset: int) -> "_Print":
        """The print of the open file ``fd`` for a cursor at ``offset``."""
        try:
            if offset <= HEAD_PRINT + BEFORE_PRINT:  # (one read: the head and what follows)
                return cls(b"", os.pread(fd, offset, 0))
            return cls(os.pread(fd, HEAD_PRINT, 0),
                       os.pread(fd, BEFORE_PRINT, offset - BEFORE_PRINT))
        except OSError:
            return cls(b"", b"")


class _Mark:
    """Where a scan of a file stopped: its inode (0: none was read), the offset after what it
    settled, whether that offset is a line's start (not: inside a line being skipped), and the
    file's bytes there (:class:`_Print`)."""

    def __init__(self) -> None:
        self.ino, self.offset, self.whole = 0, 0, True
        self.print = _Print()

    def cursor(self, ino: int) -> tuple[int, int, bool, bytes, bytes]:
        """The cursor after the scan (``ino``: the file's when it could not be read)."""
        if not self.ino:
            return (ino, 0, True, b"", b"")
        return (self.ino, self.offset, self.whole, self.print.head, self.print.before)


def _now_cursor(path: Path) -> tuple[int, int, bool] | tuple[int, int, bool, bytes, bytes]:
    """A cursor at the end of ``path``: "from now on". At a line's start when the file is
    empty or ends with a newline (else inside a line being written or torn: its rest is
    skipped); with the file's bytes there (:class:`_Print`), all of one open file."""
    try:
        with ownfiles.open_reading(path) as fh:
            info = os.fstat(fh.fileno())
            seen = _Print.of(fh.fileno(), info.st_size)
    except OSError:  # none yet (or no regular file): from its start once there is one
        ino, size = _stat(path)
        return (ino, size, True)  # (no print: the newline before it is checked, as it was)
    whole = info.st_size <= 0 or seen.before.endswith(b"\n")
    return (info.st_ino, info.st_size, whole, seen.head, seen.before)


def _shown(path: Path) -> str:
    """``path`` as a log line names it: from the workspace's ``handoffs/`` folder down."""
    return f"{path.parent.parent.name}/{path.parent.name}/{path.name}"


def _why(exc: OSError) -> str:
    """An OSError in a few words (a LockHeld names the lock and how long it was held)."""
    if isinstance(exc, logfiles.LockHeld):
        return (f"{_shown(Path(exc.filename))} has been held by another process for over "
                f"{exc.seconds:g} s: a stopped or hung one?")
    return f"{exc.strerror or exc}" + (f": {Path(exc.filename).name}" if exc.filename else "")


def _stat(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except FileNotFoundError:
        return 0, 0
    return info.st_ino, info.st_size
