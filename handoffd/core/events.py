"""The event stream: every transition of every handoff, appended once to an event log.

A backend makes each transition atomic; :class:`RecordingBackend` wraps any backend (files,
memory, PostgreSQL) and, after each transition the backend confirmed, appends one event (a flat
JSON object) to an :class:`EventLog`. The event's name and details come from the history entry
the caller recorded in the document (``completed`` with its ``seconds`` and ``code``,
``retry_scheduled``, ``recovered``...), so the log and each document's history never disagree.
``handoff stats``, the Prometheus metrics, ``handoff top`` and ``handoff ls --watch`` read it.

The log is a view, not the truth: it is written after the transition (a crash between the two
loses one line, never a handoff) and a failing write is logged once, never raised.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Iterator, Protocol

from .documents import BOOK, book_int
from .logs import log
from .states import State
from .storage import Backend, Claim, Claims, Describe, Doc, Meta
from .timeutil import iso, parse_iso

Event = dict[str, Any]
# the details of a history entry that are worth a line in the log (bounded: no document content)
DETAIL_KEYS = ("code", "seconds", "retry", "delay_seconds", "reason", "forced")
MAX_TEXT = 200
START = "start"  # EventLog.tail: from the oldest event kept
SET_ASIDE = "set-aside"  # the "state" of an event for a document moved into quarantine
RUNNING = State.IN_PROGRESS.value  # the "state" of a `claimed` event (an enum's value is a call)
# a time as :func:`~handoffd.core.timeutil.iso` writes it (UTC, milliseconds, "Z"): a history
# entry's time in this form is the event's as it stands (parsed and formatted back, the same)
ISO_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z")


class EventLog(Protocol):
    """Where events go and how they are read back (files: ``handoffs/.meta/events.jsonl``)."""

    def append(self, event: Event) -> None:
        """Append one event (one write; never partially visible to readers)."""
        ...

    def read(self, since: datetime | None = None) -> Iterator[Event]:
        """Every event kept (oldest first), those at or after ``since`` when given."""
        ...

    def tail(self, cursor: Any = None) -> tuple[list[Event], Any]:
        """Events appended after ``cursor`` (None: from now on, nothing is returned for the
        past; :data:`START`: every event kept) and the cursor to pass next time."""
        ...


def tail_into(log: EventLog, cursor: Any, take: Callable[[Event], None],
              gap: Callable[[], None] | None = None) -> Any:
    """``log.tail(cursor)`` with each event handed to ``take`` as it is read, where the log can
    (the files backend's ``tail_into``: a first look from :data:`START` then never holds every
    event kept at once), else from the list ``tail`` gives; the cursor to pass next time.
    ``gap()``: called when the log says events may have been dropped unread since ``cursor``
    (files: rotated past the files kept between two reads)."""
    stream = getattr(log, "tail_into", None)
    if stream is not None:
        return stream(cursor, take) if gap is None else stream(cursor, take, gap)
    events, cursor = log.tail(cursor)
    for event in events:
        take(event)
    return cursor


def after(event: Event, since: datetime) -> bool:
    """True when ``event`` happened at or after ``since`` (an unreadable time: False)."""
    try:
        return parse_iso(str(event.get("at"))) >= since
    except ValueError:
        return False


def last_entry(doc: Doc) -> dict[str, Any]:
    """The newest history entry of ``doc``'s bookkeeping block ({} when there is none)."""
    block = doc.get(BOOK)
    history = block.get("history") if isinstance(block, dict) else None
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        return history[-1]
    return {}


def queue_wait(doc: Doc, claimed_at: datetime) -> float | None:
    """How long a just-claimed handoff waited since it became due: since the event before its
    claim (created, or its ``due_at`` when scheduled; retry_scheduled + its delay;
    handed_back...), None when unknown. (A dependant's is cut to the time since its last
    dependency's filing before its handler starts: :mod:`handoffd.features.dependencies`.)"""
    block = doc.get(BOOK)
    history = block.get("history") if isinstance(block, dict) else None
    if not isinstance(history, list) or len(history) < 2 or not isinstance(history[-2], dict):
        return None
    before = history[-2]
    try:
        due = _parse_time(before.get("at")).timestamp()
    except ValueError:
        return None
    given = before.get("detail")
    detail: dict[str, Any] = given if isinstance(given, dict) else {}
    delay = detail.get("delay_seconds")
    if isinstance(delay, (int, float)) and not isinstance(delay, bool) and 0 <= delay < 1e9:
        due += delay
    try:
        if isinstance(detail.get("due_at"), str):  # created with --at / --delay
            due = max(due, parse_iso(detail["due_at"]).timestamp())
    except ValueError:
        pass
    return round(max(claimed_at.timestamp() - due, 0.0), 6)


