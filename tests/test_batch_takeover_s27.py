"""`handoffd run` on PostgreSQL takes a dead claimer's claim over (helper H, session 27; review
R52).

Recovery takes a claim whose owner's presence session is gone over only once the sweeping
process has itself watched it gone for ``claim_grace_seconds`` (a safety rule: wall-clock skew
between hosts never ends a live claim). A batch swept once and ended long before that, so no
number of `handoffd run` batches ever recovered it: each started watching anew. A batch now
waits, bounded, for the claims it watches, then takes them over and runs them. And a
``claim_grace_seconds`` of 0 with a PostgreSQL store (every claim refused, the batch waiting for
ever, silent) is refused as a setting.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, exe, new_workspace, wait_until
from test_postgres import T0, at, backend, key_held, request

from handoffd.core.native_format import new_native_request

# the batch dies (as kill -9) right after it admitted its claim, before the handler starts
DIE_AFTER_ADMISSION = """
import os
from handoffd.core import engine
real = engine.admit
def admit_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os._exit(99)
engine.admit = admit_then_die
"""
TOML = FLAKY_TOML.replace("lease_seconds = 30.0", "lease_seconds = 3.0").replace(
    "claim_grace_seconds = 1.0", "claim_grace_seconds = 2.0").replace(
    "retry_delay_seconds = 0.2", "retry_delay_seconds = 0.0") + """
