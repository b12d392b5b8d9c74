"""The storage interface every backend implements: files (the embedded default), memory (tests)
and PostgreSQL (next).

It is stated in terms a database can implement. A backend keeps whole documents and, beside each,
what scheduling needs: its state, routing facts (:class:`Meta`, computed by a ``describe``
function the backend is given, so it never needs to know the document formats), a due time and
the current claim's token. Policy (retry or fail, which event to record, gates) stays with the
engine; a backend only makes each transition atomic and fenced.

What a backend writes into the ``handoffd`` bookkeeping block itself: on :meth:`Backend.create`
the block is reset to ``{"id": ...}`` plus a ``created`` history event; on a claim ``attempt``
(+1), ``lease`` and a ``claimed`` event, and ``next_attempt_at`` is dropped; on
:meth:`Backend.requeue` ``next_attempt_at``, ``attempt`` (-1 when the attempt does not count) and
no ``lease``; on :meth:`Backend.finish` no ``lease``. Any other transition event (``completed``,
``retry_scheduled``, ``recovered``...) is recorded by the caller with
:func:`handoffd.core.documents.record` before it calls finish or requeue.
"""
from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection, Literal, Protocol, runtime_checkable

from ..core.documents import (
    BOOK,
    actor,
    book,
    book_int,
    next_attempt_at,
    priority_rank,
    record,
)
from ..core.errors import InvalidDocument, InvalidTransition, NotFound, WaitTimeout
from ..core.states import State
from ..core.timeutil import iso, parse_iso

Doc = dict[str, Any]
Order = Literal["newest", "oldest", "due"]
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
SAFETY_RECHECK_SECONDS = 2.0  # wake-ups are hints: waiters look again now and then regardless


@dataclass(frozen=True)
class Meta:
    """What scheduling and listing need to know of a document, whatever its format.

    ``target`` None: the document cannot be routed, so :meth:`Backend.claim_next` never hands it
    out (it can still be claimed by id, to be set aside)."""

    target: str | None
    priority: int = 2
    conversation: str | None = None
    parent: str | None = None


Describe = Callable[[Doc], Meta]


@dataclass
class Claim:
    """A handoff one caller holds in progress.

    ``doc`` is the caller's copy of the in-progress document (it may change it and pass it to
    finish or requeue). ``token`` fences every later write: once the handoff was requeued,
    finished or taken over (:meth:`Backend.expired_claims`), writes with this claim do nothing.
    ``handle`` is private to the backend that made the claim (files: the store's claim with its
    flock). ``recovered`` says why the claim was taken over from a previous owner, else None."""

    id: str
    doc: Doc
    token: str
    attempt: int
    handle: Any = field(default=None, repr=False, compare=False)
    recovered: str | None = None


@dataclass(frozen=True)
class Row:
    """One handoff as :meth:`Backend.list` returns it."""

    id: str
    state: State
    doc: Doc
    meta: Meta
    due_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Wakeup:
    """A hint that something may be worth looking at: ``kind`` is the state a handoff entered
    (a :class:`State` value) or ``"cancel"`` for a new cancel request."""

    handoff_id: str
    kind: str


WakeupCallback = Callable[[Wakeup], None]
Rows = list[Row]
Claims = list[Claim]


