"""Cancellation (seed 000's CancellationPayload): stop pending or running work, optionally cascading.

This module installs the feature and holds its daemon side. A cancel request, and the gates that
honour it before a run, are :mod:`.cancel_requests`; cancelling a handoff and its family (a
pending one filed ``cancelled`` by the canceller, a cascade's walk) is :mod:`.cancel_family`.

* A **running** handoff may belong to another process, which a cancel request reaches: every
  daemon is woken by it (the backend's wake-up feed, plus a look at every rescan) and the one
  running the handoff stops its handler at once (command handlers' process groups get SIGTERM,
  then SIGKILL; Python handlers see ``ctx.cancelled``). The handoff is filed ``cancelled`` with
  whatever partial result the handler left: a JSON result a command handler prints on SIGTERM, or
  what a Python handler passed to ``ctx.report_partial()``. A pending handoff no specialist here
  runs is filed ``cancelled`` by the poll (nothing here claims it to reach its gate).
* A cascading request is settled once its handoff is filed (the daemon's filed hook, else its
  next poll): :func:`.cancel_family.settle`.
* A seed 000 Message whose payload has ``target_message_id`` is a cancellation request: the daemon
  carries it out and files the message itself as completed with a short summary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol

from ..core import recurring
from ..core.admission import first_use_or_short
from ..core.documents import BOOK, Outcome, check_id
from ..core.errors import (
    ErrorCode,
    HandoffdError,
    InvalidDocument,
    NotFound,
    UnreadableDocument,
    is_shortage,
)
from ..core.logs import log
from ..core.states import TERMINAL, State
from ..core.storage import Wakeup
from .cancel_family import _cancel_pending, cancel, settle
from .cancel_requests import _request_texts, check_before_run, describe, install_gate

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

POLL = "reading the cancel requests"  # (the poll's kind of problem: core.recurring)


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


def install(engine: "Engine") -> None:
    """Add cancellation to an Engine (orchestration installs it): the cancel gate, a check just
    before the handler starts, partial results of a stopped handler, and the daemon side."""
    install_gate(engine)  # (cancel_gate, first)
    # first of the resumers, which run before anything else of an attempt: a parked parent
    # claimed at its aggregation deadline (the scheduler skips the gates then) was aggregated
    # rather than cancelled; a request that arrived while the handoff was claimed is met too
    engine.resumers.insert(0, lambda job, _started: check_before_run(engine, job))
    engine.daemon_plugins.append(attach)


def attach(daemon: DaemonPlugins) -> None:
    """The daemon side: be woken by new cancel requests, act on requests at every scan, carry out
    cancellation messages, and settle the request of a handoff once it is filed for good."""
    problems = recurring.Recurring()  # (the poll's shortages: one line while they last)
    daemon.add_scan_hook(lambda: poll(daemon, problems))
    daemon.add_message_handler(is_cancel_message, handle_message)
    daemon.add_filed_hook(lambda handoff_id, where: settle(daemon.engine, handoff_id)
                          if where in TERMINAL else None)
    daemon.add_wakeup_hook(lambda wakeup: daemon.request_rescan()
                           if wakeup.kind == "cancel" else None, kinds={"cancel"})


# ---------------------------------------------------------------- daemon side
def poll(daemon: DaemonPlugins, problems: recurring.Recurring | None = None) -> None:
    """Act on cancel requests: stop our running handlers, queue pending ones for the cancel gate,
    and drop requests for handoffs that are finished or gone. Never raises (the daemon loop
    calls it at every rescan). A passing shortage of descriptors or memory is one WARNING
    naming the limit, said again at most once a minute while it lasts (``problems``: the
    daemon's book of them, :mod:`handoffd.core.recurring`); it was an ERROR at every rescan.
    Another failure (the store unreachable, a folder unreadable) is one ERROR held back the
    same way. A shortage opening ``.meta/cancel`` is said by the files store alone (it
    finds no requests then), never by the store and the poll both."""
    clock = daemon.engine.clock
    with recurring.sweeping(problems or recurring.Recurring(), lambda: clock().timestamp()):
        try:
            _poll(daemon)
        except (HandoffdError, OSError, MemoryError) as exc:
            if not is_shortage(exc):  # the store is unreachable, a folder unreadable: one line
                recurring.error(POLL, exc, "cannot read the cancel requests: %s; will try "
                                           "again", exc)
                return
            recurring.error(POLL, exc, "cannot read the cancel requests for now: %s; will try "
                                       "again", exc)
        except Exception:  # a bug: its traceback, and the daemon goes on
            log.exception("cannot read the cancel requests")
        else:
            recurring.ok(POLL)  # (a shortage said before: one line says it cleared)


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
    # its id searched and recorded as admission does: for a raw claim, and for one whose
    # earlier claim was recovered before that was done (a crash after the claim; checking
    # only raw claims left the id unrecorded, and a message reusing it was carried out again)
    if not first_use_or_short(engine, claim, dialect, now):
        return None  # a reused id: set aside DUPLICATE_HANDOFF_ID
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
