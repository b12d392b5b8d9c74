"""A delegating parent's children as its aggregation and the children gate read them: each
child's facts (:class:`ChildInfo`: state, status, confidence, a short error), read one child at a
time, its answer (output and artifacts) held only within an aggregation's budget
(:class:`Holding`, :func:`read_child`) and never by the gate (:func:`child_info`).

Nothing a child's document carries is kept whole but its answer: its error is kept as its code
and the start of its message, its specialist and finish time as short strings.
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..core.documents import BOOK, book
from ..core.errors import ErrorCode, InvalidDocument, NotFound
from ..core.states import State
from ..dialects import hi_moe

if TYPE_CHECKING:
    from ..core.engine import Engine


SUCCESS_LIKE = ("success", "partial")


@dataclass
class ChildInfo:
    """A child as the aggregation sees it; ``status`` is seed 000's OutcomeStatus or None (open).
    ``output`` and ``artifacts`` are what it answered when held: :func:`child_info` never
    holds them, :func:`read_child` only within its :class:`Holding` (``reread``: let go)."""

    handoff_id: str
    state: str
    status: str | None
    confidence: float = 0.0
    specialist: str | None = None
    output: Any = None
    artifacts: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None
    finished_at: str | None = None
    asking: str | None = None  # an open child parked for its requester's answer: what it awaits
    # as read_child measured them (None: not measured; :func:`copies` measures what is held)
    output_size: int | None = None  # JSON bytes of its output
    artifacts_size: int | None = None  # JSON bytes of its artifacts as the parent lists them
    artifacts_count: int = 0
    # its document read again (_read): how an answer let go is had again
    reread: Callable[[], "ChildInfo"] | None = field(default=None, repr=False, compare=False)
    held: bool = True  # its output and artifacts are in hand (False: let go, see reread)


def child_info(engine: "Engine", handoff_id: str) -> ChildInfo:
    """A child's status and facts without its output or artifacts: the children gate needs
    statuses only, and a hundred children's answers of 16 MiB each were held together at
    every look. One child's document is in memory at a time."""
    info = _read(engine, handoff_id)
    info.output, info.artifacts = None, []
    return info


@dataclass
class Holding:
    """How many bytes (as JSON) of its children's outputs and artifacts an aggregation may
    still hold in memory; the rest is measured, let go and read again only if copied."""

    left: int


def read_child(engine: "Engine", handoff_id: str, holding: Holding) -> ChildInfo:
    """A child as the aggregation reads it: its output and artifacts (only a successful or
    partial child's are ever copied) measured, and held while ``holding`` has room for them;
    otherwise let go, for :func:`copies` to read again when it copies them."""
    info = _read(engine, handoff_id)
    if info.status not in SUCCESS_LIKE:
        info.output, info.artifacts = None, []
        return info
    items = [from_child(item, handoff_id) for item in info.artifacts]
    info.output_size, info.artifacts_size = json_size(info.output), json_size(items)
    info.artifacts_count = len(items)
    info.reread = functools.partial(_read, engine, handoff_id)  # (a held one may be let go too)
    if info.output_size + info.artifacts_size <= holding.left:
        holding.left -= info.output_size + info.artifacts_size
    else:
        let_go(info)
    return info


def let_go(info: ChildInfo) -> None:
    """Drop ``info``'s output and artifacts (its ``reread`` has them again)."""
    info.output, info.artifacts, info.held = None, [], False


