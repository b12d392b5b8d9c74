"""``handoff ls`` says when the daemon serving the workspace started with an older handoffd.toml
(a new user's complaint, session 25).

``handoffd serve`` reads handoffd.toml once, at its start; its sweep logs one warning per change
of the file, but users look at ``handoff ls``, not at the daemon's log: after an edit nothing
there said the running daemon still served the old configuration. Now a serving daemon records
itself (``handoffs/.meta/serving/``: pid, liveness mark, the file's stamp it started with) and
``ls`` prints one line on stderr when the file changed since; the JSON on stdout keeps its shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, exe, new_workspace

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service import daemon_records
from handoffd.service.daemon_records import ServingRecord, config_stamp, stale_daemons, stale_line

CONFIG = """
[daemon]
durability = "fast"
"""
SAID = "started before handoffd.toml last changed: restart it to apply the changes"


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def edit_config(path: Path) -> None:
    """A harmless change of handoffd.toml, its mtime a minute after now (after the daemon's
    start whatever the filesystem's timestamp granularity)."""
    path.write_text(path.read_text() + "# edited while the daemon serves\n")
    later = time.time_ns() + 60 * 10**9
    os.utime(path, ns=(later, later))


def ls_full(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    """``handoff ls`` through the full command line (typer), not the quick path."""
    return subprocess.run([exe("handoff"), "ls", *args, "--root", str(ws.root)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HANDOFFD_FULL_CLI": "1"})


def test_ls_says_the_serving_daemon_started_before_the_config_changed(ws: Workspace) -> None:
    daemon = ws.serve()
    quiet = ws.handoff("ls", check=True)
    assert SAID not in quiet.stderr and quiet.stderr == ""

    edit_config(ws.root / "handoffd.toml")
    line = (f"handoff: the daemon serving this workspace (pid {daemon.pid}) started before "
            "handoffd.toml last changed: restart it to apply the changes")
    for listed in (ws.handoff("ls", check=True), ls_full(ws)):  # the quick path, the full one
        assert listed.returncode == 0, listed.stderr
        assert listed.stderr.splitlines() == [line]
        assert line not in listed.stdout
    as_json = ws.handoff("ls", "--json", check=True)
    assert json.loads(as_json.stdout) == []  # stdout: the same JSON array as ever
    assert as_json.stderr.splitlines() == [line]

    assert ws.stop(daemon) == 0  # (SIGTERM to its pid)
    after = ws.handoff("ls", check=True)
    assert after.stderr == ""
    assert not list((ws.root / "handoffs" / ".meta" / "serving").glob("*.json"))  # removed


# ---------------------------------------------------------------- in-process: this process serves
@pytest.fixture
def home(tmp_path: Path) -> HandoffdWorkspace:
    workspace = HandoffdWorkspace(tmp_path / "home")
    workspace.root.mkdir()
    workspace.config_path.write_text(CONFIG)
    workspace.ensure()
    return workspace


def test_a_record_names_its_live_process_while_the_config_differs(home: HandoffdWorkspace) -> None:
    record = ServingRecord(home, config_stamp(home.config_path))
    record.write()
    assert stale_daemons(home) == []  # the file it started with
    edit_config(home.config_path)
    assert stale_daemons(home) == [os.getpid()]
    home.config_path.unlink()  # removed: a restart would serve the defaults, a change too
    assert stale_daemons(home) == [os.getpid()]
    record.remove()
    assert stale_daemons(home) == [] and stale_line(home) is None


def test_a_killed_daemons_record_says_nothing_and_the_next_serve_removes_it(
        home: HandoffdWorkspace) -> None:
    record = ServingRecord(home, None)  # started without a file, which is there now
    record.write()
    assert stale_daemons(home) == [os.getpid()]
    assert record.name is not None
    folder = home.meta / daemon_records.FOLDER
    left = json.loads((folder / record.name).read_text())
    dead = {**left, "proc": "0" * 16}  # a pid this mark does not fit: a dead (or reused) one
    (folder / "1.000000000001.json").write_text(json.dumps(dead))
    elsewhere = {**left, "host": "another-host"}  # not ours to judge, nor to remove
    (folder / "2.000000000002.json").write_text(json.dumps(elsewhere))
    record.remove()
    assert stale_daemons(home) == []
    ServingRecord(home, None).write()  # the next serve
    names = {path.name for path in folder.iterdir()}
    assert "1.000000000001.json" not in names and "2.000000000002.json" in names


def test_junk_in_the_records_folder_never_fails_ls(home: HandoffdWorkspace) -> None:
    folder = home.meta / daemon_records.FOLDER
    folder.mkdir()
    # (under the names a daemon gives its records: other names are never read)
    (folder / "11.00000000000a.json").write_text("{not json")
    (folder / "12.00000000000b.json").write_text("[1, 2]")
    (folder / "13.00000000000c.json").write_text(json.dumps({"pad": "x" * 10_000}))
    (folder / "14.00000000000d.json").mkdir()
    os.mkfifo(folder / "15.00000000000e.json")  # (opened without blocking: no hang)
    (folder / "16.00000000000f.json").symlink_to("/dev/zero")
    # a record this live process wrote, copied with each field wrong in turn
    ServingRecord(home, config_stamp(home.config_path)).write()
    good = json.loads(next(p for p in folder.glob(f"{os.getpid()}.*.json")).read_text())
    for n, (key, bad) in enumerate((("pid", "1"), ("pid", True), ("pid", -5), ("config", "x"),
                                    ("config", [1, 2]), ("config", [1, 2, 3, "4"]),
                                    ("proc", None))):
        (folder / f"{20 + n}.{n:012x}.json").write_text(json.dumps({**good, key: bad}))
    for path in folder.glob(f"{os.getpid()}.*.json"):
        path.unlink()
    edit_config(home.config_path)
    assert stale_daemons(home) == [] and stale_line(home) is None


def test_a_records_folder_that_is_a_symlink_or_a_file_is_not_read(home: HandoffdWorkspace,
                                                                   tmp_path: Path) -> None:
    outside = HandoffdWorkspace(tmp_path / "outside")
    outside.root.mkdir()
    outside.config_path.write_text(CONFIG)
    ServingRecord(outside, None).write()  # a live record (this process), stale everywhere
    (home.meta / daemon_records.FOLDER).symlink_to(outside.meta / daemon_records.FOLDER)
    assert stale_daemons(home) == []
    ServingRecord(home, None).write()  # the daemon refuses to write through it too (a warning)
    assert len(list((outside.meta / daemon_records.FOLDER).glob("*.json"))) == 1
    (home.meta / daemon_records.FOLDER).unlink()
    (home.meta / daemon_records.FOLDER).write_text("")
    assert stale_daemons(home) == [] and stale_line(home) is None


def test_several_daemons_make_one_line(home: HandoffdWorkspace,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_records, "stale_daemons", lambda ws: [11, 22])
    assert stale_line(home) == ("handoff: 2 daemons serving this workspace (pids 11, 22) started "
                                "before handoffd.toml last changed: restart them to apply the "
                                "changes")
    monkeypatch.setattr(daemon_records, "stale_daemons", lambda ws: list(range(1, 8)))
    assert "7 daemons serving this workspace (pids 1, 2, 3, 4, ...)" in str(stale_line(home))

    def broken(ws: HandoffdWorkspace) -> list[int]:
        raise RuntimeError("boom")
    monkeypatch.setattr(daemon_records, "stale_daemons", broken)
    assert stale_line(home) is None  # never ls's failure


def test_a_record_nested_thousands_deep_is_junk_to_serve_and_ls(tmp_path: Path) -> None:
    """R42: a planted file of 4 KB nested 2,048 deep made the json parser raise
    RecursionError, which the start-up's record write let out: serve exited 1."""
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    folder = ws.meta / daemon_records.FOLDER
    folder.mkdir(parents=True)
    (folder / "1.000000000abc.json").write_text("[" * 2048 + "]" * 2048)
    record = daemon_records.ServingRecord(ws, daemon_records.config_stamp(ws.config_path))
    record.write()  # (removes the dead, reading every record: never raises)
    assert record.name is not None and (folder / record.name).exists()
    assert daemon_records.stale_daemons(ws) == []
    record.remove()


def test_junk_names_never_hide_the_records_behind_them(tmp_path: Path) -> None:
    """R42: only the first 32 names were looked at, temp files and other names included, so
    32 leftovers silenced ls; temp files a killed daemon left were never removed."""
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    folder = ws.meta / daemon_records.FOLDER
    folder.mkdir(parents=True)
    old = time.time() - 2 * daemon_records.TMP_LEFT_SECONDS
    for n in range(40):
        left = folder / f".{n}.abc.json.tmp"
        left.write_text("{")
        os.utime(left, (old, old))
        (folder / f"junk-{n}.txt").write_text("x")
    for n in range(600):  # (R43: 400 names ending .json hid the record 20 times in 20)
        (folder / f"junk-{n}.json").write_text("[]")
    (folder / ".fresh.json.tmp").write_text("{")  # (a live daemon's, being renamed)
    record = daemon_records.ServingRecord(ws, (0, 0, 0, 0))  # (not the file there now)
    record.write()
    try:
        assert daemon_records.stale_daemons(ws) == [os.getpid()]
        assert not list(folder.glob(".*.abc.json.tmp"))
        assert (folder / ".fresh.json.tmp").exists()
    finally:
        record.remove()
