"""Review 15 (R6): the scheduler's lines by priority. A backlog held by a rate limit waits in the
specialist's line and is not read again at every token (it kept an idle daemon at a full core
and delayed every other specialist), and the most urgent held handoff takes the token; a
specialist's concurrency line lets out the most urgent first, not the first come.

The first tests drive one daemon's scheduler by hand on a fake monotonic clock (starts are
recorded, not run); the last ones run ``handoffd serve`` and assert counts and orders, and the
idle daemon's CPU time against a generous bound."""
from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Workspace, handlers_workspace
from test_daemon_inprocess import engine_with, submit

from handoffd import Daemon, State
from handoffd.core.settings import Rate
from handoffd.core.timeutil import iso
from handoffd.service import scheduler as scheduler_module

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)


class Books:
    """A daemon whose scheduling steps the test takes itself, on a fake clock (monotonic and
    wall), against a fake token bucket of one token every ``every`` seconds (none: no rate).
    Dispatched work is recorded in ``started``; ``instant`` gives its slot back at once."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, concurrency: int,
                 every: float | None = None, workers: int = 4, instant: bool = True) -> None:
        self.now = 1000.0
        monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: self.now))
        self.engine = engine = engine_with(tmp_path, lambda h, c: {"status": "completed"},
                                           workers=workers, durability="fast")
        engine.clock = lambda: T0 + timedelta(seconds=self.now - 1000.0)
        spec = engine.registry.get("@t")
        spec.config.concurrency = concurrency
        spec.config.rate = Rate(1, every) if every else None
        self.every = every or 0.0
        self.next_token = self.now
        self.steal = 0  # tokens another process takes as they come due
        self.asks = self.peeks = 0
        self.daemon = Daemon(engine, watch=False)
        self.books = self.daemon.scheduler
        self.started: list[str] = []
        self.tokens: dict[str, int] = {}
        self.instant = instant
        real_peek = engine.peek

        def peek(handoff_id: str) -> Any:
            self.peeks += 1
            return real_peek(handoff_id)

        def start_wait(spec: Any) -> float:
            self.asks += 1
            if self.now >= self.next_token:
                self.next_token = self.now + self.every
                if self.steal:
                    self.steal -= 1
                    return self.every
                return 0.0
            return self.next_token - self.now

        def record(agent: str, func: Any, handoff_id: str, *args: Any) -> int:
            token = self.books.start(agent)
            self.started.append(handoff_id)
            self.tokens[handoff_id] = token
            if self.instant:
                self.books.finished(token)
            return token

        monkeypatch.setattr(engine, "peek", peek)
        monkeypatch.setattr(engine, "start_wait", start_wait)
        monkeypatch.setattr(self.daemon.dispatcher, "submit", record)

    def drive(self, seconds: float) -> None:
        """What the daemon's loop does for ``seconds`` of fake time: let out what may go,
        dispatch what is due while a worker is free, else sleep until the next due time."""
        until = self.now + seconds
        books = self.books
        while True:
            with books.cv:
                books.release_parked()
                free = books.running < books.workers
                ready = books.next_ready(self.now) if free else None
                if ready is not None:
                    self.daemon.dispatcher.dispatch_safely(*ready)
                    continue
                wake = books.heap[0][0] if books.heap and free else until
            if wake > until:
                self.now = until
                return
            self.now = max(self.now, wake)
            if self.now >= until and not (books.heap and books.heap[0][0] <= self.now):
                return

    def finish(self, handoff_id: str) -> None:
        with self.books.cv:
            self.books.finished(self.tokens[handoff_id])

    def close(self) -> None:
        self.daemon.pool.shutdown()


@pytest.fixture
def books_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Books] = []

    def make(**kwargs: Any) -> Books:
        made.append(Books(tmp_path, monkeypatch, **kwargs))
        return made[-1]

    yield make
    for books in made:
        books.close()


# ---------------------------------------------------------------- rate limits
def test_a_rate_backlog_is_not_read_again_at_every_token(books_factory: Any) -> None:
    """300 handoffs held by a rate of one a second: after they were read once, each token costs
    a couple of reads and bucket updates (before: every held handoff was read again at every
    token, O(backlog), a full core for a few thousand)."""
    b = books_factory(concurrency=0, every=1.0)
    held = [submit(b.engine, priority="low") for _ in range(300)]
    b.daemon.scan()
    b.drive(0.5)
    assert len(b.started) == 1  # the other 299 wait for the next tokens
    b.peeks = b.asks = 0
    b.drive(10.0)
    assert len(b.started) == 11  # one token a second
    assert b.peeks <= 40 and b.asks <= 40, (b.peeks, b.asks)  # before: peeks ~3,000
    assert set(b.started) <= set(held) and len(set(b.started)) == len(b.started)


def test_the_most_urgent_held_handoff_takes_the_next_token(books_factory: Any) -> None:
    """operations.md: a rate limit holds back the next start, and the most urgent due one goes
    first when the token comes; a token taken by another process meanwhile keeps the order."""
    b = books_factory(concurrency=0, every=1.0)
    lows = [submit(b.engine, priority="low") for _ in range(150)]
    normals = [submit(b.engine, priority="normal") for _ in range(5)]
    b.daemon.scan()
    b.drive(0.5)
    first = list(b.started)
    critical = submit(b.engine, priority="critical")
    b.daemon.notify(critical)
    b.steal = 1  # the token due at 1 s goes to another process
    b.drive(1.4)
    assert b.started == first  # nothing started here: the token was taken elsewhere
    b.drive(0.5)  # the token at 2 s
    assert b.started[len(first)] == critical  # before: a low one from the ready window
    b.drive(len(normals) + 1.5)  # then one a second: the normal ones before any low one
    after = b.started[len(first) + 1:]
    assert len(after) == len(normals) + 1
    waiting = set(normals) - set(first)
    assert set(after[:len(waiting)]) == waiting and after[-1] in lows
    assert all(hid in lows + normals for hid in first)


def test_a_held_handoff_expires_at_its_deadline_not_at_its_turn(books_factory: Any) -> None:
    b = books_factory(concurrency=0, every=60.0)
    for _ in range(5):
        submit(b.engine, priority="critical")
    late = submit(b.engine, priority="low", expires_at=iso(T0 + timedelta(seconds=3)))
    b.daemon.scan()
    b.drive(1.0)
    assert late not in b.started  # held for a token
    b.drive(3.0)  # its deadline: dispatched to be answered EXPIRED, well before its turn
    assert late in b.started and len(b.started) == 2


def test_a_batch_drains_what_its_rate_lets_start(tmp_path: Path) -> None:
    """``handoffd run`` ends once what is due has run: the held handoffs start as the tokens
    come (5/s: a burst of five, then one every 0.2 s), and the batch then ends."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, workers=4,
                         durability="fast")
    engine.registry.get("@t").config.rate = Rate(5, 1.0)
    for _ in range(8):
        submit(engine)
    report = Daemon(engine).run_batch(max_seconds=60)
    assert report.completed == 8 and not report.error


