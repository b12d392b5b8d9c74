"""A new user's review of handoffd on PostgreSQL (session 26, task T):

1. A command or client that STARTED while the database was down (a restart) failed at once:
   only a connection lost midway was retried for ``reconnect_seconds``. Now the first
   connection waits out an outage the same way (one line while it waits), then gives up with
   ``handoffd.StoreUnavailable`` (exit 1); a refusal (no such role) still fails at once.
2. ``db init`` with a URL libpq cannot use (``:badport``) exited 1; the docs say 2.
3. On a shared store, ``handoff ls`` and the daemon said a handoff no specialist here serves
   "waits in pending/" without "(it may be another host's work)".
4. ``handoffd serve``'s first line never named the store.
6. ``handoff ls --watch`` wrote "lost the database connection" without the ``handoff:`` prefix.

Review R49 of it (the tests at the end):

7. ``handoffd serve``/``run`` waiting for the database at start took a SIGTERM in and waited on
   (exit 1 after reconnect_seconds): it now stops at once, exit 0, as a stop while it starts.
8. ``handoffd run --max-seconds S`` waited past S for the database (cron runs overlapped).
9. Settings no retry cures (no password to send, SSL required of a server without it, a named
   host with a port that is no number) waited for the reconnect window: they fail at once.
10. ``redact`` printed a password holding an unencoded "/" or "@" in full.
11. A serving record's sweep counted names it could not remove as removed (16 passes a renewal).

This module stops and starts a throw-away cluster of its own (tests/pgserver.py)."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

import pgserver
import pytest
from conftest import Workspace, exe, wait_for_words
from test_postgres import pg_workspace
from test_postgres_outage_s20 import down, up

from handoffd.backends.postgres.connection import cannot_connect, reachable_later, redact
from handoffd.core.errors import ConfigError
from handoffd.service import daemon_records


@pytest.fixture(scope="module")
def own_server() -> Iterator[pgserver.PgServer]:
    """A cluster of this module's own: its tests stop it (others share the session's)."""
    server = pgserver.start()
    if isinstance(server, str):
        pytest.skip(server)
    yield server
    server.stop()


def started(root: Path, out: Path, program: str, *args: str) -> subprocess.Popen[str]:
    """``program ARGS --root root`` started, its stderr written to ``out``."""
    err: IO[str] = out.open("w")
    try:
        return subprocess.Popen([exe(program), *args, "--root", str(root)], text=True,
                                stdout=subprocess.PIPE, stderr=err)
    finally:
        err.close()  # (the child holds its own copy)


def ended(proc: subprocess.Popen[str], timeout: float = 60) -> int:
    """The exit code of ``proc`` (killed, by pid, if it outlives ``timeout``)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise


