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

This module stops and starts a throw-away cluster of its own (tests/pgserver.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Iterator

import pgserver
import pytest
from conftest import Workspace, exe, wait_for_words
from test_postgres import pg_workspace
from test_postgres_outage_s20 import down, up

from handoffd.backends.postgres.connection import redact


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
@pytest.mark.parametrize("command", [("handoffd", "db", "init"), ("handoff", "ls")])
def test_a_port_that_is_no_number_is_a_usage_error(tmp_path: Path,
                                                   command: tuple[str, ...]) -> None:
    space = pg_workspace(tmp_path / "ws", "postgresql://x@:badport/db")
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
    ran = space.handoffd("run", "-v", "--max-seconds", "5")
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
