"""What a store keeps besides the handoffs, each an interface every backend implements (see
:mod:`.storage`, whose :class:`~.storage.Backend` hands them out): small shared records
(:class:`Records`: pauses, rate buckets), the shared context (:class:`ContextBackend`,
:class:`SharedContext`), the violations log (:class:`ViolationLog`) and the lock retention's
removals and dependency checks share (:class:`RemovalLock`).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

__all__ = ["HISTORY_LIMIT", "Change", "ContextBackend", "ContextChange", "Records",
           "RemovalLock", "SharedContext", "ViolationLog"]

# Records.update: the new value from the current one (None: absent); returning None deletes it
Change = Callable[[Any], Any]


@runtime_checkable
class Records(Protocol):
    """Small shared records beside the handoffs, by kind and key (pauses, rate-limit buckets):
    what every daemon of the store must see alike. Values are JSON."""

    def read(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind``, by key (a snapshot; {} when there is none, and for
        records the store holds but cannot use, e.g. a damaged file: a damaged record never
        raises here).

        The caller must not change the values: a backend may share them with its cache and
        with every other read (the files backend parses a file once per version and hands each
        read a shallow copy of that parse, so a read copies no record). The returned dict
        itself is the caller's. Change a record only through :meth:`update`; copy a value
        before changing it locally."""
        ...

    def update(self, kind: str, key: str, change: Change) -> Any:
        """Atomically replace the record ``kind``/``key`` with ``change(current)`` (current:
        None when absent; a None result deletes it) and return the new value. Concurrent
        updates of one record by any process are serialised. An update whose result the store
        could not keep readable (too large) raises a HandoffdError and writes nothing."""
        ...


# ContextBackend.write: the new value's JSON bytes and its history entry, from the current
# bytes (None: unset) and revision; raising writes nothing
ContextChange = Callable[[bytes | None, int], tuple[bytes, dict[str, Any]]]
# ContextBackend.history's default: how many of the newest entries a read keeps
HISTORY_LIMIT = 1000


@runtime_checkable
class ContextBackend(Protocol):
    """Where the shared context's values live (files: ``context/<key>.json``; PostgreSQL: a
    table every host shares). A value is stored as the JSON bytes it was written with, with a
    revision: 0 while the key is unset, +1 per write. Keys come normalised by the caller; who may
    write what (namespaces) is the caller's business, above this seam."""

    def read(self, key: str) -> tuple[bytes | None, int]:
        """The value's bytes (None when unset) and its revision, read consistently."""
        ...

    def write(self, key: str, change: ContextChange) -> dict[str, Any]:
        """Atomically replace ``key``'s value with the bytes ``change(current, revision)`` gives,
        at revision + 1, and append the history entry it gives (the entry is returned). Writes
        of one key by any process are serialised; an exception from ``change`` (a
        compare-and-set that found another revision) writes nothing and propagates."""
        ...

    def keys(self, prefix: str = "") -> list[str]:
        """Every key that has a value (sorted), optionally only those starting with ``prefix``."""
        ...

    def history(self, key: str | None = None, *,
                limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        """The newest ``limit`` history entries (only ``key``'s when given), oldest first; no
        more than those are ever held, however long the history."""
        ...

    def latest(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The newest history entry of each of ``keys`` that has one (``context ls``'s last
        writer), holding no more than one entry per key."""
        ...


@runtime_checkable
class SharedContext(ContextBackend, Protocol):
    """A context store several workspaces share: each host's daemon mirrors it into its own
    ``context/`` folder, fetching what changed since its last look."""

    def revisions(self) -> dict[str, int]:
        """Every key's current revision (cheap: no value is read)."""
        ...

    def read_many(self, keys: list[str]) -> dict[str, tuple[bytes, int]]:
        """The bytes and revision of each of ``keys`` that is set."""
        ...


@runtime_checkable
class ViolationLog(Protocol):
    """The contract violations log (seed 004's learning signals): one JSON object per incident,
    kept in the order appended, one log for every daemon of the store."""

    def append(self, entry: dict[str, Any]) -> None:
        """Add one entry (safe against concurrent appenders of any process or host)."""
        ...

    def read(self) -> Iterator[dict[str, Any]]:
        """Every entry, oldest first (unreadable ones are skipped), streamed: a few at a time
        are held, however long the log."""
        ...


class RemovalLock(Protocol):
    """The lock every process working one store shares for removals: retention removes
    finished handoffs only under it, and a create that names dependencies checks and stores
    under it (:mod:`handoffd.features.removal`)."""

    name: str  # how a message names it ("handoffs/.meta/retention.lock")

    def hold(self, wait: float) -> AbstractContextManager[bool]:
        """Hold the lock for the block; yields False when another process holds it past
        ``wait`` seconds (0: not waited for). Whoever waits first goes next."""
        ...

    def waited_for(self) -> bool:
        """Another process waits for the lock now (its holder lets it in between batches)."""
        ...
