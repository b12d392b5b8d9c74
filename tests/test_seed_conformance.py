"""Seed conformance, through the real `handoff` / `handoffd` commands where the rule is end to end.

* seed 003: a specialist's ``error_type: "permanent"`` fails at once (any format); ``unknown`` is
  retried and reported ``unknown``;
* seed 002: a blocked AgentHandoff carries the specialist's own blockers;
* seed 004: a completion report whose ``files_touched`` names a file outside ``files_owned`` is
  not ``valid``;
* seed 000: the 1 KB rule (in UTF-8 bytes) in reported blocked / needs_clarification outcomes and
  on what comes in; every DelegationPayload field is present; no error fields on a cancellation.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace
from dialect_examples import (
    HAIOS_HANDOFF,
    HI_MOE_DISPATCHER_TO_FLEET,
    HI_MOE_FLEET_TO_DISPATCHER,
    SWARM_HANDOFF,
    fresh,
)

from handoffd import dialects
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service.queries import validate_document

# A command specialist for every format: records each run (one line per handoff id) and prints
# the answer the test wrote for that id. Both files lie outside the workspace, where a contract's
# scope check does not see them.
SPECIALIST = r'''
import json, os, sys
json.load(sys.stdin)
here = sys.argv[1]
with open(os.path.join(here, "runs.txt"), "a") as fh:
    fh.write(os.environ["HANDOFF_ID"] + "\n")
answers = json.load(open(os.path.join(here, "answers.json")))
print(json.dumps(answers[os.environ["HANDOFF_ID"]]))
'''

CONFIG = """
[daemon]
settle_seconds = 0.05
durability = "fast"

[retry]
max_retries = 1
retry_delay_seconds = 0.1
backoff_multiplier = 1.0
"""

AGENTS = ("ingester-v1", "@answerer", "slurm-manager", "@swarm-worker", "python-lora")


@pytest.fixture
def sws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace where every agent of these tests runs SPECIALIST."""
    script = tmp_path / "specialist.py"
    script.write_text(SPECIALIST)
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(CONFIG + "".join(
        f'\n[specialists."{agent}"]\ncommand = ["{sys.executable}", "-S", "{script}", "{tmp_path}"]\n'
        for agent in AGENTS))
    HandoffdWorkspace(root).ensure()
    yield ws
    ws.cleanup()


def answering(ws: Workspace, answers: dict[str, Any]) -> None:
    """What the specialist answers, per handoff id."""
    (ws.root.parent / "answers.json").write_text(json.dumps(answers))


def runs(ws: Workspace, handoff_id: str) -> int:
    path = ws.root.parent / "runs.txt"
    return path.read_text().splitlines().count(handoff_id) if path.exists() else 0


def run(ws: Workspace) -> None:
    proc = ws.handoffd("run", "-q", timeout=60)
    assert proc.returncode in (0, 1), proc.stderr  # 1: something failed, as some must


def problems(doc: dict[str, Any]) -> list[str]:
    """The fields ``handoff validate`` would name (in-process: the same check)."""
    from handoffd.core.errors import InvalidDocument
    try:
        validate_document(None, doc, dialects.detect(doc))
    except InvalidDocument as exc:
        return [e["field"] for e in exc.errors or [{"field": "$"}]]
    return []


def hi_moe_request(msg_id: str, hint: str = "python-lora") -> dict[str, Any]:
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"] = msg_id
    doc["payload"]["specialist_hint"] = hint
    return doc


