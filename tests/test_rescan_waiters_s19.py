"""Session 19 (F3): an idle daemon re-read and re-gated every dependency waiter at every rescan.

A rescan (every ``rescan_seconds``) queued every waiter to be looked at again, for what other
processes may have filed: 20,000 handoffs depending on one unfinished handoff were each read, and
that one handoff looked up 20,000 times, every 5 s (an idle daemon at 35 s of CPU a minute; a new
handoff dropped meanwhile waited seconds behind them). Now a rescan stamps each distinct id a
waiter waits for once (``Backend.stamp_of``) and the waiters' documents in one listing
(``Backend.live_stamps``), and queues a waiter only when one of those changed since its wait was
read; those go by turns with new work; every five minutes each waiter is looked at in full.

The first tests drive one daemon's scheduler by hand on a fake clock, over the memory store given
stamps as the files store makes them (starts are recorded, not run), counting reads, gate checks
and stamps per rescan; the last one runs ``handoffd serve`` and files a dependency from outside.
"""
from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import (
    COUNT_READS,
    PROBE_HANDLERS,
    SPECIALISTS,
    Clock,
    handlers_workspace,
    probe_count,
    wait_until,
)

from handoffd import Daemon, Registry, State, build_engine, new_native_request
from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.storage import LiveStamp
from handoffd.core.workspace import Workspace
from handoffd.service import quiet
from handoffd.service import scheduler as scheduler_module


class StampedMemory(MemoryBackend):
    """The memory store with stamps that change with any change of a handoff's state or
    document (as the files store's do); ``stamped`` counts the stamps asked of each id."""

    def __init__(self) -> None:
        super().__init__()
        self.stamped: Counter[str] = Counter()

    def _stamp(self, handoff_id: str) -> LiveStamp | None:
        entry = self._entries.get(handoff_id)
        if entry is None:
            return None
        text = json.dumps([entry.state.value, entry.doc], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).digest(), 0

    def live_stamps(self) -> dict[str, LiveStamp | None]:
        with self._lock:
            return {hid: self._stamp(hid) for hid, entry in self._entries.items()
                    if entry.state in (State.PENDING, State.IN_PROGRESS)}

    def stamp_of(self, handoff_id: str) -> LiveStamp | None:
        self.stamped[handoff_id] += 1
        with self._lock:
            return self._stamp(handoff_id)

    def rewrite(self, handoff_id: str, data: Any) -> None:
        """Another program rewrites a pending document's ``input.data`` (in place)."""
        with self._lock:
            self._entries[handoff_id].doc["input"]["data"] = data


def done(handoff: Any, ctx: Any) -> dict[str, Any]:
    return {"status": "completed"}


