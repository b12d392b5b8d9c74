"""The seen-ids record (seed 000's dedup): ids accepted recently, kept for a TTL, across restarts.

Documents stay in their state folders, which are the first line of dedup; this record also
catches an id reused after its terminal document was purged or archived. It is an append-only
JSON Lines file, read incrementally (only the appended tail), and compacted under a lock when
older entries pass the TTL.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

from ...core.timeutil import iso, parse_iso
from . import fsio
from .fsio import locked
from .idindex import IdIndex


class SeenIds:
    """Bounded record of handoff ids seen within ``ttl_seconds``."""

    def __init__(self, path: Path, ttl_seconds: float) -> None:
        self.path = path
        self.ttl = float(ttl_seconds)
        self.lock_path = Path(str(path) + ".lock")
        # id -> when seen (epoch seconds), for the whole TTL: a daemon holds one entry per
        # handoff, so a compact one (16 bytes a slot, no object per id)
        self._cache = IdIndex()
        self._offset = 0
        self._inode = -1
        self._mutex = threading.Lock()
        self._lock: int | None = None  # the lock file, kept open
        self._out = fsio.Appender(path)  # the record, kept open for appends

    def add(self, handoff_id: str, now: datetime) -> None:
        """Record ``handoff_id`` as seen at ``now`` (one small O_APPEND write).

        The lock file and the record stay open between calls (a claim adds an id: opening and
        closing both was a dozen system calls per handoff). The lock keeps a compaction in
        another process from dropping the line; under it the record is stat'ed, and reopened
        when a compaction replaced it."""
        line = _line(handoff_id, now).encode()
        with self._mutex:  # one descriptor for the threads of this process: flock alone
            lock_fd = self._lock_fd()  # would not keep them apart
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                info = self._out.ready()
                os.write(self._out.fd, line)
                if (info.st_ino, info.st_size) == (self._inode, self._offset):
                    self._offset += len(line)  # nothing new to read back but our own line
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
            self._lock = fsio.open_creating(self.lock_path, os.O_RDWR)
        return self._lock

    def contains(self, handoff_id: str, now: datetime) -> bool:
        """True if ``handoff_id`` was recorded within the TTL."""
        self._refresh()
        seen = self._cache.get(handoff_id)
        return seen is not None and now.timestamp() - seen < self.ttl

    def _refresh(self) -> None:
        """Read only what was appended since the last look (the whole file after a compaction)."""
        with self._mutex:  # the stat too: an add() between a stat and the mutex would advance
            try:  # the offset past the size seen, and the whole file would be read again
                info = os.stat(self.path)
            except FileNotFoundError:
                return
            if (info.st_ino, info.st_size) == (self._inode, self._offset):
                return
            if info.st_ino != self._inode or info.st_size < self._offset:
                self._cache, self._offset, self._inode = IdIndex(), 0, info.st_ino
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                tail = fh.read()
            complete = tail[: tail.rfind(b"\n") + 1]  # a line still being appended waits
            self._offset += len(complete)
            self._cache.update(_parse(complete))

    def compact(self, now: datetime) -> int:
        """Drop entries older than the TTL; return how many remain."""
        # the mutex before the flock, in the order add() takes them
        with self._mutex, locked(self.lock_path):
            try:
                entries = _parse(self.path.read_bytes())
            except FileNotFoundError:
                entries = {}
            keep = {k: v for k, v in entries.items() if now.timestamp() - v < self.ttl}
            if len(keep) == len(entries) and self.path.exists():
                return len(keep)  # nothing expired: no rewrite
            tmp = self.path.with_suffix(".compact")
            tmp.write_text("".join(_line(k, datetime.fromtimestamp(v, timezone.utc))
                                   for k, v in keep.items()))
            os.replace(tmp, self.path)
            self._cache, self._offset, self._inode = IdIndex(), 0, -1
        return len(keep)


def _line(handoff_id: str, at: datetime) -> str:
    return json.dumps({"id": handoff_id, "at": iso(at)}) + "\n"


def _parse(data: bytes) -> dict[str, float]:
    entries: dict[str, float] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
            entries[str(item["id"])] = parse_iso(item["at"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue  # a torn line after a crash is skipped, not fatal
    return entries
