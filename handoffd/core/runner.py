"""Running one handler attempt: command specialists as child processes, Python ones in a thread
(a daemon's worker calls them itself, watched: :mod:`.watchdog`), or after a crash in a child
process of their own (:mod:`.isolation`); the child process handling both use is :mod:`.childproc`.

Both return the raw result object of the specialist protocol (docs/specialists.md) or raise HandlerError
(``PROCESSING_ERROR``, ``TIMEOUT``, ``CANCELLED``). A child runs in its own process group with an
argument list (never a shell) and a run token in its environment (see procs.py); on timeout or
cancellation the group and every token carrier get SIGTERM, then SIGKILL. When an attempt ends,
however it ends, nothing it started is left running: see :func:`run_command`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import subprocess
import threading
from typing import Any, Callable

from . import procrecords, procs
from .childproc import (
    STDERR_TAIL,
    Collector,
    Feed,
    await_exit,
    clear_previous_attempt,
    end_attempt,
    feed,
    forget_record,
    signal_name,
    start_threads,
    wait_attempt,
    write_record,
)
from .documents import MAX_DEPTH, RESULT_DEPTH_MARGIN, Outcome, nesting_depth
from .errors import ConfigError, ErrorCode, HandlerError, HandoffdError
from .ownfiles import START_UMASK
from .specialists import HandlerCancelled, HandlerContext, Specialist
from .starts import (
    SHORTAGES,
    THREADS,
    THREADS_LIMIT,
    shortage,
    started,
)
from .states import RESULT_STATUSES
from .watchdog import WATCHDOG, TakenOver, Takeover, cancelled

_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")  # an error code a handler may raise

# what a handler's call into ctx.context can be refused with, and whether a retry can help: a
# bad key, value or revision fails the same way every time (so not retried: it once was, as a
# PROCESSING_ERROR, and lost its code); a compare-and-set conflict may pass on the next attempt
CONTEXT_CODES: dict[str, bool] = {ErrorCode.INVALID_CONTEXT_KEY: False,
                                  ErrorCode.INVALID_CONTEXT_VALUE: False,
                                  ErrorCode.INVALID_CONTEXT_REVISION: False,
                                  ErrorCode.CONTEXT_CONFLICT: True}

log = logging.getLogger("handoffd")
# a result's encoder and decoder, made once (json.dumps with options makes an encoder per call;
# both keep no state between calls)
_STRICT = json.JSONEncoder(allow_nan=False, ensure_ascii=False)
_DECODER = json.JSONDecoder()

def validate_result(result: Any, handoff_id: str, max_bytes: int | None = None, *,
                    plain: bool = True) -> dict[str, Any]:
    """Check the protocol shape: an object whose ``status`` is a known value, and (``max_bytes``,
    ``[daemon] max_output_bytes``) no larger as JSON than a command's stdout may be. Unless
    ``plain`` (parsed JSON already), the result returned is a copy in plain JSON types: a dict
    or str subclass of a Python handler's could raise in any later step."""
    if not isinstance(result, dict):
        raise HandlerError(f"handoff {handoff_id}: handler returned {type(result).__name__}, "
                           "not a JSON object", handoff_id=handoff_id)
    try:  # what cannot be filed as strict UTF-8 JSON must fail the attempt, not the filing
        text = _STRICT.encode(result)  # (json.dumps(result, allow_nan=False, ensure_ascii=False))
        size = len(text.encode("utf-8"))
    except Exception as exc:  # (a handler's dict subclass may raise anything from items())
        raise HandlerError(f"handoff {handoff_id}: handler result cannot be filed as JSON "
                           f"({type(exc).__name__}: {_text(exc)[:120]})", handoff_id=handoff_id,
                           retryable=False) from None
    # what is filed must read back: no document nests past MAX_DEPTH, and the result sits some
    # levels down in it (a deeper answer was filed, then unreadable to `show` and `wait`); a
    # value cannot nest deeper than it has brackets, so most results need no walk
    limit = MAX_DEPTH - RESULT_DEPTH_MARGIN
    if text.count("{") + text.count("[") > limit and nesting_depth(result, limit) > limit:
        raise HandlerError(f"handoff {handoff_id}: handler result nests more than {limit} levels "
                           "deep; flatten it", handoff_id=handoff_id, retryable=False,
                           code=ErrorCode.DOCUMENT_TOO_DEEP)
    if not plain:  # (json.loads(text): the text is the encoder's, with nothing around it)
        result = _DECODER.raw_decode(text)[0]
    if max_bytes is not None and size > max_bytes:
        raise HandlerError(f"handoff {handoff_id}: handler result is {size} bytes as JSON, over "
                           f"max_output_bytes ({max_bytes}); write large results to a file and "
                           "name it in artifacts", handoff_id=handoff_id, retryable=False)
    status = result.get("status")
    if not isinstance(status, str) or status not in RESULT_STATUSES:  # a list is not hashable
        raise HandlerError(f"handoff {handoff_id}: handler result status {str(status)[:60]!r} "
                           f"is not one of {', '.join(sorted(RESULT_STATUSES))}", handoff_id=handoff_id)
    return result


