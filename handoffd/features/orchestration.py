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
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.documents import (
    Envelope,
    Outcome,
    book,
    book_int,
    check_id,
    new_native_request,
    priority_rank,
)
from ..core.errors import (
    DocumentNotReady,
    DuplicateHandoff,
    ErrorCode,
    HandoffdError,
    InvalidDocument,
    InvalidTransition,
    NotFound,
    UnreadableDocument,
)
from ..core.formats import ArtifactSink, FiledState
from ..core.logs import log
from ..core.states import PARKED, State
from ..core.timeutil import iso, parse_iso
from ..dialects import hi_moe
from . import aggregation, cancellation
from .aggregation import child_info, ready
from .dependencies import Verdict
from .lineage import conversation_of, parent_of

MAX_CLARIFICATIONS_ENV = 64 * 1024  # bytes of $HANDOFF_CLARIFICATIONS

if TYPE_CHECKING:
    from ..core.engine import Engine, Job
    from ..core.specialists import Specialist
    from ..core.storage import Claim
    from ..dialects import Dialect

STRATEGIES = ("all_success", "any_success", "majority", "first_success")
PARK_STATUSES = PARKED
MAX_CHILDREN = 100
MAX_WEIGHT = 1e6  # a child's weight in the aggregated confidence
MAX_CHILD_TIMEOUT_SECONDS = 10 * 365.25 * 24 * 3600  # as the config's: date arithmetic stays finite
MAX_DEPTH = 16


# ---------------------------------------------------------------- installation
def install(engine: "Engine") -> None:
    """Add orchestration to an Engine (one of :func:`handoffd.features.build.build_engine`'s features):
    the requester and children gates, aggregation of a parent whose children are done, and the
    park statuses (delegated, needs_clarification, blocked). Cancellation and artifacts are
    features of their own."""
    engine.gates[0:0] = [requester_gate, children_gate]
    engine.resumers.append(functools.partial(aggregation.resume, engine))
    for status in PARK_STATUSES:  # filed back to pending/ where a gate holds them
        engine.result_interpreters[status] = functools.partial(parked_outcome, engine)
        engine.filers[status] = functools.partial(park, engine)
    engine.before_run.append(_expose_clarifications)
    engine.on_filed.append(functools.partial(hand_on, engine))
    engine.daemon_plugins.append(
        lambda daemon: daemon.add_parked_check(functools.partial(is_parked, engine)))


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


def _expose_clarifications(job: "Job") -> None:
    """Answers reach every specialist in every format: Python ones as ``ctx.clarifications``,
    commands as ``$HANDOFF_CLARIFICATIONS`` (a JSON list; their stdin is the document without
    handoffd's block, where non-native formats keep the answers)."""
    found = clarifications_of(job.claim.doc)
    if found:
        job.context.clarifications = found
        for answers in (found, found[-1:]):  # an environment has its limits (ARG_MAX)
            text = json.dumps(answers, ensure_ascii=False)
            if len(text) <= MAX_CLARIFICATIONS_ENV:
                job.context.env["HANDOFF_CLARIFICATIONS"] = text
                break
            log.warning("handoff %s: %d answers are too long for $HANDOFF_CLARIFICATIONS (%d "
                        "bytes)", job.handoff_id, len(answers), len(text))


def clarifications_of(doc: dict[str, Any]) -> list[Any]:
    """Answers given so far with ``handoff answer`` (native: ``input.clarifications``)."""
    inp = doc.get("input")
    if isinstance(inp, dict) and isinstance(inp.get("clarifications"), list):
        return list(inp["clarifications"])
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("clarifications"), list):
        return list(block["clarifications"])
    return []


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


class _Malformed(Exception):
    pass


def _check_artifact_paths(engine: "Engine", result: dict[str, Any]) -> None:
    """_Malformed when an artifact the result names lies outside the workspace: a parked
    outcome reports its artifacts up, and the rule is the one a final result meets."""
    for index, item in enumerate(_list(result.get("artifacts"))):
        paths = [item[key] for key in ("path", "artifact_path")
                 if isinstance(item, dict) and isinstance(item.get(key), str)]
        for path in paths:
            if engine.ws.inside(path) is None:
                raise _Malformed(f"artifacts[{index}] path {path!r} points outside the workspace")


