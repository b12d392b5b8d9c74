"""Orchestration on top of the lifecycle: delegation with aggregation, clarification, blocking.

**Delegation** (seed 000 fan-out). A handler may answer::

    {"status": "delegated", "aggregation": "all_success",
     "delegate": [{"to": "@agent", "data": {...}, "objective": "...", "constraints": [...],
                   "timeout_seconds": 30, "weight": 1.0, "id": "optional-id",
                   "depends_on": ["c1"], "expected_output": {...}}, ...]}

The daemon creates one native (seed 001) child handoff per entry, with ids derived from the
parent (``<parent>.c1``, ``<parent>.c2``...; ``<parent>.r2.c1`` in a later round), each carrying
``parent_id`` and ``correlation_id`` = the parent id, the parent's ``conversation_id`` (one is
created for the parent when it has none), ``chain_position`` one step below the parent, and a
``timeout_seconds`` of at most the parent's remaining deadline. The parent goes back to pending/
with a ``handoffd.waiting_children`` block and holds no worker: a gate keeps it there until its
children are finished (for ``first_success``: until one succeeded). Then, instead of running its
handler again, the daemon writes the aggregated outcome exactly as seed 000 defines it
(``strategy_used``, ``child_outcomes`` with ``message_id`` / ``status`` / ``confidence`` /
``specialist``, ``aggregated_status``, ``aggregated_confidence`` = weighted average).

==============  ==========================================================================
strategy        aggregated status
==============  ==========================================================================
all_success     success if every child succeeded; failed if none succeeded (nor partially);
                partial otherwise
any_success     success if any child succeeded; else partial if any was partial; else failed
majority        success if more than half succeeded; else failed
first_success   success as soon as one child succeeded (the others are cancelled, cascading);
                else like any_success once all are finished
==============  ==========================================================================

Success → the parent is filed in completed/ with status ``completed``, partial → completed/ with
status ``partial``, failed → failed/ (``CHILDREN_FAILED``, not retried automatically).

**Clarification and blocking** (seed 000 NEEDS_CLARIFICATION, seed 002 blocked). A handler
answering ``{"status": "needs_clarification", "questions": [...]}`` or ``{"status": "blocked",
"blockers": [{"type": ..., "description": ..., "resolution_options": [...]}]}`` (every blocker
needs resolution options) parks its handoff in pending/ with a ``handoffd.awaiting`` block; a gate
holds it "waiting on the requester" until ``handoff answer ID --data JSON`` attaches the answer
(to ``input.clarifications`` of a native document, ``handoffd.clarifications`` otherwise, and to
the history) and releases it: the handler runs again and sees the answer.

**The code.** This module installs orchestration and holds the parent's side: reading a park
result, parking the parent (making its children, or recording its questions), failing a
delegation that cannot be carried out, the children gate and the report a parked handoff makes.
Beside it: :mod:`.delegation` (checking a ``delegated`` result), :mod:`.children` (child ids and
documents, a crash replay's adoption), :mod:`.clarification` (questions and blockers, the
requester gate, ``handoff answer``), :mod:`.aggregation` (the parent's outcome once its children
are done), :mod:`.lineage` and :mod:`.cancellation`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..core.documents import Outcome, book, book_int
from ..core.errors import (DuplicateHandoff, ErrorCode, HandoffdError, InvalidDocument,
                           is_shortage, shortage_words)
from ..core.formats import ArtifactSink, FiledState
from ..core.logs import log
from ..core.states import PARKED, State
from ..core.timeutil import iso
from . import cancel_family, cancel_requests, clarification, parked_gates
# the aggregation (and the child facts it reads) is loaded with the feature, as a daemon starts:
# its gates and resumer import it at their first parked parent, which would be on a worker's
# thread then, where an import can meet a shortage of descriptors; `handoff ls`, which installs
# the gates alone (parked_gates), loads it only for a parked parent's row
from . import aggregation  # noqa: F401
from .children import _plan_children, child_id, ensure_conversation
from .children_gate import FinishedChildren, children_gate
from .clarification import (
    ANSWER_BOOKKEEPING_BYTES,
    ANSWER_PATIENCE_SECONDS,
    MAX_CLARIFICATIONS_ENV,
    _blocked,
    _clarification,
    _expose_clarifications,
    answer,
    clarifications_of,
    requester_gate,
)
from .delegation import (
    MAX_CHILD_TIMEOUT_SECONDS,
    MAX_CHILDREN,
    MAX_DEPTH,
    MAX_WEIGHT,
    STRATEGIES,
    _delegation,
    _Malformed,
    _why,
    chain_step,
    creation_order,
)

if TYPE_CHECKING:
    from ..core.engine import Engine, Job
    from ..core.specialists import Specialist
    from ..core.storage import Claim
    from ..dialects import Dialect

PARK_STATUSES = PARKED
OUTCOME_INLINE_BYTES = 64 * 1024  # a parked handoff's report larger than this is abridged


# ---------------------------------------------------------------- installation
def install(engine: "Engine") -> None:
    """Add orchestration to an Engine (one of :func:`handoffd.features.build.build_engine`'s features):
    the requester and children gates, aggregation of a parent whose children are done, and the
    park statuses (delegated, needs_clarification, blocked). Cancellation and artifacts are
    features of their own."""
    # the requester gate, the children gate with its memory of finished children (one per
    # engine); the first_success siblings of a winner held (the gate) and, claimed, given back
    # unrun (the resumer)
    winners = parked_gates.install(engine)
    engine.resumers.append(winners.hold_back)
    engine.resumers.append(winners.resume)  # (aggregation.resume, noting a nested win)
    engine.after_run.append(winners.decided)
    engine.on_filed.append(winners.filed)
    for status in PARK_STATUSES:  # filed back to pending/ where a gate holds them
        engine.result_interpreters[status] = functools.partial(parked_outcome, engine)
        engine.filers[status] = functools.partial(park, engine)
    engine.before_run.append(_expose_clarifications)
    engine.on_filed.append(functools.partial(hand_on, engine))
    engine.daemon_plugins.append(
        lambda daemon: daemon.add_parked_check(functools.partial(is_parked, engine)))
    engine.daemon_plugins.append(lambda daemon: daemon.add_parked_check(winners.parked))
    # a handoff held for its requester's answer is read again only when its document changes
    engine.daemon_plugins.append(clarification.attach)


def hand_on(engine: "Engine", handoff_id: str, where: State) -> None:
    """Seed 002's chain: an AgentHandoff answer addressed to a next agent (the specialist named
    ``output.next_agent``) is also submitted as a new pending handoff for that agent, under the
    answer's own id. Never raises (an ``on_filed`` listener)."""
    if where is not State.COMPLETED:
        return
    try:
        _, doc = engine.filed_document(handoff_id)
    except (HandoffdError, OSError):
        return
    request = book(doc).get("request_snapshot")
    if book(doc).get("dialect") != "agent_handoff" or not isinstance(request, dict) \
            or doc.get("to_agent") in (None, request.get("from_agent")):
        return
    try:
        new_id = engine.submit(copy.deepcopy({k: v for k, v in doc.items() if k != "handoffd"}),
                               forced="agent_handoff")  # (a copy: the filed answer is shared)
        log.info("handoff %s: handed on to %s as %s", handoff_id, doc["to_agent"], new_id)
    except DuplicateHandoff:
        pass  # handed on already (a repeated notice)
    except (HandoffdError, OSError) as exc:
        log.warning("handoff %s: cannot hand it on to %s: %s", handoff_id, doc["to_agent"], exc)


