"""How the event log is read and followed (:class:`Following`, the reading half of
:class:`~handoffd.backends.files.events.FileEventLog`): every event kept, oldest first, and a
follower's tail across rotations and truncations.

Readers skip a line they cannot parse (a torn last line after a crash, one nested deeper than any
event: :func:`~handoffd.backends.files.jsontext.parse_line`), read a file a block at a time (a line
over :data:`MAX_LINE` is skipped unread, never held whole) and at most ``max_bytes`` +
:data:`MAX_LINE` bytes of each (a file larger than that is not what a rotation leaves: only its
last part is read). They follow the file across rotations by its inode and first bytes (the
rest of it, then every file rotated after it: :meth:`Following.tail_into`; a gap when it was
rotated past the files kept, said once), and from its start again when it was truncated in place
(logrotate's ``copytruncate``, ``: >``): shorter than where they were, or its first bytes or the
bytes just before where they were no longer those they read (:class:`_Print`; a newline just
before the cursor alone missed a log truncated and written past the cursor again, and the reader
went on from the middle of the new content).
"""
from __future__ import annotations

import os
import stat
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple

from ...core import jsontext, ownfiles
from ...core.events import START, Event, after
from ...core.logs import log
from . import logfiles

__all__ = ["MAX_LINE", "Following", "shown_path"]

MAX_LINE = 64 * 1024  # a line longer than this is not ours: skipped when read
# a follower's cursor keeps the file's first HEAD_PRINT bytes and the BEFORE_PRINT bytes before
# where it stopped (a line or two of ours: a time to the millisecond, an id) and compares them at
# each poll, two small reads, to tell the file it read from one truncated and written again
HEAD_PRINT, BEFORE_PRINT = 64, 256


