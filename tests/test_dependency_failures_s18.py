"""A dependency that fails fails its waiters at once, wherever it is in their lists.

A waiter's check walks its dependencies in order up to the first unfinished one and waits for
one filing only (that one's, or the last one's: see :mod:`handoffd.features.dependencies`). Before
session 18, another of its dependencies failing woke nothing: with ``depends_on = [B, A]``, A a
long job and B failing a second later, the waiter sat in pending/ until A finished (or the
five-minute re-check) to be failed for B then. Now a filing into failed/ of any dependency the
wait watches (``Verdict.fails_on``) wakes it, and the gate reads that dependency again before it
believes it failed.
"""
from __future__ import annotations

from pathlib import Path

from conftest import FLAKY_TOML, new_workspace, wait_until
from test_dependencies_s16 import drop, engine, finish, graph_of, reads, verdict  # noqa: F401

from handoffd import Engine, State
from handoffd.core.hooks import Verdict
from handoffd.features.dependencies import WATCHED_FAILURES
from handoffd.service.report import BatchReport
from handoffd.service.scheduler import Scheduler


def test_a_wait_watches_its_other_dependencies_for_failures(engine: Engine) -> None:
    for hid in ("b", "m", "a"):
        drop(engine, hid)
    drop(engine, "w", ["b", "m", "a"])
    held = verdict(engine, "w")
    assert held.action == "wait" and held.on == frozenset({"a"}), held  # the last one
    assert held.fails_on == ("b", "m")  # the first unfinished one, and the middle


def test_a_first_dependency_failing_fails_the_waiter_held_for_the_last(engine: Engine) -> None:
    drop(engine, "b")
    drop(engine, "a")
    drop(engine, "w", ["b", "a"])
    held = verdict(engine, "w")
    assert held.on == frozenset({"a"}) and held.fails_on == ("b",), held
    finish(engine, "b", State.FAILED)
    graph_of(engine).filed("b", State.FAILED)  # (the daemon's listener, as after a filing)
    failed = verdict(engine, "w")
    assert failed.action == "fail" and "w depends on b, which" in failed.reason, failed


def test_a_middle_dependency_failing_is_read_again_and_fails_the_waiter(engine: Engine) -> None:
    for hid in ("b", "m", "a"):
        drop(engine, hid)
    drop(engine, "w", ["b", "m", "a"])
    assert verdict(engine, "w").action == "wait"
    finish(engine, "m", State.FAILED)
    graph_of(engine).filed("m", State.FAILED)
    before = reads(engine)
    failed = verdict(engine, "w")
    assert failed.action == "fail" and "w depends on m, which" in failed.reason, failed
    assert reads(engine) > before  # the hint was read again, not believed


def test_a_failure_hint_that_no_longer_holds_is_dropped(engine: Engine) -> None:
    """A dependency filed into failed/ and then retried (pending again): the waiter waits on,
    and the hint goes (a retry's filing into pending/ drops it too)."""
    for hid in ("b", "m", "a"):
        drop(engine, hid)
    drop(engine, "w", ["b", "m", "a"])
    assert verdict(engine, "w").action == "wait"
    graph = graph_of(engine)
    graph.filed("m", State.FAILED)  # (noted, but m is still pending in the store)
    held = verdict(engine, "w")
    assert held.action == "wait" and "m" not in graph.failed, held
    graph.filed("m", State.FAILED)
    graph.filed("m", State.PENDING)  # retried
    assert "m" not in graph.failed


def test_a_failure_before_the_waiters_first_check_is_not_a_hint_for_it(engine: Engine) -> None:
    """The first check reads every dependency; a hint older than it is not looked at (a
    retried-and-running dependency would otherwise be read again at every check)."""
    drop(engine, "m")
    graph_of(engine).filed("m", State.FAILED)  # an earlier life of m, retried since
    drop(engine, "b")
    drop(engine, "a")
    engine.clock.advance(1)  # type: ignore[attr-defined]
    drop(engine, "w", ["b", "m", "a"])
    assert verdict(engine, "w").action == "wait"
    before = reads(engine)
    assert verdict(engine, "w").action == "wait"
    assert reads(engine) - before == 2  # b (the first unfinished) and a (the last): not m


def test_only_so_many_later_dependencies_are_watched(engine: Engine) -> None:
    deps = [f"d{i}" for i in range(WATCHED_FAILURES + 10)]
    for hid in deps:
        drop(engine, hid)
    drop(engine, "w", deps)
    held = verdict(engine, "w")
    assert held.on == frozenset({deps[-1]})
    assert len(held.fails_on) == WATCHED_FAILURES + 1  # the first, and WATCHED_FAILURES after
    assert deps[-2] not in held.fails_on


def test_the_scheduler_wakes_a_waiter_at_a_watched_failure_only(tmp_path: Path,
                                                                engine: Engine) -> None:
    scheduler = Scheduler(engine, BatchReport(), workers=1)
    verdict_ = Verdict.wait("waiting for dependency b (pending)", on=["a"], fails_on=["b"])
    assert verdict_.fails_on == ("b",)
    scheduler.hold("w", verdict_.reason, verdict_.on, verdict_.fails_on)
    scheduler.ended("b")  # b completed: the wait for a goes on
    assert "w" in scheduler.waiting
    scheduler.ended("x", failed=True)  # not one of w's
    assert "w" in scheduler.waiting
    scheduler.ended("b", failed=True)
    assert "w" not in scheduler.waiting and "w" not in scheduler.fails_on
    assert "w" in scheduler.queued  # looked at again


def test_serve_fails_a_waiter_when_a_middle_dependency_fails_while_the_others_run(
        tmp_path: Path) -> None:
    """W depends on [A, B, C]: A and C run for a long time; B waits for S, then fails for
    good. W is failed for B as soon as B is filed, while A and C are still running (its
    rescans' re-checks stop at A, the first unfinished one, and look at C, the last)."""
    ws = new_workspace(tmp_path / "ws", FLAKY_TOML)
    try:
        ws.serve()
        for hid in ("A", "C"):
            ws.create("--to", "@flaky", "--id", hid, "--data", '{"mode": "sleep", "seconds": 60}')
        ws.create("--to", "@flaky", "--id", "S", "--data", '{"mode": "sleep", "seconds": 3}')
        ws.create("--to", "@flaky", "--id", "B", "--depends-on", "S",
                  "--data", '{"mode": "permanent"}')
        ws.create("--to", "@flaky", "--id", "W", "--depends-on", "A", "--depends-on", "B",
                  "--depends-on", "C")
        # (held for A while S runs; on a slow machine B may have failed before W's first
        # check, which then fails it at once: the outcome below is the same)
        wait_until(lambda: "waiting for dependency A" in ws.handoff("ls").stdout
                   or ws.state_of("W") == ["failed"], timeout=30, what="W held for A")
        assert ws.wait_state("W", ("failed",), timeout=40) == "failed"
        # A and C still running: W waited for neither
        assert ws.state_of("A") == ["in-progress"] and ws.state_of("C") == ["in-progress"]
        error = ws.doc("W")["error"]
        assert error["code"] == "DEPENDENCY_MISSING" and "depends on B, which" in \
            error["message"], error
        assert "W" not in [r["id"] for r in ws.runs()]
    finally:
        ws.cleanup()
