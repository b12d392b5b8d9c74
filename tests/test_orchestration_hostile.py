"""Delegations that must not go wrong: entries of the wrong type, ids that collide with a
sibling's, with a purged handoff or with a document someone dropped in advance, a child that
cannot be stored midway, and a malformed delegation told to the on_filed listeners once.

Most run a real ``handoffd run`` in a temporary workspace; the cases a subprocess cannot reach
at the right moment (a crash between creating the children and parking the parent, a store
failing midway) run the engine in-process on the memory backend with a clock moved by hand."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, handlers_workspace, memory_engine

from handoffd import Daemon, Engine, Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.documents import book
from handoffd.core.errors import DuplicateHandoff
from handoffd.features import orchestration
from handoffd.service.sweeper import sweep

HANDLERS = '''
"""Python specialists for the hostile delegation tests."""


def boss(doc, ctx):
    """Delegates what its data says (a hi_moe message carries it in task_data)."""
    data = ctx.data or {}
    data = data.get("task_data", data)
    return {"status": "delegated", "aggregation": data.get("aggregation", "all_success"),
            "delegate": data["delegate"]}


def leaf(doc, ctx):
    """Records that it ran; completes with what it was given."""
    with open(ctx.root / "artifacts" / "ran.txt", "a") as fh:
        fh.write(ctx.handoff_id + "\\n")
    data = ctx.data or {}
    return {"status": "completed", "output": data.get("forced") or {"ran": ctx.handoff_id}}
'''

CONFIG = """
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
lease_seconds = 30.0
durability = "fast"

[retry]
max_retries = 0

[specialists."@boss"]
handler = "hostile_handlers:boss"
timeout_seconds = 60

[specialists."ROUTING_DISPATCHER"]
handler = "hostile_handlers:boss"
timeout_seconds = 60

[specialists."@leaf"]
handler = "hostile_handlers:leaf"
timeout_seconds = 60

