"""Three leftovers of process handling (core/procs.py, core/childproc.py), against a fake /proc
(test_procs_exec_s27.FakeProc: nothing real is read, signalled or killed).

1. A process still in the middle of exec once the rounds end is said, not counted (counting it
   as every attempt's survivor, as helper E first did, refused every retry on the host: R60).
2. prune_records scanned /proc once per record (records x processes): now one scan for all.
3. signal_all got one scan's re-look for a process in exec, not the rounds a kill has: a
   carrier whose exec took longer got no SIGTERM (no chance to stop cleanly).
"""
from __future__ import annotations

import signal
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from test_procs_exec_s27 import FakeProc, fake_proc  # noqa: F401 (fake_proc: a fixture)

from handoffd import Workspace as HandoffdWorkspace
from handoffd.core import childproc, procrecords, procs, procstat
from handoffd.core.specialists import HandlerContext

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


class StepClock:
    """procs' clock, moved only by its own sleeps: the rounds and re-reads are counted the same
    however loaded the machine (a real clock let one slow scan outlast the whole window)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def short_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rounds' look-again window shortened (a fake process in exec stays there for good),
    on a clock that only procs' own sleeps move."""
    monkeypatch.setattr(procs, "UNSETTLED_SECONDS", 0.05)
    clock = StepClock()
    monkeypatch.setattr(procs, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                              sleep=clock.sleep))


def _record(root: Path, handoff_id: str, attempt: int = 1, pgid: int | None = None) -> str:
    """Write a local record of ``handoff_id`` (this host, boot, namespace; its daemon, this
    process, is not in the fake /proc: gone); returns its raw token."""
    token = f"tok-{handoff_id}-{uuid.uuid4().hex}"
    record = procrecords.RunRecord.new(handoff_id, token, attempt)
    record.pgid = pgid
    procrecords.write_record(root, record)
    return token


# ---------------------------------------------------------------- 1. a process still in exec

def test_a_process_stuck_in_exec_neither_keeps_records_nor_refuses_retries(
        fake_proc: FakeProc, short_rounds: None, tmp_path: Path) -> None:
    """Any process on the machine may read as in the middle of exec (one hung on a stalled
    mount; on older kernels every exiting one): counted as every attempt's survivor (helper E,
    reverted after R60), it kept each record and refused each retry, charged, until the
    handoffs failed for good without running again. It is said, not counted."""
    HandoffdWorkspace(tmp_path).ensure()
    _record(tmp_path, "h1", pgid=5000)
    _record(tmp_path, "h2")
    fake_proc.add(7000, 7000, None, in_exec=True)
    assert procs.kill_run("tok-mine", None, wait_seconds=60) == (0, 0)
    assert procs.kill_leftovers(tmp_path, "h1", attempt=2) == 0
    assert procrecords.read_record(tmp_path, "h1") is None
    ctx = HandlerContext(handoff_id="h2", attempt=2, root=tmp_path, data=None, target="@c")
    childproc.clear_previous_attempt(ctx)  # (no refusal: the retry starts)
    assert procs.prune_records(tmp_path) == 0 or procrecords.read_record(tmp_path, "h2") is None
    assert not fake_proc.killed


# ---------------------------------------------------------------- 2. one scan for every record

def test_prune_scans_proc_once_for_all_records(fake_proc: FakeProc, tmp_path: Path) -> None:
    """Six records whose daemon is gone: one scan of /proc (it was one per record); the one
    whose attempt still has a process stays, the others go."""
    HandoffdWorkspace(tmp_path).ensure()
    tokens = {f"h{n}": _record(tmp_path, f"h{n}") for n in range(6)}
    fake_proc.add(5000, 5000, tokens["h3"])  # h3's leftover, still running
    fake_proc.add(6000, 6000, None)  # a bystander
    assert procs.prune_records(tmp_path) == 5
    assert fake_proc.scans == 1
    assert [h for h in tokens if procrecords.read_record(tmp_path, h)] == ["h3"]
    assert not fake_proc.killed  # pruning kills nothing


