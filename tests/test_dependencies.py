"""The dependencies feature at scale and against foreign cycles (in memory, time moved by hand).

A 1,100-long ``depends_on`` chain used to stall ``handoffd serve`` for a minute: every filing
re-checked every waiter, and every check walked the whole chain again. These tests count the
documents read and the gate checks made, so that quadratic work shows up as a number."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from handoffd import (
    Daemon,
    Engine,
    Registry,
    State,
    Workspace,
    build_engine,
    new_native_request,
)
from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.errors import InvalidDocument
from handoffd.core.storage import Doc
from handoffd.features.dependencies import ACYCLIC_SECONDS, Graph


class Clock:
    """A wall clock moved by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


class CountingBackend(MemoryBackend):
    """A memory backend that counts the documents read by id."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        self.reads += 1
        return super().get(handoff_id)


def done(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"id": ctx.handoff_id}}


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    ws = Workspace(tmp_path)
    ws.ensure()
    config = Config(daemon=DaemonSettings(expectations="advisory"))
    registry = Registry()
    registry.add_function("@x", done, config=config, concurrency=2)
    return build_engine(ws, config, registry, clock=Clock(), backend=CountingBackend())


def request(engine: Engine, handoff_id: str, depends_on: list[str] | None = None) -> Doc:
    return new_native_request(source="@test", target="@x", data={}, now=engine.clock(),
                              handoff_id=handoff_id, depends_on=depends_on)


def drop(engine: Engine, handoff_id: str, depends_on: list[str] | None = None) -> None:
    """Store a request as a foreign producer would: no creation check."""
    engine.backend.create(request(engine, handoff_id, depends_on), handoff_id, engine.clock())


def graph_of(engine: Engine) -> Graph:
    return next(g.__self__ for g in engine.gates  # type: ignore[attr-defined]
                if isinstance(getattr(g, "__self__", None), Graph))


def reads(engine: Engine) -> int:
    return engine.backend.reads  # type: ignore[attr-defined,no-any-return]


def run(engine: Engine) -> Daemon:
    daemon = Daemon(engine, workers=2, watch=False)
    assert daemon.run_batch().error is None
    return daemon


def test_creating_a_long_chain_reads_a_few_documents_per_handoff(engine: Engine) -> None:
    n = 400
    for i in range(n):
        engine.submit(request(engine, f"c{i}", [f"c{i - 1}"] if i else None))
    # each creation checks its dependency exists and walks to the first handoff already known
    # to lead to no cycle: a handful of reads, not the whole chain (80,000 before)
    assert reads(engine) < 5 * n


def test_a_long_chain_drains_with_linear_work(engine: Engine) -> None:
    n = 400
    for i in range(n):
        drop(engine, f"c{i}", [f"c{i - 1}"] if i else None)
    checks = 0
    gate = engine.gates[-1]

    def counted(engine: Engine, env: Any, doc: Any) -> Any:
        nonlocal checks
        checks += 1
        return gate(engine, env, doc)

    engine.gates[-1] = counted
    before = reads(engine)
    for _ in range(3):  # a batch runs what is due; the rest of the chain waits for the next
        run(engine)
        if not engine.backend.ids(State.PENDING):
            break
    assert engine.backend.ids(State.COMPLETED) and not engine.backend.ids(State.PENDING)
    assert len(engine.backend.ids(State.COMPLETED)) == n
    # each filing re-checks only the handoff waiting for it (not all waiters: n*n/2 = 80,000)
    assert checks < 4 * n, checks
    assert reads(engine) - before < 20 * n, reads(engine) - before


def test_a_foreign_cycle_fails_every_member_and_what_waits_on_it(engine: Engine) -> None:
    drop(engine, "a", ["b"])
    drop(engine, "b", ["c"])
    drop(engine, "c", ["a"])
    drop(engine, "x", ["a"])  # waits on the cycle without being in it
    for _ in range(3):
        run(engine)
    messages = []
    for member in "abc":
        state, doc = engine.get(member)
        assert state is State.FAILED and doc["error"]["code"] == "DEPENDENCY_MISSING"
        messages.append(doc["error"]["message"])
    # the first member looked at names the cycle; the others then depend on a failed handoff
    assert any("depends on itself through" in m for m in messages), messages
    state, doc = engine.get("x")
    assert state is State.FAILED and doc["error"]["code"] == "DEPENDENCY_MISSING"


def test_a_walk_through_a_missing_handoff_is_not_remembered_as_cycle_free(engine: Engine) -> None:
    graph = graph_of(engine)
    drop(engine, "a", ["m"])  # m does not exist yet
    assert graph.find_cycle("x", ["a"], stored=False) is None
    assert "a" not in graph.acyclic  # m may still be created, leading back
    drop(engine, "x", ["a"])
    drop(engine, "m", ["x"])
    assert graph.find_cycle("x", ["a"]) == ["x", "a", "m", "x"]


def test_creation_refuses_a_cycle_a_foreign_producer_prepared(engine: Engine) -> None:
    drop(engine, "b", ["a"])  # waits for an "a" that does not exist yet
    engine.submit(request(engine, "c", ["b"]))
    with pytest.raises(InvalidDocument, match="dependency cycle: a -> b -> a"):
        engine.submit(request(engine, "a", ["b"]))


def test_what_is_known_cycle_free_is_forgotten_after_a_while(engine: Engine) -> None:
    graph = graph_of(engine)
    drop(engine, "a")
    drop(engine, "b", ["a"])
    assert graph.find_cycle("c", ["b"], stored=False) is None
    assert {"a", "b"} <= graph.acyclic and "c" not in graph.acyclic
    clock = engine.clock
    clock.now += timedelta(seconds=ACYCLIC_SECONDS + 1)  # type: ignore[attr-defined]
    graph.find_cycle("d", [], stored=False)
    assert graph.acyclic == set()


def test_a_wait_names_a_few_dependencies_and_counts_the_rest(engine: Engine) -> None:
    for i in range(10):
        drop(engine, f"m{i}")
    drop(engine, "r", [f"m{i}" for i in range(10)])
    peek = engine.peek("r")
    assert peek is not None
    verdict = engine.gate(peek)
    assert verdict is not None and verdict.action == "wait"
    # one dependency named, the rest counted; the wait names one handoff (the last listed, as
    # the first is unfinished too), so a waiter is not woken by every filing of the others
    assert verdict.reason == "waiting for dependency m0 (pending), then 9 more", verdict.reason
    assert verdict.on == frozenset({"m9"}), verdict.on


def test_looking_at_a_long_chain_newest_first_walks_it_once(engine: Engine) -> None:
    """`handoff ls` asks the gates of the newest rows first. With a walk bounded at 1,000
    documents and nothing remembered from a walk cut short, each row of a 1,100-long chain read
    1,000 documents (8 s for 50 rows); one walk now reaches the chain's end and marks it."""
    n = 1200
    for i in range(n):
        drop(engine, f"c{i}", [f"c{i - 1}"] if i else None)
    before = reads(engine)
    for i in range(n - 1, n - 41, -1):
        peek = engine.peek(f"c{i}")
        assert peek is not None
        verdict = engine.gate(peek)
        assert verdict is not None and verdict.action == "wait"
    assert reads(engine) - before < 3 * n, reads(engine) - before
