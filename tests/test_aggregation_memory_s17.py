"""A fan-out parent's aggregation holds a bounded amount of its children's answers (session 17).

``resume`` read every child's whole output and artifacts into a ChildInfo and held them all while
it aggregated, and the children gate did the same at every look only to learn statuses: a parent
of 100 children answering 16 MiB each held 1.6 GB (20 children of 8 MiB: `handoffd run` peaked at
243 MB RSS, 40 of them at 415 MB). Now the gate keeps no output, and the aggregation holds at most
max_output_bytes of them (the rest measured, let go and read again only when copied): 105 MB for
both. The filed answer is the same as before (test_aggregation_size_s16 keeps its shape)."""
from __future__ import annotations

import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace
from test_aggregation_size_s16 import big_workspace

from handoffd import Daemon, Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.engine import Engine
from handoffd.features import aggregation, answer_copies, childfacts, orchestration

N = 16  # children
SIZE = 512 * 1024  # each one's output: N of them are 8 MiB
MAX_OUTPUT = SIZE + SIZE // 2  # the budget: one child's output is copied, and held
PEAKS: dict[str, int] = {}


def boss(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Delegates to N @big children (all_success)."""
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": "@big", "data": {"n": n}} for n in range(N)]}


def big(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """An output of SIZE bytes; every other child an artifact too."""
    n = (ctx.data or {}).get("n", 0)
    return {"status": "completed", "output": {"blob": chr(97 + n % 26) * SIZE},
            "artifacts": [{"name": f"note{n}.md", "content": f"note {n}"}] if n % 2 else []}


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """A files-store engine whose aggregation records its peak traced memory (``PEAKS``)."""
    real = aggregation.resume

    def measured(engine: Engine, job: Any, started: Any) -> Any:
        if not tracemalloc.is_tracing():
            return real(engine, job, started)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            return real(engine, job, started)
        finally:
            PEAKS["resume"] = max(PEAKS.get("resume", 0),
                                  tracemalloc.get_traced_memory()[1] - before)

    monkeypatch.setattr(aggregation, "resume", measured)  # (installed by build_engine)
    PEAKS.clear()
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(max_output_bytes=MAX_OUTPUT, durability="fast"),
                    retry=RetryPolicy(max_retries=0))
    registry = Registry()
    for agent, func in (("@boss", boss), ("@big", big)):
        registry.add_function(agent, func, config=config, concurrency=2, isolate="never")
    return build_engine(ws, config, registry)


def run_family(engine: Engine) -> dict[str, Any]:
    doc = new_native_request(source="@test", target="@boss", data=None, now=engine.clock(),
                             handoff_id="fan")
    assert engine.submit(doc) == "fan"
    tracemalloc.start()
    try:
        for _ in range(4):  # park, run the children, aggregate
            assert Daemon(engine, workers=2, watch=False).run_batch().error is None
            state, filed = engine.get("fan")
            if state is State.COMPLETED:
                return filed
    finally:
        tracemalloc.stop()
    raise AssertionError(f"fan is {state}")


def test_the_aggregation_holds_a_bounded_amount(engine: Engine) -> None:
    filed = run_family(engine)
    ids = [f"fan.c{n}" for n in range(1, N + 1)]
    results = filed["output"]["results"]
    assert results["fan.c1"] == {"blob": "a" * SIZE}  # within the budget: copied
    assert filed["output"]["outputs_omitted"] == ids[1:]
    assert all(results[cid]["size_bytes"] == SIZE + 11 for cid in ids[1:])
    # before: all N outputs held at once while aggregating (9.6 MB traced; now 2.1 MB)
    assert 0 < PEAKS["resume"] < 6 * SIZE + MAX_OUTPUT, PEAKS


def test_the_children_gate_holds_no_output(engine: Engine) -> None:
    run_family(engine)
    ids = [f"fan.c{n}" for n in range(1, N + 1)]
    # the children gate (a parked parent's): statuses, no output held
    parked = {"handoffd": {"waiting_children": {"children": ids, "aggregation": "all_success"}}}
    tracemalloc.start()
    try:
        verdicts = [orchestration.children_gate(engine, None, parked) for _ in range(3)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert verdicts == [None] * 3  # (ready)
    assert peak < 6 * SIZE, peak  # before: N outputs per look (9.5 MB traced; now 1.6 MB)
    infos = [childfacts.child_info(engine, cid) for cid in ids]
    assert all(i.status == "success" and i.output is None and i.artifacts == [] for i in infos)


def test_a_childs_facts_keep_only_short_strings_of_a_huge_failed_file(engine: Engine) -> None:
    """A failed/ file placed with a 3 MB error message, a deep ``details`` list and huge
    strings: the gate (and the aggregation) keep its error's code and the first 200
    characters of its message, a short specialist and no finished_at, not megabytes per
    child at every look (the gate's memory of finished children held 178 MB of such errors
    under its 8 MiB bound)."""
    from handoffd.features import children_gate as gates
    run_family(engine)
    completed = engine.ws.handoffs / "completed" / "fan.c2.json"
    doc = json.loads(completed.read_text())
    doc.update(error={"code": "X" * 1000, "message": "m" * 3_000_000, "details": [[]] * 100_000},
               failed_at="t" * 100_000, target={"agent_id": "@" + "a" * 100_000})
    (engine.ws.handoffs / "failed" / "fan.c2.json").write_text(json.dumps(doc))
    completed.unlink()
    info = childfacts.child_info(engine, "fan.c2")
    assert info.status == "failed" and info.finished_at is None
    assert info.error == {"code": "X" * 200, "message": "m" * 200}
    assert info.specialist == "@" + "a" * 199
    memory = gates.FinishedChildren(clock=lambda: time.time() + 10)  # the file is settled
    tracemalloc.start()
    try:
        kept = memory.info(engine, "fan.c2")
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(memory) == 1 and kept.error == info.error
    assert held < 1 << 20, held  # what stays after the read (before: the 3 MB message and more)


def test_an_answer_let_go_is_read_again_to_the_same_copies(engine: Engine) -> None:
    run_family(engine)
    ids = [f"fan.c{n}" for n in range(1, N + 1)]
    held = [childfacts.read_child(engine, cid, childfacts.Holding(sys.maxsize)) for cid in ids]
    holding = childfacts.Holding(SIZE + 20)
    let_go = [childfacts.read_child(engine, cid, holding) for cid in ids]
    assert let_go[0].held and let_go[0].output == {"blob": "a" * SIZE}
    assert all(not i.held and i.output is None and i.artifacts == [] for i in let_go[1:])
    assert [i.artifacts_count for i in let_go] == [n % 2 for n in range(N)]
    for budget in (0, 100, SIZE + 11, 3 * SIZE, N * SIZE):
        for k in (None, 0, 5):
            assert answer_copies.copies(let_go, None if k is None else let_go[k], budget) == \
                answer_copies.copies(held, None if k is None else held[k], budget), (budget, k)
    # a child's document gone (or changed) since it was measured: named, never a wrong copy
    (engine.ws.handoffs / "completed" / "fan.c4.json").unlink()
    got = answer_copies.copies(let_go, None, N * SIZE)
    assert "could not be read again" in got.results["fan.c4"]["output_omitted"]
    assert "fan.c4" in got.omitted and got.results["fan.c3"] == {"blob": "c" * SIZE}
    [record] = [a for a in got.artifacts if (a.get("metadata") or {}).get("child_id") == "fan.c4"]
    assert record["artifact_type"] == "artifacts_omitted"


def test_the_answers_held_but_not_copied_are_let_go_before_the_winners_is_read_again(
        engine: Engine) -> None:
    """Review R10: c1's answer was held while reading (it fit the budget first), but the
    first_success winner c5, read last and let go, is what is copied: c1 is let go before c5
    is read again, so the two are never held together (twice the budget)."""
    run_family(engine)
    ids = [f"fan.c{n}" for n in range(1, N + 1)]
    holding = childfacts.Holding(SIZE + 20)  # c1 fits; the rest are let go
    infos = [childfacts.read_child(engine, cid, holding) for cid in ids]
    assert infos[0].held and not infos[4].held
    seen_held: list[bool] = []
    reread = infos[4].reread
    assert reread is not None

    def reading_c5() -> childfacts.ChildInfo:
        seen_held.append(infos[0].held)  # c1, while the winner is read again
        return reread()

    infos[4].reread = reading_c5
    got = answer_copies.copies(infos, infos[4], SIZE + 11)
    assert got.results["fan.c5"] == {"blob": "e" * SIZE} and "fan.c1" in got.omitted
    assert seen_held == [False] and infos[0].output is None


# ---------------------------------------------------------------- end to end
BIG = 1_000_000


@pytest.fixture
def bws(tmp_path: Path) -> Iterator[Workspace]:
    ws = big_workspace(tmp_path, f"max_output_bytes = {2 * BIG + 100}", 2)
    yield ws
    ws.cleanup()


def test_a_large_family_is_filed_with_its_copies_and_omissions(bws: Workspace) -> None:
    sizes = [BIG, 10, BIG, BIG, 20, BIG]  # c1, c2, c3 copied (the budget); c4, c6 named
    data = {"aggregation": "all_success", "delegate": [{"to": "@big", "data": {"big": n}}
                                                       for n in sizes]}
    bws.create("--to", "@big", "--id", "fam", "--data", json.dumps(data))
    proc = bws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = bws.handoff("wait", "fam", "--timeout", "5", "--json", timeout=60)
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout)["output"]
    results = out["results"]
    for n, cid in ((BIG, "fam.c1"), (10, "fam.c2"), (BIG, "fam.c3"), (20, "fam.c5")):
        assert results[cid] == {"blob": "y" * n}, cid
    assert out["outputs_omitted"] == ["fam.c4", "fam.c6"]
    for cid in ("fam.c4", "fam.c6"):
        assert results[cid]["size_bytes"] == BIG + 11
        assert f"`handoff show {cid}`" in results[cid]["output_omitted"]
        assert "not copied: an aggregated answer copies at most" in results[cid]["output_omitted"]
    assert out["summary"].startswith("6/6 subtasks succeeded (all_success); not copied (too "
                                     "large): fam.c4, fam.c6")