def _read(engine: "Engine", handoff_id: str) -> ChildInfo:
    """A child's facts with its output and artifacts, from its document as stored now."""
    try:
        state, doc = engine.get(handoff_id)
    except (NotFound, InvalidDocument):
        return ChildInfo(handoff_id, "missing", "failed",
                         error={"code": ErrorCode.DEPENDENCY_MISSING, "message": "child handoff is missing"})
    except OSError:  # unreadable for now (permissions, disk): keep waiting
        return ChildInfo(handoff_id, "unreadable", None)
    target = given if isinstance(given := doc.get("target"), dict) else {}
    info = ChildInfo(handoff_id, state.value, None, specialist=target.get("agent_id"))
    if not state.terminal:
        awaiting = book(doc).get("awaiting") if isinstance(doc.get(BOOK), dict) else None
        if state is State.PENDING and isinstance(awaiting, dict):
            info.asking = str(awaiting.get("kind") or "needs_clarification")[:FACT_TEXT] \
                .replace("_", " ")
        return _bounded(info)
    reported = hi_moe.read_outcome(doc)  # a child that speaks seed 000 (a hi_moe parent's)
    if reported is not None:
        return _from_report(info, reported)
    error = given if isinstance(given := doc.get("error"), dict) else None
    if state is State.COMPLETED:
        info.status = "partial" if doc.get("status") == "partial" else "success"
        info.finished_at = doc.get("completed_at")
    else:
        code = (error or {}).get("code")
        info.status = ("cancelled" if doc.get("status") == "cancelled" or code == ErrorCode.CANCELLED
                       else "timeout" if code == ErrorCode.TIMEOUT else "failed")
        info.finished_at = doc.get("failed_at")
    info.output = doc.get("output")
    info.artifacts = given if isinstance(given := doc.get("artifacts"), list) else []
    info.error = _brief_error(error)
    info.confidence = _confidence(doc, info.status)
    return _bounded(info)


# what a child's facts keep of its own strings: an aggregation shows a child's error as its
# code and the first 200 characters of its message (_child_error), and a failed/ file placed
# in the workspace may hold megabytes in any of them (held once per child at every look)
FACT_TEXT = 200


def _brief_error(error: Any) -> dict[str, Any] | None:
    """The part of a child's ``error`` an aggregation uses: its code and the start of its
    message, as short strings (None: no error object)."""
    if not isinstance(error, dict):
        return None
    code, message = error.get("code"), error.get("message")
    return {"code": str(code)[:FACT_TEXT] if code is not None else None,
            "message": str(message)[:FACT_TEXT] if message is not None else None}


def _bounded(info: ChildInfo) -> ChildInfo:
    """``info`` with its specialist and finished_at kept only as short strings (a document's
    values, which a hostile file may make huge or of another type)."""
    info.specialist = info.specialist[:FACT_TEXT] if isinstance(info.specialist, str) else None
    info.finished_at = info.finished_at if isinstance(info.finished_at, str) \
        and len(info.finished_at) <= FACT_TEXT else None
    return info


def _confidence(doc: dict[str, Any], status: str) -> float:
    for holder in (doc.get("metadata"), doc.get("output")):
        if isinstance(holder, dict):
            value = holder.get("confidence")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
                return float(value)
    return {"success": 1.0, "partial": 0.5}.get(status, 0.0)


def _from_report(info: ChildInfo, reported: dict[str, Any]) -> ChildInfo:
    """A child's facts from its hi_moe answer (:func:`handoffd.dialects.hi_moe.read_outcome`)."""
    status = reported.get("status")
    info.status = status if status in ("success", "partial", "failed", "timeout", "cancelled") \
        else "failed"
    info.finished_at = reported.get("finished_at")
    info.output = reported.get("output")
    info.artifacts = list(reported.get("artifacts") or [])
    info.error = _brief_error(reported.get("error"))
    info.specialist = reported.get("specialist") or info.specialist
    confidence = reported.get("confidence")
    info.confidence = float(confidence) if isinstance(confidence, (int, float)) \
        and not isinstance(confidence, bool) and 0 <= confidence <= 1 else _confidence({}, info.status)
    return _bounded(info)


def json_size(value: Any) -> int:
    """Bytes ``value`` takes in a document (compact UTF-8 JSON, as documents are written); one
    that cannot be written counts as too large to copy."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError):  # (a lone surrogate: a ValueError)
        return sys.maxsize


def from_child(item: Any, handoff_id: str) -> Any:
    """A child's artifact as the parent lists it: tagged with the child's id."""
    if isinstance(item, dict):
        item = dict(item)
        meta = dict(item.get("metadata") or {}) if isinstance(item.get("metadata"), dict) else {}
        meta["child_id"] = handoff_id
        item["metadata"] = meta
    return item
