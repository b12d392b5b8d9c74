"""Deadlines, expiry and cancellation around orchestration (review 14b): a handoff that started
and waits (for its children, for an answer) is never expired as "not started"; a hi_moe parent's
hard deadline is its aggregation's; `handoff retry` of a hi_moe message restarts its deadline;
an unreadable descendant stops no cascade; a child waiting for its own parent is refused as a
cycle; a crashed delegation's children are cancelled when its parent fails for good."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import SPECIALISTS, Clock, Workspace, handlers_workspace, memory_engine

from handoffd.core.documents import first_seen
from handoffd.core.states import State
from handoffd.core.timeutil import iso

HANDLERS = '''
import pathlib

def dispatch(doc, ctx):
    data = ctx.data or {}
    if isinstance(data, dict) and "task_data" in data:   # a hi_moe DelegationPayload
        data = data["task_data"]
    return {"status": "delegated", "aggregation": data.get("aggregation", "all_success"),
            "summary": "fan-out", "delegate": [dict(c) for c in data["children"]]}

def scorer(doc, ctx):
    data = ctx.data or {}
    if isinstance(data, dict) and "task_data" in data:
        data = data["task_data"]
    if data.get("sleep") and ctx.cancelled.wait(data["sleep"]):
        return {"status": "failed", "error": {"code": "CANCELLED", "message": "stopped"}}
    return {"status": "completed", "output": {"value": data.get("value")}}

def asker(doc, ctx):
    answers = (doc.get("input") or {}).get("clarifications") or []
    if not answers:
        return {"status": "needs_clarification", "questions": ["which?"]}
    return {"status": "completed", "output": {"decision": answers[-1]["answer"]}}
'''


def config() -> str:
    import sys
    return f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 1.0
workers = 6
durability = "fast"

[retry]
max_retries = 0
retry_delay_seconds = 0.2

[specialists."@flaky"]
command = ["{sys.executable}", "-S", "{SPECIALISTS / 'flaky.py'}"]
timeout_seconds = 60

[specialists."@dispatcher"]
handler = "dl_handlers:dispatch"
timeout_seconds = 120

[specialists."@scorer"]
handler = "dl_handlers:scorer"
concurrency = 6
timeout_seconds = 60

[specialists."@asker"]
handler = "dl_handlers:asker"
"""


@pytest.fixture
def dws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "dl_handlers", HANDLERS, config())
    yield ws
    ws.cleanup()


def fan_out(ws: Workspace, hid: str, children: list[dict[str, Any]], *extra: str) -> None:
    ws.create("--to", "@dispatcher", "--id", hid, *extra, "--data",
              json.dumps({"aggregation": "all_success", "children": children}))


def history(ws: Workspace, hid: str) -> list[str]:
    return [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]


def hi_moe(hid: str, timeout_ms: int, hint: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"version": "1.0.0", "id": hid, "timestamp": "2025-01-15T10:30:00Z",
            "source_tier": "ABSTRACT_ARCHITECT", "target_tier": "ROUTING_DISPATCHER",
            "correlation_id": None,
            "payload": {"task_type": "x", "objective": "o", "constraints": [], "context_refs": [],
                        "priority": 1, "timeout_ms": timeout_ms, "specialist_hint": hint,
                        "deadline_hint": None, "task_data": data}}


# ---------------------------------------------------------------- 1: expiry of started work
def test_a_parent_that_started_in_time_is_aggregated_after_its_expiry(dws: Workspace) -> None:
    """--expires-after bounds the start: a parent that delegated in time waits for its
    children past it and is aggregated (it was filed EXPIRED, its children orphaned)."""
    daemon = dws.serve()
    try:
        fan_out(dws, "p-exp", [{"to": "@scorer", "data": {"sleep": 3, "value": 1}}],
                "--expires-after", "1s")
        dws.wait_state("p-exp", ("completed", "failed"), timeout=40)
    finally:
        dws.stop(daemon)
    doc = dws.doc("p-exp")
    assert dws.state_of("p-exp") == ["completed"], doc.get("error")
    assert doc["aggregated_outcome"]["aggregated_status"] == "success"
    assert dws.state_of("p-exp.c1") == ["completed"]
    assert "waiting_children" not in doc["handoffd"]


