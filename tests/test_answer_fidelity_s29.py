"""Seed fidelity of answers (helper E, session 29), through one real `handoffd run`:

1. a specialist that reports a TIMEOUT itself with ``retryable: false`` (its own word: retrying
will not help) is not retried by handoffd, yet filing leaves every TIMEOUT ``retry_available``
for a hand-made `handoff retry` (seed 001: "Increase timeout, retry"). The swarm report's
``error.retryable`` (seed 004) and the hi_moe Outcome's ``recoverable`` (seed 000; also on a
``partial`` answer that carries such an error, e.g. a dispatcher's) followed ``retry_available`` and said the failure
was retryable. They now keep the specialist's word;
2. a seed-001 Response or Failure without its answer's marks (``status: "completed"`` with the
   sender's ``output`` but no ``timestamp_completed``) is read against its answer schema and
   filed SCHEMA_VALIDATION_FAILED, not NOT_A_REQUEST, and its filing still showed the sender's
   ``output`` (and next steps) beside handoffd's failure. Its fields are kept under
   ``refused_answer``, as a NOT_A_REQUEST refusal keeps them.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh

from handoffd.core.documents import Outcome
from handoffd.dialects.base import FiledState
from handoffd.dialects.hi_moe import HiMoeDialect
from handoffd.dialects.swarm import SwarmDialect

FINAL_TIMEOUT = {"code": "TIMEOUT", "message": "upstream timed out", "retryable": False}


def _command(result: dict[str, Any]) -> str:
    """A specialist command line (TOML array) that reads the handoff and prints ``result``."""
    code = f"import json,sys; json.load(sys.stdin); print(json.dumps({result!r}))"
    return json.dumps([sys.executable, "-c", code])


CONFIG = f"""
[daemon]
settle_seconds = 0.05
durability = "fast"

[retry]
max_retries = 3
retry_delay_seconds = 0

[specialists."@ok"]
command = {_command({"status": "completed", "output": {"ran": True}})}

[specialists."@gave-up"]
command = {_command({"status": "failed", "error": FINAL_TIMEOUT})}
"""


# seed-001 answers' fields without the marks that tell an answer (timestamp_completed, error...)
UNMARKED: dict[str, dict[str, Any]] = {
    "hoff-unmarked-response": {"status": "completed", "output": {"artifact_id": "A1"},
                               "validation": {"status": "passed"}, "next_steps": ["integrate"]},
    "hoff-unmarked-failure": {"status": "failed", "output": {"half": True},
                              "recovery_actions": ["ask again"]},
}


def _swarm(task_id: str) -> dict[str, Any]:
    return {"contract": {"task_id": task_id, "files_owned": [], "files_readonly": [],
                         "dependencies_completed": [], "success_criteria": []},
            "context": {"epic_summary": "e", "your_role": "r", "what_others_did": "",
                        "what_comes_next": ""},
            "escalation": {"blocked_contact": "coordinator", "scope_change_protocol": "ask"},
            "to_agent": "@gave-up"}


def _message(msg_id: str, specialist: str) -> dict[str, Any]:
    message = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    message["id"] = msg_id
    message["payload"].update(specialist_hint=specialist, timeout_ms=600_000)
    return message


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One workspace, every document dropped into pending/, one `handoffd run`."""
    ws = new_workspace(tmp_path_factory.mktemp("fidelity29") / "ws", CONFIG)
    ws.drop("sw-gave-up.json", _swarm("sw-gave-up"))
    ws.drop("msg-gave-up.json", _message("msg-gave-up", "@gave-up"))
    for hid, sent in UNMARKED.items():
        ws.drop(f"{hid}.json", {"handoff_id": hid, "source": {"agent_id": "@tests"},
                                "target": {"agent_id": "@ok"}, "input": {"data": {}}, **sent})
    proc = ws.handoffd("run", timeout=60)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    return ws


def _claims(doc: dict[str, Any]) -> int:
    return sum(1 for event in doc["handoffd"]["history"] if event["event"] == "claimed")


def test_a_swarm_workers_own_final_timeout_is_not_reported_retryable(ran: Workspace) -> None:
    assert ran.state_of("sw-gave-up") == ["failed"]
    report = ran.doc("sw-gave-up")
    assert report["error"]["code"] == "TIMEOUT", report
    assert report["error"]["retryable"] is False, report["error"]
    assert _claims(report) == 1  # ...and handoffd did not retry it either


