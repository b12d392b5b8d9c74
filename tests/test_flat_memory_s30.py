"""A daemon's memory stays flat with failing handlers and with dependants (session 30, helper C).

1. A failed attempt left its document in reference cycles that only CPython's cyclic collector
   freed: the handler's exception kept in the runner's ``box`` (its traceback held the frames
   holding the box), a command attempt's TIMEOUT kept in ``run_command``'s frame, and for every
   attempt a daemon's worker ran, the job's ``takeover`` (a closure over the job) and the watch
   its context wakes at a cancellation. ``handoffd`` keeps the collector's default threshold for
   it (a review measured 165-520 MB held at 20,000). Here the collector is off while attempts
   run, and what they held must be gone at once: freed by reference counting.
2. (below) The dependencies feature's notes of a dependency go once nothing waits for it.
"""
from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, handlers_workspace, memory_engine, whole_json_lines

from handoffd import Daemon, new_native_request
from handoffd.core.errors import HandlerError
from handoffd.core.timeutil import parse_iso, utc_now


class Marker:
    """An object a handler holds in a local (its frame is what a traceback keeps)."""


@contextmanager
def no_collector() -> Iterator[None]:
    """CPython's cyclic collector off (garbage left before is collected first)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def tracked(engine: Any) -> list[weakref.ref[Any]]:
    """Weak references to every job the engine runs (each holds its claim's document) and its
    context, added by a ``before_run`` hook."""
    refs: list[weakref.ref[Any]] = []
    engine.before_run.append(lambda job: refs.extend((weakref.ref(job),
                                                      weakref.ref(job.context))))
    return refs


def handlers(kept: list[weakref.ref[Any]]) -> dict[str, Callable[..., Any]]:
    """Python handlers that fail in the ways a handler fails, each holding a Marker."""

    def plain(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        mine = Marker()
        kept.append(weakref.ref(mine))
        raise ValueError(f"no ({len(doc)} keys)")

    def chained(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        mine = Marker()
        kept.append(weakref.ref(mine))
        empty: dict[str, int] = {}
        try:
            empty["missing"]
        except KeyError as exc:  # (its own traceback holds this frame too)
            raise RuntimeError("wrapped") from exc
        return {"status": "completed"}

    def own_error(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        mine = Marker()
        kept.append(weakref.ref(mine))
        raise HandlerError("refused", code="BAD_INPUT", retryable=False)

    def completes(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        kept.append(weakref.ref(Marker()))  # (dead at once: a completed attempt's job is checked)
        return {"status": "completed"}

    return {"@plain": plain, "@chained": chained, "@own": own_error, "@ok": completes}


def submit_one_each(engine: Any, agents: list[str]) -> None:
    for agent in agents:
        engine.submit({"handoff_id": f"h{agent[1:]}", "source": {"agent_id": "@t"},
                       "target": {"agent_id": agent}, "input": {"data": {}},
                       "retry_policy": {"max_retries": 0}})


def test_a_daemon_frees_each_attempt_and_its_document_without_the_collector(
        tmp_path: Path) -> None:
    """A batch's workers (the path `handoffd serve` and `run` take: the handler called on the
    worker, watched by the watchdog) run failing handlers and one that completes: no job, context
    or handler frame is left once the batch is over, with the collector off throughout."""
    kept: list[weakref.ref[Any]] = []
    funcs = handlers(kept)
    engine, _ = memory_engine(tmp_path, Clock(), funcs)
    refs = tracked(engine)
    submit_one_each(engine, list(funcs))
    with no_collector():
        report = Daemon(engine, workers=2, watch=False).run_batch(max_seconds=60)
        left = [ref() for ref in refs + kept if ref() is not None]
    assert (report.completed, report.failed) == (1, 3), report
    assert len(refs) == 8 and len(kept) == 4
    # before: every job and context (the takeover closure and the watch: a cycle for each
    # attempt) and the three failing handlers' Markers (the traceback kept in the runner's box)
    assert left == [], [type(obj).__name__ for obj in left]
    errors = {hid: engine.get(hid)[1]["error"] for hid in ("hplain", "hchained", "hown")}
    assert "ValueError: no" in errors["hplain"]["message"], errors
    assert "RuntimeError: wrapped" in errors["hchained"]["message"], errors
    assert errors["hown"]["code"] == "BAD_INPUT", errors


def test_an_engine_run_frees_a_failed_handlers_frames_without_the_collector(
        tmp_path: Path) -> None:
    """Engine.run outside a daemon (the handler on a thread of its own): the exception the
    handler raised no longer keeps its frames and the document, once the attempt's failure is
    made."""
    kept: list[weakref.ref[Any]] = []
    funcs = handlers(kept)
    engine, _ = memory_engine(tmp_path, Clock(), funcs)
    refs = tracked(engine)
    submit_one_each(engine, ["@plain", "@chained"])
    with no_collector():
        for hid in ("hplain", "hchained"):
            job = engine.take(hid)
            assert engine.run(job).status == "failed"
            del job
        left = [ref() for ref in refs + kept if ref() is not None]
    assert len(refs) == 4 and left == [], [type(obj).__name__ for obj in left]


def test_a_command_attempt_ended_by_its_timeout_is_freed_without_the_collector(
        tmp_path: Path) -> None:
    """A command specialist past its timeout: the TIMEOUT error ``run_command`` kept in its frame
    and raised from there made a cycle holding the attempt (its context, the document's JSON)."""
    from handoffd.core.specialists import Specialist, specialist_from_table
    engine, _ = memory_engine(tmp_path, Clock(), {})
    engine.registry.add(Specialist(specialist_from_table(
        "@slow", {"command": [sys.executable, "-S", "-c", "import time; time.sleep(30)"],
                  "timeout_seconds": 0.5}, engine.config.retry, "test"), None))
    refs = tracked(engine)
    submit_one_each(engine, ["@slow"])
    with no_collector():
        report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=60)
        left = [ref() for ref in refs if ref() is not None]
    assert report.failed == 1 and engine.get("hslow")[1]["error"]["code"] == "TIMEOUT", report
    assert len(refs) == 2 and left == [], [type(obj).__name__ for obj in left]


