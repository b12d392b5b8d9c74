"""Contracts against the tester's review14h: what a worker's code can change while the success
criteria run, files inside a new nested git repository, forged reservations, and the hash cache
as one of handoffd's own files (no FIFO waited on, no symlinked folder followed).

The scenario tests drive the real ``handoffd`` (see ``test_contracts_hostile.py``, whose
workspace and worker they share); the cache tests use the Snapshotter directly.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace
from test_contracts_hostile import PY, gws, make_workspace, native, submit_and_run  # noqa: F401 (gws: a fixture)

from handoffd.features.contracts import snapshots

OWN_TESTS = {"files_owned": ["tests/**"], "files_readonly": ["src/lib/jwt.py"]}


@pytest.fixture
def hws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace that is no git work tree (contracts check it in hash mode)."""
    ws = make_workspace(tmp_path, repo=False)
    yield ws
    ws.cleanup()


# ---------------------------------------------------------------- 1: criteria are the worker's code
EVIL_TEST = ("import os, pathlib\nroot = pathlib.Path(os.environ['HANDOFFD_ROOT'])\n"
             "(root / 'src/lib/jwt.py').write_text('SECRET = 666\\n')\n"
             "(root / 'src/lib/new.py').write_text('x')\n")


def test_a_criterion_that_changes_files_breaks_the_contract(hws: Workspace) -> None:
    doc, _ = submit_and_run(hws, native("crit", {
        **OWN_TESTS, "success_criteria": [f"Tests pass: {PY} tests/check.py"]},
        {"write": {"tests/check.py": EVIL_TEST}}))
    assert hws.state_of("crit") == ["failed"], doc["validation"]
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    message = doc["error"]["message"]
    assert "src/lib/jwt.py: modified (read-only) while the success criteria ran" in message
    assert "src/lib/new.py: created outside files_owned while the success criteria ran" in message
    scope = doc["validation"]["scope"]
    assert scope["changes"] == [{"path": "tests/check.py", "change": "created"}]
    assert scope["changes_by_criteria"] == [{"path": "src/lib/jwt.py", "change": "modified"},
                                            {"path": "src/lib/new.py", "change": "created"}]
    assert doc["validation"]["criteria"][0]["status"] == "passed"


def test_a_criterion_writing_only_owned_files_still_passes(hws: Workspace) -> None:
    writes_owned = "import pathlib; pathlib.Path('tests/report.txt').write_text('ok')\n"
    doc, _ = submit_and_run(hws, native("fine", {
        **OWN_TESTS, "success_criteria": [f"Tests pass: {PY} tests/check.py"]},
        {"write": {"tests/check.py": writes_owned}}))
    assert hws.state_of("fine") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes_by_criteria"] == [
        {"path": "tests/report.txt", "change": "created"}]


# ---------------------------------------------------------------- 2: a new nested repository
def test_files_inside_a_new_nested_repository_are_seen(gws: Workspace) -> None:
    doc, _ = submit_and_run(gws, native("nest", {"files_owned": ["src/auth/**"]}, {
        "run": [["git", "init", "-q", "{root}/src/lib/hidden"]],
        "write": {"src/lib/hidden/payload.py": "evil\n"}}))
    assert gws.state_of("nest") == ["failed"], doc["validation"]["scope"]
    assert doc["validation"]["scope"]["mode"] == "git"
    assert "src/lib/hidden/payload.py: created outside files_owned" in doc["error"]["message"]


# ---------------------------------------------------------------- 3: forged reservations
FORGE = r'''
import json, os, time
root = os.environ["HANDOFFD_ROOT"]
path = os.path.join(root, "handoffs/.meta/reservations.json")
try:
    records = json.load(open(path))
except Exception:
    records = {}
records.setdefault("released", {})["ghost.t"] = {
    "handoff_id": "ghost", "token": "t", "patterns": ["**"], "released_at": time.time() + 3600}
records.setdefault("released", {})["old.t"] = {
    "handoff_id": "old", "token": "t", "patterns": ["**"], "released_at": time.time() + 3600}
json.dump(records, open(path, "w"))
open(os.path.join(root, "src/lib/jwt.py"), "w").write("SECRET = 666\n")
'''


