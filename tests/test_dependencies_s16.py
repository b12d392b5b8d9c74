"""The dependency gate, review of session 16.

1. The daemon remembered "completed" for ever: once a dependency id was purged and created
   again, a new dependant ran while the new handoff under that id was still running.
2. Dense graphs cost cubic time: with each of N handoffs depending on all earlier ones, every
   check read (and waited for) every unfinished dependency, and every filing re-checked every
   waiter (N=150: 288,067 documents read). The counts here are of reads and checks, not time.
3. A dependency that completed and was then archived by retention counted as missing: `create
   --depends-on` refused it and a dropped dependant failed DEPENDENCY_MISSING.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, Clock, new_workspace, wait_until
from test_dependencies import CountingBackend, done

from handoffd import Daemon, Engine, Registry, State, build_engine, new_native_request
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import archived_ids
from handoffd.features.dependencies import Graph

REMOVED = "which existed but was removed by retention (archived or purged)"


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    config = Config(daemon=DaemonSettings(expectations="advisory"))
    registry = Registry()
    registry.add_function("@x", done, config=config, concurrency=4)
    return build_engine(ws, config, registry, clock=Clock(), backend=CountingBackend())


def drop(engine: Engine, handoff_id: str, depends_on: list[str] | None = None) -> None:
    """Store a request as a foreign producer would: no creation check."""
    doc = new_native_request(source="@test", target="@x", data={}, now=engine.clock(),
                             handoff_id=handoff_id, depends_on=depends_on)
    engine.backend.create(doc, handoff_id, engine.clock())


def finish(engine: Engine, handoff_id: str, state: State = State.COMPLETED) -> None:
    claim = engine.backend.claim(handoff_id, engine.clock(), 60)
    assert claim is not None and engine.backend.finish(claim, state, claim.doc)


def graph_of(engine: Engine) -> Graph:
    return next(g.__self__ for g in engine.gates  # type: ignore[attr-defined]
                if isinstance(getattr(g, "__self__", None), Graph))


def verdict(engine: Engine, handoff_id: str) -> Any:
    peek = engine.peek(handoff_id)
    assert peek is not None
    return engine.gate(peek)


def reads(engine: Engine) -> int:
    return engine.backend.reads  # type: ignore[attr-defined,no-any-return]


# ---------------------------------------------------------------- 1: a reused dependency id
def test_a_remembered_completion_is_not_believed_for_a_later_dependant(engine: Engine) -> None:
    clock: Clock = engine.clock  # type: ignore[assignment]
    drop(engine, "x")
    drop(engine, "y1", ["x"])
    finish(engine, "x")
    assert verdict(engine, "y1") is None  # x completed: remembered
    finish(engine, "y1")
    for hid in ("x", "y1"):
        assert engine.backend.purge(hid, State.COMPLETED, clock())
    clock.advance(3601)  # the dedup window passes: the id x is free again
    drop(engine, "x")
    drop(engine, "y2", ["x"])
    held = verdict(engine, "y2")
    assert held is not None and held.action == "wait" and held.on == frozenset({"x"}), held
    finish(engine, "x")
    graph_of(engine).filed("x", State.COMPLETED)  # (the daemon's listener, as after a filing)
    assert verdict(engine, "y2") is None


def test_a_filing_of_this_daemon_counts_for_waiters_already_there(engine: Engine) -> None:
    drop(engine, "x")
    drop(engine, "y", ["x"])
    assert verdict(engine, "y").on == frozenset({"x"})
    finish(engine, "x")
    graph_of(engine).filed("x", State.COMPLETED)
    before = reads(engine)
    assert verdict(engine, "y") is None
    assert reads(engine) == before  # believed: y was waiting before x completed


REUSE_TOML = FLAKY_TOML.replace("[daemon]\n", "[daemon]\nseen_ttl_seconds = 1.0\n", 1)


def test_serve_holds_a_dependant_of_a_reused_id_until_it_completes(tmp_path: Path) -> None:
    """The reviewer's reproduction against a real `handoffd serve`: X and Y1 (depending on X)
    complete, both are purged, X is created again (sleeping) and Y2 depends on it. Y2 ran while
    the second X was running; it must start after X completed."""
    ws = new_workspace(tmp_path / "ws", REUSE_TOML)
    try:
        ws.serve()
        ws.create("--to", "@flaky", "--id", "X", "--data", '{"mode": "ok"}')
        ws.create("--to", "@flaky", "--id", "Y1", "--depends-on", "X", "--data", '{"mode": "ok"}')
        assert ws.wait_state("Y1") == "completed"
        assert "purged 2" in ws.handoff("purge", "--older-than", "0s", check=True).stdout

        def created_again() -> bool:  # refused while the dedup window (1 s) lasts
            return ws.handoff("create", "--to", "@flaky", "--id", "X", "--data",
                              '{"mode": "sleep", "seconds": 2}').returncode == 0
        wait_until(created_again, timeout=30, what="X created again")
        ws.create("--to", "@flaky", "--id", "Y2", "--depends-on", "X", "--data", '{"mode": "ok"}')
        assert ws.wait_state("Y2") == "completed" and ws.wait_state("X") == "completed"
        assert ws.doc("X")["completed_at"] <= ws.doc("Y2")["started_at"]
        assert [r["id"] for r in ws.runs()] == ["X", "Y1", "X", "Y2"]
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- 2: dense graphs, linear work
def run_all(engine: Engine, counted: list[int]) -> None:
    gate = engine.gates[-1]

    def counting(engine: Engine, env: Any, doc: Any) -> Any:
        counted[0] += 1
        return gate(engine, env, doc)
    engine.gates[-1] = counting
    for _ in range(5):  # a batch runs what is due; what waits for it goes in the next
        assert Daemon(engine, workers=4, watch=False).run_batch().error is None
        if not engine.backend.ids(State.PENDING):
            break


def test_a_dense_graph_drains_with_work_linear_in_its_handoffs(engine: Engine) -> None:
    """Each of n handoffs depends on every earlier one (n*(n-1)/2 = 4,950 edges): before, 88,000
    documents were read and 4,000 checks made at n=100 (cubic: 288,067 at n=150)."""
    n = 100
    for k in range(n):
        drop(engine, f"n{k}", [f"n{j}" for j in range(k)] or None)
    checks = [0]
    before = reads(engine)
    run_all(engine, checks)
    assert len(engine.backend.ids(State.COMPLETED)) == n
    assert checks[0] <= 4 * n, checks  # each waiter is woken about once: not once per filing
    assert reads(engine) - before <= 8 * n, reads(engine) - before


def test_dependants_arriving_later_read_each_edge_once_at_most(engine: Engine) -> None:
    """A dependant that arrives after its dependencies completed reads each of them once (a
    completion remembered from before it came is not believed: item 1), then never again."""
    n = 60
    for k in range(n):
        drop(engine, f"n{k}")
        finish(engine, f"n{k}")
    drop(engine, "late", [f"n{k}" for k in range(n)] + ["open"])
    drop(engine, "open")
    before = reads(engine)
    for _ in range(20):  # rechecks (rescans) of a waiter read its one unfinished dependency
        assert verdict(engine, "late").on == frozenset({"open"})
    assert reads(engine) - before <= n + 2 * 20, reads(engine) - before


def test_a_wait_names_the_first_unfinished_and_waits_for_the_last(engine: Engine) -> None:
    for i in range(10):
        drop(engine, f"m{i}")
    drop(engine, "r", [f"m{i}" for i in range(10)])
    held = verdict(engine, "r")
    assert held.action == "wait" and held.on == frozenset({"m9"}), held
    assert held.reason == "waiting for dependency m0 (pending), then 9 more"
    finish(engine, "m0")
    finish(engine, "m9")
    held = verdict(engine, "r")  # a rescan: m0 read completed, m1 is next; m9 is done
    assert held.reason == "waiting for dependency m1 (pending), then 8 more"
    assert held.on == frozenset({"m1"}), held


def test_a_missing_or_failed_dependency_fails_at_the_first_check(engine: Engine) -> None:
    drop(engine, "slow")
    drop(engine, "bad")
    finish(engine, "bad", State.FAILED)
    drop(engine, "a", ["slow", "nosuch", "other"])
    drop(engine, "b", ["slow", "bad", "other2"])
    drop(engine, "other")
    drop(engine, "other2")
    missing, failed = verdict(engine, "a"), verdict(engine, "b")
    assert missing.action == "fail" and "a depends on nosuch, which does not exist" in \
        missing.reason, missing
    assert failed.action == "fail" and "b depends on bad, which" in failed.reason \
        and "retry bad first" in failed.reason, failed


# ---------------------------------------------------------------- 3: archived dependencies
def test_an_archived_completed_dependency_is_completed(tmp_path: Path) -> None:
    """`handoff archive`d after it completed: `create --depends-on` takes it and a dropped
    dependant runs. Archived after it failed, or purged: missing, as before."""
    ws = new_workspace(tmp_path / "ws", FLAKY_TOML)
    try:
        ws.create("--to", "@flaky", "--id", "gone1", "--data", '{"mode": "ok"}')
        ws.handoffd("run")
        assert "purged completed/gone1" in ws.handoff("purge", "--older-than", "0s").stdout
        ws.create("--to", "@flaky", "--id", "dep1", "--data", '{"mode": "ok"}')
        ws.create("--to", "@flaky", "--id", "bad1", "--data", '{"mode": "permanent"}')
        ws.handoffd("run")
        archived = ws.handoff("archive", "--older-than", "0s", check=True).stdout
        assert "dep1" in archived and "bad1" in archived and ws.state_of("dep1") == []

        made = ws.handoff("create", "--to", "@flaky", "--id", "after1", "--depends-on", "dep1",
                          "--data", '{"mode": "ok"}')
        assert made.returncode == 0, made.stderr
        for name, deps in (("after2", ["dep1"]), ("after3", ["dep1", "gone1"])):
            ws.drop(f"{name}.json", {"handoff_id": name, "source": {"agent_id": "@o"},
                                     "target": {"agent_id": "@flaky"}, "input": {"data": {}},
                                     "depends_on": deps})
        for dep in ("bad1", "gone1"):
            refused = ws.handoff("create", "--to", "@flaky", "--depends-on", dep, "--data", "1")
            assert refused.returncode == 1 and REMOVED in refused.stderr, refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1
        ws.handoffd("run")
        assert ws.state_of("after1") == ["completed"] and ws.state_of("after2") == ["completed"]
        assert ws.state_of("after3") == ["failed"]
        error = ws.doc("after3")["error"]
        assert error["code"] == "DEPENDENCY_MISSING" and f"gone1, {REMOVED}" in error["message"]
    finally:
        ws.cleanup()


def test_the_archive_index_reads_a_file_once_until_it_changes(tmp_path: Path,
                                                              monkeypatch: Any) -> None:
    from handoffd.features.archive import append_archive
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    clock = Clock()
    append_archive(ws, [(State.COMPLETED, "a", {"x": 1}), (State.FAILED, "b", {}),
                        (State.FAILED, "c", {}), (State.COMPLETED, "c", {})], clock())
    reads_of: list[str] = []
    index = archived_ids.ArchiveIndex(ws)
    real = index.read

    def counted(path: Path) -> dict[str, str]:
        reads_of.append(path.name)
        return real(path)
    monkeypatch.setattr(index, "read", counted)
    assert index.completed("a") and index.completed("c")  # c: its last entry completed
    assert not index.completed("b") and not index.completed("nosuch")
    assert reads_of == ["2026-11-24.jsonl.gz"]  # the misses looked at the folder: unchanged
    append_archive(ws, [(State.COMPLETED, "b", {})], clock())  # b retried, completed, archived
    clock.advance(timedelta(days=1).total_seconds())
    append_archive(ws, [(State.COMPLETED, "d", {})], clock())
    assert index.completed("b") and index.completed("d") and index.completed("a")
    assert sorted(reads_of) == ["2026-11-24.jsonl.gz", "2026-11-24.jsonl.gz",
                                "2026-11-25.jsonl.gz"]


def test_the_archive_index_takes_the_newest_file_of_a_day_last(tmp_path: Path) -> None:
    """A day's files go DATE, DATE-1, DATE-2 (a torn tail starts the next one): the newest
    entry of an id is in the highest, though by name DATE-1 sorts before DATE."""
    import gzip
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    folder = ws.handoffs / ".archive"
    folder.mkdir()
    for name, state in (("2026-11-24.jsonl.gz", "failed"), ("2026-11-24-1.jsonl.gz", "completed"),
                        ("2026-11-23.jsonl.gz", "failed")):
        line = '{"id": "e", "state": "%s", "archived_at": "x", "document": {}}\n' % state
        (folder / name).write_bytes(gzip.compress(line.encode()))
    assert archived_ids.ArchiveIndex(ws).completed("e")
