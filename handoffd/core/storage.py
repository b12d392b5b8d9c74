"""The storage interface every backend implements: files (the embedded default), memory (tests)
and PostgreSQL. It lives in the core because the engine is written against it; the backends
(``handoffd.backends``) implement it and share their helpers in ``backends/base.py``.

What a store keeps besides the handoffs (records, the shared context, the violations log, the
removal lock) is :mod:`.sidestores`. It is stated in terms a database can implement. A backend keeps whole documents and, beside each,
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

Some stores hold documents written by others (the files backend: agents drop JSON into
pending/). Such a document is *raw*: its bookkeeping is not ours (``Claim.raw``), it may be
unreadable (:meth:`Backend.peek` raises UnreadableDocument) and may have to be set aside
(:meth:`Backend.set_aside`). A database backend never meets those cases, but answers the same
calls.

Whose bookkeeping it is, is one rule (:meth:`Backend.trusted_book`): a document's ``handoffd``
block is handoffd's own only when the store vouches that handoffd wrote it where it was read
(files: its seal matches the folder; a database writes every block itself, so access to it is
the trust boundary). Every document :meth:`Backend.get` and :meth:`Backend.peek` hand out has
been through it (:func:`trusted_doc`): a block the store does not vouch for is emptied, so no
reader and no decision sees its history, attempts, errors, children or waits.
:meth:`Backend.list` hands out each document as stored (retention archives and compares exactly
that), with its routing facts, due time and update time taken from the trusted view; readers of
a row's bookkeeping take the row through :func:`trusted_doc` themselves. A finished document
without handoffd's own record is a *foreign filing* (:func:`foreign_filing`): seed 001's own
consumer may write completed/ and failed/ itself.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Collection, Literal, Protocol, runtime_checkable

from .documents import BOOK, book_int, check_id, priority_rank
from .errors import NotFound
# (what a store keeps besides the handoffs: imported from here by the backends and features)
from .sidestores import (  # noqa: F401
    HISTORY_LIMIT,
    Change,
    ContextBackend,
    ContextChange,
    Records,
    RemovalLock,
    SharedContext,
    ViolationLog,
)
from .states import State

Doc = dict[str, Any]
Order = Literal["newest", "oldest", "due"]
# Backend.live_stamps: the identity of a live handoff's stored copies (bytes equal from one call
# to the next only while none of them changed) and when one last changed (ns since the epoch)
LiveStamp = tuple[bytes, int]


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
    raw: bool = False  # a document from outside: the bookkeeping it carried was not ours
    # the routing facts of the document as claimed (the event recorder reads them once; the
    # events of the same attempt reuse them: its target and priority do not change while it runs)
    meta: Meta | None = field(default=None, repr=False, compare=False)
    # the event recorder's (core.events): when the claim was made and how long the handoff
    # had waited for it (due -> claimed), logged as its ``claimed`` event only once its handler
    # starts (:meth:`Backend.handler_starts`, which sets ``handler_started``). A claim that only
    # files or changes the document (a cancel, an answer, an aggregation, an expiry, a
    # set-aside) is no start: no ``claimed`` event, no queue wait, no run time
    claimed_at: datetime | None = field(default=None, repr=False, compare=False)
    wait: float | None = field(default=None, repr=False, compare=False)
    handler_started: bool = field(default=False, repr=False, compare=False)


@dataclass(frozen=True)
class Row:
    """One handoff as :meth:`Backend.list` returns it: ``doc`` as stored (a pending one as the
    scheduler reads it), ``meta``, ``due_at`` and ``updated_at`` from its trusted view (see the
    module docstring; :func:`trusted_doc` gives the view)."""

    id: str
    state: State
    doc: Doc
    meta: Meta
    due_at: datetime
    updated_at: datetime
    problem: Exception | None = None  # a document that cannot be read (``list(unreadable=True)``)


Where = Callable[[Row], bool]


@dataclass(frozen=True)
class Wakeup:
    """A hint that something may be worth looking at: ``kind`` is the state a handoff entered
    (a :class:`State` value), ``"cancel"`` for a new cancel request, ``"context"`` (with the key
    as id) for a write of a shared context that several hosts share, or ``"lost"`` (with an empty
    id) when hints were dropped and a reader should look at everything again. ``settled`` is
    False when the document may still be being written (look again in a moment)."""

    handoff_id: str
    kind: str
    settled: bool = True


LOST = "lost"  # Wakeup.kind: some hints were lost; rescan
# Claim.recovered of a claim this process itself ended without filing it (its filing failed:
# a full disk): no crash, so the sweep hands it back rather than charge an attempt
GIVEN_UP = "given up by this process"
# Claim.recovered of a claim its process gave up before its handler ever ran (its admission and
# its hand-back both ran short: :meth:`Backend.abandon_unrun`), whichever process recovers it:
# handed back uncounted, as a claim that never started (it was once charged as a crash)
GIVEN_UP_UNRUN = "given up unrun by its process"
# how Claim.recovered of a claim whose lease ran out begins: its owner stalled (SIGSTOP, a hung
# disk, a lost network) or is on another host; nothing says that its process died
LEASE_EXPIRED = "lease expired"


def owner_died(recovered: str | None) -> bool:
    """True when a recovered claim's reason (``Claim.recovered``) says its owner's process died
    (a free claim lock, an ended database session, a claim never leased): not given up by this
    process, nor given up unrun by its own, nor a lease that ran out under a stalled or distant
    owner."""
    return recovered not in (GIVEN_UP, GIVEN_UP_UNRUN) \
        and not (recovered or "").startswith(LEASE_EXPIRED)
CONTEXT = "context"  # Wakeup.kind: a shared context key (the id) was written


WakeupCallback = Callable[[Wakeup], None]
Rows = list[Row]
Claims = list[Claim]


@runtime_checkable
class Backend(Protocol):
    """Durable storage for handoff documents and their scheduling state (thread-safe)."""

    def prepare(self) -> None:
        """Load what the first write needs, so that a caller about to stamp a time that should
        be close to its write (``handoff create``) pays it before the stamp. Default: nothing."""
        return None

    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        """Store a new document as pending, only if ``handoff_id`` is free: raise
        DuplicateHandoff when a handoff with that id exists in any state, or the id was seen
        within the dedup TTL. Stamps the bookkeeping block (see the module docstring), records
        the id as seen and wakes subscribers. The caller's dict is not changed or kept.
        ``due_at``: not to be claimed before then (``handoff create --at/--delay``)."""
        ...

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        """The current state and a copy of the document as handoffd trusts it (see
        :func:`trusted_doc`), or None when the id is unknown."""
        ...

    def trusted_book(self, state: State, handoff_id: str, doc: Doc) -> Doc | None:
        """The ``handoffd`` block of ``doc``, as read from ``state``, when this store vouches
        that handoffd wrote it there; None when it does not (or there is no block). The one
        check every reader's view goes through (:func:`trusted_doc`). Default: the block, for a
        store that writes every block itself (a database: access to it is the trust boundary)."""
        block = doc.get(BOOK)
        return block if isinstance(block, dict) else None

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest", where: Where | None = None,
             unreadable: bool = False, before: datetime | None = None) -> Rows:
        """Handoffs matching every given filter (``since``: updated at or after it; ``before``:
        updated before it, which a store may use to read only old documents; ``where``: a
        predicate of the caller's, applied before ``limit``). ``order``: ``newest``/``oldest`` by
        last update, ``due`` as :meth:`claim_next` would hand them out. Documents that cannot be
        read are left out, unless ``unreadable``: then each is a row with an empty ``doc``, no
        routing facts and its ``problem`` (``where`` is not asked about it)."""
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
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        """Claim one pending handoff by id, due or not (to cancel or reject it). None when it is
        not pending (unknown, elsewhere, or another claimer won). ``due_only`` (a claim to run
        it): NotDue, the document left as it was (nothing counted nor written), when the
        trusted ``next_attempt_at`` of the document claimed is after ``now``
        (:func:`~handoffd.backends.base.check_due`)."""
        ...

    def handler_starts(self, claim: Claim, now: datetime) -> None:
        """``claim``'s handler starts now: the claim begins a run (the engine says so just
        before the handler is called; a claim that only files or changes the document never
        does). The event recorder logs the ``claimed`` event then, with the attempt and the
        queue wait as of the claim. Default: the claim is marked started."""
        claim.handler_started = True

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

    def seen_add(self, handoff_id: str, now: datetime, mark: str | None = None, *,
                 if_absent: bool = False) -> None:
        """Record ``handoff_id`` as used at ``now`` (dedup of documents arriving from outside),
        with ``mark``, that of the claim whose admission records it
        (:data:`~handoffd.core.documents.ID_MARK`; None: no claim's, e.g. a create's).
        ``if_absent``: only when it is not recorded within the TTL already, in one step: a
        store keeping one record an id must never replace a running claim's mark with none
        (its recovery would then take it for another document's duplicate)."""
        ...

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        """True when ``handoff_id`` was recorded within the dedup TTL before ``now``."""
        ...

    def seen_marks(self, handoff_id: str, now: datetime) -> frozenset[str | None]:
        """The marks ``handoff_id`` was recorded with within the dedup TTL before ``now`` (None
        for a record with none: no claim's, or one made before marks were recorded); empty
        when it was not recorded. A store keeping one record an id (memory, PostgreSQL) gives
        its last one's. Asked only after :meth:`seen_contains` said True, for a document
        recovered from a crash: it may be slower (the file store searches its whole record)."""
        ...

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        """Block until ``handoff_id`` is completed or failed and return it. NotFound when it does
        not exist; WaitTimeout after ``timeout`` seconds (None: no limit)."""
        ...

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        """Call ``callback`` (on any thread) with hints: a handoff entered pending or a terminal
        state, or a cancel request arrived. Hints may repeat or come late; writes of other
        processes count where the backend can see them. ``kinds``: only these (e.g.
        ``{"cancel"}`` for a batch), which spares a backend watching what nobody asked for;
        lost-event hints always come. Returns the unsubscribe function."""
        ...

    # ------------------------------------------------------------ what the engine and sweeper add
    def ids(self, state: State) -> builtins.list[str]:
        """Ids of the handoffs in ``state`` (cheap: no document is read)."""
        ...

    def live_stamps(self) -> dict[str, LiveStamp | None] | None:
        """Every pending and in-progress handoff, also one set aside by a move out of those
        states that is under way or died midway (it is live: the move files it, or the sweep
        puts it back), each with the :data:`LiveStamp` of its stored copies: what a caller read
        of a document stays true while its stamp is the same (retention's
        :mod:`~handoffd.features.liverefs`). None for an id whose copies cannot be stamped (one
        is not a regular file). Cheap: no document is read. Default: None, a store whose
        documents have no such identity (a caller reads each again)."""
        return None

    def stamp_of(self, handoff_id: str) -> LiveStamp | None:
        """The :data:`LiveStamp` of ``handoff_id``'s stored copies in any state (those
        :meth:`get` reads): what a caller read of it stays true while its stamp is the same (the
        children gate's memory of finished children). None when it cannot be stamped: no copy
        in a state (unknown, or held aside for an instant), one that is not a regular file, an
        id that names no document. Cheap: no document is read. Default: None, a store whose
        documents have no such identity (a caller reads it again)."""
        return None

    def stamps_of(self, handoff_ids: Collection[str]) -> dict[str, LiveStamp | None]:
        """:meth:`stamp_of` of each of ``handoff_ids``: what a rescan asks for every id a waiter
        waits on. Default: one :meth:`stamp_of` each; a store that answers many in one go
        (PostgreSQL: one query) overrides it."""
        return {handoff_id: self.stamp_of(handoff_id) for handoff_id in handoff_ids}

    def peek(self, handoff_id: str) -> Doc | None:
        """A copy of the pending document ``handoff_id`` (None when it is not pending), to route
        it before claiming. Raises UnreadableDocument when the stored document cannot be read."""
        ...

    def abandon(self, claim: Claim) -> None:
        """Give up a claim without filing it (the caller failed midway): its lease stays until
        recovery (:meth:`expired_claims`) takes it over."""
        ...

    def abandon_unrun(self, claim: Claim) -> None:
        """:meth:`abandon` a claim whose handler never ran, whose hand-back could not be
        written (a passing shortage of descriptors or memory), marked so where the store can
        without such a write, for whichever process recovers it: its ``Claim.recovered`` is
        then :data:`GIVEN_UP_UNRUN` (handed back uncounted, not charged as a crash). Default:
        :meth:`abandon`, unmarked."""
        self.abandon(claim)

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        """Move the document ``handoff_id`` out of ``state`` into quarantine with ``code`` and
        ``message`` (a document that must never run: unreadable, unsafe, a duplicate). With
        ``claim`` (state in-progress) the claim ends too. False when nothing was there."""
        ...

    def quarantined(self) -> builtins.list[Doc]:
        """The reasons recorded for documents set aside, oldest first."""
        ...

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        """Store ``doc`` as a failed handoff under an id nothing holds (the stub of a document set
        aside, so that waiters on the id end). False when the id is taken."""
        ...

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        """Put a failed handoff back in pending as ``doc`` (``handoff retry``). False when it is
        no longer failed; DuplicateHandoff when a pending copy exists already."""
        ...

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        """Delete the finished (completed or failed) handoff ``handoff_id`` from ``state``
        (retention). Its id is recorded as seen at ``now``, so that dedup still answers "used
        before" for the TTL. False when it is not in ``state``, or (``expect``) when the document
        there is no longer ``expect``: checked and deleted in one step, so that a retry filed
        meanwhile is never deleted in place of the version an archive holds."""
        ...

    def maintain(self, now: datetime, *, skip: Collection[str] = ()) -> dict[str, builtins.list[str]]:
        """The backend's own repairs, run by every sweep (files: duplicate copies, claims that
        died before recording a lease, orphaned temp and lock files, the seen-ids record).
        ``skip``: ids this process is working on. Returns what it did, by kind of repair."""
        ...

    def records(self) -> Records:
        """The shared records of this store (see :class:`Records`)."""
        ...

    def removal_lock(self) -> RemovalLock | None:
        """The store's own :class:`RemovalLock`, for a store that processes of several
        workspaces (hosts) share (PostgreSQL): a workspace's lock file orders the processes of
        its own host only. Default: None, the workspace's lock file
        (``handoffs/.meta/retention.lock``), which every process of the store shares."""
        return None

    def close(self) -> None:
        """Release what the backend holds (watch threads, connections)."""
        ...


FOREIGN_FILING = "filed by another consumer (its bookkeeping is not handoffd's)"


def get_handoff(backend: Backend, handoff_id: str) -> tuple[State, Doc]:
    """The current state and a copy of the document of ``handoff_id`` (the store's trusted
    view); NotFound if none, InvalidDocument for an unsafe id. :meth:`Engine.get
    <handoffd.core.engine.Engine.get>` reads through it; ``handoff show`` of a handoff that is
    not pending reads through it without an Engine."""
    check_id(handoff_id)
    found = backend.get(handoff_id)
    if found is None:
        raise NotFound(f"no handoff {handoff_id}; `handoff ls` lists them",
                       handoff_id=handoff_id)
    return found


def trusted_doc(backend: Backend, state: State, handoff_id: str, doc: Doc) -> Doc:
    """``doc`` (read from ``state``) as every reader takes it: itself when the store vouches for
    its ``handoffd`` block (:meth:`Backend.trusted_book`) or it has none; otherwise a shallow
    copy whose block is emptied, as a claim empties it. A finished document's keeps the
    revision it claims: never trusted (seals are: see the files store), it is only the token
    ``handoff retry`` compares to tell that the failure it moves is still the one it read.
    Taking a view twice changes nothing."""
    if BOOK not in doc or backend.trusted_book(state, handoff_id, doc) is not None:
        return doc
    view = dict(doc)
    claimed = book_int(doc, "revision", 0) if state.terminal else 0
    view[BOOK] = {"revision": claimed} if claimed else {}
    return view


def foreign_filing(state: State, doc: Doc) -> bool:
    """True for a finished document (a trusted view, see :func:`trusted_doc`) that holds no
    record of handoffd's: every transition handoffd makes records a history event, so a
    completed or failed document it filed always has a history. Such a document was filed by
    another consumer (seed 001's own writes completed/ and failed/ itself): readers take its
    state from its folder and its status and error from its own fields, never from the block."""
    block = doc.get(BOOK)
    return state.terminal and not (isinstance(block, dict)
                                   and isinstance(block.get("history"), list)
                                   and bool(block["history"]))


def describe_native(doc: Doc) -> Meta:
    """The default ``describe``: seed-001 fields (``target.agent_id``, ``priority``,
    ``conversation_id``, ``parent_id``, also read from ``handoffd.request_snapshot``)."""
    sources = _native_sources(doc)
    target = next((t["agent_id"] for s in sources if isinstance(t := s.get("target"), dict)
                   and isinstance(t.get("agent_id"), str)), None)
    return Meta(target, priority_rank(doc.get("priority")), _first_str(sources, "conversation_id"),
                _first_str(sources, "parent_id"))


def native_links(doc: Doc) -> tuple[str | None, str | None]:
    """(conversation, parent) as :func:`describe_native` reads them: what a dialect's
    describe takes from it once the document's envelope gave its target and priority."""
    sources = _native_sources(doc)
    return _first_str(sources, "conversation_id"), _first_str(sources, "parent_id")


def _native_sources(doc: Doc) -> list[Doc]:
    """Where :func:`describe_native` looks: the document, then its ``handoffd`` block's
    ``request_snapshot`` and the block itself."""
    sources = [doc]
    block = doc.get(BOOK)
    if isinstance(block, dict):
        snap = block.get("request_snapshot")
        sources += [snap] if isinstance(snap, dict) else []
        sources.append(block)
    return sources


def _first_str(sources: list[Doc], key: str) -> str | None:
    return next((v for s in sources if isinstance(v := s.get(key), str) and v), None)
