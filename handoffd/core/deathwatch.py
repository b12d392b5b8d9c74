"""The death watch: a small process per daemon process that kills the daemon's running attempts
on this host the moment the daemon dies, however it dies (``kill -9`` too).

The parent-death signal (procs.py) kills only an attempt's direct child. A wrapper that forks
(``sh -c "python3 work.py; true"``, ``bash run.sh``) leaves its grandchild running when its
daemon is killed, and until now only the next daemon's sweep on this host killed it (through
the records under ``handoffs/.meta/procs/``). With a shared store (PostgreSQL), another host
recovers the claim without waiting for that, and runs attempt 2 beside the orphan.

So the first attempt of a daemon process that starts a child (a command specialist, an
isolated Python handler) also starts :func:`main` as ``python -I -S`` in a session of its own,
holding the read end of a pipe whose write end only the daemon holds (close-on-exec, so no
handler inherits it; closed in any child forked without exec, see :func:`_forget_after_fork`).
The daemon tells it each attempt it starts (run token, process group) and each it ends. When
the pipe reaches end of file the daemon is gone: a clean exit has ended every attempt and the
watch exits quietly; otherwise it kills every attempt still open with :func:`procs.kill_runs`
(the token's carriers, and the group only when a member carries the token: the same proof as
every other kill; one pass over /proc per round for all of them), then exits. It ignores stop
signals (SIGTERM, SIGINT, SIGHUP): it ends with its daemon, never before. It only ever knows its
own daemon's attempts, by their raw tokens (never read from the workspace), so it cannot touch
another daemon's.

A daemon that runs only in-process Python handlers never starts it. Each process of a spread
(``--processes N``) starts its own: any one of them can be killed alone. The daemon never waits
for it: its messages are a few hundred bytes written without blocking; a watch that cannot be
started, stopped reading or died is one warning line, and the attempts run as before (the next
sweep on this host still kills what a dead daemon left).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import procs
from .shown import clean

log = logging.getLogger("handoffd")

# at most one start a minute: after a failed start, or a watch that died (a broken install
# would otherwise start one per attempt); one warning line each time
RESTART_SECONDS = 60.0
_LINE_LIMIT = 4096  # PIPE_BUF: a shorter write to a pipe is atomic, never torn by a kill
# (appended: first on the path, a site-packages folder's stdlib look-alikes, backports of
# pathlib or typing, replaced the standard library in the watch alone, which died at import; a
# failed import is one line, not a traceback)
_BOOT = ("import sys\nsys.path.append(sys.argv[1])\ntry:\n"
         " from handoffd.core.deathwatch import main\n"
         "except BaseException as exc:\n"
         " sys.stderr.write('handoffd: ERROR: the death watch cannot start: %s: %s\\n'"
         " % (type(exc).__name__, str(exc)[:200]))\n"
         " sys.exit(1)\n"
         "main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))")


class _Watch:
    """The daemon's side: its death watch's process and the pipe's write end."""

    def __init__(self, proc: Any, write: int) -> None:
        self.proc = proc
        self.write = write
        self.started = time.monotonic()


_lock = threading.Lock()
_watch: _Watch | None = None
_open: dict[str, bytes] = {}  # token -> the message naming its attempt: replayed to a new watch
_next_start = 0.0  # monotonic time before which no start is tried again (a start failed)
_stuck_said = False


def guard(token: str, handoff_id: str, attempt: int, pgid: int | None = None) -> None:
    """Tell the death watch an attempt runs (started first if need be); again with ``pgid``
    once its child leads its group. Never raises, never blocks."""
    line = _message(["+", token, pgid, attempt, handoff_id[:200]])
    with _lock:
        _open[token] = line
        if _watch is not None and _send(line):
            return
        # none yet, or the one there was found gone just now: started (at most one a
        # minute) and told every open attempt, this one too; it was left unwatched until the
        # next attempt's start (R48)
        _start()


def _log_style() -> tuple[str, int]:
    """How the daemon logs (its ``--log-format``, its level): the watch's lines match them
    (plain text in a ``--log-format json`` stream broke its shipper; R48)."""
    handlers = logging.getLogger().handlers
    style = "json" if any(type(h.formatter).__name__ == "JsonLines" for h in handlers) else "text"
    return style, log.getEffectiveLevel()


def release(token: str) -> None:
    """Tell the death watch an attempt is over (its processes are killed and reaped)."""
    with _lock:
        if _open.pop(token, None) is not None and _watch is not None:
            _send(_message(["-", token]))


def _message(item: list[Any]) -> bytes:
    return json.dumps(item).encode() + b"\n"


