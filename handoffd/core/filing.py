"""Filing an attempt's outcome: is it tried again or filed, when is a retried or throttled
handoff due again, and what does its filed answer record.

The decisions are functions of the document and the outcome; :func:`file_outcome` acts on them
(requeues the claim or finishes it) through the engine's public members (:class:`Filing`), as a
feature would. :meth:`Engine.file <handoffd.core.engine.Engine.file>` calls it, then tells the
``on_filed`` listeners.
"""
from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .bounds import MAX_RETRY_DELAY_SECONDS
from .documents import PROCESS_DIED, Outcome, book, book_int, record, throttles_in_a_row
from .errors import ConfigError, ErrorCode, InvalidDocument
from .formats import ArtifactSink, Dialect, FiledState, Formats, answer_refusal
from .hooks import Hooks
from .logs import log
from .native_format import ANSWER_FIELDS, REFUSED_ANSWER, native_answer
from .settings import RetryPolicy
from .specialists import Specialist
from .states import State, Status
from .storage import Backend, Claim
from .submission import without_book
from .timeutil import Clock

MAX_THROTTLE_SECONDS = 3600.0  # a throttled handoff is looked at again within the hour
# ... and not sooner than this, doubled for each throttle in a row: a specialist answering
# `throttled` with no delay (or a negative one) would otherwise be polled in a hot loop
MIN_THROTTLE_SECONDS = 0.1
# never retried, whatever the policy: the same document would fail the same way
PERMANENT_CODES = frozenset({
    ErrorCode.SCHEMA_VALIDATION_FAILED, ErrorCode.VALIDATION_FAILED, ErrorCode.CONTRACT_VIOLATION,
    ErrorCode.CANCELLED, ErrorCode.DEPENDENCY_MISSING, ErrorCode.INVALID_DOCUMENT, ErrorCode.UNSAFE_ID,
    ErrorCode.UNKNOWN_VERSION, ErrorCode.NEEDS_CLARIFICATION, ErrorCode.BLOCKED,
    ErrorCode.NOT_A_REQUEST, ErrorCode.EXPIRED,
})


if TYPE_CHECKING:  # for the type checker only: no class to build at each import
    class Filing(Protocol):
        """What filing uses of an :class:`~handoffd.core.engine.Engine` (named here, not imported:
        engine.py imports this module)."""

        backend: Backend
        hooks: Hooks[Any]
        clock: Clock
        artifact_sink: ArtifactSink | None

        def policy(self, doc: dict[str, Any], spec: Specialist | None) -> RetryPolicy: ...

        def requeue(self, claim: Claim, dialect: Dialect, event: str, *,
                    due_at: datetime | None = None, count_attempt: bool = False,
                    **detail: Any) -> State: ...


def file_outcome(engine: Filing, claim: Claim, dialect: Dialect, spec: Specialist | None,
                 outcome: Outcome) -> State:
    """Retry or file ``outcome`` for a claimed handoff; where it went (IN_PROGRESS: nothing was
    written because the claim was lost). An outcome whose status a feature files (``filers``)
    is theirs. Tells no listener: :meth:`Engine.file <handoffd.core.engine.Engine.file>` does."""
    filer = engine.hooks.filers.get(outcome.status)
    if filer is not None:  # e.g. a parked handoff goes back to pending (orchestration)
        return filer(claim, dialect, spec, outcome)
    if outcome.status == Status.THROTTLED:
        return _throttled(engine, claim, dialect, spec, outcome)
    doc = claim.doc
    block = book(doc)
    retries = book_int(doc, "retries", 0)
    # a success is never retried, and its answer says nothing of retries: no policy to read
    policy = None if outcome.succeeded else engine.policy(doc, spec)
    now = engine.clock()
    delay = None if policy is None else retry_delay(outcome, policy, retries)
    if delay is not None:
        block["retries"] = retries + 1
        block["last_error"] = outcome.error
        return engine.requeue(claim, dialect, "retry_scheduled",
                              due_at=now + timedelta(seconds=delay), count_attempt=True,
                              retry=retries + 1, delay_seconds=delay, error=outcome.error)
    dst, answer = final_answer(doc, dialect, outcome, policy, retries, now, engine.artifact_sink)
    if engine.backend.finish(claim, dst, answer):
        engine.hooks.filed(claim.id, dst, answer)
        return dst
    return State.IN_PROGRESS


