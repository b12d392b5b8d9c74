"""Unit tests of the core: store, state machine, retry policy (injected clock), recovery."""
from __future__ import annotations

import json
import os
import re
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

from handoffd import Engine, Registry, Workspace, build_engine
from handoffd.backends.files.fsio import rename_noreplace
from handoffd.core.config import Config, RetryPolicy, load_config
from handoffd.core.documents import book, check_id
from handoffd.core.engine import Job
from handoffd.core.errors import ConfigError, DuplicateHandoff, InvalidDocument
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import ENTRY_POINT_GROUP, may_declare_entry_points
from handoffd.core.states import State, allowed, winner
from handoffd.core.timeutil import parse_iso
from handoffd.service.sweeper import requeue_failed, sweep


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 13, 10, 0, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def monotonic(self) -> float:
        """The same clock as seconds that never step (what the sweeper times leases with)."""
        return self.now.timestamp()


def make_engine(tmp_path: Path, handler: Any, clock: FakeClock | None = None,
                retry: dict[str, Any] | None = None, **spec: Any) -> Engine:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@py", handler, config=config, retry=retry, **spec) if retry else \
        registry.add_function("@py", handler, config=config, **spec)
    clock = clock or FakeClock()
    return build_engine(ws, config, registry, clock=clock, monotonic=clock.monotonic)


def submit(engine: Engine, data: Any = None, retry_policy: dict | None = None, **kw: Any) -> str:
    doc = new_native_request(source="@test", target="@py", data=data, now=engine.clock(), **kw)
    if retry_policy is not None:
        doc["retry_policy"] = retry_policy
    return engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())


def run_job(engine: Engine, job: Job) -> State:
    """Run and file one claimed job (the whole attempt), as a daemon worker does."""
    return engine.file(job.claim, job.dialect, job.specialist, engine.run(job))


def process(engine: Engine, handoff_id: str) -> State:
    job = engine.take(handoff_id)
    assert job is not None
    return run_job(engine, job)


def test_safe_ids() -> None:
    for good in ("hoff-001-1705147200000", "msg-001", "bd-123.2", "3f2b8c1e-1d2c-4b4a-9f00-aa11bb22cc33"):
        assert check_id(good) == good
    for bad in ("../x", "/abs", "a/b", "x\x00y", "", ".hidden", "a" * 200, "a..b", 5, None, "x.tmp"):
        with pytest.raises(InvalidDocument) as err:
            check_id(bad)
        assert err.value.code == "UNSAFE_ID"


def test_state_machine_and_winner() -> None:
    assert allowed(State.PENDING, State.IN_PROGRESS)
    assert not allowed(State.COMPLETED, State.PENDING)
    assert allowed(State.FAILED, State.PENDING)
    # higher revision wins; on a tie the state further along wins
    assert winner([(State.PENDING, 5), (State.FAILED, 4)]) == 0
    assert winner([(State.IN_PROGRESS, 3), (State.COMPLETED, 3)]) == 1


