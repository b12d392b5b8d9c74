"""Whether the process that wrote a lease still runs: a mark naming one process for good.

A file-store claim rides on a flock, and a free lock normally proves its owner died. But a
handler may close descriptors it did not open and drop its daemon's lock while the daemon lives
and its handler runs; until the daemon notices (within about half a second, later on a loaded
machine) another daemon of this host would take the free lock for a death and run the handoff a
second time beside the first. So each lease also carries its writer's mark, and a free lock
counts as a death only when no live process of this host bears that mark.

A mark is a digest of the boot id, the pid namespace, the pid and the pid's start time (clock
ticks after boot): a reused pid or a process of another boot never bears it. Beside it the lease
names the writer's pid and time namespaces (``ns``): only a recoverer in the same ones can look
the owner up in its /proc (pids and start times are seen through one's own namespaces), and one
in others cannot tell, so it leaves the claim to the lease's expiry. A process whose /proc is not
of its own pid namespace (a namespace entered without mounting its /proc) writes no mark: its
claims are judged by their lock alone, as before marks. A forged mark or ``ns`` can only make a
recoverer wait for the lease's expiry: never longer than a stalled owner would.
"""
from __future__ import annotations

import os

from .hashing import sha256_hex
from .procrecords import MAX_PID, boot_id, pid_namespace
from .procstat import start_time  # (not .procs: the machinery that kills processes)

_MINE: dict[int, tuple[str, str]] = {}  # by pid: a forked child computes its own


def _mark(pid: int, ticks: int) -> str:
    return sha256_hex(f"{boot_id()}/{pid_namespace()}/{pid}/{ticks}".encode())[:16]


def _namespaces() -> str:
    """This process's pid and time namespaces (``4026531836/4026531834``; empty parts where the
    kernel has none); :func:`own_mark` keeps it, with the mark, per process."""
    names = []
    for kind in ("pid", "time"):
        try:
            link = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            link = ""
        names.append(link[link.find("[") + 1:-1] if link.endswith("]") else "")
    return "/".join(names)


def _proc_is_ours() -> bool:
    """True when /proc shows this process's pid namespace (``/proc/self`` is our own pid)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def own_mark() -> tuple[str, str] | None:
    """This process's (mark, namespaces), computed once per process; None where /proc cannot
    tell (no /proc, or one of another pid namespace)."""
    pid = os.getpid()
    known = _MINE.get(pid)
    if known is None:
        ticks = start_time(pid, live=True) if _proc_is_ours() else None
        if ticks is None:
            return None
        known = _MINE[pid] = (_mark(pid, ticks), _namespaces())
    return known


def owner_may_live(owner: dict[str, object]) -> bool:
    """Whether the lease owner ``owner`` (a document's ``{host, pid, proc, ns}``, of this host)
    may still run although its claim lock is free. False only when this process can tell: the
    owner wrote a mark (older writers did not: their lock alone decides), in the namespaces this
    process is in, and no live process bears it. Nothing in ``owner`` is trusted: a forged value
    can only answer True, leaving the claim to its lease's expiry."""
    mark = owner.get("proc")
    if not isinstance(mark, str):
        return False
    known = own_mark()
    if known is None or owner.get("ns") != known[1]:
        return True  # its processes are not ours to look up
    return bears_mark(owner.get("pid"), mark)


def live_mark(pid: int) -> str | None:
    """The mark of the live process ``pid`` of this host, seen from this process's namespaces
    (one read of its /proc stat); None when no live process has that pid (or it is out of
    range)."""
    if not 0 < pid <= MAX_PID:
        return None
    ticks = start_time(pid, live=True)
    return None if ticks is None else _mark(pid, ticks)


def bears_mark(pid: object, mark: object) -> bool:
    """True when ``pid`` is a live process of this host, seen from this process's namespaces,
    whose mark is ``mark``. Both come from a document: anything but a pid in range and a mark
    string is False."""
    if type(pid) is not int or not isinstance(mark, str) or len(mark) != 16:
        return False
    return live_mark(pid) == mark
