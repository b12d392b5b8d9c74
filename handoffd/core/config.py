"""Settings from ``handoffd.toml``: daemon tuning, default retry policy, the specialists, and the
shared-context ``[namespaces]`` / ``[tiers]`` tables.

Everything is validated when the file is loaded, so ``handoffd serve`` / ``run`` refuse a bad file at
start (ConfigError, exit 2) instead of failing later. Values are taken as written, never converted:
``events = "false"`` is text, not false; ``max_document_bytes = 1.9`` is not a whole number;
``workers = "3"`` is not a number. Numbers must be finite and within sane bounds: an ``inf`` or
``1e300`` second interval is a typo that would overflow date arithmetic later, a ``1e-300`` one
spins a CPU, a ``lease_seconds`` under a second expires leases a healthy daemon still holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ConfigError

SECTIONS = frozenset({"daemon", "retry", "specialists", "namespaces", "tiers", "on_filed",
                      "retention", "store"})
STORE_KEYS = frozenset({"url", "pool_size", "reconnect_seconds"})
STORE_SCHEMES = ("postgresql://", "postgres://")
STORE_ENV = "HANDOFFD_STORE"  # the store URL from the environment (beats the file)
SPECIALIST_KEYS = frozenset({"command", "handler", "input_schema", "output_schema", "timeout_seconds",
                             "concurrency", "retry", "env", "cwd", "rate", "isolate"})
# a Python specialist's ``isolate``: when its handler runs in a one-shot process of its own
# (core.isolation); a command always does
ISOLATE_MODES = ("after_crash", "always", "never")
RETENTION_KEYS = frozenset({"completed", "failed", "mode", "every"})
RETRY_KEYS = frozenset({"max_retries", "retry_delay_seconds", "backoff_multiplier"})
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
MAX_NOTIFY_RETRIES = 20  # [[on_filed]] retries
MAX_NOTIFY_SECONDS = 3600.0  # [[on_filed]] retry_delay_seconds and timeout_seconds
MAX_EVENTS_KEEP = 1000  # [daemon] events_keep (the rotation walks this many names)
# Lower bounds of the loop intervals: below ~10 ms an idle daemon only spins (rescan_seconds =
# 1e-300 kept a CPU busy); a lease renewed every lease_seconds / 3 but at most every 0.5 s
# must last at least a second, or a healthy daemon recovers its own live claims as stalled.
MIN_INTERVAL_SECONDS = 0.01
MIN_LEASE_SECONDS = 1.0
NAMESPACE_KEYS = frozenset({"writers"})

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


def _finite_number(value: Any) -> bool:
    """True for an int or float (not a bool) that is neither inf nor nan."""
    # (an int is always finite; math.isfinite of one past a float's range raises OverflowError)
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (isinstance(value, int) or math.isfinite(value)))


def _brief(value: Any) -> str:
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
        raise ConfigError(f"{where} = {_brief(value)} is not a whole number (allowed: {allowed})")
    if not _finite_number(value):
        raise ConfigError(f"{where} = {_brief(value)} is not a finite number (allowed: {allowed})")
    if low > 0 >= value:  # the words the checks always used for a non-positive interval
        raise ConfigError(f"{where} must be greater than 0, not {_brief(value)} (allowed: {allowed})")
    if not low <= value <= high:
        raise ConfigError(f"{where} = {_brief(value)} is outside the allowed range {allowed}")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """Seed 001's retry_policy. Retry n (1-based) waits ``delay * multiplier ** (n - 1)`` seconds,
    never more than MAX_RETRY_DELAY_SECONDS (seven days)."""

    max_retries: int = 3
    retry_delay_seconds: float = 30.0
    backoff_multiplier: float = 2.0

    def delay(self, retry_number: int) -> float:
        """Seconds to wait before retry ``retry_number`` (1 for the first retry), capped at
        MAX_RETRY_DELAY_SECONDS. Never raises: a policy built directly (not via from_dict) may hold
        huge values, and this runs inside the sweeper, where an OverflowError would stop it."""
        base = self.retry_delay_seconds
        if not base > 0:  # also catches nan
            return 0.0
        try:
            value = base * self.backoff_multiplier ** max(retry_number - 1, 0)
        except OverflowError:
            return MAX_RETRY_DELAY_SECONDS
        return min(value, MAX_RETRY_DELAY_SECONDS) if value == value else MAX_RETRY_DELAY_SECONDS

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "RetryPolicy | None" = None) -> "RetryPolicy":
        """Overlay the keys present in ``data`` on ``base``; raise ConfigError (one line naming the
        key) on a bad value. Also used for policies that come from documents, so every value is
        checked: finite, ``0 <= max_retries <= 1000`` (an integer), ``0 <= retry_delay_seconds <=
        604800`` (7 days), ``1 <= backoff_multiplier <= 100``."""
        base = base or cls()
        if not isinstance(data, dict):
            raise ConfigError(f"bad retry policy {_brief(data)}: must be a table/object")
        key = _policy_key(data)
        if key is not None and cls is RetryPolicy:  # a document's is read 4 times a handoff
            return _overlaid(key, base)
        return cls._overlay(data, base)

    @classmethod
    def _overlay(cls, data: dict[str, Any], base: RetryPolicy) -> RetryPolicy:
        max_retries = _retry_value(data, "max_retries", base.max_retries, 0, MAX_RETRIES, integer=True)
        delay = _retry_value(data, "retry_delay_seconds", base.retry_delay_seconds, 0,
                             MAX_RETRY_DELAY_SECONDS)
        multiplier = _retry_value(data, "backoff_multiplier", base.backoff_multiplier, 1,
                                  MAX_BACKOFF_MULTIPLIER)
        return cls(max_retries=int(max_retries), retry_delay_seconds=float(delay),
                   backoff_multiplier=float(multiplier))


def _policy_key(data: dict[str, Any]) -> tuple[tuple[str, type, Any], ...] | None:
    """A hashable form of a small policy of plain values, types included (True is not 1 to
    the checks); None for anything else, which is checked afresh each time."""
    if len(data) > 8:
        return None
    items = []
    for name, value in data.items():
        if not isinstance(name, str) or type(value) not in (int, float, str, bool, type(None)):
            return None
        items.append((name, type(value), value))
    return tuple(sorted(items, key=lambda item: item[0]))


@lru_cache(maxsize=64)
def _overlaid(key: tuple[tuple[str, type, Any], ...], base: RetryPolicy) -> RetryPolicy:
    """RetryPolicy._overlay, remembered (a bad policy raises each time: errors are not kept)."""
    return RetryPolicy._overlay({name: value for name, _, value in key}, base)


def check_retry_table(data: Any, where: str) -> None:
    """A retry table of handoffd.toml (``[retry]``, a specialist's ``retry``): a table of the
    known keys whose values are numbers as written (no text, no bool; ``max_retries`` a whole
    number) within RetryPolicy's bounds. ConfigError ``"<where> <key> = ..."`` otherwise. (A
    document's retry_policy is checked by RetryPolicy.from_dict alone, which reads "3" as 3.)"""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(str(key) for key in set(data) - RETRY_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known: "
                          f"{', '.join(sorted(RETRY_KEYS))}")
    if "max_retries" in data:
        bounded(data["max_retries"], f"{where} max_retries", 0, MAX_RETRIES, integer=True)
    if "retry_delay_seconds" in data:
        bounded(data["retry_delay_seconds"], f"{where} retry_delay_seconds", 0,
                MAX_RETRY_DELAY_SECONDS, unit=" seconds")
    if "backoff_multiplier" in data:
        bounded(data["backoff_multiplier"], f"{where} backoff_multiplier", 1,
                MAX_BACKOFF_MULTIPLIER)


