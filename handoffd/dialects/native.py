"""Seed 001 (AgenticCoder file handoff): the native format."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from ..core.documents import Envelope, Outcome
from ..core.formats import ArtifactSink
from ..core.native_format import apply_native_outcome, native_envelope
from ..core.timeutil import iso
from .base import FiledState


class NativeDialect:
    """Request / response / failure documents exactly as seed 001 names their fields."""

    name = "native"

    def matches(self, doc: dict[str, Any]) -> bool:
        return "handoff_id" in doc and isinstance(doc.get("target"), dict)

    def id_of(self, doc: dict[str, Any]) -> Any:
        return doc.get("handoff_id")

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
        """Nothing to default: the format names its id and times itself."""

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        # a status the schema refuses is left as written: the check after the claim must see
        # it (once overwritten, "garbage" ran; `handoff validate` refused it)
        if doc.get("status", "pending") in ("pending", "in_progress"):
            doc["status"] = "in_progress"
        doc["started_at"] = iso(now)

    def mark_pending(self, doc: dict[str, Any]) -> None:
        doc["status"] = "pending"
        doc.pop("started_at", None)

    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        answer = dict(doc)
        apply_native_outcome(answer, outcome, retry_count=filed.retry_count,
                             max_retries=filed.max_retries, retry_available=filed.retry_available)
        return answer
