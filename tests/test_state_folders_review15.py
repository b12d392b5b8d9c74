"""The four state folders and the entries in them that cannot be read (review s15, fixer FC).

A. A state folder that is a symlink was followed: ``handoffs/completed`` linked out filed
   results outside the workspace (and ``handoff purge`` deleted old files there), and linked to
   ``pending`` the sweep took the document for its own duplicate and unlinked it (the handoff
   was lost). Every command and the daemon now refuse such a workspace with one line, exit 2,
   and the sweep never unlinks a "duplicate" that is the same file.
B. A junk entry beside a completed document (``failed/dN.json`` not JSON, a folder
   ``failed/d1.json``) made ``handoff show`` fail, ``handoff wait`` wait for ever, and the
   sweep stop at the folder (IsADirectoryError) for every id after it. A readable copy now
   wins, and the sweep sets each unreadable copy aside.
C. ``handoff wait`` on an unreadable entry where nothing ever moves it (completed/, failed/,
   in-progress/) waited silently for ever; it now ends with the read error (one line, exit 1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, reason_codes

from handoffd.backends.files import repair
from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.files.store import Store
from handoffd.core.errors import ConfigError
from handoffd.core.workspace import Workspace as HandoffdWorkspace

OK_TOML = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0

[specialists."@ok"]
command = [{sys.executable!r}, "-c", "import json,sys; json.load(sys.stdin); print(json.dumps({{'status':'completed','output':{{'x':1}}}}))"]
"""

AN_HOUR_AGO = time.time() - 3600
OLD = time.mktime((2020, 1, 1, 0, 0, 0, 0, 0, -1))


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", OK_TOML)
    yield workspace
    workspace.cleanup()


def folder(ws: Workspace, state: str) -> Path:
    return ws.root / "handoffs" / state


def one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], proc.stderr


