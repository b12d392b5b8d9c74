"""The files backend: the :class:`Backend` interface over the file store (handoffs/ state folders).

Every mechanism of the file protocol stays inside :class:`handoffd.backends.files.store.Store` and
the modules beside it: atomic non-overwriting writes, claims by ``rename(RENAME_NOREPLACE)``, a
flock per claim, leases fenced by the in-progress file's inode, seals, the settle window for
half-written files and the seen-ids record. What the engine gets back is neutral: a
:class:`Claim` whose ``handle`` is the store's claim (with its lock).

This module holds the interface, creating and changing documents, cancel requests, the seen ids
and wake-ups; :mod:`.claims` has the claim, lease and recovery path (claim-next's cache of
pending files, the lease watch) and :mod:`.reading` the listing and reading path. Its methods
call theirs.
"""
from __future__ import annotations

import builtins
import copy
import os
import time
import weakref
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection

from ...core import jsontext, ownfiles, recurring
from ...core.documents import revision
from ...core.errors import SHORTAGE_ERRNOS, DuplicateHandoff, InvalidTransition, NotFound
from ...core.logs import log
from ...core.ownfiles import folder_refusal, not_a_folder, open_beneath
from ...core.states import FOLDER_NAMES, State
from ...core.storage import LOST, LiveStamp, Wakeup, trusted_doc
from ...core.workspace import Workspace
from ..base import (
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    FencedFiling,
    Order,
    Rows,
    Subscribers,
    WakeupCallback,
    Where,
    describe_native,
    wait_via_feed,
)
from . import fsio, reading, seals, unrun
from .leases import CLOCK_TOLERANCE_SECONDS, release_lock
from .reading import in_order as _in_order
from .records import FileRecords
from .store import Store
from .watch import FolderWatch

if TYPE_CHECKING:
    from .claims import Claimer

__all__ = ["FilesBackend", "CLOCK_TOLERANCE_SECONDS", "MAX_RECORD_BYTES", "_in_order"]

MAX_RECORD_BYTES = 1 << 20  # a cancel marker or other small record of .meta/, read whole


# handoffs/.meta/cancel: where cancel requests are kept (features.cancellation keeps them too)
_CANCEL_PARTS = (".meta", "cancel")