def runs_again(engine: Filing, claim: Claim, spec: Specialist | None, outcome: Outcome) -> bool:
    """True when filing ``outcome`` (see :func:`file_outcome`) puts the handoff back in pending,
    where any process may start another attempt: a retry, a throttle, a feature's filer (a
    parked handoff goes back to pending); False when it files the handoff finished."""
    if outcome.status in engine.hooks.filers or outcome.status == Status.THROTTLED:
        return True
    policy = engine.policy(claim.doc, spec)
    return retry_delay(outcome, policy, book_int(claim.doc, "retries", 0)) is not None


def _throttled(engine: Filing, claim: Claim, dialect: Dialect, spec: Specialist | None,
               outcome: Outcome) -> State:
    """Seed 000's THROTTLED: the specialist was too busy to start. Back to pending, due after
    :func:`throttle_delay`; not an attempt and not a failure, so it never uses up retries."""
    delay = throttle_delay(claim.doc, outcome, lambda: engine.policy(claim.doc, spec).delay(1))
    log.info("handoff %s: %s is throttled; trying again in %gs", claim.id,
             spec.agent if spec else "its specialist", delay)
    return engine.requeue(claim, dialect, "throttled",
                          due_at=engine.clock() + timedelta(seconds=delay), delay_seconds=delay)


def retry_policy(doc: dict[str, Any], spec: Specialist | None, default: RetryPolicy) -> RetryPolicy:
    """The document's retry policy, else the specialist's, else ``default`` (the configured
    one). A document's policy overlays the specialist's; a bad one is ignored."""
    base = (spec.config.retry if spec and spec.config.retry else None) or default
    raw = doc.get("retry_policy")
    if isinstance(raw, dict):
        try:
            return RetryPolicy.from_dict(raw, base)
        except ConfigError:
            return base
    return base


def retryable(outcome: Outcome) -> bool:
    """Seed 003's error_type: permanent codes, ``retryable: false`` and ``error_type:
    permanent`` are never retried; ``unknown`` (the seed's table has no row for it) is."""
    error = outcome.error or {}
    return (error.get("code") not in PERMANENT_CODES and error.get("retryable") is not False
            and error.get("error_type") != "permanent")


def retry_delay(outcome: Outcome, policy: RetryPolicy, retries: int) -> float | None:
    """Seconds until a handoff that has been retried ``retries`` times is tried again after
    ``outcome``; None when it is filed instead (it succeeded, must not be retried, or has used
    up its retries)."""
    if outcome.succeeded or not retryable(outcome) or retries >= policy.max_retries:
        return None
    return min(policy.delay(retries + 1), MAX_RETRY_DELAY_SECONDS)  # never overflows


def throttle_delay(doc: dict[str, Any], outcome: Outcome,
                   first_retry_delay: Callable[[], float]) -> float:
    """Seed 000's THROTTLED: seconds until the handoff is looked at again. The specialist's
    ``retry_after_seconds`` (bounded), else the retry policy's first delay (asked only then),
    but at least a floor that doubles with each throttle in a row, and at most an hour."""
    asked = (outcome.park or {}).get("retry_after_seconds")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked == asked:
        # bounded before the conversion: a 401-digit integer overflows a float
        delay = float(min(max(asked, 0), MAX_THROTTLE_SECONDS))
    else:
        delay = first_retry_delay()
    floor = MIN_THROTTLE_SECONDS * 2 ** min(throttles_in_a_row(doc), 16)
    return min(max(delay, floor), MAX_THROTTLE_SECONDS)


# a key of the ``final_error`` handoffd records: the failed document holds an answer
HELD_ANSWER = "answer"
# another: the fields of a native answer this filing wrote from the outcome over the request's
# (its validation, its metadata), taken out again when it goes back to pending/
WROTE = "wrote"
# the fields of a native answer its outcome may write over a request's own (apply_native_outcome)
OUTCOME_FIELDS = ("validation", "metadata")


