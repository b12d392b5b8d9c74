"""Python handlers in a one-shot process of their own: who runs isolated, and the parent's side.

An in-process handler that ends its process (``os._exit``, a segfault, ``kill -9`` of itself)
takes every attempt running beside it down, and recovery cannot tell which one did it: each
is charged a retry. So a handoff whose previous attempt ended that way runs its next attempt
in a child process (:func:`run_isolated`): if it crashes again, only its own attempt fails
(``PROCESSING_ERROR``, "the handler's process died (signal 9)"), and it stays isolated for
as long as its attempts keep dying. The worker waits for the child as for a command handler,
so nothing else in the daemon is held. Which attempts run isolated (:func:`isolate`) is read
from the handoff's own history, which is trusted bookkeeping: a claim keeps only a sealed
``handoffd`` block (docs/guarantees.md), and the specialist's ``isolate`` setting
(``"after_crash"``, the default; ``"always"``; ``"never"``).

The child (:mod:`handoffd.core.isolated`) is started like a command handler (own process group,
run token, parent-death signal, a process record; killed with its group at the timeout or on
cancellation, SIGTERM then SIGKILL). Two dedicated pipes connect it to the parent: the request
and answers go down one, and messages come up the other, one JSON object per line: ``partial``
(``ctx.report_partial``), ``call`` (``ctx.context``, served here by the daemon's own context view,
so the child sees the same store and permissions) and finally ``result`` or ``error``, or
``not_started`` when the child could not import the handler for a passing shortage of
descriptors or memory (handed back uncounted, as an in-process handler's import is). The
child's stdout and stderr are one more pipe, kept as a tail for the error of an attempt that
fails; nothing a handler prints can reach the message pipe.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import select
import subprocess
import sys
import threading
from typing import Any, Callable

from . import procrecords, procs
from .childproc import (
    POLL_MS,
    STDERR_TAIL,
    Collector,
    await_exit,
    clear_previous_attempt,
    end_attempt,
    forget_record,
    signal_name,
    start_threads,
    wait_attempt,
    write_record,
)
from .documents import PROCESS_DIED, book
from .errors import SHORTAGE_ERRNOS, HandlerError
from .runner import rebuild_error, validate_result
from .specialists import HandlerContext, Specialist, handler_reference
from .starts import SHORTAGES, shortage, started
from .suspects import Suspects

log = logging.getLogger("handoffd")

CHILD = "handoffd.core.isolated"
# what the child runs: the daemon's own sys.path first (a handler imports in the child exactly
# as it would in the daemon, whatever put its module on the path), then the child's main
BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
        f"from {CHILD} import main; main(sys.argv[2:])")
# a message may exceed max_output_bytes by this much: its wrapper, an error's message and details
MESSAGE_MARGIN = 64 * 1024
# the calls a child may make on its context view (the daemon's), with the keyword arguments each takes
CONTEXT_CALLS: dict[str, frozenset[str]] = {
    "get_with_revision": frozenset(), "set": frozenset({"if_revision"}),
    "keys": frozenset({"prefix"}), "may_write": frozenset()}


def isolate(spec: Specialist, doc: dict[str, Any], handoff_id: str,
            suspects: Suspects | None = None) -> bool:
    """Whether this attempt of a Python specialist runs in a process of its own: its
    ``isolate`` setting, and with ``"after_crash"`` (the default) :func:`crashed_last` or the
    specialist being marked in ``suspects`` (:mod:`.suspects`). A handler that no other process
    can import (defined in ``__main__`` or inside a function) runs in the daemon, with a
    warning; with ``"always"`` its attempts fail instead."""
    mode = spec.config.isolate
    if mode == "always":
        return True
    if mode == "never":
        return False
    if crashed_last(doc):
        why = "its last attempt ended with its process"
    elif suspects is not None and spec.agent in suspects:
        return handler_reference(spec) is not None  # (marked only when it can be: said then)
    else:
        return False
    if handler_reference(spec) is None:
        log.warning("handoff %s: %s, but the handler %s of %s cannot be imported by another "
                    "process (defined in __main__ or inside a function): it runs in the daemon",
                    handoff_id, why, spec.config.handler, spec.agent)
        return False
    log.warning("handoff %s: %s; its handler runs in a process of its own", handoff_id, why)
    return True


def crashed_last(doc: dict[str, Any]) -> bool:
    """True when the attempt before the one just claimed ended with its process: recovered
    from a dead (or stalled) owner, or an isolated attempt whose process died without a result.

    Read from ``doc``'s history back from its last ``claimed`` (this attempt): claims handed
    back (never started, or stopped by a daemon's stop) say nothing of the handler and are
    passed over; then a ``recovered`` (with the ``retry_scheduled`` it led to), a
    ``retry_scheduled`` or ``failed`` that says :data:`~.documents.PROCESS_DIED`, or a manual
    ``retried`` of a handoff that failed on its recovery or its isolated death. Anything else
    (it ran and failed, was throttled...) clears it.
    ``doc`` is the claimed document: the store kept its ``handoffd`` block only if it is sealed
    for the folder it was claimed from, so a history written outside handoffd counts for nothing."""
    history = book(doc).get("history") if isinstance(doc.get("handoffd"), dict) else None
    events: list[dict[str, Any]] = []
    names: list[Any] = []
    for event in history if isinstance(history, list) else ():  # (one pass: every attempt)
        if isinstance(event, dict):
            events.append(event)
            names.append(event.get("event"))
    if "claimed" not in names:
        return False
    k = len(names) - 1 - names[::-1].index("claimed") - 1
    while k >= 1 and names[k] == "handed_back" and names[k - 1] == "claimed":
        k -= 2
    if k >= 1 and names[k] == "retried" and names[k - 1] == "failed":
        if _died(events[k - 1]):  # dead-lettered by its isolated deaths, then retried by hand
            return True
        k -= 2
    elif k >= 0 and names[k] == "retry_scheduled":
        if _died(events[k]):
            return True
        k -= 1
    return k >= 0 and names[k] == "recovered"


def _died(entry: dict[str, Any]) -> bool:
    """Did the attempt this event ended die with its isolated process? (a ``failed`` event
    says so itself; a ``retry_scheduled`` one in its error's details)"""
    detail = entry.get("detail")
    if isinstance(detail, dict) and detail.get(PROCESS_DIED) is True:
        return True
    error = detail.get("error") if isinstance(detail, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    return isinstance(details, dict) and details.get(PROCESS_DIED) is True


def run_isolated(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext, timeout: float,
                 *, max_output_bytes: int, suspects: Suspects | None = None) -> dict[str, Any]:
    """Run a Python handler in a child process and wait at most ``timeout`` seconds for its
    result; the result is checked as an in-process one (:func:`~.runner.validate_result`).
    Raises HandlerError: the handler's own, TIMEOUT, CANCELLED, or PROCESSING_ERROR when the
    process dies without a result (details ``process_died``, the signal or exit status and the
    tail of its output)."""
    ref = handler_reference(spec)
    if ref is None:
        raise HandlerError(f"handoff {ctx.handoff_id}: specialist {spec.agent} has isolate = "
                           f"\"always\", but its handler {spec.config.handler!r} cannot be imported "
                           "by another process (defined in __main__ or inside a function); move "
                           "it into a module", handoff_id=ctx.handoff_id, retryable=False)
    request = _request(ref, spec, doc, ctx, max_output_bytes)
    token = procs.new_token()
    env = dict(os.environ)
    env[procs.TOKEN_ENV] = token
    clear_previous_attempt(ctx)
    record = procrecords.RunRecord.new(ctx.handoff_id, token, ctx.attempt)
    write_record(ctx, record)  # before the fork: a crash right after it still leaves the token
    proc, up_r, down_w = _spawn(spec, ctx, env, token)
    record.pgid = proc.pid
    record.leader_start = procs.start_time(proc.pid)
    write_record(ctx, record)
    done = threading.Event()  # the child exited, or its messages broke the protocol
    exited = threading.Event()
    channel = _Channel(up_r, down_w, ctx, request, max_output_bytes + MESSAGE_MARGIN, done.set)
    output = Collector(proc.stdout, STDERR_TAIL, keep_tail=True)
    waiter = threading.Thread(target=await_exit, args=(proc, exited, done), daemon=True,
                              name=f"wait-{ctx.handoff_id}")
    try:  # from the first thread on, however the attempt ends, end_attempt kills, reaps, closes
        # the channel, which hands the child its request, last: a child whose threads could
        # not all be started is killed before its handler has anything to run
        start_threads(ctx, spec.agent, proc, exited, (output.thread, waiter, channel.thread))
        started(ctx)  # (the event log's `claimed` now, not when the child's answer is in)
        wait_attempt(done, ctx, timeout)
    finally:
        end_attempt(ctx, proc, token, exited, (channel, output), (waiter,))
    if channel.final is not None and "not_started" in channel.final \
            and not (channel.overflow or channel.problem):
        raise _import_shortage(channel.final["not_started"], spec, ctx)
    try:
        return _answer(channel, proc.returncode, output.data(), ctx.handoff_id, max_output_bytes)
    except HandlerError as exc:
        if suspects is not None and isinstance(exc.details, dict) and exc.details.get(PROCESS_DIED):
            suspects.mark(spec)  # its new handoffs too: each would take the daemon down once
        raise


def _import_shortage(given: Any, spec: Specialist, ctx: HandlerContext) -> HandlerError:
    """The child could not import the handler for a passing shortage of descriptors or memory
    (its ``not_started`` message: :func:`.isolated.main`): a start shortage, as an in-process
    handler's import (:func:`~.starts.shortage`: handed back uncounted, after a back-off); it
    once failed the handoff for good as a configuration error. A message that names no such
    shortage breaks the protocol (a failure the retry policy counts)."""
    info: dict[str, Any] = given if isinstance(given, dict) else {}
    reason, why = info.get("reason"), info.get("why")
    code = next((c for c in SHORTAGE_ERRNOS if errno.errorcode[c] == reason), None)
    if code is None or not isinstance(why, str):
        return HandlerError(f"handoff {ctx.handoff_id}: the handler's process broke the protocol "
                            f"with its daemon (a not_started message naming no shortage: "
                            f"{str(given)[:80]!r})", handoff_id=ctx.handoff_id)
    return shortage(ctx, f"the handler of {spec.agent}", errno.errorcode[code], why[:200],
                    SHORTAGES[code])


def _spawn(spec: Specialist, ctx: HandlerContext, env: dict[str, str],
           token: str) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start the child with its two message pipes: (the child, the parent's read end of the up
    pipe, its write end of the down pipe). When they cannot be made, nothing is left behind (no
    descriptor, no process record) and the HandlerError says why; a passing shortage
    (descriptors, processes, memory: :data:`~.starts.SHORTAGES`) marks the attempt as not started
    (:func:`~.starts.not_started`), so its claim is handed back uncounted, as a command
    handler's is (it once counted as a failed attempt, and an EMFILE from a pipe escaped as an
    OSError, its record and first pipe left behind)."""
    opened: list[int] = []
    try:
        opened += os.pipe()  # parent -> child: the request, then answers to its calls
        opened += os.pipe()  # child -> parent: messages
        down_r, down_w, up_r, up_w = opened
        argv = [sys.executable, "-c", BOOT,
                json.dumps([p for p in sys.path if isinstance(p, str)]), str(down_r), str(up_w)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                pass_fds=(down_r, up_w), preexec_fn=procs.child_setup(os.getpid()))
    except OSError as exc:
        for fd in opened:
            os.close(fd)
        forget_record(ctx, token)
        if exc.errno in SHORTAGES:  # not the handler's fault: it runs again after a back-off
            raise shortage(ctx, f"a process for {spec.agent}'s handler",
                            errno.errorcode[exc.errno], exc.strerror or str(exc),
                            SHORTAGES[exc.errno]) from None
        raise HandlerError(f"handoff {ctx.handoff_id}: cannot start a process for its handler: "
                           f"{exc.strerror or exc}", handoff_id=ctx.handoff_id) from None
    os.close(down_r)
    os.close(up_w)
    return proc, up_r, down_w


def _request(ref: str, spec: Specialist, doc: dict[str, Any], ctx: HandlerContext,
             max_output_bytes: int) -> bytes:
    """The child's first line: which handler, the document and what its context carries."""
    fields = {"handoff_id": ctx.handoff_id, "attempt": ctx.attempt, "root": str(ctx.root),
              "data": ctx.data, "target": ctx.target, "clarifications": ctx.clarifications,
              "artifact_path": None if ctx.artifact_path is None else str(ctx.artifact_path),
              "artifact_rel": ctx.artifact_rel, "deadline_monotonic": ctx.deadline_monotonic,
              "max_output_bytes": max_output_bytes, "context": ctx.context_factory is not None}
    try:
        return (json.dumps({"handler": ref, "agent": spec.agent, "doc": doc, "ctx": fields},
                           allow_nan=False) + "\n").encode()
    except (TypeError, ValueError) as exc:  # (a hook put something that is not JSON in the context)
        raise HandlerError(f"handoff {ctx.handoff_id}: cannot hand the handoff to a process of its "
                           f"own: {exc}", handoff_id=ctx.handoff_id, retryable=False) from None


def _answer(channel: "_Channel", code: int | None, output: bytes, handoff_id: str,
            max_output_bytes: int) -> dict[str, Any]:
    """The attempt's result from what the child sent and how it ended."""
    tail = output.decode("utf-8", "replace").strip()[-STDERR_TAIL:]
    last = tail.splitlines()[-1][:200] if tail else ""
    hint = f"; its last output: {last!r}" if last else ""
    if channel.overflow:
        raise HandlerError(f"handoff {handoff_id}: the handler's process sent a message of more "
                           f"than {channel.limit} bytes; it was stopped (max_output_bytes is "
                           f"{max_output_bytes})", handoff_id=handoff_id, retryable=False)
    if channel.problem:
        raise HandlerError(f"handoff {handoff_id}: the handler's process broke the protocol with "
                           f"its daemon ({channel.problem}); it was stopped{hint}",
                           handoff_id=handoff_id, details={"output_tail": tail})
    final = channel.final
    if final is None:
        details: dict[str, Any] = {PROCESS_DIED: True, "output_tail": tail}
        if code is not None and code < 0:
            details["signal"] = -code
            how = f"died (signal {-code}, {signal_name(-code)})"
        else:
            details["exit_code"] = code
            how = f"exited with status {code} without a result"
        raise HandlerError(f"handoff {handoff_id}: the handler's process {how}{hint}",
                           handoff_id=handoff_id, details=details)
    if "error" in final:
        raise _error_from(final["error"], handoff_id)
    return validate_result(final.get("result"), handoff_id, max_output_bytes)


def _error_from(given: Any, handoff_id: str) -> HandlerError:
    """The child's HandlerError, rebuilt from checked parts (see runner.rebuild_error)."""
    error: dict[str, Any] = given if isinstance(given, dict) else {}
    message = error.get("message")
    exc = HandlerError(message if isinstance(message, str) else
                       f"handoff {handoff_id}: the handler's process sent an unreadable error",
                       handoff_id=handoff_id, code=error.get("code"),  # type: ignore[arg-type]
                       retryable=error.get("retryable"), details=error.get("details"))
    return rebuild_error(exc, handoff_id)


class _Channel:
    """The parent's end of the two message pipes, served by one thread: it writes the request,
    then reads the child's messages (``partial``, ``call``, ``result`` / ``error``), answering
    calls on the down pipe. A message that is not one of these, or one longer than ``limit``,
    stops the attempt (``on_trouble``). Polls, so :meth:`finish` ends it in bounded time."""

    def __init__(self, up: int, down: int, ctx: HandlerContext, request: bytes, limit: int,
                 on_trouble: Callable[[], None]) -> None:
        self.up, self.down, self.ctx, self.request, self.limit = up, down, ctx, request, limit
        self.on_trouble = on_trouble
        self.final: dict[str, Any] | None = None
        self.problem = ""
        self.overflow = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"isolated-{ctx.handoff_id}")

    def _serve(self) -> None:
        try:
            if self._send(self.request):
                self._read()
        except OSError:
            pass
        finally:
            for fd in (self.up, self.down):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _send(self, data: bytes) -> bool:
        """Write ``data`` down to the child; False once it cannot be (the child is gone)."""
        view = memoryview(data)
        os.set_blocking(self.down, False)
        poller = select.poll()
        poller.register(self.down, select.POLLOUT)
        while view:
            if self.stop.is_set():
                return False
            if not poller.poll(POLL_MS):
                continue
            try:
                view = view[os.write(self.down, view[:65536]):]
            except BlockingIOError:
                continue
            except OSError:  # EPIPE: the child is gone
                return False
        return True

    def _read(self) -> None:
        poller = select.poll()
        poller.register(self.up, select.POLLIN)
        buffer = bytearray()
        while True:
            stopping = self.stop.is_set()
            if not poller.poll(0 if stopping else POLL_MS):
                if stopping:
                    return
                continue
            chunk = os.read(self.up, 65536)
            if not chunk:
                return
            buffer += chunk
            while (end := buffer.find(b"\n")) >= 0:
                line, buffer = bytes(buffer[:end]), buffer[end + 1:]
                if not self._handle(line):
                    return
            if len(buffer) > self.limit:
                self.overflow = True
                self.on_trouble()
                return

    def _handle(self, line: bytes) -> bool:
        """Act on one message; False when the child broke the protocol (the attempt stops)."""
        if len(line) > self.limit:
            self.overflow = True
            self.on_trouble()
            return False
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return self._trouble(f"a message that is not JSON: {line[:80]!r}")
        keys = set(message) if isinstance(message, dict) else set()
        if keys == {"partial"}:
            if self.final is None:
                self.ctx.report_partial(message["partial"])
        elif "call" in keys and keys <= {"call", "args", "kwargs"}:
            return self._send(self._call(message))
        elif keys in ({"result"}, {"error"}, {"not_started"}):
            if self.final is None:  # the first answer counts
                self.final = message
        else:
            return self._trouble(f"an unknown message: {line[:80]!r}")
        return True

    def _trouble(self, problem: str) -> bool:
        self.problem = problem
        self.on_trouble()
        return False

    def _call(self, message: dict[str, Any]) -> bytes:
        """Run one of the child's ``ctx.context`` calls on the daemon's view; its answer line."""
        name, args, kwargs = message.get("call"), message.get("args", []), message.get("kwargs", {})
        try:
            if not isinstance(name, str) or name not in CONTEXT_CALLS or not isinstance(args, list) \
                    or not isinstance(kwargs, dict) or not set(kwargs) <= CONTEXT_CALLS[name]:
                raise TypeError(f"ctx.context has no call {str(name)[:40]!r} with these arguments")
            answer: dict[str, Any] = {"ok": getattr(self.ctx.context, name)(*args, **kwargs)}
            return (json.dumps(answer, allow_nan=False) + "\n").encode()
        except Exception as exc:  # the handler gets it, as it would in the daemon
            return (json.dumps({"raise": describe(exc)}) + "\n").encode()

    def finish(self, wait: float) -> None:
        """Join the thread: up to ``wait`` seconds for the child's messages to end, then stop
        (one that was never started, for want of a thread to spare, only closes the pipes: the
        thread closes them otherwise)."""
        if self.thread.ident is None:
            for fd in (self.up, self.down):
                try:
                    os.close(fd)
                except OSError:
                    pass
            return
        self.thread.join(timeout=wait)
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join(timeout=wait + POLL_MS / 1000)


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as the child rebuilds it: its class by name, its arguments and attributes
    (those that are JSON)."""
    def plain(value: Any) -> bool:
        try:
            json.dumps(value, allow_nan=False)
            return True
        except (TypeError, ValueError, RecursionError):
            return False
    return {"module": type(exc).__module__, "qualname": type(exc).__qualname__,
            "args": [a for a in exc.args if plain(a)] if all(plain(a) for a in exc.args)
            else [str(exc)],
            "attrs": {k: v for k, v in vars(exc).items() if not k.startswith("_") and plain(v)}}

