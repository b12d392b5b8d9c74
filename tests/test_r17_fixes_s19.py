"""Review 17's findings, fixed in session 19.

MCP: a request whose ``id`` is no string or integer (1.5, 1.0, true, null, an object, an
integer past Python's 4,300 digits) was never answered on stdio: the SDK's notification model
ignores unknown keys, so the line read as a notification (or, failing validation, was taken for
one), and the client waited for ever. Over HTTP the session protocol answered ``202``. Both now
answer -32600 under id ``null`` (JSON-RPC 2.0). Every read is bounded.

Quarantine: ``handoff ls --state quarantined`` was driven by the ``.reason.json`` files, so an
entry whose reason was missing, unreadable or huge was hidden, and a forged reason's fields
(``"code": ["x"]``, ``"at": 1e308``) were shown as they came."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, wait_until

from handoffd.backends.files.reading import quarantined
from handoffd.core.workspace import Workspace as HandoffdWorkspace

BAD_IDS = [b"1.5", b"1.0", b"true", b"null", b'{"a": 1}', b"[1]", b"9" * 5000, b"-" + b"9" * 5000]


# ---------------------------------------------------------------- MCP over stdio
def _line(request_id: bytes, method: str = "ping", extra: bytes = b"") -> str:
    return (b'{"jsonrpc": "2.0", "id": ' + request_id + b', "method": "' + method.encode()
            + b'"' + extra + b"}").decode()


@pytest.mark.parametrize("request_id", BAD_IDS, ids=lambda raw: raw[:12].decode())
def test_a_request_with_an_unusable_id_is_refused_under_null(request_id: bytes) -> None:
    pytest.importorskip("mcp")
    from handoffd.service.mcp_stdio import refuse
    for line in (_line(request_id), _line(request_id, extra=b', "params": "x"'),
                 _line(request_id, "notifications/cancelled", b', "params": {"requestId": 3}')):
        answer = refuse(line)
        assert answer is not None and answer.id is None, line[:80]
        assert answer.error.code == -32600 and "the request's id is" in answer.error.message


def test_notifications_and_usable_ids_are_left_as_they_were() -> None:
    pytest.importorskip("mcp")
    from handoffd.service.mcp_stdio import refuse
    assert refuse('{"jsonrpc": "2.0", "method": "notifications/initialized"}') is None
    assert refuse('{"jsonrpc": "2.0", "method": "notifications/x", "params": "x"}') is None
    assert refuse(_line(b'"s"')) is None and refuse(_line(b"2" * 4000)) is None
    answer = refuse(_line(b"7", extra=b', "params": "x"'))  # answered under its id, as before
    assert answer is not None and answer.id == 7 and answer.error.code == -32602
    huge_elsewhere = refuse(_line(b"8", "tools/call", b', "params": {"a": ' + b"1" * 5000 + b"}"))
    assert huge_elsewhere is not None and huge_elsewhere.id == 8


class Stdio:
    """A `handoffd mcp` on stdio, its answers read line by line (each read bounded)."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def ask(self, line: bytes, seconds: float = 20) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        try:
            return json.loads(self.lines.get(timeout=seconds))  # type: ignore[no-any-return]
        except queue.Empty:
            raise AssertionError(f"no answer to {line[:60]!r}") from None

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def test_stdio_answers_every_request_whatever_its_id(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    (tmp_path / "ws" / "handoffs" / "pending").mkdir(parents=True)
    server = Stdio(tmp_path / "ws")
    try:
        hello = server.ask(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}}).encode())
        assert hello["id"] == 0 and "result" in hello
        assert server.proc.stdin is not None
        server.proc.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        for request_id in (b"1.5", b"true", b'{"a": 1}', b"9" * 5000):
            answer = server.ask(_line(request_id).encode())
            assert answer["id"] is None and answer["error"]["code"] == -32600, answer
        assert server.ask(_line(b"11").encode()) == {"jsonrpc": "2.0", "id": 11, "result": {}}
    finally:
        server.close()