def _start() -> None:
    """Start the death watch and tell it every open attempt; on failure one warning line, and
    no new try for :data:`RESTART_SECONDS`. Called under ``_lock``."""
    global _watch, _next_start
    if time.monotonic() < _next_start:
        return
    import subprocess
    read = write = -1
    try:
        read, write = os.pipe()  # both close-on-exec: no child of the daemon inherits them
        os.set_blocking(write, False)  # never block the daemon on a watch that does not read
        package_parent = str(Path(__file__).resolve().parent.parent.parent)
        style, level = _log_style()
        proc = subprocess.Popen(
            [sys.executable or "python3", "-I", "-S", "-c", _BOOT, package_parent, str(read),
             str(os.getpid()), style, str(level)], pass_fds=(read,), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except Exception as exc:  # (no descriptor, no process, no memory, no interpreter: any)
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
        _next_start = time.monotonic() + RESTART_SECONDS
        log.warning("cannot start the death watch of this daemon (pid %d): %s; if the daemon is "
                    "killed, its attempts' processes run on until a sweep on this host kills "
                    "them", os.getpid(), getattr(exc, "strerror", None) or exc)
        return
    os.close(read)
    _watch = _Watch(proc, write)
    for line in list(_open.values()):
        if not _send(line):
            return


def _send(line: bytes) -> bool:
    """Write one message; False when the watch is gone (then forgotten: the next guard starts
    another, told every open attempt). Called under ``_lock``."""
    global _watch, _stuck_said, _next_start
    assert _watch is not None
    if len(line) > _LINE_LIMIT:  # (cannot happen: a token, two numbers and 200 characters)
        return True
    try:
        os.write(_watch.write, line)
        _stuck_said = False
        return True
    except BlockingIOError:  # its pipe is full: it does not read (stopped?); dropped, said once
        if not _stuck_said:
            _stuck_said = True
            log.warning("the death watch of this daemon (pid %d) does not read its pipe: an "
                        "attempt started now is not killed at once if the daemon is killed",
                        _watch.proc.pid)
        return True
    except OSError as exc:  # EPIPE: it died (killed by someone)
        watch, _watch = _watch, None
        _next_start = watch.started + RESTART_SECONDS
        os.close(watch.write)
        status = watch.proc.poll()  # (reaped, not left a zombie)
        log.warning("the death watch of this daemon (pid %d) is gone (%s, exit status %s); "
                    "another is started with the next attempt (at most one a minute)",
                    watch.proc.pid, exc.strerror or exc, status)
        return False


def _forget_after_fork() -> None:
    """In a child forked without exec (a spread's process, a handler's ``multiprocessing``):
    close the inherited write end, or the watch would never see its daemon's death while the
    child lives; the child's own attempts get a watch of their own."""
    global _watch, _lock, _stuck_said, _next_start
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    if _watch is not None:
        try:
            os.close(_watch.write)
        except OSError:
            pass
    _watch = None
    _open.clear()
    _stuck_said = False
    _next_start = 0.0


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------- the watch's process

def main(read: int, daemon_pid: int, style: str = "text", level: int = logging.WARNING) -> None:
    """The death watch's process: note the attempts the daemon (``daemon_pid``) opens and ends
    from pipe ``read``; at end of file kill every attempt left open, then return. ``style`` and
    ``level``: how the daemon logs (text or json lines; its level)."""
    # it ends with its daemon, and only then: a stop signal meant for the daemon (systemd's
    # SIGTERM to the whole service, a terminal's SIGHUP) would leave the daemon's drain unwatched
    for signum in procs.STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonLine() if style == "json"
                         else logging.Formatter("handoffd: %(levelname)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    opened = _follow(read)
    if not opened:
        return  # the daemon exited cleanly (or ended each attempt before it died)
    # all at once: one pass over /proc per round for every open attempt (one kill_run each,
    # one scan or more each, took about a second for hundreds while the others ran on)
    runs = [(token, pgid) for token, (pgid, _, _) in opened.items()]
    try:
        results: list[tuple[int, int] | None] = list(procs.kill_runs(runs))
    except Exception as exc:  # one at a time then: a failure stops no other attempt's kill
        log.error("killing the attempts of daemon pid %d at once failed: %s; one at a time",
                  daemon_pid, exc)
        results = [None] * len(runs)
    for (token, (pgid, attempt, handoff_id)), result in zip(opened.items(), results):
        try:
            killed, survivors = result if result is not None else procs.kill_run(token, pgid)
        except Exception as exc:  # never stop before the other attempts are killed
            log.error("handoff %s: killing attempt %s after its daemon (pid %d) died failed: %s",
                      handoff_id, attempt, daemon_pid, exc)
            continue
        if killed or survivors:
            log.warning("handoff %s: daemon pid %d died; killed %d process(es) of attempt %s "
                        "still running%s", handoff_id, daemon_pid, killed, attempt,
                        f" ({survivors} survive SIGKILL)" if survivors else "")


class _JsonLine(logging.Formatter):
    """The watch's lines in the daemon's ``--log-format json``: time, level, message."""

    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime, timezone
        at = datetime.fromtimestamp(record.created, timezone.utc)
        return json.dumps({"time": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                           "level": record.levelname.lower(), "message": record.getMessage()})


def _follow(read: int) -> dict[str, tuple[int | None, Any, str]]:
    """Read messages until end of file; returns the attempts still open then."""
    opened: dict[str, tuple[int | None, Any, str]] = {}
    rest = b""
    while True:
        try:
            chunk = os.read(read, 65536)
        except OSError:
            chunk = b""  # (no error is expected from a pipe: read as the daemon's end)
        if not chunk:
            return opened
        *lines, rest = (rest + chunk).split(b"\n")
        if len(rest) > _LINE_LIMIT:
            rest = b""
        for line in lines:
            _note(opened, line)


def _note(opened: dict[str, tuple[int | None, Any, str]], line: bytes) -> None:
    try:
        item = json.loads(line)
        if item[0] == "+":
            pgid = item[2] if type(item[2]) is int else None
            opened[str(item[1])] = (pgid, item[3], clean(str(item[4])))
        elif item[0] == "-":
            opened.pop(str(item[1]), None)
    except (ValueError, IndexError, TypeError, KeyError):
        pass  # (only the daemon writes here)
