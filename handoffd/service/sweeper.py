"""Recovery: repair every half-finished state a crash can leave, through the backend.

* an in-progress handoff whose owner died or whose lease expired is taken over
  (:meth:`Backend.expired_claims`); what its attempt left running on this host is killed, and it
  is retried or failed per its retry policy;
* the backend's own repairs (:meth:`Backend.maintain`; files: duplicate copies, claims that died
  before recording a lease, unreadable leftovers set aside, orphaned temp and lock files, the
  seen-ids record); what they set aside is logged here, and its failure stub filed, as
  admission does, so the ``on_filed`` listeners and the event log hear of it
  (:func:`report_set_aside`);
* the features' repairs (``engine.on_sweep``) and the process records of finished attempts.

Sweeping is idempotent and safe to run from several processes at once.
"""
from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import procs, recurring
from ..core.admission import file_stub
from ..core.documents import book, book_int, record
from ..core.engine import Engine
from ..core.errors import (
    DuplicateHandoff,
    ErrorCode,
    HandoffdError,
    InvalidDocument,
    InvalidTransition,
    NotFound,
    is_shortage,
)
from ..core.events import SET_ASIDE, RecordingBackend
from ..core.filing import held_answer, restore_request
from ..core.native_format import stub_code
from ..core.states import State
from ..core.storage import GIVEN_UP, GIVEN_UP_UNRUN, Claim, owner_died
from .daemon_records import Stamp, config_stamp
from .handbacks import FREE_HANDBACKS, FREE_SHORTAGES, NOT_STARTED, STOPS, stops_in_a_row

log = logging.getLogger("handoffd")
# the key of Backend.maintain's report saying what its repairs set aside: JSON objects {"id",
# "code", "message", "stub"} (the files store's: see backends.files.repair.NOTES)
NOTES = "set_aside_notes"
# each engine's recurring problems, across its sweeps (core/recurring.py)
_PROBLEMS: weakref.WeakKeyDictionary[Engine, recurring.Recurring] = weakref.WeakKeyDictionary()
LEFTOVERS = "checking for leftover processes"  # (a recovery's step: its shortages' kind)
# the ``handed_back`` event of a claim recovered as given up unrun (GIVEN_UP_UNRUN): its
# ``not_started`` (the shortage's own name is not known to the recovery) and its reason
GIVEN_UP_NOT_STARTED = "GIVEN_UP"
UNRUN_REASON = ("its claim was given up before its handler ran (its admission and its "
                "hand-back to pending/ ran short of descriptors or memory); handed back "
                "uncounted")


