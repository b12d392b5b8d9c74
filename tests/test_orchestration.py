"""Orchestration against real `handoffd run` / `handoffd serve` processes: fan-out and aggregation,
cancellation, dependencies, clarification, shared context, artifacts, tracing."""
from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import SPECIALISTS, Workspace

from handoffd.core.workspace import Workspace as HandoffdWorkspace

HANDLERS = '''
"""Python specialists for the orchestration tests."""
import json
import time


def dispatch(doc, ctx):
    data = ctx.data or {}
    return {"status": "delegated", "aggregation": data.get("aggregation", "all_success"),
            "summary": "fan-out",
            "delegate": [dict(child) for child in data["children"]]}


def scorer(doc, ctx):
    data = ctx.data or {}
    if data.get("sleep"):
        ctx.report_partial({"progress": "started"})
        if ctx.cancelled.wait(data["sleep"]):
            return {"status": "failed", "error": {"code": "CANCELLED", "message": "stopped"}}
    meta = {"confidence": data["confidence"]} if "confidence" in data else {}
    if data.get("ok", True):
        return {"status": "completed", "output": {"value": data.get("value")}, "metadata": meta}
    return {"status": "failed", "metadata": meta,
            "error": {"code": "PROCESSING_ERROR", "message": "scorer told to fail", "retryable": False}}


def asker(doc, ctx):
    answers = (doc.get("input") or {}).get("clarifications") or []
    if not answers:
        return {"status": "needs_clarification", "summary": "ambiguous edge case",
                "questions": ["Should an empty array return -1 or raise?"]}
    return {"status": "completed", "output": {"decision": answers[-1]["answer"],
                                               "rounds": len(answers)}}


def blocker(doc, ctx):
    answers = (doc.get("input") or {}).get("clarifications") or []
    mode = (ctx.data or {}).get("mode", "good")
    if answers:
        return {"status": "completed", "output": {"chosen": answers[-1]["answer"]}}
    blockers = [{"blocker_id": "blk-gpu-001", "type": "resource_unavailable",
                 "description": "No 4x A100 nodes available",
                 "resolution_options": ["Wait 6 hours", "Use 2x A100"]}]
    if mode == "no-options":
        blockers[0].pop("resolution_options")
    return {"status": "blocked", "blockers": blockers}


def barrier(doc, ctx):
    """Completes only when every child of its parent has started: run one at a time, the first
    would wait alone and fail."""
    import pathlib
    folder = pathlib.Path("artifacts") / "barrier" / doc["parent_id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ctx.handoff_id).touch()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not ctx.cancelled.is_set():
        seen = len(list(folder.iterdir()))
        if seen >= ctx.data["of"]:
            return {"status": "completed", "output": {"saw": seen}}
        time.sleep(0.02)
    return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "retryable": False,
                                          "message": "the other children never started"}}


def writer(doc, ctx):
    data = ctx.data or {}
    ctx.context.set(f"execution/outputs/{ctx.handoff_id}", {"ok": True})
    seen = ctx.context.get("task/current-objective")
    if data.get("trespass"):
        ctx.context.set("task/current-objective", "hijacked")
    return {"status": "completed", "output": {"objective_seen": seen}}


def artist(doc, ctx):
    data = ctx.data or {}
    out = {"status": "completed",
           "output": {"content": {"components": ["UserProfile"], "code": "x" * data.get("output_bytes", 10)}},
           "artifacts": [{"name": "small.txt", "artifact_type": "test_result", "content": "5/5 tests passed"},
                         {"name": "big.tsx", "artifact_type": "code", "content": "y" * 3000}]}
    out["metadata"] = {"artifact_path_seen": str(ctx.artifact_path) if ctx.artifact_path else None}
    return out
'''

WRITE_DEST = '''
import json, os, sys
doc = json.load(sys.stdin)
path = os.environ["HANDOFF_ARTIFACT_PATH"]
with open(path, "w") as fh:
    json.dump({"written_by": "command handler"}, fh)
print(json.dumps({"status": "completed", "output": {"note": "wrote it"}}))
'''

PARTIAL_ON_TERM = '''
import json, os, signal, sys, time
def stop(signum, frame):
    print(json.dumps({"status": "partial", "output": {"done_steps": 3, "of": 10}}), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
sys.stdin.read()
# tell the test the handler is in place: a SIGTERM before it would just kill the process
open(os.path.join(os.environ["HANDOFFD_ROOT"], "artifacts", "partial-ready"), "w").close()
time.sleep(60)
print(json.dumps({"status": "completed", "output": {"done_steps": 10}}))
'''


def config(tmp: Path, extra: str = "") -> str:
    py = sys.executable
    return f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 1.0
lease_seconds = 30.0
grace_seconds = 5.0
workers = 6
durability = "fast"

[retry]
max_retries = 0
retry_delay_seconds = 0.2

[specialists."@flaky"]
command = ["{py}", "-S", "{SPECIALISTS / 'flaky.py'}"]
timeout_seconds = 60
concurrency = 6

[specialists."@dispatcher"]
handler = "orch_handlers:dispatch"
timeout_seconds = 120

