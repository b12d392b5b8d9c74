"""What the backends share: the interface they implement (defined in :mod:`handoffd.core.storage`,
re-exported here) and the helpers that keep their bookkeeping identical (stamps, due times,
ordering, wake-up subscribers, waiting built on the wake-up feed)."""
from __future__ import annotations

import copy
import errno
import math
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection

from ..core.documents import BOOK, actor, book, book_int, check_id, next_attempt_at, record
from ..core.errors import (
    ErrorCode,
    InvalidDocument,
    InvalidTransition,
    NotDue,
    NotFound,
    UsageError,
    WaitTimeout,
)
from ..core.settings import DaemonSettings
from ..core.states import TERMINAL, State
from ..core.storage import (
    LOST,
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    Meta,
    Order,
    Row,
    Rows,
    Wakeup,
    WakeupCallback,
    Where,
    describe_native,
)
from ..core.timeutil import iso, parse_iso

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
SAFETY_RECHECK_SECONDS = 2.0  # wake-ups are hints: waiters look again now and then regardless

__all__ = ["Backend", "Claim", "Claims", "Describe", "Doc", "Meta", "NotFiled", "Order", "Row",
           "Rows", "UnreadableCopy", "Wakeup", "WakeupCallback", "Where", "check_wait_timeout",
           "describe_native",
           "refiling"]


# ---------------------------------------------------------------- helpers shared by backends
class FencedFiling:
    """``finish`` and ``requeue`` as every backend implements them: both end a claim through the
    backend's ``_release``, which is fenced by the claim's token (a lost claim files nothing)."""

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        raise NotImplementedError  # the backend's own fenced write; ``copied``: doc is ours

    def finish(self, claim: Claim, state: State, doc: Doc) -> bool:
        """File a claimed handoff in a terminal state (see Backend.finish)."""
        if state not in TERMINAL:
            raise InvalidTransition(f"handoff {claim.id}: finish files completed or failed, not "
                                    f"{state.value}; use requeue", handoff_id=claim.id)
        return self._release(claim, state, doc)

    def requeue(self, claim: Claim, doc: Doc, due_at: datetime | None, *,
                count_attempt: bool) -> bool:
        """Put a claimed handoff back in pending (see Backend.requeue)."""
        stored = copy.deepcopy(doc)
        stamp_requeued(stored, due_at, count_attempt)
        return self._release(claim, State.PENDING, stored, copied=True)



# ---------------------------------------------------------------- a copy that cannot be read
class UnreadableCopy(InvalidDocument):
    """What a backend's ``get`` raises when every copy of a handoff it found is unreadable:
    the chosen copy's error, with the folder it lies in (``state``) and whether it may still be
    being written (``settling``: a half-written document, changed within the settle window).
    A wait goes on for a copy in pending/, or one still settling, and for a while for one in
    in-progress/ (a daemon's claim of junk, set aside with a failure stub right after; see
    :class:`_Looks`); any other unreadable copy ends it with the read error (it waited for
    ever)."""

    def __init__(self, message: str, *, state: State, settling: bool = False,
                 handoff_id: str | None = None, code: str = ErrorCode.INVALID_DOCUMENT,
                 errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(message, handoff_id=handoff_id, code=code, errors=errors)
        self.state = state
        self.settling = settling


# ---------------------------------------------------------------- a failed filing, kept to refile
# what a filing can fail of and succeed at a later try, with nothing to change in the document:
# space, descriptors or memory running out, an I/O error, a permission an operator will fix
PASSING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EMFILE, errno.ENFILE,
                            errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.EACCES,
                            errno.EPERM, errno.EROFS})
# what a filing fails of for its size (EFBIG: beyond this process's file size limit, ulimit -f):
# the same answer never succeeds, but a smaller one may; the claim is kept (NotFiled) all the
# same, for the caller to file a small failure instead (service.held) rather than give the
# claim up and have the handler run again, and fail again, attempt after attempt
SHRINKABLE_ERRNOS = frozenset({errno.EFBIG})


class NotFiled(OSError):
    """A filing (finish or requeue) of a claim under :func:`refiling` failed for a passing reason
    (:data:`PASSING_ERRNOS`: a full disk; or :data:`SHRINKABLE_ERRNOS`: too large) before
    anything was written where it was going. The claim is still the caller's (not finished, not
    given up: keep renewing it), its document is as it was when :func:`refiling` began, and the
    same outcome (or, too large, a smaller one) may be filed again later, or the claim given up
    (``abandon``). Outside :func:`refiling` such a failure gives the claim up."""


