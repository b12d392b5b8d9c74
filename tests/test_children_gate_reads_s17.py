"""The children gate reads a finished child's document once, not at every look (session 17).

A parked parent is looked at each time one of its open children is filed, and the gate read and
parsed every child's whole document at every look: a family of N children cost about N²/2 reads
of finished children over its life (60 children answering 1 MiB, two at a time for 0.5 s each:
1,129 reads of finished ones, 6.0 s of the daemon's CPU in the gate; now 300 and 1.9 s). Now a finished child's facts are kept under the stamp of its stored copies
(``Backend.stamp_of``: its files' inode, size, mtime and ctime) and read again only when that
changes: a retry, a filing again, its file replaced.

The memory keeps only what changed at least 2 s before a look (a write in the same timestamp tick
keeps a stamp); these tests set the installed memory's clock 10 s ahead, so that the children
they have just filed count as settled.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, handlers_workspace

from handoffd import Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.engine import Engine
from handoffd.features import children_gate as gates
from handoffd.service.sweeper import requeue_failed

N = 12  # children of the counted family
FAILS: Counter[str] = Counter()  # child id -> failures still to answer


def boss(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Delegates ``n`` children to @leaf with ``aggregation``."""
    data = ctx.data or {}
    return {"status": "delegated", "aggregation": data.get("aggregation", "all_success"),
            "delegate": [{"to": "@leaf", "data": {"n": n}} for n in range(data.get("n", N))]}


def leaf(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """An output of 20 KB; fails while ``FAILS`` says so for this child."""
    if FAILS[ctx.handoff_id] > 0:
        FAILS[ctx.handoff_id] -= 1
        return {"status": "failed", "error": {"code": "FLAKY", "message": "not this time"}}
    return {"status": "completed", "output": {"blob": "x" * 20_000}}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """A files-store engine with @boss and @leaf, whose children gate's memory (when it has
    one) takes what was filed just now as settled."""
    FAILS.clear()
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(durability="fast"), retry=RetryPolicy(max_retries=0))
    registry = Registry()
    for agent, func in (("@boss", boss), ("@leaf", leaf)):
        registry.add_function(agent, func, config=config, isolate="never")
    built = build_engine(ws, config, registry)
    kind = gates.FinishedChildren
    for gate in built.gates:
        owner = getattr(gate, "__self__", None)
        if isinstance(owner, kind):
            owner.clock = lambda: time.time() + 10
    yield built


def process(engine: Engine, handoff_id: str) -> State:
    """Claim, run and file one handoff, as a daemon's worker does."""
    job = engine.take(handoff_id)
    assert job is not None, handoff_id
    return engine.file(job.claim, job.dialect, job.specialist, engine.run(job))


def park(engine: Engine, hid: str, **data: Any) -> list[str]:
    """Submit a @boss parent and run it: it parks with its children; their ids."""
    doc = new_native_request(source="@test", target="@boss", data=data, now=engine.clock(),
                             handoff_id=hid)
    assert engine.submit(doc) == hid
    assert process(engine, hid) is State.PENDING
    children: list[str] = engine.get(hid)[1]["handoffd"]["waiting_children"]["children"]
    return children


