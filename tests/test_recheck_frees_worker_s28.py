"""A result waiting to be checked again frees its worker (session 28).

A result whose check ran short (descriptors, memory) was checked again after 1, 2, 4, 8 and
16 s on its worker, which slept meanwhile: up to 31 s with the worker held, nothing else
running in its place. Now the daemon keeps the claim and the result, and checks it again on a
timer: the worker runs other handoffs meanwhile, the handler does not run again, and the result
is filed once it can be checked.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine

from handoffd import Daemon
from handoffd.core import results as results_module
from handoffd.core.documents import book
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State

RUNS: list[str] = []


def _answer(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    RUNS.append(ctx.handoff_id)
    return {"status": "completed", "output": {"ran": ctx.handoff_id}}


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    RUNS.clear()
    # waits long enough for another handoff to run on the one worker (1+2+4+8+16 quarters: ~8 s)
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.25)
    engine, _ = memory_engine(tmp_path, Clock(), {"@a": _answer, "@b": _answer})
    return engine


def _submit(engine: Any, hid: str, target: str) -> None:
    engine.submit(new_native_request(source="@test", target=target, data={}, now=engine.clock(),
                                     handoff_id=hid))


def test_the_worker_runs_another_handoff_while_a_result_waits_for_its_recheck(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker. Checking a's result runs short (EMFILE) until b has completed: b can only
    complete if a's wait leaves the worker free. a is then filed completed, its handler run
    once, its attempt counted once."""
    real = engine.checks.check_output
    short: list[str] = []

    def check_output(job: Any, result: Any) -> Any:
        if job.handoff_id == "a" and engine.get("b")[0] is not State.COMPLETED:
            short.append(job.handoff_id)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(job, result)

    monkeypatch.setattr(engine.checks, "check_output", check_output)
    _submit(engine, "a", "@a")
    _submit(engine, "b", "@b")
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=60)
    assert short, "a's check never ran short"
    for hid in ("a", "b"):
        state, doc = engine.get(hid)
        assert state is State.COMPLETED, (hid, state, book(doc).get("last_error"))
        assert book(doc)["attempt"] == 1
    assert sorted(RUNS) == ["a", "b"]  # each handler ran once
    assert RUNS[0] == "a"  # (a started first, and b ran while a waited)
    assert report.completed == 2 and report.failed == 0 and report.errors == 0, report


def test_a_result_still_short_after_every_recheck_fails_its_attempt_retryable(
        engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound stays: a check that runs short at every try fails the attempt, retryable,
    after the last recheck (the retry policy bounds it); nothing is lost or left claimed."""
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.01)

    def check_output(job: Any, result: Any) -> Any:
        raise MemoryError()

    monkeypatch.setattr(engine.checks, "check_output", check_output)
    _submit(engine, "a", "@a")
    Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    state, doc = engine.get("a")
    assert state is State.PENDING, state
    error = book(doc)["last_error"]
    assert error["code"] == "PROCESSING_ERROR" and "could not be checked" in error["message"]
    assert book(doc)["retries"] == 1 and RUNS == ["a"]
