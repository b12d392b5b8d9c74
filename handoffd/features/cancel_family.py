"""Cancelling a handoff and, with ``cascade``, its family (:func:`cancel`: ``handoff cancel``, a
cancellation message, a failed delegation), and filing a pending one cancelled. A running one gets
a cancel request (:mod:`.cancel_requests`) that its daemon carries out (:mod:`.cancellation`).

* A **pending** handoff is claimed by the canceller (so no daemon can start it meanwhile) and filed
  straight into failed/ with status ``cancelled`` and error code ``CANCELLED``; an operation that
  claimed a handoff only to change it and failed hands the claim back as it was
  (:func:`hand_back`). A cancelled fan-out parent keeps what its completed children produced
  (:func:`children_artifacts`).
* ``cascade`` cancels every descendant too (children by ``parent_id``, recursively), including
  those made after the request. The walk of :func:`cancel` goes on to a fixed point: the
  children each member's document names as it is cancelled join it (a parent that delegated
  after the first look). A pending member is filed with the cascade kept in its block
  (:func:`.cancel_requests.keep_cascade`), a cascading request held from its claim to its
  filing; a running one keeps its cascading request until it is filed and its family walked
  again (:func:`settle`: the daemon's filed hook, else its next poll); a parent still making its
  children stops making them and cancels those it made (:func:`cancel_made`); a child never
  starts whose parent or ancestor carries a cascading request or was filed cancelled by a
  cascade (:func:`.cancel_requests.check_before_run`).
* A finished handoff is left alone (the result says so); work may finish before the request
  arrives (seed 000: cancellation is best-effort).
"""
from __future__ import annotations

import copy
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..backends.base import refiling
from ..core.documents import (CHECK, UNRECORDED, book, book_int, check_id, check_text,
                              next_attempt_at)
from ..core.errors import DocumentNotReady, ErrorCode, HandoffdError, InvalidDocument, NotFound
from ..core.logs import log
from ..core.states import State
from ..dialects import hi_moe
from .cancel_requests import (
    MAX_REASON,
    _request_texts,
    cascading,
    keep_cascade,
    request,
    requested,
)
from .lineage import MAX_WALK, children_of, descendants

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.formats import Dialect
    from ..core.storage import Claim
    from .childfacts import ChildInfo, Holding


CLAIM_TRIES = 5
STATUS_TEXT = 200  # what a result quotes of a finished document's status


# ---------------------------------------------------------------- cancelling
@dataclass
class CancelResult:
    """What happened to one handoff: ``cancelled`` (was pending), ``requested`` (running: its owner
    stops it), ``finished`` (already terminal: nothing done), ``unreadable`` (a descendant the
    store would not hand over: ``detail`` has its error code; a cancel request is left).
    ``children``: those its document named as it was cancelled (a cascade goes on to them)."""

    handoff_id: str
    action: str
    state: str
    detail: str = ""
    owner: dict[str, Any] = field(default_factory=dict)
    children: list[str] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.handoff_id, "action": self.action, "state": self.state,
                "detail": self.detail}


def cancel(engine: "Engine", handoff_id: str, *, reason: str, cascade: bool = False,
           by: str = "@cli", via: str = "cli") -> list[CancelResult]:
    """Cancel ``handoff_id`` (NotFound if it does not exist) and, with ``cascade``, every
    descendant. The first result is the handoff's own. ``reason`` is kept to MAX_REASON
    characters: it is written into the document (an unbounded one once pushed a large request
    past max_document_bytes, and nobody could read it back). UsageError, before anything is
    claimed, when ``reason``, ``by`` or ``via`` is not text a document can hold (a lone
    surrogate from argv's undecodable bytes failed the filing, and the claim was stranded)."""
    check_id(handoff_id)
    reason = check_text(reason, "the reason")[:MAX_REASON]
    check_text(by, "who cancels")
    check_text(via, "via")
    own = cancel_one(engine, handoff_id, reason=reason, by=by, via=via, cascade=cascade)
    results = [own]
    if cascade:
        # its children as it was cancelled join the walk: made since the walk looked, or not
        family = [*descendants(engine.backend, handoff_id), *own.children]
        results.extend(_cancel_family(engine, handoff_id, family, reason=reason, by=by, via=via))
    return results


