"""``handoff trace`` at scale (F5, session 19).

``handoff trace ID`` read every document of the workspace and described each one before it
looked at any relation: a handoff with no relations among 100,000 completed ones took 33 s and
688 MB, the output being one line. It now reads every document once keeping only relations
(:class:`handoffd.features.trace.Graph`), and reads again and describes only what it places.
The output is the same: the trace before the change is kept here as the reference. (`handoff ls
--to X` still reads every document the listing passes: docs/commands.md says so.)
"""
from __future__ import annotations

import json
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoffd import Workspace, build_engine
from handoffd.backends.files.seals import seal_for
from handoffd.core.engine import Engine
from handoffd.core.errors import NotFound
from handoffd.core.states import State
from handoffd.features import trace
from handoffd.features.lineage import documents

STATES = [State.PENDING, State.IN_PROGRESS, State.COMPLETED, State.FAILED]


# ---------------------------------------------------------------- workspaces
def _engine(root: Path) -> Engine:
    root.mkdir(parents=True, exist_ok=True)
    (root / "handoffd.toml").write_text('[daemon]\ndurability = "fast"\n')
    Workspace(root).ensure()
    return build_engine(Workspace(root), features=())


def _drop(engine: Engine, state: State, handoff_id: str, *, created: str | None = None,
          book: dict[str, Any] | None = None, pad: int = 0, **fields: Any) -> None:
    """A native document in ``state``, its block sealed there (so trusted) when it has one."""
    doc: dict[str, Any] = {"handoff_id": handoff_id, "timestamp": "2026-01-01T00:00:00Z",
                           "status": state.status, "source": {"agent_id": "@p"},
                           "target": {"agent_id": "@w"}, "input": {"data": {"pad": "x" * pad}},
                           **fields}
    if created is not None or book:
        key = engine.backend.store.key  # type: ignore[attr-defined]
        history = [{"at": created, "event": "created"}] if created else []
        doc["handoffd"] = {"revision": 2, "history": history, **(book or {}),
                           "seal": seal_for(key, handoff_id, 2, state.value)}
    path = engine.ws.doc_path(state, handoff_id)
    path.write_text(json.dumps(doc))


def _reference(engine: Engine, handoff_id: str) -> dict[str, Any]:
    """``trace.build`` as it was before session 19 (every document held and described)."""
    nodes = {e.handoff_id: trace.describe(e) for e in documents(engine.backend)}
    if handoff_id not in nodes:
        engine.get(handoff_id)
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
    top = handoff_id
    seen = {top}
    while nodes[top].parent in nodes and nodes[top].parent not in seen:
        top = nodes[top].parent  # type: ignore[assignment]
        seen.add(top)
    placed: set[str] = set()

    def grow(node_id: str, relation: str, depth: int = 0) -> trace.Node:
        node = nodes[node_id]
        node.relation = relation
        placed.add(node_id)
        if depth >= trace.MAX_TREE_DEPTH:
            if kids.get(node_id) or triggered.get(node_id):
                node.note = (f"{node.note}; " if node.note else "") + \
                    f"deeper than {trace.MAX_TREE_DEPTH} levels: `handoff trace {node_id}` goes on"
            return node
        for kid in sorted(kids.get(node_id, []), key=lambda k: (nodes[k].created_at or "", k)):
            if kid not in placed and len(placed) < trace.MAX_NODES:
                node.children.append(grow(kid, "child", depth + 1))
        for later in sorted(triggered.get(node_id, []), key=lambda k: (nodes[k].created_at or "", k)):
            if later not in placed and len(placed) < trace.MAX_NODES:
                node.children.append(grow(later, "triggered", depth + 1))
        return node

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


def _outcome(build: Callable[[Engine, str], dict[str, Any]], engine: Engine,
             handoff_id: str) -> Any:
    try:
        return build(engine, handoff_id)
    except NotFound as exc:
        return ("NotFound", str(exc))


# ---------------------------------------------------------------- the same trace as before
IDS = [f"h{i}" for i in range(9)]
REFS = IDS + ["gone"]  # (a relation may name a handoff that is not there)