[specialists."@scorer"]
handler = "orch_handlers:scorer"
concurrency = 6
timeout_seconds = 60

[specialists."@asker"]
handler = "orch_handlers:asker"

[specialists."@barrier"]
handler = "orch_handlers:barrier"

[specialists."@blocker"]
handler = "orch_handlers:blocker"

[specialists."@writer"]
handler = "orch_handlers:writer"

[specialists."@artist"]
handler = "orch_handlers:artist"

[specialists."@dest-writer"]
command = ["{py}", "{tmp / 'write_dest.py'}"]

[specialists."@partial"]
command = ["{py}", "{tmp / 'partial_on_term.py'}"]
timeout_seconds = 60

[tiers]
"@writer" = "SPECIALIZED_FLEET"

[namespaces."task"]
writers = ["@architect", "ABSTRACT_ARCHITECT"]
{extra}
"""


@pytest.fixture
def ows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "orch_handlers.py").write_text(HANDLERS)
    (tmp_path / "write_dest.py").write_text(WRITE_DEST)
    (tmp_path / "partial_on_term.py").write_text(PARTIAL_ON_TERM)
    monkeypatch.setenv("PYTHONPATH", str(handlers))
    monkeypatch.delenv("HANDOFF_TARGET", raising=False)
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(config(tmp_path))
    HandoffdWorkspace(root).ensure()  # the folders, made in-process
    yield ws
    ws.cleanup()


def run(ws: Workspace) -> str:
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.stderr


def fan_out(ws: Workspace, hid: str, strategy: str, children: list[dict[str, Any]]) -> None:
    ws.create("--to", "@dispatcher", "--id", hid, "--data",
              json.dumps({"aggregation": strategy, "children": children}))


def score(ok: bool, confidence: float | None = None, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"ok": ok, "value": extra.pop("value", None)}
    if confidence is not None:
        data["confidence"] = confidence
    return {"to": "@scorer", "data": data, "objective": "score it", **extra}


# ---------------------------------------------------------------- delegation and aggregation
def test_fan_out_all_success_creates_linked_children_and_aggregates(ows: Workspace) -> None:
    fan_out(ows, "p1", "all_success", [score(True, 0.9, value=1), score(True, 0.7, value=2)])
    run(ows)
    assert ows.state_of("p1") == ["completed"]
    parent = ows.doc("p1")
    assert parent["status"] == "completed"
    agg = parent["aggregated_outcome"]
    assert agg["strategy_used"] == "all_success" and agg["aggregated_status"] == "success"
    assert agg["aggregated_confidence"] == pytest.approx(0.8)
    assert agg["child_outcomes"] == [
        {"message_id": "p1.c1", "status": "success", "confidence": 0.9, "specialist": "@scorer"},
        {"message_id": "p1.c2", "status": "success", "confidence": 0.7, "specialist": "@scorer"}]
    assert parent["output"]["results"] == {"p1.c1": {"value": 1}, "p1.c2": {"value": 2}}
    assert parent["conversation_id"] == "conv-p1" and parent["children"] == ["p1.c1", "p1.c2"]
    events = [e["event"] for e in parent["handoffd"]["history"]]
    assert events[:3] == ["created", "claimed", "delegated"] and events[-2:] == ["aggregated", "completed"]
    for index, cid in enumerate(("p1.c1", "p1.c2"), start=1):
        child = ows.doc(cid)
        assert child["status"] == "completed"
        assert child["parent_id"] == "p1" and child["correlation_id"] == "p1"
        assert child["conversation_id"] == "conv-p1"
        assert child["source"]["agent_id"] == "@dispatcher" and child["target"]["agent_id"] == "@scorer"
        assert child["context"]["objective"] == "score it"
        assert child["chain_position"] == {"step": 2, "index": index, "of": 2}
        assert 0 < child["timeout_seconds"] <= 60  # the scorer's limit, within the parent's 120 s


@pytest.mark.parametrize("strategy, oks, state, status, aggregated", [
    ("all_success", [True, False, True], "completed", "partial", "partial"),
    ("all_success", [False, False], "failed", "failed", "failed"),
    ("any_success", [False, True, False], "completed", "completed", "success"),
    ("any_success", [False, False], "failed", "failed", "failed"),
    ("majority", [True, True, False], "completed", "completed", "success"),
    ("majority", [True, False, False], "failed", "failed", "failed"),
    ("majority", [True, False], "failed", "failed", "failed"),
])
def test_aggregation_strategies_with_mixed_outcomes(ows: Workspace, strategy: str, oks: list[bool],
                                                    state: str, status: str, aggregated: str) -> None:
    fan_out(ows, "px", strategy, [score(ok) for ok in oks])
    run(ows)
    assert ows.state_of("px") == [state]
    parent = ows.doc("px")
    assert parent["status"] == status
    agg = parent["aggregated_outcome"]
    assert agg["aggregated_status"] == aggregated and agg["strategy_used"] == strategy
    assert [c["status"] for c in agg["child_outcomes"]] == ["success" if ok else "failed" for ok in oks]
    expected = sum(1.0 if ok else 0.0 for ok in oks) / len(oks)
    assert agg["aggregated_confidence"] == pytest.approx(expected, abs=1e-3)
    if state == "failed":
        assert parent["error"]["code"] == "CHILDREN_FAILED"
        assert "scorer told to fail" in parent["error"]["message"]
    elif status == "partial":
        assert parent["warnings"] and "failed" in parent["warnings"][0]


def test_children_of_a_fan_out_run_side_by_side_by_default(ows: Workspace) -> None:
    """Seed 000 fans out in parallel: with no `concurrency` set, a specialist runs as many
    handoffs at once as the daemon has workers (each child waits until all three started)."""
    fan_out(ows, "pp", "all_success", [{"to": "@barrier", "data": {"of": 3}}] * 3)
    run(ows)
    assert ows.state_of("pp") == ["completed"], ows.doc("pp").get("error")
    assert [ows.doc(f"pp.c{i}")["output"] for i in (1, 2, 3)] == [{"saw": 3}] * 3


def test_one_batch_drains_fan_outs_through_a_single_slot(ows: Workspace) -> None:
    """Issue 11, item 6: `handoffd run` must not exit with due children never started. Four
    fan-outs whose children share a specialist of concurrency 1 (one child waiting on a
    sibling) all finish in one batch."""
    ows.write_config(ows.root.joinpath("handoffd.toml").read_text()
                     + '\n[specialists."@one"]\nhandler = "orch_handlers:scorer"\nconcurrency = 1\n')
    for n in range(4):
        fan_out(ows, f"pd{n}", "all_success", [{"to": "@one", "data": {"ok": True}}] * 3
                + [{"to": "@one", "data": {"ok": True}, "depends_on": [1]}])
    proc = ows.handoffd("run")
    assert proc.returncode == 0, proc.stderr
    assert all(ows.state_of(f"pd{n}") == ["completed"] for n in range(4)), proc.stderr


def test_serve_prints_the_effective_limits(ows: Workspace) -> None:
    daemon = ows.serve()
    line = daemon.ready_line  # type: ignore[attr-defined]
    assert ows.stop(daemon) == 0
    assert "6 workers" in line and "@barrier 6" in line and "@flaky 6" in line, line


def test_majority_failed_is_partial_and_flagged_for_strategy_revision(ows: Workspace) -> None:
    """Seed 000's partial success rules for all_success: majority failed -> PARTIAL, flagged for
    strategy revision; majority succeeded -> PARTIAL without the flag."""
    fan_out(ows, "prev", "all_success", [score(True), score(False), score(False)])
    fan_out(ows, "pok", "all_success", [score(True), score(True), score(False)])
    run(ows)
    flagged, fine = ows.doc("prev"), ows.doc("pok")
    assert flagged["status"] == fine["status"] == "partial"
    assert flagged["output"]["strategy_revision"] is True
    assert flagged["metadata"]["surprise_flag"] is True
    assert "flag for strategy revision" in flagged["metadata"]["surprise_reason"]
    assert "strategy_revision" not in fine["output"]
    assert not fine["metadata"].get("surprise_flag")


def test_weighted_confidence(ows: Workspace) -> None:
    fan_out(ows, "pw", "any_success", [score(True, 0.9, weight=3), score(False, 0.5, weight=1)])
    run(ows)
    agg = ows.doc("pw")["aggregated_outcome"]
    assert agg["aggregated_confidence"] == pytest.approx((3 * 0.9 + 1 * 0.5) / 4)


def test_first_success_cancels_the_rest(ows: Workspace) -> None:
    slow = {"to": "@flaky", "data": {"mode": "sleep", "seconds": 40}}
    slow_py = {"to": "@scorer", "data": {"ok": True, "sleep": 40}}
    fan_out(ows, "pf", "first_success", [slow, score(True, 0.6, value="fast"), slow_py])
    started = time.monotonic()
    run(ows)
    took = time.monotonic() - started
    print(f"first_success batch took {took:.2f}s (losers sleep 40 s)")
    assert took < 25
    parent = ows.doc("pf")
    assert ows.state_of("pf") == ["completed"] and parent["status"] == "completed"
    assert parent["output"]["winner"] == "pf.c2" and parent["output"]["result"] == {"value": "fast"}
    statuses = {c["message_id"]: c["status"] for c in parent["aggregated_outcome"]["child_outcomes"]}
    assert statuses == {"pf.c1": "cancelled", "pf.c2": "success", "pf.c3": "cancelled"}
    for loser in ("pf.c1", "pf.c3"):
        assert ows.state_of(loser) == ["failed"]
        doc = ows.doc(loser)
        assert doc["status"] == "cancelled" and doc["error"]["code"] == "CANCELLED"
    assert parent["aggregated_outcome"]["aggregated_confidence"] == pytest.approx(0.6)


def test_malformed_delegation_fails_clearly(ows: Workspace) -> None:
    fan_out(ows, "pbad", "all_success", [{"to": "@nobody", "data": {}}])
    fan_out(ows, "pcycle", "all_success", [score(True, depends_on=["c2"]), score(True, depends_on=[1])])
    fan_out(ows, "pstrat", "best_of_three", [score(True)])
    run(ows)
    for hid, needle in (("pbad", "delegate[0].to '@nobody' has no registered specialist"),
                        ("pcycle", "the children's depends_on form a cycle"),
                        ("pstrat", "'best_of_three' is not one of all_success")):
        doc = ows.doc(hid)
        assert ows.state_of(hid) == ["failed"] and doc["error"]["code"] == "VALIDATION_FAILED"
        assert needle in doc["error"]["message"], doc["error"]["message"]
    assert not ows.state_of("pcycle.c1")


def test_malformed_delegations_found_by_the_bug_hunt_fail_once(ows: Workspace) -> None:
    """Each was a retried PROCESSING_ERROR, a NaN traceback loop, or a silent wait: a child with
    a weight whose sum overflows (1e308: the aggregated confidence became NaN, which no JSON can
    hold, and the parent's filing failed at every recovery); a child depending on its own parent
    (a cycle: both waited until the deadline); a bad entry after a good one (the good child was
    created, then the parent retried, each round making and running another orphan)."""
    ows.create("--to", "@flaky", "--id", "taken", "--data", "{}")
    fan_out(ows, "pweight", "all_success", [score(True, weight=1e308), score(True, weight=1e308)])
    fan_out(ows, "ploop", "all_success", [score(True, depends_on=["ploop"])])
    fan_out(ows, "pprio", "all_success", [score(True), score(True, priority="zzz")])
    fan_out(ows, "ptaken", "all_success", [score(True), score(True, id="taken")])
    stderr = run(ows)
    assert "Traceback" not in stderr, stderr
    for hid, needle in (("pweight", "delegate[0].weight must be a number from 0 to 1e+06"),
                        ("ploop", "depends_on names 'ploop', which waits for this delegation"),
                        ("pprio", "priority"), ("ptaken", "the child id 'taken' is taken")):
        doc = ows.doc(hid)
        assert ows.state_of(hid) == ["failed"] and doc["error"]["code"] == "VALIDATION_FAILED", doc
        assert needle in doc["error"]["message"], doc["error"]["message"]
        events = [e["event"] for e in doc["handoffd"]["history"]]
        assert "retry_scheduled" not in events, events
        assert not ows.state_of(f"{hid}.c1"), hid  # no orphan made before the bad entry
    assert ows.state_of("taken") == ["completed"]


def test_children_may_depend_on_later_siblings(ows: Workspace) -> None:
    daemon = ows.serve()  # events make a race between sibling creation and dispatch likely
    fan_out(ows, "pdep", "all_success", [score(True, depends_on=["c2"], value="second"),
                                         {"to": "@flaky", "data": {"mode": "sleep", "seconds": 0.3}}])
    assert ows.wait_state("pdep", timeout=30) == "completed"
    first, second = ows.doc("pdep.c1"), ows.doc("pdep.c2")
    assert first["depends_on"] == ["pdep.c2"]
    assert second["completed_at"] <= first["started_at"]
    assert ows.doc("pdep")["aggregated_outcome"]["aggregated_status"] == "success"
    assert ows.stop(daemon) == 0


# ---------------------------------------------------------------- tracing and listing
def test_trace_ls_and_show_of_a_fan_out(ows: Workspace) -> None:
    fan_out(ows, "pt", "all_success", [score(True), score(False), score(True)])
    ows.create("--to", "@flaky", "--id", "after-pt", "--depends-on", "pt", "--data", '{"mode": "ok"}')
    run(ows)
    data = json.loads(ows.handoff("trace", "pt.c2", "--json", check=True).stdout)
    assert data["root"] == "pt" and data["conversation"] == "conv-pt"
    (tree,) = data["trees"]
    assert tree["id"] == "pt" and tree["state"] == "completed" and tree["status"] == "partial"
    kids = {c["id"]: c for c in tree["children"]}
    assert set(kids) == {"pt.c1", "pt.c2", "pt.c3", "after-pt"}
    assert kids["pt.c2"]["state"] == "failed" and kids["pt.c1"]["relation"] == "child"
    assert kids["after-pt"]["relation"] == "triggered" and kids["after-pt"]["state"] == "completed"
    assert all(c["seconds"] is not None for c in tree["children"])
    text = ows.handoff("trace", "pt").stdout
    for needle in ("pt.c1", "pt.c2", "pt.c3", "after-pt", "completed", "failed", "conv-pt"):
        assert needle in text
    rows = json.loads(ows.handoff("ls", "--conversation", "conv-pt", "--json").stdout)
    assert sorted(r["id"] for r in rows) == ["pt", "pt.c1", "pt.c2", "pt.c3"]
    assert {r["parent"] for r in rows if r["id"] != "pt"} == {"pt"}
    table = ows.handoff("ls").stdout
    assert "PARENT" in table.splitlines()[0]
    shown = ows.handoff("show", "pt").stdout
    assert "children" in shown and "pt.c3" in shown and "aggregated (all_success): partial" in shown
    family = json.loads(ows.handoff("show", "pt", "--json").stdout)["family"]
    assert [c["id"] for c in family["children"]] == ["pt.c1", "pt.c2", "pt.c3"]
    assert ows.handoff("trace", "nope").returncode == 3


# ---------------------------------------------------------------- cancellation
def test_cancel_pending_finished_and_unknown(ows: Workspace) -> None:
    hid = ows.create("--to", "@flaky", "--data", '{"mode": "ok"}', "--id", "c-pend")
    proc = ows.handoff("cancel", hid, "--reason", "plan changed")
    assert proc.returncode == 0, proc.stderr
    assert "c-pend: cancelled" in proc.stdout
    doc = ows.doc(hid)
    assert ows.state_of(hid) == ["failed"] and doc["status"] == "cancelled"
    assert doc["error"]["code"] == "CANCELLED" and "plan changed" in doc["error"]["message"]
    assert [e["event"] for e in doc["handoffd"]["history"]] == ["created", "cancelled"]
    again = ows.handoff("cancel", hid)
    assert again.returncode == 0 and "nothing to cancel" in again.stdout
    assert ows.handoff("cancel", "no-such-id").returncode == 3
    run(ows)
    assert not ows.runs()  # the cancelled handoff never ran


def wait_running(ws: Workspace, ids: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(ws.state_of(i) == ["in-progress"] for i in ids):
            return
        time.sleep(0.05)
    raise AssertionError({i: ws.state_of(i) for i in ids})


def test_a_cancelled_fan_out_keeps_what_its_children_produced(ows: Workspace) -> None:
    daemon = ows.serve()
    try:
        fan_out(ows, "pa", "all_success", [{"to": "@artist", "data": {}},
                                           {"to": "@flaky", "data": {"mode": "sleep", "seconds": 60}}])
        ows.wait_state("pa.c1", ("completed",), timeout=20)
        wait_running(ows, ["pa.c2"])
        assert ows.handoff("cancel", "pa", "--cascade", timeout=60).returncode == 0
        ows.wait_state("pa", ("failed",), timeout=20)
    finally:
        assert ows.stop(daemon) == 0
    parent = ows.doc("pa")
    assert parent["status"] == "cancelled"
    kept = [a for a in parent["artifacts"] if a["metadata"].get("child_id") == "pa.c1"]
    # its output first (session 24), then its artifacts
    assert kept[0]["artifact_type"] == "child_output", parent["artifacts"]
    assert {a["name"] for a in kept[1:]} == {"small.txt", "big.tsx"}, parent["artifacts"]


def test_cancel_cascade_stops_running_children_promptly(ows: Workspace) -> None:
    daemon = ows.serve()
    fan_out(ows, "pc", "all_success", [{"to": "@flaky", "data": {"mode": "sleep", "seconds": 60}},
                                       {"to": "@scorer", "data": {"ok": True, "sleep": 60}},
                                       {"to": "@partial", "data": {}}])
    kids = ["pc.c1", "pc.c2", "pc.c3"]
    wait_running(ows, kids)
    ready = ows.root / "artifacts" / "partial-ready"
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:  # @partial's SIGTERM handler is set
        time.sleep(0.02)
    time.sleep(0.3)  # let the other handlers get going
    started = time.monotonic()
    proc = ows.handoff("cancel", "pc", "--cascade", "--reason", "strategy revision", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for kid in kids:
        ows.wait_state(kid, ("failed",), timeout=20)
    took = time.monotonic() - started
    print(f"cascade cancel: 3 running children filed cancelled {took:.2f}s after `handoff cancel` "
          "(their timeout is 60 s)")
    assert took < 40  # stopped, not waited out: their timeout is 60 s (a loaded machine is slow)
    assert "pc: cancelled" in proc.stdout and "pc.c1: cancel requested" in proc.stdout
    parent = ows.doc("pc")
    assert parent["status"] == "cancelled" and parent["error"]["code"] == "CANCELLED"
    for kid in kids:
        doc = ows.doc(kid)
        assert doc["status"] == "cancelled" and doc["error"]["code"] == "CANCELLED", json.dumps(doc)
        assert "strategy revision" in doc["error"]["message"]
    assert ows.doc("pc.c2")["output"] == {"progress": "started"}  # ctx.report_partial
    assert ows.doc("pc.c3")["output"] == {"done_steps": 3, "of": 10}  # printed on SIGTERM
    assert not list((ows.root / "handoffs" / ".meta" / "cancel").glob("*.json"))
    assert ows.stop(daemon) == 0


def test_cancellation_message_cancels_running_work(ows: Workspace) -> None:
    daemon = ows.serve()
    hid = ows.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 60}', "--id", "msg-001")
    wait_running(ows, [hid])
    started = time.monotonic()
    ows.drop("msg-cancel-001.json", {
        "version": "1.0.0", "id": "msg-cancel-001", "timestamp": "2025-01-15T10:31:00Z",
        "source_tier": "ABSTRACT_ARCHITECT", "target_tier": "ROUTING_DISPATCHER",
        "correlation_id": None,
        "payload": {"target_message_id": "msg-001", "reason": "Strategy revision", "cascade": True}})
    ows.wait_state(hid, ("failed",), timeout=20)
    print(f"cancellation message: running handoff stopped in {time.monotonic() - started:.2f}s")
    assert time.monotonic() - started < 10
    assert ows.doc(hid)["status"] == "cancelled"
    assert ows.wait_state("msg-cancel-001", timeout=10) == "completed"
    answer = ows.doc("msg-cancel-001")
    assert answer["payload"]["status"] == "success" and answer["correlation_id"] == "msg-cancel-001"
    assert "msg-001" in answer["payload"]["summary"]
    assert ows.stop(daemon) == 0


# ---------------------------------------------------------------- dependencies
def test_three_step_dependency_chain_runs_in_order(ows: Workspace) -> None:
    ows.create("--to", "@flaky", "--id", "step-1", "--data", '{"mode": "ok"}')
    ows.create("--to", "@flaky", "--id", "step-2", "--depends-on", "step-1", "--data", '{"mode": "ok"}')
    ows.create("--to", "@flaky", "--id", "step-3", "--depends-on", "step-2", "--data", '{"mode": "ok"}')
    run(ows)
    docs = [ows.doc(f"step-{n}") for n in (1, 2, 3)]
    assert [d["status"] for d in docs] == ["completed"] * 3
    assert docs[0]["completed_at"] <= docs[1]["started_at"] and docs[1]["completed_at"] <= docs[2]["started_at"]
    data = json.loads(ows.handoff("trace", "step-2", "--json").stdout)
    (tree,) = data["trees"]
    assert tree["id"] == "step-1" and tree["children"][0]["id"] == "step-2"
    assert tree["children"][0]["children"][0]["id"] == "step-3"


def test_failed_dependency_fails_its_dependents(ows: Workspace) -> None:
    ows.create("--to", "@flaky", "--id", "dep-a", "--data", '{"mode": "permanent"}')
    ows.create("--to", "@flaky", "--id", "dep-b", "--depends-on", "dep-a", "--data", '{"mode": "ok"}')
    run(ows)
    assert ows.state_of("dep-b") == ["failed"]
    error = ows.doc("dep-b")["error"]
    assert error["code"] == "DEPENDENCY_MISSING" and "dep-a" in error["message"]
    assert [r["id"] for r in ows.runs()] == ["dep-a"]


# ---------------------------------------------------------------- clarification and blocking
def test_clarification_round_trip(ows: Workspace) -> None:
    hid = ows.create("--to", "@asker", "--from", "@architect", "--id", "ask-1", "--data", '{"task": "bsearch"}')
    run(ows)
    assert ows.state_of(hid) == ["pending"]
    (row,) = json.loads(ows.handoff("ls", "--json").stdout)
    assert row["note"].startswith("waiting on the requester (@architect): needs clarification: "
                                  "Should an empty array return -1")
    assert "handoff answer ask-1" in row["note"]
    run(ows)  # still waiting: the handler is not run again
    assert ows.state_of(hid) == ["pending"]
    assert ows.handoff("answer", "nope", "--data", "1").returncode == 3
    proc = ows.handoff("answer", hid, "--data", '"return -1"', "--as", "@architect")
    assert proc.returncode == 0, proc.stderr
    run(ows)
    doc = ows.doc(hid)
    assert doc["status"] == "completed" and doc["output"] == {"decision": "return -1", "rounds": 1}
    (clar,) = doc["input"]["clarifications"]
    assert clar["by"] == "@architect" and clar["questions"] == ["Should an empty array return -1 or raise?"]
    events = [e["event"] for e in doc["handoffd"]["history"]]
    assert events == ["created", "claimed", "needs_clarification", "answered", "claimed", "completed"]
    done = ows.handoff("answer", hid, "--data", '"again"')
    assert done.returncode == 1 and "not waiting for an answer" in done.stderr


def test_questions_are_reported_up_at_once(ows: Workspace) -> None:
    """Seed 000: BLOCKED / NEEDS_CLARIFICATION go up immediately. `handoff wait` ends with exit 4
    and the outcome in the document's own format; `handoff answer` still resumes the work."""
    ows.write_config(ows.root.joinpath("handoffd.toml").read_text()
                     + '\n[specialists."SPECIALIZED_FLEET"]\nhandler = "orch_handlers:asker"\n')
    hid = ows.create("--to", "@asker", "--from", "@architect", "--id", "ask-up", "--data", "{}")
    message = {"version": "1.0.0", "id": "msg-clar", "timestamp": "2025-01-15T10:30:05Z",
               "source_tier": "ROUTING_DISPATCHER", "target_tier": "SPECIALIZED_FLEET",
               "correlation_id": "msg-001",
               "payload": {"task_type": "execute_code", "objective": "binary search",
                           "constraints": [], "context_refs": [], "priority": 1,
                           "timeout_ms": 60000, "deadline_hint": None, "specialist_hint": None,
                           "task_data": {}}}  # seed 000: every DelegationPayload field is present
    ows.drop("msg-clar.json", message)
    run(ows)
    wait = ows.handoff("wait", hid, "--timeout", "10")
    assert wait.returncode == 4 and wait.stdout == "ask-up needs_clarification\n", wait
    assert "Should an empty array return -1 or raise?" in wait.stderr
    assert "handoff answer ask-up" in wait.stderr
    native = json.loads(ows.handoff("wait", hid, "--json").stdout)
    assert native["status"] == "needs_clarification" and "handoffd" not in native
    moe = ows.handoff("wait", "msg-clar", "--json")
    assert moe.returncode == 4
    outcome = json.loads(moe.stdout)
    assert outcome["correlation_id"] == "msg-clar" and outcome["target_tier"] == "ROUTING_DISPATCHER"
    assert outcome["payload"]["status"] == "needs_clarification"
    assert "Should an empty array" in json.dumps(outcome["payload"])
    # file readers see it too, in the parked document
    parked = json.loads((ows.root / "handoffs" / "pending" / "msg-clar.json").read_text())
    assert parked["handoffd"]["awaiting"]["outcome"] == outcome
    assert ows.handoff("answer", hid, "--data", '"return -1"', "--as", "@architect").returncode == 0
    run(ows)
    assert ows.handoff("wait", hid, "--timeout", "10").returncode == 0


def test_blocked_waits_for_a_resolution(ows: Workspace) -> None:
    ows.create("--to", "@blocker", "--id", "blk-1", "--data", '{"mode": "good"}')
    ows.create("--to", "@blocker", "--id", "blk-2", "--data", '{"mode": "no-options"}')
    run(ows)
    assert ows.state_of("blk-1") == ["pending"]
    note = {r["id"]: r["note"] for r in json.loads(ows.handoff("ls", "--json").stdout)}["blk-1"]
    assert "waiting on the requester" in note and "blocked: No 4x A100" in note
    assert ows.doc("blk-1")["handoffd"]["awaiting"]["blockers"][0]["resolution_options"]
    bad = ows.doc("blk-2")
    assert ows.state_of("blk-2") == ["failed"] and bad["error"]["code"] == "VALIDATION_FAILED"
    assert "resolution_options" in bad["error"]["message"]
    ows.handoff("answer", "blk-1", "--data", '"Use 2x A100"', check=True)
    run(ows)
    assert ows.doc("blk-1")["output"] == {"chosen": "Use 2x A100"}


# ---------------------------------------------------------------- shared context
def test_context_namespaces_and_permissions(ows: Workspace) -> None:
    denied = ows.handoff("context", "set", "task/current-objective", "--data", '"solve X"')
    assert denied.returncode == 1
    assert "@cli may not write context key 'task/current-objective'" in denied.stderr
    assert "written only by @architect, ABSTRACT_ARCHITECT" in denied.stderr
    assert not (ows.root / "context" / "task").exists()
    ok = ows.handoff("context", "set", "task/current-objective", "--data", '"solve X"', "--as", "@architect")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ows.handoff("context", "get", "task/current-objective").stdout) == "solve X"
    assert json.loads((ows.root / "context" / "task" / "current-objective.json").read_text()) == "solve X"
    ows.handoff("context", "set", "routing/task-graph", "--data", '{"a": ["b"]}', "--as", "ROUTING_DISPATCHER",
                check=True)
    ows.handoff("context", "set", "project-context", "--data", '{"project_id": "p1"}', check=True)
    for bad in ("../escape", "/etc/passwd", "task/../../x", "a//b"):
        proc = ows.handoff("context", "set", bad, "--data", "1", "--as", "@architect")
        assert proc.returncode != 0 and "not a safe relative name" in proc.stderr, (bad, proc.stderr)
    assert ows.handoff("context", "get", "task/nothing").returncode == 3
    rows = {r["key"]: r for r in json.loads(ows.handoff("context", "ls", "--json").stdout)}
    assert set(rows) == {"task/current-objective", "routing/task-graph", "project-context"}
    assert rows["task/current-objective"]["written_by"] == "@architect"
    assert [r["key"] for r in json.loads(ows.handoff("context", "ls", "task/", "--json").stdout)] == [
        "task/current-objective"]
    history = json.loads(ows.handoff("context", "history", "--json").stdout)
    assert [(h["key"], h["by"]) for h in history] == [("task/current-objective", "@architect"),
                                                      ("routing/task-graph", "ROUTING_DISPATCHER"),
                                                      ("project-context", "@cli")]
    assert all(h["at"] and len(h["sha256"]) == 64 for h in history)


