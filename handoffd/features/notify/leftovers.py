"""Journals left over: what processes that died (``kill -9``, a crash, a power loss) left
undelivered in their outbox journals, taken over by the next sweep of any process on the
workspace (a daemon's start, its periodic sweeps, ``handoffd sweep``).

A journal's process holds its ``flock`` for as long as it lives, so a journal that can be
locked is one whose process is gone, unless the mark on its first line still names a live
process (a handler closed that process's descriptor: the journal is left to it); the one
process that locks it records what it left in its own journal, and only then removes it:
each notice is delivered at least once, and two processes never both take one over (a
journal removed meanwhile, or replaced, is not taken: its file must still be the one by that
name). Every notice read is handed over, however many:
those the taker's queue has no room for are dead-lettered by it (with that reason), never
dropped.

A journal is read with bounds: a line that is not one handoffd wrote is skipped, with one log
line for the journal, never a traceback, never a stall; a FIFO, a symlink or a folder named like
one is never read, said once by each process (the first few of a sweep one by one, the others
in one line). At most :data:`MAX_JOURNAL_BYTES` of a journal are read by one sweep (no journal
handoffd writes is that large): what lies beyond is kept for the next sweep, the journal renamed
``<pid>-<random>+<offset>.jsonl`` to say where its unread part starts.

One sweep takes over a given number of notices at most (the notifier's ``TAKE_PER_SWEEP``):
the rest of a journal holding more is kept the same way, renamed at its first notice not taken
(planted journals of 200,000 notices each were once all taken by one sweep, on the daemon's
main loop). Those taken are its first notices still undelivered, once the lines marking
targets finished have been read (so none delivered already is taken); reading stops once
:data:`LIVE_MAX` more are undelivered than it takes, which no journal handoffd writes reaches.

One sweep looks at :data:`SCAN_LIMIT` names of the folder at most and takes over
:data:`JOURNALS_PER_SWEEP` journals at most; only journals it takes count against the latter (a
live process's journal, or a name it cannot read, does not). It goes on where the process's
previous sweep stopped, round the folder (a process's first sweep starts at a random place in a
folder of more than SCAN_LIMIT names), so a journal behind any number of such names is reached.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Generator, Iterator

from ...core.documents import check_id
from ...core.errors import HandoffdError
from ...core.liveness import bears_mark, own_mark
from ...core.ownfiles import open_regular, plain_folder
from ...core.states import State
from .notices import KINDS
from .outbox import Entry, Live, Outbox, ident, ident_at, unlink_if

log = logging.getLogger("handoffd")
# <pid>-<random>.jsonl; +<offset>: the part of a larger one that a sweep has not read yet
JOURNAL = re.compile(r"[0-9]{1,10}-[0-9a-f]{16}(?:\+([0-9]{1,15}))?\.jsonl")
STALE_TEMP_SECONDS = 60.0  # a journal being made whose maker died: removed after this long
MAX_LINE_BYTES = 4096  # a line handoffd writes is a few hundred bytes
# read from one left-over journal by one sweep at most: ours stay below about 20 MB (10,000
# notices queued, 480 bytes each in the live count, compacted past four times that)
MAX_JOURNAL_BYTES = 32 << 20
# notices undelivered at once in a journal handoffd writes, at most: QUEUE_LIMIT queued and a
# few in flight (one per delivery thread). A journal holding more (at any point of it) is not one
# of ours: its reading may stop there
LIVE_MAX = 12_000
JOURNALS_PER_SWEEP = 64  # left-over journals taken over by one sweep (the next takes more)
SCAN_LIMIT = 10_000  # names of the outbox folder looked at by one sweep
UNUSABLE_SAID = 5  # names that are no journal said one by one in a sweep (the rest: one line)
UNUSABLE_KEPT = 10_000  # such names a process remembers (not looked at again, not said again)
READ_STEP = 1 << 16
# what open_regular says of a name that is no regular file (a symlink, FIFO, folder, device)
NOT_A_FILE = frozenset({errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR, errno.ENODEV})
STATES = {State.COMPLETED.value: State.COMPLETED, State.FAILED.value: State.FAILED}
FINGERPRINT = re.compile(r"[0-9a-f]{16}")


@dataclass
class Sweep:
    """One sweep's taking over: what it took, and the unusable names it found."""

    outbox: Outbox
    take: Callable[[list[Entry], str], bool]
    journals: int = 0  # journals claimed (against JOURNALS_PER_SWEEP)
    notices: int = 0  # notices taken over
    said: int = 0  # unusable names logged one by one
    unsaid: int = 0  # unusable names past UNUSABLE_SAID (logged in one line at the end)