def _cancel_family(engine: "Engine", ancestor: str, members: list[str], *, reason: str, by: str,
                   via: str) -> list[CancelResult]:
    """Cancel each of ``members`` (descendants of ``ancestor``, parents first), with a cascading
    request for those running, then the children each one's document names as it is cancelled
    that were not among them, to a fixed point (at most MAX_WALK): a walk made before misses
    those a member made since (a parent parked with children meanwhile, cancelled from pending,
    left them to run). One unreadable member stops no other."""
    why = f"{reason} (cascaded from {ancestor})"
    results: list[CancelResult] = []
    queue = deque(dict.fromkeys(m for m in members if m != ancestor))
    seen = {ancestor, *queue}
    while queue:
        member = queue.popleft()
        try:
            result = cancel_one(engine, member, reason=why, by=by, via=via, cascade=True)
        except NotFound:
            continue
        except (HandoffdError, OSError) as exc:
            results.append(_unreadable(engine, member, exc, reason=why, by=by, via=via))
            continue
        results.append(result)
        for kid in result.children:
            if kid not in seen and len(seen) < MAX_WALK:
                seen.add(kid)
                queue.append(kid)
    return results


def cancel_made(engine: "Engine", parent: str, children: list[str], body: dict[str, Any]) -> None:
    """Cancel, with their descendants, ``children`` a delegation of ``parent`` made before it saw
    the cascading cancel request ``body``: a walk of the family that ran before they existed
    missed them. Never raises (each failure is a line; the walk at the parent's filing tries
    again)."""
    reason, by = _request_texts(body)
    try:
        results = _cancel_family(engine, parent, children, reason=reason, by=by, via="cascade")
    except Exception as exc:  # (a bug) the parent's filing, and its walk, still go on
        log.warning("handoff %s: cannot cancel the children it made: %s: %s", parent,
                    type(exc).__name__, str(exc)[:200])
        return
    for result in results:
        if result.action == "unreadable":
            log.warning("handoff %s: child %s %s", parent, result.handoff_id, result.detail)


def settle(engine: "Engine", handoff_id: str) -> None:
    """``handoff_id`` is filed for good: carry its cancel request's cascade to every descendant
    (children made or claimed after the canceller's walk included), then drop the request.
    Kept when the walk cannot be made, for the next poll. Never raises (a daemon's filed hook
    and its poll call it). With no request read, nothing is dropped: the usual case, where a
    second look (the drop's) cost every filing a system call. A request written after this
    read is one the drop might have removed unwalked; it stays for the next poll, which finds
    the handoff filed and settles it here again."""
    body = requested(engine, handoff_id)
    if body is None:
        return
    if cascading(body):
        reason, by = _request_texts(body)
        try:
            # the canceller's walk scanned for children other producers made; the ones made
            # since are in the children lists (or the tree shows an attempt that died)
            family = descendants(engine.backend, handoff_id, scan=False)
            _cancel_family(engine, handoff_id, family, reason=reason, by=by, via="cascade")
        except (HandoffdError, OSError) as exc:  # a folder unreadable now: the next poll
            log.error("handoff %s: cannot cancel its descendants yet: %s", handoff_id, exc)
            return
    try:
        engine.backend.clear_cancel(handoff_id)
    except (HandoffdError, OSError) as exc:
        log.error("handoff %s: cannot drop its cancel request: %s", handoff_id, exc)


def _unreadable(engine: "Engine", handoff_id: str, exc: Exception, *, reason: str, by: str,
                via: str) -> CancelResult:
    """The result for a descendant the store would not hand over (its document unreadable, a
    folder it cannot read): a cancel request is left, so whoever reads it later (a daemon
    setting it aside, or running it once it is readable) cancels it."""
    code = getattr(exc, "code", None) or type(exc).__name__
    detail = f"not cancelled: {code}: {str(exc)[:200]}"
    try:
        request(engine, handoff_id, reason=reason, cascade=True, by=by, via=via)
        detail += "; a cancel request is left for it"
    except (HandoffdError, OSError):
        pass
    log.info("cancel: %s: %s", handoff_id, detail)
    return CancelResult(handoff_id, "unreadable", "unknown", detail)


