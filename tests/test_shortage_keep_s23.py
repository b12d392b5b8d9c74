"""Shortage gaps found by review R32 (helper F2, session 23).

2. A kept claim's first delay (a claim whose admission and hand-back both ran short,
   service/shortclaims.py) was the back-off as is, not capped by its lease, and counted from
   the keep rather than the claim: an 8 s back-off under a 2 s lease let the lease lapse, and
   the sweep recovered the claim as a crash (an attempt charged).
3. A stop that came while a kept claim's timer was writing its hand-back skipped it, and the
   timer armed itself again after the stop: the batch exited 0 with the claim leased.
7. A batch whose pending document could not be read for want of descriptors ended silently
   (exit 0, no summary) with the work still pending: it is counted "handed back" now, as a
   claim shortage's hand-back is.
10. The sweep's steps and the cancel requests' poll said a descriptor shortage as an ERROR
   with the bare ``[Errno 24]``, at every sweep or rescan: one WARNING naming the limit now,
   said again at most once a minute, as the sweep's recurring problems are.
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock
from test_claim_shortage_s22 import _engine, _submit, command_workspace
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon
from handoffd.backends.files import reading
from handoffd.backends.files import repair as repair_module
from handoffd.backends.files import store as store_module
from handoffd.core import recurring, validation
from handoffd.core.documents import book
from handoffd.core.states import State
from handoffd.features import cancellation
from handoffd.service import dispatch, shortclaims
from handoffd.service.sweeper import sweep

LIMIT = "EMFILE: the daemon's limit on open files, ulimit -n"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def _names(engine: Any, hid: str) -> list[str]:
    return [e["event"] for e in book(engine.get(hid)[1])["history"]]


def _admission_short(monkeypatch: pytest.MonkeyPatch, clock: Clock, spent: float,
                     hand_backs: int, write: Any = None) -> None:
    """The first schema load fails with EMFILE, ``spent`` seconds (engine clock) after the
    claim; the first ``hand_backs`` writes into pending/ (the hand-back's) fail too."""
    def short() -> OSError:
        clock.advance(spent)  # (the claim was made that long ago)
        return _emfile()
    monkeypatch.setattr(validation, "load_builtin", FailFirst(validation.load_builtin, 1, short))
    write = write or FailFirst(store_module.fsio.create_exclusive, hand_backs, _emfile,
                               when=lambda path, *a, **k: Path(path).parent.name == "pending")
    monkeypatch.setattr(store_module.fsio, "create_exclusive", write)


def _long_backoffs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(shortclaims, "shortage_backoff", lambda streak: seconds)
    monkeypatch.setattr("handoffd.service.attempts.handbacks.shortage_backoff",
                        lambda streak: seconds)


# ---------------------------------------------------------------- 2. the first delay's cap

def test_a_kept_claims_first_delay_ends_before_its_lease_counted_from_the_claim(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", clock)
    engine.settings.lease_seconds = 2.0  # kept until 0.8 * 2 s after the claim
    hid = _submit(engine)
    _admission_short(monkeypatch, clock, spent=1.0, hand_backs=1)  # 0.6 s left of that
    _long_backoffs(monkeypatch, 8.0)  # (as the 4th shortage in a row: 1, 2, 4, 8 s)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=1, watch=False).run_batch()
    kept = [r.getMessage() for r in caplog.records if "its claim is kept" in r.getMessage()]
    assert len(kept) == 1, kept
    assert 0.4 < float(kept[0].rsplit(" in ", 1)[1].rstrip("s")) <= 0.6, kept  # (not 8 s)
    assert report.completed == 1 and report.errors == 0, report
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and book(doc)["attempt"] == 1
    assert _names(engine, hid) == ["created", "claimed", "handed_back", "claimed", "completed"]


def test_a_kept_claim_its_lease_leaves_no_time_for_is_given_up_at_once(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Given up, said once as such: not also "it stays in pending/ ... claimed again in 1s",
    nor counted handed back (review R33)."""
    engine = _engine(tmp_path / "ws", clock)
    engine.settings.lease_seconds = 2.0
    hid = _submit(engine)
    _admission_short(monkeypatch, clock, spent=1.7, hand_backs=1)  # past 0.8 * 2 s already
    _long_backoffs(monkeypatch, 0.2)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert report.errors == 1 and report.completed == 0, report  # given up, said
    assert report.handed_back == 0, report
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "given up" in said[0], said
    assert engine.get(hid)[0] is State.IN_PROGRESS
    monkeypatch.undo()
    report = Daemon(engine, workers=1, watch=False).run_batch()  # its sweep: back, uncounted
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and book(doc)["attempt"] == 1, _names(engine, hid)
    assert "retry_scheduled" not in _names(engine, hid)


# ---------------------------------------------------------------- 3. a stop during a retry

class BlockedShort:
    """create_exclusive into pending/: the first call fails with EMFILE at once; the second
    (the timer's hand-back) waits for the stop (``closing``) and then fails too."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0
        self.kept: shortclaims.KeptClaims | None = None
        self.waiting = threading.Event()

    def __call__(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).parent.name != "pending":
            return self.real(path, *args, **kwargs)
        self.calls += 1
        if self.calls > 2:
            return self.real(path, *args, **kwargs)
        if self.calls == 2 and self.kept is not None:
            self.waiting.set()
            end = time.monotonic() + 5.0
            while not self.kept.closing and time.monotonic() < end:
                time.sleep(0.01)
        raise _emfile()


def test_a_stop_during_a_timers_hand_back_leaves_no_timer_and_counts_the_give_up(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    write = BlockedShort(store_module.fsio.create_exclusive)
    _admission_short(monkeypatch, clock, spent=0.0, hand_backs=0, write=write)
    _long_backoffs(monkeypatch, 0.1)
    daemon = Daemon(engine, workers=1, watch=False)
    write.kept = daemon.attempts.kept_claims
    report = daemon.run_batch(max_seconds=1.0)  # stops while the timer's write waits
    assert write.waiting.is_set() and write.calls == 2
    timers = [t for t in threading.enumerate() if t.name.startswith("hand-back-")]
    for timer in timers:
        timer.join(5.0)
    assert write.calls == 2, "the timer was armed again after the stop"
    assert report.errors == 1, report  # exit 1: the claim is left leased, given up
    assert engine.get(hid)[0] is State.IN_PROGRESS
    monkeypatch.undo()
    Daemon(engine, workers=1, watch=False).run_batch()  # its sweep: back, uncounted
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and book(doc)["attempt"] == 1, _names(engine, hid)


# ---------------------------------------------------------------- 7. a batch's count

def test_a_batch_ending_with_an_unreadable_pending_document_counts_it_handed_back(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    read = FailFirst(reading.read_pending, 99, _emfile)
    monkeypatch.setattr(reading, "read_pending", read)
    monkeypatch.setattr(dispatch, "shortage_backoff", lambda streak: 30.0)  # (not waited)
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert read.raised >= 1 and engine.get(hid)[0] is State.PENDING
    assert report.handed_back == 1 and report.errors == 0, report
    assert report.needs_a_look() and "handed back 1" in report.line()


def test_a_batch_waits_out_a_short_read_back_off_and_runs_it(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    monkeypatch.setattr(reading, "read_pending", FailFirst(reading.read_pending, 1, _emfile))
    monkeypatch.setattr(dispatch, "shortage_backoff", lambda streak: 0.2)
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert engine.get(hid)[0] is State.COMPLETED
    assert report.completed == 1 and report.handed_back == 0 and report.errors == 0, report


UNREADABLE = """
import errno, os, sys
from handoffd.backends.files import reading
from handoffd.service import dispatch
from handoffd.cli.handoffd_cmd import main

def read_pending(*args, **kwargs):
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

reading.read_pending = read_pending
dispatch.shortage_backoff = lambda streak: 30.0
sys.argv = ["handoffd", "run", "--root", sys.argv[1]]
main()
"""


def test_a_real_batch_says_it_handed_back_what_it_could_not_read(tmp_path: Path) -> None:
    ws, hid = command_workspace(tmp_path / "ws")
    done = subprocess.run([sys.executable, "-c", UNREADABLE, str(ws)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "batch done: completed 0, failed 0, retry scheduled 0, handed back 1" in done.stderr
    assert (ws / "handoffs" / "pending" / f"{hid}.json").exists()


# ---------------------------------------------------------------- 10. sweep and cancel poll

def _said(caplog: Any, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def _errors(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_sweep_step_running_short_is_one_warning_naming_the_limit(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", clock)
    orphans = FailFirst(repair_module.remove_orphans, 3, _emfile)
    monkeypatch.setattr(repair_module, "remove_orphans", orphans)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(4):  # 3 short, then it works
        sweep(engine)
        clock.advance(1)
    said = _said(caplog, "sweep: removing orphaned files failed")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert LIMIT in said[0].getMessage() and "[Errno" not in said[0].getMessage()
    cleared = _said(caplog, "works again (EMFILE cleared after 3 failure(s))")
    assert len(cleared) == 1 and cleared[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class _Daemon:
    """What cancellation uses of a daemon; its scan hook (the poll) is kept to be called."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scan_hooks: list[Any] = []

    def add_scan_hook(self, hook: Any) -> None:
        self.scan_hooks.append(hook)

    def __getattr__(self, name: str) -> Any:  # (the other hooks: not used here)
        return lambda *args, **kwargs: None

    def running_job(self, handoff_id: str) -> None:
        return None

    def queue(self, handoff_id: str) -> None:
        pass


def test_the_cancel_poll_running_short_is_one_warning_naming_the_limit(
        tmp_path: Path, clock: Clock, caplog: Any) -> None:
    engine = _engine(tmp_path / "ws", clock)
    requests = FailFirst(engine.backend.cancel_requests, 3, _emfile)
    engine.backend.cancel_requests = requests  # type: ignore[method-assign]  # (its own)
    caplog.set_level(logging.INFO, "handoffd")
    daemon = _Daemon(engine)
    cancellation.attach(daemon)  # type: ignore[arg-type]
    [poll] = daemon.scan_hooks  # (what the daemon calls at every rescan)
    for _ in range(3):  # three rescans running short
        poll()
        clock.advance(1)
    said = _said(caplog, "cannot read the cancel requests")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert LIMIT in said[0].getMessage() and "for now" in said[0].getMessage()
    clock.advance(60)
    requests.times = 4  # once more, a minute on: said again, with what was held back
    poll()
    said = _said(caplog, "cannot read the cancel requests")
    assert len(said) == 2 and "(still; 2 more like it held back)" in said[1].getMessage()
    poll()  # it works again
    assert len(_said(caplog, "reading the cancel requests works again")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_sweep_step_running_out_of_memory_is_one_warning_without_a_traceback(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The files store's repair steps took a MemoryError for a bug: a traceback at every
    sweep (review R34)."""
    engine = _engine(tmp_path / "ws", clock)
    orphans = FailFirst(repair_module.remove_orphans, 2, MemoryError)
    monkeypatch.setattr(repair_module, "remove_orphans", orphans)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(3):
        sweep(engine)
        clock.advance(1)
    said = _said(caplog, "sweep: removing orphaned files failed")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "out of memory (MemoryError)" in said[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_listing_pending_running_short_is_said_once_then_cleared(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """`cannot list the pending handoffs` was an ERROR, the bare [Errno 24], at every rescan
    (18 lines in 8 s under `ulimit -n 64`: review R34)."""
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    ids = FailFirst(engine.backend.ids, 3, _emfile)
    monkeypatch.setattr(engine.backend.inner, "ids", ids)  # (the event log's wrapper forwards)
    daemon._listing_clock = lambda: clock().timestamp()
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(4):  # 3 short, then it works: cleared once quiet for QUIET_SECONDS
        daemon.scan()
        clock.advance(recurring.QUIET_SECONDS / 2)
    assert not _said(caplog, "listing pending/ works again")  # (5 s after the last failure)
    daemon.scan()
    said = _said(caplog, "cannot list the pending handoffs")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert LIMIT in said[0].getMessage() and "[Errno" not in said[0].getMessage()
    cleared = _said(caplog, "listing pending/ works again (EMFILE cleared after 3 failure(s))")
    assert len(cleared) == 1


def test_a_folder_the_sweep_cannot_open_for_want_of_descriptors_is_said_once(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """`sweep: cannot open <folder>: ... (EMFILE ...)` was an ERROR at every sweep while the
    shortage lasted (18 lines in 8 s under `ulimit -n 64`: review R34)."""
    from test_claim_shortage_s22 import FailIn

    from handoffd.backends.files import orphans
    engine = _engine(tmp_path / "ws", clock)
    monkeypatch.setattr(orphans.os, "open", FailIn(os.open, "_opened", 1000, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(4):
        sweep(engine)
        clock.advance(1)
    said = [r.getMessage() for r in _said(caplog, "sweep: cannot open")]
    folders = {message.split("cannot open ", 1)[1].split(":", 1)[0] for message in said}
    assert said and len(said) == len(folders), said  # each folder once, not at every sweep
    assert all(LIMIT in message for message in said), said
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- review R35

def _memory_short(hid: str) -> Any:
    from handoffd.core.errors import ClaimShortage
    return ClaimShortage(f"handoff {hid}: cannot be claimed for now: out of memory; it stays in "
                         "pending/, uncounted", handoff_id=hid, reason="MemoryError", delay=30.0)


@pytest.mark.parametrize("descriptors_before", [False, True])
def test_a_memory_back_off_is_not_cut_short_by_another_tasks_end(
        tmp_path: Path, clock: Clock, descriptors_before: bool) -> None:
    """Even when a descriptor shortage put the handoff in the rows released early before."""
    from handoffd.core.errors import ClaimShortage
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    attempts, scheduler = daemon.attempts, daemon.scheduler
    short, other = _submit(engine), _submit(engine)
    if descriptors_before:
        attempts._work_failed(short, ClaimShortage("short", handoff_id=short, reason="EMFILE"))
    attempts._work_failed(short, _memory_short(short))
    attempts.work(other)  # another task ends
    assert scheduler.queued[short] - time.monotonic() > 25


def test_a_memory_short_claims_end_releases_no_descriptor_short_claim(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim that ran short of memory freed nothing: the claims waiting out a descriptor
    shortage wait on."""
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    attempts, scheduler = daemon.attempts, daemon.scheduler
    waiting, short = _submit(engine), _submit(engine)
    attempts.claim_shortages[waiting] = 6
    scheduler.hold_off(waiting, 60.0)
    real = engine.take

    def take(hid: str, **kwargs: Any) -> Any:
        if hid == short:
            raise _memory_short(short)
        return real(hid, **kwargs)

    monkeypatch.setattr(engine, "take", take)
    attempts.work(short)
    assert scheduler.queued[waiting] - time.monotonic() > 50


@pytest.mark.parametrize("error", [_emfile, MemoryError])
def test_a_batch_end_that_cannot_list_pending_looks_again(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, error: Any) -> None:
    """It took a failed listing for "nothing is pending" and ended, exit 0, with a handoff
    that arrived meanwhile still pending; a MemoryError there ended the main loop."""
    engine = _engine(tmp_path / "ws", clock)
    _submit(engine)
    real, calls, late = engine.backend.ids, [0], []

    def ids(state: State) -> Any:
        if state is State.PENDING:
            calls[0] += 1
            if calls[0] == 1:
                listed = real(state)
                late.append(_submit(engine))  # arrives while the batch works
                return listed
            if calls[0] == 2:
                raise error()
        return real(state)

    monkeypatch.setattr(engine.backend.inner, "ids", ids)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert engine.get(late[0])[0] is State.COMPLETED
    assert report.completed == 2 and report.errors == 0 and report.error is None, report


def test_the_sweeps_folder_problem_clears_when_the_folder_opens_again(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from test_claim_shortage_s22 import FailIn

    from handoffd.backends.files import orphans
    engine = _engine(tmp_path / "ws", clock)
    monkeypatch.setattr(orphans.os, "open", FailIn(os.open, "_opened", 2, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(4):
        sweep(engine)
        clock.advance(1)
    assert _said(caplog, "sweep: cannot open")
    assert _said(caplog, "works again (EMFILE cleared after")


def test_work_between_two_failed_listings_gives_the_second_its_own_patience(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review R36: the patience counted from the first failure of the batch, not of the run of
    failures: after work in between, one brief failure ended the batch at once (exit 1), with
    a handoff that arrived meanwhile left pending."""
    from test_start_shortage_s20 import _engine as shortage_engine

    from handoffd.service import batchend
    monkeypatch.setattr(batchend, "UNLISTED_PATIENCE_SECONDS", 0.3)
    slow = [sys.executable, "-S", "-c", "import json, time; time.sleep(0.6); "
            "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))"]
    engine = shortage_engine(tmp_path / "ws", slow, clock)
    _submit(engine)
    daemon = Daemon(engine, workers=1, watch=False)
    real, calls, late = engine.backend.ids, [0], []

    def ids(state: State) -> Any:
        if state is State.PENDING:
            calls[0] += 1
            if calls[0] in (2, 4):  # each batch end that follows work: one failed listing,
                late.append(_submit(engine))  # while another handoff arrives
                daemon.scheduler.request_rescan()
                raise _emfile()
        return real(state)

    monkeypatch.setattr(engine.backend.inner, "ids", ids)
    report = daemon.run_batch(max_seconds=30)
    assert [engine.get(hid)[0] for hid in late] == [State.COMPLETED] * 2, calls
    assert report.completed == 3 and report.errors == 0 and report.error is None, report


def test_a_memory_error_looking_for_abandoned_claims_is_a_shortage_of_the_sweep(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Helper P (session 24): any store's look for abandoned claims running out of memory left
    the sweep with a bare MemoryError (the daemon's "sweep failed" and a traceback)."""
    engine = _engine(tmp_path / "ws", clock)
    monkeypatch.setattr(engine.backend.inner, "expired_claims", FailFirst(
        engine.backend.inner.expired_claims, 2, MemoryError))
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(3):
        sweep(engine)
        clock.advance(1)
    looks = [r for r in caplog.records if "cannot look for abandoned claims" in r.getMessage()]
    assert len(looks) == 1 and looks[0].levelname == "WARNING" and not looks[0].exc_info
    assert _said(caplog, "looking for abandoned claims works again")


def test_a_memory_error_recovering_one_claim_is_a_held_back_shortage(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Review R37: on the files store, a MemoryError recovering one abandoned claim was an
    ERROR with a traceback at every sweep."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    claimed = engine.claim(hid)
    assert claimed is not None
    engine.backend.abandon(claimed[0])
    clock.advance(engine.settings.lease_seconds * 3)
    store = engine.backend.inner.store
    real = store.read

    def read(state: State, handoff_id: str, *args: Any, **kwargs: Any) -> Any:
        if state is State.IN_PROGRESS:
            raise MemoryError
        return real(state, handoff_id, *args, **kwargs)

    monkeypatch.setattr(store, "read", read)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(3):
        sweep(engine)
        clock.advance(1)
    said = _said(caplog, f"recovering {hid} failed")
    assert said and not any(r.exc_info or r.levelno >= logging.ERROR for r in said), \
        [(r.levelname, r.getMessage()) for r in said]


def test_a_listing_that_fails_every_other_time_is_said_once_not_cleared_each_time(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Review R37: at a descriptor limit, every other open fails; a book whose "sweep" is one
    operation cleared the problem at each success: two lines per failure."""
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    daemon._listing_clock = lambda: clock().timestamp()
    real, calls = engine.backend.ids, [0]

    def ids(state: State) -> Any:
        calls[0] += 1
        if calls[0] % 2:
            raise _emfile()
        return real(state)

    monkeypatch.setattr(engine.backend.inner, "ids", ids)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(10):
        daemon.scan()
        clock.advance(1)
    assert len(_said(caplog, "cannot list the pending handoffs")) == 1
    assert not _said(caplog, "works again")


def test_a_shortage_met_elsewhere_in_a_worker_names_the_limit(
        tmp_path: Path, clock: Clock, caplog: Any) -> None:
    """Helper S (session 24): an OSError EMFILE reaching a worker's generic path was an ERROR
    with the bare [Errno 24]; it is a WARNING naming the limit (still an error of the run)."""
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    caplog.set_level(logging.INFO, "handoffd")
    daemon.attempts._work_failed("h1", _emfile())
    [said] = _said(caplog, "handoff h1:")
    assert said.levelno == logging.WARNING and LIMIT in said.getMessage()
    assert "[Errno" not in said.getMessage() and daemon.report.errors == 1
