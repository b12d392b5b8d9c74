"""Each seed format through the real daemon: documents dropped into pending/ by foreign producers,
``handoffd run`` (batch mode), answers filed in the request's own format.

One shared workspace runs every seed example at once (a single batch); a few scenarios that need
their own workspace (retry, unknown version...) run separately. No sleeps: batch mode returns when
nothing is due.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import exe
from dialect_examples import (
    AGENT,
    AGENT_SUCCESS,
    HAIOS_HANDOFF,
    HI_MOE,
    SWARM_HANDOFF,
    fresh,
)

from handoffd import dialects
from handoffd.core.validation import SchemaCache

SCHEMAS = SchemaCache(None)
MISSING_ARTIFACTS = "0b6f8a1e-9c2d-4e5f-8a7b-6c5d4e3f2a10"

SPECIALIST = r'''
import json, os, sys
from pathlib import Path

mode = sys.argv[1]
doc = json.load(sys.stdin)
root = Path(os.environ["HANDOFFD_ROOT"])
keys = sorted(k for k in doc if k != "handoffd")
if mode == "ok":
    result = {"status": "completed", "output": {"summary": "handled " + os.environ["HANDOFF_ID"],
                                                "keys": keys},
              "metadata": {"confidence": 0.9, "resources_used": {"tokens_in": 10}}}
elif mode == "big":
    result = {"status": "completed", "output": {"code": "x" * 3000},
              "artifacts": [{"artifact_type": "code", "content": "def f():\n" + "    pass\n" * 300},
                            {"artifact_type": "test_result", "content": "5/5 tests passed"}]}
elif mode == "partial":
    result = {"status": "partial", "output": {"summary": "2 of 3 done"}}
elif mode == "write":
    target = root / "src" / "auth" / "auth.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("def login(): ...\n")
    result = {"status": "completed", "output": {"summary": "wrote auth.py"},
              "artifacts": [{"name": "auth.py", "path": "src/auth/auth.py", "type": "code"}]}
elif mode == "lie":
    result = {"status": "completed", "output": {"summary": "wrote it, honest"},
              "artifacts": [{"name": "here.py", "path": "src/maybe/here.py", "type": "code"}]}
elif mode == "ingest":
    result = {"status": "completed", "output": {"entities_created": 1, "concepts_created": 3}}
elif mode == "ingest-wrong":
    result = {"status": "completed", "output": {"entities": "one"}}
elif mode == "swarm":
    contract = doc["contract"]
    owned = root / contract["files_owned"][0]
    owned.parent.mkdir(parents=True, exist_ok=True)
    owned.write_text("export class AuthService {}\n")
    result = {"status": "completed",
              "output": {"files_touched": contract["files_owned"][:1],
                         "summary": "AuthService implemented for " + contract["task_id"]}}
elif mode == "chain":
    result = {"status": "completed", "output": {"summary": "reviewed; planning next",
                                                "next_agent": "planner"}}
elif mode == "fail":
    result = {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "no luck",
                                            "retryable": False}}
print(json.dumps(result))
'''

TARGETS = {
    "ROUTING_DISPATCHER": "ok", "python-lora": "big", "ABSTRACT_ARCHITECT": "partial",
    "SPECIALIZED_FLEET": "ok",
    "code-quality-reviewer": "ok", "planner": "ok", "orchestrator": "ok",
    "artifact-writer": "write", "artifact-liar": "lie", "failing-agent": "fail",
    "ingester-v1": "ingest", "strict-ingester": "ingest-wrong",
    "@swarm-worker": "swarm", "@native-echo": "ok", "chain-agent": "chain",
}
ANSWER_SCHEMA = {"hi_moe": "hi_moe.message.schema.json", "agent_handoff": "agent_handoff.schema.json",
                 "haios": "haios.collaboration_result.schema.json",
                 "swarm": "swarm.completion_report.schema.json"}


class Run:
    """A workspace with one command specialist per routed target."""

    def __init__(self, root: Path, script: Path, concurrency: int = 4) -> None:
        self.root = root
        lines = ["[daemon]", "settle_seconds = 0.0", "workers = 4", "",
                 "[retry]", "max_retries = 0", ""]
        for target, mode in TARGETS.items():
            lines += [f'[specialists."{target}"]',
                      f"command = {json.dumps([sys.executable, str(script), mode])}",
                      "timeout_seconds = 60", f"concurrency = {concurrency}", ""]
        root.mkdir(parents=True, exist_ok=True)
        (root / "handoffd.toml").write_text("\n".join(lines))

    def drop(self, name: str, doc: Any) -> None:
        pending = self.root / "handoffs" / "pending"
        pending.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.part"
        tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        os.replace(tmp, pending / f"{name}.json")

    def run(self) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([exe("handoffd"), "run", "--root", str(self.root)],
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 1), proc.stderr
        return proc

    def where(self, handoff_id: str) -> str:
        found = [s for s in ("pending", "in-progress", "completed", "failed")
                 if (self.root / "handoffs" / s / f"{handoff_id}.json").exists()]
        assert len(found) == 1, (handoff_id, found)
        return found[0]

    def answer(self, handoff_id: str) -> tuple[str, dict[str, Any]]:
        state = self.where(handoff_id)
        return state, json.loads((self.root / "handoffs" / state / f"{handoff_id}.json").read_text())

    def filed(self) -> list[Path]:
        return sorted((self.root / "handoffs" / "completed").glob("*.json")) + \
            sorted((self.root / "handoffs" / "failed").glob("*.json"))


def assert_valid_answer(doc: dict[str, Any], dialect: str) -> None:
    """The answer is in ``dialect``'s format and validates against its answer schema."""
    assert doc["handoffd"]["dialect"] == dialect
    assert dialects.detect(doc).name == dialect
    body = {k: v for k, v in doc.items() if k != "handoffd"}
    assert SCHEMAS.errors(ANSWER_SCHEMA[dialect], body) == [], body


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "specialist.py"
    path.write_text(SPECIALIST)
    return path


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory, script: Path) -> Iterator[Run]:
    """Every seed example (and a few variants) in one workspace, processed by one batch run."""
    run = Run(tmp_path_factory.mktemp("dialects") / "ws", script)
    for key, doc in HI_MOE.items():
        if key != "cancellation":  # it would cancel msg-001 (a race): see its own test
            run.drop(doc["id"], doc)
    extra = fresh(HI_MOE["architect_to_dispatcher"])
    extra.update(id="msg-extra-fields", version="1.3.0", trace_parent="00-4bf92f-01")
    extra["payload"]["budget_tokens"] = 5000
    run.drop("msg-extra-fields", extra)
    for doc in AGENT.values():
        produce_artifacts(run.root, doc)
        run.drop(doc["handoff_id"], doc)
    missing = fresh(AGENT_SUCCESS)  # its artifacts were never produced
    missing["handoff_id"] = MISSING_ARTIFACTS
    missing["results"]["artifacts"][0]["path"] = "src/never/written.py"
    run.drop(MISSING_ARTIFACTS, missing)
    for target in ("artifact-writer", "artifact-liar", "failing-agent"):
        doc = fresh(AGENT_SUCCESS)
        doc.update(handoff_id=str(uuid.uuid4()), to_agent=target)
        run.drop(doc["handoff_id"], doc)
    run.drop(HAIOS_HANDOFF["handoff_id"], HAIOS_HANDOFF)
    strict = fresh(HAIOS_HANDOFF)
    strict.update(handoff_id=str(uuid.uuid4()), to_agent="strict-ingester", expected_output_schema={
        "type": "object", "required": ["entities_created"],
        "properties": {"entities_created": {"type": "integer"}}})
    run.drop(strict["handoff_id"], strict)
    run.drop("not-a-format", {"greeting": "hello", "recipient": "anyone"})
    run.proc = run.run()  # type: ignore[attr-defined]
    run.by_target = {"strict": strict["handoff_id"]}  # type: ignore[attr-defined]
    yield run