class HandlerThreads:
    """Threads for Python handlers, kept for the next call instead of started per call.

    Each call gets a thread of its own (a handler that overruns its timeout keeps it, and the
    attempt ends without it), but a thread that finished waits for the next call: starting one
    per handoff cost more than a no-op handler runs. At most ``keep`` idle threads are kept."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._lock = threading.Lock()

    def run(self, func: Callable[[], None], name: str) -> None:
        """Start ``func()`` on an idle thread (renamed ``name``), or on a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        def named() -> None:
            threading.current_thread().name = name  # tracebacks and py-spy name the handoff
            func()
        inbox.put(named)

    def _serve(self, inbox: "queue.SimpleQueue[Callable[[], None] | None]") -> None:
        while True:
            func = inbox.get()
            if func is None:
                return
            func()  # (the functions given catch everything themselves)
            del func  # (kept while idle, it held the attempt it ran: its context, its document)
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)


HANDLER_THREADS = HandlerThreads()


def run_python(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext,
               timeout: float, takeover: Takeover | None = None) -> dict[str, Any]:
    """Call a Python handler and wait at most ``timeout`` seconds for its result.

    With ``takeover`` (a daemon's worker) the handler runs on the calling thread, watched by
    :data:`~handoffd.core.watchdog.WATCHDOG`: past the timeout, or once cancelled, the watchdog
    calls ``takeover(error)`` on another thread to end the attempt on time, and this call,
    when the handler returns at last, raises :class:`~handoffd.core.watchdog.TakenOver`.
    Without it, the handler runs in a thread of its own and this call waits: past the timeout
    the handoff ends TIMEOUT and the thread's eventual result is discarded. Either way a Python
    thread cannot be killed: the context's ``cancelled`` flag is set for the handler to see.
    """
    if spec.func is None:  # (a shortage importing it: not started, no `claimed`)
        _import_before_start(spec, ctx)
    if takeover is not None:
        return _run_inline(spec, doc, ctx, timeout, takeover)
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            call_handler(spec, doc, ctx, box)
        finally:
            done.set()

    try:
        HANDLER_THREADS.run(call, f"handler-{ctx.handoff_id}")
    except RuntimeError as exc:  # no thread to spare: the handler never started
        raise shortage(ctx, f"a thread for {spec.agent}'s handler", THREADS, _text(exc),
                        THREADS_LIMIT) from None
    started(ctx)
    wait_attempt(done, ctx, timeout)
    return handler_result(box, ctx)


def _run_inline(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext, timeout: float,
                takeover: Takeover) -> dict[str, Any]:
    box: dict[str, Any] = {}
    watch = WATCHDOG.watch(ctx, timeout, takeover)
    thread = threading.current_thread()
    name, thread.name = thread.name, f"handler-{ctx.handoff_id}"  # as py-spy and tracebacks show it
    try:
        started(ctx)
        call_handler(spec, doc, ctx, box)
    finally:
        thread.name = name
    if not WATCHDOG.done(watch):
        raise TakenOver(f"handoff {ctx.handoff_id}: the attempt was ended while its handler ran")
    if ctx.stop_requested:  # cancelled as it returned: still cancelled
        raise cancelled(ctx)
    return handler_result(box, ctx)


