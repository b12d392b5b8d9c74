"""The in-memory backend: dicts behind one lock, for fast engine tests (nothing survives the
process). It keeps the same promises as the others, so the conformance suite runs on it too;
documents are deep-copied in and out, as if they had been written somewhere."""
from __future__ import annotations

import builtins
import copy
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Collection, Iterator

from ..core.documents import book, book_int
from ..core.errors import DuplicateHandoff, InvalidTransition
from ..core.memorystrikes import claim_out_of_memory
from ..core.states import State
from ..core.storage import GIVEN_UP_UNRUN, HISTORY_LIMIT, LEASE_EXPIRED, ContextChange
from ..core.timeutil import iso, utc_now
from .base import (
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    FencedFiling,
    MemoryRecords,
    Order,
    Row,
    Rows,
    Subscribers,
    WakeupCallback,
    Where,
    check_due,
    describe_native,
    due_of,
    lease_block,
    lease_expiry,
    only_kinds,
    safe_describe,
    select,
    stamp_claimed,
    stamp_created,
    updated_of,
    wait_via_feed,
)


@dataclass
class _Entry:
    """One handoff: its state, document and the token of the claim that holds it."""

    state: State
    doc: Doc
    created_at: datetime
    token: str | None = None
    unrun: str | None = None  # the token of a claim given up before its handler ran

    def row(self, handoff_id: str, describe: Describe) -> Row:
        return Row(handoff_id, self.state, copy.deepcopy(self.doc),
                   safe_describe(describe, self.doc), due_of(self.doc, self.created_at),
                   updated_of(self.doc, self.created_at))