# ------------------------------------------------- 1, 4, 6. started while the server is down
@pytest.mark.heavy
def test_commands_started_while_the_server_is_down_wait_for_it(
        tmp_path: Path, own_server: pgserver.PgServer) -> None:
    url = own_server.new_database()
    space = pg_workspace(tmp_path / "ws", url)
    # a workspace whose store gives up soon, for the commands that outlast the window
    brief = pg_workspace(tmp_path / "brief", url)
    brief.write_config((brief.root / "handoffd.toml").read_text() + "reconnect_seconds = 1\n")
    watch = started(space.root, tmp_path / "watch.err", "handoff", "ls", "--watch")
    procs: list[subprocess.Popen[str]] = [watch]
    try:
        space.handoff("ls", check=True)  # (the store is set up; the watch follows it meanwhile)
        # the watch has listed (its header printed: it is connected) before the server goes
        # down; started on a loaded machine, it once first connected after: "waiting for the
        # database", not "lost the database connection"
        assert watch.stdout is not None
        assert select.select([watch.stdout], [], [], 60)[0], "the watch never listed"
        down(own_server)
        try:
            ls = started(space.root, tmp_path / "ls.err", "handoff", "ls")
            create = started(space.root, tmp_path / "create.err", "handoff", "create",
                             "--to", "@flaky", "--data", '{"mode": "ok"}')
            serve = started(space.root, tmp_path / "serve.err", "handoffd", "serve")
            procs += [ls, create, serve]
            said = wait_for_words(tmp_path / "serve.err", ["waiting for the database"])
            assert f"waiting for the database at {redact(url)} (up to 60s)" in said, said
            # past its reconnect window: exit 1, the wait's line and the outage's error
            gave_up = brief.handoff("ls", timeout=30)
            client = subprocess.run(
                [sys.executable, "-c",
                 "import sys, handoffd\n"
                 "try:\n    handoffd.Client(sys.argv[1])\n"
                 "except handoffd.StoreUnavailable as exc:\n    print('unavailable', exc)\n",
                 str(brief.root)], capture_output=True, text=True, timeout=30)
            lost = wait_for_words(tmp_path / "watch.err", ["lost the database connection"])
            assert ls.poll() is None and create.poll() is None and serve.poll() is None
        finally:
            up(own_server)
        assert ended(ls) == 0 and ended(create) == 0
        for name in ("ls", "create"):
            lines = (tmp_path / f"{name}.err").read_text().splitlines()
            assert len(lines) == 1 and lines[0].startswith(
                f"handoff: waiting for the database at {redact(url)} (up to 60s): "), lines
        assert create.stdout is not None
        made = create.stdout.read().strip()
        said = wait_for_words(tmp_path / "serve.err", ["handoffd: serving"])
        assert f"handoffd: serving {space.root} (store: {redact(url)}; " in said, said
        assert space.handoff("wait", made, "--timeout", "60").returncode == 0
        serve.send_signal(signal.SIGTERM)
        assert ended(serve) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                ended(proc, 30)
    assert gave_up.returncode == 1, gave_up.stderr
    lines = gave_up.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("handoff: waiting for the database at ")
    assert lines[1].startswith(f"handoff: error: the PostgreSQL store {redact(url)} is "
                               "unreachable: "), lines
    assert client.stdout.startswith("unavailable the PostgreSQL store "), client.stderr
    # the watch's lines read as every other line of the command's
    assert "handoff: lost the database connection" in lost, lost
    assert all(line.startswith("handoff: ") for line in lost.splitlines()), lost


def test_a_refusal_still_fails_at_once(tmp_path: Path, own_server: pgserver.PgServer) -> None:
    url = own_server.new_database()
    space = pg_workspace(tmp_path / "ws", url.replace("postgresql://postgres@",
                                                      "postgresql://nobody@"))
    refused = space.handoff("ls", timeout=20)
    assert refused.returncode == 1 and "waiting" not in refused.stderr, refused.stderr
    assert 'role "nobody" does not exist' in refused.stderr


# ------------------------------------------------------------ 2. a URL libpq cannot use
@pytest.mark.parametrize("url", ["postgresql://x@:badport/db",  # (libpq's own refusal)
                                 "postgresql://x@localhost:badport/db"])  # (R49: a named host)