def produce_artifacts(root: Path, doc: dict[str, Any]) -> None:
    """Write the files an AgentHandoff says the agent before produced (seed 002: the receiver
    verifies they exist)."""
    for item in (doc.get("results") or {}).get("artifacts") or []:
        path = root / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# produced by {doc['from_agent']}\n")


def test_an_agent_handoff_whose_artifacts_are_missing_fails(batch: Run) -> None:
    state, answer = batch.answer(MISSING_ARTIFACTS)
    assert state == "failed" and answer["status"] == "error"
    assert "src/never/written.py" in json.dumps(answer)
    assert "dependency_missing" in json.dumps(answer).lower()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, script: Path) -> Iterator[Run]:
    """Seed 004 in a workspace of its own: contract checks watch the whole contract directory,
    so no other handler may write there meanwhile (one worker at a time)."""
    run = Run(tmp_path_factory.mktemp("swarm") / "ws", script, concurrency=1)
    # seed 004's example depends on bd-123.1: a native handoff that completes in the same batch
    run.drop("bd-123.1", {"handoff_id": "bd-123.1", "target": {"agent_id": "@native-echo"},
                          "input": {"data": {"step": 1}}})
    run.drop("bd-123.2", SWARM_HANDOFF)
    checkable = fresh(SWARM_HANDOFF)
    checkable["contract"].update(task_id="bd-123.3", files_owned=["src/api/routes.ts"],
                                 success_criteria=[f"Tests pass: {sys.executable} -c pass",
                                                   "Routes are wired"])
    run.drop("bd-123.3", checkable)
    run.proc = run.run()  # type: ignore[attr-defined]
    yield run


