"""The PostgreSQL store's file bridge and recovery at their edges: a document a workspace dropped
that the daemon then sets aside comes back to that workspace's failed/; a pending document moved
in by ``handoffd db import`` keeps its sealed bookkeeping (a scheduled retry, a parked parent);
an in-progress row without a lease token is recovered, never stuck.

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py)."""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import FLAKY_TOML, Workspace, new_workspace
from test_postgres import LEASE, backend, pg_workspace, request, sql
from test_postgres_hostile import bridge, foreign_row, local_store, native_text

from handoffd.core.states import State
from handoffd.core.timeutil import parse_iso, utc_now

# the settings of FLAKY_TOML without its specialist, for workspaces that register others
BASE_TOML = FLAKY_TOML.split('[specialists."@flaky"]')[0]
FLAKY_ONLY = '[specialists."@flaky"]' + FLAKY_TOML.split('[specialists."@flaky"]')[1]


# ---------------------------------------------------------------- set aside after ingesting
def test_the_stub_of_a_row_set_aside_goes_to_the_workspace_that_ingested_it(
        tmp_path: Path, pg_url: str) -> None:
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(store_db, local_store(root))  # origin "host:a"
    space = Workspace(root)
    try:
        space.drop("odd-1.json", {"handoff_id": "odd-1", "target_agent": "@a", "input": {}})
        assert files.ingest("odd-1") == "ingested" and space.state_of("odd-1") == []
        # what admission does with a document that must never run: set it aside, file a stub
        assert store_db.set_aside("odd-1", State.PENDING, "UNKNOWN_FORMAT", "no format")
        assert store_db.create_failed("odd-1", {"handoff_id": "odd-1", "status": "failed"})
        assert store_db.origin_of("odd-1") == "host:a"
        assert files.export() == 1 and space.state_of("odd-1") == ["failed"]
        assert space.doc("odd-1")["status"] == "failed"
        assert files.export() == 0  # written once
        # a stub after another id's set-aside, or after none, is nobody's file
        store_db.create(request("made-1"), "made-1", utc_now())
        assert store_db.set_aside("made-1", State.PENDING, "UNKNOWN_FORMAT", "no format")
        assert store_db.create_failed("other-1", {"handoff_id": "other-1", "status": "failed"})
        assert store_db.create_failed("made-1", {"handoff_id": "made-1", "status": "failed"})
        assert store_db.origin_of("other-1") is None and store_db.origin_of("made-1") is None
    finally:
        store_db.close()


@pytest.mark.parametrize("doc", [
    {"handoff_id": "bad-1", "source_agent": "@x", "target_agent": "@flaky", "input": {}},
    dict(request("not-bad-1", "@flaky", {"mode": "ok"})),
], ids=["UNKNOWN_FORMAT", "ID_MISMATCH"])
def test_a_file_the_daemon_sets_aside_comes_back_to_its_hosts_failed_folder(
        tmp_path: Path, pg_url: str, doc: dict[str, object]) -> None:
    host_a = pg_workspace(tmp_path / "a", pg_url, specialists=False)
    host_b = pg_workspace(tmp_path / "b", pg_url)
    try:
        host_a.serve()
        host_b.serve()
        host_a.drop("bad-1.json", doc)
        assert host_a.wait_state("bad-1", ("failed",), timeout=30) == "failed"
        assert host_a.doc("bad-1")["error"]["code"] in ("UNKNOWN_FORMAT", "ID_MISMATCH")
        assert sql(pg_url, "SELECT id FROM handoffd.quarantine") == [("bad-1",)]
        assert host_b.state_of("bad-1") == [] and host_b.runs() == []
    finally:
        host_a.cleanup()
        host_b.cleanup()


