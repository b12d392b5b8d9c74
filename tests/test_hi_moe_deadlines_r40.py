"""Seed 000's hard deadline: two cases review R40 found (session 24).

`timeout_ms` is "Hard timeout; receiver MUST respond before this". 1. After `handoff cancel`
and `handoff retry --force`, the deadline counted from before the retry: the scheduler kept the
stamp of when it first saw the message pending (forgotten only at a full rescan or its own
filing) and admission took the earlier of it and the retry, so msg-h (12 s) was answered
TIMEOUT 7.7 s early, 4 s after the retry. 2. While every worker was busy, a pending message was
not even read: claimed when a worker was free, its deadline counted from then, and run (R40's
msg-h, 3 s, answered success 12 s past its deadline).
"""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from dialect_examples import HI_MOE_ARCHITECT_TO_DISPATCHER, fresh

from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET

from handoffd.core.states import State
from handoffd.core.timeutil import iso, parse_iso

HANDLERS = '''
def slow(doc, ctx):
    """Works task_data.sleep seconds (ended early when its attempt is)."""
    ctx.cancelled.wait((ctx.data.get("task_data") or {}).get("sleep", 0))
    return {"status": "completed", "output": {"done": True}}
'''

CONFIG = """
[daemon]
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 60
grace_seconds = 2.0
durability = "fast"

[specialists."ROUTING_DISPATCHER"]
handler = "moe_r40:slow"
concurrency = 1
"""

BUSY_CONFIG = """
[daemon]
workers = 2
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 60
grace_seconds = 2.0
durability = "fast"

[specialists."ROUTING_DISPATCHER"]
handler = "moe_r40:slow"

[specialists."python-lora"]
handler = "moe_r40:slow"
"""


@pytest.fixture
def mws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "moe_r40", HANDLERS, CONFIG)
    yield ws
    ws.cleanup()


def message(msg_id: str, timeout_ms: int, sleep: float = 0) -> dict[str, Any]:
    """The seed's own Architect -> Dispatcher example (000_1), re-addressed."""
    doc = fresh(HI_MOE_ARCHITECT_TO_DISPATCHER)
    doc["id"] = msg_id
    doc["payload"]["timeout_ms"] = timeout_ms
    doc["payload"]["task_data"]["sleep"] = sleep
    return doc


def wait_for(predicate: Any, what: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not {what} in {timeout}s")


# ---------------------------------------------------------------- 1: counted from a retry
def test_a_retried_message_counts_its_deadline_from_the_retry(tmp_path: Path) -> None:
    """R40's msg-h: seen pending (and its deadline armed), cancelled, retried 5 s later: its
    12 s count from the retry, in the scheduler and in admission alike."""
    from handoffd import Daemon
    from handoffd.features.cancel_family import cancel
    from handoffd.service.sweeper import requeue_failed
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {}})
    engine.submit(message("msg-h", 12000))
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    peek = engine.peek("msg-h")
    assert peek is not None
    seen = clock()
    assert scheduler.deadline("msg-h", peek) == seen + timedelta(seconds=12)  # (stamped)
    clock.advance(1)
    cancel(engine, "msg-h", reason="changed my mind")
    assert engine.get("msg-h")[0] is State.FAILED
    clock.advance(5)
    retried = clock()
    requeue_failed(engine, "msg-h", force=True)
    # `handoff cancel` and `handoff retry` ran in other processes: the daemon heard of
    # neither filing, and keeps its stamp until its next full rescan
    scheduler.first_seen["msg-h"] = seen
    peek = engine.peek("msg-h")
    assert peek is not None
    assert scheduler.deadline("msg-h", peek) == retried + timedelta(seconds=12)
    clock.advance(4)  # where R40's was answered TIMEOUT: it runs
    job = engine.take("msg-h", arrived=scheduler.first_seen.get("msg-h"))
    assert job is not None and job.deadline == retried + timedelta(seconds=12)


def test_a_retried_message_is_answered_at_its_deadline_from_the_retry(mws: Workspace) -> None:
    """R40's repro with a real daemon, shortened: the specialist's one slot held by a 20 s
    handler, msg-h (3 s) dropped and parked, cancelled, retried --force a second later: its
    TIMEOUT answer names the deadline 3 s after the retry (it was answered at once, its
    deadline counted from when the daemon first saw it, before the cancel)."""
    daemon = mws.serve()
    try:
        # (20 s: the slot must still be held 3 s after the retry, however slow the commands
        # before it run on a loaded machine; the stop ends the handler early)
        mws.drop("msg-hold.json", message("msg-hold", 60000, sleep=20))
        wait_for(lambda: mws.state_of("msg-hold") == ["in-progress"], "msg-hold started")
        mws.drop("msg-h.json", message("msg-h", 3000))
        time.sleep(0.5)  # (the daemon sees it, parks it and arms its deadline)
        assert mws.state_of("msg-h") == ["pending"]
        mws.handoff("cancel", "msg-h", check=True)
        assert mws.wait_state("msg-h", ("failed",)) == "failed"
        time.sleep(1.0)
        mws.handoff("retry", "msg-h", "--force", check=True)
        assert mws.wait_state("msg-h", ("completed", "failed")) == "failed"
    finally:
        assert mws.stop(daemon) == 0
    answer = mws.doc("msg-h")
    retried = [e for e in answer["handoffd"]["history"] if e["event"] == "retried"]
    assert len(retried) == 1, answer["handoffd"]["history"]
    payload = answer["payload"]
    assert payload["status"] == "timeout", payload
    deadline = parse_iso(retried[0]["at"]) + timedelta(seconds=3)
    assert f"was not started before its deadline {iso(deadline)}" in payload["error_detail"], \
        payload


