"""Handoff documents: ids, the daemon's bookkeeping block, history, and the format-neutral views.

Every document keeps its own format; the daemon adds one block, ``handoffd``, holding what it needs
(revision, attempts, lease, next attempt time, history). :class:`Envelope` is the format-neutral view
the daemon routes by and :class:`Outcome` the format-neutral result it files; dialects translate.
The native (seed 001) format's reading, building and answering is :mod:`.native_format`.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Collection

from .config import MAX_SECONDS, RetryPolicy
from .errors import ConfigError, ErrorCode, InvalidDocument, UsageError
from .states import SUCCEEDED
from .timeutil import iso, parse_utc

# used with fullmatch: "^...$" with match() also took "abc\n" ("$" matches before a last newline)
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}")
BOOK = "handoffd"
PRIORITIES = {"critical": 0, "high": 1, "normal": 2, "medium": 2, "low": 3, "backlog": 4}
MAX_HISTORY = 200
# Bounds on what a document may ask for; anything outside is refused at admission (see Envelope).
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
MAX_DEPENDENCIES = 1000
# The most a time limit can add to a handoff's arrival (a document's timeout is at most a week,
# a configured one at most MAX_SECONDS): an arrival later than the calendar's end minus this is
# not believed, so computing its deadline can never pass year 9999
ARRIVAL_HEADROOM_SECONDS = max(MAX_SECONDS, MAX_TIMEOUT_SECONDS)
# what check_id asks of an id, as its refusals (and an ID_MISMATCH of an unsafe id) say it
SAFE_ID_RULE = "use 1-128 letters, digits and . _ - @ : +, starting with a letter or digit"


def check_id(handoff_id: object) -> str:
    """Return ``handoff_id`` if it is a safe file name, else raise InvalidDocument(UNSAFE_ID)."""
    if not isinstance(handoff_id, str) or not SAFE_ID.fullmatch(handoff_id) or ".." in handoff_id \
            or handoff_id.endswith(".tmp"):
        shown = repr(handoff_id)[:80]
        raise InvalidDocument(
            f"handoff id {shown} is not a safe file name: {SAFE_ID_RULE}", code=ErrorCode.UNSAFE_ID)
    return handoff_id


def is_safe_id(handoff_id: object) -> bool:
    """Whether ``handoff_id`` can name a document (:func:`check_id` without the exception)."""
    try:
        check_id(handoff_id)
    except InvalidDocument:
        return False
    return True


def new_id(now: datetime) -> str:
    """A fresh id in seed 001's ``hoff-...`` style, unique across hosts and processes."""
    return f"hoff-{now.strftime('%Y%m%d%H%M%S')}-{os.urandom(6).hex()}"


def random_uuid() -> str:
    """A random (version 4) UUID as text, for the formats whose ids are UUIDs."""
    import uuid  # it loads platform (~5 ms): only answers in those formats need it
    return str(uuid.uuid4())


def hostname() -> str:
    """This host's name, as ``socket.gethostname()`` gives it (both read uname; importing
    socket is a noticeable part of a CLI start that needs nothing else from it). Read once per
    process: history and leases name it about three times per handoff."""
    global _HOSTNAME
    if _HOSTNAME is None:
        _HOSTNAME = os.uname().nodename
    return _HOSTNAME


_HOSTNAME: str | None = None


def actor() -> dict[str, Any]:
    """Who is acting: this host and process (recorded in history and leases)."""
    return {"host": hostname(), "pid": os.getpid()}


def book(doc: dict[str, Any]) -> dict[str, Any]:
    """The document's ``handoffd`` bookkeeping block, created empty if absent or malformed."""
    block = doc.get(BOOK)
    if not isinstance(block, dict):
        block = {}
        doc[BOOK] = block
    return block


def raw_book(handoff_id: str) -> dict[str, Any]:
    """The bookkeeping block a claim gives a raw document (one from outside, whose block was
    not ours): only the id it is kept under, its file name, as a created one's names it (its
    answer names the handoff so: a hi_moe Outcome dropped as X is refused as X, whatever id or
    ``correlation_id`` it carries)."""
    return {"id": handoff_id}


def booked_id(doc: dict[str, Any]) -> str | None:
    """The id handoffd keeps ``doc`` under (its file name), as its bookkeeping block records
    it; None when the block names none (a document claimed before the id was recorded)."""
    block = doc.get(BOOK)
    given = block.get("id") if isinstance(block, dict) else None
    return given if isinstance(given, str) and given else None


