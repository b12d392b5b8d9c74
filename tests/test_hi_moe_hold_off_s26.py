"""Seed 000's hard deadline through a hold-off, and one read past the window (session 26).

`timeout_ms` is "Hard timeout; receiver MUST respond before this". 1. A message whose attempt
failed for a passing reason (an OSError, a shortage) is held off (``Scheduler.hold_off``: looked
at again in 5 s, no sooner): the books forgot the deadline read with it, and with slow handlers
holding every worker it sat in line, unread, until the hold-off ended: its TIMEOUT came that
much past its deadline (a 2 s message held off 5 s: about 3 s late). Now a hold-off never looks
at it later than a hard deadline read with it. 2. Every worker busy, each id read past the
64-entry ready window was read again when its turn came; now the first read is kept with it
(up to MAX_BEHIND_PEEKS) and the window takes it as read.
"""
from __future__ import annotations

import re
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from test_hi_moe_behind_window_s25 import AHEAD, ONE_WORKER, fleet, request
from test_hi_moe_deadlines_r40 import HANDLERS, message, wait_for

from handoffd.core.timeutil import parse_iso
from handoffd.service import scheduler as books

# loaded by every Python process of the workspace's daemon (it is on $PYTHONPATH): the first
# claim of msg-h fails with an OSError (as a full disk's would), and says so in a marker file;
# msg-h is held off 20 s (not 5 s): its deadline (6 s) is far enough for a loaded machine to
# make that claim and start the slow handler before it, and the hold-off far enough past it
# to tell the two apart
FAIL_FIRST_CLAIM = '''
import errno, os
from handoffd.core import engine as _engine
from handoffd.service import scheduler as _books

_MARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "msg-h.failed")
_real = _engine.Engine.take

def _take(self, handoff_id, *args, **kwargs):
    if handoff_id == "msg-h" and not os.path.exists(_MARK):
        open(_MARK, "w").close()
        raise OSError(errno.EIO, "injected: the claim of msg-h fails once")
    return _real(self, handoff_id, *args, **kwargs)

_engine.Engine.take = _take
_hold_off = _books.Scheduler.hold_off

def _held(self, handoff_id, delay):
    return _hold_off(self, handoff_id, 20.0 if handoff_id == "msg-h" else delay)

_books.Scheduler.hold_off = _held
'''


@pytest.fixture
def hws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "moe_r40", HANDLERS, ONE_WORKER)
    (tmp_path / "handlers" / "sitecustomize.py").write_text(FAIL_FIRST_CLAIM)
    yield ws
    ws.cleanup()


# ---------------------------------------------------------------- 1. end to end
def test_a_held_off_message_is_answered_at_its_own_deadline(hws: Workspace,
                                                             tmp_path: Path) -> None:
    """msg-h (6 s) is claimed by the free worker, its claim fails (injected OSError: held off
    20 s), then a 30 s handler takes the one worker and 80 seed-001 requests queue behind it:
    msg-h is answered TIMEOUT unrun near its own deadline, while the worker still runs, not
    when its hold-off ends (about 14 s past it)."""
    daemon = hws.serve()
    try:
        hws.drop("msg-h.json", fleet("msg-h", 6000))
        wait_for(lambda: (tmp_path / "handlers" / "msg-h.failed").exists(),
                 "msg-h's claim failed", timeout=20)
        hws.drop("hold.json", message("hold", 60000, sleep=30))
        queued = [f"a{n:03d}" for n in range(AHEAD)]
        for hid in queued:
            hws.drop(f"{hid}.json", request(hid))
        assert hws.wait_state("msg-h", ("completed", "failed"), timeout=40) == "failed"
        still = hws.state_of("hold")
    finally:
        assert hws.stop(daemon) == 0
    assert still == ["in-progress"], still  # (answered while every worker was busy)
    answer = hws.doc("msg-h")
    payload = answer["payload"]
    assert payload["status"] == "timeout", payload
    found = re.search(r"was not started before its deadline (\S+) ", payload["error_detail"])
    assert found, payload
    deadline = parse_iso(found.group(1))
    history = answer["handoffd"]["history"]
    answered = max(parse_iso(event["at"]) for event in history)
    # its own deadline, within generous bounds (the hold-off alone would end ~14 s past it)
    assert timedelta(0) <= answered - deadline < timedelta(seconds=8), (answered, deadline)
    events = [event["event"] for event in history]
    assert events.count("claimed") == 1 and "started" not in events, events


