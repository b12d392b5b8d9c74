"""The context/ mirror of a shared store (features/context_mirror.py), in-process on the memory
store: values written into context/<key>.json, files changed on the host taken in as ``@file``
(namespace permissions and compare-and-set apply), what cannot be taken in set aside and
replaced, young files left alone, deleted files written again, state kept across restarts.
The same mirror over PostgreSQL between two hosts' daemons: tests/test_postgres_context.py."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from handoffd.backends.memory import MemoryContext
from handoffd.core.workspace import Workspace
from handoffd.features.context import ContextStore, Permissions
from handoffd.features.context_mirror import FILE_AGENT, ContextMirror

SETTLE = 0.3


def store_at(root: Path, shared: MemoryContext) -> ContextStore:
    """One host's view of ``shared`` with the default namespaces (task/ is the architect's)."""
    ws = Workspace(root)
    ws.ensure()
    return ContextStore(ws, Permissions.from_config(ws.load_config()), durable=False,
                        backend=shared)


def mirror_of(store: ContextStore) -> ContextMirror:
    return ContextMirror(store, settle_seconds=SETTLE, durable=False)


def drop(store: ContextStore, key: str, text: str, *, age: float = 5.0) -> Path:
    """Write context/<key>.json as a file-only agent would, ``age`` seconds ago."""
    path = store.root / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


@pytest.fixture
def host(tmp_path: Path) -> tuple[ContextStore, ContextMirror]:
    store = store_at(tmp_path / "ws", MemoryContext())
    return store, mirror_of(store)


def test_the_stores_values_are_written_as_stored(host: tuple[ContextStore, ContextMirror]) -> None:
    store, mirror = host
    store.set("task/goal", {"zeta": 1, "a": 2}, agent="ABSTRACT_ARCHITECT")
    store.set("project-context", {"name": "p"}, agent="@x")
    assert sorted(mirror.pull()["written"]) == ["project-context", "task/goal"]
    data, _ = store.backend.read("task/goal")
    assert (store.root / "task" / "goal.json").read_bytes() == data
    assert list(json.loads((store.root / "task" / "goal.json").read_text())) == ["zeta", "a"]
    assert mirror.pull()["written"] == []  # nothing changed: nothing written
    store.set("task/goal", {"v": 2}, agent="ABSTRACT_ARCHITECT")
    assert mirror.pull()["written"] == ["task/goal"]
    assert json.loads((store.root / "task" / "goal.json").read_text()) == {"v": 2}


def test_a_file_added_or_changed_here_becomes_a_revision_by_file(
        host: tuple[ContextStore, ContextMirror]) -> None:
    store, mirror = host
    drop(store, "tech-stack", '{"framework": "React"}')
    report = mirror.sync()
    assert report["ingested"] == ["tech-stack"] and report["written"] == ["tech-stack"]
    assert store.get_with_revision("tech-stack") == ({"framework": "React"}, 1)
    assert store.history("tech-stack")[-1]["by"] == FILE_AGENT
    # written back in handoffd's layout, and not taken in again
    assert (store.root / "tech-stack.json").read_bytes() == store.backend.read("tech-stack")[0]
    assert mirror.sync() == {"written": [], "ingested": [], "rejected": [], "restored": []}
    drop(store, "tech-stack", '{"framework": "Vue"}')
    assert mirror.sync()["ingested"] == ["tech-stack"]
    assert store.get_with_revision("tech-stack") == ({"framework": "Vue"}, 2)


def test_what_cannot_be_taken_in_is_set_aside_and_replaced(
        host: tuple[ContextStore, ContextMirror], caplog: pytest.LogCaptureFixture) -> None:
    store, mirror = host
    store.set("task/goal", {"v": 1}, agent="ABSTRACT_ARCHITECT")
    mirror.pull()
    drop(store, "task/goal", '{"v": "mine"}')  # task/ is the architect's: @file may not write
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        report = mirror.sync()
    assert report["rejected"] == ["task/goal"] and report["written"] == ["task/goal"]
    assert json.loads((store.root / "task" / "goal.json").read_text()) == {"v": 1}
    [kept] = (store.root / ".rejected" / "task").glob("goal.*.json")
    assert json.loads(kept.read_text()) == {"v": "mine"}
    assert "may not write" in caplog.text and "revision 1 replaces it" in caplog.text
    assert store.revision("task/goal") == 1


def test_a_local_edit_loses_to_a_newer_revision_elsewhere(
        host: tuple[ContextStore, ContextMirror]) -> None:
    store, mirror = host
    store.set("notes", {"v": 1}, agent="@x")
    mirror.pull()
    store.set("notes", {"v": 2}, agent="@other-host")  # the store moved on meanwhile
    drop(store, "notes", '{"v": "edited at revision 1"}')
    report = mirror.pull()  # the stale key's local edit is looked at before it is replaced
    assert report["rejected"] == ["notes"] and report["written"] == ["notes"]
    assert store.get_with_revision("notes") == ({"v": 2}, 2)
    assert len(list((store.root / ".rejected").glob("notes.*.json"))) == 1


def test_young_unreadable_and_deleted_files(host: tuple[ContextStore, ContextMirror]) -> None:
    store, mirror = host
    drop(store, "draft", '{"half": ', age=0.0)  # being written: left for the next round
    assert mirror.sync()["rejected"] == [] and store.keys() == []
    drop(store, "draft", '{"half": ')  # still not JSON once settled: set aside, said once
    assert mirror.sync()["rejected"] == ["draft"]
    assert (store.root / "draft.json").exists() and store.keys() == []  # nothing to put back
    assert mirror.sync()["rejected"] == []
    store.set("kept", [1], agent="@x")
    mirror.pull()
    (store.root / "kept.json").unlink()
    report = mirror.sync()
    assert report["restored"] == ["kept"] and report["written"] == ["kept"]
    assert json.loads((store.root / "kept.json").read_text()) == [1]


def test_a_file_never_mirrored_that_differs_from_the_store_loses(tmp_path: Path) -> None:
    shared = MemoryContext()
    store = store_at(tmp_path / "ws", shared)
    store.set("plan", {"from": "store"}, agent="@x")
    drop(store, "plan", '{"from": "an old local copy"}')
    same = drop(store, "same", '[1]')
    store.set("same", [1], agent="@x")
    same.write_bytes(store.backend.read("same")[0] or b"")
    report = mirror_of(store).sync()
    assert report["rejected"] == ["plan"] and report["written"] == ["plan"]
    assert json.loads((store.root / "plan.json").read_text()) == {"from": "store"}
    assert store.revision("same") == 1


def test_the_mirror_remembers_across_restarts(tmp_path: Path) -> None:
    shared = MemoryContext()
    store = store_at(tmp_path / "ws", shared)
    store.set("notes", {"v": 1}, agent="@x")
    mirror_of(store).pull()
    drop(store, "notes", '{"v": "edited while the daemon was down"}')
    again = mirror_of(store_at(tmp_path / "ws", shared))  # a new process
    assert again.sync()["ingested"] == ["notes"]
    assert store.get_with_revision("notes") == ({"v": "edited while the daemon was down"}, 2)