class Books:
    """A daemon (no file watch: only its rescans see other processes' changes) on ``backend``,
    whose loop the test steps on a fake monotonic and wall clock. ``peeks`` and ``gates`` count
    the documents read and gate checks; ``started`` records what was dispatched (id, what for).
    Handoffs for ``@far`` have no specialist here: another process runs them."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 backend: MemoryBackend) -> None:
        self.now = 1000.0
        monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: self.now))
        ws = Workspace(tmp_path / "ws")
        ws.ensure()
        config = Config(daemon=DaemonSettings(durability="fast", expectations="advisory"))
        registry = Registry()
        registry.add_function("@w", done, config=config, concurrency=4)
        self.backend = backend
        self.clock = Clock()
        self.engine = build_engine(ws, config, registry, clock=self.clock, backend=backend)
        self.daemon = Daemon(self.engine, watch=False)
        self.books = self.daemon.scheduler
        self.peeks: Counter[str] = Counter()
        self.gates: Counter[str] = Counter()
        self.started: list[tuple[str, str]] = []
        real_peek, real_gate = self.engine.peek, self.engine.gate

        def peek(handoff_id: str) -> Any:
            self.peeks[handoff_id] += 1
            return real_peek(handoff_id)

        def gate(peek: Any) -> Any:
            self.gates[peek.handoff_id] += 1
            return real_gate(peek)

        def record(agent: str, func: Any, handoff_id: str, *args: Any) -> int:
            token = self.books.start(agent)
            self.started.append((handoff_id, func.__name__))
            self.books.finished(token)
            return token

        monkeypatch.setattr(self.engine, "peek", peek)
        monkeypatch.setattr(self.engine, "gate", gate)
        monkeypatch.setattr(self.daemon.dispatcher, "submit", record)

    def drop(self, handoff_id: str, target: str = "@w", depends_on: list[str] | None = None) -> str:
        """Store a request as a foreign producer would (no creation check)."""
        doc = new_native_request(source="@test", target=target, data={}, now=self.clock(),
                                 handoff_id=handoff_id, depends_on=depends_on)
        self.backend.create(doc, handoff_id, self.clock())
        return handoff_id

    def elsewhere(self, handoff_id: str, state: State | None = State.COMPLETED) -> None:
        """Another process claims ``handoff_id`` and (unless ``state`` is None) files it: this
        daemon's engine is not told, only its rescans can see it."""
        claim = self.backend.claim(handoff_id, self.clock(), 60)
        assert claim is not None
        if state is not None:
            assert self.backend.finish(claim, state, claim.doc)

    def rescan(self) -> tuple[int, int]:
        """One rescan and the looks it queued: (documents read, gate checks)."""
        peeks, gates = sum(self.peeks.values()), sum(self.gates.values())
        self.daemon.scan()
        self.drain()
        return sum(self.peeks.values()) - peeks, sum(self.gates.values()) - gates

    def drain(self) -> list[str]:
        """Hand out and dispatch what is due now; returns the ids in the order handed out."""
        order = []
        books = self.books
        with books.cv:
            while (ready := books.next_ready(self.now)) is not None:
                order.append(ready[0])
                self.daemon.dispatcher.dispatch_safely(*ready)
        return order

    def settle(self) -> None:
        """Two rescans: the first look at each handoff, then one that finds them settled (a
        waiter read once is no longer looked at again: test_operator_s22 counts the reads)."""
        self.rescan()
        self.rescan()

    def close(self) -> None:
        self.daemon.pool.shutdown()


@pytest.fixture
def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Books] = []

    def build(backend: MemoryBackend | None = None) -> Books:
        made.append(Books(tmp_path / str(len(made)), monkeypatch, backend or StampedMemory()))
        return made[-1]

    yield build
    for books in made:
        books.close()


def test_an_unchanged_dependency_backlog_costs_one_stamp_per_rescan(make: Any) -> None:
    """300 waiters on one unfinished dependency: a rescan stamps that dependency once and
    reads and gates none of them (before: 300 reads, 300 gate checks, 300 lookups of it)."""
    b = make()
    b.drop("dep", "@far")
    waiters = [b.drop(f"w{i:03d}", depends_on=["dep"]) for i in range(300)]
    b.settle()
    assert set(b.books.waiting) == set(waiters)
    b.backend.stamped.clear()
    assert [b.rescan() for _ in range(3)] == [(0, 0)] * 3
    assert b.backend.stamped == Counter({"dep": 3})
    assert b.started == []


def test_only_the_waiters_of_what_changed_are_gated_again(make: Any) -> None:
    """Ten dependencies, 30 waiters each: another process completes one; the next rescan gates
    its 30 waiters (and starts them), the other 270 not; each dependency stamped once."""
    b = make()
    deps = [b.drop(f"d{k}", "@far") for k in range(10)]
    groups = {dep: [b.drop(f"{dep}-w{i:02d}", depends_on=[dep]) for i in range(30)]
              for dep in deps}
    b.settle()
    b.elsewhere("d3")
    b.backend.stamped.clear()
    assert b.rescan() == (30, 30)
    assert b.backend.stamped == Counter({dep: 1 for dep in deps})
    assert sorted(hid for hid, _ in b.started) == groups["d3"]
    assert {what for _, what in b.started} == {"work"}


def test_a_dependency_failed_elsewhere_fails_its_waiters_at_the_next_rescan(make: Any) -> None:
    b = make()
    b.drop("dep", "@far")
    waiters = [b.drop(f"w{i}", depends_on=["dep"]) for i in range(20)]
    b.settle()
    b.elsewhere("dep", State.FAILED)
    b.rescan()
    assert sorted(b.started) == sorted((hid, "reject") for hid in waiters)


def test_a_claim_elsewhere_or_a_rewritten_waiter_is_looked_at_again(make: Any) -> None:
    """Any change of what the wait names (here: claimed by another process, still unfinished)
    queues its waiters once; a waiter whose own document changed is read again alone."""
    b = make()
    b.drop("dep", "@far")
    waiters = [b.drop(f"w{i}", depends_on=["dep"]) for i in range(20)]
    b.settle()
    b.elsewhere("dep", None)  # in progress elsewhere
    assert b.rescan() == (20, 20)
    assert b.rescan() == (0, 0) and b.started == []
    b.backend.rewrite(waiters[7], {"n": 2})  # another program rewrites one waiter's document
    b.peeks.clear()
    assert b.rescan() == (1, 1) and set(b.peeks) == {waiters[7]}
    assert b.rescan() == (0, 0)