def final_answer(doc: dict[str, Any], dialect: Dialect, outcome: Outcome,
                 policy: RetryPolicy | None, retries: int, now: datetime,
                 artifacts: ArtifactSink | None) -> tuple[State, dict[str, Any]]:
    """Where ``outcome`` is filed for good (completed or failed) and the answer filed there:
    ``doc`` with the event recorded and the format-neutral facts `handoff retry` and `handoff
    ls` read, rendered by its format (which may answer with a new document). ``policy`` may be
    None for a success, whose answer no format gives retry facts (``max_retries`` 0 then)."""
    succeeded = outcome.succeeded  # (a property: read once)
    dst = State.COMPLETED if succeeded else State.FAILED
    event = "completed" if succeeded else ("cancelled" if outcome.status == "cancelled"
                                           else "failed")
    detail: dict[str, Any] = {"seconds": outcome.seconds}
    if outcome.error:
        detail["code"] = outcome.error.get("code")
        detail["message"] = str(outcome.error.get("message"))[:500]
        given = outcome.error.get("details")
        if isinstance(given, dict) and given.get(PROCESS_DIED) is True:
            detail[PROCESS_DIED] = True  # a `handoff retry` of it runs isolated (core/isolation)
    record(doc, event, now, **detail)
    block = book(doc)
    block.pop("next_attempt_at", None)
    filed = FiledState(retries, policy.max_retries if policy is not None else 0,
                       retryable(outcome) or
                       (outcome.error or {}).get("code") == ErrorCode.TIMEOUT)
    block["retry_available"] = filed.retry_available
    if outcome.error:
        block["final_error"] = {"code": outcome.error.get("code"),
                                "message": str(outcome.error.get("message"))[:500]}
        is_answer = getattr(dialect, "is_answer", None)
        # whether it was filed unrun holding an answer, not a request (refused NOT_A_REQUEST, or
        # cancelled while pending): said in our sealed block, True or False, as `handoff retry`
        # asks it (a field in the document itself is the sender's to write). Once said only
        # when True, a request cancelled while pending read as a cancel filed before the flag
        # existed, and a `refused_answer` it carried made it an answer never to be retried
        block["final_error"][HELD_ANSWER] = is_answer is not None and bool(is_answer(doc))
        wrote = [key for key in OUTCOME_FIELDS if getattr(outcome, key) is not None
                 or (key == "validation" and outcome.error.get("errors"))]  # (the render's own)
        if dialect.name == "native" and wrote:
            # (a retried one that then succeeded showed this failure's validation, "failed",
            # beside its completed status: the new outcome wrote none over it)
            block["final_error"][WROTE] = wrote
    else:
        block.pop("final_error", None)
    if dialect.name != "native":  # its answer replaces the request: keep it for retries
        block.setdefault("request_snapshot", without_book(doc))
    return dst, dialect.render(doc, outcome, filed, artifacts=artifacts)


# the fields a native answer adds to its request: taken out when it goes back to pending/
ANSWER_KEYS = ("aggregated_outcome", "children", "error", "errors", "failed_at", "timestamp_failed",
               "retry_available",
               "recovery_actions", "execution_time_seconds", "completed_at", "timestamp_completed",
               "started_at")


def restore_request(doc: dict[str, Any]) -> None:
    """Strip native answer fields so a requeued document reads as a request again; call it
    while its ``final_error`` is still there. ``refused_answer`` is taken out only when
    handoffd put it there (:func:`filed_answer`): a request's own field of that name is the
    sender's, kept as any other (it once lost it on `handoff retry`)."""
    for key in ANSWER_KEYS:
        doc.pop(key, None)
    if filed_answer(doc):
        doc.pop(REFUSED_ANSWER, None)
    block = book(doc)
    final = block.get("final_error")
    wrote = final.get(WROTE) if isinstance(final, dict) else None
    for key in wrote if isinstance(wrote, list) else ():
        if key in OUTCOME_FIELDS:  # (what our own record names, and only those)
            doc.pop(key, None)
    if isinstance(block.get("request_snapshot"), dict):
        snapshot = block["request_snapshot"]
        for key in list(doc):
            if key != "handoffd":
                del doc[key]
        doc.update(snapshot)


