"""A passing shortage planning or storing a delegation's children costs no attempt (session 28).

There is no job to wait on when a delegation is filed: a MemoryError or an EMFILE planning its
children, or storing one of them, failed the parent's attempt (counted, PROCESSING_ERROR) and
cancelled the children already stored. Now the parent is handed back uncounted with one WARNING
line, its handler runs again after a back-off, and the children stored before the shortage are
adopted by that next attempt (same round, same ids): none is made, or run, twice.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import pytest
from conftest import Clock
from test_orchestration_hostile import RUNS, attempt, batch, mem, submit  # noqa: F401
from test_shortage_schemas_s23 import emfile
from test_start_shortage_s20 import FailFirst

from handoffd import Engine, State
from handoffd.core.documents import book, next_attempt_at
from handoffd.features import orchestration
from handoffd.features.children import CHILDREN_SHORT


def _handed_back_uncounted(engine: Engine, hid: str) -> dict[str, Any]:
    """``hid`` is back in pending/, its attempt not charged, its last event the hand-back."""
    state, doc = engine.get(hid)
    history = book(doc)["history"]
    assert state is State.PENDING, (state, history)
    assert book(doc).get("retries", 0) == 0 and "last_error" not in book(doc), book(doc)
    assert history[-1]["event"] == "handed_back", history
    assert history[-1]["detail"][CHILDREN_SHORT] in ("EMFILE", "MemoryError"), history[-1]
    assert "retry_scheduled" not in [e["event"] for e in history]
    return doc


def _shortage_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "children could not be" in r.getMessage()]


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_planning_the_children_hands_the_parent_back_uncounted(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, error: Any) -> None:
    engine, clock = mem
    plan = FailFirst(orchestration._plan_children, 1, error)
    monkeypatch.setattr(orchestration, "_plan_children", plan)
    submit(engine, "p", "@boss")
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        assert attempt(engine, "p") is State.PENDING
    assert plan.raised == 1
    _handed_back_uncounted(engine, "p")
    [line] = _shortage_lines(caplog)
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert "handed back uncounted" in line.getMessage()
    due = next_attempt_at(engine.get("p")[1])  # due again after its back-off
    assert due is not None and (due - clock()).total_seconds() == \
        orchestration.CHILDREN_SHORT_FIRST_SECONDS
    clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    for _ in range(3):  # delegate again, run the children, aggregate
        batch(engine)
    state, doc = engine.get("p")
    assert state is State.COMPLETED, book(doc)["history"]
    assert sorted(RUNS) == ["p.c1", "p.c2"]


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_storing_a_child_keeps_those_stored_and_adopts_them_next_time(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, error: Any) -> None:
    """The second child cannot be stored: the first is kept (not cancelled), the parent is
    handed back uncounted, and its next attempt adopts the first and makes the second."""
    engine, clock = mem
    store = getattr(engine.backend, "inner", engine.backend)  # under the event recorder
    made: list[str] = []
    real_create = store.create

    def create(doc: dict[str, Any], handoff_id: str, now: datetime, **kw: Any) -> Any:
        made.append(handoff_id)
        return real_create(doc, handoff_id, now, **kw)

    short = FailFirst(create, 1, error, when=lambda doc, hid, *a, **k: hid == "p.c2")
    monkeypatch.setattr(store, "create", short)
    submit(engine, "p", "@boss")
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        assert attempt(engine, "p") is State.PENDING
    assert short.raised == 1 and made == ["p", "p.c1"]
    _handed_back_uncounted(engine, "p")
    assert len(_shortage_lines(caplog)) == 1
    assert engine.get("p.c1")[0] is State.PENDING  # kept: not cancelled
    clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    assert attempt(engine, "p") is State.PENDING  # the handler delegates again: parked
    assert made == ["p", "p.c1", "p.c2"]  # p.c1 adopted, not made again
    assert book(engine.get("p")[1])["waiting_children"]["children"] == ["p.c1", "p.c2"]
    for _ in range(2):  # run the children, aggregate
        batch(engine)
    state, doc = engine.get("p")
    assert state is State.COMPLETED, book(doc)["history"]
    assert sorted(RUNS) == ["p.c1", "p.c2"]  # each child ran once
    assert book(doc).get("retries", 0) == 0


def test_a_shortage_that_outlasts_the_free_hand_backs_counts_the_attempt(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded as start shortages are: after FREE_CHILDREN_SHORTAGES hand-backs in a row the
    next shortage fails the attempt, retryable, under the retry policy."""
    engine, clock = mem
    monkeypatch.setattr(orchestration, "FREE_CHILDREN_SHORTAGES", 2)
    plan = FailFirst(orchestration._plan_children, 3, emfile)
    monkeypatch.setattr(orchestration, "_plan_children", plan)
    submit(engine, "p", "@boss")
    for _ in range(2):
        assert attempt(engine, "p") is State.PENDING
        _handed_back_uncounted(engine, "p")
        clock.advance(orchestration.CHILDREN_SHORT_MAX_SECONDS)
    assert attempt(engine, "p") is State.PENDING
    error = book(engine.get("p")[1])["last_error"]
    assert error["code"] == "PROCESSING_ERROR" and "EMFILE" in error["message"], error
    assert book(engine.get("p")[1])["retries"] == 1
