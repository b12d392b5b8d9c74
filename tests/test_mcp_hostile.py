"""`handoffd mcp` against a hostile or greedy client (found by the second bug hunt): a NaN timeout
waited for ever and kept the server alive after its client left; a few dozen long waits starved
every later call. JSON-RPC written by hand over the server's stdio, every read bounded."""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import exe

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")


class Server:
    """A `handoffd mcp` process and the replies it has sent, by request id."""

    def __init__(self, root: Path) -> None:
        self.log = root / "mcp.err"  # what the server wrote on stderr
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log)
        self.replies: dict[Any, dict[str, Any]] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}})
        assert self.reply(0, 30) is not None
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            self.replies[message.get("id")] = message

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def tool(self, request_id: int, name: str, arguments: dict[str, Any]) -> None:
        self.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                   "params": {"name": name, "arguments": arguments}})

    def reply(self, request_id: int, seconds: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if request_id in self.replies:
                return self.replies[request_id]
            time.sleep(0.02)
        return None

    def text(self, request_id: int, seconds: float = 30) -> str:
        found = self.reply(request_id, seconds)
        assert found is not None, f"no reply to {request_id} within {seconds}s"
        return str(found["result"]["content"][0]["text"])

    def error(self, request_id: int, seconds: float = 30) -> str:
        """The text of a tool error (the call's result says isError)."""
        found = self.reply(request_id, seconds)
        assert found is not None, f"no reply to {request_id} within {seconds}s"
        assert found["result"].get("isError") is True, found
        return str(found["result"]["content"][0]["text"])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    (root / "handoffd.toml").write_text('[specialists."@echo"]\ncommand = ["cat"]\n')
    served = Server(root)  # no daemon: what it creates stays pending
    yield served
    if served.proc.poll() is None:
        served.proc.kill()
    served.proc.wait(10)


def test_a_timeout_that_is_not_a_number_is_refused(server: Server) -> None:
    server.tool(1, "create_handoff", {"to": "@echo", "data": {}})
    handoff_id = json.loads(server.text(1))["id"]
    server.tool(2, "wait_handoff", {"handoff_id": handoff_id, "timeout": "nan"})
    said = server.text(2, 10)  # it used to wait for ever
    assert "USAGE_ERROR: timeout must be a number" in said, said
    assert server.proc.stdin is not None
    server.proc.stdin.close()
    assert server.proc.wait(15) == 0  # and the client's leaving ends the server


def test_long_waits_do_not_starve_other_calls(server: Server) -> None:
    server.tool(1, "create_handoff", {"to": "@echo", "data": {}})
    handoff_id = json.loads(server.text(1))["id"]
    for n in range(60):  # each held one of the loop's few pool threads for its whole timeout
        server.tool(100 + n, "wait_handoff", {"handoff_id": handoff_id, "timeout": 600})
    time.sleep(1)
    server.tool(2, "get_handoff", {"handoff_id": handoff_id})
    assert json.loads(server.text(2, 20))["state"] == "pending"
    server.tool(3, "wait_handoff", {"handoff_id": handoff_id, "timeout": 0.5})
    assert json.loads(server.text(3, 20))["finished"] is False
    assert server.proc.stdin is not None
    server.proc.stdin.close()  # 60 waits still open: the server ends all the same
    assert server.proc.wait(15) == 0


def test_every_request_gets_an_answer_even_one_the_sdk_cannot_read(server: Server) -> None:
    """Found by the second bug hunt, left then as upstream's: the SDK's stdio transport dropped
    a request it could not validate without answering it (params given as a string; arguments
    nested past pydantic's recursion limit of 200), and the client waited on that id for ever.
    handoffd's stdio front answers such a request with a JSON-RPC error naming its id."""
    assert server.proc.stdin is not None
    deep = "[" * 300 + "]" * 300
    lines = [
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":"x"}',
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"create_handoff",'
        b'"arguments":{"to":"@echo","data":' + deep.encode() + b"}}}",
        b'{"jsonrpc":"2.0","id":"three","method":"tools/call","params":[1]}',
        b"not json at all",
    ]
    for line in lines:
        server.proc.stdin.write(line + b"\n")
    server.proc.stdin.flush()
    for request_id, code in ((1, -32602), (2, -32602), ("three", -32602), (None, -32700)):
        found = server.reply(request_id, 30)  # type: ignore[arg-type]
        assert found is not None, f"no answer to {request_id!r}"
        assert found["error"]["code"] == code, found
    assert "params: Input should be an object" in server.replies[1]["error"]["message"]
    server.tool(4, "create_handoff", {"to": "@echo", "data": {"after": True}})
    assert json.loads(server.text(4))["id"]  # and the server goes on


# ---------------------------------------------------------------- found by the CLI review
def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def test_get_context_of_an_unset_key_says_not_found(server: Server) -> None:
    """It was a bare "Error executing tool get_context" (no code; `handoff context get` says
    "not set", exit 3), with tracebacks in the server's log."""
    server.tool(1, "get_context", {"key": "nope"})
    assert "NOT_FOUND: context key 'nope' is not set" in server.error(1)
    server.tool(2, "set_context", {"key": "nope", "value": {"n": 1}})
    assert json.loads(server.text(2))["revision"] == 1  # (calls run at once: this one first)
    server.tool(3, "get_context", {"key": "nope"})
    assert json.loads(server.text(3))["value"] == {"n": 1}
    assert "Traceback" not in server.log.read_text(errors="replace")


def test_list_handoffs_refuses_an_unknown_state(server: Server) -> None:
    """An unknown state answered [], as if the queue were empty (`handoff ls`: exit 2)."""
    server.tool(1, "create_handoff", {"to": "@echo", "data": {}, "handoff_id": "one"})
    assert json.loads(server.text(1))["id"] == "one"  # (calls run at once: this one first)
    for n, state in enumerate(("bogus", "Pending"), start=2):
        server.tool(n, "list_handoffs", {"state": state})
        assert "USAGE_ERROR: state must be one of pending" in server.error(n)
    server.tool(9, "list_handoffs", {"state": "pending"})
    assert [r["id"] for r in json.loads(server.text(9))["handoffs"]] == ["one"]


def test_an_argument_a_tool_does_not_take_is_refused(server: Server) -> None:
    """A misspelt argument (``timeot``) meant its default, unsaid: it is USAGE_ERROR, naming
    it and what the tool takes, and nothing is done."""
    server.tool(1, "create_handoff", {"to": "@echo", "data": {}, "handoffid": "meant"})
    said = server.error(1)
    assert "USAGE_ERROR: 'handoffid': no such argument (it takes " in said, said
    assert "handoff_id" in said and "\n" not in said.strip()
    server.tool(2, "list_handoffs", {})
    assert json.loads(server.text(2))["handoffs"] == []  # nothing was created
    server.tool(3, "wait_handoff", {"handoff_id": "x", "timeot": 1})
    assert "USAGE_ERROR: 'timeot': no such argument" in server.error(3)


def test_create_handoff_refuses_what_nests_too_deep(server: Server) -> None:
    """Filed anyway, `handoff show` could not read it back and the daemon set it aside
    (DOCUMENT_TOO_DEEP); `handoff create` refuses the same data with exit 2."""
    document = {"handoff_id": "deep3", "timestamp": "2026-11-26T00:00:00Z",
                "source": {"agent_id": "@mcp"}, "target": {"agent_id": "@echo"},
                "input": {"data": nested(55)}}
    calls = [({"to": "@echo", "handoff_id": "deep1", "data": nested(55)}, "data nests more than 54"),
             ({"to": "@echo", "handoff_id": "deep2", "data": nested(55), "objective": "x"},
              "data nests more than 54"),
             ({"document": document}, "document nests more than 56")]
    for n, (arguments, said) in enumerate(calls, start=1):
        server.tool(n, "create_handoff", arguments)
        assert f"USAGE_ERROR: {said} levels deep" in server.error(n)
    server.tool(8, "create_handoff", {"to": "@echo", "handoff_id": "ok", "data": nested(54)})
    assert json.loads(server.text(8))["id"] == "ok"  # the deepest that reads back
    server.tool(9, "get_handoff", {"handoff_id": "ok"})
    assert json.loads(server.text(9))["document"]["input"]["data"] == nested(54)
    server.tool(10, "list_handoffs", {})
    assert [r["id"] for r in json.loads(server.text(10))["handoffs"]] == ["ok"]
