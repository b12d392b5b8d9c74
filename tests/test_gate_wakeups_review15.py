"""A gate's wait names what can end it (review 15, fixer FN).

Every gate but the dependencies one answered ``Verdict.wait(reason)`` with ``on=None``: "any
filing may end it". The scheduler then looked again at every such waiter at every filing, each
read again and its gate run again (the children gate: a read of every child). 10,000 paused
handoffs made another specialist's pick-up 0.8 s (p50; 30,000: 2.2 s), 1,000 parents parked on
10 children each 0.6 s. Now: a pause and a question to the requester wait for no filing (a resume
or an answer is seen at the next rescan, the answer at once through the file watch), a parent
waits for the filing of one of its open children, a contract for the filing of the handoff
holding its files.

The real-process tests count the re-reads in the daemon itself: the handler module, imported by
the daemon, wraps what each gate calls per look (``Pauses.why``, ``child_info``) and a ``@probe``
handoff answers the counts so far.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, handlers_workspace, new_workspace, wait_until

from handoffd.cli.basics import engine as open_engine
from handoffd.core.engine import Engine
from handoffd.core.timeutil import parse_iso
from handoffd.features.clarification import requester_gate
from handoffd.features.contracts.feature import Enforcer
from handoffd.features.orchestration import children_gate
from handoffd.features.pause import pauses_of

HANDLERS = '''
import time
from collections import Counter

import handoffd.features.children_gate as _children_gate
import handoffd.features.pause as _pause

COUNTS = Counter()
_why = _pause.Pauses.why
_child_info = _children_gate.child_info


def why(self, agent):
    COUNTS["pause"] += 1
    return _why(self, agent)


def child_info(engine, handoff_id):
    COUNTS["child"] += 1
    return _child_info(engine, handoff_id)


_pause.Pauses.why = why
_children_gate.child_info = child_info


def fast(handoff, ctx):
    return {"status": "completed", "output": {"ok": True}}


def probe(handoff, ctx):
    return {"status": "completed", "output": dict(COUNTS)}


def sleepy(handoff, ctx):
    data = ctx.data if isinstance(ctx.data, dict) else {}
    time.sleep(float(data.get("s", 1)))
    return {"status": "completed", "output": {"ok": True}}


def fail_once(handoff, ctx):
    time.sleep(0.5)
    if ctx.attempt == 1:
        return {"status": "failed", "error": {"code": "FLAKY", "message": "try again"}}
    return {"status": "completed", "output": {"ok": True}}


def boss(handoff, ctx):
    data = ctx.data if isinstance(ctx.data, dict) else {}
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": data.get("to", "@park"), "data": {"s": data.get("s", 30)}}
                         for _ in range(int(data.get("n", 2)))]}


def asker(handoff, ctx):
    if ctx.clarifications:
        return {"status": "completed", "output": {"answers": ctx.clarifications}}
    return {"status": "needs_clarification", "questions": ["which one?"]}
'''


def config(rescan: float) -> str:
    return f"""
[daemon]
workers = 4
durability = "fast"
settle_seconds = 0.05
rescan_seconds = {rescan}
grace_seconds = 1.0

[specialists."@fast"]
handler = "gw15:fast"

[specialists."@probe"]
handler = "gw15:probe"

[specialists."@slow"]
handler = "gw15:fast"

[specialists."@boss"]
handler = "gw15:boss"

[specialists."@park"]
handler = "gw15:sleepy"
concurrency = 1
timeout_seconds = 900

[specialists."@quick"]
handler = "gw15:sleepy"

[specialists."@asker"]
handler = "gw15:asker"

[specialists."@worker"]
handler = "gw15:sleepy"

[specialists."@flaky"]
handler = "gw15:fail_once"
retry = {{ max_retries = 2, retry_delay_seconds = 60 }}
"""


def request(hid: str, to: str, data: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    doc = {"handoff_id": hid, "source": {"agent_id": "@gw15"}, "target": {"agent_id": to},
           "input": {"data": data or {}}}
    doc.update(extra)
    return doc


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rescan: float) -> Workspace:
    return handlers_workspace(tmp_path, monkeypatch, "gw15", HANDLERS, config(rescan))


def stop(ws: Workspace, proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        ws.cleanup()


probes = iter(range(10**6))


def counts(ws: Workspace) -> dict[str, int]:
    """What the daemon's gates were asked so far (a @probe handoff answers it)."""
    hid = f"probe-{next(probes)}"
    ws.drop(f"{hid}.json", request(hid, "@probe"))
    assert ws.wait_state(hid, timeout=30) == "completed"
    return ws.doc(hid)["output"]


