"""The event log on disk: ``handoffs/.meta/events.jsonl``, one JSON object per line.

Every process of the workspace appends to the same file with a single ``O_APPEND`` write per
event, so lines from concurrent writers never interleave. Past ``max_bytes`` the file is rotated
(``events.jsonl.1`` ... ``.N``, the oldest dropped) under a lock, so two writers never rotate
twice. The lock is waited for briefly (:data:`ROTATE_LOCK_WAIT_SECONDS`): a process holding it
for good (stopped, or not handoffd's) costs a rotation put off, never a stalled writer; the line
is written either way. A rotation that fails is one warning line and is tried again later (with
back-off), and a rotated file's name taken by something that is no regular file (a folder...)
is moved to the quarantine so that the log can rotate.

Reading and following it (across rotations and truncations) is :mod:`.eventfollow`.

A write that stores only part of its line (a full disk) is an OSError (ENOSPC), and the next
line written starts on a line of its own: glued to the torn one, both were lost.
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

from ...core.config import MAX_EVENTS_KEEP
from ...core.errors import ErrorCode
from ...core.events import Event
from ...core.logs import log
from ...core.workspace import Workspace
from . import logfiles
from .eventfollow import Following, shown_path

NAME = "events.jsonl"
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 4
LOCK_NAME = ".events.lock"
# how long a writer waits for another's rotation: a rotation holds the lock for a few renames,
# so a lock held longer is held by a stopped or foreign process (the rotation is put off)
ROTATE_LOCK_WAIT_SECONDS = 0.25
# after a rotation failed, none is tried for this long, doubled at each failure up to the last
FIRST_RETRY_SECONDS, LAST_RETRY_SECONDS = 1.0, 60.0


# built once (json.dumps given options builds an encoder at every call; encode keeps no state)
_encode_event = json.JSONEncoder(separators=(",", ":"), default=str).encode


class FileEventLog(Following):
    """The workspace's event log (see the module docstring); its reading is
    :class:`.eventfollow.Following`."""

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
        self._gap_warned = False  # a follower's gap was said (once)

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
        cannot be done now is never this append's failure (see :meth:`_rotate_or_say`).
        OSError (ENOSPC) when the disk took only part of the line; this process's next line
        starts a line of its own (:meth:`~.logfiles.Appender.write_line`)."""
        line = (_encode_event(event) + "\n").encode("utf-8")
        with self._mutex:
            info = self._out.ready()
            # a line of ours torn by a full disk was glued to the next one, both lost: the
            # next starts a line of its own. Another process's is not looked for: without a
            # lock across processes a stat can see its line half-way (a size updated page by
            # page), which was "mended" with a blank line, a pread at every line
            self._out.write_line(line, info, look=False)
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
                                "succeeds", shown_path(self.path), _why(exc))
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
        log.warning("%s %s: moved to %s so that the event log can rotate [%s]", shown_path(slot),
                    what, shown_path(target), ErrorCode.NOT_A_REGULAR_FILE)


def _why(exc: OSError) -> str:
    """An OSError in a few words (a LockHeld names the lock and how long it was held)."""
    if isinstance(exc, logfiles.LockHeld):
        return (f"{shown_path(Path(exc.filename))} has been held by another process for over "
                f"{exc.seconds:g} s: a stopped or hung one?")
    return f"{exc.strerror or exc}" + (f": {Path(exc.filename).name}" if exc.filename else "")
