"""A cancelled fan-out parent keeps what its completed children produced, whatever the
children's format (session 18, R13 defect 3). Before, ``children_artifacts`` read a child's
top-level ``artifacts``: a native child's were kept, a hi_moe child's (in ``payload.artifacts``,
beside its ``output`` artifact) were lost, and the cancelled hi_moe parent was filed with
``payload.artifacts: []``. Now each child is read through its format as aggregation reads it,
at most ``max_output_bytes`` of the artifacts are kept (the rest named by an
``artifacts_omitted`` record), and a child's answer its format cannot read keeps nothing of that
child without stopping the cancel.

Real ``handoffd serve`` and ``handoff cancel`` processes: each parent delegates a child that
blocks (until the test ends, or the cancel stops it) and children that complete with artifacts;
the parent is cancelled with ``--cascade`` while parked for its children."""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace, wait_until

# the test specialist: "__respond" anywhere in the request (outside a delegation) is printed as
# the result; "__make": n adds n code artifacts of 900 bytes (under the 1 KB rule: inline);
# "__block" waits (at most 60 s) for the workspace's file "release", its start noted first
SPEC = '''
import json, os, sys, time
doc = json.load(sys.stdin)
root = os.environ["HANDOFFD_ROOT"]
def find(value, key):
    if isinstance(value, dict):
        if key in value:
            return value[key]
        for name, item in value.items():
            found = None if name == "delegate" else find(item, key)
            if found is not None:
                return found
    if isinstance(value, list):
        for item in value:
            found = find(item, key)
            if found is not None:
                return found
    return None
if find(doc, "__block"):
    open(os.path.join(root, "started-" + os.environ["HANDOFF_ID"]), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(root, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
result = find(doc, "__respond") or {"status": "completed", "output": {"summary": "done"}}
made = find(doc, "__make")
if made:
    result = {"status": "completed", "output": {"summary": "made"},
              "artifacts": [{"artifact_type": "code", "inline_content": str(i) * 900}
                            for i in range(made)]}
big = find(doc, "__big")
if big:
    result = {"status": "completed", "output": "x" * big}
print(json.dumps(result))
'''

# a small max_output_bytes: two children's 2.7 KB of artifacts do not both fit
CONFIG = """
[daemon]
settle_seconds = 0.1
rescan_seconds = 0.5
sweep_seconds = 1.0
max_output_bytes = 4096
durability = "fast"

[retry]
max_retries = 0

[specialists."@spec"]
command = ["{python}", "-S", "{spec}"]
timeout_seconds = 90

[specialists."ROUTING_DISPATCHER"]
command = ["{python}", "-S", "{spec}"]
timeout_seconds = 90

[specialists."python-lora"]
command = ["{python}", "-S", "{spec}"]
timeout_seconds = 90
"""

CODE = {"artifact_type": "code", "inline_content": "def f(): pass"}


@pytest.fixture
def cws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose @spec, ROUTING_DISPATCHER and python-lora run :data:`SPEC`."""
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    workspace = new_workspace(tmp_path / "ws", CONFIG.format(python=sys.executable, spec=spec))
    yield workspace
    (workspace.root / "release").touch()  # (a child still blocked ends)
    workspace.cleanup()


def fan(to: str, *done: dict[str, Any]) -> dict[str, Any]:
    """A delegation: child 1 blocks, each of the next ones answers with what ``done`` holds."""
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": to, "data": {"__block": True}}]
            + [{"to": to, "data": data} for data in done]}


def hi_moe_parent(hid: str, respond: dict[str, Any]) -> dict[str, Any]:
    """A seed 000 Message to ROUTING_DISPATCHER whose specialist answers ``respond``."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"version": "1.0.0", "id": hid, "timestamp": now, "source_tier": "ABSTRACT_ARCHITECT",
            "target_tier": "ROUTING_DISPATCHER", "correlation_id": None,
            "payload": {"task_type": "decompose_and_solve", "objective": "o", "constraints": [],
                        "context_refs": [], "priority": 1, "timeout_ms": 60000,
                        "deadline_hint": None, "specialist_hint": None,
                        "task_data": {"__respond": respond}}}


def parked(ws: Workspace, parent: str, done: int) -> None:
    """Wait until ``parent`` waits for its children: child 1 running, children 2..``done``
    completed."""
    for index in range(2, done + 1):
        ws.wait_state(f"{parent}.c{index}", ("completed",), timeout=30)
    wait_until(lambda: (ws.root / f"started-{parent}.c1").exists(), 30, f"{parent}.c1 started")
    wait_until(lambda: ws.state_of(parent) == ["pending"], 30, f"{parent} parked")


