"""The seen-ids record's first question is answered by a search, not by loading the record.

`handoff create` asks once whether its id was seen within the TTL; loading a busy hour's record
(100,000 lines) for that made each create take 0.6 s. The search must agree with the index that
a second question loads, whatever the record holds."""
from __future__ import annotations

import string
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handoffd.backends.files import seen as seen_module
from handoffd.backends.files.seen import SeenIds

NOW = datetime(2026, 11, 25, 12, tzinfo=timezone.utc)


def line(handoff_id: str, at: datetime) -> bytes:
    return seen_module._line(handoff_id, at).encode()


def test_the_first_question_does_not_load_the_record(tmp_path: Path) -> None:
    path = tmp_path / "seen-ids.jsonl"
    path.write_bytes(b"".join(line(f"hoff-{i:06d}", NOW) for i in range(20_000)))
    seen = SeenIds(path, 3600)
    assert seen.contains("hoff-012345", NOW)
    assert len(seen._cache) == 0  # answered by the search: nothing loaded
    assert not seen.contains("hoff-12345", NOW)  # a second question loads the index
    assert len(seen._cache) == 20_000
    assert not SeenIds(path, 3600).contains("hoff-0123456", NOW)
    assert not SeenIds(path, 60).contains("hoff-000001", NOW + timedelta(seconds=61))


def test_the_search_takes_the_latest_line_and_skips_torn_and_hostile_ones(tmp_path: Path) -> None:
    path = tmp_path / "seen-ids.jsonl"
    path.write_bytes(line("a", NOW - timedelta(hours=2)) + line("ab", NOW) + b'["a"]\n'
                     + b'{"id": "a", "at": 5}\n' + b"[" * 50_000 + b'"a"\n'
                     + line("a", NOW - timedelta(seconds=10)) + line("b", NOW)
                     + b'{"id": "c", "at": "2026-11-25T12:00:00Z')  # torn: still being appended
    assert SeenIds(path, 60).contains("a", NOW)  # the later of its two lines
    assert not SeenIds(path, 5).contains("a", NOW)
    assert not SeenIds(path, 3600).contains("c", NOW)
    assert not SeenIds(tmp_path / "absent.jsonl", 60).contains("a", NOW)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert not SeenIds(tmp_path / "empty.jsonl", 60).contains("a", NOW)


IDS = st.text(alphabet=string.ascii_lowercase[:3] + "-", min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(st.tuples(IDS, st.integers(0, 7200)), max_size=40),
       torn=st.binary(max_size=30).filter(lambda b: b"\n" not in b), asked=IDS,
       block=st.sampled_from([16, 64, 1 << 20]))
def test_the_search_agrees_with_the_loaded_index(tmp_path_factory: pytest.TempPathFactory,
                                                  entries: list[tuple[str, int]], torn: bytes,
                                                  asked: str, block: int) -> None:
    path = tmp_path_factory.mktemp("seen") / "seen-ids.jsonl"
    path.write_bytes(b"".join(line(i, NOW - timedelta(seconds=s)) for i, s in entries) + torn)
    real_block = seen_module.SEARCH_BLOCK
    seen_module.SEARCH_BLOCK = block  # lines that straddle the blocks read
    try:
        searched = SeenIds(path, 3600)._search(asked)
    finally:
        seen_module.SEARCH_BLOCK = real_block
    loaded = SeenIds(path, 3600)
    loaded._refresh()
    assert searched == loaded._cache.get(asked)
    times = [NOW.timestamp() - s for i, s in entries if i == asked]
    assert searched == (max(times) if times else None)
