"""A files-store batch waits for an in-progress claim without a lease (session 31, review RA).

A claimer killed between its rename into in-progress/ and its lease write leaves the document
there unleased; a sweep's repair hands it back to pending/ once it has been still for
``claim_grace_seconds``. A ``handoffd run`` that found one younger than that ended at once,
exit 0, without a word of it: the handoff waited for some later batch. It now waits for it
(bounded by the grace, as a PostgreSQL store's batch waits for its watched claims), says so,
and runs it. Real ``handoffd run`` processes against a tmp workspace.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import FLAKY_TOML, exe, new_workspace

TOML = FLAKY_TOML.replace("claim_grace_seconds = 1.0", "claim_grace_seconds = 3.0")


def _request(handoff_id: str) -> str:
    return json.dumps({"handoff_id": handoff_id, "timestamp": "2026-11-28T12:00:00Z",
                       "source": {"agent_id": "@a"}, "target": {"agent_id": "@flaky"},
                       "input": {"data": {}}, "status": "pending"})


def test_a_batch_hands_back_and_runs_a_claim_left_without_its_lease(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", TOML)
    try:
        handoffs = ws.root / "handoffs"
        (handoffs / "in-progress" / "u1.json").write_text(_request("u1"))  # (its claimer died)
        ws.drop("u2.json", _request("u2"))
        batch = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), "-v",
                                "--max-seconds", "60"],
                               capture_output=True, text=True, timeout=120)
        assert batch.returncode == 0, batch.stderr
        assert ws.state_of("u2") == ["completed"]
        assert ws.state_of("u1") == ["completed"], batch.stderr  # (was: still in-progress)
        assert "waiting up to" in batch.stderr and "take over 1 claim" in batch.stderr, \
            batch.stderr
        assert "Traceback" not in batch.stderr
    finally:
        ws.cleanup()


def test_a_foreign_consumers_claim_within_its_time_is_not_waited_for(tmp_path: Path) -> None:
    """Seed 001's consumer marks its claim in_progress with started_at: held for its
    timeout_seconds, not ours to take over: the batch ends without waiting."""
    ws = new_workspace(tmp_path / "ws", TOML)
    try:
        doc = json.loads(_request("f1"))
        doc.update(status="in_progress", started_at="2099-01-01T00:00:00Z", timeout_seconds=600)
        (ws.root / "handoffs" / "in-progress" / "f1.json").write_text(json.dumps(doc))
        batch = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), "-v",
                                "--max-seconds", "60"],
                               capture_output=True, text=True, timeout=120)
        assert batch.returncode == 0, batch.stderr
        assert ws.state_of("f1") == ["in-progress"]
        assert "take over" not in batch.stderr, batch.stderr
    finally:
        ws.cleanup()