# ------------------------------------------------------------------ A: symlinked state folders
def test_a_completed_folder_linked_out_is_refused_by_every_command(ws: Workspace,
                                                                    tmp_path: Path) -> None:
    hid = ws.create("--to", "@ok", "--data", "{}")
    outside = tmp_path / "out"
    outside.mkdir()
    old = outside / "old-report.json"
    old.write_text(json.dumps({"handoff_id": "keep", "status": "completed"}))
    os.utime(old, (OLD, OLD))
    folder(ws, "completed").rmdir()
    folder(ws, "completed").symlink_to(outside)

    run = ws.handoffd("run", timeout=60)
    assert run.returncode == 2, (run.returncode, run.stderr)
    one_line_error(run, "handoffs/completed", "symlink")
    assert sorted(p.name for p in outside.iterdir()) == ["old-report.json"]  # nothing filed there
    assert (folder(ws, "pending") / f"{hid}.json").exists()  # not run, not lost

    purge = ws.handoff("purge", "--older-than", "1d")
    assert purge.returncode == 2, (purge.returncode, purge.stderr)
    one_line_error(purge, "symlink")
    assert old.exists()  # never deleted through the link

    for args in (("create", "--to", "@ok", "--data", "{}"), ("show", hid), ("ls",),
                 ("wait", hid, "--timeout", "1")):
        proc = ws.handoff(*args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        one_line_error(proc, "handoffs/completed")
    sweep = ws.handoffd("sweep", timeout=60)
    assert sweep.returncode == 2, sweep.stderr
    one_line_error(sweep, "handoffs/completed")


def test_the_daemon_refuses_to_start_on_a_state_folder_linked_to_another(ws: Workspace) -> None:
    hid = ws.create("--to", "@ok", "--data", "{}")
    folder(ws, "completed").rmdir()
    folder(ws, "completed").symlink_to("pending")
    proc = subprocess.run([exe("handoffd"), "serve", "--root", str(ws.root)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    one_line_error(proc, "handoffs/completed", "symlink")
    assert (folder(ws, "pending") / f"{hid}.json").exists()


@pytest.mark.parametrize("make", ["dangling-link", "file", "link-to-folder-outside"])
def test_a_state_folder_that_is_no_plain_folder_is_refused(ws: Workspace, tmp_path: Path,
                                                           make: str) -> None:
    path = folder(ws, "failed")
    path.rmdir()
    if make == "dangling-link":
        path.symlink_to(tmp_path / "nowhere")
    elif make == "file":
        path.write_text("")
    else:
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    for proc in (ws.handoff("ls"), ws.handoff("create", "--to", "@ok", "--data", "{}")):
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        one_line_error(proc, "handoffs/failed")
    assert sorted(os.listdir(folder(ws, "pending"))) == []


def test_the_files_backend_refuses_a_symlinked_state_folder_when_opened(ws: Workspace) -> None:
    folder(ws, "in-progress").rmdir()
    folder(ws, "in-progress").symlink_to("pending")
    for ensure in (True, False):
        with pytest.raises(ConfigError, match="in-progress"):
            FilesBackend.open(HandoffdWorkspace(ws.root), watch=False, ensure=ensure)


def test_the_sweep_never_unlinks_a_duplicate_that_is_the_same_file(ws: Workspace) -> None:
    # the reviewer's repro 2, below the refusal: the sweep itself, on completed/ -> pending/
    hid = ws.create("--to", "@ok", "--data", "{}")
    folder(ws, "completed").rmdir()
    folder(ws, "completed").symlink_to("pending")
    store = Store(HandoffdWorkspace(ws.root))
    try:
        done: dict[str, list[str]] = {"duplicates_resolved": []}
        repair.resolve_duplicates(store, done)
    finally:
        store.close()
    assert (folder(ws, "pending") / f"{hid}.json").exists()  # not lost
    assert done["duplicates_resolved"] == []


# ------------------------------------------------------------------ B: junk beside a completed copy
def test_junk_and_a_folder_beside_completed_documents(ws: Workspace) -> None:
    ids = [f"d{i}" for i in range(1, 9)]
    for hid in ids:
        ws.create("--to", "@ok", "--id", hid, "--data", "{}")
    assert ws.handoffd("run", timeout=120).returncode == 0
    assert sorted(os.listdir(folder(ws, "completed"))) == [f"{h}.json" for h in ids]
    for hid in ids[1:]:
        (folder(ws, "failed") / f"{hid}.json").write_text('{"x":')
    (folder(ws, "failed") / "d1.json").mkdir()

    show = ws.handoff("show", "d2", "--json")
    assert show.returncode == 0, show.stderr
    wait = ws.handoff("wait", "d2", "--timeout", "5", timeout=30)
    assert wait.returncode == 0, (wait.returncode, wait.stderr)
    wait = ws.handoff("wait", "d1", "--timeout", "5", timeout=30)
    assert wait.returncode == 0, (wait.returncode, wait.stderr)

    sweep = ws.handoffd("sweep", timeout=60)
    assert sweep.returncode == 0, sweep.stderr
    assert "ERROR" not in sweep.stderr and "Traceback" not in sweep.stderr, sweep.stderr
    assert "resolved 8 duplicate" in sweep.stderr, sweep.stderr
    assert os.listdir(folder(ws, "failed")) == []  # every junk copy set aside, none left
    assert sorted(os.listdir(folder(ws, "completed"))) == [f"{h}.json" for h in ids]
    codes = reason_codes(ws.root)
    assert sorted(codes) == [f"{h}.json" for h in ids]
    assert codes["d1.json"] == "NOT_A_REGULAR_FILE"
    assert codes["d2.json"] == "MALFORMED_JSON"


def test_a_readable_failed_result_is_kept_over_junk_in_completed(ws: Workspace) -> None:
    # the rule "completed wins" is for documents: a junk entry there never deletes the result
    hid = ws.create("--to", "@nobody", "--data", "{}", "--timeout-seconds", "1")
    result = {"handoff_id": hid, "status": "failed",
              "error": {"code": "X", "message": "no", "retryable": False}}
    pending = folder(ws, "pending") / f"{hid}.json"
    pending.unlink()
    (folder(ws, "failed") / f"{hid}.json").write_text(json.dumps(result))
    (folder(ws, "completed") / f"{hid}.json").write_text("{")
    os.utime(folder(ws, "completed") / f"{hid}.json", (AN_HOUR_AGO, AN_HOUR_AGO))
    sweep = ws.handoffd("sweep", timeout=60)
    assert sweep.returncode == 0, sweep.stderr
    assert json.loads((folder(ws, "failed") / f"{hid}.json").read_text()) == result
    assert not (folder(ws, "completed") / f"{hid}.json").exists()  # set aside, not deleted
    assert reason_codes(ws.root) == {f"{hid}.json": "MALFORMED_JSON"}


# ------------------------------------------------------------------ C: wait on an unreadable entry
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.mkdir()


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere.json")


def _old(data: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_text(data)
        os.utime(path, (AN_HOUR_AGO, AN_HOUR_AGO))
    return make


UNREADABLE = [("completed", _fifo, "not a regular file"),
              ("failed", _folder, "not a regular file"),
              ("completed", _dangling, "symlink"),
              ("failed", _old(""), "empty"),
              ("completed", _old('{"handoff_id": "w'), "not valid JSON"),
              ("in-progress", _old('{"handoff_id": "w'), "not valid JSON")]


@pytest.mark.parametrize("state,make,said", UNREADABLE,
                         ids=["fifo-completed", "dir-failed", "dangling-completed",
                              "empty-failed", "truncated-completed", "truncated-in-progress"])
def test_wait_on_an_unreadable_entry_ends_with_its_read_error(
        ws: Workspace, state: str, make: Callable[[Path], None], said: str) -> None:
    make(folder(ws, state) / "w1.json")
    started = time.monotonic()
    wait = ws.handoff("wait", "w1", "--timeout", "20", timeout=60)
    assert wait.returncode == 1, (wait.returncode, wait.stderr)
    assert time.monotonic() - started < 15, "the wait ran to its timeout"
    one_line_error(wait, f"{state}/w1.json", said)
    show = ws.handoff("show", "w1")
    assert show.returncode == 1 and said in show.stderr, show.stderr


def test_wait_keeps_waiting_on_a_pending_document_still_being_written(ws: Workspace) -> None:
    (folder(ws, "pending") / "w2.json").write_text('{"handoff_id": "w')
    wait = ws.handoff("wait", "w2", "--timeout", "1", timeout=60)
    assert wait.returncode == 124, (wait.returncode, wait.stderr)


def test_wait_reads_a_result_rewritten_in_place_while_it_settles(tmp_path: Path) -> None:
    # seed 001's consumer moves its request into completed/, then rewrites it in place: a
    # truncated copy changed within the settle window is still being written, not the answer
    workspace = new_workspace(tmp_path / "ws", OK_TOML.replace("settle_seconds = 0.1",
                                                              "settle_seconds = 30"))
    try:
        path = workspace.root / "handoffs" / "completed" / "w3.json"
        path.write_text('{"handoff_id": "w3", "sta')
        waiter = subprocess.Popen([exe("handoff"), "wait", "w3", "--timeout", "20", "--root",
                                   str(workspace.root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert waiter.poll() is None, waiter.communicate()
        with open(path, "w") as out:
            json.dump({"handoff_id": "w3", "status": "completed", "output": {"x": 1}}, out)
        _, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 0, (waiter.returncode, err)
    finally:
        workspace.cleanup()
