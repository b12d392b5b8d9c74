"""A delegation's children shortage hand-back, after review R58 (session 28).

1. a batch (``handoffd run``) ended at once, exit 0, saying nothing, with the parent it had just
   handed back short of children still pending: it waits that back-off out now, as it waits a
   start shortage's, or counts the parent ``handed back``;
2. the children shortages and the start shortages each kept a run of their own, each ended by
   the other kind's hand-back: alternating kinds kept both near zero, so the bound of
   ``FREE_SHORTAGES`` uncounted hand-backs in a row never came. One run counts both now;
3. children kept from a short attempt were orphaned when the next attempt delegated
   differently: neither cancelled nor waited for (one still ran, the parent completed "1/1").
   Those the new delegation does not adopt, or whose entry changed, are cancelled now, and so
   are all of them when the next delegation fails or the next attempt does not delegate.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from test_orchestration_hostile import CONFIG, HANDLERS, batch, submit
from test_shortage_schemas_s23 import emfile
from test_start_shortage_s20 import FailFirst

from handoffd import Engine, State
from handoffd.core.documents import book
from handoffd.features import orchestration
from handoffd.features.children import CHILDREN_SHORT
from handoffd.service import handbacks

# ---------------------------------------------------------------- 1. a batch waits for it
# the daemon's store runs short of descriptors once, storing the third child of "par"
SHORT_ON_THIRD = HANDLERS + '''

import errno as _errno
import os as _os

from handoffd.backends.files.backend import FilesBackend as _Files

_create = _Files.create
_short = []


def _create_short_once(self, doc, handoff_id, now, **kw):
    if handoff_id == "par.c3" and not _short:
        _short.append(1)
        raise OSError(_errno.EMFILE, _os.strerror(_errno.EMFILE))
    return _create(self, doc, handoff_id, now, **kw)


_Files.create = _create_short_once
'''


@pytest.fixture
def short_ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "hostile_handlers", SHORT_ON_THIRD, CONFIG)
    yield ws
    ws.cleanup()


def test_a_batch_waits_out_a_children_shortage_and_completes_the_parent(
        short_ws: Workspace) -> None:
    """Before: the batch exited 0 at once, the parent pending, its summary silent."""
    short_ws.create("--to", "@boss", "--id", "par", "--data", json.dumps(
        {"delegate": [{"to": "@leaf", "data": {"n": n}} for n in (1, 2, 3)]}))
    proc = short_ws.handoffd("run", "--max-seconds", "20", timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "its delegation's children could not be stored for now" in proc.stderr, proc.stderr
    assert short_ws.state_of("par") == ["completed"], (short_ws.state_of("par"), proc.stderr)
    ran = (short_ws.root / "artifacts" / "ran.txt").read_text().split()
    assert sorted(ran) == ["par.c1", "par.c2", "par.c3"]  # each child once: c1, c2 adopted
    history = [e["event"] for e in short_ws.doc("par")["handoffd"]["history"]]
    assert "handed_back" in history and "retry_scheduled" not in history, history


# ---------------------------------------------------------------- 2. one run of shortages
def _start_short(engine: Engine, hid: str) -> None:
    """Claim ``hid`` and hand it back as a handler that could not start (EMFILE) is."""
    job = engine.take(hid)
    assert job is not None
    assert engine.requeue(job.claim, job.dialect, "handed_back", reason="short",
                          **{handbacks.NOT_STARTED: "EMFILE"}) is State.PENDING


def _claimed_run(engine: Engine, hid: str) -> State:
    job = engine.take(hid)
    assert job is not None
    return engine.file(job.claim, job.dialect, job.specialist, engine.run(job))


def test_alternating_shortage_kinds_share_one_run_and_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Children shortages and start shortages alternate: before, each count stopped at the
    other kind (0 and 1 after any number); now both read one run, and past the free ones the
    children shortage counts the attempt, its error carrying the run."""
    clock = Clock()
    engine = memory_engine(tmp_path, clock, {"@boss": _boss, "@echo": _echo})[0]
    monkeypatch.setattr(orchestration, "FREE_CHILDREN_SHORTAGES", 4)
    plan = FailFirst(orchestration._plan_children, 10, emfile)
    monkeypatch.setattr(orchestration, "_plan_children", plan)
    PLANS[:] = [[{"to": "@echo", "data": {"n": 1}}]]
    submit(engine, "p", "@boss")
    for step in range(4):  # children, start, children, start: 4 in a row
        if step % 2 == 0:
            assert _claimed_run(engine, "p") is State.PENDING
            assert book(engine.get("p")[1])["history"][-1]["detail"][CHILDREN_SHORT] == "EMFILE"
        else:
            _start_short(engine, "p")
        clock.advance(120)
        doc = engine.get("p")[1]
        assert handbacks.shortages_in_a_row(doc) == step + 1
    assert _claimed_run(engine, "p") is State.PENDING  # the 5th in a row: counted
    doc = engine.get("p")[1]
    error = book(doc)["last_error"]
    assert error["code"] == "PROCESSING_ERROR" and book(doc)["retries"] == 1, error
    assert handbacks.shortages_in_a_row(doc) == 5  # (the run goes on: each further one counts)


# ---------------------------------------------------------------- 3. no orphan
PLANS: list[list[dict[str, Any]]] = []  # what @boss delegates, attempt after attempt
RUNS: list[str] = []


