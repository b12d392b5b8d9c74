"""Seed 001 (AgenticCoder file handoff): the native format."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from ..core.documents import Envelope, Outcome
from ..core.formats import ArtifactSink
from ..core.native_format import apply_native_outcome, native_answer, native_envelope, refuse_answer
from ..core.timeutil import iso
from .base import FiledState


# every status a seed-001 document has (request, Response, Failure); another is the schema's to
# refuse, never overwritten by handoffd's marks
SEED_STATUSES = frozenset({"pending", "in_progress", "completed", "partial", "failed", "cancelled"})


class NativeDialect:
    """Request / response / failure documents exactly as seed 001 names their fields."""

    name = "native"
    # matches() is never true without one of these keys (its handoff_id): detection passes over a
    # document that has none without calling it
    match_keys = frozenset({"handoff_id"})

    def matches(self, doc: dict[str, Any]) -> bool:
        return "handoff_id" in doc and isinstance(doc.get("target"), dict)

    def id_of(self, doc: dict[str, Any]) -> Any:
        return doc.get("handoff_id")

    def is_answer(self, doc: dict[str, Any]) -> bool:
        """True for a seed-001 Response or Failure (its status with an answer's own fields,
        :func:`handoffd.core.native_format.native_answer`): ``handoff validate`` checks it
        against its answer schema without routing it; offered as work it is refused
        ``NOT_A_REQUEST`` (:meth:`complete`, and native_envelope once claimed). One without a
        ``target`` is not taken for one: the seed's answers are its request with the answer's
        fields added, and a failure-shaped document from outside lacking a target is checked
        (and refused) as the request it would be (only handoffd's own sealed stubs have none)."""
        return native_answer(doc) and isinstance(doc.get("target"), dict)

    def refuse_unclaimed(self, doc: dict[str, Any], handoff_id: str) -> None:
        """Raise InvalidDocument (NOT_A_REQUEST) when ``doc``, pending as ``handoff_id``, is a
        seed-001 answer (:meth:`is_answer`): its claim refuses it whatever its target
        (native_envelope), so one whose target nobody here serves, never claimed, is refused
        as well rather than left waiting for a specialist that could not run it."""
        if self.is_answer(doc):
            refuse_answer(doc, handoff_id)

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        """Request, response or failure schema, by the document's ``status``."""
        status = doc.get("status")
        if status in ("completed", "partial"):
            return ["native.response.schema.json"]
        if status in ("failed", "cancelled"):
            return ["native.failure.schema.json"]
        return ["native.request.schema.json"]

    def envelope(self, doc: dict[str, Any]) -> Envelope:
        return native_envelope(doc)

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Nothing to default: the format names its id and times itself. A new submission
        (``handoff_id`` None) that is a seed-001 answer is refused NOT_A_REQUEST here, as the
        other formats refuse theirs (a dropped one is refused when claimed: native_envelope)."""
        if handoff_id is None and native_answer(doc):
            given = doc.get("handoff_id")
            refuse_answer(doc, given if isinstance(given, str) and len(given) <= 128 else None)

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        # a status the schema refuses is left as written: the check after the claim must see
        # it (once overwritten, "garbage" ran; `handoff validate` refused it)
        if doc.get("status", "pending") in ("pending", "in_progress"):
            doc["status"] = "in_progress"
        doc["started_at"] = iso(now)

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Back to pending/ (a retry, a hand-back, a recovery): ``status`` pending again, unless
        the document is a seed-001 answer (:func:`native_answer`: a claim left its status as
        written). Set to pending, a Response handed back before its admission (a passing
        shortage) or recovered after a crash read as a request at its next claim and ran,
        carrying the sender's ``output``; kept, it is refused NOT_A_REQUEST then. (`handoff
        retry` strips a filed failure's answer fields first, so that one reads pending.)"""
        status = doc.get("status", "pending")
        # a status no seed-001 document has is left as written too, as mark_claimed leaves it:
        # set to pending by a hand-back, a request the schema refuses ("garbage") ran
        if isinstance(status, str) and status in SEED_STATUSES and not native_answer(doc):
            doc["status"] = "pending"
        doc.pop("started_at", None)

    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        answer = dict(doc)
        apply_native_outcome(answer, outcome, retry_count=filed.retry_count,
                             max_retries=filed.max_retries, retry_available=filed.retry_available)
        error = answer.get("error") if answer.get("status") in ("failed", "cancelled") else None
        if isinstance(error, dict) and "retryable" in error:
            # what filing decided, not what the failure first said: a DEPENDENCY_MISSING raised
            # as retryable is filed for good (a permanent code), and said retryable: true next
            # to retry_available: false
            error["retryable"] = filed.retry_available
        return answer