def _retry_value(data: dict[str, Any], key: str, default: float, low: float, high: float, *,
                 integer: bool = False) -> float:
    """``data[key]`` (or ``default``) as a number within ``[low, high]``; ConfigError otherwise."""
    if key not in data:
        return default
    raw = data[key]
    value: Any = raw
    if isinstance(raw, str):  # "3" from a hand-written document: accepted as before
        try:
            value = float(raw.strip())
        except ValueError:
            value = None
    if not _finite_number(value):
        raise ConfigError(f"bad retry policy: {key} = {_brief(raw)} is not a finite number")
    if integer and value != int(value):
        raise ConfigError(f"bad retry policy: {key} = {_brief(raw)} is not a whole number")
    if not low <= value <= high:
        raise ConfigError(f"bad retry policy: {key} = {_brief(raw)} is outside {low:g}..{high:g}")
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


@dataclass
class DaemonSettings:
    """``[daemon]`` in handoffd.toml. Times are seconds."""

    workers: int = 4
    # processes `handoffd run` and `serve` fork (handoffd.service.spread); AUTO_PROCESSES is
    # "auto": for run, one per CPU for a large backlog of in-process handlers, else one
    processes: int = AUTO_PROCESSES
    rescan_seconds: float = 5.0
    sweep_seconds: float = 10.0
    lease_seconds: float = 60.0
    settle_seconds: float = 0.5
    claim_grace_seconds: float = 10.0
    grace_seconds: float = 10.0
    durability: str = "fsync"
    max_document_bytes: int = 4 * 1024 * 1024
    max_output_bytes: int = 16 * 1024 * 1024
    default_timeout_seconds: float = 300.0
    seen_ttl_seconds: float = 3600.0
    stall_seconds: float = 30.0  # progress watchdog: due work, free slots, nothing dispatched
    # what a request expects of its result (seed 001: named schemas, expected_output.schema, an
    # output artifact at expected_output.destination): "enforce" fails a handoff that does not
    # meet them; "advisory" files it with a warning instead
    expectations: str = "enforce"
    # the event log (handoffs/.meta/events.jsonl): stats, metrics, `handoff top` read it
    events: bool = True
    events_max_bytes: int = 16 * 1024 * 1024  # rotated past this size
    events_keep: int = 4  # rotated files kept

    @property
    def durable(self) -> bool:
        """True unless ``durability = "fast"``."""
        return self.durability != "fast"