# ---------------------------------------------------------------- seed 003: error_type
def test_a_permanent_error_type_fails_at_once_and_unknown_is_retried(sws: Workspace) -> None:
    """Seed 003: "PERMANENT | Fail immediately, return error"; error_type ∈ [retryable,
    permanent, unknown]. The result says what happened; a native request obeys it too."""
    ids = {"perm": "6f1c2a9e-3b4d-4c5e-9f7a-00000000a001", "unk": "6f1c2a9e-3b4d-4c5e-9f7a-00000000a002"}
    answering(sws, {
        ids["perm"]: {"status": "failed", "error": {"message": "invalid payload", "error_type": "permanent"}},
        ids["unk"]: {"status": "failed", "error": {"message": "no idea", "error_type": "unknown"}},
        "native-perm": {"status": "failed", "error": {"message": "auth error", "error_type": "permanent"}},
    })
    for hid in ids.values():
        doc = fresh(HAIOS_HANDOFF)
        doc["handoff_id"] = hid
        sws.drop(f"{hid}.json", doc)
    sws.create("--to", "@answerer", "--id", "native-perm", "--data", "{}")
    run(sws)
    perm, unk = sws.doc(ids["perm"]), sws.doc(ids["unk"])
    assert runs(sws, ids["perm"]) == 1 and perm["error"]["error_type"] == "permanent", perm["error"]
    assert runs(sws, ids["unk"]) == 2 and unk["error"]["error_type"] == "unknown", unk["error"]
    native = sws.doc("native-perm")
    assert runs(sws, "native-perm") == 1
    assert native["retry_available"] is False and native["error"]["retryable"] is False
    assert sws.handoff("retry", "native-perm").returncode != 0  # permanent: needs --force


# ---------------------------------------------------------------- seed 002: blockers
def test_a_blocked_agent_handoff_carries_the_specialists_blockers(sws: Workspace) -> None:
    hid = "c3d4e5f6-a7b8-4012-8def-345678901234"
    answering(sws, {hid: {"status": "blocked", "blockers": [
        {"blocker_id": "blk-gpu-001", "type": "resource_unavailable",
         "description": "No 4x A100 nodes available",
         "resolution_options": ["Wait for resources (ETA: 6 hours)", "Reduce to 2x A100 (available now)"],
         "blocking_tasks": ["training_execution"], "eta_hours": 6},
        {"blocker_id": 7, "type": "quota", "description": "Budget cap reached",
         "resolution_options": ["Raise the cap", 3]}]}})
    sws.drop(f"{hid}.json", {
        "handoff_id": hid, "conversation_id": "conv-2026-01-15-003", "from_agent": "orchestrator",
        "to_agent": "slurm-manager", "status": "success", "timestamp": "2026-01-15T14:20:00Z",
        "context": {"objective": "Submit training job on GPU cluster"},
        "results": {"summary": "Plan ready", "artifacts": []},
        "action_required": {"task": "Submit the training job", "priority": "high"}})
    run(sws)
    wait = sws.handoff("wait", hid, "--json", timeout=20)
    assert wait.returncode == 4, wait
    report = json.loads(wait.stdout)
    assert report["status"] == "blocked"
    assert report["blockers"] == [  # the seed's Blocker shape: the unknown type and id are made fit
        {"blocker_id": "blk-gpu-001", "type": "resource_unavailable",
         "description": "No 4x A100 nodes available",
         "resolution_options": ["Wait for resources (ETA: 6 hours)", "Reduce to 2x A100 (available now)"],
         "blocking_tasks": ["training_execution"]},
        {"type": "unknown", "description": "Budget cap reached", "resolution_options": ["Raise the cap"]}]
    assert problems(report) == []


def test_an_error_without_blockers_still_gets_a_generic_one() -> None:
    from datetime import datetime, timezone

    from handoffd.core.documents import Outcome
    from handoffd.dialects.agent_handoff import AgentHandoffDialect

    now = datetime(2026, 1, 15, tzinfo=timezone.utc)
    failed = Outcome(status="failed", started_at=now, finished_at=now,
                     error={"code": "PROCESSING_ERROR", "message": "boom"})
    (blocker,) = AgentHandoffDialect().blockers(failed, "error")
    assert blocker["type"] == "unknown" and blocker["description"] == "PROCESSING_ERROR: boom"
    assert blocker["resolution_options"]


