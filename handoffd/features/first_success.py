"""first_success's window: the siblings of a child that won, held in this process.

Once a first_success child has succeeded, its parent's gate lets the parent go and it is
aggregated (claimed, its children read, the open ones cancelled, filed): some 30 ms, in which
another worker used to claim and start a sibling (its specialist ran for nothing, and one that
ended in time was counted a success beside the winner). :class:`Winners` closes that window in
this process: from the moment a child's success is decided (before it is filed) its pending
siblings are held (a gate), and one a worker was handed just before is given back unrun (a
resumer) until the parent's aggregation (:mod:`.aggregation`) cancels it. Installed by
:func:`handoffd.features.orchestration.install`.
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core.documents import BOOK, Envelope, Outcome, book
from ..core.errors import HandoffdError
from ..core.hooks import Verdict
from ..core.logs import log
from ..core.states import State, Status
from ..dialects import hi_moe
from .lineage import parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

WIN_FILING_SECONDS = 30.0  # a success decided but still not filed this long after: void
# a filed win's parent is looked at again (one peek) when a sibling is asked about this long
# after the last look: another process may have filed the parent (a plain `handoff cancel`,
# another daemon's aggregation), which no filing hook here hears of; the siblings were held
# for ever then
WIN_RECHECK_SECONDS = 5.0
MAX_WINS = 1_000  # parents whose win is kept at once (the oldest go first)


@dataclass
class Win:
    """A first_success parent's winner, from the moment its success was decided."""

    winner: str
    siblings: frozenset[str]  # the parent's other children of that round: held back
    decided: datetime  # when its attempt ended in success (the engine's clock)
    filed: bool = False  # its success is filed (before: being filed; it may yet not be)
    looked: datetime | None = None  # when the parent was last seen waiting for this round


class Winners:
    """The first_success parents with a winner, in this process (one per engine:
    :func:`handoffd.features.orchestration.install`). Thread-safe: its hooks run on workers.

    * :meth:`decided` (an ``after_run`` hook, before the winner is filed) and :meth:`resume`
      (a nested parent's aggregated success) note the win: one read of the parent, only for a
      child's success;
    * :meth:`gate` holds the siblings in the scheduler, waiting for the parent's filing;
      :meth:`hold_back` (a resumer, after the claim, before the handler) gives back unrun a
      sibling claimed after the win (handed out just before it);
    * :meth:`filed` (``on_filed``) confirms the win when the success is filed, forgets it when
      it is not (a failed filing, a later check's failure: the siblings may run again) and when
      the parent is filed.

    A handoff without a parent costs a look at an empty dict (and three key lookups in its
    document when a win is kept). Other processes on the store do not see these wins: there
    the parent's aggregation cancels what they started (docs/orchestration.md)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wins: OrderedDict[str, Win] = OrderedDict()  # parent id -> its win
        self._parents: dict[str, str] = {}  # winner id -> its parent

    def __len__(self) -> int:
        return len(self._wins)

    def decided(self, job: "Job", outcome: Outcome) -> Outcome:
        """``after_run`` hook: a child's attempt ended in success; note its parent's win before
        it is filed (a sibling handed out later is held). ``outcome`` is returned as it is."""
        # (a handoff without a parent, almost every one, is let go here: no call to note)
        if outcome.status == Status.COMPLETED and parent_of(job.claim.doc) is not None:
            self.note(job.handoff_id, job.claim.doc)
        return outcome

    def note(self, handoff_id: str, doc: dict[str, Any]) -> None:
        """``handoff_id`` (its claimed document ``doc``) succeeded: when it is a child of a
        first_success parent waiting for it, the parent has its winner (unless it had one)."""
        parent = parent_of(doc)
        if parent is None or parent == handoff_id:
            return  # (no read for a handoff without a parent)
        siblings = _first_success_siblings(self.engine, parent, handoff_id)
        if siblings is None:
            return
        now = self.engine.clock()
        with self._lock:
            held = self._wins.get(parent)
            if held is not None and held.winner != handoff_id and not _void(held, now):
                return  # it has its winner
            self._drop(parent)
            self._wins[parent] = Win(handoff_id, siblings, now)
            self._parents[handoff_id] = parent
            while len(self._wins) > MAX_WINS:
                self._drop(next(iter(self._wins)))

    def filed(self, handoff_id: str, where: State) -> None:
        """``on_filed`` hook: confirm or forget a win as its winner is filed; forget a parent's
        win once the parent is filed for good."""
        if not self._wins:
            return
        confirm = False
        with self._lock:
            if where.terminal and handoff_id in self._wins:
                self._drop(handoff_id)  # the parent: aggregated, or cancelled
            parent = self._parents.get(handoff_id)
            if parent is None:
                return
            confirm = where is State.COMPLETED
        # (outside the lock: the answer just filed is at hand, no read)
        won = confirm and _filed_success(self.engine, handoff_id)
        with self._lock:
            win = self._wins.get(parent)
            if win is None or win.winner != handoff_id:
                return
            if won:
                win.filed = True
            else:  # filed failed, partial, or for a retry: the siblings may run after all
                self._drop(parent)

    def held_back(self, handoff_id: str, doc: dict[str, Any]) -> tuple[str, str] | None:
        """(parent, winner) when ``handoff_id`` (its document ``doc``) is a first_success
        sibling of a winner: it may not start. None otherwise."""
        if not self._wins:
            return None  # (almost always: no look at the document)
        parent = parent_of(doc)
        if parent is None:
            return None
        now = self.engine.clock()
        with self._lock:
            win = self._wins.get(parent)
            if win is None or handoff_id not in win.siblings:
                return None
            if _void(win, now):
                self._drop(parent)
                return None
            if not win.filed or (now - (win.looked or win.decided)).total_seconds() \
                    < WIN_RECHECK_SECONDS:
                return parent, win.winner
            winner = win.winner
        # (outside the lock: a peek) the parent still waits for this round, or the win is over
        waiting = _first_success_siblings(self.engine, parent, winner) is not None
        with self._lock:
            if self._wins.get(parent) is not win:
                return None  # dropped or replaced meanwhile
            if not waiting:
                self._drop(parent)
                return None
            win.looked = now
            return parent, winner

    def gate(self, engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        """The gate: a sibling of a winner waits for the parent's filing (its aggregation
        cancels it), or for the winner's, should that not be a success after all."""
        if not self._wins:
            return None  # (almost always: asked of every pending handoff, as held_back says)
        held = self.held_back(env.handoff_id, doc)
        if held is None:
            return None
        parent, winner = held
        return Verdict.wait(f"first_success: its sibling {winner} succeeded; {parent} cancels it",
                            on=(parent, winner))

    def hold_back(self, job: "Job", started: datetime) -> Outcome | None:
        """The resumer: a sibling claimed after the win (a worker was handed it just before) is
        given back to pending unrun, where the gate holds it. None: run it."""
        if not self._wins:
            return None  # (almost always: asked of every attempt, as held_back says)
        held = self.held_back(job.handoff_id, job.claim.doc)
        if held is None:
            return None
        parent, winner = held
        log.info("handoff %s: not started: its first_success sibling %s succeeded (%s)",
                 job.handoff_id, winner, parent)
        return Outcome(status=Status.DELEGATED, started_at=started, finished_at=self.engine.clock(),
                       park={"kind": "held_back", "parent": parent, "winner": winner})

    def resume(self, job: "Job", started: datetime) -> Outcome | None:
        """The aggregation's resumer (:func:`.aggregation.resume`), noting an aggregated success: the
        parent may itself be a first_success parent's child (no after_run hook sees it)."""
        outcome = _aggregation().resume(self.engine, job, started)  # (looked up: tests patch it)
        if outcome is not None and outcome.status == Status.COMPLETED:
            self.note(job.handoff_id, job.claim.doc)
        return outcome

    def parked(self, handoff_id: str) -> bool:
        """A daemon's parked check: ``handoff_id`` went back to pending held back (not a
        retry): looked at first, its gate holds it."""
        if not self._wins:
            return False
        try:
            doc = self.engine.backend.peek(handoff_id)
        except (HandoffdError, OSError):
            return False
        return doc is not None and self.held_back(handoff_id, doc) is not None

    def _drop(self, parent: str) -> None:
        """Forget ``parent``'s win (under the lock)."""
        win = self._wins.pop(parent, None)
        if win is not None and self._parents.get(win.winner) == parent:
            del self._parents[win.winner]


