"""The parked copies a PostgreSQL workspace's file bridge (:mod:`.bridge`) writes back.

A handoff this workspace ingested that is parked (needs_clarification, blocked: waiting
for its requester) is written back into pending/ as the files store keeps it there, its
report in handoffd.awaiting.outcome where file readers find it. The copy is sealed for
PARKED, not for pending/: ingesting knows it for ours (never a new drop, nor a duplicate,
nor a document `db import` may trust), and a copy the row no longer stands behind (it was
answered, cancelled, finished, purged) is removed, never ingested.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from ...core.documents import BOOK, book, check_id, is_safe_id, revision
from ...core.errors import DuplicateHandoff, InvalidDocument
from ...core.events import last_entry
from ...core.states import State
from ..files import fsio, seals
from ..files.store import Store
from .backend import PostgresBackend

__all__ = ["PARKED", "ParkedCopies"]

log = logging.getLogger("handoffd")

# what a parked copy the bridge writes into pending/ is sealed for, in place of a folder: no
# document sealed for pending/ (`db import`'s) or dropped there carries it
PARKED = "pending (parked copy)"


class ParkedCopies:
    """The parked copies of a :class:`~.bridge.FileBridge` (mixed into it, which sets what
    they use)."""

    backend: PostgresBackend
    store: Store
    origin: str
    quiet: bool
    _ours: set[str]
    _files: threading.Lock  # (terminal and parked files are written one at a time)

    def ingest(self, handoff_id: str) -> str:
        """The bridge's ingest (see :meth:`.bridge.FileBridge.ingest`)."""
        raise NotImplementedError

    def park(self, ids: list[str] | None = None) -> int:
        """Write the documents of this workspace's parked handoffs into pending/ (``ids``: only
        those) where no current copy is; returns how many were written. A file there that is
        not a parked copy of ours (a drop) is never replaced: ingesting judges it."""
        key = self.store.key
        if key is None:  # nothing can be sealed: a copy would be read as a new drop
            return 0
        written = 0
        for handoff_id, entry in self.backend.parked(self.origin, ids=ids):
            try:
                check_id(handoff_id)  # (an id from the database becomes a path)
                with self._files:
                    written += self._write_parked(handoff_id, entry, key)
            except InvalidDocument:
                continue  # an unsafe id, or a row Python cannot load: no file for it
            except OSError as exc:  # disk full, permissions: the next scan tries again
                if not self.quiet:
                    log.error("cannot write pending/%s.json (parked): %s; will try again",
                              handoff_id, exc)
        return written

    def _write_parked(self, handoff_id: str, entry: Any, key: bytes) -> bool:
        """Write the parked ``handoff_id``'s document (its newest history ``entry`` as the
        database holds it) into pending/ unless the file there is its current copy or is not
        ours; True when written."""
        path = self.store.path(State.PENDING, handoff_id)
        try:
            before: os.stat_result | None = os.stat(path)
            held = self.store.read(State.PENDING, handoff_id)
        except FileNotFoundError:
            before = held = None
        except InvalidDocument:
            return False  # a drop being written, or a broken one: ingesting judges it
        if held is not None and (not self._is_parked_copy(handoff_id, held)
                                 or last_entry(held) == entry):
            return False
        found = self.backend.get(handoff_id)
        if found is None or found[0] is not State.PENDING or last_entry(found[1]) != entry:
            return False  # moved on meanwhile: the next wake-up or scan looks again
        doc = dict(found[1])
        doc[BOOK] = {k: v for k, v in book(found[1]).items() if k != "seal"}
        doc[BOOK]["seal"] = seals.seal_for(key, handoff_id, revision(doc), PARKED)
        data = fsio.dump_json(doc)
        if before is None:
            try:
                fsio.create_exclusive(path, data, self.store.tmp, durable=self.store.durable)
            except DuplicateHandoff:  # a file dropped meanwhile: ingesting judges it
                return False
            return True
        replaced = fsio.replace_exact(path, data, self.store.tmp, durable=self.store.durable,
                                      expect=before.st_ino)
        if replaced is None:  # replaced by someone else meanwhile: theirs is kept
            return False
        if replaced[1] is not None:
            fsio.unlink(replaced[1], durable=False)  # (our older copy, moved aside)
        return True

    def _is_parked_copy(self, handoff_id: str, doc: dict[str, Any]) -> bool:
        """Whether ``doc`` (read from pending/) is a parked copy this bridge sealed there."""
        return seals.sealed(self.store.key, doc, handoff_id, revision(doc), (PARKED,))

    def _parked_current(self, handoff_id: str, doc: dict[str, Any],
                        before: os.stat_result) -> bool:
        """Whether the parked copy ``doc`` (pending/``handoff_id``.json as ``before`` saw it)
        is still its row's (pending, with the same newest history entry); if not, it is
        removed (unless another file was put in its place meanwhile: ingesting judges that)."""
        held = self.backend.finished_entry(handoff_id)
        if held is not None and held[0] == State.PENDING.value and held[1] == last_entry(doc):
            return True
        with self._files:
            self._remove_if_same(self.store.path(State.PENDING, handoff_id), before)
        return False

    def _unpark(self, handoff_id: str) -> None:
        """Remove pending/``handoff_id``.json if it is a parked copy this bridge wrote (its
        handoff finished); a file dropped under that id is left to ingesting."""
        path = self.store.path(State.PENDING, handoff_id)
        try:
            before = os.stat(path)
            doc = self.store.read(State.PENDING, handoff_id)
        except (FileNotFoundError, InvalidDocument):
            return
        if self._is_parked_copy(handoff_id, doc):
            self._remove_if_same(path, before)

    @staticmethod
    def _remove_if_same(path: Path, before: os.stat_result, *, inode_only: bool = False) -> bool:
        """Remove ``path`` if it is still the file ``before`` saw (a replace is a new inode;
        ``inode_only``: a write to the same file since, which ingesting stood behind, counts
        as the same file)."""
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino) or (
                not inode_only and now.st_mtime_ns != before.st_mtime_ns):
            return False
        return fsio.unlink(path, durable=False)

    def reparked(self, handoff_id: str) -> None:
        """``handoff_id`` went back to pending (parked, answered, retried...; on any host):
        its parked copy here is removed if the row moved on, written if it is parked now
        (only for a handoff this process ingested: the others' wait for the next scan)."""
        if not is_safe_id(handoff_id):
            return
        if self.store.path(State.PENDING, handoff_id).exists():
            self.ingest(handoff_id)  # (a parked copy: kept or removed; a drop: ingested)
        if handoff_id in self._ours:
            self.park([handoff_id])
