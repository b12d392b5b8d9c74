"""The serving records (``handoffs/.meta/serving/``) under junk and left-overs (session 26).

Two weaknesses of session 25's records: ``handoff ls`` read at most 32 records among the first
1,024 names, so 32 files under record-like names (junk, or records killed daemons left) hid the
live daemon's record and ls said nothing; and a record of another host was never removed by
anyone. Now a record's name carries its pid and its liveness mark, ls reads only those named as
a live process's (the newest first), and every serve removes another host's record once it has
not been renewed for a day (a serving daemon renews its own every five minutes).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace

from handoffd.core.documents import hostname
from handoffd.core.liveness import live_mark, own_mark
from handoffd.core.procrecords import boot_id
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service import daemon_records
from handoffd.service.daemon_records import ServingRecord, stale_daemons

CONFIG = """
[daemon]
durability = "fast"
"""
DAY = 24 * 3600.0


@pytest.fixture
def home(tmp_path: Path) -> HandoffdWorkspace:
    workspace = HandoffdWorkspace(tmp_path / "home")
    workspace.root.mkdir()
    workspace.config_path.write_text(CONFIG)
    workspace.ensure()
    (workspace.meta / daemon_records.FOLDER).mkdir(parents=True)
    return workspace


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Live processes of this host (other than this one) to name in planted records; each is
    killed by its pid at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


def sleeper(started: list[subprocess.Popen[bytes]]) -> tuple[int, str]:
    """A new live process (pid, its mark)."""
    proc = subprocess.Popen(["sleep", "60"])
    started.append(proc)
    for _ in range(1000):  # (its mark: once it has exec'd, its start time is settled)
        mark = live_mark(proc.pid)
        if mark is not None:
            return proc.pid, mark
        time.sleep(0.001)
    raise AssertionError("the sleeper never showed in /proc")


def set_age(path: Path, seconds: float) -> None:
    """Make ``path``'s mtime ``seconds`` old (negative: in the future), without following it."""
    when = time.time() - seconds
    os.utime(path, (when, when), follow_symlinks=False)


def record_body(pid: int, mark: str, **changed: Any) -> str:
    """A record as a daemon of this host writes it, stale against any handoffd.toml."""
    mine = own_mark()
    assert mine is not None
    body = {"host": hostname(), "boot": boot_id(), "pid": pid, "proc": mark, "ns": mine[1],
            "started": "2026-11-24T12:00:00Z", "config": [0, 0, 0, 0], **changed}
    return json.dumps(body)


class RealLast:
    """``os.scandir`` listing this process's own record last: the order in which the old
    reader was bound to miss it (the filesystem's own order is a matter of hashes)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __call__(self, folder: Any) -> "RealLast":
        with self.real(folder) as entries:
            self.entries = sorted(entries, key=lambda e: e.name.startswith(f"{os.getpid()}."))
        return self

    def __enter__(self) -> list[Any]:
        return self.entries

    def __exit__(self, *exc: object) -> None:
        return None


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names the records' reader opens, recorded as it opens them."""
    opened: list[str] = []
    real = daemon_records.read_regular

    def counting(path: Any, max_bytes: int, *, dir_fd: int | None = None) -> bytes:
        opened.append(str(path))
        return real(path, max_bytes, dir_fd=dir_fd)
    monkeypatch.setattr(daemon_records, "read_regular", counting)
    return opened


