"""The process records' and cancel requests' folders under a descriptor shortage (helper Q,
session 24).

``handoffs/.meta/procs`` and ``handoffs/.meta/cancel`` that could not be opened for want of
descriptors (EMFILE, ENFILE) were said as an ERROR, said again each time an open had worked in
between, with no line when the shortage ended (``handoffd serve`` under ``prlimit --nofile=8``:
``ERROR: cannot open .../.meta/procs: Too many open files (EMFILE: ...)`` and the same for
``.meta/cancel``, then nothing once the limit was raised). Now each is one WARNING naming the
limit, said again at most once a minute while it lasts, and one ``... works again`` line when it
ends, as the sweep's folder problem is (``backends/files/orphans.py``). A real refusal (a
symlink, no folder) stays one ERROR. A shortage opening the cancel requests' folder is said by
the store, never by the store and the cancel requests' poll both; a record that cannot be read
for want of descriptors is no longer called "not a process record handoffd wrote", nor removed
unchecked; another failure of the poll (an unreachable store) is one ERROR held back.
"""
from __future__ import annotations

import errno
import logging
import resource
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import Clock, exe, new_workspace
from conftest import wait_for_words as _wait_for
from test_claim_shortage_s22 import _engine
from test_shortage_keep_s23 import LIMIT, _emfile, _errors, _said
from test_start_shortage_s20 import FailFirst

from handoffd.backends.files import backend as backend_module
from handoffd.core import procrecords, recurring
from handoffd.features import cancellation


class Seconds:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def seconds(monkeypatch: pytest.MonkeyPatch) -> Seconds:
    """The process records' clock, and a fresh book of their shortages (module-wide)."""
    clock = Seconds()
    monkeypatch.setattr(procrecords, "clock", clock, raising=False)
    monkeypatch.setattr(procrecords, "shortages", recurring.Recurring(
        quiet=recurring.QUIET_SECONDS), raising=False)
    return clock


# ---------------------------------------------------------------- a real daemon

SERVE_TOML = """
[daemon]
durability = "fast"
sweep_seconds = 0.5
rescan_seconds = 0.5
stall_seconds = 600
"""


@pytest.mark.heavy
def test_a_serving_daemon_says_each_folder_short_once_and_when_it_works_again(
        tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", SERVE_TOML)
    meta = ws.root / "handoffs" / ".meta"
    for name in ("procs", "cancel"):  # (made by the first attempt and the first cancel)
        (meta / name).mkdir(exist_ok=True)
    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=sink)
    ws.daemons.append(proc)  # type: ignore[arg-type]
    try:
        assert "serving" in _wait_for(err, ["serving"]), err.read_text()
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        # below every descriptor but stdin, stdout and stderr: each new one is EMFILE
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (3, hard))
        procs, cancel = f"cannot open {meta / 'procs'}: ", f"cannot open {meta / 'cancel'}: "
        _wait_for(err, [procs, cancel])
        time.sleep(3)  # six sweeps and rescans more, all short
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        again = [f"opening {meta / name} works again" for name in ("procs", "cancel")]
        _wait_for(err, again)
        assert ws.stop(proc) == 0  # type: ignore[arg-type]
    finally:
        ws.cleanup()
    lines = err.read_text(errors="replace").splitlines()
    said = "\n".join(lines)
    for words in (procs, cancel):
        short = [line for line in lines if words in line]
        assert len(short) == 1 and "WARNING" in short[0] and LIMIT in short[0], said
        assert "(if it recurs, said again at most once a minute)" in short[0], said
    assert "cannot read the cancel requests" not in said  # (the poll: not said twice)
    for words in again:
        assert len([line for line in lines if words in line]) == 1, said
    assert not [line for line in lines if "ERROR" in line and ".meta/" in line], said
    assert "Traceback" not in said


# ---------------------------------------------------------------- 1. the process records