def cancel_one(engine: "Engine", handoff_id: str, *, reason: str, by: str, via: str,
               cascade: bool = False) -> CancelResult:
    """Cancel one handoff (see :func:`cancel`). With ``cascade``, a pending one is filed with
    the cascade kept in its block, and the result names the children its document named."""
    kids: list[str] = []
    for _ in range(CLAIM_TRIES):
        try:
            state, doc = engine.get(handoff_id)
        except NotFound:
            from .archive import archived_as  # (rare: an id retention archived)
            archived = archived_as(engine.ws, handoff_id)
            if archived is None:
                raise
            return CancelResult(handoff_id, "finished", archived[0],
                                f"already {archived[0]} ({archived[1]}); nothing to cancel")
        kids = children_of(doc)  # (a trusted view: a block from outside names none)
        if state.terminal:
            status = reported_status(doc) or state.value
            return CancelResult(handoff_id, "finished", state.value,
                                f"already {state.value} (status {status}); nothing to cancel",
                                children=kids)
        if state is State.IN_PROGRESS:
            request(engine, handoff_id, reason=reason, cascade=cascade, by=by, via=via)
            lease = given if isinstance(given := book(doc).get("lease"), dict) else {}
            owner = given if isinstance(given := lease.get("owner"), dict) else {}
            where = f" on {owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else ""
            return CancelResult(handoff_id, "requested", state.value,
                                f"running{where}; its daemon stops the handler", owner, kids)
        filed = _cancel_pending(engine, handoff_id, reason=reason, by=by, cascade=cascade, via=via)
        if filed is not None:
            return CancelResult(handoff_id, "cancelled", filed[0].value, "was pending",
                                children=filed[1])
    # it keeps moving: leave a request so whoever holds it cancels it
    request(engine, handoff_id, reason=reason, cascade=cascade, by=by, via=via)
    return CancelResult(handoff_id, "requested", "in-progress", "cancel request left for its owner",
                        children=kids)


def reported_status(doc: dict[str, Any]) -> str | None:
    """The status a finished document reports, read through its format: a hi_moe answer's is
    its ``payload.status`` (seed 000's OutcomeStatus: a Message has no top-level ``status``,
    and a timed-out child was reported "failed", a cancelled one "None"), every other
    format's its ``status``; None when it has none. At most STATUS_TEXT characters (it is
    printed, and a document placed in the workspace may hold any string there)."""
    reported = hi_moe.read_outcome(doc)
    status = reported.get("status") if reported is not None else doc.get("status")
    return status[:STATUS_TEXT] if isinstance(status, str) else None


def _cancel_pending(engine: "Engine", handoff_id: str, *, reason: str, by: str,
                    cascade: bool = False, via: str = "cli") -> tuple[State, list[str]] | None:
    """Claim a pending handoff (so nobody starts it) and file it cancelled: (where it went, the
    children its document names). None: it moved. Whatever fails once it is claimed hands the
    claim back, as it was, before the error goes on: a cancel left in in-progress/ was
    recovered by the sweep as a dead owner's claim and run (its cancel lost, a retry spent).
    ``cascade``: the filed block keeps the cascade, and a cascading request (``via``) is held
    from the claim until then: no child of it starts meanwhile (nor after: the block)."""
    now = engine.clock()
    try:
        claimed = engine.claim(handoff_id)
    except DocumentNotReady:
        return None
    if claimed is None:
        return None
    claim, dialect = claimed
    saved = copy.deepcopy(claim.doc)
    kids = children_of(claim.doc)  # (pending, it makes no more: the list is final)
    try:
        if cascade:
            request(engine, handoff_id, reason=reason, cascade=True, by=by, via=via)
            keep_cascade(claim.doc, {"reason": reason, "requested_by": by})
        where = _file_cancelled(engine, claim, dialect, now, reason=reason, by=by)
    except BaseException as exc:
        hand_back(engine, claim, dialect, saved, "cancelling it", exc)
        if cascade:  # (a member of a cascade that failed so gets one again: _unreadable)
            _drop_request(engine, handoff_id)
        raise
    if cascade and where.terminal:  # (a claim lost: its holder meets the request)
        _drop_request(engine, handoff_id)  # the filed block keeps the cascade from now on
    return where, kids


def _drop_request(engine: "Engine", handoff_id: str) -> None:
    """Drop the cancel request of ``handoff_id``; a failure is one line (the daemon's poll
    drops it later, once it has walked the family of the filed handoff again)."""
    try:
        engine.backend.clear_cancel(handoff_id)
    except (HandoffdError, OSError) as exc:
        log.warning("handoff %s: cannot drop its cancel request: %s", handoff_id, exc)