[[on_filed]]
command = ["sh", "-c", "echo $HANDOFF_ID $HANDOFF_STATE >> notified.txt"]
"""


@pytest.fixture
def hws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Workspace]:
    ws = handlers_workspace(tmp_path, monkeypatch, "hostile_handlers", HANDLERS, CONFIG)
    yield ws
    ws.cleanup()


def run(ws: Workspace) -> str:
    """One bounded batch; its stderr (which must never hold a traceback)."""
    proc = ws.handoffd("run", timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def delegate(ws: Workspace, hid: str, entries: list[dict[str, Any]]) -> None:
    ws.create("--to", "@boss", "--id", hid, "--data", json.dumps({"delegate": entries}))


def ran(ws: Workspace) -> list[str]:
    path = ws.root / "artifacts" / "ran.txt"
    return path.read_text().split() if path.exists() else []


def assert_refused(ws: Workspace, hid: str, needle: str) -> None:
    """``hid`` was filed failed at once, VALIDATION_FAILED, saying ``needle``, never retried."""
    assert ws.state_of(hid) == ["failed"], ws.state_of(hid)
    doc = ws.doc(hid)
    assert doc["error"]["code"] == "VALIDATION_FAILED", doc["error"]
    assert needle in doc["error"]["message"], doc["error"]["message"]
    assert "retry_scheduled" not in [e["event"] for e in doc["handoffd"]["history"]]


def hi_moe_message(hid: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"version": "1.0.0", "id": hid, "timestamp": now, "source_tier": "ABSTRACT_ARCHITECT",
            "target_tier": "ROUTING_DISPATCHER", "correlation_id": None,
            "payload": {"task_type": "x", "objective": "o", "constraints": [], "context_refs": [],
                        "priority": 1, "timeout_ms": 60000, "deadline_hint": None,
                        "specialist_hint": None, "task_data": {"delegate": entries}}}


# ---------------------------------------------------------------- entries of the wrong type (r1)
def test_non_list_constraints_or_context_refs_fail_the_parent_at_once(hws: Workspace) -> None:
    """A hi_moe parent's child answering ``constraints: 5`` raised a TypeError while its Message
    was built: a traceback, the parent left in in-progress/ for a lease, then retried as an
    interrupted attempt. Now it is a malformed delegation, in every format."""
    hws.drop("m1.json", hi_moe_message("m1", [{"to": "@leaf", "constraints": 5}]))
    hws.drop("m2.json", hi_moe_message("m2", [{"to": "@leaf", "context_refs": 7}]))
    delegate(hws, "n1", [{"to": "@leaf", "constraints": "not a list"}])
    delegate(hws, "n2", [{"to": "@leaf", "objective": {"an": "object"}}])
    run(hws)
    for hid, needle in (("m1", "delegate[0].constraints must be a list of strings"),
                        ("m2", "delegate[0].context_refs must be a list of strings")):
        assert hws.state_of(hid) == ["failed"], hws.state_of(hid)
        payload = hws.doc(hid)["payload"]
        assert payload["error_type"] == "validation_failed", payload
        assert needle in payload["error_detail"], payload["error_detail"]
    assert_refused(hws, "n1", "delegate[0].constraints must be a list of strings")
    assert_refused(hws, "n2", "delegate[0].objective must be a string")
    assert ran(hws) == []


# ---------------------------------------------------------------- ids (r4, r7, r10)
def test_an_explicit_id_equal_to_a_siblings_default_id_is_refused(hws: Workspace) -> None:
    """Entry 2's explicit ``job.c1`` is entry 1's default id: one child was made for both and
    the parent reported 1/1 succeeded, one entry silently dropped."""
    delegate(hws, "job", [{"to": "@leaf", "data": {"n": 1}}, {"to": "@leaf", "id": "job.c1"}])
    delegate(hws, "job2", [{"to": "@leaf", "id": "job2.c2"}, {"to": "@leaf"}])
    run(hws)
    assert_refused(hws, "job", "delegate[1] child id 'job.c1' is used twice (delegate[0] has it "
                               "by default)")
    assert_refused(hws, "job2", "delegate[1] child id 'job2.c2' is used twice (delegate[0] has it "
                                "its explicit id)")
    assert not hws.state_of("job.c1") and not hws.state_of("job2.c2") and ran(hws) == []


def test_a_recently_purged_id_refuses_the_delegation_before_any_child(hws: Workspace) -> None:
    """The second child's id was still in the seen-ids record: the first child was made and ran,
    then the parent failed PROCESSING_ERROR beside it, an orphan."""
    hws.create("--to", "@leaf", "--id", "gone", "--data", "{}")
    run(hws)
    hws.handoff("purge", "--older-than", "0s", check=True)
    (hws.root / "artifacts" / "ran.txt").unlink()
    delegate(hws, "par", [{"to": "@leaf", "data": {"n": 1}}, {"to": "@leaf", "id": "gone"}])
    run(hws)
    assert_refused(hws, "par", "the child id 'gone' was used recently")
    assert not hws.state_of("par.c1") and ran(hws) == []


def test_a_document_dropped_under_a_child_id_is_not_adopted(hws: Workspace) -> None:
    """Child ids are predictable, and a handoff whose document said ``parent_id: job`` was taken
    for job's own child left by a crash: the real child never ran and the parent aggregated the
    outsider's answer. Neither a dropped document that already ran nor one still waiting in
    pending/ with forged bookkeeping counts."""
    hws.drop("job.c1.json", {"handoff_id": "job.c1", "target": {"agent_id": "@leaf"},
                             "source": {"agent_id": "@mallory"}, "parent_id": "job",
                             "input": {"data": {"forced": {"verdict": "FORGED"}}}})
    run(hws)
    assert hws.state_of("job.c1") == ["completed"]
    forged_book = {"id": "job2.c1", "revision": 1, "seal": "0" * 32, "history": [
        {"at": "2020-01-01T00:00:00.000Z", "event": "created", "actor": {"host": "x", "pid": 1}}]}
    hws.drop("job2.c1.json", {"handoff_id": "job2.c1", "target": {"agent_id": "@nobody"},
                              "source": {"agent_id": "@mallory"}, "parent_id": "job2",
                              "input": {"data": {}}, "handoffd": forged_book})
    delegate(hws, "job", [{"to": "@leaf", "data": {"diff": "real work"}}])
    delegate(hws, "job2", [{"to": "@leaf", "data": {"diff": "real work"}}])
    run(hws)
    assert_refused(hws, "job", "the child id 'job.c1' is taken by another handoff")
    assert_refused(hws, "job2", "the child id 'job2.c1' is taken by another handoff")
    assert hws.doc("job.c1")["source"]["agent_id"] == "@mallory"  # left alone, not adopted


# ---------------------------------------------------------------- one notice (r6)
def test_a_malformed_delegation_is_announced_once(hws: Workspace) -> None:
    """A child that cannot be made (priority ``{}``) failed the parent once, but the on_filed
    listeners heard of it twice: the command ran twice and the summary said "failed 2"."""
    delegate(hws, "bad", [{"to": "@leaf", "priority": {}}])
    stderr = run(hws)
    assert_refused(hws, "bad", "priority")
    assert (hws.root / "notified.txt").read_text().splitlines() == ["bad failed"]
    assert "failed 1," in stderr, stderr


# ---------------------------------------------------------------- in-process (memory backend)
RUNS: list[str] = []


def echo(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    RUNS.append(ctx.handoff_id)
    return {"status": "completed", "output": {"echo": ctx.data}}


def fan_out(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "delegated", "delegate": [{"to": "@echo", "data": {"n": 1}},
                                                {"to": "@echo", "data": {"n": 2}}]}


@pytest.fixture
def mem(tmp_path: Path) -> tuple[Engine, Clock]:
    RUNS.clear()
    clock = Clock()
    return memory_engine(tmp_path, clock, {"@echo": echo, "@boss": fan_out})[0], clock


def submit(engine: Engine, hid: str, target: str, **extra: Any) -> None:
    doc = new_native_request(source="@test", target=target, data={}, now=engine.clock(),
                             handoff_id=hid)
    doc.update(extra)
    assert engine.submit(doc) == hid


def batch(engine: Engine) -> None:
    Daemon(engine, workers=2, watch=False).run_batch()


def attempt(engine: Engine, hid: str) -> State:
    """Claim, run and file ``hid`` on this thread (no daemon worker may start a child between
    its creation and the parent's filing)."""
    job = engine.take(hid)
    assert job is not None
    return engine.file(job.claim, job.dialect, job.specialist, engine.run(job))


class Crash(BaseException):
    """The process dying between creating the children and parking the parent."""


def test_a_crash_replay_adopts_the_children_its_interrupted_attempt_made(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch) -> None:
    """The one case an existing child id is the parent's own: made by an attempt of this
    delegation that crashed before the parent was parked. Replayed, the parent adopts them
    (nothing is made or run twice) and aggregates."""
    engine, clock = mem
    submit(engine, "p", "@boss")
    job = engine.take("p")
    assert job is not None
    outcome = engine.run(job)
    real_requeue = engine.requeue

    def crash(claim: Any, dialect: Any, event: str, **kw: Any) -> State:
        if event == "delegated":
            raise Crash()
        return real_requeue(claim, dialect, event, **kw)

    monkeypatch.setattr(engine, "requeue", crash)
    with pytest.raises(Crash):
        engine.file(job.claim, job.dialect, job.specialist, outcome)
    monkeypatch.setattr(engine, "requeue", real_requeue)
    assert engine.get("p.c1")[0] is State.PENDING and engine.get("p.c2")[0] is State.PENDING
    clock.advance(31)
    assert sweep(engine).recovered == ["p"]
    clock.advance(11)
    for _ in range(3):  # replay (adopting p.c1, p.c2), run the children, aggregate
        batch(engine)
    state, doc = engine.get("p")
    assert state is State.COMPLETED, doc
    assert doc["children"] == ["p.c1", "p.c2"] and sorted(RUNS) == ["p.c1", "p.c2"]


@pytest.mark.parametrize("forged", [False, True])
def test_on_files_only_a_sealed_child_of_the_interrupted_attempt_is_adopted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forged: bool) -> None:
    """The same crash on the files backend. A pending child whose bookkeeping says all the right
    things (created by the parent's crashed process, at the right time) but carries no valid
    seal is what a foreign producer could drop in its place: it is not adopted."""
    RUNS.clear()
    clock = Clock()
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    config = Config(daemon=DaemonSettings(lease_seconds=30, durability="fast", events=False),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=10))
    registry = Registry()
    for agent, func in (("@echo", echo), ("@boss", fan_out)):
        registry.add_function(agent, func, config=config)
    engine = build_engine(ws, config, registry, clock=clock)
    submit(engine, "p", "@boss")
    job = engine.take("p")
    assert job is not None
    outcome = engine.run(job)
    def crash(*args: Any, **kwargs: Any) -> State:
        raise Crash()

    monkeypatch.setattr(engine, "requeue", crash)
    with pytest.raises(Crash):
        engine.file(job.claim, job.dialect, job.specialist, outcome)
    monkeypatch.undo()
    engine.backend.abandon(job.claim)
    assert sweep(engine).recovered == ["p"]
    if forged:  # the very same document and bookkeeping, but no seal handoffd made
        path = ws.handoffs / "pending" / "p.c1.json"
        doc = json.loads(path.read_text())
        doc["handoffd"]["seal"] = "0" * 32
        path.write_text(json.dumps(doc))
    clock.advance(11)
    attempt(engine, "p")
    state, doc = engine.get("p")
    if forged:
        assert state is State.FAILED and doc["error"]["code"] == "VALIDATION_FAILED", doc
        assert "the child id 'p.c1' is taken by another handoff" in doc["error"]["message"]
    else:
        assert state is State.PENDING, doc
        assert book(doc)["waiting_children"]["children"] == ["p.c1", "p.c2"]
    assert RUNS == []


