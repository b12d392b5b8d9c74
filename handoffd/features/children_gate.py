"""The children gate: a delegating parent parked in pending/ waits until its children are done
(:func:`~.aggregation.ready`), and what the gate remembers of finished children so that it
does not read every child's whole document again at every look (:class:`FinishedChildren`).
Installed by :func:`handoffd.features.parked_gates.install`. The code that reads children
(:mod:`.childfacts`, :mod:`.aggregation`) is imported when a parked parent is first looked at:
a listing of pending handoffs none of which delegated never loads it."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from ..core.documents import Envelope, book
from ..core.errors import HandoffdError
from ..core.states import State
from ..core.storage import LiveStamp
from .dependencies import Verdict

if TYPE_CHECKING:
    from ..core.engine import Engine
    from .childfacts import ChildInfo


def child_info(engine: "Engine", handoff_id: str) -> ChildInfo:
    """:func:`.childfacts.child_info`: a child's facts, read from the store (its module loaded
    at the first look at a parked parent). The gate calls it by this module's name: tests
    count the reads by replacing it here."""
    from .childfacts import child_info as read
    return read(engine, handoff_id)


def children_gate(engine: "Engine", env: Envelope, doc: dict[str, Any], *,
                  known: FinishedChildren | None = None) -> Verdict | None:
    """Hold a delegating parent until its children are done (see :func:`ready`). ``known``:
    what the gate remembers of finished children (the installed gate's); without it every
    child's document is read."""
    wait = book(doc).get("waiting_children") if isinstance(doc.get("handoffd"), dict) else None
    if not isinstance(wait, dict):
        return None
    children = wait.get("children")
    ids = [cid for cid in (children if isinstance(children, list) else []) if isinstance(cid, str)]
    infos = [known.info(engine, cid) if known is not None else child_info(engine, cid)
             for cid in ids]
    from .aggregation import ready  # (a parked parent's: see the module's docstring)
    if ready(engine, wait, infos):
        return None
    open_ = [i for i in infos if i.status is None]
    # a child that asks its requester a question is what the family waits for: say so, with
    # how to answer (the parent's note was "c1 (pending)", and `handoff wait` just timed out)
    shown = ", ".join(f"{i.handoff_id} ({i.state})" if i.asking is None else
                      f"{i.handoff_id} ({i.asking}: `handoff answer {i.handoff_id}`)"
                      for i in open_[:4])
    more = f" and {len(open_) - 4} more" if len(open_) > 4 else ""
    # only a child's filing can end the wait (its deadline: the scheduler looks again then; a
    # cancel queues the parent itself); on=None re-read every parked parent, and each of its
    # children, at every filing
    return Verdict.wait(f"waiting for {len(open_)} of {len(infos)} children "
                        f"({wait.get('aggregation')}): {shown}{more}",
                        on=(i.handoff_id for i in open_))


# what the children gate remembers of finished children (FinishedChildren)
FACTS_SETTLE_SECONDS = 2.0  # copies changed this recently may change again under the same stamp
FACTS_LIFETIME_SECONDS = 600.0  # an entry is read again after this, whatever its stamp
FACTS_KEPT = 10_000  # entries at most
FACTS_KEPT_BYTES = 8 << 20  # their facts at most (JSON bytes, plus FACTS_ENTRY_BYTES each)
FACTS_ENTRY_BYTES = 256  # what an entry costs beside its facts, roughly
FACTS_ONE_BYTES = 64 << 10  # one child's facts larger than this (a huge error) are not kept
_FINISHED = (State.COMPLETED.value, State.FAILED.value)


class FinishedChildren:
    """The children gate's memory of finished children (one per engine: :func:`install`).

    A parked parent is looked at each time one of its open children is filed, and the gate
    read and parsed every child's whole document (up to ``max_document_bytes``) at every look,
    about N²/2 reads of finished children over a family's life (60 answering 1 MiB each: 1,100
    of them, 6 s of the daemon's CPU). A finished child's facts (its :class:`~.childfacts.ChildInfo`, without output) are kept
    under the stamp of its stored copies (:meth:`~handoffd.core.storage.Backend.stamp_of`; the
    files store's: their inode, size, mtime and ctime, one lstat per state folder) and used
    again while the stamp is the same. They are believed only as far as the stamp proves the
    document unchanged:

    - an open child (neither completed nor failed), a missing or unreadable one, is never kept;
    - the stamp is taken before and after the read, and the facts are kept only when the two
      agree (nothing changed while it was read);
    - nor when its copies changed within :data:`FACTS_SETTLE_SECONDS` of the look (a write in
      the same timestamp tick keeps the stamp: :mod:`~handoffd.features.liverefs`' rule);
    - a store without stamps (the plain memory store) has every child read at every look.

    A ``handoff retry`` of a failed child, its filing again, or its file replaced changes the
    stamp: it is read again. Bounded: :data:`FACTS_KEPT` entries and :data:`FACTS_KEPT_BYTES`
    at most (the oldest go first), each for :data:`FACTS_LIFETIME_SECONDS`. Thread-safe (gates
    run on whichever thread asks: the scheduler's, a status query's). ``clock``: the wall clock
    the files' times are compared with (injectable for tests)."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        # id -> (its copies' stamp, kept until (clock), bytes counted, facts); oldest first
        self._kept: OrderedDict[str, tuple[bytes, float, int, ChildInfo]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def gate(self, engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        """The children gate (:func:`children_gate`) with this memory: the one installed."""
        return children_gate(engine, env, doc, known=self)

    def info(self, engine: "Engine", handoff_id: str) -> ChildInfo:
        """``handoff_id``'s facts as :func:`~.childfacts.child_info` reads them: those kept
        when its copies' stamp is the one they were read under, else read (and kept when it
        is finished, its copies settled and unchanged by the read)."""
        now = self.clock()  # taken before the stamp: a change after it is never settled
        before = _stamp_of(engine, handoff_id)
        if before is not None:
            with self._lock:
                kept = self._kept.get(handoff_id)
                if kept is not None and kept[0] == before[0] and now < kept[1]:
                    return dataclasses.replace(kept[3])
        info = child_info(engine, handoff_id)
        keep = before is not None and info.status is not None and info.state in _FINISHED \
            and before[1] < (now - FACTS_SETTLE_SECONDS) * 1e9 \
            and _stamp_of(engine, handoff_id) == before
        self._remember(handoff_id, before[0] if keep and before is not None else None, info, now)
        return info

    def _remember(self, handoff_id: str, key: bytes | None, info: ChildInfo, now: float) -> None:
        """Keep ``info`` under ``key`` (None: forget what was kept), within the bounds."""
        from .childfacts import json_size  # (loaded by child_info already)
        size = json_size([info.error, info.finished_at, info.specialist]) + FACTS_ENTRY_BYTES \
            if key is not None else 0
        with self._lock:
            old = self._kept.pop(handoff_id, None)
            if old is not None:
                self._bytes -= old[2]
            if key is None or size > FACTS_ONE_BYTES:
                return
            self._kept[handoff_id] = (key, now + FACTS_LIFETIME_SECONDS, size,
                                      dataclasses.replace(info))
            self._bytes += size
            # the oldest first: over the bounds, or past their lifetime (kept in that order)
            while self._kept and (len(self._kept) > FACTS_KEPT or self._bytes > FACTS_KEPT_BYTES
                                  or next(iter(self._kept.values()))[1] <= now):
                self._bytes -= self._kept.popitem(last=False)[1][2]


def _stamp_of(engine: "Engine", handoff_id: str) -> LiveStamp | None:
    """The stamp of ``handoff_id``'s stored copies; None (read it, as before) when the store
    cannot give one now."""
    try:
        return engine.backend.stamp_of(handoff_id)
    except (HandoffdError, OSError):  # e.g. the store out of reach: the read says what it is
        return None