def take_over(outbox: Outbox, take: Callable[[list[Entry], str], bool], *,
              limit: int | None = None) -> int:
    """Take over the journals of processes that ended with notices left: for each, call
    ``take(entries, name)`` (which records them in our journal and queues them, or dead-letters
    those it has no room for; False: it could not, and the journal is left for later, as are
    those after it), then remove it (or, when it holds more than one sweep takes, keep what was
    not taken). ``limit``: the notices taken at most, from all journals. Returns how many
    notices were taken over."""
    if not plain_folder(outbox.folder) or (limit is not None and limit < 1):
        return 0
    sweep = Sweep(outbox, take)
    scan = _left_over(sweep)
    try:
        for path in scan:
            fd = _claim(sweep, path)
            if fd is None:
                continue
            sweep.journals += 1
            _HELD.add(fd)
            try:
                taken = _take(sweep, fd, path, None if limit is None else limit - sweep.notices)
            except OSError as exc:  # one journal never ends the sweep for those behind it
                log.warning("notification outbox %s: %s cannot be taken over now (%s): the next "
                            "sweep tries again", outbox.folder, path.name, exc)
                taken = 0
            finally:
                _HELD.discard(fd)
                os.close(fd)
            if taken is None:
                break  # not taken now (nor, then, those behind it): the next sweep tries again
            sweep.notices += taken
            if sweep.journals >= JOURNALS_PER_SWEEP or \
                    (limit is not None and sweep.notices >= limit):
                break  # (the next sweep goes on after this name)
    finally:
        scan.close()
    if sweep.unsaid:
        log.warning("notification outbox %s: %d more name(s) that are not journals handoffd "
                    "wrote: left alone", outbox.folder, sweep.unsaid)
    return sweep.notices


def _take(sweep: Sweep, fd: int, path: Path, limit: int | None) -> int | None:
    """Take over the journal ``fd`` (claimed) from where its name says its unread part starts,
    ``limit`` notices at most: how many were taken (None: ``take`` could not record them)."""
    match = JOURNAL.fullmatch(path.name)
    start = int(match.group(1)) if match and match.group(1) else 0
    if start > os.fstat(fd).st_size:  # a name no journal of ours has: nothing there to take
        _unusable(sweep, path.name, f"its name says it goes on at byte {start}, past its end")
        return 0
    if start:
        os.lseek(fd, start, os.SEEK_SET)
    entries, rest_at, counted = read_left(fd, path.name, limit)
    if entries and not sweep.take(entries, path.name):
        return None  # not recorded here: left for a later sweep
    if rest_at is None:
        unlink_if(path, ident(fd))
    else:
        why = (f"holds more notices than one sweep takes ({limit})" if counted else
               f"is larger than {MAX_JOURNAL_BYTES} bytes (no journal handoffd writes is)")
        _keep_rest(sweep.outbox, fd, path, start, start + rest_at, why)
    return len(entries)


def _keep_rest(outbox: Outbox, fd: int, path: Path, start: int, rest_at: int, why: str) -> None:
    """A journal larger than one sweep reads or takes (``why``): keep it for the next sweep,
    renamed to say where its unread part starts (with a new random part: no other file is
    replaced)."""
    kept = f"{path.name.split('-', 1)[0]}-{os.urandom(8).hex()}+{rest_at}.jsonl"
    try:
        if ident_at(path) != ident(fd):
            return  # (replaced meanwhile: not the file read)
        os.rename(path, outbox.folder / kept)
    except OSError as exc:
        log.error("notification outbox %s: %s cannot be renamed to %s (%s): the next sweep "
                  "takes over its first part again", outbox.folder, path.name, kept, exc)
        return
    log.warning("notification outbox %s: %s %s: bytes %d to %d were taken over, the rest is "
                "kept as %s for the next sweep", outbox.folder, path.name, why, start, rest_at,
                kept)


