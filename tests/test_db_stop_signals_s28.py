"""A stop signal during ``handoffd db init``'s start ends it cleanly (session 28, task G).

``db init`` and ``db import`` set their stop handler only when they opened the store, after
importing typer, psycopg and the workspace: a SIGTERM before then (a supervisor's, a Ctrl-C)
killed them with -15 instead of the documented exit 0 "stopped". The console script now holds
SIGTERM, SIGINT and SIGHUP first thing in :func:`handoffd.cli.handoffd_cmd.main` (as for
``serve`` and ``run``), before anything else of handoffd is imported; only a signal while
Python itself starts, before that, acts as on any program (docs/commands.md).

Where the hold stands is seen without a clock: the child runs with ``PYTHONPROFILEIMPORTTIME``,
whose stderr line for a module comes when it is imported. Once the entry module
(``handoffd.cli.handoffd_cmd``) is imported, every handoffd module imported after it is imported
by ``main`` after the hold: the signal is sent at varied tiny delays after the first such line
(its imports, the workspace, the wait for a database nobody serves)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import exe

ENTRY = "| handoffd.cli.handoffd_cmd"
# 20 spawns: SIGTERM mostly, SIGINT and SIGHUP too, at delays spread over the command's start
PLAN = [(signal.SIGINT if n % 5 == 3 else signal.SIGHUP if n % 5 == 4 else signal.SIGTERM,
         0.012 * n) for n in range(20)]


def nobody_on() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def a_store_away(root: Path) -> Path:
    """A workspace whose store nobody serves, waited for a minute: the command never ends by
    itself before the signal."""
    root.mkdir()
    (root / "handoffd.toml").write_text(
        f'[store]\nurl = "postgresql://u:pw@127.0.0.1:{nobody_on()}/db"\n'
        "reconnect_seconds = 60\n")
    return root


def stopped_once(root: Path, after: str, signals: Callable[[subprocess.Popen[str]], None]
                 ) -> tuple[int, list[str]]:
    """Start ``handoffd db init`` on ``root`` (its import times on stderr); once ``after``
    ("imports": it imported its first module of handoffd past the entry module, its stop
    signals held; "waiting": it waits for the database) call ``signals`` on it; its exit code
    and its own stderr lines from then on. Bounded: killed after a minute."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.Popen([exe("handoffd"), "db", "init", "--root", str(root)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60.0, proc.kill)  # (never hangs: only the process it started)
    watchdog.start()
    try:
        assert proc.stderr is not None
        entered = False
        for line in proc.stderr:
            if line.rstrip().endswith(ENTRY):
                entered = True
            elif after == "imports" and entered and line.startswith("import time:") \
                    and "| handoffd." in line:
                break
            elif after == "waiting" and "waiting for the database" in line:
                break
        else:
            raise AssertionError(f"it ended before the signals ({after})")
        signals(proc)
        rest = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
    return code, [one for one in rest.splitlines() if not one.startswith("import time:")]


def stopped_after_main_began(root: Path, signum: int, delay: float) -> tuple[int, list[str]]:
    """Start ``handoffd db init``, send ``signum`` ``delay`` seconds after it imported its
    first module of handoffd past the entry module; its exit code and its own stderr lines."""
    def send(proc: subprocess.Popen[str]) -> None:
        time.sleep(delay)  # (the delay is the point: where in its start the signal lands)
        proc.send_signal(signum)
    return stopped_once(root, "imports", send)


def test_a_stop_during_db_inits_start_is_a_clean_exit(tmp_path: Path) -> None:
    """Each exits 0 with one "stopped" line: before the fix most were killed (-15), or ended
    by KeyboardInterrupt (SIGINT)."""
    root = a_store_away(tmp_path / "ws")
    outcomes = []
    for signum, delay in PLAN:
        code, lines = stopped_after_main_began(root, signum, delay)
        outcomes.append((signal.Signals(signum).name, delay, code, lines[-1:]))
    wrong = [one for one in outcomes if one[2] != 0 or not one[3]
             or not one[3][0].startswith("handoffd: stopped: before it began")]
    assert not wrong, wrong


def sig_caught(pid: int, signum: int) -> bool | None:
    """Whether process ``pid`` has a handler for ``signum`` now (None: it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_stop_the_instant_it_is_held_is_a_clean_exit(tmp_path: Path) -> None:
    """The earliest a stop can be held: the SIGTERM is sent the instant /proc shows the
    process's handler for it (looked for every half millisecond from the spawn), at the very
    start of ``main()``, before any of handoffd past its entry module is imported. Every one
    exits 0 "stopped" (before the hold a SIGTERM may still kill it, -15: documented, while
    Python itself starts; this test never sends one then)."""
    root = a_store_away(tmp_path / "ws")
    outcomes = []
    for extra in (0.0, 0.0, 0.001, 0.003, 0.01):
        proc = subprocess.Popen([exe("handoffd"), "db", "init", "--root", str(root)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not sig_caught(proc.pid, signal.SIGTERM):
                assert proc.poll() is None and time.monotonic() < deadline, "never held"
                time.sleep(0.0005)
            time.sleep(extra)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outcomes.append((extra, proc.returncode, err.strip().splitlines()[-1:]))
    wrong = [one for one in outcomes if one[1] != 0 or not one[2]
             or not one[2][0].startswith("handoffd: stopped: before it began")]
    assert not wrong, outcomes


def test_a_sighup_ignored_by_whoever_started_it_stays_ignored(tmp_path: Path) -> None:
    """R64: `nohup handoffd db import` ended "stopped" at a SIGHUP during its start, importing
    nothing, and exited 0 (a script went on as if it had imported). A signal its starter
    ignored stays ignored: the SIGHUP changes nothing; a SIGTERM still stops the wait."""
    root = a_store_away(tmp_path / "ws")
    proc = subprocess.Popen(
        [exe("handoffd"), "db", "init", "--root", str(root)], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    watchdog = threading.Timer(60.0, proc.kill)  # (never hangs: only the process it started)
    watchdog.start()
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline()  # (the wait for the store, said once it waits)
        assert "waiting for the database" in said, said
        for _ in range(3):
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        assert proc.poll() is None, "a SIGHUP its starter ignored ended it"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(30) == 0, rest
        assert "stopped: before it began" in rest, rest
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