def agent_id_for(run: Run, target: str) -> str:
    for path in run.root.glob("handoffs/*/*.json"):
        doc = json.loads(path.read_text())
        snap = doc.get("handoffd", {}).get("request_snapshot", doc)
        if snap.get("to_agent") == target and snap.get("from_agent") == "code-generator" \
                and snap.get("handoff_id") not in (AGENT["success"]["handoff_id"],
                                                   AGENT["usage"]["handoff_id"]):
            return path.stem
    raise AssertionError(f"no handoff to {target}")


def test_batch_ran_everything(batch: Run) -> None:
    assert "Traceback" not in batch.proc.stderr  # type: ignore[attr-defined]
    assert not list((batch.root / "handoffs" / "pending").glob("*.json"))
    assert not list((batch.root / "handoffs" / "in-progress").glob("*.json"))


def test_handoff_ls_shows_the_swarm_worker(swarm: Run) -> None:
    proc = subprocess.run([exe("handoff"), "ls", "--json", "--root", str(swarm.root)],
                          capture_output=True, text=True, timeout=60)
    rows = {row["id"]: row for row in json.loads(proc.stdout)}
    assert (rows["bd-123.2"]["to"], rows["bd-123.2"]["dialect"]) == ("@swarm-worker", "swarm")


@pytest.mark.parametrize("key", ["fleet_to_dispatcher", "aggregated"])
def test_hi_moe_outcomes_going_up_are_refused_not_run(batch: Run, key: str) -> None:
    """Seed 000's upward messages (an OutcomePayload) are answers: dropped into pending/ they are
    refused with NOT_A_REQUEST, never run as work (an Outcome of an Outcome)."""
    request = HI_MOE[key]
    state, answer = batch.answer(request["id"])
    assert state == "failed"
    assert_valid_answer(answer, "hi_moe")
    payload = answer["payload"]
    assert payload["status"] == "failed" and payload["error_type"] == "not_a_request"
    assert "is an Outcome" in payload["error_detail"] and payload["recoverable"] is False


