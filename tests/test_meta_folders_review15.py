"""Found by the fifteenth review: a symlink planted at ``handoffs/.meta/cancel`` or
``handoffs/.meta/procs`` took the daemon's reads, writes and removals outside the workspace.
Every rescan deleted the ``*.json`` files of the folder ``cancel`` pointed to (a project's
package.json, tsconfig.json) as cancel requests for unknown handoffs; every attempt wrote its
process record where ``procs`` pointed, and every sweep removed the dot-files there older than
a minute (a home folder's .bashrc). Both folders are now used only as plain folders of the
workspace, opened without following a link: a link there is one error line (once), nothing is
read, written or removed through it, and ``handoff cancel`` of a running handoff, whose request
cannot then be recorded, says so in one line (exit 1)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, exe, new_workspace

PRINT = [sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])"]
SLEEP = [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(60); "
         "print('{\"status\": \"completed\"}')"]
CONFIG = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@ok"]
command = {json.dumps([*PRINT, json.dumps({"status": "completed"})])}
retry = {{ max_retries = 0 }}

[specialists."@slow"]
command = {json.dumps(SLEEP)}
retry = {{ max_retries = 0 }}
"""
OLD = time.mktime((2020, 1, 1, 0, 0, 0, 0, 0, -1))  # long past every "older than a minute"


@pytest.fixture
def mws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def native(handoff_id: str, target: str) -> dict[str, object]:
    return {"handoff_id": handoff_id, "target": {"agent_id": target}, "input": {"data": {}}}


def outside(tmp_path: Path, files: dict[str, str]) -> Path:
    """A folder outside the workspace holding ``files`` (all dated 2020)."""
    folder = tmp_path / "outside"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
        os.utime(folder / name, (OLD, OLD))
    return folder


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def serve(ws: Workspace, log: Path) -> subprocess.Popen[bytes]:
    """``handoffd serve`` with its stderr in ``log`` (read while it runs, never a full pipe)."""
    with open(log, "wb") as handle:
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=handle)
    ws.daemons.append(proc)  # (cleanup kills it by pid if a test fails before stopping it)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def lines_naming(text: str, folder: str) -> list[str]:
    return [line for line in text.splitlines() if f".meta/{folder}" in line]


def test_a_symlinked_cancel_folder_is_never_read_or_swept(mws: Workspace, tmp_path: Path) -> None:
    """The review's reproduction: `.meta/cancel` a link to a project folder, `serve` for a few
    rescans: package.json and tsconfig.json were deleted. A `c-gate.json` there cancelled the
    pending handoff of that id (read through the link), and filing `c-ok` removed `c-ok.json`."""
    files = {"package.json": '{"name": "proj"}\n', "tsconfig.json": "{}\n",
             "c-ok.json": '{"reason": "outside"}\n', "c-gate.json": '{"reason": "outside"}\n'}
    target = outside(tmp_path, files)
    os.symlink(target, mws.root / "handoffs" / ".meta" / "cancel")
    mws.drop("c-ok.json", native("c-ok", "@ok"))
    mws.drop("c-gate.json", native("c-gate", "@ok"))
    log = tmp_path / "serve.log"
    daemon = serve(mws, log)
    try:
        for hid in ("c-ok", "c-gate"):
            mws.wait_state(hid, timeout=30)
        deadline = time.monotonic() + 20  # (the code before said nothing: no failing here)
        while not lines_naming(log.read_text(), "cancel") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # several rescans and sweeps (0.5 s each) with the link in place
    finally:
        assert stop(daemon) == 0
    said = log.read_text()
    assert "Traceback" not in said, said
    assert contents(target) == files  # nothing removed or written there
    assert mws.state_of("c-ok") == ["completed"] and mws.state_of("c-gate") == ["completed"], said
    named = lines_naming(said, "cancel")
    refused = [line for line in named if "not a folder of the workspace" in line]
    watch = [line for line in named if "cannot watch" in line]  # (the watch never follows it)
    assert len(refused) == 1 and len(watch) <= 1 and len(named) == len(refused) + len(watch), said


def test_cancel_says_in_one_line_that_no_request_can_be_recorded(mws: Workspace,
                                                                  tmp_path: Path) -> None:
    """Cancelling a running handoff records a request in `.meta/cancel`: through a link it was
    written outside the workspace. Now `handoff cancel` refuses with one line (exit 1) and
    nothing is written; once the folder is a folder again, the request is recorded and met."""
    target = outside(tmp_path, {"keep.txt": "x\n"})
    link = mws.root / "handoffs" / ".meta" / "cancel"
    os.symlink(target, link)
    log = tmp_path / "serve.log"
    daemon = serve(mws, log)
    try:
        hid = mws.create("--to", "@slow", "--data", "{}", "--id", "c-slow")
        mws.wait_state(hid, ("in-progress",), timeout=30)
        refused = mws.handoff("cancel", hid, "--timeout", "1", timeout=60)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 1 and len(lines) == 1, refused.stderr
        assert "no cancel request can be recorded" in lines[0] and "Traceback" not in lines[0]
        assert contents(target) == {"keep.txt": "x\n"}
        assert mws.state_of(hid) == ["in-progress"]
        link.unlink()  # a folder of the workspace again: the request is recorded and met
        link.mkdir()
        done = mws.handoff("cancel", hid, "--timeout", "30", timeout=60)
        assert done.returncode == 0, done.stderr
        assert mws.wait_state(hid, timeout=30) == "failed"
        assert mws.doc(hid)["status"] == "cancelled"
    finally:
        assert stop(daemon) == 0
    assert "Traceback" not in log.read_text()


def test_a_symlinked_procs_folder_is_never_written_or_pruned(mws: Workspace,
                                                             tmp_path: Path) -> None:
    """The review's reproduction: `.meta/procs` a link to a folder with old dot-files: running
    a command specialist wrote its process record there and the sweep removed the dot-files."""
    files = {".bashrc": "alias x=y\n", ".gitconfig": "[user]\n", ".p1.tok.tmp": "{}",
             "p0.json": "{}"}
    target = outside(tmp_path, files)
    os.symlink(target, mws.root / "handoffs" / ".meta" / "procs")
    for hid in ("p1", "p2"):
        mws.create("--to", "@ok", "--data", "{}", "--id", hid)
    proc = mws.handoffd("run", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    swept = mws.handoffd("sweep", timeout=120)
    assert swept.returncode == 0 and "Traceback" not in swept.stderr, swept.stderr
    assert contents(target) == files  # no record written, no dot-file or record removed
    assert mws.state_of("p1") == ["completed"] and mws.state_of("p2") == ["completed"]
    named = lines_naming(proc.stderr, "procs")
    assert len(named) == 1 and "not a folder of the workspace" in named[0], proc.stderr


def test_only_a_records_own_temp_files_are_pruned(mws: Workspace) -> None:
    """In `.meta/procs` itself the sweep removed every dot-file older than a minute; only a
    record's temp file (`.<id>.<token>.tmp`, a regular file) is a dead writer's to remove."""
    folder = mws.root / "handoffs" / ".meta" / "procs"
    folder.mkdir(parents=True, exist_ok=True)
    for name in (".keep", ".h1.tok.tmp"):
        (folder / name).write_text("x")
        os.utime(folder / name, (OLD, OLD))
    swept = mws.handoffd("sweep", timeout=120)
    assert swept.returncode == 0 and "Traceback" not in swept.stderr, swept.stderr
    assert sorted(os.listdir(folder)) == [".keep"]