# ---------------------------------------------------------------- the books, on fake clocks
class Monotonic:
    """The scheduler module's ``time``, moved by hand (only ``monotonic`` is read there)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def books_on_clocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                    ) -> Iterator[tuple[Any, Clock, Monotonic, list[str]]]:
    """A one-worker daemon's scheduler (its worker free), its engine's wall clock and its
    monotonic clock both moved by hand, and the ids its engine reads, in order."""
    from handoffd import Daemon
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"ROUTING_DISPATCHER": lambda doc, ctx: {},
                                                "python-lora": lambda doc, ctx: {},
                                                "@busy": lambda doc, ctx: {}})
    reads: list[str] = []
    peek = engine.peek

    def counted(handoff_id: str) -> Any:
        reads.append(handoff_id)
        return peek(handoff_id)

    engine.peek = counted  # type: ignore[method-assign]
    scheduler = Daemon(engine, workers=1, watch=False).scheduler
    mono = Monotonic()
    monkeypatch.setattr(books, "time", mono)
    with scheduler.cv:
        yield scheduler, clock, mono, reads


def queue(scheduler: Any, mono: Monotonic, docs: list[dict[str, Any]]) -> None:
    """Submit ``docs`` and queue them in this order, a millisecond apart."""
    for doc in docs:
        scheduler.engine.submit(doc)
        mono.now += 0.001
        scheduler.notify(doc.get("handoff_id") or doc["id"])


def advance(clock: Clock, mono: Monotonic, seconds: float) -> float:
    """Move both clocks on; the monotonic time now."""
    clock.advance(seconds)
    mono.now += seconds
    return mono.now


@pytest.mark.parametrize("where", ["behind the window", "handed out"])
def test_a_hold_off_never_outlasts_a_hard_deadline_read_with_it(
        books_on_clocks: tuple[Any, Clock, Monotonic, list[str]], where: str) -> None:
    """A 3 s message held off for 5 s (its attempt failed for a passing reason) while every
    worker is busy, read past a full window or handed out before: answered at its deadline,
    not at the end of the hold-off; nothing read again before then."""
    scheduler, clock, mono, reads = books_on_clocks
    deadline = clock() + timedelta(seconds=3)  # (its arrival: submitted now)
    if where == "handed out":
        queue(scheduler, mono, [message("m-h", 3000)])
        ready = scheduler.next_ready(mono.now)
        assert ready is not None and ready[0] == "m-h"  # (its claim fails: held off)
        scheduler.start("ROUTING_DISPATCHER")
        queue(scheduler, mono, [request(f"a{n:03d}") for n in range(books.READY_WINDOW + 10)])
    else:
        scheduler.start("@busy")
        queue(scheduler, mono, [request(f"a{n:03d}") for n in range(books.READY_WINDOW)]
              + [message("m-h", 3000)])
    arrived = scheduler.first_seen.get("m-h")
    later = advance(clock, mono, 1.0)  # (the running task is old enough)
    while scheduler.heap and scheduler.heap[0][0] <= later:  # (64 a turn)
        assert scheduler.look_ahead(later) == []
    assert "m-h" in reads and (arrived is None or scheduler.first_seen["m-h"] == arrived)
    scheduler.hold_off("m-h", 5.0)
    count = reads.count("m-h")
    assert scheduler.look_ahead(advance(clock, mono, 1.0)) == []
    assert reads.count("m-h") == count  # (held off: not read before its deadline)
    assert scheduler.look_ahead(advance(clock, mono, 1.01)) == [("m-h", deadline)]
    assert reads.count("m-h") == count + 1  # read once, at its deadline
    assert "m-h" not in scheduler.queued


def test_a_hold_off_past_the_deadline_keeps_its_floor(
        books_on_clocks: tuple[Any, Clock, Monotonic, list[str]]) -> None:
    """A message held off once its deadline has passed (its answer's own write failed) is
    looked at again only when the hold-off ends: never at once, again and again."""
    scheduler, clock, mono, _ = books_on_clocks
    queue(scheduler, mono, [message("m-h", 3000)])
    assert scheduler.next_ready(mono.now) is not None
    advance(clock, mono, 4.0)
    scheduler.hold_off("m-h", 5.0)
    assert scheduler.queued["m-h"] == pytest.approx(mono.now + 5.0)


def test_an_id_read_past_the_window_is_read_once(
        books_on_clocks: tuple[Any, Clock, Monotonic, list[str]]) -> None:
    """With every worker busy, each due id past the full window is read there once and taken
    into the window as read when its turn comes (a minute-long message among them too): every
    id read once in all, handed out in turn."""
    scheduler, clock, mono, reads = books_on_clocks
    scheduler.start("@busy")
    # as many behind the window as their reads are kept (the window's worth, with the message)
    ids = [f"a{n:03d}" for n in range(books.READY_WINDOW + books.MAX_BEHIND_PEEKS - 1)]
    docs = [request(hid) for hid in ids]
    docs.insert(books.READY_WINDOW + 30, message("m-long", 60000))
    queue(scheduler, mono, docs)
    later = advance(clock, mono, 1.0)
    for _ in range(10):  # (64 a turn: one or two turns read them all)
        assert scheduler.look_ahead(later) == []
    assert not scheduler.heap and len(scheduler.behind) == len(docs) - books.READY_WINDOW
    assert set(scheduler.behind_at) == {"m-long"}
    scheduler.finished(next(iter(scheduler.inflight)))  # the worker is free: the rest, in turn
    handed = []
    while (ready := scheduler.next_ready(later)) is not None:
        handed.append(ready[0])
    assert [hid for hid in handed if hid != "m-long"] == ids and "m-long" in handed
    assert Counter(reads) == Counter(handed), [hid for hid, n in Counter(reads).items() if n > 1]
    assert not scheduler.behind_peeks


def test_the_reads_kept_past_the_window_are_bounded(
        books_on_clocks: tuple[Any, Clock, Monotonic, list[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most MAX_BEHIND_PEEKS reads are kept past the window (the first ones): the ids
    beyond them are read again in their turn, as before."""
    monkeypatch.setattr(books, "MAX_BEHIND_PEEKS", 5)
    scheduler, clock, mono, reads = books_on_clocks
    scheduler.start("@busy")
    ids = [f"a{n:03d}" for n in range(books.READY_WINDOW + 20)]
    queue(scheduler, mono, [request(hid) for hid in ids])
    later = advance(clock, mono, 1.0)
    scheduler.look_ahead(later)
    scheduler.look_ahead(later)
    assert len(scheduler.behind_peeks) == 5
    scheduler.finished(next(iter(scheduler.inflight)))
    while scheduler.next_ready(later) is not None:
        pass
    twice = sorted(hid for hid, n in Counter(reads).items() if n == 2)
    assert twice == ids[books.READY_WINDOW + 5:] and max(Counter(reads).values()) == 2
