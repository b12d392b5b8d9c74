"""The scheduler's books: when to look at which pending handoff, and which may start now.

The dispatch rules that read them are in :mod:`.dispatch`; the daemon's loop (:mod:`.daemon`)
and its finishing workers ask them for the next handoff. Two parts of the books have modules of
their own, mixed into :class:`Scheduler`: :mod:`.lines` (each specialist's line of handoffs held
for a concurrency slot or a rate limit's token) and :mod:`.quiet` (the waiters a rescan leaves
alone while nothing that may end their wait changed). Everything here is guarded by ``cv``, the
daemon's one condition variable (re-entrant: the rules call each other under it).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from datetime import datetime

from ..core.admission import resumes
from ..core.documents import BOOK, arrival
from ..core.engine import Engine, Peek
from ..core.memorystrikes import memory_backoff, memory_strikes
from ..core.specialists import Specialist
from ..features import aggregation
from .lines import Lines
from .quiet import QuietWaits
from .report import BatchReport

log = logging.getLogger("handoffd")
READY_WINDOW = 64  # due handoffs read ahead to order by priority
# Another worker starts only once every running task is this old: a task about to finish
# chains to the next due handoff itself (dispatch.Dispatcher.chain), and short handoffs drain
# fastest on one thread (2,000 no-op handoffs: 1 worker 516-552/s, 4 side by side 380-395/s,
# lost to the GIL's hand-overs and the folders' locks). Slow handlers still run side by side,
# this much later. With fsync too: a handoff there waits for the disk a millisecond or two, and
# four threads overlapping those waits cost 40-60% more CPU than one (the GIL handed over at
# every fsync), for a drain no faster; a disk slower than this delay still gets them all.
SPIN_UP_SECONDS = 0.005
# a batch without --max-seconds waits for a start-shortage back-off that ends within this long
# (the first ones: 1 s, 2 s, 4 s) rather than end handing its handoff back
BACKOFF_WAIT_SECONDS = 5.0
RETRY_LOOK_SECONDS = 5.0  # an item the scheduler could not handle is looked at again this late
MAX_HELD_OFF = 10_000  # handoffs held off at once (hold_off: the oldest forgotten first)
WAKE = ""  # a time-heap entry that only wakes the loop (no handoff id is empty)
FIRST = -1.0  # the due time of a woken waiter (look_first): before any monotonic time
# with every worker busy, the loop reads due handoffs into the ready window itself (to learn
# their hard deadlines: :meth:`Scheduler.look_ahead`) once the youngest running task is this
# old: a drain of short handoffs, whose finishing workers read the next ones, is left alone
LOOK_AHEAD_AFTER_SECONDS = 0.25
# with every worker busy and the ready window full, the loop reads on past it (each due id once,
# READY_WINDOW a turn: :meth:`Scheduler._look_behind`) and keeps the hard deadlines of at most
# this many of them (a few hundred bytes each); past that, reading pauses until one leaves
MAX_BEHIND_DEADLINES = 4096
# what that read finds is kept with the first this many of them (a document each: as many
# as the window keeps, so at most twice its memory; documents may be 4 MiB each): taken into
# the window, they are not read again (the rest are, when their turn comes)
MAX_BEHIND_PEEKS = READY_WINDOW


class Scheduler(Lines, QuietWaits):
    """The scheduling bookkeeping of one daemon, all guarded by ``cv``:

    * ``heap``/``queued``: when to look at an id next (a ``WAKE`` entry only wakes the loop:
      :meth:`wake_at`); ``ready``/``readied``: ids read and waiting for a worker, most urgent
      first (each with the rescan count when its read began: :mod:`.quiet`); ``rechecks``:
      waiters a rescan queued to be gated again, looked at by turns with other due work
      (:meth:`next_ready`); ``behind``: due entries of ``heap`` read past a full window while
      every worker was busy (:meth:`look_ahead`), still waiting their turn (the window takes
      the first MAX_BEHIND_PEEKS as read there: ``behind_peeks``).
    * the lines (:class:`~.lines.Lines`): ``parked``, ``rate_held`` and what lets them out.
    * ``inflight``: one entry per task submitted to the pool (its agent, when it started: see
      :meth:`spin_up_at`); ``busy`` and ``running`` are counts of it, kept in step by
      :meth:`start` and :meth:`finished` only.
    * ``waiting``/``waits_on``/``fails_on``: handoffs a gate holds back, and the ids whose filing
      (into failed/, for ``fails_on``) may end it;
      ``unroutable``: handoffs no specialist here takes (both shared with the run's report);
      the unchanged waits (:class:`~.quiet.QuietWaits`): the waiters a rescan does not read
      again while nothing that may end their wait changed.

    The progress watchdog (:mod:`.progress`) guards the whole and rebuilds it (:meth:`reset`).
    """

    def __init__(self, engine: Engine, report: BatchReport, *, workers: int) -> None:
        super().__init__()  # the lines' and the quiet waits' books
        self.engine = engine
        self.workers = workers
        # the cv's own lock, taken as ``lock`` where nothing is waited for: ``with cv`` is two
        # Python calls (Condition's __enter__ and __exit__), ``with lock`` none, and a worker
        # takes it three times a handoff (the same lock: notifying under it is allowed)
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.heap: list[tuple[float, int, int, str]] = []  # (due, _, seq, id): when to look
        # (priority, due, seq, id, peek, the rescan count when its read began)
        self.ready: list[tuple[int, float, int, str, Peek, int]] = []
        self.readied: set[str] = set()
        self.queued: dict[str, float] = {}
        # handoff id -> looked at again no sooner than this (monotonic), whatever hint comes: an
        # error about it (a full disk, a document this process cannot write) once had it
        # looked at again at once by the folder event its own failed claim made, ~100 times a
        # second (:meth:`hold_off`)
        self.not_before: dict[str, float] = {}
        self.seq = itertools.count()
        self.rechecks: OrderedDict[str, float] = OrderedDict()  # waiter -> when a rescan queued it
        self.rechecked_last = False  # next_ready handed out a recheck last: other work's turn
        self.picked_look: tuple[str, int] | None = None  # the last id handed out, its read's count
        # pool task token -> (agent ("" for set-aside work), monotonic time it started)
        self.inflight: dict[int, tuple[str, float]] = {}
        self.spin_up = SPIN_UP_SECONDS  # (fast and fsync alike: see SPIN_UP_SECONDS)
        self.busy: Counter[str] = Counter()  # agent -> tasks in flight (a count of inflight)
        self.running = 0  # len(inflight)
        self.last_dispatch = time.monotonic()
        self.stopping = False  # nothing more starts
        self.batch_deadline = math.inf  # run_batch(max_seconds=): nothing starts after it
        # handoff id -> when its start-shortage back-off ends (monotonic): a batch waits for it
        # (:meth:`due_soon`) rather than end handing it back; forgotten once it is looked at
        self.backoffs: dict[str, float] = {}
        self.rescan_requested = True
        self.first_seen: dict[str, datetime] = {}  # hard-timeout handoffs seen pending, by id
        # handoff id (in the ready window) -> its hard deadline (monotonic), found when it was
        # read: with every worker busy, look_ahead answers it TIMEOUT then, without a free slot
        self.ahead: dict[str, float] = {}
        # due entries of ``heap`` (same shape) that look_ahead read past a full ready window:
        # their turn is kept (taken into the window before later ones), their document is not
        self.behind: list[tuple[float, int, int, str]] = []
        # handoff id (behind) -> (its entry's due time, its hard deadline (monotonic)): at most
        # MAX_BEHIND_DEADLINES; ``deadlines_behind`` orders them (an entry not matching: void)
        self.behind_at: dict[str, tuple[float, float]] = {}
        self.deadlines_behind: list[tuple[float, str]] = []
        # handoff id (behind) -> (its entry's due time, its peek, the rescan count when that read
        # began): the read behind, used when its entry is taken into the window (an entry not
        # matching: void); at most MAX_BEHIND_PEEKS
        self.behind_peeks: dict[str, tuple[float, Peek, int]] = {}
        # hard-timeout handoff id -> its hard deadline (monotonic) as last read, kept after it is
        # handed out too: a hold-off never looks at it again later than that (:meth:`hold_off`);
        # at most MAX_HELD_OFF (the oldest forgotten first), the gone forgotten at a rescan
        self.deadline_at: dict[str, float] = {}
        self.unroutable = report.unroutable
        self.waiting = report.waiting  # handoff id -> why a gate holds it back
        # handoff id -> the ids whose filing may end its wait (absent: any filing may); a chain
        # of 1,000 dependents is then re-checked one handoff per filing, not 1,000
        self.waits_on: dict[str, frozenset[str]] = {}
        # handoff id -> the ids whose filing into failed/ may end its wait too (absent: none)
        self.fails_on: dict[str, tuple[str, ...]] = {}

    def limit(self, spec: Specialist) -> int:
        """How many handoffs of ``spec`` this daemon runs at once: its ``concurrency``, else as
        many as there are workers (children of one fan-out run side by side, as seed 000 has it)."""
        return spec.config.concurrency or self.workers

    # ------------------------------------------------------------ when to look
    def notify(self, handoff_id: str, delay: float = 0.0) -> None:
        """Hint that ``handoff_id`` may be due in ``delay`` seconds (watchdog, scans, retries).
        A hint about an id read already, in the ready window or past it (``behind_peeks``),
        voids that read: the hint is that its document changed (a folder event of another
        process's rewrite: a retry's back-off, an answer, a cancel), and what was read before
        would be dispatched as it was (a back-off set since: run that much early). It is
        read again in its turn (an id past the window keeps its place there)."""
        now = time.monotonic()
        due = now + delay
        with self.cv:
            if self.not_before and (floor := self.not_before.get(handoff_id)) is not None:
                if floor <= now:
                    del self.not_before[handoff_id]
                elif due < floor:
                    due, delay = floor, floor - now
            if self.behind_peeks:  # (empty but while every worker is busy: a dict lookup)
                self.behind_peeks.pop(handoff_id, None)
            if handoff_id in self.readied:  # (a set lookup, as before: rare past it)
                self._unready(handoff_id)
            current = self.queued.get(handoff_id)
            if current is not None and current <= due:
                return
            self.queued[handoff_id] = due
            heapq.heappush(self.heap, (due, 2, next(self.seq), handoff_id))
            self.cv.notify()

    def release(self, handoff_id: str) -> None:
        """Look at ``handoff_id`` now, whatever :meth:`hold_off` said: what held it off has
        passed (a claim given up for a shortage, once a task freed what it held)."""
        with self.cv:
            self.not_before.pop(handoff_id, None)
        self.notify(handoff_id)

    def hold_off(self, handoff_id: str, delay: float) -> None:
        """Look at ``handoff_id`` again in ``delay`` seconds, and no sooner whatever hints come
        meanwhile (a folder event, a rescan): what failed about it for a passing reason would
        fail again at once. Forgotten once it leaves pending/ or the time has passed. A hard
        deadline read with it (seed 000) that comes first is when it is looked at again, though:
        still pending then, it is answered TIMEOUT at it, not at the end of the hold-off."""
        with self.cv:
            now = time.monotonic()
            floor = look = now + delay
            at = self.deadline_at.get(handoff_id, math.inf) if self.deadline_at else math.inf
            if now < at < floor:
                look = at  # (not when it has passed: a failed answer is not tried again at once)
            self.not_before.pop(handoff_id, None)
            self.not_before[handoff_id] = floor  # (hints wait for the floor all the same)
            if len(self.not_before) > MAX_HELD_OFF:  # (the oldest first: dicts keep order)
                del self.not_before[next(iter(self.not_before))]
            # what a hint queued sooner meanwhile (the folder event of its own failed claim's
            # put-back) is superseded, and taken out of the ready window if it got there (or
            # out of line behind it: its entry there is void, so are its peek and deadline)
            self.queued[handoff_id] = look
            heapq.heappush(self.heap, (look, 2, next(self.seq), handoff_id))
            if self.behind_at:
                self.behind_at.pop(handoff_id, None)
            if self.behind_peeks:
                self.behind_peeks.pop(handoff_id, None)
            if handoff_id in self.readied:
                self._unready(handoff_id)
            self.cv.notify()

    def _unready(self, handoff_id: str) -> None:
        """Take ``handoff_id`` out of the ready window, its read void (under ``cv``)."""
        self.ready = [entry for entry in self.ready if entry[3] != handoff_id]
        heapq.heapify(self.ready)
        self.readied.discard(handoff_id)
        self.ahead.pop(handoff_id, None)

    def look_first(self, handoff_id: str) -> None:
        """Look at ``handoff_id`` before anything else due in its priority (also when it is in
        the ready window already): a waiter whose wait a filing may have ended, or a parent just
        parked, whose gate then holds it before its children run. A gate's check takes no
        worker, and what it lets go waited longest: a first_success parent, queued behind its
        other children, was looked at only once they had all run (with one worker, or a
        specialist's concurrency of 1)."""
        with self.cv:
            if handoff_id in self.readied:  # read already: first in the ready window
                for at, (rank, due, seq, hid, peek, looked) in enumerate(self.ready):
                    if hid == handoff_id and due != FIRST:
                        self.ready[at] = (rank, FIRST, seq, hid, peek, looked)
                        heapq.heapify(self.ready)
                        break
                return
            self.queued[handoff_id] = FIRST
            heapq.heappush(self.heap, (FIRST, 2, next(self.seq), handoff_id))
            self.cv.notify()

    def request_rescan(self) -> None:
        """Ask the loop to list pending/ again (events may have been lost)."""
        with self.cv:
            self.rescan_requested = True
            self.cv.notify()

    def wake_at(self, due: float) -> None:
        """Wake the loop at ``due`` (monotonic) without looking at any handoff: a rate
        limit's next token (:meth:`~.lines.Lines.rate_limited`)."""
        heapq.heappush(self.heap, (due, 2, next(self.seq), WAKE))

    def monotonic(self) -> float:
        """The books' clock: :func:`time.monotonic` as this module reads it (the lines read it
        here too, so that a test drives all of the books on one fake clock)."""
        return time.monotonic()

    def listed(self, ids: Sequence[str], running: Collection[str], *,
               recheck_waiting: bool) -> None:
        """A scan listed ``ids`` in pending/ (``running``: the ids this daemon runs): forget
        what left, queue what is not known yet, and with ``recheck_waiting`` (a rescan) queue
        the waiters whose wait something may have ended since they were gated: what others
        filed or rewrote, which only a rescan sees (:meth:`~.quiet.QuietWaits._left_alone`
        leaves the others alone). Those are looked at by turns with other work
        (:meth:`next_ready`): 20,000 of them queued ahead of it held a new handoff for
        seconds."""
        stamps = self._take_stamps() if recheck_waiting else None
        with self.cv:
            if self.parked_ids or self.rate_held_ids or self.first_seen or self.unroutable \
                    or self.waiting or self.quiet_stamps or self.looked or self.full_due \
                    or self.behind_peeks or self.deadline_at:
                self._forget_gone(set(ids))
            if recheck_waiting:
                self._count_rescan(stamps)
            now = self.monotonic()
            for handoff_id in ids:
                # a waiter queued for its deadline is looked at again at a recheck too: what
                # ends its wait may have come from elsewhere (a resume, another process's
                # filing of the child a parked parent waits for), seen only at its deadline
                rechecked = recheck_waiting and handoff_id in self.waiting
                if handoff_id in running or (handoff_id in self.queued and not rechecked) \
                        or handoff_id in self.readied or handoff_id in self.parked_ids \
                        or handoff_id in self.rate_held_ids \
                        or handoff_id in self.released or handoff_id in self.unroutable \
                        or (not recheck_waiting and handoff_id in self.waiting):
                    continue
                if not rechecked:
                    self.notify(handoff_id)
                elif handoff_id not in self.rechecks and not self._left_alone(handoff_id, now):
                    self.rechecks[handoff_id] = now
            if self.rechecks:
                self.cv.notify()

    def _forget_gone(self, present: set[str]) -> None:
        """A scan's tidying (under ``cv``): the books of ids no longer in pending/."""
        for gone in [hid for hid in self.waiting if hid not in present]:
            self.waiting.pop(gone, None)  # claimed or filed elsewhere
            self.waits_on.pop(gone, None)
            self.fails_on.pop(gone, None)
            # the features drop what they remember of it too (the dependencies feature's
            # progress and awaited ids stayed for ever: a waiter cancelled, or run by another
            # daemon or process, leaves without passing this daemon's gate, review RH)
            self._full_recheck(gone)
        self._forget_waiters(present, self.waiting)
        for gone in [hid for held in (self.parked_ids, self.rate_held_ids)
                     for hid in held if hid not in present]:
            self.unpark(gone)
        for gone in [hid for hid in self.first_seen if hid not in present]:
            del self.first_seen[gone]  # claimed or filed elsewhere
        for gone in [hid for hid in self.not_before if hid not in present]:
            del self.not_before[gone]
        for gone in [hid for hid in self.deadline_at if hid not in present]:
            del self.deadline_at[gone]
        for gone in [hid for hid in self.behind_peeks if hid not in present]:
            del self.behind_peeks[gone]  # (read again in its turn: found gone then)
        # with a shared store, other hosts run what we have no specialist for: forget
        # those once they leave pending (the set would otherwise grow for ever)
        self.unroutable &= present

    def next_ready(self, now: float) -> tuple[str, Peek | None] | None:
        """The most urgent due handoff. Due ids move from the time heap into a bounded ready
        window (read once each to learn their priority); the window hands out the lowest
        (priority, due time) first, so a critical handoff overtakes a backlog of low ones.
        A waiter a rescan queued again (``rechecks``) is handed out when nothing else is, or
        every other time: a new handoff never waits behind a rescan's rechecks for more than
        one, and they are never starved by a stream of new work."""
        self._fill(now)
        if self.rechecks and (not self.ready or not self.rechecked_last):
            recheck = self._next_recheck()
            if recheck is not None:
                self.rechecked_last = True
                return recheck
        self.rechecked_last = False
        if not self.ready:
            return None
        rank, due, seq, handoff_id, peek, looked = heapq.heappop(self.ready)
        self.readied.discard(handoff_id)
        if self.ahead:
            self.ahead.pop(handoff_id, None)
        self.picked, self.turn = (handoff_id, (rank, due, seq)), None
        self.picked_look = (handoff_id, looked)
        return handoff_id, peek

    def _fill(self, now: float) -> None:
        """Move the due ids of the time heap (and of ``behind``, due before them) into the
        ready window, each read once, while it has room (one read past the window is not made
        again: its peek was kept with it); a hard deadline read with one is kept in ``ahead``
        (:meth:`look_ahead` answers it then, should every worker still be busy)."""
        heap, behind = self.heap, self.behind
        while len(self.ready) < READY_WINDOW:
            kept = None
            if behind and (not heap or behind[0] < heap[0]):  # (all due: read when they were)
                due, _, _, handoff_id = heapq.heappop(behind)
                if self.behind_peeks:
                    kept = self.behind_peeks.get(handoff_id)
                    if kept is not None and kept[0] == due:
                        del self.behind_peeks[handoff_id]  # (void or used: it goes)
                    else:
                        kept = None
            elif heap and heap[0][0] <= now:
                due, _, _, handoff_id = heapq.heappop(heap)
            else:
                break
            if self.queued.get(handoff_id) != due:
                continue  # superseded by an earlier notification
            del self.queued[handoff_id]
            self.backoffs.pop(handoff_id, None)  # (a batch waited for it once)
            if self.behind_at and (was := self.behind_at.pop(handoff_id, None)) is not None \
                    and was[1] <= now:
                kept = None  # (its deadline passed behind: read afresh, answered as it is now)
            peek: Peek | None
            if kept is not None:  # read past the window: taken as it was read there
                _, peek, looked = kept
            else:
                looked = self.rescans
                peek = self._read(handoff_id)
                if peek is None:
                    continue
            rank = peek.priority if peek.readable else -1  # set unreadable files aside first
            heapq.heappush(self.ready, (rank, due, next(self.seq), handoff_id, peek, looked))
            self.readied.add(handoff_id)
            deadline = self.hard_deadline(handoff_id, peek)  # (None at once but for hi_moe)
            if deadline is not None:
                at = self._after_read(now, (deadline - self.engine.clock()).total_seconds())
                self.ahead[handoff_id] = at
                self._note_deadline(handoff_id, at)

    def _after_read(self, now: float, left: float) -> float:
        """The monotonic time ``left`` seconds (by the wall clock, just read) after a read just
        made in a turn that began at ``now``: reckoned from the clock at the read, not from
        ``now``, which is early by the turn's reads (a message held off till a deadline early
        by that much was started just before its deadline rather than answered TIMEOUT: review
        R47); never from before ``now`` (a caller looking ahead of the clock)."""
        return max(now, self.monotonic()) + left

    def _note_deadline(self, handoff_id: str, at: float) -> None:
        """Remember the hard deadline ``at`` (monotonic) just read with ``handoff_id``, for a
        hold-off that may come after it is handed out (:meth:`hold_off`)."""
        self.deadline_at[handoff_id] = at
        if len(self.deadline_at) > MAX_HELD_OFF:  # (the oldest first: dicts keep order)
            del self.deadline_at[next(iter(self.deadline_at))]

    def look_ahead(self, now: float) -> list[tuple[str, datetime]]:
        """Every worker is busy (called by the loop under ``cv``): the handoffs to answer
        TIMEOUT now, without a free slot, each with its hard deadline, no longer queued. Seed
        000's hard timeout counts from its arrival, and the receiver must answer before it;
        read only when a worker was free, a message that came while slow handlers held them all
        was claimed when one finished, its deadline counted from then, and run. So, once the
        youngest task is LOOK_AHEAD_AFTER_SECONDS old, the due ids are read into the window
        (the read a worker would make: kept with them), which stamps when a hard-timeout one
        was first seen (:meth:`arrival`); its deadline is kept in ``ahead``. With the window
        full, the due ids past it are read too (:meth:`_look_behind`): a message behind more
        than READY_WINDOW due handoffs was answered only when its turn came. The loop wakes
        for the first deadline (:meth:`ahead_at`)."""
        overdue: list[tuple[str, datetime]] = []
        if self.spin_up_at() - self.spin_up + LOOK_AHEAD_AFTER_SECONDS <= now:
            self._fill(now)
            if len(self.ready) >= READY_WINDOW:
                self._look_behind(now, overdue)
        for handoff_id, at in list(self.ahead.items()):
            if handoff_id not in self.readied:
                del self.ahead[handoff_id]  # handed out meanwhile (a worker took it)
            elif at <= now:
                del self.ahead[handoff_id]
                entry = next((e for e in self.ready if e[3] == handoff_id), None)
                deadline = None if entry is None else self.hard_deadline(handoff_id, entry[4])
                if entry is None or deadline is None:
                    continue
                left = (deadline - self.engine.clock()).total_seconds()
                if left > 0:  # (its stamp was forgotten and taken again meanwhile)
                    self.ahead[handoff_id] = self._after_read(now, left)
                    continue
                self.ready.remove(entry)
                heapq.heapify(self.ready)
                self.readied.discard(handoff_id)
                overdue.append((handoff_id, deadline))
        while self.deadlines_behind and self.deadlines_behind[0][0] <= now:
            at, handoff_id = heapq.heappop(self.deadlines_behind)
            kept = self.behind_at.get(handoff_id)
            if kept is None or kept[1] != at:
                continue  # taken into the window (or read again) since
            del self.behind_at[handoff_id]
            answer = self._overdue_behind(handoff_id, kept[0], now)
            if answer is not None:
                overdue.append((handoff_id, answer))
        return overdue

    def _look_behind(self, now: float, overdue: list[tuple[str, datetime]]) -> None:
        """The ready window is full and every worker busy: read the due ids past it, once
        each and READY_WINDOW a turn (the loop comes back for more: :meth:`ahead_at`), and
        keep the hard deadlines read (at most MAX_BEHIND_DEADLINES). Their entries go to
        ``behind``, and keep their turn, with what was read (up to MAX_BEHIND_PEEKS: the window
        takes it as read, not reading it again); nothing is read again before (a rescan leaves
        queued ids alone), so a backlog at rest costs nothing more. One read past its hard
        deadline already (held off till it: :meth:`hold_off`) is added to ``overdue`` as read,
        no longer queued."""
        reads = 0
        while reads < READY_WINDOW and len(self.behind_at) < MAX_BEHIND_DEADLINES \
                and self.heap and self.heap[0][0] <= now:
            entry = heapq.heappop(self.heap)
            due, handoff_id = entry[0], entry[3]
            if self.queued.get(handoff_id) != due:
                continue  # superseded by an earlier notification (or a WAKE)
            reads += 1
            del self.queued[handoff_id]  # (as _fill: a memory back-off queues it afresh)
            looked = self.rescans
            peek = self._read(handoff_id)
            if peek is None:
                continue
            deadline = self.hard_deadline(handoff_id, peek)  # (stamps its arrival: hi_moe)
            left = None
            if deadline is not None:
                left = (deadline - self.engine.clock()).total_seconds()
                if left <= 0:  # (just read: answered as read, not read again for it)
                    self.backoffs.pop(handoff_id, None)
                    overdue.append((handoff_id, deadline))
                    continue
            self.queued[handoff_id] = due
            heapq.heappush(self.behind, entry)
            if len(self.behind_peeks) < MAX_BEHIND_PEEKS:
                self.behind_peeks[handoff_id] = (due, peek, looked)
            if left is not None:
                self._keep_behind(handoff_id, due, self._after_read(now, left))

    def _keep_behind(self, handoff_id: str, due: float, at: float) -> None:
        """Keep the hard deadline ``at`` (monotonic) of ``handoff_id``, behind with ``due``."""
        self.behind_at[handoff_id] = (due, at)
        self._note_deadline(handoff_id, at)
        heapq.heappush(self.deadlines_behind, (at, handoff_id))
        if len(self.deadlines_behind) > 2 * len(self.behind_at) + READY_WINDOW:
            # (void ones, of ids taken into the window, are dropped: its size stays bounded)
            self.deadlines_behind = [(kept, hid) for hid, (_, kept) in self.behind_at.items()]
            heapq.heapify(self.deadlines_behind)

    def _overdue_behind(self, handoff_id: str, due: float, now: float) -> datetime | None:
        """``handoff_id``, behind the window with ``due``, reached the hard deadline read with
        it: read again (it may have changed, or gone); its deadline, no longer queued, when it
        has passed; else None, its place kept (and a later deadline with it)."""
        if self.queued.get(handoff_id) != due:
            return None  # queued again meanwhile (looked at first, held off): read then
        del self.queued[handoff_id]  # (as _fill: a memory back-off queues it afresh)
        self.behind_peeks.pop(handoff_id, None)  # (read afresh here)
        looked = self.rescans
        peek = self._read(handoff_id)
        if peek is None:
            return None  # gone: claimed elsewhere, or filed
        deadline = self.hard_deadline(handoff_id, peek)
        left = None if deadline is None else (deadline - self.engine.clock()).total_seconds()
        if left is None or left > 0:  # (no deadline now, or a later one: e.g. retried)
            self.queued[handoff_id] = due  # its entry behind stands, with this read
            if len(self.behind_peeks) < MAX_BEHIND_PEEKS:
                self.behind_peeks[handoff_id] = (due, peek, looked)
            if left is not None:
                self._keep_behind(handoff_id, due, self._after_read(now, left))
            return None
        self.backoffs.pop(handoff_id, None)
        return deadline

    def ahead_at(self, now: float) -> float | None:
        """When the loop must wake, every worker busy: the first hard deadline ``ahead`` or
        behind the window, or when :meth:`look_ahead` may read what is due (None: nothing to
        wait for)."""
        times = list(self.ahead.values())
        if self.deadlines_behind:
            times.append(self.deadlines_behind[0][0])
        first = None  # when the first due handoff look_ahead would read is
        if len(self.ready) < READY_WINDOW:
            first = self.first_due(now) if self.heap or self.behind else None
        elif self.heap and len(self.behind_at) < MAX_BEHIND_DEADLINES:
            first = self.heap[0][0]  # (read past the full window)
        if first is not None:
            times.append(max(first, self.spin_up_at() - self.spin_up + LOOK_AHEAD_AFTER_SECONDS))
        return min(times, default=None)

    def first_due(self, now: float) -> float:
        """When the first queued handoff is due (``now`` for one behind the window, read past
        it: due already); ``now`` when none is queued."""
        return min(self.heap[0][0] if self.heap else now, now if self.behind else math.inf)

    def _next_recheck(self) -> tuple[str, Peek] | None:
        """The next waiter a rescan queued again, read (None when none is left to look at;
        after READY_WINDOW reads of vanished ones the loop is woken to go on)."""
        reads = 0
        while self.rechecks:
            if reads >= READY_WINDOW:
                self.wake_at(self.monotonic())
                return None
            handoff_id, since = self.rechecks.popitem(last=False)
            if handoff_id not in self.waiting or handoff_id in self.readied:
                continue  # woken meanwhile (queued first), or read and waiting its turn
            reads += 1
            looked = self.rescans
            peek = self._read(handoff_id)
            if peek is None:
                continue
            rank = peek.priority if peek.readable else -1
            self.picked, self.turn = (handoff_id, (rank, since, next(self.seq))), None
            self.picked_look = (handoff_id, looked)
            return handoff_id, peek
        return None

    def _read(self, handoff_id: str) -> Peek | None:
        """``handoff_id``'s pending document as :meth:`~.Engine.peek` reads it; None (and
        forgotten) when it is gone: claimed elsewhere, or filed. None too, unread, while its
        last read ran out of memory and backs off (:func:`~handoffd.core.memorystrikes.memory_backoff`):
        looked at again then; the others proceed meanwhile."""
        backoff = memory_backoff(handoff_id)
        if backoff > 0:
            self.notify(handoff_id, backoff)
            return None
        try:
            peek = self.engine.peek(handoff_id)
        except Exception:  # peek never raises; if it ever does, the file is set aside
            log.exception("handoff %s: cannot be read", handoff_id)
            peek = Peek(handoff_id, readable=False)
        if peek is None:
            self.unpark(handoff_id)
            self.unhold(handoff_id)
            # gone without passing this daemon's gate (cancelled, run by another process): the
            # features forget it too, as a scan's tidying does (_forget_gone), which no longer
            # sees it once unhold took it from the waiters: the dependencies feature kept its
            # progress for ever, and its oldest progress pins every later note (review RC)
            self._full_recheck(handoff_id)
        elif peek.readable:
            memory_strikes.clear(handoff_id, "read")  # (a MemoryError row ends)
        return peek

    def due_soon(self) -> bool:
        """Batch mode: something queued that is due now (or within a settle window), or held
        for a token due by then, or handed back for a start shortage with a back-off that ends
        before the batch must (:meth:`backed_off_soon`)."""
        limit = time.monotonic() + self.engine.settings.settle_seconds + 0.05
        return bool(self.ready) or bool(self.rechecks) \
            or any(due <= limit for due in self.queued.values()) \
            or any(self.rate_until.get(agent, 0.0) <= limit for agent in self.rate_held) \
            or self.backed_off_soon()

    def back_off(self, handoff_id: str, delay: float) -> None:
        """``handoff_id`` was handed back for a passing start shortage, due again in ``delay``
        seconds: looked at again then (no sooner), and a batch waits for it if it can."""
        self.hold_off(handoff_id, delay)
        with self.cv:
            due = self.queued.get(handoff_id)
            if due is None:  # (looked at already: nothing to wait for)
                return
            self.backoffs[handoff_id] = due
            if len(self.backoffs) > MAX_HELD_OFF:
                del self.backoffs[next(iter(self.backoffs))]

    def backed_off_soon(self) -> bool:
        """A start-shortage back-off (:meth:`back_off`) ends before ``--max-seconds`` does, or,
        without it, within BACKOFF_WAIT_SECONDS: a batch waits it out and runs the handoff
        rather than end handing it back (one back-off each: once it is looked at, it is
        forgotten, so a shortage that lasts ends the batch after a few doubling waits)."""
        if not self.backoffs:
            return False
        bound = self.batch_deadline if self.batch_deadline < math.inf \
            else time.monotonic() + BACKOFF_WAIT_SECONDS
        for handoff_id, due in list(self.backoffs.items()):
            if self.queued.get(handoff_id) != due:
                del self.backoffs[handoff_id]  # (superseded, or looked at already)
            elif due < bound:
                return True
        return False

    # ------------------------------------------------------------ slots
    def start(self, agent: str) -> int:
        """Count a task about to be submitted against ``agent``'s slots; returns its token."""
        token = next(self.seq)
        self.last_dispatch = time.monotonic()
        self.inflight[token] = (agent, self.last_dispatch)
        self.busy[agent] += 1
        self.running += 1
        return token

    def finished(self, token: int) -> None:
        """Give the slot of task ``token`` back (once; a second call does nothing)."""
        task = self.inflight.pop(token, None)
        if task is None:
            return
        agent = task[0]
        self.busy[agent] -= 1
        if self.busy[agent] <= 0:
            del self.busy[agent]
        self.running = max(self.running - 1, 0)

    def spin_up_at(self) -> float:
        """When the scheduler may start another worker: at once when none runs, else when the
        youngest running task is ``spin_up`` seconds old (called under ``cv``)."""
        youngest = -math.inf  # (a loop: asked at every chain, a generator was three calls)
        for _, started in self.inflight.values():
            if started > youngest:
                youngest = started
        return youngest + self.spin_up

    # ------------------------------------------------------------ gates, rates, deadlines
    def hold(self, handoff_id: str, reason: str, on: frozenset[str] | None,
             fails_on: tuple[str, ...] = ()) -> None:
        """A gate holds ``handoff_id`` back for ``reason`` until a filing (of one of ``on``,
        or of any handoff when None; or of one of ``fails_on`` into failed/) may end it. Called
        by the dispatch of the id :meth:`next_ready` handed out last (the rescan count when its
        read began is kept with the wait; for any other, none: its next rescan queues it)."""
        picked = self.picked_look
        self._held(handoff_id, picked[1] if picked is not None and picked[0] == handoff_id
                   else -1)
        self.waiting[handoff_id] = reason
        if on is None:
            self.waits_on.pop(handoff_id, None)
        else:
            self.waits_on[handoff_id] = on
        if fails_on:
            self.fails_on[handoff_id] = fails_on
        else:
            self.fails_on.pop(handoff_id, None)

    def unhold(self, handoff_id: str) -> None:
        """No gate holds ``handoff_id`` back (any more)."""
        if handoff_id not in self.waiting and handoff_id not in self.looked:
            # (the usual handoff, never held: a hold notes it in both, and its waits_on,
            # fails_on and quiet stamps go when it leaves ``waiting``; ``looked`` and
            # ``full_due`` are kept past a wake, until this or a rescan's tidying)
            return
        self.waiting.pop(handoff_id, None)
        self.waits_on.pop(handoff_id, None)
        self.fails_on.pop(handoff_id, None)
        self._forget_waiter(handoff_id)

    def ended(self, handoff_id: str, failed: bool = False) -> None:
        """``handoff_id`` was filed for good (``failed``: into failed/): forget when it
        arrived, and look again at the handoffs whose wait its filing may end (a dependency
        may have been met, or have failed)."""
        self.first_seen.pop(handoff_id, None)
        self.wake(handoff_id, failed)

    def wake(self, handoff_id: str, failed: bool = False) -> None:
        """Look again at the handoffs whose wait ``handoff_id``'s filing may end: a final one
        (:meth:`ended`; ``failed``: into failed/), or one back to pending/ (a retry, a parked
        parent), whose attempt ended all the same and freed what it held (a contract's files)."""
        for waiter in list(self.waiting):
            on = self.waits_on.get(waiter)
            if on is not None and handoff_id not in on and not (
                    failed and handoff_id in self.fails_on.get(waiter, ())):
                continue  # only other handoffs' filing can end this wait
            self.waiting.pop(waiter, None)
            self.waits_on.pop(waiter, None)
            self.fails_on.pop(waiter, None)
            self.quiet_stamps.pop(waiter, None)
            self.look_first(waiter)

    def deadline(self, handoff_id: str, peek: Peek) -> datetime | None:
        """When a pending handoff must be claimed whatever holds it back: to be answered unrun
        at its ``expires_at`` (unless it started already: parked, or answered, see
        :func:`~handoffd.core.admission.resumes`), or its hard deadline counted from its
        arrival (:meth:`arrival`); a parent waiting for its children, to be aggregated once its
        deadline has passed (its open children cancelled). None without any."""
        env = peek.envelope
        if env is None:
            return None
        block = peek.doc.get(BOOK) if peek.doc is not None else None
        wait = block.get("waiting_children") if isinstance(block, dict) else None
        if isinstance(wait, dict):
            return aggregation.deadline_of(wait)
        hard = None
        if env.hard_timeout:
            hard = self.engine.deadline(env, self.engine.specialist_for(env),
                                        self.arrival(handoff_id, peek))
        expires = env.expires_at
        if expires is not None and peek.doc is not None and resumes(peek.doc):
            expires = None  # it started in time: expiry bounds starts only
        return min(filter(None, (hard, expires)), default=None)

    def hard_deadline(self, handoff_id: str, peek: Peek) -> datetime | None:
        """A pending handoff's seed 000 hard deadline (:meth:`arrival` + its time limit);
        None without one, or for a parent waiting for its children (aggregated instead)."""
        env = peek.envelope
        if env is None or not env.hard_timeout:
            return None
        block = peek.doc.get(BOOK) if peek.doc is not None else None
        if isinstance(block, dict) and isinstance(block.get("waiting_children"), dict):
            return None
        return self.engine.deadline(env, self.engine.specialist_for(env),
                                    self.arrival(handoff_id, peek))

    def arrival(self, handoff_id: str, peek: Peek) -> datetime:
        """When a pending hard-timeout handoff arrived, as admission counts it: the earlier of
        when this daemon first saw it pending and the first event (or last ``retried``) of its
        own history, a `handoff retry` later than that sighting counting from the retry
        (:func:`~handoffd.core.documents.arrival`). A throttle, a retry, an
        answer or a hand-back puts it back in pending/ after its claim made us forget when we
        first saw it: counted from then, it was answered TIMEOUT that much past its deadline.
        The peek's document is its trusted view (a block whose seal is not ours is left out of
        it, as the claim empties it), so bookkeeping from outside never moves the deadline."""
        seen = self.first_seen.setdefault(handoff_id, self.engine.clock())
        return arrival(peek.doc, seen) or seen  # (a stamp from before a `handoff retry`: stale)

    def look_again_at(self, handoff_id: str, deadline: datetime | None) -> None:
        """A handoff that cannot start now but has a hard deadline is looked at again then: if
        it is still pending it is answered TIMEOUT (seed 000: the sender stops waiting)."""
        if deadline is not None:
            self.notify(handoff_id, (deadline - self.engine.clock()).total_seconds())

    # ------------------------------------------------------------ rebuilding
    def reset(self) -> None:
        """Throw the bookkeeping away, rebuild the slot counts from the tasks in flight and
        ask for a rescan of pending/ (the progress watchdog's remedy for a stall)."""
        with self.cv:
            self.heap.clear()
            self.ready.clear()
            self.readied.clear()
            self.queued.clear()
            self.backoffs.clear()
            self._clear_lines()
            self.busy = Counter(agent for agent, _ in self.inflight.values())
            self.running = len(self.inflight)
            self.rechecks.clear()
            self.ahead.clear()
            self.behind.clear()
            self.behind_at.clear()
            self.deadlines_behind.clear()
            self.behind_peeks.clear()
            self.waiting.clear()
            self.waits_on.clear()
            self.fails_on.clear()
            self._clear_waits()
            self.unroutable.clear()
            self.rescan_requested = True
            self.last_dispatch = time.monotonic()
            self.cv.notify_all()
