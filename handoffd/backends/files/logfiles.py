"""The append-only files of the store and their locks: the event log, the seen-ids record, the
shared records, the context history and the violations log.

Their writers append whole lines under a lock of their own (:func:`locked`, :func:`flock_within`:
a wait that is bounded, since a lock held longer than ours ever are is held by a stopped process or
one that is not handoffd's); :class:`Appender` keeps such a file open across lines; and
:class:`LineReader` reads them back a block at a time, skipping any line longer than a line of
ours could be, so a reader holds little however large the file.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ...core.ownfiles import open_regular
from .fsio import READ_STEP

# record) is waited for by default. Every holder of ours keeps one for a few milliseconds, so one
# held longer is held by a process that is stopped or not handoffd's: a blocking flock on it froze
# `handoff create` and left the daemon deaf to SIGTERM (a signal does not end the wait). The wait
# polls (a blocking flock cannot be given a timeout), from 50 us up to 50 ms between tries: the
# seen-ids holder lets go within tens of microseconds, and a first pause of 1 ms made each
# loser of the seen-ids lock (two processes of one batch collide hundreds of times) wait
# twenty times longer than the holder held it.
LOCK_WAIT_SECONDS = 2.0
FIRST_POLL_SECONDS, LAST_POLL_SECONDS = 0.00005, 0.05


class LockHeld(TimeoutError):
    """A lock was held by another process for longer than the caller would wait (an OSError:
    callers that catch I/O failures catch it; its text is one line naming the lock)."""

    def __init__(self, path: Path | str, seconds: float) -> None:
        super().__init__(errno.EWOULDBLOCK, f"lock held by another process for over {seconds:g}"
                         " s (a stopped or hung one?)", os.fspath(path))
        self.seconds = seconds


def flock_within(fd: int, seconds: float, *, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None) -> bool:
    """Take an exclusive flock on ``fd`` within ``seconds`` (0: one try): True when taken,
    False when another holder kept it that long; OSError (ENOLCK...) when it cannot be locked.
    ``clock``/``sleep``: time.monotonic and time.sleep unless given (tests move time by hand)."""
    clock = clock or time.monotonic
    sleep = sleep or time.sleep
    deadline = clock() + seconds
    pause = FIRST_POLL_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        sleep(min(pause, remaining))  # (a signal handler runs between tries)
        pause = min(pause * 2, LAST_POLL_SECONDS)


@contextmanager
def locked(path: Path, wait: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent, a regular file opened without
    following a link) for the block, waiting at most ``wait`` seconds for another holder:
    :class:`LockHeld` after that.

    Each call opens its own descriptor, so threads of one process exclude each other as
    processes do (flock locks belong to the open file, not the process). The file stays: removing
    a lock file while another process waits on it would let two holders in."""
    fd = open_creating(path, os.O_RDWR)
    try:
        if not flock_within(fd, wait):
            raise LockHeld(path, wait)
        yield
    finally:
        os.close(fd)  # closing drops the lock


class LineReader:
    """The lines of the binary file ``fh`` from where it stands (without their newline), read
    :data:`READ_STEP` bytes at a time: the JSON Lines logs that anyone who can write the
    workspace can write (the event log, the violations log).

    A line over ``max_line`` bytes is no line of ours: it is skipped as it is read, never held
    whole (so a reader holds one block and one line at most, however large the file). At most
    ``limit`` bytes are read (None: to the end). ``skip_first``: the bytes up to and including
    the first newline are dropped unread (the tail of a line a reader jumped into). The last
    line, unterminated, is given only at the end of the file and when ``partial`` (a line still
    being appended waits otherwise). ``consumed``: the bytes settled after the iteration (lines
    given, skipped or dropped), where a reader resumes next time."""

    def __init__(self, fh: BinaryIO, max_line: int, *, limit: int | None = None,
                 skip_first: bool = False, partial: bool = False) -> None:
        self.fh = fh
        self.max_line = max_line
        self.limit = limit
        self.skipping = skip_first
        self.partial = partial
        self.consumed = 0

    def __iter__(self) -> Iterator[bytes]:
        rest, held, left = b"", 0, self.limit  # held: len(rest)
        at_end = False
        while True:
            ask = READ_STEP if left is None else min(READ_STEP, left)
            block = self.fh.read(ask) if ask > 0 else b""
            if not block:
                at_end = ask > 0
                break
            if left is not None:
                left -= len(block)
            start = 0
            while (end := block.find(b"\n", start)) >= 0:
                size = held + end - start
                if not self.skipping and size <= self.max_line:
                    yield rest + block[start:end] if held else block[start:end]
                self.consumed += size + 1
                rest, held, self.skipping, start = b"", 0, False, end + 1
            if self.skipping:  # (inside a line over the bound: its bytes are settled)
                self.consumed += len(block) - start
            else:
                rest += block[start:]
                held += len(block) - start
                if held > self.max_line:
                    self.consumed += held
                    rest, held, self.skipping = b"", 0, True
        if held and at_end and self.partial:
            self.consumed += held
            yield rest


