"""Seed 000's hard deadline behind a full ready window (session 25).

`timeout_ms` is "Hard timeout; receiver MUST respond before this". With every worker busy, the
loop read due handoffs into its 64-entry ready window and answered the hi_moe messages there
TIMEOUT at their deadline (review R40), but a message behind more than 64 due handoffs was not
even read: claimed when its turn came, and a dropped one, its deadline counted from then, run
(one worker held 15 s, 80 seed-001 requests ahead, a 2 s message: answered success 14 s later).
The messages read into the window while a worker was free were not watched either.
"""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh
from test_hi_moe_deadlines_r40 import BUSY_CONFIG, HANDLERS, message, wait_for

from handoffd.service import scheduler as books

ONE_WORKER = BUSY_CONFIG.replace("workers = 2", "workers = 1") + """
[specialists."@busy"]
handler = "moe_r40:slow"
"""
AHEAD = 80  # due handoffs queued ahead of the message: more than the window's 64


@pytest.fixture
def bws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "moe_r40", HANDLERS, ONE_WORKER)
    yield ws
    ws.cleanup()


def request(hid: str) -> dict[str, Any]:
    """A seed-001 request for the busy specialist (its handler returns at once)."""
    return {"handoff_id": hid, "source": {"agent_id": "@tests"}, "target": {"agent_id": "@busy"},
            "input": {"data": {}}}


def fleet(msg_id: str, timeout_ms: int) -> dict[str, Any]:
    """The seed's Dispatcher -> Fleet example (python-lora), re-addressed."""
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"] = msg_id
    doc["payload"]["timeout_ms"] = timeout_ms
    return doc


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("ahead", ["seed-001", "hi_moe"])
def test_a_message_behind_the_window_is_answered_at_its_deadline(bws: Workspace,
                                                                 ahead: str) -> None:
    """The one worker held by a 10 s handler, 80 due handoffs queued for it (seed-001
    requests, or hi_moe messages with a minute each), then a 2 s message: answered TIMEOUT
    unrun while the worker still runs, the 80 untouched (it was claimed after all of them, and
    run: answered success)."""
    daemon = bws.serve()
    try:
        bws.drop("hold.json", message("hold", 60000, sleep=10))
        wait_for(lambda: bws.state_of("hold") == ["in-progress"], "the worker busy")
        queued = [f"a{n:03d}" for n in range(AHEAD)]  # (named to list before msg-h)
        for hid in queued:
            bws.drop(f"{hid}.json", request(hid) if ahead == "seed-001" else message(hid, 60000))
        time.sleep(0.5)  # (the daemon sees them first: due before msg-h)
        bws.drop("msg-h.json", fleet("msg-h", 2000))
        assert bws.wait_state("msg-h", ("completed", "failed"), timeout=20) == "failed"
        still = bws.state_of("hold")  # (answered before the worker was free)
        untouched = [hid for hid in queued if bws.state_of(hid) == ["pending"]]
    finally:
        assert bws.stop(daemon) == 0
    assert still == ["in-progress"], still
    assert untouched == queued
    answer = bws.doc("msg-h")
    payload = answer["payload"]
    assert payload["status"] == "timeout", payload
    assert "was not started before its deadline" in payload["error_detail"], payload
    events = [e["event"] for e in answer["handoffd"]["history"]]
    assert events.count("claimed") == 1 and "started" not in events, events


# ---------------------------------------------------------------- the books
@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[Any, Clock, list[str]]]:
    """A one-worker daemon's scheduler with its worker busy, on the injectable clock, and the
    ids its engine reads (in order)."""
    from handoffd import Daemon
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {},
                                                "@busy": lambda doc, ctx: {}})
    reads: list[str] = []
    peek = engine.peek

    def counted(handoff_id: str) -> Any:
        reads.append(handoff_id)
        return peek(handoff_id)

    engine.peek = counted  # type: ignore[method-assign]
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    with scheduler.cv:
        scheduler.start("ROUTING_DISPATCHER")
        yield scheduler, clock, reads


def queue(scheduler: Any, docs: list[dict[str, Any]]) -> None:
    """Submit ``docs`` and queue them in this order (each due after the one before)."""
    for doc in docs:
        scheduler.engine.submit(doc)
        scheduler.notify(doc.get("handoff_id") or doc["id"])
        time.sleep(0.001)  # (notify stamps the monotonic clock: keep their order strict)


