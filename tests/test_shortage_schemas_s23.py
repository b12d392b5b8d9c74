"""A passing shortage (EMFILE, ENFILE, ENOMEM, MemoryError) loading a specialist's schemas, or
anywhere in admission, is "not now": the attempt (or the claim) is handed back uncounted, never
left claimed for recovery to charge as a crash, never a result failed for good.

Session 23 (review R32, items 1, 4 and 8): an EMFILE reading the specialist's input schema left
the claim in in-progress/ (`ERROR: ... will retry in 5s`), and the next process recovered it as
a crash (an attempt charged, the specialist marked suspect); one loading its output schema failed
a successful result for good (PROCESSING_ERROR, not retryable); one recording a foreign
document's id in the seen-ids record stranded its claim the same way as the first.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, new_workspace
from test_claim_shortage_s22 import COMMAND
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon, Registry, build_engine
from handoffd.core import validation
from handoffd.core.config import Config, DaemonSettings, RetryPolicy, specialist_from_table
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import Specialist
from handoffd.core.states import State
from handoffd.core.workspace import Workspace


def emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def _engine(root: Path, **table: Any) -> Engine:
    """A real-clock engine whose @cmd specialist (a command answering ``{}``) has ``table``'s
    keys too; schemas/in.json and schemas/out.json accept any object."""
    ws = Workspace(root)
    ws.ensure()
    (root / "schemas").mkdir(exist_ok=True)
    for name in ("in.json", "out.json"):
        (root / "schemas" / name).write_text('{"type": "object"}')
    config = Config(daemon=DaemonSettings(sweep_seconds=0.2, rescan_seconds=0.2),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=10))
    registry = Registry()
    registry.add(Specialist(specialist_from_table("@cmd", {"command": COMMAND, **table},
                                                  config.retry)))
    return build_engine(ws, config, registry)


def _submit(engine: Engine) -> str:
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    return engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())


def _events(engine: Engine, hid: str) -> list[dict[str, Any]]:
    return [e for e in book(engine.get(hid)[1])["history"] if isinstance(e, dict)]


def _handed_back_once_then_done(engine: Engine, hid: str, report: Any, reason: str) -> None:
    """Completed in the same batch, its one attempt counted once, after one uncounted
    hand-back naming ``reason``; no error."""
    state, stored = engine.get(hid)
    events = _events(engine, hid)
    assert state is State.COMPLETED, (state, events)
    assert report.errors == 0 and report.failed == 0, report
    names = [e["event"] for e in events]
    assert "retry_scheduled" not in names and "recovered" not in names, names
    backs = [e for e in events if e["event"] == "handed_back"]
    assert len(backs) == 1 and backs[0]["detail"].get("not_started") == reason, backs
    assert book(stored)["attempt"] == 1


@pytest.mark.parametrize("error, reason", [(emfile, "EMFILE"), (MemoryError, "ENOMEM")])
def test_a_shortage_loading_the_input_schema_hands_the_attempt_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Any, reason: str) -> None:
    engine = _engine(tmp_path / "ws", input_schema="in.json")
    hid = _submit(engine)
    read = FailFirst(validation.read_regular, 1, error,
                     when=lambda name, *a, **k: name == "in.json")
    monkeypatch.setattr(validation, "read_regular", read)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert read.raised == 1
    _handed_back_once_then_done(engine, hid, report, reason)
    said = [e["detail"]["reason"] for e in _events(engine, hid) if e["event"] == "handed_back"]
    assert "cannot start @cmd's handler for now" in said[0] and "loading its schemas" in said[0]


def test_a_shortage_loading_the_output_schema_costs_no_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded before the handler starts: a start shortage, the handler run once in all."""
    engine = _engine(tmp_path / "ws", output_schema="out.json")
    hid = _submit(engine)
    read = FailFirst(validation.read_regular, 1, emfile,
                     when=lambda name, *a, **k: name == "out.json")
    monkeypatch.setattr(validation, "read_regular", read)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert read.raised == 1
    _handed_back_once_then_done(engine, hid, report, "EMFILE")
    # the hand-back came before any start: one `claimed` per start, the handler ran once
    assert [e["event"] for e in _events(engine, hid)].count("claimed") == 2


