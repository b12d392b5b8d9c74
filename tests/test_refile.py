"""A filing that fails for a passing reason (a full disk) is retried, not the handler.

When an attempt's outcome cannot be filed (ENOSPC while writing the answer) before anything was
written where it was going, the daemon keeps the claim and the outcome (``Job.held``, the lease
still renewed) and files the same outcome again after ``RETRY_LOOK_SECONDS``, then with a
back-off: the handler, which has run (its side effects happened), does not run again. A stop
gives the claim up as before (the sweep hands it back free); a cancellation meanwhile wins; one
taker files it, however many threads look. A failure after the answer was written (removing the
in-progress copy) is resolved by recovery, which keeps the newer copy: nothing runs again."""
from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import wait_until
from test_daemon_inprocess import Serving as InThread

from handoffd import Daemon, Registry, Workspace, build_engine, new_native_request
from handoffd.backends.files import fsio, spares
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.states import State
from handoffd.service import attempts, held

FAST_REFILE = 0.2  # (RETRY_LOOK_SECONDS, 5 s in use: the first refile's wait)


class Counting:
    """A handler that counts its calls (its side effects would happen once per call)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, handoff: dict, ctx: Any) -> dict:
        with self.lock:
            self.calls += 1
        return {"status": "completed", "output": {"n": self.calls}}


def engine_with(tmp_path: Path, handler: Callable[[dict, Any], dict] | None = None, *,
                handlers: dict[str, Callable[[dict, Any], dict]] | None = None,
                **settings: Any) -> Engine:
    """An engine on a fresh workspace whose @t runs ``handler`` (or each agent of ``handlers``
    its own), with quick sweeps and rescans; ``settings`` override the daemon's."""
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(**{
        "sweep_seconds": 0.2, "rescan_seconds": 0.2, "claim_grace_seconds": 0.0,
        "grace_seconds": 2.0, **settings}))
    registry = Registry()
    for agent, func in (handlers or {"@t": handler}).items():
        assert func is not None
        registry.add_function(agent, lambda handoff, ctx, func=func: func(handoff, ctx),
                              config=config)
    return build_engine(ws, config, registry)


def submit(engine: Engine) -> str:
    doc = new_native_request(source="@test", target="@t", data=None, now=engine.clock())
    return engine.backend.store.create(doc, doc["handoff_id"])


