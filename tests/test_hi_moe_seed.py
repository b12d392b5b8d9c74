"""Seed 000 (hi_moe) through a real daemon. Timeouts: `timeout_ms` is a hard deadline counted
from the message's arrival, a TIMEOUT answer is final (never retried), a message nobody claims is
answered TIMEOUT when its time is up, the tiers' recommended timeouts apply when none is given.
Routing: a specialist_hint is a suggestion; THROTTLED is requeued. Clarification answers reach a
command specialist."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh

from handoffd.core.documents import Envelope
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.dialects.hi_moe import TIER_TIMEOUT_SECONDS, HiMoeDialect

HANDLERS = '''
def sleeper(doc, ctx):
    """Sleeps task_data.sleep seconds unless stopped (a cooperative Python specialist)."""
    (ctx.root / "artifacts" / ("ran-" + ctx.handoff_id)).touch()  # for "never run" checks
    seconds = (ctx.data.get("task_data") or {}).get("sleep", 0)
    if ctx.cancelled.wait(seconds):
        return {"status": "failed", "error": {"code": "CANCELLED", "message": "stopped"}}
    return {"status": "completed", "output": {"slept": seconds}}
'''

CONFIG = """
[daemon]
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 0.5
grace_seconds = 2.0
durability = "fast"

[retry]
max_retries = 3
retry_delay_seconds = 0.1

[specialists."SPECIALIZED_FLEET"]
handler = "moe_handlers:sleeper"
"""


@pytest.fixture
def mws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    (tmp_path / "moe_handlers.py").write_text(HANDLERS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(CONFIG)
    HandoffdWorkspace(root).ensure()
    yield ws
    ws.cleanup()


def message(msg_id: str, *, target: str = "SPECIALIZED_FLEET", timeout_ms: int | None,
            sleep: float = 0) -> dict[str, Any]:
    """The seed's own Dispatcher -> Fleet example, re-addressed (its timestamp is a year old:
    the deadline counts from arrival, so it still runs)."""
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"], doc["target_tier"] = msg_id, target
    payload = doc["payload"]
    payload["specialist_hint"] = None
    payload["timeout_ms"] = timeout_ms
    payload["task_data"]["sleep"] = sleep
    return doc


def wait_filed(ws: Workspace, hid: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for state in ("completed", "failed"):
            if (ws.root / "handoffs" / state / f"{hid}.json").exists() \
                    and not (ws.root / "handoffs" / "in-progress" / f"{hid}.json").exists():
                return state
        time.sleep(0.05)
    raise AssertionError(f"{hid} was not filed in {timeout}s: {ws.state_of(hid)}")


def events(ws: Workspace, hid: str) -> list[str]:
    return [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]


def test_the_seed_example_runs_and_answers_success(mws: Workspace) -> None:
    mws.drop("m-ok.json", message("m-ok", timeout_ms=30000))
    proc = mws.handoffd("run")
    assert proc.returncode == 0, proc.stderr
    answer = mws.doc("m-ok")
    assert answer["payload"]["status"] == "success" and answer["correlation_id"] == "m-ok"
    assert (mws.root / "artifacts" / "ran-m-ok").exists()


def test_a_timeout_answer_is_final(mws: Workspace) -> None:
    mws.drop("m-slow.json", message("m-slow", timeout_ms=800, sleep=30))
    started = time.monotonic()
    proc = mws.handoffd("run")
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    answer = mws.doc("m-slow")
    assert mws.state_of("m-slow") == ["failed"] and answer["payload"]["status"] == "timeout"
    assert events(mws, "m-slow").count("claimed") == 1  # max_retries = 3, yet not retried
    assert "retry_scheduled" not in events(mws, "m-slow")
    assert took < 25, took  # stopped at its deadline, not after the handler's 30 s


def test_a_message_nobody_claims_is_answered_timeout(mws: Workspace) -> None:
    daemon = mws.serve()
    try:
        mws.drop("m-lost.json", message("m-lost", target="ROUTING_DISPATCHER", timeout_ms=600))
        assert wait_filed(mws, "m-lost") == "failed"
    finally:
        assert mws.stop(daemon) == 0
    answer = mws.doc("m-lost")
    assert answer["payload"]["status"] == "timeout"
    assert "not started before its deadline" in json.dumps(answer["payload"])
    assert "completed" not in events(mws, "m-lost")


def test_a_message_past_its_deadline_is_not_run(mws: Workspace) -> None:
    """Created through the CLI (its history starts at creation), claimed after the deadline:
    answered TIMEOUT without running the specialist."""
    doc = message("m-late", timeout_ms=300)
    path = mws.root / "late.json"
    path.write_text(json.dumps(doc))
    assert mws.create("--file", str(path)) == "m-late"
    time.sleep(0.5)  # the deadline passes while nothing serves the queue
    proc = mws.handoffd("run")
    assert proc.returncode == 1, proc.stderr
    assert mws.doc("m-late")["payload"]["status"] == "timeout"
    assert "claimed" in events(mws, "m-late")
    assert not (mws.root / "artifacts" / "ran-m-late").exists()  # never run


def test_tier_defaults_apply_without_timeout_ms() -> None:
    base = message("m-tier", timeout_ms=None)
    for tier, seconds in (("SPECIALIZED_FLEET", 30.0), ("ROUTING_DISPATCHER", 60.0),
                          ("ABSTRACT_ARCHITECT", 120.0)):
        doc = dict(base, target_tier=tier)
        env: Envelope = HiMoeDialect().envelope(doc)
        assert env.timeout_seconds is None and env.default_timeout_seconds == seconds
        assert env.hard_timeout
    assert TIER_TIMEOUT_SECONDS["SPECIALIZED_FLEET"] == 30.0
    with_ms = HiMoeDialect().envelope(message("m-ms", timeout_ms=2000))
    assert with_ms.timeout_seconds == 2.0


def test_a_specialist_hint_is_a_suggestion(mws: Workspace) -> None:
    """Seed 000: `specialist_hint` names a LoRA if known; when no such specialist is registered
    here, the target tier's fleet takes the message instead of it waiting forever."""
    doc = message("m-hint", timeout_ms=30000)
    doc["payload"]["specialist_hint"] = "rust-lora"
    mws.drop("m-hint.json", doc)
    proc = mws.handoffd("run")
    assert proc.returncode == 0, proc.stderr
    assert mws.doc("m-hint")["payload"]["status"] == "success"
    assert (mws.root / "artifacts" / "ran-m-hint").exists()


