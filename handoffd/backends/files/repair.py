"""The files backend's own repairs (:meth:`FilesBackend.maintain`), run by every sweep.

* a handoff present in two folders keeps the copy the state machine picks (``states.winner``);
* a claim whose claimer died after its rename into in-progress/ but before it recorded a lease
  goes back to pending/ without spending an attempt (the handler never started);
* a *foreign* claim (seed 001's own consumer: it renamed the request into in-progress/ and set
  ``status: in_progress`` and ``started_at``) is honoured for its ``timeout_seconds`` (default
  :data:`FOREIGN_LEASE_SECONDS`) from when it started, then handed back as a dead claimer's;
* an in-progress entry that cannot be read (junk, a folder, a FIFO, a dangling symlink) and
  that nothing changed for the claim grace, with no claimer holding it, is quarantined with
  its code; one over our size bound only once nothing changed it for
  :data:`LARGE_QUIET_SECONDS` (:func:`set_aside_junk`). The sweep then logs the event and,
  under a safe id found nowhere else, files a failure stub as admission does for pending/ (the
  repair says what it set aside: :data:`NOTES`);
* orphaned temp files and lock files of finished claims are removed (:mod:`.orphans`);
* a document a move or purge set aside and never finished with (it died) is put back
  (:mod:`.aside`);
* the seen-ids record is compacted to its TTL.

Claims whose owner died *after* recording a lease are taken over by
:meth:`FilesBackend.expired_claims`, and the engine files them by their retry policy.
"""
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any, Collection

from ...core import recurring
from ...core.documents import book, is_safe_id, record
from ...core.errors import DuplicateHandoff, ErrorCode, InvalidDocument, UnreadableDocument
from ...core.logs import log
from ...core.states import State, winner
from ...core.timeutil import parse_iso_truncated
from . import aside, fsio
from .leases import unclaimed
from .orphans import Repairs, _plain_folder, remove_orphans
from .problems import read_error
from .reading import HALF_WRITTEN, in_folder
from .store import Store, release_lock, try_lock

FOREIGN_LEASE_SECONDS = 300.0  # a foreign claim without timeout_seconds: the daemon default
MAX_FOREIGN_LEASE_SECONDS = 7 * 24 * 3600.0
# an in-progress file over our size bound may be the live claim of a daemon with a larger
# max_document_bytes sharing the workspace (the limit lowered under it), or a foreign
# consumer's claim: neither its lease nor its claim time can be read here. It is junk only once
# nothing has changed it for this long: a live claimer rewrites it at every lease renewal
# (every lease_seconds / 3: a lease of up to half an hour renews well within it), and a foreign
# claim of no stated time is honoured FOREIGN_LEASE_SECONDS (before s16 it stayed for ever)
LARGE_QUIET_SECONDS = 600.0
# the key of the repairs' report saying what was set aside: one JSON object {"id", "code",
# "message", "stub"} each; the sweep logs its event and, for "stub", files the failure stub as
# admission does, so that the on_filed listeners, the event log and `handoff wait` hear of it
NOTES = "set_aside_notes"
# the reason of the hand-back of a claim whose claimer died before it wrote the lease: no
# attempt began (a batch's summary counts it among the takeovers not run again yet:
# service.report)
UNLEASED_REASON = "claimer died before recording its lease"


def repair(store: Store, now: datetime, *, claim_grace_seconds: float,
           skip: Collection[str] = ()) -> Repairs:
    """Run every repair once, each isolated: one that fails is logged and the others go on."""
    done: Repairs = {"recovered": [], "duplicates_resolved": [], "temp_files_removed": [],
                     "locks_removed": [], "set_aside": [], NOTES: []}
    _step("resolving duplicate copies", resolve_duplicates, store, done)
    try:
        in_progress = store.ids(State.IN_PROGRESS)
    except OSError as exc:
        recurring.error("listing in-progress/", exc, "sweep: cannot list in-progress/: %s", exc)
        in_progress = []
    else:
        recurring.ok("listing in-progress/")
    for handoff_id in in_progress:
        if handoff_id not in skip:
            _step(f"recovering {handoff_id}", _unleased_guarded, store, handoff_id,
                  claim_grace_seconds, now, done, kind=recurring.RECOVERY)
    _step("removing orphaned files", remove_orphans, store, done)
    _step("putting back what a move or purge left aside", restore_aside, store)
    _step("compacting the seen-ids record", lambda: store.seen.compact(now))
    return done