class FullDisk:
    """``fsio.create_exclusive`` failing with ENOSPC for answers written into ``folder`` while
    ``full`` (the first ``times`` of them, when given); ``gate``, when set, holds the writes
    that go through until it is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: str = "completed",
                 times: int | None = None) -> None:
        self.real = fsio.create_exclusive
        self.folder = folder
        self.times = times
        self.full = True
        self.failed = 0
        self.written = 0
        self.gate: threading.Event | None = None
        monkeypatch.setattr(fsio, "create_exclusive", self)

    def __call__(self, target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == self.folder:  # (the filing passes text)
            if self.full and (self.times is None or self.failed < self.times):
                self.failed += 1
                raise OSError(errno.ENOSPC, "No space left on device", str(target))
            if self.gate is not None:
                assert self.gate.wait(20)
            self.written += 1
        self.real(target, *args, **kwargs)


def Serving(engine: Engine) -> InThread:
    """Daemon.serve in a thread for the duration of a with-block, looking by rescans only."""
    return InThread(engine, watch=False)


def events_of(engine: Engine, hid: str) -> tuple[State, list[str]]:
    state, doc = engine.get(hid)
    return state, [e["event"] for e in book(doc)["history"]]


@pytest.fixture(autouse=True)
def fast_refile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attempts, "RETRY_LOOK_SECONDS", FAST_REFILE)
    monkeypatch.setattr(held, "RETRY_LOOK_SECONDS", FAST_REFILE)


def test_a_failed_filing_is_filed_again_and_the_handler_runs_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the claim was given up and handed back, and the handler ran a second time."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    disk = FullDisk(monkeypatch, times=1)
    hid = submit(engine)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], 20)
            wait_until(lambda: hid not in daemon.active, 10)
            assert daemon.report.errors == 0  # filed at last: a batch would exit 0
        assert handler.calls == 1 and disk.failed == 1 and disk.written == 1
        state, events = events_of(engine, hid)
        assert state is State.COMPLETED and events == ["created", "claimed", "completed"], events
        assert engine.get(hid)[1]["output"] == {"n": 1}
        assert engine.backend.ids(State.IN_PROGRESS) == []
    finally:
        engine.backend.close()


def test_a_refile_that_keeps_failing_is_given_up_at_a_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk stays full for answers; the daemon stops: its claim is handed back to pending/
    uncounted at once (it was given up and left to a sweep: another process's recovery took it
    for a crash), and the next daemon runs the handler again."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    disk = FullDisk(monkeypatch)
    hid = submit(engine)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: disk.failed >= 3, 20)  # tried again, and again (0.2 s, 0.4 s)
            job = daemon.active[hid]
            assert job.held is not None and job.refile_after >= 4 * FAST_REFILE
            token = job.claim.token
        assert disk.failed >= 4  # the stop's last try
        assert daemon.report.errors == 1  # left unfiled: a batch would exit 1
        assert daemon.report.handed_back == 1
        assert engine.backend.store.locate(hid) == [State.PENDING] and handler.calls == 1
        assert not engine.backend.store.gave_up(token)  # (handed back, not left to a sweep)
        disk.full = False
        report = Daemon(engine, watch=False).run_batch()
        assert report.completed == 1 and handler.calls == 2
        state, events = events_of(engine, hid)
        assert state is State.COMPLETED and events[-3:] == ["handed_back", "claimed",
                                                             "completed"], events
        assert book(engine.get(hid)[1]).get("retries", 0) == 0  # free, not charged
    finally:
        engine.backend.close()


def test_cancelling_while_the_filing_is_retried_files_it_cancelled_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.features.cancel_family import cancel
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    disk = FullDisk(monkeypatch)  # completed/ is full; failed/ (where cancelled goes) is not
    hid = submit(engine)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: disk.failed >= 1, 20)
            cancel(engine, hid, reason="not needed", by="@test", via="test")
            wait_until(lambda: engine.backend.store.locate(hid) == [State.FAILED], 20)
            wait_until(lambda: hid not in daemon.active, 10)
            failed = disk.failed
            wait_until(lambda: not daemon.attempts.refiles, 10)  # its timer found nothing
        assert disk.failed == failed  # nothing tried to file it completed again
        state, events = events_of(engine, hid)
        assert events == ["created", "claimed", "cancelled"], events
        assert engine.get(hid)[1]["status"] == "cancelled" and handler.calls == 1
        assert engine.backend.ids(State.IN_PROGRESS) == []
    finally:
        engine.backend.close()


def test_two_refiles_never_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer's refile is writing the answer when other threads look (the scheduler, a
    second timer): they find nothing to file; the answer is written once."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    disk = FullDisk(monkeypatch, times=1)
    disk.gate = threading.Event()
    hid = submit(engine)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: disk.failed == 1, 20)
            job = daemon.active[hid]
            wait_until(lambda: job.held is None, 10)  # the timer took it: its write waits
            others = [threading.Thread(target=daemon.attempts._refile, args=(job,))
                      for _ in range(3)]
            for thread in others:
                thread.start()
            for thread in others:
                thread.join(10)
            daemon.attempts.work(hid)  # the scheduler's look: nothing to claim, nothing to file
            disk.gate.set()
            wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], 20)
            wait_until(lambda: hid not in daemon.active, 10)
        assert disk.written == 1 and handler.calls == 1
        assert events_of(engine, hid)[1] == ["created", "claimed", "completed"]
    finally:
        disk.gate.set()
        engine.backend.close()


def test_a_failure_after_the_answer_was_written_never_runs_the_handler_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing the in-progress copy fails (EIO) once the answer is in completed/: the claim
    is given up as before, and recovery keeps the newer copy (states.winner) and removes the
    in-progress one: nothing is handed back or run again."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    real_retire, failed = spares.retire, []

    def broken_retire(path: Path, tmp_dir: Path) -> bool:
        if Path(path).parent.name == "in-progress" and not failed:  # (retire takes a str too)
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_retire(path, tmp_dir)

    monkeypatch.setattr(spares, "retire", broken_retire)
    hid = submit(engine)
    try:
        with Serving(engine):
            wait_until(lambda: failed, 20)
            wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], 20)
        assert handler.calls == 1
        assert events_of(engine, hid)[1] == ["created", "claimed", "completed"]
    finally:
        engine.backend.close()


# ------------------------------------------------------------ found by the session's review
def test_a_delegation_whose_park_fails_keeps_its_children_and_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's park (its requeue among its new children) met a full disk: the failure was
    caught as a failed delegation, its children were cancelled, and it was charged a retry (a
    second failure dead-lettered it: its child ids 'taken'). Now the children stay, the claim
    is given up, the sweep hands the parent back, and its replay adopts them."""
    engine = engine_with(tmp_path, handlers={
        "@parent": lambda doc, ctx: {
            "status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": "@child", "data": {"n": 1}}, {"to": "@child", "data": {"n": 2}}]},
        "@child": lambda doc, ctx: {"status": "completed", "output": {}}})
    doc = new_native_request(source="@test", target="@parent", data=None, now=engine.clock())
    hid = engine.backend.store.create(doc, doc["handoff_id"])
    real = fsio.create_exclusive
    failed: list[Path] = []

    def park_fails_once(target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == "pending" and Path(target).name == f"{hid}.json" \
                and not failed:  # (the filing gives its path as text)
            failed.append(target)  # the parent's park, once; its children are written
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real(target, *args, **kwargs)

    monkeypatch.setattr(fsio, "create_exclusive", park_fails_once)
    try:
        with Serving(engine):
            wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], 30)
        assert len(failed) == 1
        state, events = events_of(engine, hid)
        assert state is State.COMPLETED and "handed_back" in events, events
        assert book(engine.get(hid)[1]).get("retries", 0) == 0  # free, not charged
        for child in (f"{hid}.c1", f"{hid}.c2"):
            assert events_of(engine, child) == (State.COMPLETED, ["created", "claimed",
                                                                  "completed"])
    finally:
        engine.backend.close()


