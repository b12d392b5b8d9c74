"""``handoff stats``: what the event log says about each specialist, with the queue as it is now.

Per specialist: handoffs created, started, completed and failed in the window, retries, take-overs
of dead claims, error codes, throughput (finished per minute) and the 50th / 95th percentile of
the queue wait (runnable -> claimed: a dependant's from its last dependency's filing) and of the
run time; beside them the current depth of pending and in-progress work (read from the store,
the truth).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Iterable

from ..core.events import Event
from ..core.states import State
from ..core.timeutil import parse_iso

FINISHED = (State.COMPLETED.value, State.FAILED.value)
UNKNOWN = "(unrouted)"


@dataclass
class AgentStats:
    """The figures of one specialist."""

    agent: str
    created: int = 0
    started: int = 0
    completed: int = 0
    failed: int = 0
    retries: int = 0
    taken_over: int = 0
    pending: int = 0
    running: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    waits: list[float] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)

    def as_dict(self, minutes: float) -> dict[str, Any]:
        """The figures as JSON (percentiles in seconds, None when there is no sample)."""
        return {"agent": self.agent, "pending": self.pending, "running": self.running,
                "created": self.created, "started": self.started, "completed": self.completed,
                "failed": self.failed, "retries": self.retries, "taken_over": self.taken_over,
                "per_minute": round((self.completed + self.failed) / minutes, 3) if minutes else None,
                "errors": dict(self.errors.most_common()),
                "wait_p50": percentile(self.waits, 50), "wait_p95": percentile(self.waits, 95),
                "run_p50": percentile(self.runs, 50), "run_p95": percentile(self.runs, 95)}


def percentile(values: list[float], pct: float) -> float | None:
    """The ``pct``-th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(pct / 100 * len(ordered)) - 1, 0)
    return round(ordered[rank], 4)


MAX_NUMBER = 1e300  # no figure of ours comes near: a larger one is a forged line's


def number(value: Any) -> float | None:
    """A finite, non-negative number from an event field (events are read defensively): None
    for anything else, an integer too large for a float among them (a forged line's 400
    digits made math.isfinite raise OverflowError and failed `handoff stats`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and not -MAX_NUMBER < value < MAX_NUMBER:
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def tally(events: Iterable[Event]) -> dict[str, AgentStats]:
    """Per-specialist figures from ``events``."""
    by_agent: dict[str, AgentStats] = {}
    for event in events:
        add_event(by_agent, event)
    return by_agent


def add_event(by_agent: dict[str, AgentStats], event: Event) -> None:
    """Add one event to the per-specialist figures ``by_agent``."""
    agent = event.get("agent") if isinstance(event.get("agent"), str) else UNKNOWN
    stats = by_agent.setdefault(str(agent), AgentStats(str(agent)))
    name, state = event.get("event"), event.get("state")
    if name == "created":
        stats.created += 1
    elif name == "claimed":
        stats.started += 1
        if (wait := number(event.get("wait"))) is not None:
            stats.waits.append(wait)
    elif name == "retry_scheduled":
        stats.retries += 1
    elif name == "taken_over":
        stats.taken_over += 1
    if state in FINISHED and name not in ("purged", "archived"):
        if state == State.COMPLETED.value:
            stats.completed += 1
        else:
            stats.failed += 1
        if (seconds := number(event.get("seconds"))) is not None:
            stats.runs.append(seconds)
    code = event.get("code")
    if isinstance(code, str) and (state == State.FAILED.value or name == "retry_scheduled"):
        stats.errors[code[:64]] += 1


def report(events: Iterable[Event], depth: dict[tuple[str, str], int], *,
           since: datetime | None, now: datetime) -> dict[str, Any]:
    """``handoff stats --json``: the window, totals by state and one entry per specialist.
    ``depth``: (state, agent) -> handoffs now in that state (pending and in-progress).
    ``events`` is taken in as it is given, never held (a log is up to hundreds of MiB)."""
    by_agent: dict[str, AgentStats] = {}
    total, first = 0, None
    for event in events:
        if not total:
            first = event
        total += 1
        add_event(by_agent, event)
    for (state, agent), count in depth.items():
        stats = by_agent.setdefault(agent, AgentStats(agent))
        if state == State.PENDING.value:
            stats.pending += count
        elif state == State.IN_PROGRESS.value:
            stats.running += count
    start = since
    if start is None and first is not None:
        try:
            start = parse_iso(str(first.get("at")))
        except ValueError:
            start = None
    minutes = max((now - start).total_seconds() / 60, 1 / 60) if start else 0.0
    agents = [by_agent[a].as_dict(minutes) for a in sorted(by_agent)]
    return {"since": start.isoformat() if start else None, "until": now.isoformat(),
            "minutes": round(minutes, 3), "events": total, "agents": agents}


def current_depth(backend: Any, states: tuple[State, ...] = (State.PENDING, State.IN_PROGRESS)
                  ) -> dict[tuple[str, str], int]:
    """(state, agent) -> the handoffs in ``states`` now (pending and in progress by default),
    counted through a listing's predicate that tallies each row and keeps none: one document is
    held at a time (50,000 pending documents, listed whole only to be counted, took `handoff
    stats` to 539 MB, and a metrics scrape as much)."""
    depth: Counter[tuple[str, str]] = Counter()

    def tally(state: State, row: Any) -> bool:
        depth[(state.value, row.meta.target or UNKNOWN)] += 1
        return False

    for state in states:
        backend.list(state=state, where=partial(tally, state))
    return dict(depth)
