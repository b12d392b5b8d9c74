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
non-ASCII look-alikes and line breaks are refused, and a write or a read that would go through a
symlink (``context/alias -> task``), even one swapped in meanwhile, is refused, so no spelling
reaches a protected namespace's files. A key's last segment never ends in ``.json`` once the one
``.json`` of its spelling is dropped (``a.json.json`` is refused): key and file are one-to-one,
and a listing shows only files a key names.
``[namespaces]`` / ``[tiers]`` come from :func:`handoffd.core.config.load_config` (validated once, at
daemon start; a bad table is a ConfigError, exit 2).

Where the values live is a storage seam, :class:`~handoffd.core.storage.ContextBackend`: the
workspace's ``context/`` folder (:mod:`handoffd.backends.files.context`: ``context/<key>.json``,
revision records in ``context/.meta/``, ``context/.history.jsonl``), or on a PostgreSQL store the
database every host shares (:mod:`handoffd.backends.postgres.context`), which each daemon then
mirrors into its ``context/`` folder (:mod:`handoffd.features.context_mirror`).
:func:`handoffd.features.stores.context_backend` picks one. Permissions and the key rule are
checked here, above the seam, the same on every store. Every write is one atomic step of the
store (serialised per key) that also appends its history entry: who, when, the key, its size,
sha256 and the new revision.

