"""Seed 000 (hi_moe): versioned Message envelopes between tiers.

A Message is routed to ``payload.specialist_hint`` when set, else to its ``target_tier`` by name
(``ROUTING_DISPATCHER``...). Its answer is a new Message going back up: source and target tiers
swapped, ``correlation_id`` = the request's ``id``, and an OutcomePayload whose artifacts follow the
1 KB rule (inline under 1 KB, else written to ``artifacts/<id>/<n>.txt`` and referenced).
Unknown MAJOR versions are rejected (``UNKNOWN_VERSION``); unknown fields of a known major version
are accepted, and unknown envelope fields are carried into the answer.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from ..core.documents import (Envelope, Outcome, booked_id, check_id, document_seconds,
                              priority_rank, random_uuid)
from ..core.errors import ErrorCode, InvalidDocument
from ..core.formats import ArtifactSink
from ..core.timeutil import iso
from . import _shared as sh
from .base import FiledState

SCHEMA = "hi_moe.message.schema.json"
SUPPORTED_MAJORS = (1,)
CURRENT_VERSION = "1.0.0"
TIERS = {4: "PROGRESS_MONITOR", 3: "ABSTRACT_ARCHITECT", 2: "ROUTING_DISPATCHER",
         1: "SPECIALIZED_FLEET"}
# Seed 000's recommended timeouts by receiving tier, used when a message gives no timeout_ms
# and its specialist sets none (the seed recommends none for the progress monitor)
TIER_TIMEOUT_SECONDS = {"SPECIALIZED_FLEET": 30.0, "ROUTING_DISPATCHER": 60.0,
                        "ABSTRACT_ARCHITECT": 120.0}
ENVELOPE_KEYS = ("version", "id", "timestamp", "source_tier", "target_tier", "correlation_id",
                 "payload")
STATUS = {"completed": "success", "partial": "partial", "failed": "failed", "timeout": "timeout",
          "cancelled": "cancelled", "blocked": "blocked",
          "needs_clarification": "needs_clarification"}

# Seed 000: "Error details (only present if status is FAILED, BLOCKED, NEEDS_CLARIFICATION)".
# TIMEOUT keeps them too: the seed is ambiguous there (its aggregated example reports a child's
# timeout as a failure, with the detail in error_detail, which needs the child's own detail) —
# docs/formats.md quotes the rule and says why. CANCELLED (the requester's own decision) and
# SUCCESS carry none; PARTIAL only with an error (as the seed's aggregated example does).
ERROR_FIELD_STATUSES = ("failed", "blocked", "needs_clarification", "timeout")

TOO_LARGE = 10 ** 18  # the MAJOR of a version whose first number has more than 18 digits


def major_of(version: Any) -> int | None:
    """The MAJOR number of a ``MAJOR.MINOR.PATCH`` string, or None when it is not one."""
    if not isinstance(version, str):
        return None
    head = version.split(".", 1)[0]
    # ASCII digits only, and few: str.isdigit() is true for '²' (int() refuses it) and int()
    # refuses more than 4,300 digits; the schema's pattern says why such a version is wrong
    if not (head.isascii() and head.isdigit()):
        return None
    return int(head) if len(head) <= 18 else TOO_LARGE  # (a major no receiver speaks)


# the schema's version pattern (MAJOR.MINOR.PATCH, an optional pre-release and build); no nested
# quantifier, and only short strings are matched: linear
_SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?"
                     r"(\+[0-9A-Za-z.-]+)?")


def recoverable(status: str, outcome: Outcome, filed: FiledState) -> bool:
    """Seed 000's ``recoverable`` of an error answer: whether the work can still come to
    something. Blocked and needs_clarification flow up to be resolved: true (the sender
    clarifies or unblocks and resends). Otherwise what filing decided (``retry_available``),
    except for a failure that said itself it is not retryable (:func:`_shared.retry_promised`):
    a final TIMEOUT (its hard deadline passed and the sender stopped waiting, so handoffd never
    runs it again), or a specialist's own ``retryable: false``, a TIMEOUT it reported included
    (also when it answered ``partial``) — filing still leaves a hand-made ``handoff retry``
    open to a TIMEOUT, which is no recovery the sender can count on."""
    if status in ("blocked", "needs_clarification"):
        return True
    return sh.retry_promised(outcome, filed.retry_available)


def _semver(version: Any) -> bool:
    """True for a version string the message schema accepts."""
    return isinstance(version, str) and len(version) <= 256 and bool(_SEMVER.fullmatch(version))


def check_version(doc: dict[str, Any]) -> None:
    """Raise InvalidDocument(UNKNOWN_VERSION) for a MAJOR version this receiver does not speak."""
    major = major_of(doc.get("version"))
    if major is not None and major not in SUPPORTED_MAJORS:
        shown = str(doc.get("version"))
        shown = shown if len(shown) <= 40 else f"{shown[:30]}... ({len(shown)} characters)"
        message = (f"UNKNOWN_VERSION: message version {shown} has major version "
                   f"{major if major != TOO_LARGE else 'past 10^18'}; handoffd speaks hi_moe {', '.join(f'{m}.x.y' for m in SUPPORTED_MAJORS)} "
                   "and must reject unknown major versions (seed 000)")
        raise InvalidDocument(message, handoff_id=doc.get("id") if isinstance(doc.get("id"), str) else None,
                              code=ErrorCode.UNKNOWN_VERSION,
                              errors=[{"field": "version", "error": message,
                                       "schema_path": "#/properties/version"}])


def check_inline_bytes(doc: dict[str, Any]) -> None:
    """Raise InvalidDocument(SCHEMA_VALIDATION_FAILED) naming each ``payload.artifacts[i].
    inline_content`` of 1024 UTF-8 bytes or more (seed 000: inline content is under 1 KB). The
    schema's ``maxLength`` cannot say it: JSON Schema counts characters, and 600 x "é" is 600
    characters but 1200 bytes."""
    payload = doc.get("payload")
    items = payload.get("artifacts") if isinstance(payload, dict) else None
    errors = []
    for index, item in enumerate(items if isinstance(items, list) else []):
        text = item.get("inline_content") if isinstance(item, dict) else None
        size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
        if size >= sh.INLINE_LIMIT:
            field = f"payload.artifacts[{index}].inline_content"
            errors.append({"field": field, "schema_path": "#/$defs/Artifact/properties/inline_content",
                           "error": f"{size} UTF-8 bytes: inline content must be under 1 KB "
                                    f"({sh.INLINE_LIMIT} bytes); store it and use content_ref "
                                    "(seed 000)"})
    if errors:
        message = f"not a valid hi_moe document: {errors[0]['field']}: {errors[0]['error']}"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidDocument(message + more, code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                              handoff_id=doc.get("id") if isinstance(doc.get("id"), str) else None,
                              errors=errors)


def valid_tier(value: Any) -> bool:
    """A TierLevel name or number 1-4."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return False  # (an object or a list is no tier, and cannot be looked up: unhashable)
    return value in TIERS or value in TIERS.values()


