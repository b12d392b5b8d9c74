"""The daemon in-process: registration sources, concurrency, leases, health, faults, durability."""
from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import exe, wait_until

from handoffd import (
    Daemon,
    Engine,
    Registry,
    State,
    Workspace,
    build_engine,
    new_native_request,
    specialist,
)
from handoffd.backends.files import fsio
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.documents import book
from handoffd.core.timeutil import parse_iso
from handoffd.backends.files import inotify
from handoffd.core.storage import LOST, Wakeup


def engine_with(tmp_path: Path, handler: Any, **settings: Any) -> Engine:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(**{"sweep_seconds": 0.2, "rescan_seconds": 0.2, **settings}))
    registry = Registry()
    registry.add_function("@t", handler, config=config, concurrency=settings.get("workers", 4))
    return build_engine(ws, config, registry)


def submit(engine: Engine, data: Any = None, **extra: Any) -> str:
    doc = new_native_request(source="@test", target="@t", data=data, now=engine.clock())
    doc.update(extra)
    return engine.backend.store.create(doc, doc["handoff_id"])


class Serving:
    """Run Daemon.serve in a thread for the duration of a with-block (``watch``: inotify, or
    only the rescans)."""

    def __init__(self, engine: Engine, *, watch: bool = True) -> None:
        self.daemon = Daemon(engine, watch=watch)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.daemon.serve,
                                       kwargs={"install_signals": False, "ready": self.ready.set})

    def __enter__(self) -> Daemon:
        self.thread.start()
        assert self.ready.wait(10)
        return self.daemon

    def __exit__(self, *exc: object) -> None:
        self.daemon.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def test_decorator_registers_a_specialist(tmp_path: Path) -> None:
    @specialist("@decorated", concurrency=3, timeout_seconds=7)
    def handler(handoff: dict, ctx: Any) -> dict:
        return {"status": "completed", "output": {"via": "decorator"}}

    registry = Registry.load(Config(), use_entry_points=False)
    spec = registry.get("@decorated")
    assert spec is not None and spec.func is handler
    assert spec.config.concurrency == 3 and spec.config.timeout_seconds == 7


def test_entry_point_specialist_is_found(tmp_path: Path) -> None:
    """A package exposing `handoffd.core.specialists` entry points is picked up by the real daemon."""
    site = tmp_path / "site"
    (site / "epdemo").mkdir(parents=True)
    (site / "epdemo" / "__init__.py").write_text(
        "def handle(handoff, ctx):\n    return {'status': 'completed', 'output': {'via': 'entry point'}}\n")
    dist = site / "epdemo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: epdemo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[handoffd.core.specialists]\n@ep = epdemo:handle\n")
    root = tmp_path / "ws"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    created = subprocess.run([exe("handoff"), "create", "--to", "@ep", "--root", str(root)],
                             capture_output=True, text=True, env=env, timeout=60)
    hid = created.stdout.strip()
    run = subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    doc = json.loads((root / "handoffs" / "completed" / f"{hid}.json").read_text())
    assert doc["output"] == {"via": "entry point"}


def test_concurrency_limit_is_respected(tmp_path: Path) -> None:
    running, peak, lock = [0], [0], threading.Lock()

    def handler(handoff: dict, ctx: Any) -> dict:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, workers=4)
    engine.registry.get("@t").config.concurrency = 2
    ids = [submit(engine) for _ in range(8)]
    report = Daemon(engine).run_batch()
    assert report.completed == 8 and peak[0] == 2
    assert all(engine.backend.store.locate(i) == [State.COMPLETED] for i in ids)


