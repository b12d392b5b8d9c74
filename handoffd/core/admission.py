"""Claiming and admission: a pending handoff claimed and its format detected
(:func:`claim_pending`), then what it must pass before its specialist runs (:func:`admit`: it is
new, its file name is its id, it is valid, it has not expired nor run out of time, someone here
runs it), and what becomes of a document that must never run: set aside, with a failure stub
filed under its name so that ``handoff wait`` on it ends.

Written against the engine's public members (:class:`Admitting`), as a feature would be:
:meth:`Engine.take <handoffd.core.engine.Engine.take>` is
:meth:`~handoffd.core.engine.Engine.claim` (this module's :func:`claim_pending`), then
:func:`admit`.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .documents import (BOOK, CHECK, RECORD, UNRECORDED, Envelope, Outcome, arrival, book,
                        check_id, claim_mark, claim_marks, first_use_left, history_of,
                        mark_first_use, newest_among, record)
from .errors import (
    SHORTAGE_ERRNOS,
    ClaimShortage,
    DuplicateHandoff,
    ErrorCode,
    InvalidDocument,
    UnreadableDocument,
    claim_shortage,
)
from .formats import Dialect, FiledState, Formats, answer_refusal, id_refusal
from .hooks import Hooks
from .jobs import Job
from .logs import log
from .memorystrikes import memory_backoff, memory_strikes, out_of_memory
from .settings import DaemonSettings
from .specialists import HandlerContext, Specialist
from .states import State
from .storage import Backend, Claim
from .timeutil import Clock, iso
from .workspace import Workspace


# History events after which a handoff that started waits on its own work (a delegating parent
# for its children, a question for its answer) or was answered and has not run since: its next
# claim resumes that work. The events after which the next claim is a new start (a retry):
RESUMED_AFTER = frozenset({"delegated", "still_waiting", "needs_clarification", "blocked",
                           "answered"})
STARTS_AFTER = frozenset({"created", "retried", "retry_scheduled"})

if TYPE_CHECKING:  # for the type checker only: no class to build at each import
    class Admitting(Protocol):
        """What admission uses of an :class:`~handoffd.core.engine.Engine` (named here, not
        imported: engine.py imports this module)."""

        ws: Workspace
        settings: DaemonSettings
        backend: Backend
        formats: Formats
        hooks: Hooks[Any]
        clock: Clock

        def validate(self, doc: dict[str, Any], dialect: Dialect, *, subject: str | None = None,
                     handoff_id: str | None = None) -> None: ...

        def specialist_for(self, envelope: Envelope) -> Specialist | None: ...

        def deadline(self, envelope: Envelope, spec: Specialist | None,
                     arrived: datetime) -> datetime | None: ...

        def failure(self, started: datetime, code: str, message: str, *,
                    retryable: bool | None = None, errors: list[dict[str, str]] | None = None,
                    details: dict[str, Any] | None = None,
                    result: dict[str, Any] | None = None) -> Outcome: ...

        def file(self, claim: Claim, dialect: Dialect, spec: Specialist | None,
                 outcome: Outcome) -> State: ...

        def handback(self, claim: Claim, dialect: Dialect, *, reason: str) -> None: ...

        def requeue(self, claim: Claim, dialect: Dialect, event: str, *,
                    due_at: datetime | None = None, count_attempt: bool = False,
                    **detail: Any) -> State: ...


def claim_pending(engine: Admitting, handoff_id: str, *,
                  due_only: bool = False) -> tuple[Claim, Dialect] | None:
    """Claim a pending handoff and detect its format; None when there is nothing to claim
    (another process won, or the document was unusable and has been set aside). Raises
    DocumentNotReady; with ``due_only`` (a claim to run it), NotDue when the document claimed
    has a retry time still to come (left in pending/ as it was, nothing counted)."""
    now = engine.clock()
    found: list[Dialect] = []
    try:  # a name that is no safe id (one not even UTF-8) is set aside before any claim
        check_id(handoff_id)
    except InvalidDocument as exc:
        set_aside(engine, handoff_id, State.PENDING, ErrorCode.UNSAFE_ID,
                  f"file pending/{handoff_id}.json: {exc}", stub=False)
        return None

    def on_claim(doc: dict[str, Any]) -> None:
        dialect = engine.formats.detect(doc)
        found.append(dialect)
        book(doc)["dialect"] = dialect.name
        dialect.complete(doc, handoff_id, now)
        dialect.mark_claimed(doc, now)
        mark_first_use(doc)  # (a foreign document's: the mark its id is recorded with)

    try:
        claim = engine.backend.claim(handoff_id, now, engine.settings.lease_seconds,
                                     prepare=on_claim, due_only=due_only)
    except DuplicateHandoff as exc:  # an in-progress copy exists: never run a second one
        set_aside(engine, handoff_id, State.PENDING, ErrorCode.DUPLICATE_HANDOFF_ID, str(exc),
                  stub=False)
        return None
    except (InvalidDocument, UnreadableDocument) as exc:  # claimed, then unreadable
        if not set_aside(engine, handoff_id, State.IN_PROGRESS, exc.code, str(exc)):
            set_aside(engine, handoff_id, State.PENDING, exc.code, str(exc))
        return None
    if claim is None:
        return None
    memory_strikes.clear(handoff_id, "claim")  # (a MemoryError row ends: every store's claim)
    return claim, found[0]


def admit(engine: Admitting, claim: Claim, dialect: Dialect, now: datetime,
          arrived: datetime | None = None) -> Job | None:
    """The Job to run for a claimed handoff, or None when it may not run now: it was set aside,
    filed as failed, or handed back (nobody here runs it). ``arrived``: see
    :meth:`Engine.take <handoffd.core.engine.Engine.take>`."""
    doc, handoff_id = claim.doc, claim.id  # (its name was checked before the claim)
    try:  # any passing shortage met admitting it (the seen-ids record, a schema file): "not
        # now", the claim handed back uncounted. The seen-ids record's once escaped to the
        # worker's error path: left claimed, recovered as a crash, an attempt charged
        if not first_use(engine, claim, now):
            return None
        envelope = _envelope(engine, claim, dialect, now)
    except OSError as exc:  # (a MemoryError reading the document has its strikes: _envelope)
        if exc.errno not in SHORTAGE_ERRNOS:
            raise
        raise _short_at_admission(engine, claim, dialect, exc) from None
    except MemoryError as exc:  # (the seen-ids record's: not the document's fault)
        raise _short_at_admission(engine, claim, dialect, exc) from None
    if envelope is None:
        return None
    memory_strikes.clear(handoff_id, "admit")  # (a MemoryError row ends)
    spec = engine.specialist_for(envelope)
    if envelope.expires_at is not None and now >= envelope.expires_at and not resumes(doc):
        _file_unrun(engine, claim, dialect, spec, ErrorCode.EXPIRED,
                    _unrun_message(handoff_id, doc, envelope.expires_at, expired=True))
        return None
    # a parent waiting for its children is past its hard deadline only as the aggregation
    # tells (features.aggregation: open children are cancelled and counted timeout)
    deadline = None if isinstance(book(doc).get("waiting_children"), dict) else engine.deadline(
        envelope, spec, arrival(doc, arrived) or now)
    if deadline is not None and now >= deadline:
        _file_unrun(engine, claim, dialect, spec, ErrorCode.TIMEOUT,
                    _unrun_message(handoff_id, doc, deadline))
        return None
    if spec is None:
        engine.handback(claim, dialect, reason=f"no specialist registered for {envelope.target}")
        return None
    # the handler runs as its specialist's agent (a hi_moe hint nobody serves: its tier's), as
    # a command's HANDOFF_TARGET says: its context is that agent's
    ctx = HandlerContext(handoff_id=handoff_id, attempt=claim.attempt, root=engine.ws.root,
                         data=envelope.data, target=spec.agent,
                         max_output_bytes=engine.settings.max_output_bytes)
    return Job(claim, dialect, envelope, spec, ctx, started_at=now, deadline=deadline)


def first_use(engine: Admitting, claim: Claim, now: datetime) -> bool:
    """Do what is left of a claimed document's first use (:func:`_first_use_left`): True when
    it may go on (nothing was left, or its id was free and is recorded now), False when it was
    set aside as a reused id (DUPLICATE_HANDOFF_ID). Admission's rule, and that of whatever
    else carries out a claimed document itself (a seed 000 cancellation message:
    :func:`handoffd.features.cancellation.handle_message`), so that a document from outside
    whose claim was recovered before its first use has its id recorded in either."""
    left = _first_use_left(claim)
    return left is None or _first_use(engine, claim, now, left)


def first_use_or_short(engine: Admitting, claim: Claim, dialect: Dialect,
                       now: datetime) -> bool:
    """:func:`first_use` for a caller that carries a claimed document out itself (a seed 000
    cancellation message): a passing shortage (descriptors, memory) met in the seen-ids record
    raises the ClaimShortage saying so, carrying the claim, still held, as admission's does
    (:func:`admit`): whoever takes it hands it back uncounted (a daemon's worker keeps it when
    that write runs short too, :mod:`handoffd.service.shortclaims`). It once reached the
    worker's catch-all: a traceback, the claim left leased, recovered as a crash and an attempt
    charged."""
    try:
        return first_use(engine, claim, now)
    except OSError as exc:
        if exc.errno not in SHORTAGE_ERRNOS:
            raise
        raise _short_at_admission(engine, claim, dialect, exc) from None
    except MemoryError as exc:
        raise _short_at_admission(engine, claim, dialect, exc) from None


def _first_use(engine: Admitting, claim: Claim, now: datetime, left: str) -> bool:
    """A foreign producer's document (no bookkeeping of ours, or a hand-back's mark that its
    first use is not done: ``left``, see :func:`_first_use_left`): True when its id was not used
    recently, and it is recorded as used now (with its claim's mark,
    :data:`~handoffd.core.documents.ID_MARK`), or when the id was recorded by one of its own
    earlier claims (one cut by a crash after recording it); else it is set aside (False). While
    it runs, what is left is noted in the claim's bookkeeping (never written:
    :func:`hand_back_short` takes it into its event when a shortage cuts it short)."""
    block = book(claim.doc)
    events = history_of(claim.doc)
    if left == CHECK:
        block[UNRECORDED] = CHECK
        if engine.backend.seen_contains(claim.id, now):
            # a record made with the mark of one of its earlier claims is its own (the hot
            # path, a raw document's first claim, has none: no second look at the record)
            own = claim_marks(events[:-1])
            marks = engine.backend.seen_marks(claim.id, now) if own else frozenset({None})
            if own and not own.isdisjoint(marks):
                block.pop(UNRECORDED, None)
                return True  # recorded before the crash that cut that claim: go on
            if marks:  # (none: the record ran out between the two reads, R52: recorded below)
                block.pop(UNRECORDED, None)
                set_aside_claim(engine, claim, ErrorCode.DUPLICATE_HANDOFF_ID,
                                f"handoff id {claim.id} was already used recently; "
                                "a second document never re-runs the first")
                return False
    # searched and free: from here a hand-back only records it (its own id, added before a
    # shortage cut the add short, must never make it its own duplicate)
    block[UNRECORDED] = RECORD
    engine.backend.seen_add(claim.id, now, claim_mark(events[-1]) if events else None)
    block.pop(UNRECORDED, None)
    return True


def _first_use_left(claim: Claim) -> str | None:
    """What is left of a claimed document's first use (its id searched in the seen-ids record,
    then recorded): CHECK for a raw one (from outside), else what its history says is left
    (:func:`~handoffd.core.documents.first_use_left`: after a hand-back that said so, CHECK or
    RECORD, :data:`UNRECORDED`; after a recovery of a claim that had it to do, what that claim
    had left), else None. The history counts only as our own bookkeeping: a raw claim's block
    from outside was emptied, and it is checked in full anyway."""
    if claim.raw:
        return CHECK
    events = history_of(claim.doc)
    if not events:
        return None
    last = events[-1]
    if not (isinstance(last, dict) and last.get("event") == "claimed"):
        return None
    return first_use_left(events[:-1])


def _short_at_admission(engine: Admitting, claim: Claim, dialect: Dialect,
                        exc: OSError | MemoryError) -> ClaimShortage:
    """A claim whose admission ran short of descriptors or memory (the seen-ids record, a
    schema file): the ClaimShortage saying so (the worker backs off), carrying the claim, still held, for
    whoever takes it to hand back uncounted (:func:`hand_back_short`; a daemon's worker keeps
    it when that write runs short too). It once stayed leased in in-progress/ as an error: a
    batch left it there, and its recovery counted an attempt and took the specialist for a
    crasher."""
    short = claim_shortage(claim.id, exc, "admitted")
    short.claim, short.dialect = claim, dialect
    return short


def hand_back_short(engine: Admitting, short: ClaimShortage) -> State:
    """Hand the claim ``short`` carries back to pending/ uncounted (``handed_back``, with
    ``not_started`` naming the shortage): PENDING, or IN_PROGRESS when the claim was lost.
    A write that fails gives the claim up (the store's rule), unless the caller files under
    :func:`handoffd.backends.base.refiling`. A foreign document's first use cut short says
    what is left of it in that event (:data:`UNRECORDED`)."""
    # a foreign document's first use cut short: the event says what is left, for the
    # admission after it (_first_use_left)
    left = book(short.claim.doc).pop(UNRECORDED, None)
    mark = {UNRECORDED: left} if left in (CHECK, RECORD) else {}
    return engine.requeue(short.claim, short.dialect, "handed_back", reason=str(short),
                          not_started=short.reason, **mark)


def resumes(doc: dict[str, Any]) -> bool:
    """Whether the next claim of ``doc`` (its bookkeeping trusted: claimed, or peeked) resumes
    work its handoff started instead of starting it (again): it waits for its children or an
    answer, or was answered and has not started a new try since. An ``expires_at`` bounds
    starts only (see :class:`~handoffd.core.documents.Envelope`)."""
    block = doc.get(BOOK)
    if not isinstance(block, dict):
        return False
    if isinstance(block.get("waiting_children"), dict) or isinstance(block.get("awaiting"), dict):
        return True
    return newest_among(doc, RESUMED_AFTER, STARTS_AFTER)


def _file_unrun(engine: Admitting, claim: Claim, dialect: Dialect, spec: Specialist | None,
                code: str, message: str) -> None:
    """File a claimed handoff failed with ``code`` without running it (again). What it waited
    for goes with it: a later `handoff retry --force` starts it afresh, never parked again. The
    questions or blockers it was parked with go into the error (its ``details``, and the
    message :func:`_unrun_message` wrote): the report made when it was parked is gone with the
    ``awaiting`` block, and a sender reading only completed/ and failed/ saw nothing else."""
    block = book(claim.doc)
    block.pop("waiting_children", None)
    awaiting = block.pop("awaiting", None)
    asked = _asked(awaiting)
    details = {"awaiting": {"kind": str(awaiting.get("kind"))[:40], "asked": asked}} \
        if isinstance(awaiting, dict) and asked else None
    engine.file(claim, dialect, spec, engine.failure(engine.clock(), code, message,
                                                     retryable=False, details=details))


# history events after which the specialist had run (an attempt, counted or not, ended)
RAN_EVENTS = frozenset({"retry_scheduled", "throttled", "needs_clarification", "blocked",
                        "delegated", "recovered"})
MAX_ASKED_CHARS = 2000  # of the questions / blockers a timeout answer repeats (each 500)


def _unrun_message(handoff_id: str, doc: dict[str, Any], deadline: datetime, *,
                   expired: bool = False) -> str:
    """The message of a handoff claimed past its hard deadline (seed 000's TIMEOUT), or past
    its ``expires_at`` (``expired``). "Not started" only when it never ran since it arrived (or
    was sent again: ``retried``); else how many times it ran and what it waited for when the
    time passed (a retry, an answer: the questions it asked, which the answer would otherwise
    lose)."""
    block = book(doc)
    since: list[Any] = []
    for entry in reversed(history_of(doc)):
        if isinstance(entry, dict) and entry.get("event") == "retried":
            break
        since.append(entry)
    ran = sum(1 for entry in since if isinstance(entry, dict) and entry.get("event") in RAN_EVENTS)
    at = iso(deadline)
    awaiting = block.get("awaiting")
    if not ran and not isinstance(awaiting, dict):
        return (f"handoff {handoff_id} was not started before it expired at {at}" if expired
                else f"handoff {handoff_id} was not started before its deadline {at} (a hard "
                "timeout counts from its arrival)")
    last = next((entry.get("event") for entry in since
                 if isinstance(entry, dict) and entry.get("event") in RAN_EVENTS | {"answered"}),
                None)
    if isinstance(awaiting, dict):
        kind = str(awaiting.get("kind") or "needs_clarification")[:40]
        asked = "; ".join(_asked(awaiting))
        what = f"an answer ({kind})" + (f" to: {asked}" if asked else "")
    elif last == "answered":
        what = "its next attempt after it was answered"
    elif last == "throttled":
        what = "a retry after it was throttled"
    elif last == "delegated":
        what = "its children"
    else:
        what = "a retry"
    limit = f"it expired at {at}" if expired else \
        f"its deadline {at} (a hard timeout counts from its arrival) passed"
    return f"handoff {handoff_id} ran {max(ran, 1)} attempt(s); {limit} while it waited for {what}"


def _asked(awaiting: Any) -> list[str]:
    """The questions (or blockers' descriptions) a parked handoff's ``awaiting`` block holds,
    as text, within MAX_ASKED_CHARS all told (bookkeeping is ours, but typed anyway)."""
    if not isinstance(awaiting, dict):
        return []
    items = awaiting.get("questions") or awaiting.get("blockers") or []
    texts: list[str] = []
    left = MAX_ASKED_CHARS
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, dict):
            item = item.get("description") or item.get("question") or item.get("text") or ""
        text = str(item)[:min(500, left)] if isinstance(item, (str, int, float)) else ""
        if text:
            texts.append(text)
            left -= len(text)
        if left <= 0:
            break
    return texts


def _envelope(engine: Admitting, claim: Claim, dialect: Dialect, now: datetime) -> Envelope | None:
    """The claimed document's Envelope once it is valid and carries its file's id; None when it
    is not (set aside, or filed as failed)."""
    doc, handoff_id = claim.doc, claim.id
    try:
        # its id first, as `ls` asks it (Engine.peek): an unsafe id is set aside before
        # anything is read; an answer is refused as one before its file name is compared with
        # its id (a filed answer copied from another workspace carries the answer's own id;
        # its seal, and so the request it kept, do not travel) and before its answer schema is
        # checked; any other id than its file name is set aside
        refusal = id_refusal(dialect, doc, handoff_id) or answer_refusal(dialect, doc)
        if refusal is not None:
            raise refusal
        engine.validate(doc, dialect, handoff_id=handoff_id, subject=f"handoff {handoff_id} is "
                        f"not a valid {dialect.name} document")
        return dialect.envelope(doc)
    except InvalidDocument as exc:
        if exc.code in (ErrorCode.ID_MISMATCH, ErrorCode.UNSAFE_ID):
            set_aside_claim(engine, claim, exc.code, str(exc))
        else:
            engine.file(claim, dialect, None,
                        engine.failure(now, exc.code, str(exc), errors=exc.errors))
        return None
    except MemoryError:
        # "not now" (the daemon short of memory): handed back uncounted and read again after a
        # back-off; filed only when it runs out of memory again and again (core.jobs)
        problem = out_of_memory(handoff_id, f"handoff {handoff_id}", "admit")
        if problem.transient:  # (due after the back-off in every process: next_attempt_at)
            delay = memory_backoff(handoff_id)
            where = engine.requeue(claim, dialect, "handed_back", reason=str(problem),
                                   due_at=now + timedelta(seconds=delay))
            if where is State.PENDING:  # the worker says so, counts it handed back and backs
                # off (a batch waits for it: it once ended at once, exit 0, the work pending)
                short = claim_shortage(handoff_id, MemoryError(), "admitted")
                short.delay, short.handed_back = delay, True
                raise short
        else:
            engine.file(claim, dialect, None, engine.failure(
                now, problem.code, str(problem), retryable=False))
        return None
    except (RecursionError, ValueError, TypeError, ArithmeticError) as exc:
        # a document that defeats a reader (absurd nesting or sizes in an inline schema...)
        # is a bad document, filed with a code; it must never stay claimed for recovery
        log.warning("handoff %s: unreadable document: %s: %s", handoff_id,
                    type(exc).__name__, str(exc)[:200])
        engine.file(claim, dialect, None, engine.failure(
            now, ErrorCode.INVALID_DOCUMENT, f"handoff {handoff_id} cannot be read as a "
            f"{dialect.name} document: {type(exc).__name__}: {str(exc)[:200]}", retryable=False))
        return None


def set_aside_claim(engine: Admitting, claim: Claim, code: str, message: str) -> None:
    """Set aside a claimed document that must never run (the claim ends with it)."""
    set_aside(engine, claim.id, State.IN_PROGRESS, code, message, claim=claim,
              stub=code != ErrorCode.DUPLICATE_HANDOFF_ID)


def set_aside(engine: Admitting, handoff_id: str, state: State, code: str, message: str, *,
              claim: Claim | None = None, stub: bool = True) -> bool:
    """Set aside an unusable document; if its name is a free, safe id, file a failure stub
    under that id too so that `handoff wait` on it ends. False when it was already gone."""
    if not engine.backend.set_aside(handoff_id, state, code, message, claim=claim):
        return False
    place = getattr(engine.backend, "aside_place", None)  # a store without folders says where
    log.warning("set aside %s: %s: %s", place(state, handoff_id) if callable(place)
                else f"{state.value}/{handoff_id}.json", code, message)
    if not stub:
        return True
    try:
        file_stub(engine, handoff_id, code, message)
    except InvalidDocument:  # no safe id: nothing can be filed under that name
        pass
    return True


def used(backend: Backend, handoff_id: str, now: datetime) -> None:
    """Record the id of a document set aside unread as used (the seen-ids record), before its
    failure stub is filed: a file handoffd could not read (not JSON, too large...) never
    reached admission's record, and a dependant looked at before its stub (or without one,
    its filing cut short) was told it "does not exist; create it first". The gate reads this
    record, never the quarantine. Only an id no document holds and not recorded yet is: a
    running handoff's record, with its claim's mark, is never replaced (junk dropped under its
    id made its recovery take it for a duplicate, R-RA), also once that record is older than
    the TTL (a handoff running longer, RD). A failure to write it is one line: the stub still
    comes."""
    try:
        if backend.get(handoff_id) is not None:
            return  # (its id is the document's: the gate finds it, no record needed)
        backend.seen_add(handoff_id, now, if_absent=True)
    except Exception as exc:  # (a store away, a shortage, a refused statement: only a record)
        log.warning("handoff %s: cannot record its id as used: %s", handoff_id, exc)


def file_stub(engine: Admitting, handoff_id: str, code: str, message: str) -> bool:
    """File a native failure stub (``rejected`` with ``code``) under the id of a document set
    aside, so `handoff wait` and `show` on it end, and announce it to the ``on_filed``
    listeners (notifications, a waiting parent, dependants, the daemon's counts), its id
    recorded as used first (:func:`used`). False when a document of that id exists (or
    appeared since); InvalidDocument when it is no safe id (then nothing is recorded)."""
    check_id(handoff_id)
    now = engine.clock()
    used(engine.backend, handoff_id, now)
    doc: dict[str, Any] = {"handoff_id": handoff_id}
    record(doc, "rejected", now, code=code)
    book(doc)["dialect"] = "native"
    answer = engine.formats.by_name("native").render(
        doc, engine.failure(now, code, message), FiledState(0, 0, False))
    if not engine.backend.create_failed(handoff_id, answer):
        return False
    engine.hooks.announce(handoff_id, State.FAILED)
    return True
