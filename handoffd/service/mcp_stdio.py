"""``handoffd mcp`` on stdio: the SDK's transport, with every request answered.

The MCP SDK's stdio transport hands a line it cannot validate to the session as a bare
exception, without the request's id, and nothing is sent back: a client that sent
``"params": "x"``, or arguments nested past pydantic's recursion limit, waited for ever on that id
(fourth session's hunt). :class:`CheckedLines` sits between stdin and the transport: a line the
SDK would refuse is answered here with a JSON-RPC error naming its id (``null`` when it has
none), and never reaches the SDK. So is a request whose ``id`` is no string or integer (1.5,
true, null, an object, an integer past 4,300 digits): the SDK's notification model ignores
unknown keys, took it for a notification and answered nothing; JSON-RPC 2.0 answers it -32600
under ``null``, and only a message without ``id`` is a notification. Everything else passes
through unchanged.

A line is read no further than MAX_LINE_CHARS (+1): one longer is refused as it streams past
(the rest of it read in small pieces and dropped), and answered under the id found near its
start. Reading it whole first took 1.17 GB for a 400 MB line, and the answer said id null, which
no client could match to its request.
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
ID_SCAN_CHARS = 64 * 1024  # of a line over the cap, the start searched for its "id"
DROP_CHUNK_CHARS = 1024 * 1024  # the rest of such a line is read (and dropped) this much a time


class CheckedLines:
    """The lines of ``source`` (a text file: stdin) the SDK can read; the others are answered
    on ``replies``."""

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
        while True:
            line, too_long = await anyio.to_thread.run_sync(read_line, self.source,
                                                            abandon_on_cancel=True)
            if not line:
                return  # end of input
            refusal = refuse_long(line) if too_long else refuse(line)
            if refusal is None:
                yield line
                continue
            await self.ready.wait()
            await self.replies.send(SessionMessage(refusal))


def read_line(source: Any, cap: int = MAX_LINE_CHARS) -> tuple[str, bool]:
    """The next line of ``source`` and False; for a line of more than ``cap`` characters,
    only its first ID_SCAN_CHARS and True, the rest read in pieces and dropped. ("", False):
    the end of input."""
    line = source.readline(cap + 1)
    if len(line) <= cap or line.endswith("\n"):  # (cap characters and its newline: whole)
        return line, False
    start = line[:ID_SCAN_CHARS]
    del line
    while True:  # (a line's rest is dropped piece by piece: never held whole)
        rest = source.readline(DROP_CHUNK_CHARS)
        if not rest or rest.endswith("\n"):
            return start, True


def refuse_long(start: str) -> types.JSONRPCError:
    """The answer to a request line over the cap, of which ``start`` is the beginning: under
    its id when that comes early (``null`` otherwise: nothing more of the line is kept)."""
    return _error(scan_id(start), types.INVALID_REQUEST,
                  f"the request line is over {MAX_LINE_CHARS} characters")


def scan_id(text: str) -> int | str | None:
    """The top-level ``"id"`` of the JSON object ``text`` begins, when it is an integer or a
    string and lies within ``text``; else None. One pass (linear): strings skipped, nesting
    counted, only keys of the outer object looked at."""
    depth, at, expect_key = 0, 0, False
    while at < len(text):
        char = text[at]
        if char == '"':
            end = _string_end(text, at)
            if end < 0:
                return None
            if depth == 1 and expect_key:
                colon = _skip_blanks(text, end)
                if colon < len(text) and text[colon] == ":" and _key(text[at:end]) == "id":
                    return _id_value(text, _skip_blanks(text, colon + 1))
                expect_key = False
            at = end
            continue
        if char in "{[":
            depth += 1
            expect_key = char == "{" and depth == 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return None
        elif char == "," and depth == 1:
            expect_key = True
        at += 1
    return None


def _string_end(text: str, start: int) -> int:
    """The index just past the JSON string opening at ``start``; -1 when ``text`` ends first."""
    at = start + 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
        elif text[at] == '"':
            return at + 1
        else:
            at += 1
    return -1


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _key(quoted: str) -> str | None:
    """A JSON string token's value (escapes decoded), None if it is no valid string."""
    if "\\" not in quoted:
        return quoted[1:-1]
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _id_value(text: str, at: int) -> int | str | None:
    """The JSON-RPC id (an integer or a string) that starts at ``at``, else None."""
    if at >= len(text) or text[at] not in '"-0123456789':
        return None  # (an object, array, bool or null is no id to answer under)
    try:
        value, end = json.JSONDecoder(parse_int=_bounded_int).raw_decode(text, at)
    except (ValueError, RecursionError):
        return None
    if end >= len(text) and not isinstance(value, str):
        return None  # (a number the kept start cuts short: 12 of 123 is not its id)
    return value if isinstance(value, (int, str)) and not isinstance(value, bool) else None


