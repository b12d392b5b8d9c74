"""A compact in-memory index of handoff ids and when each was seen (the seen-ids record's).

A serving daemon remembers every id it accepted for ``seen_ttl_seconds`` (an hour by default):
at a few hundred handoffs a second that is a million ids. A dict of id strings to floats cost
~0.1 KB per id, and, worse, each id and float was a small long-lived object allocated among each
handoff's short-lived ones, pinning the allocator's arenas: the daemon's RSS grew ~0.2 KB per
handoff for it. Here an id is a 64-bit keyed hash in one flat array, its time a float in a
second: 16 bytes a slot, no object per id, and memory that grows by doubling two arrays.

The hash is keyed with a random per-process key, so ids cannot be crafted to collide; two real
ids collide with probability n / 2**64 (one in 10**13 for a million ids held), and what a
collision costs is a foreign document set aside as a duplicate, never a lost one.
"""
from __future__ import annotations

import os
from array import array
from typing import Iterable

from ...core.hashing import digest64

_KEY = os.urandom(16)
MIN_SLOTS = 1024


def id_hash(handoff_id: str) -> int:
    """The keyed 64-bit hash of ``handoff_id`` (never 0: 0 marks a free slot)."""
    digest = digest64(handoff_id.encode("utf-8", "surrogatepass"), key=_KEY)
    return int.from_bytes(digest, "little") or 1


class IdIndex:
    """Ids with the time each was last seen (epoch seconds): open addressing, linear probing,
    kept at most half full. No removal one by one: the owner rebuilds it (compaction)."""

    def __init__(self, slots: int = MIN_SLOTS) -> None:
        self._keys = array("Q", bytes(8 * slots))
        self._times = array("d", bytes(8 * slots))
        self._mask = slots - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _slot(self, key: int) -> int:
        """Where ``key`` is, or the free slot where it would go."""
        keys, mask = self._keys, self._mask
        i = key & mask
        while True:
            found = keys[i]
            if found == key or found == 0:
                return i
            i = (i + 1) & mask

    def get(self, handoff_id: str) -> float | None:
        """When ``handoff_id`` was last seen, or None."""
        i = self._slot(id_hash(handoff_id))
        return self._times[i] if self._keys[i] else None

    def put(self, handoff_id: str, at: float) -> None:
        """Record ``handoff_id`` as seen at ``at`` (the later time wins)."""
        key = id_hash(handoff_id)
        i = self._slot(key)
        if self._keys[i]:
            self._times[i] = max(self._times[i], at)
            return
        self._keys[i], self._times[i] = key, at
        self._count += 1
        if 2 * self._count > len(self._keys):
            self._grow()

    def update(self, entries: Iterable[tuple[str, float]]) -> None:
        """:meth:`put` every ``(id, time)`` of ``entries``."""
        for handoff_id, at in entries:
            self.put(handoff_id, at)

    def _grow(self) -> None:
        old = zip(self._keys, self._times)
        size = 2 * len(self._keys)
        self._keys, self._times = array("Q", bytes(8 * size)), array("d", bytes(8 * size))
        self._mask = size - 1
        for key, at in old:
            if key:
                i = self._slot(key)
                self._keys[i], self._times[i] = key, at