@dataclass
class SweepReport:
    """What one sweep did (counts plus the ids concerned)."""

    recovered: list[str] = field(default_factory=list)
    duplicates_resolved: list[str] = field(default_factory=list)
    temp_files_removed: int = 0
    locks_removed: int = 0
    # unreadable leftovers moved to the quarantine (files: junk, or a document over the size
    # bound, left in in-progress/), and the failure stubs filed under their ids
    set_aside: list[str] = field(default_factory=list)
    stubs_filed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for ``handoffd sweep``."""
        text = (f"recovered {len(self.recovered)} abandoned claim(s), resolved "
                f"{len(self.duplicates_resolved)} duplicate copies, removed "
                f"{self.temp_files_removed} temp file(s) and {self.locks_removed} stale lock(s)")
        if self.set_aside:
            text += (f"; set aside {len(self.set_aside)} unreadable document(s) (handoff ls "
                     "--state quarantined)")
        return text


def sweep(engine: Engine, *, skip: set[str] | None = None) -> SweepReport:
    """Run every repair once. ``skip``: ids this process is working on right now.

    Each step, and each handoff within a step, is isolated: a document that defeats one repair
    is logged and left for the next sweep, and never stops the repairs of the others. A fault
    that persists (an OSError: no inode left, a lock file it may not write) is said once per
    distinct problem, at most once a minute while it lasts (:mod:`handoffd.core.recurring`)."""
    problems = _PROBLEMS.setdefault(engine, recurring.Recurring())
    with recurring.sweeping(problems, lambda: engine.clock().timestamp()):
        return _sweep(engine, skip or set())


def _sweep(engine: Engine, skip: set[str]) -> SweepReport:
    report = SweepReport()
    now = engine.clock()
    _step("repairing the store", _maintain, engine, skip, report)
    try:
        taken = engine.backend.expired_claims(now, engine.settings.lease_seconds)
    except (OSError, MemoryError) as exc:  # (a MemoryError: a shortage, said as one, as a
        # step's; it once left the sweep for the daemon's "sweep failed" with a traceback)
        recurring.error("looking for abandoned claims", exc,
                        "sweep: cannot look for abandoned claims: %s", exc)
        taken = []
    else:
        recurring.ok("looking for abandoned claims")
    for claim in taken:
        _step(f"recovering {claim.id}", recover, engine, claim, report, kind=recurring.RECOVERY)
    for repair in engine.on_sweep:  # features' own repairs (contracts: file reservations)
        _step(_describe(repair), repair, engine)
    _step("pruning process records of finished attempts", procs.prune_records, engine.ws)
    # another process's recovery may have just marked a specialist (core/suspects.py)
    _step("reading the crash marks", engine.suspects.refresh)
    return report


def _maintain(engine: Engine, skip: set[str], report: SweepReport) -> None:
    done = engine.backend.maintain(engine.clock(), skip=skip)
    report.recovered.extend(done.get("recovered", []))
    report.duplicates_resolved.extend(done.get("duplicates_resolved", []))
    report.temp_files_removed += len(done.get("temp_files_removed", []))
    report.locks_removed += len(done.get("locks_removed", []))
    report.set_aside.extend(done.get("set_aside", []))
    report_set_aside(engine, done.get(NOTES, []), report)


def report_set_aside(engine: Engine, notes: list[str], report: SweepReport) -> None:
    """Do for each document the backend's repairs set aside (``notes``: :data:`NOTES`
    entries) what admission does for one it sets aside (:func:`handoffd.core.admission.
    set_aside`): an event, and the failure stub when asked for. Each on its own: one that
    cannot be filed is one line, and the next is filed."""
    for note in notes:
        try:
            item = json.loads(note)
            handoff_id, code, message = str(item["id"]), str(item["code"]), str(item["message"])
        except (ValueError, KeyError, TypeError) as exc:  # (a bug: the notes are the store's)
            log.error("sweep: a repair's note of what it set aside cannot be read: %s", exc)
            continue
        if isinstance(engine.backend, RecordingBackend):  # (the store's repairs log no event)
            engine.backend.emit("set_aside", handoff_id, SET_ASIDE, None, code=code,
                                reason=message, was=State.IN_PROGRESS.value)
        if item.get("stub") is True:
            _step(f"filing the failure of {handoff_id}", _file_stub, engine, handoff_id, code,
                  message, report)


def _file_stub(engine: Engine, handoff_id: str, code: str, message: str,
               report: SweepReport) -> None:
    """File the failure stub admission files under the id of a document set aside (unless a
    copy of it exists, or appeared since); InvalidDocument when its name is no id."""
    if file_stub(engine, handoff_id, code, message):
        report.stubs_filed.append(handoff_id)


def _describe(repair: Any) -> str:
    """A feature repair's name for the log (e.g. ``running handoffd.contracts.prune``)."""
    name = getattr(repair, "__qualname__", None) or repr(repair)
    module = getattr(repair, "__module__", None)
    return f"running {module}.{name}" if module else f"running {name}"


def _step(what: str, func: Any, *args: Any, kind: str | None = None) -> None:
    """Run one repair; a failure is one log line (with the traceback for bugs), never the sweep.
    An OSError is a recurring problem of ``kind`` (default: ``what``): said once while it lasts."""
    try:
        func(*args)
    except (OSError, MemoryError) as exc:  # (a MemoryError: a shortage, said as one)
        recurring.error(kind or what, exc, "sweep: %s failed: %s; the next sweep tries again",
                        what, exc)
    except DuplicateHandoff as exc:  # a copy appeared in the target folder meanwhile
        log.warning("sweep: %s: %s; the next sweep resolves the copies", what, exc)
    except HandoffdError as exc:  # a refusal (records over their bound, a lock held) is no bug
        code = getattr(exc, "code", None)
        log.error("sweep: %s failed: %s%s; the next sweep tries again", what, exc,
                  f" [{code}]" if code else "")
    except Exception:  # a repair bug must not stop the other repairs
        log.exception("sweep: %s failed; the next sweep tries again", what)
    else:
        recurring.ok(kind or what)