def restore_aside(store: Store) -> None:
    """Put back the documents a move or purge that died had set aside (one line each)."""
    for name in aside.restore(store, time.time() - aside.AGE_SECONDS):
        log.warning("sweep: put %s back; a move or purge set it aside and never finished", name)


def _step(what: str, func: Any, *args: Any, kind: str | None = None) -> None:
    """Run one repair; a failure is one log line (with the traceback for bugs), never the sweep.
    An OSError is a :mod:`recurring <handoffd.core.recurring>` problem of ``kind`` (default:
    ``what``): said once, not at every sweep while it lasts."""
    try:
        func(*args)
    except (OSError, MemoryError) as exc:  # (a MemoryError: a shortage, said as one)
        recurring.error(kind or what, exc, "sweep: %s failed: %s; the next sweep tries again",
                        what, exc)
    except Exception:  # a repair bug must not stop the other repairs
        log.exception("sweep: %s failed; the next sweep tries again", what)
    else:
        recurring.ok(kind or what)


def recover_guard(store: Store, handoff_id: str) -> Any:
    """The per-handoff recovery lock (None: another process is recovering it right now, or
    ``.locks`` is no plain folder of the workspace: the lock would be made, and removed, outside
    it; :func:`remove_orphans` says so once a sweep)."""
    if not _plain_folder(store.ws.locks, quiet=True):
        return None
    return try_lock(store.ws.locks / f"{handoff_id}.recover.lock")


def _unleased_guarded(store: Store, handoff_id: str, grace: float, now: datetime,
                      done: Repairs) -> None:
    # one sweeper at a time per handoff: several daemons sweep the same workspace, and a claim
    # without a lease has no claim lock to guard it
    guard = recover_guard(store, handoff_id)
    if guard is None:
        return
    try:
        recover_unleased(store, handoff_id, grace, now, done)
    except DuplicateHandoff as exc:  # a copy appeared in pending/ meanwhile
        log.warning("recovering %s: %s; the next sweep resolves the copies", handoff_id, exc)
    finally:
        release_lock(guard)


def recover_unleased(store: Store, handoff_id: str, grace: float, now: datetime,
                     done: Repairs) -> None:
    """Hand back an in-progress handoff whose claimer died before recording its lease. Never
    one whose claimer still holds its document lock (see :func:`.leases.lock_document`): it is
    alive, writing its lease, however long it has stalled since its rename."""
    with unclaimed(store.path(State.IN_PROGRESS, handoff_id)) as free:
        if free:
            _recover_unleased(store, handoff_id, grace, now, done)


def _recover_unleased(store: Store, handoff_id: str, grace: float, now: datetime,
                      done: Repairs) -> None:
    path = store.path(State.IN_PROGRESS, handoff_id)
    try:
        doc = store.read(State.IN_PROGRESS, handoff_id)
        info = path.stat()
    except FileNotFoundError:
        return  # gone
    except (InvalidDocument, OSError) as exc:  # junk, once it stays unreadable past the grace
        problem = read_error(path, exc, handoff_id)
        if not problem.transient and set_aside_junk(store, handoff_id, problem, grace, done):
            done.setdefault("set_aside", []).append(handoff_id)
        return
    # a claim's own rewrite seals it for in-progress/ with a lease; a claimer that died right
    # after its rename leaves the pending seal (or none, for a raw document)
    if store.trusted_revision(doc, State.IN_PROGRESS, handoff_id) > 0 \
            and isinstance(book(doc).get("lease"), dict):
        return  # a leased claim: expired_claims judges its owner
    ctime = info.st_ctime
    foreign_end = foreign_lease_end(doc, ctime)  # (our claims write a lease with the mark)
    if time.time() < foreign_end:
        return  # a foreign consumer's claim, still within its time
    if time.time() - ctime < grace and not (foreign_end and marked_here(doc, info)):
        return  # the claimer may be recording its lease (or its mark) right now
    mine = store.trusted_revision(doc, State.PENDING, handoff_id, State.IN_PROGRESS)
    if is_leftover(store, handoff_id, mine):
        path.unlink(missing_ok=True)
        done["duplicates_resolved"].append(handoff_id)
        return
    if mine == 0:
        undo_claim(store, handoff_id)  # raw: put it back exactly as it came
    else:  # ours: back to pending/ with the attempt it had (the lease write counts attempts)
        book(doc).pop("lease", None)
        # no "recovered" event: no attempt began (its claimed event comes with the lease), and
        # one would pair with an earlier attempt's claimed event for the readers that look for
        # interrupted attempts (features.children). The run's summary tells it back in pending/
        # by this hand-back (service.report._untried_since_recovery)
        record(doc, "handed_back", now, reason=UNLEASED_REASON)
        store.move(handoff_id, State.IN_PROGRESS, State.PENDING, doc)
    done["recovered"].append(handoff_id)


