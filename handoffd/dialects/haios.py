"""Seed 003 (HAIOS): CollaborationHandoff in, CollaborationResult out.

A handoff is routed to ``to_agent`` with ``timeout_ms``; the handler sees ``payload`` (directive,
context, original_input) as its data. ``expected_output_schema`` becomes the Envelope's, so the engine
validates the handler's output against it before the handoff may complete (``VALIDATION_FAILED``
otherwise). Claiming sets ``status`` to ``accepted``; going back to pending/ sets ``pending``.
The answer is a CollaborationResult: ``executed_by``, ``executed_at``, status success / partial /
error, ``result`` (the handler's output) and, on error, ``error.message`` with ``error_type``
(permanent when it was not retried for its kind, a final TIMEOUT included, unknown when the
specialist said so, else retryable) and handoffd's error ``code``. A specialist's own
``error.error_type: "permanent"`` fails the handoff at once (seed 003: "PERMANENT | Fail
immediately")."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from ..core.documents import (Envelope, Outcome, check_id, document_seconds, priority_rank,
                              random_uuid)
from ..core.errors import ErrorCode, InvalidDocument
from ..core.formats import ArtifactSink
from ..core.timeutil import iso
from . import _shared as sh
from .base import FiledState

HANDOFF_SCHEMA = "haios.collaboration_handoff.schema.json"
RESULT_SCHEMA = "haios.collaboration_result.schema.json"
DEFAULT_TIMEOUT_SECONDS = 30.0  # seed 003: timeout_ms defaults to 30000


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why an inline expected_output_schema is not a usable JSON Schema (None when it is): the
    same check (and the same bounded cache, keyed by content) the engine uses to run it."""
    from ..core.validation import builtin_schemas  # jsonschema loads on first use only
    try:
        builtin_schemas().for_schema("expected_output_schema", schema)
    except InvalidDocument as exc:
        prefix = "the inline schema is not a valid JSON Schema: "
        return str(exc)[len(prefix):] if str(exc).startswith(prefix) else str(exc)
    return None


STATUSES = ("pending", "accepted", "completed", "failed", "timeout")  # the request schema's enum