# ---------------------------------------------------------------- reading a park result
def parked_outcome(engine: "Engine", job: "Job", result: dict[str, Any], started: datetime) -> Outcome:
    """Turn a ``delegated`` / ``needs_clarification`` / ``blocked`` result into an Outcome that
    :func:`park` files back to pending/ (or a VALIDATION_FAILED failure when it is malformed)."""
    status = result["status"]
    try:
        _check_artifact_paths(engine, result)
        if status == "delegated":
            info = _delegation(engine, job, result)
        elif status == "blocked":
            info = _blocked(job, result)
        else:
            info = _clarification(job, result)
    except _Malformed as exc:
        return engine.failure(started, ErrorCode.VALIDATION_FAILED, f"handoff {job.handoff_id}: specialist "
                              f"answered {status}, but {exc}", retryable=False, result=result)
    except Exception as exc:  # a shape no check foresaw: one line and a code, never a traceback
        if is_shortage(exc):  # (no fault of the result's, which it filed VALIDATION_FAILED for
            raise  # good: read again after a wait, its attempt not charged: _usable_outcome)
        log.debug("handoff %s: reading the %s result failed", job.handoff_id, status, exc_info=True)
        return engine.failure(started, ErrorCode.VALIDATION_FAILED, f"handoff {job.handoff_id}: "
                              f"specialist answered {status}, but it cannot be read: {_why(exc)}",
                              retryable=False, result=result)
    info["kind"] = status
    info["asked_by"] = job.specialist.agent
    info["requester"] = job.envelope.source
    summary = result.get("summary")
    if not isinstance(summary, str) and isinstance(result.get("output"), dict):
        summary = result["output"].get("summary")
    if isinstance(summary, str):
        info["summary"] = summary
    return Outcome(status=status, started_at=started, finished_at=engine.clock(),
                   output=result.get("output"), artifacts=_list(result.get("artifacts")),
                   metadata=_dict(result.get("metadata")),
                   warnings=_list(result.get("warnings")), executed_by=job.specialist.agent,
                   park=info)


