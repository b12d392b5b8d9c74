"""Tracing a chain (seed 002's conversation_id / chain_position; seed 000's correlation ids).

``handoff trace ID`` shows the whole chain a handoff belongs to: it walks up ``parent_id`` to the
top, then down through every child, and adds, for each handoff, the handoffs its answer triggered
(those that ``depends_on`` it or carry it as ``correlation_id``, such as a cancellation message or
a follow-up request) and the other members of its conversation. Every node has its state, status,
specialist, timings and note.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..core.errors import NotFound
from ..core.storage import FOREIGN_FILING, foreign_filing
from ..core.timeutil import parse_iso
from .lineage import (
    Entry,
    conversation_of,
    correlation_of,
    depends_of,
    documents,
    parent_of,
)

if TYPE_CHECKING:
    from ..core.engine import Engine

MAX_NODES = 2000
MAX_TREE_DEPTH = 100  # levels shown (a 600-long depends_on chain exhausted the recursion limit)


@dataclass
class Node:
    """One handoff in a trace."""

    handoff_id: str
    state: str
    status: str | None
    target: str | None
    source: str | None
    parent: str | None
    conversation: str | None
    correlation: str | None
    depends_on: list[str]
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    seconds: float | None
    note: str
    relation: str = "root"
    children: list["Node"] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.handoff_id, "relation": self.relation, "state": self.state,
                "status": self.status, "to": self.target, "from": self.source,
                "parent_id": self.parent, "conversation_id": self.conversation,
                "correlation_id": self.correlation, "depends_on": self.depends_on,
                "created_at": self.created_at, "started_at": self.started_at,
                "finished_at": self.finished_at, "seconds": self.seconds, "note": self.note,
                "children": [c.as_dict() for c in self.children]}


def _event_time(history: list[Any], *names: str, last: bool = False) -> str | None:
    items = [h for h in history if isinstance(h, dict) and h.get("event") in names]
    if not items:
        return None
    return str((items[-1] if last else items[0]).get("at"))


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        a: datetime = parse_iso(start)
        b: datetime = parse_iso(end)
    except ValueError:
        return None
    return round((b - a).total_seconds(), 3)


def describe(entry: Entry) -> Node:
    """A Node for one document (a trusted view: see :func:`handoffd.features.lineage.documents`;
    no relations resolved yet). A finished document another consumer filed has no times of ours
    and says so in its note."""
    from .. import dialects

    doc = entry.doc
    block = given if isinstance(given := doc.get("handoffd"), dict) else {}
    history = given if isinstance(given := block.get("history"), list) else []
    target = source = None
    try:
        env = dialects.detect(doc).envelope(doc)
        target, source = env.target, env.source
    except Exception:  # answers of some dialects are not routable: read the raw fields
        tgt = doc.get("target")
        target = tgt.get("agent_id") if isinstance(tgt, dict) else doc.get("to_agent")
    status = doc.get("status") if isinstance(doc.get("status"), str) else None
    if status is None and isinstance(doc.get("payload"), dict):
        status = doc["payload"].get("status") if isinstance(doc["payload"].get("status"), str) else None
    created = _event_time(history, "created", "claimed")
    started = _event_time(history, "claimed")
    finished = (_event_time(history, "completed", "failed", "cancelled", "rejected", last=True)
                if entry.state.terminal else None)
    note = ""
    pending = entry.state.value == "pending"
    if pending and isinstance(block.get("awaiting"), dict):
        note = f"waiting on the requester ({block['awaiting'].get('kind')})"
    elif pending and isinstance(block.get("waiting_children"), dict):
        wait = block["waiting_children"]
        note = f"waiting for {len(wait.get('children', []))} children ({wait.get('aggregation')})"
    elif isinstance(block.get("aggregated_outcome"), dict):
        agg = block["aggregated_outcome"]
        note = (f"{agg.get('strategy_used')}: {agg.get('aggregated_status')}, confidence "
                f"{agg.get('aggregated_confidence')}")
    elif entry.state.value == "failed":
        error = given if isinstance(given := doc.get("error"), dict) else {}
        if error:
            note = f"{error.get('code')}: {str(error.get('message', ''))[:80]}"
    if foreign_filing(entry.state, doc):
        note = f"{note}; {FOREIGN_FILING}" if note else FOREIGN_FILING
    return Node(entry.handoff_id, entry.state.value, status, target, source, parent_of(doc),
                conversation_of(doc), correlation_of(doc), depends_of(doc), created, started,
                finished, _seconds(started or created, finished), note)


def build(engine: "Engine", handoff_id: str) -> dict[str, Any]:
    """The trace of ``handoff_id``: ``{"focus", "root", "conversation", "tree", "others"}``."""
    nodes = {e.handoff_id: describe(e) for e in documents(engine.backend)}
    if handoff_id not in nodes:
        engine.get(handoff_id)  # raises NotFound with the usual message
        raise NotFound(f"handoff {handoff_id} cannot be read", handoff_id=handoff_id)
    kids: dict[str, list[str]] = {}
    triggered: dict[str, list[str]] = {}
    for node in nodes.values():
        if node.parent and node.parent in nodes:
            kids.setdefault(node.parent, []).append(node.handoff_id)
        for dep in node.depends_on:
            if dep in nodes:
                triggered.setdefault(dep, []).append(node.handoff_id)
        if node.correlation and node.correlation in nodes and node.correlation != node.parent:
            triggered.setdefault(node.correlation, []).append(node.handoff_id)
    # walk up to the top of the delegation chain
    top = handoff_id
    seen = {top}
    while nodes[top].parent in nodes and nodes[top].parent not in seen:
        top = nodes[top].parent  # type: ignore[assignment]
        seen.add(top)
    placed: set[str] = set()

    def grow(node_id: str, relation: str, depth: int = 0) -> Node:
        node = nodes[node_id]
        node.relation = relation
        placed.add(node_id)
        if depth >= MAX_TREE_DEPTH:  # a long depends_on chain: the rest from its last node
            if kids.get(node_id) or triggered.get(node_id):
                node.note = (f"{node.note}; " if node.note else "") + \
                    f"deeper than {MAX_TREE_DEPTH} levels: `handoff trace {node_id}` goes on"
            return node
        for kid in sorted(kids.get(node_id, []), key=lambda k: (nodes[k].created_at or "", k)):
            if kid not in placed and len(placed) < MAX_NODES:
                node.children.append(grow(kid, "child", depth + 1))
        for later in sorted(triggered.get(node_id, []), key=lambda k: (nodes[k].created_at or "", k)):
            if later not in placed and len(placed) < MAX_NODES:
                node.children.append(grow(later, "triggered", depth + 1))
        return node

    # what the focus depends on comes first, as its own upstream roots
    upstream = []
    for dep in nodes[handoff_id].depends_on:
        root, walked = dep, {handoff_id}
        while root in nodes and root not in walked:
            walked.add(root)
            first = next((d for d in nodes[root].depends_on if d in nodes), None)
            if first is None or first in walked:
                break
            root = first
        if root in nodes and root not in upstream:
            upstream.append(root)
    trees = [grow(root, "upstream") for root in upstream if root not in placed]
    if top not in placed:
        trees.append(grow(top, "root"))
    conversation = nodes[handoff_id].conversation or nodes[top].conversation
    others = []
    if conversation:
        for node in sorted(nodes.values(), key=lambda n: (n.created_at or "", n.handoff_id)):
            if node.conversation == conversation and node.handoff_id not in placed:
                if node.parent not in nodes or node.parent is None:
                    others.append(grow(node.handoff_id, "conversation"))
    return {"focus": handoff_id, "root": top, "conversation": conversation,
            "trees": [t.as_dict() for t in trees + others]}


def conversation_members(engine: "Engine", conversation: str) -> set[str]:
    """Ids of every handoff in ``conversation``."""
    return {e.handoff_id for e in documents(engine.backend) if e.conversation == conversation}
