"""Reading and listing documents, the files backend's read-only paths, as plain functions.

The store's (:class:`.store.Store`'s methods of the same names call them, with the store as
:class:`Reading`): where a handoff's documents are, its current copy (also while a move or
purge holds it aside), the ids and entries of a state folder, and the reasons of quarantined
files. The backend's (:class:`~handoffd.backends.files.backend.FilesBackend`'s ``list`` and
``peek`` call them): rows by modification time, reading only what is shown, and the trusted
view of a pending document that the scheduler, the listing and a peek all take.
"""
from __future__ import annotations

import errno
import heapq
import os
import stat
import struct
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Protocol

from ...core import jsontext
from ...core.documents import check_id, revision
from ...core.errors import ErrorCode, InvalidDocument, NotFound
from ...core.states import State, winner
from ...core.storage import LiveStamp, trusted_doc
from ...core.workspace import Workspace
from ..base import (
    Backend,
    Describe,
    Doc,
    Meta,
    Order,
    Row,
    Rows,
    UnreadableCopy,
    Where,
    due_of,
    matches,
    safe_describe,
    select,
    updated_of,
)
from . import aside, fsio

# loaded with the store, not when a read fails: out of descriptors (EMFILE), the import
# itself failed, and a good document was taken for an unprocessable one and set aside
from .problems import read_error

# the quarantine listing, kept where readers found it
from .quarantined import MAX_REASON_BYTES, REASON, quarantined  # noqa: F401

# what a document cut short by its writer reads as: still being written while it is young
HALF_WRITTEN = frozenset({ErrorCode.MALFORMED_JSON, ErrorCode.EMPTY_DOCUMENT, ErrorCode.NOT_UTF8})
LIVE = (State.PENDING, State.IN_PROGRESS)
# what an lstat of a document fails with when its folder, not the document, is the matter
CANNOT_LOOK = frozenset({errno.EACCES, errno.EPERM, errno.EIO})
# one file of a live handoff in a stamp: which folder (its index in live_folders), inode, size,
# mtime_ns, ctime_ns; packed (bytes are small, and not tracked by the garbage collector)
_FILE_STAMP = struct.Struct("=BQqqq")


class Reading(Protocol):
    """What this module uses of :class:`.store.Store` (which imports this module)."""

    ws: Workspace
    max_filed_bytes: int
    settle_seconds: float

    def path(self, state: State, handoff_id: str) -> Path: ...

    def read(self, state: State, handoff_id: str) -> dict[str, Any]: ...

    def entries(self, state: State) -> Iterator[os.DirEntry[str]]: ...

    def trusted_revision(self, doc: dict[str, Any], state: State, handoff_id: str,
                         *also: State) -> int: ...


def locate(store: Reading, handoff_id: str) -> list[State]:
    """Every state folder holding a file for ``handoff_id`` (normally exactly one). A folder
    that cannot be looked into (EACCES, EPERM, EIO) raises that OSError, naming it: taken for
    "no such file" (os.path.lexists), it made a handoff read as gone, which ``show`` and
    ``wait`` said with exit 3, what scripts read as "it no longer exists"."""
    found = []
    for state in State:  # (one lstat a folder: a claim and a filing look here)
        try:
            os.lstat(store.path(state, handoff_id))
        except OSError as exc:
            if exc.errno in CANNOT_LOOK:
                raise type(exc)(exc.errno, f"cannot look into {state.value}/ for handoff "
                                f"{handoff_id} ({exc.strerror})", exc.filename) from None
            continue  # ENOENT, or ENOTDIR (a state folder replaced by a file): not there
        found.append(state)
    return found


def get(store: Reading, handoff_id: str) -> tuple[State, dict[str, Any]]:
    """The current state and document of ``handoff_id``; NotFound if it exists nowhere.

    A copy that cannot be read (junk, a folder, a FIFO named like it) is passed over when a
    readable one is there (a completed result stays the answer whatever lies in failed/);
    when every copy is unreadable, :class:`~handoffd.backends.base.UnreadableCopy` names the
    folder of the one the state machine would pick (see :func:`unreadable_copy`)."""
    check_id(handoff_id)
    for _ in range(5):  # a move between our listing and our read is retried
        copies: list[tuple[State, dict[str, Any]]] = []
        unreadable: list[tuple[State, InvalidDocument]] = []
        for state in locate(store, handoff_id):
            try:
                copies.append((state, store.read(state, handoff_id)))
            except FileNotFoundError:
                continue
            except InvalidDocument as exc:
                unreadable.append((state, exc))
        if copies:
            best = winner([(s, store.trusted_revision(d, s, handoff_id)) for s, d in copies])
            return copies[best]
        if unreadable:
            raise unreadable_copy(store, handoff_id, unreadable)
        if locate(store, handoff_id):
            continue  # (moved between the listing and the read)
        held = aside_copy(store, handoff_id)
        if held is not None:  # a retry or purge holds it aside for an instant: still there
            return held
        if not locate(store, handoff_id):  # in no folder, nor aside, on two looks: gone
            break
        # (a retry put it back into pending/ between those looks: read it there)
    raise NotFound(f"no handoff {handoff_id} in {store.ws.handoffs}; `handoff ls` lists them",
                   handoff_id=handoff_id)