# ---------------------------------------------------------------- the reader (ls)
def test_left_records_and_junk_never_hide_the_live_record(
        home: HandoffdWorkspace, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = home.meta / daemon_records.FOLDER
    record = ServingRecord(home, (0, 0, 0, 0))  # (not the file there now: a stale daemon)
    record.write()
    assert record.name is not None
    live = json.loads((folder / record.name).read_text())
    for n in range(40):  # records of killed daemons (a dead pid's, or a reused pid's mark)
        name = folder / f"{4_000_000 + n}.{n:012x}.json"
        name.write_text(record_body(4_000_000 + n, f"{n:016x}"))
        set_age(name, -3600)  # (newer than the live one: "newest first" alone is not enough)
        (folder / f"{os.getpid()}.{n + 1:012x}.json").write_text(
            json.dumps({**live, "proc": f"{n + 1:016x}"}))  # our pid, another (dead) mark
    for n in range(40):  # junk under record-like names
        (folder / f"{5_000_000 + n}.{n:012x}.json").write_text("{not json" if n % 2 else "[]")
    monkeypatch.setattr(os, "scandir", RealLast(os.scandir))
    opened = count_reads(monkeypatch)
    try:
        assert stale_daemons(home) == [os.getpid()]
        assert len(opened) <= daemon_records.MAX_RECORDS  # (the bound on what is read holds)
    finally:
        record.remove()


def test_hostile_files_under_live_names_are_never_followed_nor_fail_ls(
        home: HandoffdWorkspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sleepers: list[subprocess.Popen[bytes]]) -> None:
    folder = home.meta / daemon_records.FOLDER
    outside = tmp_path / "outside.json"  # a stale record of a live process, outside the ws
    hostile: list[Path] = []
    for kind in ("symlink", "fifo", "huge", "nested", "binary", "folder"):
        pid, mark = sleeper(sleepers)  # (a name that passes the liveness check)
        path = folder / f"{pid}.{mark[:12]}.json"
        if kind == "symlink":
            outside.write_text(record_body(pid, mark))
            path.symlink_to(outside)
        elif kind == "fifo":
            os.mkfifo(path)  # (never opened: no hang)
        elif kind == "huge":
            with open(path, "wb") as handle:
                handle.truncate(64 * 2**20)  # (never read: its size says it is no record)
        elif kind == "nested":
            path.write_text("[" * 2048 + "]" * 2048)
        elif kind == "binary":
            path.write_bytes(b"\xff\xfe{\"pid\": \x80}" * 10)
        else:
            path.mkdir()
        hostile.append(path)
    for path in hostile:
        set_age(path, -3600)
    record = ServingRecord(home, (0, 0, 0, 0))
    record.write()
    for n in range(40):  # and the old hiders: records left under dead names since
        (folder / f"{4_000_000 + n}.{n:012x}.json").write_text(record_body(4_000_000 + n, "0" * 16))
    monkeypatch.setattr(os, "scandir", RealLast(os.scandir))
    opened = count_reads(monkeypatch)
    try:
        # our own, stale, alone: not the symlinked one outside (a live pid's, stale too)
        assert stale_daemons(home) == [os.getpid()]
        assert {Path(name).name for name in opened} & {hostile[0].name, hostile[1].name,
                                                       hostile[2].name, hostile[5].name} == set()
        assert daemon_records.stale_line(home) is not None
    finally:
        record.remove()


# ---------------------------------------------------------------- removal and renewal (serve)
def test_serve_removes_the_records_nobody_renewed_for_a_day_and_never_a_live_ones(
        home: HandoffdWorkspace, sleepers: list[subprocess.Popen[bytes]]) -> None:
    folder = home.meta / daemon_records.FOLDER
    mine = own_mark()
    assert mine is not None

    def plant(name: str, text: str, age: float) -> str:
        (folder / name).write_text(text)
        set_age(folder / name, age)
        return name

    elsewhere = {"host": "another-host", "ns": mine[1]}
    gone = {
        plant("7.00000000000a.json", record_body(7, "a" * 16, **elsewhere), 2 * DAY),
        plant("8.00000000000b.json", record_body(8, "b" * 16, ns="1/2"), 2 * DAY),  # other ns
        plant("9.00000000000c.json", "{junk", 2 * DAY),  # no record, under a record's name
        plant(f"{4_000_001}.00000000000d.json", record_body(4_000_001, "d" * 16), 60),  # dead
        # (R47: dated more than a day ahead: no renewal ever sets that, it was kept for good)
        plant(f"{os.getpid()}.00000000001c.json", "{junk", -2 * DAY),
    }
    kept = {
        plant("17.00000000001a.json", record_body(17, "a" * 16, **elsewhere), 3600),
        plant("18.00000000001b.json", "{junk", 3600),  # (young: maybe being looked at)
        plant(f"{os.getpid()}.00000000001d.json", "{junk", -3600),  # (a clock a little ahead)
    }
    for n in range(2):  # live daemons of this host, unrenewed for days: /proc says they live
        pid, mark = sleeper(sleepers)
        kept.add(plant(f"{pid}.{mark[:12]}.json", record_body(pid, mark), 3 * DAY))
    # an older handoffd's record (named at random, no boot id) of a live daemon: the day rule
    # (R47: no boot id, so not judged as this host's), never removed at once
    pid, mark = sleeper(sleepers)
    old = json.loads(record_body(pid, mark))
    del old["boot"]
    kept.add(plant(f"{pid}.{1:012x}.json", json.dumps(old), 3600))
    gone.add(plant(f"{pid}.{2:012x}.json", json.dumps(old), 3 * DAY))
    record = ServingRecord(home, None)
    record.write()  # a serve's start
    try:
        names = {path.name for path in folder.iterdir()}
        assert gone & names == set()
        assert kept <= names and record.name in names
    finally:
        record.remove()


def test_a_serving_daemon_renews_its_record_and_writes_it_again_when_gone(
        home: HandoffdWorkspace) -> None:
    folder = home.meta / daemon_records.FOLDER
    now = [1000.0]
    record = ServingRecord(home, None, clock=lambda: now[0])
    record.write()
    assert record.name is not None
    path = folder / record.name
    set_age(path, 2 * DAY)
    old = path.stat().st_mtime
    record.renew()  # (not yet: nothing done)
    assert path.stat().st_mtime == old
    now[0] += daemon_records.RENEW_SECONDS
    record.renew()
    assert path.stat().st_mtime > time.time() - 600  # renewed
    path.unlink()  # removed while it serves (by hand; a host with a wild clock)
    now[0] += daemon_records.RENEW_SECONDS
    record.renew()
    assert path.exists() and stale_daemons(home) == [os.getpid()]
    record.remove()


# ---------------------------------------------------------------- end to end
@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def test_ls_finds_the_serving_daemon_among_thousands_of_left_records(ws: Workspace) -> None:
    folder = ws.root / "handoffs" / ".meta" / "serving"
    folder.mkdir(parents=True, exist_ok=True)
    old_elsewhere = folder / "77.0000000000ee.json"  # another host's, unrenewed for 2 days
    old_elsewhere.write_text(record_body(77, "e" * 16, host="another-host"))
    set_age(old_elsewhere, 2 * DAY)
    young_elsewhere = folder / "78.0000000000ef.json"  # another host's, renewed an hour ago
    young_elsewhere.write_text(record_body(78, "f" * 16, host="another-host"))
    set_age(young_elsewhere, 3600)
    daemon = ws.serve()
    for n in range(3000):  # (the old reader read 32 of them: ~1% chance to reach the live one)
        left = folder / f"{4_000_000 + n}.{n:012x}.json"
        left.write_text(record_body(4_000_000 + n, f"{n:016x}") if n % 3 else "{junk")
        set_age(left, -3600)
    config = ws.root / "handoffd.toml"
    config.write_text(config.read_text() + "# edited while the daemon serves\n")
    later = time.time() + 60
    os.utime(config, (later, later))
    try:
        listed = ws.handoff("ls", check=True)  # (--root: the helper adds it)
        assert listed.stderr.splitlines() == [
            f"handoff: the daemon serving this workspace (pid {daemon.pid}) started before "
            "handoffd.toml last changed: restart it to apply the changes"]
        assert not old_elsewhere.exists() and young_elsewhere.exists()
    finally:
        assert ws.stop(daemon, signal.SIGTERM) == 0
    assert not list(folder.glob(f"{daemon.pid}.*.json"))
