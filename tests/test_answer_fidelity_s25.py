"""Three fidelity defects of handoffd's answers (reviewers, session 25), through one real
`handoffd run` where practical, plus unit tests:

1. a hi_moe message answered TIMEOUT past its hard deadline said ``recoverable: true`` (taken
   from ``retry_available``, which leaves a hand-made ``handoff retry`` open), although such a
   timeout is final: handoffd never runs it again. It now says ``recoverable: false``;
2. a seed-001 Response or Failure dropped into pending/ and refused NOT_A_REQUEST was filed with
   the sender's ``output`` / ``validation`` / ``metadata`` beside handoffd's refusal, as if they
   were its outcome (and the sender's own error was overwritten). They are kept under
   ``refused_answer`` (a forced retry ran the request without them: session 27 refuses a
   retry of an answer instead, see test_answer_retries_s27);
3. the batch's stop line counted a throttled handoff (seed 000's THROTTLED: its specialist was
   too busy to start, nothing was attempted) as "retry scheduled". It is counted apart:
   ``throttled N``, and the JSON record's ``throttled`` field.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, Workspace, memory_engine, new_workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh
from test_seed_fidelity_s24 import SEED_FAILURE, SEED_RESPONSE

from handoffd.core.documents import Outcome
from handoffd.core.errors import ErrorCode
from handoffd.dialects.base import FiledState
from handoffd.dialects.hi_moe import HiMoeDialect
from handoffd.service.report import BatchReport
from handoffd.service.spread import _as_json, _merge


def _command(code: str) -> str:
    """A specialist command line (TOML array) running ``code`` on the handoff read from stdin."""
    return json.dumps([sys.executable, "-c", "import json,sys,time; json.load(sys.stdin); " + code])


QUICK = "print(json.dumps({'status': 'completed', 'output': {'ran': True}}))"
# the daemon and retry settings of this file's workspaces (test_final_answers_s25 too)
HEADER = """
[daemon]
settle_seconds = 0.05
durability = "fast"

[retry]
max_retries = 3
retry_delay_seconds = 600
"""
CONFIG = HEADER + f"""
[specialists."python-lora"]
command = {_command("time.sleep(20); print(json.dumps({'status': 'completed'}))")}

[specialists."@react-specialist"]
command = {_command(QUICK)}

[specialists."@thr"]
command = {_command("print(json.dumps({'status': 'throttled', 'retry_after_seconds': 600}))")}

[specialists."@bad"]
command = {_command("print(json.dumps({'status': 'failed', 'error': {'code': 'PROCESSING_ERROR', 'message': 'flaked'}}))")}

[specialists."@ok"]
command = {_command(QUICK)}
"""
LATE = "msg-late-s25"  # a hi_moe message whose specialist outlives its 300 ms hard deadline


def _native(hid: str, target: str) -> dict[str, Any]:
    return {"handoff_id": hid, "status": "pending", "source": {"agent_id": "@tests"},
            "target": {"agent_id": target}, "input": {"data": {}}}


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One workspace, every document dropped into pending/, one `handoffd run` (JSON log)."""
    ws = new_workspace(tmp_path_factory.mktemp("fidelity25") / "ws", CONFIG)
    late = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    late["id"] = LATE
    late["payload"]["timeout_ms"] = 300
    docs = {LATE: late, SEED_RESPONSE["handoff_id"]: SEED_RESPONSE,
            SEED_FAILURE["handoff_id"]: SEED_FAILURE, "hoff-thr-s25": _native("hoff-thr-s25", "@thr"),
            "hoff-bad-s25": _native("hoff-bad-s25", "@bad"), "hoff-ok-s25": _native("hoff-ok-s25", "@ok")}
    for name, doc in docs.items():
        ws.drop(f"{name}.json", doc)
    proc = ws.handoffd("run", "--log-format", "json", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    ws.proc = proc  # type: ignore[attr-defined]
    return ws


# ---------------------------------------------------------------- 1: a final timeout
def test_a_message_stopped_at_its_hard_deadline_is_not_recoverable(ran: Workspace) -> None:
    assert ran.state_of(LATE) == ["failed"]
    answer = ran.doc(LATE)
    payload = answer["payload"]
    assert payload["status"] == "timeout" and payload["error_type"] == "timeout", payload
    assert payload["recoverable"] is False, payload
    # filing still leaves `handoff retry` (without --force) open to it, as documented
    assert answer["handoffd"]["retry_available"] is True


def test_a_message_never_started_before_its_deadline_is_not_recoverable(tmp_path: Path) -> None:
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"SPECIALIZED_FLEET": lambda doc, ctx: {}})
    message = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    message["payload"].update(timeout_ms=1000, specialist_hint=None)
    engine.submit(message)
    clock.advance(2)
    assert engine.take(message["id"]) is None  # answered TIMEOUT unrun, at admission
    payload = engine.get(message["id"])[1]["payload"]
    assert payload["status"] == "timeout" and payload["recoverable"] is False, payload


