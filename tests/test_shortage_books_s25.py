"""Three left-overs of the shortage lines (helper C, session 25).

1. A command specialist that could not be started for a passing shortage said
   ``cannot start 'sh' ... handed back uncounted`` once per hand-back of each handoff (16 to
   30 lines in 10 s of ``handoffd run`` under ``prlimit --nofile=12``): now it goes through a
   daemon's book of recurring problems (core.recurring): one WARNING naming the first handoff
   while handlers cannot be started, and ``starting a handler works again`` once one starts.
2. A ``handoffd run`` batch that ended while a book still held a shortage back never said so
   (the operator's last word was its first WARNING): each book that still holds a problem the
   batch met says it once as the batch ends, ``still short at the end of the batch: ...``.
3. A MemoryError writing the document to a command's stdin (``childproc.feed``) killed the
   feeder thread with a traceback and the child ran on a cut document (or none), its attempt
   counted; a MemoryError encoding the document, after the spawn, escaped the runner and left
   the child waiting for its stdin. Both are now start shortages: handed back uncounted (the
   feed's, the child started, said ``stdin_short``, not ``not_started``: review, session 25).
"""
from __future__ import annotations

import errno
import json
import logging
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, exe
from test_claim_shortage_s22 import command_workspace
from test_shortage_keep_s23 import LIMIT, _emfile, _errors, _said
from test_start_shortage_s20 import (FailFirst, _batch, _children, _context, _engine, _events,
                                     _fds, _settled_fds, _submit)

from handoffd import Daemon
from handoffd.core import childproc, recurring, runner, starts
from handoffd.core.config import RetryPolicy, specialist_from_table
from handoffd.core.errors import HandlerError
from handoffd.core.specialists import Specialist
from handoffd.core.states import State

# a command that reads its whole document before it answers: a cut one is a JSON error
READER = [sys.executable, "-S", "-c",
          "import json, sys; json.load(sys.stdin); "
          "print(json.dumps({'status': 'completed', 'output': {'read': True}}))"]


@pytest.fixture
def clock() -> Clock:
    return Clock()


# ---------------------------------------------------------------- 1. one line while it lasts


