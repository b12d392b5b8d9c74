"""Python handlers on the worker's own thread: the watchdog ends overrunning or cancelled attempts
on time, exactly once, and the worker pool never runs short because a handler hangs."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import exe, wait_until

from handoffd.backends.files import fsio
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.errors import ErrorCode, HandlerError
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import HandlerContext, Registry
from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.watchdog import Watchdog
from handoffd.core.workspace import Workspace
from handoffd.features.build import build_engine
from handoffd.service.daemon import Daemon
from handoffd.service.workers import WorkerPool


def context(handoff_id: str = "h-1") -> HandlerContext:
    return HandlerContext(handoff_id=handoff_id, attempt=1, root=Path("."), data=None, target="@t")


class Taken:
    """Collects what a watchdog's takeover is called with, and on which thread."""

    def __init__(self) -> None:
        self.errors: list[HandlerError] = []
        self.threads: list[str] = []
        self.called = threading.Event()

    def __call__(self, error: HandlerError) -> None:
        self.errors.append(error)
        self.threads.append(threading.current_thread().name)
        self.called.set()


# ---------------------------------------------------------------- the watchdog
def test_a_call_that_returns_in_time_stays_the_workers() -> None:
    dog, taken = Watchdog(), Taken()
    watch = dog.watch(context(), 5.0, taken)
    assert dog.done(watch) is True
    time.sleep(0.05)
    assert taken.errors == []


def test_an_overrun_is_taken_over_on_time_on_another_thread() -> None:
    dog, taken, ctx = Watchdog(), Taken(), context()
    start = time.monotonic()
    watch = dog.watch(ctx, 0.2, taken)
    assert taken.called.wait(10)
    assert time.monotonic() - start >= 0.15  # not before its deadline
    (error,) = taken.errors
    assert error.code == ErrorCode.TIMEOUT and error.retryable
    assert ctx.cancelled.is_set()  # the handler can see it and stop
    assert taken.threads == ["takeover-h-1"]
    assert dog.running_late == 1
    assert dog.done(watch) is False  # the handler's late return files nothing
    assert dog.running_late == 0


def test_a_cancellation_is_taken_over_at_once() -> None:
    dog, taken, ctx = Watchdog(), Taken(), context()
    watch = dog.watch(ctx, 300.0, taken)
    ctx.stop("cancel requested")
    assert taken.called.wait(5)
    (error,) = taken.errors
    assert error.code == ErrorCode.CANCELLED and not error.retryable
    assert dog.done(watch) is False


def test_a_call_cancelled_before_it_began_is_taken_over() -> None:
    dog, taken, ctx = Watchdog(), Taken(), context()
    ctx.stop("daemon stopping")
    dog.watch(ctx, 300.0, taken)
    assert taken.called.wait(5)
    assert taken.errors[0].code == ErrorCode.CANCELLED


def test_a_shorter_deadline_behind_a_longer_one_is_kept() -> None:
    dog, slow, quick = Watchdog(), Taken(), Taken()
    dog.watch(context("slow"), 300.0, slow)
    time.sleep(0.05)  # the watchdog now sleeps until the long deadline
    dog.watch(context("quick"), 0.1, quick)
    assert quick.called.wait(5)
    assert slow.errors == []


def test_an_idle_watchdog_is_not_woken_by_a_call_with_a_usual_timeout() -> None:
    """With nothing to watch it sleeps IDLE_LOOK_SECONDS at a time: a call of a minutes-long
    timeout after a pause (every call, in a lightly loaded daemon) does not wake its thread,
    and a call with a deadline before its next look does."""
    dog = Watchdog()
    dog.done(dog.watch(context("first"), 300.0, Taken()))
    time.sleep(0.1)  # it woke for the first call and now sleeps on an empty set
    notified: list[bool] = []
    real = dog._cv.notify
    dog._cv.notify = lambda n=1: (notified.append(True), real(n))[1]  # type: ignore[method-assign]
    dog.done(dog.watch(context("later"), 300.0, Taken()))
    assert notified == []
    quick = Taken()
    dog.watch(context("quick"), 0.05, quick)
    assert notified == [True] and quick.called.wait(10)


def test_the_return_and_the_takeover_never_both_end_an_attempt() -> None:
    """Handlers that return right at their deadline: each attempt is ended exactly once."""
    dog = Watchdog()
    results = []
    for i in range(200):
        taken = Taken()
        watch = dog.watch(context(f"h-{i}"), 0.002, taken)
        time.sleep(0.002)
        mine = dog.done(watch)
        if not mine:
            assert taken.called.wait(5)
        time.sleep(0.001)
        results.append((mine, len(taken.errors)))
    assert all((mine and n == 0) or (not mine and n == 1) for mine, n in results)


