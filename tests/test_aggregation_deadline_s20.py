"""A child filed just as its parent's deadline stops the open ones counts as what it was filed
(session 20, review R22 #2).

At a parked parent's aggregation deadline, the children still open when they were read are
cancelled. One filed between that read and its cancel ("finished": nothing to cancel) was
still listed as "timeout": a family whose children all succeeded was filed `partial`. Now it is
read again and counts as it was filed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine

from handoffd import State
from handoffd.features import cancel_family


def parked_family(tmp_path: Path, clock: Clock, children: int = 3) -> tuple[Any, Any]:
    """A parent "pk" that ran once and delegated ``children`` children that succeed when run,
    parked all_success (test_claim_events_s20 uses it too)."""
    def dispatch(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return {"status": "delegated", "delegate": [{"to": "@worker", "data": {}}] * children}
    engine, backend = memory_engine(tmp_path, clock, {
        "@dispatcher": dispatch, "@worker": lambda doc, ctx: {"status": "completed"}})
    engine.submit({"handoff_id": "pk", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@dispatcher"}, "input": {"data": {}}})
    job = engine.take("pk")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    return engine, backend


def test_a_child_filed_as_the_deadline_cancels_it_counts_as_filed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    engine, backend = parked_family(tmp_path, clock)
    for child in ("pk.c1", "pk.c2"):
        job = engine.take(child)
        assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) \
            is State.COMPLETED
    clock.advance(10 * 86400)  # far past the parent's deadline: pk.c3 is still pending
    real_cancel = cancel_family.cancel
    cancelled: list[str] = []

    def cancel(engine_: Any, handoff_id: str, **kwargs: Any) -> Any:
        if handoff_id == "pk.c3":  # its worker files it as the aggregation comes to cancel it
            job = engine.take(handoff_id)
            assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) \
                is State.COMPLETED
        cancelled.append(handoff_id)
        return real_cancel(engine_, handoff_id, **kwargs)

    monkeypatch.setattr(cancel_family, "cancel", cancel)
    job = engine.take("pk")
    assert job is not None
    outcome = engine.run(job)
    assert cancelled == ["pk.c3"]
    aggregated = job.claim.doc["handoffd"]["aggregated_outcome"]
    assert [c["status"] for c in aggregated["child_outcomes"]] == ["success"] * 3, aggregated
    assert aggregated["aggregated_status"] == "success"
    assert engine.file(job.claim, job.dialect, job.specialist, outcome) is State.COMPLETED
    assert backend.get("pk")[1].get("status") != "partial"


def test_a_child_still_open_at_the_deadline_counts_as_timeout(tmp_path: Path) -> None:
    """What the fix keeps: a child the deadline cancels from pending is a timeout."""
    clock = Clock()
    engine, backend = parked_family(tmp_path, clock)
    for child in ("pk.c1", "pk.c2"):
        job = engine.take(child)
        engine.file(job.claim, job.dialect, job.specialist, engine.run(job))
    clock.advance(10 * 86400)
    job = engine.take("pk")
    outcome = engine.run(job)
    aggregated = job.claim.doc["handoffd"]["aggregated_outcome"]
    assert [c["status"] for c in aggregated["child_outcomes"]] == ["success", "success",
                                                                 "timeout"], aggregated
    assert engine.file(job.claim, job.dialect, job.specialist, outcome) is State.COMPLETED
    assert backend.get("pk.c3")[0] is State.FAILED
