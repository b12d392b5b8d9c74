"""`handoffd mcp --http`: one client's share of the waits (review 14g). Requests of the
2026-07-28 protocol carry no session id, and a client of the older one opens sessions at will:
capped by session alone, one client held all 200 waits. Waits are capped per peer address too.
A real server over a loopback socket, JSON-RPC by hand; every read bounded."""
from __future__ import annotations

import http.client
import json
import selectors
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import exe, wait_until

from handoffd.service.mcp_waits import MAX_WAITS_PER_SESSION

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")

MODERN = "2026-07-28"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[int]:
    """The port of `handoffd mcp --http` over a workspace holding the pending handoff p1."""
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    subprocess.run([exe("handoff"), "create", "--to", "@nobody", "--data", "1", "--id", "p1",
                    "--root", str(root)], check=True, capture_output=True, timeout=60)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "mcp.err").open("wb")
    proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root), "--http",
                             f"127.0.0.1:{port}"], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            assert proc.poll() is None, (tmp_path / "mcp.err").read_text()
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, 30, "the server to listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def modern_wait(port: int, number: int) -> socket.socket:
    """A socket that sent one wait_handoff of the 2026-07-28 protocol (an hour's timeout)."""
    body = json.dumps({"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": {
        "name": "wait_handoff", "arguments": {"handoff_id": "p1", "timeout": 3600},
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {}}}}).encode()
    head = (f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"accept: application/json, text/event-stream\r\nmcp-protocol-version: {MODERN}\r\n"
            f"mcp-method: tools/call\r\nmcp-name: wait_handoff\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body)
    return sock


def replies_within(socks: list[socket.socket], count: int, seconds: float) -> list[bytes]:
    """What the first ``count`` sockets to answer said (fewer if ``seconds`` pass first)."""
    chooser = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        chooser.register(sock, selectors.EVENT_READ)
    said: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + seconds
    while len([s for s in said.values() if b"jsonrpc" in s]) < count \
            and time.monotonic() < deadline:
        for key, _ in chooser.select(0.2):
            sock: Any = key.fileobj
            said[sock] = said.get(sock, b"") + sock.recv(65536)
    chooser.close()
    return list(said.values())


def legacy_wait(port: int) -> str:
    """A wait_handoff (1 s) in a session of its own on the 2025-06-18 protocol: its reply."""
    def post(body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/mcp", json.dumps(body), {
            "accept": "application/json, text/event-stream",
            "content-type": "application/json", **headers})
        answer = conn.getresponse()
        text, got = answer.read().decode(), dict(answer.getheaders())
        conn.close()
        return text, got
    _, got = post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}, {})
    session = {"mcp-session-id": got["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
    post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    return post({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "wait_handoff", "arguments": {"handoff_id": "p1", "timeout": 1}}}, session)[0]


def test_one_client_holds_at_most_its_share_of_the_waits(served: int) -> None:
    """Found by review 14g: 60 waits of the 2026-07-28 protocol from one address were all
    taken (no session id: no cap); now the ones past the share are BUSY at once, and so is a
    wait in a fresh session of the older protocol from the same address. A client that hangs
    up ends its waits there: its share is free again."""
    extra = 5
    socks = [modern_wait(served, n) for n in range(MAX_WAITS_PER_SESSION + extra)]
    try:
        said = [s for s in replies_within(socks, extra, 30) if b"jsonrpc" in s]
        busy = [s for s in said if b"BUSY: this client (127.0.0.1) has" in s]
        assert len(busy) == extra and len(said) == extra, said
        assert "BUSY: this client (127.0.0.1)" in legacy_wait(served)
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: "BUSY" not in legacy_wait(served), 30,
               "the waits of a client that hung up to end")