@pytest.mark.parametrize("key", ["architect_to_dispatcher", "dispatcher_to_fleet"])
def test_hi_moe_messages_answered_as_messages(batch: Run, key: str) -> None:
    request = HI_MOE[key]
    state, answer = batch.answer(request["id"])
    assert state == "completed"
    assert_valid_answer(answer, "hi_moe")
    assert answer["correlation_id"] == request["id"]
    assert answer["version"] == "1.0.0" and answer["id"] != request["id"]
    assert answer["source_tier"] == request["target_tier"]
    assert answer["target_tier"] == request["source_tier"]
    payload = answer["payload"]
    assert payload["status"] == "success"
    assert isinstance(payload["execution_time_ms"], int)
    assert isinstance(payload["resources_used"], dict)
    assert answer["handoffd"]["request_snapshot"]["payload"] == request["payload"]


def test_hi_moe_routing_by_specialist_hint_and_artifacts_by_size(batch: Run) -> None:
    _, answer = batch.answer("msg-002")
    payload = answer["payload"]
    assert payload["resources_used"]["specialist"] == "python-lora"
    arts = payload["artifacts"]
    assert [a["artifact_type"] for a in arts] == ["output", "code", "test_result"]
    for art in arts:
        assert (art["content_ref"] is None) != (art["inline_content"] is None)
    assert arts[2]["inline_content"] == "5/5 tests passed"
    for art in arts[:2]:
        assert art["content_ref"].startswith("artifacts/msg-002/")
        stored = batch.root / art["content_ref"]
        assert stored.is_file() and stored.stat().st_size >= 1024
    assert json.loads((batch.root / arts[0]["content_ref"]).read_text()) == {"code": "x" * 3000}
    _, small = batch.answer("msg-001")
    (output,) = small["payload"]["artifacts"]
    assert output["content_ref"] is None and json.loads(output["inline_content"])["summary"]
    assert small["payload"]["confidence"] == 0.9


def test_hi_moe_cancellation_message_answered_in_format(tmp_path: Path, script: Path) -> None:
    """Seed 000's cancellation of msg-001, arriving after msg-001 finished: both are answered
    with hi_moe Messages (what a cancellation does is orchestration's business)."""
    run = Run(tmp_path / "ws", script)
    run.drop("msg-001", HI_MOE["architect_to_dispatcher"])
    run.run()
    run.drop("msg-cancel-001", HI_MOE["cancellation"])
    run.run()
    assert run.answer("msg-001")[0] == "completed"
    state, answer = run.answer("msg-cancel-001")
    assert state in ("completed", "failed")
    assert_valid_answer(answer, "hi_moe")
    assert answer["correlation_id"] == "msg-cancel-001"
    assert answer["source_tier"] == "ROUTING_DISPATCHER"
    assert answer["target_tier"] == "ABSTRACT_ARCHITECT"


def test_hi_moe_unknown_fields_preserved(batch: Run) -> None:
    state, answer = batch.answer("msg-extra-fields")
    assert state == "completed"
    assert_valid_answer(answer, "hi_moe")
    assert answer["trace_parent"] == "00-4bf92f-01"
    assert answer["version"] == "1.3.0"
    assert answer["handoffd"]["request_snapshot"]["payload"]["budget_tokens"] == 5000


@pytest.mark.parametrize("key", sorted(AGENT))
def test_agent_handoffs_answered_as_agent_handoffs(batch: Run, key: str) -> None:
    request = AGENT[key]
    state, answer = batch.answer(request["handoff_id"])
    assert state == "completed"
    assert_valid_answer(answer, "agent_handoff")
    assert answer["from_agent"] == request["to_agent"]
    assert answer["to_agent"] == request["from_agent"]
    assert answer["conversation_id"] == request["conversation_id"]
    assert answer["status"] == "success" and answer["results"]["summary"].startswith("handled")
    assert answer["in_reply_to"] == request["handoff_id"]
    position = request.get("metadata", {}).get("chain_position")
    if position:
        assert answer["metadata"]["chain_position"]["step"] == position["step"] + 1


