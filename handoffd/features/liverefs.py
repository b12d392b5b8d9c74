"""What live handoffs reference, remembered between retention passes.

Retention keeps what live work still needs: the parent and the dependencies of every pending or
in-progress handoff (:func:`handoffd.features.retention.protected`). Reading every live
document for that, on every pass, took seconds with tens of thousands pending, and a serving
daemon paid it at every pass. :class:`LiveRefs` remembers what each live document referenced,
keyed by the identity of its files in the files store (inode, size, mtime and ctime in ns, of
its pending/ and of its in-progress/ copy): a document whose files are unchanged is stat'ed, not
read again.

An entry is believed only as far as that identity proves the document unchanged:

- every write handoffd makes is a new inode, and any write, rename or ``touch`` of a file
  changes its ctime (which nobody can set);
- a write within the same timestamp tick as the read keeps the identity, so an entry is kept
  only when its files last changed :data:`SETTLE_SECONDS` before the pass began (git's rule for
  "racily clean" files; a network filesystem whose server clock runs that far behind ours is
  the exception);
- only the files store gives such an identity: any other store is read on every pass, as before.

It holds the handoffs listed live in its last pass and no others, at most :data:`MAX_KEPT`.
"""
from __future__ import annotations

import os
import stat
import struct
import time
from typing import TYPE_CHECKING, Callable, Collection, NamedTuple

from ..core.states import State

if TYPE_CHECKING:
    from ..core.engine import Engine

SETTLE_SECONDS = 2.0  # a file changed this recently may change again with the same identity
MAX_KEPT = 100_000  # entries held at most (about 0.3 KB each): memory stays flat
LIVE_STATES = (State.PENDING, State.IN_PROGRESS)
# a key: inode, size, mtime_ns, ctime_ns of the document's file in each live state folder,
# packed (bytes are small and not tracked by the garbage collector: a pass adds tens of
# thousands); a missing file is inode 0, size -1
_KEY = struct.Struct("=" + "Qqqq" * len(LIVE_STATES))
_MISSING = (0, -1, 0, 0)


class Refs(NamedTuple):
    """What one live document referenced when it was read: its state, parent and dependencies
    (a named tuple: tens of thousands are made in a pass, and a frozen dataclass is slow to)."""

    state: State
    parent: str | None
    depends_on: tuple[str, ...]


class LiveRefs:
    """Per live handoff, its :class:`Refs` and the key of its files when they were read. One
    pass at a time uses it (retention's lock); ``clock`` is the wall clock file times are
    compared with (injectable for tests)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._keys: dict[str, bytes] = {}
        self._refs: dict[str, Refs] = {}
        self._folders: tuple[str, ...] = ()  # the live state folders of a files store, or ()
        self._settled_ns = 0  # files last changed before this (ns) are settled

    def __len__(self) -> int:
        return len(self._refs)

    def start(self, engine: Engine) -> None:
        """Begin a pass over ``engine``'s live handoffs (an engine over another workspace or
        another store than the last pass's starts afresh)."""
        folders = _live_folders(engine)
        if folders != self._folders:
            self._keys, self._refs = {}, {}
            self._folders = folders
        # taken before any file is looked at: a file changed after it is never settled
        self._settled_ns = int((self.clock() - SETTLE_SECONDS) * 1e9)

    def lookup(self, handoff_id: str, read: Callable[[str], Refs | None]) -> Refs | None:
        """``handoff_id``'s references: remembered when its files are as they were when it was
        read, else ``read`` (None: not live, or unreadable) and remembered when they are settled.
        The files are looked at before ``read`` reads them, so what is remembered is never older
        than the key it is filed under."""
        looked = self._look(handoff_id)
        if looked is not None and self._keys.get(handoff_id) == looked[0]:
            return self._refs[handoff_id]
        refs = read(handoff_id)
        if refs is not None and looked is not None and looked[1] \
                and (handoff_id in self._refs or len(self._refs) < MAX_KEPT):
            self._keys[handoff_id], self._refs[handoff_id] = looked[0], refs
        elif handoff_id in self._refs:
            del self._keys[handoff_id], self._refs[handoff_id]
        return refs

    def retain(self, ids: Collection[str]) -> None:
        """End the pass: forget every handoff that was not listed live in it."""
        if any(i not in ids for i in self._refs):
            self._keys = {i: k for i, k in self._keys.items() if i in ids}
            self._refs = {i: r for i, r in self._refs.items() if i in ids}

    def _look(self, handoff_id: str) -> tuple[bytes, bool] | None:
        """The key of ``handoff_id``'s live files, and whether they are settled; None when it
        cannot be remembered (no files store, no live file left, or one that is not a regular
        file)."""
        if not self._folders:
            return None
        fields: list[int] = []
        found, settled = False, True
        for folder in self._folders:
            try:
                st = os.lstat(f"{folder}/{handoff_id}.json")
            except FileNotFoundError:
                fields += _MISSING
                continue
            except OSError:
                return None
            if not stat.S_ISREG(st.st_mode):  # a symlink's target may change under it
                return None
            fields += (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            found = True
            settled = settled and max(st.st_mtime_ns, st.st_ctime_ns) < self._settled_ns
        return (_KEY.pack(*fields), settled) if found else None


def _live_folders(engine: Engine) -> tuple[str, ...]:
    """The pending/ and in-progress/ folders of ``engine``'s files store; () for another store
    (its documents have no file identity to go by)."""
    from ..backends.files import FilesBackend
    store = getattr(engine.backend, "inner", engine.backend)  # under the event log's recorder
    if not isinstance(store, FilesBackend):
        return ()
    # (the store keeps a document at <state folder>/<id>.json: Store.path)
    return tuple(os.fspath(store.ws.state_dir(state)) for state in LIVE_STATES)