def recover(engine: Engine, claim: Claim, report: SweepReport) -> None:
    """File a claim taken over from a dead or stalled owner: kill what its attempt left running
    on this host (so that a retry never overlaps it), then retry or fail it by its policy; or,
    when its attempt ran no handler (:func:`free_handback`), hand it back uncounted."""
    _kill_leftovers(engine, claim.id, claim.attempt)
    doc = claim.doc
    try:
        dialect = engine.formats.detect(doc)
    except InvalidDocument:  # an unrecognised format: fail it in the native shape
        dialect = engine.formats.by_name("native")
    try:
        spec = engine.specialist_for(dialect.envelope(doc))
    except InvalidDocument:
        spec = None
    now = engine.clock()
    reason = claim.recovered or "owner gone"
    free = free_handback(doc, reason)
    # read before the "recovered" record below: a recovery not followed by a hand-back ends
    # the run (handbacks.stops_in_a_row)
    streak = stops_in_a_row(doc) + 1
    # (recorded either way: a delegation's replay adopts the children an attempt ended by
    # recovery made, see features.children)
    record(doc, "recovered", now, reason=reason)
    if reason == GIVEN_UP_UNRUN and unrun_in_a_row(doc) < FREE_SHORTAGES:
        # its process gave it up before its handler ran (its admission and its hand-back ran
        # short: service.shortclaims), and said so: a claim that never started, no stop and
        # no crash, handed back as a start shortage's is (it was charged as a crash, and a
        # handoff with no retries left failed unrun). Bounded as start shortages are: a mark
        # is an empty folder anyone who reads the lease token can make (a handler ending its
        # own daemon at every start, marked so, was handed back for ever, uncharged)
        engine.requeue(claim, dialect, "handed_back", reason=UNRUN_REASON,
                       not_started=GIVEN_UP_NOT_STARTED)
        report.recovered.append(claim.id)
        return
    if free is not None and streak <= FREE_HANDBACKS:
        # nothing to charge, and no suspect: no handler crashed (nor is its next attempt
        # isolated: core.isolation.crashed_last passes a hand-back). Counted after
        # FREE_HANDBACKS in a row, as any interrupted attempt is: a parent whose aggregation
        # ends its daemon every time is failed after its retries, never handed back for ever
        engine.requeue(claim, dialect, "handed_back", reason=free, interrupted=True)
        report.recovered.append(claim.id)
        return
    message = f"handoff {claim.id}: attempt {claim.attempt} was interrupted: {reason}"
    if free is not None:  # (details: each further interruption in a row counts too)
        message += (f" ({free}; interrupted {streak} times in a row: after {FREE_HANDBACKS} "
                    "hand-backs in a row each counts as an attempt)")
    outcome = engine.failure(now, ErrorCode.PROCESSING_ERROR, message, retryable=True,
                             details={STOPS: streak} if free is not None else None)
    if engine.file(claim, dialect, spec, outcome) is State.FAILED:
        _cancel_orphans(engine, claim)
    report.recovered.append(claim.id)
    if owner_died(reason) and free is None:
        # which handoff ended the process is unknown: all run isolated a while (a stalled
        # owner's lease running out is no crash; an aggregation runs no handler)
        engine.suspects.mark(spec)


def free_handback(doc: dict[str, Any], reason: str) -> str | None:
    """Why a recovered claim's attempt is handed back uncounted (None: it is charged as an
    interrupted attempt). Two ended with no handler cut short by a crash: one this process
    gave up when its filing failed (a full disk: a handler that had succeeded was once
    dead-lettered this way), and the aggregation of a parked parent's children
    (:func:`resumed_aggregation`), which the next daemon simply does again."""
    if reason == GIVEN_UP:
        return "its filing failed in this process"
    if resumed_aggregation(doc):
        return "it was claimed to aggregate its children; no handler was running"
    return None


def resumed_aggregation(doc: dict[str, Any]) -> bool:
    """True when the claimed document ``doc`` (its bookkeeping handoffd's own: a store keeps
    a ``handoffd`` block only where its seal says handoffd wrote it) is a parent parked for its
    children: its claim resumes with their aggregation, and no handler runs
    (features.aggregation.resume runs first, and answers for every such claim). Not an
    answered clarification: its claim runs the handler again, with the answers."""
    block = doc.get("handoffd")
    return isinstance(block, dict) and isinstance(block.get("waiting_children"), dict)