def claimed_after(ws: Workspace, hid: str, dropped: float) -> float:
    entry = next(e for e in ws.doc(hid)["handoffd"]["history"] if e["event"] == "claimed")
    return parse_iso(entry["at"]).timestamp() - dropped


def stream(ws: Workspace, n: int = 60, gap: float = 0.02) -> list[float]:
    """Drop ``n`` @fast handoffs ``gap`` apart; their claim latencies, sorted, once all are done."""
    dropped = []
    for i in range(n):
        dropped.append(time.time())
        ws.drop(f"fast-{i}.json", request(f"fast-{i}", "@fast"))
        time.sleep(gap)
    for i in range(n):
        assert ws.wait_state(f"fast-{i}", timeout=60) == "completed"
    return sorted(claimed_after(ws, f"fast-{i}", dropped[i]) for i in range(n))


# ---------------------------------------------------------------- each gate's verdict
@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    ws = new_workspace(tmp_path / "ws", config(5.0))
    (ws.root / "src").mkdir()
    yield open_engine(ws.root)
    ws.cleanup()


def test_a_pause_waits_for_no_filing(engine: Engine) -> None:
    pauses_of(engine).set("@slow", paused=True, by="@test")
    drop(engine, request("p1", "@slow"))
    verdict = engine.gate(peek(engine, "p1"))
    assert verdict is not None and verdict.action == "wait" and verdict.reason.startswith("paused")
    assert verdict.on == frozenset()


def test_a_parked_parent_waits_for_its_open_children(engine: Engine) -> None:
    for cid in ("c2", "c3"):
        drop(engine, request(cid, "@quick"))
    doc = request("parent", "@boss")
    # c1 is gone (it counts failed: closed), 7 is no id
    doc["handoffd"] = {"waiting_children": {"children": ["c1", "c2", "c3", 7], "round": 1,
                                            "aggregation": "all_success"}}
    env = _envelope_of(engine, doc)
    verdict = children_gate(engine, env, doc)
    assert verdict is not None and verdict.action == "wait" and "2 of 3 children" in verdict.reason
    assert verdict.on == frozenset({"c2", "c3"})  # only an open child's filing can end it


def test_a_question_to_the_requester_waits_for_no_filing(engine: Engine) -> None:
    doc = request("q1", "@asker")
    doc["handoffd"] = {"awaiting": {"kind": "needs_clarification", "questions": ["which?"]}}
    verdict = requester_gate(engine, _envelope_of(engine, doc), doc)
    assert verdict is not None and verdict.action == "wait" and "which?" in verdict.reason
    assert verdict.on == frozenset()


def test_a_contract_waits_for_the_filing_of_the_holder_of_its_files(engine: Engine) -> None:
    contract = {"files_owned": ["src/**"]}
    drop(engine, request("holder", "@worker", contract=contract))
    job = engine.take("holder")
    assert job is not None
    enforcer = next(owner for g in engine.hooks.gates
                    if isinstance(owner := getattr(g, "__self__", None), Enforcer))
    assert enforcer.reservations.take("holder", job.claim.token, ["src/**"], agent="@worker") is None
    drop(engine, request("waiter", "@worker", contract={"files_owned": ["src/a.py"]}))
    verdict = engine.gate(peek(engine, "waiter"))
    assert verdict is not None and verdict.action == "wait" and "holder" in verdict.reason
    assert verdict.on == frozenset({"holder"})


def drop(engine: Engine, doc: dict[str, Any]) -> None:
    Workspace(engine.ws.root).drop(f"{doc['handoff_id']}.json", doc)


def peek(engine: Engine, hid: str) -> Any:
    found = engine.peek(hid)
    assert found is not None and found.readable, found
    return found


def _envelope_of(engine: Engine, doc: dict[str, Any]) -> Any:
    return engine.formats.detect(doc).envelope(doc)


