"""Processes of command specialists never outlive their attempt: background children holding
stdout, grandchildren that call setsid, and the whole tree of a daemon killed with kill -9.

Every test uses real processes and stops only processes it started (by pid)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, alive, run_python, wait_until

from handoffd import Daemon, Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core import procrecords, procs
from handoffd.core.config import load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

# One script, several behaviours (``input.data.mode``). Every pid it starts is noted in
# artifacts/<id>.pids so that the test can check (and, if the fix fails, clean up) each one.
SPEC = r'''
import json, os, subprocess, sys, time

def alive(pid):
    """A live (non-zombie) process running this script or its sleeper, not a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX" and (b"spec.py" in cmdline or b"sleep(" in cmdline)

def note(art, hid, name, text):
    with open(os.path.join(art, f"{hid}.{name}"), "a") as f:
        f.write(text + "\n")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]

if sys.argv[1:2] == ["worker"]:  # the long-running part of "work", in a session of its own
    _, _, art, hid, attempt, direct = sys.argv
    for line in open(os.path.join(art, f"{hid}.runs")).read().splitlines() \
            if os.path.exists(os.path.join(art, f"{hid}.runs")) else []:
        before = line.split()
        for pid in before[1:]:
            if alive(int(pid)):
                note(art, hid, "overlaps", f"attempt {attempt} started while pid {pid} of attempt "
                     f"{before[0]} was alive")
    note(art, hid, "runs", f"{attempt} {os.getpid()} {direct}")
    note(art, hid, "pids", str(os.getpid()))
    time.sleep(30 if attempt == "1" else 0.1)
    note(art, hid, "ends", f"{attempt} {os.getpid()}")
    sys.exit(0)

doc = json.load(sys.stdin)
mode = doc["input"]["data"]["mode"]
hid, attempt = os.environ["HANDOFF_ID"], os.environ["HANDOFF_ATTEMPT"]
art = os.path.join(os.environ["HANDOFFD_ROOT"], "artifacts")
os.makedirs(art, exist_ok=True)
note(art, hid, "pids", str(os.getpid()))
if mode == "bg":  # a background child that inherits stdout and stderr and keeps them open
    child = subprocess.Popen(SLEEPER)
    note(art, hid, "pids", str(child.pid))
    print(json.dumps({"status": "completed", "output": {"bg": child.pid}}), flush=True)
elif mode == "setsid":  # a grandchild leaves the process group, then the handler overruns
    child = subprocess.Popen(SLEEPER, start_new_session=True)
    note(art, hid, "pids", str(child.pid))
    time.sleep(60)
elif mode == "work":
    worker = subprocess.Popen([sys.executable, __file__, "worker", art, hid, attempt,
                               str(os.getpid())], start_new_session=True)
    worker.wait()
    print(json.dumps({"status": "completed", "output": {"attempt": attempt}}), flush=True)
