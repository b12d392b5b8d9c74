"""Whether the process that wrote a lease still runs: a mark naming one process for good.

A file-store claim rides on a flock, and a free lock normally proves its owner died. But a
handler may close descriptors it did not open and drop its daemon's lock while the daemon lives
and its handler runs; until the daemon notices (within about half a second, later on a loaded
machine) another daemon of this host would take the free lock for a death and run the handoff a
second time beside the first. So each lease also carries its writer's mark, and a free lock
counts as a death only when no live process of this host bears that mark.

A mark is a digest of the boot id, the pid namespace, the pid and the pid's start time (clock
ticks after boot): a reused pid, a process of another boot or of another pid namespace never
bears it. A forged mark can only name a live process, which makes a recoverer wait for the
lease's expiry instead: never longer than a stalled owner would.
"""
from __future__ import annotations

import os

from .hashing import sha256_hex
from .procrecords import MAX_PID, boot_id, pid_namespace

_MINE: dict[int, str] = {}  # by pid: a forked child computes its own


def _start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` (field 22 of /proc/<pid>/stat); None if it is gone or a
    zombie (a process that has finished holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # the command name may hold ')' and spaces
    try:
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (IndexError, ValueError):
        return None


def _mark(pid: int, ticks: int) -> str:
    return sha256_hex(f"{boot_id()}/{pid_namespace()}/{pid}/{ticks}".encode())[:16]


def own_mark() -> str | None:
    """This process's mark (computed once per process); None where /proc cannot tell."""
    pid = os.getpid()
    mark = _MINE.get(pid)
    if mark is None:
        ticks = _start_ticks(pid)
        if ticks is None:
            return None
        mark = _MINE[pid] = _mark(pid, ticks)
    return mark


def bears_mark(pid: object, mark: object) -> bool:
    """True when ``pid`` is a live process of this host whose mark is ``mark``. Both come from a
    document: anything but a pid in range and a mark string is False."""
    if type(pid) is not int or not 1 < pid <= MAX_PID or not isinstance(mark, str) \
            or len(mark) != 16:
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and _mark(pid, ticks) == mark
