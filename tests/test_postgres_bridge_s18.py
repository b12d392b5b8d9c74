"""The PostgreSQL store's file bridge seen from the commands (session 18, R16 defects 1, 2, 4 and
5): a file dropped into pending/ is a handoff for every ``handoff`` command and the Python client
before any daemon ingests it, and ``create --id`` never takes its id; the result files written
back into the workspace go when their handoff is purged, archived or retried, and an old one
never answers a new drop of the same id; a dropped file the bridge sets aside is counted, and
logged, as on a files store.

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, reason_codes
from test_postgres import backend, pg_workspace, request, sql
from test_postgres_hostile import bridge, local_store

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now


def ok(proc: Any) -> Any:
    """``proc`` when it exited 0 without a traceback (else the assertion shows its stderr)."""
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def listed(space: Workspace) -> dict[str, str]:
    """id -> state, as ``handoff ls --json`` lists them."""
    return {r["id"]: r["state"] for r in json.loads(ok(space.handoff("ls", "--json")).stdout)}


# ---------------------------------------------------------------- 1: a drop is a handoff at once
def test_a_dropped_file_is_a_handoff_for_every_command_before_any_daemon(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("x1.json", request("x1", "@flaky", {"mode": "ok", "who": "file agent"}))
    junk = space.drop("junk.json", b"\xff\xfe")  # never a document: set aside, with its stub
    os.utime(junk, (time.time() - 60, time.time() - 60))  # (settled: not one being written)
    shown_ls = ok(space.handoff("ls", "--json"))
    rows = json.loads(shown_ls.stdout)
    assert {r["id"]: r["state"] for r in rows if r["state"] != "quarantined"} == {
        "x1": "pending", "junk": "failed"}  # it was: nothing listed
    # and the file set aside, as a files store lists it
    aside = [r["id"] for r in rows if r["state"] == "quarantined"]
    assert len(aside) == 1 and aside[0].endswith("-junk.json"), rows
    assert shown_ls.stderr == ""  # no raw log line: the listing says what became of each
    assert space.state_of("x1") == []  # ingested by the command, as a daemon would
    shown = json.loads(ok(space.handoff("show", "x1", "--json")).stdout)
    assert shown["state"] == "pending"
    assert space.handoff("wait", "x1", "--timeout", "0.3").returncode == 124  # was 3
    # its id is taken: the quick form, the full command line (--if-absent) and --depends-on
    taken = space.handoff("create", "--to", "@flaky", "--id", "x1", "--data", '{"who": "cli"}')
    assert taken.returncode == 1 and "already exists" in taken.stderr, taken.stderr
    other = space.handoff("create", "--to", "@flaky", "--id", "x1", "--if-absent",
                          "--data", '{"who": "cli"}')
    assert other.returncode == 5, other.stderr
    ok(space.handoff("create", "--to", "@flaky", "--id", "after-x1", "--depends-on", "x1",
                     "--data", '{"mode": "ok"}'))
    # a second drop, cancelled by the command line before any daemon saw it
    space.drop("x2.json", request("x2", "@flaky", {"mode": "ok"}))
    assert "cancelled" in ok(space.handoff("cancel", "x2", "--reason", "not needed")).stdout
    ok(space.handoffd("run"))
    # the file agent's request ran (it was set aside as a duplicate of the CLI's, unanswered)
    assert space.state_of("x1") == ["completed"]
    assert space.doc("x1")["output"]["echo"]["who"] == "file agent"
    assert space.state_of("x2") == ["failed"]
    assert space.doc("x2")["error"]["code"] == "CANCELLED"
    assert listed(space)["after-x1"] == "completed"
    assert reason_codes(space.root) == {"junk.json": "NOT_UTF8"}
    assert space.doc("junk")["error"]["code"] == "NOT_UTF8"


def test_the_python_client_sees_a_dropped_file_and_never_takes_its_id(
        tmp_path: Path, pg_url: str) -> None:
    from handoffd.core.errors import DuplicateHandoff
    from handoffd.service.client import Client
    space = pg_workspace(tmp_path / "ws", pg_url)
    client = Client(space.root)
    try:
        space.drop("y1.json", request("y1", "@flaky", {"mode": "ok"}))
        assert client.get("y1").state is State.PENDING
        space.drop("y2.json", request("y2", "@flaky", {"mode": "ok"}))
        with pytest.raises(DuplicateHandoff):
            client.create(to="@flaky", data={"who": "client"}, handoff_id="y2")
        space.drop("y3.json", request("y3", "@flaky", {"mode": "ok"}))
        assert {row["id"] for row in client.list()} == {"y1", "y2", "y3"}
    finally:
        client.engine.backend.close()


def test_create_never_takes_the_id_of_a_file_still_being_written(tmp_path: Path,
                                                                 pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    half = space.drop("h1.json", '{"handoff_id": "h1", "targ')
    future = time.time() + 600  # young (being written) for the whole test
    os.utime(half, (future, future))
    for extra in ((), ("--priority", "high", "--wait-timeout", "1", "--wait")):
        taken = space.handoff("create", "--to", "@flaky", "--id", "h1", *extra)
        assert taken.returncode == 1 and "already exists in pending/" in taken.stderr, \
            taken.stderr
    assert half.exists() and listed(space) == {}


# ---------------------------------------------------------------- 2: purged results go
def test_a_purged_result_file_goes_and_never_answers_a_new_drop(tmp_path: Path,
                                                                 pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("r1.json", request("r1", "@flaky", {"mode": "ok", "v": 1}))
    ok(space.handoffd("run"))
    assert space.state_of("r1") == ["completed"]
    assert "purged 1" in ok(space.handoff("purge", "--older-than", "0")).stdout
    ok(space.handoffd("run"))  # the bridge's sync: its result file goes, as on files
    assert space.state_of("r1") == []
    # the same id dropped again (within the seen window): set aside, never answered by v1
    space.drop("r1.json", request("r1", "@flaky", {"mode": "ok", "v": 2}))
    ok(space.handoffd("run"))
    assert space.state_of("r1") == []
    assert space.handoff("wait", "r1", "--timeout", "1").returncode == 3


def test_a_new_drop_is_checked_after_the_purge_even_before_a_daemon_ran(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("r2.json", request("r2", "@flaky", {"mode": "ok", "v": 1}))
    ok(space.handoffd("run"))
    ok(space.handoff("archive", "--older-than", "0"))
    space.drop("r2.json", request("r2", "@flaky", {"mode": "ok", "v": 2}))
    ok(space.handoff("ls"))  # the command ingests: the archived result goes first
    assert space.state_of("r2") == []


def test_a_purged_stub_of_a_file_set_aside_goes_too(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("bad1.json", b"\xff\xfe")
    space.handoffd("run")
    assert space.state_of("bad1") == ["failed"]
    ok(space.handoff("purge", "--older-than", "0"))
    ok(space.handoffd("run"))
    assert space.state_of("bad1") == []


def test_only_the_stale_file_the_bridge_wrote_is_removed(tmp_path: Path, pg_url: str) -> None:
    """In-process: a result written for a newer handoff under the purged one's id, and a file
    handoffd did not write, stay; a drop whose id a result file here still holds, while the
    database holds no such handoff, is set aside as on a files store."""
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(store_db, local_store(root))
    space = Workspace(root)

    def finished(at: str, output: Any) -> dict[str, Any]:
        return {**request("s1", "@a"), "status": "completed", "output": output,
                "handoffd": {"revision": 3, "history": [{"at": at, "event": "completed"}]}}
    try:
        store_db.import_finished("s1", State.COMPLETED, finished("2026-01-01T00:00:00Z", 1),
                                 utc_now(), origin="host:a")
        assert files.export() == 1 and space.doc("s1")["output"] == 1
        assert store_db.purge("s1", State.COMPLETED, utc_now())
        # a newer handoff reused the id and its result was written before the recheck ran
        store_db.import_finished("s1", State.COMPLETED, finished("2026-01-02T00:00:00Z", 2),
                                 utc_now(), origin="host:a")
        assert files.export() == 1
        assert files.recheck() == 0 and space.doc("s1")["output"] == 2
        assert sql(pg_url, "SELECT count(*) FROM handoffd.records") == [(0,)]
        # purged now: it goes, once
        assert store_db.purge("s1", State.COMPLETED, utc_now())
        assert files.recheck() == 1 and space.state_of("s1") == []
        # a file another consumer wrote under a purged handoff's id is not ours to remove
        store_db.import_finished("s2", State.FAILED, {"handoff_id": "s2"}, utc_now(),
                                 origin="host:a")
        assert store_db.purge("s2", State.FAILED, utc_now())
        (root / "handoffs" / "failed" / "s2.json").write_text('{"handoff_id": "s2"}')
        assert files.recheck() == 0 and space.state_of("s2") == ["failed"]
        # and a new drop of that id is a duplicate here (the files store's rule)
        space.drop("s2.json", request("s2", "@a"))
        assert files.ingest("s2") == "set aside"
        assert reason_codes(root) == {"s2.json": "DUPLICATE_HANDOFF_ID"}
        assert store_db.ingested("s2") is None
    finally:
        store_db.close()


# ---------------------------------------------------------------- 4: retry removes failed/ file
def test_a_retry_removes_the_old_failed_file_at_once(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("rf.json", request("rf", "@flaky", {"mode": "permanent"}))
    space.handoffd("run")
    assert space.state_of("rf") == ["failed"]
    ok(space.handoff("pause", "@flaky"))
    ok(space.handoff("retry", "rf", "--force"))
    assert space.state_of("rf") == []  # pending again: its failure answers no more
    assert listed(space)["rf"] == "pending"


def test_a_retry_on_another_host_removes_the_failed_file_on_the_serving_origin(
        tmp_path: Path, pg_url: str) -> None:
    host_a = pg_workspace(tmp_path / "a", pg_url)
    host_b = pg_workspace(tmp_path / "b", pg_url, specialists=False)
    try:
        host_a.serve()
        host_a.drop("rc.json", request("rc", "@nobody"))  # served nowhere: it only waits
        deadline = time.monotonic() + 30
        while listed(host_b).get("rc") != "pending":
            assert time.monotonic() < deadline, "never ingested"
            time.sleep(0.05)
        ok(host_b.handoff("cancel", "rc"))
        assert host_a.wait_state("rc", ("failed",)) == "failed"
        ok(host_b.handoff("retry", "rc", "--force"))
        deadline = time.monotonic() + 30
        while host_a.state_of("rc"):
            assert time.monotonic() < deadline, "the old failed/rc.json stayed"
            time.sleep(0.05)
        assert listed(host_a)["rc"] == "pending"
    finally:
        host_a.cleanup()
        host_b.cleanup()


def test_a_retry_from_another_host_removes_the_file_on_the_origin_host(
        tmp_path: Path, pg_url: str) -> None:
    """In-process: the origin's bridge hears the handoff went back to pending."""
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(store_db, local_store(root))
    space = Workspace(root)
    failed = {**request("rg", "@a"), "status": "failed",
              "handoffd": {"revision": 2, "history": [{"at": "2026-01-01T00:00:00Z",
                                                       "event": "failed"}]}}
    try:
        store_db.import_finished("rg", State.FAILED, failed, utc_now(), origin="host:a")
        assert files.export() == 1 and space.state_of("rg") == ["failed"]
        assert files.retracted("rg") == 0  # still failed: the file stays
        assert space.state_of("rg") == ["failed"]
        assert store_db.reopen("rg", {**request("rg", "@a")})
        assert files.retracted("rg") == 1 and space.state_of("rg") == []
    finally:
        store_db.close()


# ---------------------------------------------------------------- 5: set-asides are counted
def test_a_file_the_bridge_sets_aside_is_counted_and_logged(tmp_path: Path,
                                                            pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("bin1.json", b"\xff\xfe")
    done = space.handoffd("run")
    assert done.returncode == 1 and "failed 1" in done.stderr, done.stderr  # as on files
    assert space.doc("bin1")["error"]["code"] == "NOT_UTF8"
    stats = json.loads(ok(space.handoff("stats", "--json")).stdout)
    assert sum(a["failed"] for a in stats["agents"]) == 1
    assert any(a["errors"].get("NOT_UTF8") for a in stats["agents"])
    events = [e[0]["event"] for e in sql(pg_url, "SELECT event FROM handoffd.event_log "
                                                 "ORDER BY seq")]
    assert events == ["set_aside", "rejected"]
