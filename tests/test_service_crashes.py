"""Handlers that take their daemon down, and daemons that cannot end: what the service does.

* ``run --processes N --max-seconds S`` ends even when one of its processes is stuck: the parent
  stops it, says so and exits 1 (handoffd.service.reaping).
* A handler that stops its own daemon at every start is handed back for free a few times, then
  counted and dead-lettered (handoffd.service.handbacks); an operator's stop or two stays free.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, alive, exe, wait_until

from handoffd.service import reaping
from handoffd.service.handbacks import FREE_HANDBACKS, stops_in_a_row

PLUG = '''
import json, os, signal, time

def _log(ctx, **fields):
    with open(os.environ["CRASH_LOG"], "a") as log:
        log.write(json.dumps({"id": ctx.handoff_id, "pid": os.getpid(), **fields}) + "\\n")

def _starts(ctx):
    with open(os.environ["CRASH_LOG"]) as log:
        return sum(1 for line in log if json.loads(line).get("id") == ctx.handoff_id
                   and "at" in json.loads(line))

def poison(handoff, ctx):
    _log(ctx, at=time.time())
    time.sleep(0.2)
    os._exit(3)  # takes the whole process down, and whatever runs in it

def work(handoff, ctx):
    _log(ctx, at=time.time())
    time.sleep(float(handoff.get("input", {}).get("data", {}).get("sleep", 0.4)))
    _log(ctx, done=time.time())
    return {"status": "completed"}

def selfstop(handoff, ctx):
    _log(ctx, at=time.time())
    os.kill(os.getpid(), signal.SIGTERM)  # its own daemon: a stop nobody asked for
    time.sleep(3)  # past grace_seconds
    return {"status": "completed"}

def slow_twice(handoff, ctx):
    _log(ctx, at=time.time())
    if _starts(ctx) <= 2:  # an operator stops the daemon twice while this runs
        time.sleep(3)
    _log(ctx, done=time.time())
    return {"status": "completed"}
'''

CONFIG = '''
[daemon]
durability = "fast"
settle_seconds = 0.05
grace_seconds = {grace}
workers = 4
sweep_seconds = 0.5
rescan_seconds = 0.5

[retry]
max_retries = {retries}
retry_delay_seconds = 0
backoff_multiplier = 1.0

[specialists."@poison"]
handler = "crashplug:poison"
[specialists."@work"]
handler = "crashplug:work"
[specialists."@selfstop"]
handler = "crashplug:selfstop"
[specialists."@slow"]
handler = "crashplug:slow_twice"
'''


def setup(ws: Workspace, *, grace: float = 5.0, retries: int = 2) -> None:
    plug = ws.root / "plug"
    plug.mkdir()
    (plug / "crashplug.py").write_text(PLUG)
    ws.write_config(CONFIG.format(grace=grace, retries=retries))


def drop(ws: Workspace, hid: str, agent: str, **data: Any) -> str:
    ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": agent},
                            "input": {"data": data}})
    return hid


def env(ws: Workspace) -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(ws.root / "plug"), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, PYTHONPATH=path, CRASH_LOG=str(ws.root / "runs.jsonl"))


def runs(ws: Workspace) -> list[dict[str, Any]]:
    path = ws.root / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def batch(ws: Workspace, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), *args],
                          capture_output=True, text=True, env=env(ws), timeout=timeout)


def start(ws: Workspace, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([exe("handoffd"), *args, "--root", str(ws.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env(ws))
    ws.daemons.append(proc)  # killed by the fixture if a test fails with it running
    return proc


def where(ws: Workspace, hid: str) -> str:
    found = ws.state_of(hid)
    assert len(found) == 1, (hid, found)
    return found[0]


def settled(ws: Workspace, poison: str, healthy: list[str]) -> bool:
    return ws.state_of(poison) == ["failed"] and \
        all(ws.state_of(hid) == ["completed"] for hid in healthy)


def book(ws: Workspace, hid: str) -> dict[str, Any]:
    return ws.doc(hid)["handoffd"]


# ---------------------------------------------------------------- F8: a stuck process
def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


@pytest.mark.heavy
def test_max_seconds_bounds_a_batch_whose_process_is_stuck(ws: Workspace) -> None:
    setup(ws, grace=0.5)
    ids = [drop(ws, f"w-{i:03d}", "@work", sleep=0.1) for i in range(160)]
    began = time.monotonic()
    proc = start(ws, "run", "--processes", "2", "--workers", "2", "--max-seconds", "2")
    wait_until(lambda: children_of(proc.pid), timeout=10, what="the batch forked")
    child = children_of(proc.pid)[0]
    wait_until(lambda: any(e["pid"] == child for e in runs(ws)), timeout=10,
               what="the forked process at work")
    os.kill(child, signal.SIGSTOP)  # it makes no progress from now on
    try:
        _, stderr = proc.communicate(timeout=18)
    finally:
        if alive(child):
            os.kill(child, signal.SIGCONT)
    took = time.monotonic() - began
    # 2 s of batch, then grace (0.5 s) and the hand-back margin (5 s), then SIGTERM
    assert took < 14, took
    assert proc.returncode == 1, stderr
    assert f"process {child} was still running" in stderr, stderr
    assert "stopped it with SIG" in stderr, stderr
    assert "Traceback" not in stderr
    wait_until(lambda: not alive(child), timeout=10, what="the stuck process ended")
    # nothing is lost: what it held is recovered by the next runs, and everything completes
    ended = time.monotonic() + 15
    while len(list((ws.root / "handoffs" / "completed").glob("*.json"))) < len(ids) \
            and time.monotonic() < ended:
        again = batch(ws, "--workers", "8")
        assert "Traceback" not in again.stderr
    assert all(ws.state_of(hid) == ["completed"] for hid in ids)


def spawn_stuck(ignore_term: bool) -> tuple[int, int]:
    """A child of this process that stops itself (SIGSTOP) with a pipe to us; (pid, read end)."""
    read, write = os.pipe()
    code = ("import os, signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "os.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(30)\n")
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, write, 1)])
    os.close(write)
    wait_until(lambda: stopped(pid), timeout=10, what="the child stopped itself")
    return pid, read


def stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2] == "T"


@pytest.mark.parametrize("ignore_term,signum", [(False, signal.SIGTERM), (True, signal.SIGKILL)])
def test_collect_stops_a_stopped_child_past_its_deadline(ignore_term: bool, signum: int) -> None:
    pid, read = spawn_stuck(ignore_term)
    unreaped = [pid]
    began = time.monotonic()
    done = reaping.collect(pid, read, lambda: began + 0.3, unreaped)
    took = time.monotonic() - began
    assert done.stopped == signal.Signals(signum).name
    assert done.status is not None and os.waitstatus_to_exitcode(done.status) == -signum
    assert unreaped == []
    assert took < 0.3 + reaping.TERM_SECONDS + 30, took  # (never reaped: for ever)


def test_collect_reads_a_report_and_waits_without_a_deadline() -> None:
    read, write = os.pipe()
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c",
                                          "import time; time.sleep(0.3); print('{}')"],
                         os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, write, 1)])
    os.close(write)
    done = reaping.collect(pid, read, lambda: float("inf"), [pid])
    assert (done.data.strip(), done.stopped) == (b"{}", "")
    assert done.status is not None and os.waitstatus_to_exitcode(done.status) == 0


def test_collect_past_the_deadline_still_takes_a_finished_childs_report() -> None:
    """Found by the review: collected after a stuck sibling, past the shared deadline, a
    healthy child that had ended was named "ended without a report" and its counts lost."""
    read, write = os.pipe()
    code = "import json; print(json.dumps({'ok': 1}))"
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, write, 1)])
    os.close(write)
    wait_until(lambda: os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
               is not None, timeout=10, what="the child ended")
    done = reaping.collect(pid, read, lambda: 0.0, [pid])  # the deadline long past
    assert (json.loads(done.data), done.stopped) == ({"ok": 1}, "")
    assert done.status is not None and os.waitstatus_to_exitcode(done.status) == 0


# ---------------------------------------------------------------- F9: stops in a row
@pytest.mark.heavy
def test_a_handler_that_stops_its_own_daemon_is_dead_lettered(ws: Workspace) -> None:
    setup(ws, grace=0.3, retries=1)
    hid = drop(ws, "selfstop-0", "@selfstop")
    seen = []
    for _ in range(FREE_HANDBACKS + 2):  # free hand-backs, then 1 + max_retries counted stops
        done = batch(ws)
        assert "Traceback" not in done.stderr, done.stderr
        seen.append((done.returncode, where(ws, hid), book(ws, hid).get("retries", 0)))
    free = [(0, "pending", 0)] * FREE_HANDBACKS
    assert seen == [*free, (0, "pending", 1), (1, "failed", 1)], seen
    error = ws.doc(hid)["error"]
    assert f"interrupted by stops {FREE_HANDBACKS + 2} times in a row" in error["message"]
    assert error["code"] == "PROCESSING_ERROR"


def test_an_operators_stop_or_two_costs_nothing(ws: Workspace) -> None:
    setup(ws, grace=0.3, retries=0)  # with no retry, one counted stop would fail it
    hid = drop(ws, "slow-0", "@slow")
    for stop in (1, 2):
        proc = start(ws, "serve")
        wait_until(lambda: sum("at" in e for e in runs(ws)) == stop, timeout=10,
                   what=f"run {stop} started")
        proc.send_signal(signal.SIGTERM)  # a deploy, a restart
        assert proc.wait(timeout=10) == 0
        assert where(ws, hid) == "pending"
    proc = start(ws, "serve")
    ws.wait_state(hid, ("completed",), timeout=10)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    block = book(ws, hid)
    assert "retries" not in block
    handed = [e for e in block["history"] if e["event"] == "handed_back"]
    assert len(handed) == 2 and all(e["detail"]["interrupted"] for e in handed)


# ---------------------------------------------------------------- the history readers
def event(name: str, **detail: Any) -> dict[str, Any]:
    return {"at": "2026-01-01T00:00:00Z", "event": name, **({"detail": detail} if detail else {})}


def doc_with(*events: dict[str, Any]) -> dict[str, Any]:
    return {"handoff_id": "h", "handoffd": {"history": list(events)}}


def counted_stop() -> dict[str, Any]:
    return event("retry_scheduled", error={"code": "PROCESSING_ERROR",
                                           "details": {"stops_in_a_row": 4}})


def test_stops_in_a_row_count_from_the_history() -> None:
    stop = event("handed_back", interrupted=True)
    assert stops_in_a_row(doc_with(event("created"), event("claimed"), stop, event("claimed"),
                                   stop)) == 2
    # a counted stop counts, a hand-back of an attempt that never ran neither counts nor ends
    assert stops_in_a_row(doc_with(stop, event("claimed"), counted_stop(), event("claimed"),
                                   event("handed_back", reason="daemon stopping"))) == 2
    # anything else ends the run: a failure retried, a recovery, a manual retry
    assert stops_in_a_row(doc_with(stop, event("retry_scheduled", error={"code": "X"}),
                                   event("claimed"), stop)) == 1
    assert stops_in_a_row(doc_with(stop, event("recovered"))) == 0
    assert stops_in_a_row({"handoffd": {"history": [1, 2]}}) == 0


def test_a_claim_its_own_process_gave_up_is_handed_back_uncharged(tmp_path: Path) -> None:
    """Found by the service review: a full disk while results were filed made the store give
    the claim up (its filing failed), and the sweep recovered it as a crash: a charged
    attempt, the specialist marked suspect (its handlers isolated for ten minutes), and with
    max_retries = 0 a handler that had succeeded dead-lettered. Now it is handed back, free
    (counted after FREE_HANDBACKS in a row, as any interrupted attempt)."""
    from handoffd import Registry, Workspace as HandoffdWorkspace, build_engine, new_native_request
    from handoffd.core.config import Config, RetryPolicy
    from handoffd.core.documents import book
    from handoffd.core.states import State
    from handoffd.service.sweeper import sweep
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config(retry=RetryPolicy(max_retries=0))
    registry = Registry()
    registry.add_function("@t", lambda handoff, ctx: {"status": "completed"}, config=config)
    engine = build_engine(ws, config, registry)
    try:
        doc = new_native_request(source="@test", target="@t", data=None, now=engine.clock())
        hid = engine.backend.store.create(doc, doc["handoff_id"])
        job = engine.take(hid)
        assert job is not None
        engine.backend.abandon(job.claim)  # what a failed filing does
        report = sweep(engine)
        assert hid in report.recovered
        state, filed = engine.get(hid)
        assert state is State.PENDING  # not failed, though max_retries = 0
        events = [e["event"] for e in book(filed)["history"]]
        assert events[-2:] == ["recovered", "handed_back"], events
        assert stops_in_a_row(filed) == 1 and book(filed).get("retries", 0) == 0
        assert "@t" not in engine.suspects  # no crash: its handlers are not isolated
        from handoffd.core.isolation import crashed_last
        again = engine.take(hid)  # nor is this handoff's next attempt
        assert again is not None and not crashed_last(again.claim.doc)
    finally:
        engine.backend.close()


def test_a_batch_on_a_full_disk_puts_its_claims_back_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the service review: with the disk full, every claim's lease write failed, the
    batch logged 'will retry in 5.0s' (it exited at once), printed a clean summary and exited
    0, and left every handoff in in-progress/ until a run more than claim_grace_seconds later.
    Now each claim's document goes back to pending/ at once, and the batch counts the errors
    (the command line exits 1 on them)."""
    import errno as errno_module

    from handoffd import Daemon, Registry, Workspace as HandoffdWorkspace, build_engine
    from handoffd import new_native_request
    from handoffd.backends.files import fsio
    from handoffd.core.config import Config
    from handoffd.core.states import State
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@t", lambda handoff, ctx: {"status": "completed"}, config=config)
    engine = build_engine(ws, config, registry)
    ids = []
    for _ in range(3):
        doc = new_native_request(source="@test", target="@t", data=None, now=engine.clock())
        ids.append(engine.backend.store.create(doc, doc["handoff_id"]))
    real_replace, real_exact = fsio.replace, fsio.replace_exact

    def disk_full(path: Any, *args: Any, **kwargs: Any) -> Any:
        if "in-progress" in str(path):
            raise OSError(errno_module.ENOSPC, "No space left on device")
        return real_replace(path, *args, **kwargs)

    def disk_full_exact(path: Any, *args: Any, **kwargs: Any) -> Any:  # a claim's lease write
        if "in-progress" in str(path):
            raise OSError(errno_module.ENOSPC, "No space left on device")
        return real_exact(path, *args, **kwargs)

    monkeypatch.setattr(fsio, "replace", disk_full)
    monkeypatch.setattr(fsio, "replace_exact", disk_full_exact)
    try:
        report = Daemon(engine, watch=False).run_batch()
        assert report.errors >= 3 and report.completed == 0
        assert report.needs_a_look() and "error(s)" in report.line()
        assert sorted(engine.backend.ids(State.PENDING)) == sorted(ids)
        assert engine.backend.ids(State.IN_PROGRESS) == []
        monkeypatch.setattr(fsio, "replace", real_replace)  # space again: the next run runs them
        monkeypatch.setattr(fsio, "replace_exact", real_exact)
        assert Daemon(engine, watch=False).run_batch().completed == 3
    finally:
        engine.backend.close()