def refuse(line: str) -> types.JSONRPCError | None:
    """The error answer for a line the SDK's transport would not accept, or would take for a
    notification though it has an ``id`` (so never answer), else None."""
    if not line.strip():
        return None  # (the SDK skips nothing, but an empty line is no request either)
    if len(line) > MAX_LINE_CHARS:
        return _error(None, types.INVALID_REQUEST,
                      f"the request line is over {MAX_LINE_CHARS} characters")
    try:
        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except Exception as exc:  # what the SDK would have swallowed
        return _refuse_invalid(line, _first_problem(exc))
    # the SDK's notification ignores unknown keys: {"id": 1.5, "method": "ping"} read as one,
    # and was dropped unanswered. Notifications are few and small: such a line is read again.
    if isinstance(message, types.JSONRPCNotification) and (bad := id_problem(line)):
        return _error(None, types.INVALID_REQUEST, bad)  # (JSON-RPC 2.0: under null)
    return None


def id_problem(body: str | bytes) -> str | None:
    """Why the JSON-RPC request ``body`` has an ``id`` member no answer can carry
    (:func:`unusable_id`), or None: its id is usable, it has none (a notification), or it is no
    request (no JSON object with a ``method``). A response's id is not judged: a client's answer
    to a message it could not read carries ``"id": null`` by right (JSON-RPC 2.0), and nothing
    answers a response (over HTTP it got 400, where stdio let it through)."""
    try:
        parsed = json.loads(body, parse_int=_bounded_int)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict) or "method" not in parsed or "id" not in parsed:
        return None
    return unusable_id(parsed["id"])


def _refuse_invalid(line: str, problem: str) -> types.JSONRPCError | None:
    """The answer to ``line``, which the SDK cannot validate (``problem`` says why): under its
    id when it has a usable one, under ``null`` otherwise; None for a notification (no
    ``id`` member: JSON-RPC 2.0 answers nothing to one, even a malformed one)."""
    try:  # (an integer past Python's 4,300 digits elsewhere in the line, in its params, is
        # no reason to lose the request's id; as the id itself it is no id: see _HugeInt)
        parsed = json.loads(line, parse_int=_bounded_int)
    except (ValueError, RecursionError):
        return _error(None, types.PARSE_ERROR, "not JSON, or nested too deeply to read")
    if not isinstance(parsed, dict):
        return _error(None, types.INVALID_REQUEST,
                      f"the request is not valid JSON-RPC for MCP: {problem}")
    if "id" not in parsed:
        if "method" in parsed:
            return None  # a notification: nothing may be answered (the SDK drops it)
        return _error(None, types.INVALID_REQUEST,
                      f"the request is not valid JSON-RPC for MCP: {problem}")
    bad_id = unusable_id(parsed["id"])
    if bad_id is not None:  # JSON-RPC 2.0: an id that cannot be used is answered as null
        return _error(None, types.INVALID_REQUEST, bad_id)
    code = types.INVALID_PARAMS if "params" in parsed else types.INVALID_REQUEST
    return _error(parsed["id"], code, f"the request is not valid JSON-RPC for MCP: {problem}")


def unusable_id(value: Any) -> str | None:
    """Why ``value`` (a parsed JSON-RPC ``id``) cannot be answered under, or None when it can:
    MCP's ids are strings and integers (an integer ``int()`` can read)."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return None
    if isinstance(value, _HugeInt):
        return (f"the request's id is an integer of more than {MAX_INT_DIGITS} digits: "
                "an id is a string or an integer")
    kind = "null" if value is None else "a boolean" if isinstance(value, bool) \
        else "a number with a fraction or exponent" if isinstance(value, float) \
        else f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    return f"the request's id is {kind}: an id is a string or an integer"


class _HugeInt:
    """Stands for an integer too long for ``int()``. It is no id: a request under one is
    answered under ``null`` (reading its digits is what the limit guards against), and
    nothing else of it is kept."""


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
        checked = CheckedLines(stdin)  # (read a bounded piece at a time: see read_line)
        async with stdio_server(stdin=checked) as (read_stream, write_stream):  # type: ignore[arg-type]
            checked.attach(write_stream)
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())

    anyio.run(serve)