class Following:
    """The reading half of the event log (mixed into
    :class:`~handoffd.backends.files.events.FileEventLog`, which writes it)."""

    # what the reading uses of the log it is part of
    path: Path
    max_bytes: int
    keep: int
    _gap_warned: bool

    def rotated(self, n: int) -> Path:
        """The path of the ``n``-th rotated file (``events.jsonl.n``)."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        """The files kept, oldest first."""
        older = [self.rotated(n) for n in range(self.keep, 0, -1)]
        return [p for p in older if os.path.lexists(p)] + [self.path]

    def read(self, since: datetime | None = None) -> Iterator[Event]:
        """Every event kept, oldest first (those at or after ``since``), read as it is given:
        a file at a time, a block at a time.

        The files are those kept when it starts (:meth:`_kept`), each followed by its inode as
        the followers do (:meth:`_open_ino`): opened by name, a rotation between the listing and
        the reading shifted every name by one, and a file was read twice while another was
        skipped (``handoff stats`` counted wrong). A file rotated past ``keep`` meanwhile is
        gone (nothing of it is read, nothing twice)."""
        for ino, path in self._kept():
            fh = self._open_ino(ino, path)
            if fh is None:
                continue
            for event in self._scan_open(fh, 0, _Mark(), partial=True):
                if since is None or after(event, since):
                    yield event

    def tail(self, cursor: Any = None) -> tuple[list[Event], Any]:
        """Events appended since ``cursor`` (:meth:`_Mark.cursor`: where in which file, its
        bytes there to tell a truncation, the file before it to tell a file rotated away; None:
        from now on)."""
        events: list[Event] = []
        return events, self.tail_into(cursor, events.append)

    def tail_into(self, cursor: Any, take: Callable[[Event], None],
                  gap: Callable[[], None] | None = None) -> Any:
        """:meth:`tail`, each event handed to ``take`` as it is read instead of gathered in a
        list (a first look from :data:`START` reads every file kept: a list of them all took
        hundreds of MB); the cursor to pass next time (:meth:`_Mark.cursor`).

        The file the cursor is in is found wherever rotations moved it, by its inode and its
        first bytes (a file rotated past ``keep`` frees its inode, and the next file created
        often takes it); the rest of it is read, then every newer file kept (a follower that
        went on to the current file skipped the files rotated in between: two rotations
        between two looks lost half the events). When it is gone, every file after the one
        that was before it (the cursor knows it too) is read; a gap (files rotated away
        unread, or maybe: a cursor from before the log existed and every rotated name taken)
        is said once (a warning), and ``gap()`` is called each time (the metrics count it)."""
        if cursor is None:
            return self._now_cursor()
        if cursor == START:  # every file kept, oldest first, from its start
            return self._read_on(self._kept(), 0, _From(), take, gap)
        old_ino, offset, *rest = cursor
        since = _From(offset, bool(rest[0]) if rest else True,
                      # (a cursor of an older handoffd, without them: the newline before it)
                      _Print(rest[1], rest[2]) if len(rest) >= 3 and rest[1] is not None
                      else None)
        older = (rest[3], rest[4]) if len(rest) >= 5 else None  # (None: not known)
        if old_ino and (done := self._read_current(old_ino, older, since, take)) is not None:
            return done
        files = self._kept()
        at = self._find(files, old_ino, since, older)
        if at >= 0:  # rotated since: the rest of it, then the newer ones
            return self._read_on(files, at, since, take, gap)
        before = self._index_of(files, older) if older and older[0] else -1
        if before >= 0:  # the one before it is kept: the file followed was truncated in place,
            lost, unsure = False, False  # removed or copied (the files after it came since)
        elif not old_ino:  # none there at the last look: if every name is taken, some may be gone
            lost, unsure = os.path.lexists(self.rotated(self.keep)), False
        else:  # gone with the one before it, or there was none before it: a gap unless the
            lost = bool(older and older[0])  # first file is a copy of it (copytruncate) or
            unsure = not lost and len(files) > 1  # none has rotated (truncated in place)
        if lost:
            self._gap(gap)
        # the first from the cursor if it is a copy of what was read (its print tells)
        return self._read_on(files, before + 1, since if since.seen is not None else _From(),
                             take, gap, unsure=unsure)

    def _read_current(self, ino: int, older: tuple[int, bytes] | None, since: "_From",
                      take: Callable[[Event], None]) -> Any:
        """The usual look: the cursor after reading on in the current file when it is still
        the file ``ino`` the cursor is in (its bytes before the cursor unchanged; before any
        was read, ``older`` still the newest rotated file): no rotation since. None otherwise.
        One open and two small reads."""
        fh = _opened(self.path, ino)
        if fh is None:
            return None
        if since.offset and since.seen is not None:
            same = (os.fstat(fh.fileno()).st_size >= since.offset
                    and _Print.of(fh.fileno(), since.offset) == since.seen)
        else:
            same = older is None or self._newest_rotated() == older
        if not same:  # (truncated in place, or its inode is another file's now)
            fh.close()
            return None
        mark = _Mark()
        for event in self._scan_open(fh, since.offset, mark, whole=since.whole, seen=since.seen):
            take(event)
        return mark.cursor(ino, older if older is not None else self._newest_rotated())

    def _find(self, files: list[tuple[int, Path]], ino: int, since: "_From",
              older: tuple[int, bytes] | None) -> int:
        """Where the file a cursor is in stands in ``files`` (-1: gone): its inode, and its
        first bytes when the cursor read some (else the file before it: ``older``)."""
        if not ino or ino not in (inos := [i for i, _ in files]):
            return -1
        at = inos.index(ino)
        head = since.seen.first() if since.seen is not None else b""
        if since.offset and head:
            return at if self._first_bytes(ino, files[at][1], len(head)) == head else -1
        if older is None or at == 0:  # (a cursor of an older handoffd: its inode alone)
            return at
        return at if self._token(*files[at - 1]) == older else -1

    def _index_of(self, files: list[tuple[int, Path]], token: tuple[int, bytes]) -> int:
        """Where the file of ``token`` (:meth:`_token`) stands in ``files`` (-1: gone)."""
        for k, (ino, path) in enumerate(files):
            if ino == token[0] and self._token(ino, path) == token:
                return k
        return -1

    def _newest_rotated(self) -> tuple[int, bytes]:
        """The newest rotated file's token (:meth:`_token`; (0, b""): none)."""
        path = self.rotated(1)
        ino = _regular_ino(path)
        return self._token(ino, path) if ino else (0, b"")

    def _token(self, ino: int, path: Path) -> tuple[int, bytes]:
        """What tells a file of the log from one created later under its inode: the inode and
        the first :data:`HEAD_PRINT` bytes (a rotated file is never empty)."""
        return (ino, self._first_bytes(ino, path, HEAD_PRINT) or b"")

    def _first_bytes(self, ino: int, path: Path, size: int) -> bytes | None:
        """The first ``size`` bytes of the file of inode ``ino`` (seen at ``path``); None when
        it is gone."""
        fh = self._open_ino(ino, path)
        if fh is None:
            return None
        with fh:
            try:
                return os.pread(fh.fileno(), size, 0)
            except OSError:
                return None

    def _now_cursor(self) -> tuple[int, int, bool, bytes | None, bytes | None, int, bytes]:
        """A cursor at the end of the current file: "from now on". At a line's start when the
        file is empty or ends with a newline (else inside a line being written or torn: its
        rest is skipped); with the file's bytes there (:class:`_Print`), all of one open file,
        and the newest rotated file's token, the same before and after (no rotation between)."""
        for _ in range(3):
            older = self._newest_rotated()
            try:
                with ownfiles.open_reading(self.path) as fh:
                    info = os.fstat(fh.fileno())
                    seen = _Print.of(fh.fileno(), info.st_size)
            except OSError:  # none yet (or no regular file): from its start once there is one
                ino, size = _stat(self.path)
                return (ino, size, True, None, None, *older)  # (no print: the newline before)
            if _regular_ino(self.rotated(1)) == older[0]:
                break
        whole = info.st_size <= 0 or seen.before.endswith(b"\n")
        return (info.st_ino, info.st_size, whole, seen.head, seen.before, *older)

    def _kept(self) -> list[tuple[int, Path]]:
        """The files kept as (inode, the name it was seen at), oldest first, the current one
        last. Looked at newest first: a rotation meanwhile moves a file to a name not looked at
        yet (seen twice, kept once), never past one already looked at (missed)."""
        found: dict[int, Path] = {}
        for path in self._names():
            ino = _regular_ino(path)
            if ino and ino not in found:
                found[ino] = path
        return list(reversed(found.items()))

    def _read_on(self, files: list[tuple[int, Path]], first: int, since: "_From",
                 take: Callable[[Event], None], gap: Callable[[], None] | None, *,
                 unsure: bool = False) -> Any:
        """The events of ``files[first:]`` (oldest first: the first from ``since``, the others
        from their start), each opened by its inode wherever a rotation during the read moved
        it; the cursor after the last one read ((0, 0...): none could be). ``unsure``: a gap
        unless the first file holds what the cursor read (a copy of the file followed)."""
        last, at = _Mark(), -1
        for k in range(first, len(files)):
            ino, path = files[k]
            fh = self._open_ino(ino, path)
            if fh is None:
                if ino not in self._inodes():  # rotated past keep while the others were read
                    self._gap(gap)  # (one still there that cannot be opened is no gap)
            else:
                mark = _Mark()
                for event in self._scan_open(fh, since.offset, mark, whole=since.whole,
                                             seen=since.seen):
                    take(event)
                if unsure and k == first and (mark.restarted or not since.offset):
                    self._gap(gap)
                last, at = mark, k
            since, unsure = _From(), False
        older = self._token(*files[at - 1]) if at > 0 else (0, b"")
        return last.cursor(0, older)

    def _open_ino(self, ino: int, path: Path) -> BinaryIO | None:
        """The file of inode ``ino`` opened for reading: at ``path`` (where it was seen), else
        at whichever name of the log a rotation moved it to (looked at newest first, the way
        rotations move files); None when it is gone."""
        fh = _opened(path, ino)
        if fh is not None:
            return fh
        for _ in range(2):  # (a second pass: it was renamed between a stat and its open)
            for name in self._names():
                if _regular_ino(name) == ino and (fh := _opened(name, ino)) is not None:
                    return fh
        return None

    def _names(self) -> list[Path]:
        """The log's names, newest first: the current file, then the rotated ones."""
        return [self.path, *(self.rotated(n) for n in range(1, self.keep + 1))]

    def _inodes(self) -> set[int]:
        """The inodes of the regular files at the log's names now."""
        return {_regular_ino(path) for path in self._names()}

    def _gap(self, gap: Callable[[], None] | None) -> None:
        """Events may have been rotated away unread: ``gap()``, and one warning (once)."""
        if gap is not None:
            gap()
        if not self._gap_warned:
            self._gap_warned = True
            log.warning("the event log %s rotated past the %d files it keeps (events_keep) "
                        "between two reads: events in between may have been missed (a larger "
                        "events_max_bytes or events_keep keeps more)", shown_path(self.path),
                        self.keep)

    def _scan_open(self, fh: BinaryIO, offset: int, mark: "_Mark", *, whole: bool = True,
                   partial: bool = False, seen: "_Print | None" = None) -> Iterator[Event]:
        """The events of the open file ``fh``'s complete lines from ``offset`` (it is closed
        after), at most ``max_bytes`` + MAX_LINE bytes of it (a file longer than that: its last
        part), a block at a time.
        ``mark``, once exhausted: the file read, the offset after what was settled, whether
        that is a line's start, and the file's bytes there (:class:`_Print`), and whether it was
        read from its start instead of ``offset`` (restarted). ``partial``: an unterminated last
        line too (a torn one).

        ``whole``: ``offset`` was a line's start. The file is read from its start when it was
        truncated in place (logrotate's ``copytruncate``, ``: >``), then maybe written past the
        offset again: it is shorter than ``offset``, its bytes differ from ``seen`` (those read
        last time), or (no ``seen``) it has no newline just before ``offset`` any more. Not
        ``whole`` (inside a line over MAX_LINE being skipped): on to that line's end."""
        with fh:
            info = os.fstat(fh.fileno())
            skip = False
            given = offset
            if info.st_size < offset or (offset and seen is not None
                                         and _Print.of(fh.fileno(), offset) != seen):
                offset, seen = 0, None  # truncated (and maybe written past the offset again)
            elif offset:
                if os.pread(fh.fileno(), 1, offset - 1) != b"\n":
                    offset, skip = (0, False) if whole else (offset, True)
                    seen = seen if skip else None
            mark.restarted = given > 0 and offset == 0
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

    def first(self) -> bytes:
        """The file's first bytes it holds (at most :data:`HEAD_PRINT`)."""
        return bytes(self.head or self.before[:HEAD_PRINT])

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