# ---------------------------------------------------------------- the worker pool
def test_the_pool_starts_a_thread_when_none_is_idle_and_keeps_a_few() -> None:
    pool = WorkerPool(keep=1, name="t-worker")
    gate, ran = threading.Event(), []
    pool.submit(gate.wait, 5)  # a hung task holds its thread
    pool.submit(ran.append, 1)  # still runs, on a second thread
    wait_until(lambda: ran == [1], 5)
    gate.set()
    wait_until(lambda: sum(t.name.startswith("t-worker") for t in threading.enumerate()) <= 1, 5,
               "idle threads beyond keep end")
    pool.shutdown()
    wait_until(lambda: not any(t.name.startswith("t-worker") for t in threading.enumerate()), 5)
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, 2)


def test_a_failing_task_does_not_end_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    pool = WorkerPool(keep=1, name="f-worker")
    ran: list[int] = []
    pool.submit(lambda: 1 / 0)
    wait_until(lambda: "a worker's task failed" in caplog.text, 5)
    pool.submit(ran.append, 1)  # on the thread that ran the failing task (the one kept idle)
    wait_until(lambda: ran == [1], 5)
    pool.shutdown()


# ---------------------------------------------------------------- in a daemon
def engine_with(tmp_path: Path, handler: Any, workers: int = 1,
                settings: dict[str, Any] | None = None, **spec: Any) -> Engine:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=0.2, rescan_seconds=0.2, workers=workers,
                                          **(settings or {})))
    registry = Registry()
    registry.add_function("@t", handler, config=config, **spec)
    return build_engine(ws, config, registry)


def submit(engine: Engine, data: Any = None, **extra: Any) -> str:
    doc = new_native_request(source="@test", target="@t", data=data, now=engine.clock())
    doc.update(extra)
    return engine.backend.store.create(doc, doc["handoff_id"])


def test_handlers_run_on_the_workers_thread(tmp_path: Path) -> None:
    """No thread of its own per call: the worker's thread, named for the handoff meanwhile."""
    seen: list[tuple[threading.Thread, str]] = []

    def handler(handoff: dict, ctx: Any) -> dict:
        seen.append((threading.current_thread(), threading.current_thread().name))
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, workers=1)
    ids = {submit(engine) for _ in range(5)}
    assert Daemon(engine, watch=False).run_batch().completed == 5
    assert {name for _, name in seen} == {f"handler-{hid}" for hid in ids}
    assert all(thread.name.startswith("handoffd-worker") for thread, _ in seen)  # renamed back


def test_a_hung_handler_is_filed_timeout_on_time_and_the_queue_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One worker: its handler hangs past the timeout. The attempt is filed TIMEOUT while the
    handler still runs, the next handoff runs on a new thread, and the late return is dropped."""
    caplog.set_level(logging.INFO, logger="handoffd")
    release, returned = threading.Event(), threading.Event()

    def handler(handoff: dict, ctx: Any) -> dict:
        if ctx.data == "hang":
            release.wait(30)
            returned.set()
            return {"status": "completed", "output": {"late": True}}
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, workers=1, timeout_seconds=0.3)
    hung = submit(engine, "hang", retry_policy={"max_retries": 0})
    daemon = Daemon(engine, watch=False)
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_until(lambda: engine.backend.store.locate(hung) == [State.FAILED], 10)
        doc = engine.backend.store.read(State.FAILED, hung)
        assert doc["error"]["code"] == "TIMEOUT"
        assert not returned.is_set()  # filed while the handler was still inside
        assert f"handoff {hung}: its handler is still running past its 0.3s timeout" in caplog.text
        quick = submit(engine, "ok")
        daemon.notify(quick)
        wait_until(lambda: engine.backend.store.locate(quick) == [State.COMPLETED], 10)
        release.set()
        assert returned.wait(5)
        wait_until(lambda: f"handoff {hung}: its handler returned" in caplog.text, 10)
        assert engine.backend.store.locate(hung) == [State.FAILED]
        assert engine.backend.store.read(State.FAILED, hung)["error"]["code"] == "TIMEOUT"
        events = [e["event"] for e in book(engine.backend.store.read(State.FAILED, hung))["history"]]
        assert events.count("claimed") == 1
        assert daemon.running == 0 and daemon.active == {}
    finally:
        release.set()
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_cancelling_a_running_handler_files_cancelled_at_once(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def handler(handoff: dict, ctx: Any) -> dict:
        started.set()
        release.wait(30)
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, workers=1)
    hid = submit(engine)
    daemon = Daemon(engine, watch=False)
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False})
    thread.start()
    try:
        assert started.wait(10)
        job = daemon.running_job(hid)
        assert job is not None
        job.context.stop("cancel requested")
        wait_until(lambda: engine.backend.store.locate(hid) == [State.FAILED], 10)
        assert engine.backend.store.read(State.FAILED, hid)["error"]["code"] == "CANCELLED"
    finally:
        release.set()
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_a_takeover_whose_filing_fails_still_gives_its_slot_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that ends an overrunning attempt meets a full disk: the error is logged, the
    slot is free (the daemon does not stall), and the claim and its outcome are kept, as after
    a worker's own failed filing: filed (once) when the late handler returns, or on a refile."""
    release = threading.Event()

    def handler(handoff: dict, ctx: Any) -> dict:
        release.wait(30)
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler, timeout_seconds=0.2,
                         settings={"claim_grace_seconds": 0.0})
    hid = submit(engine, retry_policy={"max_retries": 0})
    real_create, failures = fsio.create_exclusive, []

    def full_disk(target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == "failed" and not failures:  # the TIMEOUT answer's write
            failures.append(threading.current_thread().name)
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return real_create(target, *args, **kwargs)

    monkeypatch.setattr(fsio, "create_exclusive", full_disk)
    daemon = Daemon(engine, watch=False)
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False})
    thread.start()
    try:
        wait_until(lambda: failures, 10)
        assert failures == [f"takeover-{hid}"]
        # the slot is given back; the claim stays, its TIMEOUT outcome kept to be filed again
        wait_until(lambda: daemon.running == 0 and daemon.active[hid].held is not None, 10)
        release.set()  # the first attempt's handler returns: the kept outcome is filed, once
        wait_until(lambda: engine.backend.store.locate(hid) in ([State.COMPLETED],
                                                                [State.FAILED]), 30)
        (where,) = engine.backend.store.locate(hid)
        doc = engine.backend.store.read(where, hid)
        events = [e["event"] for e in book(doc)["history"]]
        # as a worker's own failed filing: nothing runs again (it was handed back and run
        # again, before tests/test_refile.py), the timeout is filed
        assert events == ["created", "claimed", "failed"], events
        assert where is State.FAILED and doc["error"]["code"] == "TIMEOUT"
        wait_until(lambda: hid not in daemon.active, 10)
    finally:
        release.set()
        daemon.stop()
        thread.join(30)
    assert not thread.is_alive()


