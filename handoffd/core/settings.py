"""The typed settings: what handoffd.toml says, as :func:`handoffd.core.config.load_config`
returns it (defaults when the file is absent). :class:`RetryPolicy` is also a document's own
``retry_policy``, read with :meth:`RetryPolicy.from_dict`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bounds import (
    AUTO_PROCESSES,
    MAX_BACKOFF_MULTIPLIER,
    MAX_RETRIES,
    MAX_RETRY_DELAY_SECONDS,
    brief,
    check_owner_grace,
    check_store_url,
    parse_duration,
    retry_value,
)
from .errors import ConfigError

STORE_ENV = "HANDOFFD_STORE"  # the store URL from the environment (beats the file)
# a Python specialist's ``isolate``: when its handler runs in a one-shot process of its own
# (core.isolation); a command always does
ISOLATE_MODES = ("after_crash", "always", "never")


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
        if base is None:  # (the defaults, made once: a document's is read 4 times a handoff)
            base = _DEFAULT_POLICY if cls is RetryPolicy else cls()
        if not isinstance(data, dict):
            raise ConfigError(f"bad retry policy {brief(data)}: must be a table/object")
        if cls is RetryPolicy and len(data) <= 8:  # a document's is read 4 times a handoff
            # a small policy of plain values is remembered by its items and their values' types
            # (True is not 1 to the checks); anything else is checked afresh each time
            types = tuple(map(type, data.values()))
            if _PLAIN.issuperset(types):
                key = (tuple(data.items()), types)
                found = _OVERLAID.get((key, id(base)))
                if found is not None and found[0] is base:
                    return found[1]
                return _overlaid(key, base)
        return cls._overlay(data, base)

    @classmethod
    def _overlay(cls, data: dict[str, Any], base: RetryPolicy) -> RetryPolicy:
        max_retries = retry_value(data, "max_retries", base.max_retries, 0, MAX_RETRIES, integer=True)
        delay = retry_value(data, "retry_delay_seconds", base.retry_delay_seconds, 0,
                            MAX_RETRY_DELAY_SECONDS)
        multiplier = retry_value(data, "backoff_multiplier", base.backoff_multiplier, 1,
                                 MAX_BACKOFF_MULTIPLIER)
        return cls(max_retries=int(max_retries), retry_delay_seconds=float(delay),
                   backoff_multiplier=float(multiplier))


_PLAIN = frozenset({int, float, str, bool, type(None)})
_DEFAULT_POLICY = RetryPolicy()
# the policies made by overlaying a key (RetryPolicy.from_dict's) on a base, by the key and the
# base's id:
# a frozen dataclass hashes (and compares) in Python, a call each, and a document's policy is
# read 4 times a handoff. Each entry keeps its base, so no other policy can take its id while
# the entry is here (and a hit is checked to be that very base all the same)
_OVERLAID: dict[tuple[Any, int], tuple[RetryPolicy, RetryPolicy]] = {}
OVERLAID_KEPT = 64


def _overlaid(key: tuple[tuple[Any, ...], tuple[type, ...]], base: RetryPolicy) -> RetryPolicy:
    """RetryPolicy._overlay, remembered in :data:`_OVERLAID` (where
    :meth:`RetryPolicy.from_dict` looks first); a bad policy raises each time: errors are not
    kept."""
    policy = RetryPolicy._overlay(dict(key[0]), base)
    if len(_OVERLAID) >= OVERLAID_KEPT:
        _OVERLAID.clear()
    _OVERLAID[key, id(base)] = (base, policy)
    return policy


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
        digits = count_text.strip()
        # ASCII digits only, as durations: int() also takes "1_000", "+5" and "٣" (Arabic three)
        if not (digits.isascii() and digits.isdigit()):
            raise ConfigError(f"rate {text!r}: {count_text!r} is not a whole number")
        count = int(digits)
        given = period.strip()
        seconds = parse_duration(given if given[:1].isdigit() else "1" + given,
                                 what=f"rate {text!r}: its period {given!r}")
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


@dataclass
class StoreSettings:
    """``[store]`` in handoffd.toml: where the handoffs live. ``url`` None: this workspace's
    handoffs/ folders (the files backend); ``postgresql://...``: that database."""

    url: str | None = None
    pool_size: int = 8  # connections one process may open (daemons: at least workers + 2)
    reconnect_seconds: float = 60.0  # how long an operation retries a lost (or first) connection
    # how long one attempt to connect may take (libpq's connect_timeout, whole seconds): every
    # connection to the store (the pool's, the wake-up, presence and key-holding sessions,
    # `handoffd db init`'s) is made within it
    connect_timeout_seconds: float = 10.0


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
    #: the file it was read from (None: defaults, no file), named by the errors it gives later
    path: Path | None = field(default=None, compare=False)

    def store_url(self, override: str | None = None) -> str | None:
        """The store to use: ``override`` (``--store``), else ``$HANDOFFD_STORE``, else
        ``[store] url``; None: the workspace's files. ConfigError for a URL that is not
        PostgreSQL's, and for a ``[daemon] claim_grace_seconds`` such a store cannot use
        (:func:`~.bounds.check_owner_grace`)."""
        import os
        env = os.environ.get(STORE_ENV)
        if override:
            url: str | None = check_store_url(override, "--store")
        elif env:
            url = check_store_url(env, f"${STORE_ENV}")
        else:
            url = self.store.url
        if url is not None:  # (named as every other setting's error: by the file's path)
            where = f"{self.path or 'handoffd.toml'}: [daemon] claim_grace_seconds"
            check_owner_grace(self.daemon.claim_grace_seconds, where)
        return url