def test_lease_is_renewed_while_the_handler_runs(tmp_path: Path) -> None:
    gate = threading.Event()
    engine = engine_with(tmp_path, lambda h, c: gate.wait(10) and {"status": "completed"},
                         lease_seconds=1.5)
    hid = submit(engine)
    with Serving(engine):
        def expiry() -> str | None:  # the claim rename comes before the lease is written
            try:
                lease = book(engine.backend.store.read(State.IN_PROGRESS, hid)).get("lease")
            except FileNotFoundError:
                return None
            return lease.get("expires_at") if isinstance(lease, dict) else None

        wait_until(lambda: expiry() is not None)
        first = expiry()
        wait_until(lambda: expiry() not in (None, first))
        later = expiry()
        assert first is not None and later is not None
        assert parse_iso(later) > parse_iso(first)
        gate.set()
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED])


def test_a_second_dispatch_of_a_running_handoff_leaves_it_tracked(tmp_path: Path) -> None:
    """A late hint can dispatch an id a second time after a worker claimed it (its peek read the
    pending file just before the claim). The second worker finds it taken; it must not drop the
    first one's job from the daemon's books: that job then had no lease renewal, was recovered
    as "stalled" by our own sweep, and never saw its cancel request (found in a full run)."""
    gate = threading.Event()
    engine = engine_with(tmp_path, lambda h, c: gate.wait(10) and {"status": "completed"})
    hid = submit(engine)
    with Serving(engine) as daemon:
        wait_until(lambda: daemon.running_job(hid) is not None)
        job = daemon.running_job(hid)
        daemon.attempts.work(hid)  # the second dispatch: the claim is gone, nothing to run
        assert daemon.running_job(hid) is job
        gate.set()
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED])
    assert daemon.running_job(hid) is None


def test_a_lease_renewal_that_meets_the_filing_is_not_a_takeover(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The main loop renews the leases of the jobs in ``active``; a job just filed is still
    there until its worker returns. Its renewal then fails (the claim is finished), which was
    logged as "claim was recovered by another process; its result will be discarded" for a
    handoff that had completed (2 of 10,000 in a serving daemon)."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    daemon = Daemon(engine, watch=False)
    real_file = engine.file

    def file_then_renew(*args: Any, **kwargs: Any) -> Any:
        filed = real_file(*args, **kwargs)
        daemon.renew_leases()  # the main loop, in the window before the worker returns
        return filed

    engine.file = file_then_renew  # type: ignore[method-assign]
    daemon.attempts.work(hid)
    assert engine.backend.store.locate(hid) == [State.COMPLETED]
    assert "recovered by another process" not in caplog.text


def test_fast_short_handoffs_chain_on_one_worker_and_slow_ones_spread(tmp_path: Path) -> None:
    """Durability fast: while another worker's task is younger than SPIN_UP_SECONDS, a finishing
    worker takes nothing more and the scheduler starts no one (that task's worker chains);
    once every running task is older, both may. With fsync too (four threads contending for
    the GIL cost a third more CPU than one, and the drain was no faster)."""
    from handoffd.service.daemon import SPIN_UP_SECONDS
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, durability="fast")
    daemon = Daemon(engine, workers=4, watch=False)
    try:
        submit(engine)
        daemon.scan()
        now = time.monotonic()
        books = daemon.scheduler
        with daemon.cv:
            books.inflight[-1] = ("@t", now)  # another worker's task, just started
            assert books.spin_up_at() == now + SPIN_UP_SECONDS
            assert daemon.dispatcher.chain() is None and daemon.running == 0
            books.inflight[-1] = ("@t", now - 1.0)  # a slow one: this worker goes on
            task = daemon.dispatcher.chain()
            assert task is not None and daemon.running == 1
            books.finished(task[0])
            del books.inflight[-1]
    finally:
        daemon.pool.shutdown()
    durable = engine_with(tmp_path / "b", lambda h, c: {"status": "completed"}, durability="fsync")
    assert Daemon(durable, workers=4, watch=False).scheduler.spin_up == SPIN_UP_SECONDS


