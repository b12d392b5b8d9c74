"""Claims whose admission ran short, and whose hand-back ran short too (:class:`KeptClaims`).

A claim whose admission meets a passing shortage of descriptors or memory (EMFILE loading a
schema file) is handed back to pending/ uncounted at once (:func:`~handoffd.core.admission.
hand_back_short`). That hand-back is a write of its own, and the same shortage may refuse it:
the claim was then given up, left leased in in-progress/, and a batch ended with it there (an
error; the next process's recovery charged an attempt and took the specialist for a crasher).

Now the hand-back is written under :func:`~handoffd.backends.base.refiling`: when it fails
for a passing reason before anything was written (:class:`~handoffd.backends.base.NotFiled`),
the claim is still ours, its document as it was, and it is kept here (still leased, its lock
held: nothing else runs it) and handed back again on a timer, after the claim shortage's own
back-off, doubling while the shortage lasts. Its lease is not renewed meanwhile, so a claim
kept for :data:`~.leases.FENCE_FRACTION` of a lease, counted from the claim (when its lease
was written), is given up before it lapses: this process's sweep hands it back uncounted
(``given up by this process``), never taken for a crash. Every delay, the first included, is
capped by what is left of that (a first back-off of 8 s under a 2 s lease once let the lease
lapse and the sweep charge an attempt). A batch waits for what it keeps (as for a held outcome,
up to ``grace_seconds``), and a stop hands each back one last time
(:meth:`KeptClaims.release_all`), waiting (a little) for a hand-back its timer is writing: that
one once re-armed its timer after the stop, and the batch exited 0 with the claim leased.

A claim given up here never ran its handler: it is given up marked so
(:meth:`~handoffd.core.storage.Backend.abandon_unrun`; the files store's mark takes no
descriptor), and whichever process recovers it, this one's sweep or the next process's after a
stop, hands it back uncounted. Unmarked, the next process's recovery charged it an attempt as
a crash (a handoff with no retries left failed without ever running).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..backends.base import NotFiled, refiling
from ..core.admission import hand_back_short
from ..core.engine import Engine
from ..core.errors import ClaimShortage
from .handbacks import shortage_backoff
from .leases import FENCE_FRACTION

log = logging.getLogger("handoffd")
GAVE_UP = -1.0  # what KeptClaims.hand_back returns for a claim it gave up (said and counted)
# a stop waits at most this long for the hand-backs its timers are writing (one write each)
BUSY_WAIT_SECONDS = 2.0


@dataclass
class _Kept:
    """One kept claim: the shortage that carries it, hand-backs tried, when it was claimed
    (monotonic: its lease counts from then, not from the keep)."""

    short: ClaimShortage
    tries: int = 1
    since: float = field(default_factory=time.monotonic)
    timer: threading.Timer | None = None
    busy: bool = False  # its timer is handing it back (still listed: a batch waits for it)


class KeptClaims:
    """The claims of one daemon whose admission and hand-back both ran short (module doc).
    ``on_returned(handoff_id)`` is told when one is back in pending/ (the worker looks at it
    again at once); ``cv`` is the scheduler's, notified when the last one goes."""

    def __init__(self, engine: Engine, cv: threading.Condition,
                 on_returned: Callable[[str], None]) -> None:
        self.engine = engine
        self.cv = cv
        self.on_returned = on_returned
        self.kept: dict[str, _Kept] = {}  # handoff id -> its kept claim (under cv)
        # a stop took them: a retry under way gives its claim up (until the next run keeps one)
        self.closing = False
        self.given_up = 0  # claims given up since the last stop (errors of the run)

    def __bool__(self) -> bool:
        return bool(self.kept)

    def hand_back(self, short: ClaimShortage, delay: float) -> float | None:
        """Hand back the claim ``short`` carries, uncounted: None when that is done (or the
        claim was lost meanwhile); when that write ran short too, the claim is kept and handed
        back again after ``delay`` seconds, capped by what its lease leaves (:meth:`_left`):
        that delay is returned. A claim whose lease leaves no time, or no thread to time it,
        is given up (an error of the run, said so): :data:`GAVE_UP`. Any other failure gives
        the claim up (the sweep hands it back) and raises."""
        if self._write(short):
            return None
        entry = _Kept(short, since=self._claimed_since(short))
        delay = min(delay, self._left(entry))
        if delay <= 0:
            self._give_up(entry, f"{short.reason}, and its lease leaves no time to wait")
            return GAVE_UP
        with self.cv:
            self.closing = False  # (a run is under way: what a stop took is behind it)
            self.kept[short.claim.id] = entry
            if self._arm(entry, delay):
                return delay
            del self.kept[short.claim.id]
        self._give_up(entry, "no thread to spare for its hand-back")
        return GAVE_UP

    def _claimed_since(self, short: ClaimShortage) -> float:
        """When ``short``'s claim was made, on the monotonic clock: its lease (written then,
        by the engine's clock) counts from there, not from now."""
        claimed_at = getattr(short.claim, "claimed_at", None)
        now = time.monotonic()
        if claimed_at is None:  # (a backend that does not say: counted from now)
            return now
        elapsed = (self.engine.clock() - claimed_at).total_seconds()
        return now - min(max(elapsed, 0.0), self.engine.settings.lease_seconds)

    def _left(self, entry: _Kept) -> float:
        """Seconds ``entry`` may still be kept: until :data:`FENCE_FRACTION` of its lease,
        counted from its claim (it is not renewed while kept), has passed."""
        lease = self.engine.settings.lease_seconds
        return FENCE_FRACTION * lease - (time.monotonic() - entry.since)

    def _write(self, short: ClaimShortage) -> bool:
        """One try at the hand-back: False when it failed for a passing reason, nothing
        written and the claim still ours (:class:`NotFiled`)."""
        claim = short.claim
        try:
            with refiling(claim):
                hand_back_short(self.engine, short)
        except NotFiled:
            return False
        except BaseException:
            self.engine.backend.abandon_unrun(claim)  # (given up already when the write failed)
            raise
        return True

    def _arm(self, entry: _Kept, delay: float) -> bool:
        """Hand ``entry`` back again in ``delay`` seconds (called under ``cv``); False when no
        thread can be started for that (a shortage too)."""
        timer = threading.Timer(delay, self._retry, args=(entry,))
        timer.daemon = True
        timer.name = f"hand-back-{entry.short.claim.id}"
        try:
            timer.start()
        except RuntimeError:
            return False
        entry.timer = timer
        return True

    def _give_up(self, entry: _Kept, why: str) -> None:
        """Give ``entry``'s claim up (this process's sweep hands it back, uncounted), counted
        as an error of this run (a batch that ends so exits non-zero, and says so) unless a
        stop counted it already (:meth:`release_all`)."""
        self.engine.backend.abandon_unrun(entry.short.claim)
        self._count_given_up(entry)
        if self.closing:  # (the process ends: the next one's recovery hands it back, marked)
            log.error("handoff %s: stopping: cannot hand it back to pending/ (%s); the sweep "
                      "recovers it", entry.short.claim.id, why)
            return
        log.error("handoff %s: cannot be handed back to pending/ (%s); given up: the sweep "
                  "hands it back, uncounted", entry.short.claim.id, why)

    def _count_given_up(self, entry: _Kept) -> None:
        """Count ``entry`` given up, unless a stop that stopped waiting for its hand-back took
        it out of the list and counted it then."""
        with self.cv:
            if entry.busy and self.kept.get(entry.short.claim.id) is not entry:
                return
            self.given_up += 1

    def _retry(self, entry: _Kept) -> None:
        """On a timer: hand ``entry``'s claim back again; kept again (the next back-off, no
        later than its lease allows) when that runs short too, given up once it cannot wait."""
        handoff_id = entry.short.claim.id
        with self.cv:
            if self.kept.get(handoff_id) is not entry:  # (a stop took it meanwhile)
                return
            entry.busy = True
        try:
            returned = self._write(entry.short)
        except Exception as exc:  # (given up: the sweep hands it back)
            self._count_given_up(entry)
            log.error("handoff %s: its hand-back failed: %s; given up: the sweep hands it back "
                      "to pending/", handoff_id, exc)
            returned = None
        if returned is False:
            delay = min(shortage_backoff(entry.tries + 1), self._left(entry))
            with self.cv:
                if delay > 0 and not self.closing:
                    entry.tries += 1
                    if self._arm(entry, delay):
                        entry.busy = False  # (its timer waits for cv: it sees this)
                        return
            self._give_up(entry, f"{entry.short.reason} for "
                                 f"{time.monotonic() - entry.since:.0f}s")
        elif returned:
            log.info("handoff %s: handed back to pending/ after its hand-back ran short",
                     handoff_id)
            self.on_returned(handoff_id)  # (queued before it leaves the list: a batch runs it)
        with self.cv:
            if self.kept.get(handoff_id) is entry:
                del self.kept[handoff_id]
            self.cv.notify_all()  # (a batch may be waiting for the last one)

    def release_all(self) -> int:
        """As the daemon stops: hand every kept claim back now, one last try each; what still
        runs short is given up (this process's sweep, or the next one's, hands it back).
        A hand-back its timer is writing is waited for (up to BUSY_WAIT_SECONDS): seeing
        ``closing``, it gives its claim up rather than arm its timer again; one still writing
        then is counted given up here (it may yet succeed: the run said an error too many,
        never too few). Returns how many were given up in this run (here, or on their timers
        before). ``closing`` stays set: a retry of this run never re-arms after it."""
        with self.cv:
            self.closing = True
            end = time.monotonic() + BUSY_WAIT_SECONDS
            while any(entry.busy for entry in self.kept.values()) and time.monotonic() < end:
                self.cv.wait(max(end - time.monotonic(), 0.0))
            busy = [entry for entry in self.kept.values() if entry.busy]
            kept = [entry for entry in self.kept.values() if not entry.busy]
            for entry in busy + kept:  # (the busy: their timers give them up, uncounted there)
                del self.kept[entry.short.claim.id]
            given_up, self.given_up = self.given_up + len(busy), 0
        for entry in kept:
            if entry.timer is not None:
                entry.timer.cancel()
            handoff_id = entry.short.claim.id
            try:
                if self._write(entry.short):
                    continue
            except Exception as exc:
                log.error("handoff %s: stopping: cannot hand it back to pending/: %s; the "
                          "sweep recovers it", handoff_id, exc)
                given_up += 1
                continue
            self.engine.backend.abandon_unrun(entry.short.claim)
            given_up += 1
            log.error("handoff %s: stopping: cannot hand it back to pending/ for now (%s); "
                      "the sweep recovers it", handoff_id, entry.short.reason)
        return given_up