def _file_cancelled(engine: "Engine", claim: "Claim", dialect: "Dialect", now: datetime, *,
                    reason: str, by: str) -> State:
    """File the claimed pending handoff cancelled (its claim by the canceller is no attempt)."""
    handoff_id = claim.id
    block = book(claim.doc)
    history = block.get("history")
    if (isinstance(history, list) and history and isinstance(history[-1], dict)
            and history[-1].get("event") == "claimed"):
        history.pop()  # the canceller claimed it only to file it; it never ran
    block["attempt"] = max(book_int(claim.doc, "attempt", 1) - 1, 0)
    block.pop("waiting_children", None)  # a cancelled parent aggregates nothing
    block.pop("awaiting", None)
    try:
        spec = engine.specialist_for(dialect.envelope(claim.doc))
    except InvalidDocument:
        spec = None
    outcome = engine.failure(now, ErrorCode.CANCELLED,
                             f"handoff {handoff_id} cancelled by {by}: {reason}",
                             retryable=False)
    outcome.artifacts = children_artifacts(engine, claim.doc)
    if claim.raw:
        # a document from outside, never admitted: its id is taken now, as an admission takes
        # it, so a later document reusing it is set aside as a duplicate (the claim's event,
        # popped above, was all that said it came from outside; a retry of this one, by
        # choice, runs). A failure here hands the claim back with the search still to do
        engine.backend.seen_add(handoff_id, now)
    with refiling(claim):  # a filing that fails before writing keeps the claim ours
        return engine.file(claim, dialect, spec, outcome)


def _why(exc: BaseException) -> str:
    """``exc`` in a line a document can hold (its text may quote a lone surrogate)."""
    text = f"{type(exc).__name__}: {str(exc)[:200]}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def hand_back(engine: "Engine", claim: "Claim", dialect: "Dialect", saved: dict[str, Any],
              doing: str, exc: BaseException) -> None:
    """Put ``claim`` back in pending/ as ``saved`` (its document as claimed), due when it was
    and without spending its attempt, its ``handed_back`` event saying that ``doing`` failed
    with ``exc``: an operation that claimed a handoff only to change it (cancel, answer) and
    failed leaves it as it found it. Never raises: when even this fails
    (the claim was given up by a filing that failed midway, the disk is full), the claim is
    left to the sweep, with a log line; the caller raises the first error."""
    try:
        claim.doc.clear()  # in place: the backend's claim shares the document
        claim.doc.update(copy.deepcopy(saved))
        history = book(claim.doc).get("history")
        if (isinstance(history, list) and history and isinstance(history[-1], dict)
                and history[-1].get("event") == "claimed"):
            history.pop()  # it never ran
        # a document from outside, whose claimed event goes: its next admission must still
        # search for its id and record it (the mark a shortage's hand-back leaves), else a
        # duplicate dropped by a producer ran unchecked once the cancel failed
        mark: dict[str, Any] = {UNRECORDED: CHECK} if claim.raw else {}
        where = engine.requeue(claim, dialect, "handed_back", due_at=next_attempt_at(saved),
                               reason=f"{doing} failed: {_why(exc)}", **mark)
    except BaseException as again:  # (a second failure must not hide the first)
        log.error("handoff %s: cannot hand back its claim (%s); the sweep recovers it",
                  claim.id, _why(again))
        return
    if where is not State.PENDING:
        log.error("handoff %s: its claim had ended (filed, given up by a filing that failed, or "
                  "taken over) before it could be handed back; nothing was written", claim.id)