# ---------------------------------------------------------------- seed 004: validateCompletion
def test_files_touched_outside_files_owned_cannot_complete(sws: Workspace) -> None:
    """validateCompletion: every files_touched entry outside files_owned is a violation and
    valid = violations.length === 0; swarm_complete: "Can't complete with contract violations".
    So even though the file was not changed, the handoff fails CONTRACT_VIOLATION, and the
    report says valid: false and why."""
    (sws.root / "src" / "lib").mkdir(parents=True)
    (sws.root / "src" / "lib" / "jwt.ts").write_text("export const sign = 1;\n")
    doc = fresh(SWARM_HANDOFF)
    contract = doc["contract"]
    contract.update(task_id="bd-7.2", dependencies_completed=[], success_criteria=["Works"])
    sws.drop("bd-7.2.json", doc)
    answering(sws, {"bd-7.2": {"status": "completed", "output": {
        "summary": "implemented AuthService", "files_touched": ["src/auth/service.ts", "src/lib/jwt.ts"]}}})
    run(sws)
    report = sws.doc("bd-7.2")
    assert sws.state_of("bd-7.2") == ["failed"], report
    assert "src/lib/jwt.ts" not in contract["files_owned"]
    assert report["valid"] is False, report
    kinds = {v["kind"]: v for v in report["violations"]}
    assert kinds["unauthorized_touched"]["path"] == "src/lib/jwt.ts"
    assert "src/lib/jwt.ts" in kinds["files_touched_mismatch"]["not_observed"]
    assert problems(report) == []


# ---------------------------------------------------------------- seed 000: the 1 KB rule
def test_a_reported_clarification_follows_the_1kb_rule_and_keeps_artifacts(sws: Workspace) -> None:
    draft = "def binary_search(nums, target):\n" + "    pass\n" * 300
    (sws.root / "artifacts" / "notes.md").write_text("# notes\n")
    answering(sws, {"msg-ask": {
        "status": "needs_clarification", "questions": ["Should empty array return -1 or raise?"],
        "output": {"summary": "draft so far", "draft": draft},
        "artifacts": [{"artifact_type": "analysis", "content": "é" * 600},  # 1200 bytes
                      {"artifact_type": "test_result", "content": "2/5 tests passed"},
                      {"artifact_type": "document", "path": "artifacts/notes.md"}]}})
    sws.drop("msg-ask.json", hi_moe_request("msg-ask"))
    run(sws)
    wait = sws.handoff("wait", "msg-ask", "--json", timeout=20)
    assert wait.returncode == 4, wait
    report = json.loads(wait.stdout)
    assert problems(report) == []
    kinds = {a["artifact_type"]: a for a in report["payload"]["artifacts"]}
    assert set(kinds) == {"output", "analysis", "test_result", "document"}
    for kind in ("output", "analysis"):  # 1 KB or more (in bytes): by reference, not inline
        ref = kinds[kind]["content_ref"]
        assert kinds[kind]["inline_content"] is None and ref.startswith("artifacts/msg-ask."), kinds[kind]
        assert "msg-ask/" not in ref  # not where the final answer writes later
    assert json.loads((sws.root / kinds["output"]["content_ref"]).read_text())["draft"] == draft
    assert (sws.root / kinds["analysis"]["content_ref"]).read_text() == "é" * 600
    assert kinds["test_result"]["inline_content"] == "2/5 tests passed"
    assert kinds["document"]["content_ref"] == "artifacts/notes.md"
    parked = json.loads((sws.root / "handoffs" / "pending" / "msg-ask.json").read_text())
    assert parked["handoffd"]["awaiting"]["outcome"] == report


def test_a_parked_result_naming_a_path_outside_the_workspace_fails(sws: Workspace) -> None:
    answering(sws, {"msg-out": {"status": "needs_clarification", "questions": ["which?"],
                                "artifacts": [{"path": "../outside.txt"}]}})
    sws.drop("msg-out.json", hi_moe_request("msg-out"))
    run(sws)
    answer = sws.doc("msg-out")
    assert sws.state_of("msg-out") == ["failed"]
    assert answer["payload"]["error_type"] == "validation_failed"
    assert "outside the workspace" in answer["payload"]["error_detail"]


