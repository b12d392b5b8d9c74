"""A file dropped into a PostgreSQL workspace's pending/ is ingested by one process (session 20,
F11): two ingesters of the same workspace (its daemon's bridge and a ``handoff`` command, which
ingests dropped files too) that both read pending/X.json before either removed it both inserted
it. One that the daemon set aside in between (its row moved into the quarantine, its failure
stub not yet filed) was ingested and set aside a second time; a valid one that ran and was
purged in between was ingested a second time. The ingester now holds an exclusive flock on the
file from before its read until after its removal (the files store's claim lock,
``leases.lock_document``): another ingester meets the lock ("later") or no file ("gone"). The
kernel drops the lock of a process that dies: its file stays in pending/ and the next ingest
takes it.

The interleavings are made deterministic by a hook after each bridge's read (``_read``): the
first ingester, having read the file, runs the second one up to its own read (or to its end),
and only then inserts. Every test takes a fresh database of the session's throw-away cluster."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from conftest import Workspace
from test_postgres import backend, request, sql
from test_postgres_hostile import bridge, local_store

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now

WAIT = 20.0  # bound of every wait on another thread (never reached when all goes well)


class Second:
    """The second ingester, run in a thread from within the first one's read hook: it stops
    after its own read (when it gets that far) until :meth:`release`."""

    def __init__(self, files: Any, handoff_id: str) -> None:
        self.files = files
        self.handoff_id = handoff_id
        self.read = threading.Event()
        self.go = threading.Event()
        self.outcome: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        hold(files, self._after_read)

    def _after_read(self) -> None:
        self.read.set()
        assert self.go.wait(WAIT)

    def _run(self) -> None:
        self.outcome = self.files.ingest(self.handoff_id)

    def start_and_wait(self) -> None:
        """Start it; back when it has read the file (old code) or has ended (it met the lock)."""
        self.thread.start()
        for _ in range(int(WAIT * 20)):
            if self.read.wait(0.05) or not self.thread.is_alive():
                return
        raise AssertionError("the second ingester neither read nor ended")

    def release(self) -> str | None:
        """Let it go on; its outcome."""
        self.go.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()
        return self.outcome


def hold(files: Any, after_read: Callable[[], None]) -> None:
    """Call ``after_read`` once, after ``files``' next read of a pending document."""
    real = files._read
    done: list[bool] = []

    def read(handoff_id: str) -> Any:
        found = real(handoff_id)
        if not done:
            done.append(True)
            after_read()
        return found

    files._read = read


def two_bridges(tmp_path: Path, pg_url: str) -> tuple[Any, Any, Any, Any, Workspace]:
    """Two bridges of one workspace (origin host:a), each with its own connection, as a daemon
    and a command have; and the workspace."""
    root = tmp_path / "ws"
    db_a, db_b = backend(pg_url), backend(pg_url)
    return db_a, db_b, bridge(db_a, local_store(root)), bridge(db_b, local_store(root)), \
        Workspace(root)


def test_a_document_set_aside_in_between_is_ingested_and_set_aside_once(
        tmp_path: Path, pg_url: str) -> None:
    db_a, db_b, first, other, space = two_bridges(tmp_path, pg_url)
    second = Second(other, "bad-1")
    hold(first, second.start_and_wait)
    try:
        space.drop("bad-1.json", {"handoff_id": "bad-1", "source_agent": "@x",
                                  "target_agent": "@a", "input": {}})
        assert first.ingest("bad-1") == "ingested"
        # the daemon's admission sets it aside: its row into the quarantine, then (a second
        # transaction) its failure stub; the second ingester goes on in between
        assert db_a.set_aside("bad-1", State.PENDING, "UNKNOWN_FORMAT", "no format")
        outcome = second.release()
        assert outcome in ("later", "gone"), outcome  # it was "ingested": a second row
        assert not db_b.set_aside("bad-1", State.PENDING, "UNKNOWN_FORMAT", "no format")
        assert db_a.create_failed("bad-1", {"handoff_id": "bad-1", "status": "failed"})
        assert sql(pg_url, "SELECT id FROM handoffd.quarantine") == [("bad-1",)]
        assert other.ingest("bad-1") == "gone" and space.state_of("bad-1") == []
        assert sql(pg_url, "SELECT count(*) FROM handoffd.events WHERE handoff_id = 'bad-1' "
                           "AND event = 'ingested'") == [(1,)]
    finally:
        db_a.close()
        db_b.close()


def test_a_valid_document_finished_and_purged_in_between_is_not_ingested_again(
        tmp_path: Path, pg_url: str) -> None:
    db_a, db_b, first, other, space = two_bridges(tmp_path, pg_url)
    second = Second(other, "ok-1")
    hold(first, second.start_and_wait)
    try:
        space.drop("ok-1.json", request("ok-1"))
        assert first.ingest("ok-1") == "ingested" and space.state_of("ok-1") == []
        # it runs, completes and is purged (retention) before the second ingester goes on
        sql(pg_url, "UPDATE handoffd.handoffs SET state = 'completed' WHERE id = 'ok-1'")
        assert db_a.purge("ok-1", State.COMPLETED, utc_now())
        outcome = second.release()
        assert outcome in ("later", "gone"), outcome  # it was "ingested": to be run again
        assert sql(pg_url, "SELECT id FROM handoffd.handoffs") == []
        assert sql(pg_url, "SELECT id FROM handoffd.quarantine") == []
    finally:
        db_a.close()
        db_b.close()


