"""Reading ``handoffd.toml``: daemon tuning, default retry policy, the specialists, the
shared-context ``[namespaces]`` / ``[tiers]``, ``[[on_filed]]``, ``[retention]`` and ``[store]``.

Everything is validated when the file is loaded, so ``handoffd serve`` / ``run`` refuse a bad file at
start (ConfigError, exit 2) instead of failing later. The file's tables become the typed settings
of :mod:`handoffd.core.settings`; each value is held to its bounds by :mod:`handoffd.core.bounds`
(taken as written, never converted: ``workers = "3"`` is not a number). The settings and bounds
this module always offered are still importable from it (``__all__``).
"""
from __future__ import annotations

import errno
import os
import posixpath
import stat
from pathlib import Path
from typing import Any

from .bounds import (
    AUTO_PROCESSES,
    DAEMON_RULES,
    MAX_BACKOFF_MULTIPLIER,
    MAX_BYTES,
    MAX_CONNECT_SECONDS,
    MAX_EVENTS_KEEP,
    MAX_NOTIFY_RETRIES,
    MAX_NOTIFY_SECONDS,
    MAX_POOL_SIZE,
    MAX_PROCESSES,
    MAX_RETRIES,
    MAX_RETRY_DELAY_SECONDS,
    MAX_SECONDS,
    MAX_WORKERS,
    MIN_CONNECT_SECONDS,
    MIN_INTERVAL_SECONDS,
    MIN_LEASE_SECONDS,
    STORE_SCHEMES,
    UNITS,
    bounded,
    brief,
    check_store_url,
    daemon_value,
    http_url,
    parse_duration,
    processes_value,
)
from .errors import ConfigError
from .ownfiles import read_at_most
from .settings import (
    ISOLATE_MODES,
    STORE_ENV,
    Config,
    DaemonSettings,
    NotifyRule,
    Rate,
    Retention,
    RetryPolicy,
    SpecialistConfig,
    StoreSettings,
)

__all__ = [
    # the file's tables and keys, and reading them
    "SECTIONS", "STORE_KEYS", "SPECIALIST_KEYS", "RETENTION_KEYS", "RETRY_KEYS", "NAMESPACE_KEYS",
    "NOTIFY_KEYS", "load_config", "check_retry_table", "parse_namespaces", "parse_tiers",
    "parse_on_filed", "parse_retention", "parse_store", "specialist_from_table",
    # core.settings
    "Config", "DaemonSettings", "NotifyRule", "Rate", "Retention", "RetryPolicy",
    "SpecialistConfig", "StoreSettings", "ISOLATE_MODES", "STORE_ENV",
    # core.bounds
    "AUTO_PROCESSES", "DAEMON_RULES", "MAX_BACKOFF_MULTIPLIER", "MAX_BYTES", "MAX_EVENTS_KEEP",
    "MAX_CONNECT_SECONDS", "MIN_CONNECT_SECONDS", "MAX_NOTIFY_RETRIES", "MAX_NOTIFY_SECONDS",
    "MAX_POOL_SIZE", "MAX_PROCESSES", "MAX_RETRIES",
    "MAX_RETRY_DELAY_SECONDS", "MAX_SECONDS", "MAX_WORKERS", "MIN_INTERVAL_SECONDS",
    "MIN_LEASE_SECONDS", "STORE_SCHEMES", "UNITS", "bounded", "check_store_url", "parse_duration",
    "processes_value",
    "ConfigError",  # (core.errors; long imported from here too)
]

SECTIONS = frozenset({"daemon", "retry", "specialists", "namespaces", "tiers", "on_filed",
                      "retention", "store"})
STORE_KEYS = frozenset({"url", "pool_size", "reconnect_seconds", "connect_timeout_seconds"})
SPECIALIST_KEYS = frozenset({"command", "handler", "input_schema", "output_schema", "timeout_seconds",
                             "concurrency", "retry", "env", "cwd", "rate", "isolate"})
RETENTION_KEYS = frozenset({"completed", "failed", "mode", "every"})
RETRY_KEYS = frozenset({"max_retries", "retry_delay_seconds", "backoff_multiplier"})
NAMESPACE_KEYS = frozenset({"writers"})
NOTIFY_KEYS = frozenset({"command", "url", "secret", "secret_env", "states", "agents", "retries",
                         "retry_delay_seconds", "timeout_seconds"})
# handoffd.toml is read up to this size: a real one is a few kilobytes
MAX_CONFIG_BYTES = 1 << 20


def load_config(path: Path) -> Config:
    """Read handoffd.toml at ``path`` (missing file: defaults); raise ConfigError on any problem.
    A specialist's ``cwd`` is checked against the workspace the file lives in (its folder)."""
    text = _config_text(path)
    if text is None:
        return Config()
    import tomllib  # ~8 ms: a workspace without handoffd.toml never needs it
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: its arrays or inline tables nest too deeply to be read") from None
    unknown = sorted(set(raw) - SECTIONS)
    if unknown:
        raise ConfigError(f"{path}: unknown section [{unknown[0]}]; known: "
                          f"{', '.join(sorted(SECTIONS))}")
    config = Config(path=path)
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
        config.specialists[agent] = specialist_from_table(agent, table, config.retry, path,
                                                          root=path.parent.resolve())
    return config