@pytest.mark.parametrize("status, error, retry_available, recoverable", [
    ("timeout", {"code": "TIMEOUT", "message": "past its deadline", "retryable": False}, True, False),
    # a TIMEOUT a specialist reported itself is retried as any failure: filing decides
    ("failed", {"code": "TIMEOUT", "message": "upstream slow"}, True, True),
    ("failed", {"code": "PROCESSING_ERROR", "message": "x", "retryable": True}, True, True),
    ("failed", {"code": "VALIDATION_FAILED", "message": "x"}, False, False),
    ("failed", {"code": "NEEDS_CLARIFICATION", "message": "which?"}, False, True),
])
def test_recoverable_says_what_will_happen(status: str, error: dict[str, Any],
                                           retry_available: bool, recoverable: bool) -> None:
    now = datetime(2026, 11, 27, tzinfo=timezone.utc)
    outcome = Outcome(status=status, started_at=now, finished_at=now, error=dict(error))
    answer = HiMoeDialect().render(fresh(HI_MOE_DISPATCHER_TO_FLEET), outcome,
                                   FiledState(0, 3, retry_available))
    assert answer["payload"]["recoverable"] is recoverable, answer["payload"]


# ---------------------------------------------------------------- 2: a refused native answer
@pytest.mark.parametrize("sent", [SEED_RESPONSE, SEED_FAILURE], ids=["response", "failure"])
def test_a_refused_answer_keeps_what_it_brought_apart(ran: Workspace, sent: dict[str, Any]) -> None:
    hid = sent["handoff_id"]
    assert ran.state_of(hid) == ["failed"]
    doc = ran.doc(hid)
    assert doc["status"] == "failed" and doc["error"]["code"] == ErrorCode.NOT_A_REQUEST, doc
    # nothing of the sender's answer reads as handoffd's outcome
    assert "output" not in doc and "validation" not in doc and "metadata" not in doc, doc
    assert doc["errors"] == [doc["error"]] and doc["retry_available"] is False
    # ...it is kept, apart, as it was sent (the sender's own error and status included)
    kept = doc["refused_answer"]
    for key in ("status", "output", "validation", "metadata", "error", "next_steps",
                "timestamp_completed", "timestamp_failed", "recovery_actions"):
        if key in sent:
            assert kept[key] == sent[key], (key, kept)
    check = ran.handoff("validate", str(ran.root / "handoffs" / "failed" / f"{hid}.json"))
    assert check.returncode == 0, check


# ---------------------------------------------------------------- 3: the stop line
def _batch_done(ws: Workspace) -> dict[str, Any]:
    records = [json.loads(line) for line in ws.proc.stderr.splitlines()  # type: ignore[attr-defined]
               if line.startswith("{")]
    (done,) = [r for r in records if r.get("event") == "batch_done"]
    return done


def test_a_throttle_is_no_retry_in_the_stop_line(ran: Workspace) -> None:
    assert ran.state_of("hoff-thr-s25") == ["pending"] and ran.state_of("hoff-bad-s25") == ["pending"]
    done = _batch_done(ran)
    # completed: @ok; failed: the late message and the two refused answers; one retry (@bad)
    assert done["message"] == ("batch done: completed 1, failed 3, retry scheduled 1, "
                               "throttled 1 (deferred, no attempt counted)"), done
    assert (done["retry_scheduled"], done["throttled"]) == (1, 1), done


def test_the_throttles_of_every_process_are_summed() -> None:
    total = BatchReport(completed=1, retrying=1, throttled=2)
    _merge(total, _as_json(BatchReport(failed=1, retrying=0, throttled=3)))
    assert total.line() == ("completed 1, failed 1, retry scheduled 1, throttled 5 (deferred, "
                            "no attempt counted)")
    assert BatchReport(retrying=2).line() == "completed 0, failed 0, retry scheduled 2"
