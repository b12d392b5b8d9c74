"""An attempt's job, handler context and document are freed as the attempt ends (reference
counting), not left in reference cycles for the garbage collector: the watchdog's watch and the
context referred to each other, and the job to itself through its takeover closure. Every
handoff a daemon ran stayed in memory until a pass of the collector, which had to come three
times as often (a 2,000-handoff drain: 194 young passes against 61; helper A, session 30; the
cycles are broken by ``Job.let_go``, see also tests/test_flat_memory_s30.py)."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoffd import Daemon, Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.engine import Engine

CONTEXTS: list[weakref.ref[Any]] = []


def remembered(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Completes, keeping only a weak reference to its context."""
    CONTEXTS.append(weakref.ref(ctx))
    return {"status": "completed", "output": {"seen": doc["handoff_id"]}}


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic collector off: what is freed is freed by reference counting alone."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(durability="fast"))
    registry = Registry()
    registry.add_function("@keeper", remembered, config=config, isolate="never")
    return build_engine(ws, config, registry)


def test_a_daemons_attempts_are_freed_as_they_end(engine: Engine, no_collector: None) -> None:
    """A daemon's worker runs the handler on its own thread, watched by the watchdog, with a
    takeover for an overrun: none of it keeps the attempt alive once it is filed."""
    CONTEXTS.clear()
    for n in range(3):
        doc = new_native_request(source="@test", target="@keeper", data={"n": n},
                                 now=engine.clock(), handoff_id=f"keep-{n}")
        engine.submit(doc)
    assert Daemon(engine, workers=1, watch=False).run_batch().error is None
    assert [engine.get(f"keep-{n}")[0] for n in range(3)] == [State.COMPLETED] * 3
    assert len(CONTEXTS) == 3
    assert [ref() is None for ref in CONTEXTS] == [True] * 3, \
        "an attempt's context outlived it: held in a reference cycle"

