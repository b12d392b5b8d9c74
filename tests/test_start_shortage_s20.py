"""A specialist that cannot be started for a passing shortage (helper F5, review R21 #1, #2).

Descriptors (EMFILE, ENFILE), processes (EAGAIN) or memory (ENOMEM) running out as a child is
spawned, or no thread to spare for its I/O (RuntimeError from Thread.start), is not the
command's fault: the handler never ran, so its claim is handed back uncounted with a back-off
(``handed_back`` with ``not_started`` in the history) and it runs later. It once failed the
handoff for good, blamed on handoffd.toml; a thread that could not start once leaked the child
(a zombie), its pipes, and stalled the claim until its lease ran out. A command that is not
there stays a permanent configuration error.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import Clock, new_workspace, wait_until

from handoffd import Daemon, Registry, Workspace, build_engine
from handoffd.core import runner, starts
from handoffd.core.config import Config, DaemonSettings, RetryPolicy, specialist_from_table
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.errors import HandlerError
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import HandlerContext, Specialist
from handoffd.core.states import State
from handoffd.service import handbacks

ANSWER = "import json; print(json.dumps({'status': 'completed', 'output': {'ok': True}}))"
COMMAND = [sys.executable, "-S", "-c", ANSWER]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _settled_fds(before: set[str]) -> None:
    """No descriptor this process has was not in ``before``: what the code under test opened
    is closed. Waited for a few seconds, for another test's threads still ending in this worker
    may hold one a moment (a leak stays, and fails). Not ``== before``: such a thread may also
    close one of ``before``'s meanwhile, which made that wait fail under load (session 31)."""
    wait_until(lambda: _fds() <= before, timeout=10,
               what=f"no descriptor beyond {sorted(before)}")


def _children() -> list[str]:
    """This process's child processes (zombies too: an unreaped child is listed)."""
    found: list[str] = []
    for task in os.listdir("/proc/self/task"):
        try:
            found += Path(f"/proc/self/task/{task}/children").read_text().split()
        except OSError:
            continue
    return found


def _engine(root: Path, command: list[str], clock: Clock) -> Engine:
    ws = Workspace(root)
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=0.2, rescan_seconds=0.2),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=10))
    registry = Registry()
    registry.add(Specialist(specialist_from_table("@cmd", {"command": command}, config.retry)))
    return build_engine(ws, config, registry, clock=clock)


def _submit(engine: Engine) -> str:
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    return engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())


def _batch(engine: Engine) -> Any:
    return Daemon(engine, workers=2, watch=False).run_batch()


def _events(engine: Engine, hid: str) -> list[dict[str, Any]]:
    return [e for e in book(engine.get(hid)[1])["history"] if isinstance(e, dict)]


class FailFirst:
    """Replaces a callable: its first ``times`` calls for which ``when`` holds raise ``error()``."""

    def __init__(self, real: Callable[..., Any], times: int, error: Callable[[], BaseException],
                 when: Callable[..., bool] = lambda *a, **k: True) -> None:
        self.real, self.times, self.error, self.when = real, times, error, when
        self.raised = 0
        self.lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            fail = self.raised < self.times and self.when(*args, **kwargs)
            if fail:
                self.raised += 1
        if fail:
            raise self.error()
        return self.real(*args, **kwargs)


@pytest.fixture
def clock() -> Clock:
    return Clock()