def test_a_question_asked_in_time_runs_with_its_answer_after_the_expiry(dws: Workspace) -> None:
    daemon = dws.serve()
    try:
        dws.create("--to", "@asker", "--id", "ask-exp", "--expires-after", "1s", "--data", "{}")
        deadline = time.monotonic() + 30
        while "awaiting" not in dws.doc("ask-exp").get("handoffd", {}):
            assert time.monotonic() < deadline, "never asked"
            time.sleep(0.05)
        time.sleep(1.5)  # past its expiry, parked (the scheduler looked at it then)
        assert dws.state_of("ask-exp") == ["pending"]
        answered = dws.handoff("answer", "ask-exp", "--data", '"-1"')
        assert answered.returncode == 0, answered.stderr
        dws.wait_state("ask-exp", ("completed", "failed"), timeout=30)
    finally:
        dws.stop(daemon)
    assert dws.state_of("ask-exp") == ["completed"], dws.doc("ask-exp").get("error")
    assert dws.doc("ask-exp")["output"] == {"decision": "-1"}


def test_expiry_bounds_starts_not_resumptions() -> None:
    """resumes(): parked, or answered and not started since; a retry is a new start."""
    from handoffd.core.admission import resumes
    def doc(*events: str, **block: Any) -> dict[str, Any]:
        return {"handoffd": {"history": [{"event": e} for e in events], **block}}
    assert not resumes(doc("created"))
    assert not resumes(doc("created", "claimed", "throttled"))
    assert resumes(doc("created", "claimed", "delegated"))
    assert resumes(doc("created", "claimed", "needs_clarification", "answered"))
    assert resumes(doc("created", "claimed", "needs_clarification", "answered", "claimed",
                       "handed_back"))
    assert not resumes(doc("created", "claimed", "delegated", "claimed", "failed", "retried"))
    assert not resumes(doc("created", "claimed", "answered", "claimed", "retry_scheduled"))
    assert resumes(doc("created", "claimed", "recovered", "retry_scheduled",
                       waiting_children={"children": []}))
    assert not resumes({"handoffd": "forged"}) and not resumes({})


def test_a_hi_moe_parent_at_its_deadline_is_aggregated_not_answered_unrun(
        dws: Workspace) -> None:
    """seed 000: at the parent's deadline its open children are cancelled and counted timeout,
    and it is aggregated, keeping a child that succeeded (it was answered `timeout` "was not
    started before its deadline")."""
    msg = hi_moe("hm-1", 5000, "@dispatcher", {"children": [
        {"to": "@scorer", "data": {"sleep": 30}}, {"to": "@scorer", "data": {"value": 2}}]})
    path = dws.root / "msg.json"
    path.write_text(json.dumps(msg))
    daemon = dws.serve()
    try:
        assert dws.handoff("create", "--file", str(path)).returncode == 0
        dws.wait_state("hm-1", ("completed", "failed"), timeout=40)
        doc = dws.doc("hm-1")
        assert "aggregated" in history(dws, "hm-1"), doc["payload"]
        dws.wait_state("hm-1.c1", ("completed", "failed"), timeout=20)
    finally:
        dws.stop(daemon)
    assert doc["payload"]["status"] == "partial", doc["payload"]
    assert "hm-1.c1 timeout" in doc["payload"]["summary"]
    assert dws.state_of("hm-1.c2") == ["completed"]


