"""The outbox: every queued notice is on disk until it is delivered or dead-lettered.

Each process that queues notices keeps a journal of its own,
``handoffs/.meta/notify/<pid>-<random>.jsonl``, and holds an exclusive ``flock`` on it for as
long as it lives. One line per queued notice (``{"n": 7, "id": ..., "state": "completed",
"rule": <fingerprint>, "index": 0, "kinds": ["webhook"], "at": ..., "revision": 3}``; a line
without ``revision``, as written before it was recorded, is read too), written (and fsynced,
with fsync durability) before the notice counts as queued, and one per target finished,
delivered or dead-lettered (``{"done": 7, "kind": "webhook"}``). When nothing is left the
journal is truncated; when it has grown past :data:`COMPACT_BYTES` with little left in it, what
is left is written to a new journal that replaces it. A process whose notices are all settled
removes its journal when it drains (its stop, its exit). A journal whose process died is taken
over by another process (:mod:`.leftovers`).

The journal is one of handoffd's own files: opened without following symlinks, as a regular
file only, in a plain folder; a new one is locked before its name shows (so that nobody takes
it over while it is being made). Its first line (unless it is empty) is its process's
liveness mark (``{"owner": {"pid": .., "proc": .., "ns": ..}}``, :mod:`...core.liveness`): a
handler that closes descriptors it did not open frees the journal's lock while its process
lives, and a sweep then leaves the journal alone as long as a live process bears that mark.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ...backends.files.fsio import fsync_dir
from ...core.liveness import own_mark
from ...core.ownfiles import open_regular, plain_folder
from ...core.states import State
from .notices import KINDS

log = logging.getLogger("handoffd")
OUTBOX_DIR = "notify"  # under handoffs/.meta/
COMPACT_BYTES = 1 << 20  # a journal larger than this, four times what is left in it, is rewritten
LIVE_BYTES = 200  # what one live record holds beyond its line (its object, its slot)


@dataclass(frozen=True)
class Entry:
    """A notice as the outbox records it: enough to deliver it again in another process."""

    handoff_id: str
    state: State
    rule: str  # the rule's fingerprint (notices.fingerprint)
    index: int  # the rule's place among [[on_filed]] when it was queued
    kinds: tuple[str, ...]  # the targets not yet finished
    filed_at: str
    revision: int | None = None  # the filed document's handoffd.revision (None: unknown)

    def line(self, seq: int, kinds: Iterable[str] | None = None) -> bytes:
        """The journal line recording this entry as number ``seq`` (``kinds``: those left)."""
        item = {"n": seq, "id": self.handoff_id, "state": self.state.value, "rule": self.rule,
                "index": self.index, "kinds": [k for k in KINDS if k in (kinds or self.kinds)],
                "at": self.filed_at}
        if self.revision is not None:
            item["revision"] = self.revision
        return (json.dumps(item, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass
class Live:
    """A notice recorded and not yet settled: the targets left, and what it holds in memory."""

    entry: Entry
    left: set[str]
    size: int


class Outbox:
    """This process's journal in ``folder`` (``handoffs/.meta/notify``), opened on first use.
    Thread-safe; never raises from :meth:`record`, :meth:`done` or :meth:`release`."""

    name: str | None  # our journal's file name (None: none open)

    def __init__(self, folder: Path, *, durable: bool) -> None:
        self.folder = folder
        self.durable = durable
        self._forget()
        self.warned: set[str] = set()  # left-over names already said to be unusable
        self.scan_at: int | None = None  # where the next sweep's scan starts (None: not yet)
        _ALL.add(self)

    def _forget(self) -> None:
        """No journal yet (also in a forked child: the parent's is the parent's)."""
        self.lock = threading.Lock()
        self.fd = -1
        self.name = None
        self.ident = (0, 0)  # (st_dev, st_ino) of our journal
        self.size = 0
        self.torn = False  # a write failed halfway: the next use starts a new journal
        self.live: dict[int, Live] = {}
        self.live_bytes = 0
        self.seq = 0
        self.problem: str | None = None  # the failure last logged (once, until it works again)

    # ------------------------------------------------------------ this process's journal
    def record(self, entries: list[Entry]) -> list[int] | None:
        """Record ``entries`` (one write, fsynced when durable): their numbers, or None when
        the journal cannot be written (logged once until it can again; nothing recorded)."""
        with self.lock:
            seqs = list(range(self.seq + 1, self.seq + 1 + len(entries)))
            lines = [entry.line(seq) for seq, entry in zip(seqs, entries)]
            try:
                self._ready()
                self._append(b"".join(lines), sync=self.durable)
            except OSError as exc:
                self._failed(exc)
                return None
            self.seq += len(entries)
            for seq, entry, line in zip(seqs, entries, lines):
                self.live[seq] = Live(entry, set(entry.kinds), len(line) + LIVE_BYTES)
                self.live_bytes += len(line) + LIVE_BYTES
            self._works()
            return seqs

    def done(self, seq: int | None, kinds: Iterable[str]) -> None:
        """Targets ``kinds`` of notice ``seq`` are finished (delivered or dead-lettered)."""
        if seq is None:
            return
        with self.lock:
            live = self.live.get(seq)
            finished = [kind for kind in kinds if live is not None and kind in live.left]
            if live is None or not finished:
                return
            live.left.difference_update(finished)
            if not live.left:
                del self.live[seq]
                self.live_bytes -= live.size
            try:
                self._ready()
                if not self.live:  # nothing left: the journal starts again, empty (its owner
                    os.ftruncate(self.fd, 0)  # line comes back with its next notice)
                    self.size = 0
                    return
                self._append(b"".join(json.dumps({"done": seq, "kind": kind}).encode() + b"\n"
                                      for kind in finished), sync=False)
                if self.size > COMPACT_BYTES and self.size > 4 * self.live_bytes:
                    self._start_journal()
            except OSError as exc:
                self._failed(exc)

    def release(self) -> None:
        """Nothing is left undelivered (a drain ended): remove the journal and its lock."""
        with self.lock:
            if self.live or self.fd < 0:
                return
            unlink_if(self.folder / str(self.name), self.ident)  # (if it is still ours)
            if self._intact():
                os.close(self.fd)
            self.fd, self.name = -1, None

    def held_bytes(self) -> int:
        """About what the live records hold in memory."""
        return self.live_bytes

    def _ready(self) -> None:
        """Our journal open and intact (a new one when there is none, or a write tore it, or
        a handler closed its descriptor), holding every live record."""
        if self.fd >= 0 and not self.torn and self._intact():
            return
        if self.fd >= 0 and not self.torn:
            log.warning("notification outbox %s: its descriptor was closed under this process "
                        "(a handler must not close descriptors it did not open): a new one "
                        "holds its notices", self.name)
            self.fd = -1  # (not ours to close any more)
        self._start_journal()

    def _intact(self) -> bool:
        try:
            info = os.fstat(self.fd)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.ident

    def _start_journal(self) -> None:
        """A new journal holding the live records, locked before its name shows (so nobody
        takes it over), then the old one removed. OSError when it cannot be made."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not plain_folder(self.folder):
            raise OSError(errno.ENOTDIR, "not a plain folder (a symlink?)", str(self.folder))
        name = f"{os.getpid()}-{os.urandom(8).hex()}.jsonl"
        temp = self.folder / f".{name}.new"
        fd = open_regular(temp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            data = owner_line() + b"".join(live.entry.line(seq, live.left)
                                           for seq, live in self.live.items())
            write_all(fd, data)
            if self.durable:
                os.fsync(fd)
            os.rename(temp, self.folder / name)
            if self.durable:
                fsync_dir(self.folder)
        except BaseException:
            os.close(fd)
            unlink_if(temp, None)
            raise
        old_fd, old_name, old_ident = self.fd, self.name, self.ident
        old_ours = old_fd >= 0 and self._intact()
        self.fd, self.name, self.ident = fd, name, ident(fd)
        self.size, self.torn = len(data), False
        if old_name is not None:  # its records are all in the new one now
            unlink_if(self.folder / old_name, old_ident)
        if old_ours:
            os.close(old_fd)

    def _append(self, data: bytes, *, sync: bool) -> None:
        if self.size == 0:  # (an empty journal holds nothing to take over: no mark needed)
            data = owner_line() + data
        try:
            write_all(self.fd, data)
            if sync:
                os.fdatasync(self.fd)
        except OSError:
            self.torn = True  # (a line cut short there: the next write starts a new journal)
            raise
        self.size += len(data)

    def _failed(self, exc: OSError) -> None:
        if self.problem is None:
            log.error("cannot record notifications in the outbox %s: %s; they are delivered "
                      "from memory only (a crash would lose them) until it works again",
                      self.folder, exc)
        self.problem = str(exc)

    def _works(self) -> None:
        if self.problem is not None:
            log.warning("the notification outbox %s works again", self.folder)
            self.problem = None


def owner_line() -> bytes:
    """The first line of this process's journals: its liveness mark (``{"owner": {"pid": ..,
    "proc": .., "ns": ..}}``), so that a sweep finding the journal's lock free (a handler closed
    our descriptor) leaves it to us while we live; empty where /proc cannot tell (no mark)."""
    known = own_mark()
    if known is None:
        return b""
    owner = {"pid": os.getpid(), "proc": known[0], "ns": known[1]}
    return (json.dumps({"owner": owner}, separators=(",", ":")) + "\n").encode("utf-8")


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (OSError when it cannot)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def ident(fd: int) -> tuple[int, int]:
    """What file ``fd`` is open on: (device, inode)."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def ident_at(path: Path) -> tuple[int, int] | None:
    """What file ``path`` names (not following a symlink), or None when it names none."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def unlink_if(path: Path, same: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still the file ``same`` names (None: whatever it is)."""
    try:
        if same is None or ident_at(path) == same:
            os.unlink(path)
    except OSError:
        pass


# a forked child (handoffd run --processes N) must not write to, nor release, its parent's
# journal: it starts its own when it first queues a notice
_ALL: weakref.WeakSet[Outbox] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for outbox in list(_ALL):
        if outbox.fd >= 0 and outbox._intact():
            try:
                os.close(outbox.fd)  # (the parent's descriptor still holds the lock)
            except OSError:
                pass
        outbox._forget()


os.register_at_fork(after_in_child=_forget_after_fork)
