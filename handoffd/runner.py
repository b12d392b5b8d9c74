"""Running one handler attempt: command specialists as child processes, Python ones in a thread.

Both return the raw result object of the README's specialist protocol or raise HandlerError
(``PROCESSING_ERROR``, ``TIMEOUT``, ``CANCELLED``). A child runs in its own process group with an
argument list (never a shell); on timeout or cancellation the group gets SIGTERM, then SIGKILL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

from .errors import ConfigError, HandlerError
from .specialists import HandlerCancelled, HandlerContext, Specialist

RESULT_STATUSES = {"completed", "failed", "partial", "blocked", "needs_clarification", "delegated"}
KILL_GRACE_SECONDS = 2.0
STDERR_TAIL = 4096


def validate_result(result: Any, handoff_id: str) -> dict[str, Any]:
    """Check the protocol shape: an object whose ``status`` is a known value."""
    if not isinstance(result, dict):
        raise HandlerError(f"handoff {handoff_id}: handler returned {type(result).__name__}, "
                           "not a JSON object", handoff_id=handoff_id)
    if result.get("status") not in RESULT_STATUSES:
        raise HandlerError(f"handoff {handoff_id}: handler result status {result.get('status')!r} "
                           f"is not one of {', '.join(sorted(RESULT_STATUSES))}", handoff_id=handoff_id)
    return result


def run_python(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext,
               timeout: float) -> dict[str, Any]:
    """Call a Python handler in its own thread and wait at most ``timeout`` seconds.

    A Python thread cannot be killed: past the timeout the handoff ends TIMEOUT, the context's
    ``cancelled`` flag is set and the thread's eventual result is discarded.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["result"] = spec.callable()(doc, ctx)
        except BaseException as exc:  # handler bugs become recorded errors, never daemon crashes
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=call, name=f"handler-{ctx.handoff_id}", daemon=True)
    worker.start()
    _wait(done, ctx, timeout)
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, HandlerError):
            raise exc
        if isinstance(exc, ConfigError):  # e.g. the handler module cannot be imported
            raise HandlerError(f"handoff {ctx.handoff_id}: {exc}", handoff_id=ctx.handoff_id,
                               retryable=False)
        if isinstance(exc, HandlerCancelled):
            raise HandlerError(str(exc), handoff_id=ctx.handoff_id, code="CANCELLED", retryable=False)
        raise HandlerError(f"handoff {ctx.handoff_id}: handler raised {type(exc).__name__}: {exc}",
                           handoff_id=ctx.handoff_id)
    return validate_result(box.get("result"), ctx.handoff_id)


