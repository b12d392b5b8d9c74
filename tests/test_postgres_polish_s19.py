"""The PostgreSQL store's rough edges found by session 18's review (session 19, P1): log lines and
messages that named folders this store never uses (``set aside in-progress/r1.json``, ``answered;
back in pending/``); ``handoff wait`` on a file still being written in pending/, which the files
store waits for and the PostgreSQL store called not found (exit 3); and the result of a handoff
a command ingested, written back only at the daemon's next scan (``rescan_seconds``).

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import FLAKY_TOML, Workspace, exe
from test_postgres import pg_workspace, request
from test_postgres_parked_s18 import ASK, ask_workspace, ok

from handoffd.core.workspace import Workspace as HandoffdWorkspace

HALF = '{"handoff_id": "half1", "input": {"da'  # a producer still writing it


def slow_settling(space: Workspace, *, rescan: float = 1.0) -> None:
    """Files younger than 30 s count as still being written; the daemon rescans every
    ``rescan`` seconds."""
    config = space.root / "handoffd.toml"
    config.write_text(config.read_text().replace("settle_seconds = 0.2", "settle_seconds = 30")
                      .replace("rescan_seconds = 1.0", f"rescan_seconds = {rescan:g}"))


def until(check: object, timeout: float = 30.0) -> None:
    """Wait (bounded) until ``check()`` is true."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


# ---------------------------------------------------------------- 2: what the store did
def test_a_set_aside_claim_is_logged_as_the_database_set_it_aside(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("r1.json", request("other", "@flaky", {"mode": "ok"}))  # its id is not its name
    done = space.handoffd("run")
    lines = [line for line in done.stderr.splitlines() if "set aside" in line]
    assert any("set aside handoff r1 (in-progress) into the database's quarantine table: "
               "ID_MISMATCH" in line for line in lines), done.stderr
    assert "in-progress/" not in done.stderr, done.stderr  # a folder this store never uses
    assert space.state_of("r1") == ["failed"]  # its stub came back to the workspace


def test_answer_says_where_the_handoff_went(tmp_path: Path, pg_url: str) -> None:
    space = ask_workspace(tmp_path, pg_url)
    space.drop("q1.json", request("q1", "@ask", {"mode": "ask"}))
    ok(space.handoffd("run"))
    said = ok(space.handoff("answer", "q1", "--data", '"yes"'))
    assert said.stdout.strip() == "q1: answered; pending again in the shared store"
    # on a files store it is back in pending/, and says so as before
    files = Workspace(tmp_path / "files")
    files.root.mkdir()
    script = tmp_path / "ask-files.py"
    script.write_text(ASK)
    files.write_config(FLAKY_TOML + f'\n[specialists."@ask"]\ncommand = ["{sys.executable}", '
                       f'"-S", "{script}"]\ntimeout_seconds = 20\n')
    HandoffdWorkspace(files.root).ensure()
    files.drop("q1.json", request("q1", "@ask", {"mode": "ask"}))
    ok(files.handoffd("run"))
    said = ok(files.handoff("answer", "q1", "--data", '"yes"'))
    assert said.stdout.strip() == "q1: answered; back in pending/"
    assert files.state_of("q1") == ["pending"]


# ---------------------------------------------------------------- 3: a file still being written
def test_wait_waits_for_a_file_still_being_written_as_on_files(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space)
    half = space.root / "handoffs" / "pending" / "half1.json"
    half.write_text(HALF)
    waited = space.handoff("wait", "half1", "--timeout", "1")
    assert waited.returncode == 124, waited.stderr  # not 3: it is there, being written
    assert "still not finished" in waited.stderr and "Traceback" not in waited.stderr
    assert half.read_text() == HALF  # left to settle, as the files store leaves it
    half.unlink()  # gone: nothing to wait for
    gone = space.handoff("wait", "half1", "--timeout", "5")
    assert gone.returncode == 3 and "no handoff half1" in gone.stderr, gone.stderr


def test_wait_follows_a_file_still_being_written_to_its_result(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space)
    half = space.root / "handoffs" / "pending" / "half1.json"
    try:
        space.serve()
        half.write_text(HALF)
        waiting = subprocess.Popen([exe("handoff"), "wait", "half1", "--timeout", "60", "--root",
                                    str(space.root)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)  # the wait has looked (no clock to inject into another process)
            assert waiting.poll() is None, waiting.communicate()
            half.write_text(json.dumps(request("half1", "@flaky", {"mode": "ok"})))  # finished
            out, err = waiting.communicate(timeout=60)
        finally:
            if waiting.poll() is None:
                waiting.kill()
                waiting.wait()
        assert waiting.returncode == 0, err
        assert out.strip() == "half1 completed"
    finally:
        space.cleanup()


# ---------------------------------------------------------------- 4: results written back at once
def test_a_result_a_command_ingested_is_written_back_at_once(
        tmp_path: Path, pg_url: str) -> None:
    from handoffd.backends.postgres import PostgresBackend
    from handoffd.cli.basics import open_workspace
    from handoffd.core.timeutil import utc_now
    from handoffd.features.build import origin_of
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space, rescan=300)  # a scan would not write it within the test
    origin = origin_of(open_workspace(str(space.root)))
    result = space.root / "handoffs" / "completed" / "c1.json"
    store = PostgresBackend(pg_url)
    try:
        space.serve()
        # what a `handoff` command of this workspace does with a file it finds in pending/
        # before the daemon's watch does (read, ingested under the workspace's name, removed)
        assert store.ingest(request("c1", "@flaky", {"mode": "ok"}), "c1", utc_now(), origin)
        until(result.exists)
        assert json.loads(result.read_text())["output"] == {"echo": {"mode": "ok"}}
    finally:
        store.close()
        space.cleanup()


def test_a_result_ingested_before_the_daemon_started_is_written_back_at_once(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space, rescan=300)
    space.drop("c2.json", request("c2", "@flaky", {"mode": "sleep", "seconds": 1}))
    listed = json.loads(ok(space.handoff("ls", "--json")).stdout)  # the command ingests it
    assert [(r["id"], r["state"]) for r in listed] == [("c2", "pending")]
    assert not os.listdir(space.root / "handoffs" / "pending")
    try:
        space.serve()
        until((space.root / "handoffs" / "completed" / "c2.json").exists)
    finally:
        space.cleanup()