# ---------------------------------------------------------------- db import keeps bookkeeping
def test_an_imported_retry_keeps_its_attempts_and_its_due_time(tmp_path: Path,
                                                              pg_url: str) -> None:
    space = new_workspace(tmp_path / "ws", FLAKY_TOML.replace("retry_delay_seconds = 0.2",
                                                              "retry_delay_seconds = 600"))
    space.create("--from", "@t", "--to", "@flaky", "--id", "job-1", "--data", '{"mode": "fail"}')
    space.handoffd("run")  # attempt 1 fails: its retry is due in 10 minutes
    sealed = space.doc("job-1")["handoffd"]
    assert space.state_of("job-1") == ["pending"] and sealed["attempt"] == 1
    due = parse_iso(sealed["next_attempt_at"])
    imported = space.handoffd("db", "import", "--store", pg_url, "--json")
    assert imported.returncode == 0, imported.stderr
    assert sql(pg_url, "SELECT raw, due_at FROM handoffd.handoffs WHERE id = 'job-1'") \
        == [(False, due)]
    store_db = backend(pg_url)
    try:
        assert store_db.claim_next(["@flaky"], due - timedelta(seconds=1), LEASE) is None
        claim = store_db.claim_next(["@flaky"], due, LEASE)
        assert claim is not None and claim.id == "job-1" and claim.attempt == 2
        events = [e["event"] for e in claim.doc["handoffd"]["history"]]
        assert events.count("claimed") == 2 and "retry_scheduled" in events, events
    finally:
        store_db.close()


PARENT = """import json, os, sys
from pathlib import Path
sys.stdin.read()
with open(Path(os.environ["HANDOFFD_ROOT"]) / "parent-runs.txt", "a") as runs:
    runs.write(os.environ["HANDOFF_ATTEMPT"] + "\\n")
print(json.dumps({"status": "delegated", "aggregation": "all_success",
                  "delegate": [{"to": "@flaky", "data": {"mode": "ok"}}]}))
"""


@pytest.mark.heavy
def test_an_imported_parked_parent_aggregates_instead_of_running_again(tmp_path: Path,
                                                                      pg_url: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent_toml = (f'[specialists."@parent"]\ncommand = ["{sys.executable}", "{script}"]\n'
                   "timeout_seconds = 20\n")
    space = new_workspace(tmp_path / "ws", BASE_TOML + parent_toml + FLAKY_ONLY)
    try:
        space.handoff("pause", "@flaky", check=True)  # its child waits here (not imported)
        space.create("--from", "@t", "--to", "@parent", "--id", "par-1")
        space.handoffd("run")  # it delegates; parked until its child is done
        assert "waiting_children" in space.doc("par-1")["handoffd"]
        assert space.state_of("par-1.c1") == ["pending"]
        imported = space.handoffd("db", "import", "--store", pg_url, "--json")
        assert imported.returncode == 0, imported.stderr
        assert json.loads(imported.stdout)["imported"]["pending"] == 2
        assert sql(pg_url, "SELECT id, raw FROM handoffd.handoffs ORDER BY id") \
            == [("par-1", False), ("par-1.c1", False)]
        space.write_config(BASE_TOML + parent_toml + FLAKY_ONLY + f'\n[store]\nurl = "{pg_url}"\n')
        space.serve()
        assert space.wait_state("par-1", timeout=60) == "completed"
        assert space.doc("par-1")["aggregated_outcome"]["strategy_used"] == "all_success"
        assert (space.root / "parent-runs.txt").read_text().split() == ["1"]  # never again
        assert [r["id"] for r in space.runs()] == ["par-1.c1"]
    finally:
        space.cleanup()


# ---------------------------------------------------------------- claims without a token
def test_an_in_progress_row_without_a_lease_token_is_recovered(pg_url: str) -> None:
    store_db = backend(pg_url)
    try:
        foreign_row(pg_url, "stuck-1", "in-progress", native_text("stuck-1", "{}"))
        store_db.create(request("live-1"), "live-1", utc_now())
        live = store_db.claim("live-1", utc_now(), LEASE)
        assert live is not None
        [taken] = store_db.expired_claims(utc_now(), LEASE)
        assert taken.id == "stuck-1" and taken.recovered
        assert sql(pg_url, "SELECT lease_token FROM handoffd.handoffs WHERE id = 'stuck-1'") \
            == [(taken.token,)]
        assert store_db.expired_claims(utc_now(), LEASE) == []  # its new lease holds
        assert store_db.renew(live, utc_now(), LEASE)  # the live claim was never touched
    finally:
        store_db.close()
