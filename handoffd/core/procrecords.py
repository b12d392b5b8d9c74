"""The record of a command-specialist attempt's processes, ``handoffs/.meta/procs/<id>.json``.

While an attempt runs, its record names it (host, boot id, pid namespace, process group, attempt,
and a digest of its run token bound to the handoff id and attempt), so that whoever finds the
attempt over (its daemon at the end, a sweep after a crash, the next attempt) can kill what it
left behind (see procs.py, which kills).

A record is a file in the workspace, and anyone who can write the workspace can plant one: a
planted record naming an unrelated process group (its leader's pid and start time are public in
/proc) once had the daemon SIGKILL that group. So a record only ever leads to processes that
prove they are the attempt's (procs.scan): the token itself is never written to the workspace,
only ``token_digest`` = HMAC-SHA-256 keyed by a fixed label over (handoff id, attempt, token):
whoever reads a record (mode 0644) cannot make another process match it, nor copy it under
another handoff id or attempt to reach a running attempt's processes. A record whose fields are
not exactly what :func:`write_record` writes (a missing or unknown field, a wrong type, a number
out of bounds, the id of another handoff) is ignored, with one warning line.
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

from . import recurring
from .documents import hostname
from .errors import SHORTAGE_ERRNOS
from .hashing import hmac_sha256_hex, same_text
from .logs import log  # (deferred: `handoff ls` reads boot_id, logging nothing)
from .ownfiles import folder_refusal, open_beneath, open_regular, read_regular


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
_REFUSED = "no process record is read, written or removed there"
# a passing shortage opening the folder (EMFILE, ENFILE, ENOMEM) is one WARNING while it lasts,
# said again at most once a minute, and one line when the folder opens again (core.recurring):
# it was an ERROR, said again each time an open worked in between, and its end unsaid. The
# workers (writing, removing), the runner and the sweep (pruning) share this book and clock
shortages = recurring.Recurring(quiet=recurring.QUIET_SECONDS)
clock: Callable[[], float] = time.monotonic


@contextmanager
def records_folder(root: Path, *, create: bool = False) -> Iterator[int | None]:
    """A descriptor of ``handoffs/.meta/procs`` itself (made first when ``create``); None when it
    is missing or no plain folder (a symlink...): then nothing is read, written or removed
    through it, and one error line says so (once, not at every attempt or sweep). None too
    while it cannot be opened for a passing shortage: one WARNING naming the limit, held back
    while it lasts (see :data:`shortages`)."""
    folder = record_dir(root)
    with recurring.sweeping(shortages, lambda: clock()):
        try:
            # each part opened without following a link: a .meta swapped for one took the
            # records (made with mkdir's parents) outside the workspace
            handoffs = Path(root) / "handoffs"
            if create:  # (the base as it is: a symlinked handoffs/ is the user's choice)
                handoffs.mkdir(parents=True, exist_ok=True)
            fd: int | None = open_beneath(handoffs, (".meta", "procs"), make=create)
        except FileNotFoundError:
            if create:
                raise
            fd = None
        except OSError as exc:
            _refused(folder, exc)
            fd = None
        else:
            _refusals_said.discard(str(folder))  # a folder again: a new refusal is said again
            recurring.ok(f"opening {folder}")  # (a shortage said before: its end is said)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _refused(folder: Path, exc: OSError) -> None:
    """Say why ``folder`` cannot be used: a shortage as the recurring problem it is, a real
    refusal (a symlink, no folder, EACCES) as one error line until it is a folder again."""
    if exc.errno in SHORTAGE_ERRNOS:
        recurring.error(f"opening {folder}", exc, "%s", folder_refusal(folder, exc, _REFUSED))
    elif str(folder) not in _refusals_said:
        _refusals_said.add(str(folder))
        log.error("%s", folder_refusal(folder, exc, _REFUSED))


def write_record(root: Path, record: RunRecord) -> None:
    """Write (or replace) the record atomically. Not fsynced: it only means something until the
    next reboot, and a lost record costs at most a leftover that the parent-death signal or the
    token scan of the next attempt still catches. Nothing is written when ``.meta/procs`` is
    no plain folder of the workspace (never through a symlink; said once, see records_folder):
    the attempt runs, recorded as a lost record would be."""
    name = f"{record.handoff_id}.json"
    with records_folder(root, create=True) as folder:
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


_READING = "reading a process record"


def read_in(folder: int, handoff_id: str) -> RunRecord | None:
    """The record of ``handoff_id`` in ``folder`` (a descriptor of ``.meta/procs``); None when
    there is none, it is no record handoffd wrote (one warning line), or a passing shortage
    kept it from being read (said as one: :func:`_read_said`)."""
    try:
        return _read_said(folder, handoff_id)
    except OSError:  # a shortage, said
        return None


def _read_said(folder: int, handoff_id: str) -> RunRecord | None:
    """:func:`read_in`, but a passing shortage reading the record is raised (after one WARNING
    held back while it lasts, see :data:`shortages`): it once read as a record "handoffd did
    not write", and the removal of a newer attempt's record went ahead unchecked."""
    with recurring.sweeping(shortages, lambda: clock()):
        try:
            record = _read(folder, handoff_id)
        except OSError as exc:
            recurring.error(_READING, exc, "cannot read handoffs/.meta/procs/%s.json for now: "
                                           "%s; nothing is killed or removed by it for now",
                            handoff_id[:200], exc)
            raise
        recurring.ok(_READING)  # (a shortage said before: its end is said)
        return record


def _read(folder: int, handoff_id: str) -> RunRecord | None:
    """:func:`read_in`; OSError for a passing shortage."""
    try:
        data = json.loads(read_regular(f"{handoff_id}.json", 1 << 16, dir_fd=folder))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in SHORTAGE_ERRNOS:  # no descriptor, no memory: not the record's fault
            raise
        problem: str | None = f"unreadable: {exc.strerror or exc}"
    except ValueError as exc:  # (UnicodeDecodeError is a ValueError)
        problem = f"unreadable: {exc}"
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
    with records_folder(root) as folder:
        return None if folder is None else read_in(folder, handoff_id)


def _same_token(current: RunRecord, token: str) -> bool:
    """True if ``token`` (raw, or a record's SealedToken) is the token of record ``current``."""
    sealed = current.token
    assert isinstance(sealed, SealedToken)  # (read back by read_in)
    if isinstance(token, SealedToken):
        return (str(token) == str(sealed) and token.handoff_id == sealed.handoff_id
                and token.attempt == sealed.attempt)
    return sealed.matches(token)


def remove_in(folder: int, handoff_id: str, token: str | None) -> None:
    """Remove ``handoff_id``'s record from ``folder`` (:func:`remove_record`)."""
    if token is not None:
        try:
            current = _read_said(folder, handoff_id)
        except OSError:  # a shortage (said): whose record it is cannot be told, so it stays
            return
        if current is not None and not _same_token(current, token):
            return
    try:
        os.unlink(f"{handoff_id}.json", dir_fd=folder)
    except FileNotFoundError:
        pass


def remove_record(root: Path, handoff_id: str, token: str | None = None) -> None:
    """Remove the record; with ``token``, only if it is still that attempt's (a newer attempt
    may have replaced it)."""
    with records_folder(root) as folder:
        if folder is not None:
            remove_in(folder, handoff_id, token)


def remove_stale_temp(folder: int, entry: os.DirEntry[str]) -> None:
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
