"""Retention and documents a mover set aside (``handoffs/.meta/aside/``).

A move that is not a claim's own filing (the sweep's recovery in-progress/ -> pending/) first
renames the document aside, then writes the new copy, then deletes what it set aside; a mover
that dies in between leaves the document there until the sweep puts it back a minute later.
Found by the review: in that minute the live document was in no listing, so retention purged
what it depends on (and its parent), and the document came back to a dependency that was gone.
A document set aside from pending/ or in-progress/ is live: the store lists it with its stamp
(:meth:`Backend.live_stamps`), and a hostile file there protects nothing and breaks no pass."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import Workspace

from handoffd.backends.files import aside
from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import retention
from handoffd.features.liverefs import LiveRefs

LIVE = [State.PENDING, State.IN_PROGRESS]
DAY = 86400.0


def _engine(root: Path) -> Any:
    """An engine over a fresh workspace at ``root`` whose clock runs two days on (so that every
    finished handoff is old)."""
    from handoffd import build_engine
    ws = HandoffdWorkspace(root)
    ws.ensure()
    later = utc_now() + timedelta(days=2)
    return build_engine(ws, ws.load_config(), clock=lambda: later)


def _create(engine: Any, hid: str, **fields: Any) -> None:
    engine.backend.create({"handoff_id": hid, "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@nobody"}, "input": {"data": {}}, **fields},
                          hid, utc_now())


def _completed(engine: Any, *ids: str) -> None:
    for hid in ids:
        _create(engine, hid)
        held = engine.backend.claim(hid, utc_now(), 60)
        assert held is not None and engine.backend.finish(held, State.COMPLETED, held.doc)


def _live(engine: Any, hid: str, state: State, **fields: Any) -> None:
    """``hid`` pending, or claimed (in-progress) when ``state`` says so."""
    _create(engine, hid, **fields)
    if state is State.IN_PROGRESS:
        assert engine.backend.claim(hid, utc_now(), 60) is not None


def _store(engine: Any) -> Any:
    return engine.backend.inner.store  # (the files backend, under the event log's recorder)


def _expire(engine: Any, **kwargs: Any) -> retention.Result:
    return retention.expire(engine, older_than={State.COMPLETED: 3600.0}, now=engine.clock(),
                            **kwargs)


@pytest.mark.parametrize("state", LIVE, ids=lambda s: s.value)
def test_a_live_document_left_aside_keeps_its_dependency_and_parent(tmp_path: Path,
                                                                     state: State) -> None:
    """The reproduction: B, live, depends on the old completed A and is a child of the old
    completed P; a mover takes B aside and dies. Retention (a dry run, then a pass)
    keeps A and P, and the sweep's restore later puts B back beside both (before, both were
    purged in that minute)."""
    engine = _engine(tmp_path)
    _completed(engine, "A", "P")
    _live(engine, "B", state, depends_on=["A"], parent_id="P")
    aside.take(_store(engine), state, "B")  # the mover's first step; then it "dies"
    assert engine.backend.ids(State.PENDING) == engine.backend.ids(State.IN_PROGRESS) == []
    why = {"A": f"{state.value} B depends on it", "P": f"parent of {state.value} B"}
    assert _expire(engine, dry_run=True).kept == why
    result = _expire(engine)
    assert result.removed == [] and result.kept == why
    assert sorted(engine.backend.ids(State.COMPLETED)) == ["A", "P"]
    assert aside.restore(_store(engine), time.time() + aside.AGE_SECONDS) == [f"{state.value}/B.json"]
    found = engine.backend.get("B")
    assert found is not None and found[0] is state and found[1]["depends_on"] == ["A"]
    engine.backend.close()


def test_a_remembered_document_set_aside_is_read_again_then_remembered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's live refs: a document remembered in in-progress/ and then set aside has a new
    stamp, so it is read again (where it is now) and still protects its dependency; unchanged
    aside, it is stat'ed on the next pass, not read."""
    engine = _engine(tmp_path)
    _completed(engine, "A")
    _live(engine, "B", State.IN_PROGRESS, depends_on=["A"])
    refs = LiveRefs(clock=lambda: time.time() + 60)  # every file there looks settled
    want = ({"A": "in-progress B depends on it"}, {"B": State.IN_PROGRESS})
    assert retention.protected(engine, refs) == want and len(refs) == 1
    files = engine.backend.inner
    real_get, reads = files.get, []

    def get(handoff_id: str) -> Any:
        reads.append(handoff_id)
        return real_get(handoff_id)

    monkeypatch.setattr(files, "get", get)
    assert retention.protected(engine, refs) == want and reads == []  # unchanged: not read
    aside.take(_store(engine), State.IN_PROGRESS, "B")
    assert retention.protected(engine, refs) == want and reads == ["B"]  # moved: read again
    assert retention.protected(engine, refs) == want and reads == ["B"]  # then remembered
    engine.backend.close()


