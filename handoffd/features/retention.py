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
from typing import TYPE_CHECKING, Any

from ..backends.base import Describe, safe_describe
from ..core.errors import HandoffdError
from ..core.states import State
from ..core.storage import Row, describe_native
from .archive import append_archive
from .liverefs import LiveRefs, Refs
from .removal import removal_lock

if TYPE_CHECKING:
    from ..core.engine import Engine

log = logging.getLogger("handoffd")
LIVE_ROUNDS = 3  # bare listings of pending/ and in-progress/ whose ids count as live
PASS_LIMIT = 500  # documents one pass of a daemon's [retention] takes: its sweep stays short
LOCK_WAIT_SECONDS = 60.0  # how long `handoff purge|archive` waits for another process's pass
# the documents one bounded pass holds (and archives, as one gzip member: well within the
# archive's MEMBER_TEXT) at most
PASS_BYTES = 32 * 1024 * 1024
FIRST_ROWS = 16  # documents the first listing of a pass bounded in bytes reads
CLI_PASS_LIMIT = 5000  # documents one pass of `handoff purge|archive` takes (it loops)


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


def _any_old(engine: Engine, older_than: dict[State, float], now: datetime) -> bool:
    """Some finished handoff is old enough to go: only then need the live ones be read (a pass
    with nothing due, most of a daemon's passes, read every live document for nothing)."""
    return any(engine.backend.list(state=state, order="oldest", limit=1,
                                   before=now - timedelta(seconds=seconds))
               for state, seconds in older_than.items())


def expire(engine: Engine, *, older_than: dict[State, float], now: datetime,
           archive: bool = False, dry_run: bool = False, limit: int | None = None,
           wait: float = LOCK_WAIT_SECONDS, refs: LiveRefs | None = None,
           max_bytes: int | None = None) -> Result:
    """Purge (or archive, then purge) finished handoffs last updated more than
    ``older_than[state]`` seconds before ``now``: at most ``limit`` of them, of at most about
    ``max_bytes`` of JSON (``Result.more`` says whether more are due). One pass at a time per
    workspace: another process's pass is waited for up to ``wait`` seconds (0: this pass is
    skipped, ``Result.busy``); two passes at once archived each document twice. ``refs``: what
    live documents referenced, kept from earlier passes (a daemon's, or the CLI's). A dry run
    holds no document: it notes what each would-be-removed one is, and drops it."""
    result = Result()
    with removal_lock(engine.ws.meta, wait) as mine:
        if not mine:
            result.busy = True
            return result
        # (a pass that is not a dry run looks twice: its second look reads only what changed)
        _expire(engine, result, older_than, now, archive=archive, dry_run=dry_run,
                bounds=(limit, max_bytes),
                refs=refs if refs is not None or dry_run else LiveRefs())
    return result


Doomed = list[tuple[State, str, dict[str, Any]]]


def _expire(engine: Engine, result: Result, older_than: dict[State, float], now: datetime, *,
            archive: bool, dry_run: bool, bounds: tuple[int | None, int | None],
            refs: LiveRefs | None) -> None:
    if not _any_old(engine, older_than, now):
        return  # nothing is old enough to go: no live document need be read
    keep, live = protected(engine, refs)
    parents: dict[str, str | None] = {}
    doomed = _doomed(engine, result, older_than, now, (keep, live), bounds, parents,
                     dry_run=dry_run)
    if dry_run or not doomed:
        result.removed = [(hid, state.value) for state, hid, _ in doomed]
        return
    if archive:
        result.archive = append_archive(engine.ws, doomed, now)
    # a pass can take a while: what live work came to depend on meanwhile stays too (the
    # documents unchanged since the first look are not read again)
    keep, live = protected(engine, refs)
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


class _Taker:
    """Sorts the listed old documents of one pass: kept (with why) or doomed, until the pass's
    bounds (documents, bytes) are reached."""

    def __init__(self, result: Result, protect: tuple[dict[str, str], dict[str, State]],
                 bounds: tuple[int | None, int | None], parents: dict[str, str | None],
                 dry_run: bool) -> None:
        self.result, (self.keep, self.live) = result, protect
        self.limit, self.max_bytes = bounds
        self.parents, self.dry_run = parents, dry_run
        self.doomed: Doomed = []
        self.held = 0
        self.seen: set[str] = set()

    def full(self) -> bool:
        """The pass took all it may: more may be due."""
        return (self.limit is not None and len(self.doomed) >= self.limit) or \
            (self.max_bytes is not None and self.held >= self.max_bytes)

    def take(self, state: State, row: Row) -> bool:
        """Note ``row`` (kept, or doomed: its document dropped in a dry run); False."""
        if row.id in self.seen or self.full():
            return False
        self.seen.add(row.id)
        parent = row.meta.parent
        if row.id in self.keep:
            self.result.kept[row.id] = self.keep[row.id]
        elif parent in self.live:
            self.result.kept[row.id] = f"child of {self.live[parent].value} {parent}"
        else:
            self.doomed.append((state, row.id, {} if self.dry_run else row.doc))
            self.parents[row.id] = parent
            if self.max_bytes is not None and not self.dry_run:
                self.held += len(json.dumps(row.doc, ensure_ascii=False))
        return False


def _doomed(engine: Engine, result: Result, older_than: dict[State, float], now: datetime,
            protect: tuple[dict[str, str], dict[str, State]],
            bounds: tuple[int | None, int | None], parents: dict[str, str | None], *,
            dry_run: bool = False) -> Doomed:
    """The finished documents old enough to go, oldest first (within ``bounds``: documents,
    bytes), each one's parent noted in ``parents``; the old ones kept go into ``result.kept``
    with why. A dry run lists through a predicate that notes each row and keeps none, so the
    files store holds one document at a time (`purge --dry-run` held them all: 275 MiB)."""
    taker = _Taker(result, protect, bounds, parents, dry_run)
    keep, live = protect
    for state, seconds in older_than.items():
        cutoff = now - timedelta(seconds=seconds)
        if dry_run:
            engine.backend.list(state=state, order="oldest", before=cutoff,
                                where=partial(taker.take, state))
        else:
            _list_some(engine, taker, state, cutoff, len(keep) + len(live))
        if taker.full():
            result.more = True  # more may be due: the next pass goes on
            break
    return taker.doomed


def _list_some(engine: Engine, taker: _Taker, state: State, cutoff: datetime,
               kept: int) -> None:
    """Take the old documents of ``state``, oldest first, in listings that grow until the pass
    is full or every one was listed. The kept ones are listed too: read enough rows to find
    what may go, reading more while kept ones fill a listing (the finished children of a
    waiting parent once filled every pass, and nothing else was ever purged). The first listing
    is short: what a pass may hold is bounded in bytes too (documents of 5 MB each, listed 500
    at once, took `handoff archive` to 915 MiB)."""
    wanted = None if taker.limit is None else taker.limit - len(taker.doomed)
    rows = None if wanted is None else (
        min(wanted, FIRST_ROWS) if taker.max_bytes is not None else wanted) + kept
    while True:
        listed = engine.backend.list(state=state, order="oldest", before=cutoff, limit=rows)
        for row in listed:
            taker.take(state, row)
        if rows is None or len(listed) < rows or taker.full():
            return
        rows *= 4


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