def test_throttled_is_requeued_without_using_up_retries(mws: Workspace) -> None:
    mws.write_config(CONFIG.replace("max_retries = 3", "max_retries = 0") + '''
[specialists."ROUTING_DISPATCHER"]
handler = "moe_handlers:busy"
''')
    (mws.root.parent / "moe_handlers.py").write_text(HANDLERS + '''

def busy(doc, ctx):
    """Throttled the first two times, then done (a throttle is not an attempt: count runs)."""
    runs = ctx.root / "artifacts" / "busy-runs"
    seen = len(runs.read_text()) if runs.exists() else 0
    runs.write_text("x" * (seen + 1))
    if seen < 2:
        return {"status": "throttled", "retry_after_seconds": 0.1}
    return {"status": "completed", "output": {"attempt": ctx.attempt, "runs": seen + 1}}
''')
    mws.drop("m-busy.json", message("m-busy", target="ROUTING_DISPATCHER", timeout_ms=30000))
    daemon = mws.serve()
    try:
        assert wait_filed(mws, "m-busy") == "completed"
    finally:
        assert mws.stop(daemon) == 0
    assert events(mws, "m-busy").count("throttled") == 2
    answer = mws.doc("m-busy")["payload"]
    assert answer["status"] == "success", answer
    assert "retry_scheduled" not in events(mws, "m-busy")


ASK_ONCE = r'''
import json, os, sys
json.load(sys.stdin)
answers = json.loads(os.environ.get("HANDOFF_CLARIFICATIONS") or "[]")
if not answers:
    print(json.dumps({"status": "needs_clarification", "questions": ["Which language?"]}))
else:
    print(json.dumps({"status": "completed", "output": {"language": answers[-1]["answer"]}}))
'''


def test_a_command_specialist_sees_the_answer_in_any_format(mws: Workspace) -> None:
    script = mws.root.parent / "ask_once.py"
    script.write_text(ASK_ONCE)
    mws.write_config(CONFIG + f'''
[specialists."ROUTING_DISPATCHER"]
command = ["{sys.executable}", "{script}"]
''')
    mws.drop("m-ask.json", message("m-ask", target="ROUTING_DISPATCHER", timeout_ms=60000))
    mws.handoffd("run")
    assert mws.handoff("wait", "m-ask", "--timeout", "5").returncode == 4
    assert mws.handoff("answer", "m-ask", "--data", '"rust"').returncode == 0
    mws.handoffd("run")
    answer = mws.doc("m-ask")
    assert answer["payload"]["status"] == "success", answer["payload"]
    (output,) = [a for a in answer["payload"]["artifacts"] if a["artifact_type"] == "output"]
    assert json.loads(output["inline_content"]) == {"language": "rust"}, output


def test_error_fields_and_the_1kb_rule_are_checked_on_what_comes_in() -> None:
    """Seed 000: error_type / error_detail / recoverable only on error statuses (a success
    carries none), and inline_content is for content under 1 KB, coming in as going out."""
    from dialect_examples import HI_MOE_FLEET_TO_DISPATCHER

    from handoffd import dialects
    from handoffd.core.errors import InvalidDocument
    from handoffd.service.queries import validate_document

    def problems(doc: dict[str, Any]) -> list[str]:
        try:
            validate_document(None, doc, dialects.detect(doc))
        except InvalidDocument as exc:
            return [e["field"] for e in exc.errors or []]
        return []

    good = fresh(HI_MOE_FLEET_TO_DISPATCHER)
    assert problems(good) == []
    success_with_error = fresh(good)
    success_with_error["payload"]["error_type"] = "timeout"
    assert "payload.error_type" in problems(success_with_error)
    big_inline = fresh(good)
    big_inline["payload"]["artifacts"] = [{"artifact_type": "code", "content_ref": None,
                                           "inline_content": "x" * 2000, "metadata": {}}]
    assert "payload.artifacts[0].inline_content" in problems(big_inline)


