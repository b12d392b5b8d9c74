"""The allowed range of every setting, and the checks that hold a value to it.

Values are taken as written, never converted: ``events = "false"`` is text, not false;
``max_document_bytes = 1.9`` is not a whole number; ``workers = "3"`` is not a number. Numbers
must be finite and within sane bounds: an ``inf`` or ``1e300`` second interval is a typo that
would overflow date arithmetic later, a ``1e-300`` one spins a CPU, a ``lease_seconds`` under a
second expires leases a healthy daemon still holds. :mod:`handoffd.core.config` reads
handoffd.toml with these; :class:`~handoffd.core.settings.RetryPolicy` checks a document's
retry policy with :func:`retry_value`.
"""
from __future__ import annotations

import math
import re
from typing import Any

from .errors import ConfigError

# Upper bounds: far above any real setting, far below what overflows datetime/timedelta arithmetic.
MAX_SECONDS = 10 * 365.25 * 24 * 3600          # any [daemon] / specialist time: 10 years
MAX_PROCESSES = 64  # [daemon] processes / handoffd run and serve --processes
AUTO_PROCESSES = 0  # how "auto" is held in DaemonSettings.processes
MAX_WORKERS = 1024  # [daemon] workers; also a specialist's concurrency
MAX_RETRY_DELAY_SECONDS = 7 * 24 * 3600.0      # one retry delay (also the cap of RetryPolicy.delay)
MAX_BACKOFF_MULTIPLIER = 100.0
MAX_RETRIES = 1000
MAX_BYTES = 1024 ** 3  # max_document_bytes, max_output_bytes, events_max_bytes: 1 GiB
MAX_POOL_SIZE = 1000  # [store] pool_size
# [store] connect_timeout_seconds: libpq counts whole seconds, and reads 1 as 2
MIN_CONNECT_SECONDS, MAX_CONNECT_SECONDS = 1, 3600
MAX_NOTIFY_RETRIES = 20  # [[on_filed]] retries
MAX_NOTIFY_SECONDS = 3600.0  # [[on_filed]] retry_delay_seconds and timeout_seconds
MAX_EVENTS_KEEP = 1000  # [daemon] events_keep (the rotation walks this many names)
# Lower bounds of the loop intervals: below ~10 ms an idle daemon only spins (rescan_seconds =
# 1e-300 kept a CPU busy); a lease renewed every lease_seconds / 3 but at most every 0.5 s
# must last at least a second, or a healthy daemon recovers its own live claims as stalled.
MIN_INTERVAL_SECONDS = 0.01
MIN_LEASE_SECONDS = 1.0
# The least [daemon] claim_grace_seconds with a PostgreSQL store: its daemons claim only while
# their presence session proved alive within half the grace, by a round trip every tenth of it
# (at least every 0.05 s); at 0 none ever could (`handoffd run` waited for ever, silent).
MIN_OWNER_GRACE_SECONDS = 1.0
STORE_SCHEMES = ("postgresql://", "postgres://")
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}

# [daemon]: key -> (kind, low, high). Kinds: "int" (a whole number; a float such as 1.9 or a
# bool is refused, never truncated), "seconds" (an int or a float), "bool" (true or false
# only: "false" is text, not false), a tuple of the strings allowed, or "processes".
DAEMON_RULES: dict[str, tuple[Any, float, float]] = {
    "workers": ("int", 1, MAX_WORKERS),
    "processes": ("processes", 1, MAX_PROCESSES),
    "rescan_seconds": ("seconds", MIN_INTERVAL_SECONDS, MAX_SECONDS),
    "sweep_seconds": ("seconds", MIN_INTERVAL_SECONDS, MAX_SECONDS),
    "lease_seconds": ("seconds", MIN_LEASE_SECONDS, MAX_SECONDS),
    "settle_seconds": ("seconds", 0, MAX_SECONDS),
    "claim_grace_seconds": ("seconds", 0, MAX_SECONDS),
    "grace_seconds": ("seconds", 0, MAX_SECONDS),
    "durability": (("fsync", "fast"), 0, 0),
    "max_document_bytes": ("int", 1024, MAX_BYTES),
    "max_output_bytes": ("int", 1024, MAX_BYTES),
    "default_timeout_seconds": ("seconds", MIN_INTERVAL_SECONDS, MAX_SECONDS),
    "seen_ttl_seconds": ("seconds", 1, MAX_SECONDS),
    "stall_seconds": ("seconds", MIN_INTERVAL_SECONDS, MAX_SECONDS),
    "expectations": (("enforce", "advisory"), 0, 0),
    "events": ("bool", 0, 0),
    "events_max_bytes": ("int", 4096, MAX_BYTES),
    "events_keep": ("int", 1, MAX_EVENTS_KEEP),
}


