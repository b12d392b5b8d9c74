"""Unchanged waits: the waiters a scheduler's rescan leaves alone while nothing that may end
their wait changed, by the stamps the store gives its documents (:meth:`Backend.live_stamps`,
:meth:`Backend.stamp_of`: none is read).

A rescan (every ``rescan_seconds``) is how a daemon sees what other processes did: a dependency
filed by another daemon or a ``handoff`` command, a foreign consumer's ``completed/X.json``, a
rewritten document. It queued every waiter to be read and gated again: 20,000 dependants of one
unfinished handoff were each read, and that one handoff looked up 20,000 times, every 5 s (an idle
daemon at 35 s of CPU a minute, a new handoff filed seconds late behind them). Now a rescan stamps
each distinct id a waiter waits for once, and the waiters' documents in one listing, and queues a
waiter again only when one of those changed since the read its wait came from:

* a waiter held ``on`` some ids (a dependency, open children, a contract's holder): when its
  own document or the stored copies of one of those ids changed (a filing anywhere is a change
  of the filed handoff's copies);
* a quiet one, held ``on=()`` (a pause, a question to the requester), whose wait a feature says
  only a change of its own document ends (:meth:`QuietWaits.add_quiet_check`): when that changed;
* one that any filing may end (``on=None``), or whose stamps the store cannot give
  (a store without stamps, the plain memory one; a listing failing with EMFILE): at every
  rescan, as before.

"Since the read" is counted in rescans: :attr:`QuietWaits.rescans` counts the rescans whose
stamps were taken, a waiter's wait remembers the count when the read it came from began
(``looked``), and each stamp remembers the first rescan it was seen at, unchanged since
(:data:`Seen`). A stamp seen at or before the read began and the same now was the same when the
read happened: what it read is what is stored. Every :data:`FULL_RECHECK_SECONDS` each waiter is
queued again whatever its stamps say, and the features are told (:meth:`add_full_recheck_hook`:
the dependencies then look at every dependency, also those the wait does not name).

:class:`QuietWaits` is a part of :class:`~handoffd.service.scheduler.Scheduler` (mixed into it);
everything here is guarded by the scheduler's ``cv``, except :meth:`QuietWaits._take_stamps`.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..core.engine import Engine
from ..core.storage import Backend, LiveStamp

log = logging.getLogger("handoffd")
# each waiter is looked at again this often whatever its stamps say (what they cannot show: a
# failure of a dependency its wait does not name, a rewrite within the file system's clock tick);
# the dependencies' own memory of a waiter is trusted as long (dependencies.PROGRESS_SECONDS)
FULL_RECHECK_SECONDS = 300.0
Seen = tuple[LiveStamp, int]  # a stamp, and the first rescan it was seen at (unchanged since)
# the last rescan's listing of every live document is kept until the next one (to date the
# stamps of waiters read since: see QuietWaits._count_rescan) when it holds at most this many
MAX_LISTING_KEPT = 100_000


class Stamps(NamedTuple):
    """What a rescan took before its books' section: the stamps of the live documents (None:
    the store has none, or cannot give them now) and of each id a waiter waits for."""

    docs: dict[str, LiveStamp | None] | None
    awaited: dict[str, LiveStamp | None]


class QuietWaits:
    """The unchanged waits of a scheduler (mixed into it), guarded by its ``cv``:

    * ``quiet_checks`` and ``full_recheck_hooks``: what features registered;
    * ``rescans``: how many rescans took stamps; ``quiet_stamps``: each waiter's document and
      ``awaited``: each id waited for, with its stamp and the rescan it was first seen at;
    * ``looked``: for each waiter, the rescan count when the read holding it back began;
      ``full_due``: when its next full re-check is due (monotonic).
    """

    # what the unchanged waits use of the scheduler they are part of
    engine: Engine
    cv: threading.Condition
    # handoff id -> the ids whose filing may end its wait (absent: any filing may; empty: none)
    waits_on: dict[str, frozenset[str]]
    fails_on: dict[str, tuple[str, ...]]

    if TYPE_CHECKING:
        def monotonic(self) -> float: ...

    def __init__(self) -> None:
        super().__init__()
        self.quiet_checks: list[Callable[[str], bool]] = []
        self.full_recheck_hooks: list[Callable[[str], None]] = []
        self.rescans = 0
        self.quiet_stamps: dict[str, Seen] = {}  # waiter id -> its document's stamp
        self.awaited: dict[str, Seen] = {}  # id a waiter waits for -> its copies' stamp
        self.looked: dict[str, int] = {}
        self.full_due: dict[str, float] = {}
        # the last rescan's listing of the live documents, and that rescan's count
        self.listing: dict[str, LiveStamp | None] = {}
        self.listed_at = 0

    def add_quiet_check(self, check: Callable[[str], bool]) -> None:
        """``check(id)`` true: the wait of the waiter ``id``, held with ``on=()`` (no filing
        ends it), ends only with a change of its own document or when the feature holding it
        queues it itself (a resume: ``Daemon.queue``). A rescan then reads it again only when
        its document's stamp changed: 5,000 paused handoffs were read and parsed again at each
        rescan, for ever (0.35 s of CPU every 5 s). Asked at each rescan, for each such waiter."""
        with self.cv:
            self.quiet_checks.append(check)

    def add_full_recheck_hook(self, hook: Callable[[str], None]) -> None:
        """``hook(id)`` is called when a rescan queues the waiter ``id`` for its full re-check
        (every :data:`FULL_RECHECK_SECONDS`), or finds it gone from pending/ (cancelled, run by
        another daemon or process): what the feature remembers of it to spare reads is to be
        dropped, so that the check looks at everything (called under ``cv``; it must be quick
        and not raise)."""
        with self.cv:
            self.full_recheck_hooks.append(hook)

    # ------------------------------------------------------------ at a rescan
    def _take_stamps(self) -> Stamps | None:
        """The stamps a rescan compares (one listing of the live documents, one stamp of each
        distinct id waited for; none is read), taken before its books' section: a waiter whose
        read began after this rescan is counted (in that section) read after them. None when
        no waiter may be left alone. The first rescan (the daemon's first listing) takes them
        even with no waiter yet: they date the waiters its reads find (:meth:`_count_rescan`)."""
        with self.cv:
            if not self.waits_on and self.rescans:
                return None
            awaited: set[str] = set()
            for handoff_id, on in self.waits_on.items():
                if on:
                    awaited.update(on)
                    awaited.update(self.fails_on.get(handoff_id, ()))
        backend = self.engine.backend
        try:
            docs = backend.live_stamps()
        except Exception as exc:  # e.g. EMFILE: they are all read again, as before; not fatal
            log.warning("cannot stamp the pending documents (%s); the waiting ones are read "
                        "again", exc)
            docs = None
        # (without the waiters' own stamps none is left alone)
        marks = _stamp_each(backend, awaited) if docs is not None else {}
        return Stamps(docs, marks)

    def _count_rescan(self, stamps: Stamps | None) -> None:
        """A rescan's books' section begins: count it, and keep each stamp with the first
        rescan it was seen at (an id not stamped now, or unstampable, is forgotten)."""
        self.rescans += 1
        docs = stamps.docs if stamps is not None else None
        mine = {hid: docs.get(hid) for hid in self.waits_on} if docs is not None else {}
        # a waiter read since the last rescan (at start-up: every one) has no stamp of its own
        # from before its read; the last rescan's listing, taken before it, dates one that is
        # the same now (its own document's, or a live dependency's: a stamp of the same copies
        # is the same bytes), where it once made this rescan read every one of them again
        listed = (self.listing, self.listed_at)
        self.quiet_stamps = _carried(self.quiet_stamps, mine, self.rescans, listed)
        self.awaited = _carried(self.awaited, stamps.awaited if stamps else {}, self.rescans,
                                listed)
        self.listing = docs if docs is not None and len(docs) <= MAX_LISTING_KEPT else {}
        self.listed_at = self.rescans

    def _left_alone(self, handoff_id: str, now: float) -> bool:
        """True when a rescan need not queue the waiter ``handoff_id`` again: nothing that may
        end its wait changed since the read that holds it back began (see the module's
        docstring), and its full re-check is not due (that one tells the features)."""
        on, looked = self.waits_on.get(handoff_id), self.looked.get(handoff_id)
        if on is None or looked is None:
            return False
        due = self.full_due.get(handoff_id)
        if due is not None and now >= due:
            del self.full_due[handoff_id]
            self._full_recheck(handoff_id)
            return False
        seen = self.quiet_stamps.get(handoff_id)
        if seen is None or seen[1] > looked:
            return False
        if not on:
            return self._quiet(handoff_id)
        for awaited in itertools.chain(on, self.fails_on.get(handoff_id, ())):
            seen = self.awaited.get(awaited)
            if seen is None or seen[1] > looked:
                return False
        return True

    # ------------------------------------------------------------ a waiter's books
    def _held(self, handoff_id: str, looked: int) -> None:
        """A gate holds ``handoff_id`` back, by a read that began at rescan ``looked`` (-1:
        not known, its next rescan queues it again); its full re-check is due
        :data:`FULL_RECHECK_SECONDS` after it first waited (not later for each re-check a
        filing brings)."""
        self.looked[handoff_id] = looked
        self.full_due.setdefault(handoff_id, self.monotonic() + FULL_RECHECK_SECONDS)

    def _forget_waiter(self, handoff_id: str) -> None:
        """``handoff_id`` waits no more (let go, gone, or queued by its feature)."""
        self.quiet_stamps.pop(handoff_id, None)
        self.looked.pop(handoff_id, None)
        self.full_due.pop(handoff_id, None)

    def _forget_waiters(self, present: set[str], waiting: dict[str, str]) -> None:
        """A rescan's tidying: the books of ids no longer pending (claimed or filed elsewhere),
        and document stamps of ids no longer waiting (e.g. resumed)."""
        for gone in [hid for hid in self.quiet_stamps if hid not in waiting]:
            del self.quiet_stamps[gone]
        for gone in [hid for hid in self.looked if hid not in present]:
            self._forget_waiter(gone)  # (full_due's ids are among looked's)

    def _clear_waits(self) -> None:
        """Forget every waiter's books (the scheduler's reset); the count goes on."""
        self.quiet_stamps.clear()
        self.awaited.clear()
        self.looked.clear()
        self.full_due.clear()
        self.listing = {}

    def _full_recheck(self, handoff_id: str) -> None:
        """Tell the features that ``handoff_id`` is queued for its full re-check."""
        for hook in self.full_recheck_hooks:
            try:
                hook(handoff_id)
            except Exception:  # a feature's bug costs it its memory, never the rescan
                log.exception("a full re-check hook failed for %s", handoff_id)

    def _quiet(self, handoff_id: str) -> bool:
        """What the quiet checks say of the waiter ``handoff_id`` (False when one fails, e.g.
        its records cannot be read: the gate, which says why, runs on the read queued now)."""
        try:
            return any(check(handoff_id) for check in self.quiet_checks)
        except Exception:
            return False


def _stamp_each(backend: Backend, ids: set[str]) -> dict[str, LiveStamp | None]:
    """Each of ``ids``' stamp (:meth:`Backend.stamps_of`: PostgreSQL asks for them in one
    query, not one each); all None when the store cannot stamp them now (out of reach: their
    waiters are gated again)."""
    try:
        return backend.stamps_of(ids)
    except Exception:
        return dict.fromkeys(ids)


def _carried(before: dict[str, Seen], now: dict[str, LiveStamp | None], rescan: int,
             listed: tuple[dict[str, LiveStamp | None], int] = ({}, 0)) -> dict[str, Seen]:
    """The stamps ``now`` taken at ``rescan``, each with the rescan it was first seen at: kept
    from ``before`` when the same, else the rescan of ``listed`` (the last rescan's listing,
    and its count) when it had the same, else this one; unstamped ids (None) are left out."""
    kept: dict[str, Seen] = {}
    listing, listed_at = listed
    for handoff_id, stamp in now.items():
        if stamp is None:
            continue
        old = before.get(handoff_id)
        if old is not None and old[0] == stamp:
            kept[handoff_id] = old
        elif listing and listing.get(handoff_id) == stamp:
            kept[handoff_id] = (stamp, listed_at)
        else:
            kept[handoff_id] = (stamp, rescan)
    return kept