def unleased_dues(store: Store, grace: float) -> list[float]:
    """How long, in seconds from now, until each in-progress document without a lease of ours
    may be handed back by :func:`recover_unleased` (its claimer died between the rename and the
    lease write, or it came in raw): a whole ``grace`` after its last change. A batch waits for
    these before it ends (:meth:`.backend.FilesBackend.takeover_watch`): it ended at once and
    left such a claim for the next, saying nothing (review RA). One read of each in-progress
    document, asked only when a batch would end; a foreign consumer's claim within its time and
    an unreadable file (set aside by the same grace, not run) are not listed."""
    dues: list[float] = []
    try:
        in_progress = store.ids(State.IN_PROGRESS)
    except OSError:
        return dues
    now = time.time()
    for handoff_id in in_progress:
        try:
            doc = store.read(State.IN_PROGRESS, handoff_id)
            info = os.stat(store.file(State.IN_PROGRESS, handoff_id))
        except (InvalidDocument, OSError):
            continue
        if store.trusted_revision(doc, State.IN_PROGRESS, handoff_id) > 0 \
                and isinstance(book(doc).get("lease"), dict):
            continue  # a leased claim: its lease says when (expired claims are judged apart)
        if foreign_lease_end(doc, info.st_ctime) > now:
            continue  # a foreign consumer's, within its time
        # (one already due is listed as due now: the batch sweeps for it before it ends)
        dues.append(max(info.st_ctime + grace - now, 0.0))
    return dues


def set_aside_junk(store: Store, handoff_id: str, problem: UnreadableDocument, grace: float,
                   done: Repairs) -> bool:
    """Quarantine the unreadable entry ``in-progress/<handoff_id>.json`` (junk, a folder, a
    FIFO, a dangling symlink, a document over our size bound) with ``problem``'s code once
    nothing has changed it for the claim grace (and the settle time: a foreign consumer rewrites
    its claim in place; :data:`LARGE_QUIET_SECONDS` for one over our size bound, whose lease
    cannot be read), and say so in ``done[NOTES]``: the sweep logs its event and, when its
    name is a safe id with no other copy, files a failure stub under it as admission does for
    pending/ (:func:`handoffd.core.admission.set_aside`), so that ``handoff wait`` ends with
    that failure. True when it was set aside: moved, never read (a large one stays on disk).

    The caller holds the handoff's recovery guard and has seen no claimer's lock on the entry
    (:func:`.leases.unclaimed`): a claimer holds that lock from before its rename until its
    lease is written, and sets an unreadable claim aside itself right after."""
    path = store.path(State.IN_PROGRESS, handoff_id)
    try:
        info = os.lstat(path)  # (the entry itself: a symlink's own times, never its target's)
    except FileNotFoundError:
        return False
    quiet = max(grace, store.settle_seconds)
    if problem.code == ErrorCode.DOCUMENT_TOO_LARGE:
        quiet = max(quiet, LARGE_QUIET_SECONDS)
    if time.time() - max(info.st_mtime, info.st_ctime) < quiet:
        return False  # renamed in or changed just now: its claimer may be writing it
    message = in_folder(str(problem), State.IN_PROGRESS, path.name)
    others = [s.value for s in store.locate(handoff_id) if s is not State.IN_PROGRESS]
    if others:
        message += f"; handoff {handoff_id} is kept in {others[0]}/"
    try:
        store.quarantine(path, problem.code, message)
    except FileNotFoundError:
        return False  # set aside or moved by another process meanwhile
    log.warning("set aside in-progress/%s.json: %s: %s", handoff_id, problem.code, message)
    done.setdefault(NOTES, []).append(json.dumps(
        {"id": handoff_id, "code": problem.code, "message": message,
         "stub": not others and is_safe_id(handoff_id)}))
    return True