# ---------------------------------------------------------------- concurrency
def test_the_concurrency_line_lets_the_most_urgent_out_first(books_factory: Any) -> None:
    """Concurrency 1: 30 low ones parked behind a running one, then a critical one and two high
    ones: when the slot frees, the critical one goes, then the high ones, then the low ones
    in the order they were read (before: the first come, whatever its priority)."""
    b = books_factory(concurrency=1, instant=False)
    for _ in range(30):
        submit(b.engine, priority="low")
    lows = b.engine.backend.ids(State.PENDING)  # the order the scan reads them in
    b.daemon.scan()
    b.drive(0.1)
    assert len(b.started) == 1 and len(b.books.parked_ids) == 29
    critical = submit(b.engine, priority="critical")
    highs = [submit(b.engine, priority="high") for _ in range(2)]
    for hid in (critical, *highs):
        b.daemon.notify(hid)
    b.drive(0.1)
    assert len(b.started) == 1 and len(b.books.parked_ids) == 32
    for _ in range(5):
        b.finish(b.started[-1])
        b.drive(0.1)
    assert b.started[1:4] == [critical, *highs]
    rest = [hid for hid in lows if hid != b.started[0]]
    assert b.started[4:] == rest[:2]
    assert list(b.books.parked["@t"]) == rest[2:]  # the line, in the order it leaves