# ---------------------------------------------------------------- under `handoffd serve`
def test_a_paused_backlog_is_not_read_again_at_every_filing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 paused handoffs: a stream of 60 others used to re-read all of them at each filing
    (tens of thousands of looks); now none until a rescan (60 s here)."""
    ws = make(tmp_path, monkeypatch, rescan=60.0)
    n = 600
    assert ws.handoff("pause", "@slow").returncode == 0
    for i in range(n):
        ws.drop(f"slow-{i}.json", request(f"slow-{i}", "@slow"))
    daemon = ws.serve()
    try:
        deadline = time.monotonic() + 60
        while (before := counts(ws)).get("pause", 0) < n:  # the first look at each
            assert time.monotonic() < deadline, before
        latencies = stream(ws)
        after = counts(ws)
        looks = after.get("pause", 0) - before.get("pause", 0)
        print(f"paused looks during the stream: {looks}; "
              f"claim p50 {latencies[len(latencies) // 2]:.3f} s")
        assert looks < n // 2, f"{looks} looks at paused handoffs during 60 filings"
    finally:
        stop(ws, daemon)


def test_parked_parents_are_not_read_again_at_every_filing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """80 parents each waiting for 5 children on a concurrency-1 specialist: each filing of
    another specialist's handoff used to read every child of every parent (400 reads)."""
    ws = make(tmp_path, monkeypatch, rescan=60.0)
    parents, children = 80, 5
    for i in range(parents):
        ws.drop(f"boss-{i}.json", request(f"boss-{i}", "@boss", {"n": children, "s": 30}))
    daemon = ws.serve()
    try:
        def parked() -> bool:
            return all("waiting_children" in ws.doc(f"boss-{i}").get("handoffd", {})
                       and ws.state_of(f"boss-{i}") == ["pending"] for i in range(parents))
        wait_until(parked, timeout=60, what="every parent parked")
        time.sleep(0.5)
        before = counts(ws)
        latencies = stream(ws)
        after = counts(ws)
        looks = after.get("child", 0) - before.get("child", 0)
        print(f"children read during the stream: {looks}; "
              f"claim p50 {latencies[len(latencies) // 2]:.3f} s")
        assert looks < parents * children, f"{looks} children read during 60 filings"
    finally:
        daemon.send_signal(signal.SIGTERM)  # (twice: the sleeping children are handed back)
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ws.cleanup()


def test_a_childs_filing_an_answer_and_a_holders_filing_still_wake_the_waiter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no rescan for a minute, what ends each wait wakes it at once: the last child's
    filing (its parent is aggregated), `handoff answer` (the file watch), the filing of the
    handoff holding a contract's files."""
    ws = make(tmp_path, monkeypatch, rescan=60.0)
    (ws.root / "src").mkdir()
    daemon = ws.serve()
    try:
        # a parent and its two children (1 s each)
        ws.drop("fam.json", request("fam", "@boss", {"n": 2, "s": 1, "to": "@quick"}))
        # a handoff that asks its requester
        ws.drop("ask.json", request("ask", "@asker"))
        # two handoffs owning the same files: the second waits for the first
        ws.drop("own-1.json", request("own-1", "@worker", {"s": 1.5},
                                      contract={"files_owned": ["src/**"]}))
        wait_until(lambda: ws.state_of("own-1") == ["in-progress"], timeout=20, what="own-1 runs")
        time.sleep(0.3)  # (its reservation taken)
        ws.drop("own-2.json", request("own-2", "@worker", {"s": 0.1},
                                      contract={"files_owned": ["src/x.py"]}))

        assert ws.wait_state("own-1", timeout=30) == "completed"
        ended = time.monotonic()
        assert ws.wait_state("own-2", timeout=30) == "completed"
        assert time.monotonic() - ended < 10, "the holder's filing did not wake its waiter"

        assert ws.wait_state("fam", timeout=30) == "completed"  # (not at a rescan: 60 s)

        wait_until(lambda: "awaiting" in ws.doc("ask").get("handoffd", {})
                   and ws.state_of("ask") == ["pending"], timeout=20, what="ask parked")
        time.sleep(0.3)
        asked = time.monotonic()
        assert ws.handoff("answer", "ask", "--data", json.dumps("the red one")).returncode == 0
        assert ws.wait_state("ask", timeout=30) == "completed"
        assert time.monotonic() - asked < 10, "the answer did not wake the parked handoff"
        assert ws.doc("ask")["output"]["answers"]
    finally:
        stop(ws, daemon)