def _cancel_orphans(engine: Engine, claim: Claim) -> None:
    """A parent filed for good after its interrupted attempt: the children that attempt made
    (a replay would have adopted them) have nobody waiting for them, so they are cancelled with
    their descendants, as when storing a delegation fails midway (features.orchestration)."""
    from ..features import cancel_family, children  # (rare: not on every command's imports)
    try:
        orphans = children.made_by_interrupted_attempts(engine, claim.doc, claim.id)
    except (HandoffdError, OSError) as exc:
        log.warning("recovering %s: cannot look for the children its attempt made: %s",
                    claim.id, exc)
        return
    for cid in orphans:
        try:
            cancel_family.cancel(engine, cid, reason=f"the delegation of {claim.id} was "
                                 "interrupted and its parent failed", cascade=True, by=claim.id,
                                 via="recovery")
        except (HandoffdError, OSError) as exc:  # the next child still goes
            log.warning("recovering %s: cannot cancel its child %s: %s", claim.id, cid, exc)


def _kill_leftovers(engine: Engine, handoff_id: str, attempt: int) -> None:
    """Before an abandoned claim is handed back, kill what its attempt left running on this host
    (a background child, a grandchild that called setsid), so that the retry never overlaps it."""
    # any failure is one line and the recovery goes on (a malformed record once made this a
    # TypeError every sweep, and the claim stayed in in-progress/ for good): the token scan of
    # the next attempt and the parent-death signal still bound a leftover
    try:
        procs.kill_leftovers(engine.ws, handoff_id, attempt=attempt)
    except Exception as exc:
        if is_shortage(exc):  # one WARNING naming the limit, held back while it recurs
            recurring.error(LEFTOVERS, exc, "recovering %s: cannot check for leftover "
                            "processes for now: %s", handoff_id, exc)
            return
        log.warning("recovering %s: cannot check for leftover processes: %s: %s", handoff_id,
                    type(exc).__name__, str(exc)[:200])
        return
    recurring.ok(LEFTOVERS)  # (a shortage said before: one line says it cleared)


def requeue_failed(engine: Engine, handoff_id: str, *, force: bool = False,
                   reason: str = "manual retry") -> None:
    """``handoff retry``: move a failed handoff back to pending/ with retry_count + 1."""
    try:
        state, doc = engine.get(handoff_id)
    except NotFound:
        from ..features.archive import archived_as  # (rare: not on every command's path)
        archived = archived_as(engine.ws, handoff_id)
        if archived is not None:  # (`handoff ls` lists no archived handoff: not "not found")
            raise InvalidTransition(
                f"handoff {handoff_id} was archived ({', '.join(archived)}) by retention: an "
                "archived handoff is not retried; submit its request again",
                handoff_id=handoff_id) from None
        raise
    if state is not State.FAILED:
        raise InvalidTransition(f"handoff {handoff_id} is {state.value}, not failed; only failed "
                                "handoffs can be retried", handoff_id=handoff_id)
    code = stub_code(doc)  # (the store's trusted view: a block from outside reads as none)
    if code is not None:
        raise InvalidTransition(
            f"handoff {handoff_id} is a failure stub, a permanent failure: the file dropped as "
            f"{handoff_id}.json was set aside unread as {code} (kept in handoffs/.quarantine/), "
            "so there is no request to retry, even with --force; fix that file and submit it "
            "under a new id", handoff_id=handoff_id)
    _check_parent_open(engine, handoff_id, doc)
    _check_holds_request(engine, handoff_id, doc)
    block = book(doc)
    error = (block.get("final_error") or (given if isinstance(given := doc.get("error"), dict) else None)
             or block.get("last_error") or {})
    if block.get("retry_available", doc.get("retry_available")) is False and not force:
        raise InvalidTransition(
            f"handoff {handoff_id} failed with a permanent error ({error.get('code', 'unknown')}); "
            "fix the cause, then retry with --force", handoff_id=handoff_id)
    dialect = engine.formats.detect(doc)
    restore_request(doc)  # (while its final_error says whose its refused_answer is)
    block["retries"] = book_int(doc, "retries", 0) + 1
    block["last_error"] = error or None
    block.pop("final_error", None)
    block.pop("retry_available", None)
    block.pop("next_attempt_at", None)
    block.pop("lease", None)
    if "retry_count" in doc:
        doc["retry_count"] = block["retries"]
    record(doc, "retried", engine.clock(), reason=reason, forced=force, previous_error=error or None)
    dialect.mark_pending(doc)
    try:
        reopened = engine.backend.reopen(handoff_id, doc)
    except DuplicateHandoff:
        raise InvalidTransition(f"handoff {handoff_id} is already pending again",
                                handoff_id=handoff_id) from None
    if not reopened:
        try:  # another retry (another shell's) won: it is pending again, not gone
            now_state = engine.get(handoff_id)[0]
        except NotFound:
            now_state = None
        if now_state is not None and now_state is not State.FAILED:
            raise InvalidTransition(f"handoff {handoff_id} is {now_state.value}, not failed "
                                    "(retried meanwhile)", handoff_id=handoff_id)
        raise NotFound(f"handoff {handoff_id} moved while retrying; look again with `handoff show`",
                       handoff_id=handoff_id)


