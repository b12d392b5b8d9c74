"""``handoffd mcp``: the workspace as a Model Context Protocol server, for agents that speak MCP.

Built on the official ``mcp`` SDK (its ``MCPServer``). Tools: ``create_handoff``,
``wait_handoff``, ``get_handoff``, ``list_handoffs``, ``cancel_handoff``, ``answer_handoff``,
``retry_handoff``, ``get_context``, ``set_context`` and ``trace_handoff``; resources: the JSON
Schema of every format (``handoffd://schemas/<file>``). Each tool is the same operation as the
``handoff`` command of that name (through :class:`handoffd.service.client.Client`). A handoffd
error comes back as an MCP tool error whose text starts with its error code
(``NOT_FOUND: no handoff x``, ``SCHEMA_VALIDATION_FAILED: ...``, ``DUPLICATE_HANDOFF_ID: ...``
for an id that is taken). The server acts as one agent identity (``--as``, default ``@mcp``):
the source of what it creates, and whose namespace permissions apply to context writes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from pydantic import TypeAdapter, ValidationError, WithJsonSchema

from ..core.errors import (
    Conflict,
    DuplicateHandoff,
    ErrorCode,
    HandlerError,
    HandoffdError,
    InvalidDocument,
    InvalidTransition,
    NotFound,
    UsageError,
    WaitTimeout,
)
from .client import Client, Result
from .mcp_waits import (
    ANSWER_MARGIN_SECONDS,
    LOOK_SECONDS,
    MAX_WAITS,
    MAX_WAITS_PER_SESSION,
    Waits,
    wait_then_look,
)

__all__ = ["MAX_WAITS", "MAX_WAITS_PER_SESSION", "build_server", "error_code", "schema_names"]
log = logging.getLogger("handoffd")
DEFAULT_AGENT = "@mcp"
MAX_WAIT_SECONDS = 3600.0
# wait_handoff's timeout: described as a number, but checked by the tool itself, so that a value
# that is not one is USAGE_ERROR (docs/agents.md) rather than the SDK's pydantic report
Seconds = Annotated[Any, WithJsonSchema({"type": "number"})]  # (0..3600: longer is clamped)
_FLOAT = TypeAdapter(float)
MAX_LISTED = 1_000  # the most rows list_handoffs returns at once


def wait_seconds(timeout: Any) -> float:
    """``timeout`` as the seconds a wait lasts, clamped to 0..MAX_WAIT_SECONDS; ToolError
    (USAGE_ERROR) unless it is a finite number (what pydantic reads as a float: "5" is 5)."""
    try:
        seconds = _FLOAT.validate_python(timeout)
    except ValidationError:
        seconds = math.nan
    if isinstance(timeout, bool) or not math.isfinite(seconds):  # "nan" would wait for ever
        raise ToolError(f"USAGE_ERROR: timeout must be a number of seconds, 0 to "
                        f"{MAX_WAIT_SECONDS:.0f}, not {timeout!r}"[:300])
    return min(max(seconds, 0.0), MAX_WAIT_SECONDS)


def error_code(exc: HandoffdError) -> str:
    """The error code an MCP caller sees for ``exc``."""
    if isinstance(exc, (InvalidDocument, HandlerError)):
        return str(exc.code)
    # (Conflict first: it is a DuplicateHandoff, whose plain case is the id's own code, as the
    # daemon records it for a second document under a taken id)
    for kind, code in ((Conflict, "CONFLICT"), (DuplicateHandoff, ErrorCode.DUPLICATE_HANDOFF_ID),
                       (NotFound, "NOT_FOUND"), (WaitTimeout, "WAIT_TIMEOUT"),
                       (UsageError, "USAGE_ERROR"), (InvalidTransition, "INVALID_TRANSITION")):
        if isinstance(exc, kind):
            return code
    return getattr(exc, "code", None) or "HANDOFFD_ERROR"


def tool_message(exc: HandoffdError) -> str:
    """The text of the tool error for ``exc``: its code, then its message, on one line, with the
    CLI's ``--force`` worded as this server's argument."""
    message = " ".join(str(exc).split()).replace("retry with --force", "retry with force: true")
    return f"{error_code(exc)}: {message}"


def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client call; a handoffd error becomes a tool error carrying its code, and so does
    a filesystem error (the workspace deleted under the server, a key's folder that is a file)."""
    try:
        return function(*args, **kwargs)
    except HandoffdError as exc:
        raise ToolError(tool_message(exc)) from None
    except OSError as exc:
        raise ToolError(os_error_message(exc)) from None
    except ValueError as exc:
        raise ToolError(f"USAGE_ERROR: {' '.join(str(exc).split())}") from None


