"""Cancellation and foreign claims against seeds 000 and 001 (session 24, review R39 items 4, 8
and 9), with real ``handoffd serve`` and ``handoff cancel`` processes and the seeds' own example
documents (ids and timestamps made fresh).

* Item 4: a cancelled fan-out parent dropped its completed children's outputs (only their
  artifacts were kept): seed 000 says a cancelled receiver responds "including any partial
  results". Each completed child's output is now a ``child_output`` artifact tagged with its
  ``metadata.child_id``, before its artifacts, within max_output_bytes (``output_omitted``).
* Item 9: ``handoff cancel`` and a cancellation message's result read a finished document's
  top-level ``status``, which a hi_moe Message has not: "-> failed (status None)" for a child
  filed cancelled, "already failed (status failed)" for one that timed out. They now read it
  through the format (``payload.status``).
* Item 8: a seed 001 foreign claim (Example 2's rename, then ``status: in_progress`` and
  ``started_at`` written in place) was held the claim grace (10 s) even when its
  ``timeout_seconds`` ended earlier; it now goes back at ``started_at + timeout_seconds``. A
  file renamed into in-progress/ already marked is still held for the grace (a daemon's own
  unlocked claim looks the same while it writes its lease).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace, wait_until
from dialect_examples import HI_MOE_ARCHITECT_TO_DISPATCHER, HI_MOE_CANCELLATION, fresh
from test_cancel_artifacts_s18 import CONFIG as S18_CONFIG
from test_cancel_artifacts_s18 import SPEC  # (the test specialist: __respond, __big, __block)

REPO = Path(__file__).resolve().parent.parent
# seed 001's example request (its Example 1)
SEED_001_REQUEST: dict[str, Any] = json.loads(
    (REPO / "benchmarks" / "seed001-request.json").read_text())

# test_cancel_artifacts_s18's workspace, with a sweep every half second, the claim grace a
# test asks for, and the seed 001 example's own agent
CONFIG = (S18_CONFIG.replace("sweep_seconds = 1.0", "sweep_seconds = 0.5\nclaim_grace_seconds = {grace}")
          + '''
[specialists."@react-specialist"]
command = ["{python}", "-S", "{spec}"]
timeout_seconds = 90
''')

CODE = {"artifact_type": "code", "inline_content": "def binary_search(nums, target): ..."}


def make_workspace(tmp_path: Path, grace: float) -> Workspace:
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    return new_workspace(tmp_path / "ws", CONFIG.format(python=sys.executable, spec=spec,
                                                        grace=grace))


@pytest.fixture
def cws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose agents run :data:`SPEC` (the default claim grace)."""
    workspace = make_workspace(tmp_path, 10.0)
    yield workspace
    (workspace.root / "release").touch()  # (a child still blocked ends)
    workspace.cleanup()


def now_iso(delta: float = 0.0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def seed_request(hid: str, data: Any) -> dict[str, Any]:
    """Seed 001's example request as ``hid`` with ``data`` (its schemas, which this workspace
    has not, left out)."""
    request = fresh(SEED_001_REQUEST)
    request["handoff_id"], request["timestamp"] = hid, now_iso()
    request["input"] = {"data": data}
    request.pop("expected_output", None)
    return request


def answers(output: Any, *artifacts: dict[str, Any]) -> dict[str, Any]:
    """A delegation entry's data: the child completes with ``output`` (and ``artifacts``)."""
    result: dict[str, Any] = {"status": "completed", "output": output}
    if artifacts:
        result["artifacts"] = list(artifacts)
    return {"__respond": result}


def fan(to: str, *entries: dict[str, Any]) -> dict[str, Any]:
    """A delegation to ``to``: one child per data in ``entries``, then one that blocks."""
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": to, "data": data} for data in entries]
            + [{"to": to, "data": {"__block": True}}]}


