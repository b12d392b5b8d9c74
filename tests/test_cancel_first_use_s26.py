"""A document from outside cancelled while pending takes its id, as an admission would
(review R46, session 26).

``handoff cancel`` of a pending document claims it only to file it cancelled, and drops the
claim's ``claimed`` event (it never ran). For a document from outside that event was all its
history said of where it came from: its id was never searched for nor recorded in the seen-ids
record, so after ``handoff retry --force`` and a run, a second document reusing the id (the
first's result collected) ran again. Now the cancel records the id; and a cancel that fails
hands the claim back with the search still to do (the mark a shortage's hand-back leaves), so a
duplicate is never run unchecked.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import new_workspace
from test_seen_recovery_s26 import _batch
from test_seen_shortage_s24 import _quarantined, _runs_command, foreign

from handoffd.core.documents import CHECK, UNRECORDED, first_use_left, history_of
from handoffd.core.states import State
from handoffd.features import cancel_family


def _workspace(tmp_path: Path, runs: Path) -> Any:
    return new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.1

[specialists."@cmd"]
command = {json.dumps(_runs_command(runs))}
""")


def test_a_cancelled_foreign_document_retried_keeps_its_id_taken(tmp_path: Path) -> None:
    runs = tmp_path / "runs.txt"
    ws = _workspace(tmp_path, runs)
    try:
        ws.drop("c-1.json", foreign("c-1"))
        ws.handoff("cancel", "c-1", check=True)
        assert ws.state_of("c-1") == ["failed"]
        ws.handoff("retry", "--force", "c-1", check=True)
        said = _batch(ws.root).stderr
        assert ws.state_of("c-1") == ["completed"], said
        assert runs.read_text() == "ran\n"  # the retry, chosen, runs
        # the consumer collects the result; a producer drops a second document with the id
        (ws.root / "handoffs" / "completed" / "c-1.json").unlink()
        ws.drop("c-1.json", foreign("c-1", input={"data": {"second": True}}))
        said += _batch(ws.root).stderr
        assert runs.read_text() == "ran\n", said  # never run again
        assert [r["code"] for r in _quarantined(ws.root)] == ["DUPLICATE_HANDOFF_ID"], said
        assert "Traceback" not in said
    finally:
        ws.cleanup()


def test_a_failed_cancel_of_a_foreign_document_leaves_its_id_to_search(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs.txt"
    ws = _workspace(tmp_path, runs)
    try:
        ws.drop("c-2.json", foreign("c-2"))
        from handoffd.cli.basics import engine as open_engine  # (in process: its filing fails)

        def failing_file(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        engine = open_engine(ws.root)
        monkeypatch.setattr(engine, "file", failing_file)
        with pytest.raises(Exception):
            cancel_family.cancel(engine, "c-2", reason="test")
        state, doc = engine.get("c-2")
        assert state is State.PENDING
        events = history_of(doc)
        assert events[-1]["event"] == "handed_back", events
        assert events[-1]["detail"][UNRECORDED] == CHECK, events
        assert first_use_left(events) == CHECK
    finally:
        ws.cleanup()
