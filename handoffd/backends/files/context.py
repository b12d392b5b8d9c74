"""Shared context on disk (seed 001's ``context/`` folder): the files implementation of
:class:`~handoffd.core.storage.ContextBackend`.

A key's value is the plain JSON file ``context/<key>.json`` (seed 001 tools read and write it
directly). Its revision is kept beside it in ``context/.meta/rev-<hash>.json`` as ``{"key",
"revision", "sha256"}``: 0 while the key is unset, 1 for a value written before revisions
existed (or by a foreign tool, with no record), +1 for every write. The record describes the bytes
it was written with, so a value changed behind handoffd's back (its sha256 differs) counts as one
revision more than the record. Writes are atomic (temp file + rename) and serialised per key
with a flock; each appends its entry to ``context/.history.jsonl``.

Every file is reached through :mod:`.contextfs` (the ``context/`` folder by descriptors): never
through a symlink, and an entry planted at the name of the history, a lock or a revision record
is set aside into the quarantine first.
"""
from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from ...core import jsontext, ownfiles
from ...core.errors import ErrorCode, InvalidDocument
from ...core.hashing import sha256_hex
from ...core.storage import HISTORY_LIMIT, ContextChange
from . import logfiles
from .contextfs import (META, TMP, ContextFolder, folders_of, leaf_of, opened, own, publish,
                        read_value, walk)

HISTORY = ".history.jsonl"
LOCK_TIMEOUT_SECONDS = 30.0
# the longest line of .history.jsonl read as an entry: ours are well under 2 KiB (a key of at
# most 512 characters, two sha256s, a handoff id, the writer) unless the writer names itself at
# length, and a write whose line would be longer is refused; a longer line is skipped as it is
# read, never held whole, so a read of N entries holds N * 16 KiB at most
HISTORY_LINE = 16 * 1024