def call_handler(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext,
                 box: dict[str, Any]) -> None:
    """Call a Python handler: its result or exception into ``box``. What it does to the process
    itself is contained as it returns: a copy of the process it forked and returned in too ends
    here at once (it held the batch's pipes and the owner lock for ever), and a umask a handler
    changed is put back once no Python handler runs (files filed after it were written mode
    000; putting it back while another handler ran undid that one's own, deliberate umask)."""
    pid = os.getpid()
    with _HANDLERS.lock:
        _HANDLERS.running += 1
    try:
        # (imported already, as before every start but a failed import's: no call to ask)
        handler = spec.func if spec.func is not None and IMPORT_FAILED not in ctx.feature_state \
            else _imported(spec, ctx)
        box["result"] = handler(doc, ctx)
    except BaseException as exc:  # handler bugs become recorded errors, never daemon crashes
        box["error"] = _without_frames(exc)
    finally:
        if os.getpid() != pid:
            os._exit(0)
        with _HANDLERS.lock:
            _HANDLERS.running -= 1
            if not _HANDLERS.running and os.umask(_UMASK) != _UMASK:
                log.warning("a Python handler changed the process umask; put back to %03o",
                            _UMASK)


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` (and the exceptions it was raised from or during) with no traceback: only its
    type, text and attributes make the attempt's failure, and nothing shows the traceback.
    Kept, it held the handler's frames and this call's (the document, the handler's locals,
    and ``box``, which holds ``exc``: a reference cycle only CPython's cyclic collector freed,
    at its next pass; a serving daemon whose handlers failed held 165-520 MB with a lazier
    collector). Without it, reference counting frees them as the attempt's failure is made."""
    todo, seen = [exc], set()
    while todo:
        one = todo.pop()
        if id(one) in seen:  # (a chain can loop: `raise a from b` where b came from a)
            continue
        seen.add(id(one))
        try:  # (a handler's exception class may make any of these raise: then it keeps them)
            one.__traceback__ = None
            todo.extend(e for e in (one.__cause__, one.__context__)
                        if isinstance(e, BaseException))
            if isinstance(one, BaseExceptionGroup):
                todo.extend(e for e in one.exceptions if isinstance(e, BaseException))
        except Exception:
            continue
    return exc


# ctx.feature_state key: the failure importing the handler met before its start was told
IMPORT_FAILED = "handoffd.import_failed"


def _import_before_start(spec: Specialist, ctx: HandlerContext) -> None:
    """Import ``spec``'s Python handler before its start is told (:func:`started`: the event
    log's ``claimed``): a shortage of descriptors or memory importing it raises here, the
    attempt not started. Any other import failure is kept for :func:`call_handler` to meet
    (the handler's failure, as before; not imported twice)."""
    if spec.func is not None:
        return
    try:
        _imported(spec, ctx)
    except HandlerError:
        raise
    except Exception as exc:
        ctx.feature_state[IMPORT_FAILED] = exc


def _imported(spec: Specialist, ctx: HandlerContext) -> Any:
    """``spec``'s Python handler, imported on first use; a shortage of descriptors or memory
    importing it is a start shortage (the attempt is handed back uncounted), not the handler's
    failure: under a low ``ulimit -n`` it failed the first handoff of each specialist for good."""
    failed = ctx.feature_state.pop(IMPORT_FAILED, None)
    if isinstance(failed, Exception):  # (met before the start was told: the same failure)
        raise failed
    try:
        return spec.callable()
    except MemoryError:
        raise shortage(ctx, f"the handler of {spec.agent}", "ENOMEM",
                       "out of memory importing it", SHORTAGES[errno.ENOMEM]) from None
    except OSError as exc:
        if exc.errno not in SHORTAGES:
            raise
        raise shortage(ctx, f"the handler of {spec.agent}", errno.errorcode[exc.errno],
                       f"importing it: {exc.strerror or exc}", SHORTAGES[exc.errno]) from None


class _Running:
    """How many Python handlers run in this process (under its own ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0


_HANDLERS = _Running()


_UMASK = START_UMASK  # as the process started (a handler may not change it for the rest)


def handler_result(box: dict[str, Any], ctx: HandlerContext) -> dict[str, Any]:
    """The handler's result (``box["result"]``) checked and copied into plain JSON types (a
    dict or str subclass of the handler's could raise in any later step), or its exception as
    a HandlerError."""
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, HandlerError):
            raise rebuild_error(exc, ctx.handoff_id)
        if isinstance(exc, ConfigError):  # e.g. the handler module cannot be imported
            raise HandlerError(f"handoff {ctx.handoff_id}: {_text(exc)}", handoff_id=ctx.handoff_id,
                               retryable=False)
        if isinstance(exc, HandlerCancelled):
            raise HandlerError(_text(exc), handoff_id=ctx.handoff_id, code=ErrorCode.CANCELLED,
                               retryable=False)
        code = getattr(exc, "code", None) if isinstance(exc, HandoffdError) else None
        if isinstance(code, str) and code in CONTEXT_CODES:  # handoffd's context API refused
            # a call: its code kept (a handler's own exception may carry any object as code)
            raise HandlerError(f"handoff {ctx.handoff_id}: {_text(exc)}",
                               handoff_id=ctx.handoff_id, code=code,
                               retryable=CONTEXT_CODES[code])
        raise HandlerError(f"handoff {ctx.handoff_id}: handler raised {type(exc).__name__}: "
                           f"{_text(exc)}", handoff_id=ctx.handoff_id)
    return validate_result(box.get("result"), ctx.handoff_id, ctx.max_output_bytes, plain=False)


def _text(exc: BaseException) -> str:
    """``str(exc)``, whatever the handler's exception does in its ``__str__``."""
    try:
        return str(exc)
    except Exception:
        return f"(a {type(exc).__name__} that cannot be shown)"


def rebuild_error(exc: HandlerError, handoff_id: str) -> HandlerError:
    """A HandlerError a handler raised, rebuilt from checked parts: its code a short name (else
    PROCESSING_ERROR), its details only if they are a JSON object (a list as the code, or
    details that are not JSON, once broke the filing and stranded the claim)."""
    code = exc.code if isinstance(exc.code, str) and type(exc.code) in (str, ErrorCode) \
        and _CODE.fullmatch(exc.code) else ErrorCode.PROCESSING_ERROR
    details: dict[str, Any] = {}
    if isinstance(exc.details, dict):
        try:
            details = json.loads(json.dumps(exc.details, allow_nan=False, ensure_ascii=False))
        except Exception:
            details = {}
    retryable = exc.retryable if isinstance(exc.retryable, bool) else None
    return HandlerError(_text(exc), handoff_id=exc.handoff_id if isinstance(exc.handoff_id, str)
                        else handoff_id, code=code, retryable=retryable, details=details)


def cancel(ctx: HandlerContext, reason: str) -> None:
    """Ask a running attempt to stop now: sets the flag and wakes whoever waits on it."""
    ctx.stop(reason)


def run_command(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext, timeout: float,
                *, max_output_bytes: int, python: str | None = None) -> dict[str, Any]:
    """Run a command specialist: document on stdin, one JSON object expected on stdout.

    The attempt's processes are tracked (see procs.py): the previous attempt's leftovers on this
    host are killed before the child starts; the child leads its own process group, carries a
    run token in its environment, dies with its daemon (parent-death signal) and is recorded in
    ``handoffs/.meta/procs/``; when it exits (or times out, or is cancelled) everything still
    carrying the token or in its group is killed, the pipes are closed and the reader threads
    joined, so nothing of the attempt outlives it, whatever its children do with stdout."""
    assert spec.config.command is not None
    argv = list(spec.config.command)
    cwd = (ctx.root / spec.config.cwd).resolve() if spec.config.cwd else ctx.root
    if cwd != ctx.root and ctx.root not in cwd.parents:
        raise HandlerError(f"handoff {ctx.handoff_id}: specialist {spec.agent} has cwd "
                           f"{spec.config.cwd!r}, which is outside the workspace; fix handoffd.toml",
                           handoff_id=ctx.handoff_id, retryable=False)
    token = procs.new_token()
    env = dict(os.environ)
    env.update(spec.config.env)
    # $HANDOFF_TARGET is the agent the handler runs as (docs/orchestration.md: `handoff context
    # set` writes as it), from handoffd.toml: a hi_moe specialist_hint nobody serves falls back to
    # its tier's specialist, and the hint itself (any string of the document's: a NUL, 200 kB)
    # once went into the environment and the attempt could not start
    env.update(HANDOFF_ID=ctx.handoff_id, HANDOFFD_ROOT=str(ctx.root),
               HANDOFF_ATTEMPT=str(ctx.attempt), HANDOFF_TARGET=spec.agent)
    env.update(ctx.env)  # set by engine hooks, e.g. HANDOFF_ARTIFACT_PATH
    env[procs.TOKEN_ENV] = token  # last: nothing may override it
    try:  # before the spawn: short of memory for it, the handler is not started
        payload = json.dumps(doc).encode()
    except MemoryError:
        raise shortage(ctx, f"{argv[0][:200]!r} for {spec.agent}", "ENOMEM",
                       "out of memory writing its document", SHORTAGES[errno.ENOMEM]) from None
    clear_previous_attempt(ctx)
    record = procrecords.RunRecord.new(ctx.handoff_id, token, ctx.attempt)
    write_record(ctx, record)  # before the fork: a crash right after it still leaves the token
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True,
                                preexec_fn=procs.child_setup(os.getpid()))
    except (OSError, ValueError) as exc:  # (ValueError: a NUL, an unencodable character)
        forget_record(ctx, token)
        if isinstance(exc, OSError) and exc.errno in SHORTAGES:  # not the command's fault
            raise shortage(ctx, f"{argv[0][:200]!r} for {spec.agent}",
                            errno.errorcode[exc.errno], exc.strerror or str(exc),
                            SHORTAGES[exc.errno]) from None
        raise _start_failed(exc, argv, env, spec.agent, ctx.handoff_id) from None
    record.pgid = proc.pid
    record.leader_start = procs.start_time(proc.pid)
    write_record(ctx, record)
    out = Collector(proc.stdout, max_output_bytes, keep_tail=False)
    err = Collector(proc.stderr, STDERR_TAIL, keep_tail=True)
    done = threading.Event()  # the child exited, its output overflowed, or the attempt was cancelled
    exited = threading.Event()  # the child exited (it is not reaped yet: its group stays ours)
    fed = Feed(done)  # (short of memory writing its stdin: handed back uncounted)
    feeder = threading.Thread(target=feed, args=(proc, payload, exited, fed), daemon=True,
                              name=f"feed-{ctx.handoff_id}")
    waiter = threading.Thread(target=await_exit, args=(proc, exited, done), daemon=True,
                              name=f"wait-{ctx.handoff_id}")
    out.on_overflow = done.set
    error: HandlerError | None = None
    on_its_own = False  # the child had exited before end_attempt signalled it
    try:  # from the first thread on, however the attempt ends, end_attempt kills, reaps, closes
        start_threads(ctx, spec.agent, proc, exited, (out.thread, err.thread, waiter, feeder))
        started(ctx)
        wait_attempt(done, ctx, timeout)
        on_its_own = exited.is_set()
        if out.overflow:
            raise HandlerError(f"handoff {ctx.handoff_id}: handler wrote more than "
                               f"{max_output_bytes} bytes to stdout; it was stopped",
                               handoff_id=ctx.handoff_id, retryable=False)
    except HandlerError as exc:
        error = exc
    finally:
        end_attempt(ctx, proc, token, exited, (out, err), (feeder, waiter))
    if fed.short is not None and (error is None or error.code != ErrorCode.CANCELLED):
        answer = _whole_answer(proc, out, err, ctx.handoff_id) \
            if error is None and on_its_own else None
        if answer is not None:  # it did its work before the feed ran short: not run again
            return answer
        # it had started, on a cut document (or none), and was stopped: not the handler's
        # fault, handed back uncounted, its history saying it was stopped after its start
        raise shortage(ctx, f"{argv[0][:200]!r} for {spec.agent}", "ENOMEM",
                       "out of memory writing its document to its stdin",
                       SHORTAGES[errno.ENOMEM], after_start=True) from None
    if error is not None:
        if error.code in (ErrorCode.CANCELLED, ErrorCode.TIMEOUT):  # what it printed on SIGTERM
            error.details.setdefault("partial_stdout", out.data()[-65536:].decode("utf-8", "replace"))
        try:
            raise error
        finally:  # (kept in this frame, it and its traceback, which holds the frame, made a
            del error  # reference cycle: the attempt's document freed only by the collector)
    return _parse_output(proc.returncode, out.data(), err.data(), ctx.handoff_id)