_refiled: dict[str, Doc] = {}  # claim token -> its document as a refiling filing began
_refiled_lock = threading.Lock()


class refiling:  # (named as the function it was: ``with refiling(claim):``)
    """Around a filing of ``claim`` whose caller files it again if it fails for a passing reason:
    the backend then raises :class:`NotFiled` rather than give the claim up (backends that
    cannot tell raise what they always raised). A shallow copy of its document is kept meanwhile
    (the filing records events in it; a refile must not record them twice). A class, not a
    generator under ``contextmanager``: every answer a daemon files goes through it, and that
    cost five Python calls more."""

    __slots__ = ("claim",)

    def __init__(self, claim: Claim) -> None:
        self.claim = claim

    def __enter__(self) -> None:
        with _refiled_lock:
            _refiled[self.claim.token] = _before_filing(self.claim.doc)

    def __exit__(self, *exc: object) -> None:
        with _refiled_lock:
            _refiled.pop(self.claim.token, None)


def refiled_copy(token: str | None, exc: OSError) -> Doc | None:
    """For a backend whose filing of the claim with ``token`` failed with ``exc`` before anything
    was written: the document to restore the claim's to before it raises :class:`NotFiled`, or
    None when the claim is given up as before (no :func:`refiling`, or no passing reason)."""
    if token is None or not (exc.errno in PASSING_ERRNOS or exc.errno in SHRINKABLE_ERRNOS):
        return None
    with _refiled_lock:
        return _refiled.get(token)


def restore(doc: Doc, saved: Doc, lease: Any) -> None:
    """Put a claim's document ``doc`` back as ``saved`` (see :func:`refiled_copy`), in place
    (the backend's claim shares it), with its current ``lease`` (renewed meanwhile)."""
    doc.clear()
    doc.update(_before_filing(saved))  # (a copy again: a second failure restores it too)
    if lease is not None:
        book(doc)["lease"] = lease


def _before_filing(doc: Doc) -> Doc:
    """What filing changes of a document, copied: its top level (a format's status), the
    bookkeeping block and its history (events are appended, old ones cut)."""
    saved = dict(doc)
    block = doc.get(BOOK)
    if isinstance(block, dict):
        saved[BOOK] = block = dict(block)
        if isinstance(block.get("history"), list):
            block["history"] = list(block["history"])
    return saved

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


def stamp_created(doc: Doc, handoff_id: str, now: datetime,
                  due_at: datetime | None = None) -> None:
    """Bookkeeping of a newly created document: a fresh block and a ``created`` event (with
    ``next_attempt_at`` when it is not due before ``due_at``)."""
    doc[BOOK] = {"id": handoff_id}
    record(doc, "created", now, **({"due_at": iso(due_at)} if due_at else {}))
    if due_at is not None and due_at > now:
        doc[BOOK]["next_attempt_at"] = iso(due_at)


def check_due(doc: Doc, handoff_id: str, now: datetime) -> None:
    """A claim for a run (``due_only``) of ``doc``, its bookkeeping trusted (a raw document's
    was emptied): NotDue when its ``next_attempt_at`` is still to come. What the caller read of
    it before (a scheduler's peek) may be older than a back-off another process set since:
    the claim's own read is the one that counts. Called before anything is stamped or written."""
    due = next_attempt_at(doc)
    if due is not None and due > now:
        raise NotDue(f"handoff {handoff_id} is not due before {iso(due)} (its retry back-off); "
                     "it stays in pending/", handoff_id=handoff_id, due_at=due)


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


def matches(row: Row, *, state: State | None, target: str | None, conversation: str | None,
            parent: str | None, since: datetime | None, where: Where | None = None,
            before: datetime | None = None) -> bool:
    """Does ``row`` pass every filter of :meth:`Backend.list`?"""
    return ((state is None or row.state is state)
            and (target is None or row.meta.target == target)
            and (conversation is None or row.meta.conversation == conversation)
            and (parent is None or row.meta.parent == parent)
            and (since is None or row.updated_at >= since)
            and (before is None or row.updated_at < before)
            and (where is None or where(row)))


def select(rows: Rows, *, state: State | None, target: str | None, conversation: str | None,
           parent: str | None, since: datetime | None, limit: int | None, order: Order,
           where: Where | None = None, before: datetime | None = None) -> Rows:
    """Filter, order and cut rows the way :meth:`Backend.list` promises."""
    kept = [r for r in rows if matches(r, state=state, target=target, conversation=conversation,
                                       parent=parent, since=since, where=where, before=before)]
    if order == "due":
        kept.sort(key=lambda r: (r.meta.priority, r.due_at, r.id))
    else:
        kept.sort(key=lambda r: (r.updated_at, r.id), reverse=order == "newest")
    return kept if limit is None else kept[:max(limit, 0)]


