"""UTC timestamps in the ISO 8601 form the seeds use (``2026-01-13T10:00:00Z``), and the
bound a command's ``--timeout`` puts on opening its store (:func:`connecting_within`)."""
from __future__ import annotations

import contextvars
import math
import re
import time
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterator

Clock = Callable[[], datetime]

# when opening a store's connections must end, on time.monotonic()'s clock (a command's
# --timeout: :func:`connecting_within`); inf: no bound but the store's own connect timeout
_CONNECT_BY: contextvars.ContextVar[float] = contextvars.ContextVar("handoffd_connect_by",
                                                                    default=math.inf)

# The last instant a datetime can hold, in UTC: a time whose UTC form falls outside the calendar
# (year 1 with a positive offset, year 9999 with a negative one) makes astimezone() and iso()
# raise OverflowError, and so does adding past this
UTC_MAX = datetime.max.replace(tzinfo=timezone.utc)

# The most digits of fractional seconds a time may carry: nanoseconds, as RFC 3339 readers
# commonly take (the RFC sets no bound; a datetime keeps microseconds, the rest is cut). Every
# check of a time says so the same way: the schemas' date_time pattern (``\.[0-9]{1,9}``), the
# ``date-time`` format (core.schemachecks.is_datetime) and :func:`parse_iso`. A document's time
# with a fraction of 100,000 digits once passed all three.
MAX_FRACTION_DIGITS = 9
# a longer fraction: a dot then one digit more (in an RFC 3339 time a dot is its fraction's);
# no repetition beyond that: linear, and it stops at the first such run
_LONG_FRACTION = re.compile(r"\.[0-9]{%d}" % (MAX_FRACTION_DIGITS + 1))
# such a fraction's first MAX_FRACTION_DIGITS digits, and the rest (greedy, one run: linear)
_FRACTION_REST = re.compile(r"(\.[0-9]{%d})[0-9]+" % MAX_FRACTION_DIGITS)


class OutsideCalendar(ValueError):
    """A timestamp that parses but cannot be used: its UTC time falls outside years 1 to 9999, or
    too near the end to add the time the caller needs. A ValueError, so every reader that refuses
    a malformed timestamp refuses this one the same way."""


@contextmanager
def connecting_within(seconds: float | None) -> Iterator[None]:
    """Within the block (this thread or context), a store opened connects within ``seconds``
    from now (:func:`connect_timeout`); an earlier bound of an enclosing block still holds.
    None: no bound of its own."""
    if seconds is None:
        yield
        return
    token = _CONNECT_BY.set(min(_CONNECT_BY.get(), time.monotonic() + max(seconds, 0.0)))
    try:
        yield
    finally:
        _CONNECT_BY.reset(token)


def connect_by() -> float:
    """When opening a store must end, on time.monotonic()'s clock (the innermost
    :func:`connecting_within` block's bound; inf outside any)."""
    return _CONNECT_BY.get()


def connect_timeout(seconds: float) -> float:
    """A connect timeout of at most ``seconds``, cut to the time left in a
    :func:`connecting_within` block, but never under 1 s (libpq counts whole seconds): such a
    block ends within its bound plus a second."""
    return max(min(seconds, _CONNECT_BY.get() - time.monotonic()), 1.0)


def utc_now() -> datetime:
    """The default clock: an aware UTC datetime."""
    return datetime.now(timezone.utc)


def iso(moment: datetime) -> str:
    """Format an aware datetime as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (milliseconds kept).

    Raises OverflowError when its UTC time is outside years 1 to 9999 (the command line's
    ``--at`` relies on that to refuse such a time): a time read from a document is checked when
    it is read instead (:func:`parse_utc`)."""
    # (isoformat in C: strftime is several times slower, formatting by hand a third slower;
    # a UTC time's ends in "+00:00", replaced by the Z)
    m = moment if moment.tzinfo is timezone.utc else moment.astimezone(timezone.utc)
    return m.isoformat(timespec="milliseconds")[:-6] + "Z"


def parse_iso(text: str) -> datetime:
    """Parse an ISO 8601 timestamp; a naive one is taken as UTC. Raises ValueError if malformed.

    The value keeps its own offset and may lie outside the UTC calendar: use :func:`parse_utc`
    for a time read from a document that will be converted, formatted or added to. A fraction of
    more than :data:`MAX_FRACTION_DIGITS` digits is malformed too (:func:`fraction_too_long`)."""
    if fraction_too_long(text):
        raise ValueError(f"{text[:40]!r}... has more than {MAX_FRACTION_DIGITS} digits of "
                         "fractional seconds")
    value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value


def fraction_too_long(text: str) -> bool:
    """Whether the time ``text`` carries more than :data:`MAX_FRACTION_DIGITS` digits of
    fractional seconds (a dot followed by more digits than that)."""
    return _LONG_FRACTION.search(text) is not None


def parse_iso_truncated(text: str) -> datetime:
    """Parse an ISO 8601 timestamp as :func:`parse_iso` does, its fractional seconds cut to
    :data:`MAX_FRACTION_DIGITS` digits first (a datetime keeps microseconds anyway: the value
    is the same). For a time another program wrote that handoffd only reads, never checks
    as a document's field: a foreign consumer's ``started_at`` (picoseconds are RFC 3339),
    whose claim was taken for none when its start was refused. Whatever it says is bounded by
    its caller (a foreign claim's start: never after its rename). Raises ValueError if
    malformed otherwise."""
    return parse_iso(_FRACTION_REST.sub(r"\1", text, count=1))


def parse_utc(text: str, *, headroom_seconds: float = 0.0) -> datetime:
    """Parse an ISO 8601 timestamp (as :func:`parse_iso`) into an aware UTC datetime.

    Raises ValueError if malformed, and OutsideCalendar (a ValueError) when its UTC time falls
    outside years 1 to 9999 (``0001-01-01T00:00:00+14:00`` is in year 0 in UTC) or when adding
    ``headroom_seconds`` to it would pass the end of year 9999. Such a value used to parse, then
    raise OverflowError far away: in iso(), astimezone() or ``+ timedelta``."""
    value = parse_iso(text)
    try:
        utc = value.astimezone(timezone.utc)
    except OverflowError:
        raise OutsideCalendar(f"{text[:60]!r} falls outside years 1 to 9999 in UTC") from None
    if headroom_seconds > 0 and utc > UTC_MAX - timedelta(seconds=headroom_seconds):
        raise OutsideCalendar(f"{text[:60]!r} is too near the end of year 9999 (UTC) to count "
                              f"{headroom_seconds:g}s from it")
    return utc
