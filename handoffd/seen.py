"""The seen-ids record (seed 000's dedup): ids accepted recently, kept for a TTL, across restarts.

Documents stay in their state folders, which are the first line of dedup; this record also
catches an id reused after its terminal document was purged or archived. It is an append-only
JSON Lines file compacted (under a lock) when older entries pass the TTL.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timedelta
from pathlib import Path

from filelock import FileLock

from .timeutil import iso, parse_iso


class SeenIds:
    """Bounded record of handoff ids seen within ``ttl_seconds``."""

    def __init__(self, path: Path, ttl_seconds: float) -> None:
        self.path = path
        self.ttl = timedelta(seconds=ttl_seconds)
        self._lock = FileLock(str(path) + ".lock")
        self._cache: dict[str, datetime] = {}
        self._cache_size = -1

    def add(self, handoff_id: str, now: datetime) -> None:
        """Record ``handoff_id`` as seen at ``now`` (one small O_APPEND write)."""
        line = json.dumps({"id": handoff_id, "at": iso(now)}) + "\n"
        with self._lock:  # so a compaction in another process cannot drop this line
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        self._cache[handoff_id] = now

    def contains(self, handoff_id: str, now: datetime) -> bool:
        """True if ``handoff_id`` was recorded within the TTL."""
        self._refresh()
        seen = self._cache.get(handoff_id)
        return seen is not None and now - seen < self.ttl

    def _refresh(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == self._cache_size:
            return
        self._cache = self._load()
        self._cache_size = size

    def _load(self) -> dict[str, datetime]:
        entries: dict[str, datetime] = {}
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return entries
        for line in text.splitlines():
            try:
                item = json.loads(line)
                entries[str(item["id"])] = parse_iso(item["at"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line after a crash is skipped, not fatal
        return entries

    def compact(self, now: datetime) -> int:
        """Drop entries older than the TTL; return how many remain."""
        with self._lock:
            keep = {k: v for k, v in self._load().items() if now - v < self.ttl}
            tmp = self.path.with_suffix(".compact")
            tmp.write_text("".join(json.dumps({"id": k, "at": iso(v)}) + "\n" for k, v in keep.items()))
            os.replace(tmp, self.path)
            self._cache, self._cache_size = keep, -1
        return len(keep)
