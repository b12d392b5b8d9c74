"""Shared records on disk: one JSON file per kind under ``handoffs/.meta/`` (``paused.json``,
``rates.json``...), replaced atomically (a temp file and a rename) under an exclusive ``flock``
of ``.<kind>.lock``, so updates of every process of the workspace are serialised and readers
never see half a file. Reads are lock-free and cached by the file's inode, mtime and size."""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from . import fsio
from .fsio import MAX_DEPTH, locked, nesting_depth

MAX_RECORDS_BYTES = 16 * 1024 * 1024  # a kind's whole file (rates, pauses, reservations)

KIND = re.compile(r"[a-z][a-z0-9_-]{0,40}")  # fullmatch ("$" matched before a final newline)


class FileRecords:
    """:class:`~handoffd.core.storage.Records` in ``folder`` (the workspace's ``.meta``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}

    def path(self, kind: str) -> Path:
        """The file of ``kind``."""
        if not KIND.fullmatch(kind):
            raise ValueError(f"record kind {kind!r}")
        return self.folder / f"{kind}.json"

    def read(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind`` (an unreadable file reads as empty: never a stuck queue)."""
        path = self.path(kind)
        try:
            info = path.stat()
        except FileNotFoundError:
            return {}
        # every update is a new file (a rename), so its inode tells two writes apart even
        # within one tick of the file system's clock
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        cached = self._cache.get(kind)
        if cached is None or cached[0] != stamp:
            cached = (stamp, _load(path))
            self._cache[kind] = cached
        return copy.deepcopy(cached[1])

    def update(self, kind: str, key: str, change: Callable[[Any], Any]) -> Any:
        """Replace one record under the kind's lock."""
        path = self.path(kind)
        self.folder.mkdir(parents=True, exist_ok=True)
        with locked(self.folder / f".{kind}.lock"):
            records = _load(path)
            old = records.get(key)
            new = change(copy.deepcopy(old))
            if new == old:
                return new  # nothing changed: no write (a sweep asks every few seconds)
            if new is None:
                records.pop(key, None)
            else:
                records[key] = new
            tmp = path.with_name(f".{kind}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, path)  # readers see the old file or the new one, never half
            return new


def _load(path: Path) -> dict[str, Any]:
    """The records in ``path``; an unreadable file, or one that is not an object or nests
    deeper than any record does (its copies would exhaust the recursion limit), is empty."""
    try:
        loaded = json.loads(fsio.read_regular(path, MAX_RECORDS_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(loaded, dict) or nesting_depth(loaded, MAX_DEPTH) > MAX_DEPTH:
        return {}
    return loaded