def unreadable_copy(store: Reading, handoff_id: str,
                    unreadable: list[tuple[State, InvalidDocument]]) -> UnreadableCopy:
    """The error of the unreadable copy the state machine would pick (completed/ first), its
    message naming the folder (``completed/X.json is not a regular file``). ``settling`` when
    it reads as cut short (empty, bad JSON or UTF-8) and changed within the settle window: a
    producer, or seed 001's consumer (it moves a request into completed/, then rewrites it in
    place), may still be writing it."""
    state, exc = unreadable[winner([(s, 0) for s, _ in unreadable])]
    message = in_folder(str(exc), state, f"{handoff_id}.json")
    settling = False
    if exc.code in HALF_WRITTEN:
        try:
            age = time.time() - os.lstat(store.path(state, handoff_id)).st_mtime
        except OSError:
            age = 0.0  # gone meanwhile: look again
        settling = age < store.settle_seconds
    return UnreadableCopy(message, state=state, settling=settling, handoff_id=handoff_id,
                          code=exc.code, errors=exc.errors)


def in_folder(message: str, state: State, name: str) -> str:
    """A read error's ``message`` that begins with the file's ``name``, with its folder."""
    return f"{state.value}/{message}" if message.startswith(name) else message


def aside_copy(store: Reading, handoff_id: str) -> tuple[State, dict[str, Any]] | None:
    """(state it was taken from, document) of ``handoff_id`` set aside by a move or purge
    under way (``handoff show`` and ``wait`` said "no handoff" in that instant). Only a plain
    folder of the workspace is looked in; a file that is no bounded, parsable document is
    passed over."""
    for state in State:
        folder = aside.existing(store.ws, state)
        if folder is None:
            continue
        path = folder / f"{handoff_id}.json"
        try:
            data, _ = fsio.read_bytes_safely(path, store.max_filed_bytes)
            return state, jsontext.parse_document(data, f"{state.value}/{handoff_id}.json")
        except (OSError, InvalidDocument):
            continue
    return None


def moving_back(store: Reading, handoff_id: str) -> bool:
    """True when the pending copy is one handoffd wrote after the in-progress copy (a newer
    sealed revision, or the in-progress copy is already gone): a move back in flight. A raw
    pending document beside a running one is a duplicate."""
    try:
        back = store.trusted_revision(store.read(State.PENDING, handoff_id), State.PENDING,
                                      handoff_id)
        if back == 0:
            return False
        running = store.read(State.IN_PROGRESS, handoff_id)
    except FileNotFoundError:  # one copy is gone: the move (or a claim) just finished
        return True
    except InvalidDocument:
        return False
    return back > store.trusted_revision(running, State.IN_PROGRESS, handoff_id)


def ids(ws: Workspace, state: State) -> list[str]:
    """Ids of the documents in one state folder (one directory listing)."""
    try:
        with os.scandir(ws.state_dir(state)) as entries:
            return [e.name[:-5] for e in entries if e.name.endswith(".json")]
    except FileNotFoundError:
        return []


def live_folders(ws: Workspace) -> list[Path]:
    """Where live documents are: pending/ and in-progress/, then the folders of documents a
    move set aside from them (those that are plain folders: see :func:`.aside.existing`)."""
    held = [aside.existing(ws, state) for state in LIVE]
    return [ws.state_dir(state) for state in LIVE] + [p for p in held if p is not None]


