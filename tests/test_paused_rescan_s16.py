"""Session 16 (H6): a serving daemon's rescan does not read a paused handoff again while its
document is unchanged.

Every rescan (``rescan_seconds``, 5 s by default) queued every waiter to be looked at again: with
5,000 handoffs of a paused specialist, 5,000 documents read and parsed every 5 s, for ever (2.1 s
of CPU per 30 s of an idle daemon). Now a paused waiter is read again at a rescan only when the
stamp of its document (inode, size, mtime, ctime) changed since the rescan that last read it; a
resume queues it (the pause feature's scan hook), and a producer's rewrite is seen by its stamp.

The first tests drive one daemon's scheduler by hand (starts are recorded, not run), counting the
documents read; the last one runs ``handoffd serve``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import PROBE_HANDLERS, handlers_workspace, probe_count, wait_until

from handoffd import Daemon, Registry, Workspace, build_engine, new_native_request
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.engine import Engine
from handoffd.features import pause
from handoffd.features.pause import pauses_of


def handler(handoff: Any, ctx: Any) -> dict[str, Any]:
    return {"status": "completed"}


class Books:
    """A daemon (no file watch: only its rescans see changes) whose loop the test steps itself;
    ``reads`` counts the pending documents it reads, ``started`` what it dispatched to run."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pause, "CACHE_SECONDS", -1.0)  # a pause or resume is seen at once
        ws = Workspace(tmp_path / "ws")
        ws.ensure()
        config = Config(daemon=DaemonSettings(durability="fast"))
        registry = Registry()
        for agent in ("@t", "@u"):
            registry.add_function(agent, handler, config=config)
        self.engine: Engine = build_engine(ws, config, registry)
        self.daemon = Daemon(self.engine, watch=False)
        self.books = self.daemon.scheduler
        self.reads: Counter[str] = Counter()
        self.started: list[str] = []
        real_peek = self.engine.peek

        def peek(handoff_id: str) -> Any:
            self.reads[handoff_id] += 1
            return real_peek(handoff_id)

        def record(agent: str, func: Any, handoff_id: str, *args: Any) -> int:
            token = self.books.start(agent)
            self.started.append(handoff_id)
            self.books.finished(token)
            return token

        monkeypatch.setattr(self.engine, "peek", peek)
        monkeypatch.setattr(self.daemon.dispatcher, "submit", record)

    def submit(self, target: str = "@t", **extra: Any) -> str:
        doc = new_native_request(source="@test", target=target, data={"n": 1},
                                 now=self.engine.clock())
        doc.update(extra)
        return self.engine.backend.store.create(doc, doc["handoff_id"])

    def path(self, handoff_id: str) -> Path:
        return self.engine.ws.root / "handoffs" / "pending" / f"{handoff_id}.json"

    def rescan(self) -> int:
        """One rescan and the looks it queued; returns how many documents were read."""
        before = sum(self.reads.values())
        self.daemon.scan()
        books = self.books
        with books.cv:
            while (ready := books.next_ready(time.monotonic())) is not None:
                self.daemon.dispatcher.dispatch_safely(*ready)
        return sum(self.reads.values()) - before

    def settle(self) -> None:
        """The first look at each handoff, then the rescan that reads each once more to record
        its stamp (a read before the rescan's stamp may have seen an older document)."""
        self.rescan()
        self.rescan()

    def close(self) -> None:
        self.daemon.pool.shutdown()


@pytest.fixture
def books(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made = Books(tmp_path, monkeypatch)
    yield made
    made.close()


def test_an_unchanged_paused_backlog_is_not_read_again_at_a_rescan(books: Books) -> None:
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    held = [books.submit() for _ in range(200)]
    books.settle()
    assert set(books.books.waiting) == set(held)
    assert [books.rescan() for _ in range(3)] == [0, 0, 0]  # before: 200 each
    assert books.started == []  # nothing runs while paused


def test_a_workspace_pause_is_not_read_again_either(books: Books) -> None:
    pauses_of(books.engine).set(pause.ALL, paused=True, by="@test")
    held = [books.submit(target) for target in ("@t", "@u") * 20]
    books.settle()
    assert books.rescan() == 0 and books.started == []
    pauses_of(books.engine).set(pause.ALL, paused=False, by="@test")
    books.rescan()
    assert sorted(books.started) == sorted(held)


def test_a_paused_handoff_rewritten_under_its_name_is_read_again(books: Books) -> None:
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    held = [books.submit() for _ in range(20)]
    books.settle()
    replaced, in_place = held[3], held[7]
    # a producer replaces one (a new file, renamed over it), still for the paused specialist
    doc = json.loads(books.path(replaced).read_text())
    doc["input"]["data"] = {"n": 2}
    tmp = books.path(replaced).with_name(".replaced.part")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, books.path(replaced))
    books.reads.clear()
    assert books.rescan() == 1 and books.reads[replaced] == 1
    assert books.started == [] and replaced in books.books.waiting  # still paused
    # another rewrites one in place (the same inode), now for a specialist that is not paused
    doc = json.loads(books.path(in_place).read_text())
    doc["target"]["agent_id"] = "@u"
    doc["input"]["data"] = {"n": 22}
    with open(books.path(in_place), "r+") as file:
        file.write(json.dumps(doc))
        file.truncate()
    books.reads.clear()
    books.rescan()
    assert books.started == [in_place]  # it runs at the rescan that saw it change
    books.reads.clear()
    books.rescan()  # (the recorded start left it pending: it is read again, the rest is not)
    assert set(books.reads) == {in_place}


