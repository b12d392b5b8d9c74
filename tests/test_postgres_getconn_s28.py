"""PostgreSQL: a MemoryError inside ``pool.getconn`` never leaks a connection (session 28).

psycopg_pool takes a connection out of its idle deque, then logs and counts before it returns
it: a MemoryError there lost the connection, the pool counting it checked out for ever (after
``max_size`` such leaks every operation waited out the pool's timeout). The checkout now gives
back a connection taken by a ``getconn`` that failed, and the caller gets the MemoryError.
"""
from __future__ import annotations

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
