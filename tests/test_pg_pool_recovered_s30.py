"""Session 30, task D: connections after a PostgreSQL outage, the connect timeout, recovered
hand-backs counted.

1. A pool holding many connections when the server restarted: each retry of the first
   operation after the restart took the next dead connection, waited its backoff and died on
   it; with ten or more the operation outlasted a short reconnect window and failed, the
   server back. A connection the server ended while it sat idle is now passed over at its
   checkout (one non-blocking poll, no round trip): the operation runs on a live one.
2. ``[store] connect_timeout_seconds`` bounds libpq's connect_timeout (it was a fixed 10 s):
   a bad value is one line and exit 2; the value reaches every connection made.
3. A claimer that died between its claim's rename and its lease write is handed back by the
   files store's repair, which records a hand-back and no ``recovered`` event (no attempt
   began): ``handoffd run``'s ``recovered_pending`` never counted such a hand-back still
   pending. That hand-back (its reason) now tells it untried; a stop's hand-back of a takeover
   that did run again does not.

This module stops and starts a throw-away cluster of its own (tests/pgserver.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pgserver
import pytest
from conftest import FLAKY_TOML, Workspace, exe, new_workspace
from test_postgres_outage_s20 import down, own_server, up  # noqa: F401  (own_server: a fixture)

from handoffd.backends.postgres.connection import Database
from handoffd.core.workspace import Workspace as HandoffdWorkspace

POOLED = 14  # idle connections when the server restarts: well past what a short window lasts
WINDOW = 4.0  # the reconnect window: six backoff steps (0.1 .. 2 s) are over 5 s


# ---------------------------------------------------------------- 1. stale pooled connections
def test_an_operation_after_a_restart_gets_a_live_connection_however_many_were_pooled(
        own_server: pgserver.PgServer) -> None:  # noqa: F811
    db = Database(own_server.new_database(), max_size=POOLED, reconnect_seconds=WINDOW)
    try:
        held = [db.pool.getconn(timeout=20) for _ in range(POOLED)]
        for conn in held:
            db.pool.putconn(conn)
        assert db.pool.get_stats()["pool_available"] == POOLED
        for _ in range(3):  # the hot path: no live connection passed over
            db.run(lambda conn, retried: conn.execute("SELECT 1"))
        assert db.pool.get_stats().get("returns_bad", 0) == 0
        down(own_server)
        up(own_server)
        calls: list[bool] = []

        def one(conn: Any, retried: bool) -> int:
            calls.append(retried)
            return int(conn.execute("SELECT 1").fetchone()[0])
        assert db.run(one) == 1  # (before: StoreUnavailable, the server back)
        # every pooled connection the restart ended was passed over at its checkout (closed,
        # given back, replaced): the operation ran once, on a live one
        assert calls == [False], calls
        assert db.pool.get_stats().get("returns_bad", 0) == POOLED
    finally:
        db.close()


# ---------------------------------------------------------------- 2. the connect timeout
@pytest.mark.parametrize("value", ["0", "0.5", "3601", "true", '"5"', "nan"])
def test_a_bad_connect_timeout_is_one_line_and_exit_2(tmp_path: Path, value: str) -> None:
    space = new_workspace(tmp_path / "ws", FLAKY_TOML + "\n[store]\nurl = \"postgresql://x@/db\"\n"
                          f"connect_timeout_seconds = {value}\n")
    done = space.handoff("ls")
    assert done.returncode == 2, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert "[store] connect_timeout_seconds" in line and "1..3600 seconds" in line, line
    assert "Traceback" not in done.stderr


def test_the_connect_timeout_reaches_every_connection(
        tmp_path: Path, own_server: pgserver.PgServer,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from handoffd.cli import db_cmd
    from handoffd.features.build import open_backend
    space = new_workspace(tmp_path / "ws", FLAKY_TOML + "\n[store]\nurl = \""
                          + own_server.new_database() + "\"\nconnect_timeout_seconds = 3\n")
    asked: list[Any] = []
    real = psycopg.connect

    def connect(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("connect_timeout"))
        return real(*args, **kwargs)
    monkeypatch.setattr(psycopg, "connect", connect)
    db_cmd.init(root=space.root, store=None)  # (its first connection, then its own)
    assert asked and set(asked) == {3}, asked
    asked.clear()
    ws = HandoffdWorkspace(space.root)
    backend: Any = open_backend(ws, ws.load_config())
    try:
        assert backend.db.connect_timeout == 3
        assert backend.db.pool.kwargs["connect_timeout"] == 3  # (the pool's connections)
        assert backend._holds.session() > 0  # the key-holding session
        unsubscribe = backend.subscribe(lambda *_: None)  # the wake-up listener's session
        backend._present()  # the presence session (as a first claim starts it)
        assert backend._listener.connect_timeout == backend._presence.connect_timeout == 3
        unsubscribe()
    finally:
        backend.close()
    assert asked and set(asked) == {3}, asked


# ---------------------------------------------------------------- 3. recovered hand-backs counted
def batch_done(space: Workspace) -> dict[str, Any]:
    """The ``batch_done`` record of one ``handoffd run`` (json log format, verbose)."""
    done = space.handoffd("run", "--log-format", "json", "-v")
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (found,) = [one for one in records if one.get("event") == "batch_done"]
    return found


@pytest.mark.parametrize("made", ["created", "dropped"])
def test_a_claim_handed_back_before_its_lease_is_counted_as_recovered(
        tmp_path: Path, made: str) -> None:
    config = FLAKY_TOML.replace("claim_grace_seconds = 1.0", "claim_grace_seconds = 0.0")
    space = new_workspace(tmp_path / "ws", config)
    if made == "created":
        hid = space.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    else:  # a document from outside: handed back untouched, with no history of ours
        hid = "foreign-1"
        space.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@flaky"},
                                   "input": {"data": {"mode": "ok"}}})
    crashed = subprocess.run([exe("handoffd"), "run", "--root", str(space.root)],
                             env={**os.environ, "HANDOFFD_CRASH_AT": "after-claim-rename"},
                             capture_output=True, text=True, timeout=60)
    assert crashed.returncode == 99, crashed.stderr  # died between the rename and the lease
    assert space.state_of(hid) == ["in-progress"]
    # a batch that recovers it but cannot run it (no specialist for it here): still pending
    space.write_config(config.split('[specialists."@flaky"]')[0])
    found = batch_done(space)
    assert (found["recovered"], found["recovered_pending"]) == (1, 1), found
    assert "recovered 1 (taken over from a dead or stalled claimer; 1 back in pending/, not " \
           "run again yet)" in found["message"], found["message"]
    assert space.state_of(hid) == ["pending"]
    if made == "created":  # a hand-back, and no "recovered": no attempt began
        events = [entry["event"] for entry in space.doc(hid)["handoffd"]["history"]]
        assert events[-2:] == ["created", "handed_back"], events
    # run again: once run, it is no longer said pending, and its attempt was not charged
    space.write_config(config)
    again = batch_done(space)
    assert (again["completed"], again["recovered"], again["recovered_pending"]) == (1, 0, 0)
    assert space.state_of(hid) == ["completed"]
    assert [run["attempt"] for run in space.runs() if run["id"] == hid] == [1]


def test_a_takeover_run_again_then_handed_back_at_the_batch_end_is_not_said_untried(
        tmp_path: Path) -> None:
    """A stop's hand-back (``--max-seconds``) ends an attempt that ran: the takeover it ended
    was run again, and is not counted "back in pending/, not run again yet" (review RD)."""
    config = FLAKY_TOML.replace("claim_grace_seconds = 1.0", "claim_grace_seconds = 0.0")
    space = new_workspace(tmp_path / "ws", config)
    hid = space.create("--to", "@flaky", "--data", json.dumps({"mode": "sleep", "seconds": 30}))
    crashed = subprocess.run([exe("handoffd"), "run", "--root", str(space.root)],
                             env={**os.environ, "HANDOFFD_CRASH_AT": "after-claim-lease"},
                             capture_output=True, text=True, timeout=60)
    assert crashed.returncode == 99, crashed.stderr  # died holding its lease
    done = space.handoffd("run", "--max-seconds", "4", "--log-format", "json", "-v")
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (found,) = [one for one in records if one.get("event") == "batch_done"]
    events = [entry for entry in space.doc(hid)["handoffd"]["history"]]
    assert [e["event"] for e in events][-2:] == ["claimed", "handed_back"], events
    assert events[-1]["detail"].get("interrupted") is True, events[-1]
    assert (found["recovered"], found["recovered_pending"]) == (1, 0), found
    assert "not run again yet" not in found["message"], found["message"]