def test_fast_slow_handlers_still_run_side_by_side(tmp_path: Path) -> None:
    """Three handlers that each wait until all three have started: they finish only if the
    daemon spins up a worker per slow task despite the chaining delay."""
    started: list[str] = []
    lock, all_in = threading.Lock(), threading.Event()

    def handler(doc: dict, ctx: Any) -> dict:
        with lock:
            started.append(ctx.handoff_id)
            if len(started) == 3:
                all_in.set()
        return {"status": "completed" if all_in.wait(10) else "failed"}

    engine = engine_with(tmp_path, handler, durability="fast", workers=3)
    ids = [submit(engine) for _ in range(3)]
    report = Daemon(engine, watch=False).run_batch()
    assert report.completed == 3, report
    assert all(engine.backend.store.locate(i) == [State.COMPLETED] for i in ids)


def test_scheduled_retry_survives_a_restart(tmp_path: Path) -> None:
    calls = []

    def handler(handoff: dict, ctx: Any) -> dict:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "try later"}}
        return {"status": "completed"}

    from datetime import datetime, timedelta, timezone

    now = [datetime(2026, 1, 13, 10, 0, tzinfo=timezone.utc)]
    engine = engine_with(tmp_path, handler)
    engine.clock = lambda: now[0]
    hid = submit(engine, retry_policy={"max_retries": 1, "retry_delay_seconds": 30})
    first = Daemon(engine).run_batch()  # attempt 1 fails; the retry is due in 30 s
    assert first.retrying == 1 and engine.backend.store.locate(hid) == [State.PENDING]
    assert parse_iso(book(engine.backend.store.read(State.PENDING, hid))["next_attempt_at"]) == now[0] + timedelta(seconds=30)
    assert Daemon(build_engine(engine.ws, engine.config, engine.registry, clock=lambda: now[0])).run_batch().completed == 0
    now[0] += timedelta(seconds=31)
    restarted = build_engine(engine.ws, engine.config, engine.registry, clock=lambda: now[0])  # a new process
    assert Daemon(restarted).run_batch().completed == 1
    assert calls == [1, 2]


def serve_past_the_grace(tmp_path: Path, meanwhile: Callable[[Engine, str], None] = lambda e, h: None
                         ) -> tuple[Engine, str, Serving]:
    """Serve one handoff whose handler runs ``meanwhile`` and then outlasts a 0.3 s grace."""
    started = threading.Event()

    def handler(handoff: dict, ctx: Any) -> dict:
        meanwhile(engine, handoff["handoff_id"])
        started.set()
        while not ctx.cancelled.is_set():
            time.sleep(0.01)
        ctx.check_cancelled()
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, grace_seconds=0.3)
    hid = submit(engine)
    serving = Serving(engine)
    with serving:
        assert started.wait(10)
    return engine, hid, serving


def test_grace_period_running_out_hands_work_back(tmp_path: Path) -> None:
    engine, hid, serving = serve_past_the_grace(tmp_path)
    assert engine.backend.store.locate(hid) == [State.PENDING]
    doc = engine.backend.store.read(State.PENDING, hid)
    assert book(doc)["history"][-1]["event"] == "handed_back" and book(doc)["attempt"] == 0
    assert serving.daemon.report.handed_back == 1


def test_a_stop_does_not_count_a_hand_back_of_a_claim_taken_over_meanwhile(tmp_path: Path) -> None:
    # the handler outlasts the grace, and meanwhile another process took the claim over (its
    # in-progress file replaced): the stop writes nothing and reports no hand-back
    def take_over(engine: Engine, hid: str) -> None:
        path = engine.ws.state_dir(State.IN_PROGRESS) / f"{hid}.json"
        spare = path.with_name(path.name + ".other")
        spare.write_bytes(path.read_bytes())
        os.replace(spare, path)  # a new inode: someone else's claim now

    engine, hid, serving = serve_past_the_grace(tmp_path, take_over)
    assert engine.backend.store.locate(hid) == [State.IN_PROGRESS]
    doc = engine.backend.store.read(State.IN_PROGRESS, hid)
    assert book(doc)["history"][-1]["event"] == "claimed"
    assert serving.daemon.report.handed_back == 0


