"""The seen-ids record's compact index (backends/files/idindex.py) against a plain dict."""
from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from handoffd.backends.files.idindex import MIN_SLOTS, IdIndex

IDS = st.text(min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(IDS, st.floats(0, 2e9)), max_size=3000), st.lists(IDS, max_size=50))
def test_it_answers_as_a_dict_does(entries: list[tuple[str, float]], others: list[str]) -> None:
    index, plain = IdIndex(), {}
    for handoff_id, at in entries:
        index.put(handoff_id, at)
        plain[handoff_id] = max(plain.get(handoff_id, at), at)
    assert len(index) == len(plain)
    for handoff_id in list(plain) + others:
        assert index.get(handoff_id) == plain.get(handoff_id)


def traced(build) -> int:
    """Bytes still allocated by what ``build()`` returns (kept alive while measured)."""
    tracemalloc.start()
    try:
        kept = build()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept is not None
    return current


def test_it_grows_and_keeps_no_object_per_id() -> None:
    ids = [f"6f1c2a9e-3b4d-4c5e-9f7a-{n:012d}" for n in range(20_000)]

    def index() -> IdIndex:
        built = IdIndex()
        for n, handoff_id in enumerate(ids):
            built.put(handoff_id, 1.7e9 + n)
        return built

    def plain() -> dict[str, float]:  # what the record kept before (its own copy of each id)
        return {"".join(handoff_id): 1.7e9 + n for n, handoff_id in enumerate(ids)}

    built = index()
    assert len(built) == 20_000 and built.get(ids[-1]) == 1.7e9 + 19_999
    assert len(built._keys) >= 2 * 20_000 > MIN_SLOTS  # it grew, and stays at most half full
    compact, loose = traced(index), traced(plain)
    assert compact < loose / 2, (compact, loose)  # two flat arrays, no object per id
