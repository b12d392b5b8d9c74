"""Rate limits: ``rate = "30/m"`` on a specialist caps how often its handoffs start.

A token bucket per specialist holds up to ``count`` tokens and gains ``count`` every ``seconds``
(evenly); each start takes one, and a start that finds none waits until the next one is due.
The buckets are the store's shared records (files: ``handoffs/.meta/rates.json``, updated under
an exclusive ``flock``; PostgreSQL: a row locked for the update), so every daemon and batch of
the store draws from the same one. A
full bucket lets a burst of ``count`` start at once; after that starts are spaced evenly.

Rate limits decide when a handoff may *start*: a limited handoff stays pending (in its place by
priority) and is looked at again when the next token is due. Retries start under the same limit;
``concurrency`` still caps how many run at once.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..core.config import Rate
from ..core.errors import HandoffdError
from ..core.storage import Records

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.specialists import Specialist

KIND = "rates"  # the records' kind (files: handoffs/.meta/rates.json)
UNREADABLE_WAIT_SECONDS = 1.0  # a bucket that cannot be updated: starts wait, asked again then
log = logging.getLogger("handoffd")


class Buckets:
    """The store's token buckets, one record per specialist."""

    def __init__(self, records: Records) -> None:
        self.records = records

    def take(self, agent: str, rate: Rate, now: datetime) -> float:
        """Take a token for one start of ``agent``: 0.0 when it may start now (the token is
        taken), else the seconds until the next token is due (nothing is taken)."""
        waited: list[float] = []

        def change(old: Any) -> dict[str, Any]:
            tokens, at = _load(old, rate)
            stamp = now.timestamp()
            per_second = rate.count / rate.seconds
            # a clock that stepped back refills nothing (never more than the full bucket)
            tokens = min(float(rate.count), tokens + max(stamp - at, 0.0) * per_second)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / per_second
            waited.append(wait)
            return {"tokens": tokens - 1.0 if wait == 0.0 else tokens, "at": max(stamp, at),
                    "rate": str(rate)}

        self.records.update(KIND, agent, change)  # one locked read-modify-write, any process
        return waited[-1]


def _load(state: Any, rate: Rate) -> tuple[float, float]:
    """(tokens, when) from a bucket record; a new or unreadable one is full."""
    try:
        tokens, at = float(state["tokens"]), float(state["at"])
    except (ValueError, KeyError, TypeError):
        return float(rate.count), 0.0
    if not (tokens == tokens and at == at) or tokens > rate.count:  # nan, or another rate's
        return float(rate.count), 0.0
    return max(tokens, -float(rate.count)), at


def install(engine: Engine) -> None:
    """The rates feature: a start limit for each specialist with a ``rate``."""
    buckets = Buckets(engine.backend.records())
    failing: set[str] = set()  # specialists whose bucket could not be read: said once

    def limit(spec: Specialist, now: datetime) -> float:
        rate = spec.config.rate
        if rate is None:
            return 0.0
        try:
            wait = buckets.take(spec.agent, rate, now)
        except (OSError, HandoffdError) as exc:
            # the scheduler's loop asks this: raising would stop the daemon. A limit that
            # cannot be kept holds starts back (never a burst past it) and asks again soon
            if spec.agent not in failing:
                failing.add(spec.agent)
                log.error("specialist %s: its rate bucket cannot be updated (%s); its handoffs "
                          "wait, tried again every %g s", spec.agent, exc, UNREADABLE_WAIT_SECONDS)
            return UNREADABLE_WAIT_SECONDS
        failing.discard(spec.agent)
        return wait

    engine.start_limits.append(limit)