def _left_over(sweep: Sweep) -> Generator[Path, None, None]:
    """Journals of other processes (and stale temp files, removed here): SCAN_LIMIT names looked
    at, at most, round the folder from where the previous sweep stopped."""
    outbox = sweep.outbox
    start = _scan_start(outbox)
    looked = 0
    for again in (False, True):  # from ``start`` to the end, then from the top up to ``start``
        if again and not start:
            return
        try:
            with os.scandir(outbox.folder) as names:
                for position, item in enumerate(names):
                    if again and position >= start:
                        return
                    if position < start and not again:
                        continue  # (looked at by the previous sweeps)
                    if looked >= SCAN_LIMIT:
                        outbox.scan_at = position
                        return
                    looked += 1
                    outbox.scan_at = position + 1
                    path = _candidate(sweep, item)
                    if path is not None:
                        yield path
        except OSError as exc:
            log.warning("notification outbox %s: cannot be listed: %s", outbox.folder, exc)
            return
        outbox.scan_at = 0  # (the end of the folder: the next sweep starts at the top)


def _scan_start(outbox: Outbox) -> int:
    """Where this sweep's scan starts: where the previous one of this process stopped; for a
    process's first sweep, a random place when the folder has more than SCAN_LIMIT names (so
    that processes that sweep once, ``handoffd sweep``, get past names they cannot take)."""
    if outbox.scan_at is None:
        try:
            with os.scandir(outbox.folder) as names:
                count = sum(1 for _ in names)
        except OSError:
            count = 0
        outbox.scan_at = random.randrange(count) if count > SCAN_LIMIT else 0
    return outbox.scan_at


def _candidate(sweep: Sweep, item: os.DirEntry[str]) -> Path | None:
    """``item``'s path if it may be a journal to take over (not ours, not one already found
    unusable); a stale temp file is removed instead."""
    name = item.name
    if name in sweep.outbox.warned:
        return None  # (said already: left alone, quietly)
    if name.startswith(".") and name.endswith(".jsonl.new"):
        _remove_stale(sweep, Path(item.path))
    elif JOURNAL.fullmatch(name) and name != sweep.outbox.name:
        return Path(item.path)
    return None


