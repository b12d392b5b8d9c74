"""Seed 000's hard deadline after a message came back to pending/ (review R39, session 24).

`timeout_ms` is "Hard timeout; receiver MUST respond before this". 1. A message a throttle (or a
retry, an answer, a hand-back) put back in pending/ was answered TIMEOUT that long after its
deadline: the scheduler counted it from when it saw the message come back (its claim made it
forget when it first saw it), admission from the document's own history. 2. A message timed out
while it waited for an answer (needs_clarification), or for a retry, was answered "not started
before its deadline", and its questions were lost with its ``awaiting`` block.
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from dialect_examples import HI_MOE_ARCHITECT_TO_DISPATCHER, fresh
from test_hi_moe_seed import wait_filed

from handoffd.core.states import State
from handoffd.core.timeutil import iso, parse_iso
from handoffd.core.workspace import Workspace as HandoffdWorkspace

HANDLERS = '''
def throttled(doc, ctx):
    """Works task_data.sleep seconds, then says it is overloaded: try again in a minute."""
    ctx.cancelled.wait((ctx.data.get("task_data") or {}).get("sleep", 0))
    return {"status": "throttled", "retry_after_seconds": 60}

def asks(doc, ctx):
    return {"status": "needs_clarification",
            "questions": ["Which language?", "Inclusive bounds?"]}

def flaky(doc, ctx):
    return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "flaked"}}
'''

CONFIG = """
[daemon]
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 0.5
grace_seconds = 2.0
durability = "fast"

[retry]
max_retries = 3
retry_delay_seconds = 60

[specialists."ROUTING_DISPATCHER"]
handler = "moe_s24:throttled"

[specialists."asker-lora"]
handler = "moe_s24:asks"

[specialists."flaky-lora"]
handler = "moe_s24:flaky"
"""


@pytest.fixture
def mws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "moe_s24", HANDLERS, CONFIG)
    yield ws
    ws.cleanup()


def message(msg_id: str, timeout_ms: int, *, hint: str | None = None,
            sleep: float = 0) -> dict[str, Any]:
    """The seed's own Architect -> Dispatcher example (000_1), re-addressed."""
    doc = fresh(HI_MOE_ARCHITECT_TO_DISPATCHER)
    doc["id"] = msg_id
    doc["payload"].update(timeout_ms=timeout_ms, specialist_hint=hint)
    doc["payload"]["task_data"]["sleep"] = sleep
    return doc


def served(ws: Workspace, hid: str) -> dict[str, Any]:
    """Serve until ``hid`` is filed into failed/; its answer."""
    daemon = ws.serve()
    try:
        assert wait_filed(ws, hid, timeout=30) == "failed"
    finally:
        assert ws.stop(daemon) == 0
    return ws.doc(hid)


def events(doc: dict[str, Any]) -> list[str]:
    return [e["event"] for e in doc["handoffd"]["history"]]


# ---------------------------------------------------------------- 1: answered at its deadline
def test_a_throttled_message_is_answered_at_its_deadline(mws: Workspace) -> None:
    """R39's msg-401: throttled (retry in 60 s) after 3 of its 3.5 s: answered TIMEOUT at its
    deadline, counted from its first claim, not 3.5 s after it came back."""
    mws.drop("msg-401.json", message("msg-401", 3500, sleep=3))
    answer = served(mws, "msg-401")
    history = answer["handoffd"]["history"]
    assert events(answer)[:3] == ["claimed", "throttled", "claimed"], events(answer)
    deadline = parse_iso(history[0]["at"]) + timedelta(milliseconds=3500)
    payload = answer["payload"]
    assert payload["status"] == "timeout" and payload["error_type"] == "timeout", payload
    assert iso(deadline) in payload["error_detail"], payload
    # the daemon's own stamps: claimed for the answer at its deadline (a loaded machine may
    # be late by a little; before the fix, it came back 3 s after it: requeue + timeout_ms)
    answered = parse_iso(history[2]["at"])
    assert answered - deadline < timedelta(seconds=2), (iso(answered), iso(deadline))
    assert "ran 1 attempt(s)" in payload["error_detail"], payload
    assert "a retry after it was throttled" in payload["error_detail"], payload
    assert "not started" not in payload["error_detail"], payload


def test_the_scheduler_counts_from_the_documents_own_history(tmp_path: Path) -> None:
    """A message that came back to pending/ (claimed, throttled): the scheduler's deadline is
    admission's, counted from its first event, not from when the scheduler saw it again."""
    from handoffd import Daemon
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {
        "status": "throttled", "retry_after_seconds": 60}})
    engine.submit(message("m-back", 3000))
    arrived = clock()
    job = engine.take("m-back")
    clock.advance(2.5)
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    scheduler = Daemon(engine, workers=1, watch=False).scheduler  # (first sees it now)
    peek = engine.peek("m-back")
    assert peek is not None and peek.due_at is not None
    assert scheduler.deadline("m-back", peek) == arrived + timedelta(seconds=3)
    clock.advance(0.5)  # at its deadline: admission answers it TIMEOUT, unrun
    assert engine.take("m-back", arrived=scheduler.first_seen.get("m-back")) is None
    state, doc = engine.get("m-back")
    assert state is State.FAILED and doc["payload"]["status"] == "timeout"