def revision(doc: dict[str, Any]) -> int:
    """The document's transition counter as written (0 for a document no handoffd process has
    written). Only a sealed document's revision is trusted: see ``Store.trusted_revision``."""
    return book_int(doc, "revision", 0)


def book_int(doc: dict[str, Any], key: str, default: int) -> int:
    """An integer counter of the ``handoffd`` block, ``default`` when absent or not a sane int
    (a document's bookkeeping is read defensively: one bad value must not stop a sweep)."""
    block = doc.get(BOOK)
    value = block.get(key, default) if isinstance(block, dict) else default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        return default
    return value


def record(doc: dict[str, Any], event: str, now: datetime, **detail: Any) -> None:
    """Append a history event and bump the revision: call once per state transition."""
    block = book(doc)
    block["revision"] = revision(doc) + 1
    history = block.get("history")
    if not isinstance(history, list):
        history = block["history"] = []
    entry: dict[str, Any] = {"at": iso(now), "event": event, "actor": actor()}
    if detail:
        entry["detail"] = detail
    history.append(entry)
    if len(history) > MAX_HISTORY:  # keep the first event and the most recent ones
        del history[1:len(history) - MAX_HISTORY + 1]


def last_events(doc: dict[str, Any], count: int) -> list[Any]:
    """The names of the last ``count`` (or fewer) events of ``doc``'s history, oldest first."""
    history = book(doc).get("history")
    entries = history[-count:] if isinstance(history, list) and count > 0 else []
    return [entry.get("event") if isinstance(entry, dict) else None for entry in entries]


def in_a_row(doc: dict[str, Any], counts: Callable[[dict[str, Any]], bool]) -> int:
    """How many history entries the handoff's history ends with that ``counts`` (given each
    entry, a dict) takes, ``claimed`` entries between them skipped, not counted."""
    history = book(doc).get("history")
    count = 0
    for entry in reversed(history if isinstance(history, list) else []):
        if not isinstance(entry, dict):
            break
        if entry.get("event") == "claimed":
            continue
        if not counts(entry):
            break
        count += 1
    return count


def throttles_in_a_row(doc: dict[str, Any]) -> int:
    """How many ``throttled`` events the history ends with (claims between them not counted)."""
    return in_a_row(doc, lambda entry: entry.get("event") == "throttled")


# What a hand-back of a foreign document's claim says is left of its first use when its
# admission ran short before the seen-ids record took its id (the detail of its ``handed_back``
# event, so in our own bookkeeping: a block from outside is emptied at the claim): CHECK, the
# search for the id (not done), or RECORD (searched and free, not yet recorded). The admission
# right after that hand-back does what is left (core.admission): the hand-back made the
# document ours, no longer raw, and its id was once never recorded, so a later document reusing
# it ran again.
UNRECORDED = "id_unrecorded"
CHECK, RECORD = "check", "record"


def unrecorded_mark(event: Any) -> str | None:
    """What a ``handed_back`` history ``event`` says is left of its document's first use
    (:data:`UNRECORDED`): CHECK or RECORD (anything else: CHECK, never less than a raw document
    gets), or None when it is no such event."""
    if not (isinstance(event, dict) and event.get("event") == "handed_back"):
        return None
    detail = event.get("detail")
    mark = detail.get(UNRECORDED) if isinstance(detail, dict) else None
    if mark is None:
        return None
    return RECORD if mark == RECORD else CHECK


# The detail of a ``claimed`` event whose claim has its document's first use to do (a foreign
# document's: :func:`first_use_left`): a mark of that claim, random, which its admission
# records with the id in the seen-ids record. After a recovery, a search for the id tells a
# record made by one of this document's own claims (cut by a crash after recording it: its
# mark is in the history) from one made for anything else (an earlier document reusing the id:
# a duplicate). Before session 27 there was no mark, a search could not tell, and a recovered
# document was recorded without one: a second document reusing an id, cut by a crash before
# its admission, ran.
ID_MARK = "id_mark"


def claim_mark(event: Any) -> str | None:
    """The mark (:data:`ID_MARK`) of a ``claimed`` history ``event``; None when it carries none
    (a claim with no first use to do, or one made by a handoffd before session 27)."""
    if not (isinstance(event, dict) and event.get("event") == "claimed"):
        return None
    detail = event.get("detail")
    mark = detail.get(ID_MARK) if isinstance(detail, dict) else None
    return mark if isinstance(mark, str) and mark else None


