"""The PostgreSQL store against rows and sessions others leave behind (session 16): timestamps
Python cannot hold (``infinity``, a year BC), documents over ``max_document_bytes``, a row
locked by another session while its lease is due for renewal, and context files under names no
key may have in ``handoffd db import``.

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py)."""
from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_postgres import T0, backend, request, sql
from test_postgres_hostile import pg_workspace

from handoffd.core.errors import InvalidDocument, UnreadableDocument
from handoffd.core.states import State

LEASE = 30.0
BOUND = 60.0  # seconds a command that must not hang is given


class Clock:
    """A monotonic clock the test moves (owner grace, stalled leases)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- timestamps Python cannot hold
def test_timestamps_past_pythons_calendar_load_clamped(pg_url: str) -> None:
    import psycopg

    from handoffd.backends.postgres.values import UTC_MAX, UTC_MIN, configure, finite
    with psycopg.connect(pg_url) as conn:
        configure(conn)
        for binary in (False, True):
            row = conn.cursor(binary=binary).execute(
                "SELECT 'infinity'::timestamptz, '-infinity'::timestamptz, "
                "'0044-03-15 BC'::timestamptz, '20000-01-01'::timestamptz, "
                "'2026-03-01 12:00:00+00'::timestamptz").fetchone()
            assert row is not None
            assert row[:4] == (UTC_MAX, UTC_MIN, UTC_MIN, UTC_MAX), (binary, row)
            assert row[4] == T0
    assert finite(UTC_MAX) is None and finite(UTC_MIN) is None and finite(T0) == T0


def test_infinite_timestamps_stop_no_sweep_claim_or_listing(pg_url: str) -> None:
    clock = Clock()
    store = backend(pg_url, owner_grace_seconds=5.0, monotonic=clock)
    try:
        for handoff_id in ("dead", "lapsed", "forever", "never", "normal"):
            store.create(request(handoff_id), handoff_id, T0)
        # a killed daemon's claim whose lease someone set to -infinity; a plain lapsed one;
        # a pending row created "at infinity" (raw: no events to fall back on); one due never
        sql(pg_url, "UPDATE handoffd.handoffs SET state = 'in-progress', lease_token = 't1', "
                    "lease_owner = 77, lease_expires_at = '-infinity' WHERE id = 'dead'")
        sql(pg_url, "UPDATE handoffd.handoffs SET state = 'in-progress', lease_token = 't2', "
                    "lease_expires_at = %s WHERE id = 'lapsed'", T0)
        sql(pg_url, "UPDATE handoffd.handoffs SET created_at = 'infinity', raw = true, "
                    "due_at = '2001-01-01' WHERE id = 'forever'")
        sql(pg_url, "UPDATE handoffd.handoffs SET due_at = 'infinity', updated_at = 'infinity' "
                    "WHERE id = 'never'")
        later = T0 + timedelta(hours=1)
        first = store.expired_claims(later, LEASE)  # no DataError; the lapsed one is taken
        assert [c.id for c in first] == ["lapsed"]
        clock.now += 6.0  # the dead owner's key unheld for longer than the grace
        assert [c.id for c in store.expired_claims(later, LEASE)] == ["dead"]
        claimed = store.claim_next(["@a"], later, LEASE)
        assert claimed is not None and claimed.id in ("forever", "normal")
        listed = {row.id: row for row in store.list(unreadable=True)}
        assert set(listed) == {"dead", "lapsed", "forever", "never", "normal"}
        assert store.ids(State.PENDING)
    finally:
        store.close()


def test_ls_and_stats_survive_a_row_due_at_infinity(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    handoff_id = space.create("--to", "@nobody", "--data", "{}")
    sql(pg_url, "UPDATE handoffd.handoffs SET due_at = 'infinity', updated_at = '-infinity', "
                "created_at = 'infinity' WHERE id = %s", handoff_id)
    for args in (("ls",), ("ls", "--json"), ("stats",), ("show", handoff_id)):
        proc = space.handoff(*args, timeout=BOUND)
        no_traceback(proc)
        assert proc.returncode == 0, (args, proc.stderr)


# ---------------------------------------------------------------- max_document_bytes
def test_create_refuses_a_document_over_max_document_bytes(tmp_path: Path, pg_url: str) -> None:
    from handoffd.service.client import Client
    store = backend(pg_url, max_document_bytes=4096)
    try:
        with pytest.raises(InvalidDocument) as caught:
            store.create(request("big", data={"pad": "x" * 6000}), "big", T0)
        assert caught.value.code == "DOCUMENT_TOO_LARGE"
        assert "over the 4096-byte limit" in str(caught.value)
        store.create(request("small"), "small", T0)  # (under it: as before)
        assert store.get("big") is None
    finally:
        store.close()
    pg_workspace(tmp_path / "ws", pg_url)  # the default limit, 4 MiB, as the files store's
    with pytest.raises(InvalidDocument) as caught:
        Client(tmp_path / "ws").create(to="@nobody", data="x" * (6 << 20))
    assert caught.value.code == "DOCUMENT_TOO_LARGE"
    assert "over the 4194304-byte limit" in str(caught.value)


def big_row(url: str, handoff_id: str, size: int, target: str = "@a") -> None:
    """A pending native request of about ``size`` bytes, inserted past handoffd."""
    text = ('{"handoff_id": "%s", "timestamp": "2026-01-01T00:00:00Z", "source": {"agent_id": '
            '"@x"}, "target": {"agent_id": "%s"}, "input": {"data": {"pad": "%s"}}}'
            % (handoff_id, target, "x" * size))
    sql(url, "INSERT INTO handoffd.handoffs (id, state, doc, target, due_at, updated_at, "
             "created_at) VALUES (%s, 'pending', %s::json, %s, '2001-01-01', now(), now())",
        handoff_id, text, target)


def test_an_oversized_row_is_never_claimed_or_loaded(pg_url: str) -> None:
    store = backend(pg_url, max_document_bytes=4096)
    try:
        big_row(pg_url, "huge", 1 << 20)  # over the limit and any bookkeeping margin
        big_row(pg_url, "over", 6000)  # within the margin, but its request is over the limit
        for handoff_id in ("huge", "over"):
            with pytest.raises(UnreadableDocument) as caught:
                store.peek(handoff_id)
            assert caught.value.code == "DOCUMENT_TOO_LARGE", handoff_id
            with pytest.raises(UnreadableDocument) as caught:
                store.claim(handoff_id, T0, LEASE)
            assert caught.value.code == "DOCUMENT_TOO_LARGE", handoff_id
        assert sorted(store.ids(State.PENDING)) == ["huge", "over"]  # (still pending: set aside)
        with pytest.raises(UnreadableDocument):
            store.claim_next(["@a"], T0, LEASE)
        problems = {row.id: row.problem for row in store.list(unreadable=True)}
        assert problems["huge"] is not None and problems["huge"].code == "DOCUMENT_TOO_LARGE"
        with pytest.raises(InvalidDocument):
            store.get("huge")
    finally:
        store.close()


def test_the_daemon_sets_an_oversized_row_aside(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    backend(pg_url).close()  # (the schema)
    big_row(pg_url, "huge", 5 << 20, target="@flaky")  # over 4 MiB and the bookkeeping margin
    done = space.handoffd("run", timeout=BOUND * 2)
    no_traceback(done)
    assert done.returncode in (0, 1), done.stderr  # (1: the batch filed a failure)
    assert "DOCUMENT_TOO_LARGE" in done.stderr
    rows = sql(pg_url, "SELECT code FROM handoffd.quarantine WHERE id = 'huge'")
    assert rows == [("DOCUMENT_TOO_LARGE",)], (rows, done.stderr)
    assert sql(pg_url, "SELECT state FROM handoffd.handoffs WHERE id = 'huge'") \
        in ([], [("failed",)])


# ---------------------------------------------------------------- a row locked by another session
def test_a_renewal_waits_for_a_locked_row_only_briefly(pg_url: str) -> None:
    import psycopg

    from handoffd.backends.postgres.claims import LeaseBusy
    store = backend(pg_url)
    try:
        for handoff_id in ("locked", "free"):
            store.create(request(handoff_id), handoff_id, T0)
        locked = store.claim("locked", T0, 3.0)
        free = store.claim("free", T0, 3.0)
        assert locked is not None and free is not None
        with psycopg.connect(pg_url) as other:  # holds the row until the block ends
            other.execute("SELECT 1 FROM handoffd.handoffs WHERE id = 'locked' FOR UPDATE")
            outcome: list[Any] = []

            def renew() -> None:
                try:
                    outcome.append(store.renew(locked, T0 + timedelta(seconds=1), 3.0))
                except LeaseBusy as exc:
                    outcome.append(exc)
            worker = threading.Thread(target=renew, daemon=True)
            worker.start()
            worker.join(BOUND)  # (a lock wait without a timeout: as long as the lock is held)
            assert outcome and isinstance(outcome[0], LeaseBusy), outcome
            assert "not renewed this round" in str(outcome[0])
            assert store.renew(free, T0 + timedelta(seconds=1), 3.0) is True
            other.rollback()
        assert store.renew(locked, T0 + timedelta(seconds=2), 3.0) is True
    finally:
        store.close()


def test_a_renewal_that_hangs_holds_back_no_other_jobs(pg_url: str) -> None:
    from types import SimpleNamespace

    from handoffd.service.leases import LeaseKeeper
    stuck = threading.Event()
    calls: dict[str, int] = {}

    def renew(claim: Any, now: Any, lease: float) -> bool:
        calls[claim] = calls.get(claim, 0) + 1
        if claim == "slow":
            stuck.wait(BOUND)
        return True
    engine = SimpleNamespace(settings=SimpleNamespace(lease_seconds=1.0), clock=lambda: T0,
                             backend=SimpleNamespace(renew=renew))
    jobs = [SimpleNamespace(handoff_id=name, claim=name, renewed_at=0.0, ending=False,
                            fenced=False) for name in ("slow", "a", "b")]
    keeper = LeaseKeeper(engine, lambda: jobs, lambda job, reason: None)  # type: ignore[arg-type]
    try:
        keeper.renew_all()  # returns within a renewal interval, the slow one still under way
        assert calls["a"] == calls["b"] == 1 and jobs[1].renewed_at > 0 and jobs[2].renewed_at > 0
        keeper.renew_all()  # the others again; the slow one is not started twice
        assert calls["a"] == 2 and calls["slow"] == 1
    finally:
        stuck.set()
        keeper.stop()


# ---------------------------------------------------------------- db import of context files
def test_db_import_counts_unsafe_context_names_as_unreadable(pg_url: str) -> None:
    from handoffd.backends.postgres.transfer import ImportReport, import_context
    names = ["ok", "a b", "line\nbreak", "k" * 2000, "../up", "dir/fine"]

    class Local:  # the workspace's context folder, as a mirror that lists every file would
        def keys(self) -> list[str]:
            return list(names)

        def read(self, key: str) -> tuple[bytes, int]:
            return b'{"v": 1}', 1
    store = backend(pg_url)
    try:
        report = ImportReport()
        import_context(store, Local(), T0, report)  # type: ignore[arg-type]
        assert report.context == 2
        assert sorted(store.shared_context().keys()) == ["dir/fine", "ok"]
        assert len(report.unreadable) == 4
        assert all("\n" not in name and len(name) < 200 for name in report.unreadable)
        assert "imported" in report.line() and "\n" not in report.line()
    finally:
        store.close()


def test_the_workspace_limit_reaches_the_postgresql_store(tmp_path: Path, pg_url: str) -> None:
    """[daemon] max_document_bytes is the store's limit on PostgreSQL too (it was the store's
    4 MiB default whatever the workspace said)."""
    from conftest import FLAKY_TOML
    root = tmp_path / "ws"
    space = pg_workspace(root, pg_url)
    space.write_config(FLAKY_TOML.replace("[daemon]\n", "[daemon]\nmax_document_bytes = 8192\n", 1)
                       + f'\n[store]\nurl = "{pg_url}"\n')
    big = space.handoff("create", "--to", "@flaky", "--data", '{"pad": "%s"}' % ("x" * 9000))
    no_traceback(big)
    assert big.returncode != 0 and "over the 8192-byte limit" in big.stderr, big.stderr
    small = space.handoff("create", "--to", "@flaky", "--data", '{"pad": "x"}')
    assert small.returncode == 0, small.stderr