@functools.cache
def _aggregation() -> ModuleType:
    """:mod:`.aggregation`, imported at its first use, not with this module: the gate is
    installed alone by `handoff ls`, which never aggregates (aggregation loads child facts,
    answer copies and artifacts); once (an import in :meth:`Winners.resume`, asked at every
    handoff, made two Python calls of the import system's each time)."""
    from . import aggregation
    return aggregation


def _void(win: Win, now: datetime) -> bool:
    """A success decided long ago and never filed (its claim lost: no filing told of it)."""
    return not win.filed and (now - win.decided).total_seconds() > WIN_FILING_SECONDS


def _first_success_siblings(engine: "Engine", parent: str, child: str) -> frozenset[str] | None:
    """The other children of ``parent`` when it waits, first_success, for a round that
    ``child`` is of (its pending document, as handoffd wrote it); None otherwise."""
    try:
        doc = engine.backend.peek(parent)
    except (HandoffdError, OSError):  # unreadable now: the window stays open this once
        return None
    wait = book(doc).get("waiting_children") if doc is not None \
        and isinstance(doc.get(BOOK), dict) else None
    if not isinstance(wait, dict) or wait.get("aggregation") != "first_success":
        return None
    children = wait.get("children")
    ids = [c for c in children if isinstance(c, str)] if isinstance(children, list) else []
    if child not in ids:
        return None
    return frozenset(c for c in ids if c != child)


def _filed_success(engine: "Engine", handoff_id: str) -> bool:
    """Whether the answer just filed for ``handoff_id`` is a success, as the parent's gate
    will read it (a partial one is no winner)."""
    try:
        state, doc = engine.filed_document(handoff_id)
    except (HandoffdError, OSError):
        return False
    if state is not State.COMPLETED:
        return False
    reported = hi_moe.read_outcome(doc)
    if reported is not None:
        return reported.get("status") == "success"
    return doc.get("status") != "partial"
