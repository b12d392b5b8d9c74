"""A daemon killed while it aggregates a parked parent costs the parent nothing (session 16).

A parent parked for its children is claimed again to aggregate them: no handler runs
(features.aggregation.resume answers for every such claim). A ``kill -9`` of its daemon at that
step was recovered as an interrupted handler run: with ``max_retries = 0`` the parent was filed
failed (PROCESSING_ERROR, "attempt 1 was interrupted: owner process is gone") although its
children had completed; with retries it cost an attempt and a ``retry_delay_seconds`` wait. Now
the recovery hands it back to pending/ uncounted, and the next daemon aggregates it. A parent
whose aggregation ends its daemon every time is still bounded: free FREE_HANDBACKS times in a
row (handbacks.stops_in_a_row), then each crash counts, and it is dead-lettered after its
retries.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, exe, handlers_workspace

from handoffd.core.documents import book
from handoffd.core.states import State
from handoffd.core.storage import GIVEN_UP, Claim
from handoffd.service.handbacks import FREE_HANDBACKS, STOPS, stops_in_a_row
from handoffd.service.sweeper import SweepReport, free_handback, recover, sweep

HANDLERS = '''
"""A fan-out parent and its children; each call is counted in artifacts/calls.jsonl."""
import json
import os


def _count(ctx):
    with open(os.path.join(str(ctx.root), "artifacts", "calls.jsonl"), "a") as out:
        out.write(json.dumps({"id": ctx.handoff_id, "attempt": ctx.attempt}) + "\\n")


def dispatch(doc, ctx):
    _count(ctx)
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": "@child", "data": {"n": 1}}, {"to": "@child", "data": {"n": 2}}]}


def child(doc, ctx):
    _count(ctx)
    return {"status": "completed", "output": {"n": (ctx.data or {}).get("n")}}
'''

# runs `handoffd ARGS` in this process, and SIGKILLs it right after it claimed (its lease
# written) a parent whose in-progress copy waits for its children: the aggregation step, before
# any of it ran. The claim's own thread passes this point before it aggregates, so the kill
# always lands there (the store's crash points are what $HANDOFFD_CRASH_AT uses)
KILLER = '''
import json, os, signal, sys
from pathlib import Path
from handoffd.backends.files import crashpoints

ROOT = Path(sys.argv[1])


def at_aggregation(name):
    if name != "after-claim-lease":
        return
    for path in (ROOT / "handoffs" / "in-progress").glob("*.json"):
        try:
            block = json.loads(path.read_text()).get("handoffd") or {}
        except (OSError, ValueError):
            continue
        if isinstance(block.get("waiting_children"), dict) and isinstance(block.get("lease"), dict):
            os.kill(os.getpid(), signal.SIGKILL)


crashpoints.crash_hook = at_aggregation
from handoffd.cli.handoffd_cmd import main
sys.argv = ["handoffd", *sys.argv[2:]]
main()
'''


def config(retries: int, delay: float) -> str:
    """The workspace's handoffd.toml: ``retries`` retries ``delay`` seconds apart."""
    return f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 0.0
sweep_seconds = 0.5
rescan_seconds = 1.0
lease_seconds = 30.0
workers = 4
durability = "fast"

[retry]
max_retries = {retries}
retry_delay_seconds = {delay}

[specialists."@boss"]
handler = "resume_handlers:dispatch"
isolate = "never"

