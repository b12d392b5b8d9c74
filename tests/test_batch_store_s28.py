"""`handoffd run` on PostgreSQL: four defects of a batch (helper C, session 28).

1. a claim a batch took over from a dead claimer and ran to completion is said as recovered
   and completed, not as a retry scheduled;
2. ``claim_grace_seconds`` under 1 with a PostgreSQL store is refused naming the config file's
   path, as every other settings error;
3. a dead owner's claim whose row another session holds locked is said, in one line, as the
   batch ends without it;
4. a store that goes away mid-batch no longer holds the batch far past ``--max-seconds``.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pgserver
import pytest
from conftest import new_workspace, wait_until
from test_batch_takeover_s27 import DIE_AFTER_ADMISSION, TOML, _create, _run, _sql, _where


def _crashed_claim(tmp_path: Path, url: str, handoff_id: str) -> Path:
    """A workspace on ``url`` whose batch died right after it claimed ``handoff_id`` (its
    claim in-progress, attempt 1, its owner gone)."""
    ws = new_workspace(tmp_path / "ws", TOML.replace("{url}", url))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIE_AFTER_ADMISSION)
    _create(url, handoff_id, {"mode": "ok"})
    crashed = _run(ws.root, PYTHONPATH=str(site))
    assert crashed.returncode == 99, crashed.stderr
    assert _where(url, handoff_id) == ("in-progress", 1)
    return ws.root


def _summary(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if "batch done:" in line)


def test_a_takeover_run_to_completion_is_said_recovered_and_completed(
        tmp_path: Path, pg_url: str) -> None:
    """The batch that takes a dead claimer's claim over and completes it says `completed 1`,
    `retry scheduled 0` and `recovered 1`. Before, `retry scheduled 1`: a retry still to come."""
    root = _crashed_claim(tmp_path, pg_url, "h1")
    later = _run(root, "--max-seconds", "60", "-v")
    assert later.returncode == 0, later.stderr
    assert _where(pg_url, "h1") == ("completed", 2), later.stderr
    summary = _summary(later.stderr)
    assert "completed 1, failed 0, retry scheduled 0" in summary, summary
    assert "recovered 1" in summary, summary


def test_a_grace_below_a_second_is_refused_naming_the_config_files_path(
        tmp_path: Path) -> None:
    """The refusal names handoffd.toml by its full path, as the other settings errors do."""
    toml = TOML.replace("claim_grace_seconds = 2.0", "claim_grace_seconds = 0.5")
    ws = new_workspace(tmp_path / "ws", toml.replace(
        "{url}", f"postgresql://nobody@/nowhere?host={tmp_path}/no-socket"))
    batch = _run(ws.root, "--max-seconds", "20")
    assert batch.returncode == 2, batch.stderr
    path = ws.root / "handoffd.toml"
    assert f"{path}: [daemon] claim_grace_seconds = 0.5 is below 1" in batch.stderr, \
        batch.stderr


def test_a_locked_dead_claim_is_said_as_the_batch_ends(tmp_path: Path, pg_url: str) -> None:
    """Another session holds the dead owner's row with SELECT ... FOR UPDATE: the batch waits
    its grace, cannot take it over, and says so in one line naming the handoff, the lock and
    who takes it later. Before, it ended with no word of it."""
    import psycopg
    root = _crashed_claim(tmp_path, pg_url, "h1")
    with psycopg.connect(pg_url, connect_timeout=10) as holder:
        holder.execute("SELECT id FROM handoffd.handoffs WHERE id = 'h1' FOR UPDATE")
        later = _run(root, "--max-seconds", "60")
        holder.rollback()
    assert later.returncode == 0, later.stderr
    assert _where(pg_url, "h1") == ("in-progress", 1)
    lines = [line for line in later.stderr.splitlines() if "h1" in line]
    assert len(lines) == 1, later.stderr
    assert "locked by another database session" in lines[0], lines
    assert "a later batch or `handoffd serve` takes it over" in lines[0], lines


@pytest.mark.heavy
def test_a_store_lost_mid_batch_ends_the_batch_within_its_bound(tmp_path: Path) -> None:
    """A cluster of this test's own is stopped while the batch runs a handoff: the batch ends
    within --max-seconds plus its slack (generously bounded here; 480 s and more before), exit
    1 (the store is unavailable), and the claim it held is still in-progress for recovery once
    the server is back."""
    server = pgserver.start()
    if isinstance(server, str):
        pytest.skip(server)
    try:
        url = server.new_database()
        ws = new_workspace(tmp_path / "ws", TOML.replace("{url}", url))
        for hid in ("slow", "next1", "next2"):
            _create(url, hid, {"mode": "sleep", "seconds": 3})
        began = time.monotonic()
        batch = subprocess.Popen([_handoffd(), "run", "--root", str(ws.root), "--max-seconds",
                                  "8", "--processes", "1"], stderr=subprocess.PIPE, text=True,
                                 env=os.environ.copy())
        try:
            wait_until(lambda: bool(ws.runs()) or batch.poll() is not None, 30,
                       "the batch's first handler started")
            server._run("pg_ctl", "stop", "-D", str(server.base / "data"), "-m", "immediate",
                        "-w", timeout=20)
            try:
                _, stderr = batch.communicate(timeout=8 + 60)
            except subprocess.TimeoutExpired:
                batch.kill()
                _, stderr = batch.communicate(timeout=10)
                pytest.fail(f"the batch was still running {time.monotonic() - began:.0f}s "
                            f"after its start: {stderr[-2000:]}")
        finally:
            if batch.poll() is None:
                batch.kill()
                batch.wait(timeout=10)
        took = time.monotonic() - began
        assert batch.returncode == 1, stderr
        assert took < 8 + 40, (took, stderr)
        assert "Traceback" not in stderr, stderr
        server._start()  # the data are kept: what the batch held is still claimed
        states = dict(_sql(url, "SELECT id, state FROM handoffd.handoffs"))
        assert set(states) == {"slow", "next1", "next2"}, states
        assert "in-progress" in states.values() or "completed" in states.values(), states
    finally:
        server.stop()


def _handoffd() -> str:
    from conftest import exe
    return exe("handoffd")


def test_the_summary_says_recovered_claims_and_a_spread_batch_adds_them_up() -> None:
    """`recovered N` is said only when there is one, after the retries; the processes of a
    spread batch add theirs up (fast, in process)."""
    from handoffd.service.report import BatchReport
    from handoffd.service.spread import _as_json, _merge
    assert "recovered" not in BatchReport(completed=1).line()
    assert BatchReport(completed=1, recovered=1).line() == (
        "completed 1, failed 0, retry scheduled 0, recovered 1 (taken over from a dead or "
        "stalled claimer)")
    total = BatchReport(recovered=1)
    _merge(total, _as_json(BatchReport(recovered=2)))
    assert total.recovered == 3


def test_a_config_names_its_own_path_in_the_grace_refusal(tmp_path: Path) -> None:
    """In process: the refusal comes from Config.store_url, which knows the file it was read
    from (and says handoffd.toml for defaults that were never read from one)."""
    from handoffd.core.config import load_config
    from handoffd.core.errors import ConfigError
    path = tmp_path / "handoffd.toml"
    path.write_text("[daemon]\nclaim_grace_seconds = 0.0\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path).store_url("postgresql://x@/y")
    assert str(refused.value).startswith(f"{path}: [daemon] claim_grace_seconds = 0.0 is below 1")


def test_a_graceful_stop_gives_running_work_its_grace_past_the_batchs_bound(
        tmp_path: Path) -> None:
    """R59: the store's retries bounded by the batch's deadline stayed bounded when a signal's
    graceful stop came before it: a filing after the deadline, within the grace, that met a
    dead pooled connection gave up at once (the result lost, the handler run again, an attempt
    charged). The graceful stop bounds them by its grace; a hard stop still by nothing."""
    import time as time_module

    from test_daemon_inprocess import engine_with

    from handoffd import Daemon

    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, grace_seconds=20.0)
    give_up = [float("inf")]

    def interrupt(grace: float = 0.0) -> None:  # as the PostgreSQL store's: only ever lowers
        give_up[0] = min(give_up[0], time_module.monotonic() + max(grace, 0.0))

    def resume() -> None:
        give_up[0] = float("inf")

    engine.backend.interrupt = interrupt  # type: ignore[attr-defined]
    engine.backend.resume = resume  # type: ignore[attr-defined]
    daemon = Daemon(engine, workers=1, watch=False)
    daemon.scheduler.batch_deadline = time_module.monotonic() + 5.0
    daemon._bound_store()
    assert give_up[0] <= time_module.monotonic() + 5.0
    daemon.stop()  # a SIGTERM at 2.5 s of a --max-seconds 5 batch: its grace is 20 s
    assert give_up[0] >= time_module.monotonic() + 15.0
    daemon.stop(hard=True)  # a second signal: now
    assert give_up[0] <= time_module.monotonic()


def test_a_stops_grace_counts_from_the_stop(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """R63: a stop's grace was counted from when the main loop got out (of a store operation
    retried through an outage, itself bounded by the grace): a batch stopped during an outage
    took two graces. A loop that gets out a whole grace after the stop hands running work back
    at once, without waiting another grace."""
    import time as time_module

    from test_daemon_inprocess import engine_with

    from handoffd import Daemon

    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, grace_seconds=30.0)
    daemon = Daemon(engine, workers=1, watch=False)
    daemon.stop()
    assert daemon._stop_began is not None
    daemon._stop_began -= 31.0  # (the loop got out a whole grace after the stop)
    daemon.scheduler.running = 1  # a handler still running
    handed: list[float] = []

    def hand_back_all() -> None:
        handed.append(time_module.monotonic())
        daemon.scheduler.running = 0

    monkeypatch.setattr(daemon.attempts, "hand_back_all", hand_back_all)
    monkeypatch.setattr(daemon, "release_held", lambda: None)
    waits: list[float] = []
    real_wait = daemon.cv.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(-1.0 if timeout is None else timeout)
        return real_wait(0)

    monkeypatch.setattr(daemon.cv, "wait", wait)
    daemon._shutdown()
    assert handed, "running work was not handed back"
    assert all(timeout <= 1.0 for timeout in waits), waits  # (before: a fresh 30 s grace)