def _whole_answer(proc: subprocess.Popen[bytes], out: Collector, err: Collector,
                  handoff_id: str) -> dict[str, Any] | None:
    """The result of a child that exited on its own, status 0, with a valid ``completed``
    result, although its document's feed ran short meanwhile (the same pass of the wait): it
    did its work, which a hand-back would run again. None otherwise. Its stdin was never
    closed, so it met no end of a cut document; whatever else it printed is not trusted."""
    if proc.returncode != 0:
        return None
    try:
        result = _parse_output(0, out.data(), err.data(), handoff_id)
    except (HandlerError, MemoryError):
        return None
    return result if result.get("status") == "completed" else None


def _start_failed(exc: OSError | ValueError, argv: list[str], env: dict[str, str], agent: str,
                  handoff_id: str) -> HandlerError:
    """Why a command could not start, as one line that blames what is at fault: a command that
    is not there or not executable is handoffd.toml's; arguments and environment the system
    refuses (too large: E2BIG; a NUL byte or an unencodable character: ValueError) may come
    from handoffd.toml, the daemon's own environment or this handoff (e.g. its answers in
    $HANDOFF_CLARIFICATIONS), so the line names the largest or the offending variable."""
    head = f"handoff {handoff_id}: cannot start {argv[0][:200]!r} for {agent}"
    if isinstance(exc, OSError) and exc.errno == errno.E2BIG:
        sizes = {name: _size(name) + _size(value) + 2 for name, value in env.items()}
        total = sum(sizes.values()) + sum(_size(arg) + 1 for arg in argv)
        name = max(sizes, key=sizes.__getitem__, default="")
        message = (f"{head}: its arguments and environment are too large for the system "
                   f"(E2BIG: {total} bytes; the largest variable is ${ascii(name[:60])[1:-1]}, "
                   f"{sizes.get(name, 0)} bytes, and one may not exceed 128 KiB); shrink "
                   "command or env in handoffd.toml, the daemon's environment, or what this "
                   "handoff passes")
        reason = "E2BIG"
    elif isinstance(exc, OSError):
        message = (f"{head}: {exc.strerror or type(exc).__name__}; check command in handoffd.toml "
                   f"for {agent}")
        reason = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    else:
        message = f"{head}: {_unpassable(argv, env)}; the system cannot pass it to a process"
        reason = "UNPASSABLE"
    return HandlerError(message, handoff_id=handoff_id, retryable=False,
                        details={"cannot_start": reason})


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _unpassable(argv: list[str], env: dict[str, str]) -> str:
    """Which argument or environment variable the system cannot pass (a NUL byte, a character
    that cannot be encoded, an '=' in a variable's name: what makes Popen raise ValueError)."""
    for number, arg in enumerate(argv):
        if not _passable(arg):
            return (f"argument {number} of its command (handoffd.toml) holds a NUL byte or a "
                    "character that cannot be encoded")
    for name, value in env.items():
        if not _passable(name) or "=" in name or not _passable(value):
            shown = ascii(name[:60])[1:-1]
            return (f"the environment variable ${shown} holds a NUL byte or a character that "
                    "cannot be encoded, or its name an '='")
    return "its arguments or environment hold a NUL byte or a character that cannot be encoded"