def test_the_look_ahead_reads_past_a_full_window_once(busy: tuple[Any, Clock, list[str]]) -> None:
    """Past a full window, each due id is read once (READY_WINDOW a turn) and keeps its turn;
    the hi_moe message among them is answered only once its deadline passed, and only it; a
    look with nothing new reads nothing."""
    scheduler, clock, reads = busy
    ahead = 2 * books.READY_WINDOW + 10
    queue(scheduler, [request(f"a{n:03d}") for n in range(ahead)] + [message("m-late", 3000)])
    later = time.monotonic() + 1.0  # (the running task is old enough)
    assert scheduler.look_ahead(later) == []  # the window, and 64 past it
    assert len(scheduler.ready) == books.READY_WINDOW and not scheduler.behind_at
    assert len(reads) == 2 * books.READY_WINDOW
    assert scheduler.ahead_at(later) <= later  # (more to read: the loop comes back at once)
    assert scheduler.look_ahead(later) == []  # the rest past it
    assert set(scheduler.behind_at) == {"m-late"} and scheduler.first_seen["m-late"] == clock()
    assert sorted(reads) == sorted({*reads}) and len(reads) == ahead + 1
    assert scheduler.ahead_at(later) == pytest.approx(later + 3, abs=0.05)
    assert scheduler.look_ahead(later + 1) == []  # (at rest: nothing read again)
    assert len(reads) == ahead + 1
    clock.advance(3)
    overdue = scheduler.look_ahead(later + 3)
    assert overdue == [("m-late", scheduler.first_seen["m-late"] + timedelta(seconds=3))]
    assert "m-late" not in scheduler.queued and not scheduler.behind_at
    assert len(reads) == ahead + 2  # (read again at its deadline: it may have changed)
    scheduler.finished(next(iter(scheduler.inflight)))  # the worker is free: the rest, in turn
    handed = []
    while (ready := scheduler.next_ready(later + 4)) is not None:
        handed.append(ready[0])
    assert handed == [f"a{n:03d}" for n in range(ahead)]


def test_a_message_taken_in_turn_is_never_answered_from_behind(
        busy: tuple[Any, Clock, list[str]]) -> None:
    """A message read past the window and handed to a worker before its deadline (it runs)
    is not answered TIMEOUT at it; nor one gone from pending/ meanwhile."""
    scheduler, clock, _ = busy
    queue(scheduler, [request(f"a{n:03d}") for n in range(books.READY_WINDOW)]
          + [message("m-taken", 3000), message("m-gone", 3000)])
    later = time.monotonic() + 1.0
    scheduler.look_ahead(later)
    assert set(scheduler.behind_at) == {"m-taken", "m-gone"}
    scheduler.finished(next(iter(scheduler.inflight)))
    handed = []
    while (ready := scheduler.next_ready(later)) is not None and ready[0] != "m-taken":
        handed.append(ready[0])  # (the window refills from behind: m-taken's priority is 1)
    assert ready is not None and handed == ["a000"] and "m-gone" in scheduler.behind_at
    scheduler.start("python-lora")  # m-taken runs
    job = scheduler.engine.take("m-gone")  # claimed elsewhere
    assert job is not None
    clock.advance(3)
    assert scheduler.look_ahead(later + 3) == []
    assert not scheduler.behind_at and not scheduler.ahead


def test_the_deadlines_kept_behind_the_window_are_bounded(
        busy: tuple[Any, Clock, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_BEHIND_DEADLINES deadlines are kept past the window; reading pauses there
    (the rest stay queued, unread) and goes on once one has been answered."""
    monkeypatch.setattr(books, "MAX_BEHIND_DEADLINES", 2)
    scheduler, clock, reads = busy
    queue(scheduler, [request(f"a{n:03d}") for n in range(books.READY_WINDOW)]
          + [message(f"m{n}", 3000 + 1000 * n) for n in range(4)])
    later = time.monotonic() + 1.0
    scheduler.look_ahead(later)
    assert set(scheduler.behind_at) == {"m0", "m1"} and "m2" not in reads
    assert scheduler.ahead_at(later) == pytest.approx(later + 3, abs=0.05)  # (no read due)
    clock.advance(3)
    assert [hid for hid, _ in scheduler.look_ahead(later + 3)] == ["m0"]
    assert scheduler.look_ahead(later + 3) == []  # m2 is read now (m3 waits for room)
    assert set(scheduler.behind_at) == {"m1", "m2"} and "m3" not in reads
    assert len(scheduler.deadlines_behind) <= 2 * 2 + books.READY_WINDOW


def test_messages_read_while_a_worker_was_free_are_watched_too(
        busy: tuple[Any, Clock, list[str]]) -> None:
    """Messages read into the window when a worker took one (then busy again) are answered at
    their deadline: only those read while every worker was busy were."""
    scheduler, clock, _ = busy
    scheduler.finished(next(iter(scheduler.inflight)))
    queue(scheduler, [message(f"m{n}", 3000) for n in range(3)])
    ready = scheduler.next_ready(time.monotonic())
    assert ready is not None and ready[0] == "m0"
    scheduler.start("ROUTING_DISPATCHER")  # m0 runs: every worker busy again
    later = time.monotonic() + 1.0
    assert scheduler.look_ahead(later) == []
    clock.advance(3)
    assert sorted(hid for hid, _ in scheduler.look_ahead(later + 3)) == ["m1", "m2"]