# ---------------------------------------------------------------- 2. dependency notes
# RH (session 29): a dependency a wait named stayed noted in Graph.completed/filed_at (and
# failed) after its dependants ran, about 0.2 KB each up to the 100,000-id bound: runnable_wait
# read filed_at as the dependant ran, after it had left the gate. A waiter now carries that
# time with it when it passes the gate (Graph.runnable, until it runs), and a note goes once no
# waiter in the gate could believe it (one first checked before it was made).
NOTES = ("completed", "filed_at", "failed", "unfinished", "progress", "awaited", "runnable")


class Ticking(Clock):
    """A clock moved by hand that also ticks a millisecond each time it is read (notes made
    after a waiter's first check are then later than it, as on a wall clock)."""

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now


def notes_left(graph: Any) -> dict[str, int]:
    return {name: len(getattr(graph, name, {})) for name in NOTES}


def test_a_pipeline_of_dependants_leaves_no_notes_and_counts_each_wait_from_its_dependency(
        tmp_path: Path) -> None:
    """30 dependency -> dependant pairs (every fifth dependency fails, and its dependant with
    it) and one dependant of the 24 others (a fan-in), drained by batches after an hour nobody
    ran anything: every dependant ran after its dependencies, its queue wait counted from the
    last one's filing (not from its creation, an hour before), and no note of any of them is
    left. Before: 24 notes each in completed and filed_at."""
    from test_flat_memory_s29 import answer, graph_of
    clock = Ticking()
    engine, _ = memory_engine(tmp_path, clock, {"@a": answer})
    seen: dict[str, tuple[float, datetime]] = {}  # id -> (queue wait, claimed at)

    def record(job: Any) -> None:  # (after the dependencies feature's runnable_wait)
        seen[job.handoff_id] = (job.claim.wait, job.claim.claimed_at)
    engine.before_run.append(record)
    n = 30
    good = [i for i in range(n) if i % 5]
    for i in range(n):
        engine.submit({"handoff_id": f"d-{i:02d}", "source": {"agent_id": "@t"},
                       "target": {"agent_id": "@a"}, "input": {"data": {"fail": i % 5 == 0}}})
        engine.submit({"handoff_id": f"w-{i:02d}", "source": {"agent_id": "@t"},
                       "depends_on": [f"d-{i:02d}"], "target": {"agent_id": "@a"},
                       "input": {"data": {}}})
    engine.submit({"handoff_id": "fan-in", "source": {"agent_id": "@t"},
                   "depends_on": [f"d-{i:02d}" for i in good],
                   "target": {"agent_id": "@a"}, "input": {"data": {}}})
    clock.advance(3600)
    ran = 2 * len(good) + 1 + (n - len(good))  # (a failed dependant never runs)
    for _ in range(5):  # (a batch runs what is due; a dependant left waiting, the next)
        Daemon(engine, workers=2, watch=False).run_batch(max_seconds=60)
        if len(seen) == ran:
            break
    assert len(seen) == ran, sorted(seen)
    for i in set(range(n)) - set(good):
        state, doc = engine.get(f"w-{i:02d}")
        assert state.value == "failed" and doc["error"]["code"] == "DEPENDENCY_MISSING", doc
    filings = {hid: completed_filing(engine, hid) for hid in seen
               if not (hid.startswith("d-") and int(hid[2:]) % 5 == 0)}
    filed = {hid: at for hid, at in filings.items() if at is not None}
    assert filed.keys() == filings.keys(), filings  # every other one completed
    for waiter, deps in [(f"w-{i:02d}", [f"d-{i:02d}"]) for i in good] + [
            ("fan-in", [f"d-{i:02d}" for i in good])]:
        wait, claimed = seen[waiter]
        last = max(filed[dep] for dep in deps)
        assert claimed >= last, (waiter, claimed, last)  # ran after its dependencies
        runnable_for = (claimed - last).total_seconds()
        assert runnable_for - 1.0 <= wait <= runnable_for, (waiter, wait, runnable_for)
    assert all(seen[f"d-{i:02d}"][0] >= 3600 for i in range(n))  # (runnable all along)
    assert notes_left(graph_of(engine)) == dict.fromkeys(NOTES, 0), notes_left(graph_of(engine))