def test_the_store_stamps_live_and_set_aside_documents(tmp_path: Path) -> None:
    """``live_stamps``: pending/, in-progress/ and what was set aside from them (not what a
    retry or purge set aside from failed/ or completed/); a stamp changes when its document
    moves, even by a rename; a file that is not a regular file is unstamped; a store without
    file identities (memory) gives None."""
    from handoffd import build_engine
    from handoffd.backends.memory import MemoryBackend
    engine = _engine(tmp_path / "files")
    _completed(engine, "done", "retried")
    _live(engine, "p", State.PENDING)
    _live(engine, "r", State.IN_PROGRESS)
    _live(engine, "moved", State.IN_PROGRESS)
    store = _store(engine)
    before = engine.backend.live_stamps()  # (through the event log's recorder)
    assert sorted(before) == ["moved", "p", "r"] and all(before.values())
    aside.take(store, State.IN_PROGRESS, "moved")
    aside.take(store, State.COMPLETED, "retried")
    after = engine.backend.live_stamps()
    assert sorted(after) == ["moved", "p", "r"]
    assert after["p"] == before["p"] and after["r"] == before["r"]
    assert after["moved"] is not None and after["moved"] != before["moved"]
    os.symlink(engine.ws.doc_path(State.PENDING, "p"), engine.ws.doc_path(State.PENDING, "s"))
    assert engine.backend.live_stamps()["s"] is None
    engine.backend.close()
    other = HandoffdWorkspace(tmp_path / "memory")
    other.ensure()
    memory = build_engine(other, backend=MemoryBackend(), features=())
    assert memory.backend.live_stamps() is None


@pytest.mark.timeout(30)
def test_hostile_files_aside_protect_nothing_and_break_no_pass(tmp_path: Path) -> None:
    """What is no document handoffd set aside (a FIFO, a symlink to a live-looking document
    outside, a folder, an oversized file, bad JSON), or an aside folder that is a symlink out of
    the workspace, is passed over: the pass neither raises nor blocks, and nothing there keeps
    a dependency."""
    outside = tmp_path / "outside"
    (outside / "pending").mkdir(parents=True)
    planted = {"handoff_id": "planted", "source": {"agent_id": "@o"}, "depends_on": ["A"],
               "target": {"agent_id": "@nobody"}, "input": {"data": {}}}
    (outside / "pending" / "planted.json").write_text(json.dumps(planted))
    engine = _engine(tmp_path / "ws")
    _completed(engine, "A")
    pending_aside = aside.folder(_store(engine), State.PENDING)
    os.mkfifo(pending_aside / "fifo.json")
    (pending_aside / "link.json").symlink_to(outside / "pending" / "planted.json")
    (pending_aside / "dir.json").mkdir()
    with open(aside.folder(_store(engine), State.IN_PROGRESS) / "big.json", "wb") as big:
        big.truncate(_store(engine).max_filed_bytes + 1)  # (sparse: nothing is written)
    (pending_aside / "bad.json").write_text('{"depends_on": ["A"], ')
    assert _expire(engine, dry_run=True).removed == [("A", "completed")]
    assert _expire(engine, refs=LiveRefs()).removed == [("A", "completed")]
    engine.backend.close()
    # a symlinked .meta/aside: never looked in, so what it leads to is no live handoff
    engine = _engine(tmp_path / "ws2")
    _completed(engine, "A")
    (engine.ws.meta / aside.NAME).symlink_to(outside)
    assert engine.backend.live_stamps() == {}
    assert engine.backend.get("planted") is None
    # (A would go: a purge itself refuses to set anything aside through the symlink)
    assert _expire(engine, dry_run=True).removed == [("A", "completed")]
    engine.backend.close()


def test_purge_keeps_what_a_document_left_aside_depends_on(ws: Workspace) -> None:
    """`handoff purge` as an operator runs it, a pending handoff's document left aside by a
    mover that died: what it depends on is kept, and says why."""
    dep = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    assert ws.handoffd("run").returncode == 0
    assert ws.state_of(dep) == ["completed"]
    waiting = ws.create("--to", "@nobody", "--depends-on", dep)
    held = ws.root / "handoffs" / ".meta" / "aside" / "pending"
    held.mkdir(parents=True)
    os.rename(ws.root / "handoffs" / "pending" / f"{waiting}.json", held / f"{waiting}.json")
    out = json.loads(ws.handoff("purge", "--older-than", "0s", "--json", check=True).stdout)
    assert out["removed"] == [] and out["kept"] == {dep: f"pending {waiting} depends on it"}
    assert ws.state_of(dep) == ["completed"]


@pytest.mark.parametrize("failing", ["read", "listing"])
def test_a_live_document_that_cannot_be_read_now_ends_the_pass_not_its_protection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """Found by review (R5): a live document unreadable for a passing reason (EMFILE: out of
    descriptors) was taken for a damaged one, which protects nothing: its dependency and its
    parent were purged while it waited for them. Now such a read (or a live folder that cannot
    be listed) ends the pass with nothing removed; a damaged document still protects nothing."""
    import errno
    engine = _engine(tmp_path / "ws")
    _completed(engine, "A", "P")
    _live(engine, "B", State.PENDING, depends_on=["A"], parent_id="P")
    real_open, real_scandir = os.open, os.scandir

    def out_of_descriptors(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files", os.fspath(path))

    if failing == "read":
        monkeypatch.setattr(os, "open", lambda path, *a, **k: out_of_descriptors(path)
                            if os.fspath(path).endswith("/B.json") else real_open(path, *a, **k))
    else:  # B held aside by a dead mover, and its aside folder cannot be listed now: before,
        # the listing skipped that folder silently and A and P were purged
        aside.take(_store(engine), State.PENDING, "B")
        held = os.fspath(engine.ws.meta / "aside" / "pending")
        monkeypatch.setattr(os, "scandir", lambda path=".": out_of_descriptors(path)
                            if os.fspath(path) == held else real_scandir(path))
    with pytest.raises(OSError):
        _expire(engine)
    monkeypatch.undo()
    assert sorted(engine.backend.ids(State.COMPLETED)) == ["A", "P"]
    kept = _expire(engine).kept  # readable again: the usual pass keeps both, says why
    assert set(kept) == {"A", "P"}
    engine.backend.close()
