"""`handoffd mcp` end to end with the official MCP SDK's own client over stdio, against a real
daemon: an agent creates a handoff, a specialist completes it, the agent waits and reads the
result; a clarification round trip; a cancellation; errors carry handoffd's codes; the formats'
schemas are resources."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, Workspace, exe

mcp = pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")

ASKER = """
def asker(doc, ctx):
    if not ctx.clarifications:
        return {"status": "needs_clarification", "questions": ["Which language?"]}
    return {"status": "completed", "output": {"language": ctx.clarifications[-1]["answer"]}}
"""


def call_result(result: Any) -> Any:
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


async def scenario(root: Path) -> dict[str, Any]:
    from mcp import Client, StdioServerParameters

    seen: dict[str, Any] = {}
    params = StdioServerParameters(command=exe("handoffd"),
                                   args=["mcp", "--root", str(root), "--as", "@planner"])
    async with Client(params, read_timeout_seconds=60) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        seen["tools"] = tools
        made = call_result(await client.call_tool(
            "create_handoff", {"to": "@flaky", "data": {"mode": "ok", "n": 7}}))
        seen["done"] = call_result(await client.call_tool(
            "wait_handoff", {"handoff_id": made["id"], "timeout": 30}))
        asked = call_result(await client.call_tool("create_handoff", {"to": "@asker", "data": {}}))
        seen["asks"] = call_result(await client.call_tool(
            "wait_handoff", {"handoff_id": asked["id"], "timeout": 30}))
        call_result(await client.call_tool("answer_handoff",
                                           {"handoff_id": asked["id"], "answer": "rust"}))
        seen["answered"] = call_result(await client.call_tool(
            "wait_handoff", {"handoff_id": asked["id"], "timeout": 30}))
        slow = call_result(await client.call_tool(
            "create_handoff", {"to": "@flaky", "data": {"mode": "sleep", "seconds": 60}}))
        await asyncio.sleep(0.5)
        call_result(await client.call_tool("cancel_handoff", {"handoff_id": slow["id"]}))
        seen["cancelled"] = call_result(await client.call_tool(
            "wait_handoff", {"handoff_id": slow["id"], "timeout": 30}))
        missing = await client.call_tool("get_handoff", {"handoff_id": "nope"})
        seen["missing"] = (missing.is_error, missing.content[0].text)
        resources = await client.list_resources()
        seen["resources"] = {str(r.uri) for r in resources.resources}
        schema = await client.read_resource("handoffd://schemas/native.request.schema.json")
        seen["schema"] = json.loads(schema.contents[0].text)
    return seen


def test_an_agent_works_the_queue_over_mcp(ws: Workspace, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mcp_handlers.py").write_text(ASKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ws.write_config(FLAKY_TOML + '\n[specialists."@asker"]\nhandler = "mcp_handlers:asker"\n')
    daemon = ws.serve()
    try:
        seen = asyncio.run(asyncio.wait_for(scenario(ws.root), 120))
    finally:
        assert ws.stop(daemon) == 0
    assert {"create_handoff", "wait_handoff", "get_handoff", "list_handoffs", "cancel_handoff",
            "answer_handoff", "retry_handoff", "get_context", "set_context",
            "trace_handoff"} <= seen["tools"]
    done = seen["done"]
    assert done["ok"] and done["state"] == "completed"
    assert done["document"]["output"] == {"echo": {"mode": "ok", "n": 7}}
    assert done["document"]["source"]["agent_id"] == "@planner"
    assert seen["asks"]["state"] == "pending" and seen["asks"]["asks"]["questions"] == ["Which language?"]
    assert seen["answered"]["ok"] and seen["answered"]["document"]["output"] == {"language": "rust"}
    assert seen["cancelled"]["state"] == "failed"
    assert seen["cancelled"]["error"]["code"] == "CANCELLED"
    assert seen["missing"][0] and "NOT_FOUND: no handoff nope" in seen["missing"][1]
    assert "handoffd://schemas/hi_moe.message.schema.json" in seen["resources"]
    assert seen["schema"]["required"] == ["handoff_id", "target"]


def test_streamable_http(ws: Workspace) -> None:
    """`handoffd mcp --http HOST:PORT`: the same tools over streamable HTTP (loopback only)."""
    import socket
    import subprocess
    import time

    from mcp import Client

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(ws.root), "--http",
                               f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None and time.monotonic() < deadline, server.stderr
            time.sleep(0.05)

        async def talk() -> tuple[Any, Any]:
            async with Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=30) as client:
                made = call_result(await client.call_tool(
                    "create_handoff", {"to": "@flaky", "handoff_id": "over-http",
                                       "data": {"mode": "ok"}}))
                rows = call_result(await client.call_tool("list_handoffs", {"state": "pending"}))
                return made, rows

        made, rows = asyncio.run(asyncio.wait_for(talk(), 60))
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert made == {"id": "over-http"} and [r["id"] for r in rows["handoffs"]] == ["over-http"]
