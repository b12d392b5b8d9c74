"""Symlinks planted for handoffd's own folders of the store, ``handoffs/.tmp`` and
``handoffs/.locks`` (review s12, R1).

The sweep (``orphans.remove_orphans``) followed such a symlink and deleted files outside the
workspace: in the ``.tmp`` target every file older than five minutes (and a level of subfolders),
in the ``.locks`` target every unlocked ``*.lock`` file (``Cargo.lock``, ``poetry.lock``). And a
claim made its owner lock file through the link. Now neither folder is swept nor written through
a symlink: every command and the daemon refuse such a workspace at start (exit 2, one line naming
the folder; see test_swapped_folders_s16.py for a folder swapped while they run), and the store's
own pieces, used from the library, still refuse each use.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, new_workspace

from handoffd.backends.files import orphans, repair
from handoffd.backends.files.store import Store
from handoffd.core.workspace import Workspace as HandoffdWorkspace

OK_TOML = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0

[specialists."@ok"]
command = [{sys.executable!r}, "-c", "print('{{\\"status\\": \\"completed\\", \\"output\\": {{}}}}')"]
"""


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", OK_TOML)
    yield workspace
    workspace.cleanup()


def link_out(ws_root: Path, folder: str, outside: Path) -> None:
    """Replace ``handoffs/<folder>`` (empty) by a symlink to ``outside``."""
    inside = ws_root / "handoffs" / folder
    inside.rmdir()
    inside.symlink_to(outside)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def old_files_outside(tmp_path: Path) -> tuple[Path, Path]:
    """A folder of old temp-like files (one in a subfolder), and one of unlocked lock files."""
    temps, project = tmp_path / "outside-tmp", tmp_path / "outside-project"
    (temps / "sub").mkdir(parents=True)
    project.mkdir()
    (temps / "report.txt").write_text("important")
    (temps / "sub" / "notes.txt").write_text("nested")
    (project / "Cargo.lock").write_text("# lockfile")
    (project / "poetry.lock").write_text("# lockfile")
    an_hour_ago = time.time() - 3600
    for path in (temps / "report.txt", temps / "sub" / "notes.txt", temps / "sub", temps):
        os.utime(path, (an_hour_ago, an_hour_ago))
    return temps, project


def test_the_sweep_never_deletes_outside_through_a_symlinked_tmp_or_locks(
        ws: Workspace, tmp_path: Path) -> None:
    temps, project = old_files_outside(tmp_path)
    before = tree(temps), tree(project)
    link_out(ws.root, ".tmp", temps)
    link_out(ws.root, ".locks", project)
    proc = ws.handoffd("sweep", timeout=60)
    assert proc.returncode == 2, proc.stderr  # refused at start
    assert (tree(temps), tree(project)) == before  # nothing removed outside
    assert "Traceback" not in proc.stderr
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and "bookkeeping folder of the workspace (it is a symlink)" in said[0]


def test_the_sweep_still_sweeps_a_plain_tmp_beside_a_symlinked_locks(tmp_path: Path) -> None:
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    _, project = old_files_outside(tmp_path)
    link_out(root.root, ".locks", project)
    stale = root.tmp / "x.tmp"
    stale.write_text("")
    os.utime(stale, (time.time() - 3600,) * 2)
    store = Store(root, durable=False)
    done: orphans.Repairs = {"temp_files_removed": [], "locks_removed": []}
    orphans.remove_orphans(store, done)
    assert done == {"temp_files_removed": ["x.tmp"], "locks_removed": []}
    assert sorted(p.name for p in project.iterdir()) == ["Cargo.lock", "poetry.lock"]
    # nor is a recovery lock made (and removed) through it
    assert repair.recover_guard(store, "some-id") is None
    assert sorted(p.name for p in project.iterdir()) == ["Cargo.lock", "poetry.lock"]


def test_no_owner_lock_is_made_through_a_symlinked_locks(tmp_path: Path) -> None:
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    outside = tmp_path / "outside"
    outside.mkdir()
    link_out(root.root, ".locks", outside)
    store = Store(root, durable=False)
    try:
        with pytest.raises(OSError) as raised:
            store.owner_lock()
        assert raised.value.errno == errno.ENOTDIR and "symlink" in str(raised.value)
        assert str(root.locks) in str(raised.value)
        assert list(outside.iterdir()) == []
        assert list(root.tmp.iterdir()) == []  # nor staged anywhere else
    finally:
        store.close()