def test_rename_noreplace_never_overwrites(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("new")
    b.write_text("old")
    with pytest.raises(FileExistsError):
        rename_noreplace(a, b)
    assert b.read_text() == "old" and a.exists()
    with pytest.raises(FileNotFoundError):
        rename_noreplace(tmp_path / "missing", tmp_path / "c")


def test_create_refuses_taken_id_and_never_overwrites(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine, {"n": 1}, handoff_id="same")
    with pytest.raises(DuplicateHandoff, match="already exists in pending"):
        submit(engine, {"n": 2}, handoff_id="same")
    assert engine.backend.store.read(State.PENDING, hid)["input"]["data"] == {"n": 1}


def test_exactly_one_claimer_wins(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    ids = [submit(engine) for _ in range(30)]
    wins: list[str] = []
    lock = threading.Lock()

    def grab() -> None:
        for hid in ids:
            claim = engine.backend.store.claim(hid, lease_seconds=30)
            if claim is not None:
                with lock:
                    wins.append(hid)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == sorted(ids)  # each exactly once


def test_completed_document_and_history(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed", "output": {"sum": sum(c.data)},
                                                 "next_steps": ["ship it"]})
    hid = submit(engine, [1, 2, 3])
    assert process(engine, hid) is State.COMPLETED
    doc = engine.backend.store.read(State.COMPLETED, hid)
    assert doc["status"] == "completed" and doc["output"] == {"sum": 6}
    assert doc["started_at"] and doc["completed_at"] and doc["execution_time_seconds"] >= 0
    assert [e["event"] for e in book(doc)["history"]] == ["created", "claimed", "completed"]
    assert book(doc)["revision"] == 3 and "lease" not in book(doc)


def test_retry_delays_follow_seed_table(tmp_path: Path) -> None:
    """Seed 001: attempt 2 after 30 s, attempt 3 after 60 s, attempt 4 after 120 s, then failed."""
    clock = FakeClock()

    def failing(handoff: dict, ctx: Any) -> dict:
        return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "boom"}}

    engine = make_engine(tmp_path, failing, clock)
    hid = submit(engine, retry_policy={"max_retries": 3, "retry_delay_seconds": 30,
                                       "backoff_multiplier": 2.0})
    delays = []
    for expected in (30, 60, 120):
        assert process(engine, hid) is State.PENDING
        doc = engine.backend.store.read(State.PENDING, hid)
        due = parse_iso(book(doc)["next_attempt_at"])
        delays.append((due - clock.now).total_seconds())
        assert engine.peek(hid).due_at == due  # the scheduler will not run it early
        clock.advance(expected)
    assert delays == [30, 60, 120]
    assert process(engine, hid) is State.FAILED
    doc = engine.backend.store.read(State.FAILED, hid)
    assert doc["retry_count"] == 3 and doc["max_retries"] == 3 and doc["retry_available"] is True
    assert doc["error"]["code"] == "PROCESSING_ERROR" and doc["recovery_actions"]
    assert book(doc)["attempt"] == 4


def test_policy_precedence(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"},
                         retry={"max_retries": 7, "retry_delay_seconds": 1})
    spec = engine.registry.get("@py")
    assert engine.policy({}, spec).max_retries == 7
    assert engine.policy({"retry_policy": {"max_retries": 1}}, spec) == RetryPolicy(1, 1.0, 2.0)
    assert engine.policy({}, None) == engine.config.retry
    assert RetryPolicy(3, 30, 2).delay(3) == 120


def test_a_remembered_retry_policy_is_still_checked_by_type_and_base() -> None:
    """Document policies are remembered by value and type: a policy that equals a valid one
    (True == 1) is still refused, and the same policy over another base gives its own result."""
    assert RetryPolicy.from_dict({"max_retries": 1}) == RetryPolicy(1, 30.0, 2.0)
    for bad in ({"max_retries": True}, {"max_retries": 1.5}, {"max_retries": 1, "x": [1]} | {
            "max_retries": "lots"}):
        for _ in range(2):  # an error is never remembered as a policy
            with pytest.raises(ConfigError):
                RetryPolicy.from_dict(bad)
    assert RetryPolicy.from_dict({"max_retries": 1}, RetryPolicy(5, 2.0, 3.0)) == RetryPolicy(1, 2.0, 3.0)
    assert RetryPolicy.from_dict({"max_retries": 1.0}) == RetryPolicy(1, 30.0, 2.0)


def test_permanent_errors_are_not_retried(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "failed", "error": {
        "code": "PROCESSING_ERROR", "message": "auth refused", "retryable": False}})
    hid = submit(engine)
    assert process(engine, hid) is State.FAILED
    doc = engine.backend.store.read(State.FAILED, hid)
    assert doc["retry_available"] is False and doc["retry_count"] == 0
    with pytest.raises(Exception, match="--force"):
        requeue_failed(engine, hid)
    requeue_failed(engine, hid, force=True)
    doc = engine.backend.store.read(State.PENDING, hid)
    assert doc["status"] == "pending" and "error" not in doc
    assert [e["event"] for e in book(doc)["history"]][-1] == "retried"


def test_python_handler_timeout_and_exception(tmp_path: Path) -> None:
    gate = threading.Event()

    def handler(handoff: dict, ctx: Any) -> dict:
        if ctx.data == "hang":
            gate.wait(5)
            return {"status": "completed"}
        raise ValueError("bad thing")

    engine = make_engine(tmp_path, handler, timeout_seconds=0.2)
    hang = submit(engine, "hang", retry_policy={"max_retries": 0})
    boom = submit(engine, "boom", retry_policy={"max_retries": 0})
    assert process(engine, hang) is State.FAILED
    gate.set()
    assert engine.backend.store.read(State.FAILED, hang)["error"]["code"] == "TIMEOUT"
    assert process(engine, boom) is State.FAILED
    assert "ValueError: bad thing" in engine.backend.store.read(State.FAILED, boom)["error"]["message"]