class HaiosDialect:
    """HAIOS collaboration handoffs and their results."""

    name = "haios"
    # matches() is never true without one of these keys (a ``$schema`` naming it, a payload, or a
    # result's executed_by): detection passes over a document that has none without calling it
    match_keys = frozenset({"$schema", "payload", "executed_by"})

    # ------------------------------------------------------------ recognising
    def matches(self, doc: dict[str, Any]) -> bool:
        declared = doc.get("$schema")
        if isinstance(declared, str) and "haios" in declared.lower():
            return True
        payload = doc.get("payload")
        if isinstance(payload, dict) and ("directive" in payload or "from_agent" in doc
                                          or "to_agent" in doc) \
                and "source_tier" not in doc and "target_tier" not in doc:
            return True  # agents and a payload object (the schema checks the rest)
        return self.is_answer(doc)

    def is_answer(self, doc: dict[str, Any]) -> bool:
        """True for a CollaborationResult (it carries executed_by and no payload)."""
        return "executed_by" in doc and "handoff_id" in doc and "payload" not in doc

    def _request(self, doc: dict[str, Any]) -> dict[str, Any]:
        request = sh.snapshot(doc) if self.is_answer(doc) else None
        return request if request is not None else doc

    def id_of(self, doc: dict[str, Any]) -> Any:
        return self._request(doc).get("handoff_id")

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        answer = self.is_answer(doc)
        # seed 003 fills these with datetime.utcnow(): naive, read as UTC (the schemas' pattern
        # takes a time without a zone; the calendar check is made here)
        sh.check_times(doc, ("executed_at",) if answer else ("created_at",), self.name,
                       "handoff_id")
        return [RESULT_SCHEMA if answer else HANDOFF_SCHEMA]

    # ------------------------------------------------------------ routing
    def envelope(self, doc: dict[str, Any]) -> Envelope:
        request = self._request(doc)
        handoff_id = check_id(request.get("handoff_id"))
        if self.is_answer(request):
            raise InvalidDocument(
                f"{handoff_id} is a CollaborationResult (an answer), not a request: submit the "
                "CollaborationHandoff instead", handoff_id=handoff_id, code=ErrorCode.NOT_A_REQUEST)
        target = request.get("to_agent")
        if not isinstance(target, str) or not target:
            raise InvalidDocument(f"handoff {handoff_id} has no to_agent", handoff_id=handoff_id,
                                  code=ErrorCode.SCHEMA_VALIDATION_FAILED)
        expected = request.get("expected_output_schema")
        if isinstance(expected, dict):
            problem = schema_problem(expected)
            if problem:
                message = f"expected_output_schema is not a valid JSON Schema: {problem}"
                raise InvalidDocument(f"handoff {handoff_id}: {message}", handoff_id=handoff_id,
                                      code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                                      errors=[{"field": "expected_output_schema", "error": message,
                                               "schema_path": ""}])
        source = request.get("from_agent")
        return Envelope(
            handoff_id=handoff_id, dialect=self.name, target=target,
            source=source if isinstance(source, str) else None,
            data=request.get("payload"),
            timeout_seconds=document_seconds(request.get("timeout_ms"), units_per_second=1000),
            priority=priority_rank(request.get("priority")),
            expected_output_schema=expected if isinstance(expected, dict) else None,
            default_timeout_seconds=DEFAULT_TIMEOUT_SECONDS, final_timeout=True,
        )

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Seed 003 defaults ``handoff_id`` (a new UUID; a dropped file's own name) and
        ``created_at`` (now). Answers are left as they are."""
        if self.is_answer(doc):
            return
        if doc.get("handoff_id") is None:
            doc["handoff_id"] = handoff_id or random_uuid()
        if doc.get("created_at") is None:
            doc["created_at"] = iso(now)

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        # a status the schema refuses is left as written, for the check after the claim; a
        # CollaborationResult's is the sender's answer, kept as written (it is refused)
        if doc.get("status", "pending") in STATUSES and not self.is_answer(doc):
            doc["status"] = "accepted"

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Back to pending/: ``status`` pending again, except a CollaborationResult's (an
        answer, :meth:`is_answer`), which stays the sender's: set to pending by a hand-back or
        a recovery before its admission, the result dropped into pending/ was no valid
        CollaborationResult any more, and its refusal kept a ``status`` nobody wrote."""
        if not self.is_answer(doc):
            doc["status"] = "pending"

    # ------------------------------------------------------------ answering
    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        request = self._request(doc)
        status = sh.effective_status(outcome)
        output = outcome.output
        result = output if isinstance(output, dict) else ({} if output is None else {"value": output})
        warnings = list(outcome.warnings)
        if status == "timeout" and output is not None:  # seed 003: the partial result, a warning
            status = "partial"
            warnings.insert(0, f"TIMEOUT: {sh.error_message(outcome) or 'time limit reached'}; "
                               "the result is what the specialist had when it was stopped")
        to_agent = request.get("to_agent")
        answer: dict[str, Any] = {
            "handoff_id": request.get("handoff_id"),
            "executed_by": outcome.executed_by or (to_agent if isinstance(to_agent, str) else "handoffd"),
            "executed_at": iso(outcome.finished_at),
            "status": {"completed": "success", "partial": "partial"}.get(status, "error"),
            "result": result,
            "error": None,
        }
        if answer["status"] == "error":
            code = sh.error_code(outcome) or status.upper()
            answer["error"] = {"message": sh.error_message(outcome) or sh.summary_of(outcome, None),
                               "error_type": error_type(outcome, filed, code),
                               "code": code}
            errors = sh.error_list(outcome, "errors")
            if errors:
                answer["error"]["errors"] = errors
        if warnings:
            answer["warnings"] = warnings
        answer["handoffd"] = sh.copy_book(doc)
        return answer


def error_type(outcome: Outcome, filed: FiledState, code: str) -> str:
    """Seed 003's ``error_type`` of a failed result, saying what happened: ``permanent`` when it
    was not retried for its kind (a permanent code, ``retryable: false``, or the specialist said
    so), ``unknown`` when the specialist said it did not know (retried, as the seed's table has
    no row for it), else ``retryable`` (retried up to the policy's limit).

    A TIMEOUT answered at the handoff's ``timeout_ms`` is final (its error says ``retryable:
    false``: handoffd never runs it again, the sender stops waiting), so it is ``permanent``,
    the seed's "fail immediately"; filing still leaves it ``retry_available`` for a hand-made
    ``handoff retry``, which is no retry the sender can count on."""
    error = outcome.error if isinstance(outcome.error, dict) else {}
    never_again = error.get("retryable") is False or error.get("error_type") == "permanent"
    if never_again or not (filed.retry_available or code == ErrorCode.TIMEOUT):
        return "permanent"
    return "unknown" if error.get("error_type") == "unknown" else "retryable"
