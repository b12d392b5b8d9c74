"""A daemon killed with kill -9 takes its attempts' whole process trees with it at once, on its
own host, without any daemon starting again (core/deathwatch.py): a wrapper that forks
(``sh -c "python3 work.py; true"``) once left its grandchild running until a sweep on that
host, while another host (PostgreSQL) ran attempt 2 beside it.

Every test stops only processes it started (the daemons by pid; a sleeper, by the pid it wrote,
only while its command line is still the sleeper's)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pgserver
import pytest
from conftest import QUICK_TOML, Workspace, alive, exe, new_workspace, wait_until
from test_processes import _cmdline

from handoffd.core import deathwatch, procrecords

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

# the work a wrapper starts: notes "<attempt> <pid>" in runs/, and any live pid of an earlier
# attempt (at its start and at its end) in overlaps/; attempt 1 sleeps long, the others briefly
WORK = r'''
import json, os, sys, time

runs = sys.argv[1]
attempt = os.environ["HANDOFF_ATTEMPT"]

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return stat[stat.rfind(")") + 2] not in "ZX" and b"work.py" in f.read()
    except OSError:
        return False

def look():
    for name in os.listdir(runs):
        if name.endswith(".pid") and not name.startswith(attempt + "."):
            pid = int(open(os.path.join(runs, name)).read())
            if alive(pid):
                with open(os.path.join(runs, "overlaps"), "a") as f:
                    f.write(f"attempt {attempt} beside {name}\n")

look()
tmp = os.path.join(runs, f".{attempt}.tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(runs, f"{attempt}.{os.getpid()}.pid"))
time.sleep(60 if attempt == "1" else 1)
look()
print(json.dumps({"status": "completed", "output": {"attempt": attempt}}), flush=True)
'''

TOML = QUICK_TOML.replace("{", "{{").replace("}", "}}") + """
[specialists."@wrapped"]
command = ["sh", "-c", {shell}]
timeout_seconds = 90
"""


class Sleepers:
    """The work processes the wrapper started under ``runs`` (their pids, as they wrote them)."""

    def __init__(self, runs: Path) -> None:
        self.runs = runs
        runs.mkdir(parents=True, exist_ok=True)

    def pids(self, attempt: int | None = None) -> list[int]:
        return [int(p.name.split(".")[1]) for p in sorted(self.runs.glob("*.pid"))
                if attempt is None or p.name.startswith(f"{attempt}.")]

    def overlaps(self) -> str:
        path = self.runs / "overlaps"
        return path.read_text() if path.exists() else ""

    def cleanup(self) -> None:
        for pid in self.pids():
            if alive(pid) and b"work.py" in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _watches_of(daemon_pid: int) -> list[int]:
    """The death watch processes started by ``daemon_pid`` (its last argument is that pid)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            argv = _cmdline(int(name)).split(b"\0")
            if b"handoffd.core.deathwatch" in b" ".join(argv) and argv[-4:-3] == [
                    str(daemon_pid).encode()] and alive(int(name)):
                found.append(int(name))
    return found


def wrapped_toml(tmp_path: Path, runs: Path) -> str:
    work = tmp_path / "work.py"
    work.write_text(WORK)
    return TOML.format(shell=json.dumps(f"'{sys.executable}' '{work}' '{runs}'; true"))


@pytest.fixture
def wrapped(tmp_path: Path) -> Iterator[tuple[Workspace, Sleepers]]:
    sleepers = Sleepers(tmp_path / "runs")
    workspace = new_workspace(tmp_path / "ws", wrapped_toml(tmp_path, sleepers.runs))
    try:
        yield workspace, sleepers
    finally:
        workspace.cleanup()  # the daemons first: nothing starts new work meanwhile
        sleepers.cleanup()


