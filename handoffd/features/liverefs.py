"""What live handoffs reference, remembered between retention passes.

Retention keeps what live work still needs: the parent and the dependencies of every pending or
in-progress handoff (:func:`handoffd.features.retention.protected`). Reading every live
document for that, on every pass, took seconds with tens of thousands pending, and a serving
daemon paid it at every pass. :class:`LiveRefs` remembers what each live document referenced,
keyed by the stamp its store gives it (:meth:`~handoffd.core.storage.Backend.live_stamps`; the
files store's is the identity of its files: inode, size, mtime and ctime in ns): a document
whose stamp is unchanged is not read again. The same listing also names the documents a move
holds aside (files: ``.meta/aside/``), which are live too.

An entry is believed only as far as its stamp proves the document unchanged:

- the store's stamp changes with any change of the document's copies (files: every write
  handoffd makes is a new inode, and any write, rename or ``touch`` changes the ctime, which
  nobody can set);
- a write within the same timestamp tick as the read keeps the stamp, so an entry is kept only
  when its copies last changed :data:`SETTLE_SECONDS` before the pass began (git's rule for
  "racily clean" files; a network filesystem whose server clock runs that far behind ours is
  the exception);
- the stamps of a pass are taken before any document is read, so what is remembered is never
  older than the stamp it is filed under;
- a store that gives no stamps (the plain memory store) is read on every pass, as before.

It holds the handoffs listed live in its last pass and no others, at most :data:`MAX_KEPT`.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Collection, NamedTuple

from ..core.states import State
from ..core.storage import LiveStamp

if TYPE_CHECKING:
    from ..core.engine import Engine

SETTLE_SECONDS = 2.0  # a file changed this recently may change again with the same identity
MAX_KEPT = 100_000  # entries held at most (about 0.3 KB each): memory stays flat


class Refs(NamedTuple):
    """What one live document referenced when it was read: its state, parent and dependencies
    (a named tuple: tens of thousands are made in a pass, and a frozen dataclass is slow to)."""

    state: State
    parent: str | None
    depends_on: tuple[str, ...]


class LiveRefs:
    """Per live handoff, its :class:`Refs` and the stamp of its copies when they were read. One
    pass at a time uses it (retention's lock); ``clock`` is the wall clock the stamps' times are
    compared with (injectable for tests)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._keys: dict[str, bytes] = {}
        self._refs: dict[str, Refs] = {}
        self._stamps: dict[str, LiveStamp | None] = {}  # the current pass's
        self._source = ""  # the workspace of the last pass
        self._settled_ns = 0  # copies last changed before this (ns) are settled

    def __len__(self) -> int:
        return len(self._refs)

    def start(self, engine: Engine) -> Collection[str]:
        """Begin a pass over ``engine``'s live handoffs: the ids its store stamps live (set-aside
        documents among them; none when it gives no stamps). An engine over another workspace,
        or a store without stamps, starts afresh."""
        # taken before any file is looked at: a file changed after it is never settled
        self._settled_ns = int((self.clock() - SETTLE_SECONDS) * 1e9)
        stamps = engine.backend.live_stamps()
        source = os.fspath(engine.ws.handoffs)
        if stamps is None or source != self._source:
            self._keys, self._refs = {}, {}
            self._source = source
        self._stamps = stamps or {}
        return self._stamps.keys()

    def lookup(self, handoff_id: str, read: Callable[[str], Refs | None]) -> Refs | None:
        """``handoff_id``'s references: remembered when its stamp is the one it was read under,
        else ``read`` (None: not live, or unreadable) and remembered when its copies are settled.
        The stamps were taken (:meth:`start`) before ``read`` reads, so what is remembered is
        never older than the stamp it is filed under."""
        stamp = self._stamps.get(handoff_id)
        if stamp is not None and self._keys.get(handoff_id) == stamp[0]:
            return self._refs[handoff_id]
        refs = read(handoff_id)
        if refs is not None and stamp is not None and stamp[1] < self._settled_ns \
                and (handoff_id in self._refs or len(self._refs) < MAX_KEPT):
            self._keys[handoff_id], self._refs[handoff_id] = stamp[0], refs
        elif handoff_id in self._refs:
            del self._keys[handoff_id], self._refs[handoff_id]
        return refs

    def retain(self, ids: Collection[str]) -> None:
        """End the pass: forget its stamps, and every handoff that was not listed live in it."""
        self._stamps = {}
        if any(i not in ids for i in self._refs):
            self._keys = {i: k for i, k in self._keys.items() if i in ids}
            self._refs = {i: r for i, r in self._refs.items() if i in ids}