def test_dead_watch_is_restarted_by_the_sweep_and_overflow_triggers_rescan(tmp_path: Path) -> None:
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    backend = engine.backend
    heard: list[Wakeup] = []
    with Serving(engine):
        unsubscribe = backend.subscribe(heard.append)
        watch = backend._watch
        assert watch is not None and watch.alive()
        events = watch._source
        events._thread = None  # the reader thread is gone as if it had died
        hid = submit(engine)  # still served: create's own hint and the rescans
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED])
        # the daemon's next sweep (backend.maintain) restarts it and asks for a rescan
        wait_until(lambda: watch.alive() and watch._source is not events)
        wait_until(lambda: any(w.kind == LOST for w in heard))
        # a foreign producer's file, seen through the restarted watch
        doc = new_native_request(source="@x", target="@t", data=None, now=engine.clock(),
                                 handoff_id="foreign-1")
        (engine.ws.state_dir(State.PENDING) / "foreign-1.json").write_text(json.dumps(doc))
        wait_until(lambda: any(w.handoff_id == "foreign-1" and w.kind == "pending" for w in heard))
        wait_until(lambda: engine.backend.store.locate("foreign-1") == [State.COMPLETED])
        heard.clear()
        watch._source._dispatch(struct.pack("iIII", -1, inotify.IN_Q_OVERFLOW, 0, 0))
        assert [w.kind for w in heard] == [LOST]  # the kernel dropped events: look at everything
        unsubscribe()


def test_disk_full_while_filing_is_retried_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, claim_grace_seconds=0.0)
    real = fsio.create_exclusive
    failures = [0]

    def flaky_create(target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == "completed" and failures[0] < 1:  # (given as text)
            failures[0] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(fsio, "create_exclusive", flaky_create)
    hid = submit(engine, retry_policy={"max_retries": 3, "retry_delay_seconds": 0.1})
    with Serving(engine):
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], timeout=20)
    doc = engine.backend.store.read(State.COMPLETED, hid)
    # its claim and outcome are kept, and the filing alone is tried again: the handler, which
    # succeeded, does not run again (it did, after a hand-back, before tests/test_refile.py)
    events = [e["event"] for e in book(doc)["history"]]
    assert failures[0] == 1 and events == ["created", "claimed", "completed"], events
    assert book(doc).get("retries", 0) == 0


def test_fast_durability_skips_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    real = os.fsync
    fast = engine_with(tmp_path / "a", lambda h, c: {"status": "completed"}, durability="fast")
    assert fast.backend.store.key  # the workspace's seal key is made (and synced) once, not per handoff
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.__setitem__(0, calls[0] + 1), real(fd))[1])
    submit(fast)
    assert Daemon(fast).run_batch().completed == 1 and calls[0] == 0
    durable = engine_with(tmp_path / "b", lambda h, c: {"status": "completed"})
    submit(durable)
    assert Daemon(durable).run_batch().completed == 1 and calls[0] >= 4


def test_priority_orders_due_handoffs(tmp_path: Path) -> None:
    order: list[str] = []
    engine = engine_with(tmp_path, lambda h, c: order.append(c.data) or {"status": "completed"},
                         workers=1)
    for name, priority in [("low-1", "low"), ("normal-1", "normal"), ("critical-1", "critical"),
                           ("backlog-1", 4), ("high-1", "high"), ("low-2", "low"), ("high-2", 1)]:
        submit(engine, name, priority=priority)
    daemon = Daemon(engine)
    handed_to_pool: list[str] = []
    real_submit = daemon.pool.submit
    daemon.pool.submit = lambda fn, *args: (handed_to_pool.append(args[2]),  # type: ignore[method-assign]
                                            real_submit(fn, *args))[1]
    assert daemon.run_batch().completed == 7
    ranks = [name.split("-")[0] for name in order]  # equal priorities: no order promised
    assert ranks == ["critical", "high", "high", "normal", "low", "low", "backlog"]
    # the scheduler handed out the first; the worker took each next one itself, by the same rules
    assert len(handed_to_pool) == 1