class MemoryBackend(FencedFiling, Backend):
    """Every handoff in a dict; thread-safe; ``seen_ttl_seconds`` as the file store's."""

    def __init__(self, *, describe: Describe = describe_native,
                 seen_ttl_seconds: float = 3600.0) -> None:
        self.describe = describe
        self.seen_ttl = timedelta(seconds=seen_ttl_seconds)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._seen: dict[str, datetime] = {}
        self._seen_mark: dict[str, str] = {}  # the mark of an id's record, when it has one
        self._cancels: dict[str, Doc] = {}
        self._quarantine: builtins.list[Doc] = []
        self._subscribers = Subscribers()
        self._records = MemoryRecords()

    # ------------------------------------------------------------ creating and reading
    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        stored = copy.deepcopy(doc)
        stamp_created(stored, handoff_id, now, due_at)
        with self._lock:
            if handoff_id in self._entries:
                where = self._entries[handoff_id].state.value
                raise DuplicateHandoff(f"handoff {handoff_id} already exists in {where}/; choose "
                                       "another id or `handoff retry` the existing one",
                                       handoff_id=handoff_id)
            if self._seen_recently(handoff_id, now):
                raise DuplicateHandoff(f"handoff id {handoff_id} was used within the last "
                                       f"{int(self.seen_ttl.total_seconds())}s; choose another id",
                                       handoff_id=handoff_id)
            self._entries[handoff_id] = _Entry(State.PENDING, stored, now)
            self._seen[handoff_id] = now
            self._seen_mark.pop(handoff_id, None)
        self._subscribers.fire(handoff_id, State.PENDING.value)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        with self._lock:
            entry = self._entries.get(handoff_id)
            return None if entry is None else (entry.state, copy.deepcopy(entry.doc))

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest", where: Where | None = None,
             unreadable: bool = False, before: datetime | None = None) -> Rows:
        with self._lock:
            rows = [e.row(i, self.describe) for i, e in self._entries.items()
                    if state is None or e.state is state]
        return select(rows, state=state, target=target, conversation=conversation, parent=parent,
                      since=since, limit=limit, order=order, where=where, before=before)

    # ------------------------------------------------------------ claims
    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        wanted = set(targets)
        with self._lock:
            due = [(meta.priority, when, i) for i, e in self._entries.items()
                   if e.state is State.PENDING and i not in exclude
                   and (meta := safe_describe(self.describe, e.doc)).target in wanted
                   and (when := due_of(e.doc, e.created_at)) <= now]
            return self._claim_locked(min(due)[2], now, lease_seconds, prepare) if due else None

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        with self._lock:
            entry = self._entries.get(handoff_id)
            if due_only and entry is not None and entry.state is State.PENDING:
                check_due(entry.doc, handoff_id, now)  # (NotDue: left pending, untouched)
            return self._claim_locked(handoff_id, now, lease_seconds, prepare)

    def _claim_locked(self, handoff_id: str, now: datetime, lease_seconds: float,
                      prepare: Callable[[Doc], None] | None) -> Claim | None:
        """The claim of the pending ``handoff_id`` (called under the lock). A MemoryError
        (copying or marking it) leaves it pending, untouched: a memory strike, the
        ClaimShortage (or, at the strikes' bound, the UnreadableDocument) of
        :func:`~handoffd.core.memorystrikes.claim_out_of_memory`, as on the file store."""
        entry = self._entries.get(handoff_id)
        if entry is None or entry.state is not State.PENDING:
            return None
        try:
            doc = copy.deepcopy(entry.doc)
            token = uuid.uuid4().hex
            attempt = stamp_claimed(doc, token, now, lease_seconds)
            if prepare is not None:
                prepare(doc)  # raising leaves the handoff pending, untouched
            stored = copy.deepcopy(doc)
        except MemoryError:
            raise claim_out_of_memory(handoff_id, f"handoff {handoff_id} (pending)") from None
        entry.state, entry.doc, entry.token = State.IN_PROGRESS, stored, token
        return Claim(handoff_id, doc, token, attempt)

    def _holds(self, claim: Claim) -> _Entry | None:
        entry = self._entries.get(claim.id)
        if entry is None or entry.state is not State.IN_PROGRESS or entry.token != claim.token:
            return None
        return entry

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        with self._lock:
            entry = self._holds(claim)
            if entry is None:
                return False
            stamp = lease_block(claim.token, now, lease_seconds)
            for doc in (entry.doc, claim.doc):
                book(doc)["lease"] = dict(stamp)
            return True

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        stored = doc if copied else copy.deepcopy(doc)
        book(stored).pop("lease", None)
        with self._lock:
            entry = self._holds(claim)
            if entry is None:
                return False
            entry.state, entry.doc, entry.token = state, stored, None
        self._subscribers.fire(claim.id, state.value)
        return True

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        taken: Claims = []
        with self._lock:
            for handoff_id, entry in self._entries.items():
                expiry = lease_expiry(entry.doc)
                if entry.state is not State.IN_PROGRESS or (expiry is not None and expiry > now):
                    continue
                reason = f"{LEASE_EXPIRED} at {expiry.isoformat() if expiry else 'unknown'}"
                if entry.unrun is not None and entry.unrun == entry.token:
                    reason = GIVEN_UP_UNRUN  # (abandon_unrun: its handler never ran)
                entry.unrun = None
                token = uuid.uuid4().hex
                entry.token = token
                book(entry.doc)["lease"] = lease_block(token, now, lease_seconds)
                attempt = book_int(entry.doc, "attempt", 1)
                taken.append(Claim(handoff_id, copy.deepcopy(entry.doc), token, attempt,
                                   recovered=reason))
        return taken

    # ------------------------------------------------------------ what the engine and sweeper add
    def ids(self, state: State) -> builtins.list[str]:
        with self._lock:
            return [i for i, e in self._entries.items() if e.state is state]

    def peek(self, handoff_id: str) -> Doc | None:
        with self._lock:
            entry = self._entries.get(handoff_id)
            if entry is None or entry.state is not State.PENDING:
                return None
            return copy.deepcopy(entry.doc)

    def abandon(self, claim: Claim) -> None:
        """Nothing is held beyond the lease, which recovery takes over when it expires."""

    def abandon_unrun(self, claim: Claim) -> None:
        """:meth:`abandon`, the claim marked for its recovery: ``GIVEN_UP_UNRUN``."""
        with self._lock:
            entry = self._entries.get(claim.id)
            if entry is not None and entry.token == claim.token:
                entry.unrun = claim.token

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        with self._lock:
            entry = self._entries.get(handoff_id)
            if entry is None or entry.state is not state \
                    or (claim is not None and entry.token != claim.token):
                return False
            del self._entries[handoff_id]
            self._quarantine.append({"file": handoff_id, "from": state.value, "code": code,
                                     "message": message, "at": iso(utc_now()),
                                     "stored_as": handoff_id, "document": entry.doc})
            return True

    def quarantined(self) -> builtins.list[Doc]:
        with self._lock:
            return copy.deepcopy(self._quarantine)

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        with self._lock:
            if handoff_id in self._entries:
                return False
            self._entries[handoff_id] = _Entry(State.FAILED, copy.deepcopy(doc), utc_now())
        self._subscribers.fire(handoff_id, State.FAILED.value)
        return True

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        with self._lock:
            entry = self._entries.get(handoff_id)
            if entry is None or entry.state is not State.FAILED:
                return False
            entry.state, entry.doc, entry.token = State.PENDING, copy.deepcopy(doc), None
        self._subscribers.fire(handoff_id, State.PENDING.value)
        return True

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        if not state.terminal:
            raise InvalidTransition(f"handoff {handoff_id}: only finished handoffs are purged",
                                    handoff_id=handoff_id)
        with self._lock:
            entry = self._entries.get(handoff_id)
            if entry is None or entry.state is not state:
                return False
            if expect is not None and entry.doc != expect:
                return False
            del self._entries[handoff_id]
            self._seen[handoff_id] = now
            self._seen_mark.pop(handoff_id, None)
        return True

    def records(self) -> MemoryRecords:
        return self._records

    def maintain(self, now: datetime, *,
                 skip: Collection[str] = ()) -> dict[str, builtins.list[str]]:
        with self._lock:  # the TTL is the only thing that needs tidying
            for handoff_id in [i for i, at in self._seen.items() if now - at >= self.seen_ttl]:
                del self._seen[handoff_id]
                self._seen_mark.pop(handoff_id, None)
        return {}

    # ------------------------------------------------------------ cancel requests
    def request_cancel(self, handoff_id: str, request: Doc) -> None:
        with self._lock:
            self._cancels[handoff_id] = copy.deepcopy(request)
        self._subscribers.fire(handoff_id, "cancel")

    def cancel_request(self, handoff_id: str) -> Doc | None:
        with self._lock:
            found = self._cancels.get(handoff_id)
            return None if found is None else copy.deepcopy(found)

    def cancel_requests(self) -> dict[str, Doc]:
        with self._lock:
            return copy.deepcopy(self._cancels)

    def clear_cancel(self, handoff_id: str) -> None:
        with self._lock:
            self._cancels.pop(handoff_id, None)

    # ------------------------------------------------------------ dedup, waiting, wake-ups
    def seen_add(self, handoff_id: str, now: datetime, mark: str | None = None, *,
                 if_absent: bool = False) -> None:
        with self._lock:
            if if_absent and self._seen_recently(handoff_id, now):
                return
            self._seen[handoff_id] = now
            if mark is None:
                self._seen_mark.pop(handoff_id, None)
            else:
                self._seen_mark[handoff_id] = mark

    def seen_marks(self, handoff_id: str, now: datetime) -> frozenset[str | None]:
        with self._lock:  # (one record an id: the last made, as the PostgreSQL store keeps)
            if not self._seen_recently(handoff_id, now):
                return frozenset()
            return frozenset({self._seen_mark.get(handoff_id)})

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        with self._lock:
            return self._seen_recently(handoff_id, now)

    def _seen_recently(self, handoff_id: str, now: datetime) -> bool:
        seen = self._seen.get(handoff_id)
        return seen is not None and now - seen < self.seen_ttl

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        return wait_via_feed(self, handoff_id, timeout)

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        return self._subscribers.add(only_kinds(callback, kinds))

    def close(self) -> None:
        """Nothing to release."""


