"""Every format's answer says what handoffd will do with a failure it filed for good (session
25, after hi_moe's ``recoverable``), through one real `handoffd run` where practical:

1. HAIOS (seed 003): a CollaborationHandoff stopped at its ``timeout_ms`` (final: its error says
   ``retryable: false``, handoffd never runs it again) was answered ``error_type: retryable``.
   It is ``permanent``, the seed's "fail immediately";
2. agent_handoff (seed 002): the blocker built for a failure filed with ``retry_available:
   false`` offered "Retry the handoff" (or "Inspect the error and retry the handoff"), which
   neither the daemon nor a plain `handoff retry` does. Its options name the forced retry;
3. native (seed 001): a failure filed with ``retry_available: false`` carried
   ``recovery_actions`` saying "Retry the handoff" (a refused answer, NOT_A_REQUEST, had the
   generic "Inspect the error and retry the handoff"). Each says how it can run again.
``retry_available`` keeps its meaning: true where a person may `handoff retry` by hand.
"""
from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import AGENT_SUCCESS, HAIOS_HANDOFF, HAIOS_RESULT, fresh
from test_answer_fidelity_s25 import HEADER, _command, _native
from test_seed_fidelity_s24 import SEED_RESPONSE

from handoffd.core.documents import Outcome
from handoffd.core.errors import ErrorCode
from handoffd.core.native_format import recovery_actions
from handoffd.dialects.agent_handoff import AgentHandoffDialect
from handoffd.dialects.base import FiledState
from handoffd.dialects.haios import HaiosDialect

# a specialist that refuses for good: failed, retryable false (never retried, retry_available
# false: `handoff retry` needs --force)
REFUSING = ("print(json.dumps({'status': 'failed', 'error': {'code': 'PROCESSING_ERROR', "
            "'message': 'the ledger is closed', 'retryable': False}}))")