def test_new_work_is_not_held_behind_a_rescans_rechecks(make: Any) -> None:
    """200 waiters queued again by a rescan (their dependency was claimed elsewhere) and a new
    handoff arriving just after: it is handed out second (before: after all 200)."""
    b = make()
    b.drop("dep", "@far")
    for i in range(200):
        b.drop(f"w{i:03d}", depends_on=["dep"])
    b.settle()
    b.elsewhere("dep", None)
    b.daemon.scan()
    b.drop("new")
    b.daemon.notify("new")  # (what the file watch does for a new document)
    order = b.drain()
    assert "new" in order[:2], order.index("new")
    assert len(order) == 201 and ("new", "work") in b.started


def test_rechecks_go_by_turns_with_a_stream_of_new_work(make: Any) -> None:
    b = make()
    b.drop("dep", "@far")
    waiters = {b.drop(f"w{i:02d}", depends_on=["dep"]) for i in range(10)}
    b.settle()
    b.elsewhere("dep", None)
    b.daemon.scan()
    order = []
    with b.books.cv:
        for i in range(10):  # a new handoff is due at every turn: the rechecks still go
            b.drop(f"n{i}")
            b.daemon.notify(f"n{i}")
            ready = b.books.next_ready(b.now)
            assert ready is not None
            order.append(ready[0])
            b.daemon.dispatcher.dispatch_safely(*ready)
    assert len(waiters & set(order)) >= 4, order


def test_every_waiter_is_looked_at_in_full_every_five_minutes(make: Any) -> None:
    """A failure elsewhere of a dependency the wait does not name (the 19th of 21: the wait
    names the last, and watches the first unfinished one and 16 after it) is not seen by the
    stamps; the full re-check five minutes on reads every dependency, and fails the waiter."""
    b = make()
    deps = [b.drop(f"d{k:02d}", "@far") for k in range(21)]
    b.drop("w", depends_on=deps)
    b.settle()
    assert b.books.waits_on["w"] == frozenset({"d20"})
    b.elsewhere("d18", State.FAILED)
    assert b.rescan() == (0, 0)  # (before: gated at every rescan, reading d00 and d20)
    b.now += quiet.FULL_RECHECK_SECONDS - 1
    b.clock.advance(quiet.FULL_RECHECK_SECONDS - 1)
    assert b.rescan() == (0, 0) and b.started == []
    b.now += 2
    b.clock.advance(2)
    assert b.rescan() == (1, 1)
    assert b.started == [("w", "reject")]


def test_without_stamps_every_waiter_is_gated_at_each_rescan(make: Any) -> None:
    """A store that gives no stamps (the plain memory store) keeps the old
    guarantee the old way: every waiter is looked at again at each rescan."""
    b = make(MemoryBackend())
    b.drop("dep", "@far")
    for i in range(30):
        b.drop(f"w{i}", depends_on=["dep"])
    b.settle()
    assert b.rescan() == (30, 30)
    b.elsewhere("dep")
    b.rescan()
    assert len(b.started) == 30


def test_a_batch_is_not_done_while_rechecks_are_queued(make: Any) -> None:
    b = make()
    b.drop("dep", "@far")
    b.drop("w", depends_on=["dep"])
    b.settle()
    b.elsewhere("dep")
    b.daemon.scan()
    with b.books.cv:
        assert list(b.books.rechecks) == ["w"] and b.books.due_soon()
    b.drain()
    assert b.started == [("w", "work")] and not b.books.due_soon()


# ---------------------------------------------------------------- under `handoffd serve`
HANDLERS = PROBE_HANDLERS + COUNT_READS + '''


def done(handoff, ctx):
    return {"status": "completed"}
'''

CONFIG = """
[daemon]
workers = 2
durability = "fast"
settle_seconds = 0.05
rescan_seconds = 0.25
grace_seconds = 1.0
expectations = "advisory"

[specialists."@w"]
handler = "rw19:done"

[specialists."@probe"]
handler = "rw19:probe"
"""