# ---------------------------------------------------------------- MCP over HTTP
def _post(app: Any, body: bytes, path: str = "/mcp", chunk: int = 1 << 20
          ) -> tuple[list[dict[str, Any]], bytes | None]:
    """What ``app`` sent for a POST of ``body`` (in ``chunk``-byte messages), and the body the
    app behind it read (None: it was never called)."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    incoming = [{"type": "http.request", "body": piece, "more_body": n < len(pieces) - 1}
                for n, piece in enumerate(pieces)]
    sent: list[dict[str, Any]] = []
    seen: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(got)
        await send({"type": "http.response.start", "status": 202, "headers": []})

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(inner, scope, receive, send))
    return sent, seen[0] if seen else None


def test_http_answers_an_unusable_id_before_the_sdk_takes_it_for_a_notification() -> None:
    pytest.importorskip("mcp")
    from handoffd.service.mcp_http import AnswerUnusableIds

    def through(inner: Any, scope: Any, receive: Any, send: Any) -> Any:
        return AnswerUnusableIds(inner, 20_000)(scope, receive, send)
    for request_id in BAD_IDS:
        sent, reached = _post(through, _line(request_id).encode(), chunk=7)
        assert reached is None and sent[0]["status"] == 400, request_id[:12]
        answer = json.loads(sent[1]["body"])
        assert answer["id"] is None and answer["error"]["code"] == -32600
    good = _line(b"3").encode()
    assert _post(through, good, chunk=7)[1] == good  # passed on whole, as it came
    notification = b'{"jsonrpc": "2.0", "method": "notifications/initialized"}'
    assert _post(through, notification)[1] == notification
    over = _line(b"1.5", extra=b', "pad": "' + b"x" * 30_000 + b'"').encode()
    assert _post(through, over, chunk=4096)[1] == over  # over the SDK's limit: the SDK's (413)
    assert _post(through, _line(b"1.5").encode(), path="/other")[1] is not None


@pytest.fixture
def http_port(tmp_path: Path) -> Iterator[int]:
    """The port of a `handoffd mcp --http` over an empty workspace."""
    pytest.importorskip("mcp")
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root), "--http",
                             f"127.0.0.1:{port}"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            assert proc.poll() is None
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, 30, "the server to listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def http_session(http_port: int) -> tuple[Any, dict[str, str]]:
    """(connection, headers) of an initialised MCP session (the 2025-06-18 protocol) on the
    real `handoffd mcp --http` server at ``http_port``."""
    import http.client
    heads = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=20)
    conn.request("POST", "/mcp", json.dumps({
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}}), heads)
    hello = conn.getresponse()
    session = hello.getheader("mcp-session-id")
    hello.read()
    assert hello.status == 200 and session
    heads |= {"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
    conn.request("POST", "/mcp", '{"jsonrpc": "2.0", "method": "notifications/initialized"}', heads)
    done = conn.getresponse()
    done.read()
    assert done.status == 202
    return conn, heads


def test_http_session_protocol_answers_a_float_id(http_port: int) -> None:
    conn, heads = http_session(http_port)
    conn.request("POST", "/mcp", '{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', heads)
    refused = conn.getresponse()
    answer = json.loads(refused.read())
    assert refused.status == 400 and answer["id"] is None and answer["error"]["code"] == -32600
    conn.close()


# ---------------------------------------------------------------- the quarantine listing
def _plant(folder: Path, name: str, reason: bytes | None) -> None:
    (folder / name).write_text("{}")
    if reason is not None:
        (folder / f"{name}.reason.json").write_bytes(reason)


@pytest.fixture
def qws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose quarantine holds entries with every kind of reason."""
    ws = new_workspace(tmp_path / "ws", "")
    folder = ws.root / "handoffs" / ".quarantine"
    folder.mkdir(parents=True, exist_ok=True)
    _plant(folder, "20260101T000001-aa-none.json", None)
    _plant(folder, "20260101T000002-bb-broken.json", b"{")
    _plant(folder, "20260101T000003-cc-huge.json",
           json.dumps({"code": "X", "message": "m" * (2 << 20)}).encode())
    _plant(folder, "20260101T000004-dd-forged.json",
           b'{"code": ["x"], "at": 1e308, "message": {"a": "\\u001b[31m"}}')
    _plant(folder, "20260101T000005-ee-fields.json",
           b'{"code": "UNSAFE_ID", "at": 1e308, "message": {"a": 1}, "file": 7}')
    _plant(folder, "20260101T000006-ff-good.json",
           b'{"code": "MALFORMED_JSON", "message": "bad \\u001b[2J json", '
           b'"at": "2026-01-01T02:00:06+02:00", "file": "good.json", "from": "pending"}')
    yield ws
    ws.cleanup()


def test_ls_lists_every_entry_set_aside_with_its_reason_checked(qws: Workspace) -> None:
    rows = json.loads(qws.handoff("ls", "--state", "quarantined", "--json", check=True).stdout)
    got = {row["id"].split("-")[-1]: (row["updated"], row["note"]) for row in rows}
    assert got == {
        "none.json": (None, "UNREADABLE_FILE: reason unreadable: no .reason.json beside it"),
        "broken.json": (None, "UNREADABLE_FILE: reason unreadable: its reason is not valid "
                              "JSON: Expecting property name enclosed in double quotes "
                              "(line 1, column 2)"),
        "huge.json": (None, "UNREADABLE_FILE: reason unreadable: larger than 1048576 bytes"),
        "forged.json": (None, "UNREADABLE_FILE: reason unreadable: it names no error code"),
        "fields.json": (None, "UNSAFE_ID: "),
        "good.json": ("2026-01-01T00:00:06.000Z", "MALFORMED_JSON: bad \x1b[2J json"),
    }
    table = qws.handoff("ls", "--state", "quarantined", check=True).stdout
    assert "\x1b" not in table and "bad \\x1b[2J json" in table and "1e+308" not in table
    assert len(table.splitlines()) == 7


def test_the_listing_keeps_only_typed_bounded_fields(qws: Workspace) -> None:
    ws = HandoffdWorkspace(qws.root)
    folder = ws.quarantine
    _plant(folder, "20260101T000007-gg-x.reason.json", b'{"code": "UNSAFE_ID", "message": "m"}')
    (folder / "orphan.reason.json").write_text('{"code": "UNSAFE_ID"}')  # its entry is gone
    (folder / ".20260101T000008-hh.json.reason.0123456789abcdef.tmp").write_text("{")
    items = {item["stored_as"].split("-")[-1]: item for item in quarantined(ws)}
    assert sorted(items) == ["broken.json", "fields.json", "forged.json", "good.json",
                             "huge.json", "none.json", "x.reason.json"]
    assert items["good.json"] == {"stored_as": "20260101T000006-ff-good.json", "file": "good.json",
                                  "from": "pending", "code": "MALFORMED_JSON",
                                  "message": "bad \x1b[2J json", "at": "2026-01-01T00:00:06.000Z"}
    assert items["fields.json"] == {"stored_as": "20260101T000005-ee-fields.json",
                                    "code": "UNSAFE_ID"}


def test_a_symlinked_quarantine_folder_is_not_followed(tmp_path: Path) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    outside = tmp_path / "outside"
    outside.mkdir()
    _plant(outside, "secret.json", b'{"code": "UNSAFE_ID", "message": "outside"}')
    if ws.quarantine.exists():
        os.rmdir(ws.quarantine)
    ws.quarantine.symlink_to(outside)
    assert quarantined(ws) == []