def mark_first_use(doc: dict[str, Any]) -> None:
    """Give the claim just stamped on ``doc`` (its last history event, ``claimed``) a fresh
    :data:`ID_MARK` when it has the document's first use to do: a document from outside, at its
    first claim or with that left (:func:`first_use_left`). Called while the claim is made, so
    that the mark is in the document the store writes before its admission records the id."""
    events = history_of(doc)
    if not events or not (isinstance(events[-1], dict) and events[-1].get("event") == "claimed"):
        return
    if len(events) > 1 and first_use_left(events[:-1]) is None:
        return  # nothing of its first use left: our own document, or one admitted already
    detail = events[-1].get("detail")
    if not isinstance(detail, dict):
        detail = events[-1]["detail"] = {}
    # one mark a document: its earlier claims' if any, so the newest claim always carries the
    # mark its record was made with (a history keeps its first event and its last 200: a mark
    # of each claim once lost the recording one's after ~100 hand-backs, R52, and the document
    # was set aside as its own duplicate). Our bookkeeping alone: a raw claim's was emptied
    previous = next((mark for event in reversed(events[:-1])
                     if (mark := claim_mark(event)) is not None), None)
    detail[ID_MARK] = previous or os.urandom(8).hex()


def claim_marks(events: list[Any]) -> frozenset[str]:
    """The marks (:data:`ID_MARK`) of the claims in ``events``: a seen-ids record made with one
    was made by this document's own first use."""
    return frozenset(mark for event in events if (mark := claim_mark(event)) is not None)


def first_use_left(events: list[Any]) -> str | None:
    """What is left of the first use of a document (of our bookkeeping) whose ``history`` is
    ``events``, for its next claim's admission: CHECK, RECORD, or None (nothing: its id was
    recorded, or the document is our own, never recorded).

    A document from outside starts its history with its first claim's ``claimed`` event (a
    raw claim's block is emptied; every document of ours starts with ``created``, and the
    history's bound keeps the first event): that claim's admission searches for its id, then
    records it. A claim doing what is left ends it unless a ``handed_back`` event saying what
    is left (:func:`unrecorded_mark`: a shortage at admission) or a ``recovered`` one ends the
    claim first. After a recovery (its claimer died or gave it up, with or without admitting
    it) what was left stays left: whether the dead claimer searched or recorded is not known.
    CHECK then searches again, and a record bearing one of the document's own claim marks
    (:data:`ID_MARK`) is its own, recorded before the crash: it goes on (a search that could
    not tell, before session 27, set it aside as its own duplicate; so a recovery left RECORD,
    and a second document reusing an id, recovered before its admission, ran unsearched). A
    claim with no mark (made by an older handoffd, which recorded none) still leaves RECORD:
    a search could not tell its record from another's."""
    left: str | None = None
    running = False  # a claim whose admission does what is left is under way
    marked = False  # ... and it carries a mark (ID_MARK) its record is made with
    for index, event in enumerate(events):
        kind = event.get("event") if isinstance(event, dict) else None
        if kind == "claimed":
            if running:  # the claim before ended otherwise: its admission did it
                left = None
            if index == 0:  # a document from outside: its first claim
                left = CHECK
            running = left is not None
            marked = claim_mark(event) is not None
        elif kind == "recovered" and running:
            left = CHECK if left == CHECK and marked else RECORD
            running = False
        elif kind == "handed_back" and (mark := unrecorded_mark(event)) is not None:
            left, running = mark, False
    return None if running else left


