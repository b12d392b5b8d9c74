"""A read the scheduler kept is never what decides a run (review R47, session 26).

The scheduler reads each due document once into its 64-entry ready window (and, every worker
busy, up to 64 past it: ``behind_peeks``) and dispatched it as read. Another process that
rewrote it meanwhile (its failed attempt requeued with a 60 s back-off) went unseen: its folder
event found the id queued already, nothing voided the read, and the claim dropped the new
``next_attempt_at`` unchecked: the handler ran 49 s early. 1. A claim to run a handoff checks
the retry time of the document it claimed (its own read) and gives it back untouched when it is
still to come (NotDue). 2. A hint about an id read already voids that read. 3. A hard deadline
read into the window is reckoned from the clocks at its read, not at the loop turn's start.
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, run_python, wait_until
from test_backend_conformance import LEASE, add, at, backend, claim  # noqa: F401 (a fixture)
from test_hi_moe_behind_window_s25 import request
from test_hi_moe_deadlines_r40 import message
from test_hi_moe_hold_off_s26 import Monotonic, advance, books_on_clocks, queue  # noqa: F401

from handoffd.backends import Backend
from handoffd.core.errors import NotDue
from handoffd.core.timeutil import parse_iso
from handoffd.service import scheduler as books

Books = tuple[Any, Clock, Monotonic, list[str]]

HANDLERS = '''
import os

def gate(doc, ctx):
    """Holds the one worker until the test drops handlers/release (a minute at most)."""
    mark = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release")
    for _ in range(3000):
        if os.path.exists(mark) or ctx.cancelled.wait(0.02):
            break
    return {"status": "completed", "output": {"done": True}}

def noop(doc, ctx):
    return {"status": "completed", "output": {"done": True}}
'''

# loaded by every Python process of the workspace (on $PYTHONPATH): the daemon's reads of the
# watched ids are written down, so the test rewrites them only once the daemon holds a read
NOTE_READS = '''
import os
from handoffd.core import engine as _engine

_NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peeked")
_real = _engine.Engine.peek

def _peek(self, handoff_id):
    if handoff_id in ("q010", "q066"):
        with open(_NOTES, "a") as notes:
            notes.write(handoff_id + "\\n")
    return _real(self, handoff_id)

_engine.Engine.peek = _peek
'''

CONFIG = """
[daemon]
workers = 1
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 60
grace_seconds = 2.0
durability = "fast"

[specialists."@gate"]
handler = "r47:gate"

[specialists."@busy"]
handler = "r47:noop"
"""

# the other process of the workspace: claims each id and requeues it, its attempt failed, with
# a back-off of argv[2] seconds (as a daemon's retry policy does)
REQUEUE = """
import sys
from datetime import timedelta
from handoffd.cli.basics import engine
eng = engine(sys.argv[1])
for hid in ("q010", "q066"):
    job = eng.take(hid)
    assert job is not None, hid
    eng.requeue(job.claim, job.dialect, "retry_scheduled", count_attempt=True,
                due_at=eng.clock() + timedelta(seconds=float(sys.argv[2])))
    print(hid, eng.get(hid)[1]["handoffd"]["next_attempt_at"])