def test_a_forged_reservation_excuses_nothing(hws: Workspace, tmp_path: Path) -> None:
    # "old" exists (and ran), but its own contract owns nothing like "**"
    doc, _ = submit_and_run(hws, native("old", {"files_owned": ["src/auth/**"]}, {}))
    assert hws.state_of("old") == ["completed"], doc.get("error")
    forge = tmp_path / "forge.py"
    forge.write_text(FORGE)
    doc, _ = submit_and_run(hws, native("forge", {"files_owned": ["src/auth/**"]},
                                        {"run": [[PY, str(forge)]]}))
    assert hws.state_of("forge") == ["failed"], doc["validation"]["scope"]
    assert doc["validation"]["scope"]["excused"] == []
    assert "src/lib/jwt.py: modified outside files_owned" in doc["error"]["message"]


# ---------------------------------------------------------------- 4, 8: the hash cache
def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("a\n")
    return root


def _take_bounded(snapper: snapshots.Snapshotter) -> snapshots.Snapshot:
    """take() on a thread, failing the test (instead of hanging it) past 30 s."""
    result: list[snapshots.Snapshot] = []
    thread = threading.Thread(target=lambda: result.append(snapper.take()), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():  # unblock the FIFO so the thread can end, then fail
        pytest.fail("the snapshot is stuck on the hash cache")
    return result[0]


def test_a_fifo_at_the_hash_cache_is_no_cache(tmp_path: Path) -> None:
    root, cache = _tree(tmp_path), tmp_path / "cache"
    first = snapshots.Snapshotter(root, mode="hash", cache_dir=cache)
    first.take()
    [path] = list(cache.iterdir())
    path.unlink()
    os.mkfifo(path)
    try:
        snap = _take_bounded(snapshots.Snapshotter(root, mode="hash", cache_dir=cache))
        assert set(snap.entries) == {"src/a.py"} and snap.entries["src/a.py"].digest
    finally:
        try:  # a reader left blocked would be woken by a writer (none is, if the fix holds)
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_a_symlinked_cache_folder_is_not_used(tmp_path: Path) -> None:
    root, outside = _tree(tmp_path), tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "meta").mkdir()
    link = tmp_path / "meta" / "contracts"
    link.symlink_to(outside)
    snap = snapshots.Snapshotter(root, mode="hash", cache_dir=link).take()
    assert snap.entries["src/a.py"].digest
    assert list(outside.iterdir()) == []


def test_a_huge_sparse_file_is_compared_by_stat_facts(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    with open(root / "big.bin", "wb") as handle:
        handle.truncate(snapshots.MAX_HASHED_BYTES + 1)
    snapper = snapshots.Snapshotter(root, mode="hash")
    before = snapper.take()
    assert before.entries["big.bin"].digest is None
    changes, _ = snapper.changes(before)
    assert changes == []
    os.truncate(root / "big.bin", snapshots.MAX_HASHED_BYTES + 2)
    changes, _ = snapper.changes(before)
    assert [(c.path, c.change) for c in changes] == [("big.bin", "modified")]
    os.unlink(root / "big.bin")


def test_the_cache_is_read_only_within_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, cache = _tree(tmp_path), tmp_path / "cache"
    snapshots.Snapshotter(root, mode="hash", cache_dir=cache).take()
    [path] = list(cache.iterdir())
    assert json.loads(path.read_text())["entries"]
    monkeypatch.setattr(snapshots, "MAX_CACHE_BYTES", 10)
    snapper = snapshots.Snapshotter(root, mode="hash", cache_dir=cache)
    assert snapper._load_cache() == {}