# how much earlier than the file's last change a mark written in place may say it started (the
# consumer stamps started_at, then writes the file)
MARK_SLACK_SECONDS = 2.0


def foreign_lease_end(doc: dict[str, Any], claimed_at: float) -> float:
    """When a foreign consumer's claim of ``doc`` ends (Unix time), or 0 when ``doc`` is not one.

    Seed 001's consumer marks its claim ``status: in_progress`` with ``started_at``; it holds the
    handoff for the request's ``timeout_seconds``. The start is never later than the rename we
    saw (``claimed_at``, our clock): a document cannot stretch its own lease. A ``started_at``
    finer than nanoseconds is read to the microsecond (:func:`~handoffd.core.timeutil.
    parse_iso_truncated`): refused, it made a consumer's claim none, held the claim grace
    only, not its ``timeout_seconds``; its bound above holds for any value."""
    if doc.get("status") != "in_progress" or not isinstance(doc.get("started_at"), str):
        return 0.0
    try:
        started = min(parse_iso_truncated(doc["started_at"]).timestamp(), claimed_at)
    except (ValueError, OverflowError):
        return 0.0
    limit = doc.get("timeout_seconds")
    seconds = float(limit) if isinstance(limit, (int, float)) and not isinstance(limit, bool) \
        and 0 < limit <= MAX_FOREIGN_LEASE_SECONDS else FOREIGN_LEASE_SECONDS
    return started + seconds


def marked_here(doc: dict[str, Any], info: os.stat_result) -> bool:
    """Was the foreign claim's mark in the in-progress file ``doc`` written there, after its
    rename into in-progress/ (seed 001's Example 2 renames, then rewrites the file)? Then the
    claim is judged by its ``started_at + timeout_seconds`` alone, not held for the claim grace
    as well (a claim of ``timeout_seconds`` 3 was held 10 s).

    Both must hold: the file was last changed by a write in place (its modification time is
    its change time; a rename changes only the latter), and its ``started_at`` is no earlier
    than that change, within :data:`MARK_SLACK_SECONDS`. The times alone do not tell: on a
    file system whose timestamps tick by the jiffy, a file written whole and renamed in at once
    has the two equal (review R40: 1,998 of 2,000 on ext4). A mark the file already carried
    (a foreign claim's, left in a request handed back to pending/) is older than its rename:
    such a file may be ours, claimed unlocked on a file system without ``flock`` and writing
    its lease, and the grace still protects that window."""
    if info.st_mtime_ns < info.st_ctime_ns:
        return False
    try:
        started = parse_iso_truncated(doc["started_at"]).timestamp()  # (as foreign_lease_end)
    except (KeyError, TypeError, ValueError, OverflowError):
        return False
    return started >= info.st_ctime - MARK_SLACK_SECONDS


def is_leftover(store: Store, handoff_id: str, mine: int) -> bool:
    """Did the owner die after writing the handoff's next copy (a newer one elsewhere, or any
    completed one)? Then the in-progress copy of trusted revision ``mine`` is a leftover."""
    for state in (State.COMPLETED, State.FAILED, State.PENDING):
        theirs = revision_at(store, state, handoff_id)
        if theirs > mine or (state is State.COMPLETED and theirs >= 0):
            return True
    return False


def undo_claim(store: Store, handoff_id: str) -> None:
    """A raw document whose claimer died before admitting it goes back to pending/ untouched
    (its bookkeeping is not ours to rewrite; admission will treat it as new)."""
    try:
        fsio.rename_noreplace(store.path(State.IN_PROGRESS, handoff_id),
                              store.path(State.PENDING, handoff_id))
    except FileNotFoundError:
        return
    except FileExistsError:  # a pending copy appeared meanwhile: keep one, quarantine the other
        store.quarantine(store.path(State.IN_PROGRESS, handoff_id), ErrorCode.DUPLICATE_HANDOFF_ID,
                         f"handoff {handoff_id} was pending twice; a second document is never run")