def test_a_resume_starts_the_backlog_at_the_next_rescan(books: Books) -> None:
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    held = [books.submit() for _ in range(50)]
    books.settle()
    assert books.rescan() == 0
    pauses_of(books.engine).set("@t", paused=False, by="@test")
    books.rescan()
    assert sorted(books.started) == sorted(held)
    assert not books.books.waiting and not books.books.quiet_stamps


def test_paused_again_after_a_resume_they_are_read_once_more_then_left(books: Books) -> None:
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    books.submit()
    books.settle()
    pauses_of(books.engine).set("@t", paused=False, by="@test")
    books.rescan()
    assert len(books.started) == 1  # (recorded, not run: it stays pending)
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    later = [books.submit() for _ in range(5)]
    books.settle()
    assert books.rescan() == 0 and len(books.started) == 1
    assert set(books.books.waiting) == set(later) | set(books.started)


def test_without_stamps_every_paused_handoff_is_read_again(books: Books,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that cannot stamp its documents (PostgreSQL: none; a listing failing with EMFILE)
    reads them again at each rescan, as before: never a wait that a rewrite cannot end."""
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    for _ in range(10):
        books.submit()
    books.settle()
    store = getattr(books.engine.backend, "inner", books.engine.backend)  # (under the event log)
    monkeypatch.setattr(store, "live_stamps", lambda: None)
    assert books.rescan() == 10

    def fail() -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(store, "live_stamps", fail)
    assert books.rescan() == 10 and books.started == []


def test_a_failing_quiet_check_reads_them_again(books: Books) -> None:
    """A feature's check that raises (its records unreadable) never stops the rescan: the
    waiters are read again, their gates saying why."""
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    for _ in range(5):
        books.submit()
    books.settle()

    def broken(handoff_id: str) -> bool:
        raise OSError(5, "Input/output error")

    books.books.quiet_checks.insert(0, broken)
    assert books.rescan() == 5 and books.started == []


def test_other_waiters_are_read_again_once_what_they_wait_on_changes(books: Books) -> None:
    """A dependency another process may file reaches this daemon only through a rescan: a
    rescan stamps what the waiters wait on (session 19: it re-read every waiter at every
    rescan, 35 s of CPU a minute for 20,000 of them) and reads a waiter again once that
    changed, not while nothing did."""
    pauses_of(books.engine).set("@t", paused=True, by="@test")
    first = books.submit("@t")
    waiter = books.submit("@u", depends_on=[first])
    books.settle()
    assert waiter in books.books.waiting
    books.reads.clear()
    books.rescan()
    books.rescan()
    assert books.reads[waiter] == 0 and books.reads[first] == 0
    doc = json.loads(books.path(first).read_text())  # changed by another process
    doc["priority"] = "high"
    books.path(first).write_text(json.dumps(doc))
    books.rescan()
    assert books.reads[waiter] == 1


# ---------------------------------------------------------------- under `handoffd serve`
HANDLERS = PROBE_HANDLERS + '''
import handoffd.features.pause as _pause

_why = _pause.Pauses.why


def why(self, agent):
    COUNTS["pause"] += 1
    return _why(self, agent)


_pause.Pauses.why = why


def fast(handoff, ctx):
    return {"status": "completed", "output": {"ok": True}}
'''

CONFIG = """
[daemon]
workers = 2
durability = "fast"
settle_seconds = 0.05
rescan_seconds = 0.25
grace_seconds = 1.0

[specialists."@slow"]
handler = "pr16:fast"

[specialists."@fast"]
handler = "pr16:fast"

[specialists."@probe"]
handler = "pr16:probe"
"""


def request(hid: str, to: str) -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@pr16"}, "target": {"agent_id": to},
            "input": {"data": {}}}


def test_a_serving_daemon_leaves_an_unchanged_paused_backlog_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 paused handoffs, a rescan every 0.25 s: after the first looks, a few seconds of
    rescans ask the pause gate almost nothing (before: 300 looks per rescan); a producer's
    rewrite for another specialist runs, and a resume starts the rest."""
    ws = handlers_workspace(tmp_path, monkeypatch, "pr16", HANDLERS, CONFIG)
    n = 300
    assert ws.handoff("pause", "@slow").returncode == 0
    for i in range(n):
        ws.drop(f"slow-{i}.json", request(f"slow-{i}", "@slow"))
    daemon = ws.serve()
    try:
        deadline = time.monotonic() + 60
        # the first look at each, and the rescan that stamps it
        while probe_count(ws, "pause") < 2 * n:
            assert time.monotonic() < deadline, "the paused handoffs were never looked at"
        before = probe_count(ws, "pause")
        time.sleep(2.0)  # (some eight rescans)
        during = probe_count(ws, "pause") - before
        print(f"pause gate asked {during} times during ~8 rescans of {n} paused handoffs")
        assert during < n // 2, f"{during} looks at unchanged paused handoffs"
        assert all(ws.state_of(f"slow-{i}") == ["pending"] for i in range(n))
        ws.drop("slow-7.json", request("slow-7", "@fast"))  # rewritten under its name
        assert ws.wait_state("slow-7", timeout=30) == "completed"
        assert ws.handoff("resume", "@slow").returncode == 0
        wait_until(lambda: all(ws.state_of(f"slow-{i}") == ["completed"] for i in range(n)),
                   timeout=60, what="the resumed backlog ran")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ws.cleanup()
