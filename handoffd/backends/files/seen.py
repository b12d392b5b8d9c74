"""The seen-ids record (seed 000's dedup): ids accepted recently, kept for a TTL, across restarts.

Documents stay in their state folders, which are the first line of dedup; this record also
catches an id reused after its terminal document was purged or archived. It is an append-only
JSON Lines file, read incrementally (only the appended tail), and compacted under a lock when
older entries pass the TTL.

It sits in the workspace, where anyone can write: it is read a block at a time, and a line
longer than :data:`MAX_LINE` (none of ours is) is skipped unread, so a forged record costs time
in proportion to its size and a bounded amount of memory, never the whole file at once.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Iterator

from ...core.logs import log
from ...core.ownfiles import open_reading
from ...core.timeutil import iso, parse_iso
from . import fsio, logfiles
from .idindex import IdIndex
from .logfiles import locked

# the record is compacted once its oldest entry is this many TTLs old: a quarter of it then
COMPACT_AFTER = 1.25
MAX_LINE = 4096  # an id is at most 256 characters (check_id): a line is far shorter; a
# longer one is no line of ours and is skipped (its bytes past this bound are never kept)
SEARCH_BLOCK = 1 << 20  # bytes of the record read at a time by a one-shot search
# How long the sweep's compaction waits for the record's lock (an add holds it for one write): a
# lock held longer puts the compaction off to a later sweep. An add waits up to
# logfiles.LOCK_WAIT_SECONDS and then fails (one line): it must not append unlocked, which a
# compaction under way (a stopped process's, resumed later) would drop.
COMPACT_LOCK_WAIT_SECONDS = 0.2


class SeenIds:
    """Bounded record of handoff ids seen within ``ttl_seconds``."""

    def __init__(self, path: Path, ttl_seconds: float) -> None:
        self.path = path
        self._path_text = str(path)  # (stat'ed at every look: a str needs no conversion)
        self.ttl = float(ttl_seconds)
        self.lock_path = Path(str(path) + ".lock")
        # id -> when seen (epoch seconds), for the whole TTL: a daemon holds one entry per
        # handoff, so a compact one (16 bytes a slot, no object per id)
        self._cache = IdIndex()
        self._offset = 0
        self._inode = -1
        self._mutex = threading.Lock()
        self._searched = False  # the first contains() searched the record (see there)
        self._skipping = False  # _offset is inside a line over MAX_LINE: skipped to its end
        self._lock: int | None = None  # the lock file, kept open
        self._put_off = False  # a compaction put off for the lock was said (once till one runs)
        self._out = logfiles.Appender(path)  # the record, kept open for appends

    def add(self, handoff_id: str, now: datetime, mark: str | None = None) -> None:
        """Record ``handoff_id`` as seen at ``now`` (one small O_APPEND write), with ``mark``
        (the claim's that records it, see :meth:`marks`) when given.

        The lock file and the record stay open between calls (a claim adds an id: opening and
        closing both was a dozen system calls per handoff). The lock keeps a compaction in
        another process from dropping the line; under it the record is stat'ed, and reopened
        when a compaction replaced it."""
        line = _line(handoff_id, now, mark).encode()
        with self._mutex:  # one descriptor for the threads of this process: flock alone
            lock_fd = self._lock_fd()  # would not keep them apart
            # bounded: a lock held for good (a stopped or foreign process) fails this one add
            # (an OSError, one line) rather than freezing a create or the daemon's claim; an
            # append without the lock could be dropped by that holder's compaction
            if not logfiles.flock_within(lock_fd, logfiles.LOCK_WAIT_SECONDS):
                raise logfiles.LockHeld(self.lock_path, logfiles.LOCK_WAIT_SECONDS)
            try:
                info = self._out.ready()
                written = self._out.write_line(line, info)
                if (info.st_ino, info.st_size) == (self._inode, self._offset):
                    self._offset += written  # nothing new to read back but our own line
                    self._skipping = False  # (which ends any over-long line before it)
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
            self._cache.put(handoff_id, now.timestamp())

    def __del__(self) -> None:  # a store dropped in a long-lived process gives it back
        lock = getattr(self, "_lock", None)
        if lock is not None:
            try:
                os.close(lock)
            except OSError:
                pass

    def _lock_fd(self) -> int:
        if self._lock is None:
            try:
                self._lock = logfiles.open_creating(self.lock_path, os.O_RDWR)
            except OSError:  # a folder or link planted at its name failed every add, so every
                from .quarantine import clear_planted, planted  # create and every claim
                if not planted(self.lock_path):
                    raise
                clear_planted(self.lock_path)
                self._lock = logfiles.open_creating(self.lock_path, os.O_RDWR)
        return self._lock

    def contains(self, handoff_id: str, now: datetime) -> bool:
        """True if ``handoff_id`` was recorded within the TTL.

        The first question is answered by searching the record for the id, without loading
        it: a one-shot command (``handoff create``) asks once, and loading an hour of a busy
        queue's ids (100,000 lines, 6 MB) made each create take 0.6 s instead of 0.07 s. A
        second question loads the record into the index, and later ones read only its tail."""
        # the lookup under the mutex too: an add() in another thread may be growing the index
        # (a dict lookup was atomic on its own; two arrays swapped mid-lookup are not)
        with self._mutex:
            if not self._searched:
                self._searched = True
                seen = self._search(handoff_id)
            else:
                self._refresh()
                seen = self._cache.get(handoff_id)
        return seen is not None and now.timestamp() - seen < self.ttl

    def marks(self, handoff_id: str, now: datetime) -> frozenset[str | None]:
        """The marks of the record's lines for ``handoff_id`` within the TTL (None for a line
        with none: a create's, or one written before marks were); empty when there is none.
        A search of the whole record, as :meth:`_search` does: asked only for a document
        recovered from a crash, never on the hot path (the index keeps no marks: it stays
        16 bytes an id)."""
        needle = json.dumps(handoff_id).encode()
        found: set[str | None] = set()
        since = now.timestamp() - self.ttl
        try:  # (no mutex: a compaction replaces the file, and this open reads one or the other)
            with open_reading(self.path) as record:
                for lines in _Lines(record):
                    found.update(_mark_of(line) for at, line in _hits(lines, needle, handoff_id)
                                 if at > since)
        except FileNotFoundError:
            pass
        return frozenset(found)

    def _search(self, handoff_id: str) -> float | None:
        """When the record last saw ``handoff_id`` (None: never), found by a byte search for
        the id as JSON writes it, a block at a time (not mapped: a file anyone can truncate
        would fault the process); each hit is checked by parsing its whole line."""
        needle = json.dumps(handoff_id).encode()
        latest: float | None = None
        try:
            with open_reading(self.path) as record:
                for lines in _Lines(record):
                    found = _last_seen(lines, needle, handoff_id)
                    if found is not None:
                        latest = found if latest is None else max(latest, found)
        except FileNotFoundError:
            return None
        return latest

    def _refresh(self) -> None:
        """Read only what was appended since the last look (the whole file after a compaction);
        under the mutex: the stat too, for an add() between a stat and the mutex would advance
        the offset past the size seen, and the whole file would be read again."""
        try:
            info = os.stat(self._path_text)
        except FileNotFoundError:
            return
        if (info.st_ino, info.st_size) == (self._inode, self._offset):
            return
        with open_reading(self.path) as fh:
            # judged by the file opened: a compaction's rename between the stat and the open
            # (another process's) had the new, shorter record read from the old one's offset,
            # and the ids appended since the last look were missed (R60: a reused id could run)
            info = os.fstat(fh.fileno())
            if info.st_ino != self._inode or info.st_size < self._offset:
                self._cache, self._offset, self._inode = IdIndex(), 0, info.st_ino
                self._skipping = False
            fh.seek(self._offset)
            lines = _Lines(fh, skipping=self._skipping)
            for complete in lines:  # a line still being appended waits
                self._cache.update(_parse(complete))
        self._offset += lines.consumed
        self._skipping = lines.skipping

    def compact(self, now: datetime) -> int | None:
        """Drop the entries older than the TTL, once the oldest is COMPACT_AFTER TTLs old; how
        many remain, or None when nothing was due (only the first line was read).

        Until then an expired entry is merely ignored (:meth:`contains` checks its time). The
        sweep calls this every few seconds: reading and rewriting the whole record each time
        made every sweep cost, in time and in a serving daemon's memory, one TTL's worth of
        ids. The record is rewritten line by line, never held whole."""
        # the mutex before the flock, in the order add() takes them
        with self._mutex:
            try:
                # briefly: an add holds the lock for one write, another compaction for a
                # moment; one held longer (a stopped or foreign process) puts the compaction
                # off to a later sweep (nothing is lost: the record only grows meanwhile)
                from .quarantine import (
                    clear_planted,  # (a folder at its name: every sweep failed)
                )
                clear_planted(self.lock_path)
                with locked(self.lock_path, wait=COMPACT_LOCK_WAIT_SECONDS):
                    return self._compact(now)
            except logfiles.LockHeld as exc:
                if not self._put_off:
                    self._put_off = True
                    log.warning("%s has been held by another process for over %g s (a stopped "
                                "or hung one?): the seen-ids record's compaction is put off to "
                                "a later sweep", _shown(self.lock_path), exc.seconds)
                return None

    def _compact(self, now: datetime) -> int | None:
        """:meth:`compact`, under the mutex and the lock."""
        self._put_off = False
        try:
            with open_reading(self.path) as record:
                oldest = _time_of(record.readline(MAX_LINE))
                if oldest is not None and now.timestamp() - oldest < self.ttl * COMPACT_AFTER:
                    return None
                record.seek(0)
                kept = self._rewrite(record, now.timestamp())
        except FileNotFoundError:
            return 0
        self._cache, self._offset, self._inode = IdIndex(), 0, -1
        self._skipping = False
        return kept

    def _rewrite(self, record: BinaryIO, now: float) -> int:
        """Replace the record by its lines seen within the TTL (under the lock); how many.

        The new record is written to a temp file of a random name beside it (the shared
        records' temp name, :data:`.records.TEMP_NAME`, which the sweep removes once old if a
        crash left it), created afresh without following a link, then renamed over the record.
        A name known ahead (``seen-ids.compact``) let a FIFO planted there stall the sweep for
        good (its open blocked, holding the record's lock), and a symlink have the record
        written outside the workspace and the link renamed over it."""
        tmp = self.path.with_name(f".{self.path.stem}.{os.urandom(8).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        kept = 0
        with fsio.discarded_on_failure(tmp):
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), fsio.FILE_MODE)  # the starting umask, not a handler's
                for lines in _Lines(record):
                    fresh = []
                    for line in lines.split(b"\n")[:-1]:  # (complete lines: the last is empty)
                        at = _time_of(line) if len(line) <= MAX_LINE else None
                        if at is not None and now - at < self.ttl:
                            fresh.append(line + b"\n")
                    out.write(b"".join(fresh))
                    kept += len(fresh)
            os.replace(tmp, self.path)
        return kept


class _Lines:
    """The complete lines of ``fh`` from where it stands, read :data:`SEARCH_BLOCK` bytes at a
    time and given in runs (bytes ending with a newline); a line still being appended (no
    newline yet) is left unread. A line over :data:`MAX_LINE` is never held whole: once that
    much of it is read without its newline, it is skipped to its end (``skipping`` after the
    last block: still inside it). ``consumed``: the bytes read past that are settled (given
    or skipped); a run given may still hold a complete line over the bound (its readers skip
    it: :func:`_last_seen`, :func:`_parse`, :meth:`SeenIds._rewrite`)."""

    def __init__(self, fh: BinaryIO, *, skipping: bool = False) -> None:
        self.fh = fh
        self.skipping = skipping
        self.consumed = 0

    def __iter__(self) -> Iterator[bytes]:
        rest = b""
        while block := self.fh.read(SEARCH_BLOCK):
            if self.skipping:
                end = block.find(b"\n")
                if end < 0:
                    self.consumed += len(block)
                    continue
                self.consumed += end + 1
                block = block[end + 1:]
                self.skipping = False
            data = rest + block if rest else block
            whole = data.rfind(b"\n") + 1  # complete lines only; the rest waits
            rest = data[whole:]
            if len(rest) > MAX_LINE:  # no line of ours: skipped, never kept whole
                self.consumed += len(rest)
                rest, self.skipping = b"", True
            if whole:
                self.consumed += whole
                yield data[:whole]


def _entry(line: bytes | str) -> tuple[str, float] | None:
    """(id, when seen in epoch seconds) of one record line; None for a torn or foreign one."""
    try:
        item = json.loads(line)
        return str(item["id"]), parse_iso(item["at"]).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None  # ("at" not a string: AttributeError; a line nested a million deep)


def _last_seen(data: bytes, needle: bytes, handoff_id: str) -> float | None:
    """The latest time of the record lines in ``data`` (complete ones) whose id is
    ``handoff_id`` (``needle``: the id as JSON writes it, quotes included, so no longer id
    contains it)."""
    return max((at for at, _line in _hits(data, needle, handoff_id)), default=None)


def _hits(data: bytes, needle: bytes, handoff_id: str) -> Iterator[tuple[float, bytes]]:
    """(time, line) of each record line in ``data`` (complete ones) whose id is ``handoff_id``
    (``needle``: see :func:`_last_seen`), the last first; a hit is checked by parsing its whole
    line."""
    end = len(data)
    while (hit := data.rfind(needle, 0, end)) >= 0:
        start = data.rfind(b"\n", 0, hit) + 1
        stop = data.find(b"\n", hit)  # (there is one: data holds complete lines)
        line = data[start:stop]
        entry = _entry(line) if stop - start <= MAX_LINE else None
        if entry is not None and entry[0] == handoff_id:
            yield entry[1], line
        end = start


def _mark_of(line: bytes) -> str | None:
    """The mark of one record line (one :func:`_entry` read); None when it has none (a
    create's line, or one written before session 27)."""
    try:
        mark = json.loads(line).get("mark")
    except (ValueError, AttributeError, RecursionError):
        return None
    return mark if isinstance(mark, str) else None


def _time_of(line: bytes) -> float | None:
    """The time of one record line; None for a torn or foreign line."""
    entry = _entry(line)
    return entry[1] if entry else None


def _shown(path: Path) -> str:
    """``path`` as a log line names it: from the workspace's ``handoffs/`` folder down."""
    return f"{path.parent.parent.name}/{path.parent.name}/{path.name}"


def _line(handoff_id: str, at: datetime, mark: str | None = None) -> str:
    """A record line: the id, when, and the mark of the claim that made it (when one did)."""
    item = {"id": handoff_id, "at": iso(at)}
    if mark is not None:
        item["mark"] = mark
    return json.dumps(item) + "\n"


def _parse(data: bytes) -> Iterator[tuple[str, float]]:
    """The entries of record lines; a torn line after a crash, or a foreign one (one over
    :data:`MAX_LINE` bytes too), is skipped."""
    for raw in data.split(b"\n"):
        if len(raw) > MAX_LINE:
            continue
        entry = _entry(raw.decode("utf-8", "replace"))
        if entry is not None:
            yield entry
