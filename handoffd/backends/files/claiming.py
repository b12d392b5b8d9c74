"""How the file store claims one pending document once it holds the document's lock
(:meth:`.store.Store.claim` takes the lock and calls :func:`claim_held`): the rename into
in-progress/, the read of what was renamed, and the lease write that replaces exactly that file.
A file still being written goes back to pending/; one a full disk keeps from being leased goes
back at once, and so does one claimed while descriptors or memory run short (EMFILE, ENFILE,
ENOMEM, a MemoryError): :class:`~handoffd.core.errors.ClaimShortage`, no attempt counted.
Part of the hot path: one rename, one read, one replacing write.
"""
from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Protocol

from ...core import jsontext
from ...core.documents import BOOK, book, book_int, raw_book, record
from ...core.errors import (
    ClaimShortage,
    DocumentNotReady,
    DuplicateHandoff,
    ErrorCode,
    SHORTAGE_ERRNOS,
    InvalidDocument,
    NotDue,
    UnreadableDocument,
    claim_shortage,
)
from ...core.memorystrikes import claim_out_of_memory, memory_strikes
from ...core.states import State
from ..base import check_due
from . import fsio, reading
from .crashpoints import crash_point
from .leases import Claim, NullLock, lease

__all__ = ["Claiming", "claim_held", "short_of"]


class Claiming(reading.Reading, Protocol):
    """What this module uses of :class:`.store.Store` (which imports this module)."""

    durable: bool
    max_open_bytes: int

    @property
    def tmp(self) -> Path: ...

    def owner_lock(self) -> str: ...

    def file(self, state: State, handoff_id: str) -> str: ...

    def encode(self, doc: dict[str, Any], state: State, handoff_id: str) -> bytes: ...

    def check_request_size(self, doc: dict[str, Any], data: bytes, name: str) -> None: ...


def claim_held(store: Claiming, handoff_id: str, held: int | None, lease_seconds: float,
               now: datetime, on_claim: Callable[[dict[str, Any]], None] | None,
               due_only: bool = False) -> tuple[Claim | None, str | None]:
    """:meth:`.store.Store.claim` once the pending document is locked (``held``: its
    descriptor, None where it cannot be locked): the claim and where the file it replaced now
    is. ``due_only``: NotDue, the file put back as it came, when the trusted
    ``next_attempt_at`` of what was renamed is still to come."""
    # (str paths: each is only handed to os, so no Path is built for them)
    src, dst = store.file(State.PENDING, handoff_id), store.file(State.IN_PROGRESS, handoff_id)
    try:
        fsio.rename_noreplace(src, dst)
    except FileNotFoundError:
        return None, None
    except FileExistsError:
        if reading.moving_back(store, handoff_id):
            # a move back to pending/ (a retry, an answer, a hand-back) writes the pending
            # copy a moment before it removes the in-progress one: not a duplicate to set
            # aside (that would lose the handoff), just not claimable for a moment
            raise DocumentNotReady(f"{handoff_id} is being put back in pending/",
                                   handoff_id=handoff_id) from None
        raise DuplicateHandoff(f"handoff {handoff_id} is already in progress",
                               handoff_id=handoff_id) from None
    crash_point("after-claim-rename")
    try:
        doc, renamed = _read_claimed(store, handoff_id, held, src, dst, now)
        memory_strikes.clear(handoff_id, "claim")  # (a MemoryError row ends)
        prior, token, attempt, data = _leased(store, doc, handoff_id, lease_seconds, now,
                                              on_claim, due_only)
    except FileNotFoundError:  # moved on since our rename (by a writer taking no lock)
        return None, None
    except NotDue:  # its own back-off (set since the caller read it): as it came, at once
        _put_back(dst, src)
        raise
    except OSError as exc:
        if exc.errno not in SHORTAGE_ERRNOS:
            raise  # (a socket, EACCES: the caller says what the renamed file is)
        _put_back(dst, src)  # as it came, at once: nothing was written, nothing counted
        raise short_of(handoff_id, exc) from None
    except MemoryError:
        raise _out_of_memory(handoff_id, src, dst) from None
    try:
        written = fsio.replace_exact(dst, data, store.tmp, durable=store.durable,
                                     expect=renamed)
    except OSError as exc:  # (a full disk): the request as it came, back in pending/ at once,
        _put_back(dst, src)  # not after a recovery's grace (it is still ours: held)
        if exc.errno in SHORTAGE_ERRNOS:  # (its temp file: no descriptor to spare)
            raise short_of(handoff_id, exc) from None
        raise
    except MemoryError:  # (writing its temp file): as one met reading it, before its lease
        raise _out_of_memory(handoff_id, src, dst) from None
    if written is None:  # not the file we renamed in (moved on meanwhile): someone else's
        return None, None
    inode, displaced = written
    return Claim(handoff_id, doc, token, NullLock(), attempt, inode, prior), displaced