def cancel(ws: Workspace, parent: str) -> dict[str, Any]:
    """``handoff cancel PARENT --cascade`` (exit 0, no traceback); the filed parent."""
    proc = ws.handoff("cancel", parent, "--cascade", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ws.wait_state(parent, ("failed",), timeout=30) == "failed"
    return ws.doc(parent)


def from_children(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The children's artifacts a cancelled parent kept (their outputs, ``child_output``
    records since session 24, are tested in test_cancel_fidelity_s24.py)."""
    return [item for item in items if "child_id" in (item.get("metadata") or {})
            and item.get("artifact_type") != "child_output"]


def test_native_and_hi_moe_parents_keep_their_completed_childrens_artifacts(
        cws: Workspace) -> None:
    serve = cws.serve()
    cws.create("--from", "@a", "--to", "@spec", "--id", "nat-par",
               "--data", json.dumps({"__respond": fan("@spec", {"__respond": {
                   "status": "completed", "output": {"summary": "c2"}, "artifacts": [CODE]}})}))
    cws.drop("hm-par.json", hi_moe_parent("hm-par", fan("python-lora", {"__respond": {
        "status": "completed", "output": {"summary": "c2"}, "artifacts": [CODE]}})))
    for parent in ("nat-par", "hm-par"):
        parked(cws, parent, 2)
    native, hi_moe = cancel(cws, "nat-par"), cancel(cws, "hm-par")
    assert native["status"] == "cancelled" and native["error"]["code"] == "CANCELLED"
    (kept,) = from_children(native["artifacts"])
    assert kept["inline_content"] == "def f(): pass" and kept["metadata"]["child_id"] == "nat-par.c2"
    # the hi_moe parent files them in its own payload.artifacts (before: [])
    assert hi_moe["payload"]["status"] == "cancelled"
    (kept,) = from_children(hi_moe["payload"]["artifacts"])
    assert kept["artifact_type"] == "code" and kept["inline_content"] == "def f(): pass"
    assert kept["metadata"]["child_id"] == "hm-par.c2"
    # its child's output artifact is its output, not one of its artifacts
    assert not any(item["artifact_type"] == "output" for item in hi_moe["payload"]["artifacts"])
    check = cws.handoff("validate", str(cws.root / "handoffs" / "failed" / "hm-par.json"))
    assert check.returncode == 0, check.stdout + check.stderr
    assert cws.doc("hm-par.c1")["payload"]["status"] == "cancelled"
    assert cws.stop(serve) == 0


def test_what_is_kept_is_bounded_and_an_unreadable_child_stops_no_cancel(cws: Workspace) -> None:
    serve = cws.serve()
    cws.create("--from", "@a", "--to", "@spec", "--id", "big-par",
               "--data", json.dumps({"__respond": fan("@spec", {"__make": 3}, {"__make": 3})}))
    cws.drop("hx-par.json", hi_moe_parent("hx-par", fan("python-lora", {"__respond": {
        "status": "completed", "output": {"summary": "c2"}, "artifacts": [CODE]}})))
    parked(cws, "big-par", 3)
    parked(cws, "hx-par", 2)
    # a completed child's answer replaced by one its format cannot read (payload.artifacts 5)
    path = cws.root / "handoffs" / "completed" / "hx-par.c2.json"
    hostile = json.loads(path.read_text())
    hostile["payload"]["artifacts"] = 5
    part = path.with_name(".hx-par.c2.part")
    part.write_text(json.dumps(hostile))
    os.replace(part, path)

    big = cancel(cws, "big-par")
    kept = from_children(big["artifacts"])
    # c2's three artifacts fit in max_output_bytes (4096); c3's do not, and are named
    assert [item["metadata"]["child_id"] for item in kept] == ["big-par.c2"] * 3 + ["big-par.c3"]
    assert [item["artifact_type"] for item in kept] == ["code"] * 3 + ["artifacts_omitted"]
    omitted = kept[3]
    assert omitted["metadata"]["count"] == 3 and omitted["metadata"]["size_bytes"] > 2700
    assert "`handoff show big-par.c3`" in omitted["inline_content"]
    assert len(json.dumps(kept)) < 4096 + 1024

    unreadable = cancel(cws, "hx-par")
    assert unreadable["payload"]["status"] == "cancelled"
    assert from_children(unreadable["payload"]["artifacts"]) == []
    assert cws.stop(serve) == 0
