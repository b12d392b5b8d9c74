"""A serving daemon's memory stays flat over many handoffs (session 29, helper G).

`make bench`'s memory figure grew 35.8 -> 39.1 MB over 10,000 handoffs, still growing at the end.
tracemalloc inside the daemon found, besides the seen-ids index (bounded by its TTL), the
dependencies feature's ``Graph.completed`` and ``Graph.filed_at``: every handoff filed noted its id
and two times there (and every failure in ``Graph.failed``), up to 100,000 ids, though nothing
depended on anything and no waiter could ever use the notes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import Clock, memory_engine

from handoffd import Daemon, State
from handoffd.features.dependencies import Graph


def answer(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Completes, or fails for good when its data says so."""
    if (ctx.data or {}).get("fail"):
        return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "no",
                                              "retryable": False}}
    return {"status": "completed"}


def graph_of(engine: Any) -> Graph:
    """The dependencies feature's graph the engine files through (its on_filed listener)."""
    return next(f.__self__ for f in engine.on_filed
                if isinstance(getattr(f, "__self__", None), Graph))


def test_filings_nothing_waits_for_leave_no_entry_per_handoff(tmp_path: Path) -> None:
    engine, _ = memory_engine(tmp_path, Clock(), {"@a": answer})
    for i in range(60):
        engine.submit({"handoff_id": f"h-{i:03d}", "source": {"agent_id": "@t"},
                       "target": {"agent_id": "@a"}, "input": {"data": {"fail": i % 2 == 1}}})
    report = Daemon(engine, workers=2, watch=False).run_batch(max_seconds=60)
    assert (report.completed, report.failed) == (30, 30), report
    graph = graph_of(engine)
    sizes = {name: len(getattr(graph, name)) for name in
             ("completed", "filed_at", "failed", "unfinished", "progress")}
    assert sizes == dict.fromkeys(sizes, 0), sizes  # before: 30, 30, 30 (one per filing)


def test_a_filing_a_waiter_may_use_is_still_noted(tmp_path: Path) -> None:
    """What a waiter's wait names (its target, the failures it watches) is noted as this daemon
    files it (the waiter woken by it goes on without reading it); what no wait names is not,
    also while waiters are in the gate (review RG: one waiter made every filing noted), and
    nothing is once the waiter leaves."""
    engine, _ = memory_engine(tmp_path, Clock(), {"@a": answer})
    graph = graph_of(engine)
    progress = graph.progress_of("waiter", ["dep", "bad"])
    graph.awaiting(progress, ("dep", "bad"))
    graph.filed("dep", State.COMPLETED)
    graph.filed("bad", State.FAILED)
    graph.filed("unrelated", State.COMPLETED)
    graph.filed("unrelated-failure", State.FAILED)
    assert "dep" in graph.completed and "dep" in graph.filed_at and "bad" in graph.failed
    assert "unrelated" not in graph.completed and "unrelated" not in graph.filed_at
    assert "unrelated-failure" not in graph.failed
    graph.done_with("waiter")
    assert graph.awaited == {}
    graph.filed("other", State.COMPLETED)
    graph.filed("worse", State.FAILED)
    assert "other" not in graph.completed and "worse" not in graph.failed


def test_a_slow_dependency_leaves_no_note_of_the_filings_beside_it(tmp_path: Path) -> None:
    """RG's case, end to end in one batch: a dependant waits for a slow handoff while 40
    unrelated handoffs are filed; none of them is noted, and the dependant runs once its
    dependency completed."""
    import time as real_time

    def slow(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        real_time.sleep(1.0)
        return {"status": "completed"}

    engine, _ = memory_engine(tmp_path, Clock(), {"@a": answer, "@slow": slow})
    engine.submit({"handoff_id": "s", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@slow"}, "input": {"data": {}}})
    engine.submit({"handoff_id": "w", "source": {"agent_id": "@t"}, "depends_on": ["s"],
                   "target": {"agent_id": "@a"}, "input": {"data": {}}})
    for i in range(40):
        engine.submit({"handoff_id": f"u-{i:03d}", "source": {"agent_id": "@t"},
                       "target": {"agent_id": "@a"}, "input": {"data": {}}})
    report = Daemon(engine, workers=2, watch=False).run_batch(max_seconds=60)
    assert report.completed == 42, report
    graph = graph_of(engine)
    assert not [hid for hid in graph.completed if hid.startswith("u-")], graph.completed
    assert graph.awaited == {} and graph.progress == {}


def test_a_waiter_gone_elsewhere_is_dropped_at_the_next_rescan(tmp_path: Path) -> None:
    """RH: a waiter that leaves pending/ without passing this daemon's gate (cancelled by
    `handoff cancel`, run by another daemon or process) kept its progress and its awaited ids
    in the graph for ever, and every later filing of what it waited for was noted. A rescan
    that finds it gone drops them, as at its full re-check."""
    engine, _ = memory_engine(tmp_path, Clock(), {"@a": answer})
    daemon = Daemon(engine, workers=2, watch=False)
    graph = graph_of(engine)
    progress = graph.progress_of("w", ["s"])
    graph.awaiting(progress, ("s",))
    scheduler = daemon.scheduler
    with scheduler.cv:
        scheduler.waiting["w"] = "waiting for dependency s (pending)"
        scheduler._forget_gone(set())  # (a rescan: w is in pending/ no more)
    assert graph.progress == {} and graph.awaited == {}
    graph.filed("s", State.COMPLETED)
    assert "s" not in graph.completed