def _delegation(engine: "Engine", job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    entries = result.get("delegate")
    if not isinstance(entries, list) or not entries:
        raise _Malformed('"delegate" must be a non-empty list of {"to": "@agent", "data": ...}')
    if len(entries) > MAX_CHILDREN:
        raise _Malformed(f"it delegates {len(entries)} children; at most {MAX_CHILDREN} are allowed")
    strategy = result.get("aggregation", "all_success")
    if strategy not in STRATEGIES:
        raise _Malformed(f'"aggregation" {strategy!r} is not one of {", ".join(STRATEGIES)}')
    step = chain_step(job.claim.doc)
    if step >= MAX_DEPTH:
        raise _Malformed(f"the delegation chain is already {step} steps deep (limit {MAX_DEPTH})")
    clean = []
    ids: set[str] = set()
    for index, entry in enumerate(entries):
        item = _check_entry(engine, f"delegate[{index}]", entry)
        if "id" in item:
            if item["id"] in ids:
                raise _Malformed(f"delegate[{index}].id {item['id']!r} is used twice")
            ids.add(item["id"])
        clean.append(item)
    _sibling_order(clean)
    upward = {job.handoff_id} | _ancestors(engine, job.claim.doc)
    for index, item in enumerate(clean):
        loop = sorted(set(item["external_deps"]) & upward)
        if loop:  # the parent waits for its children: a child waiting for it never starts
            raise _Malformed(f"delegate[{index}].depends_on names {loop[0]!r}, which waits for "
                             "this delegation (a cycle)")
    timeout = engine.timeout_for(job)
    return {"delegate": clean, "aggregation": strategy,
            "started": iso(job.started_at),
            "deadline": iso(job.started_at + timedelta(seconds=timeout))}


def _check_entry(engine: "Engine", where: str, entry: Any) -> dict[str, Any]:
    """One delegation entry, checked (_Malformed saying what is wrong), as a copy with ``to``
    resolved and ``weight`` a float."""
    if not isinstance(entry, dict):
        raise _Malformed(f"{where} is not an object")
    to = entry.get("to") or entry.get("agent") or entry.get("target")
    if not isinstance(to, str) or not to:
        raise _Malformed(f'{where} has no "to" agent id')
    if engine.registry.get(to) is None:
        raise _Malformed(f"{where}.to {to!r} has no registered specialist")
    timeout = entry.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout <= MAX_CHILD_TIMEOUT_SECONDS):
        raise _Malformed(f"{where}.timeout_seconds must be a number of seconds above 0, at most "
                         f"{MAX_CHILD_TIMEOUT_SECONDS:.0f}")
    weight = entry.get("weight", 1.0)
    # bounded: 1e308 weights summed to inf, and the aggregated confidence to NaN, which no
    # JSON can hold: the parent's filing then failed again at every recovery
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not 0 <= weight <= MAX_WEIGHT:
        raise _Malformed(f"{where}.weight must be a number from 0 to {MAX_WEIGHT:g}")
    # what the child's request carries as text (seed 000's DelegationPayload: objective str,
    # constraints and context_refs List[str]); a hi_moe child could not be written otherwise
    if entry.get("objective") is not None and not isinstance(entry["objective"], str):
        raise _Malformed(f"{where}.objective must be a string")
    for key in ("constraints", "context_refs"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, list)
                                  or not all(isinstance(v, str) for v in value)):
            raise _Malformed(f"{where}.{key} must be a list of strings")
    item = {k: v for k, v in entry.items() if k != "id" or v is not None}
    if "id" in item:
        try:
            check_id(item["id"])
        except InvalidDocument as exc:
            raise _Malformed(f"{where}.id: {exc}") from None
    item["to"] = to
    item["weight"] = float(weight)
    return item


