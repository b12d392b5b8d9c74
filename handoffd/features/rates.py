"""Rate limits: ``rate = "30/m"`` on a specialist caps how often its handoffs start.

A token bucket per specialist holds up to ``count`` tokens and gains ``count`` every ``seconds``
(evenly); each start takes one, and a start that finds none waits until the next one is due.
The buckets are the store's shared records (files: ``handoffs/.meta/rates.json``, updated under
an exclusive ``flock``; PostgreSQL: a row locked for the update), so every daemon and batch of
the store draws from the same one. A
full bucket lets a burst of ``count`` start at once; after that starts are spaced evenly.

Rate limits decide when a handoff may *start*: a limited handoff stays pending (in its place by
priority) and is looked at again when the next token is due. Retries start under the same limit;
``concurrency`` still caps how many run at once. ``handoff ls`` says so in its note (``rate 1/h:
next start in 59m``), from a read of the buckets that takes no token; a daemon says it once at
``-v`` when its starts begin to wait. :func:`handoffd.features.build.install_rates` installs
:class:`RateLimits`, loading this module only when a specialist with a rate is asked about.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable

from ..core.config import Rate
from ..core.errors import HandoffdError
from ..core.hooks import Verdict
from ..core.storage import Records
from ..core.timeutil import iso

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.specialists import Specialist

KIND = "rates"  # the records' kind (files: handoffs/.meta/rates.json)
UNREADABLE_WAIT_SECONDS = 1.0  # a bucket that cannot be updated: starts wait, asked again then
# a listing reads the buckets once; a reader that lives on (the MCP server) reads them afresh
# after this long
CACHE_SECONDS = 1.0
# a bucket stamped further ahead than this (or its period) is taken as full: a clock that
# stepped back an hour refills nothing meanwhile, but a stamp from the far future never ages
FUTURE_SECONDS = 86_400.0
# a bucket stamped later than this (the year 5138) is a forged record: it is taken as full
MAX_STAMP = 1e11
HELD_LOG_SECONDS = 60.0  # a specialist whose starts wait for its rate is said so this often
UNITS = ((86_400, "d"), (3_600, "h"), (60, "m"), (1, "s"))
PERIODS = {1.0: "s", 60.0: "m", 3_600.0: "h", 86_400.0: "d"}
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
            tokens, at = refilled(old, rate, now)
            wait = wait_for(tokens, rate)
            waited.append(wait)
            return {"tokens": tokens - 1.0 if wait == 0.0 else tokens, "at": at,
                    "rate": str(rate)}

        self.records.update(KIND, agent, change)  # one locked read-modify-write, any process
        return waited[-1]


def refilled(state: Any, rate: Rate, now: datetime) -> tuple[float, float]:
    """(tokens, as of when) of a bucket record at ``now``: what it held plus what it gained
    since. A clock that stepped back refills nothing (and never more than the full bucket)."""
    tokens, at = _load(state, rate)
    stamp = now.timestamp()
    if at > stamp + max(rate.seconds, FUTURE_SECONDS):  # stamped far ahead (a hostile record,
        tokens, at = float(rate.count), stamp  # a host clock far off): it would never refill
    per_second = rate.count / rate.seconds
    return min(float(rate.count), tokens + max(stamp - at, 0.0) * per_second), max(stamp, at)


def wait_for(tokens: float, rate: Rate) -> float:
    """Seconds until a bucket holding ``tokens`` has one to give (0.0: it has one now)."""
    return 0.0 if tokens >= 1.0 else (1.0 - tokens) / (rate.count / rate.seconds)


def _load(state: Any, rate: Rate) -> tuple[float, float]:
    """(tokens, when) from a bucket record; a new or unreadable one is full. Never raises:
    the record is the store's, which anyone with the workspace can write, and a value that
    does not read as a sane number (a string, a bool, a 400-digit integer that no float holds,
    nan, inf, a negative count, a stamp before 1970 or past :data:`MAX_STAMP`) reads as a full
    bucket, so a forged record never stalls a specialist or fails the gate that reads it."""
    if not isinstance(state, dict):
        return float(rate.count), 0.0
    tokens, at = _sane(state.get("tokens")), _sane(state.get("at"))
    # Buckets.take only takes a token from a bucket holding one or more, so no record of ours
    # holds fewer than none: a negative count is forged, and was clamped to -count, which held
    # the specialist back about two periods (outside bookkeeping outranking ours)
    if tokens is None or at is None or not 0.0 <= at <= MAX_STAMP \
            or not 0.0 <= tokens <= rate.count:
        return float(rate.count), 0.0  # unreadable, forged, or another rate's bucket
    return tokens, at


def _sane(value: Any) -> float | None:
    """``value`` as a finite float, None for anything else (a bool, a string, an integer too
    large for a float, nan, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


def spelled(rate: Rate) -> str:
    """``rate`` as a configuration writes it: ``1/h``, ``30/m``, ``10/90s``."""
    period = PERIODS.get(rate.seconds)
    return f"{rate.count}/{period}" if period else str(rate)


def span(seconds: float) -> str:
    """A wait of ``seconds``, rounded up to a whole second, in its two largest units:
    ``45s``, ``59m 30s``, ``2h 5m``, ``1d 3h``."""
    if seconds < 1.0:
        return "<1s"
    left = math.ceil(seconds)
    parts = []
    for size, unit in UNITS:
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts[:2])