class FileContext(ContextFolder):
    """The ``context/`` folder at ``root`` (``durable``: fsync each write): its keys' values,
    revisions and history, over :class:`~.contextfs.ContextFolder`'s descriptors."""

    # ------------------------------------------------------------ paths
    def path(self, key: str) -> Path:
        """The file holding ``key`` (a normalised key; never outside ``context/``), for naming
        it: reads and writes never go through this path, but through :meth:`folder`
        (:class:`~.contextfs.ContextFolder`'s)."""
        path = self.root / f"{key}.json"
        try:
            inside = self.root.resolve() in path.resolve().parents
        except (OSError, RuntimeError):  # a link swapped while it was resolved, a loop
            inside = False
        if not inside:
            raise InvalidDocument(f"context key {key!r} resolves outside {self.root} (a symlink?)",
                                  code=ErrorCode.INVALID_CONTEXT_KEY)
        return path

    # ------------------------------------------------------------ reading
    def read(self, key: str) -> tuple[bytes | None, int]:
        """(the value's bytes or None when unset, its revision). The revision record is read
        first: if a write lands in between, the bytes no longer match it and the result is one
        more than the record, which is never older than the bytes (a stale pair can only cause a
        spurious conflict, never a lost update)."""
        try:
            with self.folder([]) as root, opened(walk(root, folders_of(key))) as folder:
                return self._read_in(root, folder, key)
        except FileNotFoundError:
            return None, 0

    def _read_in(self, root: int, folder: int, key: str) -> tuple[bytes | None, int]:
        """:meth:`read` with ``context/`` and the key's folder open already."""
        record = self._rev_record(root, key)
        try:
            data, _ = read_value(folder, leaf_of(key), f"context/{key}.json")
        except (FileNotFoundError, IsADirectoryError):  # (a folder: of other keys, a.json/b)
            return None, 0
        if record is None:
            return data, 1  # written before revisions existed, or by a foreign tool
        if sha256_hex(data) == record["sha256"]:
            return data, max(int(record["revision"]), 1)
        return data, int(record["revision"]) + 1  # changed behind the record's back

    def _rev_record(self, root: int, key: str) -> dict[str, Any] | None:
        try:
            with opened(walk(root, [META])) as meta:
                data = ownfiles.read_regular(_rev_name(key), 1 << 16, dir_fd=meta)
        except (OSError, InvalidDocument):
            return None
        record = jsontext.parse_line(data)  # None for what no write of ours left (even nested deep)
        if (isinstance(record, dict) and record.get("key") == key
                and isinstance(record.get("revision"), int) and not isinstance(record["revision"], bool)
                and record["revision"] >= 0 and isinstance(record.get("sha256"), str)):
            return record
        return None

    # ------------------------------------------------------------ history
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
            with self.folder([]) as root:
                fh = os.fdopen(ownfiles.open_regular(HISTORY, os.O_RDONLY, dir_fd=root), "rb")
        except (OSError, InvalidDocument):
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
        then append the history entry. Every step goes through descriptors of ``context/``
        and the key's folder (:meth:`folder`), never a path a swap could redirect."""
        with self.folder([], make=True) as root, opened(own(root, META)) as meta, \
                self._flock(meta, _lock_name(key), LOCK_TIMEOUT_SECONDS), \
                opened(walk(root, folders_of(key), make=True)) as folder, \
                opened(own(root, TMP)) as tmp:
            # the history first opened: a write it could not record is refused before it is made
            history = self._open_history(root)
            try:
                old, revision = self._read_in(root, folder, key)
                data, entry = change(old, revision)
                # every line encoded before the first write: a history entry that cannot be
                # written (a writer's id with a lone surrogate) refuses the write, not its history
                line = _history_line(key, entry)
                record = (json.dumps({"key": key, "revision": revision + 1,
                                      "sha256": sha256_hex(data)}) + "\n").encode()
                # a folder there refused every write of the key
                self._set_aside(f"{META}/{_rev_name(key)}", f"the revision record of {key!r}")
                # the history's lock taken before the value is written, for the same reason
                with self._flock(meta, "history.lock", LOCK_TIMEOUT_SECONDS):
                    # the value first, then its record: a crash in between leaves bytes that do
                    # not match the record, which reads as record + 1, the revision this write
                    # was giving
                    publish(tmp, folder, leaf_of(key), data, durable=self.durable)
                    publish(tmp, meta, _rev_name(key), record, durable=self.durable)
                    # checked: a full disk's short write is ENOSPC (it tore the entry silently),
                    # and the next entry starts on a line of its own
                    logfiles.append_line(history, line, os.fstat(history).st_size,
                                         self.root / HISTORY)
                    if self.durable:
                        os.fsync(history)
            finally:
                os.close(history)
        return entry

    def _open_history(self, root: int) -> int:
        """``context/.history.jsonl`` opened to append (made if missing), an entry planted at
        its name (a folder, a link, a FIFO) set aside first: it refused every write until it
        was removed by hand. InvalidDocument when it still cannot be opened."""
        why = ""
        try:
            self._set_aside(HISTORY, "the history of context writes")
        except OSError as exc:  # the quarantine unusable, the folder held: said below
            why = f"; it could not be set aside: {exc.strerror or exc}"
        try:
            return ownfiles.open_regular(HISTORY, os.O_RDWR | os.O_APPEND | os.O_CREAT,
                                         dir_fd=root)  # (read: whether it ends a line)
        except OSError as exc:
            raise InvalidDocument(f"context/{HISTORY} cannot be appended to ({exc.strerror or exc}: "
                                  f"no regular file?){why}; nothing was written",
                                  code=ErrorCode.NOT_A_REGULAR_FILE) from None


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


def _lock_name(key: str) -> str:
    return "key-" + sha256_hex(key.encode())[:24] + ".lock"


def _rev_name(key: str) -> str:
    return "rev-" + sha256_hex(key.encode())[:24] + ".json"

