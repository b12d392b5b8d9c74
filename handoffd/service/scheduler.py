"""The scheduler's books: when to look at which pending handoff, and which may start now.

The dispatch rules that read them are in :mod:`.dispatch`; the daemon's loop (:mod:`.daemon`)
and its finishing workers ask them for the next handoff. Everything here is guarded by ``cv``,
the daemon's one condition variable (re-entrant: the rules call each other under it).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from datetime import datetime

from ..core.admission import resumes
from ..core.documents import BOOK
from ..core.engine import Engine, Peek
from ..core.specialists import Specialist
from ..core.storage import LiveStamp
from ..features import aggregation
from .report import BatchReport

log = logging.getLogger("handoffd")
READY_WINDOW = 64  # due handoffs read ahead to order by priority
# With durability "fast", another worker starts only once every running task is this old: a
# task about to finish chains to the next due handoff itself (dispatch.Dispatcher.chain), and
# short handoffs drain fastest on one thread (2,000 no-op handoffs: 1 worker 516-552/s, 4 side
# by side 380-395/s, lost to the GIL's hand-overs and the folders' locks). Slow handlers still
# run side by side, this much later. With fsync, a handoff mostly waits for the disk, which
# overlaps: no delay.
SPIN_UP_SECONDS = 0.005
RETRY_LOOK_SECONDS = 5.0  # an item the scheduler could not handle is looked at again this late
DEFAULT_RANK = 2  # the priority of an id parked without having been read (normal)
WAKE = ""  # a time-heap entry that only wakes the loop (no handoff id is empty)
# a place in a line: (priority rank, when it became due, arrival): the lowest goes first
Place = tuple[int, float, int]


class Line:
    """One agent's ids waiting for a slot or a token, most urgent first: a heap of places with
    lazy removal (O(log n) in and out). Iterating yields the ids in the order they will leave."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, float, int, str]] = []
        self.places: dict[str, Place] = {}

    def add(self, handoff_id: str, place: Place) -> None:
        self.places[handoff_id] = place
        heapq.heappush(self.heap, (*place, handoff_id))

    def remove(self, handoff_id: str) -> Place | None:
        place = self.places.pop(handoff_id, None)
        if place is not None and len(self.heap) > 2 * len(self.places) + 64:
            self.heap = [(*at, hid) for hid, at in self.places.items()]  # drop the dead
            heapq.heapify(self.heap)
        return place

    def _top(self) -> tuple[int, float, int, str] | None:
        while self.heap:
            entry = self.heap[0]
            if self.places.get(entry[3]) == entry[:3]:
                return entry
            heapq.heappop(self.heap)  # removed, or added again elsewhere in the line
        return None

    def head(self) -> Place | None:
        """The place of the id that leaves next (None: the line is empty)."""
        top = self._top()
        return None if top is None else top[:3]

    def pop(self) -> tuple[str, Place]:
        top = self._top()
        if top is None:
            raise IndexError("pop from an empty line")
        heapq.heappop(self.heap)
        del self.places[top[3]]
        return top[3], top[:3]

    def __len__(self) -> int:
        return len(self.places)

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self.places

    def __iter__(self) -> Iterator[str]:
        return iter([hid for _, hid in sorted((at, hid) for hid, at in self.places.items())])