def test_a_hi_moe_specialists_own_final_timeout_is_not_recoverable(ran: Workspace) -> None:
    assert ran.state_of("msg-gave-up") == ["failed"]
    answer = ran.doc("msg-gave-up")
    payload = answer["payload"]
    assert payload["error_type"] == "timeout" and payload["recoverable"] is False, payload
    assert _claims(answer) == 1


@pytest.mark.parametrize("error, retry_available, retryable", [
    (FINAL_TIMEOUT, True, False),
    ({"code": "TIMEOUT", "message": "x", "error_type": "permanent"}, True, False),
    # a TIMEOUT without the specialist's word: filing decides (a hand-made retry is open)
    ({"code": "TIMEOUT", "message": "x"}, True, True),
    ({"code": "PROCESSING_ERROR", "message": "x", "retryable": True}, True, True),
    ({"code": "VALIDATION_FAILED", "message": "x"}, False, False),
])
def test_swarm_retryable_says_what_the_failure_said(error: dict[str, Any], retry_available: bool,
                                                    retryable: bool) -> None:
    now = datetime(2026, 11, 28, tzinfo=timezone.utc)
    outcome = Outcome(status="failed", started_at=now, finished_at=now, error=dict(error))
    report = SwarmDialect().render(_swarm("t-1"), outcome, FiledState(3, 3, retry_available))
    assert report["error"]["retryable"] is retryable, report["error"]


def test_hi_moe_recoverable_on_a_partial_keeps_the_specialists_word() -> None:
    now = datetime(2026, 11, 28, tzinfo=timezone.utc)
    outcome = Outcome(status="partial", started_at=now, finished_at=now, output={"done": 1},
                      error=dict(FINAL_TIMEOUT))
    answer = HiMoeDialect().render(_message("m-1", "@x"), outcome, FiledState(0, 3, True))
    assert answer["payload"]["recoverable"] is False, answer["payload"]


# ---------------------------------------------------------------- 2: an answer failing its schema
@pytest.mark.parametrize("hid", sorted(UNMARKED))
def test_an_answer_failing_its_schema_keeps_what_it_brought_apart(ran: Workspace, hid: str) -> None:
    sent = UNMARKED[hid]
    assert ran.state_of(hid) == ["failed"]
    doc = ran.doc(hid)
    assert doc["status"] == "failed", doc
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED", doc["error"]
    # nothing of the sender's answer reads as handoffd's outcome: no output, handoffd's own
    # validation (the schema errors) and recovery actions
    assert "output" not in doc, doc
    assert doc["validation"]["status"] == "failed" and doc["next_steps"] == [], doc
    assert doc["recovery_actions"] != ["ask again"], doc
    # ...it is kept, apart, as it was sent
    assert doc["refused_answer"] == sent, doc["refused_answer"]


def test_a_retried_native_handoff_that_succeeds_drops_the_failures_validation(
        tmp_path: Any) -> None:
    """RD: a native document filed SCHEMA_VALIDATION_FAILED with handoffd's validation
    (`validation.status: failed`, the schema's errors), then forced through `handoff retry`,
    completed carrying that old validation beside its `completed` status: its retry took the
    answer's fields out, not that one. handoffd's record of the filing now says which fields
    the outcome wrote over the request, and a retry takes those out; a request's own field the
    outcome never wrote (its priority here) stays."""
    ws = new_workspace(tmp_path / "ws", CONFIG)
    ws.drop("hoff-val.json", {"handoff_id": "hoff-val", "source": {"agent_id": "@tests"},
                              "target": {"agent_id": "@ok"}, "input": {"data": {}},
                              "status": "completed", "output": {"artifact_id": "A1"},
                              "priority": "high"})
    assert ws.handoffd("run", timeout=60).returncode in (0, 1)
    failed = ws.doc("hoff-val")
    assert failed["error"]["code"] == "SCHEMA_VALIDATION_FAILED", failed
    assert failed["validation"]["status"] == "failed", failed
    assert failed["handoffd"]["final_error"].get("wrote") == ["validation"], failed["handoffd"]
    retried = ws.handoff("retry", "hoff-val", "--force")
    assert retried.returncode == 0, retried.stderr
    assert ws.handoffd("run", timeout=60).returncode == 0
    assert ws.state_of("hoff-val") == ["completed"]
    done = ws.doc("hoff-val")
    assert done["status"] == "completed" and done["output"] == {"ran": True}, done
    assert "validation" not in done, done["validation"]
    assert done["priority"] == "high", done  # (the request's own, never written)