class _From(NamedTuple):
    """Where a follower resumes in the first file it reads: the cursor's offset, whether that
    is a line's start, and the file's bytes there (:class:`_Print`; None: not known)."""

    offset: int = 0
    whole: bool = True
    seen: "_Print | None" = None


class _Mark:
    """Where a scan of a file stopped: its inode (0: none was read), the offset after what it
    settled, whether that offset is a line's start (not: inside a line being skipped), the
    file's bytes there (:class:`_Print`), and whether it was read from its start instead of
    from the cursor's offset (truncated, or another file: ``restarted``)."""

    def __init__(self) -> None:
        self.ino, self.offset, self.whole = 0, 0, True
        self.print = _Print()
        self.restarted = False

    def cursor(self, ino: int, older: tuple[int, bytes]) -> tuple[int, int, bool, bytes, bytes,
                                                                  int, bytes]:
        """The cursor after the scan: (inode, offset, at a line's start, first bytes, bytes
        before the offset, then the inode and first bytes of the file before it: ``older``,
        (0, b"") if none); ``ino``: the file's when it could not be read."""
        if not self.ino:
            return (ino, 0, True, b"", b"", *older)
        return (self.ino, self.offset, self.whole, self.print.head, self.print.before, *older)


def shown_path(path: Path) -> str:
    """``path`` as a log line names it: from the workspace's ``handoffs/`` folder down."""
    return f"{path.parent.parent.name}/{path.parent.name}/{path.name}"


def _regular_ino(path: Path) -> int:
    """The inode of the regular file at ``path`` (not followed if a link); 0: none there."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_ino if stat.S_ISREG(info.st_mode) else 0


def _opened(path: Path, ino: int) -> BinaryIO | None:
    """``path`` opened for reading if it is (still) the file of inode ``ino``, else None: a
    name alone may be another file by the time it is opened (a rotation renamed it)."""
    try:
        fh = ownfiles.open_reading(path)
    except OSError:
        return None
    try:
        if os.fstat(fh.fileno()).st_ino == ino:
            return fh
    except OSError:
        pass
    fh.close()
    return None


def _stat(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except FileNotFoundError:
        return 0, 0
    return info.st_ino, info.st_size
