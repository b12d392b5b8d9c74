"""A throw-away PostgreSQL cluster for the tests: initdb in a temp directory, listening only on a
Unix socket there, fsync off; one per test session (per xdist worker), a fresh database per test.
(``start(tcp_port=N)``: one that also listens on 127.0.0.1:N and asks passwords there.)

``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user (its temp
directory is chowned to it); as any other user it runs directly. Where no server can be started
:func:`start` returns the reason, and the tests that need one are skipped with it."""
from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

PG_BIN_DIRS = [Path(os.environ["HANDOFFD_PG_BIN"])] if os.environ.get("HANDOFFD_PG_BIN") else [
    Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15, 14)]
START_TIMEOUT = 30.0


def _bin_dir() -> Path | None:
    for folder in PG_BIN_DIRS:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


@dataclass
class PgServer:
    """A running cluster: its data/socket directory and how to reach it."""

    base: Path
    bin: Path
    user: str | None  # the OS user the server runs as (None: this process's)
    pid: int = 0
    tcp_port: int | None = None  # also listening on 127.0.0.1 here, passwords asked there
    _counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def socket_dir(self) -> Path:
        return self.base

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL for ``dbname`` over the cluster's Unix socket."""
        port = "" if self.tcp_port is None else f"&port={self.tcp_port}"
        return (f"postgresql://postgres@/{dbname}?host={quote(str(self.socket_dir), safe='')}"
                + port)

    def admin(self, sql: str, dbname: str = "postgres") -> None:
        """Run one statement outside a transaction (CREATE DATABASE...)."""
        import psycopg
        with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        name = f"t{os.getpid()}_{next(self._counter)}"
        self.admin(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def _run(self, *args: str, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=str(self.base))

    def stop(self) -> None:
        """Stop the cluster (immediate mode), then remove its directory."""
        try:
            self._run("pg_ctl", "stop", "-D", str(self.base / "data"), "-m", "immediate", "-w",
                      timeout=20)
        except (subprocess.TimeoutExpired, OSError):
            if self.pid:
                try:  # only the postmaster this module started
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.base, ignore_errors=True)

    def restart(self) -> None:
        """Stop the cluster at once (as a crash would) and start it again on the same data."""
        self._run("pg_ctl", "stop", "-D", str(self.base / "data"), "-m", "immediate", "-w",
                  timeout=20)
        self._start()

    def _start(self) -> None:
        listen = "" if self.tcp_port is None else "127.0.0.1"
        port = "" if self.tcp_port is None else f"-c port={self.tcp_port} "
        options = (f"-c listen_addresses='{listen}' {port}"
                   f"-c unix_socket_directories='{self.socket_dir}' "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   "-c max_connections=300 -c shared_buffers=32MB")
        done = self._run("pg_ctl", "start", "-D", str(self.base / "data"), "-w",
                         "-t", str(int(START_TIMEOUT)), "-l", str(self.base / "server.log"),
                         "-o", options)
        if done.returncode != 0:
            log = (self.base / "server.log")
            tail = log.read_text()[-800:] if log.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()} {tail}")
        pidfile = self.base / "data" / "postmaster.pid"
        self.pid = int(pidfile.read_text().split()[0]) if pidfile.exists() else 0


def start(tcp_port: int | None = None) -> PgServer | str:
    """Start a cluster, or return why none can be started (a one-line skip reason). With
    ``tcp_port`` it listens on 127.0.0.1 at that port too, where every role must give its
    password (scram-sha-256; its Unix socket still trusts every role)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "PostgreSQL tests skipped: psycopg is not installed (pip install 'handoffd[postgres]')"
    folder = _bin_dir()
    if folder is None:
        return ("PostgreSQL tests skipped: no PostgreSQL server binaries (initdb, pg_ctl) found in "
                f"{', '.join(map(str, PG_BIN_DIRS))} or on PATH (set HANDOFFD_PG_BIN)")
    user: str | None = None
    if os.geteuid() == 0:  # initdb refuses root: run the cluster as the postgres user
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "PostgreSQL tests skipped: running as root and there is no 'postgres' user"
        if shutil.which("runuser") is None:
            return "PostgreSQL tests skipped: running as root and runuser is missing"
        user = "postgres"
    # /tmp itself (not pytest's 0700 tmp dir): the server user must reach the socket directory
    base = Path(tempfile.mkdtemp(prefix="hpg-", dir="/tmp"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(base, entry.pw_uid, entry.pw_gid)
    server = PgServer(base, folder, user, tcp_port=tcp_port)
    try:
        done = server._run("initdb", "-D", str(base / "data"), "-A", "trust", "-U", "postgres",
                           "--no-sync", "-E", "UTF8", "--locale=C")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()[-400:]}")
        if tcp_port is not None:  # (written as the server's user: it reads it)
            hba = base / "data" / "pg_hba.conf"
            hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        server._start()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                server.admin("SELECT 1")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    except Exception as exc:
        server.stop()
        return f"PostgreSQL tests skipped: cannot start a server ({' '.join(str(exc).split())[:300]})"
    return server