[specialists."@child"]
handler = "resume_handlers:child"
isolate = "never"
"""


@pytest.fixture
def rws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    workspace = handlers_workspace(tmp_path, monkeypatch, "resume_handlers", HANDLERS,
                                   config(0, 0.2))
    (tmp_path / "killer.py").write_text(KILLER)
    yield workspace
    workspace.cleanup()


def calls(ws: Workspace) -> list[str]:
    """The ids of the handler calls made in ``ws``, in order."""
    path = ws.root / "artifacts" / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def serve_until_killed_at_aggregation(ws: Workspace) -> None:
    """A real `handoffd serve` that delegates, runs the children, claims the parent to
    aggregate them, and is SIGKILLed there."""
    proc = subprocess.Popen([sys.executable, str(ws.root.parent / "killer.py"), str(ws.root),
                             "serve", "--root", str(ws.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ws.daemons.append(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err  # killed at the aggregation, not ended some other way
    assert ws.state_of("kp") == ["in-progress"]
    # both children were filed; the kill may land before a child's worker thread retired its
    # in-progress copy (the parent's claim runs on another thread): a leftover the next
    # daemon's recovery removes, checked after it ran
    for child in ("kp.c1", "kp.c2"):
        assert "completed" in ws.state_of(child) and "failed" not in ws.state_of(child)


@pytest.mark.parametrize("retries, delay", [(0, 0.2), (2, 600.0)])
def test_a_daemon_killed_while_aggregating_costs_the_parent_nothing(
        rws: Workspace, retries: int, delay: float) -> None:
    """max_retries = 0: it was filed failed; with retries (600 s apart) it waited for one."""
    rws.write_config(config(retries, delay))
    rws.create("--to", "@boss", "--id", "kp")
    serve_until_killed_at_aggregation(rws)
    done = subprocess.run([exe("handoffd"), "run", "--root", str(rws.root)],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert rws.state_of("kp") == ["completed"], rws.doc("kp").get("error")
    doc = rws.doc("kp")
    assert doc["aggregated_outcome"]["aggregated_status"] == "success"
    block = doc["handoffd"]
    assert block.get("retries", 0) == 0 and block["attempt"] == 1
    events = [e["event"] for e in block["history"]]
    assert events[-5:] == ["recovered", "handed_back", "claimed", "aggregated", "completed"]
    handed = block["history"][-4]["detail"]
    assert handed["interrupted"] is True and "aggregate its children" in handed["reason"]
    assert sorted(calls(rws)) == ["kp", "kp.c1", "kp.c2"]  # no handler ran twice
    assert [rws.state_of(c) for c in ("kp.c1", "kp.c2")] == [["completed"]] * 2


# ---------------------------------------------------------------- the crash loop stays bounded
BACKENDS = ["memory", "postgres"]


@pytest.fixture(params=BACKENDS)
def parked(request: pytest.FixtureRequest,
           tmp_path: Path) -> Iterator[tuple[Any, Clock, list[float]]]:
    """An engine (2 retries 10 s apart, 30 s leases) on ``request.param``'s store, holding the
    parent ``kp`` parked for its two children, which have completed; and its clocks (wall,
    monotonic: a PostgreSQL sweeper watches a stalled lease a whole lease long on the latter)."""
    from handoffd import Registry, build_engine, new_native_request
    from handoffd.backends.memory import MemoryBackend
    from handoffd.core.config import Config, DaemonSettings, RetryPolicy
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    clock, tick = Clock(), [0.0]
    if request.param == "postgres":
        from handoffd.backends.postgres import PostgresBackend
        backend: Any = PostgresBackend(request.getfixturevalue("pg_url"), monotonic=lambda: tick[0])
    else:
        backend = MemoryBackend()
    ws = HandoffdWorkspace(tmp_path / "mem")
    ws.ensure()
    config = Config(daemon=DaemonSettings(lease_seconds=30),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=10))
    registry = Registry()
    registry.add_function("@boss", lambda doc, ctx: {
        "status": "delegated", "aggregation": "all_success",
        "delegate": [{"to": "@child", "data": {}}, {"to": "@child", "data": {}}]}, config=config)
    registry.add_function("@child", lambda doc, ctx: {"status": "completed"}, config=config)
    engine = build_engine(ws, config, registry, clock=clock, backend=backend)
    try:
        engine.submit(new_native_request(source="@test", target="@boss", data=None,
                                         now=clock(), handoff_id="kp"))
        for hid in ("kp", "kp.c1", "kp.c2"):  # delegate (parks it), then run each child
            job = engine.take(hid)
            assert job is not None
            engine.file(job.claim, job.dialect, job.specialist, engine.run(job))
        state, doc = engine.get("kp")
        assert state is State.PENDING and isinstance(book(doc).get("waiting_children"), dict)
        yield engine, clock, tick
    finally:
        backend.close()


def crash_at_aggregation(engine: Any, clock: Clock, tick: list[float]) -> str:
    """Claim the parked parent to aggregate it, let its owner "die" there (its lease runs
    out), sweep; the parent's state after the sweep."""
    clock.advance(11)  # (past a retry's delay)
    job = engine.take("kp")
    assert job is not None and job.claim.attempt == book(job.claim.doc)["attempt"]
    clock.advance(31)
    report = sweep(engine)
    if not report.recovered:  # a sweeper watches a lease unrenewed for a lease period first
        tick[0] += 31
        clock.advance(1)
        report = sweep(engine)
    assert report.recovered == ["kp"]
    return engine.get("kp")[0].value