def revision_at(store: Store, state: State, handoff_id: str) -> int:
    """Trusted revision of the copy in ``state``: -1 absent, 0 unsealed or unreadable."""
    try:
        return store.trusted_revision(store.read(state, handoff_id), state, handoff_id)
    except FileNotFoundError:
        return -1
    except InvalidDocument:
        return 0


def resolve_duplicates(store: Store, done: Repairs) -> None:
    """Where one id has files in several folders, keep the winner and remove the others.
    A raw (never-handled) duplicate in pending/ is quarantined rather than deleted, and so is a
    copy that cannot be read (junk, a folder, a FIFO named like a document): a readable copy
    wins over it, and what was never read is never deleted. Two names of one file (the same
    device and inode, e.g. a state folder reached through a symlink) are no duplicates:
    removing "the other" removed the only one. Each id is resolved on its own: an error with
    one (a folder that cannot be moved) is logged and the sweep goes on with the next."""
    where: dict[str, list[State]] = {}
    for state in (State.PENDING, State.IN_PROGRESS, State.FAILED):
        for handoff_id in store.ids(state):
            where.setdefault(handoff_id, []).append(state)
    # completed/ is the one that grows with every handoff: streamed against the others, not
    # held (a sweep that kept every finished id raised a serving daemon's RSS with the folder)
    for handoff_id in store.iter_ids(State.COMPLETED):
        if handoff_id in where:
            where[handoff_id].append(State.COMPLETED)
    for handoff_id, states in where.items():
        if len(states) < 2:
            continue
        try:
            resolved = _resolve_copies(store, handoff_id, states)
        except OSError as exc:
            log.error("sweep: cannot resolve the copies of handoff %s: %s; the next sweep tries "
                      "again", handoff_id, exc)
            continue
        if resolved:
            done["duplicates_resolved"].append(handoff_id)


def _resolve_copies(store: Store, handoff_id: str, states: list[State]) -> bool:
    """Keep one of ``handoff_id``'s copies in ``states`` (see :func:`resolve_duplicates`);
    False when there was nothing to resolve now (one copy left, one in in-progress/, or one
    still being written)."""
    copies: list[tuple[State, dict[str, Any], InvalidDocument | None]] = []
    files: set[tuple[int, int]] = set()
    for state in states:
        path = store.path(state, handoff_id)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if (info.st_dev, info.st_ino) in files:
            continue  # the same file under a second name: no copy of its own
        files.add((info.st_dev, info.st_ino))
        try:
            copies.append((state, store.read(state, handoff_id), None))
        except FileNotFoundError:
            continue
        except InvalidDocument as exc:
            if exc.code in HALF_WRITTEN and time.time() - info.st_mtime < store.settle_seconds:
                return False  # still being written: looked at again by the next sweep
            copies.append((state, {}, exc))
    if len(copies) < 2 or any(s is State.IN_PROGRESS for s, _, _ in copies):
        return False  # in-progress pairs are settled by recovery, once the owner is gone
    readable = [i for i, (_, _, error) in enumerate(copies) if error is None]
    among = readable or list(range(len(copies)))
    best = among[winner([(copies[i][0], store.trusted_revision(copies[i][1], copies[i][0],
                                                               handoff_id)) for i in among])]
    kept = copies[best][0].value
    for index, (state, doc, error) in enumerate(copies):
        if index == best:
            continue
        path = store.path(state, handoff_id)
        try:
            if error is not None:
                store.quarantine(path, error.code,
                                 f"{in_folder(str(error), state, path.name)}; handoff "
                                 f"{handoff_id} is kept in {kept}/")
            elif state is State.PENDING and store.trusted_revision(doc, state, handoff_id) == 0:
                store.quarantine(path, ErrorCode.DUPLICATE_HANDOFF_ID,
                                 f"handoff {handoff_id} already exists in {kept}/; a second "
                                 "document is never run")
            else:
                path.unlink()
        except FileNotFoundError:
            continue
    return True