def _config_text(path: Path) -> str | None:
    """The text of handoffd.toml (None when there is none), read as ``Path.read_text`` did
    (UTF-8, universal newlines) but never blocking (a FIFO there: O_NONBLOCK), only from a
    regular file (not a folder or a device) and only up to MAX_CONFIG_BYTES; ConfigError, one
    line, for anything it cannot read (a folder, no permission, not UTF-8, too large)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None  # (a dangling symlink too: as before, the defaults)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{path}: cannot read: {os.strerror(errno.EISDIR)}")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{path}: cannot read: not a regular file (a FIFO, socket or device)")
        data = read_at_most(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: cannot read: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


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
        setattr(settings, key, daemon_value(key, value, f"{path}: [daemon] {key}"))
    return settings


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
                          path: Path | str = "handoffd.toml", *,
                          root: Path | None = None) -> SpecialistConfig:
    """Validate one specialist table; exactly one of ``command`` / ``handler`` is required.
    ``root``: the workspace (resolved) its ``cwd`` must stay inside; None when not known here
    (an entry point, a decorator): then only a relative ``cwd`` whose ``..`` leave is refused."""
    _check_specialist(agent, table, path, root)
    where = f"{path}: specialist {agent}:"
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
        raise ConfigError(f"{where} isolate = {brief(isolate)} must be "
                          f"{' or '.join(chr(34) + k + chr(34) for k in ISOLATE_MODES)}")
    timeout = table.get("timeout_seconds")
    return SpecialistConfig(
        agent=agent, command=table.get("command"), handler=table.get("handler"),
        input_schema=table.get("input_schema"), output_schema=table.get("output_schema"),
        timeout_seconds=float(timeout) if timeout is not None else None,
        concurrency=table.get("concurrency"),
        retry=policy,
        env=dict(table.get("env") or {}),
        cwd=table.get("cwd"),
        rate=rate,
        isolate=isolate,
    )


def _check_specialist(agent: str, table: Any, path: Path | str, root: Path | None = None) -> None:
    """One specialist table's keys, its command or handler, and its plain values (concurrency,
    timeout, schema names, cwd, env); ConfigError naming the first problem."""
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
            raise ConfigError(f"{where} {name} = {brief(table[name])} must be a string")
    for name in ("input_schema", "output_schema"):
        schema = table.get(name)
        if schema is None:
            continue
        # the rule the schema cache looks a name up by, checked here rather than failing every
        # handoff to the specialist (imported only for a schema named: a one-shot command that
        # reads the configuration need not load the validation module)
        from .validation import plain_name
        if not schema or "\0" in schema or not plain_name(schema):
            raise ConfigError(f"{where} {name} = {brief(schema)} must be a plain file name in "
                              "schemas/ or a built-in schema's (no folder, not hidden, not empty)")
    cwd = table.get("cwd")
    if cwd:  # ("" is the workspace itself, as the runner reads it)
        _check_cwd(cwd, where, root)
    env = table.get("env")
    if env is not None and (not isinstance(env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and "\0" not in k
            and isinstance(v, str) and "\0" not in v for k, v in env.items())):
        raise ConfigError(f"{where} env must be a table of NAME = \"text\" (strings, no NUL)")


def _check_cwd(cwd: str, where: str, root: Path | None) -> None:
    """A specialist's ``cwd`` by the runner's rule (core.runner.run_command): the workspace
    ``root`` joined with it and resolved must be ``root`` or a folder inside it. Without a
    root, a relative ``cwd`` that ``..`` takes out of any workspace is refused (an absolute one
    is left to the runner)."""
    problem = f"{where} cwd = {brief(cwd)} must be a folder inside the workspace"
    if "\0" in cwd:
        raise ConfigError(f"{where} cwd = {brief(cwd)} must not hold a NUL")
    if root is None:
        if not posixpath.isabs(cwd) and posixpath.normpath(cwd).split("/")[0] == "..":
            raise ConfigError(problem)
        return
    try:
        resolved = (root / cwd).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # (RuntimeError: a symlink loop)
        raise ConfigError(f"{where} cwd = {brief(cwd)} cannot be resolved: {exc}") from None
    if resolved != root and root not in resolved.parents:
        raise ConfigError(problem)


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
        if rule.url is not None and not http_url(rule.url):
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
    if "connect_timeout_seconds" in table:
        settings.connect_timeout_seconds = float(bounded(
            table["connect_timeout_seconds"], f"{path}: [store] connect_timeout_seconds",
            MIN_CONNECT_SECONDS, MAX_CONNECT_SECONDS, unit=" seconds"))
    return settings
