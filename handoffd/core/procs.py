"""The processes of command-specialist attempts: tag them, record them, and kill what is left.

A command specialist may leave processes behind: a background child that keeps running after the
handler exits, a grandchild that called ``setsid`` and so left the process group, or the whole tree
when its daemon is killed with ``kill -9``. Left alone, those keep working on a handoff that has
meanwhile been retried, so two runs of one handoff overlap. To prevent that, every attempt

* runs in its own process group and carries a unique run token in its environment
  (``HANDOFFD_RUN_TOKEN=<token>``), which every descendant inherits, even one that calls setsid;
* gets ``PR_SET_PDEATHSIG(SIGKILL)``, so the direct child dies with its daemon;
* is recorded in ``handoffs/.meta/procs/<handoff_id>.json`` (host, boot id, pid namespace, process
  group, attempt, and a digest of the token bound to the handoff id and attempt) while it runs.

A record is a file in the workspace, and anyone who can write the workspace can plant one: a
planted record naming an unrelated process group (its leader's pid and start time are public in
/proc) once had the daemon SIGKILL that group. So a record only ever leads to processes that
prove they are the attempt's: a process is the attempt's when its environment carries a token
whose digest is the record's, and a process group only when one of its members is (never the
daemon's own group). The token itself is never written to the workspace, only
``token_digest`` = HMAC-SHA-256 keyed by a fixed label over (handoff id, attempt, token): whoever
reads a record (mode 0644) cannot make another process match it, nor copy it under another
handoff id or attempt to reach a running attempt's processes. A record whose fields are not
exactly what :func:`write_record` writes (a missing or unknown field, a wrong type, a number
out of bounds, the id of another handoff) is ignored, with one warning line.

:func:`kill_run` kills an attempt's leftovers (its process group and every process whose
``/proc/<pid>/environ`` carries the token) and waits until they are gone. The runner calls it when
each attempt ends and, through :func:`kill_leftovers`, before an attempt starts, so a retry never
starts on a host where the previous attempt's processes still live. Whoever recovers an abandoned
claim should call :func:`kill_leftovers` too, before handing the handoff back.

Limits: only processes on this host (same boot, same pid namespace) can be found; a descendant that
clears its environment *and* leaves the process group cannot be recognised, nor can, after its
daemon died, a group none of whose members still carries the token (the leader's pid and start
time alone no longer vouch for it: anyone can read them).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

from .documents import hostname
from .hashing import hmac_sha256_hex, same_text
from .ownfiles import open_folder, open_regular, read_regular

log = logging.getLogger("handoffd")

TOKEN_ENV = "HANDOFFD_RUN_TOKEN"
KILL_WAIT_SECONDS = 5.0  # how long kill_run waits for the killed processes to be gone
_PR_SET_PDEATHSIG = 1
_DIGEST_KEY = b"handoffd run token"  # not a secret: the token is (see _digest)
MAX_PID = 1 << 22  # the kernel's largest pid_max (PID_MAX_LIMIT on 64-bit)


class SealedToken(str):
    """A run token as read back from a record: its digest (the record never holds the token),
    with the handoff id and attempt it is bound to. :func:`scan` matches a process whose
    environment carries a token with this digest; it is never written to a process's environment."""

    handoff_id: str
    attempt: int

    def __new__(cls, digest: str, handoff_id: str, attempt: int) -> "SealedToken":
        sealed = super().__new__(cls, digest)
        sealed.handoff_id = handoff_id
        sealed.attempt = attempt
        return sealed

    def __reduce__(self) -> tuple[Any, ...]:  # (copy, deepcopy, pickle: __new__ takes three)
        return (SealedToken, (str(self), self.handoff_id, self.attempt))

    def matches(self, token: str) -> bool:
        """True if ``token`` (a raw run token) is the one this digest was made of."""
        return same_text(str(self), _digest(self.handoff_id, self.attempt, token))


def _digest(handoff_id: str, attempt: int, token: str) -> str:
    """What a record holds for ``token``: bound to the handoff and attempt, so a record copied
    under another id (or attempt) matches no process. Keyed by a fixed label: the secret is the
    token, which only the attempt's processes (and the daemon that started them) know."""
    message = f"{handoff_id}\0{attempt}\0{token}".encode("utf-8", "surrogatepass")
    return hmac_sha256_hex(_DIGEST_KEY, message)


