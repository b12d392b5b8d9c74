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
from ..core.states import State
from ..core.storage import FOREIGN_FILING, foreign_filing
from ..core.timeutil import parse_iso
from .lineage import (
    Entry,
    Link,
    conversation_of,
    correlation_of,
    depends_of,
    each_link,
    parent_of,
)

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.storage import Backend

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


class Graph:
    """The relations of every handoff, from one pass over the documents that holds none of
    them: a handoff that names no other and no conversation (most finished ones) is kept as
    its state alone. Only the handoffs a trace places are read again, to be described."""

    def __init__(self, backend: "Backend") -> None:
        self.related: dict[str, Link] = {}
        self.bare: dict[str, State] = {}
        each_link(backend, self._add)

    def _add(self, link: Link) -> None:
        # a copy found in a later state wins (as when every document was held, by id)
        self.related.pop(link.handoff_id, None)
        self.bare.pop(link.handoff_id, None)
        if link.related:
            self.related[link.handoff_id] = link
        else:
            self.bare[link.handoff_id] = link.state

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self.related or handoff_id in self.bare

    def __getitem__(self, handoff_id: str) -> Link:
        link = self.related.get(handoff_id)
        return link if link is not None else Link(handoff_id, self.bare[handoff_id])


@dataclass
class Place:
    """Where a trace puts one handoff (described once every place is known)."""

    handoff_id: str
    relation: str
    children: list["Place"] = field(default_factory=list)
    deeper: bool = False  # cut at MAX_TREE_DEPTH with more below


def _edges(graph: Graph) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(children by parent, what each handoff triggered: depends on it or correlates to it)."""
    kids: dict[str, list[str]] = {}
    triggered: dict[str, list[str]] = {}
    for link in graph.related.values():  # (a bare handoff names nobody)
        if link.parent and link.parent in graph:
            kids.setdefault(link.parent, []).append(link.handoff_id)
        for dep in link.depends_on:
            if dep in graph:
                triggered.setdefault(dep, []).append(link.handoff_id)
        if link.correlation and link.correlation in graph and link.correlation != link.parent:
            triggered.setdefault(link.correlation, []).append(link.handoff_id)
    return kids, triggered


def _upstream(graph: Graph, handoff_id: str) -> list[str]:
    """The roots of what ``handoff_id`` depends on: each dependency followed up its first
    dependency, as far as it goes."""
    upstream: list[str] = []
    for dep in graph[handoff_id].depends_on:
        root, walked = dep, {handoff_id}
        while root in graph and root not in walked:
            walked.add(root)
            first = next((d for d in graph[root].depends_on if d in graph), None)
            if first is None or first in walked:
                break
            root = first
        if root in graph and root not in upstream:
            upstream.append(root)
    return upstream


def _top(graph: Graph, handoff_id: str) -> str:
    """The top of ``handoff_id``'s delegation chain (up ``parent_id``)."""
    top = handoff_id
    seen = {top}
    while (parent := graph[top].parent) in graph and parent not in seen:
        top = parent  # type: ignore[assignment]
        seen.add(top)
    return top


def _place(graph: Graph, handoff_id: str, top: str) -> tuple[list[Place], str | None]:
    """The trees of the trace (upstream roots, the chain from ``top``, the conversation's other
    roots) and the conversation: ids and relations only, at most about MAX_NODES of them."""
    kids, triggered = _edges(graph)
    placed: set[str] = set()

    def by_creation(ids: list[str]) -> list[str]:
        return sorted(ids, key=lambda k: (graph[k].created_at or "", k))

    def grow(node_id: str, relation: str, depth: int = 0) -> Place:
        place = Place(node_id, relation)
        placed.add(node_id)
        if depth >= MAX_TREE_DEPTH:  # a long depends_on chain: the rest from its last node
            place.deeper = bool(kids.get(node_id) or triggered.get(node_id))
            return place
        for kid in by_creation(kids.get(node_id, [])):
            if kid not in placed and len(placed) < MAX_NODES:
                place.children.append(grow(kid, "child", depth + 1))
        for later in by_creation(triggered.get(node_id, [])):
            if later not in placed and len(placed) < MAX_NODES:
                place.children.append(grow(later, "triggered", depth + 1))
        return place

    # what the focus depends on comes first, as its own upstream roots
    trees = [grow(root, "upstream") for root in _upstream(graph, handoff_id) if root not in placed]
    if top not in placed:
        trees.append(grow(top, "root"))
    conversation = graph[handoff_id].conversation or graph[top].conversation
    if conversation:
        for link in sorted(graph.related.values(), key=lambda n: (n.created_at or "", n.handoff_id)):
            if link.conversation == conversation and link.handoff_id not in placed \
                    and link.parent not in graph:
                trees.append(grow(link.handoff_id, "conversation"))
    return trees, conversation


def _read_node(engine: "Engine", link: Link) -> Node:
    """The Node of a placed handoff, from its document read again. One gone or unreadable
    since the pass (purged, or rewritten meanwhile) is shown with what the pass found."""
    try:
        found = engine.backend.get(link.handoff_id)
        why = "gone since it was listed"
    except Exception:  # (a trace shows what it can: one bad read must not end it)
        found, why = None, "unreadable since it was listed"
    if found is not None:
        return describe(Entry(link.handoff_id, found[0], found[1]))
    return Node(link.handoff_id, link.state.value, None, None, None, link.parent,
                link.conversation, link.correlation, list(link.depends_on), link.created_at,
                None, None, None, why)


def _node(engine: "Engine", graph: Graph, place: Place) -> Node:
    node = _read_node(engine, graph[place.handoff_id])
    node.relation = place.relation
    if place.deeper:
        node.note = (f"{node.note}; " if node.note else "") + \
            f"deeper than {MAX_TREE_DEPTH} levels: `handoff trace {place.handoff_id}` goes on"
    node.children = [_node(engine, graph, child) for child in place.children]
    return node


def build(engine: "Engine", handoff_id: str) -> dict[str, Any]:
    """The trace of ``handoff_id``: ``{"focus", "root", "conversation", "trees"}``.

    One pass over every document keeps only their relations (:class:`Graph`); the handoffs
    placed in the trace (at most about MAX_NODES, plus its conversation's other roots) are then
    read again and described: memory follows the trace, not the workspace."""
    graph = Graph(engine.backend)
    if handoff_id not in graph:
        engine.get(handoff_id)  # raises NotFound with the usual message
        raise NotFound(f"handoff {handoff_id} cannot be read", handoff_id=handoff_id)
    top = _top(graph, handoff_id)
    trees, conversation = _place(graph, handoff_id, top)
    return {"focus": handoff_id, "root": top, "conversation": conversation,
            "trees": [_node(engine, graph, tree).as_dict() for tree in trees]}


def conversation_members(engine: "Engine", conversation: str) -> set[str]:
    """Ids of every handoff in ``conversation``."""
    members: set[str] = set()
    each_link(engine.backend, lambda link: members.add(link.handoff_id)
              if link.conversation == conversation else None)
    return members
