"""Shared context (seed 001's ``context/`` folder, seed 000's Beads state) with write permissions.

A key is a safe relative name such as ``task/current-objective`` or ``project-context``; its value
is the JSON document ``context/<key>.json`` (so seed 001's ``context/project-context.json`` is the
key ``project-context``). A ``beads:`` prefix is accepted and dropped. Everyone reads; writes are
scoped by namespace (the first path segment), as in seed 000's table:

============  =====================  ===========================
namespace     default writers        (seed 000 tier)
============  =====================  ===========================
task/         ABSTRACT_ARCHITECT     Architect
routing/      ROUTING_DISPATCHER     Dispatcher
execution/    SPECIALIZED_FLEET      Fleet
system/       PROGRESS_MONITOR       Progress Monitor
history/      PROGRESS_MONITOR       Progress Monitor
============  =====================  ===========================

``handoffd.toml`` changes or adds namespaces and says which agent belongs to which tier::

    [namespaces."task"]
    writers = ["@architect", "ABSTRACT_ARCHITECT"]   # agent ids, tier names, or "*"

    [tiers]
    "@architect" = "ABSTRACT_ARCHITECT"

A writer entry matches an agent id, the agent's tier (from ``[tiers]``, or the agent id itself
when it is a tier name, as hi_moe routes by tier), or ``*``. Keys outside every configured
namespace are open to all writers unless ``[namespaces."*"] writers = [...]`` sets a default.

Writes are atomic (temp file + rename in the same folder) and serialised per key with a file lock;
every write is appended to ``context/.history.jsonl`` with who, when, the key, its size and sha256.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from . import fsio
from .documents import actor
from .errors import HandlerError, HandoffdError, InvalidDocument
from .timeutil import iso, utc_now
from .workspace import Workspace

TIERS = ("PROGRESS_MONITOR", "ABSTRACT_ARCHITECT", "ROUTING_DISPATCHER", "SPECIALIZED_FLEET")
DEFAULT_NAMESPACES: dict[str, list[str]] = {
    "task": ["ABSTRACT_ARCHITECT"],
    "routing": ["ROUTING_DISPATCHER"],
    "execution": ["SPECIALIZED_FLEET"],
    "system": ["PROGRESS_MONITOR"],
    "history": ["PROGRESS_MONITOR"],
}
SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+=-]{0,127}$")
MAX_KEY = 512
MAX_VALUE_BYTES = 4 * 1024 * 1024
HISTORY = ".history.jsonl"
LOCK_TIMEOUT_SECONDS = 30.0


class ContextPermissionError(HandlerError):
    """An agent tried to write a context key outside the namespaces it may write."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message, code="CONTEXT_PERMISSION_DENIED", retryable=False)


def normalise_key(key: object) -> str:
    """``key`` as a safe relative name (``beads:`` and ``.json`` dropped); InvalidDocument if it is
    empty, absolute, has ``..`` or unsafe characters, or would otherwise leave ``context/``."""
    if not isinstance(key, str):
        raise InvalidDocument(f"context key {key!r} must be a string", code="INVALID_CONTEXT_KEY")
    text = key.strip()
    if text.startswith("beads:"):
        text = text[len("beads:"):]
    if text.endswith(".json"):
        text = text[:-5]
    parts = text.split("/")
    if (not text or len(text) > MAX_KEY or text.startswith("/") or "\\" in text
            or any(p in ("", ".", "..") or not SEGMENT.match(p) or p.endswith(".tmp") for p in parts)):
        raise InvalidDocument(
            f"context key {key!r} is not a safe relative name: use segments of letters, digits and "
            "._@+=- separated by '/', e.g. task/current-objective (no '..', no leading '/')",
            code="INVALID_CONTEXT_KEY")
    return text