class Reads:
    """The child documents a look reads (``engine.get``), by id, each found finished."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = engine
        self.finished: Counter[str] = Counter()
        self.counting = False
        real = engine.get

        def get(handoff_id: str) -> tuple[State, dict[str, Any]]:
            found = real(handoff_id)
            if self.counting and found[0].terminal:
                self.finished[handoff_id] += 1
            return found

        monkeypatch.setattr(engine, "get", get)

    def look(self, parent: str) -> Any:
        """The engine's gates on the pending ``parent``, as the scheduler asks them; the
        verdict is the one a gate that reads every child gives."""
        peek = self.engine.peek(parent)
        assert peek is not None and peek.doc is not None
        self.counting = True
        try:
            verdict = self.engine.gate(peek)
        finally:
            self.counting = False
        fresh = gates.children_gate(self.engine, peek.envelope, peek.doc)
        assert (verdict and (verdict.action, verdict.reason, verdict.on)) == \
            (fresh and (fresh.action, fresh.reason, fresh.on))
        return verdict


def test_a_finished_child_is_read_once_across_the_looks(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    children = park(engine, "fan", n=N)
    reads = Reads(engine, monkeypatch)
    for k, cid in enumerate(children, 1):  # each filing is followed by a look at the parent
        assert process(engine, cid) is State.COMPLETED
        verdict = reads.look("fan")
        if k < N:
            assert verdict is not None and f"waiting for {N - k} of {N}" in verdict.reason
            assert verdict.on == frozenset(children[k:])
        else:
            assert verdict is None  # ready
    for _ in range(3):
        assert reads.look("fan") is None
    # before: each look read every finished child again (78 reads for 12 children, plus 36 for
    # the last three looks); now each is read at the first look that finds it finished
    assert reads.finished == Counter({cid: 1 for cid in children}), reads.finished
    assert process(engine, "fan") is State.COMPLETED  # aggregated, as before
    filed = engine.get("fan")[1]
    assert filed["handoffd"]["aggregated_outcome"]["aggregated_status"] == "success"


def test_a_changed_finished_child_is_read_again(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    c1, c2 = park(engine, "first", n=2, aggregation="first_success")
    FAILS[c1] = 1
    reads = Reads(engine, monkeypatch)
    assert process(engine, c1) is State.FAILED
    for _ in range(2):
        verdict = reads.look("first")
        assert verdict is not None and verdict.on == frozenset({c2})
    assert reads.finished[c1] == 1  # kept: the second look did not read it

    # `handoff retry` moves it back to pending: open again, the family waits for it too
    requeue_failed(engine, c1, force=True)
    verdict = reads.look("first")
    assert verdict is not None and "waiting for 2 of 2" in verdict.reason
    assert verdict.on == frozenset({c1, c2})

    # filed again, now a success: first_success is ready although c2 is still open
    assert process(engine, c1) is State.COMPLETED
    assert reads.look("first") is None
    assert reads.look("first") is None
    assert reads.finished[c1] == 2  # read once as failed, once as completed

    # its file replaced by another writer (a new file renamed into place): partial now, which
    # first_success does not take: the family waits for c2 again
    path = engine.ws.doc_path(State.COMPLETED, c1)
    doc = json.loads(path.read_bytes())
    doc["status"] = "partial"
    staged = path.with_name(".replaced.tmp")
    staged.write_text(json.dumps(doc))
    os.replace(staged, path)
    verdict = reads.look("first")
    assert verdict is not None and verdict.on == frozenset({c2})
    assert reads.finished[c1] == 3


def test_the_memory_keeps_settled_children_only_and_is_bounded(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    children = park(engine, "few", n=4)
    for cid in children:
        assert process(engine, cid) is State.COMPLETED
    reads = Reads(engine, monkeypatch)
    reads.counting = True
    now = [time.time()]
    memory = gates.FinishedChildren(clock=lambda: now[0])
    for _ in range(2):  # filed just now: a write in the same tick could keep the stamp
        assert [memory.info(engine, cid).status for cid in children] == ["success"] * 4
    assert len(memory) == 0 and set(reads.finished.values()) == {2}
    now[0] += 10  # settled
    monkeypatch.setattr(gates, "FACTS_KEPT", 3)
    for _ in range(2):
        assert [memory.info(engine, cid).status for cid in children] == ["success"] * 4
    # at most FACTS_KEPT, the oldest out first: looks cycling over more than that read each
    # child every time, as without the memory (never more)
    assert len(memory) == 3 and [reads.finished[cid] for cid in children] == [4, 4, 4, 4]
    assert [memory.info(engine, cid).status for cid in children[2:]] == ["success"] * 2
    assert [reads.finished[cid] for cid in children] == [4, 4, 4, 4]  # the newest were kept
    now[0] += gates.FACTS_LIFETIME_SECONDS  # past their lifetime: read again
    assert memory.info(engine, children[1]).status == "success"
    assert reads.finished[children[1]] == 5 and len(memory) == 1


def test_a_stored_copy_is_stamped_by_its_files(engine: Engine, tmp_path: Path) -> None:
    """``Backend.stamp_of``: the files store's changes with every write, and is None where it
    cannot vouch (no copy, a symbolic link, an id that is no file name); the memory store has
    none."""
    from handoffd.backends.memory import MemoryBackend
    (cid,) = park(engine, "one", n=1)
    pending = engine.backend.stamp_of(cid)
    assert pending is not None and pending == engine.backend.stamp_of(cid)
    assert process(engine, cid) is State.COMPLETED
    filed = engine.backend.stamp_of(cid)
    assert filed is not None and filed[0] != pending[0] and filed[1] >= pending[1]
    path = engine.ws.doc_path(State.COMPLETED, cid)
    os.utime(path, ns=(1, 1))  # (its mtime set back: as deterministic as a touch gets)
    assert engine.backend.stamp_of(cid) not in (None, filed)
    for hid in ("nobody", "../one", "a/b", ""):
        assert engine.backend.stamp_of(hid) is None
    aside = tmp_path / "aside.json"
    os.replace(path, aside)
    path.symlink_to(aside)
    assert engine.backend.stamp_of(cid) is None
    assert MemoryBackend().stamp_of(cid) is None


HANDLERS = '''
def boss(handoff, ctx):
    data = ctx.data if isinstance(ctx.data, dict) else {}
    return {"status": "delegated", "aggregation": data["aggregation"],
            "delegate": [{"to": "@leaf", "data": {"n": n, "fail": n in data.get("fail", [])}}
                         for n in range(data["n"])]}


def leaf(handoff, ctx):
    data = ctx.data if isinstance(ctx.data, dict) else {}
    if data.get("fail"):
        return {"status": "failed", "error": {"code": "NOPE", "message": "failed on purpose"}}
    return {"status": "completed", "output": {"n": data["n"], "blob": "y" * 50000}}
'''

CONFIG = """
[daemon]
workers = 4
durability = "fast"
settle_seconds = 0.05