def os_error_message(exc: OSError) -> str:
    """``IO_ERROR: <why>: <path>`` for a filesystem error (one line)."""
    where = f": {exc.filename}" if exc.filename else ""
    return " ".join(f"IO_ERROR: {exc.strerror or exc}{where}".split())[:500]


def _view(result: Result) -> dict[str, Any]:
    """What a tool returns about a handoff."""
    view: dict[str, Any] = {"id": result.id, "state": result.state.value,
                            "finished": result.finished, "ok": result.ok,
                            "document": result.document}
    if result.foreign:  # filed by another consumer: its bookkeeping is not handoffd's
        view["foreign_filing"] = True
    if result.error is not None:
        view["error"] = {"code": result.error.code, "message": result.error.message}
    if result.asks is not None:
        view["asks"] = {k: v for k, v in result.asks.items() if k != "outcome"}
    return view


class HandoffdServer(MCPServer):
    """The SDK's server, with every tool error one line that starts with a code: arguments that
    fail validation (``to: 5``, ``limit: 1.5``) are ``USAGE_ERROR: <field>: <why>`` rather than
    pydantic's multi-line report, and anything unexpected is ``INTERNAL_ERROR`` (or
    ``IO_ERROR`` for a filesystem error) with one log line instead of a traceback, and an
    unknown tool is ``USAGE_ERROR: no tool 'x'``."""

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Context[Any, Any] | None = None) -> Any:
        """:meth:`MCPServer.call_tool`, its errors coded (see the class)."""
        tool = self._tool_manager.get_tool(name)
        if tool is None:  # (the SDK said "Unknown tool: x")
            raise ToolError(f"Error executing tool {' '.join(name.split())[:80]}: USAGE_ERROR: "
                            f"no tool {_shown(name)}")
        # an argument the tool does not take was dropped unsaid, so a misspelt one (`timeot`,
        # `handoffid`) silently meant its default: refused, as the CLI refuses an unknown option
        takes = set((tool.parameters or {}).get("properties", {}))
        unknown = sorted(str(key) for key in (arguments or {}) if key not in takes)
        if unknown:
            raise ToolError(f"Error executing tool {name}: USAGE_ERROR: {_shown(unknown[0])}: "
                            f"no such argument (it takes {', '.join(sorted(takes)) or 'none'})")
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError as exc:
            cause = exc.__cause__
            while isinstance(cause, UnexpectedToolError):  # (a nested tool's crash)
                cause = cause.__cause__
            if isinstance(cause, OSError):
                said = os_error_message(cause)
            else:
                said = f"INTERNAL_ERROR: {type(cause).__name__} (see the server's log)"
                log.error("MCP tool %s failed: %s: %s", name, type(cause).__name__,
                          " ".join(str(cause).split())[:300])
            raise ToolError(f"Error executing tool {name}: {said}") from None
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                raise ToolError(f"Error executing tool {name}: USAGE_ERROR: "
                                f"{first_problem(exc.__cause__)}") from None
            raise


def _shown(text: str) -> str:
    """``text`` quoted for one line, at most about 80 characters of it."""
    return repr(text) if len(text) <= 80 else f"{text[:77]!r}..."