@dataclass
class Permissions:
    """Namespace → writers, and agent → tier, from handoffd.toml."""

    namespaces: dict[str, list[str]]
    tiers: dict[str, str]
    default: list[str] | None = None

    @classmethod
    def load(cls, ws: Workspace) -> "Permissions":
        """Defaults overlaid with ``[namespaces]`` and ``[tiers]`` of the workspace's handoffd.toml."""
        try:
            table = tomllib.loads(ws.config_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            table = {}
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise HandoffdError(f"{ws.config_path}: {exc}") from None
        raw_namespaces = table.get("namespaces") or {}
        raw_tiers = table.get("tiers") or {}
        namespaces = {k: list(v) for k, v in DEFAULT_NAMESPACES.items()}
        default: list[str] | None = None
        for name, spec in (raw_namespaces or {}).items():
            writers = spec.get("writers") if isinstance(spec, dict) else spec
            if not isinstance(writers, list) or not all(isinstance(w, str) for w in writers):
                raise HandoffdError(f"handoffd.toml: [namespaces.\"{name}\"] writers must be a list "
                                    "of agent ids or tier names")
            if name == "*":
                default = list(writers)
            else:
                namespaces[str(name).strip("/")] = list(writers)
        tiers = {str(k): str(v) for k, v in (raw_tiers or {}).items() if isinstance(v, (str, int))}
        return cls(namespaces, tiers, default)

    def namespace_of(self, key: str) -> str | None:
        """The configured namespace a key falls in (longest matching prefix), or None."""
        best = None
        for name in self.namespaces:
            if key == name or key.startswith(name + "/"):
                if best is None or len(name) > len(best):
                    best = name
        return best

    def writers_for(self, key: str) -> list[str] | None:
        """Who may write ``key`` (None: anyone)."""
        name = self.namespace_of(key)
        if name is None:
            return self.default
        return self.namespaces[name]

    def tier_of(self, agent: str) -> str | None:
        if agent in TIERS:
            return agent
        tier = self.tiers.get(agent)
        if tier is None:
            return None
        if tier.isdigit():
            return {4: "PROGRESS_MONITOR", 3: "ABSTRACT_ARCHITECT", 2: "ROUTING_DISPATCHER",
                    1: "SPECIALIZED_FLEET"}.get(int(tier))
        return tier

    def may_write(self, agent: str, key: str) -> bool:
        writers = self.writers_for(key)
        if writers is None or "*" in writers:
            return True
        tier = self.tier_of(agent)
        return agent in writers or (tier is not None and tier in writers)

    def check(self, agent: str, key: str) -> None:
        """Raise ContextPermissionError unless ``agent`` may write ``key``."""
        if self.may_write(agent, key):
            return
        name = self.namespace_of(key) or "*"
        writers = self.writers_for(key) or []
        tier = self.tier_of(agent)
        allowed = sorted(n + "/" for n in self.namespaces if self.may_write(agent, n + "/x"))
        raise ContextPermissionError(
            f"{agent}{f' (tier {tier})' if tier else ''} may not write context key {key!r}: "
            f"namespace {name}/ is written only by {', '.join(writers) or 'nobody'}"
            + (f"; {agent} may write {', '.join(allowed)}" if allowed else "")
            + f" (change [namespaces.\"{name}\"] writers in handoffd.toml)")


class ContextStore:
    """The ``context/`` folder of one workspace."""

    def __init__(self, ws: Workspace, permissions: Permissions | None = None, *,
                 durable: bool = True) -> None:
        self.ws = ws
        self.root = ws.context
        self.permissions = permissions or Permissions.load(ws)
        self.durable = durable

    # ------------------------------------------------------------ paths
    def path(self, key: str) -> Path:
        """The file holding ``key`` (never outside ``context/``)."""
        key = normalise_key(key)
        path = self.root / f"{key}.json"
        base = self.root.resolve()
        resolved = path.resolve()
        if base not in resolved.parents:
            raise InvalidDocument(f"context key {key!r} resolves outside {self.root} (a symlink?)",
                                  code="INVALID_CONTEXT_KEY")
        return path

    def _meta(self, name: str) -> Path:
        folder = self.root / ".meta"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / name

    # ------------------------------------------------------------ reading
    def get(self, key: str) -> Any:
        """The value of ``key``; KeyError if it is not set."""
        path = self.path(key)
        try:
            data, _ = fsio.read_bytes_safely(path, MAX_VALUE_BYTES)
        except FileNotFoundError:
            raise KeyError(normalise_key(key)) from None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise InvalidDocument(f"context/{normalise_key(key)}.json is not valid JSON",
                                  code="MALFORMED_JSON") from None

    def keys(self, prefix: str = "") -> list[str]:
        """Every key (sorted), optionally only those starting with ``prefix``."""
        prefix = prefix.strip().removeprefix("beads:")
        out = []
        if not self.root.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                key = name[:-5] if rel_dir == "." else f"{rel_dir}/{name[:-5]}"
                key = key.replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def history(self, key: str | None = None) -> list[dict[str, Any]]:
        """Write records, oldest first (only those for ``key`` when given)."""
        path = self.root / HISTORY
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        wanted = normalise_key(key) if key is not None else None
        out = []
        for line in lines:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and (wanted is None or item.get("key") == wanted):
                out.append(item)
        return out

    def listing(self, prefix: str = "") -> list[dict[str, Any]]:
        """``handoff context ls`` rows: key, size, sha256, last writer and time."""
        last: dict[str, dict[str, Any]] = {}
        for item in self.history():
            last[str(item.get("key"))] = item
        rows = []
        for key in self.keys(prefix):
            try:
                size = self.path(key).stat().st_size
            except (OSError, InvalidDocument):
                continue
            info = last.get(key, {})
            rows.append({"key": key, "bytes": size, "namespace": self.permissions.namespace_of(key),
                         "written_by": info.get("by"), "written_at": info.get("at"),
                         "sha256": info.get("sha256")})
        return rows

    # ------------------------------------------------------------ writing
    def set(self, key: str, value: Any, *, agent: str, handoff_id: str | None = None) -> dict[str, Any]:
        """Write ``value`` (any JSON value) as ``agent``; returns the history record.

        ContextPermissionError when ``agent`` may not write that namespace."""
        key = normalise_key(key)
        self.permissions.check(agent, key)
        try:
            data = (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise InvalidDocument(f"context value for {key!r} is not JSON-serialisable: {exc}",
                                  code="INVALID_CONTEXT_VALUE") from None
        if len(data) > MAX_VALUE_BYTES:
            raise InvalidDocument(f"context value for {key!r} is {len(data)} bytes, over the "
                                  f"{MAX_VALUE_BYTES}-byte limit", code="INVALID_CONTEXT_VALUE")
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / ".tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()
        now = utc_now()
        entry: dict[str, Any] = {"at": iso(now), "key": key, "by": agent, "bytes": len(data),
                                 "sha256": digest, "actor": actor()}
        if handoff_id:
            entry["handoff_id"] = handoff_id
        with FileLock(str(self._meta(_lock_name(key))), timeout=LOCK_TIMEOUT_SECONDS):
            try:
                entry["previous_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:
                entry["previous_sha256"] = None
            fsio.replace(path, data, tmp, durable=self.durable)
            self._append_history(entry)
        return entry

    def _append_history(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        with FileLock(str(self._meta("history.lock")), timeout=LOCK_TIMEOUT_SECONDS):
            fd = os.open(self.root / HISTORY, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def view(self, agent: str, handoff_id: str | None = None) -> "ContextView":
        """This store seen by one agent (what Python handlers get as ``ctx.context``)."""
        return ContextView(self, agent, handoff_id)


def _lock_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24] + ".lock"


class ContextView:
    """Shared context bound to one agent: reads anything, writes only where it may.

    ``get(key, default=None)``, ``set(key, value)``, ``keys(prefix="")``, ``may_write(key)``."""

    def __init__(self, store: ContextStore, agent: str, handoff_id: str | None = None) -> None:
        self.store = store
        self.agent = agent
        self.handoff_id = handoff_id

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.store.get(key)
        except KeyError:
            return default

    def set(self, key: str, value: Any) -> dict[str, Any]:
        return self.store.set(key, value, agent=self.agent, handoff_id=self.handoff_id)

    def keys(self, prefix: str = "") -> list[str]:
        return self.store.keys(prefix)

    def may_write(self, key: str) -> bool:
        return self.store.permissions.may_write(self.agent, normalise_key(key))

    def __repr__(self) -> str:
        return f"ContextView(agent={self.agent!r}, root={str(self.store.root)!r})"


def view_for(root: Path, agent: str, handoff_id: str | None = None) -> ContextView:
    """A ContextView for a handler running in the workspace at ``root``."""
    return ContextStore(Workspace(Path(root))).view(agent, handoff_id)
