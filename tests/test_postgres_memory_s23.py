"""PostgreSQL and a passing MemoryError (session 23, review R32 items 5 and 6).

* A MemoryError after a claim's commit (returning its connection to the pool) is no "stays in
  pending/": the claim is whole and held (recorded, renewed), never a leased row nobody renews
  whose recovery charges an attempt. One before the commit still is a memory strike.
* A lost connection after the commit is never followed by a re-read of our own claim that can
  run out of memory (it once set the claimed handoff aside).
* claim-next running out of memory before any row is chosen is a passing shortage of the store
  (an OSError ENOMEM), not a bare MemoryError; one after is that row's memory strike.
* Recovery meeting a MemoryError (loading an abandoned claim's row) leaves the row for a later
  sweep, a memory strike; it once set it aside at once as unprocessable.
* A listing meeting one lists the row as "cannot be read now", transient.
"""
from __future__ import annotations

import errno
from datetime import timedelta
from typing import Any, Callable, Iterator

import psycopg
import pytest
from test_postgres import LEASE, T0, backend, request, sql

from handoffd.backends.postgres import values
from handoffd.core.errors import ClaimShortage
from handoffd.core.memorystrikes import memory_strikes
from handoffd.core.states import State
from handoffd.core.storage import GIVEN_UP


@pytest.fixture(autouse=True)
def fresh_strikes() -> Iterator[None]:
    memory_strikes._rows.clear()
    yield
    memory_strikes.clock = __import__("time").monotonic
    memory_strikes._rows.clear()


def failing_loads(monkeypatch: pytest.MonkeyPatch, handoff_id: str,
                  calls: set[int]) -> list[int]:
    """The row loader's load_json raises MemoryError at the ``calls``-th loads (1-based) of
    ``handoff_id``'s document; returns the list of calls made (its length: how many)."""
    real = values.load_json
    made: list[int] = []

    def load(text: str, *args: Any, **kwargs: Any) -> Any:
        if f'"{handoff_id}"' in text:
            made.append(1)
            if len(made) in calls:
                raise MemoryError()
        return real(text, *args, **kwargs)

    monkeypatch.setattr(values, "load_json", load)
    return made