@runtime_checkable
class Backend(Protocol):
    """Durable storage for handoff documents and their scheduling state (thread-safe)."""

    def create(self, doc: Doc, handoff_id: str, now: datetime) -> None:
        """Store a new document as pending, only if ``handoff_id`` is free: raise
        DuplicateHandoff when a handoff with that id exists in any state, or the id was seen
        within the dedup TTL. Stamps the bookkeeping block (see the module docstring), records
        the id as seen and wakes subscribers. The caller's dict is not changed or kept."""
        ...

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        """The current state and a copy of the document, or None when the id is unknown."""
        ...

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest") -> Rows:
        """Handoffs matching every given filter (``since``: updated at or after it). ``order``:
        ``newest``/``oldest`` by last update (ties by id), ``due`` as :meth:`claim_next` would
        hand them out. Documents that cannot be read are left out."""
        ...

    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        """Claim the most urgent due pending handoff for one of ``targets``: lowest priority
        rank first, then earliest due time (its retry time, else its creation time), then id.
        Handoffs not yet due, for other targets, or in ``exclude`` are skipped. Concurrent
        callers (threads, processes, hosts) never get the same handoff. ``prepare`` may mark
        the document as claimed (its format's status) before it is written in progress.
        None when nothing is due."""
        ...

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        """Claim one pending handoff by id, due or not (to cancel or reject it). None when it is
        not pending (unknown, elsewhere, or another claimer won)."""
        ...

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        """Extend the claim's lease to ``now + lease_seconds``. False when the claim no longer
        holds the handoff (finished, requeued or taken over): its work must be discarded."""
        ...

    def finish(self, claim: Claim, state: State, doc: Doc) -> bool:
        """File ``doc`` in a terminal ``state`` (completed or failed) if ``claim`` still holds the
        handoff. False, with nothing written, when it does not: a lost claim never files twice.
        A claim finishes at most once."""
        ...

    def requeue(self, claim: Claim, doc: Doc, due_at: datetime | None, *,
                count_attempt: bool) -> bool:
        """Put a claimed handoff back in pending, due at ``due_at`` (None: due now, in its
        original place in line). ``count_attempt=False`` (a graceful hand-back) gives the attempt
        back. Fenced like :meth:`finish`."""
        ...

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        """Take over every in-progress handoff whose owner is gone: its lease expired by ``now``
        (or, where the backend can tell, its owner died). Each comes back as a new claim with a
        fresh token and lease, so the old owner's renew and finish fail from now on; the caller
        finishes or requeues it by its retry policy."""
        ...

    def request_cancel(self, handoff_id: str, request: Doc) -> None:
        """Record (or replace) a request to cancel ``handoff_id``, and wake subscribers."""
        ...

    def cancel_request(self, handoff_id: str) -> Doc | None:
        """The cancel request recorded for ``handoff_id``, or None."""
        ...

    def cancel_requests(self) -> dict[str, Doc]:
        """Every recorded cancel request, by handoff id."""
        ...

    def clear_cancel(self, handoff_id: str) -> None:
        """Forget the cancel request of ``handoff_id`` (no error when there is none)."""
        ...

    def seen_add(self, handoff_id: str, now: datetime) -> None:
        """Record ``handoff_id`` as used at ``now`` (dedup of documents arriving from outside)."""
        ...

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        """True when ``handoff_id`` was recorded within the dedup TTL before ``now``."""
        ...

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        """Block until ``handoff_id`` is completed or failed and return it. NotFound when it does
        not exist; WaitTimeout after ``timeout`` seconds (None: no limit)."""
        ...

    def subscribe(self, callback: WakeupCallback) -> Callable[[], None]:
        """Call ``callback`` (on any thread) with hints: a handoff entered pending or a terminal
        state, or a cancel request arrived. Hints may repeat or come late; writes of other
        processes count where the backend can see them. Returns the unsubscribe function."""
        ...

    def close(self) -> None:
        """Release what the backend holds (watch threads, connections)."""
        ...


# ---------------------------------------------------------------- helpers shared by backends
class FencedFiling:
    """``finish`` and ``requeue`` as every backend implements them: both end a claim through the
    backend's ``_release``, which is fenced by the claim's token (a lost claim files nothing)."""

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        raise NotImplementedError  # the backend's own fenced write; ``copied``: doc is ours

    def finish(self, claim: Claim, state: State, doc: Doc) -> bool:
        """File a claimed handoff in a terminal state (see Backend.finish)."""
        if not state.terminal:
            raise InvalidTransition(f"handoff {claim.id}: finish files completed or failed, not "
                                    f"{state.value}; use requeue", handoff_id=claim.id)
        return self._release(claim, state, doc)

    def requeue(self, claim: Claim, doc: Doc, due_at: datetime | None, *,
                count_attempt: bool) -> bool:
        """Put a claimed handoff back in pending (see Backend.requeue)."""
        stored = copy.deepcopy(doc)
        stamp_requeued(stored, due_at, count_attempt)
        return self._release(claim, State.PENDING, stored, copied=True)


def describe_native(doc: Doc) -> Meta:
    """The default ``describe``: seed-001 fields (``target.agent_id``, ``priority``,
    ``conversation_id``, ``parent_id``, also read from ``handoffd.request_snapshot``)."""
    sources = [doc]
    block = doc.get(BOOK)
    if isinstance(block, dict):
        snap = block.get("request_snapshot")
        sources += [snap] if isinstance(snap, dict) else []
        sources.append(block)
    target = next((t["agent_id"] for s in sources if isinstance(t := s.get("target"), dict)
                   and isinstance(t.get("agent_id"), str)), None)
    return Meta(target, priority_rank(doc.get("priority")), _first_str(sources, "conversation_id"),
                _first_str(sources, "parent_id"))


def _first_str(sources: list[Doc], key: str) -> str | None:
    return next((v for s in sources if isinstance(v := s.get(key), str) and v), None)


def safe_describe(describe: Describe, doc: Doc) -> Meta:
    """``describe(doc)``, or an unroutable Meta when the document defeats it."""
    try:
        return describe(doc)
    except Exception:  # one bad document must never stop a listing or a claim
        return Meta(None)


def lease_block(token: str, now: datetime, seconds: float) -> Doc:
    """The ``lease`` entry of the bookkeeping block (the shape the file store writes)."""
    return {"token": token, "owner": actor(), "acquired_at": iso(now),
            "expires_at": iso(now + timedelta(seconds=seconds))}