def answer_tiers(request: dict[str, Any]) -> tuple[Any, Any]:
    """(source_tier, target_tier) of the answer: the request's, swapped. A request rejected for
    a bad tier still gets a valid answer: its receiver defaults to ROUTING_DISPATCHER and its
    sender to the tier above the receiver."""
    receiver, sender = request.get("target_tier"), request.get("source_tier")
    if not valid_tier(receiver):
        receiver = "ROUTING_DISPATCHER"
    if not valid_tier(sender):
        level = receiver if isinstance(receiver, int) else next(
            number for number, name in TIERS.items() if name == receiver)
        sender = TIERS[min(level + 1, 4)]
    return receiver, sender


def tier_name(value: Any) -> str | None:
    """A TierLevel as its name (ints 1-4 are mapped)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return TIERS.get(value)
    if isinstance(value, str) and value:
        return value
    return None


class HiMoeDialect:
    """The hi_moe Message envelope with Delegation / Outcome / Cancellation payloads."""

    name = "hi_moe"
    # matches() is never true without one of these keys (a ``$schema`` naming it, or a payload):
    # detection passes over a document that has none without calling it
    match_keys = frozenset({"$schema", "payload"})

    # ------------------------------------------------------------ recognising
    def matches(self, doc: dict[str, Any]) -> bool:
        declared = doc.get("$schema")
        if isinstance(declared, str) and "hi_moe" in declared:
            return True
        if "payload" not in doc:
            return False
        # any two of the envelope's distinctive fields, so that one missing field is reported
        # as a hi_moe error rather than an unknown format
        return ("version" in doc) + ("source_tier" in doc) + ("target_tier" in doc) >= 2

    def is_answer(self, doc: dict[str, Any]) -> bool:
        """True for an answer: one handoffd filed (its id differs from the request it keeps), or
        any message whose payload is an OutcomePayload (a report going up)."""
        request = sh.snapshot(doc)
        if request is not None and doc.get("id") != request.get("id"):
            return True
        payload = doc.get("payload")
        return isinstance(payload, dict) and "status" in payload

    def answered_id(self, doc: dict[str, Any]) -> Any:
        """The id of the request an answer answers (its ``correlation_id``): an Outcome has an
        ``id`` of its own, so a filed one copied into pending/ under its request's name is
        told by this (:func:`handoffd.core.formats.id_refusal`)."""
        return doc.get("correlation_id")

    def _request(self, doc: dict[str, Any]) -> dict[str, Any]:
        request = sh.snapshot(doc) if self.is_answer(doc) else None
        return request if request is not None else doc

    def id_of(self, doc: dict[str, Any]) -> Any:
        return self._request(doc).get("id")

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        check_version(doc)
        check_inline_bytes(doc)
        # seed 000's timestamp is a Python datetime: a naive one (no zone) is read as UTC
        sh.check_times(doc, ("timestamp",), self.name, "id")
        return [SCHEMA]

    # ------------------------------------------------------------ routing
    def envelope(self, doc: dict[str, Any]) -> Envelope:
        request = self._request(doc)
        check_version(request)
        handoff_id = check_id(request.get("id"))
        payload = given if isinstance(given := request.get("payload"), dict) else {}
        if "status" in payload:  # an OutcomePayload: a report going up, never work to run
            raise InvalidDocument(
                f"message {handoff_id} is an Outcome (payload.status {str(payload['status'])[:40]!r},"
                f" answering {str(request.get('correlation_id'))[:80]!r}), not a delegation: an "
                "answer goes up to its requester and is not run; send the DelegationPayload "
                "instead", handoff_id=handoff_id, code=ErrorCode.NOT_A_REQUEST)
        hint = payload.get("specialist_hint")
        tier = tier_name(request.get("target_tier"))
        target = hint if isinstance(hint, str) and hint else tier
        if not target:
            raise InvalidDocument(f"message {handoff_id} has no usable target_tier: use a TierLevel "
                                  f"name ({', '.join(TIERS.values())}) or 1-4",
                                  handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
        # (a 401-digit timeout_ms is refused by the Envelope like any over its bound)
        timeout = document_seconds(payload.get("timeout_ms"), units_per_second=1000)
        correlation = request.get("correlation_id")
        return Envelope(
            handoff_id=handoff_id, dialect=self.name, target=target,
            source=tier_name(request.get("source_tier")), data=payload, timeout_seconds=timeout,
            priority=priority_rank(payload.get("priority")),
            correlation_id=correlation if isinstance(correlation, str) else None,
            hard_timeout=True,
            final_timeout=True,
            depends_on=dependencies(request),
            fallback_targets=(tier,) if tier and tier != target else (),
            default_timeout_seconds=TIER_TIMEOUT_SECONDS.get(tier or ""),
        )

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Nothing to default: the format names its id and times itself."""

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        """A Message has no status field: claiming leaves it as written."""

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Nothing to undo (see mark_claimed)."""

    # ------------------------------------------------------------ answering
    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        request = sh.without_book(self._request(doc))
        # the handoff's id is the file it was dropped as (its bookkeeping names it): the same
        # as the request's id for any request admitted, but a refused Outcome carries its own
        # id (one copied from another workspace answers the file name), and its refusal, filed
        # as failed/{file name}, must answer that name, as handoffd knows it
        request_id = booked_id(doc) or str(request.get("id"))
        version = request.get("version")
        if major_of(version) not in SUPPORTED_MAJORS or not _semver(version):
            version = CURRENT_VERSION  # (the request's, copied, must not make the answer invalid)
        receiver, sender = answer_tiers(request)
        answer: dict[str, Any] = {
            "version": version,
            "id": random_uuid(),
            "timestamp": iso(outcome.finished_at),
            "source_tier": receiver,
            "target_tier": sender,
            "correlation_id": request_id,
            "payload": self.outcome_payload(request_id, outcome, filed, artifacts),
        }
        for key, value in request.items():  # unknown envelope fields of a known major survive
            if key not in ENVELOPE_KEYS and key not in answer:
                answer[key] = value
        answer["handoffd"] = sh.copy_book(doc)
        return answer

    def outcome_payload(self, request_id: str, outcome: Outcome, filed: FiledState,
                        sink: ArtifactSink | None) -> dict[str, Any]:
        """Seed 000's OutcomePayload for ``outcome``."""
        status = STATUS[sh.effective_status(outcome)]
        artifacts = self.artifacts(request_id, outcome, sink)
        refs = sh.strings(sh.output_field(outcome, "result_refs"))
        if not refs:
            refs = [a["content_ref"] for a in artifacts if a.get("content_ref")]
        confidence = sh.metadata_field(outcome, "confidence")
        if not (isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
                and 0 <= confidence <= 1):
            confidence = 1.0 if status == "success" else 0.5 if status == "partial" else 0.0
        resources = sh.metadata_field(outcome, "resources_used")
        resources = dict(resources) if isinstance(resources, dict) else {}
        if outcome.executed_by:
            resources.setdefault("specialist", outcome.executed_by)
        surprise = sh.metadata_field(outcome, "surprise_flag")
        reason = sh.metadata_field(outcome, "surprise_reason")
        payload: dict[str, Any] = {
            "status": status,
            "summary": sh.summary_of(outcome, outcome.executed_by),
            "result_refs": refs,
            "confidence": float(confidence),
            "execution_time_ms": sh.milliseconds(outcome),
            "resources_used": resources,
            "surprise_flag": bool(surprise) if isinstance(surprise, bool) else False,
            "surprise_reason": reason if isinstance(reason, str) else None,
            "error_type": None,
            "error_detail": None,
            "recoverable": None,
            "artifacts": artifacts,
        }
        aggregated = outcome.fields.get("aggregated_outcome")
        if isinstance(aggregated, dict):  # a dispatcher reporting up after parallel execution
            payload["aggregated_outcome"] = aggregated
        if status in ERROR_FIELD_STATUSES or (status == "partial" and outcome.error):
            code = sh.error_code(outcome) or status.upper()
            payload["error_type"] = code.lower()
            payload["error_detail"] = sh.error_message(outcome) or payload["summary"]
            payload["recoverable"] = recoverable(status, outcome, filed)
        return payload

    def artifacts(self, request_id: str, outcome: Outcome,
                  sink: ArtifactSink | None) -> list[dict[str, Any]]:
        """The handler's output and artifacts as seed 000 Artifacts, applying the 1 KB rule."""
        items: list[Any] = []
        if outcome.output is not None:
            items.append({"artifact_type": "output", "content": outcome.output,
                          "metadata": {"media_type": "application/json"
                                       if not isinstance(outcome.output, str) else "text/plain"}})
        items.extend(outcome.artifacts)
        out: list[dict[str, Any]] = []
        for item in items:
            index = len(out) + 1
            if isinstance(item, str):
                out.append({"artifact_type": "file", "content_ref": item, "inline_content": None,
                            "metadata": {}})
                continue
            if not isinstance(item, dict):
                item = {"content": item}
            kind = item.get("artifact_type") or item.get("type") or "data"
            metadata = dict(item["metadata"]) if isinstance(item.get("metadata"), dict) else {}
            for key in ("name", "description"):
                if isinstance(item.get(key), str):
                    metadata.setdefault(key, item[key])
            ref = item.get("content_ref") or item.get("path") or item.get("artifact_path")
            if "inline_content" in item and item["inline_content"] is not None:
                content: Any = item["inline_content"]
            elif "content" in item:
                content = item["content"]
            else:
                content = None
            if content is None and isinstance(ref, str) and ref:
                out.append({"artifact_type": str(kind), "content_ref": ref, "inline_content": None,
                            "metadata": metadata})
                continue
            text = sh.as_text(content)
            size = len(text.encode("utf-8"))
            stored = sink(request_id, index, text) if sink and size >= sh.INLINE_LIMIT else None
            if stored is not None:
                metadata.setdefault("bytes", size)
                out.append({"artifact_type": str(kind), "content_ref": stored,
                            "inline_content": None, "metadata": metadata})
            else:
                out.append({"artifact_type": str(kind), "content_ref": None,
                            "inline_content": text, "metadata": metadata})
        return out



