"""`handoffd mcp` after the fourteenth review: cancelled waits end their threads, and the wait
caps count threads, not callers; every tool error is one line that starts with a code (wrong
argument types, a whole document with options it would drop, refused transitions, context keys
that clash, a deleted workspace); a request holding a huge integer is answered with its id; bad
start-up values exit with one line. JSON-RPC by hand over stdio (tests/test_mcp_hostile.py's
Server), every read bounded; the wait caps also in-process."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest
from conftest import exe, wait_until
from test_mcp_hostile import Server

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")

CODED = re.compile(r"^Error executing tool \w+: [A-Z_]+: [^\n]+$")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    served = Server(root)  # no daemon: what it creates stays pending
    yield served
    if served.proc.poll() is None:
        served.proc.kill()
        served.proc.wait(10)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


# ---------------------------------------------------------------- 1: wait threads
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_cancelled_wait_ends_its_thread(server: Server) -> None:
    """Each cancelled wait_handoff left a thread waiting out its hour, no longer counted: they
    grew without bound and the 200-wait cap never applied."""
    server.tool(1, "create_handoff", {"to": "@nobody", "data": 1, "handoff_id": "p1"})
    assert json.loads(server.text(1))["id"] == "p1"
    before = threads_of(server.proc.pid)
    for n in range(100, 160):
        server.tool(n, "wait_handoff", {"handoff_id": "p1", "timeout": 3600})
        server.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": n}})
    server.tool(2, "get_handoff", {"handoff_id": "p1"})  # (answered after the 60 above are in)
    assert json.loads(server.text(2))["state"] == "pending"
    wait_until(lambda: threads_of(server.proc.pid) <= before + 2, 20,
               "the cancelled waits' threads to end")
    assert server.proc.stdin is not None
    server.proc.stdin.close()
    assert server.proc.wait(15) == 0


def test_the_cap_counts_live_threads_and_a_stop_ends_them() -> None:
    """In-process: a wait whose caller is cancelled is stopped at once and counts until its
    thread has ended; past the cap (or a session's share) a wait is BUSY."""
    from mcp.server.mcpserver.exceptions import ToolError

    from handoffd.service.mcp_waits import Waits
    from handoffd.service.waiting import WaitStop
    ended = threading.Event()

    def wait(seconds: float, stop: WaitStop) -> str:
        woke = threading.Event()
        stop.watch(woke)
        woke.wait(seconds)
        ended.set()
        return "stopped" if stop.is_set() else "timed out"

    async def scenario() -> None:
        waits = Waits(limit=3, per_session=2)
        first = asyncio.ensure_future(waits.run(wait, 30, session="a"))
        second = asyncio.ensure_future(waits.run(wait, 30, session="a"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        with pytest.raises(ToolError, match="BUSY: this session has 2 waits"):
            await waits.run(wait, 30, session="a")
        other = asyncio.ensure_future(waits.run(wait, 30, session="b"))  # another client's
        await asyncio.sleep(0)
        with pytest.raises(ToolError, match="BUSY: 3 waits are in progress"):
            await waits.run(wait, 30, session="c")
        for task in (first, second, other):
            task.cancel()
        await asyncio.gather(first, second, other, return_exceptions=True)
        for _ in range(1000):  # (bounded: each thread ends as soon as it is woken)
            if waits.running == 0:
                break
            await asyncio.sleep(0.01)
        assert waits.running == 0 and ended.is_set()

    asyncio.run(asyncio.wait_for(scenario(), 30))


# ---------------------------------------------------------------- 2, 8, 9: refusals
def test_a_whole_document_with_options_is_refused(server: Server) -> None:
    doc = {"handoff_id": "d1", "source": {"agent_id": "@me"}, "target": {"agent_id": "@x"},
           "input": {"data": {}}}
    server.tool(1, "create_handoff", {"document": doc, "priority": "critical",
                                      "depends_on": ["dep"], "objective": "why"})
    said = server.error(1)
    assert CODED.match(said) and "USAGE_ERROR: " in said and "priority" in said, said
    server.tool(2, "create_handoff", {"document": doc, "handoff_id": "other"})
    assert "USAGE_ERROR: " in server.error(2)
    server.tool(3, "get_handoff", {"handoff_id": "d1"})
    assert "NOT_FOUND: " in server.error(3)  # nothing was filed


def test_an_empty_handoff_id_is_refused(server: Server) -> None:
    server.tool(1, "create_handoff", {"to": "@x", "data": 1, "handoff_id": ""})
    assert "UNSAFE_ID: " in server.error(1)
    server.tool(2, "create_handoff", {"to": "@x", "data": 1, "handoff_id": "",
                                      "if_absent": True})
    assert "UNSAFE_ID: " in server.error(2)


def test_refused_answers_and_retries_say_invalid_transition(server: Server) -> None:
    server.tool(1, "create_handoff", {"to": "@x", "data": 1, "handoff_id": "base"})
    server.text(1)
    server.tool(2, "answer_handoff", {"handoff_id": "base", "answer": 1})
    assert "INVALID_TRANSITION: handoff base is pending" in server.error(2)
    server.tool(3, "cancel_handoff", {"handoff_id": "base"})
    server.text(3)
    server.tool(4, "retry_handoff", {"handoff_id": "base"})
    said = server.error(4)
    assert "INVALID_TRANSITION: " in said and "force: true" in said and "--force" not in said


# ---------------------------------------------------------------- 3, 4: coded, one line
def test_wrong_typed_arguments_are_one_coded_line(server: Server) -> None:
    calls = [("create_handoff", {"to": 5, "data": 1}, "to"),
             ("get_handoff", {"handoff_id": None}, "handoff_id"),
             ("list_handoffs", {"limit": 1.5}, "limit"),
             ("cancel_handoff", {"handoff_id": "x", "cascade": "x"}, "cascade")]
    for n, (tool, arguments, field) in enumerate(calls, 1):
        server.tool(n, tool, arguments)
        said = server.error(n)
        assert CODED.match(said), said
        assert f": USAGE_ERROR: {field}: " in said, said


def test_an_unknown_tool_is_a_coded_usage_error(server: Server) -> None:
    """Found by review 14g: an unknown tool's error was the SDK's bare "Unknown tool: nope"."""
    server.tool(1, "nope", {})
    assert server.error(1) == "Error executing tool nope: USAGE_ERROR: no tool 'nope'"
    server.tool(2, "a\nb" + "x" * 200, {})
    said = server.error(2)
    assert said.startswith("Error executing tool a b") and "\n" not in said, said
    assert ": USAGE_ERROR: no tool 'a\\nb" in said and len(said) < 300, said


def test_context_keys_that_clash_are_coded(server: Server) -> None:
    server.tool(1, "set_context", {"key": "x", "value": 1})
    server.text(1)
    server.tool(2, "set_context", {"key": "x.json/y", "value": 2})
    said = server.error(2)
    assert CODED.match(said) and "INVALID_CONTEXT_KEY: " in said, said
    server.tool(3, "get_context", {"key": "x.json/y"})
    assert "NOT_FOUND: " in server.error(3)
    server.tool(4, "set_context", {"key": "a.json/b", "value": 1})
    server.text(4)
    server.tool(5, "set_context", {"key": "a", "value": 2})
    assert "INVALID_CONTEXT_KEY: " in server.error(5)
    server.tool(6, "get_context", {"key": "a"})  # (review 14g: it said NOT_A_REGULAR_FILE)
    assert server.error(6) == "Error executing tool get_context: NOT_FOUND: context key 'a' " \
        "is not set"
    assert "Traceback" not in server.log.read_text()


def test_a_deleted_workspace_is_one_coded_line(server: Server, tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "ws" / "handoffs")  # (its stderr log stays: it is in ws/)
    server.tool(1, "create_handoff", {"to": "@x", "data": 1})
    said = server.error(1)
    assert CODED.match(said), said
    assert "Traceback" not in server.log.read_text()


# ---------------------------------------------------------------- 5: a huge integer
def test_a_huge_integer_keeps_the_request_id(server: Server) -> None:
    assert server.proc.stdin is not None
    line = ('{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"get_handoff",'
            '"arguments":{"handoff_id":"zz","x":%s}}}' % ("9" * 4301))
    server.proc.stdin.write(line.encode() + b"\n")
    server.proc.stdin.flush()
    found = server.reply(7, 30)
    assert found is not None and found["error"]["code"] == -32602, found
    assert None not in server.replies  # (it was answered with id null)


# ---------------------------------------------------------------- 6, 10: start-up
def start(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "mcp", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_bad_start_up_values_are_one_line(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    for args, code in ((["--as", ""], 2), (["--http", "nohost.invalid:8765"], 2),
                       (["--http", "::1:8765"], 2)):
        done = start(root, *args)
        assert done.returncode == code, (args, done)
        assert len(done.stderr.splitlines()) == 1 and "error:" in done.stderr, done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = start(root, "--http", f"127.0.0.1:{port}")
    assert done.returncode == 1, done
    assert len(done.stderr.splitlines()) == 1 and "cannot listen" in done.stderr, done.stderr


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_bracketed_ipv6_address_is_served(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root), "--http",
                             f"[::1]:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        def listening() -> bool:
            assert proc.poll() is None, proc.communicate()
            with socket.socket(socket.AF_INET6) as probe:
                return probe.connect_ex(("::1", port)) == 0
        wait_until(listening, 30, "the server to listen on [::1]")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "INFO" not in err and out == "", (out, err)
