"""``handoffd mcp --http HOST:PORT``: the SDK's streamable-HTTP app, served on a socket bound here.

The SDK's own ``run("streamable-http")`` left the bind to uvicorn, whose failures (a port in use,
a host that does not resolve, a bracketed IPv6 literal it could not read) became its log lines
and an exit code meaning "not found". Binding first gives one line and the documented exit code:
1 when the address cannot be listened on, 2 for a value that is no address; uvicorn then logs
only warnings and errors (stdout stays quiet, stderr holds no INFO lines).
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from ..core.errors import HandoffdError, UsageError

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

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
    app = server.streamable_http_app(host=host)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