def _check_artifact_paths(engine: "Engine", result: dict[str, Any]) -> None:
    """_Malformed when an artifact the result names lies outside the workspace: a parked
    outcome reports its artifacts up, and the rule is the one a final result meets."""
    for index, item in enumerate(_list(result.get("artifacts"))):
        paths = [item[key] for key in ("path", "artifact_path")
                 if isinstance(item, dict) and isinstance(item.get(key), str)]
        for path in paths:
            if engine.ws.inside(path) is None:
                raise _Malformed(f"artifacts[{index}] path {path!r} points outside the workspace")


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------- filing a park result
def park(engine: "Engine", claim: "Claim", dialect: "Dialect", spec: "Specialist | None",
         outcome: Outcome) -> State:
    """File a parked outcome: create children (delegation) or record the questions, and put the
    handoff back in pending/ where a gate holds it."""
    info = outcome.park or {"kind": "rewait"}
    doc = claim.doc
    block = book(doc)
    now = engine.clock()
    kind = info["kind"]
    if kind == "delegated":
        return _park_delegation(engine, claim, dialect, spec, info)
    if kind == "rewait":
        return engine.requeue(claim, dialect, "still_waiting")
    if kind == "held_back":  # a first_success loser claimed after its sibling won: never run
        return engine.requeue(claim, dialect, "handed_back", reason=f"first_success: its sibling "
                              f"{info.get('winner')} succeeded ({info.get('parent')})")
    else:
        awaiting = {k: v for k, v in info.items() if k in ("kind", "questions", "blockers",
                                                           "asked_by", "requester", "summary")}
        awaiting["since"] = iso(now)
        if outcome.output is not None:
            awaiting["partial_output"] = outcome.output
        awaiting["outcome"] = reported_outcome(engine, doc, dialect, outcome)
        block["awaiting"] = awaiting
        detail = ({"questions": info.get("questions")} if kind == "needs_clarification"
                  else {"blockers": [b.get("description") for b in info.get("blockers", [])]})
        # the attempt that asked counts (an answer gives the next one its due)
        return engine.requeue(claim, dialect, kind, count_attempt=True, **detail)


def _park_delegation(engine: "Engine", claim: "Claim", dialect: "Dialect",
                     spec: "Specialist | None", info: dict[str, Any]) -> State:
    """Create a delegation's children and park the parent until they are done. A delegation
    that cannot be carried out fails the parent at once (never left claimed for a lease) and
    leaves no child running beside it: ids are checked before any child is made, and children
    made before a later one failed are cancelled."""
    now = engine.clock()
    try:
        plan = _plan_children(engine, claim.doc, claim.id, dialect, info, now)
    except (InvalidDocument, _Malformed) as exc:  # a child nobody could run: nothing made
        return _fail_delegation(engine, claim, dialect, spec, ErrorCode.VALIDATION_FAILED,
                                f"its delegation is malformed: {exc}", retryable=False)
    except (HandoffdError, OSError, MemoryError) as exc:  # e.g. a child id's holder unreadable
        # right now, or a passing shortage (a MemoryError was filed VALIDATION_FAILED for good)
        return _fail_delegation(engine, claim, dialect, spec, ErrorCode.PROCESSING_ERROR,
                                f"could not check its child ids: {_said(exc)}", retryable=True)
    except Exception as exc:  # an entry no check foresaw (or a bug): filed, with one line
        log.debug("handoff %s: planning its children failed", claim.id, exc_info=True)
        return _fail_delegation(engine, claim, dialect, spec, ErrorCode.VALIDATION_FAILED,
                                "its delegation cannot be turned into child handoffs: "
                                f"{_why(exc)}", retryable=False)
    made: list[str] = []
    # a cancel of the parent may land while its children are made: a canceller's walk of the
    # family sees only those made so far, so its request is looked at before each child and
    # after the last (once it is seen, no more are made; see _cancelled_delegation)
    stop = cancel_requests.requested(engine, claim.id)
    try:
        for cid, child in plan.new:
            if stop is not None:
                break
            engine.backend.create(child, cid, now)
            made.append(cid)
            stop = cancel_requests.requested(engine, claim.id)
    except Exception as exc:  # whatever it was, no child may run beside a parent filed failed
        code, message, retryable = _creation_failure(claim.id, exc)
    else:
        book(claim.doc)["delegation_round"] = plan.round
        if stop is not None:
            return _cancelled_delegation(engine, claim, dialect, spec, plan.adopted + made, stop)
        # every child is made: a park that fails now (a full disk) leaves them be; the claim
        # is given up, the sweep hands the parent back, and its replay adopts them (they were
        # cancelled here once, and the parent failed for a passing disk error)
        return _wait_for_children(engine, claim, dialect, info, plan.ids, now)
    book(claim.doc)["delegation_round"] = plan.round  # (a retry's children get new ids)
    _cancel_orphans(engine, claim.id, plan.adopted + made, message)
    return _fail_delegation(engine, claim, dialect, spec, code, message, retryable=retryable)