def _leased(store: Claiming, doc: dict[str, Any], handoff_id: str, lease_seconds: float,
            now: datetime, on_claim: Callable[[dict[str, Any]], None] | None,
            due_only: bool = False) -> tuple[int, str, int, bytes]:
    """Mark the claimed ``doc`` (its attempt, lease and ``claimed`` event, its format's marks)
    and encode it for in-progress/: (its trusted prior revision, the lease token, the attempt,
    the bytes the lease write puts in place). The claim rides on the store's owner lock, named
    in its lease. Nothing is written here. ``due_only``: NotDue when its (trusted) retry time
    is still to come (:func:`~handoffd.backends.base.check_due`), before anything is marked."""
    prior = store.trusted_revision(doc, State.PENDING, handoff_id)
    if prior == 0:  # raw: whatever `handoffd` block it carries came from outside; ours names
        doc[BOOK] = raw_book(handoff_id)  # the file it was dropped as (its answer names it)
    if due_only:
        check_due(doc, handoff_id, now)
    token = os.urandom(16).hex()
    block = book(doc)
    block["attempt"] = book_int(doc, "attempt", 0) + 1
    block["lease"] = lease(token, now, lease_seconds, lock=store.owner_lock())
    block.pop("next_attempt_at", None)
    record(doc, "claimed", now, attempt=block["attempt"])
    if on_claim is not None:
        on_claim(doc)  # format-specific marks, e.g. seed 001's status/started_at
    # the rename into in-progress/ need not be durable: if a crash undoes it, the handoff
    # is simply pending again, or in-progress without a lease, which recovery hands back
    return prior, token, block["attempt"], store.encode(doc, State.IN_PROGRESS, handoff_id)


def short_of(handoff_id: str, exc: OSError) -> ClaimShortage:
    """The claim of ``handoff_id`` given up for ``exc``, a passing shortage of descriptors or
    memory (SHORTAGE_ERRNOS); the caller has left (or put) the document in pending/."""
    return claim_shortage(handoff_id, exc)


def _out_of_memory(handoff_id: str, src: str, dst: str) -> ClaimShortage | UnreadableDocument:
    """A MemoryError claiming ``handoff_id`` (reading, marking or encoding it), counted as a
    strike as one reading it is (:func:`~handoffd.core.memorystrikes.claim_out_of_memory`): put
    back in pending/ with the memory back-off; only once the strikes' bound is reached is the
    UnreadableDocument returned, the document left in in-progress/ for the caller to set
    aside."""
    problem = claim_out_of_memory(handoff_id)
    if isinstance(problem, ClaimShortage):
        _put_back(dst, src)
    return problem


def _read_claimed(store: Claiming, handoff_id: str, held: int | None, src: str, dst: str,
                  now: datetime) -> tuple[dict[str, Any], int]:
    """The document just renamed to ``dst``, and the inode the lease write may replace:
    the locked one (``held``) when there is one, else the one read. (Were they different,
    pending/ had another file put in at the instant of the claim: the lease write then gives
    the claim up, and the sweep hands back the file nobody locked.) A file still being
    written goes back to ``src`` (DocumentNotReady). With a lock, the file is read through its
    descriptor, the inode the lease write may replace (no second open: the renamed file is
    that inode, else the lease write gives the claim up without using what was read)."""
    name = f"pending/{handoff_id}.json"
    try:
        if held is not None:
            info = os.fstat(held)
            if os.lstat(dst).st_ino == info.st_ino:
                data = fsio.read_open(held, info, store.max_open_bytes, f"{handoff_id}.json")
            else:  # a file renamed over the locked one before our rename: what we renamed is
                # that one, judged on its own bytes (never on the locked file's), and the lease
                # write then gives the claim up (it is not the locked inode)
                data, _ = fsio.read_bytes_safely(dst, store.max_open_bytes)
        else:
            data, info = fsio.read_bytes_safely(dst, store.max_open_bytes)
        doc = jsontext.parse_document(data, name)
        store.check_request_size(doc, data, name)
    except InvalidDocument as exc:
        if exc.code in (ErrorCode.MALFORMED_JSON, ErrorCode.EMPTY_DOCUMENT, ErrorCode.NOT_UTF8) \
                and _young(store, dst, now):
            _put_back(dst, src)
            raise DocumentNotReady(f"{handoff_id} is still being written",
                                   handoff_id=handoff_id) from None
        raise
    return doc, info.st_ino


def _young(store: Claiming, path: str, now: datetime) -> bool:
    """True when ``path`` was written less than the store's settle time before ``now``."""
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    return now.timestamp() - mtime < store.settle_seconds


def _put_back(dst: str, src: str) -> None:
    """Rename a claimed file back into pending/, unless a newer pending copy is there."""
    try:
        fsio.rename_noreplace(dst, src)
    except FileExistsError:
        pass  # a newer pending copy appeared; recovery resolves the pair
