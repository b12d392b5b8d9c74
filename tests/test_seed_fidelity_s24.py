"""Seed fidelity (review R39, session 24), through a real `handoffd run` with the seeds' own
example documents, plus unit tests:

- seeds 000 and 003 fill their times with Python's naive ``datetime.utcnow()``: a time without a
  zone is accepted (read as UTC) where it was refused SCHEMA_VALIDATION_FAILED; the calendar is
  still checked;
- seed 001's Response and Failure dropped into pending/ are refused NOT_A_REQUEST, never run
  (they were run and filed with stale fields); a request saying ``status: pending`` and
  handoffd's own filed documents are not affected;
- a filed native failure's ``error.retryable`` says what ``retry_available`` says;
- seed 002's built blocker tells the sender how to fix a bad request instead of "Fix the
  specialist so its results pass validation".
"""
from __future__ import annotations

import copy
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import AGENT_SUCCESS, HAIOS_HANDOFF, HAIOS_RESULT, HI_MOE_DISPATCHER_TO_FLEET, fresh

from handoffd.core.documents import Outcome
from handoffd.core.errors import ErrorCode, InvalidDocument
from handoffd.core.native_format import native_envelope
from handoffd.core.validation import builtin_schemas, check_document
from handoffd.dialects.agent_handoff import AgentHandoffDialect
from handoffd.dialects.base import FiledState
from handoffd.dialects.haios import HaiosDialect
from handoffd.dialects.hi_moe import HiMoeDialect
from handoffd.dialects.native import NativeDialect

NAIVE = "2026-11-27T19:07:00.201221"  # what seed 003's datetime.utcnow().isoformat() gives
QUICK = ("import json,sys; json.load(sys.stdin); "
         "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))")
# a specialist that says its failure is retryable, with a code handoffd never retries
DEP = ("import json,sys; json.load(sys.stdin); print(json.dumps({'status': 'failed', 'error': "
       "{'code': 'DEPENDENCY_MISSING', 'message': 'artifact x not found', 'retryable': True}}))")
# every start of a specialist leaves a line here: an answer that is refused must leave none
RUNS = "runs.txt"


# seed 001's Response and Failure examples, as the seed prints them
SEED_RESPONSE: dict[str, Any] = {
    "handoff_id": "hoff-001-1705147200000", "timestamp_completed": "2026-01-13T10:05:32Z",
    "status": "completed", "execution_time_seconds": 332,
    "source": {"agent_id": "@frontend-specialist", "phase": 11},
    "target": {"agent_id": "@react-specialist", "phase": 13},
    "output": {"artifact_id": "artifact-react-comp-1705147532000",
               "artifact_path": "artifacts/phase-13-react/artifact-react-comp-1705147532000.json",
               "artifact_type": "react-components", "schema_compliance": "valid"},
    "validation": {"status": "passed", "typescript_errors": 0, "eslint_warnings": 0,
                   "tests_passing": True, "coverage_percentage": 87, "accessibility_violations": 0},
    "metadata": {"components_generated": 1, "custom_hooks_generated": 1, "test_files_generated": 1,
                 "total_lines_generated": 290},
    "next_steps": ["Integrate UserProfile component into application"],
    "warnings": [], "errors": [],
}
SEED_FAILURE: dict[str, Any] = {
    "handoff_id": "hoff-002-1705147300000", "timestamp_failed": "2026-01-13T10:10:00Z",
    "status": "failed", "execution_time_seconds": 120,
    "source": {"agent_id": "@frontend-specialist", "phase": 11},
    "target": {"agent_id": "@react-specialist", "phase": 13},
    "error": {"code": "SCHEMA_VALIDATION_FAILED",
              "message": "Input validation failed: component_requirements[0].props is missing "
                         "required field 'type'",
              "severity": "error", "timestamp": "2026-01-13T10:08:45Z"},
    "validation": {"status": "failed", "errors": [
        {"field": "component_requirements[0].props.userId", "error": "Missing required field 'type'",
         "schema_path": "$.component_requirements[*].props.*"}]},
    "retry_available": True, "retry_count": 0, "max_retries": 3,
    "recovery_actions": ["Fix input schema validation errors", "Retry handoff with corrected input"],
}
SEED_REQUEST: dict[str, Any] = {  # seed 001's request, trimmed to what routes it
    "handoff_id": "hoff-003-1705147200000", "timestamp": "2026-01-13T10:00:00Z",
    "status": "pending", "source": {"agent_id": "@frontend-specialist", "phase": 11},
    "target": {"agent_id": "@react-specialist", "phase": 13},
    "input": {"data": {"component_requirements": []}}, "timeout_seconds": 300,
}