def test_a_released_id_that_lost_its_slot_goes_first_among_its_priority(
        books_factory: Any) -> None:
    b = books_factory(concurrency=1, instant=False)
    books = b.books
    a, c, d = (submit(b.engine, priority=p) for p in ("low", "low", "critical"))
    with books.cv:
        books.park("@t", c)
        books.park("@t", a, front=True)
        books.park("@t", d)
        assert list(books.parked["@t"]) == [a, c, d]  # (parked without being read: normal)


# ---------------------------------------------------------------- real processes
HANDLERS = """
import time
def run(handoff, ctx):
    data = ctx.data if isinstance(ctx.data, dict) else {}
    time.sleep(float(data.get("s", 0)))
    return {"status": "completed", "output": {"ok": True}}
"""


def config(slow: str) -> str:
    return f"""
[daemon]
workers = 4
durability = "fast"
rescan_seconds = 5.0

[specialists."@slow"]
handler = "r15h:run"
{slow}

[specialists."@fast"]
handler = "r15h:run"
"""


def request(hid: str, agent: str, priority: str = "normal", seconds: float = 0.0) -> dict:
    return {"handoff_id": hid, "source": {"agent_id": "@test"}, "target": {"agent_id": agent},
            "priority": priority, "input": {"data": {"s": seconds}}}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def claims(ws: Workspace) -> list[str]:
    """The ids claimed so far, in the event log's order."""
    path = ws.root / "handoffs" / ".meta" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e["id"] for e in map(json.loads, filter(None, lines)) if e["event"] == "claimed"]


def test_an_idle_daemon_holding_a_rate_backlog_stays_idle(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 handoffs held by a rate of 10/s: the daemon spends well under a third of a core
    between the tokens (before: a full core, and other specialists waited seconds), and
    another specialist's handoffs go through meanwhile."""
    ws = handlers_workspace(tmp_path, monkeypatch, "r15h", HANDLERS, config('rate = "10/s"'))
    try:
        for i in range(3000):
            ws.drop(f"slow-{i:05d}.json", request(f"slow-{i:05d}", "@slow"))
        daemon = ws.serve()
        time.sleep(3.0)  # it reads the backlog once
        before, began = cpu_seconds(daemon.pid), time.monotonic()
        time.sleep(6.0)
        used, wall = cpu_seconds(daemon.pid) - before, time.monotonic() - began
        assert used < 0.3 * wall, f"{used:.2f}s of CPU in {wall:.1f}s"  # before: ~0.95 * wall
        fast = [f"fast-{i:02d}" for i in range(20)]
        for hid in fast:
            ws.drop(f"{hid}.json", request(hid, "@fast"))
            time.sleep(0.05)
        for hid in fast:
            ws.wait_state(hid, ("completed",), timeout=30)
        assert ws.stop(daemon) == 0
    finally:
        ws.cleanup()


@pytest.mark.parametrize("slow, lows, seconds", [('rate = "5/s"', 1000, 0.0),
                                                 ("concurrency = 1", 40, 0.1)],
                         ids=["rate", "concurrency"])
def test_a_critical_handoff_overtakes_a_held_backlog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     slow: str, lows: int, seconds: float) -> None:
    """Low handoffs held back by the specialist's rate or concurrency, then a critical one: it
    is claimed before more than a few of the low ones (before: every low one still waiting,
    with concurrency 1; 30 to 52 of 1,000 here, 78 of 3,000 or none within two minutes in the
    review, with a rate of 5/s)."""
    ws = handlers_workspace(tmp_path, monkeypatch, "r15h", HANDLERS, config(slow))
    try:
        daemon = ws.serve()
        for i in range(lows):
            ws.drop(f"low-{i:05d}.json", request(f"low-{i:05d}", "@slow", "low", seconds))
        time.sleep(1.5)
        already = len(claims(ws))
        assert already < lows  # the backlog is held
        ws.drop("crit.json", request("crit", "@slow", "critical", seconds))
        ws.wait_state("crit", ("completed",), timeout=60)
        order = claims(ws)
        overtaken = order.index("crit") - already
        assert overtaken <= 3, f"{overtaken} low ones claimed after the critical one came"
        assert ws.stop(daemon) == 0
    finally:
        ws.cleanup()