def test_handler_writing_outside_its_namespace_fails(ows: Workspace) -> None:
    ows.handoff("context", "set", "task/current-objective", "--data", '"goal"', "--as", "@architect", check=True)
    ows.create("--to", "@writer", "--id", "w-ok", "--data", "{}")
    ows.create("--to", "@writer", "--id", "w-bad", "--data", '{"trespass": true}')
    run(ows)
    assert ows.doc("w-ok")["status"] == "completed"
    assert ows.doc("w-ok")["output"] == {"objective_seen": "goal"}
    assert json.loads(ows.handoff("context", "get", "execution/outputs/w-ok").stdout) == {"ok": True}
    bad = ows.doc("w-bad")
    assert ows.state_of("w-bad") == ["failed"] and bad["error"]["code"] == "CONTEXT_PERMISSION_DENIED"
    assert "@writer (tier SPECIALIZED_FLEET) may not write context key 'task/current-objective'" \
        in bad["error"]["message"]
    assert json.loads(ows.handoff("context", "get", "task/current-objective").stdout) == "goal"
    writers = [h["by"] for h in json.loads(ows.handoff("context", "history", "--json").stdout)]
    assert writers == ["@architect", "@writer", "@writer"]


# ---------------------------------------------------------------- artifacts
def native_doc(hid: str, target: str, data: Any, destination: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "timestamp": "2026-01-13T10:00:00Z", "status": "pending",
                           "source": {"agent_id": "@frontend-specialist"},
                           "target": {"agent_id": target}, "input": {"data": data}}
    if destination:
        doc["expected_output"] = {"artifact_type": "react-components", "destination": destination}
    return doc