def filed_answer(doc: dict[str, Any]) -> bool:
    """True when handoffd's own record of the filing (its ``final_error``) says the failed
    ``doc`` was filed holding an answer: refused NOT_A_REQUEST, or flagged
    :data:`HELD_ANSWER` (cancelled while pending). Only then did its filing move a seed-001
    answer's fields under ``refused_answer`` (``keep_refused_answer``); a CANCELLED one
    filed before the flag holding what that moves is never retried (:func:`held_answer`)."""
    final = book(doc).get("final_error")
    return isinstance(final, dict) and (final.get("code") == ErrorCode.NOT_A_REQUEST
                                        or final.get(HELD_ANSWER) is True)


def held_answer(formats: Formats, doc: dict[str, Any]) -> str | None:
    """Why the failed ``doc`` (the store's trusted view) holds an answer, not a request, so that
    it may never be retried, even forced; None: it holds a request.

    Decided by handoffd's own record of the filing: its ``final_error`` says NOT_A_REQUEST, or
    that it held an answer (:data:`HELD_ANSWER` True); a filing says that flag True or False,
    and False is a request whatever its content. Only a CANCELLED one without the key (a cancel
    filed before the flag, session 27) falls back to content, and then to a ``refused_answer``
    only where handoffd itself could have moved it there (:func:`_moved_by_filing`). Content
    is read only for these: a seed-001 answer keeps the sender's fields under
    ``refused_answer`` (retried, what was left of it ran as work); another format's answer is
    what the retry would put back (only to be refused again). A ``refused_answer`` a request
    merely carries is no reason (it could never be retried once it failed, R53, nor once
    cancelled while pending, session 29); a refused document whose answer the user took out
    is retried as any other.
    `handoff retry` refuses on it; a dependent of such a document is told so."""
    final = book(doc).get("final_error")
    if not isinstance(final, dict):
        return None
    flagged = final.get(HELD_ANSWER) is True
    before_flag = HELD_ANSWER not in final and final.get("code") == ErrorCode.CANCELLED
    if final.get("code") != ErrorCode.NOT_A_REQUEST and not flagged and not before_flag:
        return None  # (a request, as our record says: no document content is read)
    kept = doc.get(REFUSED_ANSWER)
    # (keep_refused_answer always moves status; before the flag, only what it could have moved)
    if isinstance(kept, dict) and "status" in kept and (not before_flag or _moved_by_filing(kept)):
        status = str(kept["status"])[:40]
        kind = "Response" if status in ("completed", "partial") else "Failure"
        return (f"it is a seed-001 handoff {kind} (status {status!r}, its fields kept under "
                f"{REFUSED_ANSWER}), an answer, not a request; submit the request it answers "
                "(status pending, without the answer's fields) under a new id")
    restored = copy.deepcopy(doc)  # what the retry would put back into pending/
    restore_request(restored)
    try:
        dialect = formats.detect(restored)
    except InvalidDocument:  # no format of ours: not an answer this check could name
        return None
    refusal = answer_refusal(dialect, restored)
    if refusal is not None:
        return str(refusal)
    is_answer = getattr(dialect, "is_answer", None)
    if flagged and is_answer is not None and is_answer(restored):
        # filed holding an answer, still one, whatever else its format says of it now (R55: an
        # Outcome of an unknown major version was put back, only to be refused again)
        return ("it was filed holding an answer, not a request; submit the request it answers "
                "under a new id")
    return None


def _moved_by_filing(kept: dict[str, Any]) -> bool:
    """True when ``kept`` (a failed document's ``refused_answer``) could be what
    :func:`~handoffd.core.native_format.keep_refused_answer` moved there: it moves only a
    seed-001 answer's fields, so they are a seed-001 answer (its status and a field only an
    answer has) and nothing else. A request's own ``{"status": "completed"}`` is not."""
    return native_answer(kept) and all(key in ANSWER_FIELDS for key in kept)
