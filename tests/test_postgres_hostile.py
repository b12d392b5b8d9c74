"""The PostgreSQL store against what others may leave in it or in a workspace: rows written by
anyone with access to the database (ids that climb out of a folder, JSON Python cannot load),
files dropped with forged bookkeeping or under an id used before, a table altered by hand, a
role without rights, a URL libpq cannot parse, and a server that goes away while a caller has a
time limit of its own.

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py); a
server "going away" is one database refusing connections, so other tests never notice."""
from __future__ import annotations

import json
import logging
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pgserver
import pytest
from conftest import FLAKY_TOML, Workspace, wait_until
from test_postgres import T0, backend, request  # the same documents and stores

from handoffd.core.errors import InvalidDocument, UnreadableDocument, WaitTimeout
from handoffd.core.states import State
from handoffd.core.workspace import Workspace as HandoffdWorkspace

LEASE = 30.0
BOUND = 30.0  # seconds a call that must not hang is given (it ends in about one)
# rows PostgreSQL accepts and Python's json cannot load (or that are no document at all)
UNLOADABLE = {"deep": ("[" * 3000 + "]" * 3000, "MALFORMED_JSON"),
              "bigint": ("9" * 5000, "MALFORMED_JSON"),
              "inf": ("1e400", "MALFORMED_JSON")}