def _wait(done: threading.Event, ctx: HandlerContext, timeout: float) -> None:
    """Wait for ``done``; raise TIMEOUT / CANCELLED. Cancellation sets ``done`` too (no polling)."""
    ctx.extra.setdefault("wake", []).append(done)
    if ctx.cancelled.is_set() and ctx.extra.get("cancel_reason"):
        done.set()  # cancelled before we started waiting: do not sleep until the timeout
    deadline = time.monotonic() + timeout
    while not done.wait(max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            ctx.cancelled.set()
            raise HandlerError(f"handoff {ctx.handoff_id}: handler did not finish within "
                               f"{timeout:g}s", handoff_id=ctx.handoff_id, code="TIMEOUT", retryable=True)
    if ctx.cancelled.is_set() and ctx.extra.get("cancel_reason"):
        raise HandlerError(f"handoff {ctx.handoff_id} cancelled: {ctx.extra['cancel_reason']}",
                           handoff_id=ctx.handoff_id, code="CANCELLED", retryable=False)


def cancel(ctx: HandlerContext, reason: str) -> None:
    """Ask a running attempt to stop now: sets the flag and wakes whoever waits on it."""
    ctx.extra["cancel_reason"] = reason
    ctx.cancelled.set()
    for event in ctx.extra.get("wake", []):
        event.set()


def run_command(spec: Specialist, doc: dict[str, Any], ctx: HandlerContext, timeout: float,
                *, max_output_bytes: int, python: str | None = None) -> dict[str, Any]:
    """Run a command specialist: document on stdin, one JSON object expected on stdout."""
    assert spec.config.command is not None
    argv = list(spec.config.command)
    cwd = (ctx.root / spec.config.cwd).resolve() if spec.config.cwd else ctx.root
    if cwd != ctx.root and ctx.root not in cwd.parents:
        raise HandlerError(f"handoff {ctx.handoff_id}: specialist {spec.agent} has cwd "
                           f"{spec.config.cwd!r}, which is outside the workspace; fix handoffd.toml",
                           handoff_id=ctx.handoff_id, retryable=False)
    env = dict(os.environ)
    env.update(spec.config.env)
    env.update(HANDOFF_ID=ctx.handoff_id, HANDOFFD_ROOT=str(ctx.root),
               HANDOFF_ATTEMPT=str(ctx.attempt), HANDOFF_TARGET=ctx.target)
    env.update(ctx.extra.get("env") or {})  # set by engine hooks, e.g. HANDOFF_ARTIFACT_PATH
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True)
    except OSError as exc:
        raise HandlerError(f"handoff {ctx.handoff_id}: cannot start {argv[0]!r}: {exc.strerror}; "
                           f"check command in handoffd.toml for {spec.agent}",
                           handoff_id=ctx.handoff_id, retryable=False) from None
    payload = json.dumps(doc).encode()
    out = _Collector(proc.stdout, max_output_bytes, keep_tail=False)
    err = _Collector(proc.stderr, STDERR_TAIL, keep_tail=True)
    feeder = threading.Thread(target=_feed, args=(proc, payload), daemon=True)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (proc.wait(), done.set()), daemon=True)
    out.on_overflow = done.set
    for thread in (feeder, out.thread, err.thread, waiter):
        thread.start()
    try:
        _wait(done, ctx, timeout)
        if out.overflow:
            raise HandlerError(f"handoff {ctx.handoff_id}: handler wrote more than "
                               f"{max_output_bytes} bytes to stdout; it was stopped",
                               handoff_id=ctx.handoff_id, retryable=False)
    except HandlerError as exc:
        _stop(proc)
        if exc.code == "CANCELLED":  # keep what a handler printed on SIGTERM (partial results)
            out.thread.join(timeout=KILL_GRACE_SECONDS)
            exc.details.setdefault("partial_stdout", out.data()[-65536:].decode("utf-8", "replace"))
        raise
    finally:
        if proc.poll() is None:
            _stop(proc)
        for thread in (out.thread, err.thread):
            thread.join(timeout=KILL_GRACE_SECONDS)
    return _parse_output(proc.returncode, out.data(), err.data(), ctx.handoff_id)


def _parse_output(code: int, stdout: bytes, stderr: bytes, handoff_id: str) -> dict[str, Any]:
    tail = stderr.decode("utf-8", "replace").strip()[-STDERR_TAIL:]
    hint = f"; stderr: {tail}" if tail else ""
    if code != 0:
        raise HandlerError(f"handoff {handoff_id}: handler exited with status {code}{hint}",
                           handoff_id=handoff_id, details={"exit_code": code, "stderr_tail": tail})
    text = stdout.decode("utf-8", "replace").strip()
    if not text:
        raise HandlerError(f"handoff {handoff_id}: handler exited without printing a result{hint}",
                           handoff_id=handoff_id, details={"stderr_tail": tail})
    try:
        result = json.loads(text)
    except ValueError:
        shown = text[:120].replace("\n", " ")
        raise HandlerError(f"handoff {handoff_id}: handler output is not JSON: {shown!r}{hint}",
                           handoff_id=handoff_id, details={"stderr_tail": tail}) from None
    return validate_result(result, handoff_id)


def _feed(proc: subprocess.Popen[bytes], payload: bytes) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the handler need not read its input


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the handler's process group, then SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, KILL_GRACE_SECONDS)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class _Collector:
    """Drains a pipe in a thread, keeping at most ``limit`` bytes (the head, or the tail)."""

    def __init__(self, pipe: Any, limit: int, *, keep_tail: bool) -> None:
        self.pipe, self.limit, self.keep_tail = pipe, limit, keep_tail
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflow = False
        self.on_overflow: Any = None
        self.thread = threading.Thread(target=self._drain, daemon=True)

    def _drain(self) -> None:
        while True:
            chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
            if not chunk:
                break
            self.chunks.append(chunk)
            self.size += len(chunk)
            if self.size > self.limit:
                if self.keep_tail:
                    joined = b"".join(self.chunks)[-self.limit:]
                    self.chunks, self.size = [joined], len(joined)
                else:
                    self.overflow = True
                    if self.on_overflow:
                        self.on_overflow()
                    break
        self.pipe.close()

    def data(self) -> bytes:
        return b"".join(self.chunks)