def _check_holds_request(engine: Engine, handoff_id: str, doc: dict[str, Any]) -> None:
    """InvalidTransition, even forced, when the failed document holds an answer rather than a
    request (:func:`~handoffd.core.filing.held_answer`, ``doc`` being the store's trusted
    view)."""
    reason = held_answer(engine.formats, doc)
    if reason is not None:
        raise InvalidTransition(f"handoff {handoff_id} cannot be retried, even forced: {reason}",
                                handoff_id=handoff_id)


def _check_parent_open(engine: Engine, handoff_id: str, doc: dict[str, Any]) -> None:
    """InvalidTransition, even with --force, when ``handoff_id`` is a child its parent has
    already aggregated: the parent is filed and its trusted view lists the child (a
    ``parent_id`` a document merely claims outranks nothing). Run again on its own, the child
    would be filed anew while the parent's answer kept its old outcome; retrying the parent
    delegates a new round, aggregated from its own children. An archived parent refuses it
    too (its archived answer keeps the outcome); a purged one, or one still waiting, leaves the
    retry alone: a waiting parent counts the re-run."""
    from ..features.lineage import children_of, parent_of  # (rare: not on every command's path)
    parent = parent_of(doc)
    if parent is None or parent == handoff_id:
        return
    try:
        state, parent_doc = engine.get(parent)
    except NotFound:  # archived by retention: its answer is kept, with the child's outcome
        from ..features.archive import find_archived_document
        found = find_archived_document(engine.ws, engine.backend, parent)
        if found is None:
            return
        state, parent_doc = found
    except InvalidDocument:
        return
    if state.terminal and handoff_id in children_of(parent_doc):
        again = (f"retry the parent instead (`handoff retry --force {parent}`: a new round of "
                 "children)" if state is State.FAILED else
                 "submit the parent's request again instead")
        raise InvalidTransition(
            f"handoff {handoff_id} is a child of {parent}, which is already {state.value} with "
            f"this child's outcome aggregated, so a re-run would not reach it; {again}",
            handoff_id=handoff_id)


def unrun_in_a_row(doc: dict[str, Any]) -> int:
    """How many claims in a row, at the end of the handoff's history, were recovered given up
    unrun and handed back for it (claims, and the "recovered" record just made, skipped)."""
    history = book(doc).get("history")
    count = 0
    for entry in reversed(history if isinstance(history, list) else []):
        event = entry.get("event") if isinstance(entry, dict) else None
        detail = entry.get("detail") if isinstance(entry, dict) else None
        if event == "claimed" or (event == "recovered" and isinstance(detail, dict)
                                  and detail.get("reason") == GIVEN_UP_UNRUN):
            continue
        if event == "handed_back" and isinstance(detail, dict) \
                and detail.get(NOT_STARTED) == GIVEN_UP_NOT_STARTED:
            count += 1
            continue
        break
    return count


# ---------------------------------------------------------------- handoffd.toml changed
CONFIG_CHANGED = ("handoffd.toml changed since this daemon started; restart it to apply the "
                  "changes")


class ConfigWatch:
    """Notices, at a serving daemon's sweeps, that the workspace's handoffd.toml is no longer
    the file it started with: ``serve`` reads it once, at its start, so a specialist added
    while it serves is not served (its handoffs waited in pending/ for ever, "no specialist
    registered" in the log alone). One warning a change (a new stamp), never one a sweep; the
    file as it was at the start again (an edit undone by a copy) says nothing. ``path``:
    the workspace's handoffd.toml."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # (the daemon loads the config just before: close enough); its record says it to
        # `handoff ls` (see daemon_records.py)
        self.started: Stamp = config_stamp(path)
        self.said = self.started

    def check(self) -> bool:
        """Log :data:`CONFIG_CHANGED` once when the file changed since the last look; True
        when it was said now."""
        now = config_stamp(self.path)
        if now == self.said:
            return False
        self.said = now
        if now == self.started:
            return False  # (back as it started: the daemon serves what the file says)
        log.warning(CONFIG_CHANGED)
        return True