def sql(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        cur = conn.execute(statement, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def foreign_row(url: str, handoff_id: str, state: str, doc_text: str, *, target: str = "@a",
                origin: str | None = None, lease_expired: bool = False) -> None:
    """A row as anyone with access to the database may write it, past handoffd."""
    lease = ("'t-foreign', now() - interval '1 hour'" if lease_expired else "NULL, NULL")
    sql(url, "INSERT INTO handoffd.handoffs (id, state, doc, target, due_at, updated_at, "
             f"created_at, origin, lease_token, lease_expires_at) VALUES (%s, %s, %s::json, %s, "
             f"'2001-01-01', now(), now(), %s, {lease})",
        handoff_id, state, doc_text, target, origin)


def native_text(handoff_id: str, data: str, target: str = "@a") -> str:
    """A native request as JSON text whose ``input.data`` is ``data``, verbatim."""
    return ('{"handoff_id": "%s", "timestamp": "2026-01-01T00:00:00Z", "status": "pending", '
            '"source": {"agent_id": "@x"}, "target": {"agent_id": "%s"}, "input": {"data": %s}}'
            % (handoff_id, target, data))


def pg_workspace(root: Path, url: str) -> Workspace:
    root.mkdir(parents=True, exist_ok=True)
    space = Workspace(root)
    space.write_config(FLAKY_TOML + f'\n[store]\nurl = "{url}"\n')
    HandoffdWorkspace(root).ensure()
    return space


def local_store(root: Path) -> Any:
    from handoffd.backends.files.store import Store
    HandoffdWorkspace(root).ensure()
    return Store(HandoffdWorkspace(root), durable=False, settle_seconds=0.2)


def bridge(store_db: Any, local: Any, origin: str = "host:a") -> Any:
    from handoffd.backends.postgres.bridge import FileBridge

    def stub(handoff_id: str, code: str, message: str) -> dict[str, Any]:
        return {"handoff_id": handoff_id, "status": "failed",
                "error": {"code": code, "message": message}}
    return FileBridge(store_db, local, origin, stub=stub)


def quarantine_codes(url: str) -> dict[str, str]:
    return {str(i): str(c) for i, c in sql(url, "SELECT id, code FROM handoffd.quarantine")}


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1 and "Traceback" not in text \
        and "internal error" not in text


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``call`` on a daemon thread; its result or exception lands in the dict."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = call()
        except BaseException as exc:  # the test looks at what it raised
            out["error"] = exc
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def cut_off(server: pgserver.PgServer, url: str, *, allowed: bool) -> None:
    """Make the test's database refuse every connection (and end its sessions), or allow them
    again: to its clients, the server is away."""
    name = url.split("?")[0].rsplit("/", 1)[1]
    server.admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
    if not allowed:
        server.admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                     f"datname = '{name}'")


# ---------------------------------------------------------------- r3: ids that become paths
def test_ids_from_the_database_never_become_paths_outside_the_workspace(
        tmp_path: Path, pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "host-a" / "ws"
    files = bridge(store_db := backend(pg_url), local_store(root))
    victim = tmp_path / "host-a" / "victim.json"  # beside the workspace, not in it
    victim.write_text('{"precious": true}\n')
    doc = json.dumps({"handoff_id": "x", "status": "completed", "output": {"pwned": True}})
    try:
        for hid, state in (("../../../victim", "completed"), ("../../../../planted", "failed"),
                           ("fine", "completed")):
            foreign_row(pg_url, hid, state, doc, origin="host:a")
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert files.export() == 1  # only "fine" becomes a file
            assert files.export() == 0  # the others are gone: said once, never again
        assert victim.read_text() == '{"precious": true}\n'
        assert not (tmp_path / "planted.json").exists()
        assert (root / "handoffs" / "completed" / "fine.json").exists()
        assert quarantine_codes(pg_url) == {"../../../victim": "UNSAFE_ID",
                                            "../../../../planted": "UNSAFE_ID"}
        said = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
        assert len(said) == 2 and all("UNSAFE_ID" in m for m in said), said
    finally:
        store_db.close()


def test_an_unsafe_id_is_refused_wherever_it_is_read(pg_url: str) -> None:
    store_db = backend(pg_url)
    try:
        store_db.create(request("good"), "good", T0)
        foreign_row(pg_url, "../escape", "pending", json.dumps(request("x")))
        listed = {r.id: r for r in store_db.list(unreadable=True)}
        problem = listed["../escape"].problem
        assert isinstance(problem, UnreadableDocument) and problem.code == "UNSAFE_ID"
        assert [r.id for r in store_db.list()] == ["good"]
        with pytest.raises(UnreadableDocument) as peeked:
            store_db.peek("../escape")
        assert peeked.value.code == "UNSAFE_ID"
        with pytest.raises(UnreadableDocument) as claimed:  # its due time comes first
            store_db.claim_next(("@a",), T0 + timedelta(days=3650), LEASE)
        assert claimed.value.handoff_id == "../escape"
        assert store_db.set_aside("../escape", State.PENDING, "UNSAFE_ID", "refused")
        assert store_db.claim_next(("@a",), T0 + timedelta(days=3650), LEASE).id == "good"
    finally:
        store_db.close()


# ---------------------------------------------------------------- r4: JSON Python cannot load
def test_rows_python_cannot_load_are_unreadable_rows_never_errors(pg_url: str) -> None:
    store_db = backend(pg_url)
    try:
        store_db.create(request("good"), "good", T0)
        for hid, (data, _) in UNLOADABLE.items():
            foreign_row(pg_url, hid, "pending", native_text(hid, data))
        foreign_row(pg_url, "arr", "pending", "[1, 2]")
        foreign_row(pg_url, "deep-done", "completed",
                    native_text("deep-done", UNLOADABLE["deep"][0]))
        expected = {hid: code for hid, (_, code) in UNLOADABLE.items()}
        expected.update({"arr": "NOT_AN_OBJECT", "deep-done": "MALFORMED_JSON"})
        listed = {r.id: r for r in store_db.list(unreadable=True)}
        assert {h: getattr(r.problem, "code", None) for h, r in listed.items()} == \
            {**expected, "good": None}
        assert [r.id for r in store_db.list()] == ["good"]
        assert [r.id for r in store_db.list(where=lambda r: True)] == ["good"]
        with pytest.raises(InvalidDocument) as shown:
            store_db.get("arr")
        assert shown.value.code == "NOT_AN_OBJECT"
        with pytest.raises(UnreadableDocument):
            store_db.peek("bigint")
        with pytest.raises(UnreadableDocument):
            store_db.claim("inf", T0, LEASE)
        assert sql(pg_url, "SELECT state FROM handoffd.handoffs WHERE id = 'inf'") == \
            [("pending",)]  # the claim rolled back: still there, for set_aside
        for hid in (*UNLOADABLE, "arr"):
            assert store_db.set_aside(hid, State.PENDING, expected[hid], "unreadable")
        kept = {q["file"]: q["document"] for q in store_db.quarantined()}
        assert kept["arr"] == [1, 2] and kept["bigint"] is None  # copied as it was stored
        assert sql(pg_url, "SELECT length(document::text) > 5000 FROM handoffd.quarantine "
                           "WHERE id = 'bigint'") == [(True,)]
    finally:
        store_db.close()


def test_unloadable_claims_records_and_requests_never_stop_a_sweep(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    store_db = backend(pg_url)
    try:
        foreign_row(pg_url, "held", "in-progress", native_text("held", "9" * 5000),
                    lease_expired=True)
        sql(pg_url, "INSERT INTO handoffd.cancels (id, request) VALUES ('held', %s::json)",
            '{"n": ' + "9" * 5000 + "}")
        sql(pg_url, "INSERT INTO handoffd.records (kind, key, value) VALUES ('pause', 'x', "
                    "%s::jsonb)", '{"n": ' + "9" * 5000 + "}")
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert store_db.expired_claims(T0 + timedelta(days=3650), LEASE) == []
            assert store_db.expired_claims(T0 + timedelta(days=3650), LEASE) == []
        said = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
        assert len(said) == 1 and "MALFORMED_JSON" in said[0], said
        assert quarantine_codes(pg_url) == {"held": "MALFORMED_JSON"}
        assert store_db.cancel_requests() == {} and store_db.cancel_request("held") is None
        assert store_db.records().read("pause") == {}
    finally:
        store_db.close()


def test_a_batch_sets_unloadable_rows_aside_once_and_the_cli_lists_them(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    assert space.handoffd("db", "init").returncode == 0
    for hid, (data, _) in UNLOADABLE.items():
        foreign_row(pg_url, hid, "pending", native_text(hid, data, "@flaky"), target="@flaky")
    foreign_row(pg_url, "arr", "pending", "[1, 2]", target="@flaky")
    space.create("--to", "@flaky", "--id", "good-1", "--data", '{"mode": "ok"}')
    listed = space.handoff("ls")
    assert listed.returncode == 0, listed.stderr
    for hid, code in (("deep", "MALFORMED_JSON"), ("bigint", "MALFORMED_JSON"),
                      ("arr", "NOT_AN_OBJECT"), ("good-1", "")):
        assert any(line.startswith(hid + " ") and code in line
                   for line in listed.stdout.splitlines()), listed.stdout
    shown = space.handoff("show", "arr")
    assert shown.returncode == 1 and one_line(shown.stderr), shown.stderr
    ran = space.handoffd("run", timeout=90)  # ends (exit 1: four handoffs failed), each said once
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    assert "completed 1, failed 4" in ran.stderr and ran.stderr.count("set aside") == 4
    assert quarantine_codes(pg_url) == {"deep": "MALFORMED_JSON", "bigint": "MALFORMED_JSON",
                                        "inf": "MALFORMED_JSON", "arr": "NOT_AN_OBJECT"}
    states = dict(sql(pg_url, "SELECT id, state FROM handoffd.handoffs"))
    assert states == {"good-1": "completed", "deep": "failed", "bigint": "failed",
                      "inf": "failed", "arr": "failed"}  # stubs: `handoff wait` on them ends


# ---------------------------------------------------------------- r2: forged bookkeeping
def test_the_bridge_drops_bookkeeping_that_handoffd_did_not_seal(tmp_path: Path,
                                                                 pg_url: str) -> None:
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    local = local_store(root)
    files = bridge(store_db, local)
    space = Workspace(root)
    try:
        forged = request("forged")
        forged["handoffd"] = {"next_attempt_at": "2099-01-01T00:00:00Z", "revision": 4,
                              "awaiting": {"kind": "needs_clarification", "requester": "@evil"}}
        space.drop("forged.json", forged)
        assert files.ingest("forged") == "ingested"
        assert "handoffd" not in store_db.peek("forged")  # neither held nor parked
        # a block this workspace's handoffd sealed there (a document `db import` moves in) stays
        sealed = request("sealed")
        sealed["handoffd"] = {"next_attempt_at": "2099-01-01T00:00:00Z", "revision": 4}
        space.drop("sealed.json", local.encode(sealed, State.PENDING, "sealed"))
        assert files.ingest("sealed") == "ingested"
        assert store_db.peek("sealed")["handoffd"]["next_attempt_at"] == "2099-01-01T00:00:00Z"
    finally:
        store_db.close()


# ---------------------------------------------------------------- r6: an id used before
def test_a_different_document_under_an_ingested_id_is_set_aside(tmp_path: Path,
                                                              pg_url: str) -> None:
    from conftest import reason_codes
    store_db = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(store_db, local_store(root))
    space = Workspace(root)
    try:
        space.drop("job-1.json", request("job-1", data={"marker": "first"}))
        assert files.ingest("job-1") == "ingested"
        claim = store_db.claim("job-1", T0, LEASE)  # the stored document changes from here
        assert claim is not None
        space.drop("job-1.json", request("job-1", data={"marker": "first"}))  # a crash replay
        assert files.ingest("job-1") == "known" and space.state_of("job-1") == []
        space.drop("job-1.json", request("job-1", data={"marker": "SECOND"}))
        assert files.ingest("job-1") == "set aside"
        assert reason_codes(root) == {"job-1.json": "DUPLICATE_HANDOFF_ID"}
        [kept] = [p for p in (root / "handoffs" / ".quarantine").iterdir()
                  if not p.name.endswith(".reason.json")]
        assert "SECOND" in kept.read_text()  # the second document is kept, with its reason
        assert store_db.get("job-1")[1]["input"]["data"] == {"marker": "first"}
    finally:
        store_db.close()


# ---------------------------------------------------------------- r9: the operator's errors
def test_an_unparseable_store_url_is_one_line_without_the_url(ws: Workspace) -> None:
    url = "postgresql://user:s3cret@[::1"
    for command in (("db", "init"), ("sweep",)):
        done = ws.handoffd(*command, "--store", url, timeout=60)
        assert done.returncode == 2 and one_line(done.stderr), done.stderr
        assert "not a valid PostgreSQL URL" in done.stderr and "s3cret" not in done.stderr


def test_a_role_without_rights_is_one_line(ws: Workspace, pg_url: str,
                                           pg_server: pgserver.PgServer) -> None:
    role = f"weak{os.getpid()}"
    pg_server.admin(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object "
                    "THEN NULL; END $$")
    url = pg_url.replace("postgresql://postgres@", f"postgresql://{role}@")
    done = ws.handoffd("db", "init", "--store", url, timeout=60)
    assert done.returncode == 1 and one_line(done.stderr), done.stderr
    assert "permission denied" in done.stderr, done.stderr
    opened = ws.handoffd("sweep", "--store", url, timeout=60)
    assert opened.returncode == 1 and one_line(opened.stderr), opened.stderr


def test_a_table_altered_by_hand_is_refused_at_open_naming_what_is_missing(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    assert space.handoffd("db", "init").returncode == 0
    sql(pg_url, "ALTER TABLE handoffd.handoffs DROP COLUMN lease_owner")
    again = space.handoffd("db", "init")
    assert again.returncode == 1 and one_line(again.stderr), again.stderr
    assert "handoffd.handoffs.lease_owner" in again.stderr and "up to date" not in again.stderr
    ran = space.handoffd("run", "--max-seconds", "4")
    assert ran.returncode == 1 and one_line(ran.stderr), ran.stderr
    from handoffd.backends.postgres.schema import SchemaDamaged
    with pytest.raises(SchemaDamaged, match="lease_owner"):
        backend(pg_url)


def test_the_schema_check_names_every_table_and_column_the_migrations_make(pg_url: str) -> None:
    from handoffd.backends.postgres.schema import REQUIRED
    backend(pg_url).close()  # migrates
    made: dict[str, set[str]] = {}
    for table, column in sql(pg_url, "SELECT table_name, column_name FROM "
                                     "information_schema.columns WHERE table_schema = 'handoffd'"):
        made.setdefault(table, set()).add(column)
    assert {t: set(c) for t, c in REQUIRED.items()} == made


# ---------------------------------------------------------------- r7/r8: a server that is away
@pytest.mark.parametrize("how", ["backend", "handoff wait"])
def test_a_wait_with_a_timeout_ends_on_time_while_the_store_is_away(
        pg_url: str, pg_server: pgserver.PgServer, how: str) -> None:
    from handoffd.service.waiting import wait_terminal  # what `handoff wait` calls
    store_db = backend(pg_url, reconnect_seconds=600.0)  # the window alone would hold it 10 min
    try:
        store_db.create(request("w1"), "w1", T0)
        cut_off(pg_server, pg_url, allowed=False)
        thread, out = in_thread(lambda: store_db.wait_terminal("w1", 1.0) if how == "backend"
                                else wait_terminal(store_db, "w1", 1.0))
        thread.join(BOUND)
        assert not thread.is_alive(), "the wait outlived its timeout"
        assert isinstance(out.get("error"), WaitTimeout), out
        assert "unreachable" in str(out["error"])
    finally:
        cut_off(pg_server, pg_url, allowed=True)
        store_db.close()


def test_an_interrupt_ends_the_retries_of_a_stopping_process(
        pg_url: str, pg_server: pgserver.PgServer, caplog: pytest.LogCaptureFixture) -> None:
    from handoffd.backends.postgres import StoreUnavailable
    store_db = backend(pg_url, reconnect_seconds=600.0)
    try:
        store_db.create(request("s1"), "s1", T0)
        cut_off(pg_server, pg_url, allowed=False)
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            thread, out = in_thread(lambda: store_db.get("s1"))
            wait_until(lambda: any(r.getMessage().startswith("lost the database connection")
                                   for r in caplog.records), BOUND, "the read to retry")
        store_db.interrupt(0.0)
        thread.join(BOUND)
        assert not thread.is_alive(), "the retries outlived the interrupt"
        assert isinstance(out.get("error"), StoreUnavailable), out
    finally:
        cut_off(pg_server, pg_url, allowed=True)
        store_db.close()



def test_resume_lifts_an_interrupt(pg_url: str) -> None:
    """A program that stopped one daemon (its retries cut short) and serves again on the same
    store gets the whole reconnect window back."""
    import math
    store_db = backend(pg_url)
    try:
        store_db.interrupt(0.0)
        assert store_db.db._give_up_at < math.inf
        store_db.resume()
        assert store_db.db._give_up_at == math.inf
    finally:
        store_db.close()