def test_a_handoff_created_beforehand_with_the_parent_id_is_not_adopted(
        mem: tuple[Engine, Clock]) -> None:
    """A well-formed handoff made through the API (its bookkeeping is handoffd's own) that
    merely says ``parent_id: p`` was not made by p's delegation: the id is taken."""
    engine, _ = mem
    submit(engine, "p.c1", "@echo", parent_id="p")
    batch(engine)
    submit(engine, "p", "@boss")
    batch(engine)
    state, doc = engine.get("p")
    assert state is State.FAILED and doc["error"]["code"] == "VALIDATION_FAILED", doc
    assert "the child id 'p.c1' is taken" in doc["error"]["message"]
    assert not engine.get("p.c1")[1].get("handoffd", {}).get("waiting_children")
    assert RUNS == ["p.c1"]


@pytest.mark.parametrize("problem", [DuplicateHandoff("handoff p.c2 already exists",
                                                      handoff_id="p.c2"),
                                     OSError(28, "No space left on device"),
                                     RuntimeError("a bug")])
def test_a_child_failing_midway_leaves_no_orphan_and_files_the_parent_once(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch, problem: Exception) -> None:
    """Storing the second child fails after its ids were checked (a race, a full disk, a bug):
    the first child is cancelled before it runs and the parent is filed with a code, once,
    never left claimed for a lease."""
    engine, _ = mem
    store = getattr(engine.backend, "inner", engine.backend)  # under the event recorder
    real_create = store.create

    def create(doc: dict[str, Any], handoff_id: str, now: datetime, **kw: Any) -> None:
        if handoff_id == "p.c2":
            raise problem
        real_create(doc, handoff_id, now, **kw)

    monkeypatch.setattr(store, "create", create)
    notices: list[tuple[str, State]] = []
    engine.on_filed.append(lambda hid, where: notices.append((hid, where)))
    submit(engine, "p", "@boss")
    assert attempt(engine, "p") is engine.get("p")[0]
    state, doc = engine.get("p")
    code = {"DuplicateHandoff": "VALIDATION_FAILED"}.get(type(problem).__name__, "PROCESSING_ERROR")
    assert doc["handoffd"]["last_error" if state is State.PENDING else "final_error"]["code"] == code
    assert state is (State.PENDING if isinstance(problem, OSError) else State.FAILED), doc
    child_state, child = engine.get("p.c1")
    assert child_state is State.FAILED and child["error"]["code"] == "CANCELLED", child
    assert RUNS == [] and [n for n in notices if n[0] == "p"] == [("p", state)]


