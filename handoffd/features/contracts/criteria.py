"""Success criteria of contracts (seed 004): run the checkable ones, record the rest as unchecked.

Checkable forms (the prefix is case-insensitive)::

    Tests pass: CMD
    Type check passes: CMD
    Command succeeds: CMD

``CMD`` is split with :func:`shlex.split` and run as an argument list — never through a shell —
in the contract's directory, with stdin closed, in its own process group, and killed when it
outlives its time limit. It passes when it exits 0. Anything else is prose: recorded as
``unchecked``, never as passed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

FORMS = (("tests", "tests pass:"), ("type_check", "type check passes:"),
         ("command", "command succeeds:"))
TAIL_CHARS = 2000
KILL_WAIT_SECONDS = 5.0


def parse(criterion: str) -> tuple[str, str] | None:
    """``(kind, command text)`` for a checkable criterion, None for prose."""
    text = criterion.strip()
    lowered = text.lower()
    for kind, prefix in FORMS:
        if lowered.startswith(prefix):
            return kind, text[len(prefix):].strip()
    return None


def check(criterion: str, *, cwd: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Evaluate one criterion; the record filed under ``validation.criteria``."""
    parsed = parse(criterion)
    if parsed is None:
        return {"criterion": criterion, "kind": "prose", "status": "unchecked",
                "note": "free prose: not machine-checkable"}
    kind, text = parsed
    record: dict[str, Any] = {"criterion": criterion, "kind": kind, "command": text}
    import shlex  # shlex, subprocess, tempfile, signal: only for contracts with checkable criteria
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        return dict(record, status="failed", exit_code=None, duration_seconds=0.0,
                    output_tail=f"cannot split the command: {exc}")
    if not argv:
        return dict(record, status="failed", exit_code=None, duration_seconds=0.0,
                    output_tail="no command after the prefix")
    record["argv"] = argv
    return dict(record, **run(argv, cwd=cwd, timeout=timeout, env=env))


def run(argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` (no shell) with a time limit; status, exit code, duration and output tail."""
    import subprocess
    import tempfile
    started = time.monotonic()
    with tempfile.TemporaryFile() as sink:
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return {"status": "failed", "exit_code": None, "duration_seconds": 0.0,
                    "output_tail": f"cannot start {argv[0]!r}: {exc.strerror or exc}"}
        timed_out = False
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            try:
                proc.wait(timeout=KILL_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            code = proc.returncode
        duration = round(time.monotonic() - started, 3)
        sink.seek(0, os.SEEK_END)
        size = sink.tell()
        sink.seek(max(size - TAIL_CHARS * 4, 0))
        tail = sink.read().decode("utf-8", "replace")[-TAIL_CHARS:]
    result: dict[str, Any] = {"status": "passed" if code == 0 and not timed_out else "failed",
                              "exit_code": code, "duration_seconds": duration,
                              "output_tail": tail}
    if timed_out:
        result["timed_out"] = True
        result["output_tail"] = (tail + f"\n[killed after {timeout:g}s time limit]").lstrip("\n")
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