def test_a_document_still_in_the_database_is_known_to_neither_twice(
        tmp_path: Path, pg_url: str) -> None:
    """The plain race (nothing happens to the row in between): one ingests, the other ingests
    nothing and removes nothing it did not read."""
    db_a, db_b, first, other, space = two_bridges(tmp_path, pg_url)
    second = Second(other, "ok-2")
    hold(first, second.start_and_wait)
    try:
        space.drop("ok-2.json", request("ok-2"))
        assert first.ingest("ok-2") == "ingested"
        assert second.release() in ("later", "gone", "known")
        assert sql(pg_url, "SELECT id, state FROM handoffd.handoffs") == [("ok-2", "pending")]
        assert space.state_of("ok-2") == []
    finally:
        db_a.close()
        db_b.close()


def test_a_file_put_in_place_of_the_one_read_is_not_removed_with_it(
        tmp_path: Path, pg_url: str) -> None:
    """The ingester removes the file it read and ingested, never a new drop renamed over it
    meanwhile (ingesting judges that one next: here a different document under a used id)."""
    db_a = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(db_a, local_store(root))
    space = Workspace(root)
    try:
        space.drop("re-1.json", request("re-1"))

        def replace() -> None:  # an agent writes a second version (a temp file, a rename)
            staged = space.root / "handoffs" / "re-1.tmp"
            staged.write_text('{"handoff_id": "re-1", "other": true}')
            os.replace(staged, space.root / "handoffs" / "pending" / "re-1.json")

        real_ingest = db_a.ingest

        def ingest_then_replace(*args: Any, **kwargs: Any) -> bool:
            fresh = real_ingest(*args, **kwargs)
            replace()
            return bool(fresh)

        db_a.ingest = ingest_then_replace
        assert files.ingest("re-1") == "ingested"
        assert space.state_of("re-1") == ["pending"]  # the new one is still there
        db_a.ingest = real_ingest
        assert files.ingest("re-1") == "set aside"  # a different document under a used id
    finally:
        db_a.close()


def test_a_file_its_writer_holds_locked_is_left_for_later(tmp_path: Path, pg_url: str) -> None:
    """A producer that flocks its own file while writing it is waited for (as a files store's
    claim waits for it); the file is ingested once it lets go."""
    db_a = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(db_a, local_store(root))
    space = Workspace(root)
    try:
        path = space.drop("lk-1.json", request("lk-1"))
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert files.ingest("lk-1") == "later" and space.state_of("lk-1") == ["pending"]
        finally:
            os.close(fd)
        assert files.ingest("lk-1") == "ingested" and space.state_of("lk-1") == []
    finally:
        db_a.close()


def test_a_half_written_file_is_still_left_for_later(tmp_path: Path, pg_url: str) -> None:
    db_a = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(db_a, local_store(root))
    space = Workspace(root)
    try:
        path = space.drop("hw-1.json", b'{"handoff_id": "hw-1", "sou')
        assert files.ingest("hw-1") == "later" and space.state_of("hw-1") == ["pending"]
        path.write_text(path.read_text().replace('"sou', '"x": 1}'))
        assert files.ingest("hw-1") in ("ingested", "set aside")  # judged once it is whole
        assert space.state_of("hw-1") == []
    finally:
        db_a.close()


CRASHING = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_postgres import backend
from test_postgres_hostile import bridge, local_store
from pathlib import Path
db = backend({url!r})
files = bridge(db, local_store(Path({root!r})))
real = db.ingest
def crash(*args, **kwargs):
    if {after_insert!r}:
        real(*args, **kwargs)
    print("taken", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 while it holds the file
db.ingest = crash
files.ingest("cr-1")
"""


def crash_while_ingesting(root: Path, url: str, after_insert: bool) -> None:
    """A process that dies (SIGKILL) holding pending/cr-1.json, before or after its insert."""
    code = CRASHING.format(tests=str(Path(__file__).parent), url=url, root=str(root),
                           after_insert=after_insert)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGKILL and done.stdout == "taken\n", done.stderr


def test_a_process_killed_while_it_holds_the_file_loses_nothing(
        tmp_path: Path, pg_url: str) -> None:
    db_a = backend(pg_url)
    root = tmp_path / "ws"
    files = bridge(db_a, local_store(root))
    space = Workspace(root)
    try:
        space.drop("cr-1.json", request("cr-1"))
        crash_while_ingesting(root, pg_url, after_insert=False)
        assert space.state_of("cr-1") == ["pending"]  # still there, and free (no lock left)
        assert files.ingest("cr-1") == "ingested" and space.state_of("cr-1") == []
        # killed after its insert committed, before the removal: the next ingest removes it
        sql(pg_url, "DELETE FROM handoffd.handoffs")
        space.drop("cr-1.json", request("cr-1"))
        crash_while_ingesting(root, pg_url, after_insert=True)
        assert space.state_of("cr-1") == ["pending"]
        assert files.ingest("cr-1") == "known" and space.state_of("cr-1") == []
        assert sql(pg_url, "SELECT id FROM handoffd.handoffs") == [("cr-1",)]
    finally:
        db_a.close()
