"""The owner lock a daemon's claims ride on, when a handler closes its descriptor (bug F4).

An in-process Python handler that closes file descriptors it did not open (``os.closerange(3,
50)``, a careless "close inherited fds" helper) used to drop the daemon's owner lock silently:
the daemon kept serving, a second daemon took its running claim for abandoned ("owner process is
gone") and ran the same handoff at the same time. Now the daemon notices (one ``fstat`` per
claim, a full check every half second), takes a new lock, holds the lost one again if nobody
took it meanwhile, and fences the attempts that rode on it like a lost lease.

The unit tests close descriptors of this process one by one; the end-to-end ones let a real
``handoffd`` (never this test process) run the fd-closing handler, with a second daemon beside it
(repros r4.sh and r4b.sh of the ninth hunt), and record each run's start and end with its pid.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
from conftest import exe, wait_until

from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.files.store import Store
from handoffd.core.documents import book
from handoffd.core import liveness
from handoffd.core.liveness import bears_mark, own_mark, owner_may_live
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace
from handoffd.service.leases import LOST_LOCK_REASON, LeaseKeeper

# ------------------------------------------------------------------------------------------
# unit: the lock-health check


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    opened = Store(ws, durable=False)
    yield opened
    opened.close()


def held_by_someone(path: Path) -> bool:
    """True when some opening of ``path`` holds its flock (tried from a new opening)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (a lock we got is released with it)
    return False


def close_it(store: Store, path: Path) -> int | None:
    """A handler's os.close of the lock's descriptor; returns a descriptor to close later."""
    assert store.owners.held is not None
    os.close(store.owners.held.fd)
    return None


def reuse_it(store: Store, path: Path) -> int | None:
    """Closed, and its number taken by the next file the process opens."""
    assert store.owners.held is not None
    number = store.owners.held.fd
    os.close(number)
    other = os.open(path.parent.parent / "pending", os.O_RDONLY)
    if other != number:  # (another thread opened something meanwhile: put ours there)
        os.dup2(other, number)
        os.close(other)
    return number


def reopen_it(store: Store, path: Path) -> int | None:
    """Closed, and the lock file itself opened again under the same number (no lock held)."""
    assert store.owners.held is not None
    number = store.owners.held.fd
    os.close(number)
    again = os.open(path, os.O_RDWR)
    if again != number:
        os.dup2(again, number)
        os.close(again)
    return number


def remove_it(store: Store, path: Path) -> int | None:
    """The lock file removed: whoever opens the name next gets a new, free lock."""
    path.unlink()
    return None


def replace_it(store: Store, path: Path) -> int | None:
    """The lock file replaced by another one of the same name."""
    path.unlink()
    path.write_text("")
    return None


@pytest.mark.parametrize("lose, why, held_again", [
    (close_it, "descriptor was closed", True),
    (reuse_it, "reused for another file", True),
    (reopen_it, "lock file opened again", True),
    (remove_it, "file was removed", False),
    (replace_it, "file was replaced", False),
])
def test_lock_health_check_sees_each_way_of_losing_the_lock(
        store: Store, caplog: pytest.LogCaptureFixture,
        lose: Callable[[Store, Path], int | None], why: str, held_again: bool) -> None:
    old = store.owner_lock()
    path = store.ws.locks / old
    assert store.check_owner_lock() == old  # healthy: left alone, nothing said
    assert not caplog.records
    stray = lose(store, path)
    try:
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            new = store.check_owner_lock()
        assert new is not None and new != old
        assert store.owner_lock() == new  # later claims name the new lock
        assert held_by_someone(store.ws.locks / new)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "a handler closed the daemon's owner lock" in said[0], said
        assert why in said[0] and old in said[0] and new in said[0]
        if held_again:  # nobody took it meanwhile: held under a new descriptor, as a shield
            assert held_by_someone(path)
        assert store.check_owner_lock() == new  # said once
        assert len(caplog.records) == 1
        store.keep_shields(set())  # no claim rides on it any more: let go, file removed
        if held_again:
            assert not path.exists()
    finally:
        store.close()
        if stray is not None:  # close() left it alone: not its descriptor any more
            os.fstat(stray)
            os.close(stray)