def only_kinds(callback: WakeupCallback, kinds: Collection[str] | None) -> WakeupCallback:
    """``callback`` told only of ``kinds`` (and of lost hints); itself when ``kinds`` is None."""
    if kinds is None:
        return callback
    wanted = frozenset(kinds) | {LOST}

    def filtered(wakeup: Wakeup) -> None:
        if wakeup.kind in wanted:
            callback(wakeup)
    return filtered


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

    def fire(self, handoff_id: str, kind: str, settled: bool = True) -> None:
        """Tell every subscriber; exceptions they raise are swallowed (hints only)."""
        with self._lock:
            callbacks = list(self._callbacks)
        if not callbacks:  # (a batch's filings: nobody listens to its own store)
            return
        wakeup = Wakeup(handoff_id, kind, settled)
        for callback in callbacks:
            try:
                callback(wakeup)
            except Exception:  # a subscriber's bug must not break the writer that woke it
                pass


class WaitStop:
    """Ends a :func:`wait_via_feed` from another thread: :meth:`set` wakes the wait, which then
    raises WaitTimeout. An MCP client that cancels its ``wait_handoff`` must not leave a thread
    waiting out the whole timeout (they grew without bound, past every cap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._wakes: list[threading.Event] = []

    def set(self) -> None:
        """Stop every wait watching this (now, and any that starts watching later)."""
        with self._lock:
            self._stopped = True
            wakes = list(self._wakes)
        for wake in wakes:
            wake.set()

    def is_set(self) -> bool:
        """True once :meth:`set` was called."""
        return self._stopped

    def watch(self, wake: threading.Event) -> Callable[[], None]:
        """Set ``wake`` when the stop comes (at once if it has); returns the un-watch."""
        with self._lock:
            self._wakes.append(wake)
            if self._stopped:
                wake.set()

        def unwatch() -> None:
            with self._lock:
                self._wakes.remove(wake)
        return unwatch


def check_wait_timeout(timeout: float | None) -> None:
    """UsageError unless ``timeout`` is None or a finite number of seconds, 0 or more (``nan``
    never runs out): what every wait takes, checked before anything is done for it."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 <= timeout < math.inf):
        raise UsageError(f"a wait's timeout must be a number of seconds, 0 or more; not {timeout!r}")


def wait_via_feed(backend: Backend, handoff_id: str, timeout: float | None, *,
                  grace_not_found: float = 0.0,
                  until: Callable[[State, Doc], Any] | None = None,
                  stop: WaitStop | None = None) -> tuple[State, Doc]:
    """:meth:`Backend.wait_terminal` built on ``get`` and the wake-up feed (level-triggered:
    look, then sleep until a hint for this id or the safety recheck). NotFound once the id has
    been unknown for ``grace_not_found`` seconds (a producer may be about to drop it).
    ``until``: also return once it is true of the handoff's state and document. An id no
    handoff can have is InvalidDocument (UNSAFE_ID) at once, and ``timeout`` must be None or a
    finite number of seconds, 0 or more (UsageError): ``nan`` never ran out, and an unsafe id
    read as "still being written", so both waited for ever. ``stop``: WaitTimeout as soon as
    it is set (checked where the wait sleeps; setting it wakes the sleep). A copy that cannot
    be read is judged by :class:`_Looks`."""
    check_id(handoff_id)
    check_wait_timeout(timeout)
    look = _Looks(backend, handoff_id)
    found = look()
    if found is not None and (found[0].terminal or (until and until(*found))):
        return found  # already there: no watch to set up (most waits of a finished handoff)
    wake = threading.Event()
    unsubscribe = backend.subscribe(lambda w: wake.set() if w.handoff_id == handoff_id else None)
    unwatch = stop.watch(wake) if stop is not None else None
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    try:
        while True:
            wake.clear()
            if stop is not None and stop.is_set():
                raise WaitTimeout(f"the wait for handoff {handoff_id} was stopped",
                                  handoff_id=handoff_id)
            found = look()
            if found is None and time.monotonic() - start >= grace_not_found:
                raise NotFound(f"no handoff {handoff_id}; `handoff ls` lists them",
                               handoff_id=handoff_id)
            if found is not None and (found[0].terminal or (until and until(*found))):
                return found
            remaining = SAFETY_RECHECK_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(f"handoff {handoff_id} is still not finished after {timeout:g}s; "
                                  "wait again or check `handoff show`", handoff_id=handoff_id)
            wake.wait(min(remaining, SAFETY_RECHECK_SECONDS,
                          grace_not_found if found is None else SAFETY_RECHECK_SECONDS))
    finally:
        unsubscribe()
        if unwatch is not None:
            unwatch()