def test_agent_handoff_verified_artifact_completes(batch: Run) -> None:
    state, answer = batch.answer(agent_id_for(batch, "artifact-writer"))
    assert state == "completed"
    assert_valid_answer(answer, "agent_handoff")
    assert answer["results"]["artifacts"] == [{"name": "auth.py", "path": "src/auth/auth.py",
                                               "type": "code"}]


def test_agent_handoff_unverified_artifact_is_an_error(batch: Run) -> None:
    state, answer = batch.answer(agent_id_for(batch, "artifact-liar"))
    assert state == "failed"
    assert_valid_answer(answer, "agent_handoff")
    assert answer["status"] == "error"
    (blocker,) = answer["blockers"]
    assert blocker["type"] == "validation_failed"
    assert "src/maybe/here.py" in blocker["description"]
    assert answer["handoffd"]["history"][-1]["detail"]["code"] == "VALIDATION_FAILED"


def test_agent_handoff_handler_failure_is_an_error(batch: Run) -> None:
    state, answer = batch.answer(agent_id_for(batch, "failing-agent"))
    assert state == "failed"
    assert_valid_answer(answer, "agent_handoff")
    assert answer["status"] == "error" and "no luck" in answer["blockers"][0]["description"]


def test_haios_handoff_answered_with_collaboration_result(batch: Run) -> None:
    state, answer = batch.answer(HAIOS_HANDOFF["handoff_id"])
    assert state == "completed"
    assert_valid_answer(answer, "haios")
    assert answer["handoff_id"] == HAIOS_HANDOFF["handoff_id"]
    assert answer["executed_by"] == "ingester-v1"
    assert answer["status"] == "success" and answer["error"] is None
    assert answer["result"] == {"entities_created": 1, "concepts_created": 3}
    assert answer["handoffd"]["request_snapshot"]["status"] == "accepted"  # claimed = accepted


def test_haios_expected_output_schema_violation(batch: Run) -> None:
    state, answer = batch.answer(batch.by_target["strict"])  # type: ignore[attr-defined]
    assert state == "failed"
    assert_valid_answer(answer, "haios")
    assert answer["status"] == "error"
    assert answer["error"]["code"] == "VALIDATION_FAILED"
    assert answer["error"]["error_type"] == "permanent"
    assert "entities_created" in answer["error"]["message"]


def test_swarm_seed_example_answered_with_completion_report(swarm: Run) -> None:
    """Seed 004's own example: its checkable criteria (bun test, tsc) are run by the contract
    checks; the report records each criterion, and the handoff completes only if they pass."""
    assert swarm.where("bd-123.1") == "completed"
    state, answer = swarm.answer("bd-123.2")
    assert_valid_answer(answer, "swarm")
    assert answer["task_id"] == "bd-123.2"
    assert answer["files_touched"] == ["src/auth/service.ts"]
    assert answer["summary"] == "AuthService implemented for bd-123.2"
    assert answer["agent"] == "@swarm-worker"
    criteria = {c["criterion"]: c["status"] for c in answer["success_criteria"]}
    assert list(criteria) == SWARM_HANDOFF["contract"]["success_criteria"]
    assert criteria["AuthService.login() returns JWT token"] == "unchecked"  # prose: never "passed"
    checkable = [v for k, v in criteria.items() if ":" in k]
    if all(v == "passed" for v in checkable):
        assert state == "completed" and answer["valid"] is True
    else:  # bun / tsc missing or failing here: the contract is not met
        assert state == "failed" and answer["valid"] is False
        assert answer["error"]["code"] == "VALIDATION_FAILED"


