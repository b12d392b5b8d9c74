"""Contract snapshots, session 16: bounded walks and submodules.

* A tree too big (more than ``MAX_ENTRIES`` files and folders) or too deep (``MAX_DEPTH``) to
  see makes the snapshot *incomplete*: comparing with it fails the scope check in one line
  (``CONTRACT_VIOLATION``, recorded in the violations log), never a false "no change", never a
  stalled daemon; a path too long for the system is the same, never an ``OSError`` traceback.
* The walk never enters a symlinked folder, handoffd's own ``handoffs/`` or a ``.git`` folder; a
  folder it cannot open is an entry of its own.
* git mode sees writes inside a submodule's working tree (git lists a submodule as one entry).

The unit tests use the Snapshotter directly (bounds lowered with monkeypatch); the scenario tests
drive the real ``handoffd`` against a git work tree (``test_contracts_hostile``'s worker).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace
from test_contracts_hostile import PY, git, make_workspace, native, submit_and_run

from handoffd.features.contracts import walk
from handoffd.features.contracts.snapshots import ScopeUnverifiable, Snapshotter

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def files(root: Path, names: dict[str, str]) -> None:
    """Write ``names`` (relative path: text) under ``root``."""
    for rel, text in names.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def many(root: Path, folder: str, count: int) -> None:
    """``count`` empty files in ``root/folder``."""
    (root / folder).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (root / folder / f"f{i}").write_text("")


def plain_git(root: Path, *args: str) -> None:
    """git in a test repository (identity and local-path submodules allowed)."""
    subprocess.run(["git", "-C", str(root), "-c", "user.email=t@example.invalid",
                    "-c", "user.name=t", "-c", "protocol.file.allow=always", *args],
                   check=True, timeout=60, capture_output=True)


def library(tmp_path: Path) -> Path:
    """A small repository (``a.py``) to add as a submodule."""
    lib = tmp_path / "lib"
    files(lib, {"a.py": "A = 1\n"})
    plain_git(lib, "init", "-q")
    plain_git(lib, "add", "-A")
    plain_git(lib, "commit", "-qm", "lib")
    return lib


def repo_with_submodule(tmp_path: Path) -> Path:
    """A git work tree ``ws`` holding ``x.py`` and the submodule ``vendor/lib`` (``a.py``)."""
    lib = library(tmp_path)
    ws = tmp_path / "ws"
    files(ws, {"x.py": "X = 1\n"})
    plain_git(ws, "init", "-q")
    plain_git(ws, "add", "-A")
    plain_git(ws, "commit", "-qm", "init")
    plain_git(ws, "submodule", "add", "-q", str(lib), "vendor/lib")
    plain_git(ws, "commit", "-qm", "submodule")
    return ws


# ---------------------------------------------------------------- bounds: too many entries
def test_a_tree_past_the_entry_bound_is_incomplete_never_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    many(tmp_path, "big", 60)
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    assert before.incomplete and not before.entries
    assert before.note == before.incomplete == (
        "the contract directory holds more than 50 files and folders (the snapshot limit: list "
        "large folders in the contract's scope_ignore, or narrow its cwd)")
    (tmp_path / "outside.py").write_text("written while the snapshot could not see the tree")
    with pytest.raises(ScopeUnverifiable) as caught:
        snapper.changes(before)
    assert str(caught.value) == ("the scope cannot be verified: before the handler ran, "
                                 + before.note)


def test_a_tree_planted_past_the_bound_by_the_handler_is_unverifiable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    many(tmp_path, "small", 10)
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    assert not before.incomplete and len(before.entries) == 10
    many(tmp_path, "planted", 100)
    with pytest.raises(ScopeUnverifiable, match="^the scope cannot be verified: after the handler "
                       "ran, the contract directory holds more than 50 files and folders"):
        snapper.changes(before)


def test_scope_ignore_keeps_a_big_folder_out_of_the_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    many(tmp_path, "node_modules", 100)
    files(tmp_path, {"src/a.py": "a"})
    snapper = Snapshotter(tmp_path, mode="hash", skip=lambda rel: rel.startswith("node_modules"))
    before = snapper.take()
    assert not before.incomplete and list(before.entries) == ["src/a.py"]
    (tmp_path / "src/a.py").write_text("b")
    assert [c.path for c in snapper.changes(before)[0]] == ["src/a.py"]


def test_empty_folders_count_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a tree of folders and no file must not be walked without end either
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    for i in range(60):
        (tmp_path / "wide" / f"d{i}").mkdir(parents=True)
    assert Snapshotter(tmp_path, mode="hash").take().incomplete


@needs_git
def test_git_mode_counts_the_listing_and_the_nested_repository_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    files(tmp_path, {"a.py": "a"})
    plain_git(tmp_path, "init", "-q")
    snapper = Snapshotter(tmp_path, mode="git")
    before = snapper.take()
    assert before.mode == "git" and not before.incomplete
    many(tmp_path, "hidden", 60)  # a nested repository: git names its folder only, it is walked
    plain_git(tmp_path / "hidden", "init", "-q")
    with pytest.raises(ScopeUnverifiable, match="after the handler ran, the contract directory "
                       "holds more than 50 files"):
        snapper.changes(before)
    shutil.rmtree(tmp_path / "hidden")
    many(tmp_path, "untracked", 60)  # plain untracked files: git lists each
    with pytest.raises(ScopeUnverifiable, match="holds more than 50 files"):
        snapper.changes(before)
    assert Snapshotter(tmp_path, mode="git").take().mode == "git"  # incomplete, still git's


# ---------------------------------------------------------------- bounds: depth, long paths
def test_a_tree_past_the_depth_bound_is_unverifiable_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walk, "MAX_DEPTH", 8)
    files(tmp_path, {"a/b/c.py": "c"})
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    assert list(before.entries) == ["a/b/c.py"]
    (tmp_path / "deep" / "/".join(["d"] * 20)).mkdir(parents=True)
    with pytest.raises(ScopeUnverifiable) as caught:
        snapper.changes(before)
    assert str(caught.value) == (
        "the scope cannot be verified: after the handler ran, deep/d/d/d/d/d/d/d/d is nested "
        "more than 8 folders deep (the snapshot limit: list large folders in the contract's "
        "scope_ignore, or narrow its cwd)")


def test_a_path_too_long_for_the_system_is_unverifiable_never_an_oserror(tmp_path: Path) -> None:
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    fd = os.open(tmp_path, os.O_RDONLY)
    try:  # 30 levels of 200 characters: past PATH_MAX (4096), built relative to each parent
        for _ in range(30):
            os.mkdir("d" * 200, dir_fd=fd)
            child = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("payload", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)
    with pytest.raises(ScopeUnverifiable) as caught:
        snapper.changes(before)
    message = str(caught.value)
    assert message.startswith("the scope cannot be verified: after the handler ran, "
                              "cannot look at ddd")
    assert message.endswith("...: File name too long") and len(message) < 300


# ---------------------------------------------------------------- what the walk never enters
def test_the_walk_never_enters_a_symlinked_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    files(outside, {"secret.txt": "s", "sub/more.txt": "m"})
    root = tmp_path / "root"
    files(root, {"a.py": "a"})
    (root / "link").symlink_to(outside, target_is_directory=True)
    snapper = Snapshotter(root, mode="hash")
    before = snapper.take()
    assert sorted(before.entries) == ["a.py", "link"] and before.entries["link"].kind == "link"
    (outside / "secret.txt").write_text("changed outside the directory: not watched")
    assert snapper.changes(before)[0] == []


def test_a_symlink_swapped_in_for_a_folder_mid_walk_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside = tmp_path / "outside"
    many(outside, "", 5)
    root = tmp_path / "root"
    files(root, {"src/a.py": "a"})
    real_scandir = os.scandir
    swapped: list[bool] = []

    class Listed:
        """A folder's entries, read before the swap (as a walk that lost the race saw them)."""

        def __init__(self, items: list[os.DirEntry[str]]) -> None:
            self.items = items

        def __enter__(self) -> Iterator[os.DirEntry[str]]:
            return iter(self.items)

        def __exit__(self, *exc: object) -> None:
            return None

    def racing_scandir(target: int) -> Listed:  # the root listed: swap src for a symlink now
        with real_scandir(target) as entries:
            items = list(entries)
        if not swapped:
            swapped.append(True)
            shutil.rmtree(root / "src")
            (root / "src").symlink_to(outside, target_is_directory=True)
        return Listed(items)
    monkeypatch.setattr(walk.os, "scandir", racing_scandir)
    found = Snapshotter(root, mode="hash")._walk()
    assert swapped and found == {"src"}  # the link itself, never outside's files


