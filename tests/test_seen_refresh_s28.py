"""The seen-ids record read after another process's compaction (R60, session 28).

A look-up reads what was appended since its last look: it stat'ed the record, then opened it.
A compaction's rename between the two had the new, shorter record read from the old record's
offset, and the ids appended since the last look were missed: a reused id could run again."""
from __future__ import annotations

import os
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from handoffd.backends.files import seen as seen_module
from handoffd.backends.files.seen import SeenIds

NOW = datetime(2026, 11, 28, 12, tzinfo=timezone.utc)
TTL = 100.0


def test_a_compaction_between_the_stat_and_the_open_misses_no_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "seen-ids.jsonl"
    ours, other = SeenIds(path, TTL), SeenIds(path, TTL)  # this daemon's; another process's
    for n in range(2000):  # expired: the other's compaction is due
        other.add(f"old-{n:05d}", NOW - timedelta(seconds=TTL * 2))
    other.add("warm", NOW)
    assert ours.contains("warm", NOW) and ours.contains("warm", NOW)  # index loaded, at the end
    other.add("X", NOW)  # recorded by the other after our last look
    real = seen_module.open_reading
    armed = [True]

    def open_reading(where: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0]:  # right after the stat: the other's compaction renames its record in
            armed[0] = False
            inode = os.stat(path).st_ino
            compaction = threading.Thread(target=other.compact, args=(NOW,))
            compaction.start()
            compaction.join(30)
            assert os.stat(path).st_ino != inode
        return real(where, *args, **kwargs)

    monkeypatch.setattr(seen_module, "open_reading", open_reading)
    assert ours.contains("X", NOW)
    assert not armed[0]  # (the compaction did land between the two)
    assert ours.contains("warm", NOW) and not ours.contains("old-00001", NOW)