def test_a_shortage_checking_the_output_after_the_run_is_a_retryable_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory checking the result (its schema loaded already) at every check, the
    rechecks after each wait included (session 25: a passing one is checked again, uncounted):
    the result is never failed for good, nor is the handler run again uncounted (review R33: a
    result that exhausts memory being checked re-ran a completed handler 33 times): the
    attempt fails retryable, and its retry policy counts and bounds the runs."""
    from handoffd.core import results
    monkeypatch.setattr(results, "RECHECK_SECONDS", 0.01)
    engine = _engine(tmp_path / "ws", output_schema="out.json")
    hid = _submit(engine)
    check = FailFirst(engine.checks.schemas.errors_with, 1 + results.RECHECKS,
                      MemoryError)
    monkeypatch.setattr(engine.checks.schemas, "errors_with", check)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert check.raised == 1 + results.RECHECKS
    state, stored = engine.get(hid)
    events = _events(engine, hid)
    names = [e["event"] for e in events]
    assert state is State.PENDING and "handed_back" not in names, (state, names)
    assert names.count("retry_scheduled") == 1 and book(stored)["attempt"] == 1, names
    error = book(stored)["last_error"]
    assert error["code"] == "PROCESSING_ERROR" and error["retryable"] is True, error
    assert "could not be checked for now: out of memory (MemoryError)" in error["message"]
    assert report.failed == 0, report


@pytest.mark.parametrize("step, error, reason", [
    ("add", emfile, "EMFILE"), ("contains", emfile, "EMFILE"), ("add", MemoryError, "MemoryError")])
def test_a_shortage_in_the_seen_ids_record_hands_the_claim_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, error: Any,
        reason: str) -> None:
    engine = _engine(tmp_path / "ws")
    raw = {"handoff_id": "raw-1", "source": {"agent_id": "@test"},
           "target": {"agent_id": "@cmd"}, "input": {"data": {}}}
    (engine.ws.handoffs / "pending" / "raw-1.json").write_text(json.dumps(raw))
    seen = engine.backend.store.seen
    fail = FailFirst(getattr(seen, step), 1, error)
    monkeypatch.setattr(seen, step, fail)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert fail.raised == 1
    state, stored = engine.get("raw-1")
    events = _events(engine, "raw-1")
    assert state is State.COMPLETED and report.errors == 0, (state, events, report)
    assert [e["event"] for e in events] == ["claimed", "handed_back", "claimed", "completed"]
    assert events[1]["detail"]["not_started"] == reason
    assert "cannot be admitted for now" in events[1]["detail"]["reason"]
    assert book(stored)["attempt"] == 1


# run in the batch's process: its first read of schemas/in.json fails with EMFILE
PATCH = """
import errno, os, sys
from handoffd.core import validation
real, left = validation.read_regular, [1]
def read_regular(name, *a, **k):
    if name == "in.json" and left:
        left.pop()
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    return real(name, *a, **k)
validation.read_regular = read_regular
from handoffd.cli.handoffd_cmd import main
sys.argv[0] = "handoffd"
sys.exit(main())
"""


def test_a_batch_hands_back_an_attempt_short_loading_its_input_schema(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.2
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@cmd"]
command = {json.dumps(COMMAND)}
input_schema = "in.json"
""")
    try:
        (ws.root / "schemas").mkdir(exist_ok=True)
        (ws.root / "schemas" / "in.json").write_text('{"type": "object"}')
        ws.drop("s-in.json", new_native_request(source="@test", target="@cmd", data={},
                                                handoff_id="s-in", now=Clock()()))
        done = subprocess.run([sys.executable, "-c", PATCH, "run", "--root", str(ws.root)],
                              capture_output=True, text=True, timeout=120)
    finally:
        ws.cleanup()
    said = done.stderr
    assert done.returncode == 0, said
    assert ws.state_of("s-in") == ["completed"], said
    block = ws.doc("s-in")["handoffd"]
    assert block["attempt"] == 1, said
    assert [e["event"] for e in block["history"]] == ["claimed", "handed_back", "claimed",
                                                      "completed"], said
    assert "ERROR" not in said and "Traceback" not in said, said
    assert "cannot start @cmd's handler for now" in said and "ulimit -n" in said, said


@pytest.mark.parametrize("others", [0, 4])
def test_a_memory_error_admitting_is_counted_handed_back_and_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, others: int) -> None:
    """A MemoryError validating the claimed document (a memory strike in the "admit" stage):
    admission handed it back itself and the worker was told nothing, so a batch ended at
    once, exit 0, no summary, the work still pending (review R33). Now the worker counts it
    handed back and backs off, and a batch waits a short back-off out and runs it, other work
    in the batch or not (review R34: each other task's end released it early, as a descriptor
    shortage's claim is, and the batch then ended without it)."""
    from handoffd.core import memorystrikes
    monkeypatch.setattr(memorystrikes, "MEMORY_BACKOFF_SECONDS", 1.5)  # (past a batch's
    # look ahead for work due soon: what only the worker's count makes it wait for)
    engine = _engine(tmp_path / "ws")
    hid = _submit(engine)
    rest = [_submit(engine) for _ in range(others)]
    validate = FailFirst(engine.validate, 1, MemoryError, when=lambda doc, *a, **k:
                         doc.get("handoff_id") == hid)
    monkeypatch.setattr(engine, "validate", validate)
    try:
        report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    finally:
        memorystrikes.memory_strikes._rows.clear()
    assert validate.raised == 1
    state, stored = engine.get(hid)
    names = [e["event"] for e in _events(engine, hid)]
    assert state is State.COMPLETED, (state, names)
    assert names == ["created", "claimed", "handed_back", "claimed", "completed"], names
    assert book(stored)["attempt"] == 1
    assert all(engine.get(other)[0] is State.COMPLETED for other in rest)
    assert report.completed == 1 + others and report.errors == 0, report
    assert report.handed_back == 0, report