def test_a_waiter_let_go_here_but_claimed_by_another_process_is_forgotten(
        tmp_path: Path) -> None:
    """With two daemons (or `--processes 2`) both gate a dependant; the one that loses the
    claim never runs it, so nothing takes what the gate carried for it: it goes once
    RUNNABLE_SECONDS old, at the next waiter let go."""
    from test_flat_memory_s29 import answer, graph_of

    from handoffd.features.dependencies import RUNNABLE_SECONDS
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"@a": answer})
    graph = graph_of(engine)
    for waiter in ("elsewhere", "here"):
        progress = graph.progress_of(waiter, ["d"])
        progress.saw_filed(clock())
        graph.let_go(waiter, progress)
        clock.advance(RUNNABLE_SECONDS + 1)
    assert list(graph.runnable) == ["here"] and graph.progress == {}


def completed_filing(engine: Any, handoff_id: str) -> datetime | None:
    """When ``handoff_id`` was filed into completed/, as its history says."""
    from handoffd.features.dependencies import completed_at
    state, doc = engine.get(handoff_id)
    return completed_at(doc) if state.value == "completed" else None


SERVE_HANDLERS = '''
import gc

from handoffd.features.dependencies import Graph


def work(handoff, ctx):
    return {"status": "completed"}


def probe(handoff, ctx):
    """The sizes of the serving daemon's dependency graph(s), as its output."""
    graphs = [o for o in gc.get_objects() if isinstance(o, Graph)]
    names = %r
    return {"status": "completed", "output": {
        name: sum(len(getattr(g, name, {})) for g in graphs) for name in names}}
''' % (NOTES,)

SERVE_CONFIG = """
[daemon]
workers = 2
durability = "fast"
settle_seconds = 0.05
rescan_seconds = 0.5

[specialists."@work"]
handler = "fm30:work"

[specialists."@probe"]
handler = "fm30:probe"
"""