def requeue_holding_the_unlink(engine: Engine, hid: str, event: str,
                               monkeypatch: pytest.MonkeyPatch,
                               **book_entries: Any) -> threading.Timer:
    """Claim ``hid`` and move it back to pending/ (``event``) with the removal of its
    in-progress copy held back 0.3 s: the window in which both copies exist. The timer that
    removes it is returned (join it)."""
    from handoffd.backends.files import store as store_module
    from handoffd.core.states import State

    claimed = engine.claim(hid)
    assert claimed is not None
    book(claimed[0].doc).update(book_entries)
    late: list[threading.Timer] = []
    real_unlink, real_retire = store_module.fsio.unlink, store_module.spares.retire

    def unlink_later(path: Path, durable: bool = True) -> None:
        late.append(threading.Timer(0.3, real_unlink, (path,), {"durable": durable}))
        late[-1].start()

    def retire_later(path: Path, tmp_dir: Path) -> None:  # the claim's own copy: kept as a spare
        late.append(threading.Timer(0.3, real_retire, (path, tmp_dir)))
        late[-1].start()

    monkeypatch.setattr(store_module.fsio, "unlink", unlink_later)
    monkeypatch.setattr(store_module.spares, "retire", retire_later)
    assert engine.requeue(claimed[0], claimed[1], event) is State.PENDING
    monkeypatch.setattr(store_module.fsio, "unlink", real_unlink)
    monkeypatch.setattr(store_module.spares, "retire", real_retire)
    assert engine.backend.store.locate(hid) == [State.PENDING, State.IN_PROGRESS]
    return late[0]


