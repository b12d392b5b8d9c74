"""`handoffd run` over several processes (handoffd.service.spread): each handoff runs once, the
summary and exit code cover every process, signals and kills stop them all, nothing is lost."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Workspace, alive, exe, wait_until
from handoffd.backends.memory import MemoryBackend
from handoffd.cli.basics import engine
from handoffd.core.config import load_config
from handoffd.core import specialists
from handoffd.core.errors import ConfigError
from handoffd.core.states import State
from handoffd.service import spread

PLUG = '''
import json, os, time

def work(handoff, ctx):
    data = handoff.get("input", {}).get("data", {})
    with open(os.environ["SPREAD_LOG"], "a") as log:
        log.write(json.dumps({"id": ctx.handoff_id, "pid": os.getpid(), "at": time.time(),
                              "tmp": sorted(os.listdir(os.environ["SPREAD_TMP"]))}) + "\\n")
    time.sleep(float(data.get("sleep", 0)))
    with open(os.environ["SPREAD_LOG"], "a") as log:
        log.write(json.dumps({"id": ctx.handoff_id, "pid": os.getpid(), "done": time.time()}) + "\\n")
    if data.get("fail"):
        raise RuntimeError("asked to fail")
    return {"status": "completed"}
'''

CONFIG = '''
[daemon]
durability = "{durability}"
settle_seconds = 0.05
grace_seconds = 20.0
{extra}
[specialists."@spread"]
handler = "spreadplug:work"
{spec}
'''


def setup(ws: Workspace, count: int, *, extra: str = "", spec: str = "", durability: str = "fast",
          **data: object) -> None:
    plug = ws.root / "plug"
    plug.mkdir()
    (plug / "spreadplug.py").write_text(PLUG)
    ws.write_config(CONFIG.format(extra=extra, spec=spec, durability=durability))
    for i in range(count):
        hid = f"sp-{i:04d}"
        item = {key: (value(i) if callable(value) else value) for key, value in data.items()}
        ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@spread"},
                                "input": {"data": item}})


def env(ws: Workspace) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ws.root / "plug"),
                SPREAD_LOG=str(ws.root / "runs.jsonl"),
                SPREAD_TMP=str(ws.root / "handoffs" / ".tmp"))


def runs(ws: Workspace) -> list[dict[str, object]]:
    path = ws.root / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def batch(ws: Workspace, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([exe("handoffd"), "run", "--root", str(ws.root), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(ws))


def folders(ws: Workspace) -> dict[str, set[str]]:
    return {state: {p.stem for p in (ws.root / "handoffs" / state).glob("*.json")}
            for state in ("pending", "in-progress", "completed", "failed")}


def never_twice_at_once(ws: Workspace, killed: int | None = None) -> None:
    """No handoff ran in two places at the same time: per id, each start follows the end of the
    one before (a run of the ``killed`` process ended when it was killed, before any re-run)."""
    running: dict[object, object] = {}  # id -> pid of its open run
    for entry in sorted(runs(ws), key=lambda e: float(e.get("at", e.get("done", 0)))):  # type: ignore[arg-type]
        hid = entry["id"]
        if "at" in entry:
            assert running.get(hid) in (None, killed), f"{hid} started while running"
            running[hid] = entry["pid"]
        else:
            running.pop(hid, None)


def test_a_backlog_runs_once_each_over_two_processes(ws: Workspace) -> None:
    setup(ws, 240, sleep=0.002)
    proc = batch(ws, "--processes", "2", "-v")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "the batch runs on 2 processes" in stderr
    assert "batch done: completed 240, failed 0" in stderr, stderr
    assert "Traceback" not in stderr
    started = [e for e in runs(ws) if "at" in e]
    assert sorted(str(e["id"]) for e in started) == [f"sp-{i:04d}" for i in range(240)]
    assert len({e["pid"] for e in started}) == 2  # both processes ran some
    assert folders(ws)["completed"] == {f"sp-{i:04d}" for i in range(240)}
    assert not any(folders(ws)[s] for s in ("pending", "in-progress", "failed"))
    # the forked process wrote its temp files in a folder of its own (no lock shared with the
    # first at every file it creates), and removed it with its spares as it ended
    child = next(e["pid"] for e in started if e["pid"] != proc.pid)
    seen = {name for e in started for name in e["tmp"]}  # type: ignore[attr-defined]
    assert any(name.startswith(f"p{child}-") for name in seen), seen
    assert not any(name.startswith(f"p{proc.pid}-") for name in seen), seen
    assert not list((ws.root / "handoffs" / ".tmp").iterdir())  # each process cleaned its spares


def test_the_summary_and_exit_code_count_every_process(ws: Workspace) -> None:
    setup(ws, 200, spec="\n[retry]\nmax_retries = 0", sleep=0.002, fail=lambda i: i % 4 == 0)
    proc = batch(ws, "--processes", "2")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "batch done: completed 150, failed 50" in stderr, stderr
    assert len({e["pid"] for e in runs(ws)}) == 2


def test_sigterm_to_the_batch_stops_every_process_and_hands_nothing_twice(ws: Workspace) -> None:
    setup(ws, 40, sleep=0.3)
    proc = batch(ws, "--processes", "2", "--workers", "2")
    wait_until(lambda: len({e["pid"] for e in runs(ws)}) == 2, timeout=30, what="both processes at work")
    pids = {int(e["pid"]) for e in runs(ws)}  # type: ignore[call-overload]
    proc.send_signal(signal.SIGTERM)  # the first: finish what runs, claim nothing new
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, what="every process gone")
    state = folders(ws)
    assert not state["in-progress"] and not state["failed"]
    assert state["pending"] and state["completed"]  # stopped part-way
    assert state["pending"] | state["completed"] == {f"sp-{i:04d}" for i in range(40)}
    never_twice_at_once(ws)
    again = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), "--processes", "2"],
                           capture_output=True, text=True, env=env(ws), timeout=120)
    assert again.returncode == 0, again.stderr
    assert folders(ws)["completed"] == {f"sp-{i:04d}" for i in range(40)}


NO_DELAY = "\n[retry]\nretry_delay_seconds = 0"  # an interrupted attempt is retried at once
# a process killed between its claim's rename and its lease leaves a claim without a lease,
# which recovery takes only after claim_grace_seconds (it might be a slow claimer)
SHORT_GRACE = "claim_grace_seconds = 0.5"


def run_until_done(ws: Workspace, expected: int, seconds: float = 30) -> str:
    """``handoffd run`` as cron would, again until ``expected`` handoffs are completed; the
    runs' stderr. Each exits 0 (nothing fails)."""
    said = ""
    deadline = time.monotonic() + seconds
    while len(folders(ws)["completed"]) < expected and time.monotonic() < deadline:
        again = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root)],
                               capture_output=True, text=True, env=env(ws), timeout=120)
        assert again.returncode == 0, again.stderr
        said += again.stderr
        time.sleep(0.2)
    assert len(folders(ws)["completed"]) == expected, folders(ws)
    return said