def children_artifacts(engine: "Engine", doc: dict[str, Any]) -> list[Any]:
    """What the completed children of a cancelled fan-out parent produced (each marked with its
    ``metadata.child_id``): cancelling the parent keeps the work that was done (seed 000: a
    cancelled receiver responds "including any partial results"). Each child is read through
    its format as aggregation reads it (:func:`.childfacts.read_child`): a hi_moe child keeps
    its artifacts in ``payload.artifacts`` beside its ``output`` artifact, a native one in
    ``artifacts`` (the other formats' parents make native children). Each child's output is
    kept as a ``child_output`` artifact (an aggregated answer's ``output.results`` holds it;
    a cancelled parent's answer is a failure's, and its artifacts are what it files), before
    its artifacts. At most max_output_bytes of them (JSON) are kept, the outputs first, as an
    aggregated answer copies them (:mod:`.answer_copies`): an output that does not fit is
    named by an ``output_omitted`` record, a child's artifacts by an ``artifacts_omitted`` one
    (the filed parent stays readable)."""
    # loaded by the first cancelled handoff that has children (`handoff cancel` of one without
    # never loads them)
    from .childfacts import Holding, from_child

    budget = Holding(engine.settings.max_output_bytes)
    children = book(doc).get("children")
    ids = [c for c in children if isinstance(c, str)] if isinstance(children, list) else []
    out: list[Any] = []  # the outputs first, then the artifacts
    done: list[str] = []
    for child in dict.fromkeys(ids):  # (a list written twice names a child twice)
        info = _completed_child(engine, child)
        if info is None:
            continue
        done.append(child)
        if info.output is not None:
            record = _output_record(info)  # (None: it cannot be written as text)
            out.extend(_within(engine, budget, child, "output", [record] if record else [],
                                   size=None if record else sys.maxsize))
    for child in done:
        # read again: one child's answer in hand at a time (the outputs had the budget first)
        info = _completed_child(engine, child)
        if info is not None:
            items = [from_child(_not_output(item), child) for item in info.artifacts
                     if isinstance(item, dict)]
            out.extend(_within(engine, budget, child, "artifacts", items))
    return out


def _not_output(item: dict[str, Any]) -> dict[str, Any]:
    """A child's artifact as its cancelled parent keeps it: a hi_moe child's ``output``
    artifact stored by reference (an output of 1 KB or more: only an inline one is read as its
    output) becomes a ``child_output`` record keeping its reference, as an inline output does
    (:func:`_output_record`); in the parent, an ``output`` artifact would read as the parent's
    own answer (review R40)."""
    if item.get("artifact_type") == "output":
        return {**item, "artifact_type": "child_output"}
    return item


def _completed_child(engine: "Engine", child: str) -> "ChildInfo | None":
    """``child`` read through its format with its output and artifacts, when it completed
    successfully (or partially); None otherwise, or when its answer cannot be read (a file
    placed in the workspace: the parent is cancelled all the same, without that child's)."""
    from .childfacts import SUCCESS_LIKE, Holding, read_child
    try:
        # one child's answer in hand at a time: the budget is applied by the caller
        info = read_child(engine, child, Holding(sys.maxsize))
    except (HandoffdError, OSError, TypeError, ValueError, RecursionError) as exc:
        log.warning("cancel: the output and artifacts of child %s are not kept: its answer "
                    "cannot be read: %s: %s", child, type(exc).__name__, str(exc)[:200])
        return None
    if info.state != State.COMPLETED.value or info.status not in SUCCESS_LIKE:
        return None
    return info


def _output_record(info: "ChildInfo") -> dict[str, Any] | None:
    """A child's output as an artifact of its cancelled parent: inline text (JSON unless it is
    a string, as a hi_moe answer's own ``output`` artifact holds it), tagged with its id. Its
    type is not ``output``: a hi_moe parent's ``output`` artifact is read as its own answer.
    None when it cannot be written as JSON text."""
    from . import artifacts
    from .childfacts import from_child
    output = info.output
    try:
        text = output if isinstance(output, str) else json.dumps(
            output, ensure_ascii=False, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    media = "text/plain" if isinstance(output, str) else "application/json"
    record = artifacts._record("child_output", name=None, ref=None, facts=None, inline=text,
                               metadata={"media_type": media})
    return dict(from_child(record, info.handoff_id))


def _within(engine: "Engine", budget: "Holding", child: str, what: str, items: list[Any], *,
            size: int | None = None) -> list[Any]:
    """``items`` (``child``'s output record, or its artifacts) when they fit in what is left
    of ``budget`` (JSON bytes, or ``size``; taken from it), else one ``output_omitted`` or
    ``artifacts_omitted`` record naming the child and their size."""
    from . import artifacts
    from .childfacts import json_size
    size = json_size(items) if size is None else size
    if size <= budget.left:
        budget.left -= size
        return items
    shown = "too large to write" if size == sys.maxsize else f"{size} bytes"
    said = "its output is" if what == "output" else f"its {len(items)} artifacts are"
    meta: dict[str, Any] = {"child_id": child, "size_bytes": size}
    if what != "output":
        meta["count"] = len(items)
    return [artifacts._record(
        f"{what}_omitted", name=None, ref=None, facts=None,
        inline=f"{said} not kept ({shown}): a cancelled parent keeps at most "
               f"{engine.settings.max_output_bytes} bytes of its children's outputs and "
               f"artifacts; see `handoff show {child}`",
        metadata=meta)]