def test_a_claim_after_the_lock_was_closed_names_a_new_lock(store: Store) -> None:
    """The claim's hot path checks the descriptor (one fstat): a claim never names a lock that
    any other process could take at once."""
    old = store.owner_lock()
    assert store.owners.held is not None
    os.close(store.owners.held.fd)
    doc = new_native_request(source="@t", target="@x", data={}, now=utc_now())
    hid = store.create(doc, "h1")
    claim = store.claim(hid, lease_seconds=30)
    assert claim is not None
    named = book(claim.doc)["lease"]["lock"]
    assert named != old and named == store.check_owner_lock()
    assert held_by_someone(store.ws.locks / named)


def test_a_lock_another_process_took_is_not_taken_back(store: Store) -> None:
    """Lost, then taken by another process (a recoverer) before we noticed: a new lock, and
    the old one stays the other's."""
    old = store.owner_lock()
    path = store.ws.locks / old
    assert store.owners.held is not None
    os.close(store.owners.held.fd)
    other = os.open(path, os.O_RDWR)  # (another opening stands for another process)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        new = store.check_owner_lock()
        assert new != old and not store.owners.shields
        fcntl.flock(other, fcntl.LOCK_UN)
        assert not held_by_someone(path)  # nobody of ours holds it
    finally:
        os.close(other)


def test_close_never_raises_nor_closes_a_descriptor_no_longer_its_own(store: Store) -> None:
    """close() after a handler closed the lock: no EBADF, and a reused number is left alone."""
    store.owner_lock()
    assert store.owners.held is not None
    number = store.owners.held.fd
    os.close(number)
    store.close()  # a dead descriptor: no "Bad file descriptor"
    store.owner_lock()
    assert store.owners.held is not None
    number = store.owners.held.fd
    os.close(number)
    other = os.open(store.ws.root, os.O_RDONLY)
    if other != number:
        os.dup2(other, number)
        os.close(other)
    try:
        store.close()
        os.fstat(number)  # still open: not ours to close
    finally:
        os.close(number)