def stamp_created(doc: Doc, handoff_id: str, now: datetime) -> None:
    """Bookkeeping of a newly created document: a fresh block and a ``created`` event."""
    doc[BOOK] = {"id": handoff_id}
    record(doc, "created", now)


def stamp_claimed(doc: Doc, token: str, now: datetime, lease_seconds: float) -> int:
    """Bookkeeping of a claim (attempt + 1, lease, ``claimed`` event); returns the attempt."""
    block = book(doc)
    block["attempt"] = book_int(doc, "attempt", 0) + 1
    block["lease"] = lease_block(token, now, lease_seconds)
    block.pop("next_attempt_at", None)
    record(doc, "claimed", now, attempt=block["attempt"])
    return int(block["attempt"])


def stamp_requeued(doc: Doc, due_at: datetime | None, count_attempt: bool) -> None:
    """Bookkeeping of a requeue: retry time, no lease, the attempt given back if it not counts."""
    block = book(doc)
    if due_at is None:
        block.pop("next_attempt_at", None)
    else:
        block["next_attempt_at"] = iso(due_at)
    if not count_attempt:
        block["attempt"] = max(book_int(doc, "attempt", 1) - 1, 0)
    block.pop("lease", None)


def _event_time(doc: Doc, index: int, event: str | None = None) -> datetime | None:
    history = book(doc).get("history") if isinstance(doc.get(BOOK), dict) else None
    if not isinstance(history, list) or not history:
        return None
    entry = history[index]
    if not isinstance(entry, dict) or (event is not None and entry.get("event") != event):
        return None
    try:
        return parse_iso(str(entry.get("at")))
    except ValueError:
        return None


def due_of(doc: Doc, fallback: datetime) -> datetime:
    """When a pending document is due: its retry time, else its creation time, else
    ``fallback`` (a raw document: when it arrived)."""
    return next_attempt_at(doc) or _event_time(doc, 0, "created") or fallback


def updated_of(doc: Doc, fallback: datetime) -> datetime:
    """When a document last changed state: its last history event, else ``fallback``."""
    return _event_time(doc, -1) or fallback


def lease_expiry(doc: Doc) -> datetime | None:
    """When the document's lease expires (None: no readable lease)."""
    held = book(doc).get("lease") if isinstance(doc.get(BOOK), dict) else None
    try:
        return parse_iso(str(held["expires_at"])) if isinstance(held, dict) else None
    except (KeyError, ValueError):
        return None


def select(rows: Rows, *, state: State | None, target: str | None, conversation: str | None,
           parent: str | None, since: datetime | None, limit: int | None, order: Order) -> Rows:
    """Filter, order and cut rows the way :meth:`Backend.list` promises."""
    kept = [r for r in rows if (state is None or r.state is state)
            and (target is None or r.meta.target == target)
            and (conversation is None or r.meta.conversation == conversation)
            and (parent is None or r.meta.parent == parent)
            and (since is None or r.updated_at >= since)]
    if order == "due":
        kept.sort(key=lambda r: (r.meta.priority, r.due_at, r.id))
    else:
        kept.sort(key=lambda r: (r.updated_at, r.id), reverse=order == "newest")
    return kept if limit is None else kept[:max(limit, 0)]


class Subscribers:
    """A thread-safe list of wake-up callbacks; a failing callback never stops the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[WakeupCallback] = []

    def add(self, callback: WakeupCallback) -> Callable[[], None]:
        """Register ``callback``; returns the function that removes it."""
        with self._lock:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)
        return remove

    def __len__(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def fire(self, handoff_id: str, kind: str) -> None:
        """Tell every subscriber; exceptions they raise are swallowed (hints only)."""
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(Wakeup(handoff_id, kind))
            except Exception:  # a subscriber's bug must not break the writer that woke it
                pass


def wait_via_feed(backend: Backend, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
    """:meth:`Backend.wait_terminal` built on ``get`` and the wake-up feed (level-triggered:
    look, then sleep until a hint for this id or the safety recheck)."""
    wake = threading.Event()
    unsubscribe = backend.subscribe(lambda w: wake.set() if w.handoff_id == handoff_id else None)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            wake.clear()
            try:
                found = backend.get(handoff_id)
            except InvalidDocument:  # a producer is still writing it: keep waiting
                found = (State.PENDING, {})
            if found is None:
                raise NotFound(f"no handoff {handoff_id}; `handoff ls` lists them",
                               handoff_id=handoff_id)
            if found[0].terminal:
                return found
            remaining = SAFETY_RECHECK_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"handoff {handoff_id} is still not finished after {timeout:g}s; "
                                  "wait again or check `handoff show`", handoff_id=handoff_id)
            wake.wait(min(remaining, SAFETY_RECHECK_SECONDS))
    finally:
        unsubscribe()