@pytest.mark.heavy
def test_a_killed_process_is_reported_and_its_claim_recovered(ws: Workspace) -> None:
    setup(ws, 40, extra=SHORT_GRACE, spec=NO_DELAY, sleep=0.3)
    proc = batch(ws, "--processes", "2", "--workers", "2")
    wait_until(lambda: len({e["pid"] for e in runs(ws)}) == 2, timeout=30, what="both processes at work")
    child = next(int(e["pid"]) for e in runs(ws) if e["pid"] != proc.pid)  # type: ignore[call-overload]
    os.kill(child, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"error: process {child} ended without a report (killed by signal 9)" in stderr, stderr
    assert "1 process(es) ended without a report" in stderr  # the summary is printed too
    killed = {str(e["id"]) for e in runs(ws) if e["pid"] == child and "at" in e} - \
        {str(e["id"]) for e in runs(ws) if e["pid"] == child and "done" in e}
    assert killed and killed <= folders(ws)["in-progress"]  # its claims, left behind
    assert "recovered" in run_until_done(ws, 40)  # the dead process's claims
    never_twice_at_once(ws, killed=child)


@pytest.mark.heavy
def test_the_children_stop_when_the_batch_is_killed(ws: Workspace) -> None:
    setup(ws, 40, extra=SHORT_GRACE, spec=NO_DELAY, sleep=0.3)
    proc = batch(ws, "--processes", "2", "--workers", "2")
    wait_until(lambda: len({e["pid"] for e in runs(ws)}) == 2, timeout=30, what="both processes at work")
    child = next(int(e["pid"]) for e in runs(ws) if e["pid"] != proc.pid)  # type: ignore[call-overload]
    proc.kill()
    proc.communicate(timeout=30)
    wait_until(lambda: not alive(child), timeout=30, what="the child stopped with its parent")
    mine = {str(e["id"]) for e in runs(ws) if e["pid"] == child}
    state = folders(ws)
    assert not mine & state["in-progress"]  # the child finished or handed back what it ran
    run_until_done(ws, 40)
    never_twice_at_once(ws, killed=proc.pid)


# ---------------------------------------------------------------- how many processes

def plan(ws: Workspace, pending: int, requested: int | None = None, *, extra: str = "",
         spec: str = "", cpus: int = 4, durability: str = "fast",
         monkeypatch: pytest.MonkeyPatch) -> int:
    setup(ws, pending, extra=extra, spec=spec, durability=durability)
    monkeypatch.setattr(spread, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(specialists, "_DECORATED", {})  # other tests' @specialist functions
    return spread.processes_for(engine(ws.root), requested)


def test_auto_uses_every_cpu_for_a_large_backlog(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan(ws, spread.AUTO_MIN_PENDING, monkeypatch=monkeypatch) == 4


def test_auto_adds_a_process_with_fsync(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fsync each process also waits for the disk: one more than the CPUs keeps them busy."""
    assert plan(ws, spread.AUTO_MIN_PENDING, durability="fsync", cpus=2,
                monkeypatch=monkeypatch) == 3
    assert plan_again(ws, cpus=spread.AUTO_MAX_PROCESSES, monkeypatch=monkeypatch) \
        == spread.AUTO_MAX_PROCESSES


def plan_again(ws: Workspace, *, cpus: int, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(spread, "usable_cpus", lambda: cpus)
    return spread.processes_for(engine(ws.root), None)


def test_auto_runs_one_process_for_a_small_backlog(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan(ws, spread.AUTO_MIN_PENDING - 1, monkeypatch=monkeypatch) == 1


def test_auto_runs_one_process_on_one_cpu(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan(ws, spread.AUTO_MIN_PENDING, cpus=1, monkeypatch=monkeypatch) == 1


def test_auto_runs_one_process_when_a_specialist_has_a_cap(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan(ws, spread.AUTO_MIN_PENDING, spec="concurrency = 1",
                monkeypatch=monkeypatch) == 1


def test_auto_runs_one_process_for_command_specialists(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = '\n[specialists."@cmd"]\ncommand = ["true"]\n'
    assert plan(ws, spread.AUTO_MIN_PENDING, spec=extra, monkeypatch=monkeypatch) == 1


def test_a_setting_or_option_is_taken_as_given(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan(ws, 3, extra="processes = 3", monkeypatch=monkeypatch) == 3
    eng = engine(ws.root)
    assert spread.processes_for(eng, 1) == 1
    assert spread.processes_for(eng, 5) == 5


def test_a_store_that_cannot_fork_runs_one(ws: Workspace, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    setup(ws, 0)
    eng = engine(ws.root)
    eng.backend = MemoryBackend()
    assert spread.processes_for(eng, 4) == 1
    assert "not shared by forked processes" in caplog.text


@pytest.mark.parametrize("value, ok", [('"auto"', 0), ("1", 1), ("64", 64), ('"3"', 3),
                                       ("0", None), ("65", None), ("-1", None), ('"two"', None),
                                       ("true", None), ("2.5", None)])
def test_the_processes_setting(tmp_path: Path, value: str, ok: int | None) -> None:
    (tmp_path / "handoffd.toml").write_text(f"[daemon]\nprocesses = {value}\n")
    if ok is None:
        with pytest.raises(ConfigError, match="processes"):
            load_config(tmp_path / "handoffd.toml")
    else:
        assert load_config(tmp_path / "handoffd.toml").daemon.processes == ok


@pytest.mark.parametrize("full", [False, True])
def test_the_processes_option_on_both_command_lines(ws: Workspace, full: bool) -> None:
    """The quick path and the full (typer) command line take and refuse the same values."""
    setup(ws, 6)
    extra = {"HANDOFFD_FULL_CLI": "1"} if full else {}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), *args],
                              capture_output=True, text=True, env={**env(ws), **extra}, timeout=120)

    for bad in ("0", "x", "65", "-1"):
        proc = run("--processes", bad)
        assert proc.returncode == 2, proc.stderr
        assert "--processes" in proc.stderr and "Traceback" not in proc.stderr
    assert run("--processes", "auto").returncode == 0
    proc = run("--processes", "2", "-v")
    assert proc.returncode == 0 and "the batch runs on 2 processes" in proc.stderr, proc.stderr
    assert len(folders(ws)["completed"]) == 6


def test_each_process_starts_on_its_own_stretch_of_the_backlog(ws: Workspace) -> None:
    """Two processes that queue the pending list in one order race for every handoff (both read
    it, one loses the claim); with stripes they start half a list apart."""
    from handoffd.service.daemon import Daemon
    setup(ws, 10)
    eng = engine(ws.root)
    listed = eng.backend.ids(State.PENDING)
    for index, first in ((0, listed[0]), (1, listed[5])):
        daemon = Daemon(eng, watch=False, stripe=(index, 2))
        assert daemon.scan() == 10
        order = [hid for _, _, _, hid in sorted(daemon.scheduler.heap)]
        assert order[0] == first and sorted(order) == sorted(listed)


def test_dependency_chains_finish_in_one_batch_over_two_processes(ws: Workspace) -> None:
    """A dependant waits in both processes; whichever files what it waits for runs it next, and
    the summary names nothing as waiting once it ran."""
    setup(ws, 20, spec=NO_DELAY, sleep=0.02)
    for chain in range(6):
        ids = [f"c{chain}-{k}" for k in range(4)]
        for k, hid in enumerate(ids):
            ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@spread"},
                                    "depends_on": ids[k - 1:k], "input": {"data": {"sleep": 0.05}}})
    proc = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), "--processes", "2", "-v"],
                          capture_output=True, text=True, env=env(ws), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "batch done: completed 44, failed 0, retry scheduled 0\n" in proc.stderr, proc.stderr
    assert len(folders(ws)["completed"]) == 44 and not folders(ws)["pending"]
    starts = {str(e["id"]): float(e["at"]) for e in runs(ws) if "at" in e}  # type: ignore[arg-type]
    ends = {str(e["id"]): float(e["done"]) for e in runs(ws) if "done" in e}  # type: ignore[arg-type]
    for chain in range(6):
        for k in range(1, 4):
            assert starts[f"c{chain}-{k}"] >= ends[f"c{chain}-{k - 1}"]


def test_max_seconds_ends_every_process_on_time(ws: Workspace) -> None:
    setup(ws, 40, sleep=60)
    proc = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), "--processes", "2",
                           "--workers", "2", "--max-seconds", "2"],
                          capture_output=True, text=True, env=env(ws), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "handed back 4" in proc.stderr, proc.stderr  # two running in each process
    assert len({e["pid"] for e in runs(ws)}) == 2
    state = folders(ws)
    assert not state["in-progress"] and len(state["pending"]) == 40


# ---------------------------------------------------------------- handoffd serve --processes

def start_serving(ws: Workspace, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env(ws))
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving" in line, line
    return proc, line


def drop_many(ws: Workspace, count: int, **data: object) -> None:
    for i in range(count):
        hid = f"sv-{i:04d}"
        ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@spread"},
                                "input": {"data": data}})


def test_serve_on_two_processes_runs_each_handoff_once_and_stops_whole(ws: Workspace) -> None:
    setup(ws, 0)
    proc, ready = start_serving(ws, "--processes", "2")
    try:
        assert "(store: files; 2 processes of 4 workers;" in ready
        drop_many(ws, 200, sleep=0.002)
        wait_until(lambda: len(folders(ws)["completed"]) == 200, timeout=60, what="all filed")
        pids = {int(e["pid"]) for e in runs(ws)}  # type: ignore[call-overload]
        assert len(pids) == 2 and proc.pid in pids
        assert sorted(str(e["id"]) for e in runs(ws) if "at" in e) == \
            [f"sv-{i:04d}" for i in range(200)]  # each once
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "stopped: completed 200, failed 0" in stderr, stderr  # both processes counted
        wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10, what="all gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_a_serving_process_that_dies_stops_the_others_for_the_supervisor(ws: Workspace) -> None:
    setup(ws, 0, extra="rescan_seconds = 0.5\n" + SHORT_GRACE, spec=NO_DELAY)
    proc, _ = start_serving(ws, "--processes", "2")
    try:
        drop_many(ws, 100, sleep=0.002)
        wait_until(lambda: len({e["pid"] for e in runs(ws)}) == 2, timeout=60, what="both at work")
        child = next(int(e["pid"]) for e in runs(ws) if e["pid"] != proc.pid)  # type: ignore[call-overload]
        os.kill(child, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1  # a supervisor restarts the whole
        stderr = proc.stderr.read() if proc.stderr else ""
        assert f"error: process {child} ended without a report (killed by signal 9)" in stderr
        assert "Traceback" not in stderr
        run_until_done(ws, 100)  # the dead process's claims recovered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_auto_is_one_process(ws: Workspace) -> None:
    setup(ws, 0, extra='processes = "auto"')
    proc, ready = start_serving(ws)
    try:
        assert "processes of" not in ready
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
