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

Namespaces are compared case-insensitively (``TASK/x`` is in ``task/``), and a key is only ever
a plain relative name: ``/task/x``, ``./task/x``, ``task//x``, `` task/x`` with inner whitespace,
non-ASCII look-alikes and line breaks are refused, and a write that would go through a symlink
(``context/alias -> task``) is refused, so no spelling reaches a protected namespace's files.
``[namespaces]`` / ``[tiers]`` come from :func:`handoffd.core.config.load_config` (validated once, at
daemon start; a bad table is a ConfigError, exit 2).

Writes are atomic (temp file + rename in the same folder) and serialised per key with a file lock;
every write is appended to ``context/.history.jsonl`` with who, when, the key, its size, sha256 and
the new revision.

**Revisions.** The value file stays the plain JSON value (seed 001 tools read and write it
directly). Each key's revision is kept beside it in ``context/.meta/rev-<hash>.json`` as
``{"key", "revision", "sha256"}``: 0 while the key is unset, 1 for a value written before
revisions existed (or by a foreign tool, with no record), and +1 for every write. The record
describes the bytes it was written with, so a value changed behind handoffd's back (its sha256
differs) counts as one revision more than the record. Compare-and-set: ``set(...,
if_revision=N)`` writes only if the key is still at revision N (``ContextConflict`` otherwise; N = 0
means "only if unset"); ``update(key, func)`` is an atomic read-modify-write under the key's lock.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..backends.files import fsio
from ..core.documents import actor
from ..core.errors import ErrorCode, HandlerError, HandoffdError, InvalidDocument
from ..core.keys import (
    normalise_key,  # the key rule is the core's (config checks [namespaces] with it)
)
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace

TIERS = ("PROGRESS_MONITOR", "ABSTRACT_ARCHITECT", "ROUTING_DISPATCHER", "SPECIALIZED_FLEET")
DEFAULT_NAMESPACES: dict[str, list[str]] = {
    "task": ["ABSTRACT_ARCHITECT"],
    "routing": ["ROUTING_DISPATCHER"],
    "execution": ["SPECIALIZED_FLEET"],
    "system": ["PROGRESS_MONITOR"],
    "history": ["PROGRESS_MONITOR"],
}
MAX_VALUE_BYTES = 4 * 1024 * 1024
HISTORY = ".history.jsonl"
LOCK_TIMEOUT_SECONDS = 30.0
#: internal: "the key is unset" while a write computes its value
MISSING: Any = object()


class ContextConflict(HandoffdError):
    """A compare-and-set write found the key at another revision than the caller expected."""

    exit_code = 1

    def __init__(self, key: str, expected: int, actual: int) -> None:
        super().__init__(
            f"conflict: context key {key!r} is at revision {actual}, not {expected}; nothing was "
            "written (read it again with `handoff context get --with-revision` and retry)")
        self.code = ErrorCode.CONTEXT_CONFLICT
        self.key = key
        self.expected = expected
        self.actual = actual


