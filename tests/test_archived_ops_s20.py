"""Retry and cancel of archived handoffs, and the loser of two retries (session 20, review R23).

* A child whose parent retention archived could be retried alone (the archived parent counted
  as gone): it ran again and nobody aggregated it. Now it is refused as for a filed parent.
* `handoff cancel` and `handoff retry` of an archived handoff said "no handoff ...; `handoff
  ls` lists them" (exit 3) where `show` and `wait` find it: now cancel says it is already
  finished, archived (exit 0, as for any finished one), and retry refuses it (exit 1).
* Of two `handoff retry` of one id at once, the loser sometimes said "moved while retrying"
  (exit 3, "not found"): now it says it is pending, not failed (exit 1)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine
from test_children_gate_reads_s17 import HANDLERS
from test_retry_child_s20 import CONFIG

from handoffd import State
from handoffd.core.errors import InvalidTransition
from handoffd.service.sweeper import requeue_failed


def test_archived_family_and_handoffs_are_refused_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws: Workspace = handlers_workspace(tmp_path, monkeypatch, "cg17", HANDLERS, CONFIG)
    try:
        ws.create("--to", "@boss", "--id", "part", "--data",
                  json.dumps({"aggregation": "all_success", "n": 2, "fail": [1]}))
        ws.create("--to", "@leaf", "--id", "lone", "--data", json.dumps({"n": 0, "fail": True}))
        ws.handoffd("run", timeout=120)
        assert ws.state_of("part") == ["completed"] and ws.state_of("part.c2") == ["failed"]
        done = ws.handoff("archive", "--older-than", "0s", "--state", "completed")
        assert done.returncode == 0, done.stderr
        assert ws.state_of("part") == []  # archived: only the archive holds it

        proc = ws.handoff("retry", "--force", "part.c2")
        assert proc.returncode == 1, proc
        assert "child of part, which is already completed" in proc.stderr, proc.stderr
        assert ws.state_of("part.c2") == ["failed"]

        proc = ws.handoff("cancel", "part")  # as for a finished one: nothing to do, exit 0
        assert proc.returncode == 0 and proc.stderr == "", proc
        assert proc.stdout.startswith("part: already completed (archived at"), proc

        assert ws.handoff("archive", "--older-than", "0s", "--state", "failed").returncode == 0
        proc = ws.handoff("retry", "--force", "lone")
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc
        assert "lone was archived (failed, archived at" in proc.stderr, proc.stderr
    finally:
        ws.cleanup()


def test_the_loser_of_two_retries_is_told_it_is_pending(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, backend = memory_engine(tmp_path, Clock(), {
        "@w": lambda doc, ctx: {"status": "failed", "error": {"code": "NOPE", "message": "x"}}})
    engine.submit({"handoff_id": "f1", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@w"}, "input": {"data": {}},
                   "retry_policy": {"max_retries": 0}})
    job = engine.take("f1")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.FAILED
    real_reopen = backend.reopen

    def reopen(handoff_id: str, doc: Any) -> bool:  # the other shell's retry lands first
        monkeypatch.setattr(backend, "reopen", real_reopen)
        requeue_failed(engine, handoff_id, force=True)
        return False

    monkeypatch.setattr(backend, "reopen", reopen)
    with pytest.raises(InvalidTransition, match="is pending, not failed"):
        requeue_failed(engine, "f1", force=True)
    assert backend.get("f1")[0] is State.PENDING
