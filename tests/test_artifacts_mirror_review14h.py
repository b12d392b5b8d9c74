"""Artifacts and the context mirror against the tester's review14h: a huge (sparse) artifact is
refused before it is read, a destination cannot name another handoff's artifact folder, and the
mirror's own files and folders (``.rejected``, ``.tmp``, ``mirror.json``, ``mirror.lock``) are
never followed out of the workspace nor waited on."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable

import pytest
from test_context_mirror import drop, mirror_of, store_at

from handoffd.backends.memory import MemoryContext
from handoffd.core.errors import InvalidDocument
from handoffd.core.workspace import Workspace
from handoffd.features import artifact_paths, artifacts


# ---------------------------------------------------------------- 5: a huge artifact
def test_a_huge_sparse_artifact_fails_without_being_read(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    big = ws.root / "big.bin"
    with open(big, "wb") as handle:
        handle.truncate(64 << 30)  # sparse: no disk used
    try:
        with pytest.raises(InvalidDocument) as caught:
            artifacts._one(ws, "huge", 1, {"path": "big.bin"}, set())
        assert caught.value.code == "VALIDATION_FAILED"
        assert "over the 1073741824-byte limit" in str(caught.value)
        assert "\n" not in str(caught.value)
    finally:
        big.unlink()


def test_hashing_stops_when_the_attempt_is_stopped(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    (ws.root / "mid.bin").write_bytes(b"x" * 64)
    monkeypatch.setattr(artifacts, "HASH_STEP", 8)
    asked: list[int] = []

    def stopped() -> bool:
        asked.append(1)
        return True
    with pytest.raises(OSError, match="stopped while mid.bin was hashed"):
        artifacts._one(ws, "h", 1, {"path": "mid.bin"}, set(), stopped)
    assert asked == [1]  # after the first chunk, not after the whole file
    record = artifacts._one(ws, "h", 1, {"path": "mid.bin"}, set(), lambda: False)
    assert record["size_bytes"] == 64


# ---------------------------------------------------------------- 6: another handoff's folder
def test_a_destination_in_another_handoffs_folder_is_refused(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    (ws.handoffs / "completed").mkdir(parents=True, exist_ok=True)
    (ws.handoffs / "completed" / "victim.json").write_text("{}")
    (ws.artifacts / "victim").mkdir(parents=True)
    hashed = artifact_paths._id_part("job@1")
    (ws.artifacts / hashed).mkdir()
    for template in ("artifacts/victim/output.txt", "victim/x.json", f"artifacts/{hashed}/output.txt"):
        with pytest.raises(InvalidDocument) as caught:
            artifact_paths.resolve_destination(ws, template, handoff_id="thief", attempt=1, agent="@w")
        assert caught.value.code == "SCHEMA_VALIDATION_FAILED"
        assert "the artifact folder of another handoff" in str(caught.value)
    # its own folder, a shared folder and a folder of no handoff stay usable
    for template in ("artifacts/thief/out.txt", "artifacts/phase-13-react/r-{timestamp}.json",
                     "artifacts/report.json", "artifacts/nobody/x.txt"):
        artifact_paths.resolve_destination(ws, template, handoff_id="thief", attempt=1, agent="@w")
    artifact_paths.resolve_destination(ws, "artifacts/victim/again.txt", handoff_id="victim",
                                       attempt=2, agent="@w")


# ---------------------------------------------------------------- 7: the context mirror
def _bounded(func: Callable[[], object], what: str) -> None:
    """Run ``func`` on a thread; fail (not hang) when it has not ended within 30 s."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            func()
        except BaseException as exc:  # reported below
            errors.append(exc)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"{what} is stuck"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("folder", [".rejected", ".rejected/task"])
def test_a_symlinked_rejected_folder_keeps_no_copy_outside(tmp_path: Path, folder: str) -> None:
    store = store_at(tmp_path / "ws", MemoryContext())
    mirror = mirror_of(store)
    store.set("task/goal", {"v": 1}, agent="ABSTRACT_ARCHITECT")
    mirror.sync()
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / folder).parent.mkdir(parents=True, exist_ok=True)
    (store.root / folder).symlink_to(outside)
    drop(store, "task/goal", '{"v": 2}')  # @file may not write task/: rejected
    report = mirror.sync()
    assert report["rejected"] == ["task/goal"]
    assert list(outside.rglob("*")) == []
    assert json.loads((store.root / "task/goal.json").read_text()) == {"v": 1}


def test_a_symlinked_tmp_folder_is_not_written_through(tmp_path: Path) -> None:
    shared = MemoryContext()
    store = store_at(tmp_path / "ws", shared)
    store.root.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / ".tmp").symlink_to(outside)
    shared.write("notes", lambda old, rev: (b'{"a": 1}\n', {"key": "notes", "revision": rev + 1}))
    report = mirror_of(store).sync()
    assert report["written"] == []
    assert list(outside.iterdir()) == []
    assert not (store.root / "notes.json").exists()


@pytest.mark.parametrize("name", ["mirror.json", "mirror.lock"])
def test_a_fifo_among_the_mirrors_files_never_blocks_a_round(tmp_path: Path, name: str) -> None:
    store = store_at(tmp_path / "ws", MemoryContext())
    mirror = mirror_of(store)
    store.set("notes/a", {"v": 1}, agent="@w")
    mirror.sync()
    # (the record is handoffd's own since session 16, sealed, in handoffs/.meta)
    fifo = (store.ws.meta / "context-mirror.json" if name == "mirror.json"
            else store.root / ".meta" / name)
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    try:
        if name == "mirror.json":  # no record: the round still runs
            _bounded(mirror.pull, "a pull")
        else:  # no lock: the round fails in one line (guarded), never waits
            with pytest.raises(OSError):
                _bounded(mirror.pull, "a pull")
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_a_symlinked_lock_is_not_followed(tmp_path: Path) -> None:
    store = store_at(tmp_path / "ws", MemoryContext())
    mirror = mirror_of(store)
    mirror.sync()
    target = tmp_path / "elsewhere.lock"
    lock = store.root / ".meta" / "mirror.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(target)
    with pytest.raises(OSError):
        mirror.pull()
    assert not target.exists()