@dataclass
class SpecialistConfig:
    """One ``[specialists."@agent"]`` table."""

    agent: str
    command: list[str] | None = None
    handler: str | None = None
    input_schema: str | None = None
    output_schema: str | None = None
    timeout_seconds: float | None = None
    concurrency: int | None = None  # None: as many at once as the daemon has workers
    retry: RetryPolicy | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    rate: "Rate | None" = None  # at most rate.count starts per rate.seconds, workspace-wide
    isolate: str = "after_crash"  # one of ISOLATE_MODES


@dataclass(frozen=True)
class Rate:
    """A specialist's ``rate = "30/m"``: at most ``count`` starts per ``seconds`` (a token
    bucket of ``count`` tokens refilled evenly over ``seconds``)."""

    count: int
    seconds: float

    @classmethod
    def parse(cls, text: Any) -> "Rate":
        """``"30/m"``, ``"5/s"``, ``"100/h"``, ``"1000/d"`` or ``"10/90s"``; ConfigError else."""
        if not isinstance(text, str) or text.count("/") != 1:
            raise ConfigError(f"rate {text!r} must look like \"30/m\" (count/period)")
        count_text, period = text.split("/")
        try:
            count = int(count_text.strip())
        except ValueError:
            raise ConfigError(f"rate {text!r}: {count_text!r} is not a whole number") from None
        seconds = parse_duration(period.strip() if period.strip()[:1].isdigit()
                                 else "1" + period.strip())
        if not seconds > 0:
            raise ConfigError(f"rate {text!r}: the period must be longer than 0")
        if not 1 <= count <= 1_000_000:
            raise ConfigError(f"rate {text!r}: the count must be between 1 and 1000000")
        return cls(count, seconds)

    def __str__(self) -> str:
        return f"{self.count}/{self.seconds:g}s"


@dataclass
class Retention:
    """``[retention]``: finished handoffs older than these are purged (or archived, with
    ``mode = "archive"``) by the daemon, every ``every`` seconds. None: kept forever."""

    completed: float | None = None
    failed: float | None = None
    mode: str = "purge"
    every: float = 3600.0


UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(value: Any) -> float:
    """Seconds from ``"45s"``, ``"10m"``, ``"12h"``, ``"7d"``, ``"2w"`` or a number of seconds;
    ConfigError for anything else, negative, or over ten years."""
    if isinstance(value, bool):
        raise ConfigError(f"duration {value!r} must be a number of seconds or like \"7d\"")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower()
        unit = UNITS.get(text[-1])
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1.0)
        except ValueError:
            raise ConfigError(f"duration {value!r} must look like 45s, 10m, 12h, 7d or 2w") from None
    else:
        raise ConfigError(f"duration {value!r} must look like 45s, 10m, 12h, 7d or 2w")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
        raise ConfigError(f"duration {value!r} must be between 0 and 10 years")
    return seconds


@dataclass
class StoreSettings:
    """``[store]`` in handoffd.toml: where the handoffs live. ``url`` None: this workspace's
    handoffs/ folders (the files backend); ``postgresql://...``: that database."""

    url: str | None = None
    pool_size: int = 8  # connections one process may open (daemons: at least workers + 2)
    reconnect_seconds: float = 60.0  # how long an operation retries a lost connection


def check_store_url(url: str, where: str = "store url") -> str:
    """``url`` if it names a PostgreSQL database; ConfigError otherwise."""
    if not isinstance(url, str) or not url.startswith(STORE_SCHEMES) or any(
            c in url for c in "\n\r\0"):
        raise ConfigError(f"{where}: give a postgresql://user@host/dbname URL (no value: the "
                          "workspace's files)")
    return url


def parse_store(table: Any, path: Path | str = "handoffd.toml") -> StoreSettings:
    """The ``[store]`` table as StoreSettings; ConfigError naming the first problem."""
    if not isinstance(table, dict) or set(table) - STORE_KEYS:
        raise ConfigError(f"{path}: [store] is a table with keys {', '.join(sorted(STORE_KEYS))}")
    settings = StoreSettings()
    if "url" in table:
        settings.url = check_store_url(table["url"], f"{path}: [store] url")
    if "pool_size" in table:
        settings.pool_size = bounded(table["pool_size"], f"{path}: [store] pool_size", 1,
                                     MAX_POOL_SIZE, integer=True)
    if "reconnect_seconds" in table:
        settings.reconnect_seconds = float(bounded(
            table["reconnect_seconds"], f"{path}: [store] reconnect_seconds", 0, MAX_SECONDS,
            unit=" seconds"))
    return settings


@dataclass
class Config:
    """Everything handoffd.toml says (defaults when the file is absent)."""

    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    specialists: dict[str, SpecialistConfig] = field(default_factory=dict)
    #: ``[namespaces]``, parsed: namespace (lower-case, no slashes; ``"*"`` for the default) ->
    #: writers. Only what the file says; the built-in seed-000 table is added by context_store.
    namespaces: dict[str, list[str]] = field(default_factory=dict)
    #: ``[tiers]``: agent id -> tier name (a number 1-4 is kept as its digit).
    tiers: dict[str, str] = field(default_factory=dict)
    #: ``[[on_filed]]``: who to tell when a handoff is filed (the notify feature).
    on_filed: list[NotifyRule] = field(default_factory=list)
    #: ``[retention]``: how long finished handoffs are kept.
    retention: Retention = field(default_factory=Retention)
    #: ``[store]``: the files backend (no url) or a PostgreSQL database.
    store: StoreSettings = field(default_factory=StoreSettings)

    def store_url(self, override: str | None = None) -> str | None:
        """The store to use: ``override`` (``--store``), else ``$HANDOFFD_STORE``, else
        ``[store] url``; None: the workspace's files. ConfigError for a URL that is not
        PostgreSQL's."""
        import os
        if override:
            return check_store_url(override, "--store")
        env = os.environ.get(STORE_ENV)
        if env:
            return check_store_url(env, f"${STORE_ENV}")
        return self.store.url


NOTIFY_KEYS = frozenset({"command", "url", "secret", "secret_env", "states", "agents", "retries",
                         "retry_delay_seconds", "timeout_seconds"})


