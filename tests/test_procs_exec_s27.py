"""Finding an attempt's processes (core/procs.py) when one is in the middle of exec, and the
death watch's kill of many attempts at once (core/deathwatch.py).

Right after ``subprocess.Popen`` returns, the child is past exec's point of no return but the
kernel may not have set up its new environment yet: ``/proc/<pid>/environ`` reads empty (17 of
300 reads). A kill by token (the death watch's, kill_leftovers') then found nothing, killed
nothing, and the attempt ran on. And the death watch killed its daemon's attempts one after
another, one full /proc scan or more each (about a second for hundreds).

Every test stops only processes it started, by pid; the scan-counting tests run against a
fake /proc and kill nothing real."""
from __future__ import annotations

import builtins
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import alive, new_workspace, wait_until
from test_deathwatch_s26 import Sleepers, _watches_of, wrapped_toml
from test_processes import sleepers

from handoffd.core import deathwatch, procs, procstat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def test_a_process_whose_environment_reads_empty_at_first_is_looked_at_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of the leftover's environment comes back empty, as it does in the middle
    of exec: kill_run with its group unproven found no carrier and returned (0, 0)."""
    token = f"tok-exec-{uuid.uuid4().hex}"
    with sleepers(token) as (leftover,):
        path = f"/proc/{leftover.pid}/environ"
        reads = []

        def first_read_empty(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if file == path:
                reads.append(file)
                if len(reads) == 1:
                    return io.BytesIO(b"")  # what /proc shows before exec sets it up
            return builtins.open(file, mode, *args, **kwargs)

        monkeypatch.setattr(procs, "open", first_read_empty, raising=False)
        killed, survivors = procs.kill_run(token, leftover.pid)
        assert (killed, survivors) == (1, 0)
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert len(reads) >= 2


def test_a_process_started_just_now_is_killed_by_its_token() -> None:
    """Popen, then at once a kill by token alone (as the death watch's right after a start):
    each one is found, whether or not exec has set its environment up by then."""
    command = [sys.executable, "-S", "-c", "import time; time.sleep(60)"]
    for _ in range(20):
        token = f"tok-just-now-{uuid.uuid4().hex}"
        child = subprocess.Popen(command, start_new_session=True,
                                 env={**os.environ, procs.TOKEN_ENV: token})
        try:
            assert procs.kill_run(token, child.pid) == (1, 0)
            assert child.wait(timeout=10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)


def test_a_cleared_environment_is_judged_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose environment is empty for good (``env -i``) is no exec in progress: the
    scan never waits for it (the common path stays one read per process)."""
    child = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"],
                             start_new_session=True, env={})
    try:
        def exec_done() -> bool:
            info = procs._stat(child.pid)
            return info is not None and info.env is not None and info.env[1] != 0
        wait_until(exec_done, timeout=10, what="the child's exec set its environment up")

        def no_sleep(seconds: float) -> None:
            raise AssertionError("the scan waited for a cleared environment")
        monkeypatch.setattr(procs, "time", types.SimpleNamespace(
            monotonic=time.monotonic, sleep=no_sleep))
        # this child alone: another process of the machine in the middle of exec just then
        # would be waited for, rightly (R51: the test failed beside one)
        monkeypatch.setattr(procs, "_pids", lambda: iter([child.pid]))
        found, unsettled = procs._scan([("tok-none", child.pid)])
        assert [(p.pid, p.marked) for p in found[0]] == [(child.pid, False)]
        assert unsettled == []
    finally:
        child.kill()
        child.wait(timeout=10)


# ---------------------------------------------------------------- a fake /proc