def test_foreign_bookkeeping_never_moves_the_deadline(tmp_path: Path) -> None:
    """A dropped document's own (unsealed) history is left out of the scheduler's view: a
    forged early arrival would have it answered TIMEOUT at once."""
    from handoffd import Daemon, Registry, build_engine
    from handoffd.core.config import Config
    clock = Clock()
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    registry = Registry()
    registry.add_function("ROUTING_DISPATCHER", lambda doc, ctx: {}, config=Config())
    engine = build_engine(ws, Config(), registry, clock=clock)
    doc = message("m-forged", 3000)
    doc["handoffd"] = {"history": [{"event": "created", "at": "2001-01-01T00:00:00.000Z"}]}
    (tmp_path / "handoffs" / "pending" / "m-forged.json").write_text(json.dumps(doc))
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    peek = engine.peek("m-forged")
    assert peek is not None
    assert scheduler.deadline("m-forged", peek) == clock() + timedelta(seconds=3)


# ---------------------------------------------------------------- 2: what the answer says
def test_a_message_waiting_for_an_answer_times_out_with_its_questions(mws: Workspace) -> None:
    """R39's msg-103: the answer said "not started before its deadline" and the questions
    were gone (only pending/'s awaiting block ever held them)."""
    mws.drop("msg-103.json", message("msg-103", 1500, hint="asker-lora"))
    answer = served(mws, "msg-103")
    assert "needs_clarification" in events(answer)
    payload = answer["payload"]
    assert payload["status"] == "timeout" and payload["error_type"] == "timeout", payload
    detail = payload["error_detail"]
    assert "not started" not in detail and "ran 1 attempt(s)" in detail, detail
    assert "waited for an answer (needs_clarification) to: Which language?; Inclusive " \
        "bounds?" in detail, detail
    assert "awaiting" not in answer["handoffd"]


def test_a_message_waiting_for_a_retry_says_it_ran(mws: Workspace) -> None:
    mws.drop("msg-104.json", message("msg-104", 1500, hint="flaky-lora"))
    answer = served(mws, "msg-104")
    assert "retry_scheduled" in events(answer)
    detail = answer["payload"]["error_detail"]
    assert answer["payload"]["status"] == "timeout"
    assert "ran 1 attempt(s)" in detail and "waited for a retry" in detail, detail


def test_a_message_never_run_is_still_not_started(tmp_path: Path) -> None:
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {}})
    engine.submit(message("m-late", 1000))
    clock.advance(2)
    assert engine.take("m-late") is None
    detail = engine.get("m-late")[1]["payload"]["error_detail"]
    assert detail.startswith("handoff m-late was not started before its deadline"), detail


def test_the_questions_carried_are_bounded(tmp_path: Path) -> None:
    """A parked outcome's questions go into the timeout answer, 500 characters each, 2,000 all
    told (the error's ``details`` name them too, for formats that carry them)."""
    clock = Clock()
    questions = ["q" * 5000] * 20
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {
        "status": "needs_clarification", "questions": questions}})
    engine.submit(message("m-ask", 1000))
    job = engine.take("m-ask")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    clock.advance(2)
    assert engine.take("m-ask") is None
    state, doc = engine.get("m-ask")
    assert state is State.FAILED
    detail = doc["payload"]["error_detail"]
    assert "q" * 500 in detail and "q" * 501 not in detail and len(detail) < 2600, len(detail)


def test_a_native_retry_past_its_expiry_says_it_ran(tmp_path: Path) -> None:
    """Seed 001 (no hard timeout): a request whose retry was due after its ``expires_at`` is
    answered EXPIRED at its expiry, saying it ran once (it said "not started")."""
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"@x": lambda doc, ctx: {
        "status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "flaked"}}})
    engine.submit({"handoff_id": "n-exp", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@x"}, "input": {"data": {}},
                   "expires_at": iso(clock() + timedelta(seconds=5))})
    job = engine.take("n-exp")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    clock.advance(6)  # the retry is due in 10 s: it expired meanwhile
    assert engine.take("n-exp") is None
    state, doc = engine.get("n-exp")
    assert state is State.FAILED and doc["error"]["code"] == "EXPIRED", doc["error"]
    assert "ran 1 attempt(s); it expired at" in doc["error"]["message"], doc["error"]
    assert "waited for a retry" in doc["error"]["message"]