def test_the_walk_never_enters_handoffs_or_git_internals(tmp_path: Path) -> None:
    files(tmp_path, {"a.py": "a", "handoffs/pending/x.json": "{}", ".git/HEAD": "ref",
                     "sub/.git/config": "[core]", "sub/b.py": "b"})
    snapper = Snapshotter(tmp_path, mode="hash",
                          skip=lambda rel: rel == "handoffs" or rel.startswith("handoffs/"))
    before = snapper.take()
    assert sorted(before.entries) == ["a.py", "sub/b.py"]
    files(tmp_path, {"handoffs/pending/y.json": "{}", ".git/HEAD": "other", "sub/.git/config": "x"})
    assert snapper.changes(before)[0] == []


def test_a_folder_the_walk_cannot_open_is_an_entry_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files(tmp_path, {"a.py": "a"})
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    files(tmp_path, {"locked/payload.py": "hidden from a reader"})
    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if path == "locked" and kwargs.get("dir_fd") is not None:  # (root ignores permissions)
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(walk.os, "open", refusing_open)
    changes, after = snapper.changes(before)
    assert [(c.path, c.change) for c in changes] == [("locked", "created")]
    assert after.entries["locked"].kind == "folder"


# ---------------------------------------------------------------- submodules
@needs_git
def test_writes_inside_a_submodule_are_seen(tmp_path: Path) -> None:
    ws = repo_with_submodule(tmp_path)
    snapper = Snapshotter(ws, mode="git")
    before = snapper.take()
    assert before.mode == "git" and not before.incomplete
    assert {"x.py", "vendor/lib/a.py"} <= set(before.entries)
    assert "vendor/lib" not in before.entries  # the submodule's folder is no file
    (ws / "vendor/lib/a.py").write_text("A = 2\n")
    (ws / "vendor/lib/new.py").write_text("new\n")
    changes, after = snapper.changes(before)
    assert [(c.path, c.change) for c in changes] == [("vendor/lib/a.py", "modified"),
                                                     ("vendor/lib/new.py", "created")]
    assert snapper.changes(after)[0] == []  # and nothing more when nothing changed