class MemoryContext:
    """:class:`~handoffd.core.storage.SharedContext` in a dict (tests: the conformance suite,
    the context mirror without a database). Thread-safe; writes are serialised by one lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._values: dict[str, tuple[bytes, int]] = {}
        self._history: builtins.list[dict[str, Any]] = []

    def read(self, key: str) -> tuple[bytes | None, int]:
        with self._lock:
            found = self._values.get(key)
        return (None, 0) if found is None else found

    def write(self, key: str, change: ContextChange) -> dict[str, Any]:
        with self._lock:
            old, revision = self.read(key)
            data, entry = change(old, revision)
            self._values[key] = (bytes(data), revision + 1)
            self._history.append(copy.deepcopy(entry))
        return entry

    def keys(self, prefix: str = "") -> builtins.list[str]:
        with self._lock:
            return sorted(k for k in self._values if k.startswith(prefix))

    def history(self, key: str | None = None, *,
                limit: int = HISTORY_LIMIT) -> builtins.list[dict[str, Any]]:
        kept: deque[dict[str, Any]] = deque(maxlen=max(limit, 0))
        with self._lock:
            kept.extend(e for e in self._history if key is None or e.get("key") == key)
            return [copy.deepcopy(e) for e in kept]

    def latest(self, keys: builtins.list[str]) -> dict[str, dict[str, Any]]:
        wanted, last = set(keys), {}
        with self._lock:
            for entry in self._history:
                if (found := entry.get("key")) in wanted:
                    last[found] = entry
            return copy.deepcopy(last)

    def revisions(self) -> dict[str, int]:
        with self._lock:
            return {k: rev for k, (_, rev) in self._values.items()}

    def read_many(self, keys: builtins.list[str]) -> dict[str, tuple[bytes, int]]:
        with self._lock:
            return {k: self._values[k] for k in keys if k in self._values}


class MemoryViolationLog:
    """:class:`~handoffd.core.storage.ViolationLog` in a list."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: builtins.list[dict[str, Any]] = []

    def append(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._entries.append(copy.deepcopy(entry))

    def read(self) -> Iterator[dict[str, Any]]:
        index = 0
        while True:  # one entry copied at a time (the lock is not held while the caller reads)
            with self._lock:
                if index >= len(self._entries):
                    return
                entry = copy.deepcopy(self._entries[index])
            index += 1
            yield entry
