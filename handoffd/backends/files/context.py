"""Shared context on disk (seed 001's ``context/`` folder): the files implementation of
:class:`~handoffd.core.storage.ContextBackend`.

A key's value is the plain JSON file ``context/<key>.json`` (seed 001 tools read and write it
directly). Its revision is kept beside it in ``context/.meta/rev-<hash>.json`` as ``{"key",
"revision", "sha256"}``: 0 while the key is unset, 1 for a value written before revisions
existed (or by a foreign tool, with no record), +1 for every write. The record describes the bytes
it was written with, so a value changed behind handoffd's back (its sha256 differs) counts as one
revision more than the record. Writes are atomic (temp file + rename in the same folder) and
serialised per key with a file lock; each appends its entry to ``context/.history.jsonl``.
"""
from __future__ import annotations

import json
import os
import stat
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from ...core import jsontext, ownfiles
from ...core.errors import ErrorCode, InvalidDocument
from ...core.hashing import sha256_hex
from ...core.ownfiles import plain_folder
from ...core.storage import HISTORY_LIMIT, ContextChange
from . import fsio, logfiles

HISTORY = ".history.jsonl"
LOCK_TIMEOUT_SECONDS = 30.0
MAX_VALUE_BYTES = 4 * 1024 * 1024
# the longest line of .history.jsonl read as an entry: ours are well under 2 KiB (a key of at
# most 512 characters, two sha256s, a handoff id, the writer) unless the writer names itself at
# length, and a write whose line would be longer is refused; a longer line is skipped as it is
# read, never held whole, so a read of N entries holds N * 16 KiB at most
HISTORY_LINE = 16 * 1024