class ContextPermissionError(HandlerError):
    """An agent tried to write a context key outside the namespaces it may write."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.CONTEXT_PERMISSION_DENIED, retryable=False)


@dataclass
class Permissions:
    """Namespace → writers, and agent → tier, from handoffd.toml."""

    namespaces: dict[str, list[str]]
    tiers: dict[str, str]
    default: list[str] | None = None

    @classmethod
    def load(cls, ws: Workspace) -> "Permissions":
        """Defaults overlaid with ``[namespaces]`` and ``[tiers]`` of the workspace's handoffd.toml,
        as validated by :func:`handoffd.core.config.load_config` (ConfigError, exit 2, when bad)."""
        return cls.from_config(ws.load_config())

    @classmethod
    def from_config(cls, config: Any) -> "Permissions":
        """From a parsed :class:`handoffd.core.config.Config` (its names are already lower case)."""
        namespaces = {k: list(v) for k, v in DEFAULT_NAMESPACES.items()}
        default: list[str] | None = None
        for name, writers in (config.namespaces or {}).items():
            if name == "*":
                default = list(writers)
            else:
                namespaces[_fold(name)] = list(writers)
        return cls(namespaces, dict(config.tiers or {}), default)

    def namespace_of(self, key: str) -> str | None:
        """The configured namespace a key falls in (longest matching prefix, compared
        case-insensitively: ``TASK/x`` is in ``task/``), or None."""
        best = None
        key = _fold(key)
        for name in self.namespaces:
            folded = _fold(name)
            if key == folded or key.startswith(folded + "/"):
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
        if not isinstance(agent, str) or not agent.strip():
            return False
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
                                  code=ErrorCode.INVALID_CONTEXT_KEY)
        return path

    def _write_path(self, key: str) -> Path:
        """``path(key)`` for a write: also refused when a symlink inside ``context/`` would send
        it to another key's file (``context/alias -> task`` must not let ``alias/x`` write
        ``task/x`` past the namespace check)."""
        path = self.path(key)
        base = self.root.resolve()
        resolved = path.resolve()
        rel = resolved.relative_to(base).as_posix()
        if rel.casefold() != f"{key}.json".casefold():
            raise InvalidDocument(f"context key {key!r} resolves to context/{rel} through a symlink; "
                                  "refused", code=ErrorCode.INVALID_CONTEXT_KEY)
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
        return self._decode(normalise_key(key), data)

    def _rev_record(self, key: str) -> dict[str, Any] | None:
        try:
            data = (self.root / ".meta" / _rev_name(key)).read_bytes()
            record = json.loads(data.decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if (isinstance(record, dict) and record.get("key") == key
                and isinstance(record.get("revision"), int) and not isinstance(record["revision"], bool)
                and record["revision"] >= 0 and isinstance(record.get("sha256"), str)):
            return record
        return None

    def _read_current(self, key: str) -> tuple[bytes | None, int]:
        """(the value's bytes or None when unset, its revision). The revision record is read
        first: if a write lands in between, the bytes no longer match it and the result is one
        more than the record, which is never older than the bytes (a stale pair can only cause a
        spurious conflict, never a lost update)."""
        record = self._rev_record(key)
        try:
            data, _ = fsio.read_bytes_safely(self.path(key), MAX_VALUE_BYTES)
        except FileNotFoundError:
            return None, 0
        if record is None:
            return data, 1  # written before revisions existed, or by a foreign tool
        if hashlib.sha256(data).hexdigest() == record["sha256"]:
            return data, max(int(record["revision"]), 1)
        return data, int(record["revision"]) + 1  # changed behind the record's back

    def _decode(self, key: str, data: bytes) -> Any:
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise InvalidDocument(f"context/{key}.json is not valid JSON",
                                  code=ErrorCode.MALFORMED_JSON) from None

    def get_with_revision(self, key: str) -> tuple[Any, int]:
        """(value, revision) of ``key``, read consistently; KeyError if it is not set. Pass the
        revision to ``set(..., if_revision=)`` for a compare-and-set."""
        key = normalise_key(key)
        data, revision = self._read_current(key)
        if data is None:
            raise KeyError(key)
        return self._decode(key, data), revision

    def revision(self, key: str) -> int:
        """The revision of ``key`` (0 when it is not set)."""
        return self._read_current(normalise_key(key))[1]

    def keys(self, prefix: str = "") -> list[str]:
        """Every key (sorted), optionally only those starting with ``prefix``."""
        prefix = prefix.strip().removeprefix("beads:")
        out: list[str] = []
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
                         "sha256": info.get("sha256"), "revision": self.revision(key)})
        return rows

    # ------------------------------------------------------------ writing
    def set(self, key: str, value: Any, *, agent: str, handoff_id: str | None = None,
            if_revision: int | None = None) -> dict[str, Any]:
        """Write ``value`` (any JSON value) as ``agent``; returns the history record (with the new
        ``revision``).

        ``if_revision=N``: write only if the key is still at revision N (0: only if unset), else
        raise ContextConflict and write nothing. ContextPermissionError when ``agent`` may not
        write that namespace."""
        if if_revision is not None and (not isinstance(if_revision, int) or isinstance(if_revision, bool)
                                        or if_revision < 0):
            raise InvalidDocument(f"if_revision must be a revision number >= 0, not {if_revision!r}",
                                  code=ErrorCode.INVALID_CONTEXT_REVISION)

        def check(_current: Any, revision: int) -> Any:
            if if_revision is not None and revision != if_revision:
                raise ContextConflict(key, if_revision, revision)
            return value

        key = normalise_key(key)
        return self._write(key, check, agent=agent, handoff_id=handoff_id, decode=False)

    def update(self, key: str, func: Callable[[Any], Any], *, agent: str,
               handoff_id: str | None = None, default: Any = None) -> dict[str, Any]:
        """Atomic read-modify-write: under the key's lock, write ``func(current value)`` and bump
        the revision; returns the history record (``value`` holds the new value). ``func`` gets
        ``default`` when the key is unset (None unless given) and must be quick:
        it runs while every other writer of that key waits. An exception from ``func`` writes
        nothing and propagates."""
        key = normalise_key(key)
        entry = self._write(key, lambda current, _rev: func(default if current is MISSING else current),
                            agent=agent, handoff_id=handoff_id, decode=True)
        return entry

    def _write(self, key: str, compute: Callable[[Any, int], Any], *, agent: str,
               handoff_id: str | None, decode: bool) -> dict[str, Any]:
        """The one write path: permission check, then under the key's lock read the current
        value and revision, ``compute(current, revision)`` the new value, write it and its
        revision record, append to the history."""
        self.permissions.check(agent, key)
        path = self._write_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / ".tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock  # imported where a lock is taken
        with FileLock(str(self._meta(_lock_name(key))), timeout=LOCK_TIMEOUT_SECONDS):
            old, revision = self._read_current(key)
            current: Any = MISSING
            if decode and old is not None:
                current = self._decode(key, old)
            value = compute(current, revision)
            data = _encode(key, value)
            digest = hashlib.sha256(data).hexdigest()
            entry: dict[str, Any] = {"at": iso(utc_now()), "key": key, "by": agent,
                                     "bytes": len(data), "sha256": digest, "actor": actor(),
                                     "revision": revision + 1,
                                     "previous_sha256": hashlib.sha256(old).hexdigest() if old is not None else None}
            if handoff_id:
                entry["handoff_id"] = handoff_id
            record = (json.dumps({"key": key, "revision": revision + 1, "sha256": digest}) + "\n").encode()
            # the value first, then its record: a crash in between leaves bytes that do not match
            # the record, which reads as record + 1, the revision this write was giving them
            fsio.replace(path, data, tmp, durable=self.durable)
            fsio.replace(self._meta(_rev_name(key)), record, tmp, durable=self.durable)
            self._append_history(entry)
        if decode:
            entry = dict(entry, value=value)
        return entry

    def _append_history(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        from filelock import FileLock
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


def _encode(key: str, value: Any) -> bytes:
    try:
        data = (json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidDocument(f"context value for {key!r} is not JSON-serialisable: {exc}",
                              code=ErrorCode.INVALID_CONTEXT_VALUE) from None
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidDocument(f"context value for {key!r} is {len(data)} bytes, over the "
                              f"{MAX_VALUE_BYTES}-byte limit", code=ErrorCode.INVALID_CONTEXT_VALUE)
    return data


def _rev_name(key: str) -> str:
    return "rev-" + hashlib.sha256(key.encode()).hexdigest()[:24] + ".json"


def _fold(name: str) -> str:
    """A namespace or key as namespaces compare it: no outer whitespace or slashes, case-folded."""
    return str(name).strip().strip("/").casefold()



class ContextView:
    """Shared context bound to one agent: reads anything, writes only where it may.

    ``get(key, default=None)``, ``get_with_revision(key)``, ``set(key, value, if_revision=None)``,
    ``update(key, func, default=None)``, ``keys(prefix="")``, ``may_write(key)``."""

    def __init__(self, store: ContextStore, agent: str, handoff_id: str | None = None) -> None:
        self.store = store
        self.agent = agent
        self.handoff_id = handoff_id

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.store.get(key)
        except KeyError:
            return default

    def set(self, key: str, value: Any, *, if_revision: int | None = None) -> dict[str, Any]:
        return self.store.set(key, value, agent=self.agent, handoff_id=self.handoff_id,
                              if_revision=if_revision)

    def update(self, key: str, func: Callable[[Any], Any], *, default: Any = None) -> dict[str, Any]:
        """Atomic read-modify-write (see ContextStore.update)."""
        return self.store.update(key, func, agent=self.agent, handoff_id=self.handoff_id,
                                 default=default)

    def get_with_revision(self, key: str) -> tuple[Any, int]:
        return self.store.get_with_revision(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.store.keys(prefix)

    def may_write(self, key: str) -> bool:
        return self.store.permissions.may_write(self.agent, normalise_key(key))

    def __repr__(self) -> str:
        return f"ContextView(agent={self.agent!r}, root={str(self.store.root)!r})"


def view_for(root: Path, agent: str, handoff_id: str | None = None) -> ContextView:
    """A ContextView for a handler running in the workspace at ``root``."""
    return ContextStore(Workspace(Path(root))).view(agent, handoff_id)