@dataclass
class RunRecord:
    """One attempt's processes, as written to ``handoffs/.meta/procs/<handoff_id>.json``."""

    handoff_id: str
    token: str
    attempt: int
    host: str
    boot_id: str
    pid_namespace: str
    daemon_pid: int
    pgid: int | None = None  # the child's pid (it leads its own group); None until it started
    leader_start: int | None = None  # the child's start time (clock ticks after boot)
    started_at: float = 0.0

    @classmethod
    def new(cls, handoff_id: str, token: str, attempt: int) -> "RunRecord":
        """A record for an attempt about to start on this host."""
        return cls(handoff_id=handoff_id, token=token, attempt=attempt, host=hostname(),
                   boot_id=boot_id(), pid_namespace=pid_namespace(), daemon_pid=os.getpid(),
                   started_at=time.time())

    def local(self) -> bool:
        """True when the record's pids mean the same processes here (same host, boot, namespace)."""
        return (self.host == hostname() and self.boot_id == boot_id()
                and self.pid_namespace == pid_namespace())


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about one live (non-zombie) process."""

    pid: int
    pgid: int
    start: int
    marked: bool  # carries the run token in its environment


# ---------------------------------------------------------------- identity of this machine

def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): pids from another boot mean nothing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``): pids from another one mean nothing."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


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


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or None if it is gone."""
    info = _stat(pid)
    return info[2] if info else None


# ---------------------------------------------------------------- records

def record_dir(root: Path) -> Path:
    """``handoffs/.meta/procs`` of the workspace at ``root``."""
    return Path(root) / "handoffs" / ".meta" / "procs"


def record_path(root: Path, handoff_id: str) -> Path:
    """Where the record of ``handoff_id``'s running attempt lives."""
    return record_dir(root) / f"{handoff_id}.json"


# ``.meta/procs`` is read, written and pruned only as a folder of the workspace itself, through
# a descriptor opened without following a link: a symlink planted there once had the records
# written, and every dot-file older than a minute (a home folder's .bashrc) removed, wherever it
# pointed
_refusals_said: set[str] = set()  # folders refused already (one error line each)
_TEMP_NAME = re.compile(r"\..+\.tmp")  # a record's temp file (see write_record)


@contextmanager
def _records_folder(root: Path, *, create: bool = False) -> Iterator[int | None]:
    """A descriptor of ``handoffs/.meta/procs`` itself (made first when ``create``); None when it
    is missing or no plain folder (a symlink...): then nothing is read, written or removed
    through it, and one error line says so (once, not at every attempt or sweep)."""
    folder = record_dir(root)
    try:
        fd = open_folder(folder, make=create)
    except FileNotFoundError:
        if create:
            raise
        fd = None
    except OSError as exc:
        if str(folder) not in _refusals_said:
            _refusals_said.add(str(folder))
            log.error("%s is not a folder of the workspace (a symlink?): no process record is "
                      "read, written or removed there until it is one (%s)", folder,
                      exc.strerror or exc)
        fd = None
    else:
        _refusals_said.discard(str(folder))  # a folder again: a new refusal is said again
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def write_record(root: Path, record: RunRecord) -> None:
    """Write (or replace) the record atomically. Not fsynced: it only means something until the
    next reboot, and a lost record costs at most a leftover that the parent-death signal or the
    token scan of the next attempt still catches. Nothing is written when ``.meta/procs`` is
    no plain folder of the workspace (never through a symlink; said once, see _records_folder):
    the attempt runs, recorded as a lost record would be."""
    name = f"{record.handoff_id}.json"
    with _records_folder(root, create=True) as folder:
        if folder is None:
            return
        tmp = f".{record.handoff_id}.{os.urandom(8).hex()}.tmp"  # (the token stays unwritten)
        fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=folder)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(_on_disk(record)))
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise


