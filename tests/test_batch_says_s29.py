"""What `handoffd run` and `handoffd db` say (helper B, session 29).

1. a claim a batch took over whose retry is still to come as it ends (a retry delay) is said so
   in the summary (`recovered 1 (...; 1 back in pending/, not run again yet)`, JSON
   ``recovered_pending``), not as recovered alone (which read as finished);
2. a dead owner's row another database session holds locked is named as the batch ends at
   ``--max-seconds`` too, not only at its takeover wait's own bound;
3. a second stop signal during `handoffd db init`'s start says one line (exit 0 still).
"""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from conftest import new_workspace
from test_batch_takeover_s27 import DIE_AFTER_ADMISSION, TOML, _create, _run, _where
from test_db_stop_signals_s28 import a_store_away, stopped_once

from handoffd.service.report import BatchReport


def _crashed_claim(tmp_path: Path, url: str, handoff_id: str, toml: str = TOML,
                   data: dict[str, object] | None = None) -> Path:
    """A workspace on ``url`` (its handoffd.toml ``toml``) whose batch died right after it
    claimed ``handoff_id`` (in-progress, attempt 1, its owner gone; its data ``data``, by
    default one that completes at once)."""
    ws = new_workspace(tmp_path / "ws", toml.replace("{url}", url))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIE_AFTER_ADMISSION)
    _create(url, handoff_id, data or {"mode": "ok"})
    crashed = _run(ws.root, PYTHONPATH=str(site))
    assert crashed.returncode == 99, crashed.stderr
    assert _where(url, handoff_id) == ("in-progress", 1)
    return ws.root


def test_a_takeover_whose_retry_is_to_come_is_said_so(tmp_path: Path, pg_url: str) -> None:
    """A retry delay of 10 minutes: the batch takes the dead claimer's claim over, its retry
    is scheduled for later, and the batch ends. Its summary says the retry is still to come,
    and so does its JSON record. Before: `recovered 1 (taken over ...)` alone, which read as a
    handoff that finished."""
    toml = TOML.replace("retry_delay_seconds = 0.0", "retry_delay_seconds = 600.0")
    root = _crashed_claim(tmp_path, pg_url, "h1", toml)
    later = _run(root, "--max-seconds", "60", "-v", "--log-format", "json")
    assert later.returncode == 0, later.stderr
    assert _where(pg_url, "h1") == ("pending", 1), later.stderr
    records = [json.loads(line) for line in later.stderr.splitlines() if line.startswith("{")]
    done = next(r for r in records if r.get("event") == "batch_done")
    assert "completed 0, failed 0, retry scheduled 0" in done["message"], done
    assert ("recovered 1 (taken over from a dead or stalled claimer; 1 back in pending/, not "
            "run again yet)") in done["message"], done
    assert (done["recovered"], done["recovered_pending"], done["completed"]) == (1, 1, 0), done


def test_a_takeover_run_again_is_not_said_pending() -> None:
    """Fast, in process: a recovered id still pending with no claim since its recovery is
    counted; one claimed since (run again, retried), finished, or unknown is not."""
    def doc(*events: str) -> dict[str, object]:
        return {"handoffd": {"history": [{"event": e} for e in events]}}

    from handoffd.core.states import State
    found = {"waits": (State.PENDING, doc("claimed", "recovered", "retry_scheduled")),
             "ran": (State.PENDING, doc("recovered", "retry_scheduled", "claimed",
                                        "retry_scheduled")),
             "done": (State.COMPLETED, doc("recovered", "retry_scheduled", "claimed",
                                           "completed"))}

    class Store:
        def get(self, hid: str) -> object:
            return found.get(hid)

    report = BatchReport(recovered=4, recovered_ids=["waits", "ran", "done", "gone", "waits"])
    report.settle_recovered(Store())  # type: ignore[arg-type]
    assert report.recovered_pending == 1
    assert report.line().endswith("recovered 4 (taken over from a dead or stalled claimer; "
                                  "1 back in pending/, not run again yet)")
    # more takeovers than ids kept (RECOVERED_IDS_KEPT): at least
    report = BatchReport(recovered=5, recovered_ids=["waits"])
    report.settle_recovered(Store())  # type: ignore[arg-type]
    assert report.line().endswith("; at least 1 back in pending/, not run again yet)")

    class Away:
        interrupted: list[float] = []

        def interrupt(self, grace: float) -> None:
            self.interrupted.append(grace)

        def get(self, hid: str) -> object:
            raise OSError("the store is away")

    # R-RB: a store that cannot be read is given a short grace, and the count is unknown
    away = Away()
    report = BatchReport(recovered=1, recovered_ids=["waits"])
    report.settle_recovered(away)  # type: ignore[arg-type]
    assert away.interrupted and away.interrupted[0] <= 2.0
    assert report.recovered_pending is None
    assert report.line().endswith("; whether it ran again is unknown: the store could not be "
                                  "read)")
    assert BatchReport(recovered=1).line().endswith("(taken over from a dead or stalled "
                                                    "claimer)")
    # a spread batch's processes send their ids to the parent, which settles them all at once
    from handoffd.service.spread import _as_json, _merge
    total = BatchReport(recovered_ids=["waits"])
    _merge(total, _as_json(BatchReport(recovered=1, recovered_ids=["ran"])))
    assert total.recovered_ids == ["waits", "ran"]


