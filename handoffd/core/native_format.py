"""The native (seed 001) format in the core: a native request read into an :class:`Envelope`
(:func:`native_envelope`), a new request built (:func:`new_native_request`, the document
``handoff create`` writes and the library's front door exports), and an :class:`Outcome` written
into its response or failure form (:func:`apply_native_outcome`, with seed 001's
``recovery_actions``).

They sit in the core, below the dialects, so that building a native request (``handoff create``,
a child's document, the client) loads no dialect; :mod:`handoffd.dialects.native` uses them as a
dialect. The format-neutral pieces they use (ids, Envelope, Outcome, time limits) are
:mod:`.documents`.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from .documents import (
    BOOK,
    PRIORITIES,
    Envelope,
    Outcome,
    check_id,
    document_seconds,
    new_id,
    newest_among,
    priority_rank,
)
from .errors import ErrorCode, InvalidDocument
from .timeutil import MAX_FRACTION_DIGITS, OutsideCalendar, fraction_too_long, iso, parse_utc


# Seed 001's answers, told from its request by their status and the fields only an answer has:
# the Response (status completed, timestamp_completed; its Example 3 writes completed_at) and the
# Failure (status failed, timestamp_failed and error; Example 4 writes failed_at). handoffd also
# files partial and cancelled ones. A request that merely carries a status ("pending") has none.
ANSWER_MARKS: dict[str, tuple[str, ...]] = {
    "completed": ("timestamp_completed", "completed_at"),
    "partial": ("timestamp_completed", "completed_at"),
    "failed": ("timestamp_failed", "failed_at", "error"),
    "cancelled": ("timestamp_failed", "failed_at", "error"),
}
# the events of handoffd's own history that file a handoff, and those that take it up again
# (``rejected``: a failure stub's one event)
_FILED = frozenset({"completed", "failed", "cancelled", "rejected"})
_TAKEN_UP = frozenset({"created", "claimed", "retried", "handed_back", "recovered"})


def native_answer(doc: dict[str, Any]) -> bool:
    """True when ``doc`` is a seed-001 Response or Failure (:data:`ANSWER_MARKS`), whoever
    wrote it: an answer, not a request."""
    status = doc.get("status")
    marks = ANSWER_MARKS.get(status) if isinstance(status, str) else None
    return marks is not None and any(key in doc for key in marks)


def taken_up(doc: dict[str, Any]) -> bool:
    """True when handoffd's history says ``doc`` is being taken up as work: its latest filing or
    taking-up event takes it up (a claim appends ``claimed``, so a foreign answer dropped into
    pending/ always is once claimed, whatever history it brought). False for a document
    handoffd filed, and for one without history: a document another consumer filed (readers
    see its block emptied) keeps its target."""
    return newest_among(doc, _TAKEN_UP, _FILED)


def refuse_answer(doc: dict[str, Any], handoff_id: str | None) -> None:
    """Raise InvalidDocument (NOT_A_REQUEST) for a seed-001 Response or Failure offered as work:
    run, it was filed with the answer's stale fields. Called as a claimed document is read
    (:func:`native_envelope`, :func:`taken_up`) and as one is submitted; handoffd's own filed
    documents, and those another consumer filed, stay readable as the request they were."""
    if native_answer(doc):
        status = str(doc.get("status"))
        kind = "Response" if status in ("completed", "partial") else "Failure"
        marks = ", ".join(key for key in ANSWER_MARKS[status] if key in doc)
        raise InvalidDocument(
            f"{handoff_id or 'the document'} is a seed-001 handoff {kind} (status {status!r} "
            f"with {marks}), an answer, not a request: it is not run; submit the request instead "
            "(status pending, without the answer's fields)", handoff_id=handoff_id,
            code=ErrorCode.NOT_A_REQUEST)


def native_envelope(doc: dict[str, Any]) -> Envelope:
    """Read a seed-001 request into an Envelope; raise InvalidDocument if it cannot be routed
    (NOT_A_REQUEST for an answer being taken up: :func:`refuse_answer`)."""
    handoff_id = check_id(doc.get("handoff_id"))
    if taken_up(doc):
        refuse_answer(doc, handoff_id)
    target = doc.get("target")
    agent = target.get("agent_id") if isinstance(target, dict) else None
    if not isinstance(agent, str) or not agent:
        raise InvalidDocument(f"handoff {handoff_id} has no target.agent_id: name the specialist "
                              "that should run it", handoff_id=handoff_id,
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED)
    source = doc.get("source")
    # only a string names the requester (as the other dialects read it): an object or a number
    # here once became Envelope.source and broke every `handoff ls` of the workspace
    agent_from = source.get("agent_id") if isinstance(source, dict) else None
    inp = given_input if isinstance(given_input := doc.get("input"), dict) else {}
    out = given_output if isinstance(given_output := doc.get("expected_output"), dict) else {}
    timeout = doc.get("timeout_seconds")
    depends = doc.get("depends_on") or []
    # (each field read once: the Envelope is built at the peek, the claim's event and admission)
    contract = given if isinstance(given := doc.get("contract"), dict) else None
    return Envelope(
        handoff_id=handoff_id, dialect="native", target=agent,
        source=agent_from if isinstance(agent_from, str) else None,
        data=inp.get("data"),
        timeout_seconds=document_seconds(timeout),
        priority=priority_rank(doc.get("priority")),
        retry_policy=given if isinstance(given := doc.get("retry_policy"), dict) else None,
        input_schema=given if isinstance(given := inp.get("schema"), str) else None,
        output_schema=given if isinstance(given := out.get("schema"), str) else None,
        correlation_id=given if isinstance(given := doc.get("correlation_id"), str) else None,
        conversation_id=given if isinstance(given := doc.get("conversation_id"), str) else None,
        depends_on=_with_contract_dependencies(contract, depends),
        contract=contract,
        expires_at=_expires_at(doc, handoff_id),
    )


def _expires_at(doc: dict[str, Any], handoff_id: str) -> datetime | None:
    """A native request's ``expires_at`` (an RFC 3339 time with its zone), in UTC.

    InvalidDocument (SCHEMA_VALIDATION_FAILED) when it is no date-time, or one whose UTC time is
    outside years 1 to 9999 (``0001-01-01T00:00:00+14:00``): the schema's date-time format
    accepts that, and admission then raised OverflowError formatting it, leaving the handoff
    claimed until recovery and burning every retry."""
    value = doc.get("expires_at")
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return parse_utc(value)
    except OutsideCalendar:
        problem = (f"{str(value)[:60]!r} falls outside years 1 to 9999 once in UTC: give a "
                   "date-time such as 2026-11-25T12:00:00Z")
    except ValueError:
        problem = f"{str(value)[:60]!r} is not a date-time such as 2026-11-25T12:00:00Z"
        if isinstance(value, str) and fraction_too_long(value):  # (parse_iso's bound)
            problem += f" (at most {MAX_FRACTION_DIGITS} digits of fractional seconds)"
    raise InvalidDocument(f"handoff {handoff_id}: expires_at {problem}", handoff_id=handoff_id,
                          code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                          errors=[{"field": "expires_at", "error": problem, "schema_path": ""}])


def _with_contract_dependencies(contract: dict[str, Any] | None, depends: Any) -> list[str]:
    """``depends_on`` plus the ``contract``'s ``dependencies_completed`` list (seed 004),
    deduplicated."""
    # (an empty depends_on, the usual one, is a new list without a comprehension's call)
    out = [d for d in depends if isinstance(d, str)] if depends and isinstance(depends, list) \
        else []
    extra = contract.get("dependencies_completed") if contract is not None else None
    if isinstance(extra, list):
        out += [d for d in extra if isinstance(d, str) and d not in out]
    return out


def _request_field_problems(source: Any, target: Any, timeout: Any, priority: Any,
                            depends_on: Any) -> list[tuple[str, str]]:
    """(field, error) for each value the native request schema refuses."""
    problems = []
    for name, agent in (("source.agent_id", source), ("target.agent_id", target)):
        if not isinstance(agent, str) or not agent:
            problems.append((name, f"{agent!r} must be a non-empty string"))
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        problems.append(("timeout_seconds", f"{timeout!r} must be a number above 0"))
    whole = isinstance(priority, int) or (isinstance(priority, float) and priority.is_integer())
    if priority is not None and not (
            (isinstance(priority, str) and priority in PRIORITIES)
            or (whole and not isinstance(priority, bool) and 0 <= priority <= 4)):
        problems.append(("priority", f"{priority!r} is not one of {', '.join(PRIORITIES)} or 0-4"))
    if depends_on is not None and (not isinstance(depends_on, (list, tuple))
                                   or not all(isinstance(d, str) for d in depends_on)):
        problems.append(("depends_on", "every entry must be a handoff id (a string)"))
    return problems


def new_native_request(
    *, source: str, target: str, data: Any, now: datetime, handoff_id: str | None = None,
    timeout_seconds: float | None = None, priority: str | int | None = None,
    depends_on: list[str] | None = None,
) -> dict[str, Any]:
    """Build a seed-001 handoff request (the document ``handoff create`` writes).

    Raises InvalidDocument (SCHEMA_VALIDATION_FAILED) for exactly what the native request schema
    would refuse in the fields it fills in, so a document it returns is valid without loading a
    schema validator (``tests/test_core.py`` holds the two to agreement)."""
    problems = _request_field_problems(source, target, timeout_seconds, priority, depends_on)
    if problems:
        field_name, error = problems[0]
        raise InvalidDocument(f"the new handoff is not a valid native document: {field_name}: "
                              f"{error}", code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                              errors=[{"field": f, "error": e, "schema_path": ""}
                                      for f, e in problems])
    doc: dict[str, Any] = {
        # only None means "make one": an empty id was silently replaced by a fresh one (so
        # `if_absent` with it was no longer idempotent); it is UNSAFE_ID like any other bad id
        "handoff_id": check_id(new_id(now) if handoff_id is None else handoff_id),
        "timestamp": iso(now),
        "status": "pending",
        "source": {"agent_id": source},
        "target": {"agent_id": target},
        "input": {"data": data},
    }
    if timeout_seconds is not None:
        doc["timeout_seconds"] = timeout_seconds
    if priority is not None:
        doc["priority"] = priority
    if depends_on:
        doc["depends_on"] = list(depends_on)
    return doc


# The fields only a seed-001 Response or Failure has (its request has none of them): what a
# refused answer brought (:func:`keep_refused_answer`)
ANSWER_FIELDS = ("status", "timestamp_completed", "completed_at", "timestamp_failed", "failed_at",
                 "execution_time_seconds", "output", "validation", "metadata", "artifacts",
                 "next_steps", "warnings", "errors", "error", "retry_available", "retry_count",
                 "max_retries", "recovery_actions")
REFUSED_ANSWER = "refused_answer"


def keep_refused_answer(doc: dict[str, Any]) -> None:
    """Move the answer fields of a seed-001 Response or Failure filed as a failure (the
    sender's ``output``, ``validation``, ``error``...) under :data:`REFUSED_ANSWER`, kept for
    reference: left where they were, the filed refusal showed an ``output`` handoffd never
    produced (and a passed ``validation``) next to its own error, and lost the sender's error
    and next steps under handoffd's. The refusal then has the Failure's shape alone."""
    given = {key: doc.pop(key) for key in ANSWER_FIELDS if key in doc}
    if given:
        doc[REFUSED_ANSWER] = given


def answer_status(doc: dict[str, Any]) -> bool:
    """True when ``doc``'s ``status`` is one only a seed-001 answer has (completed, partial,
    failed, cancelled: :data:`ANSWER_MARKS`), with or without the answer's own fields. Read
    as a claimed document is filed: a claim leaves such a status as the sender wrote it
    (handoffd's own documents are in_progress then), and the schema check reads the document
    as the Response or Failure its status names (one without its marks fails it)."""
    return isinstance(doc.get("status"), str) and doc["status"] in ANSWER_MARKS


def answer_fields_lacking(doc: dict[str, Any]) -> str:
    """What a seed-001 document whose ``status`` only an answer has (:func:`answer_status`)
    lacks of that answer's own fields (:data:`ANSWER_MARKS`), in words (``status 'completed',
    a seed-001 Response's, without timestamp_completed or completed_at``); "" for any other
    document (a request, a whole answer). A claim checks such a document against its answer's
    schema and files it ``SCHEMA_VALIDATION_FAILED``; ``handoff ls`` notes it."""
    if not answer_status(doc) or native_answer(doc):
        return ""
    status = str(doc["status"])
    kind = "Response" if status in ("completed", "partial") else "Failure"
    marks = ANSWER_MARKS[status]
    return f"status {status!r}, a seed-001 {kind}'s, without {', '.join(marks[:-1])} or {marks[-1]}"


def apply_native_outcome(doc: dict[str, Any], outcome: Outcome, *, retry_count: int,
                         max_retries: int, retry_available: bool) -> None:
    """Turn an in-progress seed-001 document into its response (completed) or failure form
    (for a refused answer, with what it brought set aside: :func:`keep_refused_answer`)."""
    if not outcome.succeeded and (native_answer(doc) or answer_status(doc)):
        # an answer filed as a failure, whatever the code (NOT_A_REQUEST, or CANCELLED by
        # `handoff cancel` while it was pending): the document is still the sender's answer
        # (a claim leaves its status as written, and handoffd's own are in_progress here), so
        # its fields are the sender's, never a result. Keyed on the code alone, a refusal
        # with another code showed the sender's output beside handoffd's error. So is a
        # Response or Failure that lacks its answer's marks: checked against its answer's
        # schema, it is filed SCHEMA_VALIDATION_FAILED, and showed the sender's output too
        keep_refused_answer(doc)
    doc["execution_time_seconds"] = outcome.seconds
    for key in ("validation", "metadata"):
        if getattr(outcome, key) is not None:
            doc[key] = getattr(outcome, key)
    if outcome.output is not None:
        doc["output"] = outcome.output
    if outcome.artifacts:
        doc["artifacts"] = outcome.artifacts
    doc["next_steps"] = list(outcome.next_steps)
    doc["warnings"] = list(outcome.warnings)
    doc.update(outcome.fields)
    when = iso(outcome.finished_at)
    if outcome.status in ("needs_clarification", "blocked"):  # reported up while it waits
        doc["status"] = outcome.status
        for key in ("questions", "blockers", "summary"):
            if outcome.park and outcome.park.get(key):
                doc[key] = outcome.park[key]
        return
    if outcome.succeeded:
        doc["status"] = "completed" if outcome.status == "completed" else "partial"
        doc["completed_at"] = doc["timestamp_completed"] = when
        doc["errors"] = []
        for key in ("error", "failed_at", "timestamp_failed", "recovery_actions"):
            doc.pop(key, None)
        return
    error = dict(outcome.error or {"code": ErrorCode.PROCESSING_ERROR, "message": "handler failed"})
    code = error.get("code", ErrorCode.PROCESSING_ERROR)
    doc["status"] = "cancelled" if outcome.status == "cancelled" else "failed"
    doc["failed_at"] = doc["timestamp_failed"] = when
    doc["error"] = {"code": code, "message": str(error.get("message", code)),
                    "severity": error.get("severity", "error"), "timestamp": when}
    if error.get("retryable") is not None:
        doc["error"]["retryable"] = bool(error["retryable"])
    if error.get("errors"):
        doc["validation"] = {"status": "failed", "errors": error["errors"]}
    doc["errors"] = [doc["error"]]
    doc["retry_available"] = retry_available
    doc["retry_count"] = retry_count
    doc["max_retries"] = max_retries
    # a stub has no request to retry: its advice is about the file that was set aside; a gate
    # may give its own (Engine.reject), where the code's usual steps would mislead
    details = given if isinstance(given := error.get("details"), dict) else {}
    advice = details.get(RECOVERY_DETAIL)
    doc["recovery_actions"] = list(STUB_RECOVERY) if stub_code(doc) == code \
        else [str(step) for step in advice] if isinstance(advice, list) and advice \
        else recovery_actions(code, retry_available=retry_available,
                              handoff_id=doc.get("handoff_id"))
    for key in ("completed_at", "timestamp_completed"):
        doc.pop(key, None)


# the key of a failure's ``error.details`` holding a gate's own recovery steps (Engine.reject)
RECOVERY_DETAIL = "recovery_actions"

RECOVERY: dict[str, list[str]] = {
    ErrorCode.SCHEMA_VALIDATION_FAILED: ["Fix the input so it matches the specialist's input schema",
                                         "Retry the handoff with corrected input"],
    ErrorCode.PROCESSING_ERROR: ["Check the specialist's stderr tail in error.message",
                                 "Retry the handoff"],
    ErrorCode.TIMEOUT: ["Increase timeout_seconds or make the specialist faster", "Retry the handoff"],
    ErrorCode.DEPENDENCY_MISSING: ["Complete the dependency first", "Retry the handoff"],
    ErrorCode.VALIDATION_FAILED: ["Fix the specialist so its output passes validation"],
    ErrorCode.CANCELLED: ["Create a new handoff if the work is still wanted"],
    ErrorCode.CONTRACT_VIOLATION: ["Keep the worker inside files_owned", "Split the task differently"],
    # handoffd's own refusals of a document, never run (always retry_available: false)
    ErrorCode.NOT_A_REQUEST: [
        "This document is a seed-001 Response or Failure: an answer goes back to its "
        "orchestrator, not into handoffs/pending/",
        "To have the work done, submit its request (status pending, without the answer's "
        "fields) into handoffs/pending/ under a new handoff_id: handoff retry refuses this one, "
        "even forced, as it holds an answer (its fields under refused_answer), not a request"],
    ErrorCode.EXPIRED: ["Create a new handoff with a later expires_at if the work is still "
                        "wanted: this one would expire again"],
    ErrorCode.INVALID_DOCUMENT: ["Fix the document as error.message says and submit it again"],
}
# The step of a RECOVERY entry that retries the handoff (as the seed words it), and what replaces
# it when filing says ``retry_available: false``: `handoff retry` refuses such a failure without
# --force, and the daemon never retries it, so "Retry the handoff" next to it was no way out
RETRY_STEPS = ("Retry the handoff", "Retry the handoff with corrected input")
FINAL_RETRY_STEP = ("handoffd will not retry it: once the cause is fixed, run it again with "
                    "handoff retry --force {handoff_id}")
FINAL_CORRECTED_INPUT = ("Submit the corrected input as a new handoff: handoff retry would run "
                         "this same input again")


def recovery_actions(code: str, *, retry_available: bool = True,
                     handoff_id: Any = None) -> list[str]:
    """Seed 001's ``recovery_actions`` for an error code, agreeing with ``retry_available``:
    for a failure handoffd filed for good (false), a retry step says how it can run again
    (``handoff retry --force``, or a new handoff for corrected input) instead of "Retry the
    handoff", which `handoff retry` refuses without --force."""
    actions = RECOVERY.get(code, ["Inspect the error and retry the handoff"])
    if retry_available:
        return list(actions)
    if code not in RECOVERY:
        actions = ["Inspect the error", RETRY_STEPS[0]]
    named = handoff_id if isinstance(handoff_id, str) and handoff_id else "<handoff_id>"
    return [FINAL_CORRECTED_INPUT if step == RETRY_STEPS[1]
            else FINAL_RETRY_STEP.format(handoff_id=named) if step in RETRY_STEPS else step
            for step in actions]


# ---------------------------------------------------------------- failure stubs
# A *failure stub* is the native failure document handoffd files under the name of a dropped
# file it set aside unread (admission's ``file_stub``, the PostgreSQL bridge's ``stub``), so that
# `handoff wait` and `show` on that id end. Nobody read a request from the file, so it has no
# ``target``: it is validated by the rules below, never routed, and never retried.
STUB_EVENT = "rejected"
STUB_RECOVERY = ["Fix the file kept in handoffs/.quarantine/ (its .reason.json says why) and "
                 "submit it again under a new handoff_id: this one is taken by this failure",
                 "handoff retry cannot run it: no request was ever read from the file"]
_KNOWN_CODES = frozenset(code.value for code in ErrorCode)


def stub_code(doc: dict[str, Any]) -> str | None:
    """The code a failure stub was filed with, or None when ``doc`` is no stub by its
    bookkeeping: a stub has no ``target`` and its ``handoffd`` history is the one ``rejected``
    event (filed that way, never claimed, never retried), whose detail names the code.

    It reads only the block: the caller must know the block is handoffd's own (its seal, or the
    store's trusted view), since bookkeeping from outside never outranks ours."""
    if "target" in doc:
        return None
    block = doc.get(BOOK)
    history = block.get("history") if isinstance(block, dict) else None
    if not isinstance(history, list) or len(history) != 1 or not isinstance(history[0], dict):
        return None
    detail = history[0].get("detail")
    code = detail.get("code") if isinstance(detail, dict) else None
    return code if history[0].get("event") == STUB_EVENT and isinstance(code, str) else None


def stub_problems(doc: dict[str, Any], code: str) -> list[dict[str, str]]:
    """What a failure stub filed with ``code`` breaks of the rules for a stub, beyond the native
    failure schema (which the caller checks): ``status`` failed, ``error.code`` that code and
    one of handoffd's own, a native ``handoffd`` block. One error entry (``field``, ``error``,
    ``schema_path``) per rule broken; none for a valid stub."""
    error = doc.get("error")
    given = error.get("code") if isinstance(error, dict) else None
    block = doc.get(BOOK)
    dialect = block.get("dialect") if isinstance(block, dict) else None
    checks = (
        ("status", doc.get("status") == "failed", f"{str(doc.get('status'))[:40]!r} must be "
         "'failed' in a failure stub"),
        ("error.code", code in _KNOWN_CODES, f"{code[:60]!r} is not an error code of handoffd's"),
        ("error.code", given == code, f"{str(given)[:60]!r} must be the code the file was set "
         f"aside with ({code[:60]!r})"),
        ("handoffd.dialect", dialect == "native", f"{str(dialect)[:40]!r} must be 'native' in a "
         "failure stub"),
    )
    return [{"field": f, "error": e, "schema_path": ""} for f, ok, e in checks if not ok]
