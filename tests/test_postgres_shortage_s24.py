"""PostgreSQL and a passing MemoryError (session 24): two gaps the shortages work left.

* ``Database.run`` returns its pooled connection whatever is raised: a MemoryError returning
  it (in ``putconn`` itself, as the operation's own MemoryError unwinds or not) once leaked it,
  the pool counting it checked out for ever; after ``max_size`` such leaks every operation
  waited for the pool's timeout. The put is tried once more; a connection that cannot be
  returned is closed and handed back closed, and the pool replaces it.
* The sweep running out of memory in its first look for abandoned claims (before any row is
  handled) is a memory shortage of the store: one WARNING naming it, held back as the sweep's
  recurring problems are, no traceback, nothing taken over, set aside or charged, and the
  next sweep looks again. It once left the sweep with a bare MemoryError.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_postgres import LEASE, T0, backend, request, sql

from handoffd.backends.postgres.connection import Database
from handoffd.core.memorystrikes import memory_strikes

MAX_SIZE = 2
OPERATIONS = MAX_SIZE + 2  # more than the pool holds: every leak would show


@pytest.fixture(autouse=True)
def fresh_strikes() -> Iterator[None]:
    memory_strikes._rows.clear()
    yield
    memory_strikes._rows.clear()


def small_db(url: str) -> Database:
    """A pool of :data:`MAX_SIZE` connections that gives up waiting for one within about 1 s
    (a leaked pool fails fast, never after the default minute)."""
    return Database(url, max_size=MAX_SIZE, reconnect_seconds=1.0, connect_timeout=1.0)


def short_puts(db: Database, pattern: str) -> list[int]:
    """``db.pool.putconn`` runs out of memory by ``pattern``, one letter per call, cycled:
    ``b`` raises MemoryError before doing anything, ``a`` after doing its work, ``.`` works.
    Returns the list of calls made (its length: how many)."""
    real = db.pool.putconn
    calls: list[int] = []

    def putconn(conn: Any) -> None:
        step = pattern[len(calls) % len(pattern)]
        calls.append(1)
        if step == "b":
            raise MemoryError()
        real(conn)
        if step == "a":
            raise MemoryError()

    db.pool.putconn = putconn  # type: ignore[method-assign]
    return calls


def leaked(db: Database) -> int:
    """Connections the pool counts but holds none of, once its background work settles
    (replacements connecting): nothing is checked out here, so 0 unless some leaked."""
    ends = time.monotonic() + 5.0
    while True:
        stats = db.pool.get_stats()
        missing = stats["pool_size"] - stats["pool_available"]
        if missing == 0 or time.monotonic() > ends:
            return missing
        time.sleep(0.05)


def outcomes(db: Database, operation: Callable[[Any, bool], Any]) -> list[str]:
    """:data:`OPERATIONS` runs of ``operation``: what each returned or raised."""
    said = []
    for _ in range(OPERATIONS):
        try:
            said.append(repr(db.run(operation)))
        except Exception as exc:  # (a MemoryError, or a pool waited out: StoreUnavailable)
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def select_one(conn: Any, _retried: bool) -> int:
    return int(conn.execute("SELECT 1").fetchone()[0])


@pytest.mark.parametrize("pattern", ["b.", "a"], ids=["before-its-work", "after-its-work"])
def test_a_put_that_runs_short_once_returns_the_connection(pg_url: str, pattern: str) -> None:
    """Running short once returning the connection (before the pool took it back, or after):
    the operation's result is returned, and no connection leaks."""
    db = small_db(pg_url)
    try:
        calls = short_puts(db, pattern)
        said = outcomes(db, select_one)
        assert leaked(db) == 0
        assert said == ["1"] * OPERATIONS
        assert len(calls) == 2 * OPERATIONS  # the second put: the retry (or a no-op)
        assert db.run(select_one) == 1
    finally:
        db.close()


def test_a_connection_that_cannot_be_returned_is_closed_and_replaced(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    db = small_db(pg_url)
    try:
        short_puts(db, "bb.")  # twice short: closed, then handed back closed
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            said = outcomes(db, select_one)
        assert leaked(db) == 0
        assert said == ["1"] * OPERATIONS
        assert db.pool.get_stats().get("returns_bad") == OPERATIONS  # each one replaced
        lines = [r for r in caplog.records if "returned to its pool" in r.getMessage()]
        assert [r.getMessage() for r in lines] == [
            "a connection to the PostgreSQL store could not be returned to its pool: out of "
            "memory (MemoryError); closed, the pool replaces it"] * OPERATIONS
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in lines)
        assert db.run(select_one) == 1
    finally:
        db.close()