HANGING = textwrap.dedent("""
    import threading
    def hang(handoff, ctx=None):
        threading.Event().wait()  # never returns, and ignores ctx.cancelled
""")


@pytest.mark.heavy
def test_a_batch_exits_although_a_handler_never_returns(tmp_path: Path) -> None:
    """`handoffd run`: the attempt ends TIMEOUT on time and the process exits; the hung
    handler's thread does not keep it alive."""
    root = tmp_path / "ws"
    for state in ("pending", "in-progress", "completed", "failed"):
        (root / "handoffs" / state).mkdir(parents=True)
    (root / "plug").mkdir()
    (root / "plug" / "hangspec.py").write_text(HANGING)
    (root / "handoffd.toml").write_text('[specialists."@hang"]\nhandler = "hangspec:hang"\n'
                                        "timeout_seconds = 0.5\n")
    doc = new_native_request(source="@test", target="@hang", data=None, now=utc_now())
    doc["retry_policy"] = {"max_retries": 0}
    (root / "handoffs" / "pending" / f"{doc['handoff_id']}.json").write_text(json.dumps(doc))
    env = dict(os.environ, PYTHONPATH=str(root / "plug"))
    proc = subprocess.run([exe("handoffd"), "run", "--root", str(root)], env=env,
                          capture_output=True, text=True, timeout=60)  # (a hang: TimeoutExpired)
    assert proc.returncode == 1, proc.stderr
    failed = root / "handoffs" / "failed" / f"{doc['handoff_id']}.json"
    assert '"TIMEOUT"' in failed.read_text()


def test_a_handler_returning_before_its_takeover_counted_it_leaves_no_late_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the watchdog sets ctx.cancelled, then starts the takeover thread; a
    handler that stops at ctx.cancelled may return first. Its return took the late count to
    -1 (deleted), the takeover's +1 then left 1 for good, and this daemon never claimed the
    handoff again ('its next attempt waits' every second, for ever). Now either order settles
    at zero."""
    from types import SimpleNamespace

    daemon = Daemon(engine_with(tmp_path, lambda handoff, ctx: {"status": "completed"}),
                    watch=False)
    attempts = daemon.attempts
    monkeypatch.setattr(attempts, "_end_attempt", lambda job, outcome: None)
    monkeypatch.setattr(attempts, "_hold", lambda job, outcome: False)  # (filed at once)
    monkeypatch.setattr(attempts, "_forget_job", lambda job: None)
    monkeypatch.setattr(attempts.scheduler, "finished", lambda token: None)
    job: Any = SimpleNamespace(handoff_id="h-1")
    with daemon.cv:
        attempts._late_returned("h-1")  # the handler's return, first
        assert not attempts._held_by_late("h-1")  # (-1: nothing runs late)
    attempts._taken_over(0, job, lambda: None)  # then the takeover
    assert attempts.late == {} and not attempts._held_by_late("h-1")
    attempts._taken_over(0, job, lambda: None)  # the usual order: counted, then returned
    with daemon.cv:
        assert attempts._held_by_late("h-1")
        attempts._late_returned("h-1")
    assert attempts.late == {}