def test_swarm_handoff_meeting_its_contract_completes(swarm: Run) -> None:
    state, answer = swarm.answer("bd-123.3")
    assert state == "completed", answer.get("error")
    assert_valid_answer(answer, "swarm")
    assert answer["files_touched"] == ["src/api/routes.ts"]
    assert answer["valid"] is True and answer["violations"] == []
    assert [c["status"] for c in answer["success_criteria"]] == ["passed", "unchecked"]


def test_unknown_format_is_set_aside_with_a_clear_message(batch: Run) -> None:
    state, stub = batch.answer("not-a-format")
    assert state == "failed"
    assert stub["error"]["code"] == "UNKNOWN_FORMAT"
    for name in ("hi_moe", "haios", "agent_handoff", "swarm", "native"):
        assert name in stub["error"]["message"]
    reasons = [json.loads(p.read_text()) for p in
               (batch.root / "handoffs" / ".quarantine").glob("*.reason.json")]
    assert [r["code"] for r in reasons if r["file"] == "not-a-format.json"] == ["UNKNOWN_FORMAT"]
    kept = [p for p in (batch.root / "handoffs" / ".quarantine").iterdir()
            if p.name.endswith("not-a-format.json")]
    assert json.loads(kept[0].read_text()) == {"greeting": "hello", "recipient": "anyone"}
    assert not list((batch.root / "handoffs" / ".locks").glob("not-a-format.*"))


