"""What ``/proc/<pid>/stat`` says about one process: its state, group and start time.

Kept apart from :mod:`.procs` (finding and killing an attempt's processes), which
:mod:`.liveness` needed only for :func:`start_time`: ``handoff ls`` asks whether a daemon's or
a claim's owner still runs, and loading the whole process machinery for that one read was part
of every such listing's start."""
from __future__ import annotations

from typing import NamedTuple

_PF_KTHREAD = 0x00200000  # the stat flag of a kernel thread: no environment, never an attempt's


class _Stat(NamedTuple):
    """What /proc/<pid>/stat says about one process."""

    state: str
    pgid: int
    start: int
    kernel: bool  # a kernel thread
    # where its environment lies in its memory (start, end): end 0 while exec has not set it up
    # yet (or the process has let its memory go: it is exiting); None: not shown (Linux < 3.5)
    env: tuple[int, int] | None


def _stat(pid: int) -> _Stat | None:
    """What /proc/<pid>/stat says about ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields start after the last ')'
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        env = (int(fields[47]), int(fields[48])) if len(fields) > 48 else None
        return _Stat(fields[0].decode(), int(fields[2]), int(fields[19]),
                     bool(int(fields[6]) & _PF_KTHREAD), env)
    except (IndexError, ValueError):
        return None


def start_time(pid: int, *, live: bool = False) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or None if it is gone (with ``live``,
    also when it has finished and awaits its reaping: a zombie holds nothing)."""
    info = _stat(pid)
    if info is None or live and info.state in ("Z", "X"):
        return None
    return info.start