@dataclass
class NotifyRule:
    """One ``[[on_filed]]`` table: run ``command`` (argv, the filed document on stdin) and/or
    POST it to ``url`` (signed with ``secret``), for handoffs filed in one of ``states`` whose
    specialist is one of ``agents`` (empty: any)."""

    command: list[str] | None = None
    url: str | None = None
    secret: str | None = None
    secret_env: str | None = None  # or the name of an environment variable holding it
    states: list[str] = field(default_factory=lambda: ["completed", "failed"])
    agents: list[str] = field(default_factory=list)
    retries: int = 3
    retry_delay_seconds: float = 1.0
    timeout_seconds: float = 10.0


def _http_url(url: Any) -> bool:
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


def parse_on_filed(tables: Any, path: Path) -> list[NotifyRule]:
    """``[[on_filed]]`` tables as NotifyRules; ConfigError naming the first problem."""
    if not isinstance(tables, list):
        raise ConfigError(f"{path}: on_filed must be an array of tables: [[on_filed]]")
    rules = []
    for index, table in enumerate(tables):
        where = f"{path}: [[on_filed]] #{index + 1}"
        if not isinstance(table, dict) or set(table) - NOTIFY_KEYS:
            raise ConfigError(f"{where}: known keys are {', '.join(sorted(NOTIFY_KEYS))}")
        rule = NotifyRule(**table)
        if rule.command is None and rule.url is None:
            raise ConfigError(f"{where}: give a command = [...] or a url = \"http://...\"")
        if rule.command is not None and (not isinstance(rule.command, list) or not rule.command
                                         or not all(isinstance(c, str) and "\0" not in c
                                                    for c in rule.command)):
            raise ConfigError(f"{where}: command must be a non-empty list of strings (no shell, "
                              "no NUL)")
        if rule.url is not None and not _http_url(rule.url):
            raise ConfigError(f"{where}: url must be an http:// or https:// address with a host, "
                              "a valid port and no spaces or control characters")
        if not all(v is None or isinstance(v, str) for v in (rule.secret, rule.secret_env)):
            raise ConfigError(f"{where}: secret and secret_env must be strings")
        if not isinstance(rule.states, list) or not all(
                s in ("completed", "failed") for s in rule.states):
            raise ConfigError(f"{where}: states may list completed and failed")
        if not isinstance(rule.agents, list) or not all(isinstance(a, str) for a in rule.agents):
            raise ConfigError(f"{where}: agents must be a list of agent ids")
        bounded(rule.retries, f"{where}: retries", 0, MAX_NOTIFY_RETRIES, integer=True)
        for name in ("retry_delay_seconds", "timeout_seconds"):
            value = bounded(getattr(rule, name), f"{where}: {name}", MIN_INTERVAL_SECONDS,
                            MAX_NOTIFY_SECONDS, unit=" seconds")
            setattr(rule, name, float(value))
        rules.append(rule)
    return rules


def load_config(path: Path) -> Config:
    """Read handoffd.toml at ``path`` (missing file: defaults); raise ConfigError on any problem."""
    if not path.exists():
        return Config()
    import tomllib  # ~8 ms: a workspace without handoffd.toml never needs it
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(raw) - SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section [{unknown[0]}]; known: "
                          f"{', '.join(sorted(SECTIONS))}")
    config = Config()
    config.daemon = _daemon_settings(raw.get("daemon", {}), path)
    retry = raw.get("retry", {})
    check_retry_table(retry, f"{path}: [retry]")
    try:
        config.retry = RetryPolicy.from_dict(retry)
    except ConfigError as exc:
        raise ConfigError(f"{path}: [retry] {exc}") from None
    config.namespaces = parse_namespaces(raw.get("namespaces", {}), path)
    config.tiers = parse_tiers(raw.get("tiers", {}), path)
    config.on_filed = parse_on_filed(raw.get("on_filed", []), path)
    config.retention = parse_retention(raw.get("retention", {}), path)
    config.store = parse_store(raw.get("store", {}), path)
    specialists = raw.get("specialists", {})
    if not isinstance(specialists, dict):
        raise ConfigError(f"{path}: specialists must be tables: [specialists.\"@agent\"]")
    for agent, table in specialists.items():
        config.specialists[agent] = specialist_from_table(agent, table, config.retry, path)
    return config