def test_incoming_inline_content_is_counted_in_utf8_bytes(sws: Workspace) -> None:
    """Seed 000: inline content under 1 KB. 600 x "é" is 600 characters but 1200 bytes."""
    files = {}
    for name, text in {"ascii-1023": "x" * 1023, "e-511": "é" * 511, "e-512": "é" * 512,
                       "e-600": "é" * 600, "ascii-1024": "x" * 1024}.items():
        doc = fresh(HI_MOE_FLEET_TO_DISPATCHER)
        doc["payload"]["artifacts"][1]["inline_content"] = text
        path = sws.root / f"{name}.json"
        path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        files[name] = path
    proc = sws.handoff("validate", "--json", *map(str, files.values()))
    results = {Path(item["file"]).stem: item for item in json.loads(proc.stdout)}
    assert proc.returncode == 1
    assert {name for name, item in results.items() if item["valid"]} == {"ascii-1023", "e-511"}
    for name in ("e-512", "e-600", "ascii-1024"):
        (error,) = results[name]["errors"]
        assert error["field"] == "payload.artifacts[1].inline_content", error
        assert "UTF-8 bytes" in error["error"]


# ---------------------------------------------------------------- seed 000: DelegationPayload
OPTIONAL = ("timeout_ms", "deadline_hint", "specialist_hint")  # X | None in the seed
REQUIRED = ("task_type", "objective", "constraints", "context_refs", "priority", "task_data")


@pytest.mark.parametrize("field", REQUIRED + OPTIONAL)
def test_every_delegation_field_must_be_present(field: str) -> None:
    doc = hi_moe_request("msg-field")
    del doc["payload"][field]
    assert problems(doc) == ["payload"], field


def test_only_the_optional_delegation_fields_may_be_null() -> None:
    doc = hi_moe_request("msg-null")
    for field in OPTIONAL:
        doc["payload"][field] = None
    assert problems(doc) == []
    for field in ("constraints", "context_refs", "priority", "task_data"):
        bad = fresh(doc)
        bad["payload"][field] = None
        assert problems(bad) == [f"payload.{field}"], field


def test_a_delegation_missing_fields_is_refused_not_run(sws: Workspace) -> None:
    doc = hi_moe_request("msg-min")
    doc["payload"] = {"task_type": "execute_code", "objective": "Write binary search function",
                      "specialist_hint": "python-lora"}
    path = sws.root / "msg-min.json"
    path.write_text(json.dumps(doc))
    assert sws.handoff("validate", str(path)).returncode == 1
    answering(sws, {"msg-min": {"status": "completed", "output": {"summary": "ran"}}})
    sws.drop("msg-min.json", doc)
    run(sws)
    answer = sws.doc("msg-min")
    assert sws.state_of("msg-min") == ["failed"] and runs(sws, "msg-min") == 0
    assert answer["payload"]["status"] == "failed"
    assert answer["payload"]["error_type"] == "schema_validation_failed"
    assert "constraints" in answer["payload"]["error_detail"]


# ---------------------------------------------------------------- seed 000: error fields
def test_a_cancelled_outcome_carries_no_error_fields(sws: Workspace) -> None:
    """Seed 000: "Error details (only present if status is FAILED, BLOCKED,
    NEEDS_CLARIFICATION)"; a cancellation is the requester's own decision."""
    path = sws.root / "msg-c.json"
    path.write_text(json.dumps(hi_moe_request("msg-c")))
    assert sws.create("--file", str(path)) == "msg-c"
    assert sws.handoff("cancel", "msg-c").returncode == 0
    payload = sws.doc("msg-c")["payload"]
    assert payload["status"] == "cancelled"
    assert (payload["error_type"], payload["error_detail"], payload["recoverable"]) == (None, None, None)
    assert "cancelled by" in payload["summary"]  # what happened is said there
    incoming = fresh(HI_MOE_FLEET_TO_DISPATCHER)
    incoming["payload"].update(status="cancelled", error_type="cancelled")
    assert "payload.error_type" in problems(incoming)