def test_the_records_folder_short_is_one_warning_held_back_then_cleared(
        tmp_path: Path, seconds: Seconds, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    root = tmp_path
    procrecords.record_dir(root).mkdir(parents=True)
    opening = FailFirst(procrecords.open_beneath, 4, _emfile)
    monkeypatch.setattr(procrecords, "open_beneath", opening)
    caplog.set_level(logging.INFO, "handoffd")
    for turn in range(4):  # attempts' ends, the next attempt's look for leftovers
        if turn % 2:
            assert procrecords.read_record(root, "h1") is None
        else:
            procrecords.remove_record(root, "h1")
        seconds.now += 5
    said = _said(caplog, "cannot open ")
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert LIMIT in message and "[Errno" not in message and "for now" in message
    assert str(procrecords.record_dir(root)) in message
    seconds.now += 60
    opening.times = 6  # twice more, a minute on: said again, with what was held back
    procrecords.remove_record(root, "h1")
    procrecords.remove_record(root, "h1")
    said = _said(caplog, "cannot open ")
    assert len(said) == 2 and "(still; 3 more like it held back)" in said[1].getMessage()
    assert not _said(caplog, "works again")
    procrecords.remove_record(root, "h1")  # it opens again: said once quiet that long
    assert not _said(caplog, "works again")
    seconds.now += recurring.QUIET_SECONDS
    procrecords.remove_record(root, "h1")
    cleared = _said(caplog, f"opening {procrecords.record_dir(root)} works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 6 failure(s))" in \
        cleared[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert not _errors(caplog)


def test_a_records_folder_that_is_a_symlink_is_still_one_error(
        tmp_path: Path, seconds: Seconds, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setattr(procrecords, "_refusals_said", set())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = procrecords.record_dir(tmp_path / "ws")
    folder.parent.mkdir(parents=True)
    folder.symlink_to(elsewhere)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(3):
        assert procrecords.read_record(tmp_path / "ws", "h1") is None
        seconds.now += 61
    said = _said(caplog, "is not a folder of the workspace")
    assert len(said) == 1 and said[0].levelno == logging.ERROR


def _write(root: Path, handoff_id: str, token: str) -> None:
    record = procrecords.RunRecord.new(handoff_id, token, 1)
    procrecords.write_record(root, record)


def test_a_record_unread_for_want_of_descriptors_is_said_so_and_kept(
        tmp_path: Path, seconds: Seconds, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """It read as "not a process record handoffd wrote (unreadable: Too many open files)", and
    an attempt's end removed the record unchecked: a newer attempt's, perhaps."""
    _write(tmp_path, "h1", "newer-token")
    path = procrecords.record_path(tmp_path, "h1")
    reading = FailFirst(procrecords.read_regular, 3, _emfile)
    monkeypatch.setattr(procrecords, "read_regular", reading)
    caplog.set_level(logging.INFO, "handoffd")
    assert procrecords.read_record(tmp_path, "h1") is None
    procrecords.remove_record(tmp_path, "h1", "older-token")  # an older attempt's end
    assert path.exists()  # whose it is could not be told: kept
    procrecords.remove_record(tmp_path, "h1", "older-token")
    assert path.exists()
    said = _said(caplog, "cannot read handoffs/.meta/procs/h1.json for now")
    assert len(said) == 1 and said[0].levelno == logging.WARNING and LIMIT in \
        said[0].getMessage()
    assert not _said(caplog, "not a process record handoffd wrote")
    seconds.now += recurring.QUIET_SECONDS  # (cleared by a read that works after so long)
    record = procrecords.read_record(tmp_path, "h1")  # it works again
    assert record is not None and isinstance(record.token, procrecords.SealedToken)
    assert record.token.matches("newer-token")
    assert len(_said(caplog, "reading a process record works again")) == 1
    procrecords.remove_record(tmp_path, "h1", "older-token")
    assert path.exists()  # (not the older attempt's: never removed by its end)
    assert not _errors(caplog)


# ---------------------------------------------------------------- 2. the cancel requests


def _cancel_engine(tmp_path: Path, clock: Clock) -> tuple[Any, Seconds]:
    engine: Any = _engine(tmp_path / "ws", clock)
    monotonic = Seconds()
    engine.backend.monotonic = monotonic  # (the files store's, through its recorder)
    return engine, monotonic


def _fail_opening(monkeypatch: pytest.MonkeyPatch, times: int) -> FailFirst:
    """The first ``times`` openings of ``.meta/cancel`` by the store fail with EMFILE."""
    opening = FailFirst(backend_module.open_beneath, times, _emfile,
                        when=lambda base, parts, *a, **k: tuple(parts)[-1:] == ("cancel",))
    monkeypatch.setattr(backend_module, "open_beneath", opening)
    return opening


def test_the_cancel_folder_short_is_one_warning_held_back_then_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    engine, monotonic = _cancel_engine(tmp_path, Clock())
    backend = engine.backend
    backend.request_cancel("h1", {"reason": "r"})
    opening = _fail_opening(monkeypatch, 3)
    caplog.set_level(logging.INFO, "handoffd")
    for _ in range(3):  # a gate's look, a filed handoff's clearing
        assert backend.cancel_request("h1") is None
        monotonic.now += 5
    folder = f"cannot open {backend._cancel_folder}: "
    said = _said(caplog, folder)
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert LIMIT in said[0].getMessage() and "[Errno" not in said[0].getMessage()
    monotonic.now += 60
    opening.times = 5
    backend.clear_cancel("h1")
    assert len(_said(caplog, folder)) == 2
    assert "(still; 2 more like it held back)" in _said(caplog, folder)[1].getMessage()
    backend.clear_cancel("h1")
    assert len(_said(caplog, folder)) == 2  # (held back)
    assert backend.cancel_request("h1") == {"reason": "r"}  # it opens again: not yet cleared
    assert not _said(caplog, f"opening {backend._cancel_folder} works again")
    monotonic.now += recurring.QUIET_SECONDS  # (as quiet as that, the next open clears it)
    assert backend.cancel_request("h1") == {"reason": "r"}
    cleared = _said(caplog, f"opening {backend._cancel_folder} works again")
    assert len(cleared) == 1 and "(EMFILE cleared after 5 failure(s))" in cleared[0].getMessage()
    assert not _errors(caplog)


class _Daemon:
    """What cancellation uses of a daemon; its scan hook (the poll) is kept to be called."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scan_hooks: list[Callable[[], None]] = []

    def add_scan_hook(self, hook: Callable[[], None]) -> None:
        self.scan_hooks.append(hook)

    def __getattr__(self, name: str) -> Any:  # (the other hooks: not used here)
        return lambda *args, **kwargs: None

    def running_job(self, handoff_id: str) -> None:
        return None


def test_a_short_cancel_folder_is_said_by_the_store_not_by_the_poll_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    clock = Clock()
    engine, monotonic = _cancel_engine(tmp_path, clock)
    (engine.ws.meta / "cancel").mkdir(exist_ok=True)
    _fail_opening(monkeypatch, 3)
    caplog.set_level(logging.INFO, "handoffd")
    daemon = _Daemon(engine)
    cancellation.attach(daemon)  # type: ignore[arg-type]
    [poll] = daemon.scan_hooks  # (what the daemon calls at every rescan)
    for rescan in range(4):  # three rescans short, then it works (quiet long enough)
        if rescan == 3:
            monotonic.now += recurring.QUIET_SECONDS
        poll()
        clock.advance(1)
        monotonic.now += 1
    said = [r.getMessage() for r in caplog.records]
    folder = engine.backend._cancel_folder
    short = _said(caplog, f"cannot open {folder}: ")
    assert len(short) == 1 and short[0].levelno == logging.WARNING, said
    assert LIMIT in short[0].getMessage()
    assert not _said(caplog, "cannot read the cancel requests"), said  # (said twice)
    assert len(_said(caplog, f"opening {folder} works again (EMFILE cleared after "
                             "3 failure(s))")) == 1, said
    assert not _said(caplog, "reading the cancel requests works again"), said
    assert not _errors(caplog)


def test_the_poll_failing_otherwise_is_one_error_held_back(
        tmp_path: Path, caplog: Any) -> None:
    """An unreachable store (PostgreSQL down) was an ERROR at every rescan."""
    clock = Clock()
    engine, _monotonic = _cancel_engine(tmp_path, clock)
    calls = FailFirst(engine.backend.cancel_requests, 3,
                      lambda: OSError(errno.ECONNREFUSED, "the store is unreachable"))
    engine.backend.cancel_requests = calls  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, "handoffd")
    daemon = _Daemon(engine)
    cancellation.attach(daemon)  # type: ignore[arg-type]
    [poll] = daemon.scan_hooks
    for _ in range(4):
        poll()
        clock.advance(1)
    said = _said(caplog, "cannot read the cancel requests: ")
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "the store is unreachable" in said[0].getMessage()
    assert len(_said(caplog, "reading the cancel requests works again (ECONNREFUSED")) == 1


def test_a_records_folder_short_every_other_open_is_said_once(
        tmp_path: Path, seconds: Seconds, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Review R37: at the limit every other open fails; each success cleared the problem, so
    each failure was two lines ("cannot open", then "works again")."""
    root = tmp_path
    procrecords.record_dir(root).mkdir(parents=True)
    real, calls = procrecords.open_beneath, [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] % 2:
            raise _emfile()
        return real(*args, **kwargs)

    monkeypatch.setattr(procrecords, "open_beneath", flaky)
    caplog.set_level(logging.INFO, "handoffd")
    for turn in range(10):
        procrecords.read_record(root, f"h-{turn}")
        seconds.now += 1
    assert len(_said(caplog, "cannot open ")) == 1
    assert not _said(caplog, "works again")