def test_a_claim_through_a_symlinked_locks_fails_with_one_line(ws: Workspace,
                                                               tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "Cargo.lock").write_text("# lockfile")
    link_out(ws.root, ".locks", outside)
    made = ws.handoff("create", "--to", "@ok", "--data", "{}")
    assert made.returncode == 2 and "handoffs/.locks" in made.stderr, made.stderr
    doc = '{"handoff_id": "h-1", "target": {"agent_id": "@ok"}, "input": {"data": {}}}'
    (ws.root / "handoffs" / "pending" / "h-1.json").write_text(doc)  # (a foreign producer's)
    proc = ws.handoffd("run", "--max-seconds", "1", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and "handoffs/.locks" in said[0], proc.stderr
    assert [p.name for p in outside.iterdir()] == ["Cargo.lock"]
    assert ws.state_of("h-1") == ["pending"]  # untouched: runs once the folder is one again


def test_no_temp_file_is_written_through_a_symlinked_tmp(ws: Workspace, tmp_path: Path) -> None:
    """Every document is written as a temp file in handoffs/.tmp, then renamed into place:
    through a symlink planted there, it was written outside the workspace first."""
    outside = tmp_path / "outside"
    outside.mkdir()
    link_out(ws.root, ".tmp", outside)
    proc = ws.handoff("create", "--to", "@ok", "--data", "{}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and "handoffs/.tmp" in said[0] and "symlink" in said[0], proc.stderr
    assert list(outside.iterdir()) == []
    assert list((ws.root / "handoffs" / "pending").iterdir()) == []


def test_recovery_makes_no_lock_file_through_a_symlinked_locks(tmp_path: Path) -> None:
    """A claim whose owner is gone is judged by trying its owner's lock file; through a symlink
    planted at handoffs/.locks that made (and removed) a file outside the workspace. Then only
    the lease's expiry tells."""
    from handoffd.core.native_format import new_native_request
    from handoffd.core.states import State
    from handoffd.core.timeutil import utc_now
    from handoffd.backends.files.backend import FilesBackend
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    first = FilesBackend(Store(root, durable=False), watch=False, claim_grace_seconds=0.0)
    doc = new_native_request(source="@t", target="@x", data={}, now=utc_now())
    hid = doc["handoff_id"]
    first.create(doc, hid, utc_now())
    assert first.claim(hid, utc_now(), 30.0) is not None
    first.close()  # its owner lock is dropped: the claim's owner is gone
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in root.locks.iterdir():
        entry.unlink()
    link_out(root.root, ".locks", outside)
    second = FilesBackend(Store(root, durable=False), watch=False, claim_grace_seconds=0.0)
    try:
        assert second.expired_claims(utc_now(), 30.0) == []  # the lease runs: not recovered
        assert list(outside.iterdir()) == []
        assert second.store.locate(hid) == [State.IN_PROGRESS]
    finally:
        second.close()


def test_nothing_is_set_aside_through_a_symlinked_quarantine(ws: Workspace, tmp_path: Path) -> None:
    """A document that cannot be run is moved to handoffs/.quarantine with a reason beside it;
    through a symlink planted there both went outside the workspace. Now the daemon refuses the
    workspace at start (exit 2, one line); the document stays where it is and is set aside once
    the folder is one again."""
    outside = tmp_path / "outside"
    outside.mkdir()
    quarantine = ws.root / "handoffs" / ".quarantine"
    if quarantine.is_dir():
        link_out(ws.root, ".quarantine", outside)
    else:
        quarantine.symlink_to(outside)
    (ws.root / "handoffs" / "pending" / "junk.json").write_text("{ not json")
    proc = ws.handoffd("run", "--max-seconds", "2", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # refused at start
    assert list(outside.iterdir()) == []
    assert "handoffs/.quarantine" in proc.stderr and "symlink" in proc.stderr, proc.stderr
    assert ws.state_of("junk") == ["pending"]  # kept, to be looked at again
    quarantine.unlink()
    for _ in range(5):  # (the first run's claim was given back to pending/: looked at again)
        ws.handoffd("run", "--max-seconds", "2", timeout=60)
        if ws.state_of("junk") == ["failed"]:  # (a stub saying why: the usual set-aside)
            break
        time.sleep(0.5)
    assert ws.state_of("junk") == ["failed"]
    assert any(p.name.endswith("junk.json") for p in (ws.root / "handoffs" / ".quarantine").iterdir())


def test_a_folder_swapped_for_a_symlink_during_the_sweep_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder was checked, then used by path: swapped for a link between the check and the
    removals, the sweep deleted the same-named files outside. It now sweeps through the
    descriptor it opened, so the swap moves nothing outside its reach."""
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    temps, project = old_files_outside(tmp_path)
    (temps / "x.tmp").write_text("outside")  # same names as the stale files inside
    an_hour_ago = time.time() - 3600
    os.utime(temps / "x.tmp", (an_hour_ago, an_hour_ago))
    for path in (root.tmp / "x.tmp", root.locks / "Cargo.lock"):
        path.write_text("")
        os.utime(path, (an_hour_ago, an_hour_ago))
    targets = {root.tmp.name: temps, root.locks.name: project}
    original = orphans._scan

    def scan_then_swap(folder: object) -> list[os.DirEntry[str]]:
        entries = original(folder)  # type: ignore[arg-type]
        name = os.path.basename(folder) if isinstance(folder, (str, Path)) \
            else os.readlink(f"/proc/self/fd/{folder}").rsplit("/", 1)[-1]
        if name in targets:  # listed: now the folder becomes a link to the outside
            inside = root.root / "handoffs" / name
            inside.rename(inside.with_name(name + "-swapped"))
            inside.symlink_to(targets[name])
        return entries

    monkeypatch.setattr(orphans, "_scan", scan_then_swap)
    done: orphans.Repairs = {"temp_files_removed": [], "locks_removed": []}
    orphans.remove_orphans(Store(root, durable=False), done)
    assert (temps / "x.tmp").read_text() == "outside"
    assert sorted(p.name for p in project.iterdir()) == ["Cargo.lock", "poetry.lock"]
    # what was removed is what the sweep listed, in the folders it opened
    assert done == {"temp_files_removed": ["x.tmp"], "locks_removed": ["Cargo.lock"]}
    assert not (root.root / "handoffs" / ".tmp-swapped" / "x.tmp").exists()
    assert not (root.root / "handoffs" / ".locks-swapped" / "Cargo.lock").exists()