def test_a_result_too_deep_to_read_back_fails_the_attempt(tmp_path: Path) -> None:
    """Found by the fan-out hunt: output nested 70 levels was filed as completed, then every
    reader (show, wait, a fan-out parent, notices) refused the document as too deep."""
    def handler(handoff: dict, ctx: Any) -> dict:
        value: Any = "leaf"
        for _ in range(ctx.data):
            value = [value]
        return {"status": "completed", "output": value}

    engine = make_engine(tmp_path, handler)
    deep, fine = submit(engine, 70), submit(engine, 50)
    assert process(engine, deep) is State.FAILED
    error = engine.backend.store.read(State.FAILED, deep)["error"]
    assert error["code"] == "DOCUMENT_TOO_DEEP" and error["retryable"] is False
    assert process(engine, fine) is State.COMPLETED
    assert engine.backend.get(fine) is not None  # what is filed reads back


def test_a_command_printing_nesting_past_the_recursion_limit_is_not_json() -> None:
    from handoffd.core.errors import HandlerError
    from handoffd.core.runner import _parse_output
    with pytest.raises(HandlerError, match="handler output is not JSON"):
        _parse_output(0, b"[" * 100_000 + b"]" * 100_000, b"", "h1")


def test_input_schema_errors_carry_field_paths(tmp_path: Path) -> None:
    calls = []
    engine = make_engine(tmp_path, lambda h, c: calls.append(1) or {"status": "completed"},
                         input_schema="items.schema.json")
    (engine.ws.schemas / "items.schema.json").write_text(json.dumps({
        "type": "object", "required": ["component_requirements"],
        "properties": {"component_requirements": {"type": "array", "items": {
            "type": "object", "properties": {"props": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["type"]}}}}}}}))
    hid = submit(engine, {"component_requirements": [{"props": {"userId": {"required": True}}}]})
    assert process(engine, hid) is State.FAILED
    doc = engine.backend.store.read(State.FAILED, hid)
    assert calls == []  # invalid input never reaches the handler
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED" and doc["retry_available"] is False
    (entry,) = doc["validation"]["errors"]
    assert entry["field"] == "component_requirements[0].props.userId"
    assert entry["error"] == "Missing required field 'type'"
    assert entry["schema_path"].startswith("#/properties/component_requirements/items")


def test_recover_claim_whose_owner_is_gone(tmp_path: Path, dead_owner_marks: None) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    claim = engine.backend.store.claim(hid, lease_seconds=30)
    assert claim is not None
    assert sweep(engine).recovered == []  # lock held: the owner is alive
    engine.backend.store.close()  # the owner lock goes, as when the owner process dies
    report = sweep(engine)
    assert report.recovered == [hid]
    doc = engine.backend.store.read(State.PENDING, hid)
    assert [e["event"] for e in book(doc)["history"]][-2:] == ["recovered", "retry_scheduled"]


def test_recover_claim_whose_lease_expired(tmp_path: Path) -> None:
    clock = FakeClock()
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"}, clock)
    hid = submit(engine)
    claim = engine.backend.store.claim(hid, lease_seconds=30, now=clock.now)
    assert claim is not None and sweep(engine).recovered == []
    clock.advance(31)  # owner alive but stalled: lease not renewed
    assert sweep(engine).recovered == [hid]
    assert engine.backend.store.locate(hid) == [State.PENDING]
    # the stalled owner wakes up: its result is discarded, not filed twice
    assert engine.backend.store.finish(claim, State.COMPLETED, claim.doc) is False
    assert engine.backend.store.locate(hid) == [State.PENDING]


