"""The scheduler's lines: each specialist's due handoffs held for one of its concurrency slots
(parking) or for its rate limit's next token, most urgent first, and how they are let out.

:class:`Lines` is a part of :class:`~handoffd.service.scheduler.Scheduler` (which it is mixed
into): it keeps these books, and reads the scheduler's clock, slots and time heap. Everything
here is guarded by the scheduler's ``cv``.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from ..core.engine import Engine
from ..core.specialists import Specialist

DEFAULT_RANK = 2  # the priority of an id parked without having been read (normal)
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


class Lines:
    """The lines of a scheduler (mixed into it), guarded by its ``cv``:

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
      bucket update per token, whatever the backlog). The scheduler's time heap wakes the loop
      then (``wake_at``).
    * ``picked``/``turn``: the place of the id just handed out (the scheduler's ``next_ready``),
      and the place it had in a line it was just taken out of (:meth:`unpark`), so that it goes
      back where it was (:meth:`_place`).
    """

    # what the lines use of the scheduler they are part of
    engine: Engine
    busy: Counter[str]  # agent -> tasks in flight
    seq: Iterator[int]

    if TYPE_CHECKING:
        def monotonic(self) -> float: ...
        def limit(self, spec: Specialist) -> int: ...
        def notify(self, handoff_id: str, delay: float = 0.0) -> None: ...
        def wake_at(self, due: float) -> None: ...
        def look_again_at(self, handoff_id: str, deadline: datetime | None) -> None: ...

    def __init__(self) -> None:
        super().__init__()
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
        self.rate_until: dict[str, float] = {}  # agent -> monotonic time its next start is due

    def _place(self, handoff_id: str) -> Place:
        """Where ``handoff_id`` goes in a line: by what ``next_ready`` read (priority, due
        time), at the place it had in a line it was just taken out of if any (the priority as
        read now: its document may have been rewritten), else normal, now."""
        picked = self.picked[1] if self.picked and self.picked[0] == handoff_id else None
        if self.turn is not None and self.turn[0] == handoff_id:
            rank, due, seq = self.turn[1]
            return (picked[0] if picked else rank, due, seq)
        return picked or (DEFAULT_RANK, self.monotonic(), next(self.seq))

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
            now = self.monotonic()
            for agent in list(self.rate_held):
                if agent in self.rate_turn or self.rate_until.get(agent, 0.0) > now:
                    continue  # one turn at a time; the loop wakes for the token (wake_at)
                waiting = self.rate_held[agent]
                handoff_id, place = waiting.pop()
                del self.rate_held_ids[handoff_id]
                self.rate_turn[agent] = handoff_id
                self.rate_turn_ids[handoff_id] = agent
                self.out_places[handoff_id] = place
                self.notify(handoff_id)
                if not waiting:
                    del self.rate_held[agent]

    def rate_limited(self, spec: Specialist, handoff_id: str, deadline: datetime | None) -> bool:
        """True when ``spec``'s rate limit holds ``handoff_id`` back: it waits in the agent's
        line (``rate_held``), by priority then due time, until it is the head when the next
        token is due (:meth:`release_parked`), or until its deadline. The bucket is shared by
        every process of the workspace; ``rate_until`` spares it while this process already
        knows the answer, and so does a more urgent id already waiting for the token."""
        if not spec.config.rate:
            return False
        agent = spec.agent
        now = self.monotonic()
        place = self._place(handoff_id)
        line = self.rate_held.get(agent)
        ahead = line.head() if line is not None else None
        if (ahead is None or place <= ahead) and self.rate_until.get(agent, 0.0) <= now:
            wait = self.engine.start_wait(spec)
            if wait <= 0:
                return False  # the token is taken: it starts
            self.rate_until[agent] = now + wait
            self.wake_at(now + wait)
        self.rate_held.setdefault(agent, Line()).add(handoff_id, place)
        self.rate_held_ids[handoff_id] = agent
        self.look_again_at(handoff_id, deadline)
        return True

    def _clear_lines(self) -> None:
        """Forget every line, release and place (the scheduler's reset; ``rate_until`` stays:
        the tokens are the store's)."""
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