def test_a_serving_daemon_keeps_no_note_of_the_dependencies_it_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`handoffd serve` drains 40 pairs and a fan-in, dropped before it started: each
    dependant's `claimed` event counts its queue wait from its dependency's filing, and the
    daemon keeps no note of any dependency (a probe handler counts the graph's entries).
    Before: 40 notes each in completed and filed_at."""
    ws = handlers_workspace(tmp_path, monkeypatch, "fm30", SERVE_HANDLERS, SERVE_CONFIG)
    n = 40

    # submitted as `handoff create` does (their creation in their history: a queue wait
    # counts from it), by an engine of this process on the workspace, not run by it
    from handoffd import build_engine
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    producer = build_engine(HandoffdWorkspace(ws.root))

    def create(hid: str, deps: list[str]) -> None:
        producer.submit(new_native_request(source="@fm30", target="@work", data={},
                                           now=utc_now(), handoff_id=hid,
                                           depends_on=deps or None))
    try:
        for i in range(n):
            create(f"d-{i}", [])
            create(f"w-{i}", [f"d-{i}"])
        create("fan-in", [f"d-{i}" for i in range(n)])
        ws.serve()
        for hid in [f"w-{i}" for i in range(n)] + ["fan-in"]:
            assert ws.wait_state(hid, timeout=60) == "completed", hid
        ws.drop("probe.json", {"handoff_id": "probe", "source": {"agent_id": "@fm30"},
                               "target": {"agent_id": "@probe"}, "input": {"data": {}}})
        assert ws.wait_state("probe", timeout=30) == "completed"
        left = ws.doc("probe")["output"]
        events = whole_json_lines(ws.root / "handoffs" / ".meta" / "events.jsonl")
    finally:
        ws.cleanup()
    claimed = {e["id"]: e for e in events if e.get("event") == "claimed"}
    done = {e["id"]: parse_iso(e["at"]) for e in events if e.get("event") == "completed"}
    for waiter, deps in [(f"w-{i}", [f"d-{i}"]) for i in range(n)] + [
            ("fan-in", [f"d-{i}" for i in range(n)])]:
        at, last = parse_iso(claimed[waiter]["at"]), max(done[dep] for dep in deps)
        assert at >= last, (waiter, at, last)  # ran after its dependencies
        # (its filing is noted a moment after its `completed` event's time)
        assert claimed[waiter]["wait"] <= (at - last).total_seconds() + 0.002, claimed[waiter]
    assert left == dict.fromkeys(NOTES, 0), left


def test_a_waiter_cancelled_while_a_daemon_serves_pins_no_note(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter cancelled while `handoffd serve` holds it (its dependency has no specialist
    here) leaves the daemon's books as it leaves pending/: the scheduler found it gone on the
    read its cancel woke and forgot it without telling the features, so the dependencies
    feature kept its progress, and its progress, the oldest, kept every later note (review RC:
    200 pairs after one cancel left 200 notes in completed and in filed_at)."""
    ws = handlers_workspace(tmp_path, monkeypatch, "fm30", SERVE_HANDLERS, SERVE_CONFIG)
    from handoffd import build_engine
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    producer = build_engine(HandoffdWorkspace(ws.root))

    def create(hid: str, deps: list[str], target: str = "@work") -> None:
        producer.submit(new_native_request(source="@fm30", target=target, data={},
                                           now=utc_now(), handoff_id=hid,
                                           depends_on=deps or None))

    def probe(hid: str) -> dict[str, int]:
        ws.drop(f"{hid}.json", {"handoff_id": hid, "source": {"agent_id": "@fm30"},
                                "target": {"agent_id": "@probe"}, "input": {"data": {}}})
        assert ws.wait_state(hid, timeout=30) == "completed"
        return ws.doc(hid)["output"]  # type: ignore[no-any-return]
    try:
        create("blocker", [], target="@nobody")  # (no specialist here: pending for good)
        create("w", ["blocker"])
        ws.serve()
        # w waits, held by the gate (its first check may come after a first probe's)
        assert any(probe(f"probe-0{n}")["progress"] == 1 for n in range(10))
        cancelled = ws.handoff("cancel", "w")
        assert cancelled.returncode == 0, cancelled.stderr
        for i in range(20):
            create(f"d-{i}", [])
            create(f"w-{i}", [f"d-{i}"])
        for i in range(20):
            assert ws.wait_state(f"w-{i}", timeout=60) == "completed", i
        left = probe("probe-1")
    finally:
        ws.cleanup()
    # (the blocker's "read unfinished" note may stay: it goes at a later such note once older
    # than UNFINISHED_SECONDS, whichever waiter reads one)
    assert left["unfinished"] <= 1, left
    assert {**left, "unfinished": 0} == dict.fromkeys(NOTES, 0), left
