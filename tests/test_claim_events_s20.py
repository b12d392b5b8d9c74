"""Only a claim that runs a handler is a start in the event log (session 20, review R24 #2).

Every claim logged ``claimed`` with a ``wait``: the canceller's, ``handoff answer``'s, a parked
parent's aggregation, an expired handoff filed unrun. ``handoff stats`` and the metrics counted
starts, queue waits (the time a human took to answer) and run times (0.006 s cancels, a 91 s
"run" of a family) that never happened. Now the ``claimed`` event is logged when the handler
starts; a filing that ran none carries no ``seconds``, and the attempt its document keeps."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from conftest import Clock, Workspace, memory_engine, new_workspace
from prometheus_client.parser import text_string_to_metric_families
from test_aggregation_deadline_s20 import parked_family

from handoffd import State
from handoffd.backends.files.events import FileEventLog
from handoffd.core.timeutil import iso, parse_iso
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service.stats import tally

ASKER = """\
import json, sys
doc = json.load(sys.stdin)
print(json.dumps({"status": "needs_clarification", "questions": ["which one?"]}))
"""


def _events(root: Path) -> list[dict[str, Any]]:
    return list(FileEventLog(HandoffdWorkspace(root)).read())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _asker_workspace(tmp_path: Path) -> Workspace:
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.0
[specialists."@w"]
command = ["{sys.executable}", "-S", "ask.py"]
timeout_seconds = 20
[specialists."@pa"]
command = ["{sys.executable}", "-S", "ask.py"]
""")
    (ws.root / "ask.py").write_text(ASKER)
    return ws


def test_cancels_and_answers_start_nothing_in_stats_and_metrics(tmp_path: Path) -> None:
    """r24's reproduction: three handoffs of a paused specialist cancelled, one answered."""
    ws = _asker_workspace(tmp_path)
    try:
        assert ws.handoff("pause", "@pa").returncode == 0
        for i in (1, 2, 3):
            ws.create("--to", "@pa", "--id", f"p{i}", "--data", "{}")
        ws.create("--to", "@w", "--id", "q1", "--data", '{"mode": "ask"}')
        assert ws.handoffd("run").returncode == 0
        assert ws.doc("q1")["handoffd"]["awaiting"]  # parked, asking
        for i in (1, 2, 3):
            assert ws.handoff("cancel", f"p{i}").returncode == 0
        answered = ws.handoff("answer", "q1", "--data", '"x"')
        assert answered.returncode == 0, answered.stderr

        stats = json.loads(ws.handoff("stats", "--json").stdout)
        by = {a["agent"]: a for a in stats["agents"]}
        pa, w = by["@pa"], by["@w"]
        assert (pa["started"], pa["failed"], pa["errors"]) == (0, 3, {"CANCELLED": 3}), pa
        assert (pa["wait_p50"], pa["wait_p95"], pa["run_p50"], pa["run_p95"]) \
            == (None, None, None, None), pa
        assert w["started"] == 1, w  # q1 ran once; the answer's claim started nothing

        metrics = ws.handoffd("metrics")
        assert metrics.returncode == 0, metrics.stderr
        got = _samples(metrics.stdout)
        pa_label, w_label = (("agent", "@pa"),), (("agent", "@w"),)
        assert (("handoffd_transitions_total", (("agent", "@pa"), ("event", "claimed")))
                not in got)
        assert ("handoffd_queue_wait_seconds_count", pa_label) not in got
        assert ("handoffd_run_seconds_count", pa_label) not in got
        assert got[("handoffd_transitions_total", (("agent", "@pa"), ("event", "cancelled")))] == 3
        assert got[("handoffd_transitions_total", (("agent", "@w"), ("event", "claimed")))] == 1
        assert got[("handoffd_queue_wait_seconds_count", w_label)] == 1

        # the events say what the documents say: a cancel's claim is no attempt
        events = _events(ws.root)
        cancelled = [e for e in events if e["event"] == "cancelled"]
        assert [(e["attempt"], "seconds" in e) for e in cancelled] == [(0, False)] * 3
        assert [e["attempt"] for e in events if e["event"] == "answered"] \
            == [ws.doc("q1")["handoffd"]["attempt"]] == [1]

        # the answered handoff's next run does start its handler again: a start, whose wait
        # counts from the answer (the time the human took is no queue wait)
        assert ws.handoffd("run").returncode == 0
        events = _events(ws.root)
        starts = [e for e in events if e["id"] == "q1" and e["event"] == "claimed"]
        answered_at = next(e["at"] for e in events if e["event"] == "answered")
        assert [e["attempt"] for e in starts] == [1, 2]
        history = ws.doc("q1")["handoffd"]["history"]
        assert [h["event"] for h in history[-3:]] == ["answered", "claimed", "needs_clarification"]
        assert history[-3]["at"] == answered_at and history[-2]["at"] == starts[-1]["at"]
        waited = (parse_iso(starts[-1]["at"]) - parse_iso(answered_at)).total_seconds()
        assert abs(starts[-1]["wait"] - waited) < 0.01
        stats = json.loads(ws.handoff("stats", "--json").stdout)
        assert {a["agent"]: a["started"] for a in stats["agents"]} == {"@pa": 0, "@w": 2}
    finally:
        ws.cleanup()