def parse_retention(table: Any, path: Path | str = "handoffd.toml") -> Retention:
    """``[retention]``: ``completed``/``failed`` durations, ``mode``, ``every``."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [retention] must be a table")
    unknown = sorted(set(table) - RETENTION_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown [retention] setting {unknown[0]!r}; known: "
                          f"{', '.join(sorted(RETENTION_KEYS))}")
    try:
        retention = Retention(
            completed=parse_duration(table["completed"]) if "completed" in table else None,
            failed=parse_duration(table["failed"]) if "failed" in table else None,
            mode=table.get("mode", "purge"),
            every=parse_duration(table.get("every", 3600)))
    except ConfigError as exc:
        raise ConfigError(f"{path}: [retention] {exc}") from None
    if not isinstance(retention.mode, str) or retention.mode not in ("purge", "archive"):
        raise ConfigError(f"{path}: [retention] mode must be \"purge\" or \"archive\"")
    if retention.every < 1:
        raise ConfigError(f"{path}: [retention] every must be at least 1 second")
    return retention


def _daemon_settings(table: dict[str, Any], path: Path) -> DaemonSettings:
    """``[daemon]`` as DaemonSettings: every key checked against DAEMON_RULES (its type, never
    converted, and its range); ConfigError naming the first bad one."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [daemon] must be a table")
    settings = DaemonSettings()
    for key, value in table.items():
        if key not in DAEMON_RULES:
            raise ConfigError(f"{path}: unknown [daemon] setting {key!r}; known: "
                              f"{', '.join(DAEMON_RULES)}")
        setattr(settings, key, _daemon_value(key, value, f"{path}: [daemon] {key}"))
    return settings


def _daemon_value(key: str, value: Any, where: str) -> Any:
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


def parse_namespaces(table: Any, path: Path | str = "handoffd.toml") -> dict[str, list[str]]:
    """Validate ``[namespaces]``: each entry is ``"name" = { writers = [...] }`` (or a bare list),
    ``name`` a safe context-key prefix or ``"*"``, writers non-empty strings. Names are
    normalised the way keys are compared (lower case, no leading/trailing ``/``), so
    ``"Task/"`` and ``"task"`` are one namespace (two entries for it are an error)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [namespaces] must be a table of "
                          "[namespaces.\"name\"] writers = [...] entries")
    out: dict[str, list[str]] = {}
    for raw_name, spec in table.items():
        where = f"[namespaces.\"{raw_name}\"]"
        name = _namespace_name(raw_name, where, path)
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - NAMESPACE_KEYS)
            if unknown:
                raise ConfigError(f"{path}: {where}: unknown key {unknown[0]!r}; known: writers")
            if "writers" not in spec:
                raise ConfigError(f"{path}: {where} needs writers = [...] (agent ids, tier names or \"*\")")
            writers = spec["writers"]
        else:
            writers = spec
        if not isinstance(writers, list) or not all(isinstance(w, str) and w.strip() for w in writers):
            raise ConfigError(f"{path}: {where} writers must be a list of agent ids, tier names "
                              f"or \"*\" (got {writers!r})")
        if name in out:
            raise ConfigError(f"{path}: {where}: namespace {name!r} is configured twice "
                              "(names are compared case-insensitively)")
        out[name] = [w.strip() for w in writers]
    return out


def _namespace_name(raw: Any, where: str, path: Path | str) -> str:
    """A ``[namespaces]`` entry's name as it is compared: ``*`` or a lower-case safe key."""
    from .errors import InvalidDocument
    from .keys import normalise_key

    text = str(raw).strip()
    if text == "*":
        return "*"
    try:
        return normalise_key(text.strip("/")).casefold()
    except InvalidDocument:
        raise ConfigError(f"{path}: {where}: {text!r} is not a valid namespace: use \"*\" or "
                          "segments of letters, digits and ._@+=- separated by '/' "
                          "(no '..', no empty segments)") from None