class Scheduler:
    """The scheduling bookkeeping of one daemon, all guarded by ``cv``:

    * ``heap``/``queued``: when to look at an id next; ``ready``/``readied``: ids read and waiting
      for a worker, most urgent first.
    * ``parked[agent]``: a :class:`Line` of due ids waiting for one of the agent's concurrency
      slots, most urgent first (priority, then due time; ``parked_ids`` maps each back to its
      agent). On every loop iteration :meth:`release_parked` lets out as many as the agent has
      free slots, minus releases still in flight (``released``/``releasing``); a released id
      leaves that set when it is dispatched again or turns out gone, so a release is never lost
      on a dead entry.
    * ``rate_held[agent]``: the same for the agent's rate limit (``rate_held_ids``): due ids held
      until its next token (``rate_until``). They are not read again while they wait: when the
      token is due, :meth:`release_parked` lets out the head alone (``rate_turn``), which takes
      it, or is held again at its place when another process took it meanwhile (one read and one
      bucket update per token, whatever the backlog). A ``WAKE`` entry in the time heap wakes
      the loop then.
    * ``picked``/``turn``: the place of the id just handed out (:meth:`next_ready`), and the
      place it had in a line it was just taken out of (:meth:`unpark`), so that it goes back
      where it was (:meth:`_place`).
    * ``inflight``: one entry per task submitted to the pool (its agent, when it started: see
      :meth:`spin_up_at`); ``busy`` and ``running`` are counts of it, kept in step by
      :meth:`start` and :meth:`finished` only.
    * ``waiting``/``waits_on``: handoffs a gate holds back, and the ids whose filing may end it;
      ``unroutable``: handoffs no specialist here takes (both shared with the run's report);
      ``quiet_stamps``: the waiters a rescan does not read again while their document is the
      same (:meth:`add_quiet_check`: paused handoffs), each with its document's stamp.

    The progress watchdog (:mod:`.progress`) guards the whole and rebuilds it (:meth:`reset`).
    """

    def __init__(self, engine: Engine, report: BatchReport, *, workers: int) -> None:
        self.engine = engine
        self.workers = workers
        self.cv = threading.Condition()
        self.heap: list[tuple[float, int, int, str]] = []  # (due, _, seq, id): when to look
        self.ready: list[tuple[int, float, int, str, Peek]] = []  # (priority, due, seq, id, peek)
        self.readied: set[str] = set()
        self.queued: dict[str, float] = {}
        self.seq = itertools.count()
        self.parked: dict[str, Line] = {}  # agent -> ids waiting for a slot
        self.parked_ids: dict[str, str] = {}  # id -> agent, for every parked id
        self.released: dict[str, str] = {}  # id -> agent: let out of parking, not yet re-dispatched
        self.releasing: Counter[str] = Counter()  # agent -> len of its entries in released
        self.rate_held: dict[str, Line] = {}  # agent -> ids waiting for its next token
        self.rate_held_ids: dict[str, str] = {}  # id -> agent, for every rate-held id
        self.rate_turn: dict[str, str] = {}  # agent -> the id let out for its next token
        self.rate_turn_ids: dict[str, str] = {}  # the same, id -> agent
        self.out_places: dict[str, Place] = {}  # id let out of a line -> the place it had
        self.picked: tuple[str, Place] | None = None  # the id next_ready handed out last
        self.turn: tuple[str, Place] | None = None  # the id unpark took out of a line last
        # pool task token -> (agent ("" for set-aside work), monotonic time it started)
        self.inflight: dict[int, tuple[str, float]] = {}
        self.spin_up = 0.0 if engine.settings.durable else SPIN_UP_SECONDS
        self.busy: Counter[str] = Counter()  # agent -> tasks in flight (a count of inflight)
        self.running = 0  # len(inflight)
        self.last_dispatch = time.monotonic()
        self.stopping = False  # nothing more starts
        self.batch_deadline = math.inf  # run_batch(max_seconds=): nothing starts after it
        self.rescan_requested = True
        self.first_seen: dict[str, datetime] = {}  # hard-timeout handoffs seen pending, by id
        self.rate_until: dict[str, float] = {}  # agent -> monotonic time its next start is due
        self.unroutable = report.unroutable
        self.waiting = report.waiting  # handoff id -> why a gate holds it back
        # handoff id -> the ids whose filing may end its wait (absent: any filing may); a chain
        # of 1,000 dependents is then re-checked one handoff per filing, not 1,000
        self.waits_on: dict[str, frozenset[str]] = {}
        self.quiet_checks: list[Callable[[str], bool]] = []
        # quiet waiter id -> the stamp of its document when a rescan last queued it to be read
        # again: while the stamp is the same, what it was read as is what is stored
        self.quiet_stamps: dict[str, LiveStamp] = {}

    def limit(self, spec: Specialist) -> int:
        """How many handoffs of ``spec`` this daemon runs at once: its ``concurrency``, else as
        many as there are workers (children of one fan-out run side by side, as seed 000 has it)."""
        return spec.config.concurrency or self.workers

    # ------------------------------------------------------------ when to look
    def notify(self, handoff_id: str, delay: float = 0.0) -> None:
        """Hint that ``handoff_id`` may be due in ``delay`` seconds (watchdog, scans, retries)."""
        due = time.monotonic() + delay
        with self.cv:
            if handoff_id in self.readied and delay == 0:
                return  # already read and waiting its turn in the ready window
            current = self.queued.get(handoff_id)
            if current is not None and current <= due:
                return
            self.queued[handoff_id] = due
            heapq.heappush(self.heap, (due, 2, next(self.seq), handoff_id))
            self.cv.notify()

    def request_rescan(self) -> None:
        """Ask the loop to list pending/ again (events may have been lost)."""
        with self.cv:
            self.rescan_requested = True
            self.cv.notify()

    def listed(self, ids: Sequence[str], running: Collection[str], *,
               recheck_waiting: bool) -> None:
        """A scan listed ``ids`` in pending/ (``running``: the ids this daemon runs): forget
        what left, queue what is not known yet (waiting ids only when ``recheck_waiting``, a
        quiet one only when its document changed: :meth:`add_quiet_check`)."""
        stamps = self._stamps_for_quiet() if recheck_waiting else None
        with self.cv:
            if self.parked_ids or self.rate_held_ids or self.first_seen or self.unroutable \
                    or self.waiting or self.quiet_stamps:
                present = set(ids)
                for gone in [hid for hid in self.waiting if hid not in present]:
                    self.waiting.pop(gone, None)  # claimed or filed elsewhere
                    self.waits_on.pop(gone, None)
                for gone in [hid for hid in self.quiet_stamps if hid not in self.waiting]:
                    del self.quiet_stamps[gone]  # gone, or no longer waiting (e.g. resumed)
                for gone in [hid for held in (self.parked_ids, self.rate_held_ids)
                             for hid in held if hid not in present]:
                    self.unpark(gone)
                for gone in [hid for hid in self.first_seen if hid not in present]:
                    del self.first_seen[gone]  # claimed or filed elsewhere
                # with a shared store, other hosts run what we have no specialist for: forget
                # those once they leave pending (the set would otherwise grow for ever)
                self.unroutable &= present
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
                if rechecked and self._quiet_and_unchanged(handoff_id, stamps):
                    continue  # read as it is stored, and only a change of it ends its wait
                self.notify(handoff_id)

    def add_quiet_check(self, check: Callable[[str], bool]) -> None:
        """``check(id)`` true: the wait of the waiter ``id``, held with ``on=()`` (no filing
        ends it), ends only with a change of its own document or when the feature holding it
        queues it itself (a resume: ``Daemon.queue``). A rescan then reads it again only when
        its document's stamp changed: 5,000 paused handoffs were read and parsed again at each
        rescan, for ever (0.35 s of CPU every 5 s). Asked at each rescan, for each such waiter."""
        with self.cv:
            self.quiet_checks.append(check)

    def _stamps_for_quiet(self) -> dict[str, LiveStamp | None] | None:
        """The stamps of the live documents (one listing, none read) when a waiter may be quiet;
        None when none may be, or when the store has no stamps or cannot give them now (every
        waiter is read again then). Taken before the rescan's ``cv`` section, where a quiet
        waiter's stamp is recorded only as it is queued to be read: that read comes after it."""
        with self.cv:
            wanted = bool(self.quiet_checks) and any(not on for on in self.waits_on.values())
        if not wanted:
            return None
        try:
            return self.engine.backend.live_stamps()
        except Exception as exc:  # e.g. EMFILE: they are all read again, as before; not fatal
            log.warning("cannot stamp the pending documents (%s); the waiting ones are read "
                        "again", exc)
            return None

    def _quiet_and_unchanged(self, handoff_id: str,
                             stamps: dict[str, LiveStamp | None] | None) -> bool:
        """True when the waiter ``handoff_id`` is quiet (:meth:`add_quiet_check`) and its
        document's stamp in ``stamps`` is the one recorded when a rescan last queued it: the read
        that holds it back came after that, so it saw what is stored now. Otherwise the stamp
        (if any) is recorded for the read the caller queues now (called under ``cv``)."""
        stamp = stamps.get(handoff_id) if stamps is not None else None
        on = self.waits_on.get(handoff_id)
        if stamp is None or on is None or on or not self._quiet(handoff_id):
            self.quiet_stamps.pop(handoff_id, None)
            return False
        if self.quiet_stamps.get(handoff_id) == stamp:
            return True
        self.quiet_stamps[handoff_id] = stamp
        return False

    def _quiet(self, handoff_id: str) -> bool:
        """What the quiet checks say of the waiter ``handoff_id`` (False when one fails, e.g.
        its records cannot be read: the gate, which says why, runs on the read queued now)."""
        try:
            return any(check(handoff_id) for check in self.quiet_checks)
        except Exception:
            return False

    def next_ready(self, now: float) -> tuple[str, Peek | None] | None:
        """The most urgent due handoff. Due ids move from the time heap into a bounded ready
        window (read once each to learn their priority); the window hands out the lowest
        (priority, due time) first, so a critical handoff overtakes a backlog of low ones."""
        while self.heap and self.heap[0][0] <= now and len(self.ready) < READY_WINDOW:
            due, _, _, handoff_id = heapq.heappop(self.heap)
            if self.queued.get(handoff_id) != due:
                continue  # superseded by an earlier notification
            del self.queued[handoff_id]
            try:
                peek = self.engine.peek(handoff_id)
            except Exception:  # peek never raises; if it ever does, the file is set aside
                log.exception("handoff %s: cannot be read", handoff_id)
                peek = Peek(handoff_id, readable=False)
            if peek is None:
                self.unpark(handoff_id)  # gone: claimed elsewhere, or filed
                continue
            rank = peek.priority if peek.readable else -1  # set unreadable files aside first
            heapq.heappush(self.ready, (rank, due, next(self.seq), handoff_id, peek))
            self.readied.add(handoff_id)
        if not self.ready:
            return None
        rank, due, seq, handoff_id, peek = heapq.heappop(self.ready)
        self.readied.discard(handoff_id)
        self.picked, self.turn = (handoff_id, (rank, due, seq)), None
        return handoff_id, peek

    def _place(self, handoff_id: str) -> Place:
        """Where ``handoff_id`` goes in a line: by what :meth:`next_ready` read (priority, due
        time), at the place it had in a line it was just taken out of if any (the priority as
        read now: its document may have been rewritten), else normal, now."""
        picked = self.picked[1] if self.picked and self.picked[0] == handoff_id else None
        if self.turn is not None and self.turn[0] == handoff_id:
            rank, due, seq = self.turn[1]
            return (picked[0] if picked else rank, due, seq)
        return picked or (DEFAULT_RANK, time.monotonic(), next(self.seq))

    def due_soon(self) -> bool:
        """Batch mode: something queued that is due now (or within a settle window), or held
        for a token due by then."""
        limit = time.monotonic() + self.engine.settings.settle_seconds + 0.05
        return bool(self.ready) or any(due <= limit for due in self.queued.values()) \
            or any(self.rate_until.get(agent, 0.0) <= limit for agent in self.rate_held)

    # ------------------------------------------------------------ parking
    def park(self, agent: str, handoff_id: str, *, front: bool = False) -> None:
        """Hold a due ``handoff_id`` until ``agent`` has a free slot (idempotent: parked again,
        it keeps its place). The line is ordered by priority, then due time. ``front``: it was
        already let out once and lost its slot to a newcomer, so it goes first among its
        priority (a more urgent one still goes before it)."""
        self.unpark(handoff_id)
        place = self._place(handoff_id)
        if front:
            place = (place[0], -math.inf, place[2])
        self.parked.setdefault(agent, Line()).add(handoff_id, place)
        self.parked_ids[handoff_id] = agent

    def unpark(self, handoff_id: str) -> None:
        """Forget ``handoff_id`` in parking and in a rate limit's line, and free its release
        (or its turn for a token) if one is in flight. The place it had is kept in ``turn``,
        for it to go back there (:meth:`_place`)."""
        place = self.out_places.pop(handoff_id, None)
        for ids, lines in ((self.parked_ids, self.parked), (self.rate_held_ids, self.rate_held)):
            held_by = ids.pop(handoff_id, None)
            line = lines.get(held_by) if held_by is not None else None
            if held_by is not None and line is not None:
                place = line.remove(handoff_id) or place
                if not line:
                    del lines[held_by]
        agent = self.released.pop(handoff_id, None)
        if agent is not None:
            self.releasing[agent] -= 1
            if self.releasing[agent] <= 0:
                del self.releasing[agent]
        agent = self.rate_turn_ids.pop(handoff_id, None)
        if agent is not None and self.rate_turn.get(agent) == handoff_id:
            del self.rate_turn[agent]
        if place is not None:
            self.turn = (handoff_id, place)

    def release_parked(self) -> None:
        """Let out as many parked ids as each agent has free slots, most urgent first, and the
        head of each rate limit's line whose next token is due (level-triggered: runs on every
        loop iteration, so a free slot or a due token never waits for an event)."""
        for agent in list(self.parked):
            waiting = self.parked[agent]
            spec = self.engine.registry.get(agent)
            limit = self.limit(spec) if spec is not None else len(waiting)
            free = limit - self.busy.get(agent, 0) - self.releasing.get(agent, 0)
            while free > 0 and waiting:
                handoff_id, place = waiting.pop()
                del self.parked_ids[handoff_id]
                self.released[handoff_id] = agent
                self.releasing[agent] += 1
                self.out_places[handoff_id] = place
                self.notify(handoff_id)
                free -= 1
            if not waiting:
                del self.parked[agent]
        if self.rate_held:
            now = time.monotonic()
            for agent in list(self.rate_held):
                if agent in self.rate_turn or self.rate_until.get(agent, 0.0) > now:
                    continue  # one turn at a time; the loop wakes for the token (WAKE)
                waiting = self.rate_held[agent]
                handoff_id, place = waiting.pop()
                del self.rate_held_ids[handoff_id]
                self.rate_turn[agent] = handoff_id
                self.rate_turn_ids[handoff_id] = agent
                self.out_places[handoff_id] = place
                self.notify(handoff_id)
                if not waiting:
                    del self.rate_held[agent]

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
        return max((started for _, started in self.inflight.values()), default=-math.inf) \
            + self.spin_up

    # ------------------------------------------------------------ gates, rates, deadlines
    def hold(self, handoff_id: str, reason: str, on: frozenset[str] | None) -> None:
        """A gate holds ``handoff_id`` back for ``reason`` until a filing (of one of ``on``,
        or of any handoff when None) may end it."""
        self.waiting[handoff_id] = reason
        if on is None:
            self.waits_on.pop(handoff_id, None)
        else:
            self.waits_on[handoff_id] = on

    def unhold(self, handoff_id: str) -> None:
        """No gate holds ``handoff_id`` back (any more)."""
        self.waiting.pop(handoff_id, None)
        self.waits_on.pop(handoff_id, None)
        self.quiet_stamps.pop(handoff_id, None)

    def ended(self, handoff_id: str) -> None:
        """``handoff_id`` was filed for good: forget when it arrived, and look again at the
        handoffs whose wait its filing may end (a dependency may have been met)."""
        self.first_seen.pop(handoff_id, None)
        self.wake(handoff_id)

    def wake(self, handoff_id: str) -> None:
        """Look again at the handoffs whose wait ``handoff_id``'s filing may end: a final one
        (:meth:`ended`), or one back to pending/ (a retry, a parked parent), whose attempt
        ended all the same and freed what it held (a contract's files)."""
        for waiter in list(self.waiting):
            on = self.waits_on.get(waiter)
            if on is not None and handoff_id not in on:
                continue  # only other handoffs' filing can end this wait
            self.waiting.pop(waiter, None)
            self.waits_on.pop(waiter, None)
            self.quiet_stamps.pop(waiter, None)
            self.notify(waiter)

    def rate_limited(self, spec: Specialist, handoff_id: str, deadline: datetime | None) -> bool:
        """True when ``spec``'s rate limit holds ``handoff_id`` back: it waits in the agent's
        line (``rate_held``), by priority then due time, until it is the head when the next
        token is due (:meth:`release_parked`), or until its deadline. The bucket is shared by
        every process of the workspace; ``rate_until`` spares it while this process already
        knows the answer, and so does a more urgent id already waiting for the token."""
        if not spec.config.rate:
            return False
        agent = spec.agent
        now = time.monotonic()
        place = self._place(handoff_id)
        line = self.rate_held.get(agent)
        ahead = line.head() if line is not None else None
        if (ahead is None or place <= ahead) and self.rate_until.get(agent, 0.0) <= now:
            wait = self.engine.start_wait(spec)
            if wait <= 0:
                return False  # the token is taken: it starts
            self.rate_until[agent] = now + wait
            heapq.heappush(self.heap, (now + wait, 2, next(self.seq), WAKE))  # wake for it
        self.rate_held.setdefault(agent, Line()).add(handoff_id, place)
        self.rate_held_ids[handoff_id] = agent
        self.look_again_at(handoff_id, deadline)
        return True

    def deadline(self, handoff_id: str, peek: Peek) -> datetime | None:
        """When a pending handoff must be claimed whatever holds it back: to be answered unrun
        at its ``expires_at`` (unless it started already: parked, or answered, see
        :func:`~handoffd.core.admission.resumes`), or its hard deadline counted from when this
        daemon first saw it (a document's own history is trusted only once it is claimed:
        admission uses that); a parent waiting for its children, to be aggregated once its
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
            arrived = self.first_seen.setdefault(handoff_id, self.engine.clock())
            hard = self.engine.deadline(env, self.engine.specialist_for(env), arrived)
        expires = env.expires_at
        if expires is not None and peek.doc is not None and resumes(peek.doc):
            expires = None  # it started in time: expiry bounds starts only
        return min(filter(None, (hard, expires)), default=None)

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
            self.parked.clear()
            self.parked_ids.clear()
            self.released.clear()
            self.releasing.clear()
            self.rate_held.clear()
            self.rate_held_ids.clear()
            self.rate_turn.clear()
            self.rate_turn_ids.clear()
            self.out_places.clear()
            self.picked = self.turn = None
            self.busy = Counter(agent for agent, _ in self.inflight.values())
            self.running = len(self.inflight)
            self.waiting.clear()
            self.waits_on.clear()
            self.quiet_stamps.clear()
            self.unroutable.clear()
            self.rescan_requested = True
            self.last_dispatch = time.monotonic()
            self.cv.notify_all()
