"""A WorkerHandoff the dependencies gate fails lists its ``dependency_missing`` violation in its
completion report (session 18, R13 defect 5). Seed 004's validateCompletion returns ``{valid:
violations.length === 0, violations}`` and docs/contracts.md counts ``dependency_missing`` among
the violations: before, the report of a handoff whose ``dependencies_completed`` named a task
that never existed said ``valid: true, violations: []`` while the violations log recorded a
``dependency_missing`` for it. Now the report lists the violation (``missing``: the
dependencies the failure names) and the log's details carry the same facts.

One real ``handoffd run`` batch over WorkerHandoffs in a temporary workspace."""
from __future__ import annotations

import json
import sys
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace

# the worker: completes, or answers what the handoff's "script" says
WORKER = '''
import json, sys
doc = json.load(sys.stdin)
script = doc.get("script") or {}
if script.get("fail"):
    print(json.dumps({"status": "failed", "error": {"code": script["fail"], "message": "asked to",
                                                    "retryable": False}}))
else:
    print(json.dumps({"status": "completed", "output": {"summary": "done"}}))
'''

CONFIG = """
[daemon]
settle_seconds = 0.1
rescan_seconds = 0.3
sweep_seconds = 0.5
durability = "fast"

[retry]
max_retries = 0

[specialists."@swarm-worker"]
command = ["{python}", "-S", "{worker}"]
timeout_seconds = 30
"""


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """A workspace where one batch ran: bd-ok completes, bd-bad fails, bd-5 depends on a task
    that does not exist, bd-6 on bd-ok and bd-bad, bd-7's worker answers DEPENDENCY_MISSING
    itself."""
    tmp = tmp_path_factory.mktemp("swarm-deps")
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    ws = new_workspace(tmp / "ws", CONFIG.format(python=sys.executable, worker=worker))
    ws.drop("bd-ok.json", handoff("bd-ok"))
    ws.drop("bd-bad.json", handoff("bd-bad", script={"fail": "PROCESSING_ERROR"}))
    ws.drop("bd-5.json", handoff("bd-5", deps=["bd-nope"]))
    ws.drop("bd-6.json", handoff("bd-6", deps=["bd-ok", "bd-bad"]))
    ws.drop("bd-7.json", handoff("bd-7", script={"fail": "DEPENDENCY_MISSING"}))
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    yield ws
    ws.cleanup()


def handoff(task_id: str, *, deps: list[str] | None = None,
            script: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seed 004's WorkerHandoff for ``task_id`` (its files under src/<task_id>/)."""
    doc: dict[str, Any] = {
        "contract": {"task_id": task_id, "files_owned": [f"src/{task_id}/**"],
                     "files_readonly": [], "dependencies_completed": deps or [],
                     "success_criteria": []},
        "context": {"epic_summary": "e", "your_role": "r", "what_others_did": "w",
                    "what_comes_next": "n"},
        "escalation": {"blocked_contact": "coordinator", "scope_change_protocol": "ask"},
    }
    if script:
        doc["script"] = script
    return doc


def report(ws: Workspace, task_id: str) -> dict[str, Any]:
    """The filed completion report of ``task_id``, checked against its schema."""
    assert ws.state_of(task_id) == ["failed"], ws.state_of(task_id)
    path = ws.root / "handoffs" / "failed" / f"{task_id}.json"
    check = ws.handoff("validate", str(path))
    assert check.returncode == 0, check.stdout + check.stderr
    return json.loads(path.read_text())


def logged(ws: Workspace, task_id: str) -> list[dict[str, Any]]:
    path = ws.root / "handoffs" / ".meta" / "violations.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [entry for entry in map(json.loads, lines) if entry["handoff_id"] == task_id]


def test_a_dependency_that_does_not_exist_makes_the_report_invalid(batch: Workspace) -> None:
    doc = report(batch, "bd-5")
    assert doc["error"]["code"] == "DEPENDENCY_MISSING"
    assert doc["valid"] is False
    (violation,) = doc["violations"]
    assert violation == {"kind": "dependency_missing", "missing": ["bd-nope"],
                         "dependencies": ["bd-nope"], "message": doc["error"]["message"]}
    # the violations log says the same of the same handoff
    (entry,) = logged(batch, "bd-5")
    assert entry["kind"] == "dependency_missing" and entry["task_id"] == "bd-5"
    assert entry["details"] == {k: v for k, v in violation.items() if k != "kind"}


def test_a_failed_dependency_is_named_among_the_completed_ones(batch: Workspace) -> None:
    assert batch.state_of("bd-ok") == ["completed"] and batch.state_of("bd-bad") == ["failed"]
    doc = report(batch, "bd-6")
    assert doc["valid"] is False and "bd-bad" in doc["error"]["message"]
    (violation,) = doc["violations"]
    assert violation["kind"] == "dependency_missing"
    assert violation["missing"] == ["bd-bad"] and violation["dependencies"] == ["bd-ok", "bd-bad"]
    (entry,) = logged(batch, "bd-6")
    assert entry["details"]["missing"] == ["bd-bad"]


def test_a_worker_that_answers_dependency_missing_is_not_a_violation(batch: Workspace) -> None:
    """What a worker answers is its word, as any failure (it reports a violation of its own in
    ``output.violations``): only the gate's check is a contract violation, so the report and
    the log still agree."""
    doc = report(batch, "bd-7")
    assert doc["error"]["code"] == "DEPENDENCY_MISSING"
    assert doc["valid"] is True and doc["violations"] == []
    assert logged(batch, "bd-7") == []


def test_a_handoff_the_gate_passes_stays_valid(batch: Workspace) -> None:
    path = batch.root / "handoffs" / "completed" / "bd-ok.json"
    doc = json.loads(path.read_text())
    assert doc["valid"] is True and doc["violations"] == [] and doc["status"] == "completed"
    assert not any(e["kind"] == "dependency_missing" for e in logged(batch, "bd-ok"))
