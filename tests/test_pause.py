"""Pause and resume a specialist or the whole workspace, through the real CLI and daemons: paused
work stays pending (`handoff ls` says why), survives restarts, and every daemon obeys."""
from __future__ import annotations

import json
import time

from conftest import Workspace


def note_of(ws: Workspace, hid: str) -> str:
    rows = json.loads(ws.handoff("ls", "--json").stdout)
    return next(r["note"] for r in rows if r["id"] == hid)


def test_pause_a_specialist_then_resume(ws: Workspace) -> None:
    paused = ws.handoff("pause", "@flaky", "--reason", "incident 42", "--as", "@oncall")
    assert paused.returncode == 0 and "@flaky  paused by @oncall" in paused.stdout
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    assert ws.handoffd("run").returncode == 0  # a batch leaves it (and a restart would too)
    assert ws.state_of(hid) == ["pending"] and ws.runs() == []
    note = note_of(ws, hid)
    assert note.startswith("paused: @flaky is paused by @oncall") and "incident 42" in note
    listed = json.loads(ws.handoff("paused", "--json").stdout)
    assert listed["@flaky"]["reason"] == "incident 42"
    daemon = ws.serve()  # a serving daemon takes it as soon as the pause is lifted
    try:
        time.sleep(0.3)
        assert ws.state_of(hid) == ["pending"]
        assert ws.handoff("resume", "@flaky").stdout == "nothing is paused\n"
        ws.wait_state(hid, ("completed",), timeout=20)
    finally:
        assert ws.stop(daemon) == 0


def test_pause_everything(ws: Workspace) -> None:
    assert ws.handoff("pause", "--all").returncode == 0
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    ws.handoffd("run")
    assert ws.state_of(hid) == ["pending"] and "the workspace is paused" in note_of(ws, hid)
    assert ws.handoff("pause").returncode == 2  # nothing named
    assert ws.handoff("pause", "@x", "--all").returncode == 2
    assert ws.handoff("resume", "--all").returncode == 0
    ws.handoffd("run")
    assert ws.state_of(hid) == ["completed"]