'''


def config(spec: Path) -> str:
    return f"""
[daemon]
settle_seconds = 0.2
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 1.0
lease_seconds = 30.0
grace_seconds = 5.0
workers = 2

[retry]
max_retries = 2
retry_delay_seconds = 0.2
backoff_multiplier = 1.0

[specialists."@procs"]
command = ["{sys.executable}", "{spec}"]
timeout_seconds = 20
concurrency = 2

[specialists."@short"]
command = ["{sys.executable}", "{spec}"]
timeout_seconds = 1
retry = {{ max_retries = 0 }}
"""


class Procs:
    """The pids a workspace's specialist noted; whatever is still alive at teardown is killed
    (only these pids: processes this test started)."""

    def __init__(self, root: Path) -> None:
        self.art = root / "artifacts"

    def noted(self, handoff_id: str, name: str = "pids") -> list[str]:
        path = self.art / f"{handoff_id}.{name}"
        return path.read_text().splitlines() if path.exists() else []

    def pids(self, handoff_id: str) -> list[int]:
        return [int(line) for line in self.noted(handoff_id)]

    def all_pids(self) -> list[int]:
        if not self.art.exists():
            return []
        return [int(line) for path in self.art.glob("*.pids") for line in path.read_text().split()]

    def cleanup(self) -> None:
        for pid in self.all_pids():
            if alive(pid) and b"spec.py" in _cmdline(pid) or alive(pid) and b"sleep(" in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def pws(ws: Workspace, tmp_path: Path) -> Iterator[tuple[Workspace, Procs]]:
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    ws.write_config(config(spec))
    tracker = Procs(ws.root)
    try:
        yield ws, tracker
    finally:
        ws.cleanup()  # the daemons first, so that nothing starts new specialists meanwhile
        tracker.cleanup()


def create(ws: Workspace, to: str, mode: str) -> str:
    return ws.create("--from", "@test", "--to", to, "--data", json.dumps({"mode": mode}))


def test_background_child_holding_stdout_is_killed_and_costs_nothing(pws: Any) -> None:
    ws, tracker = pws
    ids = [create(ws, "@procs", "bg") for _ in range(3)]
    batch = ws.handoffd("run", timeout=60)
    assert batch.returncode == 0, batch.stderr
    for handoff_id in ids:
        assert ws.state_of(handoff_id) == ["completed"]
        doc = ws.doc(handoff_id)
        pids = tracker.pids(handoff_id)
        assert len(pids) == 2 and doc["output"]["bg"] == pids[1]
        assert not [p for p in pids if alive(p)], "the background child outlived its attempt"
        assert procrecords.read_record(ws.root, handoff_id) is None  # the record goes with the attempt


def test_setsid_grandchild_is_killed_at_timeout(pws: Any) -> None:
    ws, tracker = pws
    handoff_id = create(ws, "@short", "setsid")
    batch = ws.handoffd("run", timeout=60)
    assert batch.returncode == 1, batch.stderr
    assert ws.state_of(handoff_id) == ["failed"]
    assert ws.doc(handoff_id)["error"]["code"] == "TIMEOUT"
    pids = tracker.pids(handoff_id)
    assert len(pids) == 2
    # the grandchild left the process group; the run token in its environment gave it away
    assert not [p for p in pids if alive(p)], "a process of the timed-out attempt survived"
    assert procrecords.read_record(ws.root, handoff_id) is None


def test_kill_9_daemon_leftovers_die_before_the_retry_starts(pws: Any) -> None:
    """The daemon dies mid-run: its direct child dies with it (parent-death signal); the worker,
    in a session of its own, is killed when the claim is recovered, before attempt 2 starts."""
    ws, tracker = pws
    first = ws.serve()
    handoff_id = create(ws, "@procs", "work")
    wait_until(lambda: tracker.noted(handoff_id, "runs"), what="attempt 1 started its worker")
    attempt, worker, direct = (int(x) for x in tracker.noted(handoff_id, "runs")[0].split())
    assert attempt == 1 and alive(worker) and alive(direct)
    record = procrecords.read_record(ws.root, handoff_id)
    assert record is not None and record.attempt == 1 and record.pgid == direct
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    # the worker was what must not overlap attempt 2: the daemon's death watch now kills it at
    # once, with no daemon started (tests/test_deathwatch_s26.py); the recovery below would
    # kill whatever it missed, and attempt 2's worker checks both pids

    second = ws.serve()
    assert ws.wait_state(handoff_id, timeout=30) == "completed"
    runs = tracker.noted(handoff_id, "runs")
    assert [line.split()[0] for line in runs] == ["1", "2"]
    assert tracker.noted(handoff_id, "overlaps") == []  # attempt 2 saw no live predecessor
    assert tracker.noted(handoff_id, "ends") == [f"2 {runs[1].split()[1]}"]  # 1 never finished
    assert not alive(worker) and not alive(direct)
    wait_until(lambda: procrecords.read_record(ws.root, handoff_id) is None, timeout=10,
               what="the attempt's record is removed")
    assert ws.stop(second) == 0


def test_children_get_the_parent_death_signal() -> None:
    """child_setup (the runner's preexec_fn) sets PR_SET_PDEATHSIG = SIGKILL in the child."""
    probe = ("import ctypes; s = ctypes.c_int(0); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); print(s.value)")  # GET_PDEATHSIG
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30,
                          start_new_session=True, preexec_fn=procs.child_setup(os.getpid()))
    assert proc.stdout.strip() == str(int(signal.SIGKILL)).encode(), proc.stderr


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _zombie_children() -> list[int]:
    """Pids of this process's children that finished and were never reaped."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.append(int(name))
    return found


@pytest.mark.heavy
def test_in_process_daemon_fds_threads_and_processes_stay_flat(pws: Any) -> None:
    ws, tracker = pws
    root = ws.root
    cfg = load_config(root / "handoffd.toml")
    engine = build_engine(HandoffdWorkspace(root), cfg, Registry.load(cfg, use_entry_points=False))
    daemon = Daemon(engine, workers=2)
    ready = threading.Event()
    server = threading.Thread(target=daemon.serve, kwargs={"install_signals": False,
                                                           "ready": ready.set})
    server.start()

    def submit_and_wait(count: int) -> list[str]:
        ids = []
        for _ in range(count):
            doc = new_native_request(source="@test", target="@procs", data={"mode": "bg"},
                                     now=engine.clock())
            ids.append(engine.backend.store.create(doc, doc["handoff_id"]))
        for handoff_id in ids:
            assert ws.wait_state(handoff_id, timeout=30) == "completed"
        return ids

    try:
        assert ready.wait(10)
        submit_and_wait(4)  # warm-up: the pool's worker threads exist from here on
        time.sleep(0.3)
        fds, threads = _fds(), threading.active_count()
        ids = submit_and_wait(20)
        wait_until(lambda: daemon.running == 0, what="the workers are idle")
        time.sleep(0.3)
        assert _fds() <= fds + 2, f"fds {fds} -> {_fds()}"
        assert threading.active_count() <= threads + 1, f"threads {threads} -> {threading.active_count()}"
        leftover = [p for handoff_id in ids for p in tracker.pids(handoff_id) if alive(p)]
        assert leftover == [], "background children outlived their attempts"
        assert _zombie_children() == [], "finished specialists were not reaped"
    finally:
        daemon.stop()
        server.join(timeout=30)
    assert not server.is_alive()
    assert engine.backend.store.ids(State.IN_PROGRESS) == []


def test_the_allocator_is_asked_to_keep_memory_flat() -> None:
    """`handoffd serve` caps glibc's malloc arenas before its threads start and trims after each
    sweep; on glibc both calls take effect, elsewhere they say they did nothing."""
    import platform

    from handoffd.service import allocator
    glibc = platform.libc_ver()[0] == "glibc"
    code = ("from handoffd.service import allocator; "
            "print(allocator.limit_arenas(), allocator.trim())")
    out = run_python(code)
    assert out.stdout.split() == ([str(glibc)] * 2), out
    assert allocator.trim() is glibc


def _wait_for_token(pid: int, token: str) -> None:
    """Wait (bounded) until ``pid``'s environment, as /proc shows it, carries ``token``."""
    entry = f"{procs.TOKEN_ENV}={token}".encode()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return
        except OSError:
            pass
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} never showed its token in /proc")


@contextmanager
def sleepers(*tokens: str | None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One sleeping process per entry, each in a session of its own and carrying that run token
    (None: none); whatever is left of them is killed and reaped at the end."""
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = [subprocess.Popen(command, start_new_session=True,
                                env={**os.environ, **({procs.TOKEN_ENV: token} if token else {})})
               for token in tokens]
    try:
        # Popen returns once the child's exec is past its point of no return, but the kernel
        # sets the new environment up after that: /proc/<pid>/environ read at once may still
        # be empty, and the token not found (the "0 killed" CI failure)
        for proc, token in zip(started, tokens):
            if token is not None:
                _wait_for_token(proc.pid, token)
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_a_kill_sends_sigkill_once_however_long_the_scan_took(tmp_path: Path) -> None:
    """kill_run checked its deadline before its first SIGKILL: when one scan of /proc outlasted
    the wait (a loaded CI machine), nothing was killed and the leftover survived (the CI failure
    of test_leftovers_are_killed_whether_the_workspace_is_given_as_a_path_or_not). A wait of 0
    stands for that scan."""
    token = f"tok-slow-scan-{uuid.uuid4().hex}"
    with sleepers(token) as (leftover,):
        killed, survivors = procs.kill_run(token, None, wait_seconds=0)
        assert killed == 1
        assert leftover.wait(timeout=10) == -signal.SIGKILL


def test_leftovers_of_another_pid_namespace_are_killed_by_their_token_alone(
        tmp_path: Path) -> None:
    """A record written in another pid namespace of this boot (a daemon in a container sharing
    the workspace, kill -9'd) killed nothing, so the host's retry ran beside the leftover (R27).
    Its carriers this process can see are killed by token; its group, a number of the other
    namespace, never (here: a live bystander's group)."""
    HandoffdWorkspace(tmp_path).ensure()
    token = f"tok-ns-{uuid.uuid4().hex}"
    with sleepers(token, None) as (leftover, bystander):
        record = procrecords.RunRecord.new("h1", token, 1)
        procrecords.write_record(tmp_path, procrecords.RunRecord(**{
            **record.__dict__, "pid_namespace": "pid:[1]", "pgid": bystander.pid}))
        assert procs.kill_leftovers(tmp_path, "h1", attempt=2) == 1
        leftover.wait(timeout=10)
        assert bystander.poll() is None  # its group was not the record's to kill
        assert procrecords.read_record(tmp_path, "h1") is None


def test_the_stop_signal_reaches_each_process_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM goes to the attempt's process group, then to token carriers outside it. A member
    of the group must not get it twice: a second SIGTERM a moment later re-enters a handler that
    prints its partial result, and the answer became two JSON lines (seen in a full run)."""
    from handoffd.core import childproc

    sent: list[tuple[str, int]] = []
    found = [procs.ProcInfo(100, 100, 1, True), procs.ProcInfo(101, 100, 1, True),
             procs.ProcInfo(200, 200, 1, True)]  # the leader, a child, a setsid grandchild
    monkeypatch.setattr(childproc.procs, "find", lambda token, pgid: found)
    monkeypatch.setattr(childproc.os, "kill", lambda pid, sig: sent.append(("pid", pid)))
    monkeypatch.setattr(childproc.os, "killpg", lambda pgid, sig: sent.append(("group", pgid)))
    childproc.signal_all(100, "token", signal.SIGTERM)
    assert sent == [("group", 100), ("pid", 200)]

    def gone(pgid: int, sig: int) -> None:
        raise ProcessLookupError
    sent.clear()
    monkeypatch.setattr(childproc.os, "killpg", gone)  # the group is gone: each carrier by pid
    childproc.signal_all(100, "token", signal.SIGTERM)
    assert sent == [("pid", 100), ("pid", 101), ("pid", 200)]


@pytest.mark.parametrize("as_given", [Path, str, HandoffdWorkspace])
def test_leftovers_are_killed_whether_the_workspace_is_given_as_a_path_or_not(
        tmp_path: Path, as_given: Any) -> None:
    """A new attempt clears its predecessor's leftovers through ``ctx.root``, a Path: whose own
    ``root`` attribute is '/', once read as a Workspace's (no record found, nothing killed, and
    the attempt refused as if the leftover had survived SIGKILL)."""
    HandoffdWorkspace(tmp_path).ensure()
    # a token of its own, so that no other test's kill can take its leftover (the CI failure
    # here was kill_run's, though: see test_a_kill_sends_sigkill_once_however_long_the_scan_took)
    token = f"tok-leftover-{uuid.uuid4().hex}"
    with sleepers(token) as (leftover,):
        record = procrecords.RunRecord.new("h1", token, 1)
        procrecords.write_record(tmp_path, procrecords.RunRecord(**{
            **record.__dict__, "pgid": leftover.pid, "leader_start": procs.start_time(leftover.pid)}))
        assert procs.kill_leftovers(as_given(tmp_path), "h1", attempt=2) >= 1
        leftover.wait(timeout=10)
        assert procrecords.read_record(tmp_path, "h1") is None