HAIOS_ID = "6f1c2a9e-3b4d-4c5e-9f7a-0000000000a1"
BAD_PATH_ID = "6f1c2a9e-3b4d-4c5e-9f7a-0000000000a2"


def _documents() -> dict[str, dict[str, Any]]:
    """Every document the run gets, by the id (file name) it is dropped under."""
    haios = fresh(HAIOS_HANDOFF)
    haios.update(handoff_id=HAIOS_ID, to_agent="quick-v1", created_at=NAIVE)
    hi_moe = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    hi_moe.update(id="msg-naive-s24", timestamp="2025-01-15T10:30:05")  # seed 000's, naive
    bad_id = fresh(AGENT_SUCCESS)
    bad_id.update(handoff_id="hoff-1", to_agent="quick-v1")
    bad_path = fresh(AGENT_SUCCESS)
    bad_path.update(handoff_id=BAD_PATH_ID, to_agent="quick-v1")
    bad_path["results"]["artifacts"] = [{"name": "passwd", "path": "/etc/passwd", "type": "data"}]
    planted = copy.deepcopy(SEED_RESPONSE)  # an answer claiming handoffd filed it
    planted.update(handoff_id="hoff-planted-s24", handoffd={
        "history": [{"at": "2026-01-13T10:05:32.000Z", "event": "completed"}],
        "retry_available": False})
    dep = copy.deepcopy(SEED_REQUEST)
    dep.update(handoff_id="hoff-dep-s24", target={"agent_id": "dep"})
    return {HAIOS_ID: haios, "msg-naive-s24": hi_moe, "hoff-1": bad_id, BAD_PATH_ID: bad_path,
            SEED_RESPONSE["handoff_id"]: SEED_RESPONSE, SEED_FAILURE["handoff_id"]: SEED_FAILURE,
            SEED_REQUEST["handoff_id"]: SEED_REQUEST, "hoff-dep-s24": dep,
            "hoff-planted-s24": planted}


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """One workspace, every document dropped into pending/, one `handoffd run`."""
    base = tmp_path_factory.mktemp("fidelity")
    runs = base / RUNS
    # each specialist notes the id it ran before answering, so that a refused answer shows none
    note = f"import json,sys; d=json.load(sys.stdin); open({str(runs)!r}, 'a').write(str(d.get('handoff_id') or d.get('id')) + '\\n'); "
    quick, dep = (note + code.split("json.load(sys.stdin); ", 1)[1] for code in (QUICK, DEP))
    config = f"""
[daemon]
settle_seconds = 0.05
durability = "fast"

[retry]
max_retries = 2
retry_delay_seconds = 0.05

[specialists."quick-v1"]
command = [{json.dumps(sys.executable)}, "-c", {json.dumps(quick)}]

[specialists."python-lora"]
command = [{json.dumps(sys.executable)}, "-c", {json.dumps(quick)}]

[specialists."@react-specialist"]
command = [{json.dumps(sys.executable)}, "-c", {json.dumps(quick)}]

[specialists."dep"]
command = [{json.dumps(sys.executable)}, "-c", {json.dumps(dep)}]
"""
    ws = new_workspace(base / "ws", config)
    for name, doc in _documents().items():
        ws.drop(f"{name}.json", doc)
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr, proc.stderr
    ws.ran = runs.read_text().split() if runs.exists() else []  # type: ignore[attr-defined]
    return ws


# ---------------------------------------------------------------- naive times (seeds 000, 003)

def test_seed_003_naive_created_at_is_accepted(ran: Workspace) -> None:
    assert ran.state_of(HAIOS_ID) == ["completed"]
    answer = ran.doc(HAIOS_ID)
    assert answer["status"] == "success", answer
    assert answer["handoffd"]["request_snapshot"]["created_at"] == NAIVE  # kept as written


def test_seed_000_naive_timestamp_is_accepted(ran: Workspace) -> None:
    assert ran.state_of("msg-naive-s24") == ["completed"]
    assert ran.doc("msg-naive-s24")["payload"]["status"] == "success"


