"""The child side of an isolated Python handler (see :mod:`handoffd.core.isolation`).

Started by the daemon with two pipe descriptors: it reads one request line from the first
(handler reference, document, context fields), calls the handler as a daemon's worker would,
checks its result the same way (:func:`~handoffd.core.runner.validate_result`, a copy in plain
JSON types, a HandlerError for anything else) and writes ``result`` or ``error`` as one JSON
line on the second, then exits (``not_started`` instead when a passing shortage of descriptors
or memory kept it from importing the handler: the daemon hands the attempt back uncounted).
Meanwhile ``ctx.report_partial`` sends ``partial`` lines, and ``ctx.context`` is a proxy whose
calls the daemon answers with its own context view (the same store, the same permissions).
SIGTERM (a timeout or a cancellation: the daemon signals the process group, and SIGKILLs it
after its grace) sets ``ctx.cancelled``, so ``ctx.check_cancelled()`` raises as it would in
the daemon.

Lives in the core because it needs nothing above it: the context is served by the daemon.
"""
from __future__ import annotations

import errno
import importlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

from .config import SpecialistConfig
from .errors import ConfigError, ErrorCode, HandlerError, InvalidDocument
from .runner import call_handler, handler_result
from .specialists import Handler, HandlerContext, Specialist, import_failure

CAS_TRIES = 64  # ctx.context.update: compare-and-set rounds before a conflict is given up


class _Link:
    """The child's two pipes: messages up (one writer at a time), calls answered down."""

    def __init__(self, down: int, up: int) -> None:
        self.down: BinaryIO = os.fdopen(down, "rb")
        self.up = up
        self.lock = threading.Lock()  # one message, or one call and its answer, at a time

    def read_line(self) -> Any:
        line = self.down.readline()
        if not line:
            raise EOFError("the daemon closed the pipe")
        return json.loads(line)

    def send(self, message: dict[str, Any]) -> None:
        """Write one message line (the caller checked it is JSON)."""
        data = _line(message)
        with self.lock:
            self._write(data)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.up, view):]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """One ``ctx.context`` call, run by the daemon; its answer, or its exception raised."""
        try:
            data = _line({"call": name, "args": list(args), "kwargs": kwargs})
        except (TypeError, ValueError) as exc:
            raise InvalidDocument(f"context value is not JSON-serialisable: {exc}",
                                  code=ErrorCode.INVALID_CONTEXT_VALUE) from None
        with self.lock:
            self._write(data)
            try:
                answer = self.read_line()
            except (EOFError, ValueError) as exc:
                raise HandlerError(f"ctx.context.{name}: no answer from the daemon ({exc})") from None
        if isinstance(answer, dict) and "ok" in answer:
            return answer["ok"]
        raise rebuild(answer.get("raise") if isinstance(answer, dict) else None)


def _line(message: dict[str, Any]) -> bytes:
    """``message`` as one line of UTF-8 JSON (escaped to ASCII when it holds lone surrogates)."""
    text = json.dumps(message, allow_nan=False, ensure_ascii=False)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(message, allow_nan=False) + "\n").encode("ascii")


def rebuild(given: Any) -> BaseException:
    """The daemon's exception (see :func:`~handoffd.core.isolation.describe`) as the handler
    would have met it in the daemon: the same class, arguments and attributes; a RuntimeError
    naming it when the class cannot be had here."""
    info: dict[str, Any] = given if isinstance(given, dict) else {}
    given_args = info.get("args")
    args: list[Any] = given_args if isinstance(given_args, list) else []
    name = f"{info.get('module')}.{info.get('qualname')}"
    try:
        found: Any = importlib.import_module(str(info.get("module")))
        for part in str(info.get("qualname")).split("."):
            found = getattr(found, part)
        if isinstance(found, type) and issubclass(found, Exception):
            exc = found.__new__(found, *args)
            exc.args = tuple(args)
            attrs = info.get("attrs")
            if isinstance(attrs, dict):
                exc.__dict__.update(attrs)
            return exc
    except Exception:
        pass
    return RuntimeError(f"{name}: {' '.join(str(a) for a in args)}")