def test_a_timeout_outcome_keeps_its_error_fields() -> None:
    """TIMEOUT is not in the seed's list, but its aggregated example reports a child's timeout
    with the detail in error_detail: ambiguous, so handoffd keeps them (docs/formats.md)."""
    from datetime import datetime, timezone

    from handoffd.core.documents import Outcome
    from handoffd.core.formats import FiledState

    now = datetime(2026, 1, 15, tzinfo=timezone.utc)
    outcome = Outcome(status="timeout", started_at=now, finished_at=now,
                      error={"code": "TIMEOUT", "message": "timeout after 30000ms", "retryable": False})
    answer = dialects.by_name("hi_moe").render(hi_moe_request("msg-t"), outcome, FiledState(0, 3, True))
    assert answer["payload"]["error_type"] == "timeout"
    assert answer["payload"]["error_detail"] == "timeout after 30000ms"
    assert problems({k: v for k, v in answer.items() if k != "handoffd"}) == []


def test_a_message_with_object_tiers_is_answered_not_crashed() -> None:
    """Found by tests/test_fuzz.py while checking these fixes: a tier given as an object made
    the answer's tier lookup raise (unhashable), which left the handoff in in-progress/. It is
    answered, with the default tiers."""
    from datetime import datetime, timezone

    from handoffd.core.documents import Outcome
    from handoffd.core.formats import FiledState

    now = datetime(2026, 1, 15, tzinfo=timezone.utc)
    doc = hi_moe_request("msg-tiers")
    doc["source_tier"], doc["target_tier"] = {"a": 1}, ["b"]
    failed = Outcome(status="failed", started_at=now, finished_at=now,
                     error={"code": "SCHEMA_VALIDATION_FAILED", "message": "bad tiers"})
    answer = dialects.by_name("hi_moe").render(doc, failed, FiledState(0, 3, False))
    assert (answer["source_tier"], answer["target_tier"]) == ("ROUTING_DISPATCHER", "ABSTRACT_ARCHITECT")


def test_a_status_the_schema_refuses_is_refused_not_overwritten_by_the_claim(
        sws: Workspace) -> None:
    """Found by the seed review: claiming wrote the queue's status (in_progress, accepted) over
    the one the request carried before the schema check, so a native request with status
    "garbage" and a HAIOS handoff with "running" ran, though `handoff validate` refuses both
    (DESIGN: a readable document that fails its schema is filed in failed/)."""
    native = {"handoff_id": "n-garbage", "status": "garbage", "target": {"agent_id": "@answerer"},
              "input": {"data": {}}}
    haios = {"handoff_id": "5f0c7a2e-1111-4222-8333-944455556667", "from_agent": "a-v1",
             "to_agent": "ingester-v1", "created_at": "2025-12-02T10:00:00Z",
             "payload": {"directive": {"action": "ingest"}}, "timeout_ms": 30000,
             "status": "running"}
    answering(sws, {native["handoff_id"]: {"status": "completed", "output": {}},
                    haios["handoff_id"]: {"status": "completed", "output": {}}})
    for doc in (native, haios):
        assert problems(doc) == ["status"]
        sws.drop(f"{doc['handoff_id']}.json", doc)
    run(sws)
    for doc in (native, haios):
        hid = doc["handoff_id"]
        assert sws.state_of(hid) == ["failed"] and runs(sws, hid) == 0
        assert "SCHEMA_VALIDATION_FAILED" in json.dumps(sws.doc(hid))
    # a valid status is still the queue's to set
    ok = dict(native, handoff_id="n-ok", status="pending")
    answering(sws, {"n-ok": {"status": "completed", "output": {}}})
    sws.drop("n-ok.json", ok)
    run(sws)
    assert sws.state_of("n-ok") == ["completed"]