def test_an_answer_waits_out_the_parking_moves_second_step(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Parking writes the pending copy a moment before it removes the in-progress one; an
    answer arriving in between (the requester saw the question at once) tries again rather
    than telling the requester the handoff moved."""
    from handoffd.core.states import State
    from handoffd.features import orchestration

    engine = engine_with(tmp_path, lambda doc, ctx: {"ok": True})
    hid = submit(engine, {"q": 1})
    timer = requeue_holding_the_unlink(engine, hid, "needs_clarification", monkeypatch, awaiting={
        "kind": "needs_clarification", "questions": ["which?"]})
    orchestration.answer(engine, hid, "rust")  # raced the unlink: tried again, then answered
    timer.join()
    state, doc = engine.get(hid)
    assert state is State.PENDING and "awaiting" not in book(doc)
    assert doc["input"]["clarifications"][0]["answer"] == "rust"


def test_a_claim_racing_a_move_back_to_pending_waits_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that sees the pending copy of a handoff being moved back (answered, retried,
    handed back) before the in-progress copy is removed must not set it aside as a duplicate:
    it is told to look again, and claims it once the move is done. A raw document dropped
    beside a running one is still a duplicate."""
    from handoffd.core.errors import DocumentNotReady
    from handoffd.core.states import State

    engine = engine_with(tmp_path, lambda doc, ctx: {"ok": True})
    hid = submit(engine, {"q": 1})
    timer = requeue_holding_the_unlink(engine, hid, "handed_back", monkeypatch)
    with pytest.raises(DocumentNotReady):
        engine.claim(hid)  # the daemon's claim in the window
    assert engine.backend.store.locate(hid) == [State.PENDING, State.IN_PROGRESS]
    assert engine.backend.store.quarantined() == []
    timer.join()
    again = engine.claim(hid)
    assert again is not None and again[0].doc["handoff_id"] == hid
    # a foreign document with a running handoff's id is a duplicate, set aside as before
    raw = json.dumps({"handoff_id": hid, "source": {"agent_id": "@x"},
                      "target": {"agent_id": "@t"}, "input": {"data": None}})
    (engine.ws.handoffs / "pending" / f"{hid}.json").write_text(raw)
    assert engine.claim(hid) is None
    assert [q["code"] for q in engine.backend.store.quarantined()] == ["DUPLICATE_HANDOFF_ID"]
    assert engine.backend.store.locate(hid) == [State.IN_PROGRESS]


def test_an_idle_serving_daemon_trims_the_heap_after_a_burst(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What a burst of handoffs freed goes back to the system once nothing runs (malloc_trim),
    not only at the next sweep; never while handoffs are running, nor when nothing was done."""
    from handoffd.service import allocator
    from handoffd.service import daemon as daemon_module
    gate = threading.Event()
    trims: list[int] = []
    engine = engine_with(tmp_path, lambda h, c: gate.wait(10) and {"status": "completed"},
                         sweep_seconds=3600.0)  # no sweep trims during the test
    monkeypatch.setattr(daemon_module, "IDLE_TRIM_SECONDS", 0.05)
    with Serving(engine) as daemon:
        monkeypatch.setattr(allocator, "trim", lambda: trims.append(daemon.running) or True)
        time.sleep(0.3)
        idle_before = len(trims)  # (at most the one idle trim after start)
        hid = submit(engine)
        wait_until(lambda: daemon.running == 1)
        time.sleep(0.3)
        assert len(trims) == idle_before  # a handoff runs: no trim
        gate.set()
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED])
        wait_until(lambda: len(trims) > idle_before, what="a trim once idle")
        assert all(running == 0 for running in trims)
        settled = len(trims)
        time.sleep(0.3)
        assert len(trims) == settled  # idle with nothing done since: no more trims


@pytest.mark.parametrize("store", ["unreachable", "taken over"])
def test_a_lease_that_cannot_be_kept_stops_the_handler(tmp_path: Path, store: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Found by the fourth bug hunt (PostgreSQL): during an outage longer than the lease, the
    daemon could not renew, another host recovered the handoff when the lease lapsed, and both
    ran it at once; the first only logged that its result would be discarded. Now the lease
    keeper stops the handler once its lease was last extended 0.8 of a lease ago (the store
    unreachable), or as soon as a renewal finds the claim gone, and hands the attempt back."""
    stopped: list[str | None] = []

    def handler(handoff: Any, ctx: Any) -> Any:
        if ctx.attempt == 1:
            ctx.cancelled.wait(30)
            stopped.append(ctx.cancel_reason)
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, lease_seconds=1.0, sweep_seconds=60.0)
    hid = submit(engine)

    def renew(*args: Any) -> bool:
        if store == "unreachable":
            raise OSError(111, "Connection refused")
        return False

    engine.backend.renew = renew  # type: ignore[method-assign]
    started = time.monotonic()
    with Serving(engine) as daemon:
        wait_until(lambda: bool(stopped), timeout=20, what="the handler stopped")
        assert time.monotonic() - started < 15  # the lease is 1 s (not the handler's 30 s)
        wait_until(lambda: daemon.running_job(hid) is None or daemon.running_job(hid).context.attempt > 1)
    reason = stopped[0] or ""
    if store == "unreachable":
        assert "lease could not be renewed" in reason, reason
    else:
        assert "recovered by another process" in reason, reason
    assert f"handoff {hid}: " in caplog.text
    # the fenced attempt counts (a daemon too busy to renew in time handed the same handoffs
    # back uncounted, for ever): a retryable failure saying what to do
    history = book(engine.get(hid)[1])["history"]
    retried = [e for e in history if e["event"] in ("retry_scheduled", "completed")]
    assert retried and retried[0]["event"] == "retry_scheduled", history
    assert "raise [daemon] lease_seconds" in json.dumps(retried[0]), retried[0]


def test_a_python_handler_past_its_attempt_never_runs_beside_the_next(tmp_path: Path) -> None:
    """Found by the fourth session's crash hunt: a Python handler whose attempt was ended (timed
    out, cancelled, fenced) runs on (a thread cannot be stopped); the daemon then claimed the
    handoff again on another worker, and two runs of one handoff overlapped in one live
    daemon. The next attempt now waits until the late handler returns."""
    from handoffd.core.config import RetryPolicy
    runs: list[tuple[int, float, float]] = []

    def stubborn(handoff: Any, ctx: Any) -> Any:
        start = time.monotonic()
        if ctx.attempt == 1:
            time.sleep(1.5)  # ignores its 0.3 s timeout and its cancellation
        runs.append((ctx.attempt, start, time.monotonic()))
        return {"status": "completed"}

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=0.2, rescan_seconds=0.2),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=0.0))
    registry = Registry()
    registry.add_function("@t", stubborn, config=config, concurrency=4)
    registry.get("@t").config.timeout_seconds = 0.3
    engine = build_engine(ws, config, registry)
    hid = submit(engine)
    with Serving(engine):
        wait_until(lambda: engine.backend.store.locate(hid) == [State.COMPLETED], timeout=20)
        wait_until(lambda: len(runs) == 2)
    (first, second) = sorted(runs)
    assert second[1] >= first[2], f"attempt 2 started {first[2] - second[1]:.2f}s before attempt 1 ended"