def first_use_undone(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` (our bookkeeping, e.g. a pending copy ingested from a file) has its first
    use left undone (:func:`first_use_left`: handed back so, or recovered before its admission
    recorded its id): whoever ingests it must leave that to its next admission, which would
    otherwise find the id and set the document aside as its own duplicate."""
    return first_use_left(history_of(doc)) is not None


def history_of(doc: dict[str, Any]) -> list[Any]:
    """``doc``'s bookkeeping history (entries untyped: bookkeeping may be damaged); [] when it
    has none."""
    block = doc.get(BOOK)
    events = block.get("history") if isinstance(block, dict) else None
    return events if isinstance(events, list) else []


def newest_among(doc: dict[str, Any], yes: Collection[str], no: Collection[str]) -> bool:
    """True when, walking ``doc``'s history back from its newest event, an event in ``yes``
    comes before any in ``no`` (False when neither does)."""
    for entry in reversed(history_of(doc)):
        event = entry.get("event") if isinstance(entry, dict) else None
        if event in yes:
            return True
        if event in no:
            return False
    return False


def first_seen(doc: dict[str, Any]) -> datetime | None:
    """When the handoff arrived, as far as a hard deadline counts: its last ``retried`` event
    (`handoff retry` sends it again, seed 000's deadline starts anew), else the first event of
    its history (created, or the claim of a foreign document); None when unknown. Trust it only
    on a claimed document: claiming replaces the bookkeeping a foreign document brought with
    it."""
    history = book(doc).get("history") if isinstance(doc.get(BOOK), dict) else None
    if not isinstance(history, list) or not history:
        return None
    arrival = next((entry for entry in reversed(history)
                    if isinstance(entry, dict) and entry.get("event") == "retried"), history[0])
    if not isinstance(arrival, dict):
        return None
    at = arrival.get("at")
    try:  # a hard deadline is counted from it: leave room to add any time limit (10 years)
        return parse_utc(at, headroom_seconds=ARRIVAL_HEADROOM_SECONDS) if isinstance(at, str) \
            else None
    except ValueError:  # malformed, or outside the calendar: unknown, as when absent
        return None


def arrival(doc: dict[str, Any] | None, seen: datetime | None) -> datetime | None:
    """When a hard deadline counts from: the earlier of ``seen`` (when a daemon first saw the
    handoff pending) and :func:`first_seen` of its trusted ``doc``; but after a `handoff retry`
    (a ``retried`` event later than ``seen``), the retry: a stamp from before it is stale (the
    daemon kept it from the handoff's earlier stay in pending/), and counted from it the
    retried handoff was answered TIMEOUT early. None when neither is known."""
    own = first_seen(doc) if doc is not None else None
    if own is None or seen is None:
        return own or seen
    if seen < own and _retried(doc):
        return own
    return min(seen, own)


def _retried(doc: dict[str, Any] | None) -> bool:
    """True when ``doc``'s bookkeeping records a `handoff retry` (a ``retried`` event)."""
    return doc is not None and any(isinstance(entry, dict) and entry.get("event") == "retried"
                                   for entry in history_of(doc))


def next_attempt_at(doc: dict[str, Any]) -> datetime | None:
    """When a scheduled retry becomes due, or None when the handoff is due now."""
    value = book(doc).get("next_attempt_at") if isinstance(doc.get(BOOK), dict) else None
    if not isinstance(value, str):
        return None
    try:
        return parse_utc(value)
    except ValueError:  # malformed, or outside the calendar: due now, as when absent
        return None


def priority_rank(value: object) -> int:
    """Map a priority (0-4 or a name such as ``high``) to 0 (most urgent) .. 4; default 2."""
    if isinstance(value, bool):
        return 2
    if isinstance(value, int):
        return min(max(value, 0), 4)
    if isinstance(value, str):
        return PRIORITIES.get(value.lower(), 2)
    return 2


# Deep enough for any real handoff, shallow enough that every recursive reader (jsonschema,
# copy.deepcopy, json.dumps) stays far from Python's recursion limit: no document nests deeper.
MAX_DEPTH = 64
# A handler's result object is filed inside a document (an answer's ``output``, a seed's
# result or payload block, a child's ``input.data``): it keeps this many levels free for them.
RESULT_DEPTH_MARGIN = 8
# A request is copied inside the documents filed for it (an answer's
# ``handoffd.request_snapshot``, a parked handoff's report in ``handoffd.awaiting.outcome``):
# it keeps as many levels free, or those copies could not be read back (a result lost)
REQUEST_DEPTH_MARGIN = 8
# in an error's details and its "failed" event: the handler's process died without a result
# (an isolated attempt; see core/isolation.py), so a manual retry runs isolated again
PROCESS_DIED = "process_died"


def nesting_depth(value: Any, limit: int) -> int:
    """Depth of nested objects/arrays in ``value`` (iterative; stops counting past ``limit``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return deepest


def check_text(text: object, what: str) -> str:
    """``text`` when it is text a document can hold (a str that is UTF-8: no lone surrogate,
    which is how argv's undecodable bytes arrive); UsageError naming ``what`` otherwise. For
    text an operation writes into a handoff it has claimed (a cancellation's reason, who
    answers): refused before the claim, not while filing it (that left the claim stranded in
    in-progress/)."""
    if not isinstance(text, str):
        raise UsageError(f"{what} must be text, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} is not UTF-8 text (character {exc.start + 1})") from None
    return text


def check_request_size(doc: dict[str, Any], stored_bytes: int, max_bytes: int, name: str, *,
                       handoff_id: str | None = None) -> None:
    """InvalidDocument (DOCUMENT_TOO_LARGE) when the request in ``doc`` (all but its
    ``handoffd`` block) is over ``max_bytes``; ``stored_bytes``, the document's size as stored,
    spares the measure when it is within the limit already. The block may add bookkeeping on
    top; every store reads a pending document by this rule. ``name`` says which document."""
    if stored_bytes <= max_bytes:
        return
    request = {k: v for k, v in doc.items() if k != BOOK}
    size = len(json.dumps(request, ensure_ascii=False, separators=(",", ":"))
               .encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidDocument(
            f"{name} holds a {size}-byte request, over the {max_bytes}-byte limit (raise "
            "daemon.max_document_bytes in handoffd.toml if this is intended)",
            handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)


def check_request_depth(doc: dict[str, Any], brackets: int | None, name: str, *,
                        handoff_id: str | None = None) -> None:
    """InvalidDocument (DOCUMENT_TOO_DEEP) when the request in ``doc`` (all but its ``handoffd``
    block) nests more than ``MAX_DEPTH - REQUEST_DEPTH_MARGIN`` levels: what is filed for it
    nests deeper than that (an answer holding a copy of it, 62 levels deep, could not be read
    by any command: the result was lost). ``brackets``, the count of ``{`` and ``[`` in the
    stored text (when known), spares the walk for almost every document: none can nest deeper."""
    limit = MAX_DEPTH - REQUEST_DEPTH_MARGIN
    if brackets is not None and brackets <= limit:
        return
    if nesting_depth({k: v for k, v in doc.items() if k != BOOK}, limit) > limit:
        raise InvalidDocument(f"{name} nests more than {limit} levels deep (handoffd keeps "
                              f"{REQUEST_DEPTH_MARGIN} of the {MAX_DEPTH} levels a document may "
                              "have for the copies it files of a request); flatten it",
                              handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_DEEP)


def check_storable(value: Any, what: str, *, depth_below: int = 0) -> Any:
    """``value`` when a document can hold it ``depth_below`` levels inside (an answer sits in
    ``input.clarifications[n].answer``: 4): JSON data (dicts, lists, strings, numbers,
    booleans, null; no bytes, sets, NaN or Infinity, lone surrogates, integers too long to
    write) nesting at most :data:`MAX_DEPTH` levels with those above it. UsageError naming
    ``what`` otherwise, before anything is claimed (see :func:`check_text`)."""
    limit = MAX_DEPTH - depth_below
    if nesting_depth(value, limit) > limit:  # (first: a deep value is no RecursionError below)
        raise UsageError(f"{what} nests more than {limit} levels deep; flatten it")
    try:  # (encoded as a document is written: a lone surrogate is no UTF-8)
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # (UnicodeEncodeError: a ValueError)
        raise UsageError(f"{what} must be JSON data (dicts, lists, strings, numbers, booleans, "
                         f"null): {str(exc)[:200]}") from None
    return value


@dataclass
class Envelope:
    """What the daemon needs to route and run a handoff, whatever its format."""

    handoff_id: str
    dialect: str
    target: str
    source: str | None = None
    data: Any = None
    timeout_seconds: float | None = None
    priority: int = 2
    retry_policy: dict[str, Any] | None = None
    input_schema: str | None = None
    output_schema: str | None = None  # a named schema the output must satisfy (seed 001)
    expected_output_schema: dict[str, Any] | None = None
    correlation_id: str | None = None
    conversation_id: str | None = None
    depends_on: list[str] = field(default_factory=list)
    contract: dict[str, Any] | None = None
    # a hard timeout (seed 000): it counts from when handoffd first saw the handoff, not from
    # its start; one not started in time is answered TIMEOUT unrun
    hard_timeout: bool = False
    final_timeout: bool = False  # a TIMEOUT answer is never retried (seeds 000 and 003)
    # files the request says an earlier agent produced (seed 002's results.artifacts paths):
    # the receiver verifies they exist before it starts
    input_artifacts: tuple[str, ...] = ()
    # who may stand in when ``target`` has no specialist here, in order (seed 000: a
    # specialist_hint is a suggestion; the target tier's fleet takes the work)
    fallback_targets: tuple[str, ...] = ()
    default_timeout_seconds: float | None = None  # the format's own default (seed 000's tiers)
    # never started (or restarted) after this: failed EXPIRED instead (native ``expires_at``)
    expires_at: datetime | None = None

    def __post_init__(self) -> None:
        """The one place where what a document asks for is bounded, whatever its format: every
        dialect builds an Envelope, so a value no dialect should accept is refused here with
        SCHEMA_VALIDATION_FAILED (and the document is filed as failed, never raised into a loop)."""
        problems: list[tuple[str, str]] = []
        timeout = self.timeout_seconds
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout
                                        <= MAX_TIMEOUT_SECONDS):
            problems.append(("timeout_seconds", f"timeout {_seconds_shown(timeout)} is outside "
                             f"0 < t <= {MAX_TIMEOUT_SECONDS:g}s (one week)"))
        if len(self.depends_on) > MAX_DEPENDENCIES:
            problems.append(("depends_on", f"{len(self.depends_on)} dependencies; at most "
                             f"{MAX_DEPENDENCIES}"))
        if self.retry_policy is not None:
            problems.extend(_retry_policy_problems(self.retry_policy))
        if problems:
            field_name, message = problems[0]
            raise InvalidDocument(
                f"handoff {self.handoff_id}: {field_name}: {message}", handoff_id=self.handoff_id,
                code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                errors=[{"field": f, "error": m, "schema_path": ""} for f, m in problems])


def _seconds_shown(timeout: object) -> str:
    """A refused timeout as its error shows it: ``0.0s``, ``1e+20s``; an integer too large for a
    float (read as ``math.inf``: see :func:`document_seconds`) as what it is, not ``infs``."""
    if isinstance(timeout, float) and math.isinf(timeout):
        return "of over 1.8e308s" if timeout > 0 else f"{timeout!r}s"
    return f"{timeout!r}s"


def _retry_policy_problems(policy: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, error) for a document's retry_policy that RetryPolicy refuses."""
    try:
        RetryPolicy.from_dict(policy)
    except ConfigError as exc:
        return [("retry_policy", str(exc))]
    return []


def document_seconds(value: Any, units_per_second: int = 1) -> float | None:
    """A document's positive time limit in seconds (``units_per_second`` 1000 for a
    ``timeout_ms``); None when it is absent, a bool, not a number, or not above 0.

    JSON integers have no bound, and ``float()`` or ``/`` of one past ~1.8e308 raised
    OverflowError: such a number is read as ``math.inf``, which the Envelope refuses like any
    timeout over MAX_TIMEOUT_SECONDS (SCHEMA_VALIDATION_FAILED, one line)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    try:
        return value / units_per_second
    except OverflowError:
        return math.inf


@dataclass
class Outcome:
    """A handler's result as the daemon files it (see docs/specialists.md, the command protocol).

    ``status`` is one of completed, partial, failed, blocked, needs_clarification, timeout,
    cancelled; ``error`` holds ``code``, ``message`` and optionally ``retryable``, ``errors``.
    """

    status: str
    started_at: datetime
    finished_at: datetime
    output: Any = None
    artifacts: list[Any] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    next_steps: list[Any] = field(default_factory=list)
    warnings: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None
    executed_by: str | None = None
    # more top-level fields of the filed answer (aggregation: aggregated_outcome, children)
    fields: dict[str, Any] = field(default_factory=dict)
    # a parked outcome's request to its filer (orchestration: children to create, questions to
    # record, "rewait", or "held_back": a first_success loser given back unrun); never written
    # into the document
    park: dict[str, Any] | None = None

    @property
    def succeeded(self) -> bool:
        """Completed and partial outcomes are filed in completed/; the rest in failed/."""
        return self.status in SUCCEEDED

    @property
    def seconds(self) -> float:
        """Wall time of the attempt."""
        return round((self.finished_at - self.started_at).total_seconds(), 3)
