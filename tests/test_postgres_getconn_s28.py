"""PostgreSQL: a MemoryError inside ``pool.getconn`` never leaks a connection (session 28).

psycopg_pool takes a connection out of its idle deque, then logs and counts before it returns
it: a MemoryError there lost the connection, the pool counting it checked out for ever (after
``max_size`` such leaks every operation waited out the pool's timeout). The checkout now gives
back a connection taken by a ``getconn`` that failed, and the caller gets the MemoryError. So
does a checkout that waited and was handed a connection, then ran short counting its wait
(review R58: still leaked then).
"""
from __future__ import annotations

import time
from typing import Any

import pytest
from test_postgres_shortage_s24 import OPERATIONS, leaked, outcomes, select_one, small_db


def short_checkouts(db: Any) -> list[int]:
    """Every ``getconn`` of ``db``'s pool runs out of memory after taking its connection (as
    its "connection given" logging would); returns the calls made."""
    real = db.pool._getconn_with_check_loop
    calls: list[int] = []

    def taken_then_short(deadline: float) -> Any:
        real(deadline)  # the connection leaves the pool...
        calls.append(1)
        raise MemoryError()  # ...and never reaches its caller

    db.pool._getconn_with_check_loop = taken_then_short
    return calls


def test_a_checkout_running_short_after_taking_a_connection_gives_it_back(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db = small_db(pg_url)
    try:
        calls = short_checkouts(db)
        said = outcomes(db, select_one)  # (each one a MemoryError, more than the pool holds)
        assert said == ["MemoryError: "] * OPERATIONS
        assert len(calls) == OPERATIONS
        assert leaked(db) == 0
        del db.pool._getconn_with_check_loop  # memory is back: every operation works
        assert outcomes(db, select_one) == ["1"] * OPERATIONS
        assert leaked(db) == 0
    finally:
        db.close()


class _ShortStats(dict):  # type: ignore[type-arg]
    """psycopg_pool's statistics, whose first update of ``key`` runs out of memory:
    "requests_wait_ms" (as ``getconn``'s ``finally`` counts a wait, after the waiting client
    was handed its connection) or "requests_queued" (right after the checkout took its place
    in the pool's queue, before it waited there)."""

    def __init__(self, real: Any, key: str) -> None:
        super().__init__(real)
        self.key = key
        self.raised = 0

    def __missing__(self, key: str) -> int:
        return 0

    def __setitem__(self, key: str, value: int) -> None:
        if key == self.key and not self.raised:
            self.raised += 1
            raise MemoryError()
        super().__setitem__(key, value)


def test_a_waiting_checkout_running_short_after_it_was_handed_a_connection_gives_it_back(
        pg_url: str) -> None:
    """Every connection is out; a third checkout waits, is handed one as it is returned, and
    runs out of memory counting its wait: the connection it was handed is given back, never
    leaked (R58: `leaked: 1` before; after ``max_size`` such leaks every operation waited out
    the pool's timeout)."""
    import threading
    db = small_db(pg_url)
    try:
        held = [db.pool.getconn(timeout=5) for _ in range(db.pool.max_size)]
        stats = db.pool._stats = _ShortStats(db.pool._stats, "requests_wait_ms")
        said: list[str] = []
        waiter = threading.Thread(target=lambda: said.extend(outcomes_once(db)), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while not db.pool._waiting and time.monotonic() < deadline:  # it waits for one
            time.sleep(0.01)
        assert db.pool._waiting, "the checkout never waited"
        for conn in held:
            db.pool.putconn(conn)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        assert stats.raised == 1 and said == ["MemoryError: "], said
        assert leaked(db) == 0
        assert outcomes(db, select_one) == ["1"] * OPERATIONS
    finally:
        db.close()


def outcomes_once(db: Any) -> list[str]:
    """One run of ``select_one``: what it returned or raised."""
    try:
        return [repr(db.run(select_one))]
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}"]


def test_a_checkout_running_short_as_it_queues_leaves_no_place_to_take_a_connection(
        pg_url: str) -> None:
    """R62 #6: a MemoryError counting a queued request left the checkout's place in the pool's
    queue; the next connection given back was handed to that abandoned place and lost. The
    place is failed now, and the pool hands the connection on."""
    db = small_db(pg_url)
    try:
        held = [db.pool.getconn(timeout=5) for _ in range(db.pool.max_size)]
        stats = db.pool._stats = _ShortStats(db.pool._stats, "requests_queued")
        said = outcomes_once(db)
        assert stats.raised == 1 and said == ["MemoryError: "], said
        for conn in held:
            db.pool.putconn(conn)
        assert leaked(db) == 0
        assert outcomes(db, select_one) == ["1"] * OPERATIONS
    finally:
        db.close()
