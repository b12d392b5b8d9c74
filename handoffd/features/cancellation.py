"""Cancellation (seed 000's CancellationPayload): stop pending or running work, optionally cascading.

* A **pending** handoff is claimed by the canceller (so no daemon can start it meanwhile) and filed
  straight into failed/ with status ``cancelled`` and error code ``CANCELLED``.
* A **running** handoff may belong to another process: the canceller records a cancel request in
  the backend (files: ``handoffs/.meta/cancel/<id>.json``, written atomically). Every daemon is
  woken by it (the backend's wake-up feed, plus a look at every rescan) and the one running the
  handoff stops its handler at once (command
  handlers' process groups get SIGTERM, then SIGKILL; Python handlers see ``ctx.cancelled``). The
  handoff is filed ``cancelled`` with whatever partial result the handler left: a JSON result a
  command handler prints on SIGTERM, or what a Python handler passed to ``ctx.report_partial()``.
  A request also cancels the handoff if it comes back to pending/ (recovered from a dead owner).
* ``cascade`` cancels every descendant too (children by ``parent_id``, recursively), including
  those made after the request: the walk of :func:`cancel` sees the family as it is then, so a
  cascading request stays until the handoff is filed and its family walked again (the daemon's
  filed hook, else its next poll); a parent still making its children stops making them and
  cancels those it made (:func:`cancel_made`); a child whose parent carries a cascading request
  never starts (:func:`check_before_run`).
* A seed 000 Message whose payload has ``target_message_id`` is a cancellation request: the daemon
  carries it out and files the message itself as completed with a short summary.
* A finished handoff is left alone (the result says so); work may finish before the request
  arrives (seed 000: cancellation is best-effort).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol

from ..backends.base import refiling
from ..core.documents import (
    BOOK,
    Envelope,
    Outcome,
    actor,
    book,
    book_int,
    check_id,
    check_text,
    next_attempt_at,
)
from ..core.engine import Verdict
from ..core.errors import (
    DocumentNotReady,
    ErrorCode,
    HandlerError,
    HandoffdError,
    InvalidDocument,
    NotFound,
    UnreadableDocument,
)
from ..core.logs import log
from ..core.states import State
from ..core.storage import Wakeup
from ..core.timeutil import iso
from .lineage import descendants, parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine, Job
    from ..core.formats import Dialect
    from ..core.storage import Claim

CLAIM_TRIES = 5


class DaemonPlugins(Protocol):
    """What cancellation uses of a daemon (its public plugin API; see handoffd.service.daemon)."""

    engine: "Engine"

    def running_job(self, handoff_id: str) -> "Job | None": ...
    def queue(self, handoff_id: str) -> None: ...
    def request_rescan(self) -> None: ...
    def add_scan_hook(self, hook: Callable[[], None]) -> None: ...
    def add_message_handler(self, predicate: Callable[[dict[str, Any] | None], bool],
                            handler: Callable[["Engine", str], State | None]) -> None: ...
    def add_filed_hook(self, hook: Callable[[str, State], None]) -> None: ...
    def add_wakeup_hook(self, hook: Callable[[Wakeup], None], *,
                        kinds: Collection[str] | None = None) -> None: ...



MAX_REASON = 1000  # characters of a cancellation's reason kept in the document


def install(engine: "Engine") -> None:
    """Add cancellation to an Engine (orchestration installs it): the cancel gate, a check just
    before the handler starts, partial results of a stopped handler, and the daemon side."""
    engine.gates.insert(0, cancel_gate)
    # first of the resumers, which run before anything else of an attempt: a parked parent
    # claimed at its aggregation deadline (the scheduler skips the gates then) was aggregated
    # rather than cancelled; a request that arrived while the handoff was claimed is met too
    engine.resumers.insert(0, lambda job, _started: check_before_run(engine, job))
    engine.daemon_plugins.append(attach)


def attach(daemon: DaemonPlugins) -> None:
    """The daemon side: be woken by new cancel requests, act on requests at every scan, carry out
    cancellation messages, and settle the request of a handoff once it is filed for good."""
    daemon.add_scan_hook(lambda: poll(daemon))
    daemon.add_message_handler(is_cancel_message, handle_message)
    daemon.add_filed_hook(lambda handoff_id, where: settle(daemon.engine, handoff_id)
                          if where.terminal else None)
    daemon.add_wakeup_hook(lambda wakeup: daemon.request_rescan()
                           if wakeup.kind == "cancel" else None, kinds={"cancel"})


def request(engine: "Engine", handoff_id: str, *, reason: str, cascade: bool, by: str,
            via: str) -> None:
    """Ask whoever runs ``handoff_id`` to stop it (a cancel request in the backend)."""
    check_id(handoff_id)
    engine.backend.request_cancel(handoff_id, {
        "handoff_id": handoff_id, "reason": reason, "cascade": cascade, "requested_by": by,
        "via": via, "requested_at": iso(engine.clock()), "actor": actor()})


def describe(body: dict[str, Any] | None) -> str:
    """A cancel request in a line a document can hold: its reason and who asked."""
    reason, by = _request_texts(body or {})
    who = (body or {}).get("requested_by")
    return f"{reason} (by {by})" if isinstance(who, str) and who else reason


def requested(engine: "Engine", handoff_id: str) -> dict[str, Any] | None:
    """The cancel request recorded for ``handoff_id``, or None. Never raises: a store that
    cannot answer now is asked again by whoever looks next (a gate, the daemon's poll)."""
    try:
        body = engine.backend.cancel_request(handoff_id)
    except (HandoffdError, OSError) as exc:
        log.debug("handoff %s: cannot read its cancel request: %s", handoff_id, exc)
        return None
    return body if isinstance(body, dict) else None


def cascading(body: dict[str, Any] | None) -> bool:
    """True when the cancel request ``body`` asks for the descendants too."""
    return isinstance(body, dict) and body.get("cascade") is True


def _text(value: object, default: str, limit: int) -> str:
    """``value`` as text a document can hold (a request is read from the store: a lone
    surrogate there must not make every cancel it asks for fail its check), at most ``limit``
    characters."""
    text = value if isinstance(value, str) and value else default
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


# ---------------------------------------------------------------- engine hooks
def cancel_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """A pending handoff with a cancel request is filed cancelled instead of being run."""
    body = engine.backend.cancel_request(env.handoff_id)
    if body is None:
        return None
    return Verdict.fail(ErrorCode.CANCELLED, f"handoff {env.handoff_id} cancelled: {describe(body)}")


def check_before_run(engine: "Engine", job: "Job") -> None:
    """Before an attempt runs or resumes (the engine's first resumer): a request that arrived
    while the handoff was being claimed, or that the gates were not asked about (a parked
    parent claimed at its aggregation deadline), ends it CANCELLED; so does a cascading
    request of its parent (one read more per attempt)."""
    body = engine.backend.cancel_request(job.handoff_id)
    if body is not None:
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(body)}",
                           handoff_id=job.handoff_id, code=ErrorCode.CANCELLED, retryable=False)
    # a child made, or claimed, after its parent's cascading request was walked: the request
    # stays until the family is walked again, and the child must not start meanwhile
    parent = parent_of(job.claim.doc)
    above = requested(engine, parent) if parent is not None and parent != job.handoff_id else None
    if cascading(above):
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(above)} (cascaded "
                           f"from {parent})", handoff_id=job.handoff_id, code=ErrorCode.CANCELLED,
                           retryable=False)


