"""The queue of notices waiting to be delivered: one lane per ``[[on_filed]]`` rule.

One delivery thread once took every notice in turn from one queue, whatever its rule: a webhook
that hung held it for ``timeout_seconds`` a try, then its backoff, for each of its notices, and
another rule's healthy command waited behind them all (47 s after its handoff was filed; a
``handoffd run`` dead-lettered them at its end, never tried). Now each rule's notices wait in a
lane of their own, and a delivery thread serves one lane at a time (:mod:`.delivery`): one
rule's failures hold its own notices only. A thread takes one notice of a lane, then the lane
goes to the back of the turn, so that with more rules than threads they take turns.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterator

from .notices import Notice


def lane_of(notice: Notice) -> int:
    """The lane ``notice`` waits in: its rule's (the rule objects live as long as the
    configuration that holds them)."""
    return id(notice.rule)


class Lanes:
    """Notices waiting, in a lane per rule (in the order queued within a lane). Not thread-safe:
    the notifier's lock guards it. Reads as one collection of every notice waiting."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[int, deque[Notice]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Notice]:
        for lane in self._lanes.values():
            yield from lane

    def append(self, notice: Notice) -> None:
        """Queue ``notice`` at the end of its rule's lane."""
        self._lanes.setdefault(lane_of(notice), deque()).append(notice)
        self._count += 1

    def clear(self) -> None:
        """Drop every notice waiting (a drain took them)."""
        self._lanes.clear()
        self._count = 0

    def ready(self, busy: set[int]) -> int:
        """How many lanes have a notice waiting and are not in ``busy`` (being delivered)."""
        return sum(1 for key in self._lanes if key not in busy)

    def take(self, busy: set[int]) -> Notice | None:
        """The first notice of the first lane not in ``busy`` (that lane then goes to the back
        of the turn), or None when there is none."""
        key = next((key for key in self._lanes if key not in busy), None)
        if key is None:
            return None
        lane = self._lanes[key]
        notice = lane.popleft()
        self._count -= 1
        if lane:
            self._lanes.move_to_end(key)
        else:
            del self._lanes[key]  # (only lanes with a notice waiting are kept)
        return notice