CONFIG = HEADER + f"""
[specialists."slow-v1"]
command = {_command("time.sleep(20); print(json.dumps({'status': 'completed'}))")}

[specialists."@refuses"]
command = {_command(REFUSING)}

[specialists."code-quality-reviewer"]
command = {_command(REFUSING)}

[specialists."@react-specialist"]  # SEED_RESPONSE's target: claimed, then refused
command = {_command(REFUSING)}
"""
HAIOS_LATE = "6f1c2a9e-3b4d-4c5e-9f7a-0000000000a1"  # stopped at its 300 ms timeout_ms
HAIOS_ANSWER = HAIOS_RESULT["handoff_id"]  # a CollaborationResult dropped in as work
AGENT_REFUSED = "a1b2c3d4-e5f6-4890-abcd-0000000000a2"  # its specialist refuses for good
AGENT_MISSING = "a1b2c3d4-e5f6-4890-abcd-0000000000a3"  # its results' artifacts do not exist
NATIVE_REFUSED = "hoff-refused-s25"
FORCED = "handoff retry --force"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One workspace, every document dropped into pending/, one `handoffd run`."""
    ws = new_workspace(tmp_path_factory.mktemp("final25") / "ws", CONFIG)
    late = fresh(HAIOS_HANDOFF)
    late.update(handoff_id=HAIOS_LATE, to_agent="slow-v1", timeout_ms=300)
    refused = fresh(AGENT_SUCCESS)
    refused["handoff_id"] = AGENT_REFUSED
    del refused["results"]["artifacts"]  # nothing to check before it runs
    missing = fresh(AGENT_SUCCESS)
    missing["handoff_id"] = AGENT_MISSING
    docs = {HAIOS_LATE: late, HAIOS_ANSWER: fresh(HAIOS_RESULT), AGENT_REFUSED: refused,
            AGENT_MISSING: missing, NATIVE_REFUSED: _native(NATIVE_REFUSED, "@refuses"),
            SEED_RESPONSE["handoff_id"]: copy.deepcopy(SEED_RESPONSE)}
    for name, doc in docs.items():
        ws.drop(f"{name}.json", doc)
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return ws


def _failed(ws: Workspace, hid: str) -> dict[str, Any]:
    assert ws.state_of(hid) == ["failed"], ws.state_of(hid)
    return ws.doc(hid)


# ---------------------------------------------------------------- 1: HAIOS
def test_a_haios_handoff_stopped_at_its_timeout_is_a_permanent_error(ran: Workspace) -> None:
    answer = _failed(ran, HAIOS_LATE)
    assert answer["status"] == "error" and answer["error"]["code"] == ErrorCode.TIMEOUT, answer
    assert answer["error"]["error_type"] == "permanent", answer["error"]
    history = [e["event"] for e in answer["handoffd"]["history"]]
    assert history.count("claimed") == 1, history  # it is indeed never run again...
    assert answer["handoffd"]["retry_available"] is True  # ...but may be retried by hand


def test_a_refused_collaboration_result_is_a_permanent_error(ran: Workspace) -> None:
    answer = _failed(ran, HAIOS_ANSWER)
    assert answer["error"]["code"] == ErrorCode.NOT_A_REQUEST, answer
    assert answer["error"]["error_type"] == "permanent", answer["error"]


@pytest.mark.parametrize("error, retry_available, expected", [
    ({"code": "TIMEOUT", "message": "past timeout_ms", "retryable": False}, True, "permanent"),
    # a TIMEOUT a specialist reported itself is retried as any failure
    ({"code": "TIMEOUT", "message": "upstream slow"}, True, "retryable"),
    ({"code": "TIMEOUT", "message": "upstream slow", "error_type": "permanent"}, True, "permanent"),
    ({"code": "PROCESSING_ERROR", "message": "flaked"}, True, "retryable"),
    ({"code": "PROCESSING_ERROR", "message": "?", "error_type": "unknown"}, True, "unknown"),
    ({"code": "NOT_A_REQUEST", "message": "an answer"}, False, "permanent"),
    ({"code": "SCHEMA_VALIDATION_FAILED", "message": "no to_agent"}, False, "permanent"),
])
def test_haios_error_type_says_what_will_happen(error: dict[str, Any], retry_available: bool,
                                                expected: str) -> None:
    now = datetime(2026, 11, 27, tzinfo=timezone.utc)
    outcome = Outcome(status="timeout" if error.get("retryable") is False else "failed",
                      started_at=now, finished_at=now, error=dict(error))
    answer = HaiosDialect().render(fresh(HAIOS_HANDOFF), outcome, FiledState(0, 3, retry_available))
    assert answer["error"]["error_type"] == expected, answer["error"]


# ---------------------------------------------------------------- 2: agent_handoff
def _options(answer: dict[str, Any]) -> list[str]:
    (blocker,) = answer["blockers"]
    return list(blocker["resolution_options"])


@pytest.mark.parametrize("hid, code", [(AGENT_REFUSED, ErrorCode.PROCESSING_ERROR),
                                       (AGENT_MISSING, ErrorCode.DEPENDENCY_MISSING)])
def test_an_agent_handoff_filed_for_good_promises_no_plain_retry(ran: Workspace, hid: str,
                                                                 code: str) -> None:
    answer = _failed(ran, hid)
    assert answer["status"] == "error" and answer["handoffd"]["retry_available"] is False
    assert answer["blockers"][0]["description"].startswith(code), answer["blockers"]
    options = _options(answer)
    assert not any("retry the handoff" in option.lower() for option in options), options
    assert f"{FORCED} {hid}" in options[-1], options
    # what the options say is what handoffd does: a plain `handoff retry` is refused
    assert ran.handoff("retry", hid).returncode != 0
    assert ran.state_of(hid) == ["failed"]


def test_a_retryable_agent_failure_keeps_its_retry_option() -> None:
    now = datetime(2026, 11, 27, tzinfo=timezone.utc)
    flaked = Outcome(status="failed", started_at=now, finished_at=now,
                     error={"code": "PROCESSING_ERROR", "message": "flaked"})
    answer = AgentHandoffDialect().render(fresh(AGENT_SUCCESS), flaked, FiledState(3, 3, True))
    assert _options(answer) == ["Inspect the error and retry the handoff",
                                "Escalate to the orchestrator"]
    cancelled = Outcome(status="cancelled", started_at=now, finished_at=now,
                        error={"code": "CANCELLED", "message": "stopped", "retryable": False})
    answer = AgentHandoffDialect().render(fresh(AGENT_SUCCESS), cancelled, FiledState(0, 3, False))
    assert "new AgentHandoff" in _options(answer)[0], answer["blockers"]


# ---------------------------------------------------------------- 3: native (seed 001)
def test_a_native_failure_filed_for_good_names_the_forced_retry(ran: Workspace) -> None:
    doc = _failed(ran, NATIVE_REFUSED)
    assert doc["retry_available"] is False and doc["error"]["retryable"] is False, doc
    actions = doc["recovery_actions"]
    assert actions[0] == "Check the specialist's stderr tail in error.message", actions
    assert not any(a.startswith("Retry the handoff") for a in actions), actions
    assert f"{FORCED} {NATIVE_REFUSED}" in actions[-1], actions
    assert ran.handoff("retry", NATIVE_REFUSED).returncode != 0  # as they say


def test_a_refused_native_answer_says_to_submit_the_request(ran: Workspace) -> None:
    doc = _failed(ran, SEED_RESPONSE["handoff_id"])
    assert doc["error"]["code"] == ErrorCode.NOT_A_REQUEST and doc["retry_available"] is False
    actions = doc["recovery_actions"]
    assert "an answer goes back to its orchestrator" in actions[0], actions
    assert "submit its request (status pending" in actions[1], actions
    assert not any("retry the handoff" in a.lower() for a in actions), actions
    check = ran.handoff("validate", str(ran.root / "handoffs" / "failed" /
                                        f"{SEED_RESPONSE['handoff_id']}.json"))
    assert check.returncode == 0, check


@pytest.mark.parametrize("code", [code.value for code in ErrorCode])
def test_no_final_recovery_promises_a_plain_retry(code: str) -> None:
    actions = recovery_actions(code, retry_available=False, handoff_id="hoff-1")
    assert actions and not any("retry the handoff" in a.lower() for a in actions), actions


@pytest.mark.parametrize("code", [ErrorCode.TIMEOUT, ErrorCode.PROCESSING_ERROR, "SOME_OWN_CODE"])
def test_a_failure_open_to_a_retry_keeps_the_seeds_wording(code: str) -> None:
    """retry_available true (a TIMEOUT always: `handoff retry` takes it up by hand)."""
    actions = recovery_actions(code, retry_available=True, handoff_id="hoff-1")
    assert any("retry the handoff" in a.lower() for a in actions), actions
    assert not any("--force" in a for a in actions), actions


def test_corrected_input_goes_into_a_new_handoff() -> None:
    actions = recovery_actions(ErrorCode.SCHEMA_VALIDATION_FAILED, retry_available=False)
    assert actions[0].startswith("Fix the input") and "new handoff" in actions[1], actions