def parse_tiers(table: Any, path: Path | str = "handoffd.toml") -> dict[str, str]:
    """Validate ``[tiers]``: ``"agent" = "TIER_NAME"`` or a tier number 1-4."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tiers] must be a table of \"@agent\" = \"TIER\" entries")
    out: dict[str, str] = {}
    for agent, tier in table.items():
        if isinstance(tier, int) and not isinstance(tier, bool) and 1 <= tier <= 4:
            out[str(agent)] = str(tier)
        elif isinstance(tier, str) and tier.strip():
            out[str(agent)] = tier.strip()
        else:
            raise ConfigError(f"{path}: [tiers] \"{agent}\" = {tier!r}: a tier is a name such as "
                              "\"SPECIALIZED_FLEET\" or a number 1-4")
    return out


def specialist_from_table(agent: str, table: dict[str, Any], default_retry: RetryPolicy,
                          path: Path | str = "handoffd.toml") -> SpecialistConfig:
    """Validate one specialist table; exactly one of ``command`` / ``handler`` is required."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [specialists.\"{agent}\"] must be a table")
    unknown = sorted(set(table) - SPECIALIST_KEYS)
    if unknown:
        raise ConfigError(f"{path}: specialist {agent}: unknown key {unknown[0]!r}; known: "
                          f"{', '.join(sorted(SPECIALIST_KEYS))}")
    command, handler = table.get("command"), table.get("handler")
    if (command is None) == (handler is None):
        raise ConfigError(f"{path}: specialist {agent} needs exactly one of command = [...] or "
                          "handler = \"module:function\"")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(c, str) for c in command)):
        raise ConfigError(f"{path}: specialist {agent}: command must be a non-empty list of strings "
                          "(it is never run through a shell)")
    if handler is not None and (not isinstance(handler, str) or ":" not in handler):
        raise ConfigError(f"{path}: specialist {agent}: handler must look like \"package.module:function\"")
    where = f"{path}: specialist {agent}:"
    concurrency = table.get("concurrency")
    if concurrency is not None:
        bounded(concurrency, f"{where} concurrency", 1, MAX_WORKERS, integer=True)
    timeout = table.get("timeout_seconds")
    if timeout is not None:
        bounded(timeout, f"{where} timeout_seconds", MIN_INTERVAL_SECONDS, MAX_SECONDS,
                unit=" seconds")
    for name in ("input_schema", "output_schema", "cwd"):
        if table.get(name) is not None and not isinstance(table[name], str):
            raise ConfigError(f"{where} {name} = {table[name]!r} must be a string")
    env = table.get("env")
    if env is not None and (not isinstance(env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and "\0" not in k
            and isinstance(v, str) and "\0" not in v for k, v in env.items())):
        raise ConfigError(f"{where} env must be a table of NAME = \"text\" (strings, no NUL)")
    retry = table.get("retry")
    if retry is not None:
        check_retry_table(retry, f"{where} retry")
    try:
        policy = RetryPolicy.from_dict(retry, default_retry) if retry is not None else None
    except ConfigError as exc:
        raise ConfigError(f"{path}: specialist {agent}: retry: {exc}") from None
    try:
        rate = Rate.parse(table["rate"]) if "rate" in table else None
    except ConfigError as exc:
        raise ConfigError(f"{path}: specialist {agent}: {exc}") from None
    isolate = table.get("isolate", ISOLATE_MODES[0])
    if not isinstance(isolate, str) or isolate not in ISOLATE_MODES:
        raise ConfigError(f"{where} isolate = {_brief(isolate)} must be "
                          f"{' or '.join(chr(34) + k + chr(34) for k in ISOLATE_MODES)}")
    return SpecialistConfig(
        agent=agent, command=command, handler=handler,
        input_schema=table.get("input_schema"), output_schema=table.get("output_schema"),
        timeout_seconds=float(timeout) if timeout is not None else None,
        concurrency=concurrency,
        retry=policy,
        env=dict(env or {}),
        cwd=table.get("cwd"),
        rate=rate,
        isolate=isolate,
    )
