"""Session 16 (H9): a serving daemon's rescan does not read a handoff waiting for its
requester's answer (needs_clarification / blocked) again while its document is unchanged.

The requester gate holds such a handoff with ``on=()`` (no filing ends its wait): every rescan
(``rescan_seconds``, 5 s by default) still queued each of them to be read and parsed again, for
ever (2,000 waiting: 1.76 s of CPU per 30 s of an idle daemon). Only an answer ends the wait,
and an answer rewrites the document, so clarification registers a quiet check with the scheduler
as pause does (handoffd.features.clarification.attach): a waiter is read again at a rescan only
when its document's stamp changed. ``handoff answer`` resumes it at once (the file watch, or the
daemon's own filing) or at the next rescan at the latest, and so does a hand edit of the document.

The first tests drive one daemon's scheduler by hand (no file watch; starts are recorded, not
run), counting the documents read; the last one runs ``handoffd serve``.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    COUNT_READS,
    PROBE_HANDLERS,
    handlers_workspace,
    probe_count,
    wait_until,
)
from conftest import Workspace as Folder

from handoffd import Daemon, Registry, Workspace, build_engine, new_native_request
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.engine import Engine
from handoffd.features import cancel_requests, clarification


def asker(handoff: Any, ctx: Any) -> dict[str, Any]:
    if ctx.clarifications:
        return {"status": "completed", "output": {"answer": ctx.clarifications[-1]["answer"]}}
    return {"status": "needs_clarification", "questions": ["which one?"]}


def blocker(handoff: Any, ctx: Any) -> dict[str, Any]:
    if ctx.clarifications:
        return {"status": "completed"}
    return {"status": "blocked", "blockers": [{"description": "no GPU",
                                               "resolution_options": ["wait", "use a CPU"]}]}


class Books:
    """Handoffs that asked their requester (run for real by a batch), then a daemon (no file
    watch: only its rescans see changes) whose loop the test steps itself; ``reads`` counts the
    pending documents it reads, ``started`` what it dispatched (recorded, not run)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ws = Workspace(tmp_path / "ws")
        self.ws.ensure()
        self.config = Config(daemon=DaemonSettings(durability="fast"))
        self.registry = Registry()
        self.registry.add_function("@ask", asker, config=self.config)
        self.registry.add_function("@blk", blocker, config=self.config)
        self.engine: Engine = build_engine(self.ws, self.config, self.registry)
        self.monkeypatch = monkeypatch
        self.reads: Counter[str] = Counter()
        self.started: list[tuple[str, str]] = []

    def park(self, asked: int, blocked: int) -> list[str]:
        """Submit the handoffs and run them once (a batch): each asks its requester."""
        ids = [self.submit("@ask") for _ in range(asked)] + \
            [self.submit("@blk") for _ in range(blocked)]
        Daemon(self.engine, watch=False).run_batch()
        assert all(self.awaiting(hid) for hid in ids)
        self.daemon = Daemon(self.engine, watch=False)
        self.books = self.daemon.scheduler
        real_peek = self.engine.peek

        def peek(handoff_id: str) -> Any:
            self.reads[handoff_id] += 1
            return real_peek(handoff_id)

        def record(agent: str, func: Any, handoff_id: str, *args: Any) -> int:
            token = self.books.start(agent)
            self.started.append((handoff_id, func.__name__))
            self.books.finished(token)
            return token

        self.monkeypatch.setattr(self.engine, "peek", peek)
        self.monkeypatch.setattr(self.daemon.dispatcher, "submit", record)
        return ids

    def submit(self, target: str) -> str:
        doc = new_native_request(source="@req", target=target, data={"n": 1},
                                 now=self.engine.clock())
        return self.engine.backend.store.create(doc, doc["handoff_id"])

    def other(self) -> Engine:
        """Another process's engine on the same store (``handoff answer``, ``handoff cancel``):
        what it does reaches this daemon through its rescans only."""
        return build_engine(self.ws, self.config, self.registry)

    def path(self, handoff_id: str) -> Path:
        return self.ws.root / "handoffs" / "pending" / f"{handoff_id}.json"

    def awaiting(self, handoff_id: str) -> bool:
        try:
            doc = json.loads(self.path(handoff_id).read_text())
        except FileNotFoundError:
            return False
        return isinstance(doc.get("handoffd", {}).get("awaiting"), dict)

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
        if hasattr(self, "daemon"):
            self.daemon.pool.shutdown()


