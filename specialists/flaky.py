#!/usr/bin/env python3
"""@flaky: a test specialist that misbehaves on request.

A handoffd command specialist (docs/specialists.md) whose behaviour is chosen by the handoff's
``input.data``: ``{"mode": ..., "seconds": N, "message": "..."}``.

=============  ====================================================================================
mode           behaviour
=============  ====================================================================================
ok (default)   ``completed`` with ``output: {"echo": data}``
fail           ``failed``, ``PROCESSING_ERROR``, retryable
permanent      ``failed``, ``PROCESSING_ERROR``, not retryable
garbage        prints text that is not JSON, exits 0
sleep          sleeps ``seconds`` (default 1), then completes
crash          writes ``message`` to stderr and exits 3 without printing anything
empty          exits 0 without printing anything
huge           writes ``seconds`` MiB (default 64) of ``x`` to stdout  (``seconds`` is the size here)
fail_then_ok   fails (retryable) while ``$HANDOFF_ATTEMPT`` < 2, completes from attempt 2 on
exclusive      like sleep, but first checks that no earlier run of the same handoff is still alive
               (``artifacts/live/<id>.pid``); a live one is appended to
               ``artifacts/flaky-overlaps.jsonl`` (two runs of one handoff at the same time)
=============  ====================================================================================

Before acting, every run appends one JSON line ``{"id", "attempt", "pid", "mode"}`` to
``$HANDOFFD_ROOT/artifacts/flaky-runs.jsonl`` with a single ``O_APPEND`` write, so tests can count
executions even when several runs happen at once. Standard library only.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

MODES = ("ok", "fail", "permanent", "garbage", "sleep", "crash", "empty", "huge", "fail_then_ok",
         "exclusive")
MIB = 1024 * 1024
RUN_LOG = Path("artifacts") / "flaky-runs.jsonl"


def attempt_number() -> int:
    """``$HANDOFF_ATTEMPT`` as an int (1 when absent or malformed)."""
    try:
        return int(os.environ.get("HANDOFF_ATTEMPT", "1"))
    except ValueError:
        return 1


def log_run(root: Path, handoff_id: str | None, attempt: int, mode: str) -> None:
    """Append one line to the run log in a single O_APPEND write (atomic for small lines)."""
    path = root / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"id": handoff_id, "attempt": attempt, "pid": os.getpid(), "mode": mode,
                       "at": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def exclusive_run(root: Path, handoff_id: str, seconds: float) -> None:
    """Sleep ``seconds`` as the only live run of ``handoff_id``; record any overlap seen."""
    live = root / "artifacts" / "live"
    live.mkdir(parents=True, exist_ok=True)
    marker = live / f"{handoff_id}.pid"
    try:
        other = int(marker.read_text())
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid() and _is_flaky(other):
        line = json.dumps({"id": handoff_id, "pid": os.getpid(), "alive": other}) + "\n"
        fd = os.open(root / "artifacts" / "flaky-overlaps.jsonl",
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    staged = live / f".{handoff_id}.{os.getpid()}"
    staged.write_text(str(os.getpid()))
    os.replace(staged, marker)
    time.sleep(seconds)
    try:
        if marker.read_text() == str(os.getpid()):
            marker.unlink()
    except OSError:
        pass


def _is_flaky(pid: int) -> bool:
    """True when ``pid`` is a live (not zombie) run of this script."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and b"flaky.py" in cmdline


def emit(result: dict[str, Any]) -> int:
    """Print the one result object and return exit status 0."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def failed(message: str, *, retryable: bool, code: str = "PROCESSING_ERROR") -> dict[str, Any]:
    """A failure result."""
    return {"status": "failed", "error": {"code": code, "message": message, "retryable": retryable}}


def completed(data: Any, attempt: int, **extra: Any) -> dict[str, Any]:
    """A success result echoing the input data."""
    result: dict[str, Any] = {"status": "completed", "output": {"echo": data},
                              "metadata": {"attempt": attempt, "pid": os.getpid()}}
    result.update(extra)
    return result


def write_huge(mebibytes: float) -> int:
    """Write ``mebibytes`` MiB of ``x`` to stdout (stops quietly if the reader goes away)."""
    remaining = int(mebibytes * MIB)
    chunk = b"x" * MIB
    out = sys.stdout.buffer
    try:
        while remaining > 0:
            piece = chunk[:remaining]
            out.write(piece)
            remaining -= len(piece)
        out.flush()
    except (BrokenPipeError, OSError):
        # the reader stopped listening; exit without a traceback (and without flushing again)
        os._exit(0)
    return 0


def crash(message: str) -> NoReturn:
    """Die the way a broken handler does: stderr text, exit status 3, nothing on stdout."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.exit(3)


def number(data: dict[str, Any], key: str, default: float) -> float:
    """A non-negative number from ``data`` (``default`` when absent or not a number)."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return default
    return float(value)


def main() -> int:
    """Read the handoff, log the run, then behave as ``input.data.mode`` says."""
    raw = sys.stdin.buffer.read()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        doc = None
    inp = doc.get("input") if isinstance(doc, dict) else None
    data = inp.get("data") if isinstance(inp, dict) else None
    if not isinstance(data, dict):
        data = {}
    mode = data.get("mode", "ok")
    attempt = attempt_number()
    handoff_id = os.environ.get("HANDOFF_ID") or (doc.get("handoff_id") if isinstance(doc, dict) else None)
    root = Path(os.environ.get("HANDOFFD_ROOT") or os.getcwd())
    log_run(root, handoff_id, attempt, str(mode))

    message = data.get("message")
    message = message if isinstance(message, str) else f"flaky: mode {mode!r} on attempt {attempt}"
    if doc is None:
        return emit(failed("the handoff on stdin is not JSON", retryable=False,
                           code="SCHEMA_VALIDATION_FAILED"))
    if mode not in MODES:
        return emit(failed(f"unknown mode {mode!r}; use one of {', '.join(MODES)}",
                           retryable=False, code="SCHEMA_VALIDATION_FAILED"))
    if mode == "ok":
        return emit(completed(data, attempt))
    if mode == "fail":
        return emit(failed(message, retryable=True))
    if mode == "permanent":
        return emit(failed(message, retryable=False))
    if mode == "garbage":
        sys.stdout.write("this is not JSON {{{ <<<\n")
        return 0
    if mode == "sleep":
        time.sleep(number(data, "seconds", 1.0))
        return emit(completed(data, attempt))
    if mode == "exclusive":
        exclusive_run(root, str(handoff_id), number(data, "seconds", 0.05))
        return emit(completed(data, attempt))
    if mode == "crash":
        crash(message)
    if mode == "empty":
        return 0
    if mode == "huge":
        return write_huge(number(data, "seconds", 64.0))
    # fail_then_ok
    if attempt < 2:
        return emit(failed(f"{message} (failing until attempt 2)", retryable=True))
    return emit(completed(data, attempt, warnings=[f"succeeded on attempt {attempt}"]))


if __name__ == "__main__":
    sys.exit(main())