# ---------------------------------------------------------------- 2: retry of a hi_moe message
def test_a_retried_hi_moe_message_runs_again_with_a_new_deadline(dws: Workspace) -> None:
    """docs/formats.md: a `timeout` answer is final, but `handoff retry` starts it again by
    hand: its deadline counts from the retry (it was answered unrun, "not started before its
    deadline", counted from its creation)."""
    path = dws.root / "msg.json"
    # 5 s: room for `handoffd run` to start and claim on a loaded machine (with 1 s, a slow
    # start answered the first run "not started" and the retried one too; with 2.5 s, a
    # retried one under a load of 15: session 31's CI)
    path.write_text(json.dumps(hi_moe("hm-r", 5000, "@scorer", {"sleep": 12})))
    assert dws.handoff("create", "--file", str(path)).returncode == 0
    dws.handoffd("run")
    assert dws.doc("hm-r")["payload"]["status"] == "timeout"  # run, or not started in time
    time.sleep(5.1)  # its first deadline is well past when it is retried
    assert dws.handoff("retry", "hm-r").returncode == 0
    dws.handoffd("run")
    detail = dws.doc("hm-r")["payload"]["error_detail"]
    assert "did not finish within" in detail and "not started" not in detail, detail
    assert history(dws, "hm-r")[-3:] == ["retried", "claimed", "failed"]


def test_first_seen_counts_from_the_last_manual_retry() -> None:
    def at(seconds: int) -> str:
        return f"2026-01-01T00:00:{seconds:02d}Z"
    doc = {"handoffd": {"history": [{"event": "created", "at": at(0)},
                                    {"event": "retried", "at": at(10)},
                                    {"event": "retry_scheduled", "at": at(15)},
                                    {"event": "retried", "at": at(20)},
                                    {"event": "claimed", "at": at(30)}]}}
    assert iso(first_seen(doc)) == "2026-01-01T00:00:20.000Z"  # type: ignore[arg-type]
    del doc["handoffd"]["history"][1:4]
    assert iso(first_seen(doc)) == "2026-01-01T00:00:00.000Z"  # type: ignore[arg-type]