@pytest.fixture
def sws(tmp_path: Path) -> Iterator[Workspace]:
    """A git work tree with the submodule ``vendor/lib`` (``test_contracts_hostile``'s tree)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    lib = library(tmp_path)
    ws = make_workspace(tmp_path, repo=True)
    git(ws.root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib),
        "vendor/lib")
    git(ws.root, "commit", "-qm", "submodule")
    yield ws
    ws.cleanup()


def test_the_daemon_fails_a_write_inside_a_submodule_outside_files_owned(sws: Workspace) -> None:
    doc, stderr = submit_and_run(sws, native("sub-write", {"files_owned": ["src/auth/**"]}, {
        "append": {"vendor/lib/a.py": "# planted\n", "src/auth/service.py": "# in scope\n"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION", doc.get("error")
    assert "vendor/lib/a.py: modified outside files_owned" in doc["error"]["message"]
    assert doc["validation"]["scope"]["mode"] == "git"
    assert "Traceback" not in stderr
    # owning the submodule makes the same write allowed
    doc, _ = submit_and_run(sws, native("sub-owned", {"files_owned": ["vendor/lib/**"]}, {
        "append": {"vendor/lib/a.py": "# owned\n"}}))
    assert sws.state_of("sub-owned") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes"] == [{"path": "vendor/lib/a.py",
                                                      "change": "modified"}]


# ---------------------------------------------------------------- the daemon, end to end
DEEP = ["-c", "import os; os.makedirs(os.path.join('deep', *['d'] * 140))"]


def test_a_deep_tree_planted_by_a_worker_fails_in_one_line_and_never_stalls(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, repo=False)
    try:
        doc, stderr = submit_and_run(ws, native("planter", {"files_owned": ["src/auth/**"]},
                                                {"run": [[PY, *DEEP]]}))
        assert doc["error"]["code"] == "CONTRACT_VIOLATION", doc.get("error")
        message = doc["error"]["message"]
        assert message.startswith("handoff planter broke its contract: the scope cannot be "
                                  "verified: after the handler ran, deep/d/d/")
        assert (f"is nested more than {walk.MAX_DEPTH} folders deep (the snapshot limit"
                in message)
        assert "\n" not in message and "Traceback" not in stderr
        assert doc["retry_available"] is False
        logged = [json.loads(line) for line in
                  (ws.root / "handoffs/.meta/violations.jsonl").read_text().splitlines()]
        assert [(e["kind"], e["handoff_id"]) for e in logged] == [("scope_creep", "planter")]
        assert "nested more than" in logged[0]["details"]["message"]
        # the tree stays: the next contract cannot be verified either, and says so
        doc, _ = submit_and_run(ws, native("next", {"files_owned": ["src/auth/**"]},
                                           {"append": {"src/auth/service.py": "# ok\n"}}))
        assert doc["error"]["code"] == "CONTRACT_VIOLATION"
        assert ("the scope cannot be verified: before the handler ran, deep/d/d/"
                in doc["error"]["message"])
        # scope_ignore is the way out
        doc, _ = submit_and_run(ws, native("ignoring", {"files_owned": ["src/auth/**"],
                                                        "scope_ignore": ["deep/**"]},
                                           {"append": {"src/auth/service.py": "# ok\n"}}))
        assert ws.state_of("ignoring") == ["completed"], doc.get("error")
    finally:
        ws.cleanup()


def test_a_contract_directory_inside_handoffs_is_refused(tmp_path: Path) -> None:
    """A contract whose cwd lies in handoffs/ watched handoffd's own files, which every filing
    changes: refused as a bad contract, like a cwd outside the workspace."""
    from handoffd.core.errors import InvalidDocument
    from handoffd.features.contracts.contract import Contract
    (tmp_path / "handoffs" / "pending").mkdir(parents=True)
    (tmp_path / "src").mkdir()

    def contract(cwd: str) -> Contract:
        return Contract(task_id="t1", files_owned=("**",), files_readonly=(), dependencies=(),
                        criteria=(), cwd=cwd, criteria_timeout=10.0, scope_check="auto",
                        scope_ignore=())

    assert contract("src").directory(tmp_path) == (tmp_path / "src").resolve()
    for cwd in ("handoffs", "handoffs/pending", "src/../handoffs"):
        with pytest.raises(InvalidDocument, match="inside handoffs/"):
            contract(cwd).directory(tmp_path)