# how long after a copy was last seen unreadable a wait takes "no such handoff" for the moment
# between its set-aside and its failure stub: the daemon moves it to the quarantine, then
# files the stub (a wait woken by that move found nothing, and ended "no handoff", exit 3)
STUB_FOLLOWS_SECONDS = 5.0


class _Looks:
    """``backend.get`` as one wait looks, again and again, at one handoff. A copy that cannot
    be read reads as pending (keep waiting) where it may still come right: in pending/ (a
    producer still writing it; the daemon sets it aside and files its failure stub), or one
    still settling (half-written and changed within the settle window). One in in-progress/
    reads as in progress, with no document, while it may still be settled: a daemon renames a
    pending document into in-progress/ to claim it, and only then finds it unreadable and sets
    it aside with its stub; the sweep sets aside any other unreadable entry there once it has
    been left alone for the claim grace. So the wait goes on for the claim grace plus a sweep
    period from when it first saw it (:meth:`unsettled_seconds`; always within the wait's own
    timeout), and only then ends with the read error: nobody settles it (no daemon runs).
    Any other unreadable entry (a FIFO, a folder, a dangling symlink, a truncated document in
    completed/ or failed/, where nothing ever moves it) is the wait's answer at once: its read
    error (InvalidDocument, one line, exit 1); it waited for ever. An id found nowhere within
    :data:`STUB_FOLLOWS_SECONDS` of an unreadable copy is one being set aside (its stub
    follows): pending still."""

    def __init__(self, backend: Backend, handoff_id: str, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.handoff_id = handoff_id
        self.monotonic = monotonic  # (tests move it)
        self.unsettled_since: float | None = None  # first seen unreadable in in-progress/
        self.unreadable_at: float | None = None  # last seen unreadable, anywhere

    def __call__(self) -> tuple[State, Doc] | None:
        """Where the handoff stands, as the wait reads it (None: found nowhere)."""
        now = self.monotonic()
        try:
            found = self.backend.get(self.handoff_id)
        except UnreadableCopy as exc:
            self.unreadable_at = now
            if exc.state is State.PENDING or exc.settling:
                return (State.PENDING, {})
            if exc.state is not State.IN_PROGRESS:
                raise
            if self.unsettled_since is None:
                self.unsettled_since = now
            if now - self.unsettled_since >= self.unsettled_seconds():
                raise
            return (State.IN_PROGRESS, {})
        except InvalidDocument:  # (a backend that does not say where): a producer still writing it
            self.unreadable_at = now
            return (State.PENDING, {})
        if found is None and self.unreadable_at is not None \
                and now - self.unreadable_at < STUB_FOLLOWS_SECONDS:
            return (State.PENDING, {})  # set aside this instant: its failure stub follows
        return found

    def unsettled_seconds(self) -> float:
        """How long an unreadable copy in in-progress/ may still be settled: the store's claim
        grace (after which a sweep sets it aside) plus its sweep period (both as the workspace's
        handoffd.toml sets them; the defaults for a store that does not say)."""
        return (_seconds(self.backend, "claim_grace_seconds", DaemonSettings.claim_grace_seconds)
                + _seconds(self.backend, "sweep_seconds", DaemonSettings.sweep_seconds))


def _seconds(backend: Backend, name: str, default: float) -> float:
    """``backend``'s attribute ``name`` if it is a finite number of seconds, 0 or more, else
    ``default`` (a store without it, a wrapper's stand-in)."""
    value = getattr(backend, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value < math.inf:
        return default
    return float(value)


class MemoryRecords:
    """:class:`~handoffd.core.storage.Records` in a dict (the memory backend's)."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def read(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind`` (copies)."""
        with self._lock:
            return copy.deepcopy(self._data.get(kind, {}))

    def update(self, kind: str, key: str, change: Callable[[Any], Any]) -> Any:
        """Replace one record under the lock."""
        with self._lock:
            records = self._data.setdefault(kind, {})
            new = change(copy.deepcopy(records.get(key)))
            if new is None:
                records.pop(key, None)
            else:
                records[key] = copy.deepcopy(new)
            return new
