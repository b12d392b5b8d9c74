"""A Python handler that runs on past its ended attempt (a thread cannot be stopped) never runs
beside its retry, in any process: the daemon keeps the attempt's outcome, and the claim with it,
until the handler returns (then the retry is filed at once), the handoff is cancelled (filed
cancelled at once), or the daemon stops (filed as it exits). A batch waits for it (up to its
grace_seconds).

The handler here (``late``) records each call's start and end; its first attempt ignores
``ctx.cancelled`` and returns only once the test creates the release file, so each test decides
when the late handler returns, with no timing to guess."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pgserver
import pytest
from conftest import exe, wait_until

from handoffd import Daemon, Registry, build_engine
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.documents import book
from handoffd.core.native_format import new_native_request
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace

SPEC = textwrap.dedent("""
    import json, os, time

    def _record(kind, ctx):
        line = json.dumps({"kind": kind, "attempt": ctx.attempt, "pid": os.getpid(),
                           "at": time.time()}) + "\\n"
        fd = os.open(os.environ["LATE_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line.encode())
        os.close(fd)

    def late(handoff, ctx=None):
        _record("start", ctx)
        if ctx.attempt == 1:  # past its timeout, ignoring ctx.cancelled, until released
            end = time.monotonic() + 30
            while not os.path.exists(os.environ["LATE_RELEASE"]) and time.monotonic() < end:
                time.sleep(0.01)
        _record("end", ctx)
        return {"status": "completed"}
""")
POLICY = {"max_retries": 2, "retry_delay_seconds": 0}


class Setup:
    """A workspace whose @late specialist is :data:`SPEC`'s ``late`` (timeout 0.3 s), the
    files its handler records to and waits for, and the daemons a test started."""

    def __init__(self, tmp_path: Path, daemon: str = "", store: str | None = None,
                 lease: float = 1) -> None:
        self.root = tmp_path / "ws"
        Workspace(self.root).ensure()
        (tmp_path / "plug").mkdir()
        (tmp_path / "plug" / "latespec.py").write_text(SPEC)
        self.runs, self.release = tmp_path / "runs.jsonl", tmp_path / "release"
        self.store, self.lease = store, lease
        extra = f'[store]\nurl = "{store}"\n\n' if store else ""
        (self.root / "handoffd.toml").write_text(
            f"[daemon]\nsweep_seconds = 0.2\nlease_seconds = {lease}\n{daemon}\n\n{extra}"
            '[specialists."@late"]\nhandler = "latespec:late"\ntimeout_seconds = 0.3\n')
        path = os.pathsep.join(filter(None, [str(tmp_path / "plug"), os.environ.get("PYTHONPATH")]))
        self.env = dict(os.environ, PYTHONPATH=path, LATE_RUNS=str(self.runs),
                        LATE_RELEASE=str(self.release))
        self.daemons: list[tuple[subprocess.Popen[str], list[str]]] = []

    def submit(self) -> str:
        """A request to @late, retried twice at once; its id."""
        doc = new_native_request(source="@test", target="@late", data=None, now=utc_now())
        doc["retry_policy"] = POLICY
        hid = str(doc["handoff_id"])
        if self.store:
            from handoffd.backends.postgres import PostgresBackend
            backend = PostgresBackend(self.store)
            try:
                backend.create(doc, hid, utc_now())
            finally:
                backend.close()
        else:
            (self.root / "handoffs" / "pending" / f"{hid}.json").write_text(json.dumps(doc))
        return hid

    def where(self, hid: str) -> str | None:
        """The handoff's state ("in-progress", ...), None when it has no document yet."""
        if self.store:
            import psycopg
            with psycopg.connect(self.store, autocommit=True, connect_timeout=10) as conn:
                row = conn.execute("SELECT state FROM handoffd.handoffs WHERE id = %s",
                                   (hid,)).fetchone()
            return None if row is None else str(row[0])
        for state in ("pending", "in-progress", "completed", "failed"):
            if (self.root / "handoffs" / state / f"{hid}.json").exists():
                return state
        return None

    def doc(self, hid: str) -> dict[str, Any]:
        """The handoff's document (files backend)."""
        for state in ("failed", "completed", "pending", "in-progress"):
            path = self.root / "handoffs" / state / f"{hid}.json"
            if path.exists():
                return dict(json.loads(path.read_text()))
        raise AssertionError(f"no document for {hid}")

    def records(self) -> list[dict[str, Any]]:
        """What the handler recorded: one start and one end per call."""
        text = self.runs.read_text() if self.runs.exists() else ""
        return [json.loads(line) for line in text.splitlines()]

    def start(self, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
        """``handoffd ARGS`` on the workspace; its stderr lines collect in the list."""
        proc = subprocess.Popen([exe("handoffd"), *args, "--root", str(self.root)],
                                env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        lines: list[str] = []
        stderr = proc.stderr
        assert stderr is not None
        threading.Thread(target=lambda: lines.extend(iter(stderr.readline, "")),
                         daemon=True).start()
        self.daemons.append((proc, lines))
        return proc, lines

    def serve(self) -> tuple[subprocess.Popen[str], list[str]]:
        """``handoffd serve``, once it says it serves."""
        proc, lines = self.start("serve")
        wait_until(lambda: any("serving" in line for line in lines) or proc.poll() is not None,
                   30, "the daemon serves")
        assert proc.poll() is None, "".join(lines)
        return proc, lines

    def held_by(self, lines: list[str], hid: str) -> bool:
        """True once a daemon's log (``lines``) says it keeps ``hid``'s outcome and claim."""
        return any(f"handoff {hid}: stays claimed" in line for line in lines)

    def stop_all(self) -> None:
        """SIGTERM to the daemons this test started (by pid), then SIGKILL if one hangs."""
        self.release.touch()
        for proc, _ in self.daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.daemons:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def spans(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) of each call, by attempt."""
    at: dict[int, dict[str, float]] = {}
    for record in records:
        at.setdefault(record["attempt"], {})[record["kind"]] = record["at"]
    return [(s["start"], s.get("end", float("inf"))) for _, s in sorted(at.items())]


def two_daemons_never_overlap(setup: Setup) -> None:
    """Two daemons serve the workspace; attempt 1 overruns its timeout: the retry starts only
    once its handler has returned, the held claim stays renewed meanwhile (two leases long)."""
    try:
        setup.serve()
        setup.serve()
        hid = setup.submit()
        # the first attempt times out; one daemon keeps its retry while its handler runs on
        # (before: the other daemon claimed the retry at once and ran it beside the handler)
        wait_until(lambda: any(setup.held_by(lines, hid) for _, lines in setup.daemons)
                   or setup.where(hid) == "completed", 20, "attempt 1 held, or the retry ran")
        held_at = time.monotonic()
        while time.monotonic() - held_at < 2 * setup.lease and setup.where(hid) != "completed":
            time.sleep(0.05)  # two leases long: renewed, and no sweep recovers it
        assert setup.where(hid) == "in-progress", setup.records()
        setup.release.touch()
        wait_until(lambda: setup.where(hid) == "completed", 20, "the retry completed")
        wait_until(lambda: len(setup.records()) == 4, 10, "both calls recorded")
    finally:
        setup.stop_all()
    first, second = spans(setup.records())
    assert second[0] >= first[1], (first, second)  # attempt 2 began after attempt 1 returned
    logs = "".join(line for _, lines in setup.daemons for line in lines)
    assert "recovered" not in logs and "could not be renewed" not in logs, logs
    assert logs.count("stays claimed") == 1, logs  # one warning line for the held handoff


@pytest.mark.heavy
def test_two_daemons_never_run_a_late_handler_beside_its_retry(tmp_path: Path) -> None:
    # (leases of 2 s: on a loaded machine a daemon starved of the CPU for a whole 1 s lease
    # lost the held claim to the other, which rightly took it and ran the retry)
    two_daemons_never_overlap(Setup(tmp_path, lease=2))


@pytest.mark.heavy
def test_two_daemons_on_postgres_never_run_a_late_handler_beside_its_retry(
        tmp_path: Path, pg_server: pgserver.PgServer) -> None:
    url = pg_server.new_database()
    from handoffd.backends.postgres import PostgresBackend
    PostgresBackend(url).close()  # the schema, before the daemons start
    two_daemons_never_overlap(Setup(tmp_path, store=url, lease=2))


def test_sigterm_files_the_held_retry_before_the_daemon_exits(tmp_path: Path) -> None:
    """A daemon holding a late handler's retry is stopped: it exits on time (the handler never
    returns), and nothing is left in in-progress/: the retry is in pending/, counted."""
    setup = Setup(tmp_path)
    try:
        proc, lines = setup.serve()
        hid = setup.submit()
        wait_until(lambda: setup.held_by(lines, hid), 20, "attempt 1 held")
        assert setup.where(hid) == "in-progress"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        setup.stop_all()
    assert setup.where(hid) == "pending"
    assert list((setup.root / "handoffs" / "in-progress").iterdir()) == []
    assert book(setup.doc(hid))["retries"] == 1
    wait_until(lambda: any("stopped:" in line for line in lines), 10, "the summary")
    summary = next(line for line in lines if "stopped:" in line)
    assert "retry scheduled 1" in summary, summary


def test_a_batch_runs_the_retry_once_the_late_handler_returns(tmp_path: Path) -> None:
    """`handoffd run`: attempt 1 overruns its timeout. The batch waits for its handler (work
    under way), then runs the retry, and exits with the handoff completed; before, it ended
    with the retry pending, one attempt per run."""
    setup = Setup(tmp_path)
    hid = setup.submit()
    try:
        batch, lines = setup.start("run", "-v")
        wait_until(lambda: setup.held_by(lines, hid) or batch.poll() is not None, 20,
                   "attempt 1 held (or the batch ended)")
        setup.release.touch()  # its late handler returns
        batch.wait(timeout=30)
    finally:
        setup.stop_all()
    assert batch.returncode == 0, "".join(lines)
    assert setup.where(hid) == "completed", "".join(lines)
    first, second = spans(setup.records())
    assert second[0] >= first[1]
    events = [e["event"] for e in book(setup.doc(hid))["history"]]
    assert events[-4:] == ["claimed", "retry_scheduled", "claimed", "completed"], events


def test_a_batch_waits_for_a_late_handler_no_longer_than_its_grace(tmp_path: Path) -> None:
    """A late handler that does not return: the batch gives it ``grace_seconds`` (what a stop
    gives running work), then exits as a stop does, its retry filed as it exits (one attempt,
    counted) and nothing left in in-progress/: a hung handler never holds a cron batch for ever."""
    setup = Setup(tmp_path, daemon="grace_seconds = 0.5")
    hid = setup.submit()
    try:
        batch, lines = setup.start("run", "-v")
        assert batch.wait(timeout=30) == 0, "".join(lines)
    finally:
        setup.stop_all()
    assert setup.held_by(lines, hid), "".join(lines)
    assert setup.where(hid) == "pending"
    assert list((setup.root / "handoffs" / "in-progress").iterdir()) == []
    assert book(setup.doc(hid))["retries"] == 1
    wait_until(lambda: any("batch done" in line for line in lines), 10, "the summary")
    summary = next(line for line in lines if "batch done" in line)
    assert "retry scheduled 1" in summary, summary


def test_cancelling_a_held_handoff_files_it_cancelled_at_once(tmp_path: Path) -> None:
    """`handoff cancel` of a handoff whose attempt is held (its late handler still runs): filed
    cancelled within the cancel's wait, not when the handler returns; the handler's return
    later files nothing more."""
    setup = Setup(tmp_path)
    try:
        proc, lines = setup.serve()
        hid = setup.submit()
        wait_until(lambda: setup.held_by(lines, hid), 20, "attempt 1 held")
        cancel = subprocess.run([exe("handoff"), "cancel", hid, "--root", str(setup.root),
                                 "--timeout", "10"], env=setup.env, capture_output=True,
                                text=True, timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert setup.where(hid) == "failed"
        assert setup.doc(hid)["status"] == "cancelled"
        setup.release.touch()  # the late handler returns now
        wait_until(lambda: len(setup.records()) == 2, 10, "the late handler returned")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        setup.stop_all()
    assert setup.where(hid) == "failed"
    events = [e["event"] for e in book(setup.doc(hid))["history"]]
    assert events.count("claimed") == 1 and events[-1] == "cancelled", events


def test_a_cooperative_handler_s_retry_runs_at_once(tmp_path: Path) -> None:
    """Handlers that stop at ctx.cancelled return while (or before) their attempt is being
    ended: every retry runs without a stop, nothing stays held, no late count is left (the
    reverted first hold kept such outcomes until the daemon stopped)."""
    returned: list[str] = []

    def coop(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
        ctx.cancelled.wait(30)
        returned.append(ctx.handoff_id)
        return {"status": "completed"}

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=0.5, rescan_seconds=0.5),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=0))
    registry = Registry()
    registry.add_function("@t", coop, config=config, concurrency=4, timeout_seconds=0.2)
    engine = build_engine(ws, config, registry)
    daemon = Daemon(engine, watch=False)
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False})
    thread.start()
    try:
        ids = []
        for _ in range(12):
            doc = new_native_request(source="@test", target="@t", data=None, now=engine.clock())
            ids.append(engine.submit(doc))
            daemon.notify(ids[-1])
        failed = ws.root / "handoffs" / "failed"
        wait_until(lambda: all((failed / f"{hid}.json").exists() for hid in ids), 20,
                   "every handoff failed after its three attempts")
        wait_until(lambda: len(returned) == 36, 10, "every call returned")
        wait_until(lambda: not daemon.active and not daemon.attempts.late, 10, "nothing held")
    finally:
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive()