def _boss(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    entries = PLANS.pop(0) if len(PLANS) > 1 else PLANS[0]
    if not entries:  # (this attempt does its work itself)
        return {"status": "completed", "output": {"alone": True}}
    return {"status": "delegated", "delegate": entries}


def _echo(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    RUNS.append(ctx.handoff_id)
    return {"status": "completed", "output": {"echo": ctx.data}}


@pytest.fixture
def boss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Engine, Clock]]:
    """An engine whose @boss delegates PLANS[0], then the next plan; the store runs short of
    descriptors once, storing ``p.c3``."""
    RUNS.clear()
    clock = Clock()
    engine = memory_engine(tmp_path, clock, {"@boss": _boss, "@echo": _echo})[0]
    store = getattr(engine.backend, "inner", engine.backend)
    short = FailFirst(store.create, 1, emfile, when=lambda doc, hid, *a, **k: hid == "p.c3")
    monkeypatch.setattr(store, "create", short)
    yield engine, clock
    PLANS.clear()


def _three() -> list[dict[str, Any]]:
    return [{"to": "@echo", "data": {"n": n}} for n in (1, 2, 3)]


def _finish(engine: Engine, clock: Clock) -> dict[str, Any]:
    clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    # the parent's next attempt first, its kept children still pending (a batch may run a kept
    # child before its parent: then it ran, and is cancelled or adopted after; the order was
    # left to the batch, and the assertions below on what ran were a race)
    _claimed_run(engine, "p")
    for _ in range(4):  # its children, the aggregation
        batch(engine)
        clock.advance(1)
    state, doc = engine.get("p")
    assert state is State.COMPLETED, book(doc)["history"]
    return doc


def _cancelled(engine: Engine, hid: str) -> bool:
    state, doc = engine.get(hid)
    return state is State.FAILED and doc["error"]["code"] == "CANCELLED"


def test_children_kept_but_not_delegated_again_are_cancelled(
        boss: tuple[Engine, Clock]) -> None:
    """Three delegated, the third runs short; the next attempt delegates one. Before: p.c2 ran
    beside a parent that completed "1/1", waiting for nobody's p.c2."""
    engine, clock = boss
    PLANS[:] = [_three(), [{"to": "@echo", "data": {"n": 1}}]]
    submit(engine, "p", "@boss")
    assert _claimed_run(engine, "p") is State.PENDING  # handed back short of children
    assert engine.get("p.c2")[0] is State.PENDING  # kept
    doc = _finish(engine, clock)
    assert _cancelled(engine, "p.c2")
    assert "p.c2" not in RUNS and RUNS == ["p.c1"]  # p.c1 adopted: its entry is the same
    assert book(doc)["children"] == ["p.c1"], book(doc).get("children")


def test_a_kept_child_whose_entry_changed_is_not_adopted(boss: tuple[Engine, Clock]) -> None:
    """The next attempt's first entry differs from the kept p.c1's: p.c1 is cancelled, never
    run, and the delegation takes the next round's ids (p.r2.c1...), each made afresh."""
    engine, clock = boss
    changed = [{"to": "@echo", "data": {"n": 10}}, {"to": "@echo", "data": {"n": 2}}]
    PLANS[:] = [_three(), changed]
    submit(engine, "p", "@boss")
    assert _claimed_run(engine, "p") is State.PENDING
    _finish(engine, clock)
    assert _cancelled(engine, "p.c1") and _cancelled(engine, "p.c2")
    assert sorted(RUNS) == ["p.r2.c1", "p.r2.c2"], RUNS
    assert engine.get("p.r2.c1")[1]["input"]["data"] == {"n": 10}


def test_the_same_delegation_still_adopts_what_was_kept(boss: tuple[Engine, Clock]) -> None:
    """The same three again: p.c1 and p.c2 adopted, p.c3 made, each run once."""
    engine, clock = boss
    PLANS[:] = [_three()]
    submit(engine, "p", "@boss")
    assert _claimed_run(engine, "p") is State.PENDING
    _finish(engine, clock)
    assert sorted(RUNS) == ["p.c1", "p.c2", "p.c3"]


def test_kept_children_are_cancelled_when_the_next_delegation_is_malformed(
        boss: tuple[Engine, Clock]) -> None:
    """The next attempt's delegation is refused (an id used twice): the kept children are
    cancelled with it, never left running for nobody."""
    engine, clock = boss
    PLANS[:] = [_three(), [{"to": "@echo"}, {"to": "@echo", "id": "p.c1"}]]
    submit(engine, "p", "@boss")
    assert _claimed_run(engine, "p") is State.PENDING
    clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    assert _claimed_run(engine, "p") is State.FAILED
    assert _cancelled(engine, "p.c1") and _cancelled(engine, "p.c2")


def test_kept_children_are_cancelled_when_the_next_attempt_does_not_delegate(
        boss: tuple[Engine, Clock]) -> None:
    """The next attempt completes on its own: the kept p.c1 and p.c2 are cancelled, never
    run for a parent that no longer waits for them."""
    engine, clock = boss
    PLANS[:] = [_three(), []]
    submit(engine, "p", "@boss")
    assert _claimed_run(engine, "p") is State.PENDING
    clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    assert _claimed_run(engine, "p") is State.COMPLETED
    assert _cancelled(engine, "p.c1") and _cancelled(engine, "p.c2")
    batch(engine)
    assert RUNS == []
