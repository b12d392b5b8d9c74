"""Helpers the non-native dialects share: request snapshots, error facts, small coercions."""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..core.documents import BOOK, Outcome
from ..core.errors import ErrorCode, InvalidDocument
from ..core.states import REPORTED

# Outcome.status (and error codes the engine turns into "failed") → a neutral status name.
CODE_STATUS: dict[str, str] = {ErrorCode.BLOCKED: "blocked",
                               ErrorCode.NEEDS_CLARIFICATION: "needs_clarification",
                               ErrorCode.TIMEOUT: "timeout", ErrorCode.CANCELLED: "cancelled"}
INLINE_LIMIT = 1024  # seed 000: content under 1 KB (UTF-8 bytes) goes inline
# the zone that ends an RFC 3339 time (Z or an offset); anchored at the end, no repetition: linear
_ZONE = re.compile(r"(?:[Zz]|[+-][0-9]{2}:[0-9]{2})$")


def naive_time_errors(doc: dict[str, Any], fields: tuple[str, ...],
                      schema_path: str = "#/$defs/date_time") -> list[dict[str, str]]:
    """An error entry for each top-level ``fields`` value of ``doc`` that is a string but no
    date-time, where a time without a zone counts as UTC (seeds 000 and 003 fill these fields
    with Python's naive ``datetime.utcnow()``, whose ``isoformat()`` has no ``Z``). The schemas
    of those formats check the shape with a pattern whose zone is optional; this is the
    calendar check (``2026-02-30``) their ``format: date-time`` made, asked of the same RFC 3339
    check with a ``Z`` added to a naive time. Other values are the schema's to report."""
    from ..core.schemachecks import is_datetime  # (loads its validators on first use only)
    errors = []
    for name in fields:
        value = doc.get(name)
        if not isinstance(value, str):
            continue
        zoned = value if _ZONE.search(value) else value + "Z"
        if not is_datetime(zoned):
            errors.append({"field": name, "schema_path": schema_path,
                           "error": f"{value[:60]!r} is not a 'date-time' (such as "
                                    "2026-01-15T10:30:00Z, or 2026-01-15T10:30:00 read as UTC)"})
    return errors


def check_times(doc: dict[str, Any], fields: tuple[str, ...], dialect: str, id_field: str) -> None:
    """Raise InvalidDocument (SCHEMA_VALIDATION_FAILED, every error) when a ``fields`` value of
    ``doc`` is no date-time (:func:`naive_time_errors`); called where the format names its
    schemas, as the schema's own format check was."""
    errors = naive_time_errors(doc, fields)
    if errors:
        given = doc.get(id_field)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise InvalidDocument(f"not a valid {dialect} document: {errors[0]['field']}: "
                              f"{errors[0]['error']}{more}", code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                              handoff_id=given if isinstance(given, str) else None, errors=errors)


def schema_errors(name: str, doc: dict[str, Any]) -> list[dict[str, str]]:
    """Errors of ``doc`` (minus the bookkeeping block) against built-in schema ``name``."""
    from ..core.validation import builtin_schemas  # jsonschema loads on first use only
    return builtin_schemas().errors(name, without_book(doc))


def snapshot(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The request the engine kept when it filed this document's answer (``handoffd.request_snapshot``)."""
    block = doc.get(BOOK)
    if isinstance(block, dict) and isinstance(block.get("request_snapshot"), dict):
        return block["request_snapshot"]
    return None


def without_book(doc: dict[str, Any]) -> dict[str, Any]:
    """The document minus handoffd's bookkeeping block."""
    return {k: v for k, v in doc.items() if k != BOOK}


def copy_book(doc: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the bookkeeping block (an answer carries it on)."""
    block = doc.get(BOOK)
    return copy.deepcopy(block) if isinstance(block, dict) else {}


def effective_status(outcome: Outcome) -> str:
    """completed, partial, failed, blocked, needs_clarification, timeout or cancelled."""
    if outcome.status in REPORTED:
        return outcome.status
    return CODE_STATUS.get(error_code(outcome) or "", "failed")


def error_code(outcome: Outcome) -> str | None:
    """The outcome's error code, if any."""
    error = outcome.error if isinstance(outcome.error, dict) else {}
    code = error.get("code")
    return str(code) if code else None


def error_message(outcome: Outcome) -> str | None:
    """The outcome's error message, if any."""
    error = outcome.error if isinstance(outcome.error, dict) else {}
    message = error.get("message")
    return str(message) if message else None


def retry_promised(outcome: Outcome, retry_available: bool) -> bool:
    """Whether a failure's answer may say its work can still be retried (seed 000's
    ``recoverable``, seed 004's ``error.retryable``): what filing decided (``retry_available``),
    unless the failure itself said it is not retryable (``retryable: false`` or ``error_type:
    "permanent"``: a specialist's own word, or handoffd's final TIMEOUT past a hard deadline).
    Filing leaves every TIMEOUT ``retry_available`` for a hand-made `handoff retry` (seed 001:
    "Increase timeout, retry"), but handoffd never retries such a one, and the answer must
    not turn the specialist's "not retryable" into "retryable"."""
    error = outcome.error if isinstance(outcome.error, dict) else {}
    said_final = error.get("retryable") is False or error.get("error_type") == "permanent"
    return bool(retry_available) and not said_final


def error_list(outcome: Outcome, key: str) -> list[Any]:
    """A list carried by the error (``violations``, ``errors``), also looked up under ``details``."""
    error = outcome.error if isinstance(outcome.error, dict) else {}
    for holder in (error, details if isinstance(details := error.get("details"), dict) else {}):
        value = holder.get(key)
        if isinstance(value, list):
            return list(value)
    return []


def output_field(outcome: Outcome, key: str) -> Any:
    """``outcome.output[key]`` when the output is an object, else None."""
    return outcome.output.get(key) if isinstance(outcome.output, dict) else None


def metadata_field(outcome: Outcome, key: str) -> Any:
    """``outcome.metadata[key]`` when there is metadata, else None."""
    return outcome.metadata.get(key) if isinstance(outcome.metadata, dict) else None


def summary_of(outcome: Outcome, agent: str | None) -> str:
    """The handler's own summary (output.summary, metadata.summary), else a generated line."""
    for value in (output_field(outcome, "summary"), metadata_field(outcome, "summary")):
        if isinstance(value, str) and value.strip():
            return value
    who = agent or outcome.executed_by or "the specialist"
    status = effective_status(outcome)
    if status == "completed":
        return f"Completed by {who}."
    if status == "partial":
        return f"Partially completed by {who}."
    message = error_message(outcome)
    code = error_code(outcome)
    return f"{status} ({code}): {message}" if code and message else f"{status}: {message or who}"


def strings(value: Any) -> list[str]:
    """``value`` as a list of strings (non-strings dropped; a non-list gives [])."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def as_text(value: Any) -> str:
    """Artifact content as text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def milliseconds(outcome: Outcome) -> int:
    """Wall time of the attempt in whole milliseconds."""
    return max(int(round(outcome.seconds * 1000)), 0)