def architect_message(hid: str, respond: dict[str, Any]) -> dict[str, Any]:
    """Seed 000's "Architect -> Dispatcher" example as ``hid``: its dispatcher answers
    ``respond`` (in its task_data)."""
    doc = fresh(HI_MOE_ARCHITECT_TO_DISPATCHER)
    doc["id"], doc["timestamp"] = hid, now_iso()
    doc["payload"]["task_data"]["__respond"] = respond
    return doc


def parked(ws: Workspace, parent: str, last: int) -> None:
    """Wait until ``parent`` waits for its children: children 1..``last - 1`` finished, child
    ``last`` running."""
    for index in range(1, last):
        ws.wait_state(f"{parent}.c{index}", timeout=30)
    wait_until(lambda: (ws.root / f"started-{parent}.c{last}").exists(), 30,
               f"{parent}.c{last} started")
    wait_until(lambda: ws.state_of(parent) == ["pending"], 30, f"{parent} parked")


def from_children(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in items if "child_id" in (item.get("metadata") or {})]


def validate(ws: Workspace, state: str, hid: str) -> None:
    check = ws.handoff("validate", str(ws.root / "handoffs" / state / f"{hid}.json"))
    assert check.returncode == 0, check.stdout + check.stderr


# ---------------------------------------------------------------- item 4 (and 9)
def test_a_cancellation_message_keeps_the_completed_childrens_outputs(cws: Workspace) -> None:
    serve = cws.serve()
    cws.drop("msg-702.json", architect_message("msg-702", fan(
        "python-lora", answers({"answer": "c1 says 42"}), answers("c2: plain text"))))
    parked(cws, "msg-702", 3)
    cancel = fresh(HI_MOE_CANCELLATION)
    cancel["id"], cancel["timestamp"] = "msg-cancel-702", now_iso()
    cancel["payload"]["target_message_id"] = "msg-702"
    cws.drop("msg-cancel-702.json", cancel)
    assert cws.wait_state("msg-702", ("failed",), timeout=30) == "failed"
    parent = cws.doc("msg-702")
    assert parent["payload"]["status"] == "cancelled"
    kept = from_children(parent["payload"]["artifacts"])  # (before: [])
    assert [(k["artifact_type"], k["metadata"]["child_id"]) for k in kept] == [
        ("child_output", "msg-702.c1"), ("child_output", "msg-702.c2")]
    assert json.loads(kept[0]["inline_content"]) == {"answer": "c1 says 42"}
    assert kept[0]["metadata"]["media_type"] == "application/json"
    assert kept[1]["inline_content"] == "c2: plain text"
    # not an "output" artifact: a hi_moe answer's output artifact is its own answer
    assert not any(i["artifact_type"] == "output" for i in parent["payload"]["artifacts"])
    validate(cws, "failed", "msg-702")
    assert cws.wait_state("msg-cancel-702", timeout=30) == "completed"
    assert cws.doc("msg-702.c3")["payload"]["status"] == "cancelled"
    assert cws.stop(serve) == 0


def test_handoff_cancel_keeps_outputs_and_artifacts_and_says_the_hi_moe_status(
        cws: Workspace) -> None:
    serve = cws.serve()
    cws.drop("msg-703.json", architect_message("msg-703", fan(
        "python-lora", answers({"lines": 15}, CODE), answers({"passed": 5}))))
    parked(cws, "msg-703", 3)
    proc = cws.handoff("cancel", "--cascade", "msg-703", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("msg-703.c3:")]
    # the running child, waited for: its hi_moe answer's status (before: "status None")
    assert "-> failed (status cancelled)" in line, line
    parent = cws.doc("msg-703")
    kept = from_children(parent["payload"]["artifacts"])
    assert [(k["artifact_type"], k["metadata"]["child_id"]) for k in kept] == [
        ("child_output", "msg-703.c1"), ("child_output", "msg-703.c2"), ("code", "msg-703.c1")]
    assert [json.loads(k["inline_content"]) for k in kept[:2]] == [{"lines": 15}, {"passed": 5}]
    assert kept[2]["inline_content"] == CODE["inline_content"]
    validate(cws, "failed", "msg-703")
    assert cws.stop(serve) == 0