def test_a_locked_dead_claim_is_said_when_max_seconds_ends_the_batch(
        tmp_path: Path, pg_url: str) -> None:
    """The batch runs a slow handoff past its --max-seconds while a dead owner's row is held
    locked by another session (watched for its whole grace meanwhile): ended by its bound, it
    names the claim it could not take over. Before, only an end at the takeover wait's own
    bound did; an end at --max-seconds said nothing of it."""
    import psycopg
    root = _crashed_claim(tmp_path, pg_url, "h1")
    _create(pg_url, "slow", {"mode": "sleep", "seconds": 15})
    with psycopg.connect(pg_url, connect_timeout=10) as holder:
        holder.execute("SELECT id FROM handoffd.handoffs WHERE id = 'h1' FOR UPDATE")
        later = _run(root, "--max-seconds", "6")
        holder.rollback()
    assert "--max-seconds reached" in later.stderr, later.stderr
    assert _where(pg_url, "h1") == ("in-progress", 1)
    lines = [line for line in later.stderr.splitlines() if "h1" in line]
    assert len(lines) == 1, later.stderr
    assert ("handoff h1: its owner is gone but its claim could not be taken over: its row is "
            "locked by another database session") in lines[0], lines
    assert "Traceback" not in later.stderr


def test_a_takeover_still_running_at_max_seconds_is_not_said_left(
        tmp_path: Path, pg_url: str) -> None:
    """R-RB: the batch takes the dead owner's claim over and runs it (a long handler) until
    --max-seconds hands it back: it was taken over, so no line says it "could not be taken
    over" (the watch of the dead owner's claim outlived the takeover: it said so)."""
    root = _crashed_claim(tmp_path, pg_url, "h1", data={"mode": "sleep", "seconds": 30})
    later = _run(root, "--max-seconds", "12", "-v")  # (a takeover well within it, under load)
    assert "--max-seconds reached" in later.stderr, later.stderr
    assert "recovered 1 abandoned" in later.stderr, later.stderr
    assert "could not be taken over" not in later.stderr, later.stderr
    assert "Traceback" not in later.stderr


def _two_stops(root: Path, after: str) -> tuple[int, str]:
    """Start ``handoffd db init`` on ``root``; once ``after`` ("imports": it imports handoffd's
    modules past its entry module, its stop signals held; "waiting": it waits for the
    database) send SIGTERM and SIGINT back to back (two signals, never coalesced into one);
    its exit code and its stderr lines past that point."""
    def send(proc: subprocess.Popen[str]) -> None:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
    code, lines = stopped_once(root, after, send)
    return code, "\n".join(lines)


def test_a_second_stop_during_db_inits_imports_says_so(tmp_path: Path) -> None:
    """Two stops while `db init` imports: exit 0 at once, with one line saying it stopped
    before it began, at a second signal, nothing done to the store. Before: no line."""
    root = a_store_away(tmp_path / "ws")
    code, said = _two_stops(root, "imports")
    assert code == 0, said
    lines = said.splitlines()
    assert len(lines) == 1, said
    assert lines[0].startswith("handoffd: stopped: before it began, at a second stop signal"), \
        said
    assert "nothing was done to" in lines[0], said


def test_a_second_stop_while_db_init_waits_for_the_database_says_so(tmp_path: Path) -> None:
    """Two stops while `db init` waits for a database nobody serves: exit 0 at once, one line
    naming the store (its password hidden). Before: no line."""
    root = a_store_away(tmp_path / "ws")
    code, said = _two_stops(root, "waiting")
    assert code == 0, said
    lines = said.splitlines()
    assert len(lines) == 1, said
    assert lines[0].startswith("handoffd: stopped: before it began, at a second stop signal, "
                               "waiting for the database at postgresql://u:"), said
    assert "pw@" not in lines[0] and "nothing was done to the store" in lines[0], said
