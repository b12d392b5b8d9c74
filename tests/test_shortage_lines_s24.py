"""The last lines that took a passing shortage for a bug (helper S, session 24).

Found running ``handoffd serve`` under ``prlimit --nofile=8:4096``:

1. the stall watchdog's check listing pending/ with no descriptor left was ``ERROR: progress
   check failed; will check again`` with a full traceback, at every check: now one WARNING
   naming the limit, held back while it recurs, and ``the progress check works again``; a bug
   keeps its traceback. A handoff held off for a shortage whose back-off just ended (the loop
   checks before it dispatches it) read as a stall: ``ERROR: scheduler stalled``;
2. an answer that could not be filed for want of descriptors was ``ERROR: handoff X: [Errno 24]
   X could not be filed in completed/: Too many open files; its claim is kept ...`` at every try
   of every kept answer: now one WARNING naming the limit, held back while filings run short,
   and ``filing an answer works again`` (a full disk stays an ERROR at each try);
3. ``cannot check for leftover processes: OSError: [Errno 24] ...`` (an attempt's start, a
   recovery): now names the limit (held back in a sweep).
"""
from __future__ import annotations

import errno
import logging
import os
import resource
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Clock, exe, new_workspace
from conftest import wait_for_words as _wait_for
from test_claim_shortage_s22 import _engine, _submit
from test_refile import Counting, FullDisk, Serving, engine_with, submit
from test_shortage_keep_s23 import LIMIT, _emfile, _errors, _said
from test_start_shortage_s20 import FailFirst, _context

from handoffd import Daemon, State
from handoffd.backends.base import NotFiled
from handoffd.core import childproc, procs, recurring
from handoffd.service import attempts, held, sweeper

# ---------------------------------------------------------------- 1. the progress check

@pytest.fixture
def watch(tmp_path: Path) -> Any:
    """A daemon's progress watchdog (not serving), its check due at every call."""
    daemon = Daemon(_engine(tmp_path / "ws", Clock()), workers=1, watch=False,
                    stall_seconds=30.0)
    daemon.scheduler.last_dispatch = -1e9  # (nothing dispatched for ages)
    yield daemon.progress
    daemon.pool.shutdown()


def _check(progress: Any, now: float) -> None:
    progress.next_progress_check = 0.0
    progress.check(now)