def test_an_aggregation_that_crashes_every_time_is_bounded(
        parked: tuple[Any, Clock, list[float]]) -> None:
    """Free FREE_HANDBACKS times in a row, then each crash counts: 2 retries, then failed."""
    engine, clock, tick = parked
    seen = []
    for _ in range(FREE_HANDBACKS + 3):
        state = crash_at_aggregation(engine, clock, tick)
        doc = engine.get("kp")[1]
        seen.append((state, book(doc).get("retries", 0), book(doc).get("attempt")))
    # (a pending document's attempt is those counted so far: the delegating one was given back)
    assert seen == [("pending", 0, 0)] * FREE_HANDBACKS + [
        ("pending", 1, 1), ("pending", 2, 2), ("failed", 2, 3)], seen
    error = engine.get("kp")[1]["error"]
    assert error["code"] == "PROCESSING_ERROR"
    assert f"interrupted {FREE_HANDBACKS + 3} times in a row" in error["message"]
    # each counted crash carries the run's length on: the retry it scheduled continues it
    assert book(engine.get("kp")[1])["last_error"]["details"] == {STOPS: FREE_HANDBACKS + 2}


def test_a_parent_aggregated_after_its_free_hand_back(
        parked: tuple[Any, Clock, list[float]]) -> None:
    engine, clock, tick = parked
    assert crash_at_aggregation(engine, clock, tick) == "pending"
    job = engine.take("kp")
    assert job is not None
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.COMPLETED
    doc = engine.get("kp")[1]
    assert doc["aggregated_outcome"]["aggregated_status"] == "success"
    assert book(doc).get("retries", 0) == 0 and book(doc)["attempt"] == 1


def test_a_given_up_claim_is_free_ten_times_in_a_row_then_counted(
        parked: tuple[Any, Clock, list[float]]) -> None:
    """The hand-back this reuses (a claim its own process gave up when its filing failed) was
    free for ever: its "recovered" record ended the run it was counting."""
    engine, clock, _ = parked
    states = []
    for _ in range(FREE_HANDBACKS + 1):
        clock.advance(11)
        job = engine.take("kp")
        assert job is not None
        book(job.claim.doc).pop("waiting_children", None)  # (as a handler's attempt: not a resume)
        given_up = Claim(job.claim.id, job.claim.doc, job.claim.token, job.claim.attempt,
                         job.claim.handle, recovered=GIVEN_UP)
        recover(engine, given_up, SweepReport())
        states.append((engine.get("kp")[0].value, book(engine.get("kp")[1]).get("retries", 0)))
    assert states == [("pending", 0)] * FREE_HANDBACKS + [("pending", 1)], states


# ---------------------------------------------------------------- which recoveries are free
def event(name: str, **detail: Any) -> dict[str, Any]:
    return {"at": "2026-01-01T00:00:00Z", "event": name, **({"detail": detail} if detail else {})}


def doc_with(*events: dict[str, Any], **block: Any) -> dict[str, Any]:
    return {"handoff_id": "h", "handoffd": {"history": list(events), **block}}


def test_a_recovery_that_handed_back_continues_the_run_of_stops() -> None:
    free = event("handed_back", interrupted=True)
    counted = event("retry_scheduled", error={"code": "PROCESSING_ERROR", "details": {STOPS: 3}})
    stop = event("handed_back", interrupted=True, reason="daemon stopping")
    assert stops_in_a_row(doc_with(event("claimed"), event("recovered"), free, event("claimed"),
                                   stop, event("claimed"), event("recovered"), counted,
                                   event("claimed"))) == 3
    # a recovery that charged an attempt ends it; so does one not (yet) followed by anything
    assert stops_in_a_row(doc_with(stop, event("claimed"), event("recovered"),
                                   event("retry_scheduled", error={"code": "X"}))) == 0
    assert stops_in_a_row(doc_with(stop, event("claimed"), event("recovered"))) == 0
    assert stops_in_a_row(doc_with(event("recovered"), event("recovered"), free)) == 1


def test_only_an_aggregation_or_a_given_up_claim_is_recovered_free() -> None:
    gone = "owner process is gone (its claim lock is free)"
    parked = doc_with(event("delegated"), event("claimed"), waiting_children={"children": []})
    assert free_handback(parked, gone) is not None
    assert free_handback(doc_with(event("claimed")), GIVEN_UP) is not None
    # an answered clarification runs its handler again when claimed: a crash then is charged
    answered = doc_with(event("needs_clarification"), event("answered"), event("claimed"))
    assert free_handback(answered, gone) is None
    assert free_handback(doc_with(event("claimed")), gone) is None
    assert free_handback({"handoffd": "x", "waiting_children": {}}, gone) is None
