"""Python handlers called on the worker's own thread, and the watchdog that ends them on time.

A daemon's worker calls a Python handler directly: handing each call to a thread of its own and
waiting for it cost two thread wake-ups per handoff, more than a short handler runs (see
docs/performance.md). A thread cannot be killed, so the limits are kept from outside: each call
is *watched* (:meth:`Watchdog.watch`) with its deadline, and when the deadline passes or the
attempt is cancelled first, the watchdog's thread takes the attempt over. It marks the watch
taken and starts a thread that ends the attempt on time (``takeover(error)``: the daemon files
TIMEOUT or CANCELLED), while the worker stays inside the handler. When the handler returns at
last, :meth:`Watchdog.done` says the attempt is no longer the worker's, and the worker unwinds
with :class:`TakenOver`, filing nothing. Exactly one of the two ends an attempt: the handler's
return and the takeover both settle the watch under one lock.

The watchdog sleeps until the earliest deadline it knows of, and with none, for IDLE_LOOK_SECONDS.
A new call with a later deadline (the usual case: one timeout for every handoff, of seconds or
minutes) does not wake it; one with an earlier deadline, or a cancellation, does. (Sleeping
without end when idle made every call after a pause, which in a lightly loaded daemon is every
call, wake the watchdog's thread while the worker ran.)
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable

from .errors import ErrorCode, HandlerError
from .specialists import HandlerContext

Takeover = Callable[[HandlerError], None]
log = logging.getLogger("handoffd")
IDLE_LOOK_SECONDS = 1.0  # how long the watchdog sleeps with nothing to watch


class TakenOver(Exception):
    """Raised in a worker whose handler returned after the watchdog took its attempt over: the
    attempt is already ended elsewhere, so the worker files nothing and unwinds."""


class Watch:
    """One watched handler call: its deadline, its attempt and who ends it."""

    __slots__ = ("deadline", "timeout", "ctx", "takeover", "_watchdog")

    def __init__(self, watchdog: Watchdog, ctx: HandlerContext, timeout: float,
                 takeover: Takeover) -> None:
        self._watchdog = watchdog
        self.ctx = ctx
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.takeover = takeover

    def set(self) -> None:
        """Called by :meth:`HandlerContext.stop` (a cancellation): the watchdog looks now."""
        self._watchdog.poke()



class Watchdog:
    """Takes over watched calls that overrun their deadline or are cancelled (one thread, started
    on first use and again in a forked child)."""

    def __init__(self) -> None:
        # (a worker takes the lock itself, twice a handoff: a Condition's own enter and exit
        # are Python calls, the lock's are not; it is the lock the Condition waits with)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._open: dict[int, Watch] = {}
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None
        self.running_late = 0  # handlers still running after the watchdog ended their attempt

    def watch(self, ctx: HandlerContext, timeout: float, takeover: Takeover) -> Watch:
        """Start watching a call of ``ctx``'s handler that may run ``timeout`` seconds; past
        that, or once cancelled, ``takeover`` is called on a new thread with the error to file."""
        watch = Watch(self, ctx, timeout, takeover)
        with self._lock:
            self._open[id(watch)] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="handoffd-watchdog",
                                                daemon=True)
                self._thread.start()
            if watch.deadline < self._wake_at:
                self._wake_at = watch.deadline
                self._cv.notify()
        ctx.wake_on_cancel(watch)
        if watch.ctx.stop_requested:  # cancelled before the call began
            self.poke()
        return watch

    def done(self, watch: Watch) -> bool:
        """The handler returned: True when the worker still owns the attempt, False when the
        watchdog took it over (the worker must then file nothing)."""
        with self._lock:
            if self._open.pop(id(watch), None) is not None:
                return True
            self.running_late -= 1
        late = time.monotonic() - watch.deadline
        log.info("handoff %s: its handler returned %.1fs after the attempt was ended; its result "
                 "is discarded", watch.ctx.handoff_id, max(late, 0.0))
        return False

    def poke(self) -> None:
        """Look at every open watch now."""
        with self._cv:
            self._wake_at = -math.inf
            self._cv.notify()

    def _serve(self) -> None:
        while True:
            with self._cv:
                due = self._due(time.monotonic())
                if not due:
                    self._cv.wait(max(self._wake_at - time.monotonic(), 0.0))
                    continue
            for watch in due:
                if not watch.ctx.stop_requested:  # (a cancelled handler is expected to stop on its own)
                    log.warning("handoff %s: its handler is still running past its %gs timeout; "
                                "the attempt ends now and the handler's thread is left to finish "
                                "(%d such)", watch.ctx.handoff_id, watch.timeout, self.running_late)
                try:
                    _take_over(watch)
                except Exception:  # e.g. no thread could be started: this thread must live on
                    log.exception("handoff %s: could not end the attempt", watch.ctx.handoff_id)

    def _due(self, now: float) -> list[Watch]:
        """Settle and return the watches past their deadline or cancelled (under the lock)."""
        due = [w for w in self._open.values() if w.deadline <= now or w.ctx.stop_requested]
        for watch in due:
            del self._open[id(watch)]
        self.running_late += len(due)
        self._wake_at = min((w.deadline for w in self._open.values()),
                            default=now + IDLE_LOOK_SECONDS)
        return due

    def forget(self) -> None:
        """In a forked child: the parent's watches and thread are not this process's."""
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._open = {}
        self._wake_at = math.inf
        self._thread = None
        self.running_late = 0


def cancelled(ctx: HandlerContext) -> HandlerError:
    """The error of an attempt stopped with a reason (CANCELLED, never retried)."""
    return HandlerError(f"handoff {ctx.handoff_id} cancelled: {ctx.cancel_reason}",
                        handoff_id=ctx.handoff_id, code=ErrorCode.CANCELLED, retryable=False)


def timed_out(ctx: HandlerContext, timeout: float) -> HandlerError:
    """The error of an attempt past its time (TIMEOUT, retryable); flags the context, so that a
    handler that checks ``ctx.cancelled`` stops on its own."""
    ctx.cancelled.set()
    return HandlerError(f"handoff {ctx.handoff_id}: handler did not finish within {timeout:g}s",
                        handoff_id=ctx.handoff_id, code=ErrorCode.TIMEOUT, retryable=True)


def _take_over(watch: Watch) -> None:
    ctx = watch.ctx
    error = cancelled(ctx) if ctx.stop_requested else timed_out(ctx, watch.timeout)
    try:
        threading.Thread(target=watch.takeover, args=(error,), name=f"takeover-{ctx.handoff_id}",
                         daemon=True).start()
    except RuntimeError:  # no thread to spare: end it here (the watchdog waits a filing's time)
        watch.takeover(error)


WATCHDOG = Watchdog()
os.register_at_fork(after_in_child=WATCHDOG.forget)