def test_a_failure_before_the_answer_hands_the_claim_back_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure before the answer is written (here: a format's artifact, as a hi_moe answer of
    1 KB or more writes first) left the claim neither filed nor held: it lapsed and was
    recovered as a crash (an attempt charged, the specialist isolated as a suspect). Now the
    claim is given up at once and the sweep hands it back free."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    real_file = engine.file
    failed: list[str] = []

    def file_failing_first(claim: Any, *args: Any) -> State:
        if not failed:
            failed.append(claim.id)
            raise OSError(errno.ENOSPC, "No space left on device", "artifacts/x/1.txt")
        return real_file(claim, *args)

    monkeypatch.setattr(engine, "file", file_failing_first)
    hid = submit(engine)
    try:
        with Serving(engine):
            wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], 30)
        state, events = events_of(engine, hid)
        assert events == ["created", "claimed", "recovered", "handed_back", "claimed",
                          "completed"], events
        assert book(engine.get(hid)[1]).get("retries", 0) == 0 and handler.calls == 2
        assert "@t" not in engine.suspects
    finally:
        engine.backend.close()


def test_a_kept_outcome_whose_claim_was_lost_is_not_counted_filed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handler = Counting()
    # no sweep meanwhile: the copy below keeps our (given-up) token, which this process's own
    # sweep would hand back and run again, unlike a real takeover's new token
    engine = engine_with(tmp_path, handler, sweep_seconds=600)
    disk = FullDisk(monkeypatch, times=1)
    hid = submit(engine)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: disk.failed == 1 and hid in daemon.active, 20)
            path = engine.backend.store.path(State.IN_PROGRESS, hid)  # another's takeover:
            other = path.with_name("other.tmp")  # a new inode where ours was
            other.write_bytes(path.read_bytes())
            other.replace(path)
            wait_until(lambda: hid not in daemon.active, 20)
            assert daemon.report.errors == 1  # nothing was filed: the error stands
        assert engine.backend.store.locate(hid) == [State.IN_PROGRESS] and disk.written == 0
    finally:
        engine.backend.close()


