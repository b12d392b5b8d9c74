"""The processes of command-specialist attempts: tag them, record them, and kill what is left.

A command specialist may leave processes behind: a background child that keeps running after the
handler exits, a grandchild that called ``setsid`` and so left the process group, or the whole tree
when its daemon is killed with ``kill -9``. Left alone, those keep working on a handoff that has
meanwhile been retried, so two runs of one handoff overlap. To prevent that, every attempt

* runs in its own process group and carries a unique run token in its environment
  (``HANDOFFD_RUN_TOKEN=<token>``), which every descendant inherits, even one that calls setsid;
* gets ``PR_SET_PDEATHSIG(SIGKILL)``, so the direct child dies with its daemon;
* is told to the daemon's death watch (deathwatch.py), a process of its own session that kills
  the attempts of its daemon the moment the daemon dies (``kill -9`` too), grandchildren of a
  wrapper that forks included, with no other daemon needed (another host sharing a PostgreSQL
  store would otherwise run attempt 2 beside them);
* is recorded in ``handoffs/.meta/procs/<handoff_id>.json`` while it runs (procrecords.py: the
  record's format, and why a planted record leads to no process).

A record only ever leads to processes that prove they are the attempt's: a process is the
attempt's when its environment carries a token whose digest is the record's, and a process group
only when one of its members is (never the daemon's own group).

:func:`kill_run` kills an attempt's leftovers (its process group and every process whose
``/proc/<pid>/environ`` carries the token) and waits until they are gone. The runner calls it when
each attempt ends and, through :func:`kill_leftovers`, before an attempt starts, so a retry never
starts on a host where the previous attempt's processes still live. Whoever recovers an abandoned
claim should call :func:`kill_leftovers` too, before handing the handoff back. :func:`kill_runs`
kills several attempts from one pass over /proc per round (the death watch's, its daemon dead).
A process in the middle of exec (right after Popen returns, /proc shows its environment empty
until the kernel has set it up) is looked at again, never passed over as carrying no token:
each scan re-reads it for :data:`SETTLE_SECONDS`, then further rounds look again for up to
:data:`UNSETTLED_SECONDS` (a kill's rounds, :func:`find`'s for a stop signal or a retry's
check). One still in exec after that is said in one line, not counted: any process on the
machine may be in that state (one hung in exec on a stalled mount; on older kernels every
exiting process reads so), and counting it as every attempt's survivor kept their records and
refused their retries for good (R60). :func:`prune_records` makes one scan for every record.

Limits: only processes on this host that this process can see can be found (a record of another
pid namespace, a container's, is found by token only: from the host, not from a sibling
container); a descendant that
clears its environment *and* leaves the process group cannot be recognised, nor can, after its
daemon died, a group none of whose members still carries the token (the leader's pid and start
time alone no longer vouch for it: anyone can read them). When a daemon dies, its death watch
kills its attempts at once; when the watch is gone too (it could not be started, which says so
in one line; an OOM kill or ``kill -9`` of both), the attempts' grandchildren (the direct child
has the parent-death signal) run on until a daemon on this host kills them through the records:
the next attempt here, or a sweep that recovers the claim. Another host cannot: with a shared
store it may run the next attempt meanwhile.
"""
from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .documents import hostname
from .logs import log  # (deferred: `handoff ls` imports this module's callers, logging nothing)
from .procrecords import (MAX_PID, RunRecord, SealedToken, boot_id, read_in, read_record,
                          records_folder, remove_in, remove_record, remove_stale_temp)
# what /proc/<pid>/stat says: a module of its own for liveness, named here too as it always was
from .procstat import _Stat, _stat, start_time  # noqa: F401

