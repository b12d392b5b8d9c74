"""Exclusive file ownership while a contract handoff runs.

A running handoff whose contract names ``files_owned`` holds a *reservation*: a record with its
patterns (relative to the workspace root), its claim's lease token and when it was taken. The
reservations are the store's shared records (kind ``reservations``; files:
``handoffs/.meta/reservations.json`` under a lock; PostgreSQL: a locked row every host sees), and
taking one is a single locked read-modify-write of all of them, so two processes, on any host,
can never both reserve overlapping patterns: the second one sees the first and backs off.

A reservation is *live* while its handoff is in progress carrying the same lease token; when the
owner dies the sweeper recovers the claim and the reservation dies with it (the sweeper also
retires the record). Released reservations are kept for a while (key ``released``) so that a
scope check can tell which other handoffs owned a path during its run (their writes are theirs):
while any reservation is live, the ones released since it was taken (and two minutes before),
but only the newest that fit in :data:`RELEASED_BUDGET` bytes, so a handoff running for hours
beside thousands of short ones cannot grow the records to their bound.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.documents import actor, book
from ...core.errors import HandoffdError, InvalidDocument
from ...core.logs import deferred
from ...core.states import State
from ...core.timeutil import iso, utc_now
from . import patterns

if TYPE_CHECKING:
    from ...core.engine import Engine

KIND = "reservations"
LIVE, RELEASED = "live", "released"  # the two records: id -> record; id.token -> record
RELEASED_KEEP_SECONDS = 120.0
# The released records take at most half the kind's bound (files: 2 of 4 MiB; the same budget on
# PostgreSQL), the newest kept: the other half is the live records' room, so a release, a prune
# and a take always fit, however long a live reservation pins the cutoff.
RELEASED_BUDGET = 2 * 1024 * 1024  # (the files store's bound: backends/files/records.LIMITS)

log = deferred("handoffd.contracts")


@dataclass(frozen=True)
class Conflict:
    """Another live reservation overlapping ours."""

    holder: str
    theirs: str
    ours: str

    def reason(self) -> str:
        mine = "" if self.theirs == self.ours else f" (overlaps {self.ours})"
        return f"waiting for files owned by {self.holder}: {self.theirs}{mine}"


def _valid(record: Any) -> bool:
    return isinstance(record, dict) and isinstance(record.get("handoff_id"), str) \
        and isinstance(record.get("patterns"), list)


def _entries(value: Any) -> dict[str, dict[str, Any]]:
    """The valid records of a ``live`` / ``released`` value (anything else reads as none)."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if _valid(v)}


