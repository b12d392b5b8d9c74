"""Three defects of the session's shortage work, found at review: a result checked again after a
shortage files each advisory warning once; each batch reports its own recurring problems, by a
rule no looser than the sweep's; a command whose stdin feed ran out of memory after it started is
not said "not started"."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock
from test_shortage_books_s25 import _NoMemory
from test_shortage_keep_s23 import _emfile, _said
from test_shortage_schemas_s23 import _engine, _events
from test_start_shortage_s20 import FailFirst, _context
from test_start_shortage_s20 import _engine as start_engine
from test_start_shortage_s20 import _submit as start_submit

from handoffd import Daemon
from handoffd.core import childproc, recurring, runner, starts
from handoffd.core.config import RetryPolicy, specialist_from_table
from handoffd.core.errors import HandlerError
from handoffd.core import results as results_module
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import Specialist
from handoffd.core.states import State
from handoffd.service import handbacks


# a command that reads its whole document before it answers
READER = [sys.executable, "-S", "-c",
          "import json, sys; json.load(sys.stdin); "
          "print(json.dumps({'status': 'completed', 'output': {'read': True}}))"]


@pytest.fixture(autouse=True)
def quick_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits between two checks of a result, shortened (no test waits out a second)."""
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.01, raising=False)


def test_a_result_checked_again_after_a_shortage_files_its_advisory_warning_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ws"
    engine = _engine(root)
    (root / "schemas" / "strict.json").write_text('{"type": "object", "required": ["x"]}')
    from dataclasses import replace
    engine.settings = replace(engine.settings, expectations="advisory")
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    doc["expected_output"] = {"schema": "strict.json"}  # not met by {}: a warning, advisory
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    # the output checked (its warning noted), then memory runs short building the outcome, twice
    build = FailFirst(results_module.reported_outcome, 2, MemoryError)
    monkeypatch.setattr(results_module, "reported_outcome", build)
    Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert build.raised == 2
    state, filed = engine.get(hid)
    assert state is State.COMPLETED, (state, _events(engine, hid))
    warnings = filed.get("warnings") or filed["handoffd"].get("warnings", [])
    unmet = [w for w in warnings if "strict.json" in str(w)]
    assert len(unmet) == 1, warnings


# ---------------------------------------------------------------- 2. each batch its own problems


def test_a_second_batch_of_one_daemon_does_not_repeat_the_first_ones_problems(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = start_engine(tmp_path / "ws", READER, Clock())
    for _ in range(2):
        start_submit(engine)
    daemon = Daemon(engine, workers=1, watch=False)
    with monkeypatch.context() as patch:
        patch.setattr(subprocess, "Popen", FailFirst(subprocess.Popen, 99, _emfile))
        caplog.set_level(logging.INFO, "handoffd")
        assert daemon.run_batch(max_seconds=30).handed_back == 2
    assert len(_said(caplog, "at the end of the batch")) == 1
    caplog.clear()
    daemon.run_batch(max_seconds=30)  # (its clock stands still: nothing is due, nothing met)
    assert not _said(caplog, "at the end of the batch"), [r.getMessage() for r in caplog.records]


def test_a_key_still_failing_for_one_claim_is_held_at_a_batch_end(caplog: Any) -> None:
    caplog.set_level(logging.INFO, "handoffd")
    book = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
    since = recurring.mark()
    with recurring.sweeping(book, lambda: 1.0):  # one claim still fails, another works
        recurring.error(recurring.RECOVERY, _emfile(), "cannot recover: %s", _emfile())
        recurring.ok(recurring.RECOVERY)
    assert book.active  # (the sweep's own rule holds it)
    caplog.clear()
    recurring.batch_end(since)
    assert not _said(caplog, "works again"), [r.getMessage() for r in caplog.records]
    assert len(_said(caplog, "still short at the end of the batch")) == 1
    assert book.active


def test_a_problem_a_later_sweep_did_not_meet_works_again_at_a_batch_end(caplog: Any) -> None:
    caplog.set_level(logging.INFO, "handoffd")
    book = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
    since = recurring.mark()
    with recurring.sweeping(book, lambda: 1.0):
        recurring.error(recurring.RECOVERY, _emfile(), "cannot recover: %s", _emfile())
        recurring.ok(recurring.RECOVERY)
    with recurring.sweeping(book, lambda: 2.0):  # not quiet long: kept until the batch ends
        recurring.ok(recurring.RECOVERY)
    assert book.active
    caplog.clear()
    recurring.batch_end(since)
    assert len(_said(caplog, "works again")) == 1 and not book.active
    assert not _said(caplog, "at the end of the batch")


# ---------------------------------------------------------------- 3. stopped after its start


ANSWER_AT_ONCE = [sys.executable, "-S", "-c",  # answers without reading its stdin
                  "import json; print(json.dumps({'status': 'completed', 'output': {'ok': 1}}))"]
FAIL_AT_ONCE = [sys.executable, "-S", "-c", "import sys; sys.exit(3)"]


def _spec(command: list[str]) -> Specialist:
    return Specialist(specialist_from_table("@cmd", {"command": command}, RetryPolicy()))


def _feed_short_after_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The feed runs out of memory (its view of the document) once the child has exited: the
    race of a child that answers in the same pass as the MemoryError, made certain."""
    real = runner.feed

    def feed(proc: Any, payload: bytes, stop: Any, fed: Any = None) -> None:
        stop.wait(60)  # (the child's exit: generous, a loaded machine is slow to start one)
        with monkeypatch.context() as patch:
            patch.setattr(childproc, "memoryview", _NoMemory(), raising=False)
            real(proc, payload, stop, fed)

    monkeypatch.setattr(runner, "feed", feed)


def test_a_whole_answer_given_as_the_feed_ran_short_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    _feed_short_after_exit(monkeypatch)
    result = runner.run_command(_spec(ANSWER_AT_ONCE), {"big": "x" * 100_000}, ctx, 60,
                                max_output_bytes=1 << 20)
    assert result["status"] == "completed" and result["output"] == {"ok": 1}
    assert starts.not_started(ctx) is None and not ctx.handback


def test_a_child_that_failed_as_the_feed_ran_short_is_handed_back_as_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    _feed_short_after_exit(monkeypatch)
    with pytest.raises(HandlerError):
        runner.run_command(_spec(FAIL_AT_ONCE), {"big": "x" * 100_000}, ctx, 60,
                           max_output_bytes=1 << 20)
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.after_start and ctx.handback
    assert "was stopped after it started" in shortage.message, shortage.message


def test_a_feed_short_of_memory_is_said_stopped_after_its_start_not_unstarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = start_engine(tmp_path / "ws", READER, Clock())
    hid = start_submit(engine)
    monkeypatch.setattr(childproc, "memoryview", _NoMemory(), raising=False)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert report.handed_back == 1 and report.failed == 0 and report.retrying == 0
    state, doc = engine.get(hid)
    assert state is State.PENDING and doc["handoffd"].get("attempt", 0) == 0  # uncounted
    events = _events(engine, hid)
    last = events[-1]
    assert last["event"] == "handed_back" and "not_started" not in last["detail"], last
    assert last["detail"]["stdin_short"] == "ENOMEM"
    assert "was stopped after it started" in last["detail"]["reason"]
    assert handbacks.shortages_in_a_row(doc) == 1  # (bounded as every start shortage is)