**Revisions.** Each key has one: 0 while the key is unset and +1 for every write (on files, a
value written before revisions existed, or changed by a foreign tool, counts as one more, see
the files module). Compare-and-set: ``set(..., if_revision=N)`` writes only if the key is still
at revision N (``ContextConflict`` otherwise; N = 0 means "only if unset"); ``update(key,
func)`` is an atomic read-modify-write under the key's lock.
"""
from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..backends.files.context import HISTORY_LINE, FileContext
from ..backends.files.contextfs import MAX_VALUE_BYTES
from ..core.documents import actor, nesting_depth
from ..core.errors import ErrorCode, HandlerError, HandoffdError, InvalidDocument
from ..core.hashing import sha256_hex
from ..core.jsontext import load_json
from ..core.keys import (
    normalise_key,  # the key rule is the core's (config checks [namespaces] with it)
)
from ..core.storage import HISTORY_LIMIT, ContextBackend
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace

# `handoff context history --limit N`: the most records one read keeps (each at most
# backends.files.context.HISTORY_LINE long)
MAX_HISTORY_LIMIT = 10_000

# A context value is not a document (it may nest deeper than MAX_DEPTH) but is still bounded:
# well within Python's recursion limit, and the same when written and when read back.
MAX_VALUE_DEPTH = 256

TIERS = ("PROGRESS_MONITOR", "ABSTRACT_ARCHITECT", "ROUTING_DISPATCHER", "SPECIALIZED_FLEET")
DEFAULT_NAMESPACES: dict[str, list[str]] = {
    "task": ["ABSTRACT_ARCHITECT"],
    "routing": ["ROUTING_DISPATCHER"],
    "execution": ["SPECIALIZED_FLEET"],
    "system": ["PROGRESS_MONITOR"],
    "history": ["PROGRESS_MONITOR"],
}
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
    """The shared context of one workspace: its ``context/`` folder, or the store's shared
    context (``backend``: any :class:`~handoffd.core.storage.ContextBackend`; see
    :func:`handoffd.features.stores.context_backend`). Permissions are checked here, above the
    seam, the same for every store."""

    def __init__(self, ws: Workspace, permissions: Permissions | None = None, *,
                 durable: bool = True, backend: ContextBackend | None = None) -> None:
        self.ws = ws
        self.root = ws.context
        self.permissions = permissions or Permissions.load(ws)
        self.durable = durable
        self.backend: ContextBackend = backend or FileContext(self.root, durable=durable)

    def path(self, key: str) -> Path:
        """The file of ``key`` in this workspace's ``context/`` (a mirror's copy on a shared
        store; never outside ``context/``)."""
        return FileContext(self.root).path(normalise_key(key))

    # ------------------------------------------------------------ reading
    def get(self, key: str) -> Any:
        """The value of ``key``; KeyError if it is not set."""
        return self.get_with_revision(key)[0]

    def _decode(self, key: str, data: bytes) -> Any:
        """A value as any tool may have written it: held to what a document may hold (finite
        numbers, bounded nesting, no lone surrogate), one line with a code otherwise."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidDocument(f"context/{key}.json is not UTF-8 (byte {exc.start})",
                                  code=ErrorCode.NOT_UTF8) from None
        return load_json(text, f"context/{key}.json", max_depth=MAX_VALUE_DEPTH)

    def get_with_revision(self, key: str) -> tuple[Any, int]:
        """(value, revision) of ``key``, read consistently; KeyError if it is not set. Pass the
        revision to ``set(..., if_revision=)`` for a compare-and-set."""
        key = normalise_key(key)
        try:
            data, revision = self.backend.read(key)
        except NotADirectoryError:  # a folder on its path is another key's file: x.json/y after x
            raise KeyError(key) from None
        if data is None:
            raise KeyError(key)
        return self._decode(key, data), revision

    def revision(self, key: str) -> int:
        """The revision of ``key`` (0 when it is not set)."""
        return self.backend.read(normalise_key(key))[1]

    def keys(self, prefix: str = "") -> list[str]:
        """Every key (sorted), optionally only those starting with ``prefix``."""
        return self.backend.keys(prefix.strip().removeprefix("beads:"))

    def history(self, key: str | None = None, *,
                limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        """The newest ``limit`` write records (0..MAX_HISTORY_LIMIT), oldest first (only those
        for ``key`` when given). No more than those are held, however long the history."""
        return self.history_window(key, limit=limit)[0]

    def history_window(self, key: str | None = None, *,
                       limit: int = HISTORY_LIMIT) -> tuple[list[dict[str, Any]], bool]:
        """(:meth:`history`, whether older records were left out): one more is asked of the
        store than is given, so that a listing can say so without counting the rest."""
        if (isinstance(limit, bool) or not isinstance(limit, int)
                or not 0 <= limit <= MAX_HISTORY_LIMIT):
            raise ValueError(f"limit must be a whole number 0..{MAX_HISTORY_LIMIT}, not {limit!r}")
        items = self.backend.history(normalise_key(key) if key is not None else None,
                                     limit=limit + 1)
        return items[len(items) - limit:] if limit else [], len(items) > limit

    def listing(self, prefix: str = "") -> list[dict[str, Any]]:
        """``handoff context ls`` rows: key, size, sha256, last writer and time (the newest
        record of each key listed, found in one pass: the whole history was held for it)."""
        keys = self.keys(prefix)
        last = self.backend.latest(keys)
        rows = []
        for key in keys:
            try:
                data, revision = self.backend.read(key)
            except (OSError, InvalidDocument):
                continue
            if data is None:
                continue
            info = last.get(key, {})
            rows.append({"key": key, "bytes": len(data), "namespace": self.permissions.namespace_of(key),
                         "written_by": info.get("by"), "written_at": info.get("at"),
                         "sha256": info.get("sha256"), "revision": revision})
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
        """The one write path: the permission check, then the backend's atomic write, in which
        ``compute(current, revision)`` gives the new value and its history record is made."""
        self.permissions.check(agent, key)
        self._refuse_clash(key)
        written: list[Any] = []

        def change(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
            current: Any = MISSING
            if decode and old is not None:
                current = self._decode(key, old)
            value = compute(current, revision)
            data = _encode(key, value)
            entry: dict[str, Any] = {"at": iso(utc_now()), "key": key, "by": agent,
                                     "bytes": len(data), "sha256": sha256_hex(data),
                                     "actor": actor(), "revision": revision + 1,
                                     "previous_sha256": sha256_hex(old) if old is not None else None}
            if handoff_id:
                entry["handoff_id"] = handoff_id
            _check_entry(key, entry)
            written[:] = [value]
            return data, entry

        try:
            entry = self.backend.write(key, change)
        except (NotADirectoryError, IsADirectoryError):  # (a clash that appeared meanwhile)
            raise _clash(key, "its file's path is taken by another key's file or folder") from None
        if decode:
            entry = dict(entry, value=written[0])
        return entry

    def _refuse_clash(self, key: str) -> None:
        """INVALID_CONTEXT_KEY when ``key``'s file cannot exist beside the others: a folder on
        its path is another key's file (``x.json/y`` once ``x`` is set), or its file is the
        folder of other keys (``x`` once ``x.json/y`` is set). Such a write failed deep in the
        store with a bare OSError: a traceback over MCP, no code on the command line."""
        parts = key.split("/")
        for end in range(1, len(parts)):
            folder = "/".join(parts[:end])
            if folder.endswith(".json") and self._is_set(folder[:-len(".json")]):
                raise _clash(key, f"context/{folder} is the file of the key "
                                  f"{folder[:-len('.json')]!r}")
        if self._is_folder(key):
            raise _clash(key, f"context/{key}.json is a folder of other keys")

    def _is_folder(self, key: str) -> bool:
        """``context/<key>.json`` is a folder, looked at by descriptors (never a path that a
        symlink swapped in meanwhile could send elsewhere: that made the check itself fail)."""
        try:
            return stat.S_ISDIR(FileContext(self.root).stat(key).st_mode)
        except (OSError, InvalidDocument):  # missing, or refused by the write on its own terms
            return False

    def _is_set(self, key: str) -> bool:
        try:
            return self.backend.read(key)[0] is not None
        except (OSError, HandoffdError):  # unreadable: the write meets it on its own terms
            return False

    def view(self, agent: str, handoff_id: str | None = None) -> "ContextView":
        """This store seen by one agent (what Python handlers get as ``ctx.context``)."""
        return ContextView(self, agent, handoff_id)


def _clash(key: str, why: str) -> InvalidDocument:
    return InvalidDocument(f"context key {key!r} cannot be written: {why}; choose another key",
                           code=ErrorCode.INVALID_CONTEXT_KEY)


def _check_entry(key: str, entry: dict[str, Any]) -> None:
    """INVALID_CONTEXT_VALUE when ``entry`` is longer than a history read takes (HISTORY_LINE:
    only a writer id thousands of characters long makes it so): on every store such a record
    is skipped as it is read, so the write is refused rather than left with no history."""
    size = len(json.dumps(entry, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > HISTORY_LINE:
        raise InvalidDocument(f"context key {key!r} not written: its history record would be "
                              f"{size:,} bytes, over {HISTORY_LINE:,} (a writer id that long?)",
                              code=ErrorCode.INVALID_CONTEXT_VALUE)


def _encode(key: str, value: Any) -> bytes:
    # a value nested past what any reader accepts could be written but never read back
    if nesting_depth(value, MAX_VALUE_DEPTH) > MAX_VALUE_DEPTH:
        raise InvalidDocument(f"context value for {key!r} nests more than {MAX_VALUE_DEPTH} levels "
                              "deep; flatten it", code=ErrorCode.INVALID_CONTEXT_VALUE)
    try:
        data = (json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidDocument(f"context value for {key!r} is not JSON-serialisable: {exc}",
                              code=ErrorCode.INVALID_CONTEXT_VALUE) from None
    if len(data) > MAX_VALUE_BYTES:
        raise InvalidDocument(f"context value for {key!r} is {len(data)} bytes, over the "
                              f"{MAX_VALUE_BYTES}-byte limit", code=ErrorCode.INVALID_CONTEXT_VALUE)
    return data


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