@pytest.mark.parametrize("dialect, doc, field", [
    (HaiosDialect(), HAIOS_HANDOFF, "created_at"),
    (HaiosDialect(), HAIOS_RESULT, "executed_at"),
    (HiMoeDialect(), HI_MOE_DISPATCHER_TO_FLEET, "timestamp"),
])
def test_naive_times_validate_and_the_calendar_is_still_checked(dialect: Any, doc: dict[str, Any],
                                                                field: str) -> None:
    schemas = builtin_schemas()
    for good in (NAIVE, "2026-11-27T19:07:00", "2026-11-27T19:07:00Z", "2026-11-27T19:07:00+02:00"):
        check_document(schemas, dialect, {**fresh(doc), field: good})
    for bad in ("2026-02-30T10:30:00", "2026-02-30T10:30:00Z", "2026-11-27", "2026-11-27T25:00:00",
                "2026-11-27T19:07:00+2", "x" * 10_000, "2026-11-27T19:07:00." + "1" * 50_000 + "Q"):
        with pytest.raises(InvalidDocument) as caught:
            check_document(schemas, dialect, {**fresh(doc), field: bad})
        assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED
        assert caught.value.errors[0]["field"] == field, caught.value.errors


def test_other_formats_still_require_a_zone() -> None:
    """Only the seeds whose own code writes naive times take them."""
    doc = {**copy.deepcopy(SEED_REQUEST), "timestamp": NAIVE}
    with pytest.raises(InvalidDocument):
        check_document(builtin_schemas(), NativeDialect(), doc)


# ---------------------------------------------------------------- seed 001 answers are no requests

@pytest.mark.parametrize("hid", [SEED_RESPONSE["handoff_id"], SEED_FAILURE["handoff_id"],
                                 "hoff-planted-s24"])
def test_seed_001_answers_dropped_into_pending_are_refused_not_run(ran: Workspace, hid: str) -> None:
    assert ran.state_of(hid) == ["failed"]
    doc = ran.doc(hid)
    assert doc["status"] == "failed" and doc["error"]["code"] == ErrorCode.NOT_A_REQUEST, doc
    assert doc["retry_available"] is False and "completed_at" not in doc
    assert hid not in ran.ran  # type: ignore[attr-defined]


def test_a_request_saying_pending_runs_and_its_filed_document_stays_readable(ran: Workspace) -> None:
    from handoffd.core.native_format import native_answer, taken_up
    hid = SEED_REQUEST["handoff_id"]
    assert ran.state_of(hid) == ["completed"] and hid in ran.ran  # type: ignore[attr-defined]
    filed = ran.doc(hid)
    assert filed["status"] == "completed" and native_answer(filed) and not taken_up(filed)
    assert native_envelope(filed).target == "@react-specialist"  # handoffd's own: not refused
    rows = {row["id"]: row for row in json.loads(ran.handoff("ls", "--json").stdout)}
    assert rows[hid]["to"] == "@react-specialist", rows[hid]
    check = ran.handoff("validate", str(ran.root / "handoffs" / "completed" / f"{hid}.json"))
    assert check.returncode == 0, check


def test_handoff_create_refuses_a_seed_001_answer(ran: Workspace, tmp_path: Path) -> None:
    path = tmp_path / "response.json"
    path.write_text(json.dumps({**SEED_RESPONSE, "handoff_id": "hoff-create-s24"}))
    proc = ran.handoff("create", "--file", str(path))
    assert proc.returncode != 0 and "an answer, not a request" in proc.stderr, proc
    assert "Traceback" not in proc.stderr and ran.state_of("hoff-create-s24") == []


def _at(event: str) -> dict[str, Any]:
    return {"at": "2026-01-13T10:00:00.000Z", "event": event}


@pytest.mark.parametrize("history, refused", [
    ([_at("claimed")], True),  # a foreign answer just claimed
    ([_at("failed"), _at("claimed")], True),  # a planted filing, then our claim
    ([_at("created"), _at("claimed"), _at("failed")], False),  # filed by handoffd
    ([_at("created"), _at("claimed"), _at("completed"), _at("aggregated")], False),
    (None, False),  # filed by another consumer (its block emptied for readers): still readable
    ([], False),
])
def test_an_answer_is_refused_once_taken_up(history: Any, refused: bool) -> None:
    for answer in (SEED_RESPONSE, SEED_FAILURE):
        doc = copy.deepcopy(answer)
        if history is not None:
            doc["handoffd"] = {"history": history}
        if refused:
            with pytest.raises(InvalidDocument) as caught:
                native_envelope(doc)
            assert caught.value.code == ErrorCode.NOT_A_REQUEST
        else:
            assert native_envelope(doc).target == "@react-specialist"


