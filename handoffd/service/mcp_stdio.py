"""``handoffd mcp`` on stdio: the SDK's transport, with every request answered.

The MCP SDK's stdio transport hands a line it cannot validate to the session as a bare
exception, without the request's id, and nothing is sent back: a client that sent
``"params": "x"``, or arguments nested past pydantic's recursion limit, waited for ever on that id
(fourth session's hunt). :class:`CheckedLines` sits between stdin and the transport: a line the
SDK would refuse is answered here with a JSON-RPC error naming its id (``null`` when it has
none), and never reaches the SDK. Everything else passes through unchanged.
"""
from __future__ import annotations

import json
import logging
import sys
from io import TextIOWrapper
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio
import mcp_types as types
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

log = logging.getLogger("handoffd")
MAX_LINE_CHARS = 16 * 1024 * 1024  # a request line longer than this is refused, not parsed
MAX_INT_DIGITS = 4_300  # Python's default int() limit (sys.get_int_max_str_digits)


class CheckedLines:
    """The lines of ``source`` the SDK can read; the others are answered on ``replies``."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.replies: Any = None  # the transport's write stream, once it exists
        self.ready = anyio.Event()

    def attach(self, replies: Any) -> None:
        """Start answering refused lines on ``replies`` (the transport's write stream)."""
        self.replies = replies
        self.ready.set()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        async for line in self.source:
            refusal = refuse(line)
            if refusal is None:
                yield line
                continue
            await self.ready.wait()
            await self.replies.send(SessionMessage(refusal))


def refuse(line: str) -> types.JSONRPCError | None:
    """The error answer for a line the SDK's transport would not accept, or None."""
    if not line.strip():
        return None  # (the SDK skips nothing, but an empty line is no request either)
    if len(line) > MAX_LINE_CHARS:
        return _error(None, types.INVALID_REQUEST,
                      f"the request line is over {MAX_LINE_CHARS} characters")
    try:
        types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return None
    except Exception as exc:  # what the SDK would have swallowed
        problem = _first_problem(exc)
    try:  # (an integer past Python's 4,300 digits is no reason to lose the request's id)
        parsed = json.loads(line, parse_int=_bounded_int)
    except (ValueError, RecursionError):
        return _error(None, types.PARSE_ERROR, "not JSON, or nested too deeply to read")
    request_id = parsed.get("id") if isinstance(parsed, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        request_id = None
    if isinstance(parsed, dict) and "method" in parsed and request_id is None:
        return None  # a notification: nothing may be answered (the SDK drops it)
    code = types.INVALID_PARAMS if isinstance(parsed, dict) and "params" in parsed \
        else types.INVALID_REQUEST
    return _error(request_id, code, f"the request is not valid JSON-RPC for MCP: {problem}")


class _HugeInt:
    """Stands for an integer too long for ``int()`` (it is no id, and nothing else is kept)."""


def _bounded_int(text: str) -> int | _HugeInt:
    """``int(text)``, or a :class:`_HugeInt` past ``int()``'s digit limit (``json.loads``
    raised ValueError for the whole line, and the answer lost the request's id)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _HugeInt()
    return int(text)


def _first_problem(exc: Exception) -> str:
    """One line saying what is wrong: pydantic's first complaint about the request as a request
    (its field, and why), else the exception's first line."""
    errors = getattr(exc, "errors", None)
    try:
        found = errors(include_url=False) if callable(errors) else []
    except Exception:  # not pydantic's
        found = []
    as_request = [e for e in found if e.get("loc")[:1] == ("JSONRPCRequest",)] or found
    if as_request:
        first = as_request[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "the request"
        return f"{where}: {first.get('msg')}"[:300]
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def _error(request_id: int | str | None, code: int, message: str) -> types.JSONRPCError:
    return types.JSONRPCError(jsonrpc="2.0", id=request_id,
                              error=types.ErrorData(code=code, message=message))


def run_stdio(server: MCPServer) -> None:
    """Serve ``server`` on stdin/stdout, answering every request (see the module)."""
    lowlevel = getattr(server, "_lowlevel_server", None)
    if lowlevel is None:  # an SDK without it: its own transport, as it stands
        server.run("stdio")
        return

    async def serve() -> None:
        stdin = TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
        source = anyio.wrap_file(stdin)
        checked = CheckedLines(source)
        async with stdio_server(stdin=checked) as (read_stream, write_stream):  # type: ignore[arg-type]
            checked.attach(write_stream)
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())

    anyio.run(serve)
