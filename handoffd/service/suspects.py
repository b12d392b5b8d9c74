"""Suspects: handoffs recovered from a dead owner run alone once, so that only a crasher pays.

An in-process (Python) handler that kills its process (``os._exit``, an abort, a segfault)
takes every attempt running beside it down too. Recovery cannot tell which one did it: it
charges each of them a retry (:func:`~handoffd.service.sweeper.recover`), and they come back
due together, so they used to be claimed together again, beside the crasher, at every restart,
until all of them were dead-lettered "owner process is gone".

So recovery marks what it recovers as *suspect* (``suspect: true`` in the details of its
``recovered`` history event), and a daemon runs a suspect attempt alone (:class:`Solo`): it
starts only when nothing else runs in that process, and nothing else starts until it has ended
(its Python handler returned, even past its attempt). A handoff that brings the process down
again is then the only one charged for it; the innocent ones lose one retry, once. A suspect is
suspect until its attempt ends, whatever the outcome (the history moves on: :func:`is_suspect`).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..core.documents import book
from .handbacks import interrupted

log = logging.getLogger("handoffd")
SUSPECT = "suspect"  # the detail of a ``recovered`` event that marks the recovery's retry
# how long a suspect whose attempt ended (timed out, cancelled) while its Python handler runs
# on still runs alone: a thread cannot be stopped, and one that never returns must not stop
# the daemon for ever; past this, the rest of the work goes on beside it
LATE_HOLD_SECONDS = 60.0


def is_suspect(doc: dict[str, Any] | None) -> bool:
    """True when ``doc`` (a pending document as the scheduler reads it: bookkeeping only when
    sealed) waits for the retry its recovery scheduled, or runs it: its history ends with a
    suspect ``recovered`` and that recovery's ``retry_scheduled``, then only claims and
    hand-backs of attempts whose handler never started (a daemon stopping as it claimed it).
    Any other event (the retry ran and ended: filed, retried, handed back) clears it."""
    history = book(doc).get("history") if isinstance(doc, dict) \
        and isinstance(doc.get("handoffd"), dict) else None
    if not isinstance(history, list):
        return False
    expect = ["recovered", "retry_scheduled"]  # what is left to find, going back in time
    for entry in reversed(history):
        if not isinstance(entry, dict):
            return False
        event = entry.get("event")
        detail = given if isinstance(given := entry.get("detail"), dict) else {}
        if expect == ["recovered", "retry_scheduled"] and \
                (event == "claimed" or (event == "handed_back" and not interrupted(entry))):
            continue  # its retry has not run yet
        if event != expect.pop():
            return False
        if not expect:
            return detail.get(SUSPECT) is True
    return False


class Solo:
    """A daemon's bookkeeping of suspect attempts (guarded by the daemon's ``cv``).

    ``waiting``: suspects found due while something else ran; while any waits, the daemon
    starts nothing new, so that its running tasks drain and the first of them starts alone.
    ``running``: the suspect now running (its pool token), whose Python handler may still run
    after its attempt ended (the daemon's ``late`` count): nothing starts beside it until then,
    or for :data:`LATE_HOLD_SECONDS` at most (a handler that never returns must not hold the
    daemon for ever; ``clock``: monotonic seconds).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.waiting: OrderedDict[str, None] = OrderedDict()
        self.running: tuple[str, int] | None = None  # (handoff id, pool token)
        self.late_since: float | None = None  # when its attempt ended with its handler running
        self.clock = clock

    def hold(self, handoff_id: str) -> None:
        """``handoff_id`` is a due suspect that cannot start alone now: it starts first once
        nothing runs."""
        self.waiting[handoff_id] = None

    def started(self, handoff_id: str, token: int) -> None:
        """The suspect ``handoff_id`` was submitted alone as pool task ``token``."""
        self.waiting.pop(handoff_id, None)
        self.running = (handoff_id, token)
        self.late_since = None

    def blocks(self, inflight: Collection[int], late: Mapping[str, int]) -> bool:
        """True while no other task may start: a suspect runs (:meth:`runs`) or waits for the
        others to end."""
        return self.runs(inflight, late) or bool(self.waiting)

    def runs(self, inflight: Collection[int], late: Mapping[str, int]) -> bool:
        """True while a suspect runs: its task is in ``inflight``, or its Python handler runs
        on past its attempt (``late``), for :data:`LATE_HOLD_SECONDS` at most."""
        if self.running is None:
            return False
        handoff_id, token = self.running
        if token in inflight:
            return True
        if late.get(handoff_id):
            now = self.clock()
            if self.late_since is None:
                self.late_since = now
            if now - self.late_since < LATE_HOLD_SECONDS:
                return True
            log.warning("handoff %s: its handler still runs %gs after its attempt ended; other "
                        "work starts beside it again", handoff_id, LATE_HOLD_SECONDS)
        self.running = None  # it ended: nothing is suspect any more
        return False

    def next_waiting(self, running: int) -> str | None:
        """The suspect to start now that ``running`` tasks run (None unless that is 0 and no
        suspect runs); taken off the waiting list."""
        if running or self.running is not None or not self.waiting:
            return None
        handoff_id, _ = self.waiting.popitem(last=False)
        return handoff_id

    def forget_waiting(self) -> None:
        """Drop the waiting list (a scheduler reset: a rescan finds them again in pending/)."""
        self.waiting.clear()