def test_every_document_the_daemon_wrote_validates(batch: Run, swarm: Run) -> None:
    """All answers in completed/ and failed/ validate against their format's schema, through the
    library and through the installed `handoff validate`."""
    files = batch.filed() + swarm.filed()
    assert len(files) == 16 + 3  # every document dropped in the two batches
    for path in files:
        doc = json.loads(path.read_text())
        name = doc["handoffd"]["dialect"]
        body = {k: v for k, v in doc.items() if k != "handoffd"}
        if name == "native":
            schema = ("native.response.schema.json" if path.parent.name == "completed"
                      else "native.failure.schema.json")
        else:
            schema = ANSWER_SCHEMA[name]
        assert SCHEMAS.errors(schema, body) == [], (path.name, SCHEMAS.errors(schema, body))
    ours = [str(p) for p in files if json.loads(p.read_text())["handoffd"]["dialect"] != "native"]
    proc = subprocess.run([exe("handoff"), "validate", *ours, "--json"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    assert all(item["valid"] for item in json.loads(proc.stdout))


def test_handoff_ls_shows_the_request_direction(batch: Run) -> None:
    proc = subprocess.run([exe("handoff"), "ls", "--json", "--limit", "100", "--root", str(batch.root)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = {row["id"]: row for row in json.loads(proc.stdout)}
    assert (rows["msg-002"]["from"], rows["msg-002"]["to"]) == ("ROUTING_DISPATCHER", "python-lora")
    success = rows[AGENT_SUCCESS["handoff_id"]]
    assert (success["from"], success["to"], success["dialect"]) == \
        ("code-generator", "code-quality-reviewer", "agent_handoff")
    assert rows[HAIOS_HANDOFF["handoff_id"]]["to"] == "ingester-v1"


# ------------------------------------------------------------------ scenarios with their own workspace
def test_unknown_major_version_fails_in_format(tmp_path: Path, script: Path) -> None:
    run = Run(tmp_path / "ws", script)
    doc = fresh(HI_MOE["dispatcher_to_fleet"])
    doc["version"] = "2.0.0"
    run.drop("msg-002", doc)
    run.run()  # (admission failures are not yet counted in the batch exit code)
    state, answer = run.answer("msg-002")
    assert state == "failed"
    assert_valid_answer(answer, "hi_moe")
    assert answer["version"] == "1.0.0"
    payload = answer["payload"]
    assert payload["status"] == "failed" and payload["error_type"] == "unknown_version"
    assert "major version 2" in payload["error_detail"] and payload["recoverable"] is False


def test_invalid_document_fails_in_its_own_format(tmp_path: Path, script: Path) -> None:
    run = Run(tmp_path / "ws", script)
    doc = fresh(AGENT["partial"])
    del doc["blockers"]
    run.drop(doc["handoff_id"], doc)
    haios = fresh(HAIOS_HANDOFF)
    haios["created_at"] = "not a time"
    run.drop(haios["handoff_id"], haios)
    run.run()
    state, answer = run.answer(doc["handoff_id"])
    assert state == "failed"
    assert_valid_answer(answer, "agent_handoff")
    assert "SCHEMA_VALIDATION_FAILED" in answer["blockers"][0]["description"]
    assert "blockers" in answer["blockers"][0]["description"]
    state, result = run.answer(haios["handoff_id"])
    assert state == "failed"
    assert_valid_answer(result, "haios")
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert any(e["field"] == "created_at" for e in result["error"]["errors"])


def test_retry_restores_the_request_and_answers_again(tmp_path: Path, script: Path) -> None:
    run = Run(tmp_path / "ws", script)
    doc = fresh(AGENT_SUCCESS)
    doc["to_agent"] = "artifact-liar"
    produce_artifacts(run.root, doc)
    run.drop(doc["handoff_id"], doc)
    run.run()
    assert run.answer(doc["handoff_id"])[1]["status"] == "error"
    proc = subprocess.run([exe("handoff"), "retry", "--force", doc["handoff_id"], "--root",
                           str(run.root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    state, pending = run.answer(doc["handoff_id"])
    assert state == "pending"
    assert {k: v for k, v in pending.items() if k != "handoffd"} == doc
    (run.root / "src" / "maybe").mkdir(parents=True)
    (run.root / "src" / "maybe" / "here.py").write_text("# now it exists\n")
    run.run()
    state, answer = run.answer(doc["handoff_id"])
    assert state == "completed"
    assert_valid_answer(answer, "agent_handoff")
    assert answer["status"] == "success" and answer["in_reply_to"] == doc["handoff_id"]


def test_create_file_accepts_every_format(tmp_path: Path, script: Path) -> None:
    run = Run(tmp_path / "ws", script)
    docs = [HI_MOE["dispatcher_to_fleet"], AGENT["blocked"], HAIOS_HANDOFF]
    ids = []
    for doc in docs:
        path = tmp_path / "doc.json"
        path.write_text(json.dumps(doc))
        proc = subprocess.run([exe("handoff"), "create", "--file", str(path), "--root",
                               str(run.root)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        ids.append(proc.stdout.strip())
    assert ids == ["msg-002", AGENT["blocked"]["handoff_id"], HAIOS_HANDOFF["handoff_id"]]
    assert run.run().returncode == 0
    for handoff_id, name in zip(ids, ("hi_moe", "agent_handoff", "haios")):
        state, answer = run.answer(handoff_id)
        assert state == "completed"
        assert_valid_answer(answer, name)


def test_an_answer_naming_a_next_agent_is_handed_on(tmp_path: Path, script: Path) -> None:
    """Seed 002: "create new handoff - pass results to next agent". A specialist that names
    output.next_agent gets its answer addressed to that agent and submitted as a new handoff."""
    run = Run(tmp_path / "ws", script)
    doc = fresh(AGENT_SUCCESS)
    doc["to_agent"] = "chain-agent"
    produce_artifacts(run.root, doc)
    run.drop(doc["handoff_id"], doc)
    run.run()  # one batch: the handed-on handoff is due at once and runs too
    state, answer = run.answer(doc["handoff_id"])
    assert state == "completed" and answer["to_agent"] == "planner"
    assert answer["from_agent"] == "chain-agent" and answer["in_reply_to"] == doc["handoff_id"]
    onward_state, onward = run.answer(answer["handoff_id"])
    assert onward_state == "completed", onward
    assert onward["from_agent"] == "planner" and onward["to_agent"] == "chain-agent"
    assert onward["in_reply_to"] == answer["handoff_id"]
    assert onward["conversation_id"] == doc["conversation_id"]