def live_stamps(ws: Workspace) -> dict[str, LiveStamp | None]:
    """See :meth:`Backend.live_stamps`: every document file of :func:`live_folders`, one lstat
    each, none read. An id's stamp packs each of its files (folder, inode, size, mtime and ctime
    in ns) in folder order, with the latest mtime or ctime of them. It changes with any change
    of its files: every write handoffd makes is a new inode, any write, rename or ``touch``
    changes the ctime (which nobody can set), and a move changes the folders. A file that is
    not a regular file leaves its id unstamped (None): a symlink's target may change under it."""
    stamps: dict[str, LiveStamp | None] = {}
    pack = _FILE_STAMP.pack  # (a loop run once per live document: kept lean)
    for slot, folder in enumerate(live_folders(ws)):
        try:
            listing = os.scandir(folder)
        except (FileNotFoundError, NotADirectoryError):  # nothing live there
            continue
        # (any other error, EMFILE or EIO, raises: a live folder left unlisted would let
        # retention purge what its documents depend on)
        with listing:
            for entry in listing:
                name = entry.name
                if name[-5:] != ".json":
                    continue
                handoff_id = name[:-5]
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # moved since the listing: a later folder may hold it
                    continue
                except OSError:
                    stamps[handoff_id] = None
                    continue
                if not stat.S_ISREG(st.st_mode):
                    stamps[handoff_id] = None
                    continue
                own = pack(slot, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                changed = max(st.st_mtime_ns, st.st_ctime_ns)
                if handoff_id not in stamps:
                    stamps[handoff_id] = (own, changed)
                elif (held := stamps[handoff_id]) is not None:  # a second copy (a move)
                    stamps[handoff_id] = (held[0] + own, max(held[1], changed))
    return stamps


def stamp_of(store: Reading, handoff_id: str) -> LiveStamp | None:
    """See :meth:`Backend.stamp_of`: ``handoff_id``'s file in each state folder (the copies
    :func:`get` chooses from), one lstat each, none read, packed as :func:`live_stamps` packs
    them (the folder is its state's index in ``State``). It changes with any change of them, as
    a live stamp does. None when no state folder holds a file for it (:func:`get` would look
    for a copy held aside), when one is not a regular file or cannot be looked at, and for an
    id that is no safe file name (never a path outside the workspace)."""
    try:
        check_id(handoff_id)
    except InvalidDocument:
        return None
    own, changed = b"", 0
    for slot, state in enumerate(State):
        try:
            st = os.lstat(store.path(state, handoff_id))
        except FileNotFoundError:
            continue
        except OSError:  # EACCES, ENOTDIR (a folder replaced by a file)...: read it, as before
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        own += _FILE_STAMP.pack(slot, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        changed = max(changed, st.st_mtime_ns, st.st_ctime_ns)
    return (own, changed) if own else None


def iter_ids(ws: Workspace, state: State) -> Iterator[str]:
    """The ids of :func:`ids`, read as the listing goes (a folder of 100,000 finished
    documents is never a list in memory)."""
    try:
        with os.scandir(ws.state_dir(state)) as entries:
            for entry in entries:
                if entry.name.endswith(".json"):
                    yield entry.name[:-5]
    except FileNotFoundError:
        return


def entries(ws: Workspace, state: State) -> Iterator[os.DirEntry[str]]:
    """Raw directory entries of a state folder, including files that are not documents."""
    try:
        with os.scandir(ws.state_dir(state)) as found:
            yield from list(found)
    except FileNotFoundError:
        return


def revision_at(path: Path, max_bytes: int) -> int | None:
    """The revision the document at ``path`` says it has (None: unreadable)."""
    try:
        data, _ = fsio.read_bytes_safely(path, max_bytes)
        return revision(jsontext.parse_document(data, path.name))
    except (OSError, InvalidDocument):
        return None


# ---------------------------------------------------------------- the backend's listing
def in_order(stamped: list[tuple[float, State, str]], limit: int | None, *,
             newest: bool) -> Iterator[tuple[float, State, str]]:
    """``stamped`` by (mtime, id), newest or oldest first. A listing usually shows its first
    ``limit`` rows: those are picked with a heap first (sorting 100,000 entries to show 50 took
    a sixth of ``handoff ls``), and the whole list is sorted only if filters skipped too many."""
    def key(s: tuple[float, State, str]) -> tuple[float, str]:
        return s[0], s[2]
    first = 4 * limit + 16 if limit is not None else len(stamped)
    if first >= len(stamped):
        yield from sorted(stamped, key=key, reverse=newest)
        return
    pick = heapq.nlargest if newest else heapq.nsmallest
    yield from pick(first, stamped, key=key)  # the same as the sorted list's head
    yield from sorted(stamped, key=key, reverse=newest)[first:]


def by_claim(backend: Backend, store: Reading, describe: Describe,
             stamps: list[tuple[float, State, str]], unreadable: bool
             ) -> list[tuple[float, State, str]]:
    """``stamps`` with each running handoff placed by its claim (its row's ``updated_at``: the
    ``claimed`` event of its trusted history) rather than its file's mtime. A running handoff's
    file is rewritten at every lease renewal: by its mtime a listing placed it at its last
    renewal, and ``ls --limit`` showed other rows than the database and memory stores, which
    place it at its claim. One read per running handoff (as many as run at once), one document
    held at a time: only the claim time is kept (the rows shown are read again; keeping every
    running row held up to 4 MiB a document for a listing of five)."""
    placed: list[tuple[float, State, str]] = []
    for mtime, st, handoff_id in stamps:
        if st is State.IN_PROGRESS:
            got = row(backend, store, describe, handoff_id, st, unreadable)
            if got is not None and got.problem is None:
                mtime = got.updated_at.timestamp()
        placed.append((mtime, st, handoff_id))
    return placed


def rows(backend: Backend, store: Reading, describe: Describe, *, state: State | None,
         target: str | None, conversation: str | None, parent: str | None,
         since: datetime | None, limit: int | None, order: Order, where: Where | None,
         unreadable: bool, before: datetime | None) -> Rows:
    """The rows of :meth:`Backend.list` (see there) from ``store``'s folders."""
    filters: dict[str, Any] = {"state": state, "target": target, "conversation": conversation,
                               "parent": parent, "since": since, "where": where,
                               "before": before}
    if order == "due":  # by what the documents say: every one is read
        every = [r for _, st, hid in stamped(store, state)
                 if (r := row(backend, store, describe, hid, st, unreadable)) is not None]
        return select([r for r in every if r.problem is None], limit=limit, order=order,
                      **filters)
    # newest/oldest: by modification time, so that only what is shown is read (a listing of
    # a few rows stays cheap with 100,000 finished documents); running ones by their claim
    found: Rows = []
    # a finished document is updated no earlier than its file was written (see row): one
    # written at or after ``before`` need not be read (retention then reads only old ones)
    cut = before.timestamp() if before is not None else None
    stamps = by_claim(backend, store, describe, stamped(store, state), unreadable)
    for mtime, st, handoff_id in in_order(stamps, limit, newest=order == "newest"):
        if limit is not None and len(found) >= limit:
            break
        if cut is not None and st.terminal and mtime >= cut:
            continue
        got = row(backend, store, describe, handoff_id, st, unreadable)
        if got is not None and (got.problem is not None or matches(got, **filters)):
            found.append(got)
    return found


def stamped(store: Reading, state: State | None) -> list[tuple[float, State, str]]:
    """(mtime, state, id) of every document file in ``state`` (all states: None)."""
    found: list[tuple[float, State, str]] = []
    append = found.append  # (a loop run once per finished document: kept lean)
    for st in ([state] if state is not None else State):
        for entry in store.entries(st):
            name = entry.name
            if name[-5:] != ".json":
                continue
            try:
                append((entry.stat(follow_symlinks=False).st_mtime, st, name[:-5]))
            except OSError:  # gone since the listing (or unstattable): nothing to show
                continue
    return found


def row(backend: Backend, store: Reading, describe: Describe, handoff_id: str, state: State,
        unreadable: bool) -> Row | None:
    """The row of ``handoff_id``'s document in ``state``; None when it is gone, or unreadable
    and ``unreadable`` rows are not asked for."""
    path = store.path(state, handoff_id)
    try:
        stamp = datetime.fromtimestamp(os.stat(path, follow_symlinks=False).st_mtime,
                                       timezone.utc)
        doc = read_pending(backend, store, handoff_id) if state is State.PENDING \
            else store.read(state, handoff_id)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a socket, EACCES, invalid JSON...: a row only when asked
        if not unreadable:
            return None
        now = datetime.now(timezone.utc)
        return Row(handoff_id, state, {}, Meta(None), now, now,
                   problem=read_error(path, exc, handoff_id))
    # the row keeps the document as stored (retention archives it and deletes only that);
    # what is derived from it (routing, parent, times) comes from its trusted view: a
    # forged history must not make a filing look new for ever, nor a forged parent keep it
    view = doc if state is State.PENDING else trusted_doc(backend, state, handoff_id, doc)
    updated = updated_of(view, stamp)
    if state.terminal and stamp > updated:
        # filed after our last event (a foreign filing has none of ours: seed 001's own
        # consumer writes completed/ itself): retention ages it from its filing
        updated = stamp
    return Row(handoff_id, state, doc, safe_describe(describe, view),
               due_of(view, stamp), updated)


def read_pending(backend: Backend, store: Reading, handoff_id: str) -> Doc:
    """A pending document as the scheduler and the listing see it (its trusted view): a
    ``handoffd`` block that handoffd did not write there (no valid seal for pending/) is
    only a foreign document's claim to bookkeeping, so it is left out, as the claim leaves
    it out; otherwise a forged ``next_attempt_at``, ``awaiting`` or ``waiting_children``
    would hold or park it."""
    return trusted_doc(backend, State.PENDING, handoff_id, store.read(State.PENDING, handoff_id))


def peek(backend: Backend, store: Reading, handoff_id: str) -> Doc | None:
    """See :meth:`Backend.peek`: a pending document's trusted view, None when it is gone; an
    UnreadableDocument (saying why) when it cannot be read."""
    try:
        return read_pending(backend, store, handoff_id)
    except FileNotFoundError:
        return None
    except Exception as exc:  # one bad file must never stop the scheduler or `handoff ls`
        raise read_error(store.path(State.PENDING, handoff_id), exc, handoff_id) from exc
