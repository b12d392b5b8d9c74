"""Which handoffs retention archived as completed, for the dependency gate (:mod:`.dependencies`).

A completed dependency that retention archived (``handoff archive``, ``[retention] mode =
"archive"``) is completed: ``create --depends-on`` takes it and a dependant runs. The archive
(``handoffs/.archive``, written by :mod:`.archive`) grows by appends and new files, so each file
is read once, its ids only, into sorted arrays of their hashes (:class:`ArchiveIndex`).
"""
from __future__ import annotations

import os
import threading
from array import array
from bisect import bisect_left
from pathlib import Path

from ..core.hashing import digest64
from ..core.workspace import Workspace


class ArchiveIndex:
    """Which handoffs retention archived, and whether the last entry of each says completed:
    each archive file is read once (again when it changes: ``handoffs/.archive`` grows by
    appends and new files) into sorted arrays of 8-byte hashes of its ids (a collision is a
    chance of one in 2**64 per pair), so a lookup reads no archive that did not change, and a
    million archived ids take 8 MB. Only a lookup that finds no completed entry looks at the
    folder again: an id that retention removed from completed/ was in the archive, fsynced,
    before it went. A process's first such lookup reads the whole archive once (as ``handoff
    show`` of an archived id does), its ids only: no document is parsed."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        # file name -> (its stamp when read, ids whose last entry is completed, the other ids)
        self.files: dict[str, tuple[tuple[int, int, int], array[int], array[int]]] = {}
        self.order: list[str] = []  # their names, oldest first (as retention sorts them)
        self.lock = threading.Lock()

    def completed(self, handoff_id: str) -> bool:
        """``handoff_id`` is archived, and its newest entry says it completed."""
        key = _key(handoff_id)
        with self.lock:
            found = self._find(key)
            if not found:  # (a newer entry may say completed: a reused id archived again)
                self._refresh()
                found = self._find(key)
        return bool(found)

    def _find(self, key: int) -> bool | None:
        """True/False: the newest file holding ``key`` says completed/not; None: in none."""
        for name in reversed(self.order):
            _, done, other = self.files[name]
            if _holds(done, key):
                return True
            if _holds(other, key):
                return False
        return None

    @staticmethod
    def read(path: Path) -> dict[str, str]:
        """The state of each id's last entry in the archive file ``path``."""
        from .archive import archived_states
        return archived_states(path)

    def _refresh(self) -> None:
        """Read the archive files that are new or changed since they were read; forget gone
        ones. Files that are not regular files are passed over (their reader refuses them)."""
        from .archive import archive_files  # (only when a dependency is found nowhere else)
        current: dict[str, tuple[Path, tuple[int, int, int]]] = {}
        for path in archive_files(self.ws):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            current[path.name] = (path, (st.st_ino, st.st_size, st.st_mtime_ns))
        for gone in [name for name in self.files if name not in current]:
            del self.files[gone]
        self.order = []
        for name, (path, stamp) in current.items():
            if name not in self.files or self.files[name][0] != stamp:
                states = self.read(path)
                done = sorted(_key(i) for i, state in states.items() if state == "completed")
                other = sorted(_key(i) for i, state in states.items() if state != "completed")
                self.files[name] = (stamp, array("Q", done), array("Q", other))
            self.order.append(name)


def _key(handoff_id: str) -> int:
    """The 8-byte hash an archived id is indexed under."""
    digest = digest64(handoff_id.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest, "big")


def _holds(keys: "array[int]", key: int) -> bool:
    """``key`` is in the sorted array ``keys``."""
    at = bisect_left(keys, key)
    return at < len(keys) and keys[at] == key