def _batch(ws: Workspace) -> subprocess.Popen[str]:
    proc = subprocess.Popen([exe("handoffd"), "run", "--root", str(ws.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    ws.daemons.append(proc)  # (killed at cleanup if still running)
    return proc


@pytest.mark.parametrize("how", ["serve", "run", "serve --processes 2"])
def test_a_killed_daemons_grandchild_dies_at_once_without_a_restart(
        wrapped: Any, how: str) -> None:
    ws, sleepers = wrapped
    hid = ws.create("--from", "@t", "--to", "@wrapped", "--data", "{}")
    started = _batch(ws) if how == "run" else ws.serve(*how.split()[1:])
    wait_until(lambda: sleepers.pids(1), timeout=30, what="attempt 1's work started")
    [work] = sleepers.pids(1)
    record = procrecords.read_record(ws.root, hid)
    assert record is not None
    # the daemon process running the attempt: the one started, or the spread's process
    daemon = record.daemon_pid
    assert daemon == started.pid or how.endswith("2")
    os.kill(daemon, signal.SIGKILL)  # a process this test started (or its own spread child)
    if daemon == started.pid:
        started.wait(timeout=10)
    # no daemon runs on this workspace now (a spread's parent is told to stop: it claims nothing
    # more, and the claim of the killed process stays put); the work must still die
    wait_until(lambda: not alive(work), timeout=10, what="the orphaned grandchild is killed")
    wait_until(lambda: not _watches_of(daemon), timeout=10, what="the death watch exits")


def test_a_clean_exit_leaves_no_death_watch_and_kills_nothing(wrapped: Any,
                                                              tmp_path: Path) -> None:
    ws, sleepers = wrapped
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text().replace(
        "timeout_seconds = 90", "timeout_seconds = 90\nconcurrency = 1"))
    daemon = ws.serve()
    assert not _watches_of(daemon.pid)  # none before the first command attempt
    hid = ws.create("--from", "@t", "--to", "@wrapped", "--data", "{}")
    wait_until(lambda: sleepers.pids(1), timeout=30, what="attempt 1's work started")
    wait_until(lambda: _watches_of(daemon.pid), timeout=10, what="a death watch started")
    assert ws.stop(daemon) == 0  # handed back: the attempt's processes killed by the daemon
    wait_until(lambda: not _watches_of(daemon.pid), timeout=10, what="the death watch exits")
    assert ws.state_of(hid) == ["pending"]
    assert "death watch" not in (daemon.stderr.read() if daemon.stderr else "")


def test_a_death_watch_that_cannot_start_is_one_warning_and_blocks_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(deathwatch, "_watch", None)
    monkeypatch.setattr(deathwatch, "_open", {})
    monkeypatch.setattr(deathwatch, "_next_start", 0.0)
    monkeypatch.setattr(deathwatch.sys, "executable", "/nonexistent/python3")
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        for n in range(3):
            deathwatch.guard(f"token{n}", "h1", 1)
            deathwatch.guard(f"token{n}", "h1", 1, pgid=12345)
            deathwatch.release(f"token{n}")
    lines = [r.getMessage() for r in caplog.records if "death watch" in r.getMessage()]
    assert len(lines) == 1 and "cannot start" in lines[0], lines


def test_a_death_watch_that_does_not_read_never_blocks_the_daemon(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    read, write = os.pipe()
    try:
        os.set_blocking(write, False)
        stuck = deathwatch._Watch(subprocess.Popen([sys.executable, "-c", "pass"]), write)
        stuck.proc.wait(timeout=30)
        monkeypatch.setattr(deathwatch, "_watch", stuck)
        monkeypatch.setattr(deathwatch, "_open", {})
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            for n in range(2000):  # far more than a pipe holds (64 KiB)
                deathwatch.guard(f"{n:032x}", "h" * 200, 1, pgid=n + 2)
        lines = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
        assert len(lines) == 1, lines
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.heavy
def test_postgres_no_second_run_beside_a_killed_hosts_orphan(
        tmp_path: Path, pg_server: pgserver.PgServer) -> None:
    """Two workspaces (hosts) on one database: host a is killed mid-run; host b recovers the
    claim (after the 1 s claim grace: a's sessions ended) and runs attempt 2, which must never
    see attempt 1's work alive, with no daemon of host a started again."""
    url = pg_server.new_database()
    sleepers = Sleepers(tmp_path / "runs")
    toml = wrapped_toml(tmp_path, sleepers.runs) + f'\n[store]\nurl = "{url}"\n'
    hosts = [new_workspace(tmp_path / name, toml) for name in "ab"]
    try:
        first = hosts[0].serve()
        hid = hosts[0].create("--from", "@t", "--to", "@wrapped", "--data", "{}")
        wait_until(lambda: sleepers.pids(1), timeout=30, what="attempt 1's work started on a")
        [work] = sleepers.pids(1)
        second = hosts[1].serve()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        done = hosts[1].handoff("wait", hid, "--timeout", "60")
        assert done.returncode == 0, done.stderr
        assert sleepers.pids(2), "attempt 2 ran on host b"
        assert sleepers.overlaps() == ""
        assert not alive(work)
        assert hosts[1].stop(second) == 0
    finally:
        for host in hosts:
            host.cleanup()
        sleepers.cleanup()