def test_a_handoff_a_bug_cannot_handle_is_backed_off_not_spun_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by the fourth bug hunt (PostgreSQL): a row no reader could load raised an
    unexpected error at each claim; the batch looked at it again at once, for ever, a
    traceback a millisecond (4,950 in 12 s), and `handoffd run` never ended. Now the first
    error has its traceback, the next ones a line each, and the handoff is looked at again only
    after a back-off doubling from 1 s: the batch ends with it still pending."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    calls = 0

    def broken(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    engine.take = broken  # type: ignore[method-assign]
    daemon = Daemon(engine, watch=False)
    done = threading.Thread(target=daemon.run_batch)
    done.start()
    done.join(timeout=30)
    assert not done.is_alive(), "the batch spun on a handoff it cannot handle"
    assert 1 <= calls <= 3, calls
    assert caplog.text.count("Traceback") <= 1 and f"handoff {hid}: unexpected error" in caplog.text
    assert engine.backend.store.locate(hid) == [State.PENDING]


def test_an_unreachable_store_is_one_line_at_each_cancel_poll(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Found by the fourth bug hunt (PostgreSQL down): every rescan's cancel poll logged a full
    traceback for the store being unreachable. It is one line; a bug still gets its traceback."""
    from handoffd.features.cancellation import poll
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    daemon = Daemon(engine, watch=False)

    def unreachable() -> Any:
        raise OSError(111, "the PostgreSQL store is unreachable")

    engine.backend.cancel_requests = unreachable  # type: ignore[method-assign]
    poll(daemon)
    assert "cannot read the cancel requests: [Errno 111] the PostgreSQL store is unreachable" in caplog.text
    assert "Traceback" not in caplog.text


def test_a_stopping_daemon_tells_its_store_to_stop_retrying(tmp_path: Path) -> None:
    """Found by the fourth bug hunt: with PostgreSQL down, SIGTERM took four minutes (each
    store operation retried for its whole reconnect window). A stop now interrupts the
    store's retries: within grace_seconds, or at once for a hard stop."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"}, grace_seconds=7.0)
    told: list[float] = []
    engine.backend.interrupt = told.append  # type: ignore[attr-defined]
    resumed: list[bool] = []
    engine.backend.resume = lambda: resumed.append(True)  # type: ignore[attr-defined]
    daemon = Daemon(engine, watch=False)
    daemon.stop()
    daemon.stop(hard=True)
    assert told == [7.0, 0.0]
    Daemon(engine, watch=False).run_batch()  # a daemon that serves again lifts the cut
    assert resumed == [True]