def test_a_free_lock_of_a_live_owner_is_no_death(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the owner notices its lock is gone (half a second, or seconds on a loaded machine:
    seen with 8 test workers), a recoverer of this host finds the lock free. The lease's owner
    mark says its process lives: the claim is left to it (and to its lease), the lock file to its
    owner. A mark no live process bears, or none at all, is a death as before."""
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    owner = FilesBackend.open(ws, watch=False, durable=False)
    recoverer = FilesBackend.open(ws, watch=False, durable=False)
    now = utc_now()
    owner.create(new_native_request(source="@t", target="@x", data={}, now=now), "a", now)
    claim = owner.claim("a", now, 30)
    assert claim is not None
    held = book(claim.doc)["lease"]
    assert held["owner"]["pid"] == os.getpid() and len(held["owner"]["proc"]) == 16
    assert owner.store.owners.held is not None
    os.close(owner.store.owners.held.fd)  # a handler's careless close: the flock is gone
    assert not held_by_someone(ws.locks / held["lock"])
    try:
        assert recoverer.expired_claims(now, 30) == []
        assert (ws.locks / held["lock"]).exists()  # left to its owner, not removed
        assert not held_by_someone(ws.locks / held["lock"])  # nor kept
        # the same free lock with its owner gone (its mark borne by no live process): taken
        monkeypatch.setattr(liveness, "bears_mark", lambda pid, mark: False)
        taken = recoverer.expired_claims(now, 30)
        assert [c.id for c in taken] == ["a"] and "owner process is gone" in str(taken[0].recovered)
    finally:
        owner.store.close()
        recoverer.store.close()


def test_a_mark_names_one_live_process() -> None:
    """Marks come from documents: only a live pid whose start (this boot, this namespace)
    digests to the mark bears it; a finished child, another mark or a wrong type does not."""
    known = own_mark()
    assert known is not None
    mine, namespaces = known
    assert bears_mark(os.getpid(), mine) and namespaces.count("/") == 1
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    assert not bears_mark(child.pid, mine)
    for pid, mark in ((os.getpid(), "0" * 16), (os.getpid(), None), (str(os.getpid()), mine),
                      (True, mine), (-1, mine), (0, mine), (1 << 40, mine), (os.getpid(), mine + "x")):
        assert not bears_mark(pid, mark), (pid, mark)


def test_only_an_owner_this_process_can_look_up_is_judged_dead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease without a mark (an older writer) is judged by its lock alone; one written in other
    namespaces (a container on the same host: its pids and start times are not ours to read) or
    read where /proc is not of our pid namespace may live: only its lease's expiry ends it."""
    known = own_mark()
    assert known is not None
    me = {"host": "h", "pid": os.getpid(), "proc": known[0], "ns": known[1]}
    assert owner_may_live(me)
    assert not owner_may_live({**me, "proc": "0" * 16})  # nobody bears it: dead
    assert not owner_may_live({k: v for k, v in me.items() if k != "proc"})  # no mark: the lock
    for odd in ({**me, "ns": "1/2"}, {**me, "ns": None}, {**me, "proc": "0" * 16, "ns": ["x"]}):
        assert owner_may_live(odd), odd  # cannot be looked up from here
    monkeypatch.setattr(liveness, "_MINE", {})
    monkeypatch.setattr(liveness, "_proc_is_ours", lambda: False)
    assert own_mark() is None  # writes no mark, and cannot judge one
    assert owner_may_live({**me, "proc": "0" * 16})


UNSHARE_PROBE = """
import json, os
from handoffd.core.liveness import own_mark, bears_mark
known = own_mark()
print(json.dumps({"pid": os.getpid(), "known": known,
                  "bears": bool(known) and bears_mark(os.getpid(), known[0])}))
"""


@pytest.mark.parametrize("mount_proc", [True, False])
def test_a_process_in_a_pid_namespace_marks_itself_only_where_it_can_be_looked_up(
        mount_proc: bool) -> None:
    """As pid 1 of a new pid namespace (a container's entrypoint) a daemon bears its own mark
    (pid 1 was refused); in a namespace whose /proc is still the host's, it writes none (its mark
    named the host's process of its pid number: kthreadd, which never dies)."""
    unshare = shutil.which("unshare")
    command = [unshare or "unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []),
               sys.executable, "-c", UNSHARE_PROBE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except OSError as exc:
        pytest.skip(f"unshare cannot run here: {exc}")
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no pid namespaces here: {done.stderr.strip()}")
    seen = json.loads(done.stdout)
    assert seen["pid"] == 1, seen
    if mount_proc:
        assert seen["known"] is not None and seen["bears"] is True, seen
    else:
        assert seen["known"] is None, seen


# ------------------------------------------------------------------------------------------
# unit: the fence


def test_claims_on_a_lost_lock_are_broken_and_fenced(tmp_path: Path) -> None:
    """The lease keeper's lock check fences the running jobs whose claims name the lost lock,
    not those on the new one; the lost lock is held until their attempts have ended."""
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    backend = FilesBackend.open(ws, watch=False, durable=False)
    clock = utc_now()
    for hid in ("a", "b"):
        backend.create(new_native_request(source="@t", target="@x", data={}, now=clock), hid,
                       clock)
    before = backend.claim("a", clock, 30)
    assert before is not None
    old = book(before.doc)["lease"]["lock"]
    assert backend.store.owners.held is not None
    os.close(backend.store.owners.held.fd)
    after = backend.claim("b", clock, 30)  # (its claim notices and takes a new lock)
    assert after is not None and book(after.doc)["lease"]["lock"] != old

    # (stand-ins for the daemon's jobs and engine: only what the lease keeper reads)
    jobs: list[Any] = [SimpleNamespace(claim=before, ending=False, fenced=False, handoff_id="a"),
                       SimpleNamespace(claim=after, ending=False, fenced=False, handoff_id="b")]
    fenced: list[tuple[str, str]] = []
    engine: Any = SimpleNamespace(backend=backend, settings=SimpleNamespace(lease_seconds=30.0))
    keeper = LeaseKeeper(engine, lambda: jobs,
                         lambda job, why: fenced.append((job.handoff_id, why)))
    keeper.check_locks()
    assert fenced == [("a", LOST_LOCK_REASON)]
    keeper.check_locks()  # at most once per job
    assert len(fenced) == 1
    assert held_by_someone(ws.locks / old)  # held again while "a" winds down
    # its attempt ends, filed as usual (nobody else took the claim over)
    assert backend.finish(before, State.FAILED, before.doc)
    jobs.pop(0)
    keeper.check_locks()
    assert not (ws.locks / old).exists()  # let go once no claim rides on it
    backend.store.close()


# ------------------------------------------------------------------------------------------
# end to end: real daemons running a handler that closes descriptors 3..50

PLUGIN = '''
import json, os, time

def closer(h, ctx):
    time.sleep(0.3)  # (not while another worker is mid-claim: that is another story)
    for fd in range(3, 51):  # a careless "close inherited fds" helper
        try:
            os.close(fd)
        except OSError:
            pass
    return {"status": "completed"}

def file_closer(h, ctx):
    """closer, sparing pipes and inotify descriptors: the file watch, once its pipe was closed,
    writes into whatever file reused the number when it restarts (handoffd/backends/files/
    inotify.py, not the owner lock; see test_a_batch_whose_lock_a_handler_closed_exits_cleanly)."""
    time.sleep(0.3)
    for fd in range(3, 51):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "anon_inode:")):
                continue
            os.close(fd)
        except OSError:
            pass
    return {"status": "completed"}

def _note(ctx, what):
    line = json.dumps({"id": ctx.handoff_id, "pid": os.getpid(), "attempt": ctx.attempt,
                       "what": what, "t": time.time()})
    fd = os.open(os.path.join(str(ctx.root), "runs.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)

def slow(h, ctx):
    """Runs for RUN_SECONDS unless cancelled (a handler that honours ctx.cancelled)."""
    _note(ctx, "start")
    try:
        ctx.cancelled.wait(RUN_SECONDS)
    finally:
        _note(ctx, "end")
    return {"status": "completed"}

def ok(h, ctx):
    return {"status": "completed"}
'''

# (durability "fsync": other parts of a daemon close descriptor numbers a handler closed and the
# process reused meanwhile, e.g. the file watch's restart; a temp file whose descriptor became a
# pipe then fails its fsync instead of being published empty)
CONFIG = """
[daemon]
workers = 2
sweep_seconds = 0.5
settle_seconds = 0.1
claim_grace_seconds = 1.0
lease_seconds = 30.0
grace_seconds = 3.0

[retry]
max_retries = 3
retry_delay_seconds = 0.1
backoff_multiplier = 1.0

[specialists."@closer"]
handler = "fdplug:closer"

[specialists."@file_closer"]
handler = "fdplug:file_closer"

[specialists."@slow"]
handler = "fdplug:slow"

[specialists."@ok"]
handler = "fdplug:ok"
"""
RUN_SECONDS = 6.0
LOST = "new claims hold owner."  # (in the one warning of a lost owner lock)


class Daemons:
    """Real handoffd processes on one workspace, their stderr in files; killed (by pid) at the
    end whatever happened."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        plug = root / "plug"
        plug.mkdir(parents=True)
        (plug / "fdplug.py").write_text(PLUGIN.replace("RUN_SECONDS", repr(RUN_SECONDS)))
        (root / "handoffd.toml").write_text(CONFIG)
        Workspace(root).ensure()
        self.env = {**os.environ, "PYTHONPATH": str(plug)}

    def start(self, *args: str, name: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "wb") as err:
            proc = subprocess.Popen([exe("handoffd"), *args, "--root", str(self.root)],
                                    stdout=subprocess.DEVNULL, stderr=err, env=self.env)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def create(self, target: str) -> str:
        done = subprocess.run([exe("handoff"), "create", "--root", str(self.root), "--to", target,
                               "--data", "{}"], capture_output=True, text=True, timeout=20,
                              env=self.env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def runs(self) -> list[dict[str, Any]]:
        path = self.root / "runs.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    def states(self, hid: str) -> list[str]:
        folders = self.root / "handoffs"
        return [s.value for s in State if (folders / s.value / f"{hid}.json").exists()]

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=10)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Daemons]:
    started = Daemons(tmp_path / "ws")
    yield started
    started.kill_all()


def overlaps(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of runs of one handoff (start to end, by pid and attempt) that overlapped in time;
    a run with no end yet lasts until now."""
    spans: dict[tuple[str, int, int], list[float]] = {}
    for run in runs:
        span = spans.setdefault((run["id"], run["pid"], run["attempt"]), [0.0, time.time()])
        span[0 if run["what"] == "start" else 1] = run["t"]
    found = []
    keys = sorted(spans)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if a[0] == b[0] and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]:
                found.append(({"run": a, "span": spans[a]}, {"run": b, "span": spans[b]}))
    return found


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` (bounded); its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def lose_lock_under_a_running_handoff(daemons: Daemons, first: subprocess.Popen[bytes],
                                      name: str) -> str:
    """Start @slow in daemon ``first``, then @file_closer, which closes its files; then a
    second daemon of the workspace, once the first said it lost its lock (at most 2 s: before
    the fix it never did, and the second daemon took the running claim over)."""
    slow = daemons.create("@slow")
    wait_until(lambda: any(r["what"] == "start" for r in daemons.runs()), 10, "@slow started")
    daemons.create("@file_closer")
    wait_for(lambda: LOST in daemons.log(name), 2.0)
    return slow


@pytest.mark.heavy
def test_two_daemons_never_run_a_handoff_at_once_after_a_handler_closed_the_lock(
        daemons: Daemons) -> None:
    a = daemons.start("serve", name="a")
    wait_until(lambda: "serving" in daemons.log("a"), 10, "daemon A serving")
    slow = lose_lock_under_a_running_handoff(daemons, a, "a")
    b = daemons.start("serve", name="b")
    assert wait_for(lambda: daemons.states(slow) == ["completed"], 15), \
        (daemons.states(slow), daemons.runs(), daemons.log("a"), daemons.log("b"))
    assert a.poll() is None and b.poll() is None
    code_a, code_b = daemons.stop(a), daemons.stop(b)
    runs = daemons.runs()
    assert not overlaps(runs), (overlaps(runs), daemons.log("a"), daemons.log("b"))
    assert "owner process is gone" not in daemons.log("b"), daemons.log("b")
    assert LOST in daemons.log("a"), daemons.log("a")  # (said at least once)
    assert not list((daemons.root / "handoffs" / "in-progress").iterdir())
    assert daemons.states(slow) == ["completed"]
    # the attempt on the lost lock was fenced: a counted, retryable PROCESSING_ERROR
    history = json.loads((daemons.root / "handoffs" / "completed" / f"{slow}.json").read_text())
    assert "PROCESSING_ERROR" in json.dumps(history), history
    for name, code in (("a", code_a), ("b", code_b)):
        assert code == 0 and "error: " not in daemons.log(name), (name, daemons.log(name))


@pytest.mark.heavy
def test_a_batch_that_lost_its_lock_leaves_every_handoff_filed_once(daemons: Daemons) -> None:
    """A `run` batch whose lock a handler closed under a running handoff, with a serving daemon
    beside it: nothing runs twice at once, nothing is taken over, nothing stays in
    in-progress/ (its exit code: see the next test)."""
    slow = daemons.create("@slow")
    daemons.create("@file_closer")
    others = [daemons.create("@ok") for _ in range(3)]
    batch = daemons.start("run", name="a")
    wait_for(lambda: LOST in daemons.log("a"), 2.0)  # (before the fix: never said)
    serving = daemons.start("serve", name="b")
    assert wait_for(lambda: all(daemons.states(h) == ["completed"] for h in [slow, *others]), 15), \
        ([daemons.states(h) for h in [slow, *others]], daemons.runs(), daemons.log("a"),
         daemons.log("b"))
    batch.wait(timeout=15)
    daemons.stop(serving)
    runs = daemons.runs()
    assert not overlaps(runs), (overlaps(runs), daemons.log("a"), daemons.log("b"))
    assert "owner process is gone" not in daemons.log("b"), daemons.log("b")
    assert LOST in daemons.log("a"), daemons.log("a")  # (said at least once)
    assert not list((daemons.root / "handoffs" / "in-progress").iterdir())


def test_a_batch_whose_lock_a_handler_closed_exits_cleanly(daemons: Daemons) -> None:
    """Everything completed: exit 0, never "error: Bad file descriptor" (the batch of repro
    r4b): Store.close, every lock check and the file watch's stop never use a descriptor the
    handler closed (and the process may have reused)."""
    for _ in range(3):
        daemons.create("@ok")
    daemons.create("@closer")
    batch = daemons.start("run", name="a")
    code = batch.wait(timeout=20)
    assert "error:" not in daemons.log("a"), daemons.log("a")
    assert code == 0, daemons.log("a")
    assert not list((daemons.root / "handoffs" / "in-progress").iterdir())


def test_a_sweep_between_a_new_locks_creation_and_its_flock_cannot_remove_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen once in the kill -9 test: a daemon's first claim after a restart creates its owner
    lock file, and another daemon's sweep (remove_orphans) found it there before it was flocked,
    took it for a dead owner's, and removed it. The new lock then held a file no longer in
    .locks: its next check found "its file was removed" and fenced its running handoff, a
    counted retry with no crash anywhere. A new lock file now appears in .locks already locked."""
    from handoffd.backends.files import orphans
    real_flock = fcntl.flock
    swept: list[list[str]] = []

    def sweep_first(fd: int, op: int) -> None:
        if not swept:  # (the sweep's own try_lock flocks too: run it once)
            done: Any = {"locks_removed": [], "temp_files_removed": []}
            swept.append(done["locks_removed"])
            orphans.remove_orphans(store, done)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", sweep_first)
    name = store.owner_lock()
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert swept == [[]]  # the sweep ran between creation and flock, and removed nothing
    assert held_by_someone(store.ws.locks / name)
    assert store.check_owner_lock() == name  # still held: nothing to fence


def test_a_new_owner_lock_is_made_within_locks_even_when_it_is_a_mount_of_its_own(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review s12, R8: the lock was made in .tmp and renamed into .locks; with .locks a mount of
    its own (a tmpfs) that rename failed with EXDEV at every claim, and nothing ran. The rename
    here fails as it would across two filesystems; the lock is staged in .locks itself."""
    real_rename = os.rename

    def one_filesystem_per_folder(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", one_filesystem_per_folder)
    name = store.owner_lock()
    monkeypatch.setattr(os, "rename", real_rename)
    assert held_by_someone(store.ws.locks / name)
    assert sorted(p.name for p in store.ws.locks.iterdir()) == [name]  # nothing left staged
    assert store.check_owner_lock() == name


def test_the_sweep_removes_a_staged_owner_lock_only_once_its_process_is_surely_gone(
        store: Store) -> None:
    """A process that died between making its new lock file (under its staging name) and naming
    it leaves the file: the sweep removes it once it is older than the temp age and free; never
    a young one (its process may be naming it now) nor one somebody holds."""
    from handoffd.backends.files import orphans
    locks = store.ws.locks
    old = time.time() - orphans.TMP_MAX_AGE_SECONDS - 60
    dead, young, held = (locks / f"owner.{os.urandom(16).hex()}.lock.new" for _ in range(3))
    for path in (dead, young, held):
        path.write_bytes(b"")
    os.utime(dead, (old, old))
    os.utime(held, (old, old))
    holder = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done: Any = {"locks_removed": [], "temp_files_removed": []}
        orphans.remove_orphans(store, done)
    finally:
        os.close(holder)
    assert done == {"locks_removed": [dead.name], "temp_files_removed": []}
    assert sorted(p.name for p in locks.iterdir()) == sorted([young.name, held.name])


FORKER = '''
import os, pathlib, time

def forks(h, ctx=None):
    pid = os.fork()  # no exec: the child keeps the daemon's memory and descriptors
    if pid == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    pathlib.Path(os.environ["FORKED_PIDFILE"]).write_text(str(pid))
    time.sleep(60)
    return {"status": "completed"}
'''


def test_a_child_a_handler_forks_does_not_keep_a_dead_daemons_claims_alive(
        tmp_path: Path) -> None:
    """A Python handler that forks without exec (``multiprocessing``'s default start on Linux)
    gave its child the daemon's owner-lock descriptor: the daemon killed, its claim looked
    alive for as long as the child lived. The child's copy is closed at the fork, so the claim
    is recovered at the next sweep."""
    root = tmp_path / "ws"
    (root / "plug").mkdir(parents=True)
    (root / "plug" / "forker.py").write_text(FORKER)
    (root / "handoffd.toml").write_text(
        "[daemon]\nsweep_seconds = 0.5\nsettle_seconds = 0.1\nclaim_grace_seconds = 1.0\n"
        "lease_seconds = 60.0\n\n[specialists.\"@forker\"]\nhandler = \"forker:forks\"\n")
    Workspace(root).ensure()
    pidfile = tmp_path / "forked.pid"
    env = {**os.environ, "PYTHONPATH": str(root / "plug"), "FORKED_PIDFILE": str(pidfile)}
    made = subprocess.run([exe("handoff"), "create", "--root", str(root), "--to", "@forker",
                           "--id", "f1"], capture_output=True, text=True, timeout=30, env=env)
    assert made.returncode == 0, made.stderr
    daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(root)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    forked = 0
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 30, "the fork")
        forked = int(pidfile.read_text())
        daemon.kill()
        daemon.wait(timeout=10)
        time.sleep(1.2)  # past the claim grace
        swept = subprocess.run([exe("handoffd"), "sweep", "--root", str(root)],
                               capture_output=True, text=True, timeout=60, env=env)
        assert swept.returncode == 0, swept.stderr
        assert not (root / "handoffs" / "in-progress" / "f1.json").exists(), swept.stdout
        assert (root / "handoffs" / "pending" / "f1.json").exists(), swept.stdout
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)
        if forked:
            try:
                os.kill(forked, signal.SIGKILL)
            except ProcessLookupError:
                pass
