"""Review R29's findings on this session's operator fixes (session 22).

1. A PostgreSQL outage beginning within the quiet window after the last one's "back" line was
   never said, however long it lasted (``connection.Outages``).
2. A lease renewal failing after its round stopped waiting for it made the log flap "cannot
   renew" / "works again" at every round (``core.recurring``: what was met between rounds was
   forgotten).
3. "looking for abandoned claims" never cleared: a failure hours later read as "still".
4. ``handoffd run --processes 2`` ended "handed back N" for handoffs a sibling process ran once
   their start-shortage back-off ended (``spread._forget_settled``).
5. A notify journal left to a live writer's mark was left silently (a forged mark of a live
   process would hold it for ever without a word).
"""
from __future__ import annotations

import contextvars
import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock
from test_operator2_s22 import _entry
from test_operator_s22 import _clocked_engine

from handoffd.backends.postgres import connection
from handoffd.core import recurring
from handoffd.core.native_format import new_native_request
from handoffd.features.notify.leftovers import take_over
from handoffd.features.notify.outbox import Outbox
from handoffd.service import spread
from handoffd.service.report import BatchReport
from handoffd.service.sweeper import sweep


class Who:
    """Stands for one of a process's connections to the store."""


def test_an_outage_right_after_the_last_one_ended_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(connection.time, "monotonic", lambda: now[0])
    outages, url = connection.Outages(), "postgresql://db"
    presence, pool, listener = Who(), Who(), Who()
    assert outages.lost(url, presence)  # a restart: the first to notice says it
    assert not outages.lost(url, listener)
    now[0] += 4
    assert outages.back(url, presence) and not outages.back(url, listener)
    now[0] += 1
    assert not outages.lost(url, pool)  # the same outage, noticed late by an idle pool
    assert not outages.back(url, pool)
    now[0] += 2  # the server stops again, 3 s after it came back
    assert outages.lost(url, presence), "a connection back from the last outage lost it again"
    assert not outages.lost(url, listener)
    now[0] += 50
    assert outages.back(url, listener) and not outages.back(url, presence)


def test_a_failure_between_rounds_is_not_taken_for_the_problem_gone(
        caplog: pytest.LogCaptureFixture) -> None:
    book, clock = recurring.Recurring(), [0.0]
    caplog.set_level(logging.INFO, logger="handoffd")
    failure = OSError(errno.EIO, "I/O error")
    for _ in range(8):  # rounds of renewals: h0's fails after its round stopped waiting
        with recurring.sweeping(book, lambda: clock[0]):
            recurring.ok("renewing a lease")  # (the other jobs' renewals)
            straggler = contextvars.copy_context()  # (h0's, submitted to the pool)
        straggler.run(recurring.error, "renewing a lease", failure, "cannot renew %s", "h0")
        clock[0] += 0.5
    said = [r.getMessage() for r in caplog.records]
    assert not [line for line in said if "works again" in line], said
    assert len([line for line in said if line.startswith("cannot renew h0 (")]) == 1, said
    for _ in range(2):  # the round the last failure landed in, then one where all works
        with recurring.sweeping(book, lambda: clock[0]):
            recurring.ok("renewing a lease")
    assert [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]


def test_looking_for_abandoned_claims_says_when_it_works_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    engine = _clocked_engine(tmp_path, clock)
    store = engine.backend.inner  # (under the event log's wrapper)
    real = store.expired_claims
    failing = [True]

    def expired(*args: Any, **kwargs: Any) -> Any:
        if failing[0]:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "expired_claims", expired)
    caplog.set_level(logging.INFO, logger="handoffd")
    sweep(engine)
    failing[0] = False
    clock.advance(5)
    sweep(engine)
    assert [r for r in caplog.records if "looking for abandoned claims works again"
            in r.getMessage()], [r.getMessage() for r in caplog.records]
    caplog.clear()
    clock.advance(3600)  # a new failure an hour later is new, not "still"
    failing[0] = True
    sweep(engine)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(said) == 1 and "still" not in said[0], said


def test_a_batch_of_processes_counts_no_hand_back_a_sibling_ran(tmp_path: Path) -> None:
    clock = Clock()
    engine = _clocked_engine(tmp_path, clock)
    ran, left = (engine.submit(new_native_request(source="@s", target="@t", data={},
                                                  now=clock())) for _ in range(2))
    assert engine.take(ran) is not None  # a process took `ran` again once its back-off ended
    report = BatchReport(handed_back=1, backed_off=[ran])  # this process handed `ran` back
    # a sibling's report: it handed both back (and one more for another reason)
    spread._merge(report, spread._as_json(BatchReport(handed_back=3, backed_off=[ran, left])))
    spread._merge(report, {"handed_back": 1})  # a child's report from before the list: kept
    spread._forget_settled(engine, report)
    assert report.handed_back == 3 and report.backed_off == [left]


def test_a_journal_left_to_its_live_writer_is_said_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "notify"
    owner = Outbox(folder, durable=False)
    assert owner.record([_entry(1)]) is not None
    os.close(owner.fd)  # a handler closed it: the lock is free, its writer (we) lives
    caplog.set_level(logging.INFO, logger="handoffd")
    for _ in range(3):
        assert take_over(Outbox(folder, durable=False), lambda entries, name: True) == 0
    said = [r.getMessage() for r in caplog.records if "still runs" in r.getMessage()]
    assert len(said) == 1 and str(owner.name) in said[0] and str(os.getpid()) in said[0], said