def _passable(text: str) -> bool:
    try:
        os.fsencode(text)
    except (UnicodeError, ValueError):
        return False
    return "\0" not in text


def _parse_output(code: int, stdout: bytes, stderr: bytes, handoff_id: str) -> dict[str, Any]:
    tail = stderr.decode("utf-8", "replace").strip()[-STDERR_TAIL:]
    hint = f"; stderr: {tail}" if tail else ""
    if code < 0:  # killed by a signal: said as an isolated Python handler's death is
        raise HandlerError(f"handoff {handoff_id}: handler died (signal {-code}, "
                           f"{signal_name(-code)}){hint}", handoff_id=handoff_id,
                           details={"signal": -code, "stderr_tail": tail})
    if code != 0:
        raise HandlerError(f"handoff {handoff_id}: handler exited with status {code}{hint}",
                           handoff_id=handoff_id, details={"exit_code": code, "stderr_tail": tail})
    try:  # JSON is UTF-8: other bytes were once filed as U+FFFD, the answer silently changed
        text = stdout.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise HandlerError(f"handoff {handoff_id}: handler output is not UTF-8 (byte {exc.start})"
                           f"{hint}", handoff_id=handoff_id, code=ErrorCode.NOT_UTF8,
                           retryable=False, details={"stderr_tail": tail}) from None
    if not text:
        raise HandlerError(f"handoff {handoff_id}: handler exited without printing a result{hint}",
                           handoff_id=handoff_id, details={"stderr_tail": tail})
    try:
        result = json.loads(text)
    except (ValueError, RecursionError):  # (nesting past the recursion limit: not a result)
        shown = text[:120].replace("\n", " ")
        raise HandlerError(f"handoff {handoff_id}: handler output is not JSON: {shown!r}{hint}",
                           handoff_id=handoff_id, details={"stderr_tail": tail}) from None
    return validate_result(result, handoff_id)