def test_start_shortages_of_a_batch_are_one_warning_then_works_again(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", READER, clock)
    ids = [_submit(engine) for _ in range(4)]
    popen = FailFirst(subprocess.Popen, 3, _emfile)  # three handoffs short, the fourth starts
    monkeypatch.setattr(subprocess, "Popen", popen)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=1, watch=False).run_batch()  # (one at a time: in order)
    assert popen.raised == 3 and report.completed == 1 and report.handed_back == 3
    said = _said(caplog, "cannot start")
    assert len(said) == 1, [r.getMessage() for r in said]
    first = said[0].getMessage()
    assert said[0].levelno == logging.WARNING and LIMIT in first
    assert "handed back uncounted, started again in 1s" in first
    assert "others short the same way are handed back too" in first
    # one handler started since: cleared as the batch ends (its quiet period not waited out)
    cleared = _said(caplog, "starting a handler works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 3 failure(s))" in cleared[0].getMessage()
    assert not _said(caplog, "at the end of the batch") and not _errors(caplog)
    for hid in ids:  # each still handed back uncounted, as before
        state, doc = engine.get(hid)
        assert state in (State.PENDING, State.COMPLETED)
        if state is State.PENDING:
            assert _events(engine, hid)[-1]["detail"]["not_started"] == "EMFILE"
            assert doc["handoffd"].get("attempt", 0) == 0


# ---------------------------------------------------------------- 2. said as the batch ends


def test_a_batch_ending_short_says_so_once(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", READER, clock)
    for _ in range(3):
        _submit(engine)
    monkeypatch.setattr(subprocess, "Popen", FailFirst(subprocess.Popen, 99, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    assert _batch(engine).handed_back == 3
    end = _said(caplog, "at the end of the batch")
    assert len(end) == 1 and end[0].levelno == logging.WARNING, [r.getMessage() for r in end]
    assert end[0].getMessage() == (
        f"still short at the end of the batch: starting a handler: Too many open files "
        f"({LIMIT}) (3 time(s) since it began)")
    assert not _said(caplog, "works again")


def test_each_book_says_what_the_batch_met_and_still_holds_in_one_line(caplog: Any) -> None:
    caplog.set_level(logging.INFO, "handoffd")
    old, book, other = (recurring.Recurring(quiet=recurring.QUIET_SECONDS) for _ in range(3))
    with recurring.sweeping(old, lambda: 0.0):  # met before the batch began: not its to say
        recurring.error("listing pending/", _emfile(), "cannot list: %s", _emfile())
    since = recurring.mark()
    with recurring.sweeping(book, lambda: 1.0):
        recurring.error("filing an answer", _emfile(), "cannot file: %s", _emfile())
        recurring.error("filing an answer", MemoryError(), "cannot file: %s", MemoryError())
    with recurring.sweeping(other, lambda: 1.0):
        recurring.error("the progress check", _emfile(), "cannot check: %s", _emfile())
    with recurring.sweeping(other, lambda: 2.0):  # it worked since: not quiet long, but cleared
        recurring.ok("the progress check")
    caplog.clear()
    recurring.batch_end(since)
    lines = sorted(r.getMessage() for r in caplog.records)  # (books in no set order)
    assert lines == [
        f"still short at the end of the batch: filing an answer: Too many open files ({LIMIT}) "
        "(1 time(s) since it began); filing an answer: out of memory (MemoryError) (1 time(s) "
        "since it began)",
        "the progress check works again (EMFILE cleared after 1 failure(s))"], lines
    assert old.active and book.active and not other.active  # (what is held stays held)
    caplog.clear()
    recurring.batch_end(recurring.mark())  # a later batch that met nothing says nothing
    assert not caplog.records


def test_a_failure_that_is_no_shortage_is_said_failing(caplog: Any) -> None:
    caplog.set_level(logging.INFO, "handoffd")
    book = recurring.Recurring()
    since = recurring.mark()
    with recurring.sweeping(book, lambda: 1.0):
        recurring.error(recurring.RECOVERY, OSError(errno.ENOSPC, "No space left on device"),
                        "sweep: %s", "full")
    caplog.clear()
    recurring.batch_end(since)
    [line] = caplog.records
    assert line.levelno == logging.ERROR and line.getMessage() == (
        "still failing at the end of the batch: recovering a claim: OSError: [Errno 28] No "
        "space left on device (1 time(s) since it began)")


SHORT_FILES = 12  # `prlimit --nofile=12`: the daemon starts, each spawn of a handler fails


def test_handoffd_run_under_a_descriptor_limit_says_one_line_and_ends_saying_it(
        tmp_path: Path) -> None:
    """End to end: ``handoffd run`` under ``ulimit -n 12``, its one handoff handed back at
    every start (after 1 s, 2 s...): one WARNING, and the batch's end says it still ran short."""
    root, hid = command_workspace(tmp_path / "ws")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = subprocess.run(
        [exe("handoffd"), "run", "--root", str(root), "--max-seconds", "4"],
        capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SHORT_FILES, hard)))
    said = done.stderr
    assert "Traceback" not in said, said
    starts_short = [line for line in said.splitlines() if "cannot start" in line]
    assert len(starts_short) == 1 and "WARNING" in starts_short[0] and LIMIT in starts_short[0], \
        said
    assert "still short at the end of the batch: starting a handler: Too many open files " \
           f"({LIMIT})" in said, said
    assert "handed back 1" in said, said
    doc = json.loads((root / "handoffs" / "pending" / f"{hid}.json").read_text())
    assert doc["handoffd"].get("attempt", 0) == 0  # (uncounted)


def test_handoffd_serve_under_a_descriptor_limit_says_it_still_runs_short_as_it_stops(
        tmp_path: Path) -> None:
    """``handoffd serve`` stopped (SIGTERM) while a start shortage is still held back says so
    once, as a batch's end does (session 26: its operator's last lines before a restart said
    nothing of it)."""
    root, hid = command_workspace(tmp_path / "ws")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.Popen(
        [exe("handoffd"), "serve", "--root", str(root), "--processes", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SHORT_FILES, hard)))
    try:
        assert proc.stderr is not None
        seen = [proc.stderr.readline() for _ in range(2)]  # "serving", then the first shortage
        assert "cannot start" in seen[-1], seen
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    said = "".join(seen) + rest
    assert proc.returncode == 0 and "Traceback" not in said, said
    end = [line for line in said.splitlines() if "still short" in line]
    assert len(end) == 1 and "WARNING" in end[0], said
    assert end[0].startswith("handoffd: WARNING: still short at the daemon's stop: starting a "
                             f"handler: Too many open files ({LIMIT})"), said
    assert "at the end of the batch" not in said
    doc = json.loads((root / "handoffs" / "pending" / f"{hid}.json").read_text())
    assert doc["handoffd"].get("attempt", 0) == 0  # (uncounted)


# ---------------------------------------------------------------- 3. feeding the child


class _NoMemory:
    """``memoryview`` for childproc alone: the feed's view of the document runs out of memory."""

    def __init__(self) -> None:
        self.raised = 0

    def __call__(self, payload: bytes) -> memoryview:
        self.raised += 1
        raise MemoryError


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException]:
    """What escaped a thread (a traceback threading would print)."""
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: escaped.append(args.exc_value))
    return escaped