class RateLimits:
    """One engine's rate limits: :meth:`limit`, which a daemon's scheduler asks before each
    start (it takes the token), and :meth:`note`, why a pending handoff waits for its rate (it
    reads the buckets: never takes a token or writes a record)."""

    def __init__(self, records: Records, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.buckets = Buckets(records)
        self.monotonic = monotonic
        self.failing: set[str] = set()  # specialists whose bucket could not be updated: said once
        # specialist -> when it was last said that its starts wait for a token: once per
        # HELD_LOG_SECONDS, not at every start of a backlog that the rate paces
        self.held: dict[str, float] = {}
        self._read: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def limit(self, spec: Specialist, now: datetime) -> float:
        """Seconds until ``spec`` may start a handoff (0.0: now, and the token is taken)."""
        rate = spec.config.rate
        if rate is None:
            return 0.0
        try:
            wait = self.buckets.take(spec.agent, rate, now)
        except (OSError, HandoffdError) as exc:
            # the scheduler's loop asks this: raising would stop the daemon. A limit that
            # cannot be kept holds starts back (never a burst past it) and asks again soon
            if spec.agent not in self.failing:
                self.failing.add(spec.agent)
                log.error("specialist %s: its rate bucket cannot be updated (%s); its handoffs "
                          "wait, tried again every %g s", spec.agent, exc, UNREADABLE_WAIT_SECONDS)
            return UNREADABLE_WAIT_SECONDS
        self.failing.discard(spec.agent)
        said = self.held.get(spec.agent)
        if wait > 0.0 and (said is None or self.monotonic() - said >= HELD_LOG_SECONDS):
            self.held[spec.agent] = self.monotonic()
            log.info("specialist %s: its handoffs wait for its rate %s; next start in %s (at %s)",
                     spec.agent, spelled(rate), span(wait), iso(now + timedelta(seconds=wait)))
        return wait

    def note(self, spec: Specialist, now: datetime) -> str | None:
        """Why ``spec``'s pending handoffs wait for its rate at ``now`` (None: a token is
        there, or it has no rate)."""
        rate = spec.config.rate
        if rate is None:
            return None
        try:
            state = self._buckets().get(spec.agent)
        except (OSError, HandoffdError) as exc:  # a listing never fails for a bucket
            return f"rate {spelled(rate)}: its bucket cannot be read ({exc})"
        wait = wait_for(refilled(state, rate, now)[0], rate)
        if wait <= 0.0:
            return None
        return (f"rate {spelled(rate)}: next start in {span(wait)} "
                f"(at {iso(now + timedelta(seconds=wait))})")

    def gate(self, spec: Specialist, now: datetime) -> Verdict | None:
        """:meth:`note` as a gate's verdict: a wait that says why (None: no wait)."""
        why = self.note(spec, now)
        return Verdict.wait(why) if why else None

    def _buckets(self) -> dict[str, Any]:
        """Every bucket, read once for a listing's rows (afresh after CACHE_SECONDS)."""
        with self._lock:
            now = self.monotonic()
            if self._read is None or now - self._read[0] > CACHE_SECONDS:
                self._read = (now, self.buckets.records.read(KIND))
            return self._read[1]


def install(engine: Engine) -> None:
    """The rate limit alone, made at once (what :data:`handoffd.features.build.FEATURES`
    installs loads this module only when needed, and adds the gate that says why a handoff
    waits)."""
    engine.start_limits.append(RateLimits(engine.backend.records()).limit)