FAN_HANDLERS = '''

def moe_dispatch(doc, ctx):
    """A dispatcher: fans its task_data.children out."""
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": ctx.data["task_data"]["children"]}


def leaf(doc, ctx):
    data = ctx.data["task_data"]
    if not data.get("ok", True):
        return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "leaf failed",
                                              "retryable": False}}
    return {"status": "completed", "output": {"value": data["v"]}, "metadata": {"confidence": 0.8}}
'''


def test_children_of_a_message_are_messages(mws: Workspace) -> None:
    """Seed 000: a dispatcher's fan-out goes one tier down as Messages (not seed 001 requests):
    each child is a DelegationPayload Message correlated to its parent, and the parent's
    aggregated answer reads the children's Outcome messages."""
    (mws.root.parent / "moe_handlers.py").write_text(HANDLERS + FAN_HANDLERS)
    mws.write_config(CONFIG + """
[specialists."ROUTING_DISPATCHER"]
handler = "moe_handlers:moe_dispatch"

[specialists."@leaf"]
handler = "moe_handlers:leaf"
""")
    doc = message("msg-fan", target="ROUTING_DISPATCHER", timeout_ms=60000)
    doc["source_tier"] = "ABSTRACT_ARCHITECT"
    doc["payload"]["task_data"] = {"children": [
        {"to": "@leaf", "data": {"v": 1}, "objective": "first half"},
        {"to": "@leaf", "data": {"v": 2}, "objective": "second half", "depends_on": [1]}]}
    mws.drop("msg-fan.json", doc)
    proc = mws.handoffd("run")
    assert proc.returncode == 0, proc.stderr
    for index, value in ((1, 1), (2, 2)):
        answer = mws.doc(f"msg-fan.c{index}")
        child = answer["handoffd"]["request_snapshot"]
        assert child["version"] == "1.0.0" and child["correlation_id"] == "msg-fan"
        assert (child["source_tier"], child["target_tier"]) == ("ROUTING_DISPATCHER",
                                                                 "SPECIALIZED_FLEET")
        assert child["payload"]["specialist_hint"] == "@leaf"
        assert child["payload"]["task_data"] == {"v": value}
        assert child["payload"]["objective"] == ("first half", "second half")[index - 1]
        assert answer["payload"]["status"] == "success"
    second = mws.doc("msg-fan.c2")["handoffd"]["request_snapshot"]
    assert second["depends_on"] == ["msg-fan.c1"] and second["parent_id"] == "msg-fan"
    parent = mws.doc("msg-fan")
    assert parent["correlation_id"] == "msg-fan" and parent["payload"]["status"] == "success"
    agg = parent["payload"]["aggregated_outcome"]
    assert [c["status"] for c in agg["child_outcomes"]] == ["success", "success"]
    from handoffd import dialects
    from handoffd.service.queries import validate_document
    validate_document(None, parent, dialects.detect(parent))  # a valid Outcome Message
    first_done = [e["at"] for e in mws.doc("msg-fan.c1")["handoffd"]["history"]
                  if e["event"] == "completed"][0]
    second_claimed = [e["at"] for e in mws.doc("msg-fan.c2")["handoffd"]["history"]
                      if e["event"] == "claimed"][0]
    assert second_claimed >= first_done  # its sibling dependency held it back
    assert agg["aggregated_confidence"] == pytest.approx(0.8)
    trace = mws.handoff("trace", "msg-fan", "--json")
    assert trace.returncode == 0 and "msg-fan.c2" in trace.stdout


@pytest.mark.parametrize("version, major", [("1.0.0", 1), ("2.0.0", 2), ("².0.0", None),
                                            ("١.0.0", None), ("x.0.0", None), (7, None),
                                            ("9" * 5000 + ".0.0", 10 ** 18)])
def test_only_ascii_majors_are_read_and_a_huge_one_is_unknown(version: Any, major: int | None) -> None:
    """Found by the fourth bug hunt: '².0.0' (isdigit, but int() refuses it) and a 5,000-digit
    MAJOR (past int()'s 4,300-digit limit) were internal ValueErrors in `handoff validate` and
    `create`; a huge MAJOR is a version no receiver speaks (seed 000: reject it)."""
    from handoffd.core.errors import InvalidDocument
    from handoffd.dialects.hi_moe import check_version, major_of
    assert major_of(version) == major
    doc = {"version": version, "id": "m"}
    if major is not None and major != 1:
        with pytest.raises(InvalidDocument) as caught:
            check_version(doc)
        assert caught.value.code == "UNKNOWN_VERSION" and len(str(caught.value)) < 400
    else:
        check_version(doc)