def _on_disk(record: RunRecord) -> dict[str, Any]:
    """The record as written: ``token_digest`` in place of the token."""
    data = {f.name: getattr(record, f.name) for f in fields(RunRecord)}
    token = data.pop("token")
    data["token_digest"] = (str(record.token) if isinstance(record.token, SealedToken)
                            else _digest(record.handoff_id, record.attempt, token))
    return data


_malformed_said: set[str] = set()  # handoff ids whose record was refused already (one line each)
_STR_BOUND = 256
_INT_BOUND = 1 << 63


def _int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high  # (not a bool, a float or a string)


def _problem(data: Any, handoff_id: str) -> str | None:
    """Why ``data`` is not a record :func:`write_record` wrote for ``handoff_id``; None if it is."""
    if not isinstance(data, dict):
        return "not a JSON object"
    expected = [f.name for f in fields(RunRecord) if f.name != "token"] + ["token_digest"]
    missing = [k for k in expected if k not in data]
    unknown = [str(k)[:40] for k in data if k not in expected]
    if missing or unknown:
        return ", ".join([f"no {k}" for k in missing] + [f"unknown field {k}" for k in unknown])
    if data["handoff_id"] != handoff_id:
        return "it names another handoff"
    digest = data["token_digest"]
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        return "token_digest is not a SHA-256 digest"
    for name in ("host", "boot_id", "pid_namespace"):
        if not (isinstance(data[name], str) and len(data[name]) <= _STR_BOUND):
            return f"{name} is not a string of at most {_STR_BOUND} characters"
    checks = (("attempt", 0, _INT_BOUND), ("daemon_pid", 1, MAX_PID))
    for name, low, high in checks:
        if not _int(data[name], low, high):
            return f"{name} is not an integer from {low} to {high}"
    if data["pgid"] is not None and not _int(data["pgid"], 2, MAX_PID):
        return f"pgid is neither null nor an integer from 2 to {MAX_PID}"
    if data["leader_start"] is not None and not _int(data["leader_start"], 0, _INT_BOUND):
        return "leader_start is neither null nor a non-negative integer"
    started = data["started_at"]
    if type(started) not in (int, float) or not 0 <= started < 1e12:  # (NaN fails too)
        return "started_at is not a time"
    return None


def _read_in(folder: int, handoff_id: str) -> RunRecord | None:
    try:
        data = json.loads(read_regular(f"{handoff_id}.json", 1 << 16, dir_fd=folder))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        problem: str | None = f"unreadable: {getattr(exc, 'strerror', None) or exc}"
    else:
        problem = _problem(data, handoff_id)
    if problem is not None:
        if handoff_id not in _malformed_said:
            if len(_malformed_said) >= 1024:
                _malformed_said.clear()
            _malformed_said.add(handoff_id)
            log.warning("handoffs/.meta/procs/%s.json is not a process record handoffd wrote "
                        "(%s): ignored, nothing is killed by it", handoff_id[:200], problem[:200])
        return None
    _malformed_said.discard(handoff_id)
    digest = data.pop("token_digest")
    return RunRecord(token=SealedToken(digest, handoff_id, data["attempt"]), **data)


def read_record(root: Path, handoff_id: str) -> RunRecord | None:
    """The record of ``handoff_id``, or None if there is none (or it is unreadable, or
    ``.meta/procs`` is no plain folder)."""
    with _records_folder(root) as folder:
        return None if folder is None else _read_in(folder, handoff_id)


def _same_token(current: RunRecord, token: str) -> bool:
    """True if ``token`` (raw, or a record's SealedToken) is the token of record ``current``."""
    sealed = current.token
    assert isinstance(sealed, SealedToken)  # (read back by _read_in)
    if isinstance(token, SealedToken):
        return (str(token) == str(sealed) and token.handoff_id == sealed.handoff_id
                and token.attempt == sealed.attempt)
    return sealed.matches(token)


def _remove_in(folder: int, handoff_id: str, token: str | None) -> None:
    if token is not None:
        current = _read_in(folder, handoff_id)
        if current is not None and not _same_token(current, token):
            return
    try:
        os.unlink(f"{handoff_id}.json", dir_fd=folder)
    except FileNotFoundError:
        pass


