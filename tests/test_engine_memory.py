"""The engine and its features on the in-memory backend: no file in handoffs/, time moved by hand.

The same lifecycle the file store runs (retries with backoff, permanent failures and `handoff
retry`, dependencies, delegation with aggregation, cancellation, recovery of an expired lease),
proving that the engine, the features and the daemon reach storage only through the Backend
interface."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine

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
from handoffd.core.config import Config
from handoffd.core.documents import book
from handoffd.features import cancel_family
from handoffd.service.sweeper import requeue_failed, sweep

CALLS: list[tuple[str, int]] = []


def flaky(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Fails (retryably) on the first attempt when asked to, else echoes its data."""
    CALLS.append((ctx.handoff_id, ctx.attempt))
    data = ctx.data or {}
    if data.get("fail") == "always":
        return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "no",
                                              "retryable": False}}
    if data.get("fail") == "once" and ctx.attempt == 1:
        return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "flaky"}}
    return {"status": "completed", "output": {"echo": data}}


def dispatch(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Delegates to two @echo children."""
    return {"status": "delegated", "aggregation": "all_success", "summary": "fan-out",
            "delegate": [{"to": "@echo", "data": {"n": 1}}, {"to": "@echo", "data": {"n": 2}}]}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Engine, Clock, MemoryBackend]:
    CALLS.clear()
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@echo": flaky, "@boss": dispatch})
    return engine, clock, backend


def create(engine: Engine, handoff_id: str, target: str = "@echo", data: Any = None,
           depends_on: list[str] | None = None) -> None:
    doc = new_native_request(source="@test", target=target, data=data, now=engine.clock(),
                             handoff_id=handoff_id, depends_on=depends_on)
    assert engine.submit(doc) == handoff_id


def batch(engine: Engine) -> None:
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert report.error is None


def test_nothing_is_written_to_the_state_folders(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, _, _ = setup
    create(engine, "m1", data={"x": 1})
    batch(engine)
    state, doc = engine.get("m1")
    assert state is State.COMPLETED and doc["output"] == {"echo": {"x": 1}}
    assert [e["event"] for e in book(doc)["history"]] == ["created", "claimed", "completed"]
    for folder in ("pending", "in-progress", "completed", "failed"):
        assert not list((engine.ws.handoffs / folder).glob("*.json")), folder


def test_a_retry_waits_for_its_backoff_on_the_injected_clock(
        setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, clock, _ = setup
    create(engine, "m2", data={"fail": "once"})
    batch(engine)
    state, doc = engine.get("m2")
    assert state is State.PENDING and book(doc)["retries"] == 1
    assert book(doc)["next_attempt_at"] == "2026-11-24T12:00:10.000Z"
    batch(engine)  # not due yet: nothing runs
    assert CALLS == [("m2", 1)]
    clock.advance(11)
    batch(engine)
    state, doc = engine.get("m2")
    assert state is State.COMPLETED and CALLS == [("m2", 1), ("m2", 2)]


def test_a_permanent_failure_is_filed_and_can_be_retried_by_hand(
        setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, _, _ = setup
    create(engine, "m3", data={"fail": "always"})
    batch(engine)
    state, doc = engine.get("m3")
    assert state is State.FAILED and doc["error"]["code"] == "PROCESSING_ERROR"
    requeue_failed(engine, "m3", force=True)
    assert engine.get("m3")[0] is State.PENDING
    assert engine.backend.ids(State.PENDING) == ["m3"]


def test_a_dependency_holds_its_dependant_back(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, _, backend = setup
    # stored straight in the backend, as a foreign producer's file is: submit() would refuse a
    # dependency that does not exist yet
    later = new_native_request(source="@test", target="@echo", data={"n": 2}, now=engine.clock(),
                               handoff_id="later", depends_on=["first"])
    backend.create(later, "later", engine.clock())
    create(engine, "first", data={"n": 1})
    batch(engine)
    assert engine.get("first")[0] is State.COMPLETED
    assert engine.get("later")[0] is State.COMPLETED
    assert [c[0] for c in CALLS] == ["first", "later"]


def test_delegation_and_aggregation(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, _, backend = setup
    create(engine, "parent", target="@boss")
    for _ in range(3):  # park, run the children, aggregate
        batch(engine)
    state, doc = engine.get("parent")
    assert state is State.COMPLETED, doc
    children = [r.id for r in backend.list(parent="parent")]
    assert len(children) == 2
    assert all(engine.get(c)[0] is State.COMPLETED for c in children)
    events = [e["event"] for e in book(doc)["history"]]
    assert "delegated" in events and events[-1] == "completed"


def test_cancelling_a_pending_handoff(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, _, _ = setup
    create(engine, "m4")
    [result] = cancel_family.cancel(engine, "m4", reason="not needed")
    assert result.action == "cancelled"
    state, doc = engine.get("m4")
    assert state is State.FAILED and doc["error"]["code"] == "CANCELLED"
    assert CALLS == []


def test_an_expired_lease_is_recovered_and_retried(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    engine, clock, _ = setup
    engine.registry.with_overrides("@echo", isolate="never")  # its calls are counted here
    create(engine, "m5")
    job = engine.take("m5")
    assert job is not None  # claimed, and its owner "dies" here
    assert sweep(engine).recovered == []  # the lease is still live
    clock.advance(31)
    assert sweep(engine).recovered == ["m5"]
    state, doc = engine.get("m5")
    assert state is State.PENDING
    assert [e["event"] for e in book(doc)["history"]][-2:] == ["recovered", "retry_scheduled"]
    assert not engine.backend.renew(job.claim, clock(), 30)  # the old owner is fenced out
    clock.advance(11)
    batch(engine)
    assert engine.get("m5")[0] is State.COMPLETED and CALLS == [("m5", 2)]


def test_a_stalled_owners_expired_lease_marks_no_suspect_a_dead_owner_does(
        setup: tuple[Engine, Clock, MemoryBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovering a claim whose lease ran out (a stalled owner: SIGSTOP, a hung disk) is no
    crash: its specialist is not sent to run isolated for ten minutes. A dead owner's is."""
    from handoffd.core.storage import GIVEN_UP, Claim, owner_died
    from handoffd.service.sweeper import SweepReport, recover
    engine, clock, _ = setup
    marked: list[Any] = []
    monkeypatch.setattr(engine.suspects, "mark", marked.append)
    create(engine, "m6")
    job = engine.take("m6")
    assert job is not None
    clock.advance(31)
    assert sweep(engine).recovered == ["m6"] and marked == []  # (memory: a lease expiry)
    for reason, died in (("lease expired at 2026-01-01T00:00:00Z (owner h:1 stalled)", False),
                         (GIVEN_UP, False), (None, True),
                         ("owner process is gone (its claim lock is free)", True)):
        assert owner_died(reason) is died
    clock.advance(11)
    job = engine.take("m6")
    assert job is not None
    dead = Claim(job.claim.id, job.claim.doc, job.claim.token, job.claim.attempt,
                 recovered="owner process is gone (its claim lock is free)")
    recover(engine, dead, SweepReport())
    assert [spec.agent for spec in marked] == ["@echo"]


def test_submit_checks_what_handoff_create_checks(setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    from handoffd.core.errors import DuplicateHandoff, ErrorCode, InvalidDocument
    from handoffd.dialects import models

    engine, _, backend = setup
    bad = new_native_request(source="@test", target="@echo", data=None, now=engine.clock(),
                             handoff_id="s-bad")
    bad["priority"] = "urgent"
    with pytest.raises(InvalidDocument) as caught:
        engine.submit(bad)
    assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED and caught.value.errors
    with pytest.raises(InvalidDocument) as caught:  # depends on something that does not exist
        create(engine, "s-dep", depends_on=["nowhere"])
    assert caught.value.code == ErrorCode.DEPENDENCY_MISSING
    with pytest.raises(InvalidDocument) as caught:
        engine.submit(["not", "an", "object"])
    assert caught.value.code == ErrorCode.INVALID_DOCUMENT
    assert backend.ids(State.PENDING) == []  # nothing stored
    assert backend.get("s-bad") is None and backend.get("s-dep") is None
    typed = models.NativeRequest.from_dict(new_native_request(
        source="@test", target="@echo", data={"typed": True}, now=engine.clock(), handoff_id="s-1"))
    assert engine.submit(typed) == "s-1"  # a typed model goes in as its document
    with pytest.raises(DuplicateHandoff):
        create(engine, "s-1")
    create(engine, "s-2", depends_on=["s-1"])
    batch(engine)
    assert engine.get("s-2")[0] is State.COMPLETED


def test_without_the_dependencies_feature_submit_does_not_check_them(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    engine = build_engine(ws, Config(), Registry(), backend=MemoryBackend(), features=())
    doc = new_native_request(source="@test", target="@echo", data=None, now=engine.clock(),
                             handoff_id="lone", depends_on=["nowhere"])
    assert engine.submit(doc) == "lone" and engine.submit_checks == []


def test_submit_if_absent_returns_the_same_request_and_refuses_a_different_one(
        setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    """Idempotent create through the Python API, on the memory backend: a re-submission of the
    same request (a new timestamp does not make it different) gets the id back, before and after
    it ran; another request under that id is a Conflict."""
    from handoffd.core.errors import Conflict

    engine, clock, _ = setup

    def request(data: Any) -> dict[str, Any]:
        return new_native_request(source="@orch", target="@echo", data=data, now=engine.clock(),
                                  handoff_id="idem-1")

    assert engine.submit(request({"n": 1}), if_absent=True) == "idem-1"
    clock.now += timedelta(seconds=5)
    assert engine.submit(request({"n": 1}), if_absent=True) == "idem-1"
    batch(engine)
    assert engine.get("idem-1")[0] is State.COMPLETED
    assert engine.submit(request({"n": 1}), if_absent=True) == "idem-1"
    with pytest.raises(Conflict) as caught:
        engine.submit(request({"n": 2}), if_absent=True)
    assert caught.value.exit_code == 5 and "different request" in str(caught.value)


def test_settings_replaced_after_the_engine_was_built_govern_its_checks(
        setup: tuple[Engine, Clock, MemoryBackend]) -> None:
    """The checks read the engine's settings when they run, not a copy taken at construction
    (a program or test that sets engine.settings afterwards got the old behaviour)."""
    from dataclasses import replace
    engine, _, _ = setup
    engine.settings = replace(engine.settings, expectations="advisory")
    doc = new_native_request(source="@test", target="@echo", data=None, now=engine.clock(),
                             handoff_id="adv1")
    doc["input"]["schema"] = "nowhere.input.schema.json"  # a schema the workspace lacks
    assert engine.submit(doc) == "adv1"
    batch(engine)
    state, filed = engine.get("adv1")
    assert state is State.COMPLETED, filed
    assert any("nowhere" in str(w) for w in filed.get("warnings") or filed["handoffd"].get("warnings", [])), filed
