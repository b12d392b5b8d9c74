"""The seen-ids record (seed 000's dedup): ids accepted recently, kept for a TTL, across restarts.

Documents stay in their state folders, which are the first line of dedup; this record also
catches an id reused after its terminal document was purged or archived. It is an append-only
JSON Lines file, read incrementally (only the appended tail), and compacted under a lock when
older entries pass the TTL.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from ...core.timeutil import iso, parse_iso
from .fsio import locked


class SeenIds:
    """Bounded record of handoff ids seen within ``ttl_seconds``."""

    def __init__(self, path: Path, ttl_seconds: float) -> None:
        self.path = path
        self.ttl = float(ttl_seconds)
        self.lock_path = Path(str(path) + ".lock")
        # id -> when seen, as epoch seconds: a float is half a datetime's size, and a daemon
        # holds one entry per handoff for the whole TTL
        self._cache: dict[str, float] = {}
        self._offset = 0
        self._inode = -1

    def add(self, handoff_id: str, now: datetime) -> None:
        """Record ``handoff_id`` as seen at ``now`` (one small O_APPEND write)."""
        line = _line(handoff_id, now)
        with locked(self.lock_path):  # so a compaction in another process cannot drop this line
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        self._cache[handoff_id] = now.timestamp()

    def contains(self, handoff_id: str, now: datetime) -> bool:
        """True if ``handoff_id`` was recorded within the TTL."""
        self._refresh()
        seen = self._cache.get(handoff_id)
        return seen is not None and now.timestamp() - seen < self.ttl

    def _refresh(self) -> None:
        """Read only what was appended since the last look (the whole file after a compaction)."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return
        if (info.st_ino, info.st_size) == (self._inode, self._offset):
            return
        if info.st_ino != self._inode or info.st_size < self._offset:
            self._cache, self._offset, self._inode = {}, 0, info.st_ino
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            tail = fh.read()
        complete = tail[: tail.rfind(b"\n") + 1]  # a line still being appended waits
        self._offset += len(complete)
        self._cache.update(_parse(complete))

    def compact(self, now: datetime) -> int:
        """Drop entries older than the TTL; return how many remain."""
        with locked(self.lock_path):
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
            self._cache, self._offset, self._inode = {}, 0, -1
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