TOKEN_ENV = "HANDOFFD_RUN_TOKEN"
KILL_WAIT_SECONDS = 5.0  # how long kill_run waits for the killed processes to be gone
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about one live (non-zombie) process."""

    pid: int
    pgid: int
    start: int
    marked: bool  # carries the run token in its environment


def new_token() -> str:
    """A fresh run token (unguessable, so no unrelated process carries it)."""
    return os.urandom(16).hex()


# ---------------------------------------------------------------- the child side

@functools.cache  # loaded on the first command run: a CLI process never needs ctypes
def _load_prctl() -> Any:
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal, the records still work
        return None


def child_setup(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` making the child die with its daemon (PR_SET_PDEATHSIG = SIGKILL).

    The signal fires when the thread that forked exits; the runner forks from the worker thread
    that waits for the child, so that thread outlives the child unless the daemon dies. If the
    daemon died between fork and prctl, the child exits at once instead of running orphaned."""
    prctl = _load_prctl()  # here in the parent: the child may not import

    def setup() -> None:  # runs in the child between fork and exec: no locks, no imports
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(70)

    return setup


# what stops a daemon gracefully (a second one: hands back at once). SIGHUP too: a closed
# terminal or ssh session once killed a foreground `serve` on the spot, its running attempts
# then charged as a crash's
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def parent_death_signal(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when the thread that forked it ends
    (Linux; elsewhere nothing happens)."""
    prctl = _load_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


# ---------------------------------------------------------------- finding and killing

# How long one scan looks again at a process whose environment reads empty because it is in the
# middle of exec: Popen returns once exec is past its point of no return, but the kernel sets
# the new environment up after that (17 of 300 reads right after Popen came back empty; the
# longest such window measured on a loaded machine, about 5 ms). A process still in that state
# afterwards is reported, and the caller looks again in its next round (see _Looking).
SETTLE_SECONDS = 0.02
_SETTLE_STEP = 0.001
UNSETTLED_SECONDS = 0.25  # how long further rounds look again for processes still in exec
_ROUND_SECONDS = 0.01  # between two rounds: lets the kernel finish a kill, or an exec


def _environ(pid: int) -> bytes | None:
    """``pid``'s environment as /proc shows it; None if it is gone, or another user's process
    (never ours to kill)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read()
    except OSError:
        return None


_PREFIX = f"{TOKEN_ENV}=".encode()


class _Tokens:
    """The run tokens one scan looks for, matched against each environment read once: exactly
    the entry for a raw token, an entry whose token has the digest for a record's
    :class:`SealedToken`."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.raw: dict[bytes, list[int]] = {}
        self.sealed: list[tuple[int, SealedToken]] = []
        for index, token in enumerate(tokens):
            if isinstance(token, SealedToken):
                self.sealed.append((index, token))
            else:
                self.raw.setdefault(_PREFIX + token.encode(), []).append(index)

    def carried(self, environ: bytes) -> set[int]:
        """The indices of the tokens ``environ`` carries."""
        if _PREFIX not in environ:  # most processes: no attempt's
            return set()
        found: set[int] = set()
        for entry in environ.split(b"\0"):
            if not entry.startswith(_PREFIX):
                continue
            found.update(self.raw.get(entry, ()))
            if self.sealed:
                value = entry[len(_PREFIX):].decode("utf-8", "surrogateescape")
                found.update(index for index, token in self.sealed if token.matches(value))
        return found


def _pids() -> Iterator[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    me = os.getpid()
    for name in names:
        if name.isdigit() and int(name) != me:
            yield int(name)


def scan(token: str, pgid: int | None = None) -> list[ProcInfo]:
    """Live processes that carry ``token`` (raw, or a record's :class:`SealedToken`) or belong
    to process group ``pgid``."""
    return _scan([(token, pgid)])[0][0]


class _Looking:
    """Rounds of scans, and how long a process found in the middle of exec keeps them going:
    the rounds :func:`kill_runs` and :func:`find` share (a stop signal once got one scan's
    20 ms, a kill its rounds' 0.25 s)."""

    def __init__(self, wait_seconds: float) -> None:
        self.started = time.monotonic()
        # a process in the middle of exec keeps the rounds going only this long: it is most
        # likely none of the runs' (any process on the machine), and one stuck there (an exit
        # hung in the kernel, on older kernels) must not hold every attempt's end for the wait
        self.until = self.started + min(UNSETTLED_SECONDS, wait_seconds)
        self.unsettled: list[int] = []  # still in the middle of exec at the last scan

    def scan(self, runs: Sequence[tuple[str, int | None]]) -> list[list[ProcInfo]]:
        """One round: :func:`_scan`, its pids still in exec kept in :attr:`unsettled`."""
        found, self.unsettled = _scan(runs)
        return found

    def again(self) -> bool:
        """True while a process of the last round was in the middle of exec and the rounds
        may still wait for it (its environment unread: it may carry any run's token)."""
        return bool(self.unsettled) and time.monotonic() < self.until

    def say_unsettled(self) -> None:
        """One warning line naming the pids still in exec when the rounds ended."""
        if self.unsettled:
            log.warning("pid(s) %s stayed in the middle of exec (environment not set up) for "
                        "%.2f s: not known whether they belong to the attempt(s) looked for; "
                        "not counted as theirs", ", ".join(str(pid) for pid in
                                                                self.unsettled[:10]),
                        time.monotonic() - self.started)


def find(token: str, pgid: int | None = None) -> list[ProcInfo]:
    """:func:`scan`, looking again in further rounds (up to :data:`UNSETTLED_SECONDS`) while a
    process is in the middle of exec: what carries ``token`` (or is of group ``pgid``). One
    still in exec then is said in one warning line, not counted (see the module)."""
    looking = _Looking(UNSETTLED_SECONDS)
    while True:
        found = looking.scan([(token, pgid)])[0]
        if not looking.again():
            looking.say_unsettled()
            return found
        time.sleep(_ROUND_SECONDS)


def _scan(runs: Sequence[tuple[str, int | None]]) -> tuple[list[list[ProcInfo]], list[int]]:
    """One pass over /proc for several runs ``(token, pgid)``: for each, the live processes that
    carry its token or belong to its group; and the pids still in the middle of exec after
    :data:`SETTLE_SECONDS` (their environment not set up yet: they may carry any token)."""
    tokens = _Tokens([token for token, _ in runs])
    groups: dict[int, list[int]] = {}
    for index, (_, pgid) in enumerate(runs):
        if pgid is not None:
            groups.setdefault(pgid, []).append(index)
    found: list[list[ProcInfo]] = [[] for _ in runs]

    def judge(pid: int, info: _Stat, environ: bytes) -> None:
        marked = tokens.carried(environ)
        for index in sorted(marked.union(groups.get(info.pgid, ()))):
            found[index].append(ProcInfo(pid, info.pgid, info.start, index in marked))

    pending: list[int] = []
    for pid in _pids():
        info = _stat(pid)
        if info is None or info.state in ("Z", "X") or info.kernel:
            continue  # a zombie has finished, a kernel thread is none of ours: nothing to kill
        environ = _environ(pid)
        if environ == b"":  # empty: an environment cleared, or one exec has not set up yet
            pending.append(pid)
        else:
            judge(pid, info, environ or b"")
    if not pending:
        return found, []
    # looked at again (the first time at once): the stat read after the environment tells
    # whether it was empty for good (its bounds set and equal) or exec had not set it up yet
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        unsettled: list[tuple[int, _Stat]] = []
        for pid in pending:
            environ = _environ(pid)
            info = _stat(pid)
            if info is None or info.state in ("Z", "X"):
                continue
            # in exec only while the kernel has not set the environment's bounds (end 0): once
            # they are set, what it reads is what it carries (a process can make its own
            # environment unreadable, mprotect: it once held every kill for its whole wait)
            if environ or environ is None or info.env is not None and info.env[1] != 0:
                judge(pid, info, environ or b"")
            else:
                unsettled.append((pid, info))
        if not unsettled or time.monotonic() >= deadline:
            break
        pending = [pid for pid, _ in unsettled]
        time.sleep(_SETTLE_STEP)
    for pid, info in unsettled:
        judge(pid, info, b"")  # a member of a group still counts as one
    # a kernel that shows no environment bounds cannot tell a cleared environment from one
    # not set up yet: judged by what it reads after the wait
    return found, [pid for pid, info in unsettled if info.env is not None]


def _group_is_ours(procs: list[ProcInfo], pgid: int) -> bool:
    """The group is this attempt's only if a member carries the token. Its leader's pid and start
    time prove nothing (process-group ids are reused once a group is empty, and anyone can read
    both from /proc and write them into a record)."""
    return any(p.pgid == pgid and p.marked for p in procs)


def _group_allowed(pgid: int | None) -> bool:
    """Never the daemon's own process group (its supervisor's, often), init's or a non-pid."""
    return type(pgid) is int and 1 < pgid <= MAX_PID and pgid != os.getpgrp()


def kill_run(token: str, pgid: int | None = None, *, group_known: bool = False,
             wait_seconds: float = KILL_WAIT_SECONDS) -> tuple[int, int]:
    """SIGKILL every process of one attempt and wait (bounded) until they are gone.

    Targets are the processes carrying ``token`` and, when the group is provably this attempt's
    (``group_known``: the caller still holds the unreaped leader; otherwise see _group_is_ours),
    every member of process group ``pgid``; never the daemon's own group. Repeats until none is
    left, so children forked while it runs are caught too. Returns (processes killed, processes
    still alive at the deadline)."""
    return kill_runs([(token, pgid)], group_known=group_known, wait_seconds=wait_seconds)[0]


def kill_runs(runs: Sequence[tuple[str, int | None]], *, group_known: bool = False,
              wait_seconds: float = KILL_WAIT_SECONDS) -> list[tuple[int, int]]:
    """:func:`kill_run` for several attempts ``(token, pgid)`` at once, each round one pass over
    /proc for all of them (the death watch's, when its daemon died with hundreds open: one
    scan each took about a second). Each attempt's targets are proven as in kill_run, its own
    token or its own group. Returns (killed, survivors) for each attempt, in order."""
    groups: list[int | None] = []
    for token, pgid in runs:
        if pgid is not None and not _group_allowed(pgid):
            log.warning("run %s: process group %s is not an attempt's (the daemon's own, or no "
                        "pid): only the token's carriers are killed", _label(token), pgid)
            pgid = None
        groups.append(pgid)
    ours = [group_known] * len(runs)
    killed: list[set[int]] = [set() for _ in runs]
    survivors = [0] * len(runs)
    left = list(range(len(runs)))  # the attempts that may still have processes
    looking = _Looking(wait_seconds)
    deadline = looking.started + wait_seconds
    rounds = 0
    while left:
        found = looking.scan([(runs[i][0], groups[i]) for i in left])
        targets: dict[int, list[ProcInfo]] = {}
        for i, procs in zip(left, found):
            pgid = groups[i]
            if pgid is not None and not ours[i]:
                ours[i] = _group_is_ours(procs, pgid)
            targets[i] = [p for p in procs if p.marked or (ours[i] and p.pgid == pgid)]
        # an attempt is done once a round finds none of its processes, and none in the middle
        # of exec (its environment unread, it may carry this token: looked at next round)
        # (one still in exec when the rounds end is said, not counted: any process on the
        # machine may be, an exiting one on older kernels too; counted as a survivor of every
        # attempt, it kept their records and refused their retries for good, R60)
        waiting = looking.again()
        left = [i for i in left if targets[i] or waiting]
        if not left:
            break
        # at least one round of SIGKILL, whatever the clock says: on a loaded machine one scan
        # of /proc once outlasted the whole wait, and nothing was killed at all
        if rounds and time.monotonic() >= deadline:
            for i in left:
                if targets[i]:
                    survivors[i] = len(targets[i])
                    log.warning("run %s: %d process(es) survived SIGKILL: %s",
                                _label(runs[i][0]), len(targets[i]),
                                ", ".join(str(p.pid) for p in targets[i][:10]))
            break
        for i in left:
            group = groups[i]
            if ours[i] and group is not None and targets[i]:  # (a group gone: its id may be
                _signal_group(group)                            # another's soon)
            for proc in targets[i]:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed[i].add(proc.pid)
                except (ProcessLookupError, PermissionError):
                    continue
        rounds += 1
        time.sleep(_ROUND_SECONDS)  # let the kernel finish them before looking again
    looking.say_unsettled()
    return [(len(pids), count) for pids, count in zip(killed, survivors)]


def _label(token: str) -> str:
    """How a log line names a run: never by its token (the log may be read by others), by the
    start of its digest (as in its record)."""
    if isinstance(token, SealedToken):
        return f"{token.handoff_id[:200]}#{token.attempt} ({str(token)[:12]})"
    return "of this attempt"


def _signal_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def workspace_root(workspace: Any) -> Path:
    """The root folder of ``workspace``: a Workspace, or its root as a path (a ``Path`` has a
    ``root`` attribute of its own, ``'/'``: never read it as a Workspace's)."""
    if isinstance(workspace, (str, os.PathLike)):
        return Path(workspace)
    return Path(workspace.root)


def kill_leftovers(workspace: Any, handoff_id: str, *, attempt: int | None = None,
                   wait_seconds: float = KILL_WAIT_SECONDS) -> int:
    """Kill what a previous attempt of ``handoff_id`` left running on this host; returns how many
    processes were killed.

    ``workspace`` is a Workspace or its root path. Uses the attempt's record: on another host it
    does nothing (those pids are not ours to judge); from an earlier boot it only removes the
    record; with ``attempt``, a record of a newer attempt is left alone. On this host it SIGKILLs
    the attempt's process group (when provably still its own) and every process carrying its
    token, waits until they are gone (at most ``wait_seconds``) and removes the record. A record
    of another pid namespace of this boot kills the token's carriers this process can see.

    Call it when an attempt is known to be over (a recovered claim) and before its handoff is
    handed back to pending/: a new attempt on this host kills its predecessor's leftovers too."""
    root = workspace_root(workspace)
    record = read_record(root, handoff_id)
    if record is None:
        return 0
    if attempt is not None and record.attempt > attempt:
        return 0
    if record.host != hostname():
        return 0
    if record.boot_id != boot_id():  # another boot: nothing of it runs any more
        remove_record(root, handoff_id, record.token)
        return 0
    # another pid namespace of this boot (a container sharing the workspace): its pids and group
    # mean nothing here, but its processes may be visible by their token (from the host, an
    # ancestor namespace): those are killed, never a group by number
    pgid = record.pgid if record.local() else None
    killed, survivors = kill_run(record.token, pgid, wait_seconds=wait_seconds)
    if killed:
        log.warning("handoff %s: killed %d process(es) left over by attempt %d (daemon pid %d)",
                    handoff_id, killed, record.attempt, record.daemon_pid)
    if not survivors:
        remove_record(root, handoff_id, record.token)
    return killed


def prune_records(workspace: Any) -> int:
    """Remove records on this host whose attempt has no process left (a daemon died and the
    handoff was not retried here, e.g. it failed for good); returns how many were removed. Kills
    nothing: a record whose processes live belongs to a running attempt or to kill_leftovers.
    One pass over /proc serves every record (one each once cost records x processes). Only a plain ``.meta/procs`` is pruned, through a descriptor (never through a
    symlink)."""
    with records_folder(workspace_root(workspace)) as folder:
        return 0 if folder is None else _prune_in(folder)


def _prune_in(folder: int) -> int:
    removed = 0
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except FileNotFoundError:
        return 0
    over: list[RunRecord] = []  # records of an earlier boot: nothing of theirs runs
    unproven: list[RunRecord] = []  # local records whose daemon is gone: over unless found
    for entry in entries:
        if entry.name.startswith("."):
            remove_stale_temp(folder, entry)
            continue
        if not entry.name.endswith(".json"):
            continue
        record = read_in(folder, entry.name[:-5])
        if record is None or record.host != hostname():
            continue
        if record.local():
            if not _alive(record.daemon_pid):
                unproven.append(record)
        elif record.boot_id != boot_id():
            over.append(record)
        # (another pid namespace on this boot: its own daemons judge it)
    if unproven:
        # one pass over /proc for every record (one each once cost records x processes)
        found, _ = _scan([(record.token, None) for record in unproven])
        over.extend(record for record, procs in zip(unproven, found) if not procs)
    for record in over:
        remove_in(folder, record.handoff_id, record.token)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    info = _stat(pid)
    return info is not None and info.state not in ("Z", "X")
