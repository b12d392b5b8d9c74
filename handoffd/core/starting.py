"""What opening the store must know of a daemon that is still starting: a stop asked of it
meanwhile, and the bound its batch puts on the start.

``handoffd serve`` and ``run`` hold SIGTERM, SIGINT and SIGHUP from their first instruction
(:func:`handoffd.cli.daemon_commands.hold_stop_signals`) and their daemon acts on them once it
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
from typing import Iterator

# the stop signals asked while starting (a signal handler appends: no lock, since a handler
# runs in the thread it interrupts and would deadlock on a lock that thread holds)
_ASKED: list[int] = []
# when a start must give up waiting for its store, on time.monotonic()'s clock; inf: no bound
_START_BY: contextvars.ContextVar[float] = contextvars.ContextVar("handoffd_start_by",
                                                                  default=math.inf)


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
