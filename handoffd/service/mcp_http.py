"""``handoffd mcp --http HOST:PORT``: the SDK's streamable-HTTP app, served on a socket bound here.

The SDK's own ``run("streamable-http")`` left the bind to uvicorn, whose failures (a port in use,
a host that does not resolve, a bracketed IPv6 literal it could not read) became its log lines
and an exit code meaning "not found". Binding first gives one line and the documented exit code:
1 when the address cannot be listened on, 2 for a value that is no address; uvicorn then logs
only warnings and errors (stdout stays quiet, stderr holds no INFO lines).

A request whose ``id`` no answer can carry (``1.5``, ``true``, ``null``, an object, an integer of
more than 4,300 digits) is answered ``400`` with JSON-RPC error -32600 under ``null``
(:class:`AnswerUnusableIds`): the SDK's transport for the session protocol (2025 versions) took
it for a notification, whose model ignores unknown keys, and answered ``202``, never the request.
"""
from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

from ..core.errors import HandoffdError, UsageError

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXAMPLE = "give HOST:PORT, e.g. 127.0.0.1:8765 or [::1]:8765"


def parse_listen(spec: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (host 127.0.0.1);
    UsageError for anything else."""
    host, sep, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 literal must be bracketed: which colon ends it?
        raise UsageError(f"--http {spec!r}: {EXAMPLE}")
    # (ASCII digits: "²" passes str.isdigit() and int() refuses it, an "internal error")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 \
            or any(c.isspace() or c in "[]/" for c in host):
        raise UsageError(f"--http {spec!r}: {EXAMPLE}")
    return host or "127.0.0.1", int(port)


def bind(spec: str, host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port``: UsageError (exit 2) when ``host`` does not
    resolve, HandoffdError (exit 1) when the address cannot be bound (in use, not local)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--http {spec!r}: cannot resolve {host!r}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise HandoffdError(f"--http {spec!r}: cannot listen on {host} port {port}: "
                            f"{exc.strerror or exc}") from None
    return sock


def run_http(server: MCPServer, spec: str) -> None:
    """Serve ``server`` over streamable HTTP (at ``/mcp``) on the address ``spec`` names."""
    import uvicorn
    host, port = parse_listen(spec)
    sock = bind(spec, host, port)
    from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
    app = AnswerUnusableIds(server.streamable_http_app(host=host), DEFAULT_MAX_REQUEST_BODY_SIZE)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


class AnswerUnusableIds:
    """The ASGI app ``app`` (the SDK's), except that a POST to ``/mcp`` whose body is a JSON-RPC
    request (a ``method``) with an ``id`` no answer can carry is answered here (a response, such
    as a client's error under ``"id": null``, goes on to the SDK): ``400``, JSON-RPC error -32600
    under ``null`` (JSON-RPC 2.0; what the SDK's 2026-07-28 entry answers). Only a body of at
    most ``max_body`` bytes (the SDK's own limit) is looked at; a longer one goes on to the SDK
    as it came, which refuses it (413)."""

    def __init__(self, app: ASGIApp, max_body: int, path: str = "/mcp") -> None:
        self.app = app
        self.max_body = max_body
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" \
                or str(scope.get("path", "")).rstrip("/") != self.path:
            await self.app(scope, receive, send)
            return
        read: list[Message] = []
        size, whole = 0, False
        while size <= self.max_body:  # (read as the SDK reads it: whole, within its limit)
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                whole = size <= self.max_body
                break
        if whole:
            from .mcp_stdio import id_problem
            problem = id_problem(b"".join(m.get("body", b"") for m in read))
            if problem is not None:
                await _refuse(send, problem)
                return

        async def replay() -> Message:
            return read.pop(0) if read else await receive()
        await self.app(scope, replay, send)


async def _refuse(send: Send, problem: str) -> None:
    """Answer ``400`` with JSON-RPC error -32600 (Invalid Request) under id ``null``."""
    from mcp_types import INVALID_REQUEST
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": INVALID_REQUEST, "message": problem}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
