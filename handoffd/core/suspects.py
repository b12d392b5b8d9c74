"""Specialists under suspicion after a crash: their Python attempts run isolated for a while.

When a process dies with handoffs running, recovery cannot tell which handler ended it, and a
handler that crashes at every start would take the daemon (and every attempt beside it) down
once per new handoff of its own. So a recovery, or an isolated attempt whose process died,
marks the specialist of that handoff: for :data:`SUSPECT_SECONDS` every attempt of it runs in
a process of its own (``isolate = "after_crash"``, see :mod:`.isolation`).

The mark is a shared record of the store (kind ``suspects``, by agent: ``{"until": <epoch
seconds>}``), so every process of the workspace sees it, not only the one that recovered the
crash: the processes of a ``handoffd run --processes N``, other daemons, a one-shot
``handoffd sweep``. Each process reads the records again at most once a second (a file read,
not one per attempt) and at once after each of its sweeps. A record that ends further ahead
than a mark can (:data:`SUSPECT_SECONDS`, plus a minute of clock skew between hosts) or is not
a finite number is ignored: a forged record can at most make attempts run isolated for ten
minutes, the cost of a process start each.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

from .logs import log
from .specialists import Specialist, handler_reference
from .storage import Records

KIND = "suspects"  # the shared records' kind
SUSPECT_SECONDS = 600.0  # how long after a crash a suspect specialist's attempts run isolated
REFRESH_SECONDS = 1.0  # how often a process reads the shared marks again
SKEW_SECONDS = 60.0  # another host's clock may run this far ahead of ours


class Suspects:
    """One engine's view of the marks (thread-safe): :meth:`mark` after a crash, ``agent in``
    to ask. ``records`` gives the store's shared records (called on first use: a command that
    never runs a handler never opens them); ``clock`` is wall time (marks are shared between
    hosts' processes)."""

    def __init__(self, records: Callable[[], Records], *,
                 clock: Callable[[], float] = time.time) -> None:
        self._records = records
        self.clock = clock
        self._until: dict[str, float] = {}
        self._read_at = -math.inf
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # held by the one thread reading the shared marks
        self._said: set[str] = set()  # agents whose mark was logged (once per mark)

    def mark(self, spec: Specialist | None) -> None:
        """A handoff of ``spec`` was running when its process died: its attempts run isolated
        for :data:`SUSPECT_SECONDS` (only Python handlers with ``isolate = "after_crash"``;
        one that no other process can import is not marked, and said so once)."""
        if spec is None or spec.is_command or spec.config.isolate != "after_crash":
            return
        agent = spec.agent
        if handler_reference(spec) is None:
            if agent not in self._said:
                self._said.add(agent)
                log.warning("specialist %s: a handoff of it was running when a process died, "
                            "but its handler %s cannot be imported by another process (defined "
                            "in __main__ or inside a function): it keeps running in the daemon",
                            agent, spec.config.handler)
            return
        until = self.clock() + SUSPECT_SECONDS
        with self._lock:
            fresh = self._until.get(agent, 0.0) <= self.clock()
            self._until[agent] = max(self._until.get(agent, 0.0), until)
        if fresh:
            log.warning("specialist %s: a handoff of it was running when a process died; for "
                        "the next %.0f s its handlers run in processes of their own", agent,
                        SUSPECT_SECONDS)
        def renewed(old: Any) -> dict[str, float]:
            known = _until(old)  # (one further ahead than a mark can be is nobody's: replaced)
            return {"until": max(until, known) if known <= until + SKEW_SECONDS else until}

        try:
            self._records().update(KIND, agent, renewed)
        except Exception as exc:  # (this process still isolates: only the sharing is lost)
            log.warning("specialist %s: cannot share its crash mark with the other processes: "
                        "%s", agent, exc)

    def __contains__(self, agent: str) -> bool:
        now = self.clock()
        if now - self._read_at >= REFRESH_SECONDS:
            self.refresh()
        return self._until.get(agent, 0.0) > now

    def refresh(self) -> None:
        """Read the shared marks now (after a sweep: another process may have just recovered a
        crash). One thread reads at a time; the others go on with the marks known."""
        now = self.clock()
        if not self._reading.acquire(blocking=False):
            return
        try:
            self._read_at = now  # (before the read: workers arriving meanwhile do not read too)
            try:
                shared = self._records().read(KIND)
            except Exception:  # unreadable records: the marks this process knows still count
                shared = {}
            self._merge(shared, now)
        finally:
            self._reading.release()

    def _merge(self, shared: dict[str, Any], now: float) -> None:
        with self._lock:
            for agent, record in shared.items():
                until = _until(record)
                if until > now + SUSPECT_SECONDS + SKEW_SECONDS:
                    continue  # no mark of ours says that: a forged one isolates nothing
                if isinstance(agent, str) and until > self._until.get(agent, 0.0):
                    self._until[agent] = until
            for agent in [a for a, until in self._until.items() if until <= now]:
                del self._until[agent]


def _until(record: Any) -> float:
    """A record's ``until`` when it is a finite number, else 0 (expired)."""
    value = record.get("until") if isinstance(record, dict) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 0.0
    try:
        number = float(value)
    except OverflowError:  # a 4,000-digit integer: raised out of every attempt's check
        return 0.0
    return number if math.isfinite(number) else 0.0
