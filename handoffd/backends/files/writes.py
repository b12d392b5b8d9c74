"""The file store's writes besides a claim's transitions: a new handoff published in pending/
(:func:`create`), a document published as it is (:func:`write_new`), a finished document
deleted only if it is still the copy the caller read (:func:`remove_if`), and an unusable file
moved to quarantine with its reason (:func:`quarantine`). Plain functions over the
:class:`Writing` members of :class:`.store.Store`, whose methods of the same names call them.
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from ...core import jsontext
from ...core.documents import check_id
from ...core.errors import DuplicateHandoff, ErrorCode, InvalidDocument
from ...core.states import State
from ...core.timeutil import utc_now
from ...core.workspace import Workspace
from ..base import stamp_created
from . import aside, fsio
from .quarantine import move_to_quarantine
from .seen import SeenIds


class Writing(Protocol):
    """What this module uses of :class:`.store.Store` (which imports this module)."""

    ws: Workspace
    durable: bool
    max_bytes: int
    max_filed_bytes: int
    seen: SeenIds

    @property
    def tmp(self) -> Path: ...

    def path(self, state: State, handoff_id: str) -> Path: ...

    def locate(self, handoff_id: str) -> list[State]: ...

    def encode(self, doc: dict[str, Any], state: State, handoff_id: str) -> bytes: ...

    def quarantine(self, path: Path, code: str, message: str) -> Path: ...


def write_new(store: Writing, state: State, doc: dict[str, Any]) -> None:
    """Publish ``doc`` in ``state`` atomically; DuplicateHandoff if that name is taken."""
    handoff_id = check_id(_doc_id(doc))
    fsio.create_exclusive(store.path(state, handoff_id), store.encode(doc, state, handoff_id),
                          store.tmp, durable=store.durable)


def create(store: Writing, doc: dict[str, Any], handoff_id: str, *,
           now: datetime | None = None, due_at: datetime | None = None) -> str:
    """Submit a new document to pending/; DuplicateHandoff naming the existing copy if taken."""
    now = now or utc_now()
    check_id(handoff_id)
    existing = store.locate(handoff_id)
    if existing:
        raise DuplicateHandoff(
            f"handoff {handoff_id} already exists in {existing[0].value}/; choose another id "
            "or `handoff retry` the existing one", handoff_id=handoff_id)
    if store.seen.contains(handoff_id, now):
        raise DuplicateHandoff(f"handoff id {handoff_id} was used within the last "
                               f"{int(store.seen.ttl)}s; choose another id",
                               handoff_id=handoff_id)
    if aside.holds(store, handoff_id):  # a retry or purge of it is under way: still taken
        raise DuplicateHandoff(f"handoff {handoff_id} is being moved; choose another id",
                               handoff_id=handoff_id)
    stamp_created(doc, handoff_id, now, due_at)  # bookkeeping a document brings is not ours
    data = store.encode(doc, State.PENDING, handoff_id)
    if len(data) > store.max_bytes:  # the daemon would set it aside unread: refuse it now
        raise InvalidDocument(
            f"handoff {handoff_id} would be {len(data)} bytes, over the {store.max_bytes}-byte "
            "limit (raise daemon.max_document_bytes in handoffd.toml if this is intended)",
            handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)
    try:
        fsio.create_exclusive(store.path(State.PENDING, handoff_id), data,
                              store.tmp, durable=store.durable)
    except DuplicateHandoff:
        raise DuplicateHandoff(f"handoff {handoff_id} already exists in pending/",
                               handoff_id=handoff_id) from None
    try:
        store.seen.add(handoff_id, now)
    except (OSError, MemoryError) as exc:  # (LockHeld: its lock held for good by a stopped process)
        # the handoff is created (it runs, and its file keeps the id taken); only the record
        # that outlives it misses the id until a purge records it (a purge records first): a
        # create that failed here after writing made a script submit it twice (a MemoryError,
        # under ulimit -v, exited 1 as well)
        from ...core.logs import log
        why = (f"{os.path.basename(str(exc.filename or ''))}: {exc.strerror or exc}"
               if isinstance(exc, OSError) else "out of memory")
        log.warning("handoff %s: created, but the seen-ids record could not take it now (%s)",
                    handoff_id, why)
    return handoff_id


def remove_if(store: Writing, state: State, handoff_id: str, expect: dict[str, Any]) -> bool:
    """Delete ``handoff_id``'s document in the finished ``state`` if it still is ``expect``.

    The file is first set aside (:mod:`.aside`), so what is compared is what is deleted:
    a document filed in its place meanwhile (a retry that failed again) is never the one
    removed. One that differs is put back."""
    try:
        taken = aside.take(store, state, handoff_id)
    except (FileNotFoundError, FileExistsError):  # gone, or another process has it aside
        return False
    try:
        data, _ = fsio.read_bytes_safely(taken, store.max_filed_bytes)
        same = jsontext.parse_document(data, f"{state.value}/{taken.name}") == expect
    except (OSError, InvalidDocument):
        same = False
    if same:
        os.unlink(taken)
        return True
    aside.put_back(store, taken, state)
    return False


def quarantine(store: Writing, path: Path, code: str, message: str, *,
               now: datetime | None = None) -> Path:
    """Move an unusable file out of the state folders, with a ``.reason.json`` beside it."""
    return move_to_quarantine(
        store.ws.quarantine, path, code, message,
        lambda dst, data: fsio.replace(dst, data, store.tmp, durable=store.durable), now=now)


def _doc_id(doc: dict[str, Any]) -> str:
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("id"), str):
        return block["id"]
    return str(doc.get("handoff_id"))