def test_a_submitted_answer_is_refused_and_a_dropped_one_is_left_to_its_claim() -> None:
    now = datetime(2026, 1, 13, tzinfo=timezone.utc)
    for answer in (SEED_RESPONSE, SEED_FAILURE):
        with pytest.raises(InvalidDocument) as caught:
            NativeDialect().complete(copy.deepcopy(answer), None, now)
        assert caught.value.code == ErrorCode.NOT_A_REQUEST
        NativeDialect().complete(copy.deepcopy(answer), answer["handoff_id"], now)
    NativeDialect().complete(copy.deepcopy(SEED_REQUEST), None, now)


@pytest.mark.parametrize("extra", [
    {"status": "pending"}, {"status": "in_progress", "started_at": "2026-01-13T10:00:00Z"},
    {"status": "completed"},  # a status alone is no answer
    {"status": "pending", "error": {"code": "X", "message": "y"}},  # an error alone neither
])
def test_requests_are_not_taken_for_answers(extra: dict[str, Any]) -> None:
    from handoffd.core.native_format import native_answer
    doc = {**copy.deepcopy(SEED_REQUEST), **extra}
    assert not native_answer(doc) and native_envelope(doc).target == "@react-specialist"


# ---------------------------------------------------------------- error.retryable agrees

def test_a_filed_failure_says_retryable_as_retry_available_does(ran: Workspace) -> None:
    doc = ran.doc("hoff-dep-s24")
    assert doc["error"]["code"] == ErrorCode.DEPENDENCY_MISSING, doc
    assert doc["retry_available"] is False and doc["error"]["retryable"] is False, doc
    assert ran.ran.count("hoff-dep-s24") == 1  # type: ignore[attr-defined]  # never retried


def test_render_follows_filing_both_ways() -> None:
    now = datetime(2026, 1, 13, tzinfo=timezone.utc)
    for retry_available in (False, True):
        for given in (True, False):
            outcome = Outcome(status="failed", started_at=now, finished_at=now,
                              error={"code": "PROCESSING_ERROR", "message": "x", "retryable": given})
            answer = NativeDialect().render(copy.deepcopy(SEED_REQUEST), outcome,
                                            FiledState(0, 3, retry_available))
            assert answer["error"]["retryable"] is retry_available
            assert answer["retry_available"] is retry_available
    outcome = Outcome(status="failed", started_at=now, finished_at=now,
                      error={"code": "PROCESSING_ERROR", "message": "x"})
    answer = NativeDialect().render(copy.deepcopy(SEED_REQUEST), outcome, FiledState(0, 3, True))
    assert "retryable" not in answer["error"]  # not added where the failure had none


# ---------------------------------------------------------------- seed 002: who must act

SPECIALIST_FIX = "Fix the specialist so its results pass validation"


def test_a_bad_handoff_id_gets_options_to_fix_the_request(ran: Workspace) -> None:
    (blocker,) = ran.doc("hoff-1")["blockers"]
    options = blocker["resolution_options"]
    assert SPECIALIST_FIX not in options, options
    assert options[0].startswith("Fix the request's handoff_id: 'hoff-1'"), options
    assert any("new AgentHandoff" in option for option in options)
    assert "hoff-1" not in ran.ran  # type: ignore[attr-defined]


def test_an_artifact_path_outside_the_workspace_gets_options_to_fix_the_request(ran: Workspace) -> None:
    (blocker,) = ran.doc(BAD_PATH_ID)["blockers"]
    options = blocker["resolution_options"]
    assert SPECIALIST_FIX not in options, options
    assert options[0].startswith("Fix the request's results.artifacts[0].path"), options
    assert BAD_PATH_ID not in ran.ran  # type: ignore[attr-defined]


def test_a_bad_result_keeps_the_specialist_options() -> None:
    now = datetime(2026, 1, 15, tzinfo=timezone.utc)
    request = fresh(AGENT_SUCCESS)
    request["results"]["artifacts"] = [{"name": "a", "path": "out/a.py", "type": "code"}]
    for error in ({"code": "VALIDATION_FAILED", "message": "unverified artifacts: 'out/a.py' does "
                   "not exist", "details": {"missing_artifacts": ["out/a.py"]}},
                  {"code": "VALIDATION_FAILED", "message": "output does not match its schema"}):
        failed = Outcome(status="failed", started_at=now, finished_at=now, error=error,
                         executed_by="quick-v1")
        (blocker,) = AgentHandoffDialect().blockers(failed, "error", request)
        assert blocker["resolution_options"][0] == SPECIALIST_FIX, blocker
