"""Review R48 of the death watch (session 26): a contract's criteria commands die with a
daemon killed by kill -9 as its attempts do; the watch's lines follow the daemon's
``--log-format``; a watch found gone is started again at once (within its rate limit); it is
started with the standard library first on its path.

Every test stops only processes it started (the daemon by pid; the sleeper by the pid it
wrote, only while its command line is still the sleeper's)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from conftest import alive, wait_until
from test_contracts import SCOPE, make_workspace, native
from test_deathwatch_s26 import _cmdline, _watches_of

from handoffd.core import deathwatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n"


def test_a_killed_daemons_criterion_tree_dies_with_it(tmp_path: Path) -> None:
    """A criterion run through a wrapper that forks (``sh -c "python3 ...; true"``): kill -9 of
    the daemon while it runs, and no daemon started again: its grandchild is killed at once.
    It had no run token, no parent-death signal and no watch: it ran on, orphaned."""
    sleeper, pidfile = tmp_path / "sleeper.py", tmp_path / "criterion.pid"
    sleeper.write_text(SLEEPER)
    ws = make_workspace(tmp_path)
    criterion = f"Tests pass: sh -c \"'{sys.executable}' '{sleeper}' '{pidfile}'; true\""
    ws.drop("crit-k.json", native("crit-k", dict(SCOPE, success_criteria=[criterion]), {}))
    daemon = ws.serve()
    work = 0
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=60,
                   what="the criterion's work started")
        work = int(pidfile.read_text())
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=10)
        wait_until(lambda: not alive(work), timeout=10, what="the criterion's grandchild killed")
        wait_until(lambda: not _watches_of(daemon.pid), timeout=10, what="the death watch exits")
    finally:
        ws.cleanup()
        if work and alive(work) and b"sleeper.py" in _cmdline(work):
            os.kill(work, signal.SIGKILL)


def test_the_watch_logs_as_its_daemon_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``--log-format json`` the watch's line is a JSON object (plain text in that
    stream broke a log shipper), at the daemon's level."""
    import logging
    from handoffd.cli.daemon_commands import JsonLines
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines())
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    assert deathwatch._log_style()[0] == "json"
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    assert deathwatch._log_style()[0] == "text"
    line = deathwatch._JsonLine().format(logging.LogRecord(
        "handoffd", logging.WARNING, __file__, 1, "handoff %s: killed", ("h1",), None))
    assert json.loads(line)["message"] == "handoff h1: killed"
    assert json.loads(line)["level"] == "warning"


def test_the_boot_puts_the_standard_library_first() -> None:
    """The package's folder is appended to the path: first, a site-packages folder's
    look-alikes of the standard library (a pathlib or typing backport) replaced it in the watch
    alone, which died at import with a traceback."""
    assert "sys.path.append(sys.argv[1])" in deathwatch._BOOT
    assert "insert" not in deathwatch._BOOT


def test_a_watch_found_gone_is_started_again_for_the_attempt_that_found_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt whose message found the watch gone (EPIPE) starts another at once, when
    the rate limit allows: it was left unwatched until the next attempt's start."""
    starts: list[int] = []

    class Gone:
        pid = 1

        def poll(self) -> int:
            return 0

    read, write = os.pipe()
    os.close(read)  # the watch is gone: a write is EPIPE
    monkeypatch.setattr(deathwatch, "_open", {})
    monkeypatch.setattr(deathwatch, "_watch", deathwatch._Watch(Gone(), write))
    deathwatch._watch.started -= deathwatch.RESTART_SECONDS + 1  # (long ago: a restart allowed)
    monkeypatch.setattr(deathwatch, "_start", lambda: starts.append(1))
    old = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        deathwatch.guard("t1", "h1", 1, pgid=4242)
    finally:
        signal.signal(signal.SIGPIPE, old)
    assert starts == [1] and deathwatch._watch is None
