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
from typing import IO, TYPE_CHECKING, Any

from ...core.errors import is_shortage
from .shortages import wait_out

if TYPE_CHECKING:
    import subprocess
    import threading

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


def check(criterion: str, *, cwd: Path, timeout: float, env: dict[str, str],
          cancelled: threading.Event | None = None) -> dict[str, Any]:
    """Evaluate one criterion; the record filed under ``validation.criteria``. ``cancelled``:
    the attempt's stop, which ends a wait for descriptors early (see :func:`run`)."""
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
    return dict(record, **run(argv, cwd=cwd, timeout=timeout, env=env, cancelled=cancelled))


def run(argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str],
        cancelled: threading.Event | None = None) -> dict[str, Any]:
    """Run ``argv`` (no shell) with a time limit; status, exit code, duration and output tail.
    A command that cannot start for a passing shortage (EMFILE...) is started again after a
    wait (see :func:`_start`); one that still cannot start has failed, as any other."""
    import subprocess

    from ...core import deathwatch, procs
    # a run token of its own, as an attempt's handler has: a daemon killed meanwhile takes the
    # criterion's whole tree with it (its death watch kills the token's carriers), or it ran on
    # beside the attempt another host started after the lease (session 26, R48)
    token = os.urandom(16).hex()
    env = {**env, procs.TOKEN_ENV: token}
    started = _start(argv, cwd=cwd, env=env, cancelled=cancelled)
    if isinstance(started, OSError):
        return {"status": "failed", "exit_code": None, "duration_seconds": 0.0,
                "output_tail": f"cannot start {argv[0]!r}: {started.strerror or started}"}
    sink, proc = started
    deathwatch.guard(token, f"criterion {argv[0][:100]!r}", 0, proc.pid)
    try:
        return _wait(proc, sink, timeout)
    finally:
        deathwatch.release(token)


def _wait(proc: subprocess.Popen[bytes], sink: IO[bytes], timeout: float) -> dict[str, Any]:
    """Wait for the criterion's command (killing its group past ``timeout``): its result."""
    import subprocess
    began = time.monotonic()
    with sink:
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
        duration = round(time.monotonic() - began, 3)
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


def _start(argv: list[str], *, cwd: Path, env: dict[str, str],
           cancelled: threading.Event | None) -> tuple[IO[bytes], subprocess.Popen[bytes]] | OSError:
    """The command's output file and process, or the OSError that kept it from starting.
    A passing shortage (descriptors, memory: the daemon's, not the command's fault) is waited out
    (:func:`~handoffd.features.contracts.shortages.wait_out`) and only this command started
    again: the criteria run before it keep their results (run again, their changes would be
    judged as the handler's). A shortage creating the output file, past the waits, is raised."""
    import subprocess
    import tempfile

    from ...core import procs
    waits = 0
    while True:
        try:
            sink = tempfile.TemporaryFile()
        except OSError as exc:
            if not is_shortage(exc) or not wait_out(exc, waits, f"criterion {argv[0]!r}: its "
                                                    "output file could not be made", cancelled):
                raise
            waits += 1
            continue
        try:
            return sink, subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                          stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True,
                                          preexec_fn=procs.child_setup(os.getpid()))
        except OSError as exc:
            sink.close()
            if not is_shortage(exc) or not wait_out(exc, waits, f"criterion {argv[0]!r} could "
                                                    "not start", cancelled):
                return exc
            waits += 1


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