def _claim(sweep: Sweep, path: Path) -> int | None:
    """``path`` opened and flocked, if its process has ended and nobody else takes it
    over (and it is still the file by that name); else None."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in NOT_A_FILE:  # a FIFO, a symlink, a folder, a device: never read, said once
            _unusable(sweep, path.name, exc.strerror or str(exc))
        else:  # out of descriptors, EACCES, EIO: perhaps not next time, so not remembered
            log.warning("notification outbox %s: %s cannot be opened now (%s): the next sweep "
                        "tries again", sweep.outbox.folder, path.name, exc.strerror or exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # a free lock is a death only when no live process bears the writer's mark: a handler
        # may have closed its daemon's descriptor (the daemon, at its next write, makes a new
        # journal and removes this one; if it dies first, its mark names nobody any more)
        if ident(fd) == ident_at(path):
            owner = journal_owner(fd)
            if not owner_lives(owner):
                return fd
            _left_to_owner(sweep, path.name, owner)
    except OSError:  # held: its process lives (or another one takes it over right now)
        pass
    os.close(fd)
    return None


# journals said to be left to a live writer, by this process (each said once; bounded)
_LEFT_SAID: set[tuple[str, str]] = set()


def _left_to_owner(sweep: Sweep, name: str, owner: dict[str, object]) -> None:
    """A journal whose lock is free is left to the live process its mark names: said once by
    this process (a forged mark of a live process would otherwise hold it silently)."""
    key = (str(sweep.outbox.folder), name)
    if key in _LEFT_SAID:
        return
    if len(_LEFT_SAID) >= UNUSABLE_KEPT:
        _LEFT_SAID.clear()
    _LEFT_SAID.add(key)
    log.warning("notification outbox %s: %s is not locked, but its writer (pid %s) still runs: "
                "left to it (a handler may have closed its descriptor); taken over once that "
                "process ends", sweep.outbox.folder, name, str(owner.get("pid"))[:20])


def owner_lives(owner: dict[str, object]) -> bool:
    """True when this process can tell that the journal's writer ``owner`` still runs: it wrote
    a mark, in this process's namespaces, and a live process bears it. Where it cannot tell (no
    mark, other namespaces) the free lock decides, as before marks: a journal is then perhaps
    delivered twice, never left for good (a dead writer's namespaces may never come back)."""
    known = own_mark()
    if known is None or owner.get("ns") != known[1]:
        return False
    return bears_mark(owner.get("pid"), owner.get("proc"))


def journal_owner(fd: int) -> dict[str, object]:
    """The owner a journal's first line names (:func:`.outbox.owner_line`), or {} (a journal
    written before marks were, or by a process that could not make one: its lock decides)."""
    try:
        head = os.pread(fd, MAX_LINE_BYTES + 1, 0).split(b"\n", 1)[0]
        item = json.loads(head) if head.startswith(b'{"owner":') else None
    except (OSError, ValueError, RecursionError):
        return {}
    owner = item.get("owner") if isinstance(item, dict) else None
    return owner if isinstance(owner, dict) else {}


def _unusable(sweep: Sweep, name: str, why: str) -> None:
    """``name`` is not a journal handoffd wrote: left alone, said once by this process."""
    outbox = sweep.outbox
    if len(outbox.warned) < UNUSABLE_KEPT:  # (past that, such a name is said each sweep)
        outbox.warned.add(name)
    if sweep.said < UNUSABLE_SAID:
        sweep.said += 1
        log.warning("notification outbox %s: %s is not a journal handoffd wrote (%s): left "
                    "alone", outbox.folder, name, why)
    else:
        sweep.unsaid += 1


def _remove_stale(sweep: Sweep, path: Path) -> None:
    """A journal its maker died making (the one it replaced is still there)."""
    try:
        if time.time() - os.lstat(path).st_mtime < STALE_TEMP_SECONDS:
            return
    except OSError:
        return
    fd = _claim(sweep, path)
    if fd is not None:
        unlink_if(path, ident(fd))
        os.close(fd)


def read_journal(fd: int, name: str) -> list[Entry]:
    """The notices a journal leaves undelivered, in the order queued, read from where ``fd``
    stands (at most MAX_JOURNAL_BYTES: see :func:`read_left`)."""
    return read_left(fd, name)[0]


def read_left(fd: int, name: str,
              limit: int | None = None) -> tuple[list[Entry], int | None, bool]:
    """The first ``limit`` (default: all) notices a journal leaves undelivered, in the order
    queued, read from where ``fd`` stands; where its part not taken starts, in bytes from
    there (None: all of it was taken); and whether that is for ``limit`` (True) or for
    MAX_JOURNAL_BYTES (False). The part not taken starts at the first notice left undelivered
    and not taken (a notice before it whose target is marked finished after it is not taken
    again); a line that is not one handoffd wrote is skipped: one warning for the whole
    journal. Reading stops once LIVE_MAX more than ``limit`` are undelivered."""
    queued: dict[int, Live] = {}
    at: dict[int, int] = {}  # where each queued notice's line starts
    skipped, first = 0, ""
    lines = Lines(fd)
    for line, problem in lines:
        parsed = problem or _parse(line)
        if parsed is None:
            continue  # (its writer's mark)
        if isinstance(parsed, str):
            skipped, first = skipped + 1, first or parsed
        elif isinstance(parsed[1], str):  # a target finished
            live = queued.get(parsed[0])
            if live is not None:
                live.left.discard(parsed[1])
                if not live.left:
                    del queued[parsed[0]], at[parsed[0]]
        elif parsed[0] in queued:
            skipped, first = skipped + 1, first or "a number used twice"
        else:
            queued[parsed[0]] = Live(parsed[1], set(parsed[1].kinds), 0)
            at[parsed[0]] = lines.line_at
            if limit is not None and len(queued) > limit + LIVE_MAX:
                break  # (not one of ours: what is taken is settled, and its rest starts earlier)
    if skipped:
        log.warning("notification outbox %s: skipped %d line(s) that are not notices handoffd "
                    "wrote (the first: %s)", name, skipped, first)
    left = list(queued.items())
    rest_at, counted = lines.read, False
    if limit is not None and len(left) > limit:
        rest_at, counted = at[left[limit][0]], True
        left = left[:limit]
    return ([replace(live.entry, kinds=tuple(k for k in KINDS if k in live.left))
             for _, live in left], rest_at, counted)


class Lines:
    """The lines of a journal from where its descriptor stands (without their newlines), or
    why one is skipped: at most MAX_JOURNAL_BYTES are read, a line longer than MAX_LINE_BYTES
    is not kept. :attr:`line_at` is where the line last given starts (bytes from where the
    descriptor stood). After the iteration, :attr:`read` is how many bytes were taken when the
    journal holds more (where its unread part starts), None when all of it was read."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.read: int | None = None
        self.line_at = 0

    def __iter__(self) -> Iterator[tuple[bytes, str | None]]:
        rest, total, skipping = b"", 0, False
        at = 0  # where ``rest`` starts
        while total < MAX_JOURNAL_BYTES:
            chunk = os.read(self.fd, min(READ_STEP, MAX_JOURNAL_BYTES - total))
            if not chunk:
                break
            total += len(chunk)
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for line in parts:
                self.line_at, at = at, at + len(line) + 1
                if skipping:  # the end of a line too long to keep
                    skipping = False
                elif len(line) > MAX_LINE_BYTES:
                    yield b"", f"a line over {MAX_LINE_BYTES} bytes"
                elif line.strip():
                    yield line, None
            if len(rest) > MAX_LINE_BYTES:
                if not skipping:
                    self.line_at = at
                    yield b"", f"a line over {MAX_LINE_BYTES} bytes"
                rest, skipping, at = b"", True, at + len(rest)
        else:
            if os.read(self.fd, 1):  # more than one sweep reads: the line begun is read next
                self.read = at  # (the line begun)
                return
        if rest.strip() and not skipping:
            self.line_at = at
            yield b"", "a line cut short (its process died writing it)"


def _parse(line: bytes) -> tuple[int, Entry] | tuple[int, str] | str | None:
    """(number, entry) for a queued notice, (number, kind) for a finished target, None for
    the writer's mark (its owner line), else why the line is not one handoffd wrote."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(item, dict):
        return "not a JSON object"
    if set(item) == {"owner"} and isinstance(item["owner"], dict):
        return None
    if "done" in item:
        seq, kind = item.get("done"), item.get("kind")
        if isinstance(seq, int) and _number(seq) and isinstance(kind, str) and kind in KINDS:
            return seq, kind
        return "a bad 'done' line"
    seq, kinds, index, at = item.get("n"), item.get("kinds"), item.get("index"), item.get("at")
    state, rule = STATES.get(str(item.get("state"))), item.get("rule")
    revision = item.get("revision")  # (absent from lines written before it was recorded)
    try:
        handoff_id = check_id(item.get("id"))
    except HandoffdError:
        return "not a safe handoff id"
    if not (_number(seq) and _number(index) and state is not None and isinstance(rule, str)
            and FINGERPRINT.fullmatch(rule) and isinstance(kinds, list) and kinds
            and all(k in KINDS for k in kinds) and isinstance(at, str) and len(at) <= 64
            and (revision is None or _number(revision))):
        return "a bad notice line"
    assert isinstance(seq, int) and isinstance(index, int) and isinstance(rule, str)
    assert revision is None or isinstance(revision, int)
    return seq, Entry(handoff_id, state, rule, index, tuple(k for k in KINDS if k in kinds), at,
                      revision)


def _number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


# the journal a takeover holds (it runs on a thread of its own): a process forked meanwhile (a
# Python handler's) must not keep its lock, or that journal, renamed for its next part, could
# not be taken over until the child exits. (Closing the child's copy keeps the parent's lock.)
_HELD: set[int] = set()


def _forget_after_fork() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
