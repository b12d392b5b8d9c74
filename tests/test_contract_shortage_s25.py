"""A descriptor shortage inside a contract check costs no attempt, and runs nothing twice.

R43: the checks that catch their own OSError (starting a criterion's command, opening a folder of
the tree, starting git) turned an EMFILE into the work's fault: VALIDATION_FAILED or a fatal
``scope_creep`` (CONTRACT_VIOLATION), not retryable, and a false entry in the learning log. Now
only the step that ran short is done again after a wait: the criterion's command is started
again (the criteria run before it are not), the comparison with the snapshot is made again.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from test_shortage_schemas_s23 import _engine, _events, emfile
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon
from handoffd.core import results as results_module
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.features.contracts import criteria as criteria_mod
from handoffd.features.contracts import walk

PY = sys.executable


@pytest.fixture(autouse=True)
def quick_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits between two tries, shortened (no test waits out a second)."""
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.01, raising=False)


def _armed_after_handler(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when the contract's review starts (after the handler ran): the before
    snapshot and the handler's own start are left alone."""
    [enforcer] = [getattr(h, "__self__") for h in engine.after_run
                  if getattr(h, "__name__", "") == "after"]
    armed = threading.Event()
    real = enforcer.reviewer.review

    def review(*args: Any, **kwargs: Any) -> Any:
        armed.set()
        return real(*args, **kwargs)
    monkeypatch.setattr(enforcer.reviewer, "review", review)
    return armed


def _the_directory(armed: threading.Event, root: Path) -> Callable[..., bool]:
    """When an ``os.open`` is the walk's opening of the contract directory ``root``, once
    ``armed``."""
    root = root.resolve()
    return lambda path, *a, **k: armed.is_set() and isinstance(path, (str, Path)) \
        and Path(path) == root


def _learning_log(engine: Engine) -> str:
    """The violations log's text ("" before its first entry)."""
    path = engine.ws.root / "handoffs" / ".meta" / "violations.jsonl"
    return path.read_text() if path.exists() else ""


def _run_last_attempt(engine: Engine, contract: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Submit a handoff with ``contract`` and no retry left, run it; its id and document."""
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    doc["contract"] = contract
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    state, stored = engine.get(hid)
    names = [e["event"] for e in _events(engine, hid)]
    assert state is State.COMPLETED, (state, names, book(stored).get("last_error"),
                                      stored.get("validation"))
    assert names == ["created", "claimed", "completed"], names
    assert book(stored)["attempt"] == 1
    assert report.completed == 1 and report.failed == 0 and report.errors == 0, report
    assert hid not in _learning_log(engine)  # no false entry in the learning log
    return hid, stored


def test_a_criterion_that_cannot_start_for_descriptors_is_started_again_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE starting the second criterion's command: only that command is started again
    (the first criterion ran once); the handoff completes on its last attempt."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    (tmp_path / "ws" / "src").mkdir()
    count = tmp_path / "ws" / "src" / "count"
    first = f"Command succeeds: {PY} -c \"open('src/count','a').write('x')\""
    second = f"Tests pass: {PY} -c \"'second'\""
    armed = _armed_after_handler(engine, monkeypatch)
    popen = FailFirst(subprocess.Popen, 1, emfile,
                      when=lambda argv, *a, **k: armed.is_set() and "'second'" in argv)
    monkeypatch.setattr(subprocess, "Popen", popen)
    _, stored = _run_last_attempt(engine, {"files_owned": ["src/**"],
                                           "success_criteria": [first, second]})
    assert popen.raised == 1
    assert count.read_text() == "x"  # the first criterion ran once
    assert [c["status"] for c in stored["validation"]["criteria"]] == ["passed", "passed"]


def test_a_criterion_short_past_every_wait_still_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shortage outlasting the waits: the criterion fails, as before (said in the docs)."""
    popen = FailFirst(subprocess.Popen, 100, emfile)
    monkeypatch.setattr(subprocess, "Popen", popen)
    got = criteria_mod.run([PY, "-c", "pass"], cwd=tmp_path, timeout=5, env=dict(os.environ),
                           cancelled=threading.Event())
    assert popen.raised == results_module.RECHECKS + 1
    assert got["status"] == "failed" and "Too many open files" in got["output_tail"], got


def test_a_stopped_attempt_does_not_wait_for_descriptors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt stopped (its cancelled event set): no wait, the criterion fails at once."""
    popen = FailFirst(subprocess.Popen, 100, emfile)
    monkeypatch.setattr(subprocess, "Popen", popen)
    cancelled = threading.Event()
    cancelled.set()
    got = criteria_mod.run([PY, "-c", "pass"], cwd=tmp_path, timeout=5, env=dict(os.environ),
                           cancelled=cancelled)
    assert popen.raised == 1 and got["status"] == "failed", got


def test_a_folder_that_cannot_be_opened_for_descriptors_is_compared_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE opening the contract directory to compare it with its snapshot: compared again
    after a wait, not a fatal scope_creep (CONTRACT_VIOLATION) and a false log entry."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    (tmp_path / "ws" / "src").mkdir()
    armed = _armed_after_handler(engine, monkeypatch)
    opener = FailFirst(os.open, 1, emfile, when=_the_directory(armed, tmp_path / "ws"))
    monkeypatch.setattr(walk.os, "open", opener)
    _, stored = _run_last_attempt(engine, {"files_owned": ["src/**"], "scope_check": "hash"})
    assert opener.raised == 1
    assert stored["validation"]["scope"]["checked"] and not stored["validation"]["violations"]


def test_a_folder_deep_in_the_tree_that_cannot_be_opened_is_compared_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE opening a subfolder (``_open_child``): compared again, not an opaque entry of
    its own (outside files_owned: a "created" scope_creep)."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    (tmp_path / "ws" / "src").mkdir()
    (tmp_path / "ws" / "lib" / "deep").mkdir(parents=True)
    armed = _armed_after_handler(engine, monkeypatch)
    opener = FailFirst(os.open, 1, emfile,
                       when=lambda path, *a, **k: armed.is_set() and path == "deep")
    monkeypatch.setattr(walk.os, "open", opener)
    _, stored = _run_last_attempt(engine, {"files_owned": ["src/**"], "scope_check": "hash"})
    assert opener.raised == 1
    assert not stored["validation"]["violations"], stored["validation"]


def test_git_that_cannot_start_for_descriptors_is_asked_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE starting git after the handler ran: the comparison is made again, not a fatal
    "the scope cannot be verified"."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    proj = tmp_path / "ws" / "proj"
    (proj / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(proj)], check=True, timeout=30)
    armed = _armed_after_handler(engine, monkeypatch)
    popen = FailFirst(subprocess.Popen, 1, emfile,
                      when=lambda argv, *a, **k: armed.is_set() and argv[0] == "git")
    monkeypatch.setattr(subprocess, "Popen", popen)
    _, stored = _run_last_attempt(engine, {"cwd": "proj", "files_owned": ["src/**"],
                                           "scope_check": "git"})
    assert popen.raised == 1
    assert stored["validation"]["scope"]["mode"] == "git", stored["validation"]
    assert not stored["validation"]["violations"], stored["validation"]


def test_the_comparison_short_past_every_wait_is_unverifiable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shortage outlasting the waits: the scope is unverifiable (fails closed), as before."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    (tmp_path / "ws" / "src").mkdir()
    armed = _armed_after_handler(engine, monkeypatch)
    opener = FailFirst(os.open, 1000, emfile, when=_the_directory(armed, tmp_path / "ws"))
    monkeypatch.setattr(walk.os, "open", opener)
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    doc["contract"] = {"files_owned": ["src/**"], "scope_check": "hash"}
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    state, stored = engine.get(hid)
    assert opener.raised == results_module.RECHECKS + 1
    assert state is State.FAILED
    error = book(stored)["final_error"]
    assert error["code"] == "CONTRACT_VIOLATION" and "Too many open files" in error["message"], error
    assert hid in _learning_log(engine)  # (the log path is the one _learning_log reads)


def test_a_folder_that_cannot_be_opened_before_the_handler_hands_it_back_uncounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R44: EMFILE opening a subfolder while the snapshot is taken, before the handler, made
    the snapshot incomplete: CONTRACT_VIOLATION, not retryable, the handler never run, even
    with retries left. It is a start shortage: handed back uncounted, then run."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    (tmp_path / "ws" / "src").mkdir()
    (tmp_path / "ws" / "lib" / "deep").mkdir(parents=True)
    opener = FailFirst(os.open, 1, emfile, when=lambda path, *a, **k: path == "deep")
    monkeypatch.setattr(walk.os, "open", opener)
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    doc["contract"] = {"files_owned": ["src/**"], "scope_check": "hash"}
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert opener.raised == 1
    state, stored = engine.get(hid)
    events = _events(engine, hid)
    assert state is State.COMPLETED, (state, [e["event"] for e in events], stored.get("error"))
    assert [e["event"] for e in events] == ["created", "claimed", "handed_back", "claimed",
                                            "completed"], events
    assert events[2]["detail"]["not_started"] == "EMFILE", events[2]
    assert book(stored)["attempt"] == 1 and report.failed == 0, report
    assert hid not in _learning_log(engine)