class Reservations:
    """The reservation records of one store."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.shared = engine.backend.records()

    # ------------------------------------------------------------ reading
    def records(self) -> list[dict[str, Any]]:
        """Every reservation (live or not yet known dead), unordered."""
        return list(_entries(self.shared.read(KIND).get(LIVE)).values())

    def alive(self, record: dict[str, Any]) -> bool:
        """True while the record's handoff is in progress under the same claim."""
        try:
            found = self.engine.backend.get(record["handoff_id"])
        except InvalidDocument:
            return False
        if found is None or found[0] is not State.IN_PROGRESS:
            return False
        held = book(found[1]).get("lease")
        return isinstance(held, dict) and held.get("token") == record.get("token")

    def live(self) -> list[dict[str, Any]]:
        """The reservations whose handoff still runs."""
        return [r for r in self.records() if self.alive(r)]

    @staticmethod
    def conflict(handoff_id: str, owned: list[str], others: list[dict[str, Any]]) -> Conflict | None:
        """The first reservation among ``others`` (not ``handoff_id``'s) overlapping ``owned``."""
        for record in sorted(others, key=lambda r: (r.get("taken_at", 0), r["handoff_id"])):
            if record["handoff_id"] == handoff_id:
                continue
            for theirs in record["patterns"]:
                for ours in owned:
                    if isinstance(theirs, str) and patterns.overlap(theirs, ours):
                        return Conflict(record["handoff_id"], theirs, ours)
        return None

    def first_conflict(self, handoff_id: str, owned: list[str]) -> Conflict | None:
        """A check without the lock, for gates: a live reservation overlapping ``owned``."""
        return self.conflict(handoff_id, owned, self.live())

    # ------------------------------------------------------------ taking and releasing
    def take(self, handoff_id: str, token: str | None, owned: list[str], *,
             agent: str | None) -> Conflict | None:
        """Reserve ``owned`` for this claim atomically; the conflict instead if one exists."""
        found: list[Conflict | None] = []

        def change(value: Any) -> Any:
            live = _entries(value)
            conflict = self.conflict(handoff_id, owned, [r for r in live.values() if self.alive(r)])
            found.append(conflict)
            if conflict is not None:
                return value  # unchanged
            live[handoff_id] = {"handoff_id": handoff_id, "token": token,
                                "patterns": list(owned), "agent": agent, "taken_at": time.time(),
                                "taken": iso(utc_now()), "owner": actor()}
            return live

        self.shared.update(KIND, LIVE, change)
        return found[-1]

    def release(self, handoff_id: str, token: str | None) -> None:
        """Drop this claim's reservation (kept a while as released, for scope attribution)."""
        record = _entries(self.shared.read(KIND).get(LIVE)).get(handoff_id)
        if record is None or record.get("token") != token:
            return
        self._drop([record], "released")

    def prune(self) -> int:
        """Sweeper: retire the reservations of handoffs no longer in progress under that claim."""
        dead = [r for r in self.records() if not self.alive(r)]
        self._drop(dead, "owner gone")
        return len(dead)

    def _drop(self, records: list[dict[str, Any]], why: str) -> None:
        """End ``records``: recorded as released first, then removed from the live ones, so a
        scope check reading both in between finds each in one or the other, never in neither
        (a neighbour's write must never be blamed on the run being checked). When the records
        refuse the released copy, they are removed all the same, said in one line."""
        if not records:
            return
        try:
            self._retire(records, why)
        except (HandoffdError, OSError) as exc:
            # left live, an ended handoff's record would stay for good (it blocks nobody, but
            # each refused release added one more and the file only grew); removing it costs at
            # most one neighbour's write a check running beside it now cannot excuse (a
            # violation anyone can see and requeue), never a store that refuses every release
            ids = ", ".join(sorted({r["handoff_id"] for r in records}))
            log.warning("reservation of %s: cannot keep it as released (%s); removed from the "
                        "live ones all the same", ids, exc)
        ended = {(r["handoff_id"], r.get("token")) for r in records}

        def change(value: Any) -> Any:
            live = _entries(value)
            for hid, record in list(live.items()):
                if (hid, record.get("token")) in ended:
                    del live[hid]
            return live or None

        self.shared.update(KIND, LIVE, change)

    def confirmed(self, record: dict[str, Any]) -> tuple[str, ...]:
        """The patterns ``record``'s handoff really owned, as the store says: those of the
        contract in its own document (the request it kept when answered), workspace-relative;
        none when the store holds no such handoff, no block of handoffd's vouches for it (it was
        never claimed) or its contract owns nothing. The records themselves are a file in the
        workspace a worker can write: a forged record must excuse nothing."""
        from ... import dialects
        from .contract import parse
        try:
            found = self.engine.backend.get(record["handoff_id"])
        except (HandoffdError, OSError):
            return ()
        if found is None:
            return ()
        doc = found[1]
        block = book(doc)
        attempt = block.get("attempt")
        if not (isinstance(attempt, int) and attempt > 0):
            return ()  # never claimed by handoffd (or its block is not vouched for: emptied)
        kept = block.get("request_snapshot")
        request = kept if isinstance(kept, dict) else doc
        try:
            contract = parse(dialects.detect(request).envelope(request))
        except (HandoffdError, KeyError, TypeError, ValueError):
            return ()
        return tuple(contract.owned_in_workspace()) if contract is not None else ()

    def neighbours(self, handoff_id: str, since: float) -> list[dict[str, Any]]:
        """Other reservations (live or released) that existed at some time since ``since``;
        their patterns are only what the records say (see :meth:`confirmed`)."""
        every = self.shared.read(KIND)
        out = [r for r in _entries(every.get(LIVE)).values() if r["handoff_id"] != handoff_id]
        for record in _entries(every.get(RELEASED)).values():
            released = record.get("released_at")
            if record["handoff_id"] == handoff_id or (
                    isinstance(released, (int, float)) and released < since):
                continue
            out.append(record)
        return out

    # ------------------------------------------------------------ internals
    def _retire(self, records: list[dict[str, Any]], why: str) -> None:
        """Keep ``records`` as released, and forget released ones nobody running can need, and
        past :data:`RELEASED_BUDGET` the oldest of the rest."""
        # the records being retired end now: no neighbour needs keeping for their sake (counted,
        # an ended handoff whose live record could not be removed pinned the cutoff for good)
        ending = {(r["handoff_id"], r.get("token")) for r in records}
        starts = [r.get("taken_at") for r in self.records()
                  if (r["handoff_id"], r.get("token")) not in ending]
        oldest = min([s for s in starts if isinstance(s, (int, float))], default=time.time())
        cutoff = min(oldest, time.time()) - RELEASED_KEEP_SECONDS
        now = time.time()

        def change(value: Any) -> Any:
            kept = {k: r for k, r in _entries(value).items()
                    if not (isinstance(r.get("released_at"), (int, float))
                            and r["released_at"] < cutoff)}
            for record in records:
                key = f"{record['handoff_id']}.{record.get('token') or 'none'}"
                kept[key] = dict(record, released_at=now, released=iso(utc_now()), why=why)
            return _newest(kept, RELEASED_BUDGET) or None

        self.shared.update(KIND, RELEASED, change)


def _newest(released: dict[str, dict[str, Any]], budget: int) -> dict[str, dict[str, Any]]:
    """The newest ``released`` records (by ``released_at``) that fit in ``budget`` bytes.

    A run's neighbours are the records released since it started, so keeping an unbroken run of
    the newest leaves every check of a run started after the oldest kept one complete; one of a
    run older than that may miss a neighbour and blame it one of that neighbour's writes."""
    def when(key: str) -> int | float:  # (no float(): a forged 10**400 would overflow it)
        at = released[key].get("released_at")
        if isinstance(at, (int, float)) and at == at:  # (NaN: not a time)
            return at
        return float("-inf")  # forged: the oldest, trimmed first

    kept: dict[str, dict[str, Any]] = {}
    used = 0
    for key in sorted(released, key=when, reverse=True):
        used += _size(key, released[key])
        if used > budget:
            break
        kept[key] = released[key]
    return kept


def _size(key: str, record: dict[str, Any]) -> int:
    """About the bytes ``record`` takes in the files' ``reservations.json`` (indent 1, ASCII;
    two levels deep there: two more spaces a line), rounded up."""
    text = json.dumps(record, indent=1)
    return len(text) + 2 * (text.count("\n") + 1) + len(json.dumps(key)) + 8