def delegation(parent: dict[str, Any], child_id: str, *, to: str, data: Any, now: datetime,
               timeout_seconds: float, priority: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A child of the hi_moe request ``parent``: a Message with a DelegationPayload one tier
    down (seed 000: delegation goes down), addressed by ``specialist_hint`` to ``to``, its
    ``task_data`` the child's data, ``correlation_id`` the parent. ``fields``: the entry's
    objective, constraints, context_refs and task_type, when given."""
    receiver, _ = answer_tiers(parent)
    level = receiver if isinstance(receiver, int) else next(
        (number for number, name in TIERS.items() if name == receiver), 2)
    objective = fields.get("objective")
    return {
        "version": CURRENT_VERSION, "id": child_id, "timestamp": iso(now),
        "source_tier": tier_name(receiver), "target_tier": TIERS[max(level - 1, 1)],
        "correlation_id": parent.get("id"),
        "payload": {
            "task_type": str(fields.get("task_type") or "execute"),
            "objective": objective if isinstance(objective, str) else "",
            "constraints": _texts(fields, "constraints"),
            "context_refs": _texts(fields, "context_refs"),
            "priority": min(max(int(priority), 0), 4),
            "timeout_ms": max(int(timeout_seconds * 1000), 1),
            # seed 000: task_data is a dict, always present (an entry without data gets {})
            "deadline_hint": None, "specialist_hint": to, "task_data": {} if data is None else data,
        },
    }


def _texts(fields: dict[str, Any], key: str) -> list[str]:
    """A DelegationPayload list field (seed 000: ``List[str]``) from a delegation entry; absent
    is empty. InvalidDocument (VALIDATION_FAILED) when it is not a list: iterating a number
    raised a TypeError that left the delegating handoff claimed until its lease ran out."""
    value = fields.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidDocument(f"{key} must be a list of strings (seed 000: List[str]), not "
                              f"{type(value).__name__}", code=ErrorCode.VALIDATION_FAILED)
    return [str(c) for c in value]


def read_outcome(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The format-neutral facts of a filed hi_moe answer (for aggregation): ``status`` (seed
    000's), ``confidence``, ``output`` (its ``output`` artifact, when inline), ``artifacts`` (the
    others), ``error`` and ``specialist``; None when ``answer`` is not a hi_moe answer."""
    payload = answer.get("payload")
    if not isinstance(payload, dict) or "status" not in payload:
        return None
    output: Any = None
    others = []
    given = payload.get("artifacts")  # (a list in every answer handoffd files: not in a planted one)
    for item in given if isinstance(given, list) else []:
        if isinstance(item, dict) and item.get("artifact_type") == "output" and output is None \
                and isinstance(item.get("inline_content"), str):
            try:
                output = json.loads(item["inline_content"])
            except ValueError:
                output = item["inline_content"]
        elif isinstance(item, dict):
            others.append(item)
    used = payload.get("resources_used")
    error = None
    if payload.get("error_type"):
        error = {"code": str(payload["error_type"]).upper(), "message": payload.get("error_detail")}
    elif payload.get("status") == "cancelled":  # no error fields (seed 000): its summary says why
        error = {"code": "CANCELLED", "message": payload.get("summary")}
    return {"status": payload.get("status"), "confidence": payload.get("confidence"),
            "output": output, "artifacts": others, "error": error,
            "finished_at": answer.get("timestamp"),
            "specialist": used.get("specialist") if isinstance(used, dict) else None}


def dependencies(request: dict[str, Any]) -> list[str]:
    """``depends_on``: an extra envelope field (a Message has none of its own) with the
    handoffs this one waits for, as handoffd writes it for a delegated child's siblings."""
    deps = request.get("depends_on")
    return [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []
