"""Session 16 (F9): an unreachable store never fails a valid handoff nor freezes the MCP server.

1. A store outage met while reading a pending handoff (PostgreSQL's StoreUnavailable, an
   OSError) is transient: the handoff stays pending and is looked at again, never set aside.
2. ``wait_handoff`` ends at its timeout with the store away, and never blocks the event loop
   (a ``ping`` meanwhile is answered).
3. A stdio request line over the cap is answered under its own id, read no further than the cap.
4. A scan hook meeting an unreachable store logs one line, not a traceback.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import Clock, memory_engine, wait_until

from handoffd import Daemon, Engine, new_native_request
from handoffd.backends.postgres.connection import StoreUnavailable
from handoffd.core.errors import ErrorCode, UnreadableDocument
from handoffd.core.states import State


def echo(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"echo": ctx.data}}


def create(engine: Engine, handoff_id: str) -> None:
    doc = new_native_request(source="@test", target="@echo", data={"n": handoff_id},
                             now=engine.clock(), handoff_id=handoff_id)
    assert engine.submit(doc) == handoff_id


def state_of(engine: Engine, handoff_id: str) -> State | None:
    """Where ``handoff_id`` stands, None while the store is away."""
    try:
        return engine.get(handoff_id)[0]
    except OSError:
        return None


class Outage:
    """Makes a backend's ``peek`` fail as PostgreSQL's does past its reconnect window (or with
    ``error``), while ``away``."""

    def __init__(self, backend: Any, error: Callable[[], Exception] | None = None) -> None:
        self.away = True
        self.calls = 0
        self.real = backend.peek
        self.error = error or (lambda: StoreUnavailable("the PostgreSQL store is unreachable"))
        backend.peek = self.peek

    def peek(self, handoff_id: str) -> Any:
        self.calls += 1
        if self.away:
            raise self.error()
        return self.real(handoff_id)


# ---------------------------------------------------------------- 1. outages are transient
def test_a_peek_meeting_an_unreachable_store_is_a_transient_problem(tmp_path: Path) -> None:
    engine, backend = memory_engine(tmp_path, Clock(), {"@echo": echo})
    create(engine, "h1")
    outage = Outage(backend)
    peek = engine.peek("h1")
    assert peek is not None and not peek.readable and peek.problem is not None
    assert peek.problem.transient and not peek.problem.claimable
    assert "unreachable" in str(peek.problem) and "\n" not in str(peek.problem)
    # a reader crashing on the document itself is still no passing trouble: set aside
    outage.error = lambda: RuntimeError("the reader choked")
    crashed = engine.peek("h1")
    assert crashed is not None and crashed.problem is not None
    assert not crashed.problem.transient
    assert crashed.problem.code == ErrorCode.UNPROCESSABLE_DOCUMENT
    # and a backend's own verdict on a document is kept as it is
    verdict = UnreadableDocument("bad", handoff_id="h1", code=ErrorCode.NOT_UTF8)
    outage.error = lambda: verdict
    assert engine.peek("h1").problem is verdict  # type: ignore[union-attr]


def test_a_batch_during_an_outage_leaves_valid_handoffs_pending(tmp_path: Path) -> None:
    engine, backend = memory_engine(tmp_path, Clock(), {"@echo": echo})
    for hid in ("h1", "h2", "h3"):
        create(engine, hid)
    outage = Outage(backend)
    report = Daemon(engine, workers=2, watch=False).run_batch(max_seconds=30)
    assert report.error is None
    assert outage.calls >= 3  # each was read, and met the outage
    assert backend.quarantined() == []
    assert {hid: engine.get(hid)[0] for hid in ("h1", "h2", "h3")} == \
        dict.fromkeys(("h1", "h2", "h3"), State.PENDING)
    outage.away = False  # the store is back: the next batch runs them
    assert Daemon(engine, workers=2, watch=False).run_batch(max_seconds=30).error is None
    assert {engine.get(hid)[0] for hid in ("h1", "h2", "h3")} == {State.COMPLETED}


def test_a_document_a_reader_crashes_on_is_still_set_aside(tmp_path: Path) -> None:
    engine, backend = memory_engine(tmp_path, Clock(), {"@echo": echo})
    create(engine, "h1")
    Outage(backend, error=lambda: RuntimeError("the reader choked"))
    assert Daemon(engine, workers=2, watch=False).run_batch(max_seconds=30).error is None
    assert [q["code"] for q in backend.quarantined()] == [ErrorCode.UNPROCESSABLE_DOCUMENT]


def test_a_real_postgres_outage_during_a_read_sets_nothing_aside(
        tmp_path: Path, pg_url: str, pg_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database goes away exactly as the scheduler reads a pending handoff and comes back
    after two failed reads (the second, before the fix, was the one that set it aside)."""
    from test_postgres_hostile import cut_off

    from handoffd import Registry, Workspace, build_engine
    from handoffd.backends.postgres import PostgresBackend
    from handoffd.core.config import Config, DaemonSettings
    from handoffd.service import dispatch
    monkeypatch.setattr(dispatch, "RETRY_LOOK_SECONDS", 0.2)
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=30, rescan_seconds=30))
    registry = Registry()
    registry.add_function("@echo", echo, config=config)
    store = PostgresBackend(pg_url, reconnect_seconds=0.5)
    engine = build_engine(ws, config, registry, backend=store)
    create(engine, "h1")
    real, failed = store.peek, []

    def peek(handoff_id: str) -> Any:
        if len(failed) < 2:
            cut_off(pg_server, pg_url, allowed=False)
            try:
                return real(handoff_id)
            except OSError as exc:
                failed.append(exc)
                raise
            finally:
                if len(failed) >= 2:
                    cut_off(pg_server, pg_url, allowed=True)
        return real(handoff_id)

    store.peek = peek  # type: ignore[method-assign]
    daemon = Daemon(engine, workers=2, watch=False)
    ready = threading.Event()
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False,
                                                           "ready": ready.set})
    thread.start()
    try:
        assert ready.wait(30)
        wait_until(lambda: state_of(engine, "h1") is State.COMPLETED, 60, "h1 completed")
        assert store.quarantined() == []
    finally:
        daemon.stop()
        thread.join(timeout=60)
        cut_off(pg_server, pg_url, allowed=True)
        store.close()
    assert len(failed) == 2 and all(isinstance(e, StoreUnavailable) for e in failed)


# ---------------------------------------------------------------- 4. scan hooks
def test_a_scan_hook_meeting_an_unreachable_store_logs_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    from handoffd.service.hooks import Hooks
    hooks = Hooks()

    def look() -> None:
        raise StoreUnavailable("the PostgreSQL store x is unreachable: no\nconnection")

    def buggy() -> None:
        raise KeyError("a bug")

    hooks.scan_hooks += [look, buggy]
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        hooks.scanning()
    away, bug = caplog.records
    assert away.exc_info is None and "\n" not in away.getMessage()
    assert "unreachable" in away.getMessage() and "will try again" in away.getMessage()
    assert bug.exc_info is not None  # a real bug keeps its traceback


# ---------------------------------------------------------------- 2. wait_handoff, store away
def test_a_wait_whose_last_look_meets_the_store_away_ends_as_its_timeout() -> None:
    from contextlib import contextmanager

    from handoffd.core.errors import WaitTimeout
    from handoffd.service.mcp_waits import LOOK_SECONDS, wait_then_look
    from handoffd.service.waiting import WaitStop
    bounded: list[float] = []

    class Away:
        @contextmanager
        def waiting(self, handoff_id: str, timeout: float) -> Any:
            bounded.append(timeout)
            try:
                yield
            except StoreUnavailable as exc:  # as PostgreSQL's waiting() says it
                raise WaitTimeout(f"handoff {handoff_id}: no answer within {timeout:g}s: "
                                  f"{exc}") from None

    def timed_out(seconds: float, stop: WaitStop) -> Any:
        raise WaitTimeout("handoff p1: no answer within 3s")

    def look() -> Any:
        raise StoreUnavailable("the PostgreSQL store x is unreachable")

    with pytest.raises(WaitTimeout) as caught:
        wait_then_look(timed_out, look, Away(), "p1")(3.0, WaitStop())
    assert bounded == [LOOK_SECONDS]
    assert str(caught.value) == ("handoff p1: no answer within 3s, and where it stands cannot be "
                                 "read now: the PostgreSQL store x is unreachable")
    # a readable store: the wait's answer is where it stands
    assert wait_then_look(timed_out, lambda: "pending", Away(), "p1")(3.0, WaitStop()) == \
        "pending"


def test_mcp_wait_ends_at_its_timeout_and_pings_are_answered_with_the_store_away(
        tmp_path: Path, pg_url: str, pg_server: Any) -> None:
    """The store's reconnect window (120 s) outlasts every bounded read below: before the fix
    the wait's last look blocked the event loop for all of it."""
    from test_mcp_hostile import Server
    from test_postgres_hostile import cut_off
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    (root / "handoffd.toml").write_text(f'[store]\nurl = "{pg_url}"\nreconnect_seconds = 120\n')
    server = Server(root)
    try:
        server.tool(1, "create_handoff", {"to": "@nobody", "data": 1, "handoff_id": "p1"})
        assert json.loads(server.text(1))["id"] == "p1"
        cut_off(pg_server, pg_url, allowed=False)
        server.tool(2, "wait_handoff", {"handoff_id": "p1", "timeout": 1})
        said = server.error(2, 30)
        assert said.startswith("Error executing tool wait_handoff: WAIT_TIMEOUT: handoff p1: no "
                               "answer within 1s"), said
        assert "unreachable" in said and "\n" not in said
        server.tool(3, "wait_handoff", {"handoff_id": "p1", "timeout": 1})
        deadline = time.monotonic() + 30
        while 3 not in server.replies and time.monotonic() < deadline:  # pings meanwhile
            server.send({"jsonrpc": "2.0", "id": "ping", "method": "ping"})
            assert server.reply("ping", 10) is not None, "a ping went unanswered"  # type: ignore[arg-type]
            del server.replies["ping"]
        assert server.error(3, 1).count("WAIT_TIMEOUT") == 1
        cut_off(pg_server, pg_url, allowed=True)  # back: the wait says where it stands
        server.tool(4, "wait_handoff", {"handoff_id": "p1", "timeout": 0.5})
        assert json.loads(server.text(4, 60))["state"] == "pending"
    finally:
        cut_off(pg_server, pg_url, allowed=True)
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


# ---------------------------------------------------------------- 3. stdio lines over the cap
def high_water_kib(pid: int) -> int:
    """The peak resident memory of process ``pid`` (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM in /proc")
def test_a_stdio_line_over_the_cap_is_answered_under_its_id_and_never_held_whole(
        tmp_path: Path) -> None:
    from test_mcp_hostile import Server

    from handoffd.service.mcp_stdio import MAX_LINE_CHARS
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    server = Server(root)
    try:
        before = high_water_kib(server.proc.pid)
        size = 8 * MAX_LINE_CHARS  # (128 MiB: held whole, the peak grew by more than that)
        head = b'{"jsonrpc": "2.0", "id": 41, "method": "tools/call", "params": {"name": ' \
               b'"get_handoff", "arguments": {"handoff_id": "'
        assert server.proc.stdin is not None
        server.proc.stdin.write(head)
        chunk = b"x" * (1 << 20)
        for _ in range(size >> 20):
            server.proc.stdin.write(chunk)
        server.proc.stdin.write(b'"}}}\n')
        server.proc.stdin.flush()
        answer = server.reply(41, 60)
        assert answer is not None, "the long line was not answered under its id"
        assert answer["error"]["code"] == -32600
        assert str(MAX_LINE_CHARS) in answer["error"]["message"]
        server.send({"jsonrpc": "2.0", "id": 42, "method": "ping"})  # the next line: whole
        assert server.reply(42, 30) is not None
        grown = high_water_kib(server.proc.pid) - before
        assert grown < 4 * MAX_LINE_CHARS // 1024, f"peak memory grew by {grown} KiB"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_the_id_of_a_long_line_is_found_near_its_start() -> None:
    from handoffd.service.mcp_stdio import scan_id
    assert scan_id('{"jsonrpc": "2.0", "id": 7, "params": {"x": "') == 7
    assert scan_id('{"params": {"id": 3}, "id": "s\\"1", "x": "') == 's"1'
    assert scan_id('{"i\\u0064": -5, "x": "') == -5
    assert scan_id('{"x": "id", "id": true, "y": "') is None  # (no id a reply can carry)
    assert scan_id('[{"id": 1}, {"') is None  # (a batch)
    assert scan_id('{"id": 12') is None  # (cut short: 12 may be 123)
    assert scan_id('{"method": "x", "params": {"a": "') is None
    assert scan_id('{"id": ' + "9" * 5_000 + ",") is None
