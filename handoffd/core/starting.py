"""What opening the store must know of a daemon that is still starting: a stop asked of it
meanwhile, and the bound its batch puts on the start.

``handoffd serve``, ``run`` and ``db`` hold SIGTERM, SIGINT and SIGHUP from their first instruction
(:func:`hold_stop_signals`) and their daemon acts on them once it
runs. But opening a PostgreSQL store that is away waits for it (up to ``reconnect_seconds``)
before there is a daemon: that wait asks :func:`stop_asked` between its attempts (a stopped
start then ends at once, :class:`~handoffd.core.errors.StartStopped`, exit 0) and ends by
:func:`start_by` (``run --max-seconds``: a cron batch never outlives its period waiting).
"""
from __future__ import annotations

import contextvars
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

# the stop signals asked while starting (a signal handler appends: no lock, since a handler
# runs in the thread it interrupts and would deadlock on a lock that thread holds)
_ASKED: list[int] = []
# when a start must give up waiting for its store, on time.monotonic()'s clock; inf: no bound
_START_BY: contextvars.ContextVar[float] = contextvars.ContextVar("handoffd_start_by",
                                                                  default=math.inf)


# the stop signals that came before the daemon took them (hold_stop_signals), oldest first
HELD_SIGNALS: list[int] = []
# what SIGTERM, SIGINT and SIGHUP did before hold_stop_signals (release_stop_signals puts it back)
_BEFORE_HOLD: dict[int, Any] = {}
# the line (bytes, ready to write) a second stop signal says as it ends the start at once
# (empty: none), and the event that makes it a JSON log record instead (empty: plain text; its
# time is known only then); set by :func:`say_at_once`
_AT_ONCE: list[bytes] = [b""]
_AT_ONCE_EVENT: list[bytes] = [b""]


def hold_stop_signals(at_once: str = "") -> None:
    """Hold SIGTERM, SIGINT and SIGHUP from now on: each is recorded in :data:`HELD_SIGNALS`
    and asked (:func:`ask_stop`), and the daemon, once it takes them
    (:meth:`handoffd.service.daemon.Daemon.take_signals`, or
    :func:`handoffd.service.spread.spread`'s), acts on them as if they came then; ``handoffd db``
    ends with exit 0 "stopped" before it opens the store. A supervisor's stop that came while
    ``serve`` (or ``db init``) started (its imports, the workspace's checks) killed it with -15
    instead of the promised exit 0 (7 of 113 restarts under load). A second one before the
    daemon took them ends the process at once, with 0 (nothing is claimed yet): a start that
    waits (a store away) is not deaf to its supervisor: the first one also ends its wait for the
    store (exit 0, as a stop while it starts). ``at_once``: the line that second one says on
    stderr (:func:`say_at_once`; ``db``'s: it ended with no word). Called first thing by the
    console script (:func:`handoffd.cli.handoffd_cmd.main`), so this module stays light."""
    say_at_once(at_once)
    import signal
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):  # (core.procs.STOP_SIGNALS, not imported)
        signum = getattr(signal, name)
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue  # ignored by whoever started it (nohup, a script's background job): kept
            # so (R64: `nohup handoffd db import` ended "stopped" at a SIGHUP, importing nothing)
        before = signal.signal(signum, _hold)
        _BEFORE_HOLD.setdefault(signum, before)


def release_stop_signals() -> None:
    """Give SIGTERM, SIGINT and SIGHUP back what they did before :func:`hold_stop_signals`
    (nothing when they are not held): ``handoffd db``, once its store is open, is stopped by
    them as any program is."""
    import signal
    for signum, before in list(_BEFORE_HOLD.items()):
        signal.signal(signum, before)
        del _BEFORE_HOLD[signum]


def _hold(signum: int, frame: object) -> None:
    HELD_SIGNALS.append(signum)
    # (a wait for the store, in the engine's making, cannot be told otherwise: it looks)
    ask_stop(signum)
    if len(HELD_SIGNALS) > 1:  # "at once", as a second signal is documented to act
        stop_at_once()


def say_at_once(line: str, *, event: str = "") -> None:
    """From now on, a second stop signal during the start (:func:`stop_at_once`) says ``line``
    on stderr as it ends the process ("": it says nothing). With ``event`` (``--log-format
    json``), ``line`` is the message of one JSON log record with that event, as the daemon's
    own records read (time, level, message, event): plain text broke a log shipper's stream."""
    _AT_ONCE[0] = f"{line}\n".encode("utf-8", "backslashreplace") if line else b""
    _AT_ONCE_EVENT[0] = b""
    if line and event:  # (the record's message and event encoded now: a signal handler that
        # imported json could find it half-imported, were the signal to land in its import)
        import json
        _AT_ONCE[0] = json.dumps(line).encode("ascii")
        _AT_ONCE_EVENT[0] = json.dumps(event).encode("ascii")


def stop_at_once() -> NoReturn:
    """End the process now, with exit 0, saying the line of :func:`say_at_once` on stderr: a
    second stop signal during the start, before anything was done. Safe in a signal handler:
    one write(2) to file descriptor 2, no lock (``print`` to ``sys.stderr`` takes its buffer's
    lock, and a handler that interrupts a write to it fails with "reentrant call")."""
    import os
    import signal  # (loaded already: hold_stop_signals imported it)
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):  # a third signal while this exit unwinds said
        signal.signal(getattr(signal, name), signal.SIG_IGN)  # the line again, and one after
        # Python put the default handlers back on its way out killed it with -15 (RF)
    said = _AT_ONCE[0]
    if said and _AT_ONCE_EVENT[0]:
        said = _json_record(said, _AT_ONCE_EVENT[0])
    if said:
        try:
            os.write(2, said)
        except OSError:  # (stderr closed: the exit says the rest)
            pass
    raise SystemExit(0)


def _json_record(message: bytes, event: bytes) -> bytes:
    """``message`` and ``event`` (JSON strings, encoded) as one line of the daemon's JSON log
    format (its time: now, in UTC to the millisecond, as
    :class:`handoffd.cli.daemon_commands.JsonLines` writes it). Imports nothing: it runs in a
    signal handler."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    return (b'{"time": "' + stamp.encode("ascii") + b'", "level": "info", "message": ' + message
            + b', "event": ' + event + b"}\n")


def ask_stop(signum: int) -> None:
    """Record that stop signal ``signum`` came (safe in a signal handler: one list append)."""
    _ASKED.append(signum)


def stop_asked() -> bool:
    """True once a stop was asked of this process while it started (:func:`ask_stop`)."""
    return bool(_ASKED)


@contextmanager
def starting_within(seconds: float | None) -> Iterator[None]:
    """Within the block (this thread or context), waiting for a store that is away ends
    ``seconds`` from now (an earlier bound of an enclosing block still holds). None: no bound
    of its own."""
    if seconds is None:
        yield
        return
    token = _START_BY.set(min(_START_BY.get(), time.monotonic() + max(seconds, 0.0)))
    try:
        yield
    finally:
        _START_BY.reset(token)


def start_by() -> float:
    """When waiting for a store that is away must end (time.monotonic(); inf: no bound)."""
    return _START_BY.get()