# ---------------------------------------------------------------- 3. the stop signal's rounds

class SlowExec(FakeProc):
    """A fake /proc whose pids in ``slow`` stay in the middle of exec for their first
    ``scans_in_exec`` scans (longer than one scan's re-look), then show their environment."""

    def __init__(self, scans_in_exec: int) -> None:
        super().__init__()
        self.scans_in_exec = scans_in_exec
        self.slow: set[int] = set()

    def pids(self) -> Iterator[int]:
        if self.scans == self.scans_in_exec:  # settled now: exec has set the environment up
            for pid in self.slow:
                pgid, environ, _ = self.table[pid]
                self.table[pid] = (pgid, environ, False)
        yield from super().pids()


@pytest.fixture
def slow_exec(fake_proc: FakeProc, monkeypatch: pytest.MonkeyPatch) -> SlowExec:
    fake = SlowExec(scans_in_exec=2)
    clock = StepClock()  # (the window counted in procs' own sleeps, not in a loaded machine's)
    monkeypatch.setattr(procs, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                              sleep=clock.sleep))
    monkeypatch.setattr(procs, "_pids", fake.pids)
    monkeypatch.setattr(procs, "open", fake.open, raising=False)
    monkeypatch.setattr(procstat, "open", fake.open, raising=False)  # (/proc/<pid>/stat's reader)
    return fake


def test_the_stop_signal_reaches_a_carrier_whose_exec_outlasts_one_scan(
        slow_exec: SlowExec, monkeypatch: pytest.MonkeyPatch) -> None:
    """signal_all looks again in rounds as a kill does (procs.find): the carrier in exec for
    two scans gets its SIGTERM (it got none: one scan, 20 ms of re-reads, then passed over)."""
    slow_exec.add(7000, 7000, "tok-stop", in_exec=True)
    slow_exec.slow.add(7000)
    slow_exec.add(7100, 7100, "tok-another")
    sent: list[tuple[str, int, int]] = []

    def no_group(pgid: int, sig: int) -> None:
        sent.append(("group", pgid, sig))
        raise ProcessLookupError(pgid)
    calls = {name: getattr(childproc.os, name) for name in dir(childproc.os)
             if not name.startswith("__")}
    monkeypatch.setattr(childproc, "os", types.SimpleNamespace(**{
        **calls, "kill": lambda pid, sig: sent.append(("pid", pid, sig)), "killpg": no_group}))
    childproc.signal_all(6000, "tok-stop", signal.SIGTERM)
    assert sent == [("group", 6000, signal.SIGTERM), ("pid", 7000, signal.SIGTERM)]
    assert slow_exec.scans >= 3


def test_find_says_which_processes_stay_in_exec(fake_proc: FakeProc, short_rounds: None,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """The shared rounds end after UNSETTLED_SECONDS (counted in scans: a round sleeps 10 ms),
    saying what is still in exec in one line, not counting it; with nothing in exec, one scan
    and no sleep."""
    import logging
    fake_proc.add(7000, 7000, None, in_exec=True)
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        assert procs.find("tok-mine") == []
    said = [r.getMessage() for r in caplog.records if "middle of exec" in r.getMessage()]
    assert len(said) == 1 and "7000" in said[0], said
    assert 2 <= fake_proc.scans < 20
    del fake_proc.table[7000]
    fake_proc.scans = 0
    fake_proc.add(5000, 5000, "tok-mine")

    def no_sleep(seconds: float) -> Any:
        raise AssertionError("find waited with no process in exec")
    monkeypatch.setattr(procs, "time", types.SimpleNamespace(
        monotonic=time.monotonic, sleep=no_sleep))
    assert procs.find("tok-mine") == [procs.ProcInfo(5000, 5000, 500, True)]
    assert fake_proc.scans == 1