def keep_partial(ctx: HandlerContext, outcome: Outcome) -> Outcome:
    """A cancelled or timed-out attempt keeps what the handler had: ``ctx.report_partial``'s
    output, else the last JSON line a command printed on SIGTERM (its ``output``, or the whole
    object). The filed output then carries ``metadata.partial = true``."""
    error = outcome.error if isinstance(outcome.error, dict) else None
    if error is None:
        return outcome
    given = error.get("details")
    details: dict[str, Any] = given if isinstance(given, dict) else {}
    partial: Any = ctx.partial
    text = details.pop("partial_stdout", None)
    if not details:
        error.pop("details", None)
    if partial is None and isinstance(text, str) and text.strip():
        try:
            parsed = json.loads(text.strip().split("\n")[-1], parse_constant=_no_constant)
        except (ValueError, IndexError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            partial = parsed.get("output", parsed)
            if isinstance(parsed.get("warnings"), list):
                outcome.warnings = list(parsed["warnings"])
    partial = _fileable(partial, ctx)
    if partial is not None:
        outcome.output = partial
        outcome.metadata = dict(outcome.metadata or {})
        outcome.metadata["partial"] = True
    return outcome


def _no_constant(name: str) -> Any:
    """``json.loads``'s hook for NaN and Infinity, which are not JSON: refused."""
    raise ValueError(f"{name} is not JSON")


def _fileable(partial: Any, ctx: HandlerContext) -> Any:
    """A plain JSON copy of ``partial`` when it can be filed as a result's output (strict JSON,
    within the result's depth and ``max_output_bytes``), else None with one warning: a partial
    that could not be filed made the filing itself fail (NaN: a traceback and a claim stranded
    until recovery) or filed a document nobody could read back (too deep)."""
    if partial is None:
        return None
    try:
        return validate_result({"status": "failed", "output": partial}, ctx.handoff_id,
                               ctx.max_output_bytes, plain=False)["output"]
    except HandlerError as exc:
        log.warning("handoff %s: its partial result is not kept: %s", ctx.handoff_id, exc)
    except Exception as exc:  # (a handler's own object may raise anything when copied)
        log.warning("handoff %s: its partial result is not kept: %s: %s", ctx.handoff_id,
                    type(exc).__name__, _text(exc)[:120])
    return None