[store]
url = "{url}"
"""


def _sql(url: str, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        cur = conn.execute(statement, args)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def _where(url: str, handoff_id: str) -> tuple[str, int]:
    """(state, attempt) of ``handoff_id`` in the store."""
    rows = _sql(url, "SELECT state, (doc::jsonb #>> '{handoffd,attempt}')::int "
                     "FROM handoffd.handoffs WHERE id = %s", handoff_id)
    assert len(rows) == 1, rows
    return str(rows[0][0]), int(rows[0][1] or 0)


def _create(url: str, handoff_id: str, data: dict[str, Any]) -> None:
    from handoffd.backends.postgres import PostgresBackend
    store = PostgresBackend(url, pool_size=1)
    try:
        now = datetime.now(timezone.utc)
        store.create(new_native_request(source="@test", target="@flaky", handoff_id=handoff_id,
                                        data=data, now=now), handoff_id, now)
    finally:
        store.close()


def _run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_one_later_batch_recovers_a_dead_batchs_claim(tmp_path: Path, pg_url: str) -> None:
    """A batch dies right after admission: its claim stays in-progress, its owner gone. ONE
    later batch watches the claim for the grace, takes it over and completes it (attempt 2),
    exit 0, saying in one line that it waits. Before, it ended at once, the claim untouched (as
    every later batch did)."""
    ws = new_workspace(tmp_path / "ws", TOML.replace("{url}", pg_url))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIE_AFTER_ADMISSION)
    try:
        _create(pg_url, "h1", {"mode": "ok"})
        crashed = _run(ws.root, PYTHONPATH=str(site))
        assert crashed.returncode == 99, crashed.stderr  # died right after its admission
        assert _where(pg_url, "h1") == ("in-progress", 1)
        later = _run(ws.root, "--max-seconds", "60")
        assert later.returncode == 0, later.stderr
        assert _where(pg_url, "h1") == ("completed", 2), later.stderr
        assert "waiting up to" in later.stderr and "to take over 1 claim(s)" in later.stderr, \
            later.stderr
        assert "recovered 1 abandoned handoff(s): h1" in later.stderr, later.stderr
        assert "Traceback" not in later.stderr
        runs = [json.loads(line) for line in
                (ws.root / "artifacts" / "flaky-runs.jsonl").read_text().splitlines()]
        assert [(r["id"], r["attempt"]) for r in runs] == [("h1", 2)]  # attempt 1 never ran
    finally:
        ws.cleanup()


def test_a_batch_beside_a_live_serve_never_takes_its_claim(tmp_path: Path, pg_url: str) -> None:
    """The control: a live `serve` (another host) runs a handoff longer than its lease; a batch
    run beside it ends within its bound, exit 0, and takes nothing over: the serve completes
    the handoff with its first attempt."""
    host_a = new_workspace(tmp_path / "a", TOML.replace("{url}", pg_url))
    host_b = new_workspace(tmp_path / "b", TOML.replace("{url}", pg_url))
    try:
        _create(pg_url, "slow", {"mode": "sleep", "seconds": 6})
        serving = host_a.serve()
        host_a.wait_started("slow")
        began = time.monotonic()
        batch = _run(host_b.root, "--max-seconds", "30")
        took = time.monotonic() - began
        assert batch.returncode == 0, batch.stderr
        assert "recovered" not in batch.stderr and "take over" not in batch.stderr, batch.stderr
        assert took < 20, (took, batch.stderr)  # (its bound; not a speed check: the serve's
        # handler still runs as it ends)
        deadline = time.monotonic() + 30
        while _where(pg_url, "slow")[0] != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _where(pg_url, "slow") == ("completed", 1)
        assert [r["attempt"] for r in host_a.runs()] == [1]
        assert not (host_b.root / "artifacts" / "flaky-runs.jsonl").exists()
        host_a.stop(serving)
    finally:
        host_a.cleanup()
        host_b.cleanup()


@pytest.mark.parametrize("grace", ["0.0", "0.5"])
def test_a_grace_below_a_second_is_refused_with_a_postgresql_store(
        tmp_path: Path, grace: str) -> None:
    """`claim_grace_seconds` under 1 with a PostgreSQL store: one line, exit 2, before any
    connection (the URL names no server). It once left `handoffd run` waiting for ever,
    claiming nothing and saying nothing."""
    toml = TOML.replace("claim_grace_seconds = 2.0", f"claim_grace_seconds = {grace}")
    ws = new_workspace(tmp_path / "ws", toml.replace(
        "{url}", f"postgresql://nobody@/nowhere?host={tmp_path}/no-socket"))
    try:
        batch = _run(ws.root, "--max-seconds", "20")
        assert batch.returncode == 2, batch.stderr
        lines = batch.stderr.strip().splitlines()
        assert len(lines) == 1, batch.stderr
        assert f"claim_grace_seconds = {grace} is below 1, the least a PostgreSQL store " \
               "allows" in lines[0], batch.stderr
    finally:
        ws.cleanup()


def test_a_grace_of_zero_is_still_the_files_stores_to_use(tmp_path: Path) -> None:
    """The files store takes a 0 grace as before: no refusal."""
    toml = FLAKY_TOML.replace("claim_grace_seconds = 1.0", "claim_grace_seconds = 0.0")
    ws = new_workspace(tmp_path / "ws", toml)
    try:
        batch = _run(ws.root, "--max-seconds", "20")
        assert batch.returncode == 0, batch.stderr
    finally:
        ws.cleanup()


def test_the_store_says_when_each_watched_claim_may_be_taken_over(pg_url: str) -> None:
    """What a batch waits for (in process, on an injected monotonic clock): a dead owner's claim
    is due a whole grace after the sweep first saw its owner gone, and is watched no more once
    taken over; a live owner's claim is never watched."""
    clock = [100.0]
    owner, dying = backend(pg_url), backend(pg_url)
    sweeper = backend(pg_url, owner_grace_seconds=2.0, monotonic=lambda: clock[0])
    try:
        for hid in ("live", "dead"):
            owner.create(request(hid), hid, T0)
        assert owner.claim("live", at(1), 600) is not None
        assert dying.claim("dead", at(1), 600) is not None
        assert sweeper.expired_claims(at(2), 600) == []
        assert sweeper.takeover_watch(600) == []  # both owners hold their keys
        dying.close()  # as kill -9 would: its presence session ends
        wait_until(lambda: not key_held(pg_url, dying.owner_key))
        assert sweeper.expired_claims(at(3), 600) == []  # first seen gone at 100
        assert sweeper.takeover_watch(600) == [102.0]
        clock[0] = 102.0
        assert [c.id for c in sweeper.expired_claims(at(4), 600)] == ["dead"]
        assert sweeper.expired_claims(at(5), 600) == []
        assert sweeper.takeover_watch(600) == []
        # R56: a live owner's lease that looks stale (its clock behind ours) is not waited for:
        # every batch beside such a serve waited a whole lease
        assert sweeper.expired_claims(at(5) + timedelta(seconds=3600), 600) == []
        assert sweeper.takeover_watch(600) == []
    finally:
        owner.close()
        sweeper.close()