@pytest.mark.parametrize("command", [("handoffd", "db", "init"), ("handoff", "ls")])
def test_a_port_that_is_no_number_is_a_usage_error(tmp_path: Path, command: tuple[str, ...],
                                                   url: str) -> None:
    space = pg_workspace(tmp_path / "ws", url)
    done = subprocess.run([exe(command[0]), *command[1:], "--root", str(space.root)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"{command[0]}: error: the store URL is not a valid PostgreSQL URL: invalid integer "
        'value "badport" for connection option "port"']


# ------------------------------------------------ 3. another host's work, on a shared store
def test_work_for_a_specialist_of_another_host_says_so(
        tmp_path: Path, own_server: pgserver.PgServer) -> None:
    space = pg_workspace(tmp_path / "ws", own_server.new_database())
    made = space.create("--to", "@onlyB", "--data", "{}")
    listed = space.handoff("ls", check=True).stdout
    assert ("waiting: no specialist registered for @onlyB here (it may be another host's "
            "work)") in listed, listed
    # (30 s: a bound, not a wait; it ends at once when it has looked. With 5 s a load of 15
    # ended it by --max-seconds before its look, which the waits line comes from: session 31)
    ran = space.handoffd("run", "-v", "--max-seconds", "30")
    assert (f"handoff {made} waits: no specialist registered for @onlyB here (it may be "
            "another host's work)") in ran.stderr, ran.stderr
    assert "pending/" not in ran.stderr


# ----------------------------------------------------------------- 4. a files store too
def test_serve_names_a_files_store(ws: Workspace) -> None:
    daemon = ws.serve()
    try:
        assert f"serving {ws.root} (store: files; " in daemon.ready_line  # type: ignore[attr-defined]
    finally:
        assert ws.stop(daemon) == 0


# ------------------------------------------- 7, 8. R49: a daemon waiting for the database
@pytest.mark.heavy
def test_a_daemon_waiting_for_the_database_stops_at_a_signal_and_by_its_batch_bound(
        tmp_path: Path, own_server: pgserver.PgServer) -> None:
    url = own_server.new_database()
    space = pg_workspace(tmp_path / "ws", url)  # (reconnect_seconds: 60, the default)
    space.handoff("ls", check=True)  # (the store is set up)
    down(own_server)
    procs: list[subprocess.Popen[str]] = []
    try:
        serve = started(space.root, tmp_path / "serve.err", "handoffd", "serve")
        run = started(space.root, tmp_path / "run.err", "handoffd", "run", "-v")
        bounded = started(space.root, tmp_path / "bounded.err", "handoffd", "run",
                          "--max-seconds", "2")
        procs += [serve, run, bounded]
        for name, proc in (("serve", serve), ("run", run)):
            said = wait_for_words(tmp_path / f"{name}.err", ["waiting for the database"])
            assert "waiting for the database" in said, said
            proc.send_signal(signal.SIGTERM)
        # the first SIGTERM ends the wait: exit 0, long before the 60 s window would
        assert ended(serve, 30) == 0
        assert ended(run, 30) == 0
        # the batch's 2 s bound ends its wait: exit 1, the store said unreachable
        assert ended(bounded, 30) == 1
    finally:
        up(own_server)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    lines = (tmp_path / "serve.err").read_text().splitlines()
    assert lines[-1] == ("handoffd: stopped: before it began, waiting for the database at "
                         f"{redact(url)}"), lines
    assert "before it began, waiting for the database" in (tmp_path / "run.err").read_text()
    lines = (tmp_path / "bounded.err").read_text().splitlines()
    # (a start slower than the 2 s bound on a loaded machine has no wait left to announce: it
    # says the store unreachable at once; a wait it announces is the batch's, not the window's)
    waits = [line.partition(f"waiting for the database at {redact(url)} (up to ")[2]
             for line in lines if "waiting for the database" in line]
    assert all(0 <= float(waited.partition("s)")[0]) <= 2 for waited in waits), lines
    assert lines[-1].startswith(f"handoffd: error: the PostgreSQL store {redact(url)} is "
                                "unreachable: "), lines


# ---------------------------------------------------- 9. R49: settings no retry cures
def fake_server(stop: threading.Event, listener: socket.socket) -> None:
    """A server speaking just enough of PostgreSQL's protocol: no SSL (``N``), and a
    cleartext password asked of every start-up."""
    listener.settimeout(0.1)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            conn.settimeout(5)
            try:
                while True:
                    head = conn.recv(8, socket.MSG_WAITALL)
                    if len(head) < 8:
                        break
                    length, code = int.from_bytes(head[:4]), int.from_bytes(head[4:])
                    if code in (80877103, 80877104):  # SSLRequest, GSSENCRequest
                        conn.sendall(b"N")
                        continue
                    conn.recv(length - 8, socket.MSG_WAITALL)  # (the start-up message)
                    conn.sendall(b"R" + (8).to_bytes(4) + (3).to_bytes(4))  # a password, please
            except OSError:
                pass


@pytest.fixture
def no_ssl_asks_password() -> Iterator[int]:
    """The port of a :func:`fake_server` on 127.0.0.1."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()
    thread = threading.Thread(target=fake_server, args=(stop, listener), daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    listener.close()


@pytest.mark.parametrize("options, words", [
    ("sslmode=require&gssencmode=disable", "server does not support SSL, but SSL was required"),
    ("sslmode=disable&gssencmode=disable", "fe_sendauth: no password supplied")])
def test_settings_no_retry_cures_fail_at_once(tmp_path: Path, no_ssl_asks_password: int,
                                              options: str, words: str) -> None:
    space = pg_workspace(tmp_path / "ws",
                         f"postgresql://u@127.0.0.1:{no_ssl_asks_password}/db?{options}")
    done = space.handoff("ls", timeout=30)  # (the 60 s window, waited, runs past this)
    assert done.returncode == 1 and "waiting" not in done.stderr, done.stderr
    assert words in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def test_what_no_retry_cures_is_told_from_an_outage() -> None:
    for words in ("connection is bad: fe_sendauth: no password supplied",
                  "server does not support SSL, but SSL was required",
                  "failed to resolve host 'db': [Errno -8] Servname not supported for "
                  "ai_socktype"):
        assert not reachable_later(words), words
    named = cannot_connect("postgresql://u@db:x/d", "failed to resolve host 'db': [Errno -8] "
                           "Servname not supported for ai_socktype")
    assert isinstance(named, ConfigError)
    for words in ('connection to server on socket "/tmp/.s.PGSQL.5432" failed: No such file '
                  "or directory", "connection to server at \"127.0.0.1\", port 5432 failed: "
                  "Connection refused", "FATAL: the database system is starting up",
                  "FATAL: the database system is shutting down"):
        assert reachable_later(words), words


# ------------------------------------------------------------ 10. R49: a password redacted
@pytest.mark.parametrize("url, said", [
    ("postgresql://u:s3cr/etPW@host/db", "postgresql://u:***@host/db"),
    ("postgresql://u:p@ss@host:5432/db", "postgresql://u:***@host:5432/db"),
    ("postgres://u:a:b?c#d@h/db?sslmode=require", "postgres://u:***@h/db?sslmode=require"),
    ("postgresql://u:pw@h/db?password=x&sslmode=require",
     "postgresql://u:***@h/db?password=***&sslmode=require"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
])
def test_a_urls_password_is_masked_whatever_it_holds(url: str, said: str) -> None:
    assert redact(url) == said
    for secret in ("s3cr", "etPW", "p@ss", "a:b?c#d", "pw", "password=x"):
        if secret in url:
            assert secret not in redact(url)


def test_a_password_with_a_slash_never_shows_in_the_outage_line(tmp_path: Path) -> None:
    space = pg_workspace(tmp_path / "ws", "postgresql://u:s3cr/etPW@host/db")
    done = space.handoff("ls", timeout=30)
    assert "s3cr" not in done.stderr and "etPW" not in done.stderr, done.stderr


# -------------------------------------------- 11. R49: an unremovable name is not removed
def test_a_name_that_cannot_be_removed_is_not_counted_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listings: list[int] = []

    def listing(folder: int, now: float, marks: object) -> tuple[bool, list[str], list[object]]:
        listings.append(1)  # a full listing with one removable name, which is never removed
        return True, ["1.aaaaaaaaaaaa.json"], []

    monkeypatch.setattr(daemon_records, "_sweep_listing", listing)
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # (no such file in it: the unlink fails, as it does of an unremovable one)
        daemon_records._remove_dead(folder, ("0", "0"), 0.0)
    finally:
        os.close(folder)
    assert len(listings) == 1  # (a listing that removed nothing is the last)


# ---------------------------------------------------- R50: masks, bounds, the batch's line
@pytest.mark.parametrize("url", [
    "postgresql://u@127.0.0.1:5432/db?%70assword=SECRET1",
    "postgresql://u@127.0.0.1:5432/db?pass%77ord=SECRET1&sslmode=disable",
    "postgresql://u@127.0.0.1:5432/db?sslpassword=SECRET1",
    "host=127.0.0.1 user=u sslpassword=SECRET1 dbname=db"])
def test_a_secret_in_the_query_is_masked_however_its_key_is_spelt(url: str) -> None:
    assert "SECRET1" not in redact(url), redact(url)


def test_a_spread_batch_keeps_its_whole_bound_past_a_slow_first_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --max-seconds S`` over two processes: the bound is counted from where each daemon
    counts it (the spread's start, before the parent's first sweep); counted from the call, a
    slow sweep (1 s here) was taken off it twice (R50). The parent's daemon is looked at."""
    from handoffd.cli import daemon_commands
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.service import daemon as daemon_mod
    from handoffd.service.sweeper import SweepReport
    HandoffdWorkspace(tmp_path / "ws").ensure()
    parent, seen = os.getpid(), []

    def fake_run_batch(self: Any, *, install_signals: bool = False,
                       max_seconds: float | None = None, early: Any = None) -> Any:
        if os.getpid() == parent:
            seen.append(self.started + (max_seconds or 0.0))
        return daemon_mod.BatchReport()

    def slow_sweep(self: Any) -> SweepReport:
        time.sleep(1.0)
        return SweepReport()

    monkeypatch.setattr(daemon_mod.Daemon, "run_batch", fake_run_batch)
    monkeypatch.setattr(daemon_mod.Daemon, "sweep", slow_sweep)
    start = time.monotonic()
    daemon_commands.run_batch(root=tmp_path / "ws", max_seconds=10.0, processes=2, quiet=True)
    assert len(seen) == 1 and abs(seen[0] - (start + 10.0)) < 0.5, (seen, start)