def _creation_failure(parent: str, exc: Exception) -> tuple[str, str, bool]:
    """(code, message, retryable) of a failure while storing a delegation's children."""
    if isinstance(exc, DuplicateHandoff):  # taken between the check and the create (a race)
        return (ErrorCode.VALIDATION_FAILED, "its delegation is malformed: the child id "
                f"{exc.handoff_id!r} is taken by another handoff", False)
    if isinstance(exc, InvalidDocument):  # e.g. a child over max_document_bytes
        return ErrorCode.VALIDATION_FAILED, f"its delegation is malformed: {exc}", False
    if isinstance(exc, (HandoffdError, OSError, MemoryError)):  # a full disk, a passing
        # shortage: worth another try
        return ErrorCode.PROCESSING_ERROR, f"could not create its child handoffs: {_said(exc)}", True
    log.debug("handoff %s: creating its children failed", parent, exc_info=exc)
    return ErrorCode.PROCESSING_ERROR, f"could not create its child handoffs: {_why(exc)}", False


def _said(exc: BaseException) -> str:
    """``exc`` as a failure's message says it: a passing shortage in its usual words."""
    return shortage_words(exc) if is_shortage(exc) else str(exc)


def _wait_for_children(engine: "Engine", claim: "Claim", dialect: "Dialect",
                       info: dict[str, Any], children: list[str], now: datetime) -> State:
    """Park the parent in pending/ with its ``waiting_children`` block (the children gate
    holds it there until they are done)."""
    block = book(claim.doc)
    known = block.setdefault("children", [])
    known.extend(c for c in children if c not in known)
    block["waiting_children"] = {
        "round": block["delegation_round"], "aggregation": info["aggregation"],
        "children": children, "weights": {c: e["weight"] for c, e in zip(children, info["delegate"])},
        "since": iso(now), "started": info["started"], "deadline": info["deadline"],
        "summary": info.get("summary"),
    }
    # waiting for children is not an attempt: the one that delegated is given back
    return engine.requeue(claim, dialect, "delegated", children=children,
                          aggregation=info["aggregation"])


def _cancelled_delegation(engine: "Engine", claim: "Claim", dialect: "Dialect",
                          spec: "Specialist | None", children: list[str],
                          body: dict[str, Any]) -> State:
    """File the parent CANCELLED: the cancel request ``body`` arrived while its children were
    being made. A cascading request cancels those made (the canceller's walk may have run
    before they existed); a plain one leaves them, as it leaves the children of a parked
    parent. Either way the filed parent names every child it made (``handoffd.children``), so
    a cascading request's walk at its filing (cancel_family.settle) reaches them and theirs."""
    block = book(claim.doc)
    known = block.get("children")
    if not isinstance(known, list):
        known = block["children"] = []
    known.extend(c for c in children if c not in known)
    cascade = cancel_requests.cascading(body)
    if cascade:
        cancel_family.cancel_made(engine, claim.id, children, body)
    log.info("handoff %s: cancelled while making its children (%d made%s)", claim.id,
             len(children), ", cancelled with it" if cascade else "")
    outcome = engine.failure(engine.clock(), ErrorCode.CANCELLED,
                             f"handoff {claim.id} cancelled while delegating: "
                             f"{cancel_requests.describe(body)}; {len(children)} child(ren) made"
                             + (", cancelled with it" if cascade and children else ""),
                             retryable=False)
    outcome.artifacts = cancel_family.children_artifacts(engine, claim.doc)
    return engine._file(claim, dialect, spec, outcome)  # (a filer: Engine.file tells listeners)