def _reader() -> Specialist:
    return Specialist(specialist_from_table("@cmd", {"command": READER}, RetryPolicy()))


def test_a_feed_out_of_memory_is_a_start_shortage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        thread_errors: list[BaseException]) -> None:
    ctx = _context(tmp_path)
    short = _NoMemory()
    monkeypatch.setattr(childproc, "memoryview", short, raising=False)
    before, children = _fds(), _children()
    with pytest.raises(HandlerError) as raised:
        runner.run_command(_reader(), {"big": "x" * 100_000}, ctx, 10, max_output_bytes=1 << 20)
    assert short.raised == 1 and thread_errors == []  # (no traceback of the feeder)
    assert raised.value.retryable is True
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "ENOMEM" and ctx.handback
    assert shortage.after_start  # (the child had started: stopped, not "not started")
    assert "out of memory writing its document to its stdin" in shortage.message
    assert "the memory the daemon may use" in shortage.message
    assert _children() == children  # the child was killed and reaped
    _settled_fds(before)  # its pipes closed (stdin too, left open by the feed that ran short)
    assert not list((tmp_path / "handoffs" / ".meta" / "procs").glob("*.json"))


def test_a_document_that_cannot_be_encoded_for_memory_is_not_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(runner.json, "dumps", FailFirst(json.dumps, 1, MemoryError))
    popen, spawned = subprocess.Popen, []

    def spawn(*args: Any, **kwargs: Any) -> Any:
        spawned.append(args)
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spawn)
    before, children = _fds(), _children()
    with pytest.raises(HandlerError):
        runner.run_command(_reader(), {}, ctx, 10, max_output_bytes=1 << 20)
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "ENOMEM"
    assert spawned == [] and _children() == children  # nothing was started for it
    _settled_fds(before)


def test_a_daemon_hands_a_feed_short_of_memory_back_uncounted(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any,
        thread_errors: list[BaseException]) -> None:
    engine = _engine(tmp_path / "ws", READER, clock)
    hid = _submit(engine)
    monkeypatch.setattr(childproc, "memoryview", _NoMemory(), raising=False)
    caplog.set_level(logging.INFO, "handoffd")
    report = _batch(engine)
    assert report.handed_back == 1 and report.failed == 0 and report.retrying == 0
    assert thread_errors == [] and not _errors(caplog)
    state, doc = engine.get(hid)
    assert state is State.PENDING and doc["handoffd"].get("attempt", 0) == 0
    last = _events(engine, hid)[-1]
    assert last["event"] == "handed_back" and last["detail"]["stdin_short"] == "ENOMEM"
    monkeypatch.undo()  # memory again: it runs, as its first attempt
    clock.advance(1.5)
    assert _batch(engine).completed == 1
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and doc["output"] == {"read": True}
    assert doc["handoffd"]["attempt"] == 1