def finite_number(value: Any) -> bool:
    """True for an int or float (not a bool) that is neither inf nor nan."""
    # (an int is always finite; math.isfinite of one past a float's range raises OverflowError)
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (isinstance(value, int) or math.isfinite(value)))


def brief(value: Any) -> str:
    """``repr(value)`` cut to a line (a document's 5,000-digit number is shown by its start)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _shown(number: float) -> str:
    """A bound as the error shows it: ``1``, ``0.01``, ``315576000``."""
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def bounded(value: Any, where: str, low: float, high: float, *, integer: bool = False,
            unit: str = "") -> Any:
    """``value`` if it is a number within ``[low, high]``: an int (not a bool) when ``integer``,
    else an int or a float, finite. Nothing is converted: a string, a bool or (for a whole
    number) a float is refused. ConfigError ``"<where> = <value> ..."`` naming the range
    otherwise (``where`` names the key, e.g. ``"handoffd.toml: [daemon] workers"``)."""
    allowed = f"{_shown(low)}..{_shown(high)}{unit}"
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} = {brief(value)} is not a whole number (allowed: {allowed})")
    if not finite_number(value):
        raise ConfigError(f"{where} = {brief(value)} is not a finite number (allowed: {allowed})")
    if low > 0 >= value:  # the words the checks always used for a non-positive interval
        raise ConfigError(f"{where} must be greater than 0, not {brief(value)} (allowed: {allowed})")
    if not low <= value <= high:
        raise ConfigError(f"{where} = {brief(value)} is outside the allowed range {allowed}")
    return value


def retry_value(data: dict[str, Any], key: str, default: float, low: float, high: float, *,
                integer: bool = False) -> float:
    """``data[key]`` (or ``default``) as a number within ``[low, high]``; ConfigError otherwise.
    Unlike :func:`bounded`, text is read as a number: a document's retry policy says "3"."""
    if key not in data:
        return default
    raw = data[key]
    value: Any = raw
    if isinstance(raw, str):  # "3" from a hand-written document: accepted as before
        try:
            value = float(raw.strip())
        except ValueError:
            value = None
    if not finite_number(value):
        raise ConfigError(f"bad retry policy: {key} = {brief(raw)} is not a finite number")
    if integer and value != int(value):
        raise ConfigError(f"bad retry policy: {key} = {brief(raw)} is not a whole number")
    if not low <= value <= high:
        raise ConfigError(f"bad retry policy: {key} = {brief(raw)} is outside {low:g}..{high:g}")
    return value


def processes_value(raw: object) -> int:
    """``[daemon] processes`` / ``--processes``: "auto" (AUTO_PROCESSES) or a whole number
    1..MAX_PROCESSES, given as a number or as text; ValueError otherwise."""
    if raw == "auto":
        return AUTO_PROCESSES
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ValueError(raw)
    value = int(raw)
    if not 1 <= value <= MAX_PROCESSES:
        raise ValueError(raw)
    return value