class FakeProc:
    """A fake /proc: processes by pid (group, environment, whether exec has set it up), read
    through ``open`` and listed through ``_pids``; SIGKILL removes them. Counts the scans."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[int, bytes, bool]] = {}
        self.scans = 0
        self.killed: set[int] = set()
        self.hidden: set[int] = set()

    def add(self, pid: int, pgid: int, token: str | None, *, in_exec: bool = False,
            hidden: bool = False) -> None:
        """``in_exec``: its environment reads empty and its bounds are unset; ``hidden``: it
        reads empty though its bounds are set (a process that made it unreadable itself)."""
        environ = b"PATH=/bin\0" + (f"{procs.TOKEN_ENV}={token}\0".encode() if token else b"")
        self.table[pid] = (pgid, environ, in_exec)
        if hidden:
            self.hidden.add(pid)

    def pids(self) -> Iterator[int]:
        self.scans += 1
        yield from list(self.table)

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        parts = str(file).split("/")
        if len(parts) != 4 or parts[1] != "proc" or not parts[2].isdigit():
            return builtins.open(file, mode, *args, **kwargs)
        pid = int(parts[2])
        if pid not in self.table:
            raise FileNotFoundError(file)
        pgid, environ, in_exec = self.table[pid]
        if parts[3] == "environ":
            return io.BytesIO(b"" if in_exec or pid in self.hidden else environ)
        env = (0, 0) if in_exec else (1000, 1000 + len(environ))
        fields = ["S", "1", str(pgid), str(pgid), "0", "-1", "4194304"] + ["0"] * 12 + [
            "500"] + ["0"] * 27 + [str(env[0]), str(env[1]), "0"]
        return io.BytesIO(f"{pid} (fake) {' '.join(fields)}\n".encode())

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.table:
            raise ProcessLookupError(pid)
        del self.table[pid]
        self.killed.add(pid)

    def killpg(self, pgid: int, sig: int) -> None:
        members = [pid for pid, (group, _, _) in self.table.items() if group == pgid]
        if not members:
            raise ProcessLookupError(pgid)
        for pid in members:
            self.kill(pid, sig)


@pytest.fixture
def fake_proc(monkeypatch: pytest.MonkeyPatch) -> FakeProc:
    fake = FakeProc()
    monkeypatch.setattr(procs, "_pids", fake.pids)
    monkeypatch.setattr(procs, "open", fake.open, raising=False)
    # (/proc/<pid>/stat is read by core.procstat, which liveness loads without procs)
    monkeypatch.setattr(procstat, "open", fake.open, raising=False)
    # only procs' own os is faked: its kill and killpg reach the fake table, nothing real
    calls = {name: getattr(os, name) for name in dir(os) if not name.startswith("__")}
    monkeypatch.setattr(procs, "os", types.SimpleNamespace(
        **{**calls, "kill": fake.kill, "killpg": fake.killpg}))
    return fake


def test_the_death_watch_kills_every_open_attempt_from_one_scan_per_round(
        fake_proc: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six attempts open when the daemon died: one kill_run each took two scans or more each
    (twelve here). Now: one round kills all, a second finds none: two scans. The proof is the
    same as each kill's: a group only when a member carries its attempt's token."""
    tokens = [f"tok-{n}-{uuid.uuid4().hex}" for n in range(6)]
    for n, token in enumerate(tokens):
        leader = 5000 + 10 * n
        fake_proc.add(leader, leader, token)                 # the wrapper, leading its group
        fake_proc.add(leader + 1, leader, None)              # a child without the token
        fake_proc.add(leader + 2, leader + 2, token)         # a setsid grandchild
    fake_proc.add(6000, 6000, None)  # a group one record names, no member carrying its token
    fake_proc.add(6001, 6001, "tok-another-daemons")         # another daemon's attempt
    read, write = os.pipe()
    try:
        lines = [["+", token, 5000 + 10 * n, 1, f"h{n}"] for n, token in enumerate(tokens)]
        lines.append(["+", f"tok-gone-{uuid.uuid4().hex}", 6000, 1, "h-gone"])
        os.write(write, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        os.close(write)
        write = -1
        # main() in this process: no signal dispositions and no root logger changed here
        monkeypatch.setattr(procs, "STOP_SIGNALS", ())
        monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
        deathwatch.main(read, 4242)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert fake_proc.killed == {5000 + 10 * n + k for n in range(6) for k in range(3)}
    assert sorted(fake_proc.table) == [6000, 6001]
    assert fake_proc.scans == 2


def test_a_process_that_stays_in_exec_is_never_skipped_silently(
        fake_proc: FakeProc, caplog: pytest.LogCaptureFixture) -> None:
    """A process whose environment stays unset (in the middle of exec) may carry the token: the
    kill looks again each round until its deadline and then says so, never returns at once."""
    fake_proc.add(7000, 7000, "tok-unknown", in_exec=True)
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        assert procs.kill_run("tok-mine", None, wait_seconds=0.05) == (0, 0)
    assert fake_proc.scans >= 2 and not fake_proc.killed
    lines = [r.getMessage() for r in caplog.records if "middle of exec" in r.getMessage()]
    assert len(lines) == 1 and "7000" in lines[0], lines


def test_a_process_stuck_in_exec_holds_a_kill_only_briefly(
        fake_proc: FakeProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """R51: any process of the machine that stayed unsettled held every kill_run (every
    attempt's end) for its whole wait, 5 s. It is looked at again for UNSETTLED_SECONDS at
    most, whatever the wait (counted in scans, not in time: one round sleeps 10 ms)."""
    monkeypatch.setattr(procs, "UNSETTLED_SECONDS", 0.05)
    fake_proc.add(7000, 7000, "tok-unknown", in_exec=True)
    assert procs.kill_run("tok-mine", None, wait_seconds=60) == (0, 0)
    assert 2 <= fake_proc.scans < 20 and not fake_proc.killed


def test_an_environment_made_unreadable_is_judged_at_once(fake_proc: FakeProc) -> None:
    """R51: a process that made its own environment unreadable (mprotect) reads empty though
    exec set it up long ago (its bounds set): it was taken for one in the middle of exec, and
    held every kill for 5 s. It is judged on what it reads: one scan, nothing to kill."""
    fake_proc.add(7000, 7000, "tok-mine", hidden=True)
    assert procs.kill_run("tok-mine", None, wait_seconds=60) == (0, 0)
    assert fake_proc.scans == 1 and not fake_proc.killed


@pytest.mark.heavy
def test_several_attempts_open_at_a_daemons_death_are_all_killed(tmp_path: Path) -> None:
    """Three attempts' grandchildren running when their daemon is killed with -9: all three
    die at once, with no daemon started again."""
    runs = Sleepers(tmp_path / "runs")
    ws = new_workspace(tmp_path / "ws", wrapped_toml(tmp_path, runs.runs))
    try:
        daemon = ws.serve()
        for _ in range(3):
            ws.create("--from", "@t", "--to", "@wrapped", "--data", "{}")
        wait_until(lambda: len(runs.pids(1)) == 3, timeout=30, what="three attempts' work")
        works = runs.pids(1)
        os.kill(daemon.pid, signal.SIGKILL)  # the daemon this test started
        daemon.wait(timeout=10)
        wait_until(lambda: not any(alive(pid) for pid in works), timeout=10,
                   what="every orphaned grandchild is killed")
        wait_until(lambda: not _watches_of(daemon.pid), timeout=10, what="the watch exits")
    finally:
        ws.cleanup()
        runs.cleanup()