# ---------------------------------------------------------------- the daemon hands it back


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM])
def test_a_shortage_at_the_spawn_hands_the_claim_back_uncounted(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any,
        code: int) -> None:
    engine = _engine(tmp_path / "ws", COMMAND, clock)
    hid = _submit(engine)
    popen = FailFirst(subprocess.Popen, 2, lambda: OSError(code, os.strerror(code)))
    monkeypatch.setattr(subprocess, "Popen", popen)
    report = _batch(engine)
    assert popen.raised == 1 and report.failed == 0 and report.handed_back == 1
    state, doc = engine.get(hid)
    assert state is State.PENDING
    last = _events(engine, hid)[-1]
    assert last["event"] == "handed_back"
    assert last["detail"]["not_started"] == errno.errorcode[code]
    assert "interrupted" not in last["detail"]  # (not a stop: it never started)
    assert "handoffd.toml" not in last["detail"]["reason"]
    assert doc["handoffd"].get("attempt", 0) == 0  # the attempt was given back
    said = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert len(said) == 1 and "handed back uncounted, started again in 1s" in said[0]
    assert "handoffd.toml" not in said[0] and errno.errorcode[code] in said[0]
    # due after its back-off, not at once: a batch now leaves it; a second shortage doubles it
    assert _batch(engine).handed_back == 0 and popen.raised == 1
    clock.advance(1.5)
    assert _batch(engine).handed_back == 1 and popen.raised == 2
    assert handbacks.shortages_in_a_row(engine.get(hid)[1]) == 2
    assert any("started again in 2s" in r.getMessage() for r in caplog.records)
    clock.advance(2.5)
    report = _batch(engine)  # the shortage passed: it runs, as its first attempt
    assert report.completed == 1 and report.failed == 0
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and doc["output"] == {"ok": True}
    assert doc["handoffd"]["attempt"] == 1
    assert [e["event"] for e in _events(engine, hid)] == [
        "created", "claimed", "handed_back", "claimed", "handed_back", "claimed", "completed"]


def test_a_command_that_is_not_there_still_fails_for_good(tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", [str(tmp_path / "no-such-command")], clock)
    hid = _submit(engine)
    report = _batch(engine)
    assert report.failed == 1 and report.handed_back == 0
    state, doc = engine.get(hid)
    assert state is State.FAILED
    assert doc["error"]["retryable"] is False
    assert "check command in handoffd.toml" in doc["error"]["message"]
    assert "not_started" not in json.dumps(_events(engine, hid))


@pytest.mark.parametrize("which", ["feed-", "handler-output", "wait-"])
def test_a_thread_that_cannot_start_hands_back_and_leaks_nothing(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    engine = _engine(tmp_path / "ws", COMMAND, clock)
    _submit(engine)
    assert _batch(engine).completed == 1  # (what a daemon keeps open once it filed something)
    hid = _submit(engine)
    start = FailFirst(threading.Thread.start, 1, lambda: RuntimeError("can't start new thread"),
                      lambda thread: thread.name.startswith(which))
    monkeypatch.setattr(threading.Thread, "start", lambda self: start(self))
    before, children = _fds(), _children()
    report = _batch(engine)
    assert start.raised == 1 and report.handed_back == 1 and report.errors == 0
    assert engine.get(hid)[0] is State.PENDING  # at once, not after its lease
    last = _events(engine, hid)[-1]
    assert last["event"] == "handed_back" and last["detail"]["not_started"] == "THREADS"
    assert _children() == children  # the child was killed and reaped: no zombie
    _settled_fds(before)  # its pipes closed
    clock.advance(1.5)
    assert _batch(engine).completed == 1
    assert engine.get(hid)[1]["handoffd"]["attempt"] == 1


# ---------------------------------------------------------------- the runner itself


def _context(root: Path) -> HandlerContext:
    Workspace(root).ensure()
    return HandlerContext(handoff_id="r1", attempt=1, root=root, data={}, target="@cmd")


def _spec() -> Specialist:
    return Specialist(specialist_from_table("@cmd", {"command": COMMAND}, RetryPolicy()))


def test_run_command_marks_a_spawn_shortage_and_keeps_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", FailFirst(
        subprocess.Popen, 1, lambda: OSError(errno.EMFILE, "Too many open files")))
    before = _fds()
    with pytest.raises(HandlerError) as raised:
        runner.run_command(_spec(), {}, ctx, 10, max_output_bytes=1 << 20)
    assert raised.value.retryable is True
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "EMFILE"
    assert "ulimit -n" in shortage.message and ctx.handback
    _settled_fds(before)
    assert not list((tmp_path / "handoffs" / ".meta" / "procs").glob("*.json"))