handoff_spec = st.fixed_dictionaries({
    "state": st.sampled_from(STATES),
    "created": st.none() | st.sampled_from(["2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"]),
    "parent": st.none() | st.sampled_from(REFS),
    "parent_in_book": st.booleans(),
    "depends_on": st.lists(st.sampled_from(REFS), max_size=3),
    "correlation": st.none() | st.sampled_from(REFS),
    "conversation": st.none() | st.sampled_from(["c1", "c2"]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(handoff_spec, min_size=1, max_size=len(IDS)),
       small=st.booleans())
def test_the_trace_is_the_one_every_document_held_gave(specs: list[dict[str, Any]],
                                                      small: bool) -> None:
    """Random relation graphs (parents in the document or its sealed block, dependencies,
    correlations, conversations, missing ids, cycles), with the node and depth limits small
    or not: every handoff's trace (and a missing one's error) is what it was."""
    limits = (trace.MAX_NODES, trace.MAX_TREE_DEPTH)
    with tempfile.TemporaryDirectory() as tmp:
        engine = _engine(Path(tmp) / "ws")
        try:
            for handoff_id, spec in zip(IDS, specs):
                fields: dict[str, Any] = {"depends_on": spec["depends_on"]}
                book: dict[str, Any] = {}
                if spec["parent"] is not None:
                    (book if spec["parent_in_book"] else fields)["parent_id"] = spec["parent"]
                if spec["correlation"] is not None:
                    fields["correlation_id"] = spec["correlation"]
                if spec["conversation"] is not None:
                    fields["conversation_id"] = spec["conversation"]
                _drop(engine, spec["state"], handoff_id, created=spec["created"], book=book,
                      **fields)
            if small:
                trace.MAX_NODES, trace.MAX_TREE_DEPTH = 4, 2
            for focus in [*IDS[:len(specs)], "gone"]:
                assert _outcome(trace.build, engine, focus) == \
                    _outcome(_reference, engine, focus), focus
        finally:
            trace.MAX_NODES, trace.MAX_TREE_DEPTH = limits
            engine.backend.close()


# ---------------------------------------------------------------- memory follows the trace
def _unrelated(engine: Engine, count: int, pad: int = 0) -> None:
    for i in range(count):
        _drop(engine, State.COMPLETED, f"u{i:05d}", created="2026-01-01T00:00:00Z", pad=pad)


def test_only_the_handoffs_a_trace_shows_are_described(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """300 unrelated finished handoffs: a trace of a parent and its child describes two
    documents (it described 302), and reads again only those two."""
    engine = _engine(tmp_path / "ws")
    _unrelated(engine, 300)
    _drop(engine, State.PENDING, "top", created="2026-01-01T00:00:00Z")
    _drop(engine, State.COMPLETED, "kid", created="2026-01-01T00:00:01Z", parent_id="top")
    described: list[str] = []
    real = trace.describe
    monkeypatch.setattr(trace, "describe", lambda e: described.append(e.handoff_id) or real(e))
    data = trace.build(engine, "kid")
    assert data["root"] == "top" and data["trees"][0]["children"][0]["id"] == "kid"
    assert sorted(described) == ["kid", "top"]
    engine.backend.close()


def _peak(root: Path, count: int) -> int:
    engine = _engine(root)
    _unrelated(engine, count, pad=4000)
    _drop(engine, State.PENDING, "focus")
    tracemalloc.start()
    try:
        trace.build(engine, "focus")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        engine.backend.close()


def test_a_trace_holds_no_document_it_does_not_show(tmp_path: Path) -> None:
    """The peak of a trace of one handoff grows by the listing's own bookkeeping per document
    (its name, its time: well under 2 KB), not by each document (4 KB of data each: with every
    one held, over 8 KB more per document)."""
    small, large = 100, 500
    per_doc = (_peak(tmp_path / "large", large) - _peak(tmp_path / "small", small)) / (large - small)
    assert per_doc < 2000, f"{per_doc:.0f} bytes more per document"
