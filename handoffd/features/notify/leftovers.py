"""Journals left over: what processes that died (``kill -9``, a crash, a power loss) left
undelivered in their outbox journals, taken over by the next sweep of any process on the
workspace (a daemon's start, its periodic sweeps, ``handoffd sweep``).

A journal's process holds its ``flock`` for as long as it lives, so a journal that can be
locked is one whose process is gone; the one process that locks it records what it left in its
own journal, and only then removes it: each notice is delivered at least once, and two
processes never both take one over (a journal removed meanwhile, or replaced, is not taken:
its file must still be the one by that name). A journal is read with bounds: a line that is
not one handoffd wrote is skipped, with one log line for the journal, never a traceback, never
a stall; a FIFO or a symlink named like one is never read, and said once.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from ...core.documents import check_id
from ...core.errors import HandoffdError
from ...core.ownfiles import open_regular, plain_folder
from ...core.states import State
from .notices import KINDS
from .outbox import Entry, Live, Outbox, ident, ident_at, unlink_if

log = logging.getLogger("handoffd")
JOURNAL = re.compile(r"[0-9]{1,10}-[0-9a-f]{16}\.jsonl")
STALE_TEMP_SECONDS = 60.0  # a journal being made whose maker died: removed after this long
MAX_LINE_BYTES = 4096  # a line handoffd writes is a few hundred bytes
MAX_JOURNAL_BYTES = 32 << 20  # read from one left-over journal at most (ours stay < 10 MB)
JOURNALS_PER_SWEEP = 64  # left-over journals taken over by one sweep (the next takes more)
SCAN_LIMIT = 10_000  # names of the outbox folder looked at by one sweep
READ_STEP = 1 << 16
TOO_LARGE = "larger than MAX_JOURNAL_BYTES"
STATES = {State.COMPLETED.value: State.COMPLETED, State.FAILED.value: State.FAILED}
FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def take_over(outbox: Outbox, take: Callable[[list[Entry], str], bool], *, limit: int) -> int:
    """Take over the journals of processes that ended with notices left: for each, call
    ``take(entries, name)`` (which records them in our journal and queues them; False:
    it could not, and the journal is left for later), then remove it. At most ``limit``
    notices are read from one journal. Returns how many notices were taken over."""
    if not plain_folder(outbox.folder):
        return 0
    taken = 0
    for path in _left_over(outbox):
        fd = _claim(outbox, path)
        if fd is None:
            continue
        try:
            entries = read_journal(fd, path.name, limit=limit)
            if entries and not take(entries, path.name):
                continue
            unlink_if(path, ident(fd))
            taken += len(entries)
        finally:
            os.close(fd)
    return taken


def _left_over(outbox: Outbox) -> Iterator[Path]:
    """Journals of other processes (and stale temp files, removed here), a bounded few."""
    found = 0
    try:
        with os.scandir(outbox.folder) as names:
            for seen, item in enumerate(names):
                if seen >= SCAN_LIMIT or found >= JOURNALS_PER_SWEEP:
                    return
                if item.name.startswith(".") and item.name.endswith(".jsonl.new"):
                    _remove_stale(outbox, Path(item.path))
                elif JOURNAL.fullmatch(item.name) and item.name != outbox.name:
                    found += 1
                    yield Path(item.path)
    except OSError as exc:
        log.warning("notification outbox %s: cannot be listed: %s", outbox.folder, exc)


def _claim(outbox: Outbox, path: Path) -> int | None:
    """``path`` opened and flocked, if its process has ended and nobody else takes it
    over (and it is still the file by that name); else None."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a FIFO, a symlink, a device: never read, said once
        if path.name not in outbox.warned and len(outbox.warned) < 1000:
            outbox.warned.add(path.name)
            log.warning("notification outbox %s: %s is not a journal handoffd wrote (%s): "
                        "left alone", outbox.folder, path.name, exc.strerror or exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if ident(fd) == ident_at(path):
            return fd
    except OSError:  # held: its process lives (or another one takes it over right now)
        pass
    os.close(fd)
    return None


def _remove_stale(outbox: Outbox, path: Path) -> None:
    """A journal its maker died making (the one it replaced is still there)."""
    try:
        if time.time() - os.lstat(path).st_mtime < STALE_TEMP_SECONDS:
            return
    except OSError:
        return
    fd = _claim(outbox, path)
    if fd is not None:
        unlink_if(path, ident(fd))
        os.close(fd)


def read_journal(fd: int, name: str, *, limit: int) -> list[Entry]:
    """The notices a journal leaves undelivered (at most ``limit``), in the order queued. A
    line that is not one handoffd wrote is skipped: one warning for the whole journal."""
    queued: dict[int, Live] = {}
    skipped, first, cut = 0, "", ""
    for line, problem in _lines(fd):
        if problem == TOO_LARGE:
            cut = f"; only its first {MAX_JOURNAL_BYTES} bytes were read"
            break
        parsed = problem or _parse(line)
        if isinstance(parsed, str):
            skipped, first = skipped + 1, first or parsed
        elif isinstance(parsed[1], str):  # a target finished
            live = queued.get(parsed[0])
            if live is not None:
                live.left.discard(parsed[1])
                if not live.left:
                    del queued[parsed[0]]
        elif parsed[0] in queued or len(queued) >= limit:
            skipped += 1
            first = first or ("a number used twice" if parsed[0] in queued
                              else f"more than {limit} notices left")
        else:
            queued[parsed[0]] = Live(parsed[1], set(parsed[1].kinds), 0)
    if skipped or cut:
        log.warning("notification outbox %s: skipped %d line(s) that are not notices handoffd "
                    "wrote%s%s", name, skipped, f" (the first: {first})" if first else "", cut)
    return [replace(live.entry, kinds=tuple(k for k in KINDS if k in live.left))
            for live in queued.values()]


def _lines(fd: int) -> Iterator[tuple[bytes, str | None]]:
    """The lines of a journal (without their newlines), or why one is skipped: at most
    MAX_JOURNAL_BYTES are read, a line longer than MAX_LINE_BYTES is not kept."""
    rest, total, skipping = b"", 0, False
    while True:
        chunk = os.read(fd, READ_STEP)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_JOURNAL_BYTES:
            yield b"", TOO_LARGE
            return
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for line in parts:
            if skipping:  # the end of a line too long to keep
                skipping = False
            elif len(line) > MAX_LINE_BYTES:
                yield b"", f"a line over {MAX_LINE_BYTES} bytes"
            elif line.strip():
                yield line, None
        if len(rest) > MAX_LINE_BYTES:
            if not skipping:
                yield b"", f"a line over {MAX_LINE_BYTES} bytes"
            rest, skipping = b"", True
    if rest.strip() and not skipping:
        yield b"", "a line cut short (its process died writing it)"


def _parse(line: bytes) -> tuple[int, Entry] | tuple[int, str] | str:
    """(number, entry) for a queued notice, (number, kind) for a finished target, else why
    the line is not one handoffd wrote."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(item, dict):
        return "not a JSON object"
    if "done" in item:
        seq, kind = item.get("done"), item.get("kind")
        if isinstance(seq, int) and _number(seq) and isinstance(kind, str) and kind in KINDS:
            return seq, kind
        return "a bad 'done' line"
    seq, kinds, index, at = item.get("n"), item.get("kinds"), item.get("index"), item.get("at")
    state, rule = STATES.get(str(item.get("state"))), item.get("rule")
    try:
        handoff_id = check_id(item.get("id"))
    except HandoffdError:
        return "not a safe handoff id"
    if not (_number(seq) and _number(index) and state is not None and isinstance(rule, str)
            and FINGERPRINT.fullmatch(rule) and isinstance(kinds, list) and kinds
            and all(k in KINDS for k in kinds) and isinstance(at, str) and len(at) <= 64):
        return "a bad notice line"
    assert isinstance(seq, int) and isinstance(index, int) and isinstance(rule, str)
    return seq, Entry(handoff_id, state, rule, index, tuple(k for k in KINDS if k in kinds), at)


def _number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