def submit(ws: Workspace, doc: dict[str, Any]) -> None:
    path = ws.root.parent / f"{doc['handoff_id']}.json"
    path.write_text(json.dumps(doc))
    ws.handoff("create", "--file", str(path), check=True)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_artifacts_destination_and_one_kilobyte_rule(ows: Workspace) -> None:
    dest = "artifacts/phase-13-react/artifact-react-comp-{timestamp}.json"
    submit(ows, native_doc("art-1", "@artist", {"output_bytes": 10}, dest))
    submit(ows, native_doc("art-2", "@artist", {"output_bytes": 5000}, None))
    submit(ows, native_doc("art-3", "@dest-writer", {}, "phase-14/{handoff_id}-{attempt}.json"))
    submit(ows, native_doc("art-4", "@artist", {}, "../../outside-{timestamp}.json"))
    submit(ows, native_doc("art-5", "@artist", {}, "artifacts/{nonsense}.json"))
    run(ows)
    one = ows.doc("art-1")
    assert one["status"] == "completed"
    out = one["output"]
    assert re.fullmatch(r"artifacts/phase-13-react/artifact-react-comp-\d{13}\.json", out["artifact_path"])
    assert out["artifact_type"] == "react-components" and out["artifact_id"].startswith("artifact-react-comp-")
    written = ows.root / out["artifact_path"]
    assert json.loads(written.read_text())["components"] == ["UserProfile"]
    assert one["metadata"]["artifact_path_seen"] == str(written)
    records = {a.get("name"): a for a in one["artifacts"]}
    main = records[written.name]
    assert main["path"] == out["artifact_path"] and main["sha256"] == sha(written)
    assert main["size_bytes"] == written.stat().st_size and main["inline_content"] is None
    small = records["small.txt"]  # under 1 KB: inline, no reference
    assert small["inline_content"] == "5/5 tests passed" and small["content_ref"] is None
    assert small["size_bytes"] == 16 and small["sha256"] == hashlib.sha256(b"5/5 tests passed").hexdigest()
    big = records["big.tsx"]  # 1 KB or more: by reference
    assert big["inline_content"] is None and big["content_ref"] == big["path"] == "artifacts/art-1/big.tsx"
    assert (ows.root / big["path"]).read_text() == "y" * 3000
    assert big["size_bytes"] == 3000 and big["sha256"] == sha(ows.root / big["path"])
    two = ows.doc("art-2")  # no destination, but output.content over 1 KB: moved out by reference
    assert two["output"]["artifact_path"] == "artifacts/art-2/output.json"
    assert "content" not in two["output"]
    assert json.loads((ows.root / "artifacts/art-2/output.json").read_text())["code"] == "x" * 5000
    three = ows.doc("art-3")  # a command handler wrote $HANDOFF_ARTIFACT_PATH itself
    assert three["output"]["artifact_path"] == "artifacts/phase-14/art-3-1.json"
    assert json.loads((ows.root / "artifacts/phase-14/art-3-1.json").read_text()) == {"written_by": "command handler"}
    assert three["artifacts"][0]["sha256"] == sha(ows.root / "artifacts/phase-14/art-3-1.json")
    for bad, needle in (("art-4", "outside artifacts/"), ("art-5", "unknown placeholder {nonsense}")):
        doc = ows.doc(bad)
        assert ows.state_of(bad) == ["failed"] and doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
        assert needle in doc["error"]["message"]
    assert not list(ows.root.parent.glob("outside-*")) and not list(ows.root.glob("outside-*"))


def test_ids_that_differ_only_in_at_colon_plus_keep_their_own_artifacts(ows: Workspace) -> None:
    """Found by the fourth bug hunt: `job@1`, `job:1`, `job+1` and `job_1` shared the folder
    artifacts/job_1/: each handoff's moved-out output overwrote the previous one's, whose filed
    sha256 then named bytes it never wrote."""
    ids = ("job@1", "job:1", "job+1", "job_1")
    for handoff_id in ids:
        submit(ows, native_doc(handoff_id, "@artist", {"output_bytes": 5000}, None))
    run(ows)
    paths = set()
    for handoff_id in ids:
        doc = ows.doc(handoff_id)
        assert doc["status"] == "completed", doc
        path = doc["output"]["artifact_path"]
        paths.add(path)
        assert hashlib.sha256((ows.root / path).read_bytes()).hexdigest() == doc["artifacts"][0]["sha256"]
    assert len(paths) == 4 and "artifacts/job_1/output.json" in paths, paths
