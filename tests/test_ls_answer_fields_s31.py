"""``handoff ls`` notes a seed-001 document whose status only an answer has but which lacks
that answer's fields (session 31, task F).

A whole answer (status completed with ``completed_at``...) in pending/ is noted NOT_A_REQUEST;
one with the status alone (``"status": "failed"``, no ``error`` nor ``failed_at``) had no note,
though its claim checks it against the Failure's schema and files it SCHEMA_VALIDATION_FAILED
(session 29). It now gets a ``SCHEMA_VALIDATION_FAILED: ...`` note saying what it lacks, in
``ls`` and ``show`` alike, once nothing else keeps it waiting; a request and a whole answer keep
theirs. Real ``handoff`` and
``handoffd run`` processes against a tmp workspace.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from conftest import Workspace, new_workspace

ANSWER = "import json; print(json.dumps({'status': 'completed', 'output': {}}))"
CONFIG = f"""
[daemon]
settle_seconds = 0.0

[specialists."@b"]
command = {json.dumps([sys.executable, "-S", "-c", ANSWER])}
"""


def _native(handoff_id: str, **fields: Any) -> dict[str, Any]:
    return {"handoff_id": handoff_id, "timestamp": "2026-11-28T12:00:00Z",
            "source": {"agent_id": "@a"}, "target": {"agent_id": "@b"},
            "input": {"data": {}}, **fields}


def _filed(ws: Workspace, state: str, doc: dict[str, Any]) -> None:
    """``doc`` written into ``state``/ as another consumer files it."""
    (ws.root / "handoffs" / state / f"{doc['handoff_id']}.json").write_text(json.dumps(doc))


def _notes(ws: Workspace) -> dict[str, str]:
    rows = json.loads(ws.handoff("ls", "--json", check=True).stdout)
    return {row["id"]: row["note"] for row in rows}


def _shown(ws: Workspace, handoff_id: str) -> str:
    return str(json.loads(ws.handoff("show", handoff_id, "--json", check=True).stdout)["note"])


def test_a_pending_answer_status_without_its_fields_is_noted(tmp_path: Path) -> None:
    """Its note says what its claim files it for, and `handoffd run` then files it so."""
    ws = new_workspace(tmp_path / "ws", CONFIG)
    ws.drop("bare-done.json", _native("bare-done", status="completed"))
    ws.drop("bare-failed.json", _native("bare-failed", status="failed"))
    ws.drop("whole.json", _native("whole", status="completed", completed_at="2026-11-28T12:01:00Z",
                                  execution_time_seconds=1.0))
    request = ws.create("--from", "@a", "--to", "@b")
    notes = _notes(ws)
    for hid, status, lacks in (("bare-done", "completed", "timestamp_completed or completed_at"),
                               ("bare-failed", "failed", "timestamp_failed, failed_at or error")):
        head = f"SCHEMA_VALIDATION_FAILED: {hid} has status {status!r}"
        assert notes[hid].startswith(head), notes
        assert lacks in notes[hid] and notes[hid].endswith("(status pending)"), notes
        assert _shown(ws, hid) == notes[hid]
    assert notes["whole"].startswith("NOT_A_REQUEST: "), notes  # (unchanged)
    assert notes[request] == "", notes
    ws.handoffd("run")
    filed = _notes(ws)
    for hid in ("bare-done", "bare-failed"):  # what the note said its claim would do
        assert ws.state_of(hid) == ["failed"]
        assert filed[hid].startswith("SCHEMA_VALIDATION_FAILED: "), filed
    assert ws.state_of(request) == ["completed"] and filed[request] == ""


def test_a_wait_keeps_its_note_before_the_answer_check(tmp_path: Path) -> None:
    """What holds a pending document is said first, as its claim comes only after it (RF): a
    target nobody here serves, a dependency still pending. Filed so by another consumer into
    completed/, such a document keeps its foreign filing's note alone (a workspace schema may
    take it: ``handoff validate`` is what judges a filed document)."""
    ws = new_workspace(tmp_path / "ws", CONFIG)
    ws.drop("nobody-bare.json", _native("nobody-bare", status="failed", target={"agent_id": "@nobody"}))
    ws.drop("blocker.json", _native("blocker", target={"agent_id": "@nobody"}, status="pending"))
    ws.drop("waits-bare.json", _native("waits-bare", status="completed", depends_on=["blocker"]))
    _filed(ws, "completed", _native("c-bare", status="completed"))
    notes = _notes(ws)
    assert notes["nobody-bare"] == "waiting: no specialist registered for @nobody", notes
    assert "blocker" in notes["waits-bare"], notes
    assert "SCHEMA_VALIDATION_FAILED" not in notes["waits-bare"], notes
    assert "SCHEMA_VALIDATION_FAILED" not in notes["c-bare"], notes
