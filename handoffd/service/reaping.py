"""Collecting a forked process of a batch (:mod:`.spread`) within a bound, or stopping it.

The parent of a ``handoffd run --processes N`` reads each child's report from a pipe and
reaps it. A child that makes no progress (stopped, a handler holding the interpreter's lock, a
wedged disk) used to hold the parent, and with it the whole batch, for ever: ``--max-seconds``
did not bound it. Now the parent waits for a child until a deadline it is given (None: as long
as it takes), then stops it: SIGCONT (a stopped child can act on what follows), SIGTERM (it
hands its work back and ends), and SIGKILL if it has not ended :data:`TERM_SECONDS` later. The
claims of a killed child are recovered by the next sweep, as for any dead owner.
"""
from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Callable

TERM_SECONDS = 3.0  # a child sent SIGTERM past its deadline has this long to end, then SIGKILL
KILL_SECONDS = 5.0  # a SIGKILLed child is waited for this long (one stuck in the kernel is left)
SLICE_SECONDS = 0.5  # the longest single wait: the deadline is looked at again this often
EXIT_POLL_SECONDS = 0.02  # how often the exit of a child that closed its pipe is looked for
EXIT_GRACE_SECONDS = 1.0  # past the deadline, a child whose pipe ended gets this long to exit
Clock = Callable[[], float]


@dataclass
class Collected:
    """What became of a child: its report's bytes, its wait status (None: not reaped), and
    how it was stopped ("" when it ended on its own)."""

    data: bytes
    status: int | None
    stopped: str = ""


def collect(pid: int, read: int, until: Callable[[], float], unreaped: list[int], *,
            clock: Clock = time.monotonic) -> Collected:
    """Read child ``pid``'s report from pipe ``read`` (closed here) and reap it; past
    ``until()`` (a monotonic time, asked again as it may move: a signal sets one) stop it
    first. ``pid`` is taken off ``unreaped`` before it is reaped (a reaped pid may be reused,
    and the parent's signal handlers send to the pids listed there)."""
    data = bytearray()
    try:
        exited = _await(pid, read, data, until, clock)
        stopped = ""
        if not exited:
            stopped, exited = _stop(pid, read, data, clock)
    finally:
        os.close(read)
    unreaped.remove(pid)
    return Collected(bytes(data), _reap(pid) if exited else None, stopped)


def _reap(pid: int) -> int | None:
    """Reap ``pid``, which has exited; its wait status (None: reaped elsewhere already)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _await(pid: int, read: int, data: bytearray, until: Callable[[], float], clock: Clock) -> bool:
    """Gather the pipe into ``data`` until it closes, then wait for ``pid`` to exit; False when
    ``until()`` came first."""
    while True:
        left = until() - clock()
        if left <= 0:
            # a healthy child collected after a stuck one, past the shared deadline: what it
            # wrote is taken, and it is given a moment to exit (its report was once dropped)
            if read >= 0 and _drain_ready(read, data):
                end = clock() + EXIT_GRACE_SECONDS
                while not _exited(pid) and clock() < end:
                    time.sleep(EXIT_POLL_SECONDS)
            return _exited(pid)
        if read >= 0 and not _read_some(read, data, min(left, SLICE_SECONDS)):
            read = -1  # the pipe is at its end: only the exit is left to wait for
        elif read < 0:
            if _exited(pid):
                return True
            time.sleep(min(left, EXIT_POLL_SECONDS))


def _read_some(read: int, data: bytearray, seconds: float) -> bool:
    """Wait up to ``seconds`` for the pipe and add what it holds to ``data``; False at its
    end."""
    poller = select.poll()
    poller.register(read, select.POLLIN | select.POLLHUP)
    if not poller.poll(max(int(seconds * 1000), 1)):
        return True
    chunk = os.read(read, 65536)
    data.extend(chunk)
    return bool(chunk)


def _drain_ready(read: int, data: bytearray) -> bool:
    """Add to ``data`` what the pipe holds now, without waiting; True when it is at its end."""
    poller = select.poll()
    poller.register(read, select.POLLIN | select.POLLHUP)
    while poller.poll(0):
        chunk = os.read(read, 65536)
        if not chunk:
            return True
        data.extend(chunk)
    return False


def _exited(pid: int) -> bool:
    """True when ``pid`` has exited (it is left to be reaped)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (not by us): nothing to wait for
        return True


def _stop(pid: int, read: int, data: bytearray, clock: Clock) -> tuple[str, bool]:
    """Stop a child that did not end in time: SIGCONT and SIGTERM, then SIGKILL; (the last
    signal sent, whether it has exited)."""
    for signum in (signal.SIGCONT, signal.SIGTERM):
        _send(pid, signum)
    end = clock() + TERM_SECONDS
    if _await(pid, read, data, lambda: end, clock):  # (a report sent now is kept)
        return "SIGTERM", True
    _send(pid, signal.SIGKILL)
    end = clock() + KILL_SECONDS
    return "SIGKILL", _await(pid, -1, data, lambda: end, clock)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it has just ended
        pass
