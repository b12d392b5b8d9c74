"""One reconnect window per PostgreSQL outage, not one per operation (session 29, helper D).

``Database.run`` gave each operation a window of ``reconnect_seconds`` of its own from its start:
during an outage, N store operations in a row (a batch without ``--max-seconds``, a ``handoff``
command, a sweep) waited about N windows. The window is now the outage's, shared by the pool's
operations: once it is over, an operation makes one real connection attempt and fails at once
if the store is still away, or connects (the pool given the connect timeout to reconnect) if it
is back.

This module stops and starts a throw-away cluster of its own (tests/pgserver.py)."""
from __future__ import annotations

import logging
from typing import Any, Callable

import pgserver
import pytest
from test_postgres_outage_s20 import down, own_server, up  # noqa: F401

from handoffd.backends.postgres import connection
from handoffd.core.errors import StoreUnavailable

WINDOW = 1.0  # reconnect_seconds: short, the first operation of the outage waits it out


def select_one(conn: Any, retried: bool) -> int:
    """A store operation: one round trip."""
    return int(conn.execute("SELECT 1").fetchone()[0])


def counted(calls: list[Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, each call's first argument noted in ``calls``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)
    return call


def test_one_outage_is_waited_for_once_and_a_store_back_after_it_is_used_again(
        own_server: pgserver.PgServer, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="handoffd")
    db = connection.Database(own_server.new_database(), max_size=2, reconnect_seconds=WINDOW,
                             connect_timeout=5.0)
    probes: list[Any] = []  # the direct connection attempts of operations past the window
    monkeypatch.setattr(connection, "_last_error", counted(probes, connection._last_error))
    waits: list[Any] = []  # the seconds offered to the outage: backoff steps, pool checkouts
    monkeypatch.setattr(db, "_pause", counted(waits, db._pause))
    monkeypatch.setattr(db, "_checkout", counted(waits, db._checkout))
    try:
        assert db.run(select_one) == 1
        down(own_server)
        try:
            waited = []
            for _ in range(3):
                before = len(waits)
                with pytest.raises(StoreUnavailable, match="unreachable"):
                    db.run(select_one)
                waited.append(sum(waits[before:]))
        finally:
            up(own_server)
        # the first waited out the outage's window; the two after it met an outage past its
        # window: one connection attempt each, failed, and no wait (each waited a whole window
        # of its own, in backoff steps and pool checkouts, one after the other: three windows)
        assert waited[0] > 0 and waited[1:] == [0, 0], waited
        assert len(probes) == 2
        # the server is back, after the window (the pool still reconnecting): the next
        # operation gets its real chance and succeeds, and the outage ends
        assert db.run(select_one) == 1
        assert db.run(select_one) == 1
        assert len(probes) == 3  # (only the first after the window looked)
    finally:
        db.close()
    said = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("lost the database connection") \
        and said[1].startswith("reconnected to the database after"), said


def test_past_the_window_an_interrupted_operation_makes_no_attempt_of_its_own(
        own_server: pgserver.PgServer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    db = connection.Database(own_server.new_database(), max_size=2, reconnect_seconds=0.0)
    probes: list[Any] = []
    monkeypatch.setattr(connection, "_last_error", counted(probes, connection._last_error))
    try:
        assert db.run(select_one) == 1
        down(own_server)
        try:
            with pytest.raises(StoreUnavailable):
                db.run(select_one)  # (a window of 0: the outage's is over at once)
            db.interrupt()  # a stopping daemon: no attempt past its grace, none of the probe's
            with pytest.raises(StoreUnavailable):
                db.run(select_one)
            assert probes == []
        finally:
            up(own_server)
        db.resume()
        assert db.run(select_one) == 1  # (its probe: the store is back)
        assert len(probes) == 1
    finally:
        db.close()
