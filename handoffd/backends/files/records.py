"""Shared records on disk: one JSON file per kind under ``handoffs/.meta/`` (``paused.json``,
``rates.json``...), replaced atomically (a temp file and a rename) under an exclusive ``flock``
of ``.<kind>.lock``, so updates of every process of the workspace are serialised and readers
never see half a file.

Anyone who can write the workspace can write these files, so each one is hostile input. Reads
are lock-free and parse a file once per identity (inode, mtime, size, ctime); every read of that
identity gets a shallow copy of the one parse, never a deep copy (the caller must not change
the values: see :class:`~handoffd.core.storage.Records`). A file over its kind's bound
(:data:`LIMITS`), not UTF-8 JSON, not an object, nesting too deep, not a regular file or not
readable by its mode reads as empty, said in one log line per identity, and is not parsed again
until it changes. An update never writes over such a file: it moves it to
``handoffs/.quarantine/`` first (see :meth:`FileRecords.update`).

The lock is hostile input too: it is waited on for at most :data:`LOCK_WAIT_SECONDS` (the
scheduler's loop updates rate buckets: a process holding the lock for good must cost one refused
update, never a frozen daemon), opened without following a symlink, and an entry under its name
that is no regular file is moved to the quarantine as a bad records file is. Every failure of an
update to lock or write is an :class:`UnusableRecords`, so callers catch one error type."""
from __future__ import annotations

import copy
import errno
import json
import os
import re
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ...core.documents import MAX_DEPTH, nesting_depth
from ...core.errors import ErrorCode, HandoffdError
from ...core.logs import log
from ...core.ownfiles import open_regular, read_at_most
from . import logfiles
from .quarantine import move_to_quarantine, planted, publish_beside, set_aside_planted

KIB = 1024
# Bounds on a kind's whole file; a file over its bound is not even opened. The small kinds hold
# one short entry per specialist or agent (a pause: when, by whom, why; a rate bucket: two numbers
# and the rate; a crash mark: one number), so a real file is a few KiB: 256 KiB is room for a
# thousand specialists with long pause reasons, and parses in a millisecond or two, so a forged
# file costs a reader next to nothing and an update (which parses under the lock, every time)
# little more. Reservations carry every running contract handoff's files_owned globs (at most 256
# of 512 characters, usually a few short paths) and the released ones a running one may need
# (at most half the bound: contracts.reservations.RELEASED_BUDGET): 4 MiB holds thousands. A kind not listed here (a new feature's) gets 1 MiB.
LIMITS = {"paused": 256 * KIB, "rates": 256 * KIB, "suspects": 256 * KIB,
          "reservations": 4096 * KIB}
MAX_RECORDS_BYTES = 1024 * KIB

KIND = re.compile(r"[a-z][a-z0-9_-]{0,40}")  # fullmatch ("$" matched before a final newline)
# the temp file an update writes beside the kind's file (see quarantine.publish_beside); one a process that died
# mid-update left is removed by the sweep once it is old (orphans.remove_orphans)
TEMP_NAME = re.compile(r"\.[a-z][a-z0-9_-]{0,40}\.[0-9a-f]{16}\.tmp")

# How long an update waits for its kind's lock. A real update holds it for a few milliseconds
# (a 4 MiB reservations file: a parse and a dump, a fraction of a second), so a lock held for
# longer is held by a process that is stopped or not handoffd's: waiting on it with no bound froze
# the scheduler's loop (rate buckets) and left a daemon deaf to SIGTERM. The wait polls
# (:func:`.logfiles.flock_within`, shared with the event log's and the seen-ids record's locks).
LOCK_WAIT_SECONDS = logfiles.LOCK_WAIT_SECONDS
_monotonic, _sleep = time.monotonic, time.sleep  # (tests replace them: no real waiting)

Stamp = tuple[int, int, int, int]  # a file's identity: inode, mtime, size, ctime (ns)
NOT_REGULAR = (errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP)


@dataclass(frozen=True)
class Problem:
    """Why a records file cannot be used: the recorded code, and what is wrong with it."""

    code: ErrorCode
    what: str  # said of the file: "is not valid JSON: ..."
    passing: bool = False  # the file may be fine (EIO, EMFILE): read it again next time


class UnusableRecords(HandoffdError):
    """An update refused, with nothing written: the kind's file cannot be read now (so what it
    holds is unknown), or the result would be a file no reader could use."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def limit_of(kind: str) -> int:
    """The largest file, in bytes, that ``kind``'s records may take."""
    return LIMITS.get(kind, MAX_RECORDS_BYTES)