def _parse_time(given: Any) -> datetime:
    """``parse_iso(str(given))``; a time in the form :func:`iso` writes (our own history's) is
    read by ``datetime.fromisoformat`` alone. ValueError when it is no time."""
    own = _own_time(given)
    return own.replace(tzinfo=timezone.utc) if own is not None else parse_iso(str(given))


def _own_time(given: Any) -> datetime | None:
    """``given`` read as the naive UTC time it says when it is in the form :func:`iso` writes
    (C calls only); None for any other form; ValueError for that form naming no real time (a
    13th month)."""
    if isinstance(given, str) and ISO_TIME.fullmatch(given):
        return datetime.fromisoformat(given[:-1])
    return None


class RecordingBackend:
    """A backend that appends an event to ``events`` after each transition it confirms; every
    other attribute is the wrapped backend's (``inner``). A claim is logged (``claimed``) only
    when its handler starts (:meth:`handler_starts`): a claim taken only to file or change the
    document is no start, and its filing carries no run time."""

    def __init__(self, inner: Backend, events: EventLog, describe: Describe,
                 clock: Callable[[], datetime]) -> None:
        self.inner = inner
        self.events = events
        self.describe = describe
        self.clock = clock
        self._warned = False
        # told of each event after it is logged (handoffd serve -v logs filings with them)
        self.listeners: list[Callable[[Event], None]] = []

    OWN = frozenset({"inner", "events", "describe", "clock", "_warned", "listeners"})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a setting of the store (a test's claim_grace_seconds...) goes to the store itself
        if name in self.OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # ------------------------------------------------------------ the transitions
    def create(self, doc: Doc, handoff_id: str, now: datetime, **kwargs: Any) -> None:
        """See Backend.create."""
        self.inner.create(doc, handoff_id, now, **kwargs)
        self.emit("created", handoff_id, State.PENDING, doc, at=now)

    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float,
                   **kwargs: Any) -> Claim | None:
        """See Backend.claim_next."""
        return self._claimed(self.inner.claim_next(targets, now, lease_seconds, **kwargs), now)

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float,
              **kwargs: Any) -> Claim | None:
        """See Backend.claim."""
        return self._claimed(self.inner.claim(handoff_id, now, lease_seconds, **kwargs), now)

    def _claimed(self, claim: Claim | None, now: datetime) -> Claim | None:
        if claim is not None:
            claim.meta = self._meta(claim.doc)
            # no event yet: a claim is a start only once its handler starts (handler_starts);
            # one that only files or changes the document (a cancel, an answer, an
            # aggregation, an expiry, a set-aside) logs its filing alone. The wait is taken
            # now, while the history's entry before the claim is the last but one
            claim.claimed_at, claim.wait = now, queue_wait(claim.doc, now)
        return claim

    def handler_starts(self, claim: Claim, now: datetime) -> None:
        """See Backend.handler_starts: the ``claimed`` event (once per claim), at the claim's
        time, with its attempt and queue wait."""
        if claim.handler_started:
            return
        self.inner.handler_starts(claim, now)
        claim.handler_started = True
        self.emit("claimed", claim.id, RUNNING, claim.doc, at=claim.claimed_at or now,
                  attempt=claim.attempt, wait=claim.wait, meta=claim.meta)

    def finish(self, claim: Claim, state: State, doc: Doc) -> bool:
        """See Backend.finish."""
        done = self.inner.finish(claim, state, doc)
        if done:
            self._released(claim, state, doc, given_back=False)
        return done

    def requeue(self, claim: Claim, doc: Doc, due_at: datetime | None, *,
                count_attempt: bool) -> bool:
        """See Backend.requeue."""
        done = self.inner.requeue(claim, doc, due_at, count_attempt=count_attempt)
        if done:
            self._released(claim, State.PENDING, doc, given_back=not count_attempt)
        return done

    def _released(self, claim: Claim, state: State, doc: Doc, *, given_back: bool) -> None:
        """The event of a claim's filing or requeue. A claim whose handler never started here
        (a cancel's, an answer's, an aggregation's, an expiry's, the sweep's take-over) ran
        nothing: its event has no ``seconds`` (the outcome's are not a run time) and the
        attempt its document keeps, not the one its claim counted."""
        if claim.handler_started:
            self.emit_entry(claim.id, state, doc, attempt=claim.attempt, meta=claim.meta)
            return
        attempt = book_int(doc, "attempt", claim.attempt)
        attempt = max(attempt - 1, 0) if given_back else attempt  # (as the store stamps it)
        self.emit_entry(claim.id, state, doc, attempt=attempt, meta=claim.meta, ran=False)

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        """See Backend.expired_claims (each takeover is an event; its filing is another)."""
        claims = self.inner.expired_claims(now, lease_seconds)
        for claim in claims:
            self.emit("taken_over", claim.id, State.IN_PROGRESS, claim.doc, at=now,
                      attempt=claim.attempt, reason=claim.recovered)
        return claims

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        """See Backend.set_aside."""
        done = self.inner.set_aside(handoff_id, state, code, message, claim=claim)
        if done:
            self.emit("set_aside", handoff_id, SET_ASIDE, None, code=code, reason=message,
                      was=state.value)
        return done

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        """See Backend.create_failed."""
        done = self.inner.create_failed(handoff_id, doc)
        if done:
            self.emit_entry(handoff_id, State.FAILED, doc)
        return done

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        """See Backend.reopen."""
        done = self.inner.reopen(handoff_id, doc)
        if done:
            self.emit_entry(handoff_id, State.PENDING, doc)
        return done

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        """See Backend.purge."""
        done = self.inner.purge(handoff_id, state, now, expect=expect)
        if done:
            self.emit("purged", handoff_id, state, None, at=now)
        return done

    # ------------------------------------------------------------ writing events
    def emit_entry(self, handoff_id: str, state: State, doc: Doc, *, ran: bool = True,
                   **extra: Any) -> None:
        """An event named after the newest history entry of ``doc`` (what the caller recorded).
        ``ran`` False: no handler ran for it, so its ``seconds`` are left out (no run time)."""
        entry = last_entry(doc)
        detail = entry.get("detail")
        fields = {k: detail[k] for k in DETAIL_KEYS if isinstance(detail, dict) and k in detail
                  and (ran or k != "seconds")}
        at: datetime | str | None = None
        given = entry.get("at")
        try:
            if _own_time(given) is not None:  # (a real time: ValueError if not)
                at = given  # our own form: no parse and format back (the common case)
            elif given is not None:
                at = parse_iso(str(given))
        except ValueError:  # (no time: the event's is now)
            at = None
        self.emit(str(entry.get("event") or state.value), handoff_id, state, doc, at=at,
                  **extra, **fields)

    def _meta(self, doc: Doc) -> Meta | None:
        """``describe(doc)``; None for a document that defeats it (it still gets its events)."""
        try:
            return self.describe(doc)
        except Exception:
            return None

    def emit(self, name: str, handoff_id: str, state: State | str, doc: Doc | None, *,
             at: datetime | str | None = None, meta: Meta | None = None, **fields: Any) -> None:
        """Append one event; a failing write is logged (once), never raised. ``meta``: the
        document's routing facts when the caller has them (its claim's), else read from ``doc``.
        ``at``: when (now if None), or a time already as :func:`iso` writes it."""
        when = at if isinstance(at, str) else iso(at or self.clock())
        event: Event = {"at": when, "event": name, "id": handoff_id,
                        # (_value_: the enum's ``value`` property costs two Python calls)
                        "state": state._value_ if isinstance(state, State) else state}
        if meta is None and doc is not None:
            meta = self._meta(doc)
        if meta is not None:
            event["agent"] = meta.target
            event["priority"] = meta.priority
        for key, value in fields.items():
            if value is None:
                continue
            event[key] = value[:MAX_TEXT] if isinstance(value, str) else value
        try:
            self.events.append(event)
        except Exception as exc:  # the log is a view: never fail a transition over it
            if not self._warned:
                log.warning("cannot write the event log (%s); transitions go on unlogged", exc)
                self._warned = True
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not fail the transition either
                log.exception("event listener %r failed", listener)