class FilesBackend(FencedFiling, Backend):
    """One workspace's handoffs/ folders. ``monotonic`` judges how long this process has watched
    another owner's lease go unrenewed (a clock that never steps); ``watch`` enables watchdog
    hints of other processes' writes for subscribers."""

    # processes forked after it was opened may each use it (handoffd.service.spread): it opens
    # its files when first used, and forgets inherited spares and folder handles after a fork
    forkable = True

    def __init__(self, store: Store, *, describe: Describe = describe_native,
                 monotonic: Callable[[], float] = time.monotonic, watch: bool = True,
                 claim_grace_seconds: float = 10.0, sweep_seconds: float = 10.0) -> None:
        self.store = store
        self.claim_grace_seconds = claim_grace_seconds
        # the workspace's sweep period (handoffd.toml's): a wait on junk in in-progress/ gives
        # a daemon the claim grace plus one sweep to set it aside (see base._Looks)
        self.sweep_seconds = sweep_seconds
        self.ws = store.ws
        self.describe = describe
        self.monotonic = monotonic
        self._subscribers = Subscribers()
        self._watch = FolderWatch(self._folders(), self._subscribers.fire) if watch else None
        self._records = FileRecords(self.ws.meta)  # pauses, rate buckets: .meta/<kind>.json

    @classmethod
    def open(cls, workspace: Workspace, *, describe: Describe = describe_native,
             monotonic: Callable[[], float] = time.monotonic, watch: bool = True,
             claim_grace_seconds: float = 10.0, sweep_seconds: float = 10.0,
             ensure: bool = True, **store_options: Any) -> "FilesBackend":
        """A backend on ``workspace`` (its folders are created unless ``ensure`` is False);
        ``store_options`` go to Store. ConfigError (one line, exit 2) when a state folder is
        a symlink, no folder, or another's (:meth:`Workspace.check_state_folders`): the daemon
        must not start filing results through it."""
        if ensure:
            workspace.ensure()
        else:
            workspace.check_state_folders()
        return cls(Store(workspace, **store_options), describe=describe, monotonic=monotonic,
                   watch=watch, claim_grace_seconds=claim_grace_seconds,
                   sweep_seconds=sweep_seconds)

    @cached_property
    def _claimer(self) -> Claimer:
        """The claim, lease and recovery path (:mod:`.claims`), made when first used: a
        one-shot command that only reads or creates never loads it."""
        from .claims import Claimer
        # a proxy, not the backend itself: a cycle would keep a dropped backend (its seen-ids
        # lock, its open files) alive until the cyclic collector happens to run
        return Claimer(weakref.proxy(self), self.store, describe=self.describe,
                       monotonic=self.monotonic)

    def _folders(self) -> dict[Path, str]:
        return {self.ws.state_dir(State.PENDING): State.PENDING.value,
                self.ws.state_dir(State.COMPLETED): State.COMPLETED.value,
                self.ws.state_dir(State.FAILED): State.FAILED.value,
                self._cancel_dir(): "cancel"}

    # ------------------------------------------------------------ creating and reading
    def prepare(self) -> None:
        """See Backend.prepare: the rename that publishes a new document needs renameat2, and
        every write the seal key (ConfigError, one line, when it is unusable)."""
        fsio.load_renameat2()
        _ = self.store.key

    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        self.store.create(copy.deepcopy(doc), handoff_id, now=now, due_at=due_at)
        self._subscribers.fire(handoff_id, State.PENDING.value)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        try:
            state, doc = self.store.get(handoff_id)
        except NotFound:
            return None
        return state, trusted_doc(self, state, handoff_id, doc)

    def trusted_book(self, state: State, handoff_id: str, doc: Doc) -> Doc | None:
        """See Backend.trusted_book: the block when its seal matches the folder it was read
        from. A claim renames a pending document into in-progress/ before it writes its lease
        (and seed 001's own consumer claims by that rename alone), so in-progress/ also takes a
        document sealed for pending/, as the sweep's recovery does. A document in completed/ or
        failed/ is handoffd's only when handoffd filed it there. Without a seal key no document
        here was ever sealed, and no block is vouched for."""
        folders = (state.value, State.PENDING.value) if state is State.IN_PROGRESS \
            else (state.value,)
        return seals.own_block(self.store.key, doc, handoff_id, folders)

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest", where: Where | None = None,
             unreadable: bool = False, before: datetime | None = None) -> Rows:
        return reading.rows(self, self.store, self.describe, state=state, target=target,
                            conversation=conversation, parent=parent, since=since, limit=limit,
                            order=order, where=where, unreadable=unreadable, before=before)

    # ------------------------------------------------------------ claims (see .claims)
    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        return self._claimer.claim_next(targets, now, lease_seconds, exclude=exclude,
                                        prepare=prepare)

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        """As :meth:`Backend.claim`. Files may also raise what :meth:`Store.claim` raises:
        DocumentNotReady (still being written; put back), DuplicateHandoff (an in-progress copy
        exists) and InvalidDocument (unreadable; left in in-progress/ for the caller to set
        aside)."""
        return self._claimer.claim(handoff_id, now, lease_seconds, prepare=prepare,
                                   due_only=due_only)

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        return self._claimer.renew(claim, now, lease_seconds)

    def broken_claims(self, claims: Collection[Claim]) -> builtins.list[Claim]:
        """Those of ``claims`` riding on an owner lock this process may have lost (see
        :meth:`.claims.Claimer.broken_claims`): the caller fences them."""
        return self._claimer.broken_claims(claims)

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        if not self.store.finish(claim.handle, state, doc):
            return False
        self._claimer.released(claim.id)
        self._subscribers.fire(claim.id, FOLDER_NAMES[state])
        return True

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        return self._claimer.expired_claims(now, lease_seconds)

    # ------------------------------------------------------------ what the engine and sweeper add
    def ids(self, state: State) -> builtins.list[str]:
        return self.store.ids(state)

    def live_stamps(self) -> dict[str, LiveStamp | None]:
        """See Backend.live_stamps: the documents of pending/, in-progress/ and of
        ``.meta/aside/pending|in-progress/`` (a move that died there leaves its document for a
        minute before the sweep puts it back), each stamped by its files' identity (inode,
        size, mtime and ctime): see :func:`.reading.live_stamps`."""
        return reading.live_stamps(self.ws)

    def stamp_of(self, handoff_id: str) -> LiveStamp | None:
        """See Backend.stamp_of: its files' identity in every state folder, one lstat each
        (see :func:`.reading.stamp_of`)."""
        return reading.stamp_of(self.store, handoff_id)

    def peek(self, handoff_id: str) -> Doc | None:
        return reading.peek(self, self.store, handoff_id)

    def abandon(self, claim: Claim) -> None:
        release_lock(claim.handle.lock)
        self.store.give_up(claim.token)  # its lease names our owner lock, which stays held

    def abandon_unrun(self, claim: Claim) -> None:
        """:meth:`abandon`, the claim marked given up unrun for every process's recovery
        (:mod:`.unrun`: a mark made without a descriptor, as the shortage that refused its
        hand-back lasts)."""
        if claim.token is not None:
            unrun.mark(self.ws, claim.id, claim.token)
        self.abandon(claim)

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        try:
            return self._claimer.quarantine(state, handoff_id, code, message)
        except OSError:
            if state is State.IN_PROGRESS and claim is None:
                self._give_back_unreadable(handoff_id)
            raise
        finally:
            if claim is not None:
                claim.handle.finished = True
                release_lock(claim.handle.lock)

    def _give_back_unreadable(self, handoff_id: str) -> None:
        """A document claimed, then found unreadable, that cannot be set aside now (the
        quarantine folder is full, unwritable, or no folder): back to pending/, to be looked
        at again. In in-progress/ without a lease nothing ever looked at it again."""
        try:
            fsio.rename_noreplace(self.store.path(State.IN_PROGRESS, handoff_id),
                                  self.store.path(State.PENDING, handoff_id))
        except OSError as exc:  # a new pending copy, or gone: the sweep's duplicate rules
            log.warning("handoff %s: cannot put its unreadable document back into pending/: %s",
                        handoff_id, exc)

    def quarantined(self) -> builtins.list[Doc]:
        return self.store.quarantined()

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        if self.store.locate(handoff_id):
            return False
        try:
            self.store.write_new(State.FAILED, doc)
        except DuplicateHandoff:
            return False
        self._subscribers.fire(handoff_id, State.FAILED.value)
        return True

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        if not os.path.lexists(self.store.path(State.FAILED, handoff_id)):
            return False
        try:
            # only the failure the caller read: one filed again meanwhile is not this retry's
            self.store.move(handoff_id, State.FAILED, State.PENDING, doc,
                            replaces=revision(doc) - 1)
        except (FileNotFoundError, FileExistsError):  # gone, or moved or filed again meanwhile
            return False
        self._subscribers.fire(handoff_id, State.PENDING.value)
        return True

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        if not state.terminal:
            raise InvalidTransition(f"handoff {handoff_id}: only finished handoffs are purged",
                                    handoff_id=handoff_id)
        self.store.folders.check()  # never removed (nor recorded) through a swapped folder
        self.store.seen.add(handoff_id, now)  # first: dedup must outlive the document
        if expect is not None:
            return self.store.remove_if(state, handoff_id, expect)
        try:
            os.unlink(self.store.path(state, handoff_id))
        except FileNotFoundError:
            return False
        return True

    def records(self) -> FileRecords:
        return self._records

    def maintain(self, now: datetime, *,
                 skip: Collection[str] = ()) -> dict[str, builtins.list[str]]:
        # first: a folder of handoffs/ swapped for a link since the last look is set aside and
        # made again (a missing one made) before anything is watched, listed or repaired through
        # it (an OSError here skips this sweep's repairs)
        self.store.folders.check_all(make_missing=True)
        if self._watch is not None and len(self._subscribers) and not self._watch.alive():
            # a folder left unwatched (no inotify watches left, pending/ replaced before it could
            # be watched again) is added to the running watch, said once (in .inotify)
            again = self._watch.rewatch()
            if again is None:
                log.warning("the file watch died; restarting it (and rescanning)")
                self._watch.stop()
                try:
                    self._watch.start()
                except OSError as exc:  # e.g. no inotify instances left: rescans see files
                    log.error("cannot restart the file watch: %s; relying on rescans", exc)
            if again != 0:
                self._subscribers.fire("", LOST)
        from .repair import repair  # (the sweep's: a one-shot command never loads it)
        return repair(self.store, now, claim_grace_seconds=self.claim_grace_seconds,
                             skip=skip)

    def takeover_watch(self, lease_seconds: float) -> builtins.list[float]:
        """When (on this process's monotonic clock) each in-progress claim without a lease may
        be handed back by a sweep's repair (:func:`.repair.unleased_dues`): a batch waits for
        them before it ends, bounded by ``claim_grace_seconds``, as it waits for a PostgreSQL
        store's watched claims. ``lease_seconds``: unused (the store's signature)."""
        from .repair import unleased_dues  # (a one-shot command never loads the repairs)
        tick = time.monotonic()
        return [tick + left for left in unleased_dues(self.store, self.claim_grace_seconds)]

    # ------------------------------------------------------------ cancel requests
    # ``.meta/cancel`` is read, written and cleared only as a folder of the workspace itself,
    # through a descriptor opened without following a link: a symlink planted there once made
    # every daemon delete the ``*.json`` files of the folder it pointed to (a project's
    # package.json) as requests for unknown handoffs
    _cancel_refusal_said = False  # the one error line for a .meta/cancel that is no folder
    _CANCEL_REFUSED = "no cancel request is read, recorded or removed there"

    def _cancel_dir(self) -> Path:
        return self.ws.handoffs.joinpath(*_CANCEL_PARTS)  # (features.cancellation's too)

    @cached_property
    def _cancel_folder(self) -> str:
        return str(self._cancel_dir())

    @cached_property
    def _cancel_shortages(self) -> recurring.Recurring:
        """A passing shortage opening ``.meta/cancel`` (EMFILE, ENFILE, ENOMEM): one WARNING
        while it lasts, said again at most once a minute (by :attr:`monotonic`), and one line
        when the folder opens again (:mod:`handoffd.core.recurring`); it was an ERROR, said
        again each time an open worked in between, and its end unsaid."""
        return recurring.Recurring(quiet=recurring.QUIET_SECONDS)

    def _open_cancel_folder(self) -> int | None:
        """A descriptor of ``.meta/cancel`` itself; None when it is missing, or when it is no
        plain folder (a symlink...): then nothing is read or removed through it, said once.
        None too while a passing shortage keeps it from being opened, said as one (see
        :attr:`_cancel_shortages`) here only: the cancel requests' poll gets no requests, and
        says nothing of it."""
        kind = f"opening {self._cancel_folder}"
        with recurring.sweeping(self._cancel_shortages, self.monotonic):
            try:
                self.store.folders.check()  # (.meta swapped for a link: put right first)
                fd = open_beneath(self.ws.handoffs, _CANCEL_PARTS)  # (no link followed)
            except FileNotFoundError:
                return None
            except OSError as exc:
                refusal = folder_refusal(self._cancel_folder, exc, self._CANCEL_REFUSED)
                if exc.errno in SHORTAGE_ERRNOS:  # passing: a WARNING, said once while it lasts
                    recurring.error(kind, exc, "%s", refusal)
                elif not self._cancel_refusal_said:
                    self._cancel_refusal_said = True
                    log.error("%s", refusal)
                return None
            self._cancel_refusal_said = False  # a folder again: a new refusal is said again
            recurring.ok(kind)  # (a shortage said before: its end is said)
            return fd

    def request_cancel(self, handoff_id: str, request: Doc) -> None:
        folder = self._cancel_dir()
        try:
            # each part made and opened without following a link: mkdir's parents followed a
            # .meta swapped for one, and the request was written outside the workspace
            fd = open_beneath(self.ws.handoffs, _CANCEL_PARTS, make=True)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise not_a_folder(folder, "no cancel request can be recorded there", exc) from None
        try:
            tmp = fsio.write_temp(self.store.tmp, fsio.dump_json(request),
                                  durable=self.store.durable)
            with fsio.discarded_on_failure(tmp):  # renamed into the folder we opened, never
                os.replace(tmp, f"{handoff_id}.json", dst_dir_fd=fd)  # through a link put since
            if self.store.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._subscribers.fire(handoff_id, "cancel")

    def cancel_request(self, handoff_id: str) -> Doc | None:
        name = f"{handoff_id}.json"
        if not self._cancel_file_exists(name):
            return None  # the usual answer, asked three times per handoff: one lstat
        fd = self._open_cancel_folder()
        if fd is None:
            return None
        try:
            return self._read_cancel(fd, name)
        finally:
            os.close(fd)

    def _cancel_file_exists(self, name: str) -> bool:
        """Whether ``.meta/cancel/<name>`` exists, as ``os.path.lexists`` tells (any error
        looking: no), in one lstat of a joined string (the gate, the check before the run and
        the filed hook each ask it of every handoff: posixpath's join and lexists were three
        Python calls a look)."""
        try:
            os.lstat(self._cancel_prefix + name)
        except (OSError, ValueError):  # (ValueError: a NUL in the name, as lexists says False)
            return False
        return True

    @cached_property
    def _cancel_prefix(self) -> str:
        return os.path.join(self._cancel_folder, "")

    def _read_cancel(self, folder: int, name: str) -> Doc | None:
        try:  # a FIFO or a symlink to /dev/zero there must neither block nor run on
            data = ownfiles.read_regular(name, MAX_RECORD_BYTES, dir_fd=folder)
        except OSError:
            return None
        # a body that is no object of ours (not JSON, not UTF-8, nested past any request, even
        # thirty thousand deep) still asks for the cancel: a bare request, never an exception
        # that stops the poll over every other request
        body = jsontext.parse_line(data)
        return body if isinstance(body, dict) else {"reason": "cancellation requested"}

    def cancel_requests(self) -> dict[str, Doc]:
        fd = self._open_cancel_folder()
        if fd is None:
            return {}
        try:
            names = [n for n in os.listdir(fd) if n.endswith(".json")]
            return {n[:-5]: body for n in names
                    if (body := self._read_cancel(fd, n)) is not None}
        finally:
            os.close(fd)

    def clear_cancel(self, handoff_id: str) -> None:
        name = f"{handoff_id}.json"
        if not self._cancel_file_exists(name):
            return  # the usual answer, asked once per filed handoff: one lstat
        fd = self._open_cancel_folder()
        if fd is None:
            return
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    # ------------------------------------------------------------ dedup, waiting, wake-ups
    def seen_add(self, handoff_id: str, now: datetime, mark: str | None = None, *,
                 if_absent: bool = False) -> None:
        # (the record keeps every line an id has: an added one never hides a claim's mark, so
        # the look and the add need not be one step)
        if if_absent and self.store.seen.contains(handoff_id, now):
            return
        self.store.seen.add(handoff_id, now, mark)

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        return self.store.seen.contains(handoff_id, now)

    def seen_marks(self, handoff_id: str, now: datetime) -> frozenset[str | None]:
        return self.store.seen.marks(handoff_id, now)

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        return wait_via_feed(self, handoff_id, timeout)

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        if kinds is not None and self._watch is not None:
            return self._subscribe_to(callback, set(kinds))
        remove = self._subscribers.add(callback)
        if self._watch is not None:
            try:
                self._watch.start()
            except BaseException:  # (no watch: the caller polls; its callback must not stay)
                remove()
                raise

        def unsubscribe() -> None:
            remove()
            if self._watch is not None and not len(self._subscribers):
                self._watch.stop()  # nobody listens: no watch thread left behind
        return unsubscribe

    def _subscribe_to(self, callback: WakeupCallback, kinds: set[str]) -> Callable[[], None]:
        """A watch of its own over only the folders of ``kinds``: a batch that listens for
        cancel requests must not wake for every file the batch itself writes."""
        folders = {path: kind for path, kind in self._folders().items() if kind in kinds}
        watch = FolderWatch(folders, lambda handoff_id, kind, settled:
                            callback(Wakeup(handoff_id, kind, settled)))
        watch.start()
        return watch.stop

    def after_fork(self) -> None:
        """In a process forked to share the work (``--processes``): temp files go to a folder
        of this process's own (see :meth:`Store.use_own_tmp`)."""
        self.store.use_own_tmp()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        self.store.close()
