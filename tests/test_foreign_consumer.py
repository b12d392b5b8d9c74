"""Seed 001's own consumer (its Example 2 and 3) beside a running daemon: it renames a request
into in-progress/, marks it `status: in_progress` with `started_at`, and later writes the response
into completed/. handoffd honours that claim for the request's `timeout_seconds` instead of
pulling it back as a dead claimer's, and hands it back once that time is over. What it files is
a foreign filing: read by its folder and its own fields, never as handoffd's record (the
`handoffd` block it copied from pending/ is sealed for pending/, not for where it now is)."""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from conftest import Workspace

from handoffd.core.storage import FOREIGN_FILING

CONFIG = """
[daemon]
settle_seconds = 0.05
claim_grace_seconds = 0.5
sweep_seconds = 0.2
rescan_seconds = 0.5
durability = "fast"
"""  # no specialist: the foreign consumer is the one doing the work


def utc() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def pick_up(ws: Workspace, hid: str) -> Path:
    """Example 2: move the request to in-progress/ and mark it (not atomically: as written)."""
    src = ws.root / "handoffs" / "pending" / f"{hid}.json"
    dst = ws.root / "handoffs" / "in-progress" / f"{hid}.json"
    os.rename(src, dst)
    doc = json.loads(dst.read_text())
    doc["status"], doc["started_at"] = "in_progress", utc()
    dst.write_text(json.dumps(doc, indent=2))
    return dst


def complete(ws: Workspace, hid: str) -> None:
    """Example 3: write the response into completed/, remove the in-progress copy."""
    src = ws.root / "handoffs" / "in-progress" / f"{hid}.json"
    doc = json.loads(src.read_text())
    doc.update(status="completed", completed_at=utc(), output={"artifact_id": "x"})
    (ws.root / "handoffs" / "completed" / f"{hid}.json").write_text(json.dumps(doc, indent=2))
    src.unlink()


def fail(ws: Workspace, hid: str) -> None:
    """Example 4: write the failure into failed/, remove the in-progress copy."""
    src = ws.root / "handoffs" / "in-progress" / f"{hid}.json"
    doc = json.loads(src.read_text())
    doc.update(status="failed", failed_at=utc(), retry_available=True, retry_count=0,
               error={"code": "PROCESSING_ERROR", "message": "the specialist gave up"})
    (ws.root / "handoffs" / "failed" / f"{hid}.json").write_text(json.dumps(doc, indent=2))
    src.unlink()


def test_a_foreign_claim_is_honoured_for_its_timeout(ws: Workspace) -> None:
    ws.write_config(CONFIG)
    hid = ws.create("--to", "@react-specialist", "--timeout-seconds", "60", "--data", "{}")
    daemon = ws.serve()
    try:
        pick_up(ws, hid)
        time.sleep(2.0)  # four claim graces and ten sweeps: a dead claimer would be pulled back
        assert ws.state_of(hid) == ["in-progress"]
        complete(ws, hid)
        wait = ws.handoff("wait", hid, "--timeout", "10")
        assert wait.returncode == 0 and wait.stdout == f"{hid} completed\n", wait
    finally:
        assert ws.stop(daemon) == 0
    assert ws.state_of(hid) == ["completed"]
    shown = json.loads(ws.handoff("show", hid, "--json").stdout)
    assert shown["foreign_filing"] is True and shown["document"]["output"] == {"artifact_id": "x"}
    (row,) = json.loads(ws.handoff("ls", "--json").stdout)
    assert row["note"] == FOREIGN_FILING


def test_a_foreign_failure_is_waited_on_and_retried_as_the_consumers(ws: Workspace) -> None:
    """Example 4: the consumer files a failure itself. `wait` ends 1 with the consumer's own
    error (said to be filed by another consumer), and `retry` moves it back with a history of
    handoffd's own: the one it copied from pending/ is not handoffd's record any more."""
    hid = ws.create("--to", "@react-specialist", "--data", "{}")
    pick_up(ws, hid)
    fail(ws, hid)
    wait = ws.handoff("wait", hid, "--timeout", "10")
    assert wait.returncode == 1 and wait.stdout == f"{hid} failed\n", wait
    assert wait.stderr == (f"handoff: {hid}: PROCESSING_ERROR: the specialist gave up; "
                           f"{FOREIGN_FILING}\n")
    assert ws.handoff("retry", hid).returncode == 0
    assert ws.state_of(hid) == ["pending"]
    doc = ws.doc(hid)
    assert doc["status"] == "pending" and doc["retry_count"] == 1
    assert [e["event"] for e in doc["handoffd"]["history"]] == ["retried"]


def test_a_foreign_claim_past_its_timeout_is_handed_back(ws: Workspace) -> None:
    ws.write_config(CONFIG)
    hid = ws.create("--to", "@react-specialist", "--timeout-seconds", "1", "--data", "{}")
    daemon = ws.serve()
    try:
        pick_up(ws, hid)  # ... and the consumer dies
        deadline = time.monotonic() + 15
        while ws.state_of(hid) != ["pending"]:
            assert time.monotonic() < deadline, ws.state_of(hid)
            time.sleep(0.05)
    finally:
        assert ws.stop(daemon) == 0
    events = [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]
    assert events[-1] == "handed_back", events