class ContextProxy:
    """``ctx.context`` in the child: the daemon's view of the shared context, call by call.

    ``get``, ``get_with_revision``, ``set``, ``keys`` and ``may_write`` behave as in the daemon
    (the daemon runs them). ``update(key, func)`` runs ``func`` here and writes with a
    compare-and-set, again while another writer changed the key meanwhile: the write is as
    atomic as in the daemon, but ``func`` may run more than once."""

    def __init__(self, link: _Link, agent: str) -> None:
        self._link = link
        self.agent = agent

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.get_with_revision(key)[0]
        except KeyError:
            return default

    def get_with_revision(self, key: str) -> tuple[Any, int]:
        value, revision = self._link.call("get_with_revision", key)
        return value, revision

    def set(self, key: str, value: Any, *, if_revision: int | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = self._link.call("set", key, value, if_revision=if_revision)
        return answer

    def update(self, key: str, func: Callable[[Any], Any], *, default: Any = None) -> dict[str, Any]:
        """Atomic read-modify-write by compare-and-set (see the class)."""
        for tries in range(1, CAS_TRIES + 1):
            try:
                current, revision = self.get_with_revision(key)
            except KeyError:
                current, revision = default, 0
            value = func(current)
            try:
                return dict(self.set(key, value, if_revision=revision), value=value)
            except Exception as exc:
                if getattr(exc, "code", None) != ErrorCode.CONTEXT_CONFLICT or tries == CAS_TRIES:
                    raise
        raise AssertionError("unreachable")

    def keys(self, prefix: str = "") -> list[str]:
        found: list[str] = self._link.call("keys", prefix=prefix)
        return found

    def may_write(self, key: str) -> bool:
        return bool(self._link.call("may_write", key))

    def __repr__(self) -> str:
        return f"ContextProxy(agent={self.agent!r})"


@dataclass
class ChildContext(HandlerContext):
    """A HandlerContext whose partial results go up to the daemon as they are reported."""

    link: _Link | None = field(default=None, repr=False)

    def report_partial(self, output: Any) -> None:
        """Record partial results; the daemon keeps the last one if the attempt is cancelled
        or times out. They must be JSON, and no larger than a result may be."""
        if self.link is not None:
            try:
                data = _line({"partial": output})
            except (TypeError, ValueError) as exc:
                raise TypeError(f"report_partial needs a JSON value: {exc}") from None
            if self.max_output_bytes is not None and len(data) > self.max_output_bytes:
                raise ValueError(f"report_partial: {len(data)} bytes as JSON, over "
                                 f"max_output_bytes ({self.max_output_bytes})")
            with self.link.lock:
                self.link._write(data)
        super().report_partial(output)


def load_handler(ref: str, agent: str) -> Handler:
    """``module:qualname`` imported (a dotted qualname walked); ConfigError as the registry
    words it, except for a passing shortage of descriptors or memory, raised as an OSError
    (EMFILE, ENFILE, ENOMEM) or a MemoryError (:func:`~.specialists.import_failure`)."""
    module_name, _, qualname = ref.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except MemoryError:
        raise  # a passing shortage, as an OSError EMFILE is: main tells the daemon
    except Exception as exc:  # a shortage (an OSError) as such; else a configuration problem
        raise import_failure(exc, agent, ref) from None
    if not callable(found):
        raise ConfigError(f"specialist {agent}: {ref!r} is not callable")
    handler: Handler = found
    return handler


def _context(request: dict[str, Any], link: _Link) -> ChildContext:
    given = request["ctx"]
    artifact = given.get("artifact_path")
    ctx = ChildContext(handoff_id=given["handoff_id"], attempt=given["attempt"],
                       root=Path(given["root"]), data=given.get("data"), target=given["target"],
                       deadline_monotonic=given.get("deadline_monotonic"),
                       clarifications=list(given.get("clarifications") or []),
                       artifact_path=Path(artifact) if artifact else None,
                       artifact_rel=given.get("artifact_rel"),
                       max_output_bytes=given.get("max_output_bytes"), link=link)
    if given.get("context"):
        agent = str(request["agent"])
        ctx.context_factory = lambda _root, _agent, _id: ContextProxy(link, agent)
    return ctx


def _outcome(box: dict[str, Any], ctx: HandlerContext) -> dict[str, Any]:
    """The message that ends the attempt: the checked result, or the error."""
    try:
        return {"result": handler_result(box, ctx)}
    except HandlerError as exc:
        return {"error": {"message": str(exc), "code": str(exc.code), "retryable": exc.retryable,
                          "details": exc.details}}


def _not_started(link: _Link, exc: OSError | MemoryError) -> None:
    """Tell the daemon that the handler could not be imported for a passing shortage of
    descriptors or memory (``not_started``: the attempt is handed back uncounted, as an
    in-process handler's is; a ConfigError failed it for good), and exit."""
    if isinstance(exc, OSError):
        reason = errno.errorcode.get(exc.errno or 0, "EMFILE")
        why = f"importing it: {exc.strerror or exc}"
    else:
        reason, why = "ENOMEM", "out of memory importing it"
    try:
        link.send({"not_started": {"reason": reason, "why": why[:200]}})
    except (OSError, MemoryError):  # (no answer: the daemon sees a process that died)
        pass
    os._exit(0)


def main(argv: list[str]) -> None:
    """Run one handler call: ``argv`` = [down pipe fd, up pipe fd] (see the module)."""
    try:
        link = _Link(int(argv[0]), int(argv[1]))
        request = link.read_line()
        ctx = _context(request, link)
    except Exception as exc:  # not started by a daemon, or its request is unreadable
        print(f"handoffd.core.isolated: cannot start: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        os._exit(70)
    # set from a thread: the handler's own thread may hold the lock of the event being set
    signal.signal(signal.SIGTERM, lambda _sig, _frame: threading.Thread(
        target=ctx.stop, args=("stopped by its daemon",), daemon=True).start())
    try:  # a pipe is block-buffered: line by line, what it printed before a crash is kept
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    box: dict[str, Any] = {}
    try:
        func = load_handler(str(request["handler"]), str(request["agent"]))
    except ConfigError as exc:
        box["error"] = exc
    except (OSError, MemoryError) as exc:  # a passing shortage: the handler never started
        _not_started(link, exc)
    else:
        config = SpecialistConfig(agent=str(request["agent"]), handler=str(request["handler"]))
        call_handler(Specialist(config, func), request["doc"], ctx, box)
    message = _outcome(box, ctx)
    limit = (ctx.max_output_bytes or 0) + 32 * 1024
    if "error" in message and len(_line(message)) > limit:  # huge details: the line alone
        message["error"].update(message=message["error"]["message"][:4000], details={})
    link.send(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the handler
            pass
    os._exit(0)  # threads the handler left behind must not keep the attempt