def test_an_unexpected_error_while_planning_files_the_parent(
        mem: tuple[Engine, Clock], monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong turning a delegation into children, the parent is filed with a code
    and one line, not left claimed until its lease runs out."""
    engine, _ = mem

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(orchestration, "_plan_children", broken)
    submit(engine, "p", "@boss")
    assert attempt(engine, "p") is State.FAILED
    state, doc = engine.get("p")
    assert state is State.FAILED and doc["error"]["code"] == "VALIDATION_FAILED", doc
    assert "TypeError: 'int' object is not iterable" in doc["error"]["message"]
    assert RUNS == []


def test_the_hi_moe_child_builder_refuses_a_non_list(tmp_path: Path) -> None:
    """Defence in depth: the Message builder itself says what is wrong instead of a TypeError."""
    from handoffd.core.errors import InvalidDocument
    from handoffd.dialects import hi_moe
    parent = hi_moe_message("m", [])
    with pytest.raises(InvalidDocument, match="constraints must be a list of strings"):
        hi_moe.delegation(parent, "m.c1", to="@leaf", data=None, now=datetime.now(timezone.utc),
                          timeout_seconds=1.0, priority=1, fields={"constraints": 5})


def test_only_a_hi_moe_message_is_a_cancellation() -> None:
    """Found by the seed review: a HAIOS directive (seed 003) or a native request (seed 001)
    whose payload happened to carry ``target_message_id`` was taken for a seed 000
    CancellationPayload: it cancelled an unrelated running handoff and never ran its own work.
    Seed 000 defines that payload for hi_moe Messages only."""
    from dialect_examples import HI_MOE_CANCELLATION

    from handoffd.features.cancellation import is_cancel_message
    assert is_cancel_message(HI_MOE_CANCELLATION)
    haios = {"handoff_id": "5f0c7a2e-1111-4222-8333-944455556666", "from_agent": "interpreter-v1",
             "to_agent": "ingester-v1", "created_at": "2025-12-02T10:00:00Z",
             "payload": {"directive": {"action": "ingest"}, "target_message_id": "victim1"},
             "timeout_ms": 30000, "status": "pending"}
    native = {"handoff_id": "n-1", "target": {"agent_id": "@w"}, "input": {"data": {}},
              "payload": {"target_message_id": "victim2"}}
    assert not is_cancel_message(haios) and not is_cancel_message(native)
    # bookkeeping from outside does not make a native request a hi_moe Message
    assert not is_cancel_message({**native, "handoffd": {"dialect": "hi_moe"}})