def test_the_progress_check_short_is_one_warning_held_back_then_cleared(
        watch: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    backend = watch.engine.backend.inner  # (the recording backend passes ids() on)
    listing = FailFirst(backend.ids, 4, _emfile)
    monkeypatch.setattr(backend, "ids", listing)
    caplog.set_level(logging.INFO, "handoffd")
    now = 1000.0
    for _ in range(3):
        _check(watch, now)
        now += 5
    said = _said(caplog, "progress check")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert LIMIT in message and "[Errno" not in message and "for now" in message
    assert said[0].exc_info is None  # (no traceback)
    _check(watch, now + 60)  # a minute on: said again, with what was held back
    assert "(still; 2 more like it held back)" in _said(caplog, "progress check")[-1].getMessage()
    _check(watch, now + 65)  # it lists again: cleared only once it stayed away long enough
    assert not _said(caplog, "the progress check works again")
    _check(watch, now + 60 + recurring.QUIET_SECONDS)
    cleared = _said(caplog, "the progress check works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 4 failure(s))" in cleared[0].getMessage()
    assert not _errors(caplog)


def test_the_progress_check_out_of_memory_is_a_warning(
        watch: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    backend = watch.engine.backend.inner
    monkeypatch.setattr(backend, "ids", FailFirst(backend.ids, 1, MemoryError))
    caplog.set_level(logging.INFO, "handoffd")
    _check(watch, 1000.0)
    [said] = _said(caplog, "progress check")
    assert said.levelno == logging.WARNING and "out of memory (MemoryError)" in said.getMessage()


def test_a_progress_check_that_fails_of_a_bug_keeps_its_traceback(
        watch: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    backend = watch.engine.backend.inner
    monkeypatch.setattr(backend, "ids", FailFirst(backend.ids, 2, lambda: ValueError("a bug")))
    caplog.set_level(logging.INFO, "handoffd")
    _check(watch, 1000.0)
    _check(watch, 1005.0)
    said = _said(caplog, "progress check failed; will check again")
    assert len(said) == 2 and all(r.levelno == logging.ERROR and r.exc_info for r in said)


def test_a_back_off_just_ended_is_no_stall(tmp_path: Path) -> None:
    """The loop wakes for a held-off handoff's floor and for the check at once, and checks
    first: a start or claim short of descriptors, backed off as long as stall_seconds, read as
    ``scheduler stalled`` (an ERROR, the bookkeeping thrown away)."""
    engine = _engine(tmp_path / "ws", Clock())
    daemon = Daemon(engine, workers=1, watch=False, stall_seconds=30.0)
    try:
        hid = _submit(engine)
        assert daemon.progress.due_with_free_slot() == hid  # due, a slot free
        daemon.scheduler.not_before[hid] = time.monotonic() - 0.01  # (its floor: just passed)
        assert daemon.progress.due_with_free_slot() is None
        daemon.scheduler.not_before[hid] = time.monotonic() - 31.0  # due for stall_seconds
        assert daemon.progress.due_with_free_slot() == hid
    finally:
        daemon.pool.shutdown()


# ---------------------------------------------------------------- 2. a filing kept to refile

@pytest.fixture
def fast_refile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attempts, "RETRY_LOOK_SECONDS", 0.1)
    monkeypatch.setattr(held, "RETRY_LOOK_SECONDS", 0.1)


class ShortFiling(FullDisk):
    """The answers' writes into completed/ failing with EMFILE (the first ``times``)."""

    def __call__(self, target: Path, *args: Any, **kwargs: Any) -> None:
        if Path(target).parent.name == self.folder and self.failed < (self.times or 0):
            self.failed += 1
            raise _emfile()
        self.real(target, *args, **kwargs)


def test_answers_unfiled_for_want_of_descriptors_are_one_warning_then_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any,
        fast_refile: None) -> None:
    # (cleared at the first filing that works: the quiet period is the book's own matter,
    # tested on the listing's and the process records' books)
    monkeypatch.setattr(recurring, "QUIET_SECONDS", 0.0)
    handler = Counting()
    engine = engine_with(tmp_path, handler, workers=2)
    ShortFiling(monkeypatch, times=4)  # (two answers, tried again twice each)
    caplog.set_level(logging.INFO, "handoffd")
    ids = [submit(engine) for _ in range(2)]
    with Serving(engine):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                all(engine.backend.store.locate(h) == [State.COMPLETED] for h in ids)
                and _said(caplog, "filing an answer works again")):
            time.sleep(0.02)
    said = [r.getMessage() for r in caplog.records]
    kept = _said(caplog, "could not be filed in completed/")
    assert len(kept) == 1 and kept[0].levelno == logging.WARNING, said
    message = kept[0].getMessage()
    assert LIMIT in message and "[Errno" not in message, message
    assert "its claim is kept and the filing tried again" in message
    cleared = _said(caplog, "filing an answer works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 4 failure(s))" in \
        cleared[0].getMessage(), said
    assert handler.calls == 2  # (each handler ran once)
    assert not _errors(caplog), said


def _kept_job(refile_after: float = 5.0) -> Any:
    return SimpleNamespace(handoff_id="h1", refile_after=refile_after)


def _outcomes(clock: Clock) -> Any:
    """A bare HeldOutcomes with its engine's clock and its book of filing shortages."""
    outcomes = held.HeldOutcomes()
    outcomes.engine = SimpleNamespace(clock=clock)  # type: ignore[assignment]
    outcomes.filing_shortages = recurring.Recurring()
    return outcomes


def test_a_kept_answer_short_again_is_held_back_a_minute(caplog: Any) -> None:
    clock = Clock()
    outcomes = _outcomes(clock)
    caplog.set_level(logging.INFO, "handoffd")
    short = NotFiled(errno.EMFILE, "h1 could not be filed in completed/: Too many open files "
                     f"({LIMIT})")
    for _ in range(3):
        outcomes._say_kept(_kept_job(), short)
        clock.advance(10)
    clock.advance(40)
    outcomes._say_kept(_kept_job(20.0), short)
    said = _said(caplog, "could not be filed")
    assert len(said) == 2 and all(r.levelno == logging.WARNING for r in said)
    assert "(still; 2 more like it held back)" in said[1].getMessage()
    assert "[Errno" not in said[0].getMessage()


def test_a_full_disk_is_still_an_error_at_each_try(caplog: Any) -> None:
    outcomes = _outcomes(Clock())
    caplog.set_level(logging.INFO, "handoffd")
    full = NotFiled(errno.ENOSPC, "h1 could not be filed in completed/: No space left on device")
    outcomes._say_kept(_kept_job(), full)
    outcomes._say_kept(_kept_job(10.0), full)
    said = _said(caplog, "could not be filed")
    assert len(said) == 2 and all(r.levelno == logging.ERROR for r in said)


# ---------------------------------------------------------------- 3. leftover processes

def test_an_attempt_that_cannot_check_for_leftovers_names_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(procs, "kill_leftovers", FailFirst(procs.kill_leftovers, 1, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    childproc.clear_previous_attempt(ctx)
    [said] = _said(caplog, "cannot check for leftover processes")
    assert said.levelno == logging.WARNING and LIMIT in said.getMessage()
    assert "[Errno" not in said.getMessage()


def test_an_attempt_failing_otherwise_says_what_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(procs, "kill_leftovers", FailFirst(
        procs.kill_leftovers, 1, lambda: TypeError("a malformed record")))
    caplog.set_level(logging.INFO, "handoffd")
    childproc.clear_previous_attempt(ctx)
    [said] = _said(caplog, "cannot check for leftover processes")
    assert "TypeError: a malformed record" in said.getMessage()


def test_a_recovery_short_of_descriptors_is_one_warning_held_back_then_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", Clock())
    monkeypatch.setattr(procs, "kill_leftovers", FailFirst(procs.kill_leftovers, 3, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    book, seconds = recurring.Recurring(), iter(range(1000, 2000, 5))
    for hid in ("h1", "h2", "h3", "h4"):  # four recoveries in sweeps, the last one works
        with recurring.sweeping(book, lambda: float(next(seconds))):
            sweeper._kill_leftovers(engine, hid, 1)
    said = _said(caplog, "cannot check for leftover processes")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert LIMIT in said[0].getMessage() and "[Errno" not in said[0].getMessage()
    cleared = _said(caplog, "checking for leftover processes works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 3 failure(s))" in cleared[0].getMessage()


# ---------------------------------------------------------------- a real daemon

SERVE_TOML = """
[daemon]
durability = "fast"
sweep_seconds = 0.5
rescan_seconds = 0.5
stall_seconds = 0.3
"""


@pytest.mark.heavy
def test_a_serving_daemon_short_of_descriptors_says_its_progress_check_once(
        tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", SERVE_TOML)
    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=sink)
    ws.daemons.append(proc)  # type: ignore[arg-type]
    short = "progress check: cannot look for due work for now: "
    try:
        assert "serving" in _wait_for(err, ["serving"]), err.read_text()
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        # below every descriptor but stdin, stdout and stderr: each new one is EMFILE
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (3, hard))
        _wait_for(err, [short])
        time.sleep(2)  # six checks more, all short
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        _wait_for(err, ["the progress check works again"])
        assert ws.stop(proc) == 0  # type: ignore[arg-type]
    finally:
        ws.cleanup()
    lines = err.read_text(errors="replace").splitlines()
    said = "\n".join(lines)
    mine = [line for line in lines if short in line]
    assert len(mine) == 1 and "WARNING" in mine[0] and LIMIT in mine[0], said
    assert len([line for line in lines if "the progress check works again" in line]) == 1, said
    assert "progress check failed" not in said and "Traceback" not in said
    assert "[Errno" not in said and "ERROR" not in said, said


# ---------------------------------------------------------------- 4. a handler's output

def test_the_output_drain_short_of_memory_reads_again_and_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found under ``prlimit --as``: the drain thread died of a MemoryError in its read (a
    traceback), the handler's answer was lost and its attempt counted failed (retried)."""
    answer = b'{"status": "completed", "output": {"n": 1}}\n'
    read_end, write_end = os.pipe()
    os.write(write_end, answer)
    os.close(write_end)
    died: list[BaseException | None] = []
    monkeypatch.setattr("threading.excepthook", lambda args: died.append(args.exc_value))
    monkeypatch.setattr(os, "read", FailFirst(os.read, 2, MemoryError,
                                              when=lambda fd, *a: fd == read_end))
    collector = childproc.Collector(os.fdopen(read_end, "rb"), 1 << 20, keep_tail=False)
    collector.thread.start()
    collector.finish(10.0)
    assert not died and collector.data() == answer


def test_the_output_kept_short_of_memory_is_kept_once_it_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    collector = childproc.Collector(None, 1 << 20, keep_tail=False)

    class Tight(bytearray):
        """A buffer whose first two growths run out of memory."""

        failures = 2

        def __iadd__(self, more: Any) -> Any:
            if Tight.failures:
                Tight.failures -= 1
                raise MemoryError
            return bytearray.__iadd__(self, more)

    collector.buffer = Tight()
    assert collector._keep(b"abc") and bytes(collector.buffer) == b"abc"
    Tight.failures = 1
    collector.stop.set()  # told to stop: the output is cut there
    assert not collector._keep(b"def") and bytes(collector.buffer) == b"abc"