def test_a_parked_parents_aggregation_is_no_start(tmp_path: Path) -> None:
    """The aggregation files the parent without running its handler: no second start, no
    90 s queue wait, no 91 s run time."""
    clock = Clock()
    engine, backend = parked_family(tmp_path, clock, children=2)
    for child in ("pk.c1", "pk.c2"):
        clock.advance(1)
        job = engine.take(child)
        assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) \
            is State.COMPLETED
    clock.advance(90)
    job = engine.take("pk")
    assert job is not None
    outcome = engine.run(job)
    assert outcome.seconds >= 90  # (the family's time: not the run of any handler)
    assert engine.file(job.claim, job.dialect, job.specialist, outcome) is State.COMPLETED

    events = [e for e in _events(tmp_path) if e["id"] == "pk"]
    assert [e["event"] for e in events] == ["created", "claimed", "delegated", "completed"]
    filed = events[-1]
    assert "seconds" not in filed and filed["attempt"] == backend.get("pk")[1]["handoffd"][
        "attempt"]
    stats = tally(_events(tmp_path))["@dispatcher"]
    assert (stats.started, stats.completed) == (1, 1)
    assert len(stats.waits) == 1 and stats.waits[0] < 90 and stats.runs == []
    workers = tally(_events(tmp_path))["@worker"]  # the children ran: starts and run times
    assert (workers.started, workers.completed, len(workers.runs)) == (2, 2, 2)


def test_an_expired_handoff_is_filed_without_a_start_or_a_run(tmp_path: Path) -> None:
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@w": lambda doc, ctx: {"status": "completed"}})
    engine.submit({"handoff_id": "ex", "source": {"agent_id": "@t"}, "target": {"agent_id": "@w"},
                   "input": {"data": {}}, "expires_at": iso(clock.now.replace(minute=1))})
    clock.advance(300)
    assert engine.take("ex") is None  # filed EXPIRED: "not started"
    state, doc = backend.get("ex")
    assert state is State.FAILED and doc["handoffd"]["final_error"]["code"] == "EXPIRED"
    events = [e for e in _events(tmp_path) if e["id"] == "ex"]
    assert [e["event"] for e in events] == ["created", "failed"]
    assert events[-1]["code"] == "EXPIRED" and "seconds" not in events[-1]
    assert events[-1]["attempt"] == doc["handoffd"]["attempt"]
    stats = tally(_events(tmp_path))["@w"]
    assert (stats.started, stats.failed, stats.waits, stats.runs) == (0, 1, [], [])


def test_a_run_is_still_one_start_with_its_wait_and_run_time(tmp_path: Path) -> None:
    """What the fix keeps: a claim whose handler runs logs `claimed` (at the claim's time,
    with its attempt and queue wait) and its filing's run time."""
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"@w": lambda doc, ctx: {"status": "completed"}})
    engine.submit({"handoff_id": "ok", "source": {"agent_id": "@t"}, "target": {"agent_id": "@w"},
                   "input": {"data": {}}})
    clock.advance(7)
    job = engine.take("ok")
    claimed_at = iso(clock.now)
    clock.advance(2)  # (admission to the handler's start: the event keeps the claim's time)
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.COMPLETED
    events = [e for e in _events(tmp_path) if e["id"] == "ok"]
    assert [e["event"] for e in events] == ["created", "claimed", "completed"]
    assert (events[1]["at"], events[1]["attempt"], events[1]["wait"]) == (claimed_at, 1, 7.0)
    assert "seconds" in events[2] and events[2]["attempt"] == 1