"""
BACK_OFF = 8.0  # seconds: past the drain of the 75 no-op handoffs once the gate opens


@pytest.fixture
def rws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "r47", HANDLERS, CONFIG)
    (tmp_path / "handlers" / "sitecustomize.py").write_text(NOTE_READS)
    yield ws
    ws.cleanup()


# ---------------------------------------------------------------- 1. end to end
def test_a_back_off_set_by_another_process_is_kept(rws: Workspace, tmp_path: Path) -> None:
    """The one worker held, 75 handoffs queue behind it; the daemon reads q010 (in the ready
    window) and q066 (past it). Another process claims both, and their attempts fail: back in
    pending/ with an 8 s back-off. Once the worker is free, neither is run before its
    next_attempt_at, nor with an attempt spent or a hand-back recorded by the daemon's
    refused claim: each is run once, at its retry time."""
    handlers = tmp_path / "handlers"
    daemon = rws.serve()
    try:
        rws.drop("gate.json", {"handoff_id": "gate", "source": {"agent_id": "@tests"},
                               "target": {"agent_id": "@gate"}, "input": {"data": {}}})
        wait_until(lambda: rws.state_of("gate") == ["in-progress"], 20, "the gate runs")
        for n in range(75):
            rws.drop(f"q{n:03d}.json", request(f"q{n:03d}"))
        notes = handlers / "peeked"
        wait_until(lambda: notes.exists() and {"q010", "q066"} <= set(notes.read_text().split()),
                   30, "the daemon has read q010 and q066")
        other = run_python(REQUEUE, str(rws.root), str(BACK_OFF))
        assert other.returncode == 0, other.stderr[-2000:]
        due = {hid: parse_iso(at) for hid, at in (line.split() for line in
                                                  other.stdout.splitlines())}
        (handlers / "release").touch()
        for hid in ("q010", "q066", "q074"):
            assert rws.wait_state(hid, timeout=60) == "completed", hid
    finally:
        assert rws.stop(daemon) == 0
    for hid in ("q010", "q066"):
        history = rws.doc(hid)["handoffd"]["history"]
        events = [event["event"] for event in history]
        assert events.count("claimed") == 2 and "handed_back" not in events, (hid, events)
        last_claim = [e for e in history if e["event"] == "claimed"][-1]
        assert last_claim["detail"]["attempt"] == 2, (hid, history)
        assert parse_iso(last_claim["at"]) >= due[hid], (hid, due[hid], history)


# ---------------------------------------------------------------- 1. the claim, every store
def test_a_claim_to_run_refuses_a_document_not_due(backend: Backend) -> None:  # noqa: F811
    """A claim with ``due_only`` of a document whose own next_attempt_at is still to come
    raises NotDue and leaves it pending as it was (no attempt, no event, no lease); once it is
    due, the claim takes it (the attempt counted once)."""
    add(backend, "r1")
    held = claim(backend, "r1")
    assert backend.requeue(held, held.doc, at(60), count_attempt=True)
    before = backend.get("r1")
    with pytest.raises(NotDue) as refused:
        backend.claim("r1", at(10), LEASE, due_only=True)
    assert refused.value.due_at == at(60)
    assert backend.get("r1") == before  # (state and document: untouched)
    again = backend.claim("r1", at(60), LEASE, due_only=True)
    assert again is not None and again.attempt == 2


def test_a_forged_retry_time_holds_no_claim_back(tmp_path: Path) -> None:
    """A foreign producer's document carrying its own ``next_attempt_at`` (bookkeeping that is
    not ours: emptied at its claim) is claimed to run at once."""
    from test_backend_conformance import make_backend, request_doc
    store = make_backend("files", tmp_path)
    try:
        doc = request_doc("f1")
        doc["handoffd"] = {"next_attempt_at": "2099-01-01T00:00:00Z"}
        pending = tmp_path / "handoffs" / "pending"
        pending.mkdir(parents=True, exist_ok=True)
        (pending / "f1.json").write_text(json.dumps(doc))
        got = store.claim("f1", at(0), LEASE, due_only=True)
        assert got is not None and got.attempt == 1
    finally:
        store.close()


# ---------------------------------------------------------------- 2. a hint voids a kept read
@pytest.mark.parametrize("where", ["in the window", "behind it"])
def test_a_hint_voids_the_read_of_a_rewritten_document(books_on_clocks: Books,  # noqa: F811
                                                        where: str) -> None:
    """Every worker busy, the window and what lies past it read; another process requeues one
    of them with a 60 s back-off, and its folder event comes: the id is read again before it
    is handed out (seen with its retry time), in its turn, every other read kept."""
    scheduler, clock, mono, reads = books_on_clocks
    scheduler.start("@busy")
    ids = [f"a{n:03d}" for n in range(books.READY_WINDOW + 10)]
    queue(scheduler, mono, [request(hid) for hid in ids])
    later = advance(clock, mono, 1.0)
    for _ in range(4):
        scheduler.look_ahead(later)
    victim = ids[10] if where == "in the window" else ids[books.READY_WINDOW + 2]
    assert victim in (scheduler.readied if where == "in the window" else scheduler.behind_peeks)
    engine = scheduler.engine
    job = engine.take(victim)  # (another daemon of the workspace: its attempt fails)
    assert job is not None
    engine.requeue(job.claim, job.dialect, "retry_scheduled", count_attempt=True,
                   due_at=clock() + timedelta(seconds=60))
    scheduler.notify(victim)  # its folder event
    scheduler.finished(next(iter(scheduler.inflight)))
    seen = {}
    while (ready := scheduler.next_ready(later)) is not None:
        seen[ready[0]] = ready[1]
    assert set(seen) == set(ids)
    assert seen[victim].due_at == clock() + timedelta(seconds=60)
    assert reads.count(victim) == 2 and all(reads.count(hid) == 1 for hid in ids
                                            if hid != victim)


# ---------------------------------------------------------------- 3. deadlines as of the read
@pytest.mark.parametrize("where", ["in the window", "behind it"])
def test_a_hard_deadline_is_reckoned_from_its_read(books_on_clocks: Books,  # noqa: F811
                                                    where: str) -> None:
    """Reads take time (10 ms each here, both clocks moving on): a 3 s message read after the
    requests queued ahead of it keeps its true deadline, not one early by the turn's reads
    (which had a message held off till then started just before its deadline)."""
    scheduler, clock, mono, _ = books_on_clocks
    engine = scheduler.engine
    peek = engine.peek

    def slow_read(handoff_id: str) -> Any:
        advance(clock, mono, 0.01)
        return peek(handoff_id)

    engine.peek = slow_read
    ahead = books.READY_WINDOW + (5 if where == "behind it" else -30)
    if where == "behind it":
        scheduler.start("@busy")
    queue(scheduler, mono, [request(f"a{n:03d}") for n in range(ahead)])
    queue(scheduler, mono, [message("m", 3000)])
    true_deadline = mono.now + 3.0  # (its arrival: submitted then)
    if where == "behind it":
        later = advance(clock, mono, 0.5)
        scheduler.look_ahead(later)
        scheduler.look_ahead(mono.now)
        assert scheduler.behind_at["m"][1] == pytest.approx(true_deadline)
    else:
        scheduler.next_ready(mono.now)  # (the window filled: the message handed out first)
    assert scheduler.deadline_at["m"] == pytest.approx(true_deadline)