def daemon_value(key: str, value: Any, where: str) -> Any:
    """One ``[daemon]`` value, checked against its rule in DAEMON_RULES."""
    kind, low, high = DAEMON_RULES[key]
    if kind == "processes":
        try:
            return processes_value(value)
        except ValueError:
            raise ConfigError(f"{where} = {value!r}: must be \"auto\" or a whole number "
                              f"1..{MAX_PROCESSES}") from None
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} must be true or false (unquoted)")
        return value
    if isinstance(kind, tuple):
        if not isinstance(value, str) or value not in kind:
            raise ConfigError(f"{where} = {value!r} must be "
                              f"{' or '.join(chr(34) + k + chr(34) for k in kind)}")
        return value
    if kind == "int":
        return bounded(value, where, low, high, integer=True)
    return float(bounded(value, where, low, high, unit=" seconds"))


# a number as float() reads it, in ASCII digits and without "_" (float() also takes "1_0" and
# "١٠"), then the unit, after spaces if any
DURATION = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)[ \t]*"
                      r"([smhdwSHDW]?)", re.ASCII)
DURATION_FORM = ("a number of seconds or one with a unit: 45s, 10m, 12h, 7d or 2w (ASCII "
                 "digits, no _)")
MONTHS = re.compile(r"[^M]*[0-9.][ \t]*M", re.ASCII)  # "6M": minutes, or the months meant?


def parse_duration(value: Any, what: str | None = None) -> float:
    """Seconds from ``"45s"``, ``"10m"``, ``"12h"``, ``"7d"``, ``"2w"`` (``S H D W`` too, a
    space before the unit, an exponent: ``"1e3"``) or a number of seconds; ConfigError for
    anything else, negative, or over ten years (``what`` names the value in it: a default
    ``duration '...'``). Refused, as they were misread: ``M`` (read as minutes where months
    were meant: ``m`` is minutes, months have no unit), ``_`` and non-ASCII digits."""
    name = what or f"duration {brief(value)}"
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be {DURATION_FORM}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (found := DURATION.fullmatch(value.strip())):
        seconds = float(found[1]) * (UNITS[found[2].lower()] if found[2] else 1.0)
    elif isinstance(value, str) and MONTHS.fullmatch(value.strip()):
        raise ConfigError(f"{name}: use m for minutes; months are not supported")
    else:
        raise ConfigError(f"{name} must be {DURATION_FORM}")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
        raise ConfigError(f"{name} must be between 0 and 10 years")
    return seconds


def check_owner_grace(grace: float, where: str = "handoffd.toml: [daemon] claim_grace_seconds"
                      ) -> None:
    """ConfigError when ``grace`` (``claim_grace_seconds``) is below
    :data:`MIN_OWNER_GRACE_SECONDS`, which a PostgreSQL store needs (the files store takes 0)."""
    if grace < MIN_OWNER_GRACE_SECONDS:
        raise ConfigError(
            f"{where} = {brief(grace)} is below {_shown(MIN_OWNER_GRACE_SECONDS)}, the least a "
            "PostgreSQL store allows (a daemon claims only while it proved its presence within "
            "half of it: with less it could claim nothing)")


def check_store_url(url: str, where: str = "store url") -> str:
    """``url`` if it names a PostgreSQL database; ConfigError otherwise."""
    if not isinstance(url, str) or not url.startswith(STORE_SCHEMES) or any(
            c in url for c in "\n\r\0"):
        raise ConfigError(f"{where}: give a postgresql://user@host/dbname URL (no value: the "
                          "workspace's files)")
    try:  # argv's or the environment's undecodable bytes (lone surrogates) reach no driver
        url.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: the URL is not UTF-8 text") from None
    return url


def http_url(url: Any) -> bool:
    """True for an http(s) URL that every delivery can use (one that failed to parse, say
    ``http://[::1`` or a bad port, made each delivery a traceback)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return False
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return False
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad one
    except ValueError:
        return False
    return bool(parts.hostname)
