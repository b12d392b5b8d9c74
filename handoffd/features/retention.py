"""Retention: purge or archive finished handoffs older than a given age.

``handoff purge --older-than 7d`` deletes completed and failed handoffs last updated before
then; ``handoff archive`` first appends each one to ``handoffs/.archive/YYYY-MM-DD.jsonl.gz``
(its file format, and the readers that find a handoff there again: :mod:`.archive`), flushed to
disk before the documents are deleted. ``handoff show`` still finds an archived handoff.
``[retention]`` in handoffd.toml makes every serving daemon do the same on its own
(``completed = "7d"``, ``failed = "30d"``, ``mode = "purge"|"archive"``, ``every = "1h"``).

Never removed: a handoff that a pending or running handoff depends on, and the parent of a
pending or running handoff (its children still report to it). A live document that a move holds
aside (the files store's ``.meta/aside/``: for a minute, when its mover died) counts as live.
The store records each purged id as seen, so dedup still refuses the id for its TTL after the
document is gone. Knowing what live work needs means reading the live documents: a pass with
nothing old enough to go reads none, and a daemon's passes read again only the live documents
whose files changed (see liverefs).
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..backends.base import Describe, safe_describe
from ..core.errors import HandoffdError
from ..core.states import State
from ..core.storage import Row, describe_native
from .archive import append_archive
from .liverefs import LiveRefs, Refs
from .removal import store_lock

if TYPE_CHECKING:
    from ..core.engine import Engine

log = logging.getLogger("handoffd")
LIVE_ROUNDS = 3  # bare listings of pending/ and in-progress/ whose ids count as live
PASS_LIMIT = 500  # documents one pass of a daemon's [retention] takes: its sweep stays short
LOCK_WAIT_SECONDS = 60.0  # how long `handoff purge|archive` waits for another process's pass
# the documents one bounded pass holds (and archives, as one gzip member: well within the
# archive's MEMBER_TEXT) at most
PASS_BYTES = 32 * 1024 * 1024
CLI_PASS_LIMIT = 5000  # documents one batch of `handoff purge|archive` takes (it goes on)


@dataclass
class Result:
    """What one retention pass did (or would do, with ``dry_run``)."""

    removed: list[tuple[str, str]] = field(default_factory=list)  # (id, state)
    kept: dict[str, str] = field(default_factory=dict)  # id -> why it was kept
    archive: Path | None = None
    more: bool = False  # the pass stopped at its limit: more are due
    busy: bool = False  # another process's pass was under way: nothing done


def protected(engine: Engine, refs: LiveRefs | None = None
              ) -> tuple[dict[str, str], dict[str, State]]:
    """Ids that must stay, with why (what live handoffs depend on, and their parents), and the
    live handoffs themselves (a finished child of a live parent stays too: the parent, waiting
    for its other children, has yet to aggregate it).

    Live work moves between pending/ and in-progress/ (a claim, a retry, a parent parked): one
    that moved between the listings of the two was in neither, and what it depends on was
    purged (a handoff retried at once, over and over, was missed that way every few passes).
    So the ids of both are gathered over a few rounds of bare listings (no document read, so
    each round is quick), with those the store stamps live (:meth:`LiveRefs.start`: also the
    documents a move holds aside), then each document is read wherever it is by then: unless
    ``refs`` remembers what it referenced and its stamp is unchanged since (see liverefs)."""
    keep: dict[str, str] = {}
    live: dict[str, State] = {}
    ids: dict[str, None] = {}
    for _ in range(LIVE_ROUNDS):
        for state in (State.PENDING, State.IN_PROGRESS):
            ids.update(dict.fromkeys(engine.backend.ids(state)))
    read = partial(_read_refs, engine, getattr(engine.backend, "describe", describe_native))
    refs = refs if refs is not None else LiveRefs()  # (this pass's own: kept by nobody)
    ids.update(dict.fromkeys(refs.start(engine)))
    for handoff_id in ids:
        found = refs.lookup(handoff_id, read)
        if found is None:
            continue
        live[handoff_id] = found.state
        if found.parent:
            keep.setdefault(found.parent, f"parent of {found.state.value} {handoff_id}")
        for dep in found.depends_on:
            keep.setdefault(dep, f"{found.state.value} {handoff_id} depends on it")
    refs.retain(ids)
    return keep, live


def _read_refs(engine: Engine, describe: Describe, handoff_id: str) -> Refs | None:
    """What the live document ``handoff_id`` references, read wherever it is now (also where a
    move holds it aside: ``get`` finds it there); None when it is finished, gone or damaged (a
    damaged live document protects nothing: it is set aside when claimed). A read that fails for
    a passing reason (EMFILE, EIO, a lost database connection) raises: the pass ends with
    nothing more removed, rather than purge what that document may depend on."""
    try:
        found = engine.backend.get(handoff_id)
    except HandoffdError:  # damaged (InvalidDocument), or gone meanwhile (NotFound)
        return None
    if found is None or found[0].terminal:
        return None
    state, doc = found
    parent = safe_describe(describe, doc).parent
    try:
        deps = tuple(engine.formats.detect(doc).envelope(doc).depends_on)
    except Exception:  # (its parent still counts)
        deps = ()
    return Refs(state, parent, deps)


def expire(engine: Engine, *, older_than: dict[State, float], now: datetime,
           archive: bool = False, dry_run: bool = False, limit: int | None = None,
           wait: float = LOCK_WAIT_SECONDS, refs: LiveRefs | None = None,
           max_bytes: int | None = None) -> Result:
    """Purge (or archive, then purge) finished handoffs last updated more than
    ``older_than[state]`` seconds before ``now``: at most ``limit`` of them, of at most about
    ``max_bytes`` of JSON (``Result.more`` says whether more are due). One pass at a time per
    store (its removal lock: :func:`.removal.store_lock`, every host's on PostgreSQL): another
    process's pass is waited for up to ``wait`` seconds (0: this pass is skipped,
    ``Result.busy``); two passes at once archived each document twice. ``refs``: what
    live documents referenced, kept from earlier passes (a daemon's, or the CLI's). A dry run
    holds no document: it notes what each would-be-removed one is, and drops it."""
    result = Result()
    with store_lock(engine).hold(wait) as mine:
        if not mine:
            result.busy = True
            return result
        # (a pass that is not a dry run looks twice: its second look reads only what changed)
        _expire(engine, result, older_than, now, archive=archive, dry_run=dry_run,
                bounds=(limit, max_bytes),
                refs=refs if refs is not None or dry_run else LiveRefs())
    return result


def expire_all(engine: Engine, *, older_than: dict[State, float], now: datetime,
               archive: bool = False, limit: int | None = CLI_PASS_LIMIT,
               max_bytes: int | None = PASS_BYTES, wait: float = LOCK_WAIT_SECONDS,
               refs: LiveRefs | None = None) -> Result:
    """What ``handoff purge|archive`` does: remove (or archive, then remove) every finished
    handoff old enough to go, in batches of at most ``limit`` documents or about ``max_bytes``
    of them, each archived (one gzip member) and deleted before the next is taken: memory stays
    bounded, and a kill costs at most one batch archived twice. Each state is listed once, its
    documents read as the listing goes: a loop of bounded passes listed (and stat'ed) the whole
    folder again at every pass, quadratic in the backlog (100,000 old documents: past five
    minutes). The removal lock is held throughout, except that a process waiting for it (a
    create that names dependencies, another purge) is let in after the batch under way; the
    listing then starts again under the lock, so that nothing read before it is removed
    (another pass may have archived it meanwhile). ``Result.busy``: the lock was held past
    ``wait`` (what was removed before stays in ``Result.removed``)."""
    result = Result()
    refs = refs if refs is not None else LiveRefs()
    while True:
        with store_lock(engine).hold(wait) as mine:
            if not mine:
                result.busy = True
                return result
            taker = _Taker(engine, result, refs, (limit, max_bytes), dry_run=False,
                           flush=partial(_flush, engine, result, refs, archive, now))
            try:
                _list_old(engine, taker, older_than, now)
                if taker.doomed:  # the last batch
                    _flush(engine, result, refs, archive, now, taker, last=True)
                return result
            except _Yield:
                pass  # let the waiting process in, then list again
        # (a document decided on already is not taken again: see _Taker.take)


Doomed = list[tuple[State, str, dict[str, Any]]]


class _Full(Exception):
    """Ends a listing from within its predicate: the pass took all it may (a listing that went
    on would read every old document left, only to drop it)."""


class _Yield(Exception):
    """Ends a listing of :func:`expire_all` after a batch: another process waits for the lock."""


def _expire(engine: Engine, result: Result, older_than: dict[State, float], now: datetime, *,
            archive: bool, dry_run: bool, bounds: tuple[int | None, int | None],
            refs: LiveRefs | None) -> None:
    taker = _Taker(engine, result, refs, bounds, dry_run)
    result.more = _list_old(engine, taker, older_than, now)
    if dry_run or not taker.doomed:
        result.removed = [(hid, state.value) for state, hid, _ in taker.doomed]
        return
    _remove(engine, result, taker.doomed, taker.parents, archive, refs, now)


def _list_old(engine: Engine, taker: _Taker, older_than: dict[State, float],
              now: datetime) -> bool:
    """Offer ``taker`` the documents of each state of ``older_than`` old enough to go, oldest
    first, one listing per state through a predicate that takes each row and keeps none: the
    files store reads one document at a time, and holds none itself. True when the taker was
    full (more may be due); without a flush, the listing ends there."""
    for state, seconds in older_than.items():
        try:
            engine.backend.list(state=state, order="oldest",
                                before=now - timedelta(seconds=seconds),
                                where=partial(taker.offer, state))
        except _Full:
            return True
    return False


def _remove(engine: Engine, result: Result, doomed: Doomed, parents: dict[str, str | None],
            archive: bool, refs: LiveRefs | None, now: datetime
            ) -> tuple[dict[str, str], dict[str, State]]:
    """Archive (``archive``) and delete ``doomed``, but for what live work came to need
    meanwhile (kept, with why, in ``result.kept``); the protection found by that second look."""
    if archive:
        result.archive = append_archive(engine.ws, doomed, now)
    # a pass can take a while: what live work came to depend on meanwhile stays too (the
    # documents unchanged since the first look are not read again)
    keep, live = protect = protected(engine, refs)
    for state, hid, doc in doomed:
        parent = parents.get(hid)
        why = keep.get(hid) or (f"child of {live[parent].value} {parent}"
                                if parent is not None and parent in live else None)
        if why:
            result.kept[hid] = why
            continue
        # only what was listed (and archived) is deleted: a `handoff retry` between the listing
        # and the purge once made it delete the retry's new failure, the archive holding only
        # the old one; the backend compares and deletes in one step
        if engine.backend.purge(hid, state, now, expect=doc):
            result.removed.append((hid, state.value))
        elif _still_there(engine, hid, state):
            result.kept[hid] = "changed while it was being archived"
    return protect


def _flush(engine: Engine, result: Result, refs: LiveRefs, archive: bool, now: datetime,
           taker: _Taker, *, last: bool = False) -> None:
    """Remove the batch ``taker`` holds, and empty it; then :class:`_Yield` when another
    process waits for the removal lock (unless this was the ``last`` batch)."""
    taker.protect = _remove(engine, result, taker.doomed, taker.parents, archive, refs, now)
    taker.empty()
    if not last and _waited_for(engine):
        raise _Yield


def _waited_for(engine: Engine) -> bool:
    """Another process waits for the removal lock (:meth:`.removal.FileRemovalLock.waited_for`,
    or the store's own)."""
    return store_lock(engine).waited_for()


class _Taker:
    """Sorts the listed old documents of one pass: kept (with why) or doomed, until the pass's
    bounds (documents, bytes) are reached; then, with a ``flush``, that removes the batch and
    the taker goes on, else the listing ends (:class:`_Full`). What live work needs is read
    when the first old document is offered: a pass with nothing old enough reads none."""

    def __init__(self, engine: Engine, result: Result, refs: LiveRefs | None,
                 bounds: tuple[int | None, int | None], dry_run: bool,
                 flush: Callable[[_Taker], None] | None = None) -> None:
        self.engine, self.result, self.refs = engine, result, refs
        self.limit, self.max_bytes = bounds
        self.dry_run, self.flush = dry_run, flush
        self.protect: tuple[dict[str, str], dict[str, State]] | None = None
        self.doomed: Doomed = []
        self.parents: dict[str, str | None] = {}
        self.held = 0
        self.seen: set[str] = set()

    def empty(self) -> None:
        """Drop the batch (it was removed)."""
        self.doomed, self.parents, self.held, self.seen = [], {}, 0, set()

    def full(self) -> bool:
        """The pass took all it may: more may be due."""
        return (self.limit is not None and len(self.doomed) >= self.limit) or \
            (self.max_bytes is not None and self.held >= self.max_bytes)

    def offer(self, state: State, row: Row) -> bool:
        """The listing's predicate: note ``row`` (see :meth:`take`); False, so that the listing
        holds no document. Ends the listing (:class:`_Full`) when the taker is full and has
        no flush."""
        if self.protect is None:  # the first old document: only now is live work read
            self.protect = protected(self.engine, self.refs)
        self.take(state, row)
        if self.full():
            if self.flush is None:
                raise _Full
            self.flush(self)
        return False

    def take(self, state: State, row: Row) -> bool:
        """Note ``row`` (kept, or doomed: its document dropped in a dry run); False. A row
        already decided on (kept, or taken into this batch) is passed over."""
        if row.id in self.seen or row.id in self.result.kept or self.full():
            return False
        self.seen.add(row.id)
        keep, live = self.protect if self.protect is not None else ({}, {})
        parent = row.meta.parent
        if row.id in keep:
            self.result.kept[row.id] = keep[row.id]
        elif parent in live:
            self.result.kept[row.id] = f"child of {live[parent].value} {parent}"
        else:
            self.doomed.append((state, row.id, {} if self.dry_run else row.doc))
            self.parents[row.id] = parent
            if self.max_bytes is not None and not self.dry_run:
                self.held += len(json.dumps(row.doc, ensure_ascii=False))
        return False


def _still_there(engine: Engine, handoff_id: str, state: State) -> bool:
    """``handoff_id`` is (still, or again) in ``state``: a purge that did not delete it kept it."""
    try:
        found = engine.backend.get(handoff_id)
    except Exception:  # unreadable now: it is there, and was not deleted
        return True
    return found is not None


# ---------------------------------------------------------------------------- the daemon's part
def install(engine: Engine) -> None:
    """Apply ``[retention]`` on the sweeps of a serving daemon, at most every ``every`` seconds."""
    policy = engine.config.retention
    older_than = {s: v for s, v in ((State.COMPLETED, policy.completed),
                                    (State.FAILED, policy.failed)) if v is not None}
    if not older_than:
        return
    lock = threading.Lock()
    last: list[datetime] = []
    refs = LiveRefs()  # what live documents referenced, from pass to pass

    def apply(engine: Engine) -> object:
        now = engine.clock()
        if not lock.acquire(blocking=False):
            return None
        try:
            if last and (now - last[0]).total_seconds() < policy.every:
                return None
            # a bounded pass, so that the sweep (and the claims waiting behind it) stays short;
            # while more are due, the next sweep goes on, and the interval starts when all went
            result = expire(engine, older_than=older_than, now=now,
                            archive=policy.mode == "archive", limit=PASS_LIMIT, wait=0,
                            refs=refs, max_bytes=PASS_BYTES)
            # (a pass that removed nothing waits the interval even if more are due: what it
            # could not remove would be archived again at every sweep)
            if not result.busy and (not result.more or not result.removed):
                last[:] = [now]
            if result.removed:
                log.info("retention: %s %d finished handoff(s)", "archived" if policy.mode ==
                         "archive" else "purged", len(result.removed))
            return result
        finally:
            lock.release()

    engine.on_sweep.append(apply)
