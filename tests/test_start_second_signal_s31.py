"""A second stop signal while ``handoffd serve`` or ``run`` starts (session 31, task F).

The first SIGTERM during the start (the imports, before the daemon takes its signals) is held
and acted on once the daemon runs; a second one ends the start at once, exit 0, nothing
claimed: the same meaning as a second signal once the daemon runs (hand back at once: there is
nothing to hand back yet). It ended with no word at all; it now says so in one stderr line, in
the daemon's log format (``handoffd db`` already did, session 28). The start is made slow by a
``sitecustomize`` that holds the import of ``handoffd.service.daemon`` for 30 s
(:func:`test_exhaustion_leftovers_s20._start_slowly`), the signals are sent by pid.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from conftest import wait_until
from test_exhaustion_leftovers_s20 import _start_slowly

LINE = ("stopped: before it began, at a second stop signal: nothing was claimed, nothing to "
        "hand back")


def _two_signals(tmp_path: Path, *command: str, third: bool = False) -> \
        tuple[int, list[str], list[str]]:
    """Start ``handoffd COMMAND`` slowly, send SIGTERM then SIGINT during its start; its exit
    code, its stderr lines and the states of the workspace's one handoff. Bounded: 60 s for the
    start to reach its slow import, 20 s (not the 30 s the start still had to go) to end."""
    ws, mark, proc = _start_slowly(tmp_path, *command, pause=30)
    try:
        wait_until(lambda: mark.exists() or proc.poll() is not None, 60, "the start")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        while third and proc.poll() is None:  # more, while the second's exit unwinds
            proc.send_signal(signal.SIGTERM)  # and after: until it has ended
            time.sleep(0.0005)
        _, err = proc.communicate(timeout=20)
        states = ws.state_of("early-1")
    finally:
        ws.cleanup()
    return proc.returncode, err.splitlines(), states


@pytest.mark.parametrize("command", [["serve"], ["run"], ["serve", "--processes", "2"],
                                     ["run", "--processes", "2", "-v"]])
def test_a_second_signal_during_the_start_says_it_stopped(
        tmp_path: Path, command: list[str]) -> None:
    """One line, the last: exit 0, nothing claimed. Before: exit 0 and an empty stderr."""
    code, lines, states = _two_signals(tmp_path, *command)
    assert code == 0, (code, lines)
    assert lines and lines[-1] == f"handoffd: {LINE}", lines
    assert sum("stopped" in line for line in lines) == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    assert states == ["pending"]


def test_a_second_signal_during_the_start_says_it_in_json(tmp_path: Path) -> None:
    """With ``--log-format json`` the line is one JSON record with the "stopped" event, as the
    daemon's "stopped" line is (plain text broke a log shipper's stream)."""
    code, lines, states = _two_signals(tmp_path, "serve", "--log-format", "json")
    assert code == 0, (code, lines)
    assert lines, "no line"
    record = json.loads(lines[-1])
    assert record["event"] == "stopped" and record["message"] == LINE, record
    assert record["level"] == "info" and record["time"].endswith("Z"), record
    assert states == ["pending"]


def test_a_quiet_batch_stays_quiet_at_a_second_signal(tmp_path: Path) -> None:
    """``run -q`` says no "stopped" line at a first signal either: none at the second."""
    code, lines, states = _two_signals(tmp_path, "run", "-q")
    assert code == 0 and not lines, (code, lines)
    assert states == ["pending"]


@pytest.mark.parametrize("attempt", range(3))
def test_a_third_signal_says_nothing_more(tmp_path: Path, attempt: int) -> None:
    """SIGTERM, SIGINT, then SIGTERMs till it ends: still one line and exit 0. A third found the
    start's handler still installed (the line twice, in 10 of 12 runs) or, once Python put the
    default handlers back on its way out, killed it with -15 (RF)."""
    code, lines, states = _two_signals(tmp_path, "serve", third=True)
    assert code == 0, (code, lines)
    assert lines.count(f"handoffd: {LINE}") == 1, lines
    assert states == ["pending"]