@pytest.fixture
def books(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made = Books(tmp_path, monkeypatch)
    yield made
    made.close()


def test_unchanged_waits_for_an_answer_are_not_read_again_at_a_rescan(books: Books) -> None:
    held = books.park(asked=100, blocked=100)
    books.settle()
    assert set(books.books.waiting) == set(held)
    assert [books.rescan() for _ in range(3)] == [0, 0, 0]  # before: 200 each
    assert books.started == []
    assert all(why.startswith(clarification.ASKING) for why in books.books.waiting.values())


def test_an_answer_from_another_process_resumes_at_the_next_rescan(books: Books) -> None:
    asked, blocked = books.park(asked=20, blocked=20)[::20]
    books.settle()
    other = books.other()
    clarification.answer(other, asked, "the left one", by="@req")
    clarification.answer(other, blocked, "use a CPU", by="@req")
    books.reads.clear()
    assert books.rescan() == 2 and set(books.reads) == {asked, blocked}
    assert sorted(books.started) == sorted([(asked, "work"), (blocked, "work")])
    assert asked not in books.books.waiting and asked not in books.books.quiet_stamps


def test_a_hand_edit_of_the_document_is_read_at_the_next_rescan(books: Books) -> None:
    """An edit in place (the same inode): the answer written by hand, the wait removed."""
    held = books.park(asked=10, blocked=0)
    books.settle()
    edited, touched = held[4], held[6]
    doc = json.loads(books.path(edited).read_text())
    doc["handoffd"].pop("awaiting")
    doc["input"]["clarifications"] = [{"answer": "by hand"}]
    with open(books.path(edited), "r+") as file:
        file.write(json.dumps(doc))
        file.truncate()
    books.path(touched).touch()  # changed, and still waiting: read once, then left alone
    books.reads.clear()
    assert books.rescan() == 2 and set(books.reads) == {edited, touched}
    assert books.started == [(edited, "work")]
    assert books.rescan() == 1 and books.reads[touched] == 1  # (edited: recorded, still pending)
    assert books.reads[edited] == 2


def test_a_cancel_request_still_files_a_quiet_waiter(books: Books) -> None:
    """A cancel request is not a change of the document: cancellation's scan hook queues the
    waiter itself, and its gate files it."""
    held = books.park(asked=5, blocked=0)
    books.settle()
    cancel_requests.request(books.other(), held[2], reason="not needed", cascade=False,
                            by="@req", via="test")
    books.rescan()
    assert books.started == [(held[2], "reject")]


def test_without_stamps_every_waiter_is_read_again(books: Books,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that cannot stamp its documents (PostgreSQL) reads them again, as before."""
    books.park(asked=10, blocked=0)
    books.settle()
    store = getattr(books.engine.backend, "inner", books.engine.backend)  # (under the event log)
    monkeypatch.setattr(store, "live_stamps", lambda: None)
    assert books.rescan() == 10 and books.started == []


# ---------------------------------------------------------------- under `handoffd serve`
HANDLERS = PROBE_HANDLERS + COUNT_READS + '''


def asker(handoff, ctx):
    if ctx.clarifications:
        return {"status": "completed", "output": {"answer": ctx.clarifications[-1]["answer"]}}
    return {"status": "needs_clarification", "questions": ["which one?"]}


def blocker(handoff, ctx):
    if ctx.clarifications:
        return {"status": "completed", "output": {"answer": ctx.clarifications[-1]["answer"]}}
    return {"status": "blocked",
            "blockers": [{"description": "no GPU", "resolution_options": ["wait", "CPU"]}]}
'''

CONFIG = """
[daemon]
workers = 2
durability = "fast"
settle_seconds = 0.05
rescan_seconds = 0.25
grace_seconds = 1.0

[specialists."@ask"]
handler = "qw16:asker"

[specialists."@blk"]
handler = "qw16:blocker"

[specialists."@probe"]
handler = "qw16:probe"
"""


def request(hid: str, to: str) -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@qw16"}, "target": {"agent_id": to},
            "input": {"data": {}}}


def awaiting(ws: Folder, hid: str) -> bool:
    try:
        doc = ws.doc(hid)
    except (AssertionError, ValueError):  # (mid-write)
        return False
    return ws.state_of(hid) == ["pending"] and "awaiting" in doc.get("handoffd", {})


def test_a_serving_daemon_leaves_unanswered_handoffs_alone_until_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 handoffs waiting for an answer, a rescan every 0.25 s: a few seconds of rescans read
    almost none of them (before: 300 reads per rescan); `handoff answer` (asked or blocked) and
    a hand edit that answers resume their handoff."""
    ws = handlers_workspace(tmp_path, monkeypatch, "qw16", HANDLERS, CONFIG)
    n = 300
    ids = [(f"ask-{i}", "@ask") if i % 2 else (f"blk-{i}", "@blk") for i in range(n)]
    for hid, to in ids:
        ws.drop(f"{hid}.json", request(hid, to))
    daemon = ws.serve()
    try:
        wait_until(lambda: all(awaiting(ws, hid) for hid, _ in ids), timeout=60,
                   what="every handoff asked its requester")
        deadline = time.monotonic() + 60
        # the first run, the look once parked, and the stamping rescan
        while probe_count(ws, "read") < 3 * n:
            assert time.monotonic() < deadline, "the waiting handoffs were never looked at"
        time.sleep(0.5)
        before = probe_count(ws, "read")
        time.sleep(2.0)  # (some eight rescans)
        during = probe_count(ws, "read") - before
        print(f"{during} reads during ~8 rescans of {n} handoffs waiting for an answer")
        assert during < n // 2, f"{during} reads of unchanged waiting handoffs"
        assert all(awaiting(ws, hid) for hid, _ in ids)
        for hid, answer in (("ask-7", '"the left one"'), ("blk-8", '"CPU"')):
            proc = ws.handoff("answer", hid, "--data", answer, "--as", "@qw16")
            assert proc.returncode == 0, proc.stderr
            assert ws.wait_state(hid, timeout=30) == "completed"
            assert ws.doc(hid)["output"] == {"answer": json.loads(answer)}
        path = ws.root / "handoffs" / "pending" / "ask-9.json"
        doc = json.loads(path.read_text())
        doc["handoffd"].pop("awaiting")  # answered by hand, in place
        doc["input"]["clarifications"] = [{"answer": "by hand"}]
        with open(path, "r+") as file:
            file.write(json.dumps(doc))
            file.truncate()
        assert ws.wait_state("ask-9", timeout=30) == "completed"
        assert ws.doc("ask-9")["output"] == {"answer": "by hand"}
        assert all(awaiting(ws, hid) for hid, _ in ids if hid not in ("ask-7", "blk-8", "ask-9"))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            ws.cleanup()