def test_a_resume_is_seen_at_the_next_rescan(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ws = make(tmp_path, monkeypatch, rescan=1.0)
    assert ws.handoff("pause", "@slow").returncode == 0
    for i in range(3):
        # s0 expires one day: the daemon queues it for then, and a rescan alone passes it by
        extra: dict[str, Any] = {"expires_at": "2099-01-01T00:00:00Z"} if i == 0 else {}
        ws.drop(f"s{i}.json", request(f"s{i}", "@slow", **extra))
    daemon = ws.serve()
    try:
        time.sleep(1.5)
        assert all(ws.state_of(f"s{i}") == ["pending"] for i in range(3))
        resumed = time.monotonic()
        assert ws.handoff("resume", "@slow").returncode == 0
        assert ws.wait_state("s0", timeout=30) == "completed"
        for i in range(3):
            assert ws.wait_state(f"s{i}", timeout=30) == "completed"
        assert time.monotonic() - resumed < 10
    finally:
        stop(ws, daemon)


def test_a_parent_whose_child_another_process_ends_is_aggregated_at_the_next_rescan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parked parent waits for its children's filings, but a filing by another process
    (here `handoff cancel` of a child whose specialist is paused) reaches this daemon only
    through a rescan; the rescan passed a waiter queued for its deadline by, so the parent
    stayed parked until its deadline (an hour)."""
    ws = make(tmp_path, monkeypatch, rescan=1.0)
    assert ws.handoff("pause", "@park").returncode == 0
    ws.drop("fam.json", request("fam", "@boss", {"n": 1}))
    daemon = ws.serve()
    try:
        wait_until(lambda: "waiting_children" in ws.doc("fam").get("handoffd", {})
                   and ws.state_of("fam") == ["pending"], timeout=20, what="fam parked")
        time.sleep(1.5)  # parked past a rescan
        child = ws.doc("fam")["handoffd"]["waiting_children"]["children"][0]
        cancelled = time.monotonic()
        assert ws.handoff("cancel", child).returncode == 0
        assert ws.wait_state("fam", timeout=30) in ("completed", "failed")
        assert time.monotonic() - cancelled < 10, "the parent waited for its deadline"
    finally:
        stop(ws, daemon)


def retried(ws: Workspace, hid: str) -> bool:
    """``hid``'s document says a retry was scheduled (read while it may be moving: False)."""
    try:
        history = ws.doc(hid)["handoffd"]["history"]
    except (OSError, ValueError, KeyError, AssertionError):  # (AssertionError: in no folder)
        return False
    return any(entry.get("event") == "retry_scheduled" for entry in history)


def test_a_holder_filed_back_for_a_retry_wakes_its_contract_waiter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contract holder whose attempt fails and is filed back for a retry (a minute away) has
    released its files: its waiter runs at once, not at the next rescan (a minute here)."""
    ws = make(tmp_path, monkeypatch, rescan=60.0)
    (ws.root / "src").mkdir()
    daemon = ws.serve()
    try:
        ws.drop("hold.json", request("hold", "@flaky", contract={"files_owned": ["src/**"]}))
        wait_until(lambda: ws.state_of("hold") == ["in-progress"], timeout=20, what="hold runs")
        ws.drop("next.json", request("next", "@worker", {"s": 0.1},
                                     contract={"files_owned": ["src/x.py"]}))
        # (its retry filed back, not a hand-back: under load hold may be claimed, then handed
        # back to wait for next's files when next reserved them first, then run)
        wait_until(lambda: ws.state_of("hold") == ["pending"] and retried(ws, "hold"),
                   timeout=20, what="hold retried")
        filed_back = time.monotonic()
        assert ws.wait_state("next", timeout=30) == "completed"
        assert time.monotonic() - filed_back < 10, "the retry's filing did not wake its waiter"
        assert ws.state_of("hold") == ["pending"]  # (its retry is still a minute away)
    finally:
        stop(ws, daemon)