def first_problem(exc: ValidationError) -> str:
    """Pydantic's first complaint as ``<field>: <why>`` (one line, bounded)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return "the arguments are not valid"
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "arguments"
    return " ".join(f"{where}: {first.get('msg')}".split())[:300]


def build_server(root: Path | None, *, agent: str = DEFAULT_AGENT,
                 waits_per_session: int | None = None) -> MCPServer:
    """An MCPServer over the workspace at ``root`` acting as ``agent`` (``waits_per_session``:
    the most wait_handoff calls one session may have in progress: HTTP's share, see
    :mod:`handoffd.service.mcp_waits`)."""
    from .. import __version__
    client = Client(root, agent=agent)
    server = HandoffdServer("handoffd", version=__version__, instructions=(
        "A durable handoff queue: create_handoff hands work to a specialist agent, "
        "wait_handoff waits for its result (or for its questions: answer them with "
        "answer_handoff). Errors start with handoffd's error code."))

    @server.tool()
    def create_handoff(to: str | None = None, data: Any = None,
                       document: dict[str, Any] | None = None, handoff_id: str | None = None,
                       objective: str | None = None, priority: str | int | None = None,
                       depends_on: list[str] | None = None,
                       if_absent: bool = False) -> dict[str, Any]:
        """Hand work to the specialist ``to`` (``data`` is its input; ``objective`` says why),
        or submit a whole ``document`` in any supported format. ``if_absent`` with a
        ``handoff_id`` makes it idempotent. Returns the handoff's id."""
        if document is not None:
            refuse_with_document(to=to, data=data, handoff_id=handoff_id, objective=objective,
                                 priority=priority, depends_on=depends_on)
        if objective is not None and document is None:
            data = {"objective": objective, **(data if isinstance(data, dict) else
                                              {} if data is None else {"data": data})}
        if document is not None:
            handle = _call(client.create, document=document, if_absent=if_absent)
        else:
            handle = _call(client.create, to, data, handoff_id=handoff_id, priority=priority,
                           depends_on=depends_on, if_absent=if_absent)
        return {"id": handle.id}

    waits = Waits(MAX_WAITS, waits_per_session)

    @server.tool()
    async def wait_handoff(handoff_id: str, ctx: Context,  # type: ignore[type-arg]
                           timeout: Seconds = 60.0) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds for the handoff to finish (or to ask a question);
        returns the filed document, or where it stands when the time is up."""
        limit = wait_seconds(timeout)
        handle = client.handle(handoff_id)
        # (where it stands at the timeout is read on the wait's thread, bounded: on the event
        # loop, a store that was away froze every session for its reconnect window)
        # (a file still being written into pending/ of a shared store's workspace is waited
        # for, and stands pending at the timeout: Handle.look)
        wait = wait_then_look(lambda seconds, stop: handle.wait(seconds, stop=stop),
                              handle.look, client.engine.backend, handoff_id)
        bound = asyncio.timeout(limit + LOOK_SECONDS + ANSWER_MARGIN_SECONDS)
        try:
            session, peer = caller_keys(ctx)
            async with bound:  # (whatever a store does, the answer comes by then)
                result = await waits.run(wait, limit, session=session, peer=peer)
        except HandoffdError as exc:
            raise ToolError(tool_message(exc)) from None
        except OSError as exc:
            if bound.expired():  # (a TimeoutError) a store that kept no deadline of its own
                raise ToolError(f"WAIT_TIMEOUT: handoff {handoff_id}: no answer within "
                                f"{limit:g}s, and the store did not say where it stands in "
                                "time") from None
            raise ToolError(os_error_message(exc)) from None
        return _view(result)

    @server.tool()
    def get_handoff(handoff_id: str) -> dict[str, Any]:
        """Where a handoff stands now, with its document."""
        return _view(_call(client.get, handoff_id))

    @server.tool()
    def list_handoffs(state: str | None = None, to: str | None = None, limit: int = 50,
                      conversation: str | None = None) -> dict[str, Any]:
        """Newest-first handoffs (``handoffs``: rows as `handoff ls --json` prints them),
        filtered by state, target agent or conversation; ``limit`` is the number of rows asked
        for, as kept (1 to 1,000), and ``more`` says whether it left rows out."""
        kept = min(max(limit, 1), MAX_LISTED)
        rows = list(_call(client.list, state=state, to=to, limit=kept + 1,
                          conversation=conversation))  # (one past the limit: are there more?)
        return {"handoffs": rows[:kept], "limit": kept, "more": len(rows) > kept}

    @server.tool()
    def cancel_handoff(handoff_id: str, cascade: bool = False,
                       reason: str = "cancelled by an MCP client") -> dict[str, Any]:
        """Cancel a handoff (``cascade``: and everything it delegated)."""
        return {"id": handoff_id, "action": _call(client.cancel, handoff_id, reason=reason,
                                                  cascade=cascade)}

    @server.tool()
    def answer_handoff(handoff_id: str, answer: Any) -> dict[str, Any]:
        """Answer what a handoff asks (needs_clarification or blocked); it runs again."""
        _call(client.answer, handoff_id, answer)
        return {"id": handoff_id, "answered": True}

    @server.tool()
    def retry_handoff(handoff_id: str, force: bool = False) -> dict[str, Any]:
        """Put a failed handoff back in the queue (``force``: also a permanent failure)."""
        _call(client.retry, handoff_id, force=force)
        return {"id": handoff_id, "retried": True}

    @server.tool()
    def get_context(key: str) -> dict[str, Any]:
        """A shared-context value (``context/<key>.json``) and its revision."""
        try:
            value, revision = _call(_context(client).get_with_revision, key)
        except KeyError:  # unset: it reached the SDK as a bare error, with tracebacks logged
            raise ToolError(f"NOT_FOUND: context key {key!r} is not set") from None
        return {"key": key, "value": value, "revision": revision}

    @server.tool()
    def set_context(key: str, value: Any, if_revision: int | None = None) -> dict[str, Any]:
        """Write a shared-context value as this server's agent (namespace permissions apply;
        ``if_revision``: only if the key is still at that revision)."""
        return dict(_call(_context(client).set, key, value, agent=client.agent,
                          if_revision=if_revision))

    @server.tool()
    def trace_handoff(handoff_id: str) -> dict[str, Any]:
        """The tree of a handoff: its conversation, children and their states."""
        from ..features.trace import build
        return dict(_call(build, client.engine, handoff_id))

    for name in schema_names():
        _add_schema(server, name)
    return server


def caller_keys(ctx: Context) -> tuple[Any, Any]:  # type: ignore[type-arg]
    """``(session, peer)``: who a call's waits count against. Over HTTP the session is its
    ``mcp-session-id`` header (None on the 2026-07-28 protocol, which has none: the SDK's
    session object is made anew for each request there) and the peer its address (its host:
    each connection has a port of its own); elsewhere (stdio) the session object alone."""
    request = ctx.request_context.request
    headers = getattr(request, "headers", None)
    if headers is None:
        return id(ctx.request_context.session), None
    address = getattr(request, "client", None)
    peer = getattr(address, "host", None) or "unknown"  # (one share for every unknown one)
    return headers.get("mcp-session-id") or None, peer


def refuse_with_document(**options: Any) -> None:
    """ToolError (USAGE_ERROR) when a whole ``document`` comes with options only the to/data
    form uses: they were dropped without a word (as ``handoff create --file`` refuses
    ``--priority``)."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ToolError("USAGE_ERROR: document submits a whole document; do not combine it with "
                        "to/data/handoff_id/objective/priority/depends_on (given: "
                        f"{', '.join(given)})")


def _context(client: Client) -> Any:
    from ..features.context import ContextStore, Permissions
    from ..features.stores import context_backend
    engine = client.engine
    durable = engine.config.daemon.durable
    return ContextStore(engine.ws, Permissions.from_config(engine.config), durable=durable,
                        backend=context_backend(engine.ws, engine.backend, durable=durable))


def schema_names() -> list[str]:
    """The built-in JSON Schemas (one per format and answer)."""
    folder = resources.files("handoffd") / "schemas"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".schema.json"))


def _add_schema(server: MCPServer, name: str) -> None:
    @server.resource(f"handoffd://schemas/{name}", name=name, mime_type="application/schema+json",
                     description=f"The JSON Schema {name}")
    def schema() -> str:
        return json.dumps(json.loads((resources.files("handoffd") / "schemas" / name)
                                     .read_text(encoding="utf-8")), indent=2)