class FileContext:
    """The ``context/`` folder at ``root`` (``durable``: fsync each write)."""

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root
        self.durable = durable

    # ------------------------------------------------------------ paths
    def path(self, key: str) -> Path:
        """The file holding ``key`` (a normalised key; never outside ``context/``)."""
        path = self.root / f"{key}.json"
        base = self.root.resolve()
        if base not in path.resolve().parents:
            raise InvalidDocument(f"context key {key!r} resolves outside {self.root} (a symlink?)",
                                  code=ErrorCode.INVALID_CONTEXT_KEY)
        return path

    def write_path(self, key: str) -> Path:
        """``path(key)`` for a write: also refused when a symlink inside ``context/`` would send
        it to another key's file (``context/alias -> task`` must not let ``alias/x`` write
        ``task/x`` past the namespace check)."""
        path = self.path(key)
        rel = path.resolve().relative_to(self.root.resolve()).as_posix()
        if rel.casefold() != f"{key}.json".casefold():
            raise InvalidDocument(f"context key {key!r} resolves to context/{rel} through a symlink; "
                                  "refused", code=ErrorCode.INVALID_CONTEXT_KEY)
        return path

    def meta(self, name: str) -> Path:
        """A bookkeeping file under ``context/.meta/`` (the folder is made)."""
        return _plain_folder(self.root / ".meta") / name

    # ------------------------------------------------------------ reading
    def read(self, key: str) -> tuple[bytes | None, int]:
        """(the value's bytes or None when unset, its revision). The revision record is read
        first: if a write lands in between, the bytes no longer match it and the result is one
        more than the record, which is never older than the bytes (a stale pair can only cause a
        spurious conflict, never a lost update)."""
        record = self._rev_record(key)
        path = self.path(key)
        try:
            data, _ = fsio.read_bytes_safely(path, MAX_VALUE_BYTES)
        except FileNotFoundError:
            return None, 0
        except InvalidDocument:
            if _folder(path):  # the folder of other keys (a.json/b): ``a`` is not set
                return None, 0
            raise
        if record is None:
            return data, 1  # written before revisions existed, or by a foreign tool
        if sha256_hex(data) == record["sha256"]:
            return data, max(int(record["revision"]), 1)
        return data, int(record["revision"]) + 1  # changed behind the record's back

    def _rev_record(self, key: str) -> dict[str, Any] | None:
        try:
            data = ownfiles.read_regular(self.root / ".meta" / _rev_name(key), 1 << 16)
        except OSError:
            return None
        record = jsontext.parse_line(data)  # None for what no write of ours left (even nested deep)
        if (isinstance(record, dict) and record.get("key") == key
                and isinstance(record.get("revision"), int) and not isinstance(record["revision"], bool)
                and record["revision"] >= 0 and isinstance(record.get("sha256"), str)):
            return record
        return None

    def keys(self, prefix: str = "") -> list[str]:
        """Every ``*.json`` file's key under ``context/`` (dot files and folders are handoffd's)."""
        out: list[str] = []
        if not self.root.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                key = name[:-5] if rel_dir == "." else f"{rel_dir}/{name[:-5]}"
                key = key.replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def history(self, key: str | None = None, *,
                limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        """The newest ``limit`` entries of ``context/.history.jsonl`` (only ``key``'s when
        given), oldest first. The file is streamed a block at a time and only those entries are
        kept: the whole file was read, decoded and parsed at once (a 70 MB history took 570 MB).
        A line that is no entry of ours (torn, foreign, nested deep, over HISTORY_LINE) is
        skipped."""
        kept: deque[dict[str, Any]] = deque(maxlen=max(limit, 0))
        for item in self._entries():
            if key is None or item.get("key") == key:
                kept.append(item)
        return list(kept)

    def latest(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The newest entry of each of ``keys`` that has one, in one streamed pass."""
        wanted, last = set(keys), {}
        for item in self._entries():
            if (found := item.get("key")) in wanted:
                last[found] = item
        return last

    def _entries(self) -> Iterator[dict[str, Any]]:
        """The history's entries, oldest first, one line held at a time (the file is opened as
        the logs are: never a FIFO's wait, never a symlink's target)."""
        try:
            fh = ownfiles.open_reading(self.root / HISTORY)
        except FileNotFoundError:
            return
        with fh:
            for line in logfiles.LineReader(fh, HISTORY_LINE, partial=True):
                # decoded line by line on "\n" alone (the reader's): splitlines() also breaks at
                # U+2028 and U+0085 in an entry's text
                item = jsontext.parse_line(line.decode("utf-8", "replace"))
                if isinstance(item, dict):
                    yield item

    # ------------------------------------------------------------ writing
    def write(self, key: str, change: ContextChange) -> dict[str, Any]:
        """Under the key's lock: read, ``change``, write the value, then its revision record,
        then append the history entry."""
        _plain_folder(self.root)  # context/ itself: a symlink would take every write elsewhere
        path = self.write_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _plain_folder(self.root / ".tmp")
        from filelock import FileLock  # imported where a lock is taken
        with FileLock(self._lock_path(_lock_name(key)), timeout=LOCK_TIMEOUT_SECONDS):
            # the history first opened: a write it could not record is refused before it is made
            history = ownfiles.open_regular(self.root / HISTORY, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                old, revision = self.read(key)
                data, entry = change(old, revision)
                # every line encoded before the first write: a history entry that cannot be
                # written (a writer's id with a lone surrogate) refuses the write, not its history
                line = _history_line(key, entry)
                record = (json.dumps({"key": key, "revision": revision + 1,
                                      "sha256": sha256_hex(data)}) + "\n").encode()
                # the history's lock taken before the value is written, for the same reason
                with FileLock(self._lock_path("history.lock"), timeout=LOCK_TIMEOUT_SECONDS):
                    # the value first, then its record: a crash in between leaves bytes that do
                    # not match the record, which reads as record + 1, the revision this write
                    # was giving
                    fsio.replace(path, data, tmp, durable=self.durable)
                    fsio.replace(self.meta(_rev_name(key)), record, tmp, durable=self.durable)
                    os.write(history, line)
                    if self.durable:
                        os.fsync(history)
            finally:
                os.close(history)
        return entry

    def _lock_path(self, name: str) -> str:
        """The lock file ``name`` in ``context/.meta``; a folder or link planted at its name is
        quarantined first (in ``handoffs/.quarantine``): it failed every write of the key, said
        as a clash with another key's file."""
        from .quarantine import clear_planted
        path = self.meta(name)
        clear_planted(path, self.root.parent / "handoffs" / ".quarantine")
        return str(path)


def _history_line(key: str, entry: dict[str, Any]) -> bytes:
    """``entry`` as its line of ``.history.jsonl``; InvalidDocument when it cannot be one (a
    string in it that UTF-8 cannot encode, a lone surrogate from a non-UTF-8 environment) or
    would be longer than a reader reads (HISTORY_LINE)."""
    try:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidDocument(f"context key {key!r} not written: its history entry holds text "
                              f"UTF-8 cannot encode ({exc.reason}: a writer id or name from a "
                              "non-UTF-8 environment?)", code=ErrorCode.NOT_UTF8) from None
    if len(line) - 1 > HISTORY_LINE:  # every reader would skip it: a write with no history
        raise InvalidDocument(f"context key {key!r} not written: its history entry would be "
                              f"{len(line) - 1:,} bytes, over {HISTORY_LINE:,} (a writer id that "
                              "long?)", code=ErrorCode.INVALID_CONTEXT_VALUE)
    return line


def _plain_folder(folder: Path) -> Path:
    """``folder``, made if missing; InvalidDocument when it is a symlink or not a folder (it
    would take context writes, locks and records out of the workspace)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not plain_folder(folder):
        raise InvalidDocument(f"{folder} is not a folder of the workspace (a symlink?); context "
                              "writes are refused", code=ErrorCode.INVALID_CONTEXT_KEY)
    return folder


def _lock_name(key: str) -> str:
    return "key-" + sha256_hex(key.encode())[:24] + ".lock"


def _folder(path: Path) -> bool:
    """``path`` is a folder (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _rev_name(key: str) -> str:
    return "rev-" + sha256_hex(key.encode())[:24] + ".json"
