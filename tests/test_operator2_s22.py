"""Six defects left in earlier closing notes (session 22, helper P2).

1. A notify journal whose lock a handler closed was taken over while its owner lived (its
   notices then delivered twice): the journal's first line now bears its writer's mark.
2. A batch ended "handed back 1" when its only work was under a 1 s start-shortage back-off: it
   now waits such a back-off out (within --max-seconds, else 5 s) and runs the handoff.
3. On an ASCII-only stdout, `handoff ls` measured a cell before the stream escaped it.
4. A PostgreSQL outage was said by each of a process's connections (pool, listener, presence):
   three warnings each way for one outage; now one each way.
5. open_within (a command's --timeout while its PostgreSQL store is away) let each connection
   attempt take the store's whole connect timeout (10 s) on a path that drops packets.
6. A dependant's queue wait counted from its creation, not from its last dependency's filing.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, exe

from handoffd import Daemon, Registry, Workspace, build_engine
from handoffd.core.config import Config, DaemonSettings, RetryPolicy, specialist_from_table
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import Specialist
from handoffd.core.states import State
from handoffd.features.notify.leftovers import take_over
from handoffd.features.notify.outbox import Entry, Outbox


def _entry(n: int) -> Entry:
    return Entry(f"h-{n}", State.COMPLETED, "0123456789abcdef", 0, ("webhook",),
                 "2026-01-01T00:00:00Z")


def test_a_journal_whose_lock_a_handler_closed_is_left_to_its_live_owner(tmp_path: Path) -> None:
    folder = tmp_path / "notify"
    owner = Outbox(folder, durable=False)
    assert owner.record([_entry(1), _entry(2)]) is not None
    os.close(owner.fd)  # what a handler's os.closerange does: the journal's flock is free
    taken: list[Entry] = []

    def take(entries: list[Entry], name: str) -> bool:
        taken.extend(entries)
        return True

    sweeper = Outbox(folder, durable=False)  # another process's sweep (same host, same ns)
    assert take_over(sweeper, take) == 0
    assert taken == []
    assert (folder / str(owner.name)).exists()
    # the owner, at its next write, makes a new journal holding all and removes this one
    old = owner.name
    owner.done(1, ["webhook"])
    assert owner.name != old and not (folder / str(old)).exists()
    lines = (folder / str(owner.name)).read_bytes().splitlines()
    assert json.loads(lines[0])["owner"]["pid"] == os.getpid()
    assert [json.loads(line)["id"] for line in lines[1:] if b'"id"' in line] == ["h-2"]


def test_a_journal_whose_mark_names_no_live_process_is_taken_over(tmp_path: Path) -> None:
    folder = tmp_path / "notify"
    owner = Outbox(folder, durable=False)
    assert owner.record([_entry(1)]) is not None
    path = folder / str(owner.name)
    os.close(owner.fd)
    lines = path.read_bytes().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["owner"]["proc"] = "0" * 16  # the mark of a process that ended (no live one bears it)
    path.write_bytes(json.dumps(head).replace(" ", "").encode() + b"\n" + b"".join(lines[1:]))
    taken: list[Entry] = []
    assert take_over(Outbox(folder, durable=False),
                     lambda entries, name: taken.extend(entries) or True) == 1
    assert [e.handoff_id for e in taken] == ["h-1"] and not path.exists()


def test_a_journal_without_a_mark_is_judged_by_its_lock(tmp_path: Path) -> None:
    folder = tmp_path / "notify"
    folder.mkdir()
    (folder / f"{os.getpid()}-{'ab' * 8}.jsonl").write_bytes(_entry(3).line(1))
    taken: list[Entry] = []
    assert take_over(Outbox(folder, durable=False),
                     lambda entries, name: taken.extend(entries) or True) == 1
    assert [e.handoff_id for e in taken] == ["h-3"]


# ---------------------------------------------------------------- 2. a short back-off in a batch


def _cmd_engine(root: Path, output: str, max_retries: int, clock: Clock | None = None) -> Any:
    """An engine on a new workspace at ``root`` with one command specialist, @cmd, answering
    completed with ``output`` (a Python literal)."""
    ws = Workspace(root)
    ws.ensure()
    config = Config(daemon=DaemonSettings(), retry=RetryPolicy(max_retries=max_retries))
    registry = Registry()
    answer = f"import json; print(json.dumps({{'status': 'completed', 'output': {output}}}))"
    registry.add(Specialist(specialist_from_table(
        "@cmd", {"command": [sys.executable, "-S", "-c", answer]}, config.retry)))
    if clock is None:
        return build_engine(ws, config, registry)
    return build_engine(ws, config, registry, clock=clock)


def _shortage_batch(root: Path, fails: int, max_seconds: float | None) -> tuple[Any, State]:
    """A batch over one handoff whose first ``fails`` spawns hit EMFILE (a real clock)."""
    engine = _cmd_engine(root, "{'ok': True}", 2)
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    real, raised = subprocess.Popen, [0]

    def popen(*args: Any, **kwargs: Any) -> Any:
        if raised[0] < fails:
            raised[0] += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", popen)
        report = Daemon(engine, workers=2, watch=False).run_batch(max_seconds=max_seconds)
    return report, engine.get(hid)[0]


@pytest.mark.parametrize("max_seconds", [None, 60.0])
def test_a_batch_waits_out_a_short_start_shortage_back_off(
        tmp_path: Path, max_seconds: float | None) -> None:
    report, state = _shortage_batch(tmp_path / "ws", 1, max_seconds)
    assert (report.completed, report.handed_back, report.failed) == (1, 0, 0)
    assert state is State.COMPLETED


def test_a_back_off_past_max_seconds_is_handed_back(tmp_path: Path) -> None:
    report, state = _shortage_batch(tmp_path / "ws", 1, 0.5)  # (the back-off is 1 s)
    assert (report.completed, report.handed_back) == (0, 1) and state is State.PENDING


# ---------------------------------------------------------------- 3. an ASCII-only stdout


def test_ls_on_an_ascii_stdout_aligns_cells_holding_escapes(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    env = {**os.environ, "LC_ALL": "C", "PYTHONIOENCODING": "ascii"}
    env.pop("FORCE_COLOR", None)
    for target, source in (("@caf\u00e9", "@na\u00efve-agent"), ("@plain", "@cli")):
        subprocess.run([exe("handoff"), "create", "--to", target, "--from", source, "--data",
                        "{}", "--root", str(root)], check=True, capture_output=True,
                       timeout=60, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    shown = subprocess.run([exe("handoff"), "ls", "--root", str(root)], capture_output=True,
                           timeout=60, env=env, check=True).stdout.decode("ascii")
    lines = shown.splitlines()
    assert len(lines) == 3 and "@caf\\xe9" in shown
    for column in ("FROM", "TO", "ATTEMPT", "UPDATED", "NOTE"):
        at = lines[0].index(column)
        for line in lines[1:]:  # every cell of the column starts where its header does
            assert line[at - 2:at] == "  " and line[at] != " ", (column, line)


# ---------------------------------------------------------------- 5. open_within's connect timeout


def test_open_within_bounds_each_connect_timeout_by_the_time_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    psycopg = pytest.importorskip("psycopg")
    from handoffd.backends.postgres import connection
    from handoffd.cli.reads import open_within
    from handoffd.core.errors import WaitTimeout
    from handoffd.core.timeutil import connect_timeout, connecting_within
    asked: list[float] = []

    def connect(url: str, **kwargs: Any) -> Any:  # a path that drops packets: it times out
        asked.append(kwargs["connect_timeout"])
        raise psycopg.OperationalError("connection timeout expired")

    monkeypatch.setattr(connection.psycopg, "connect", connect)
    with pytest.raises(WaitTimeout, match="within 2.5s: .* unreachable"):
        open_within(2.5, "no answer", lambda: connection.Database("postgresql://u@127.0.0.1/d"))
    assert asked and asked[0] == 2 and all(1 <= value <= 2 for value in asked)
    assert connect_timeout(10.0) == 10.0  # (outside a bounded block: the store's own)
    with connecting_within(0.2):
        assert connect_timeout(10.0) == 1.0  # (never under libpq's second)


# ---------------------------------------------------------------- 6. a dependant's queue wait


def test_a_dependants_queue_wait_counts_from_its_last_dependencys_filing(tmp_path: Path) -> None:
    clock = Clock()
    engine = _cmd_engine(tmp_path / "ws", "{}", 0, clock)
    first = new_native_request(source="@test", target="@cmd", data={}, now=clock())
    engine.submit(first)
    then = new_native_request(source="@test", target="@cmd", data={}, now=clock(),
                              depends_on=[first["handoff_id"]])
    engine.submit(then)
    clock.advance(3600)  # nobody ran the first for an hour: the dependant could not run either
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert report.completed == 2
    events = [json.loads(line) for line in
              (engine.ws.root / "handoffs" / ".meta" / "events.jsonl").read_text().splitlines()]
    waits = {e["id"]: e["wait"] for e in events if e["event"] == "claimed"}
    assert waits[first["handoff_id"]] == 3600  # (it was runnable all along)
    assert waits[then["handoff_id"]] == 0  # runnable once the first was filed, and claimed then


# ---------------------------------------------------------------- 4. one outage, one line each way


def test_an_outage_of_every_connection_is_said_once_each_way(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import time

    import psycopg

    from handoffd.backends.postgres.backend import PostgresBackend
    caplog.set_level(logging.DEBUG, logger="handoffd")
    store = PostgresBackend(pg_url)
    unsubscribe = store.subscribe(lambda *args: None)
    try:
        assert store.get("absent") is None
        with psycopg.connect(pg_url, autocommit=True) as admin:  # every connection drops
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                          "datname = current_database() AND pid <> pg_backend_pid()")
        ends = time.monotonic() + 30
        while time.monotonic() < ends and not any(
                "(its wake-up connection)" in r.getMessage()
                for r in caplog.records):
            time.sleep(0.05)
        assert store.get("absent") is None  # the pool notices at its next operation, and is back
        said = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "database" in r.getMessage()]
        lines = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
        assert len(lines) == 4, lines  # (the listener's and the pool's, each lost and back)
        assert len(said) == 2 and said[0].startswith("lost the database connection") \
            and said[1].startswith("reconnected to the database after"), said
    finally:
        unsubscribe()
        store.close()