def _fail_delegation(engine: "Engine", claim: "Claim", dialect: "Dialect",
                     spec: "Specialist | None", code: str, message: str, *,
                     retryable: bool) -> State:
    """File the parent failed (or retried, by its policy) with ``code``. Through the engine's
    own filing step, not ``Engine.file``: this runs as a filer inside ``Engine.file``, which
    tells the ``on_filed`` listeners of the state returned here; telling them here too ran an
    ``[[on_filed]]`` command twice and counted one failure twice."""
    failure = engine.failure(engine.clock(), code, f"handoff {claim.id}: {message}",
                             retryable=retryable)
    return engine._file(claim, dialect, spec, failure)


def _cancel_orphans(engine: "Engine", parent: str, children: list[str], why: str) -> None:
    """Cancel (with their descendants) children made for a delegation that failed: none may
    run beside a parent that does not wait for it. Never raises."""
    for cid in children:
        try:
            cancel_family.cancel(engine, cid, reason=f"the delegation of {parent} failed: {why}",
                                 cascade=True, by=parent, via="delegation")
        except Exception as exc:  # the next child, and the parent's filing, still go on
            log.warning("handoff %s: cannot cancel its child %s: %s", parent, cid, _why(exc))


def reported_outcome(engine: "Engine", doc: dict[str, Any], dialect: "Dialect",
                     outcome: Outcome) -> dict[str, Any] | None:
    """The answer a needs_clarification / blocked outcome makes in the document's own format,
    reported up at once (seed 000) while the handoff waits in pending/ for the answer: kept in
    ``handoffd.awaiting.outcome``, where `handoff wait` and file readers find it."""
    info = outcome.park or {}
    asked = [str(q) for q in info.get("questions") or []] or [
        str(b.get("description")) for b in info.get("blockers") or [] if isinstance(b, dict)]
    report = dataclasses.replace(outcome, error=outcome.error or {
        "code": str(outcome.status).upper(), "message": "; ".join(asked) or str(outcome.status),
        "retryable": True})  # formats carry the questions where they carry an error's detail
    try:
        answer = dialect.render(copy.deepcopy(doc), report,
                                FiledState(book_int(doc, "retries", 0), 0, False),
                                artifacts=_report_sink(engine, outcome, book_int(doc, "attempt", 1)))
    except Exception as exc:  # a format that cannot say it must not stop the park
        log.warning("handoff %s: cannot render the %s outcome: %s", dialect.id_of(doc),
                    outcome.status, exc)
        return None
    answer.pop("handoffd", None)  # the bookkeeping is the document's, not the report's
    if len(json.dumps(answer, ensure_ascii=False)) > OUTCOME_INLINE_BYTES:
        # a large request copied into its own report would double the document (past
        # max_document_bytes, the daemon could not read it back): what the report repeats of
        # the document is left to be read there, and named
        same = [key for key in answer if key in doc and answer[key] == doc[key]]
        for key in same:
            del answer[key]
        answer["abridged"] = same
    return answer


def _report_sink(engine: "Engine", outcome: Outcome, attempt: int) -> ArtifactSink | None:
    """The engine's artifact sink for a parked outcome's report, so that seed 000's 1 KB rule
    holds there as in a final answer. Each report stores under ``<id>.<kind>-<attempt>``, not
    the handoff's own ``<id>``: the final answer writes there later, and a report the requester
    already holds must keep naming what it said when it was made."""
    sink = engine.artifact_sink
    if sink is None:
        return None
    suffix = f".{outcome.status}-{attempt}"
    return lambda handoff_id, index, text: sink(handoff_id + suffix, index, text)


def is_parked(engine: "Engine", handoff_id: str) -> bool:
    """True when the pending handoff waits for its children or its requester (not a retry)."""
    try:
        doc = engine.backend.peek(handoff_id)
    except HandoffdError:
        return False
    if doc is None:
        return False
    block = book(doc)
    return isinstance(block.get("waiting_children"), dict) or isinstance(block.get("awaiting"), dict)


# what other modules and tests import from here (the names the one module had)
__all__ = [
    "ANSWER_BOOKKEEPING_BYTES", "ANSWER_PATIENCE_SECONDS", "MAX_CHILD_TIMEOUT_SECONDS",
    "MAX_CHILDREN", "MAX_CLARIFICATIONS_ENV", "MAX_DEPTH", "MAX_WEIGHT", "OUTCOME_INLINE_BYTES",
    "FinishedChildren", "PARK_STATUSES", "STRATEGIES", "answer", "chain_step", "child_id",
    "children_gate", "clarifications_of", "creation_order", "ensure_conversation", "hand_on", "install",
    "is_parked", "park", "parked_outcome", "reported_outcome", "requester_gate",
]