def once_after(real: Callable[..., Any], error: Callable[[], BaseException]) -> Callable[..., Any]:
    """``real``, whose next call raises ``error()`` after doing its work."""
    left = [1]

    def call(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if left[0]:
            left[0] -= 1
            raise error()
        return result

    return call


def state_of(url: str, handoff_id: str) -> str:
    return sql(url, "SELECT state FROM handoffd.handoffs WHERE id = %s", handoff_id)[0][0]


def test_a_memory_error_after_the_claims_commit_keeps_the_claim(pg_url: str,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    store = backend(pg_url)
    try:
        store.create(request("after"), "after", T0)
        # the connection goes back to the pool, then the pool's bookkeeping runs out of memory
        monkeypatch.setattr(store.db.pool, "putconn", once_after(store.db.pool.putconn,
                                                                 MemoryError))
        claim = store.claim("after", T0, LEASE)  # once: ClaimShortage, "stays in pending/"
        monkeypatch.undo()
        assert claim is not None and claim.id == "after"
        assert state_of(pg_url, "after") == "in-progress"
        # held as any claim: recorded as ours, renewed, filed
        assert store.written_at("after", claim.token, T0 + timedelta(seconds=LEASE)) is not None
        assert store.renew(claim, T0 + timedelta(seconds=5), LEASE)
        assert memory_strikes.backoff("after") == 0.0  # no strike: nothing ran short of it
    finally:
        store.close()


def test_asking_after_the_commit_running_short_gives_the_claim_up(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """When even asking whether the commit held runs out of memory, the claim is given up:
    if it did commit, this process's sweep hands it back uncounted once its lease ends."""
    store = backend(pg_url)
    try:
        store.create(request("unsure"), "unsure", T0)
        real_run = store.db.run
        runs = [0]

        def run(op: Any) -> Any:
            runs[0] += 1
            if runs[0] == 1:  # the claim: committed, then its connection's return fails
                return once_after(real_run, MemoryError)(op)
            raise MemoryError()  # and so does asking

        monkeypatch.setattr(store.db, "run", run)
        with pytest.raises(ClaimShortage):
            store.claim("unsure", T0, LEASE)
        monkeypatch.undo()
        assert state_of(pg_url, "unsure") == "in-progress"
        taken = store.expired_claims(T0 + timedelta(seconds=LEASE + 1), LEASE)
        assert [(c.id, c.recovered) for c in taken] == [("unsure", GIVEN_UP)]
    finally:
        store.close()


def test_a_memory_error_before_the_commit_is_still_a_strike(pg_url: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    store = backend(pg_url)
    try:
        store.create(request("before"), "before", T0)
        failing_loads(monkeypatch, "before", {1})
        with pytest.raises(ClaimShortage, match="stays in pending/"):
            store.claim("before", T0, LEASE)
        assert state_of(pg_url, "before") == "pending"
        assert memory_strikes.backoff("before") > 0
        assert store.claim("before", T0, LEASE) is not None  # the next one works
    finally:
        store.close()


def test_a_lost_connection_after_the_commit_is_not_followed_by_a_re_read(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry after a lost connection finds its own committed claim by its token and
    hands over what it wrote: no second load of the row, which could run out of memory (then
    the claimed handoff was set aside as unprocessable)."""
    store = backend(pg_url)
    try:
        store.create(request("lost"), "lost", T0)
        loads = failing_loads(monkeypatch, "lost", {2})
        monkeypatch.setattr(store.db.pool, "putconn", once_after(
            store.db.pool.putconn, lambda: psycopg.OperationalError("connection lost")))
        claim = store.claim("lost", T0, LEASE)
        monkeypatch.undo()
        assert claim is not None and claim.id == "lost"
        assert len(loads) == 1
        assert state_of(pg_url, "lost") == "in-progress"
        assert store.renew(claim, T0 + timedelta(seconds=5), LEASE)
    finally:
        store.close()


def test_claim_next_running_out_of_memory(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend(pg_url)
    try:
        store.create(request("next"), "next", T0)
        failing_loads(monkeypatch, "next", {1})  # the chosen row's load: that row's strike
        with pytest.raises(ClaimShortage) as short:
            store.claim_next(["@a"], T0, LEASE)
        assert short.value.handoff_id == "next"
        assert state_of(pg_url, "next") == "pending"
        monkeypatch.undo()
        memory_strikes._rows.clear()
        real_run = store.db.run

        def run(op: Any) -> Any:  # before any row is chosen: no document's strike
            return real_run(lambda conn, retried: (_ for _ in ()).throw(MemoryError()))

        monkeypatch.setattr(store.db, "run", run)
        with pytest.raises(OSError) as exc:
            store.claim_next(["@a"], T0, LEASE)
        assert exc.value.errno == errno.ENOMEM
        assert not memory_strikes._rows
        monkeypatch.undo()
        assert state_of(pg_url, "next") == "pending"
    finally:
        store.close()


def test_recovery_leaves_a_row_it_runs_out_of_memory_on_for_a_later_sweep(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend(pg_url)
    now = [1000.0]
    memory_strikes.clock = lambda: now[0]
    try:
        store.create(request("rec"), "rec", T0)
        claim = store.claim("rec", T0, LEASE)
        assert claim is not None
        store.abandon(claim)  # given up by this process: its sweep takes it back
        later = T0 + timedelta(seconds=600)
        loads = failing_loads(monkeypatch, "rec", {1})
        assert store.expired_claims(later, LEASE) == []  # once: set aside, UNPROCESSABLE
        assert len(loads) == 1
        assert state_of(pg_url, "rec") == "in-progress"
        assert store.quarantined() == []
        assert store.expired_claims(later, LEASE) == []  # backing off: not read again yet
        assert len(loads) == 1
        now[0] += 60.0
        taken = store.expired_claims(later, LEASE)
        assert [(c.id, c.recovered) for c in taken] == [("rec", GIVEN_UP)]
        assert memory_strikes._rows == {}  # the take-over that worked ended the row
    finally:
        store.close()


def test_recovery_sets_a_row_aside_only_at_the_strikes_bound(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend(pg_url)
    now = [1000.0]
    memory_strikes.clock = lambda: now[0]
    try:
        store.create(request("bound"), "bound", T0)
        claim = store.claim("bound", T0, LEASE)
        assert claim is not None
        store.abandon(claim)
        later = T0 + timedelta(seconds=600)
        failing_loads(monkeypatch, "bound", set(range(1, 100)))
        for _ in range(20):
            store.expired_claims(later, LEASE)
            if store.quarantined():
                break
            assert state_of(pg_url, "bound") == "in-progress"
            now[0] += 61.0
        assert now[0] - 1000.0 >= 300.0  # not before 5 minutes of it
        assert "ran out of memory" in str(store.quarantined()[0].get("message"))
    finally:
        store.close()


def test_a_listing_says_a_row_cannot_be_read_now(pg_url: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = backend(pg_url)
    try:
        store.create(request("ls"), "ls", T0)
        failing_loads(monkeypatch, "ls", {1})
        rows = store.list(unreadable=True)
        assert [row.id for row in rows] == ["ls"]
        problem = rows[0].problem
        assert problem is not None and problem.transient and "cannot be read now" in str(problem)
        assert rows[0].state is State.PENDING
        assert memory_strikes._rows == {}  # a listing decides nothing: no strike
    finally:
        store.close()


# ---------------------------------------------------------------- review R33: get and export

def test_retention_keeps_what_a_live_row_it_runs_out_of_memory_on_depends_on(
        tmp_path: Any, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``get`` turned a MemoryError loading a live row into an InvalidDocument ("damaged,
    protects nothing"): retention purged the completed handoff it depends on. Now the
    MemoryError is raised as such, as the file store's read raises it, and the pass ends
    with nothing removed."""
    from test_postgres_s22 import _dependent, _engine

    from handoffd.core.timeutil import utc_now
    from handoffd.features import retention
    engine = _engine(tmp_path / "ws", pg_url)
    try:
        now = utc_now()
        engine.backend.import_finished("dep-a", State.COMPLETED, {
            **request("dep-a", "@flaky"), "status": "completed", "output": 1,
            "handoffd": {"revision": 3, "history": [
                {"at": "2026-01-01T00:00:00Z", "event": "completed"}]}},
            now - timedelta(days=10))
        engine.submit(_dependent("live-b", "dep-a", now))
        failing_loads(monkeypatch, "live-b", {1, 2, 3, 4, 5})
        with pytest.raises(MemoryError):
            retention.expire(engine, older_than={State.COMPLETED: 3600.0},
                             now=now + timedelta(days=1))
        monkeypatch.undo()
        assert state_of(pg_url, "dep-a") == "completed"
        result = retention.expire(engine, older_than={State.COMPLETED: 3600.0},
                                  now=now + timedelta(days=1))
        assert result.removed == [] and "dep-a" in result.kept, result
    finally:
        engine.backend.close()


def test_an_export_running_out_of_memory_on_a_row_leaves_it_for_the_next(
        tmp_path: Any, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge's export set a finished row aside for good (UNPROCESSABLE_DOCUMENT, its
    terminal file never written) when loading it ran out of memory once."""
    from test_postgres_bridge_s18 import bridge, local_store

    from handoffd.core.timeutil import utc_now
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(store_db, local_store(root))
    try:
        store_db.import_finished("x1", State.COMPLETED, {
            **request("x1", "@a"), "status": "completed", "output": 1,
            "handoffd": {"revision": 3, "history": [
                {"at": "2026-01-01T00:00:00Z", "event": "completed"}]}},
            utc_now(), origin="host:a")
        failing_loads(monkeypatch, "x1", {1})
        assert files.export() == 0
        monkeypatch.undo()
        assert store_db.quarantined() == []
        assert files.export() == 1
        assert (root / "handoffs" / "completed" / "x1.json").is_file()
    finally:
        store_db.close()