def test_a_throttled_message_keeps_its_earlier_arrival(tmp_path: Path) -> None:
    """R39's case stays: without a retry, the earlier of the daemon's stamp and the history's
    first event wins (a throttle put it back in pending/)."""
    from handoffd import Daemon
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {
        "status": "throttled", "retry_after_seconds": 60}})
    engine.submit(message("m-back", 3000))
    arrived = clock()
    job = engine.take("m-back")
    assert job is not None
    clock.advance(2)
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    peek = engine.peek("m-back")
    assert peek is not None
    assert scheduler.deadline("m-back", peek) == arrived + timedelta(seconds=3)
    clock.advance(1)
    assert engine.take("m-back", arrived=scheduler.first_seen.get("m-back")) is None
    state, doc = engine.get("m-back")
    assert state is State.FAILED and doc["payload"]["status"] == "timeout"


# ---------------------------------------------------------------- 2: every worker busy
@pytest.mark.parametrize("workers", [1, 2])
def test_a_message_is_answered_at_its_deadline_while_every_worker_is_busy(
        mws: Workspace, workers: int) -> None:
    """R40's repro, shortened: every worker held by an 8 s handler, then the seed's Dispatcher
    -> Fleet example (2 s): answered TIMEOUT unrun while they still run (it was claimed once
    one finished, its deadline counted from then, and run: answered success)."""
    mws.write_config(BUSY_CONFIG.replace("workers = 2", f"workers = {workers}"))
    holders = [f"msg-hold{n}" for n in range(workers)]
    daemon = mws.serve()
    try:
        for hid in holders:
            mws.drop(f"{hid}.json", message(hid, 60000, sleep=8))
        wait_for(lambda: all(mws.state_of(hid) == ["in-progress"] for hid in holders),
                 "every worker busy")
        doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
        doc["id"] = "msg-h"
        doc["payload"]["timeout_ms"] = 2000
        mws.drop("msg-h.json", doc)
        assert mws.wait_state("msg-h", ("completed", "failed"), timeout=20) == "failed"
        still = [mws.state_of(hid) for hid in holders]  # (answered before a worker was free)
        for hid in holders:
            assert mws.wait_state(hid, ("completed",), timeout=20) == "completed"
    finally:
        assert mws.stop(daemon) == 0
    assert still == [["in-progress"]] * workers, still
    answer = mws.doc("msg-h")
    payload = answer["payload"]
    assert payload["status"] == "timeout", payload
    assert "was not started before its deadline" in payload["error_detail"], payload
    events = [e["event"] for e in answer["handoffd"]["history"]]
    assert "claimed" in events and "started" not in events, events


def test_the_look_ahead_answers_only_hard_deadlines_when_they_pass(tmp_path: Path) -> None:
    """The scheduler's books, on the injectable clock: with its one worker busy, a due hi_moe
    message is read (its arrival stamped then) and handed out for its TIMEOUT answer only once
    its deadline passed; a seed 001 request read with it has none, and waits for a worker."""
    from handoffd import Daemon
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {},
                                                "@x": lambda doc, ctx: {}})
    engine.submit(message("m-busy", 3000))
    engine.submit({"handoff_id": "n-busy", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@x"}, "input": {"data": {}}})
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    with scheduler.cv:
        scheduler.start("ROUTING_DISPATCHER")  # (every worker busy)
        scheduler.notify("m-busy")
        scheduler.notify("n-busy")
        later = time.monotonic() + 1.0  # (the running task is old enough)
        assert scheduler.look_ahead(later) == []
        assert set(scheduler.ahead) == {"m-busy"} and scheduler.readied == {"m-busy", "n-busy"}
        assert scheduler.first_seen["m-busy"] == clock()
        clock.advance(3)
        overdue = scheduler.look_ahead(later + 3)
        assert overdue == [("m-busy", scheduler.first_seen["m-busy"] + timedelta(seconds=3))]
        assert scheduler.readied == {"n-busy"} and not scheduler.ahead
