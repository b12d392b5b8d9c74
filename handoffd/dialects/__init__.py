"""Dialects: the document formats handoffd speaks, detected per document.

A dialect knows how to find a document's id, turn it into an :class:`~handoffd.core.documents.Envelope`
(routing, timeout, priority...), mark it claimed or pending again, and render the final answer in
its own format from an :class:`~handoffd.core.documents.Outcome`. The daemon runs one lifecycle for all.

Built in: ``hi_moe`` (seed 000 Message), ``haios`` (seed 003 CollaborationHandoff / Result),
``agent_handoff`` (seed 002 AgentHandoff), ``swarm`` (seed 004 WorkerHandoff) and ``native``
(seed 001, what ``handoff create --to`` builds). A document matching none of them is rejected with
``UNKNOWN_FORMAT`` naming the formats tried.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import ErrorCode, InvalidDocument
from ..core.storage import Meta, describe_native, native_links
from .agent_handoff import AgentHandoffDialect
from .base import Dialect, FiledState
from .haios import HaiosDialect
from .hi_moe import HiMoeDialect
from .native import NativeDialect
from .swarm import SwarmDialect

if TYPE_CHECKING:
    from ..core.documents import Outcome

# Tried in this order; native stays last (register() inserts before it).
DIALECTS: list[Dialect] = [HiMoeDialect(), HaiosDialect(), AgentHandoffDialect(), SwarmDialect(),
                           NativeDialect()]

SHAPES = {
    "hi_moe": "version + source_tier/target_tier + payload",
    "haios": "from_agent + to_agent + payload.directive, or a CollaborationResult",
    "agent_handoff": "from_agent + to_agent + status success/partial/blocked/error",
    "swarm": "contract.task_id, or a completion report",
    "native": "handoff_id + target.agent_id",
}


def register(dialect: Dialect) -> None:
    """Add a dialect; it is tried before the native one, which is the fallback."""
    DIALECTS.insert(len(DIALECTS) - 1, dialect)


def by_name(name: str) -> Dialect:
    """The dialect called ``name``; KeyError lists the known names."""
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise KeyError(f"unknown dialect {name!r}; known: {', '.join(d.name for d in DIALECTS)}")


def detect(doc: dict, forced: str | None = None) -> Dialect:
    """The dialect a document is written in (``forced`` overrides detection).

    A document the daemon has handled records its dialect in ``handoffd.dialect``. A document that
    matches no dialect raises InvalidDocument(code="UNKNOWN_FORMAT") naming the formats tried.
    """
    if forced:
        return by_name(forced)
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("dialect"), str):
        try:
            return by_name(block["dialect"])
        except KeyError:
            pass
    for dialect in DIALECTS:
        # (a dialect's ``match_keys``, when it says them: none in the document, no match; a
        # document is detected at its peek and at its claim, and four of the five formats
        # are passed over for the usual one). Only the class's own: a plugin's subclass of a
        # built-in that matches otherwise would inherit keys that are not its own (RD)
        keys = type(dialect).__dict__.get("match_keys")
        if isinstance(keys, frozenset) and keys.isdisjoint(doc):
            continue
        if dialect.matches(doc):
            return dialect
    tried = "; ".join(f"{d.name} ({SHAPES[d.name]})" if d.name in SHAPES else d.name
                      for d in DIALECTS)
    keys = ", ".join(sorted(str(k) for k in doc if k != "handoffd")[:12]) or "none"
    handoff_id = doc.get("handoff_id") if isinstance(doc.get("handoff_id"), str) else None
    raise InvalidDocument(
        f"unrecognised handoff format (top-level keys: {keys}): the document matches none of the "
        f"formats tried: {tried}; use --dialect NAME to validate it as one of them",
        handoff_id=handoff_id, code=ErrorCode.UNKNOWN_FORMAT)


def describe(doc: dict[str, Any]) -> Meta:
    """Routing facts of a document in any format, for a backend's scheduling columns: target and
    priority from its envelope; conversation and parent as the native reader finds them. A
    document no dialect can route gets no target (it is never handed out by claim-next)."""
    try:
        env = detect(doc).envelope(doc)
    except Exception:  # an answer, or a document a reader chokes on: not routable
        native = describe_native(doc)
        return Meta(None, native.priority, native.conversation, native.parent)
    # (the envelope gave target and priority: the native reader's links alone are read)
    conversation, parent = native_links(doc)
    return Meta(env.target, env.priority, env.conversation_id or conversation, parent)


def review_outcome(job: Any, outcome: "Outcome") -> "Outcome":
    """Engine ``after_run`` hook: let the job's dialect check a result before it may complete
    (seed 002 verifies that reported artifacts exist). ``job`` is a ``lifecycle.Job``, not
    imported: dialects sit below the engine."""
    review: Any = getattr(job.dialect, "review", None)
    if review is None:
        return outcome
    return review(job.claim.doc, outcome, job.context.root)


__all__ = ["DIALECTS", "Dialect", "FiledState", "by_name", "describe", "detect", "register", "review_outcome"]
