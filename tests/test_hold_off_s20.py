"""A handoff that failed for a passing reason is looked at again no sooner than its back-off,
whatever hints come meanwhile (session 20, review R26 #1).

A document larger than the daemon's `ulimit -f` cannot be claimed (the lease write is
refused: EFBIG): the daemon said "will retry in 5.0s" and claimed it again ~100 times a second,
its own put-back's folder event cutting the wait short (half a core, 624 log lines in 14 s).
The scheduler now keeps a floor per id (``Scheduler.hold_off``) that notify() respects, and
the look-again doubles to a minute."""
from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import Clock, exe, memory_engine, new_workspace

from handoffd import Daemon


def test_a_held_off_handoff_ignores_hints_until_its_time(tmp_path: Path) -> None:
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": lambda doc, ctx: {"status": "completed"}})
    books = Daemon(engine, workers=1, watch=False).scheduler
    before = time.monotonic()
    books.notify("h1")  # a folder event before the failure was known: superseded
    books.hold_off("h1", 5.0)
    books.notify("h1")  # a folder event, a rescan: not sooner
    assert books.queued["h1"] >= before + 4.9
    assert books.next_ready(time.monotonic()) is None  # (the sooner entry is skipped)
    books.not_before["h1"] = time.monotonic() - 1  # (the time has passed: hints count again)
    books.notify("h1")
    assert books.queued["h1"] <= time.monotonic() and "h1" not in books.not_before


def _small_files() -> None:
    """The daemon's own `ulimit -f`: 64 KiB (SIGXFSZ ignored, as Python starts)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_document_this_process_cannot_write_is_not_claimed_in_a_loop(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
durability = "fast"

[specialists."@echo"]
command = ["{sys.executable}", "-S", "-c", "print('{{\\"status\\": \\"completed\\"}}')"]
""")
    try:
        ws.create("--to", "@echo", "--data", json.dumps({"x": "a" * 100_000}))
        daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=_small_files)
        try:
            time.sleep(4.0)  # (before: some 400 claims and error lines by now; now one)
        finally:
            daemon.send_signal(signal.SIGTERM)
            _, err = daemon.communicate(timeout=30)
        tries = [line for line in err.splitlines() if "File too large" in line]
        # (a worker may have been handed it again, by its put-back's folder event, before the
        # first failure held it off: a try or two more, each doubling the wait)
        assert 1 <= len(tries) <= 4, err[-2000:]
        assert [t.rsplit("will retry in ", 1)[1] for t in tries] == \
            ["5s", "10s", "20s", "40s"][:len(tries)], tries
        assert "Traceback" not in err
        assert ws.state_of(next(iter(p.stem for p in (ws.root / "handoffs" / "pending")
                                     .glob("*.json")))) == ["pending"]
    finally:
        ws.cleanup()