def remove_record(root: Path, handoff_id: str, token: str | None = None) -> None:
    """Remove the record; with ``token``, only if it is still that attempt's (a newer attempt
    may have replaced it)."""
    with _records_folder(root) as folder:
        if folder is not None:
            _remove_in(folder, handoff_id, token)


# ---------------------------------------------------------------- finding and killing

def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time) of ``pid`` from /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields start after the last ')'
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


_PREFIX = f"{TOKEN_ENV}=".encode()


def _carries(pid: int, token: str) -> bool:
    """True if ``pid``'s environment holds the run token ``token``: exactly that entry for a raw
    token, an entry whose token has the digest for a record's :class:`SealedToken`."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except OSError:  # gone, or another user's process (never ours to kill)
        return False
    if not isinstance(token, SealedToken):
        return _PREFIX + token.encode() in environ.split(b"\0")
    if _PREFIX not in environ:
        return False
    return any(entry.startswith(_PREFIX)
               and token.matches(entry[len(_PREFIX):].decode("utf-8", "surrogateescape"))
               for entry in environ.split(b"\0"))


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
    found = []
    for pid in _pids():
        info = _stat(pid)
        if info is None or info[0] in ("Z", "X"):  # a zombie has finished: nothing left to kill
            continue
        marked = _carries(pid, token)
        if marked or (pgid is not None and info[1] == pgid):
            found.append(ProcInfo(pid, info[1], info[2], marked))
    return found


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
    killed: set[int] = set()
    if pgid is not None and not _group_allowed(pgid):
        log.warning("run %s: process group %s is not an attempt's (the daemon's own, or no "
                    "pid): only the token's carriers are killed", _label(token), pgid)
        pgid = None
    ours = group_known
    deadline = time.monotonic() + wait_seconds
    while True:
        procs = scan(token, pgid)
        if pgid is not None and not ours:
            ours = _group_is_ours(procs, pgid)
        targets = [p for p in procs if p.marked or (ours and p.pgid == pgid)]
        if not targets:
            return len(killed), 0
        if time.monotonic() >= deadline:
            log.warning("run %s: %d process(es) survived SIGKILL: %s", _label(token),
                        len(targets), ", ".join(str(p.pid) for p in targets[:10]))
            return len(killed), len(targets)
        if ours and pgid is not None:
            _signal_group(pgid)
        for proc in targets:
            try:
                os.kill(proc.pid, signal.SIGKILL)
                killed.add(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
        time.sleep(0.01)  # let the kernel finish them before looking again


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
    token, waits until they are gone (at most ``wait_seconds``) and removes the record.

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
    if not record.local():  # another boot (or pid namespace) on this host: nothing to kill here
        if record.boot_id != boot_id():
            remove_record(root, handoff_id, record.token)
        return 0
    killed, survivors = kill_run(record.token, record.pgid, wait_seconds=wait_seconds)
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
    Only a plain ``.meta/procs`` is pruned, through a descriptor (never through a symlink)."""
    with _records_folder(workspace_root(workspace)) as folder:
        return 0 if folder is None else _prune_in(folder)


def _prune_in(folder: int) -> int:
    removed = 0
    try:
        with os.scandir(folder) as listing:
            entries = list(listing)
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith("."):
            _remove_stale_temp(folder, entry)
            continue
        if not entry.name.endswith(".json"):
            continue
        record = _read_in(folder, entry.name[:-5])
        if record is None or record.host != hostname():
            continue
        if record.local() and (_alive(record.daemon_pid) or scan(record.token, None)):
            continue
        if not record.local() and record.boot_id == boot_id():
            continue  # another pid namespace on this boot: its own daemons judge it
        _remove_in(folder, record.handoff_id, record.token)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    info = _stat(pid)
    return info is not None and info[0] not in ("Z", "X")


def _remove_stale_temp(folder: int, entry: os.DirEntry[str]) -> None:
    """A record's temp file (a regular ``.<id>.<token>.tmp``) of a writer that died mid-write
    (older than a minute); nothing else in the folder is removed."""
    if not _TEMP_NAME.fullmatch(entry.name):
        return
    try:
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > 60:
            os.unlink(entry.name, dir_fd=folder)
    except OSError:
        pass
