"""The PostgreSQL store beyond the conformance suite: claimers on several connections, fencing
after a takeover, reconnection, choosing the store, ``handoffd db``, and real processes (a daemon
with the CLI, the file bridge between two hosts' workspaces).

Every test needing a server takes ``pg_url`` (a fresh database on the session's throw-away
cluster, tests/pgserver.py); without a server they are skipped with the reason."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, Workspace, exe, run_python, wait_until

from handoffd.core.config import Config, StoreSettings, load_config
from handoffd.core.documents import record
from handoffd.core.errors import ConfigError
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.workspace import Workspace as HandoffdWorkspace

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
LEASE = 30.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def request(handoff_id: str, target: str = "@a", data: Any = None) -> dict[str, Any]:
    return new_native_request(source="@test", target=target, data=data or {"id": handoff_id},
                              now=T0, handoff_id=handoff_id)


def backend(url: str, **options: Any) -> Any:
    from handoffd.backends.postgres import PostgresBackend
    return PostgresBackend(url, **options)


def sql(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def key_held(url: str, key: int) -> bool:
    """Whether a session of this test's database holds the presence key ``key``."""
    rows = sql(url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND objsubid = 1 AND database = (SELECT oid FROM pg_database WHERE "
                    "datname = current_database()) AND ((classid::bigint << 32) | "
                    "objid::bigint) = %s", key)
    return bool(rows[0][0])


# ---------------------------------------------------------------- choosing the store (no server)
def test_store_url_from_file_env_and_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HANDOFFD_STORE", raising=False)
    (tmp_path / "handoffd.toml").write_text('[store]\nurl = "postgresql://u@h/file"\npool_size = 4\n')
    config = load_config(tmp_path / "handoffd.toml")
    assert config.store == StoreSettings("postgresql://u@h/file", 4, 60.0)
    assert config.store_url() == "postgresql://u@h/file"
    monkeypatch.setenv("HANDOFFD_STORE", "postgres://u@h/env")
    assert config.store_url() == "postgres://u@h/env"  # the environment beats the file
    assert config.store_url("postgresql://u@h/flag") == "postgresql://u@h/flag"  # the flag beats both
    monkeypatch.delenv("HANDOFFD_STORE")
    assert Config().store_url() is None  # no [store]: the workspace's files


@pytest.mark.parametrize("table", ['url = "mysql://x/y"', "url = 3", 'host = "x"', "pool_size = 0",
                                   "reconnect_seconds = -1", 'url = "postgresql://a\\nb"'])
def test_bad_store_settings_are_config_errors(tmp_path: Path, table: str) -> None:
    (tmp_path / "handoffd.toml").write_text(f"[store]\n{table}\n")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "handoffd.toml")