def open_creating(path: Path, flags: int) -> int:
    """:func:`open_regular` with ``O_CREAT``, creating the folder when it is missing (a
    workspace whose folder for it does not exist yet)."""
    flags |= os.O_CREAT
    try:
        return open_regular(path, flags)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open_regular(path, flags)


def append_line(fd: int, line: bytes, size: int, path: Path | str, *, known_end: int = -1) -> int:
    """Append ``line`` (newline-terminated) to ``fd`` (opened to read and ``O_APPEND``) in one
    write, the file being ``size`` bytes before it; the bytes written. A file that does not end
    with a newline (a line a crash or a full disk cut short) gets one first, glued to the torn
    line this one would be lost with it; one that ends where the caller's own last line did
    (``known_end``) is not looked at. OSError (ENOSPC) naming ``path`` when the write stored
    only part of the line (a full disk, a quota): the line is torn, and is said to be. Every
    appender of the store's JSON Lines files writes through it."""
    if size not in (0, known_end) and os.pread(fd, 1, size - 1) != b"\n":
        # looked at again by the descriptor's own size: ``size`` may be another file's (the path
        # stat'ed just as another process rotated it away), and a whole line then read as torn
        # (a blank line written before ours)
        end = os.fstat(fd).st_size
        if end and os.pread(fd, 1, end - 1) != b"\n":
            line = b"\n" + line
    return write_whole(fd, line, path)


def write_whole(fd: int, line: bytes, path: Path | str) -> int:
    """One write of ``line``; the bytes written. OSError (ENOSPC) naming ``path`` when it
    stored only part of it (a full disk, a quota): the line is torn, and is said to be."""
    written = os.write(fd, line)
    if written != len(line):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a line cut short: {written}"
                      f" of {len(line)} bytes written)", os.fspath(path))
    return written


class Appender:
    """A file kept open for ``O_APPEND`` writes (the event log, the seen-ids record: opening and
    closing it for each line doubled their system calls), reopened when its path names another
    file: a rotation or compaction in another process replaced it. Callers hold their own lock
    around :meth:`ready` and the write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._where = os.fspath(path)  # (stat'ed at each line: a Path costs two Python calls)
        self.fd = -1
        self._ino = -1
        self._end = -1  # the file's size after our last line (it ends with that newline)
        self._torn = False  # our last line was cut short (write_line(look=False) mends it)

    def ready(self) -> os.stat_result:
        """The stat of ``path`` (before the caller's write), with :attr:`fd` open on that file."""
        try:
            info: os.stat_result | None = os.stat(self._where)
        except FileNotFoundError:
            info = None
        if info is None or info.st_ino != self._ino or self.fd < 0:
            self.close()
            self.fd = open_creating(self.path, os.O_RDWR | os.O_APPEND)  # read: write_line
            info = os.fstat(self.fd)
            self._ino = info.st_ino
        return info

    def write_line(self, line: bytes, info: os.stat_result, *, look: bool = True) -> int:
        """Append ``line`` (newline-terminated) in one write, given :meth:`ready`'s ``info``;
        the bytes written. A file that does not end with a newline (a line a crash or a full
        disk cut short) gets one first: glued to the torn line, this one would be lost with it.
        Only a file that someone else wrote last, or whose last line of ours was cut short, is
        looked at (one pread). A writer without one lock around its stat and write (the event
        log) may see another's line half-written: its own then follows a blank line, which
        readers skip. OSError (ENOSPC) when the write stored only part of the line.

        ``look=False`` (a writer with no lock across processes: the event log) looks at no
        file: only a line of its own that was cut short gets the newline first. Another
        process's line seen half-way (its size updated page by page) was "mended" with a blank
        line, and a pread cost every line when several processes wrote."""
        if not look:
            mended = b"\n" + line if self._torn else line
            self._torn = True  # (until written whole)
            written = write_whole(self.fd, mended, self.path)
            self._torn = False
            return written
        self._end, end = -1, self._end  # (until it is written whole: the next line looks)
        written = append_line(self.fd, line, info.st_size, self.path, known_end=end)
        self._end = info.st_size + written
        return written

    def close(self) -> None:
        """Close the descriptor (the next :meth:`ready` opens it again)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self._ino, self._end = -1, -1, -1

    def __del__(self) -> None:  # an engine dropped in a long-lived process gives it back
        try:
            self.close()
        except (OSError, AttributeError):
            pass