def test_a_handler_result_cannot_claim_a_shortage(tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.feature_state[starts.NOT_STARTED] = {"reason": "EMFILE"}  # (not the runner's mark)
    assert starts.not_started(ctx) is None


def test_a_python_handler_without_a_thread_is_not_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    ran: list[int] = []

    def handler(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        ran.append(1)
        return {"status": "completed"}
    registry = Registry()
    spec = registry.add_function("@py", handler, config=Config())
    threads = runner.HandlerThreads()
    monkeypatch.setattr(runner, "HANDLER_THREADS", threads)
    monkeypatch.setattr(threading.Thread, "start", FailFirst(
        threading.Thread.start, 1, lambda: RuntimeError("can't start new thread")))
    with pytest.raises(HandlerError):
        runner.run_python(spec, {}, ctx, 10)
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "THREADS" and not ran


def test_a_shortage_that_lasts_is_counted_after_a_run_of_free_hand_backs(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", COMMAND, clock)
    hid = _submit(engine)
    monkeypatch.setattr(handbacks, "FREE_SHORTAGES", 2)
    popen = FailFirst(subprocess.Popen, 3, lambda: OSError(errno.EAGAIN, "Resource busy"))
    monkeypatch.setattr(subprocess, "Popen", popen)
    for _ in range(2):
        assert _batch(engine).handed_back == 1
        clock.advance(60)
    report = _batch(engine)  # the third in a row: a failed attempt, retried by the policy
    assert report.handed_back == 0 and report.retrying == 1
    error = _events(engine, hid)[-1]["detail"]["error"]
    assert error["details"]["shortages_in_a_row"] == 3 and "3 times in a row" in error["message"]


# ---------------------------------------------------------------- a real daemon under ulimit -n

SHORT_TOML = f"""
[daemon]
workers = 8
settle_seconds = 0.2
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5
grace_seconds = 5.0

[retry]
max_retries = 6
retry_delay_seconds = 0.2
backoff_multiplier = 1.0

[specialists."@slow"]
command = ["{sys.executable}", "-S", "-c", "import json, time; time.sleep(1); print(json.dumps({{'status': 'completed', 'output': {{}}}}))"]
timeout_seconds = 30
concurrency = 8
"""
# low enough that 8 children at once cannot all get their pipes (the daemon itself needs ~10
# descriptors, a child 3 while it runs and 8 while it is spawned), high enough for 2 or 3
OPEN_FILES = 28


@pytest.mark.heavy
def test_a_daemon_short_of_descriptors_completes_every_handoff_in_the_end(
        tmp_path: Path) -> None:
    import resource
    from conftest import exe
    ws = new_workspace(tmp_path / "ws", SHORT_TOML)
    ids = [f"s{n}" for n in range(16)]
    for hid in ids:
        doc = new_native_request(source="@test", target="@slow", data={}, handoff_id=hid,
                                 now=Clock()())
        ws.drop(f"{hid}.json", doc)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.Popen(
        [exe("handoffd"), "serve", "--root", str(ws.root)], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, hard)))
    ws.daemons.append(proc)
    try:
        for hid in ids:
            ws.wait_state(hid, ("completed", "failed"), timeout=90)
    finally:
        ws.stop(proc)
        ws.cleanup()
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert [hid for hid in ids if ws.state_of(hid) != ["completed"]] == [], said[-3000:]
    handed = [e for hid in ids for e in ws.doc(hid)["handoffd"]["history"]
              if e.get("event") == "handed_back" and "not_started" in e.get("detail", {})]
    assert handed, f"no start ran short of descriptors: raise the load or lower OPEN_FILES\n{said}"
    # (a log line lost to EMFILE itself is logging's own traceback; no handoff's error is one)
    assert "check command in handoffd.toml" not in said and "unexpected error" not in said, said
    assert "ulimit -n" in said


def test_a_spawn_a_shortage_refused_is_no_start_in_the_event_log(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """R25 #2: the event log's `claimed` was written before the spawn, so each hand-back for a
    shortage counted as a start (with its queue wait) in `handoff stats` and the metrics. The
    runner now says when the handler started; a spawn refused says nothing."""
    from handoffd.backends.files.events import FileEventLog
    engine = _engine(tmp_path / "ws", COMMAND, clock)
    hid = _submit(engine)
    popen = FailFirst(subprocess.Popen, 1, lambda: OSError(errno.EMFILE, "Too many open files"))
    monkeypatch.setattr(subprocess, "Popen", popen)
    assert _batch(engine).handed_back == 1
    clock.advance(1.5)
    assert _batch(engine).completed == 1
    logged = [e for e in FileEventLog(engine.ws).read() if e.get("id") == hid]
    assert [e["event"] for e in logged] == ["handed_back", "claimed", "completed"], \
        logged
    assert "seconds" not in logged[0]  # (the hand-back ran nothing)
    assert logged[1]["attempt"] == 1 and isinstance(logged[1]["wait"], float)