# ---------------------------------------------------------------- 3: cascades past unreadables
def _parked_family(tmp_path: Path, clock: Clock) -> tuple[Any, Any]:
    def dispatch(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return {"status": "delegated", "delegate": [{"to": "@worker", "data": {}}] * 3}
    engine, backend = memory_engine(tmp_path, clock, {"@dispatcher": dispatch,
                                                      "@worker": lambda doc, ctx: {}})
    engine.submit({"handoff_id": "pk", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@dispatcher"}, "input": {"data": {}}})
    job = engine.take("pk")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    return engine, backend


def test_one_unreadable_descendant_stops_no_cascade(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.core.errors import UnreadableDocument
    from handoffd.features import cancel_family
    engine, backend = _parked_family(tmp_path, Clock())
    real_get = backend.get

    def get(handoff_id: str) -> Any:
        if handoff_id == "pk.c2":
            raise UnreadableDocument("pending/pk.c2.json is not valid JSON", handoff_id=handoff_id,
                                     code="MALFORMED_JSON")
        return real_get(handoff_id)
    monkeypatch.setattr(backend, "get", get)
    results = cancel_family.cancel(engine, "pk", reason="stop", cascade=True)
    assert [(r.handoff_id, r.action) for r in results] == [
        ("pk", "cancelled"), ("pk.c1", "cancelled"), ("pk.c2", "unreadable"),
        ("pk.c3", "cancelled")]
    assert results[2].detail.startswith("not cancelled: MALFORMED_JSON: ")
    assert backend.cancel_request("pk.c2") is not None  # whoever reads it later cancels it


def test_a_cancellation_message_cascades_past_an_unreadable_descendant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.core.errors import UnreadableDocument
    from handoffd.features import cancellation
    engine, backend = _parked_family(tmp_path, Clock())
    real_get = backend.get

    def get(handoff_id: str) -> Any:
        if handoff_id == "pk.c1":
            raise UnreadableDocument("pending/pk.c1.json is not valid JSON", handoff_id=handoff_id,
                                     code="MALFORMED_JSON")
        return real_get(handoff_id)
    monkeypatch.setattr(backend, "get", get)
    message = {"version": "1.0.0", "id": "msg-c1", "timestamp": "2025-01-15T10:31:00Z",
               "source_tier": "ABSTRACT_ARCHITECT", "target_tier": "ROUTING_DISPATCHER",
               "correlation_id": None,
               "payload": {"target_message_id": "pk", "reason": "revision", "cascade": True}}
    engine.submit(message)
    assert cancellation.handle_message(engine, "msg-c1") is State.COMPLETED
    for hid in ("pk", "pk.c2", "pk.c3"):
        assert real_get(hid)[0] is State.FAILED and real_get(hid)[1]["status"] == "cancelled"
    summary = real_get("msg-c1")[1]["payload"]["summary"]
    assert "2 descendant(s) cancelled" in summary and "1 unreadable, not cancelled: pk.c1" \
        in summary, summary


# ---------------------------------------------------------------- 4: a child waiting for its parent
def test_a_child_that_waits_for_its_own_parent_is_refused_as_a_cycle(dws: Workspace) -> None:
    """pz.c1 depends on xz, xz on pz, and pz waits for pz.c1: it held until pz's deadline,
    shown as plain waits; now the delegation fails naming the cycle."""
    fan_out(dws, "pz", [{"to": "@scorer", "data": {}, "depends_on": ["xz"]}],
            "--timeout-seconds", "60")
    dws.create("--to", "@scorer", "--id", "xz", "--depends-on", "pz", "--data", "{}")
    started = time.monotonic()
    dws.handoffd("run", "--max-seconds", "30")
    assert time.monotonic() - started < 30  # (not held until the parent's deadline)
    error = dws.doc("pz")["error"]
    assert error["code"] == "VALIDATION_FAILED" and "xz -> pz (a cycle)" in error["message"]
    assert dws.doc("xz")["error"]["code"] == "DEPENDENCY_MISSING"
    assert "handoff retry --force xz" in dws.doc("xz")["error"]["message"]


def test_the_gate_follows_a_parked_parents_children(tmp_path: Path) -> None:
    """The dependency walk sees a parked parent waiting for its children (its sealed
    bookkeeping's, never a block anyone wrote into a pending file)."""
    from handoffd.features.dependencies import Graph
    engine, backend = _parked_family(tmp_path, Clock())
    graph = Graph(engine)
    assert graph.state("pk")[1] == ["pk.c1", "pk.c2", "pk.c3"]
    assert graph.path_to(["pk"], {"pk.c3"}) == ["pk", "pk.c3"]
    assert graph.path_to(["pk.c1"], {"pk"}) is None


# ---------------------------------------------------------------- 5: a crash on the last attempt
def test_children_of_a_crashed_last_attempt_are_cancelled_with_their_parent(
        tmp_path: Path) -> None:
    """The parent's attempt made a child, then its process died; the sweep files the parent
    for good (no retries left): the child, which a replay would have adopted, is cancelled
    instead of running with nobody waiting for it."""
    from handoffd.service.sweeper import sweep
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@dispatcher": lambda doc, ctx: {},
                                                      "@worker": lambda doc, ctx: {}})
    engine.submit({"handoff_id": "big", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@dispatcher"}, "input": {"data": {}},
                   "retry_policy": {"max_retries": 0}})
    # made before the attempt: it says parent_id, but no attempt of the parent made it
    engine.submit({"handoff_id": "other", "source": {"agent_id": "@t"}, "parent_id": "big",
                   "target": {"agent_id": "@worker"}, "input": {"data": {}}})
    clock.advance(0.5)
    job = engine.take("big")
    clock.advance(0.5)  # the child is made while the attempt runs
    backend.create({"handoff_id": "big.c1", "source": {"agent_id": "@dispatcher"},
                    "target": {"agent_id": "@worker"}, "input": {"data": {}},
                    "parent_id": "big"}, "big.c1", clock())
    assert job is not None  # ... and the process dies: the claim is left for its lease
    clock.advance(60)
    sweep(engine)
    assert backend.get("big")[0] is State.FAILED
    assert backend.get("big.c1")[0] is State.FAILED
    assert backend.get("big.c1")[1]["status"] == "cancelled"
    assert backend.get("other")[0] is State.PENDING


def test_a_parked_parents_deadline_is_when_it_is_aggregated(tmp_path: Path) -> None:
    """The scheduler looks at a parked parent at its aggregation deadline, and never at its
    expires_at (it started)."""
    from handoffd.service.report import BatchReport
    from handoffd.service.scheduler import Scheduler
    clock = Clock()
    engine, backend = _parked_family(tmp_path, clock)
    scheduler = Scheduler(engine, BatchReport(), workers=2)
    peek = engine.peek("pk")
    wait = peek.doc["handoffd"]["waiting_children"]
    assert iso(scheduler.deadline("pk", peek)) == iso(  # type: ignore[arg-type]
        __import__("handoffd.core.timeutil", fromlist=["parse_iso"]).parse_iso(wait["deadline"])
        + timedelta(seconds=5))
    peek.envelope.expires_at = clock() - timedelta(seconds=1)  # type: ignore[union-attr]
    del peek.doc["handoffd"]["waiting_children"]
    assert scheduler.deadline("pk", peek) is None  # parked before ("delegated"): not expired


def test_cancel_cascade_on_the_command_line_goes_past_an_unreadable_child(dws: Workspace) -> None:
    """`handoff cancel --cascade` says what it could not cancel, on its line, cancels the rest,
    and exits 1 (it stopped at the first unreadable child, with only that child's error)."""
    assert dws.handoff("pause", "@scorer").returncode == 0
    fan_out(dws, "pk", [{"to": "@scorer", "data": {}}] * 3)
    dws.handoffd("run")  # the parent delegates; its children wait (@scorer is paused)
    assert [dws.state_of(f"pk.c{n}") for n in (1, 2, 3)] == [["pending"]] * 3
    (dws.root / "handoffs" / "pending" / "pk.c2.json").write_text("{garbage")
    done = dws.handoff("cancel", "pk", "--cascade", "--timeout", "0")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["pk", "pk.c1", "pk.c2", "pk.c3"], lines
    assert "not cancelled: MALFORMED_JSON" in lines[2] and "Traceback" not in done.stderr
    assert dws.state_of("pk.c1") == dws.state_of("pk.c3") == ["failed"]
    assert dws.doc("pk.c3")["error"]["code"] == "CANCELLED"
    again = dws.handoff("cancel", "pk", "--cascade", "--json")
    assert again.returncode == 1
    assert [r["action"] for r in json.loads(again.stdout) if r["id"] == "pk.c2"] == ["unreadable"]


def test_a_parent_whose_child_asks_says_which_child_to_answer(dws: Workspace) -> None:
    """The parent's note named the asking child only as 'pq.c1 (pending)'."""
    fan_out(dws, "pq", [{"to": "@asker", "data": {}}])
    dws.handoffd("run")  # the parent delegates, the child asks its question and waits
    assert dws.state_of("pq.c1") == ["pending"]
    shown = dws.handoff("show", "pq")
    assert "pq.c1 (needs clarification: `handoff answer pq.c1`)" in shown.stdout, shown.stdout


def test_a_cancel_request_wins_over_the_aggregation_deadline(tmp_path: Path) -> None:
    """At a parked parent's aggregation deadline the scheduler claims it without asking the
    gates, and the aggregation (a resumer) ran before the cancel check: a parent its requester
    had asked to cancel was aggregated CHILDREN_FAILED instead of cancelled."""
    clock = Clock()
    engine, backend = _parked_family(tmp_path, clock)
    backend.request_cancel("pk", {"reason": "stop it", "cascade": False})
    clock.advance(10 * 86400)  # far past its deadline: its children would count as timeout
    job = engine.take("pk")
    assert job is not None
    outcome = engine.run(job)
    assert outcome.status == "cancelled" and outcome.error["code"] == "CANCELLED", outcome.error