def test_refusing_disks_hold_at_most_one_kept_answer_per_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """completed/ refusing every answer: the daemon went on claiming the whole backlog, one
    kept claim and one timer thread each (1,000 of them for 1,000 handoffs). Now it claims
    nothing more once as many answers wait as it has workers (those already being claimed
    beside them still run: at most twice the workers)."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    ids = [submit(engine) for _ in range(24)]
    disk = FullDisk(monkeypatch)
    try:
        with Serving(engine) as daemon:
            bound = 2 * daemon.workers
            wait_until(lambda: len(daemon.attempts.refiles) >= daemon.workers, 20)
            deadline = time.monotonic() + 1.0  # a second more: nothing else is claimed
            while time.monotonic() < deadline:
                assert handler.calls <= bound and len(daemon.active) <= bound
                time.sleep(0.05)
            disk.full = False
            wait_until(lambda: all(engine.backend.store.locate(i) == [State.COMPLETED]
                                   for i in ids), 60)
        assert handler.calls == len(ids)  # each ran once
    finally:
        engine.backend.close()


def test_a_stop_whose_hand_back_is_refused_too_gives_the_claim_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers and pending/ both refused at the stop: the claim is given up, and the next
    sweep of a daemon in this process hands it back free."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    hid = submit(engine)
    disk = FullDisk(monkeypatch)
    pending_full = FullDisk(monkeypatch, folder="pending")  # (wraps the first)
    pending_full.full = False
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: disk.failed >= 2, 20)
            token = daemon.active[hid].claim.token
            pending_full.full = True
        assert engine.backend.store.locate(hid) == [State.IN_PROGRESS]
        assert engine.backend.store.gave_up(token) and daemon.report.handed_back == 0
        disk.full = pending_full.full = False
        report = Daemon(engine, watch=False).run_batch()
        assert report.completed == 1 and handler.calls == 2
        assert book(engine.get(hid)[1]).get("retries", 0) == 0  # free, not charged
    finally:
        engine.backend.close()


def test_a_batch_on_a_disk_that_refuses_every_answer_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saturated (as many answers kept as workers), a batch starts nothing more; it waits up
    to grace_seconds for a refile, then ends as a stop does: what it kept is handed back, the
    rest stays pending for the next run, and it reports the errors."""
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    ids = [submit(engine) for _ in range(16)]
    FullDisk(monkeypatch)
    try:
        daemon = Daemon(engine, watch=False)
        started = time.monotonic()
        report = daemon.run_batch()
        assert time.monotonic() - started < 20
        assert report.completed == 0 and report.errors >= 1
        assert report.handed_back == handler.calls <= 2 * daemon.workers
        assert sorted(engine.backend.ids(State.PENDING)) == sorted(ids)
        assert engine.backend.ids(State.IN_PROGRESS) == []
    finally:
        engine.backend.close()


def test_a_saturated_daemon_is_no_stall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is dispatched on purpose while answers wait for a refusing disk: the progress
    watchdog took that for a stalled scheduler and reset it every stall_seconds."""
    engine = engine_with(tmp_path, Counting(), workers=2, stall_seconds=0.3)
    for _ in range(8):
        submit(engine)
    FullDisk(monkeypatch)
    try:
        with Serving(engine) as daemon:
            wait_until(lambda: daemon.attempts.saturated(), 20)
            time.sleep(1.5)  # five stall periods, saturated throughout
            assert daemon.report.stalls == 0
    finally:
        engine.backend.close()


def test_a_stop_hands_an_unfiled_answer_back_free_ten_times_then_counts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch on a disk that refuses answers ran the handler and handed it back for free,
    for ever (and its interrupted marks charged the next genuine stop at once). Now it counts
    as a stop's interrupted attempt does: free ten times in a row, then a counted attempt."""
    from handoffd.service.handbacks import FREE_HANDBACKS
    handler = Counting()
    engine = engine_with(tmp_path, handler)  # (max_retries: the default 3)
    hid = submit(engine)
    FullDisk(monkeypatch)
    monkeypatch.setattr(engine.settings, "grace_seconds", 0.05, raising=False)
    try:
        for _ in range(FREE_HANDBACKS + 1):
            Daemon(engine, watch=False).run_batch()
        doc = engine.get(hid)[1]
        assert handler.calls == FREE_HANDBACKS + 1
        assert book(doc).get("retries", 0) == 1, [e["event"] for e in book(doc)["history"]]
    finally:
        engine.backend.close()


def test_a_cancel_during_a_refile_under_way_still_files_it_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel request came while a refile had taken the kept answer: the waker found
    nothing to file, and fires once; that try failed, and the next one filed it completed."""
    from handoffd.features.cancel_family import cancel
    handler = Counting()
    engine = engine_with(tmp_path, handler)
    hid = submit(engine)
    real = fsio.create_exclusive
    tries: list[str] = []
    under_way, cancelled_now = threading.Event(), threading.Event()

    def answers_refused_twice(target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == "completed" and len(tries) < 2:  # (given as text)
            tries.append(Path(target).name)
            if len(tries) == 2:  # the first refile: cancelled while it runs, then it fails
                under_way.set()
                assert cancelled_now.wait(20)
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real(target, *args, **kwargs)

    monkeypatch.setattr(fsio, "create_exclusive", answers_refused_twice)
    try:
        with Serving(engine) as daemon:
            assert under_way.wait(20)
            cancel(engine, hid, reason="not needed", by="@test", via="test")
            cancelled_now.set()
            wait_until(lambda: engine.backend.store.locate(hid) == [State.FAILED], 20)
            wait_until(lambda: hid not in daemon.active, 10)
        state, events = events_of(engine, hid)
        assert events == ["created", "claimed", "cancelled"], events
        assert handler.calls == 1
    finally:
        engine.backend.close()