[retry]
max_retries = 0

[specialists."@boss"]
handler = "cg17:boss"

[specialists."@leaf"]
handler = "cg17:leaf"
concurrency = 2
"""


def test_handoffd_run_still_aggregates_a_fan_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws: Workspace = handlers_workspace(tmp_path, monkeypatch, "cg17", HANDLERS, CONFIG)
    try:
        families = {"all": {"aggregation": "all_success", "n": 6, "fail": [2]},
                    "maj": {"aggregation": "majority", "n": 5, "fail": [0, 1]},
                    "first": {"aggregation": "first_success", "n": 3, "fail": [0, 1, 2]}}
        for hid, data in families.items():
            ws.create("--to", "@boss", "--id", hid, "--data", json.dumps(data))
        proc = ws.handoffd("run", timeout=120)
        # (exit 1: some handoffs failed) 8 + 2 parents completed, 6 children + "first" failed
        assert proc.returncode == 1 and "completed 10, failed 7," in proc.stderr, proc.stderr
        expected = {"all": ("completed", "partial"), "maj": ("completed", "success"),
                    "first": ("failed", "failed")}
        for hid, (state, status) in expected.items():
            assert ws.state_of(hid) == [state], (hid, ws.state_of(hid))
            outcome = ws.doc(hid)["handoffd"]["aggregated_outcome"]
            assert outcome["aggregated_status"] == status, (hid, outcome)
            statuses = {c["message_id"]: c["status"] for c in outcome["child_outcomes"]}
            fail = families[hid]["fail"]
            assert statuses == {f"{hid}.c{n + 1}": "failed" if n in fail else "success"
                                for n in range(int(families[hid]["n"]))}, (hid, statuses)
    finally:
        ws.cleanup()