def test_interrupted_finish_keeps_the_finished_copy(tmp_path: Path, dead_owner_marks: None) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    job = engine.take(hid)
    assert job is not None
    stale = json.dumps(job.claim.doc)
    run_job(engine, job)
    # simulate a crash between writing completed/ and removing in-progress/
    engine.backend.store.path(State.IN_PROGRESS, hid).write_text(stale)
    engine.backend.store.close()  # the crash: the owner lock goes with the process
    sweep(engine)
    assert engine.backend.store.locate(hid) == [State.COMPLETED]


def test_interrupted_manual_retry_keeps_the_pending_copy(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "failed", "error": {"code": "X", "message": "x"}},
                         retry={"max_retries": 0})
    hid = submit(engine)
    assert process(engine, hid) is State.FAILED
    failed_copy = engine.backend.store.path(State.FAILED, hid).read_text()
    requeue_failed(engine, hid)
    engine.backend.store.path(State.FAILED, hid).write_text(failed_copy)  # crash before the unlink
    sweep(engine)
    assert engine.backend.store.locate(hid) == [State.PENDING]


def test_orphan_temp_files_and_locks_are_removed(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    tmp = engine.ws.tmp / "deadbeef.tmp"
    tmp.write_text("{")
    os.utime(tmp, (0, 0))
    (engine.ws.locks / "gone.abc.lock").write_text("")
    report = sweep(engine)
    assert report.temp_files_removed == 1 and report.locks_removed == 1
    assert not tmp.exists()


def test_a_process_temp_folder_is_swept_and_made_again(tmp_path: Path) -> None:
    """A forked daemon process writes temp files in a folder of its own: the sweeper removes
    the old files in it, then the folder once it is empty and idle; a live process whose idle
    folder was removed makes it again at its next write."""
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    engine.backend.after_fork()
    own = engine.backend.store.tmp
    assert own.parent == engine.ws.tmp and own.name.startswith(f"p{os.getpid()}-")
    old, young = own / "old.tmp", own / "young.tmp"
    old.write_text("{")
    young.write_text("{")
    os.utime(old, (0, 0))
    os.utime(own, (0, 0))
    report = sweep(engine)
    assert report.temp_files_removed == 1 and not old.exists()
    assert young.exists()  # a folder with a young file in it stays
    young.unlink()
    os.utime(own, (0, 0))
    sweep(engine)
    assert not own.exists()
    hid = submit(engine)
    assert process(engine, hid) is State.COMPLETED  # its writes make the folder again
    assert own.is_dir()


def test_seen_ids_survive_restart_and_expire(tmp_path: Path) -> None:
    clock = FakeClock()
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"}, clock)
    hid = submit(engine, handoff_id="once")
    assert process(engine, hid) is State.COMPLETED
    engine.backend.store.path(State.COMPLETED, hid).unlink()  # archived away
    again = make_engine(tmp_path, lambda h, c: {"status": "completed"}, clock)  # a restart
    with pytest.raises(DuplicateHandoff, match="used within"):
        submit(again, handoff_id="once")
    clock.advance(3601)
    again.backend.store.seen.compact(clock.now)
    assert submit(again, handoff_id="once") == "once"


def test_seen_ids_kept_open_follow_a_compaction_elsewhere(tmp_path: Path) -> None:
    """The record stays open between adds; a compaction by another process replaces the file,
    and the next add must land in the new file (a line in the old one would be lost)."""
    from handoffd.backends.files.seen import SeenIds
    path = tmp_path / "seen-ids.jsonl"
    now = datetime(2026, 11, 25, tzinfo=timezone.utc)
    mine, theirs = SeenIds(path, 60), SeenIds(path, 60)
    mine.add("old", now)
    assert theirs.contains("old", now)
    later = now + timedelta(seconds=120)
    assert theirs.compact(later) == 0  # "old" expired: the file is replaced by an empty one
    mine.add("new", later)
    assert theirs.contains("new", later) and not theirs.contains("old", later)
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["new"]
    threads = [threading.Thread(target=lambda n=n: [mine.add(f"t{n}-{i}", later) for i in range(50)])
               for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    fresh = SeenIds(path, 60)
    assert all(fresh.contains(f"t{n}-{i}", later) for n in range(4) for i in range(50))
    assert all(mine.contains(f"t{n}-{i}", later) for n in range(4) for i in range(50))


def test_a_schema_added_after_a_miss_is_found(tmp_path: Path) -> None:
    from handoffd.core.validation import SchemaCache
    folder = tmp_path / "schemas"
    folder.mkdir()
    cache = SchemaCache(folder)
    assert not cache.has("late.schema.json") and not cache.has("late.schema.json")
    (folder / "late.schema.json").write_text('{"type": "object"}')
    assert cache.has("late.schema.json")


def test_config_errors_are_clear(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text('[specialists."@x"]\ncommand = "rm -rf /"\n')
    with pytest.raises(ConfigError, match="never run through a shell"):
        load_config(path)
    path.write_text("[daemon]\nworkerz = 3\n")
    with pytest.raises(ConfigError, match="unknown"):
        load_config(path)


@pytest.mark.parametrize("text,needle", [
    ("[bogus]\nx = 1\n", "unknown section [bogus]"),
    ('[specialists."@x"]\ncommand = ["true"]\ntimout_seconds = 3\n', "unknown key 'timout_seconds'"),
    ("[daemon]\nsweep_seconds = -1\n", "sweep_seconds must be greater than 0"),
    ("[daemon]\nlease_seconds = 0\n", "lease_seconds must be greater than 0"),
])
def test_config_mistakes_are_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(path)


def test_workspace_accepts_a_string(tmp_path: Path) -> None:
    ws = Workspace(str(tmp_path))
    assert ws.handoffs == tmp_path.resolve() / "handoffs"


def test_crash_points_are_a_test_seam(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection without an environment variable: a hook sees every crash point passed."""
    from handoffd.backends.files import crashpoints
    seen: list[str] = []
    monkeypatch.setattr(crashpoints, "crash_hook", seen.append)
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed"})
    assert process(engine, submit(engine)) is State.COMPLETED
    assert seen == list(crashpoints.CRASH_POINTS)


_AGENTS = ["@a", "", "x" * 3]
_TIMEOUTS = [None, 1, 0.5, 0, -1, True, float("nan"), 3600]
_PRIORITIES = [None, "high", "normal", "backlog", "urgent", "", 0, 4, 5, -1, True, 2.0]


@pytest.mark.parametrize("timeout", _TIMEOUTS)
@pytest.mark.parametrize("priority", _PRIORITIES)
@pytest.mark.parametrize("source", _AGENTS)
def test_new_native_request_refuses_exactly_what_the_schema_refuses(
        source: str, priority: Any, timeout: Any) -> None:
    """`handoff create --to` skips the schema check (Engine.submit(prechecked=True)): what
    new_native_request builds must then be valid, and what it refuses must be invalid."""
    from handoffd import dialects
    from handoffd.core.validation import builtin_schemas, check_document

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    raw = {"handoff_id": "h-1", "timestamp": "2026-01-01T00:00:00.000Z", "status": "pending",
           "source": {"agent_id": source}, "target": {"agent_id": "@t"}, "input": {"data": 1}}
    if timeout is not None:
        raw["timeout_seconds"] = timeout
    if priority is not None:
        raw["priority"] = priority
    try:
        check_document(builtin_schemas(), dialects.by_name("native"), raw)
        # NaN passes a JSON Schema "exclusiveMinimum" (no comparison holds); admission refuses
        # it (Envelope bounds), so the builder refuses it up front
        schema_ok = timeout == timeout
    except InvalidDocument:
        schema_ok = False
    try:
        doc = new_native_request(source=source, target="@t", data=1, now=now, handoff_id="h-1",
                                 timeout_seconds=timeout, priority=priority)
    except InvalidDocument as exc:
        assert not schema_ok, f"refused a valid request: {exc}"
        return
    assert schema_ok, "built a request the schema refuses"
    check_document(builtin_schemas(), dialects.by_name("native"), doc)


def _fake_distribution(site: Path, entry_points: str | bytes, name: str = "x") -> Path:
    dist = site / f"{name}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    path = dist / "entry_points.txt"
    if isinstance(entry_points, bytes):
        path.write_bytes(entry_points)
    else:
        path.write_text(entry_points)
    return dist


def test_registry_sees_an_entry_point_found_by_the_precheck(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path declaring the group passes the cheap pre-check, and the real
    scan (importlib.metadata) then registers its specialist."""
    _fake_distribution(tmp_path, f"[{ENTRY_POINT_GROUP}]\n@x = xmod:handle\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert may_declare_entry_points(ENTRY_POINT_GROUP)
    spec = Registry.load(Config()).get("@x")
    assert spec is not None and spec.config.handler == "xmod:handle" and spec.func is None


def test_entry_point_precheck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """may_declare_entry_points answers False only when no distribution can declare the group."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site), str(tmp_path / "missing")])
    assert not may_declare_entry_points(ENTRY_POINT_GROUP)  # nothing installed
    _fake_distribution(site, "[console_scripts]\nx = xmod:main\n")
    (site / "y-1.0.egg-info").write_text("Metadata-Version: 1.0\n")  # a PKG-INFO file, no folder
    (site / "z.dist-info").mkdir()  # no entry_points.txt
    assert not may_declare_entry_points(ENTRY_POINT_GROUP)
    assert may_declare_entry_points("console_scripts")
    egg_info = site / "w-1.0.egg-info"
    egg_info.mkdir()
    (egg_info / "entry_points.txt").write_text(f"# comment\n\n  [ {ENTRY_POINT_GROUP} ]  \n@w = w:f\n")
    assert may_declare_entry_points(ENTRY_POINT_GROUP)  # whitespace around the name allowed
    # a .egg folder on sys.path keeps its metadata in EGG-INFO
    egg = tmp_path / "v-1.0-py3.11.egg"
    (egg / "EGG-INFO").mkdir(parents=True)
    (egg / "EGG-INFO" / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n@v = v:f\n")
    monkeypatch.setattr(sys, "path", [str(egg)])
    assert may_declare_entry_points(ENTRY_POINT_GROUP)
    # what it cannot look into cheaply is a "may": the real scan decides
    undecodable = tmp_path / "undecodable"
    _fake_distribution(undecodable, b"[other]\nx = \xff\n")
    monkeypatch.setattr(sys, "path", [str(undecodable)])
    assert may_declare_entry_points(ENTRY_POINT_GROUP)
    archive = tmp_path / "lib.zip"
    archive.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip archive
    monkeypatch.setattr(sys, "path", [str(archive)])
    assert may_declare_entry_points(ENTRY_POINT_GROUP)

    class Finder:
        @staticmethod
        def find_distributions(context: object = None) -> list[object]:
            return []

    monkeypatch.setattr(sys, "path", [str(site / "missing")])
    assert not may_declare_entry_points(ENTRY_POINT_GROUP)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Finder])
    assert may_declare_entry_points(ENTRY_POINT_GROUP)


def test_registry_load_without_entry_points_skips_importlib_metadata(tmp_path: Path) -> None:
    """No distribution declares the group: Registry.load never imports importlib.metadata
    (~45 ms of a one-shot command's start)."""
    code = ("import sys; from handoffd.core.config import Config; "
            "from handoffd.core.specialists import Registry; Registry.load(Config()); "
            "print('importlib.metadata' in sys.modules)")
    out = run_python(code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_folder_fsyncs_are_shared_but_never_early(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Group commit: callers arriving while a folder fsync runs share the next one; none
    returns before an fsync that began after it asked has finished."""
    import time as time_module

    from handoffd.backends.files import dirsync
    syncs: list[tuple[float, float]] = []

    def slow_fsync(path: str) -> None:
        began = time_module.monotonic()
        time_module.sleep(0.02)
        syncs.append((began, time_module.monotonic()))

    monkeypatch.setattr(dirsync, "_fsync", slow_fsync)
    calls: list[tuple[float, float]] = []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(5):
            asked = time_module.monotonic()
            dirsync.fsync_dir(tmp_path)
            with lock:
                calls.append((asked, time_module.monotonic()))

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 40
    assert len(syncs) < 40  # shared
    for asked, returned in calls:  # and never early
        assert any(asked <= began and ended <= returned for began, ended in syncs)


def test_a_failing_folder_fsync_raises_and_the_next_caller_tries_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from handoffd.backends.files import dirsync
    outcomes = [OSError(5, "EIO"), None]

    def flaky(path: str) -> None:
        failure = outcomes.pop(0)
        if failure is not None:
            raise failure

    monkeypatch.setattr(dirsync, "_fsync", flaky)
    with pytest.raises(OSError):
        dirsync.fsync_dir(tmp_path)
    dirsync.fsync_dir(tmp_path)
    assert outcomes == []


@pytest.mark.parametrize("limit", [None, 0, 1, 3, 50, 400])
@pytest.mark.parametrize("newest", [True, False])
def test_listing_order_with_a_heap_is_the_sorted_order(limit: int | None, newest: bool) -> None:
    """handoff ls picks its first rows with a heap; read to the end it is the full sort."""
    import random

    from handoffd.backends.files.backend import _in_order
    rng = random.Random(7)
    stamped = [(float(rng.randrange(50)), rng.choice(list(State)), f"h{i:04d}") for i in range(300)]
    expected = sorted(stamped, key=lambda s: (s[0], s[2]), reverse=newest)
    assert list(_in_order(stamped, limit, newest=newest)) == expected


def test_seen_ids_never_read_the_whole_record_again_under_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """contains() reads only what was appended since its last look, whatever adds run at the
    same time (a stat taken before the lock once made it read the whole record again: a drain
    of 20,000 handoffs spent most of its time there)."""
    from handoffd.backends.files import seen as seen_module
    parsed: list[int] = []
    real_parse = seen_module._parse

    def counting(data: bytes) -> Any:
        parsed.append(data.count(b"\n"))
        return real_parse(data)

    monkeypatch.setattr(seen_module, "_parse", counting)
    record = seen_module.SeenIds(tmp_path / "seen-ids.jsonl", 3600)
    now = datetime(2026, 11, 25, tzinfo=timezone.utc)
    other = seen_module.SeenIds(tmp_path / "seen-ids.jsonl", 3600)  # another process's adds

    def work(n: int) -> None:
        for i in range(150):
            record.contains(f"w{n}-{i}", now)
            record.add(f"w{n}-{i}", now)
            if i % 10 == 0:
                other.add(f"o{n}-{i}", now)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    lines = len((tmp_path / "seen-ids.jsonl").read_bytes().splitlines())
    assert sum(parsed) <= lines  # each line read at most once
    assert all(record.contains(f"w{n}-{i}", now) for n in range(4) for i in range(150))
    assert all(record.contains(f"o{n}-{i}", now) for n in range(4) for i in range(0, 150, 10))


def test_the_seen_record_is_compacted_only_once_a_quarter_has_expired(tmp_path: Path) -> None:
    """The sweep asks every few seconds; the record is read whole and rewritten only once its
    oldest entry is COMPACT_AFTER TTLs old. Expired entries in between are ignored, not kept."""
    from handoffd.backends.files.seen import COMPACT_AFTER, SeenIds
    path = tmp_path / "seen-ids.jsonl"
    now = datetime(2026, 11, 25, tzinfo=timezone.utc)
    seen = SeenIds(path, 100)
    seen.add("old", now)
    seen.add("new", now + timedelta(seconds=50))
    inode = path.stat().st_ino
    soon = now + timedelta(seconds=110)
    assert seen.compact(soon) is None and path.stat().st_ino == inode  # not read, not rewritten
    assert not seen.contains("old", soon) and seen.contains("new", soon)
    due = now + timedelta(seconds=100 * COMPACT_AFTER)
    assert seen.compact(due) == 1 and path.stat().st_ino != inode
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["new"]
    assert seen.contains("new", due) and not seen.contains("old", due)


def test_hostile_lines_in_the_seen_record_are_skipped(tmp_path: Path) -> None:
    """The record sits in the workspace where anyone can write: a line that is not ours (a
    number for a time, not an object, nested past the parser's depth, torn) is skipped by the
    reader and dropped by compaction, never raised into a claim."""
    from handoffd.backends.files.seen import SeenIds
    path = tmp_path / "seen-ids.jsonl"
    now = datetime(2026, 11, 25, tzinfo=timezone.utc)
    path.write_bytes(b'{"id": "x", "at": 5}\n[1]\n' + b"[" * 100_000 + b"\n"
                     b'{"id": "y", "at": "2026-11-25T00:00:00Z"}\n{"id": "z", "at": "2026-1')
    seen = SeenIds(path, 60)
    assert seen.contains("y", now) and not seen.contains("x", now) and not seen.contains("z", now)
    seen.add("w", now)
    assert seen.compact(now + timedelta(seconds=30)) == 2  # y and w; the rest dropped
    assert SeenIds(path, 60).contains("w", now)