def test_a_files_workspace_never_imports_psycopg(ws: Workspace) -> None:
    code = ("import sys; from handoffd.cli.handoff_cmd import main; sys.argv = ['handoff', "
            f"'create', '--from', '@t', '--to', '@flaky', '--root', {str(ws.root)!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('psycopg' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "HANDOFFD_STORE"}
    done = run_python(code, env=env)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr


def test_an_unreachable_store_is_one_clear_line(ws: Workspace) -> None:
    # (waited for first, as a lost connection is, for reconnect_seconds: session 26)
    ws.write_config((ws.root / "handoffd.toml").read_text() + "\n[store]\nreconnect_seconds = 1\n")
    done = subprocess.run(
        [exe("handoffd"), "sweep", "--root", str(ws.root), "--store",
         "postgresql://nobody@/nowhere?host=/nonexistent-dir&connect_timeout=2"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    waiting, error = done.stderr.strip().splitlines()
    assert waiting.startswith("handoffd: WARNING: waiting for the database at ")
    assert error.startswith("handoffd: error: the PostgreSQL store ") and "unreachable" in error
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- the backend, several connections
def test_concurrent_claimers_on_several_connections_never_share_a_handoff(pg_url: str) -> None:
    writers = [backend(pg_url, pool_size=3) for _ in range(4)]
    try:
        for n in range(200):
            writers[n % 4].create(request(f"c{n:03d}", ("@a", "@b")[n % 2]), f"c{n:03d}", at(n % 7))
        start = threading.Barrier(8)
        got: list[list[str]] = [[] for _ in range(8)]

        def worker(index: int) -> None:
            mine = writers[index % 4]
            start.wait()
            while (claim := mine.claim_next(("@a", "@b"), at(60), LEASE)) is not None:
                got[index].append(claim.id)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        claimed = [i for mine in got for i in mine]
        assert len(claimed) == 200 and len(set(claimed)) == 200
        assert sum(1 for mine in got if mine) >= 2  # the work really was shared
        assert sql(pg_url, "SELECT count(*) FROM handoffd.handoffs WHERE state = 'in-progress'") \
            == [(200,)]
    finally:
        for one in writers:
            one.close()


def test_a_fenced_finish_after_takeover_writes_nothing(pg_url: str) -> None:
    tick = [0.0]
    owner, sweeper = backend(pg_url), backend(pg_url, monotonic=lambda: tick[0])
    try:
        owner.create(request("h1"), "h1", T0)
        stale = owner.claim("h1", at(1), LEASE)
        assert stale is not None
        # its owner's session lives (a stalled owner): taken once watched unrenewed a lease long
        assert sweeper.expired_claims(at(LEASE + 2), LEASE) == []
        tick[0] += LEASE
        taken = sweeper.expired_claims(at(LEASE + 2), LEASE)
        assert [c.id for c in taken] == ["h1"] and "stalled" in str(taken[0].recovered)
        before = sql(pg_url, "SELECT doc, lease_token FROM handoffd.handoffs WHERE id = 'h1'")
        record(stale.doc, "completed", at(LEASE + 3))
        stale.doc["status"] = "completed"
        assert not owner.finish(stale, State.COMPLETED, stale.doc)
        assert not owner.renew(stale, at(LEASE + 3), LEASE)
        assert not owner.requeue(stale, stale.doc, None, count_attempt=False)
        assert sql(pg_url, "SELECT doc, lease_token FROM handoffd.handoffs WHERE id = 'h1'") == before
        record(taken[0].doc, "failed", at(LEASE + 4))
        assert sweeper.finish(taken[0], State.FAILED, taken[0].doc)
        events = sql(pg_url, "SELECT event, state FROM handoffd.events WHERE handoff_id = 'h1' "
                             "ORDER BY seq")
        assert events == [("created", "pending"), ("claimed", "in-progress"), ("failed", "failed")]
        assert sweeper.purge("h1", State.FAILED, at(LEASE + 5))  # retention takes its trail too
        assert sql(pg_url, "SELECT count(*) FROM handoffd.events WHERE handoff_id = 'h1'") == [(0,)]
    finally:
        owner.close()
        sweeper.close()


def test_a_dead_owners_claim_is_taken_over_before_its_lease_expires(pg_url: str) -> None:
    """A claimer holds its presence lock on a session of its own, which ends when it dies: once
    no session has held the key for the grace period (watched on the sweeper's monotonic clock)
    its claim is recovered, long before a 10-minute lease expires. A live owner whose session
    was merely cut takes its key again and keeps its claim."""
    clock = [0.0]
    owner, stale_owner = backend(pg_url), backend(pg_url)
    sweeper = backend(pg_url, owner_grace_seconds=10.0, monotonic=lambda: clock[0])
    try:
        for hid in ("live", "dead"):
            owner.create(request(hid), hid, T0)
        live = owner.claim("live", at(1), 600)
        dead = stale_owner.claim("dead", at(1), 600)
        assert live is not None and dead is not None
        assert sweeper.expired_claims(at(2), 600) == []  # both owners hold their keys
        # the live owner's presence session is cut (the call waits until the sessions have
        # ended): it takes its key again by itself
        sql(pg_url, "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE "
                    "query LIKE '%pg_advisory_lock%' AND pid <> pg_backend_pid() "
                    "AND datname = current_database()")
        stale_owner.close()  # as kill -9 would: its session (and presence lock) ends
        # the server ends a closed session a moment later; other tests' keys (the cluster is
        # shared) are not counted
        wait_until(lambda: not key_held(pg_url, stale_owner.owner_key))
        assert sweeper.expired_claims(at(3), 600) == []  # first seen gone (clock 0)
        wait_until(lambda: key_held(pg_url, owner.owner_key))  # the owner holds its key again
        clock[0] = 5.0
        assert sweeper.expired_claims(at(4), 600) == []  # gone for 5 s only
        clock[0] = 11.0
        taken = sweeper.expired_claims(at(5), 600)
        assert [c.id for c in taken] == ["dead"] and "session" in (taken[0].recovered or "")
        assert owner.renew(live, at(6), 600)  # the live owner was never taken over
        revived = backend(pg_url)  # the dead owner's claim, written through a new handle
        try:
            record(dead.doc, "completed", at(7))
            assert not revived.finish(dead, State.COMPLETED, dead.doc)
        finally:
            revived.close()
        record(taken[0].doc, "completed", at(8))
        assert sweeper.finish(taken[0], State.COMPLETED, taken[0].doc)
    finally:
        owner.close()
        sweeper.close()


def test_lost_connections_are_retried_and_said_once(pg_url: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    store = backend(pg_url, pool_size=2)
    try:
        store.create(request("h1"), "h1", T0)
        held = store.claim("h1", at(1), LEASE)
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                        "datname = current_database() AND pid <> pg_backend_pid()")
            assert store.renew(held, at(2), LEASE)  # a new connection, transparently
            record(held.doc, "completed", at(3))
            assert store.finish(held, State.COMPLETED, held.doc)
        assert store.get("h1")[0] is State.COMPLETED
        said = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
        assert len([m for m in said if m.startswith("lost the database connection")]) == 1, said
        assert len([m for m in said if m.startswith("reconnected to the database")]) == 1, said
    finally:
        store.close()


def test_wakeups_cross_processes_through_notify(pg_url: str) -> None:
    listener, writer = backend(pg_url), backend(pg_url)
    heard = threading.Event()
    stop = listener.subscribe(lambda w: heard.set() if (w.handoff_id, w.kind) == ("x1", "pending")
                              else None)
    try:
        writer.create(request("x1"), "x1", T0)
        assert heard.wait(5), "no NOTIFY from another connection"
    finally:
        stop()
        listener.close()
        writer.close()


def test_a_sweeper_whose_clock_is_ahead_never_takes_a_live_renewing_claim(pg_url: str) -> None:
    """Host b's wall clock runs past a's lease (70 s ahead of a 30 s lease) while a lives and
    renews: b only watches (on its monotonic clock), and each renewal starts its watch again. A
    renewal between b's look and its lock wins too."""
    tick = [0.0]
    owner, sweeper = backend(pg_url), backend(pg_url, monotonic=lambda: tick[0])
    try:
        owner.create(request("h1"), "h1", T0)
        claim = owner.claim("h1", at(1), LEASE)
        assert claim is not None
        for step in range(4):
            assert sweeper.expired_claims(at(70 + step * 20), LEASE) == []
            tick[0] += LEASE * 0.7
            assert owner.renew(claim, at(2 + step * 20), LEASE)  # a live owner renews in time
        assert sweeper.expired_claims(at(200), LEASE) == []
        seen = sweeper.db.run(lambda conn, _: conn.execute(
            "SELECT lease_token, lease_expires_at FROM handoffd.handoffs WHERE id = 'h1'").fetchone())
        assert owner.renew(claim, at(100), LEASE)  # renewed after the look, before the lock
        assert sweeper.db.run(lambda conn, _: sweeper._take_over(
            conn, "h1", ("stale", seen[0], seen[1], None), at(200), LEASE, [])) is None
        assert owner.renew(claim, at(101), LEASE)  # still its owner's
    finally:
        owner.close()
        sweeper.close()


def test_a_process_whose_clock_steps_forward_keeps_its_own_claims(pg_url: str) -> None:
    """Its own sweep, the wall clock stepped past the lease (NTP), takes none of its live claims
    (they would be retried beside their running handlers); one it gave up is taken once
    expired, as given up (handed back, not charged)."""
    from handoffd.core.storage import GIVEN_UP
    tick = [0.0]
    store = backend(pg_url, monotonic=lambda: tick[0])
    try:
        for hid in ("live", "dropped"):
            store.create(request(hid), hid, T0)
        live = store.claim("live", at(1), LEASE)
        dropped = store.claim("dropped", at(1), LEASE)
        assert live is not None and dropped is not None
        store.abandon(dropped)
        taken = store.expired_claims(at(LEASE + 61), LEASE)
        assert [(c.id, c.recovered) for c in taken] == [("dropped", GIVEN_UP)]
        assert store.renew(live, at(LEASE + 62), LEASE)
        assert store.expired_claims(at(3 * LEASE + 61), LEASE) == []  # renewed: watched afresh
    finally:
        store.close()


def test_documents_the_store_cannot_hold_are_refused_or_cleaned(pg_url: str) -> None:
    from handoffd.core.errors import InvalidDocument
    store = backend(pg_url)
    try:
        bad = request("nul")
        bad["input"]["data"] = {"text": "a\u0000b"}
        with pytest.raises(InvalidDocument):
            store.create(bad, "nul", T0)
        assert store.get("nul") is None
        store.create(request("ok"), "ok", T0)
        held = store.claim("ok", at(1), LEASE)
        held.doc["output"] = {"text": "x\u0000y\ud800"}  # a handler's output: kept, cleaned
        record(held.doc, "completed", at(2))
        assert store.finish(held, State.COMPLETED, held.doc)
        assert store.get("ok")[1]["output"] == {"text": "x\ufffdy\ufffd"}
        # the text backslash-u0000 (a regex, source code) is no NUL: kept as it is, both ways
        text = {"regex": "[^\\u0000-\\u001f]", "raw": "\\u0000", "odd": "\\\\u0000"}
        plain = request("text")
        plain["input"]["data"] = text
        store.create(plain, "text", T0)
        held = store.claim("text", at(1), LEASE)
        assert held.doc["input"]["data"] == text
        held.doc["output"] = text
        record(held.doc, "completed", at(2))
        assert store.finish(held, State.COMPLETED, held.doc)
        assert store.get("text")[1]["output"] == text
    finally:
        store.close()


@pytest.mark.parametrize("value, kept", [
    ("a\u0000b", False), ("\\\u0000", False), ("x\ud800y", False), ("[^\\u0000-\\u001f]", True),
    ("\\\\u0000", True), ("\\\\\\u0000", True), ("\\u0000\u0000", False)])
def test_encode_replaces_only_real_nul_characters_and_lone_surrogates(value: str, kept: bool) -> None:
    from handoffd.backends.postgres.records import encode
    from handoffd.core.errors import InvalidDocument
    back = json.loads(encode({"k": value, value: 1}, strict=False))
    if kept:
        assert back == {"k": value, value: 1} and encode({"k": value}, strict=True)
    else:
        assert "\ufffd" in back["k"] and not any(c == "\x00" or "\ud800" <= c <= "\udfff"
                                                 for c in back["k"])
        with pytest.raises(InvalidDocument):
            encode({"k": value}, strict=True)


def test_documents_keep_their_key_order(pg_url: str) -> None:
    """Documents are kept as json text, not jsonb (which sorts keys, shorter first): what comes
    back, through claim, renew, takeover and finish, lists its keys as they were written."""
    ticks = iter(range(0, 10**9, 10**6))  # (its own takeover, judged by the wall clock alone)
    store = backend(pg_url, monotonic=lambda: float(next(ticks)))
    try:
        doc = {"handoff_id": "order", "zeta": 1, "target": {"agent_id": "@a", "phase": 2},
               "input": {"data": {"longest_key_first": 1, "b": 2, "a": 3}}, "c": None}
        store.create(doc, "order", T0)
        order = ["handoff_id", "zeta", "target", "input", "c"]
        assert list(store.get("order")[1])[:5] == order
        held = store.claim("order", at(1), LEASE)
        assert store.renew(held, at(2), LEASE)
        [taken] = store.expired_claims(at(2 + LEASE + 1), LEASE)
        assert store.renew(taken, at(40), LEASE)
        stored = store.get("order")[1]
        assert list(stored)[:5] == order and stored["handoffd"]["lease"]["token"] == taken.token
        assert list(stored["input"]["data"]) == ["longest_key_first", "b", "a"]
        taken.doc["output"] = {"z": 1, "a": 2}
        record(taken.doc, "completed", at(41))
        assert store.finish(taken, State.COMPLETED, taken.doc)
        state, final = store.get("order")
        assert state is State.COMPLETED and list(final)[:5] == order
        assert list(final["output"]) == ["z", "a"]
        assert not store.renew(held, at(42), LEASE)  # a fenced renew changes nothing
    finally:
        store.close()


# ---------------------------------------------------------------- handoffd db
def test_db_init_is_idempotent_and_prints_the_version(ws: Workspace, pg_url: str) -> None:
    from handoffd.backends.postgres import SCHEMA_VERSION
    assert SCHEMA_VERSION == 6
    for applied in ("applied migration(s) 1, 2, 3, 4, 5, 6", "already up to date"):
        done = ws.handoffd("db", "init", "--store", pg_url)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "schema version 6" and applied in done.stderr
    no_store = ws.handoffd("db", "init")
    assert no_store.returncode == 2 and "no PostgreSQL store" in no_store.stderr


@pytest.mark.heavy
def test_db_import_moves_a_files_workspace_in(ws: Workspace, pg_url: str) -> None:
    done_id = ws.create("--from", "@t", "--to", "@flaky", "--data", '{"mode": "ok"}')
    assert ws.handoffd("run").returncode == 0
    waiting = ws.create("--from", "@t", "--to", "@flaky", "--id", "waits-1")
    ws.drop("raw-1.json", request("raw-1", "@flaky"))
    ws.drop("junk.json", "{not json")
    assert ws.handoff("context", "set", "task/goal", "--as", "ABSTRACT_ARCHITECT", "--data",
                      '{"z": 1, "a": 2}').returncode == 0
    (ws.root / "context" / "project-context.json").write_text('{"id":  "proj-001"}')
    (ws.root / "context" / "broken.json").write_text("{")
    (ws.root / "handoffs" / ".meta" / "violations.jsonl").write_text(
        '{"kind": "scope_creep", "agent": "@w", "time": "2026-03-01T12:00:00Z"}\n')
    first = ws.handoffd("db", "import", "--store", pg_url, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["imported"] == {"pending": 2, "completed": 1, "failed": 0}
    assert report["set_aside"] == ["junk"] and report["unreadable"] == ["context/broken.json"]
    assert (report["context"], report["violations"]) == (2, 1)
    values = dict(sql(pg_url, "SELECT key, value FROM handoffd.context"))
    assert values["project-context"] == '{"id":  "proj-001"}'  # byte for byte
    assert values["task/goal"] == (ws.root / "context" / "task" / "goal.json").read_text()
    assert ws.state_of(waiting) == [] and ws.state_of(done_id) == ["completed"]
    again = json.loads(ws.handoffd("db", "import", "--store", pg_url, "--json").stdout)
    assert again["imported"] == {"pending": 0, "completed": 0, "failed": 0} and again["already"] == 2  # + the stub of junk
    assert (again["context"], again["context_already"], again["violations"]) == (0, 2, 0)
    assert sql(pg_url, "SELECT entry->>'kind' FROM handoffd.violations") == [("scope_creep",)]
    states = dict(sql(pg_url, "SELECT id, state FROM handoffd.handoffs"))
    assert states == {done_id: "completed", "waits-1": "pending", "raw-1": "pending",
                      "junk": "failed"}


# ---------------------------------------------------------------- real processes
def pg_workspace(root: Path, url: str, specialists: bool = True) -> Workspace:
    root.mkdir(parents=True, exist_ok=True)
    space = Workspace(root)
    text = FLAKY_TOML if specialists else FLAKY_TOML.split('[specialists."@flaky"]')[0]
    space.write_config(text + f'\n[store]\nurl = "{url}"\n')
    HandoffdWorkspace(root).ensure()
    return space


@pytest.mark.heavy
def test_daemon_and_cli_on_postgres(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    try:
        space.serve()
        ids = [space.create("--from", "@t", "--to", "@flaky", "--data", json.dumps({"mode": m}))
               for m in ("ok", "permanent")]
        assert space.handoff("wait", ids[0], "--timeout", "30").returncode == 0
        assert space.handoff("wait", ids[1], "--timeout", "30").returncode == 1
        listing = json.loads(space.handoff("ls", "--json", check=True).stdout)
        assert {(r["id"], r["state"]) for r in listing} == {(ids[0], "completed"),
                                                           (ids[1], "failed")}
        shown = json.loads(space.handoff("show", ids[0], "--json", check=True).stdout)
        assert shown["state"] == "completed"
        assert shown["document"]["output"] == {"echo": {"mode": "ok"}}
        # the database is the truth: nothing was filed in the workspace's folders
        assert space.state_of(ids[0]) == [] and space.state_of(ids[1]) == []
        # retry and cancel go through the database too
        assert space.handoff("retry", ids[1], "--force").returncode == 0
        assert space.handoff("wait", ids[1], "--timeout", "30").returncode == 1
        assert [r["id"] for r in space.runs()].count(ids[1]) == 2
        parked = space.create("--from", "@t", "--to", "@nobody")
        assert space.handoff("cancel", parked, "--reason", "not needed").returncode == 0
        assert space.handoff("wait", parked, "--timeout", "30").returncode == 1
        cancelled = json.loads(space.handoff("show", parked, "--json", check=True).stdout)
        assert cancelled["document"]["error"]["code"] == "CANCELLED"
        # the Python API follows the workspace's [store] as every command does
        from handoffd.service.client import Client
        result = Client(space.root).create("@flaky", {"mode": "ok"}).wait(timeout=30)
        assert result.ok and result.output == {"echo": {"mode": "ok"}}
    finally:
        space.cleanup()


def test_a_file_dropped_on_host_b_runs_on_host_a_and_comes_back_to_b(tmp_path: Path,
                                                                    pg_url: str) -> None:
    host_a = pg_workspace(tmp_path / "a", pg_url)
    host_b = pg_workspace(tmp_path / "b", pg_url, specialists=False)
    try:
        host_a.serve()
        host_b.serve()
        host_b.drop("from-b.json", request("from-b", "@flaky", {"mode": "ok"}))
        assert host_b.wait_state("from-b", timeout=30) == "completed"
        filed = host_b.doc("from-b")
        assert filed["status"] == "completed" and filed["output"] == {"echo": {"mode": "ok"}}
        assert host_b.state_of("from-b") == ["completed"]  # pending/ emptied, one result
        assert host_a.state_of("from-b") == []  # A ran it; the file is B's
        assert [r["id"] for r in host_a.runs()] == ["from-b"] and host_b.runs() == []
        host_b.drop("bad.json", "{oops")  # never runnable: a failure stub in B's failed/
        assert host_b.wait_state("bad", timeout=30) == "failed"
    finally:
        host_a.cleanup()
        host_b.cleanup()


def test_the_file_bridge_meets_hostile_files(tmp_path: Path, pg_url: str) -> None:
    """In-process: what a foreign producer may drop into pending/ never stops the bridge, never
    reaches the database half-read, and always leaves a reason (and a stub when it can)."""
    from handoffd.backends.files.store import Store
    from handoffd.backends.postgres.bridge import FileBridge
    store_db = backend(pg_url)
    spaces = {}
    for name in ("a", "b"):
        HandoffdWorkspace(tmp_path / name).ensure()
        spaces[name] = Workspace(tmp_path / name)
    local = {n: Store(HandoffdWorkspace(tmp_path / n), durable=False, settle_seconds=0.2)
             for n in spaces}

    def stub(handoff_id: str, code: str, message: str) -> dict[str, Any]:
        return {"handoff_id": handoff_id, "status": "failed",
                "error": {"code": code, "message": message}}

    bridges = {n: FileBridge(store_db, local[n], f"host:{n}", stub=stub) for n in spaces}
    a = spaces["a"]
    try:
        nul = request("nul-1", "@flaky")
        nul["input"]["data"] = {"text": "a\u0000b"}
        a.drop("nul-1.json", nul)
        (a.root / "handoffs" / "pending" / "link-1.json").symlink_to("/etc/passwd")
        a.drop("bad name.json", request("x", "@flaky"))
        a.drop("twice.json", request("twice", "@flaky"))
        spaces["b"].drop("twice.json", request("twice", "@flaky"))
        half = a.root / "handoffs" / "pending" / "half.json"
        half.write_text('{"handoff_id": "ha')  # still being written (young)
        future = time.time() + 600  # young for the whole test, however slow the machine is
        os.utime(half, (future, future))
        assert bridges["a"].ingest("half") == "later" and half.exists()
        assert bridges["a"].ingest_all() == 1  # only twice.json is a document
        assert bridges["b"].ingest("twice") == "set aside"  # the id is host a's handoff
        assert sorted(p.name for p in (a.root / "handoffs" / "pending").iterdir()) == ["half.json"]
        from conftest import reason_codes
        assert reason_codes(a.root) == {"nul-1.json": "UNPROCESSABLE_DOCUMENT",
                                        "link-1.json": "NOT_A_REGULAR_FILE",
                                        "bad name.json": "UNSAFE_ID"}
        assert reason_codes(spaces["b"].root) == {"twice.json": "DUPLICATE_HANDOFF_ID"}
        assert a.state_of("nul-1") == ["failed"] and a.state_of("link-1") == ["failed"]
        assert store_db.get("nul-1")[0] is State.FAILED  # `handoff wait nul-1` ends too
        # a crash between ingesting and removing the file: the next pass only removes it
        a.drop("twice.json", request("twice", "@flaky"))
        assert bridges["a"].ingest("twice") == "known" and a.state_of("twice") == []
        assert store_db.origin_of("twice") == "host:a"
    finally:
        store_db.close()


def test_a_cron_batch_on_postgres_ingests_and_files_back(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("by-file.json", request("by-file", "@flaky", {"mode": "ok"}))
    done = space.handoffd("run")
    assert done.returncode == 0, done.stderr
    assert space.state_of("by-file") == ["completed"]  # written back before the batch ended
    assert space.doc("by-file")["output"] == {"echo": {"mode": "ok"}}


def test_concurrent_openers_migrate_once(pg_url: str) -> None:
    """Several daemons starting at once on an empty database: each migration applies once."""
    opened: list[Any] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        try:
            opened.append(backend(pg_url, pool_size=1))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert errors == [] and len(opened) == 4
        assert {b.schema_version for b in opened} == {6}
        assert sql(pg_url, "SELECT version FROM handoffd.schema_version ORDER BY version") \
            == [(1,), (2,), (3,), (4,), (5,), (6,)]
    finally:
        for one in opened:
            one.close()


def test_pauses_rates_and_the_event_stream_span_hosts(tmp_path: Path, pg_url: str) -> None:
    """With a PostgreSQL store, operations hold on every host: a pause said on host B holds host
    A's daemon, and every host's `handoff stats` / metrics read one event stream."""
    host_a = pg_workspace(tmp_path / "a", pg_url)
    host_b = pg_workspace(tmp_path / "b", pg_url, specialists=False)
    try:
        assert host_b.handoff("pause", "@flaky", "--reason", "db upgrade").returncode == 0
        host_a.serve()
        held = host_b.create("--from", "@t", "--to", "@flaky")
        time.sleep(0.8)  # host A's daemon hears of it at once; a pause is all that holds it
        assert json.loads(host_a.handoff("show", held, "--json").stdout)["state"] == "pending"
        note = next(r["note"] for r in json.loads(host_a.handoff("ls", "--json").stdout)
                    if r["id"] == held)
        assert "paused" in note and "db upgrade" in note  # host A sees B's pause
        assert host_a.handoff("resume", "@flaky").returncode == 0
        assert host_b.handoff("wait", held, "--timeout", "30").returncode == 0
        stats = json.loads(host_b.handoff("stats", "--json").stdout)  # B ran nothing itself
        flaky = next(a for a in stats["agents"] if a["agent"] == "@flaky")
        assert (flaky["created"], flaky["started"], flaky["completed"]) == (1, 1, 1)
        metrics = host_b.handoffd("metrics")
        assert 'handoffd_transitions_total{agent="@flaky",event="completed"} 1.0' in metrics.stdout
    finally:
        host_a.cleanup()
        host_b.cleanup()


def test_file_reservations_hold_across_hosts(tmp_path: Path, pg_url: str) -> None:
    """Contract reservations are the store's shared records: a handoff running on host A owns
    its files_owned for every host; host B's overlapping handoff waits until A's is done."""
    from handoffd.features.build import build_engine
    from handoffd.features.contracts.reservations import Reservations
    engines = []
    for name in ("a", "b"):
        space = HandoffdWorkspace(tmp_path / name)
        space.ensure()
        engines.append(build_engine(space, backend=backend(pg_url), features=()))
    host_a, host_b = (Reservations(e) for e in engines)
    for hid in ("on-a", "on-b"):
        engines[0].backend.create(request(hid, "@w"), hid, T0)
    claim_a = engines[0].backend.claim("on-a", T0, LEASE)
    claim_b = engines[1].backend.claim("on-b", T0, LEASE)
    assert claim_a is not None and claim_b is not None
    try:
        assert host_a.take("on-a", claim_a.token, ["shared/**"], agent="@w") is None
        conflict = host_b.take("on-b", claim_b.token, ["shared/a.txt"], agent="@w")
        assert conflict is not None and conflict.holder == "on-a"
        assert host_b.first_conflict("on-b", ["shared/x"]) is not None  # the gate sees it too
        assert host_b.take("on-b", claim_b.token, ["other/**"], agent="@w") is None  # disjoint
        host_a.release("on-a", claim_a.token)
        assert host_b.first_conflict("on-b", ["shared/a.txt"]) is None
        assert [r["handoff_id"] for r in host_b.neighbours("on-b", 0.0)] == ["on-a"]
    finally:
        for engine in engines:
            engine.backend.close()


def test_a_file_artifact_names_the_host_that_holds_it(tmp_path: Path, pg_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a shared store, content of 1 KB or more is a file in the producing host's artifacts/;
    its record names that host beside the content_ref (docs/scaling.md)."""
    import socket
    (tmp_path / "big_handlers.py").write_text(
        "def big(doc, ctx):\n    return {'status': 'completed', 'output': {'content': 'x' * 2048}}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.write_config((space.root / "handoffd.toml").read_text()
                       + '\n[specialists."@big"]\nhandler = "big_handlers:big"\n')
    hid = space.create("--from", "@t", "--to", "@big")
    assert space.handoffd("run").returncode == 0
    shown = json.loads(space.handoff("show", hid, "--json", check=True).stdout)["document"]
    [artifact] = shown["artifacts"]
    assert artifact["content_ref"] == f"artifacts/{hid}/output.txt"
    assert artifact["host"] == socket.gethostname() == artifact["metadata"]["host"]
    assert (space.root / artifact["content_ref"]).stat().st_size == 2048


@pytest.mark.parametrize("order", ["newest", "oldest", "due"])
def test_a_filtered_listing_reads_in_batches(pg_url: str, order: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``list(where=...)`` fetched every row's document in one query before filtering (a dry-run
    purge or ``ls --to`` over a large store held them all): it reads a batch at a time from
    where the last ended, and lists the same rows, in the same order, once each."""
    from handoffd.backends.postgres import reading
    store = backend(pg_url)
    for i in range(23):  # several rows share an updated_at: the id breaks the tie
        hid = f"b{i:02d}"
        store.create(request(hid, target="@b" if i % 3 == 0 else "@a"), hid, at(i // 2))
    wanted = [r.id for r in store.list(order=order) if r.meta.target == "@b"]
    assert len(wanted) == 8
    monkeypatch.setattr(reading, "FILTER_BATCH", 3)
    fetched: list[int] = []
    real_run = store.db.run

    def counting(work: Any) -> Any:
        result = real_run(work)
        if isinstance(result, list):
            fetched.append(len(result))
        return result

    monkeypatch.setattr(store.db, "run", counting)
    asked: list[str] = []

    def only_b(row: Any) -> bool:
        asked.append(row.id)
        return bool(row.meta.target == "@b")

    assert [r.id for r in store.list(order=order, where=only_b)] == wanted
    assert len(asked) == len(set(asked)) == 23  # each row asked about once
    assert fetched and max(fetched) <= 3
    fetched.clear()
    asked.clear()
    assert [r.id for r in store.list(order=order, where=only_b, limit=2)] == wanted[:2]
    assert len(asked) < 23  # it stopped once it had kept its limit