# ---------------------------------------------------------------- cancelling
@dataclass
class CancelResult:
    """What happened to one handoff: ``cancelled`` (was pending), ``requested`` (running: its owner
    stops it), ``finished`` (already terminal: nothing done), ``unreadable`` (a descendant the
    store would not hand over: ``detail`` has its error code; a cancel request is left)."""

    handoff_id: str
    action: str
    state: str
    detail: str = ""
    owner: dict[str, Any] = field(default_factory=dict)

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
    results = [cancel_one(engine, handoff_id, reason=reason, by=by, via=via, cascade=cascade)]
    if cascade:
        results.extend(_cancel_family(engine, handoff_id, descendants(engine.backend, handoff_id),
                                      reason=reason, by=by, via=via))
    return results


def _cancel_family(engine: "Engine", ancestor: str, members: list[str], *, reason: str, by: str,
                   via: str) -> list[CancelResult]:
    """Cancel each of ``members`` (descendants of ``ancestor``), with a cascading request for
    those running: one unreadable member stops no other."""
    why = f"{reason} (cascaded from {ancestor})"
    results: list[CancelResult] = []
    for member in members:
        try:
            results.append(cancel_one(engine, member, reason=why, by=by, via=via, cascade=True))
        except NotFound:
            continue
        except (HandoffdError, OSError) as exc:
            results.append(_unreadable(engine, member, exc, reason=why, by=by, via=via))
    return results


