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


def test_retry_all_failed_skips_what_it_cannot_retry_and_counts_what_went(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R23 #3: `retry --all-failed` racing a purge exited 3 with a "no handoff" error for each
    failure the purge removed after its listing; a child already aggregated made it exit 1."""
    ws: Workspace = handlers_workspace(tmp_path, monkeypatch, "cg17", HANDLERS, CONFIG)
    try:
        ws.create("--to", "@boss", "--id", "part", "--data",
                  json.dumps({"aggregation": "all_success", "n": 2, "fail": [1]}))
        for n in range(3):
            ws.create("--to", "@leaf", "--id", f"f{n}", "--data",
                      json.dumps({"n": n, "fail": True}))
        ws.handoffd("run", timeout=120)
        # f0 goes between the listing and its retry, as a purge racing it removes it
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(
            "from handoffd.service import sweeper\n"
            "real = sweeper.requeue_failed\n"
            "def requeue(engine, handoff_id, **kw):\n"
            "    if handoff_id == 'f0':\n"
            "        import os; os.unlink(engine.ws.doc_path(sweeper.State.FAILED, 'f0'))\n"
            "    return real(engine, handoff_id, **kw)\n"
            "sweeper.requeue_failed = requeue\n")
        monkeypatch.setenv("PYTHONPATH", f"{hook}:{tmp_path / 'handlers'}")
        proc = ws.handoff("retry", "--all-failed")
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.split()) == ["f1", "f2"], proc.stdout
        assert "skipped: handoff part.c2 is a child of part" in proc.stderr, proc.stderr
        assert "1 failed handoff(s) listed were gone before their retry" in proc.stderr
        assert "no handoff" not in proc.stderr and "Traceback" not in proc.stderr
    finally:
        ws.cleanup()