def test_an_operations_memory_error_is_its_callers_and_its_connection_returns(
        pg_url: str) -> None:
    """The operation runs out of memory (rolled back as it unwinds), and so does the put:
    the caller gets the operation's MemoryError, and the connection is back in the pool."""
    def short(conn: Any, _retried: bool) -> None:
        conn.execute("SELECT 1")
        raise MemoryError("the operation's")

    db = small_db(pg_url)
    try:
        short_puts(db, "b.")
        said = outcomes(db, short)
        assert leaked(db) == 0
        assert said == ["MemoryError: the operation's"] * OPERATIONS
        assert db.run(select_one) == 1
    finally:
        db.close()


# ------------------------------------------------------------------ the sweep's first look
class _ShortLook:
    """A connection whose sweep look (the first SELECT of expired_claims) runs out of memory
    while ``left[0]`` is above 0 (each such look spends one)."""

    def __init__(self, conn: Any, left: list[int]) -> None:
        self._conn, self._left = conn, left

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(query)  # (the look: it reads the rows' expiry as text, among its columns)
        if text.startswith("SELECT h.id,") and "lease_expires_at::text" in text \
                and self._left[0] > 0:
            self._left[0] -= 1
            raise MemoryError()
        return self._conn.execute(query, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def short_looks(monkeypatch: pytest.MonkeyPatch, store: Any, times: int) -> list[int]:
    """The next ``times`` sweep looks of ``store`` run out of memory; returns the count left."""
    real_run = store.db.run
    left = [times]

    def run(operation: Callable[[Any, bool], Any]) -> Any:
        return real_run(lambda conn, retried: operation(_ShortLook(conn, left), retried))

    monkeypatch.setattr(store.db, "run", run)
    return left


def lease_of(url: str, handoff_id: str) -> tuple[Any, ...]:
    return sql(url, "SELECT state, lease_token, lease_expires_at FROM handoffd.handoffs "
                    "WHERE id = %s", handoff_id)[0]


def test_a_sweep_look_that_runs_out_of_memory_is_a_shortage_tried_again(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from handoffd.core.workspace import Workspace
    from handoffd.features.build import build_engine
    from handoffd.service import sweeper
    space = Workspace(tmp_path / "ws")
    space.ensure()
    store = backend(pg_url)
    engine = build_engine(space, backend=store, features=())
    try:
        store.create(request("gone"), "gone", T0)
        assert store.claim("gone", T0, LEASE) is not None
        # an abandoned claim the sweep takes over at once: expired, of no recorded owner
        sql(pg_url, "UPDATE handoffd.handoffs SET lease_owner = NULL WHERE id = 'gone'")
        before = lease_of(pg_url, "gone")
        left = short_looks(monkeypatch, store, 2)
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            for _ in range(2):  # the second held back as the sweep's recurring problems are
                assert sweeper.sweep(engine).recovered == []
        assert left == [0]
        said = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.getMessage() for r in said] == [
            "sweep: cannot look for abandoned claims: out of memory (MemoryError) reading the "
            "in-progress rows (ENOMEM: the memory the daemon may use) (if it recurs, said "
            "again at most once a minute)"]
        assert said[0].levelno == logging.WARNING and said[0].exc_info is None
        # nothing taken over, set aside or charged; no memory strike (no row's fault)
        assert lease_of(pg_url, "gone") == before
        assert memory_strikes._rows == {}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert sweeper.sweep(engine).recovered == ["gone"]  # the next sweep looks again
        assert "looking for abandoned claims works again (ENOMEM cleared after 2 failure(s))" \
            in [r.getMessage() for r in caplog.records]
        assert lease_of(pg_url, "gone")[1] != before[1]
    finally:
        store.close()


def test_a_connection_lost_after_the_pool_unlinked_it_is_replaced(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Review R37: psycopg_pool unlinks a returned connection before it stores it; a
    MemoryError storing it made the retry's "comes from no pool" read as "taken back", and the
    pool stayed one connection short for good (every later operation waited it out)."""
    import collections

    db = Database(pg_url, max_size=1, reconnect_seconds=1.0, connect_timeout=1.0)
    try:
        class ShortOnce(collections.deque):  # type: ignore[type-arg]
            left = 1

            def append(self, item: Any) -> None:
                if ShortOnce.left:
                    ShortOnce.left -= 1
                    raise MemoryError()
                super().append(item)

        db.pool._pool = ShortOnce(db.pool._pool)  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert db.run(select_one) == 1
        assert leaked(db) == 0
        assert db.run(select_one) == 1  # (it waited the pool out, then failed)
        assert [r for r in caplog.records if "returned to its pool" in r.getMessage()]
    finally:
        db.close()
