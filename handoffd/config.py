"""Settings from ``handoffd.toml``: daemon tuning, default retry policy and the specialists."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError


SECTIONS = frozenset({"daemon", "retry", "specialists", "namespaces", "tiers"})
SPECIALIST_KEYS = frozenset({"command", "handler", "input_schema", "output_schema", "timeout_seconds",
                             "concurrency", "retry", "env", "cwd"})
POSITIVE_SETTINGS = ("rescan_seconds", "sweep_seconds", "lease_seconds", "max_document_bytes",
                     "max_output_bytes", "default_timeout_seconds", "seen_ttl_seconds")


@dataclass(frozen=True)
class RetryPolicy:
    """Seed 001's retry_policy. Retry n (1-based) waits ``delay * multiplier ** (n - 1)`` seconds."""

    max_retries: int = 3
    retry_delay_seconds: float = 30.0
    backoff_multiplier: float = 2.0

    def delay(self, retry_number: int) -> float:
        """Seconds to wait before retry ``retry_number`` (1 for the first retry)."""
        return self.retry_delay_seconds * self.backoff_multiplier ** max(retry_number - 1, 0)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "RetryPolicy | None" = None) -> "RetryPolicy":
        """Overlay the keys present in ``data`` on ``base``; raise ConfigError on bad values."""
        base = base or cls()
        try:
            policy = cls(
                max_retries=int(data.get("max_retries", base.max_retries)),
                retry_delay_seconds=float(data.get("retry_delay_seconds", base.retry_delay_seconds)),
                backoff_multiplier=float(data.get("backoff_multiplier", base.backoff_multiplier)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad retry policy {data!r}: {exc}") from None
        if policy.max_retries < 0 or policy.retry_delay_seconds < 0 or policy.backoff_multiplier < 1:
            raise ConfigError(f"bad retry policy {data!r}: values must be >= 0 (multiplier >= 1)")
        return policy


@dataclass
class DaemonSettings:
    """``[daemon]`` in handoffd.toml. Times are seconds."""

    workers: int = 4
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
    concurrency: int = 1
    retry: RetryPolicy | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


@dataclass
class Config:
    """Everything handoffd.toml says (defaults when the file is absent)."""

    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    specialists: dict[str, SpecialistConfig] = field(default_factory=dict)
    namespaces: dict[str, Any] = field(default_factory=dict)


def load_config(path: Path) -> Config:
    """Read handoffd.toml at ``path`` (missing file: defaults); raise ConfigError on any problem."""
    if not path.exists():
        return Config()
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
    config.retry = RetryPolicy.from_dict(raw.get("retry", {}))
    config.namespaces = raw.get("namespaces", {})
    for agent, table in (raw.get("specialists") or {}).items():
        config.specialists[agent] = specialist_from_table(agent, table, config.retry, path)
    return config


def _daemon_settings(table: dict[str, Any], path: Path) -> DaemonSettings:
    known = {f.name: f.type for f in fields(DaemonSettings)}
    settings = DaemonSettings()
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown [daemon] setting {key!r}; known: {', '.join(known)}")
        default = getattr(settings, key)
        try:
            setattr(settings, key, type(default)(value))
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: [daemon] {key} = {value!r} is not of type {type(default).__name__}") from None
    if settings.durability not in ("fsync", "fast"):
        raise ConfigError(f"{path}: [daemon] durability must be \"fsync\" or \"fast\"")
    if settings.workers < 1:
        raise ConfigError(f"{path}: [daemon] workers must be at least 1")
    for name in POSITIVE_SETTINGS:
        if getattr(settings, name) <= 0:
            raise ConfigError(f"{path}: [daemon] {name} must be greater than 0")
    for name in ("settle_seconds", "claim_grace_seconds", "grace_seconds"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{path}: [daemon] {name} must not be negative")
    return settings


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
    concurrency = table.get("concurrency", 1)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"{path}: specialist {agent}: concurrency must be a positive integer")
    timeout = table.get("timeout_seconds")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{path}: specialist {agent}: timeout_seconds must be a positive number")
    retry = table.get("retry")
    return SpecialistConfig(
        agent=agent, command=command, handler=handler,
        input_schema=table.get("input_schema"), output_schema=table.get("output_schema"),
        timeout_seconds=float(timeout) if timeout is not None else None,
        concurrency=concurrency,
        retry=RetryPolicy.from_dict(retry, default_retry) if isinstance(retry, dict) else None,
        env={str(k): str(v) for k, v in (table.get("env") or {}).items()},
        cwd=table.get("cwd"),
    )