def _request_texts(body: dict[str, Any]) -> tuple[str, str]:
    """(reason, by) of a stored request, as text a document can hold."""
    reason = _text(body.get("reason"), "cancellation requested", MAX_REASON)
    return reason, _text(body.get("requested_by"), "@handoffd", 200)


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
    and its poll call it)."""
    body = requested(engine, handoff_id)
    if body is not None and cascading(body):
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
    """Cancel one handoff (see :func:`cancel`)."""
    for _ in range(CLAIM_TRIES):
        state, doc = engine.get(handoff_id)
        if state.terminal:
            status = doc.get("status") if isinstance(doc.get("status"), str) else state.value
            return CancelResult(handoff_id, "finished", state.value,
                                f"already {state.value} (status {status}); nothing to cancel")
        if state is State.IN_PROGRESS:
            request(engine, handoff_id, reason=reason, cascade=cascade, by=by, via=via)
            lease = given if isinstance(given := book(doc).get("lease"), dict) else {}
            owner = given if isinstance(given := lease.get("owner"), dict) else {}
            where = f" on {owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else ""
            return CancelResult(handoff_id, "requested", state.value,
                                f"running{where}; its daemon stops the handler", owner)
        filed = _cancel_pending(engine, handoff_id, reason=reason, by=by)
        if filed is not None:
            return CancelResult(handoff_id, "cancelled", filed.value, "was pending")
    # it keeps moving: leave a request so whoever holds it cancels it
    request(engine, handoff_id, reason=reason, cascade=cascade, by=by, via=via)
    return CancelResult(handoff_id, "requested", "in-progress", "cancel request left for its owner")


def _cancel_pending(engine: "Engine", handoff_id: str, *, reason: str, by: str) -> State | None:
    """Claim a pending handoff (so nobody starts it) and file it cancelled. None: it moved.
    Whatever fails once it is claimed hands the claim back, as it was, before the error goes
    on: a cancel left in in-progress/ was recovered by the sweep as a dead owner's claim and
    run (its cancel lost, a retry spent)."""
    now = engine.clock()
    try:
        claimed = engine.claim(handoff_id)
    except DocumentNotReady:
        return None
    if claimed is None:
        return None
    claim, dialect = claimed
    saved = copy.deepcopy(claim.doc)
    try:
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
        with refiling(claim):  # a filing that fails before writing keeps the claim ours
            return engine.file(claim, dialect, spec, outcome)
    except BaseException as exc:
        hand_back(engine, claim, dialect, saved, "cancelling it", exc)
        raise


def _runs_here(engine: "Engine", doc: dict[str, Any]) -> bool:
    """A specialist of this daemon runs ``doc`` (True too when it cannot be told: the gate
    decides then)."""
    try:
        return engine.specialist_for(engine.formats.detect(doc).envelope(doc)) is not None
    except (InvalidDocument, KeyError):
        return True


def _cancel_unserved(engine: "Engine", handoff_id: str, body: dict[str, Any]) -> None:
    """File the cancel of a pending handoff that no specialist here runs. Its cancel gate is
    never reached (nothing here claims it to run), and queueing it again at every rescan kept
    a batch from ever ending; any process may cancel a pending handoff, as the command line
    does. A failure is one line: the next rescan tries again."""
    reason, by = _request_texts(body)
    try:
        filed = _cancel_pending(engine, handoff_id, reason=reason, by=by)
    except (HandoffdError, OSError) as exc:
        log.error("handoff %s: cannot file its cancel: %s; will try again", handoff_id, exc)
        return
    if filed is not None:
        log.info("handoff %s: cancelled while pending (no specialist here runs it)", handoff_id)


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
        where = engine.requeue(claim, dialect, "handed_back", due_at=next_attempt_at(saved),
                               reason=f"{doing} failed: {_why(exc)}")
    except BaseException as again:  # (a second failure must not hide the first)
        log.error("handoff %s: cannot hand back its claim (%s); the sweep recovers it",
                  claim.id, _why(again))
        return
    if where is not State.PENDING:
        log.error("handoff %s: its claim had ended (filed, given up by a filing that failed, or "
                  "taken over) before it could be handed back; nothing was written", claim.id)


def children_artifacts(engine: "Engine", doc: dict[str, Any]) -> list[Any]:
    """What the completed children of a cancelled fan-out parent produced (each marked with its
    ``metadata.child_id``): cancelling the parent keeps the work that was done."""
    out: list[Any] = []
    children = book(doc).get("children")
    for child in children if isinstance(children, list) else []:
        try:
            state, child_doc = engine.get(str(child))
        except (HandoffdError, OSError):
            continue
        items = child_doc.get("artifacts") if state is State.COMPLETED else None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict):
                given = item.get("metadata")
                meta: dict[str, Any] = given if isinstance(given, dict) else {}
                out.append({**item, "metadata": {**meta, "child_id": child}})
    return out


# ---------------------------------------------------------------- daemon side
def poll(daemon: DaemonPlugins) -> None:
    """Act on cancel requests: stop our running handlers, queue pending ones for the cancel gate,
    and drop requests for handoffs that are finished or gone. Never raises (the daemon loop
    calls it at every rescan)."""
    try:
        _poll(daemon)
    except (HandoffdError, OSError) as exc:  # the store is unreachable, a folder unreadable:
        log.error("cannot read the cancel requests: %s; will try again", exc)  # one line
    except Exception:  # a bug: its traceback, and the daemon goes on
        log.exception("cannot read the cancel requests")


def _poll(daemon: DaemonPlugins) -> None:
    backend = daemon.engine.backend
    for handoff_id, body in backend.cancel_requests().items():
        try:
            check_id(handoff_id)
        except InvalidDocument:
            continue
        job = daemon.running_job(handoff_id)
        if job is not None:
            if not job.context.cancel_logged:
                job.context.cancel_logged = True
                log.info("handoff %s: cancel requested; stopping its handler", handoff_id)
            from ..core.runner import (
                cancel as stop_handler,  # loaded by the daemon already
            )
            stop_handler(job.context, describe(body))
            continue
        try:
            found = backend.get(handoff_id)
        except InvalidDocument:
            continue  # unreadable right now: look again at the next scan
        if found is not None and found[0] is State.PENDING:
            if _runs_here(daemon.engine, found[1]):
                daemon.queue(handoff_id)  # its cancel gate files it
            else:
                _cancel_unserved(daemon.engine, handoff_id, body)
        elif found is not None and found[0].terminal:
            settle(daemon.engine, handoff_id)  # its cascade reaches the whole family first
        elif found is None:
            backend.clear_cancel(handoff_id)  # unknown


# ---------------------------------------------------------------- cancellation messages
def is_cancel_message(doc: dict[str, Any] | None) -> bool:
    """True for a seed 000 CancellationPayload message: a hi_moe Message (as its format is
    detected, bookkeeping from outside aside) whose payload names a ``target_message_id``.
    Seed 000 defines that payload for hi_moe Messages only: a HAIOS directive or a native
    request that happens to carry the key is work for its own specialist (it once cancelled an
    unrelated handoff instead of running)."""
    if not isinstance(doc, dict):
        return False
    payload = doc.get("payload")
    if not (isinstance(payload, dict) and isinstance(payload.get("target_message_id"), str)):
        return False
    from ..dialects import detect
    try:
        return detect({k: v for k, v in doc.items() if k != BOOK}).name == "hi_moe"
    except InvalidDocument:
        return False


def handle_message(engine: "Engine", handoff_id: str) -> State | None:
    """Claim a cancellation message, carry it out, and file it (completed, with a summary)."""
    now = engine.clock()
    claimed = engine.claim(handoff_id)
    if claimed is None:
        return None
    claim, dialect = claimed
    doc = claim.doc
    if claim.raw:  # never handled by handoffd
        if engine.backend.seen_contains(handoff_id, now):
            engine.set_aside_claim(claim, ErrorCode.DUPLICATE_HANDOFF_ID,
                                   f"message id {handoff_id} was already used recently")
            return None
        engine.backend.seen_add(handoff_id, now)
    try:
        engine.validate(doc, dialect, handoff_id=handoff_id,
                        subject=f"cancellation message {handoff_id} is invalid")
    except InvalidDocument as exc:
        return engine.file(claim, dialect, None, engine.failure(now, exc.code, str(exc),
                                                                errors=exc.errors))
    payload = doc["payload"]
    target = payload["target_message_id"]
    reason = payload.get("reason") if isinstance(payload.get("reason"), str) else "cancelled"
    cascade = payload.get("cascade") is True
    source = doc.get("source_tier") if isinstance(doc.get("source_tier"), str) else "message"
    try:
        results = cancel(engine, target, reason=reason, cascade=cascade, by=str(source),
                         via=f"message:{handoff_id}")
    except NotFound:
        outcome = engine.failure(now, ErrorCode.TARGET_NOT_FOUND, f"cancellation {handoff_id}: no handoff "
                                 f"{target} in this workspace", retryable=False)
        return engine.file(claim, dialect, None, outcome)
    except (InvalidDocument, UnreadableDocument) as exc:  # the target's document is unusable
        outcome = engine.failure(now, exc.code, f"cancellation {handoff_id}: {exc}", retryable=False)
        return engine.file(claim, dialect, None, outcome)
    except (HandoffdError, OSError) as exc:  # the store refused: worth another try
        outcome = engine.failure(now, ErrorCode.PROCESSING_ERROR, f"cancellation {handoff_id}: "
                                 f"cannot reach {target}: {exc}", retryable=True)
        return engine.file(claim, dialect, None, outcome)
    own = results[0]
    cascaded = [r for r in results[1:] if r.action in ("cancelled", "requested")]
    unreadable = [r.handoff_id for r in results[1:] if r.action == "unreadable"]
    summary = (f"cancellation of {target}: {own.action} ({own.detail})"
               + (f"; {len(cascaded)} descendant(s) cancelled" if cascade else "")
               + (f"; {len(unreadable)} unreadable, not cancelled: {', '.join(unreadable[:5])}"
                  if unreadable else ""))
    outcome = Outcome(status="completed", started_at=now, finished_at=engine.clock(),
                      output={"summary": summary, "target_message_id": target, "cascade": cascade,
                              "results": [r.as_dict() for r in results]},
                      metadata={"confidence": 1.0}, executed_by="handoffd")
    return engine.file(claim, dialect, None, outcome)