def test_what_a_cancelled_parent_keeps_of_outputs_is_bounded(cws: Workspace) -> None:
    """A native parent (seed 001's example request): an output over what is left of
    max_output_bytes (4096) is named by an ``output_omitted`` record, and the outputs have
    the budget before the artifacts (as an aggregated answer copies them)."""
    serve = cws.serve()
    request = seed_request("hoff-706", {"__respond": fan(
        "@spec", {"__big": 3000}, {"__big": 3000}, answers({"small": True}, CODE))})
    request["target"]["agent_id"] = "@spec"
    cws.drop("hoff-706.json", request)
    parked(cws, "hoff-706", 4)
    proc = cws.handoff("cancel", "--cascade", "hoff-706", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert cws.wait_state("hoff-706", ("failed",), timeout=30) == "failed"
    parent = cws.doc("hoff-706")
    assert parent["status"] == "cancelled"
    kept = from_children(parent["artifacts"])
    assert [(k["artifact_type"], k["metadata"]["child_id"]) for k in kept] == [
        ("child_output", "hoff-706.c1"), ("output_omitted", "hoff-706.c2"),
        ("child_output", "hoff-706.c3"), ("code", "hoff-706.c3")]
    assert kept[0]["inline_content"] == "x" * 3000
    assert kept[1]["metadata"]["size_bytes"] > 3000
    assert "`handoff show hoff-706.c2`" in kept[1]["inline_content"]
    assert json.loads(kept[2]["inline_content"]) == {"small": True}
    assert len(json.dumps(kept)) < 4096 + 1024
    assert cws.stop(serve) == 0


# ---------------------------------------------------------------- item 9
def cancel_results(ws: Workspace, hid: str) -> list[dict[str, Any]]:
    """The per-handoff results a filed cancellation message's answer holds (its ``output``
    artifact: inline, or the file its content_ref names)."""
    (item,) = [i for i in ws.doc(hid)["payload"]["artifacts"] if i["artifact_type"] == "output"]
    text = item["inline_content"]
    if text is None:
        text = (ws.root / item["content_ref"]).read_text()
    results: list[dict[str, Any]] = json.loads(text)["results"]
    return results


def test_a_cancellation_result_says_a_timed_out_hi_moe_childs_status(cws: Workspace) -> None:
    serve = cws.serve()
    respond = fan("python-lora", answers({"answer": 1}))
    respond["delegate"].insert(1, {"to": "python-lora", "data": {"__block": True},
                                   "timeout_seconds": 1})
    cws.drop("msg-705.json", architect_message("msg-705", respond))
    assert cws.wait_state("msg-705.c2", ("failed",), timeout=30) == "failed"
    assert cws.doc("msg-705.c2")["payload"]["status"] == "timeout"
    parked(cws, "msg-705", 3)
    cancel = fresh(HI_MOE_CANCELLATION)
    cancel["id"], cancel["timestamp"] = "msg-cancel-705", now_iso()
    cancel["payload"]["target_message_id"] = "msg-705"
    cws.drop("msg-cancel-705.json", cancel)
    assert cws.wait_state("msg-cancel-705", timeout=30) == "completed"
    details = {r["id"]: r["detail"] for r in cancel_results(cws, "msg-cancel-705")}
    # before: "already failed (status failed)"
    assert details["msg-705.c2"] == "already failed (status timeout); nothing to cancel"
    assert details["msg-705.c1"] == "already completed (status success); nothing to cancel"
    proc = cws.handoff("cancel", "msg-705.c2")
    assert proc.stdout.strip() == ("msg-705.c2: already failed (status timeout); nothing to "
                                   "cancel"), proc.stdout + proc.stderr
    assert cws.stop(serve) == 0


# ---------------------------------------------------------------- item 8
def foreign_claim(ws: Workspace, hid: str, timeout_seconds: int) -> None:
    """Seed 001's Example 1 (a request in pending/), then its Example 2 by a consumer that dies
    right after its claim: ``shutil.move`` into in-progress/, then the document rewritten in
    place with ``status: in_progress`` and ``started_at``."""
    request = seed_request(hid, {"component_requirements": []})
    request["timeout_seconds"] = timeout_seconds
    ws.drop(f"{hid}.json", request)
    handoffs = ws.root / "handoffs"
    path = handoffs / "in-progress" / f"{hid}.json"
    shutil.move(str(handoffs / "pending" / f"{hid}.json"), str(path))
    handoff = json.loads(path.read_text())
    handoff["status"] = "in_progress"
    handoff["started_at"] = datetime.now(timezone.utc).isoformat()[:-6] + "Z"
    with open(path, "w") as f:
        json.dump(handoff, f, indent=2)


def test_a_dead_foreign_consumers_claim_ends_at_its_timeout_not_the_claim_grace(
        tmp_path: Path) -> None:
    # a claim grace far longer than the claim's timeout_seconds (3): before, the claim was held
    # until the grace ran out (30 s here; 10 s by default)
    ws = make_workspace(tmp_path, 30.0)
    try:
        foreign_claim(ws, "hoff-fc3", 3)
        # a request that came into in-progress/ already marked, its claim long over (a claim
        # handed back to pending/ as it was, then renamed in by an unlocked claimer): the grace
        # still holds it
        request = seed_request("hoff-fc4", {"component_requirements": []})
        request.update(timeout_seconds=3, status="in_progress", started_at=now_iso(-3600))
        written = ws.drop("hoff-fc4.json", request)
        long_ago = datetime.now(timezone.utc).timestamp() - 3600
        os.utime(written, (long_ago, long_ago))  # (written then, not now)
        written.rename(ws.root / "handoffs" / "in-progress" / "hoff-fc4.json")
        # the same written whole and renamed in at once (review R40): its modification and
        # change times agree at the jiffy, but its mark is an hour older than its rename
        request = seed_request("hoff-fc5", {"component_requirements": []})
        request.update(timeout_seconds=3, status="in_progress", started_at=now_iso(-3600))
        ws.drop("hoff-fc5.json", request).rename(
            ws.root / "handoffs" / "in-progress" / "hoff-fc5.json")
        serve = ws.serve()
        assert ws.wait_state("hoff-fc3", ("completed",), timeout=20) == "completed"
        assert ws.doc("hoff-fc3")["status"] == "completed"
        assert ws.state_of("hoff-fc4") == ["in-progress"]
        assert ws.state_of("hoff-fc5") == ["in-progress"]
        assert ws.stop(serve) == 0
    finally:
        ws.cleanup()


def test_a_large_hi_moe_child_output_is_kept_as_a_child_output_too(cws: Workspace) -> None:
    """Review R40: a hi_moe child's output of 1 KB or more is stored by reference, read among
    its artifacts, not as its output: it was kept as an ``output`` artifact, which in the
    parent reads as the parent's own answer."""
    serve = cws.serve()
    cws.drop("msg-r40.json", architect_message("msg-r40", fan("python-lora", {"__big": 3000})))
    parked(cws, "msg-r40", 2)
    cancel = fresh(HI_MOE_CANCELLATION)
    cancel["id"], cancel["timestamp"] = "msg-cancel-r40", now_iso()
    cancel["payload"]["target_message_id"] = "msg-r40"
    cws.drop("msg-cancel-r40.json", cancel)
    assert cws.wait_state("msg-r40", ("failed",), timeout=30) == "failed"
    items = cws.doc("msg-r40")["payload"]["artifacts"]
    assert not any(i.get("artifact_type") == "output" for i in items), items
    kept = from_children(items)
    assert [(k["artifact_type"], k["metadata"]["child_id"]) for k in kept] == [
        ("child_output", "msg-r40.c1")], items
    assert kept[0].get("content_ref"), kept
    validate(cws, "failed", "msg-r40")
    (cws.root / "release").touch()
    assert cws.stop(serve) == 0