def _why(exc: BaseException) -> str:
    """An unexpected exception in one line: its type and the start of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _ancestors(engine: "Engine", doc: dict[str, Any]) -> set[str]:
    """The ids above ``doc`` in its delegation chain (its parent, the parent's...), each of
    which waits for what is below it."""
    found: set[str] = set()
    current = doc
    for _ in range(MAX_DEPTH):
        parent = parent_of(current)
        if not isinstance(parent, str) or parent in found:
            break
        found.add(parent)
        try:
            _, current = engine.get(parent)
        except (HandoffdError, OSError):
            break
    return found


def _sibling_order(entries: list[dict[str, Any]]) -> None:
    """Resolve ``depends_on`` references to siblings (``c2``, 2, or a sibling's explicit id) into
    ``sibling_deps`` (0-based) and check they form no cycle; other strings stay handoff ids."""
    names = {f"c{i}": i - 1 for i in range(1, len(entries) + 1)}
    names.update({e["id"]: i for i, e in enumerate(entries) if isinstance(e.get("id"), str)})
    for index, entry in enumerate(entries):
        deps = entry.get("depends_on") or []
        if not isinstance(deps, list):
            raise _Malformed(f"delegate[{index}].depends_on must be a list")
        siblings, others = [], []
        for dep in deps:
            if isinstance(dep, int) and not isinstance(dep, bool):
                if not 1 <= dep <= len(entries):
                    raise _Malformed(f"delegate[{index}].depends_on names sibling {dep}, but there "
                                     f"are {len(entries)}")
                siblings.append(dep - 1)
            elif isinstance(dep, str) and dep in names:
                siblings.append(names[dep])
            elif isinstance(dep, str):
                others.append(dep)
            else:
                raise _Malformed(f"delegate[{index}].depends_on has {dep!r}; use ids or c1, c2...")
        if index in siblings:
            raise _Malformed(f"delegate[{index}] depends on itself")
        entry["sibling_deps"] = siblings
        entry["external_deps"] = others
    order = creation_order(entries)
    if order is None:
        raise _Malformed("the children's depends_on form a cycle")


def creation_order(entries: list[dict[str, Any]]) -> list[int] | None:
    """Sibling indices with every dependency before its dependents (None: a cycle)."""
    order: list[int] = []
    state: dict[int, int] = {}

    def visit(node: int) -> bool:
        if state.get(node) == 2:
            return True
        if state.get(node) == 1:
            return False
        state[node] = 1
        for dep in entries[node].get("sibling_deps", []):
            if not visit(dep):
                return False
        state[node] = 2
        order.append(node)
        return True

    for index in range(len(entries)):
        if not visit(index):
            return None
    return order


def _clarification(job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    questions: list[Any] = []
    output = given if isinstance(given := result.get("output"), dict) else {}
    error = given if isinstance(given := result.get("error"), dict) else {}
    for source in (result.get("questions"), output.get("questions")):
        if isinstance(source, list):
            questions.extend(q for q in source if isinstance(q, (str, dict)))
        elif isinstance(source, str) and source.strip():
            questions.append(source)
    for text in (result.get("error_detail"), error.get("message")):
        if not questions and isinstance(text, str) and text.strip():
            questions.append(text)
    if not questions:
        raise _Malformed('it names no questions (give "questions": ["..."], as seed 000 asks for '
                         "specific questions)")
    return {"questions": questions}


def _blocked(job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    blockers = result.get("blockers")
    if blockers is None and isinstance(result.get("output"), dict):
        blockers = result["output"].get("blockers")
    if not isinstance(blockers, list) or not blockers:
        raise _Malformed('it lists no "blockers" (seed 002: a blocked handoff has blockers with '
                         "resolution options)")
    for index, blocker in enumerate(blockers):
        if not isinstance(blocker, dict) or not isinstance(blocker.get("description"), str):
            raise _Malformed(f"blockers[{index}] needs a description")
        options = blocker.get("resolution_options")
        if not isinstance(options, list) or not options:
            raise _Malformed(f"blockers[{index}] has no resolution_options (seed 002 requires at "
                             "least one)")
    return {"blockers": blockers}


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
    except (HandoffdError, OSError) as exc:  # e.g. a child id's holder unreadable right now
        return _fail_delegation(engine, claim, dialect, spec, ErrorCode.PROCESSING_ERROR,
                                f"could not check its child ids: {exc}", retryable=True)
    except Exception as exc:  # an entry no check foresaw (or a bug): filed, with one line
        log.debug("handoff %s: planning its children failed", claim.id, exc_info=True)
        return _fail_delegation(engine, claim, dialect, spec, ErrorCode.VALIDATION_FAILED,
                                "its delegation cannot be turned into child handoffs: "
                                f"{_why(exc)}", retryable=False)
    made: list[str] = []
    try:
        for cid, child in plan.new:
            engine.backend.create(child, cid, now)
            made.append(cid)
        book(claim.doc)["delegation_round"] = plan.round
        return _wait_for_children(engine, claim, dialect, info, plan.ids, now)
    except Exception as exc:  # whatever it was, no child may run beside a parent filed failed
        code, message, retryable = _creation_failure(claim.id, exc)
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
    if isinstance(exc, (HandoffdError, OSError)):  # e.g. a full disk: worth another try
        return ErrorCode.PROCESSING_ERROR, f"could not create its child handoffs: {exc}", True
    log.debug("handoff %s: creating its children failed", parent, exc_info=exc)
    return ErrorCode.PROCESSING_ERROR, f"could not create its child handoffs: {_why(exc)}", False


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
            cancellation.cancel(engine, cid, reason=f"the delegation of {parent} failed: {why}",
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


def chain_step(doc: dict[str, Any]) -> int:
    """Seed 002's ``chain_position.step`` of a document (1 when absent)."""
    for holder in (doc, given if isinstance(given := doc.get("metadata"), dict) else {}):
        pos = holder.get("chain_position")
        if isinstance(pos, dict) and isinstance(pos.get("step"), int) and pos["step"] > 0:
            return pos["step"]
    return 1


def ensure_conversation(doc: dict[str, Any], dialect: "Dialect", handoff_id: str) -> str:
    """The handoff's conversation id, creating ``conv-<id>`` when it has none."""
    found = conversation_of(doc)
    if found:
        return found
    conv = f"conv-{handoff_id}"
    if dialect.name == "native":
        doc["conversation_id"] = conv
    else:
        book(doc)["conversation_id"] = conv
    return conv


def child_id(parent: str, round_no: int, index: int) -> str:
    import hashlib
    suffix = f".c{index}" if round_no <= 1 else f".r{round_no}.c{index}"
    candidate = parent + suffix
    try:
        return check_id(candidate)
    except InvalidDocument:
        short = hashlib.sha1(parent.encode()).hexdigest()[:10]
        return check_id(f"{parent[:96]}-{short}{suffix}")


@dataclasses.dataclass
class _Plan:
    """A delegation's children before any is stored."""

    ids: list[str]  # every child's id, in the delegation's order
    new: list[tuple[str, dict[str, Any]]]  # (id, document) to create, dependencies first
    adopted: list[str]  # made by an interrupted attempt of this delegation (a crash replay)
    round: int  # the delegation round these children are of


def _plan_children(engine: "Engine", doc: dict[str, Any], parent: str, dialect: "Dialect",
                   info: dict[str, Any], now: datetime) -> _Plan:
    """Every child document of a delegation, in creation order, before any is stored: one that
    cannot be made (a bad priority, an id used twice or held by another handoff, or used
    recently) raises InvalidDocument or _Malformed, and then none is made (no orphan runs
    beside a parent that fails)."""
    # the round is written into the document only as the parent is parked or filed: the lease
    # renewer writes claim.doc while the children are made, and a round it saved too early made a
    # crash replay a new round, whose children ran beside the interrupted round's
    round_no = book_int(doc, "delegation_round", 0) + 1
    conv = ensure_conversation(doc, dialect, parent)
    env = dialect.envelope(doc)
    step = chain_step(doc)
    deadline = parse_iso(info["deadline"])
    remaining = max((deadline - now).total_seconds(), 1.0)
    base_context = given if isinstance(given := doc.get("context"), dict) else {}
    entries = info["delegate"]
    ids = [e["id"] if isinstance(e.get("id"), str) else child_id(parent, round_no, i)
           for i, e in enumerate(entries, start=1)]
    _check_distinct(entries, ids)
    adopted = [cid for cid in ids if _free_for(engine, cid, doc, parent, now)]
    planned: list[tuple[str, dict[str, Any]]] = []
    # dependencies first, so a daemon never sees a child whose sibling dependency is missing
    for position in creation_order(entries) or range(len(entries)):
        index, entry, cid = position + 1, entries[position], ids[position]
        if cid in adopted:
            continue
        spec = engine.registry.get(entry["to"])
        wanted = entry.get("timeout_seconds") or (spec.config.timeout_seconds if spec else None) \
            or engine.settings.default_timeout_seconds
        deps = [ids[i] for i in entry.get("sibling_deps", [])] + list(entry.get("external_deps", []))
        timeout = round(min(float(wanted), remaining), 3)
        if dialect.name == "hi_moe":  # children speak the parent's format (seed 000)
            given = entry.get("priority")
            rank = priority_rank(given) if given is not None else env.priority
            planned.append((cid, _message_child(doc, parent, cid, entry, deps, timeout, rank,
                                                 now, conv, {"step": step + 1, "index": index,
                                                             "of": len(entries)})))
            continue
        child = new_native_request(source=env.target, target=entry["to"], data=entry.get("data"),
                                   now=now, handoff_id=cid, timeout_seconds=timeout,
                                   priority=entry.get("priority", env.priority), depends_on=deps)
        context = dict(base_context)
        for key in ("objective", "constraints", "context_refs", "scope"):
            if entry.get(key) is not None:
                context[key] = entry[key]
        if context:
            child["context"] = context
        for key in ("expected_output", "retry_policy"):
            if isinstance(entry.get(key), dict):
                child[key] = entry[key]
        if isinstance(entry.get("input_schema"), str):
            child["input"]["schema"] = entry["input_schema"]
        child["parent_id"] = parent
        child["correlation_id"] = parent
        child["conversation_id"] = conv
        child["chain_position"] = {"step": step + 1, "index": index, "of": len(entries)}
        planned.append((cid, child))
    return _Plan(ids, planned, adopted, round_no)


def _check_distinct(entries: list[dict[str, Any]], ids: list[str]) -> None:
    """_Malformed when two entries would be one child: an explicit id may equal another
    entry's default id (``<parent>.c1``), and then one entry was silently dropped."""
    first: dict[str, int] = {}
    for index, cid in enumerate(ids):
        if cid in first:
            how = "its explicit id" if isinstance(entries[first[cid]].get("id"), str) else "by default"
            raise _Malformed(f"delegate[{index}] child id {cid!r} is used twice "
                             f"(delegate[{first[cid]}] has it {how})")
        first[cid] = index


def _free_for(engine: "Engine", cid: str, doc: dict[str, Any], parent: str, now: datetime) -> bool:
    """False when ``cid`` is free for a child of ``parent`` (whose claimed document is ``doc``);
    True when it holds a child this very delegation made in an attempt that was interrupted
    before the parent was parked (a crash replay: adopted, not made again). _Malformed when
    any other handoff holds it, or held it recently (the store would refuse it midway)."""
    try:
        state, existing = engine.get(cid)
    except NotFound:
        if engine.backend.seen_contains(cid, now):
            raise _Malformed(f"the child id {cid!r} was used recently (a handoff purged within "
                             "the dedup window had it); choose another id") from None
        return False
    except (InvalidDocument, UnreadableDocument):
        raise _Malformed(f"the child id {cid!r} is taken by another handoff") from None
    if not _made_by_interrupted_attempt(engine, cid, state, existing, doc, parent):
        raise _Malformed(f"the child id {cid!r} is taken by another handoff")
    return True


def _made_by_interrupted_attempt(engine: "Engine", cid: str, state: State,
                                 existing: dict[str, Any], doc: dict[str, Any],
                                 parent: str) -> bool:
    """Whether ``existing`` is ``parent``'s own child, told by bookkeeping only handoffd writes,
    never by what a document says of itself (anyone can drop a ``parent_id`` into pending/): its
    ``created`` event names the process and time of an attempt of the parent, in the parent's
    own history, that was interrupted (``recovered``) since the parent last delegated. A
    document another producer dropped has no ``created`` event (its block is replaced when it
    is claimed, and an unsealed one is left out while it waits in pending/)."""
    if parent_of(existing) != parent:
        return False
    if state is State.PENDING:  # the block as the scheduler trusts it (see Backend.peek)
        try:
            existing = engine.backend.peek(cid) or {}
        except HandoffdError:
            return False
    history = book(existing).get("history") if isinstance(existing.get("handoffd"), dict) else None
    created = history[0] if isinstance(history, list) and history else None
    if not isinstance(created, dict) or created.get("event") != "created":
        return False
    at = _when(created)
    # no upper bound: a stalled owner may go on creating children after it was recovered
    # (the same delegation's, by their ids), and "recovered" is stamped by another host's clock
    return at is not None and any(actor == created.get("actor") and begun <= at
                                  for actor, begun in _interrupted_attempts(doc))


def _interrupted_attempts(doc: dict[str, Any]) -> list[tuple[Any, datetime]]:
    """(actor, claimed at) of each attempt in ``doc``'s history that ended by recovery, since
    its last delegation was parked (an earlier round's children are not this round's). Both
    stamps of a pair come from the claiming process, so its clock alone decides."""
    history = book(doc).get("history")
    events = [e for e in (history if isinstance(history, list) else []) if isinstance(e, dict)]
    last = max((i for i, e in enumerate(events) if e.get("event") == "delegated"), default=-1)
    found, current = [], None
    for event in events[last + 1:]:
        if event.get("event") == "claimed":
            current = event
        elif event.get("event") == "recovered" and current is not None:
            begun = _when(current)
            if begun is not None:
                found.append((current.get("actor"), begun))
            current = None
    return found


def _when(event: dict[str, Any]) -> datetime | None:
    """When a history event happened (None: unreadable)."""
    try:
        return parse_iso(str(event.get("at")))
    except ValueError:
        return None


def _message_child(doc: dict[str, Any], parent: str, cid: str, entry: dict[str, Any],
                   deps: list[str], timeout: float, priority: int, now: datetime, conv: str,
                   position: dict[str, int]) -> dict[str, Any]:
    """A hi_moe parent's child: a Message one tier down. The relations a Message has no field
    for (parent, conversation, dependencies, chain position) are extra envelope fields, which
    seed 000 allows within a MAJOR version (and every reader of the file can see)."""
    child = hi_moe.delegation(doc, cid, to=entry["to"], data=entry.get("data"), now=now,
                              timeout_seconds=timeout, priority=priority, fields=entry)
    child.update(parent_id=parent, conversation_id=conv, chain_position=position)
    if deps:
        child["depends_on"] = deps
    return child


# ---------------------------------------------------------------- gates
def requester_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """Hold a handoff parked by needs_clarification / blocked until it is answered."""
    awaiting = book(doc).get("awaiting") if isinstance(doc.get("handoffd"), dict) else None
    if not isinstance(awaiting, dict):
        return None
    kind = str(awaiting.get("kind", "needs_clarification")).replace("_", " ")
    items = awaiting.get("questions") or awaiting.get("blockers") or []
    items = items if isinstance(items, list) else [items]  # (bookkeeping is ours, but typed)
    first = items[0] if items else ""
    if isinstance(first, dict):
        first = first.get("description") or first.get("question") or first.get("text") or ""
    more = f" (+{len(items) - 1} more)" if len(items) > 1 else ""
    who = awaiting.get("requester") or "the requester"
    return Verdict.wait(f"waiting on the requester ({who}): {kind}: {str(first)[:100]}{more}; "
                        f"answer with `handoff answer {env.handoff_id} --data JSON`")


def children_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """Hold a delegating parent until its children are done (see :func:`ready`)."""
    wait = book(doc).get("waiting_children") if isinstance(doc.get("handoffd"), dict) else None
    if not isinstance(wait, dict):
        return None
    children = wait.get("children")
    infos = [child_info(engine, cid) for cid in (children if isinstance(children, list) else [])
             if isinstance(cid, str)]
    if ready(engine, wait, infos):
        return None
    open_ = [i for i in infos if i.status is None]
    shown = ", ".join(f"{i.handoff_id} ({i.state})" for i in open_[:4])
    more = f" and {len(open_) - 4} more" if len(open_) > 4 else ""
    return Verdict.wait(f"waiting for {len(open_)} of {len(infos)} children "
                        f"({wait.get('aggregation')}): {shown}{more}")


# ---------------------------------------------------------------- answering
# a handoff just parked is written to pending/ a moment before its in-progress copy goes: an
# answer racing that moment (or a daemon's look at it) tries again for this long
ANSWER_PATIENCE_SECONDS = 2.0
ANSWER_BOOKKEEPING_BYTES = 2048  # what an answer adds besides itself: its entry, history, seal
OUTCOME_INLINE_BYTES = 64 * 1024  # a parked handoff's report larger than this is abridged


def answer(engine: "Engine", handoff_id: str, data: Any, *, by: str = "@cli") -> dict[str, Any]:
    """Attach an answer to a handoff waiting on its requester and release it to pending/."""
    box: list[Any] = []

    def on_claim(claimed: dict[str, Any]) -> None:
        try:
            dialect = engine.formats.detect(claimed)
        except InvalidDocument:
            dialect = engine.formats.by_name("native")
        box.append(dialect)

    give_up_at = time.monotonic() + ANSWER_PATIENCE_SECONDS
    while True:
        state, doc = engine.get(handoff_id)
        if state is not State.PENDING or not isinstance(book(doc).get("awaiting"), dict):
            raise InvalidTransition(f"handoff {handoff_id} is {state.value} and not waiting for "
                                    "an answer (only handoffs that asked for clarification or "
                                    "were blocked can be answered)", handoff_id=handoff_id)
        _check_room(engine, handoff_id, doc, data)
        now = engine.clock()
        try:
            claim = engine.backend.claim(handoff_id, now, engine.settings.lease_seconds,
                                         prepare=on_claim)
        except (DuplicateHandoff, DocumentNotReady, UnreadableDocument):
            claim = None
        if claim is not None:
            break
        if time.monotonic() >= give_up_at:
            raise InvalidTransition(f"handoff {handoff_id} moved while answering; look at it "
                                    "with `handoff show` and try again", handoff_id=handoff_id)
        time.sleep(0.02)
    doc = claim.doc
    block = book(doc)
    history = block.get("history")
    if isinstance(history, list) and history and history[-1].get("event") == "claimed":
        history.pop()  # claimed only to write the answer in; it did not run
    awaiting = block.pop("awaiting", None) or {}
    entry = {"at": iso(now), "by": by, "kind": awaiting.get("kind"), "answer": data}
    for key in ("questions", "blockers"):
        if awaiting.get(key):
            entry[key] = awaiting[key]
    dialect = box[0]
    if dialect.name == "native":
        inp = given if isinstance(given := doc.get("input"), dict) else {}
        doc["input"] = inp
        inp.setdefault("clarifications", []).append(entry)
    else:
        block.setdefault("clarifications", []).append(entry)
    # the history names the answer; the document holds it once (clarifications)
    shown = data if isinstance(data, (int, float, bool)) or data is None else str(data)[:300]
    if engine.requeue(claim, dialect, "answered", by=by, answer=shown) is not State.PENDING:
        raise InvalidTransition(f"handoff {handoff_id} was taken over while answering",
                                handoff_id=handoff_id)
    return entry


def _check_room(engine: "Engine", handoff_id: str, doc: dict[str, Any], data: Any) -> None:
    """InvalidDocument (DOCUMENT_TOO_LARGE) before anything is written when the document with
    the answer in it would be over ``max_document_bytes``: the daemon could not read it back,
    and the handoff would be set aside instead of resumed."""
    limit = engine.settings.max_document_bytes
    size = (len(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            + len(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            + ANSWER_BOOKKEEPING_BYTES)
    if size > limit:
        raise InvalidDocument(f"the answer would make handoff {handoff_id} about {size} bytes, over "
                              f"the {limit}-byte limit; answer with less, or point to a file "
                              "(raise daemon.max_document_bytes in handoffd.toml if this is "
                              "intended)", handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None