def request(hid: str, to: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@rw19"}, "target": {"agent_id": to},
            "input": {"data": {}}, **extra}


def test_a_serving_daemon_leaves_waiters_alone_until_another_process_files_their_dependency(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """200 handoffs waiting for ``done`` and 100 for ``gone`` (both for a specialist of another
    host), a rescan every 0.25 s: rescans read almost none of them (before: 300 a rescan). A
    foreign consumer writes completed/done.json, `handoff cancel gone` fails the other: each
    releases (or fails) its waiters within a few rescans."""
    ws = handlers_workspace(tmp_path, monkeypatch, "rw19", HANDLERS, CONFIG)
    ws.drop("done.json", request("done", "@far"))
    ws.drop("gone.json", request("gone", "@far"))
    waiters = {f"w{i:03d}": "done" if i % 3 else "gone" for i in range(300)}
    for hid, dep in waiters.items():
        ws.drop(f"{hid}.json", request(hid, "@w", depends_on=[dep]))
    daemon = ws.serve()
    try:
        deadline = time.monotonic() + 60
        # the first look, and the stamping rescan's
        while probe_count(ws, "read") < 2 * len(waiters):
            assert time.monotonic() < deadline, "the waiters were never looked at"
        time.sleep(0.5)
        before = probe_count(ws, "read")
        time.sleep(2.0)  # (some eight rescans)
        during = probe_count(ws, "read") - before
        print(f"{during} reads during ~8 rescans of {len(waiters)} dependency waiters")
        assert during < len(waiters) // 2, f"{during} reads of unchanged waiters"
        doc = ws.doc("done")
        doc["status"] = "completed"
        done_path = ws.root / "handoffs" / "completed" / "done.json"
        done_path.write_text(json.dumps(doc))  # a foreign consumer files it
        (ws.root / "handoffs" / "pending" / "done.json").unlink()
        proc = ws.handoff("cancel", "gone", "--reason", "not needed")
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: all(ws.state_of(hid) == ["completed" if dep == "done" else "failed"]
                               for hid, dep in waiters.items()),
                   timeout=60, what="every waiter released or failed")
        assert ws.doc("w000")["error"]["code"] == "DEPENDENCY_MISSING"
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ws.cleanup()


@pytest.mark.heavy
@pytest.mark.timeout(300)  # a dozen CLI start-ups against PostgreSQL: slow on a loaded machine
def test_on_postgresql_a_dependency_another_process_ends_reaches_its_waiters(
        tmp_path: Path, pg_url: str) -> None:
    """On the PostgreSQL store (stamps from each row's xmin since session 20) a dependency another process completes (here a second
    host's daemon) or cancels (`handoff cancel`) releases or fails its waiters at a rescan.
    Two waiters per dependency show that every waiter (not just the first) is reached; more only
    add CLI start-ups (R28: 24 of them took up to 82 s under load)."""
    from test_postgres import pg_workspace
    space = pg_workspace(tmp_path / "ws", pg_url)
    other = pg_workspace(tmp_path / "other", pg_url, specialists=False)
    with open(other.root / "handoffd.toml", "a") as config:  # the host that runs @other
        config.write(f'\n[specialists."@other"]\ncommand = ["{sys.executable}", "-S", '
                     f'"{SPECIALISTS / "flaky.py"}"]\n')
    try:
        space.serve()
        done = space.create("--from", "@t", "--to", "@other", "--data", '{"mode": "ok"}')
        gone = space.create("--from", "@t", "--to", "@other")
        waiters = {space.create("--from", "@t", "--to", "@flaky", "--depends-on", dep,
                                "--data", '{"mode": "ok"}'): dep
                   for dep in (done, gone) for _ in range(2)}
        time.sleep(1.5)  # (the waiters looked at and held, past a rescan)
        assert space.handoff("cancel", gone).returncode == 0
        other.serve()
        for hid, dep in waiters.items():
            proc = space.handoff("wait", hid, "--timeout", "30")
            assert proc.returncode == (0 if dep == done else 1), (hid, proc.stdout, proc.stderr)
        failed = next(hid for hid, dep in waiters.items() if dep == gone)
        shown = json.loads(space.handoff("show", failed, "--json", check=True).stdout)
        assert shown["document"]["error"]["code"] == "DEPENDENCY_MISSING"
    finally:
        for host in (space, other):
            for proc in host.daemons:
                proc.send_signal(signal.SIGTERM)
            for proc in host.daemons:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    host.cleanup()