class FileRecords:
    """:class:`~handoffd.core.storage.Records` in ``folder`` (the workspace's ``.meta``); a bad
    file is moved to ``quarantine`` (default: the workspace's ``.quarantine`` beside it)."""

    def __init__(self, folder: Path, *, quarantine: Path | None = None) -> None:
        self.folder = folder
        self.quarantine = quarantine if quarantine is not None else folder.parent / ".quarantine"
        self._cache: dict[str, tuple[Stamp, dict[str, Any]]] = {}
        self._said: dict[str, Stamp] = {}  # kind -> the identity of the bad file last logged
        self._parsing = threading.Lock()  # one parse per identity, however many threads ask

    def path(self, kind: str) -> Path:
        """The file of ``kind``."""
        if not KIND.fullmatch(kind):
            raise ValueError(f"record kind {kind!r}")
        return self.folder / f"{kind}.json"

    def read(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind``: a new dict whose values are shared with the cached parse
        and every other read, so the caller must not change them. A file that cannot be used
        reads as empty (never a stuck queue), said once per identity of the file."""
        path = self.path(kind)
        try:
            info = os.lstat(path)
        except OSError:  # absent (or its folder is unusable: nothing to read either way)
            return {}
        cached = self._cache.get(kind)
        if cached is None or cached[0] != _stamp(info):
            with self._parsing:
                cached = self._cache.get(kind)  # another thread may have parsed it meanwhile
                if cached is None or cached[0] != _stamp(info):
                    cached = self._parse(kind, path, info)
        return dict(cached[1]) if cached is not None else {}

    def _parse(self, kind: str, path: Path, info: os.stat_result
               ) -> tuple[Stamp, dict[str, Any]] | None:
        """Parse ``path`` and cache the result by the identity read (None: it could not be
        read now, e.g. EIO or EMFILE, so the next read tries again)."""
        try:
            stamp, records, problem = _load(path, info, limit_of(kind))
        except FileNotFoundError:  # gone since the stat (an update moved it aside): none
            return None
        except OSError as exc:
            self._say(kind, _stamp(info), path, Problem(
                ErrorCode.UNREADABLE_FILE, f"cannot be read now ({exc.strerror or exc})",
                passing=True))
            return None
        if problem is not None:
            self._say(kind, stamp, path, problem)
        self._cache[kind] = (stamp, records)
        return stamp, records

    def _say(self, kind: str, stamp: Stamp, path: Path, problem: Problem) -> None:
        """Log why ``path`` reads as empty, once per identity of the file."""
        if self._said.get(kind) == stamp:
            return
        self._said[kind] = stamp
        if problem.passing:
            log.warning("%s %s: its %s records read as none meanwhile [%s]", _shown(path),
                        problem.what, kind, problem.code)
            return
        log.warning("%s %s: its %s records read as none until it changes (the next update of "
                    "them moves it to %s/) [%s]", _shown(path), problem.what, kind,
                    _shown_folder(self.quarantine), problem.code)

    def update(self, kind: str, key: str, change: Callable[[Any], Any]) -> Any:
        """Replace one record under the kind's lock.

        A file that cannot be used (see the module) is moved to the quarantine with its reason
        before the new file replaces it, rather than the update refused: every reader already
        reads it as empty, so refusing would only stop pauses, rate buckets, crash marks and
        reservations from working until someone removed it by hand, while moving it keeps its
        bytes for whoever wants to look, and no record anyone could read is lost. A file that
        cannot be read for a passing reason (EIO, EMFILE) may hold good records: that update is
        refused (:class:`UnusableRecords`), nothing written. So is one whose result no reader
        could use (over the kind's bound, nesting too deep), one whose lock is held by another
        process for over :data:`LOCK_WAIT_SECONDS` or cannot be opened, and one whose new file
        cannot be written: every such failure is an :class:`UnusableRecords` (callers such as
        the contracts feature's reservations catch HandoffdError, not OSError)."""
        path = self.path(kind)
        with self._locked(kind):
            records, problem = self._current(kind, path)
            old = records.get(key)
            new = change(copy.deepcopy(old))
            if new == old:
                return new  # nothing changed: no write (a sweep asks every few seconds)
            if new is None:
                records.pop(key, None)
            else:
                records[key] = new
            data = _encode(kind, key, records)
            if problem is not None:
                self._move_aside(kind, path, problem)
            try:
                publish_beside(path, data)  # readers see the old file or the new one, never half
            except OSError as exc:  # a full disk, a read-only folder: one error type for callers
                raise UnusableRecords(f"{_shown(path)} cannot be written ({exc.strerror or exc});"
                                      f" its {kind} records are left as they are",
                                      code=ErrorCode.PROCESSING_ERROR) from None
            return new

    @contextmanager
    def _locked(self, kind: str) -> Iterator[None]:
        """Hold the kind's lock, ``.<kind>.lock``, for the block (its own descriptor, so threads
        exclude each other as processes do; the file stays: removing a lock file while another
        process waits on it would let two holders in). UnusableRecords when it cannot be had."""
        lock = self.folder / f".{kind}.lock"
        fd = self._open_lock(kind, lock)
        try:
            _flock_within(fd, _shown(lock), f"its {kind} records are left as they are")
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _open_lock(self, kind: str, lock: Path) -> int:
        """A descriptor on the lock file: a regular file, never through a symlink, never
        blocking on a FIFO (:func:`.logfiles.open_creating`). A folder, symlink or FIFO planted under
        its name would refuse every update of the kind for good: it is moved to the quarantine
        and the open tried once more."""
        try:
            return logfiles.open_creating(lock, os.O_RDWR)
        except OSError as exc:
            failure = exc
        if self._set_aside_lock(kind, lock):
            try:
                return logfiles.open_creating(lock, os.O_RDWR)
            except OSError as exc:
                failure = exc
        raise UnusableRecords(f"{_shown(lock)} cannot be opened ({failure.strerror or failure}); "
                              f"its {kind} records are left as they are",
                              code=ErrorCode.UNREADABLE_FILE) from None

    def _set_aside_lock(self, kind: str, lock: Path) -> bool:
        """Move the entry at ``lock`` to the quarantine if it is no regular file: True when the
        lock should be opened again (moved, here or by another process), False when it is a
        regular file or cannot be looked at (its open failed for another reason: EACCES...)."""
        if not planted(lock):
            return not os.path.lexists(lock)  # gone meanwhile: open it again
        try:  # (under the folder's own flock, looked at again: see set_aside_planted)
            set_aside_planted(lock, self.quarantine)
        except FileNotFoundError:  # gone: another process moved it
            return True
        except OSError as exc:  # (the folder's own lock, or the move)
            raise UnusableRecords(f"{_shown(lock)} is not a regular file, and cannot be moved "
                                  f"({exc.strerror or exc}); its {kind} records cannot be "
                                  "updated", code=ErrorCode.NOT_A_REGULAR_FILE) from None
        return True

    def _current(self, kind: str, path: Path) -> tuple[dict[str, Any], Problem | None]:
        """The records in ``path`` now (a fresh parse, never the readers' cache: an inode can
        be reused within one tick of the file system's clock), and its problem if any."""
        try:
            info = os.lstat(path)
            _, records, problem = _load(path, info, limit_of(kind))
        except FileNotFoundError:
            return {}, None
        except OSError as exc:
            raise UnusableRecords(f"{_shown(path)} cannot be read ({exc.strerror or exc}); its "
                                  f"{kind} records are left as they are",
                                  code=ErrorCode.UNREADABLE_FILE) from None
        return records, problem

    def _move_aside(self, kind: str, path: Path, problem: Problem) -> None:
        """Move a file that cannot be used out of the way, or refuse the update."""
        self._set_aside(kind, path, problem, then=f"before an update of its {kind} records "
                        "(nothing in it could be read, so no record is lost)",
                        refused="are left as they are")

    def _set_aside(self, kind: str, path: Path, problem: Problem, *, then: str,
                   refused: str) -> None:
        """``path`` moved into the quarantine as the store sets files aside
        (:func:`.quarantine.move_to_quarantine`, so ``handoff ls`` lists it), said in one line;
        UnusableRecords when it cannot be moved (FileNotFoundError: gone meanwhile)."""
        def publish(dst: Path, data: bytes) -> None:
            try:
                publish_beside(dst, data)
            except OSError as exc:  # moved already: the update goes on, its reason is logged
                log.warning("%s: cannot record why it was moved (%s)", _shown(dst),
                            exc.strerror or exc)

        try:
            target = move_to_quarantine(self.quarantine, path, str(problem.code),
                                        f"{path.name} {problem.what}", publish)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise UnusableRecords(
                f"{_shown(path)} {problem.what}, and cannot be moved to "
                f"{_shown_folder(self.quarantine)}/ ({exc.strerror or exc}); its {kind} records "
                f"{refused}", code=problem.code) from None
        log.warning("%s %s: moved to %s %s [%s]", _shown(path), problem.what, _shown(target),
                    then, problem.code)


def _flock_within(fd: int, shown: str, left: str) -> None:
    """Take an exclusive flock on ``fd`` within :data:`LOCK_WAIT_SECONDS`, or raise
    UnusableRecords naming ``shown`` (and saying ``left``: what is left undone)."""
    try:
        taken = logfiles.flock_within(fd, LOCK_WAIT_SECONDS, clock=_monotonic, sleep=_sleep)
    except OSError as exc:  # ENOLCK...
        raise UnusableRecords(f"{shown} cannot be locked ({exc.strerror or exc}); {left}",
                              code=ErrorCode.UNREADABLE_FILE) from None
    if not taken:
        raise UnusableRecords(
            f"{shown} has been held by another process for over {LOCK_WAIT_SECONDS:g} s (a "
            f"stopped or hung one?); {left}", code=ErrorCode.TIMEOUT)


def _stamp(info: os.stat_result) -> Stamp:
    # every update is a new file (a rename), so its inode tells two writes apart even within
    # one tick of the file system's clock; the ctime changes with a chmod too (a file made
    # readable again is read again)
    return info.st_ino, info.st_mtime_ns, info.st_size, info.st_ctime_ns


def _load(path: Path, info: os.stat_result, limit: int
          ) -> tuple[Stamp, dict[str, Any], Problem | None]:
    """(the identity read, its records, its problem) for ``path``, whose ``lstat`` is ``info``:
    a file that cannot be used has no records. OSError when it cannot be read now."""
    if not stat.S_ISREG(info.st_mode):
        return _stamp(info), {}, Problem(ErrorCode.NOT_A_REGULAR_FILE, "is not a regular file")
    if info.st_size > limit:  # not opened: a forged 16 MB file costs one stat per read
        return _stamp(info), {}, _too_large(info.st_size, limit)
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in NOT_REGULAR:  # (replaced since the stat)
            return _stamp(info), {}, Problem(ErrorCode.NOT_A_REGULAR_FILE, "is not a regular file")
        if exc.errno in (errno.EACCES, errno.EPERM):  # the file's own mode: no reader can read it
            return _stamp(info), {}, Problem(ErrorCode.UNREADABLE_FILE,
                                             f"cannot be read ({exc.strerror})")
        raise  # EIO, EMFILE...: a passing failure, whatever the file holds
    try:
        opened = os.fstat(fd)  # the identity of what is read (it may have been replaced)
        if opened.st_size > limit:
            return _stamp(opened), {}, _too_large(opened.st_size, limit)
        data = read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        return _stamp(opened), {}, _too_large(len(data), limit)
    records, problem = _decode(data)
    return _stamp(opened), records, problem


def _too_large(size: int, limit: int) -> Problem:
    return Problem(ErrorCode.DOCUMENT_TOO_LARGE, f"is {size} bytes, over the {limit}-byte limit")


def _decode(data: bytes) -> tuple[dict[str, Any], Problem | None]:
    """The records in a file's bytes, or none and why (an empty file is no records: a write
    that never reached the disk before a crash)."""
    if not data.strip():
        return {}, None
    try:
        loaded = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return {}, Problem(ErrorCode.NOT_UTF8, f"is not UTF-8 (byte {exc.start})")
    except RecursionError:
        return {}, Problem(ErrorCode.DOCUMENT_TOO_DEEP, "nests too deeply")
    except ValueError as exc:  # invalid JSON, an integer past Python's digit limit
        return {}, Problem(ErrorCode.MALFORMED_JSON, f"is not valid JSON: {str(exc)[:120]}")
    if not isinstance(loaded, dict):
        return {}, Problem(ErrorCode.NOT_AN_OBJECT,
                           f"holds a JSON {type(loaded).__name__}, not an object")
    # deeper than any record nests: its copies would exhaust the recursion limit
    if nesting_depth(loaded, MAX_DEPTH) > MAX_DEPTH:
        return {}, Problem(ErrorCode.DOCUMENT_TOO_DEEP, f"nests more than {MAX_DEPTH} levels")
    return loaded, None


def _encode(kind: str, key: str, records: dict[str, Any]) -> bytes:
    """The file for ``records``; UnusableRecords when no reader could use it (over the kind's
    bound, or nesting too deep): writing it would hide every record of the kind."""
    limit = limit_of(kind)
    if nesting_depth(records, MAX_DEPTH) > MAX_DEPTH:
        raise UnusableRecords(f"{kind} record {key!r} nests more than {MAX_DEPTH} levels: not "
                              "written", code=ErrorCode.DOCUMENT_TOO_DEEP)
    data = (json.dumps(records, indent=1, sort_keys=True) + "\n").encode("utf-8")
    if len(data) > limit:
        raise UnusableRecords(f"{kind} records would be {len(data)} bytes with {key!r}, over "
                              f"their {limit}-byte limit: not written",
                              code=ErrorCode.DOCUMENT_TOO_LARGE)
    return data


def _shown(path: Path) -> str:
    """``path`` as a log line names it: from the workspace's ``handoffs/`` folder down."""
    return f"{path.parent.parent.name}/{path.parent.name}/{path.name}"


def _shown_folder(path: Path) -> str:
    """A folder of the workspace's ``handoffs/`` as a log line names it."""
    return f"{path.parent.name}/{path.name}"
