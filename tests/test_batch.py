"""`handoffd run` as cron runs it: quiet unless something needs a look, SIGTERM handled like
`serve` (nothing left claimed, no orphan specialist), --max-seconds ends a batch on time."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest
from conftest import Workspace, alive, exe, wait_until


def start_batch(ws: Workspace, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([exe("handoffd"), "run", "--root", str(ws.root), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_batch_with_nothing_wrong_prints_nothing(ws: Workspace) -> None:
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    ws.create("--to", "@nobody", "--data", "{}")  # no specialist here: not worth a mail
    proc = ws.handoffd("run")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert ws.state_of(hid) == ["completed"]


def test_a_failure_is_summarised_unless_quiet(ws: Workspace) -> None:
    ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    proc = ws.handoffd("run")
    assert proc.returncode == 1
    assert "handoffd: batch done: completed 0, failed 1" in proc.stderr, proc.stderr
    ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    quiet = ws.handoffd("run", "-q")
    assert (quiet.returncode, quiet.stderr) == (1, "")
    verbose = ws.handoffd("run", "-v")
    assert verbose.returncode == 0 and "batch done: completed 0, failed 0" in verbose.stderr


def running_pid(ws: Workspace, hid: str) -> int:
    wait_until(lambda: any(r["id"] == hid for r in ws.runs()))
    return next(r["pid"] for r in ws.runs() if r["id"] == hid)


@pytest.mark.heavy
def test_sigterm_hands_back_and_leaves_no_orphan(ws: Workspace) -> None:
    """cron's `timeout` sends SIGTERM (then SIGKILL): the batch stops like `serve` does."""
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "sleep", "seconds": 60}))
    batch = start_batch(ws)
    pid = running_pid(ws, hid)
    batch.send_signal(signal.SIGTERM)
    batch.send_signal(signal.SIGTERM)  # the second one: hand back at once, as `serve` does
    assert batch.wait(timeout=30) == 0
    stderr = batch.stderr.read() if batch.stderr else ""
    assert "handed back 1" in stderr and "Traceback" not in stderr, stderr
    wait_until(lambda: not alive(pid), timeout=10)
    assert ws.state_of(hid) == ["pending"]
    history = [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]
    assert history[-1] == "handed_back", history


def test_max_seconds_ends_the_batch_on_time(ws: Workspace) -> None:
    slow = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "sleep", "seconds": 60}))
    quick = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    # 3 s, not 1: under a loaded machine the batch's start-up can eat most of one second,
    # and the test must see the slow handler running before it is handed back
    batch = start_batch(ws, "--max-seconds", "3")
    pid = running_pid(ws, slow)
    assert batch.wait(timeout=30) == 0
    stderr = batch.stderr.read() if batch.stderr else ""
    assert "--max-seconds reached" in stderr and "handed back 1" in stderr, stderr
    wait_until(lambda: not alive(pid), timeout=10)
    assert ws.state_of(slow) == ["pending"] and ws.state_of(quick) == ["completed"]
    assert ws.handoffd("run", "--max-seconds", "x").returncode == 2


def test_json_logs_are_one_object_per_line(ws: Workspace) -> None:
    ok = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    bad = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    proc = ws.handoffd("run", "-v", "--log-format", "json")
    assert proc.returncode == 1
    records = [json.loads(line) for line in proc.stderr.splitlines()]  # every line is JSON
    assert all({"time", "level", "message"} <= set(r) for r in records)
    claimed = {r["handoff_id"]: r for r in records if r.get("event") == "claimed"}
    assert set(claimed) == {ok, bad} and claimed[ok]["agent"] == "@flaky"
    assert claimed[ok]["attempt"] == 1
    assert any(r.get("event") == "batch_done" and "failed 1" in r["message"] for r in records)
    failed = next(r for r in records if r.get("event") == "failed")
    assert (failed["handoff_id"], failed["agent"], failed["attempt"], failed["code"]) == \
        (bad, "@flaky", 1, "PROCESSING_ERROR") and failed["duration"] > 0
    assert ws.handoffd("run", "--log-format", "xml").returncode == 2


@pytest.mark.parametrize("command", ["serve", "run"])
def test_sighup_stops_like_sigterm(ws: Workspace, command: str) -> None:
    """Found by the service review: a closed terminal or ssh session (SIGHUP) killed a
    foreground daemon on the spot (exit 129, no summary); its running handler died with it and
    the next sweep charged the attempt as a crash's and marked the specialist suspect. Now
    SIGHUP stops it as SIGTERM does: the running handler finishes within grace_seconds."""
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 1}')
    proc = ws.serve() if command == "serve" else start_batch(ws)
    ws.wait_started(hid)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=30) in (0, 1)
    assert proc.returncode >= 0  # (not killed by the signal: -1 is SIGHUP's)
    assert ws.state_of(hid) == ["completed"], ws.state_of(hid)
    events = [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]
    assert "recovered" not in events and events[-1] == "completed"
