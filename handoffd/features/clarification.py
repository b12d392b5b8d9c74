"""Clarification and blocking (seed 000 NEEDS_CLARIFICATION, seed 002 blocked), the requester's
side of orchestration: reading such a result, the gate that holds the parked handoff "waiting on
the requester" (:func:`~.parked_gates.requester_gate`, with the other gates ``handoff ls``
installs alone), ``handoff answer``, and how the answers reach the specialist when it runs again
(what parking does: :mod:`handoffd.features.orchestration`).

Only an answer ends such a wait, and an answer rewrites the handoff's document: a serving daemon
does not read a waiting handoff again at its rescans while its document is unchanged
(:func:`attach`, the scheduler's quiet checks); ``handoff answer`` or an edit of the document
resumes it at once (the file watch) or at the next rescan at the latest (its stamp changed).
"""
from __future__ import annotations

import copy
import json
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..backends.base import refiling
from ..core.documents import book, check_storable, check_text
from ..core.errors import (
    DocumentNotReady,
    DuplicateHandoff,
    ErrorCode,
    InvalidDocument,
    InvalidTransition,
    UnreadableDocument,
)
from ..core.logs import log
from ..core.states import State
from ..core.timeutil import iso
from .delegation import _Malformed
# the requester gate is installed alone by `handoff ls` (parked_gates): kept there, named here
from .parked_gates import ASKING, requester_gate  # noqa: F401  (named here too)

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

MAX_CLARIFICATIONS_ENV = 64 * 1024  # bytes of $HANDOFF_CLARIFICATIONS
# a handoff just parked is written to pending/ a moment before its in-progress copy goes: an
# answer racing that moment (or a daemon's look at it) tries again for this long
ANSWER_PATIENCE_SECONDS = 2.0
ANSWER_BOOKKEEPING_BYTES = 2048  # what an answer adds besides itself: its entry, history, seal
# how deep an answer sits in the document it is filed in: document, input (or the handoffd
# block), clarifications, the entry, its answer (4); in the request, which keeps 8 levels free
# for the copies filed of it (core.documents.REQUEST_DEPTH_MARGIN)
ANSWER_DEPTH = 4 + 8


# ---------------------------------------------------------------- reading the result
def _clarification(job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    questions: list[Any] = []
    output = given if isinstance(given := result.get("output"), dict) else {}
    error = given if isinstance(given := result.get("error"), dict) else {}
    for source in (result.get("questions"), output.get("questions")):
        if isinstance(source, list):
            questions.extend(q for q in source if isinstance(q, (str, dict)))
        elif isinstance(source, str) and source.strip():
            questions.append(source)
    for text in (result.get("error_detail"), error.get("message")):
        if not questions and isinstance(text, str) and text.strip():
            questions.append(text)
    if not questions:
        raise _Malformed('it names no questions (give "questions": ["..."], as seed 000 asks for '
                         "specific questions)")
    return {"questions": questions}


def _blocked(job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    blockers = result.get("blockers")
    if blockers is None and isinstance(result.get("output"), dict):
        blockers = result["output"].get("blockers")
    if not isinstance(blockers, list) or not blockers:
        raise _Malformed('it lists no "blockers" (seed 002: a blocked handoff has blockers with '
                         "resolution options)")
    for index, blocker in enumerate(blockers):
        if not isinstance(blocker, dict) or not isinstance(blocker.get("description"), str):
            raise _Malformed(f"blockers[{index}] needs a description")
        options = blocker.get("resolution_options")
        if not isinstance(options, list) or not options:
            raise _Malformed(f"blockers[{index}] has no resolution_options (seed 002 requires at "
                             "least one)")
    return {"blockers": blockers}


# ---------------------------------------------------------------- the gate, and the answers
class QuietWaits(Protocol):
    """What clarification uses of a daemon's scheduler (see handoffd.service.scheduler)."""

    waiting: dict[str, str]

    def add_quiet_check(self, check: Callable[[str], bool]) -> None: ...


class DaemonPlugins(Protocol):
    """What clarification uses of a daemon: its scheduler."""

    scheduler: QuietWaits


def attach(daemon: DaemonPlugins) -> None:
    """The daemon side (a daemon plugin): a handoff the requester gate holds back is not read
    again at a rescan while its document is unchanged. 2,000 handoffs waiting for an answer were
    read and parsed again at every rescan, for ever."""
    waiting = daemon.scheduler.waiting

    def awaits_answer(handoff_id: str) -> bool:
        """The last read of ``handoff_id`` was held back by the requester gate (its reason says
        so; the scheduler asks only of waits no filing ends, held with ``on=()``): the gate
        reads the document alone, so while that is unchanged it holds it back again. Nothing
        else ends the wait: an answer rewrites the document (a rescan sees its stamp change),
        a cancel request queues it itself."""
        return waiting.get(handoff_id, "").startswith(ASKING)

    daemon.scheduler.add_quiet_check(awaits_answer)


def _expose_clarifications(job: "Job") -> None:
    """Answers reach every specialist in every format: Python ones as ``ctx.clarifications``,
    commands as ``$HANDOFF_CLARIFICATIONS`` (a JSON list; their stdin is the document without
    handoffd's block, where non-native formats keep the answers)."""
    found = clarifications_of(job.claim.doc)
    if found:
        job.context.clarifications = found
        for answers in (found, found[-1:]):  # an environment has its limits (ARG_MAX)
            text = json.dumps(answers, ensure_ascii=False)
            if len(text) <= MAX_CLARIFICATIONS_ENV:
                job.context.env["HANDOFF_CLARIFICATIONS"] = text
                break
            log.warning("handoff %s: %d answers are too long for $HANDOFF_CLARIFICATIONS (%d "
                        "bytes)", job.handoff_id, len(answers), len(text))


def clarifications_of(doc: dict[str, Any]) -> list[Any]:
    """Answers given so far with ``handoff answer`` (native: ``input.clarifications``)."""
    inp = doc.get("input")
    if isinstance(inp, dict) and isinstance(inp.get("clarifications"), list):
        return list(inp["clarifications"])
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("clarifications"), list):
        return list(block["clarifications"])
    return []


# ---------------------------------------------------------------- answering
def answer(engine: "Engine", handoff_id: str, data: Any, *, by: str = "@cli") -> dict[str, Any]:
    """Attach an answer to a handoff waiting on its requester and release it to pending/.

    UsageError, before anything is claimed, when ``data`` is no JSON a document can hold at
    its place (NaN, a set, bytes, a lone surrogate, too deep) or ``by`` is not UTF-8 text.
    Whatever fails once the handoff is claimed hands it back as it was (still waiting for an
    answer, its attempt not spent) before the error goes on: left in in-progress/, the sweep
    recovered it as a dead owner's claim, spent a retry and ran it without the answer."""
    from .cancel_family import hand_back  # (the one hand-back of a claim taken to change it)
    check_storable(data, "answer", depth_below=ANSWER_DEPTH)
    check_text(by, "who answers")
    box: list[Any] = []

    def on_claim(claimed: dict[str, Any]) -> None:
        try:
            dialect = engine.formats.detect(claimed)
        except InvalidDocument:
            dialect = engine.formats.by_name("native")
        box.append(dialect)

    give_up_at = time.monotonic() + ANSWER_PATIENCE_SECONDS
    while True:
        state, doc = engine.get(handoff_id)
        if state is not State.PENDING or not isinstance(book(doc).get("awaiting"), dict):
            raise InvalidTransition(f"handoff {handoff_id} is {state.value} and not waiting for "
                                    "an answer (only handoffs that asked for clarification or "
                                    "were blocked can be answered)", handoff_id=handoff_id)
        _check_room(engine, handoff_id, doc, data)
        now = engine.clock()
        try:
            claim = engine.backend.claim(handoff_id, now, engine.settings.lease_seconds,
                                         prepare=on_claim)
        except (DuplicateHandoff, DocumentNotReady, UnreadableDocument):
            claim = None
        if claim is not None:
            break
        if time.monotonic() >= give_up_at:
            raise InvalidTransition(f"handoff {handoff_id} moved while answering; look at it "
                                    "with `handoff show` and try again", handoff_id=handoff_id)
        time.sleep(0.02)
    saved = copy.deepcopy(claim.doc)
    dialect = box[0] if box else engine.formats.by_name("native")
    if not isinstance(book(claim.doc).get("awaiting"), dict):
        # answered by another `handoff answer` (another host's) between the read above and
        # this claim: the claimed document waits for nothing, and a second answer written
        # into it reached its handler beside the first. Given back as it was
        taken = InvalidTransition(f"handoff {handoff_id} is pending and not waiting for an "
                                  "answer (answered meanwhile)", handoff_id=handoff_id)
        hand_back(engine, claim, dialect, saved, "answering it", taken)
        raise taken
    try:
        entry, detail = _write_answer(claim.doc, dialect.name, data, by, now)
        # the history names the answer; the document holds it once (clarifications)
        shown = data if isinstance(data, (int, float, bool)) or data is None else str(data)[:300]
        with refiling(claim):  # a write that fails before writing keeps the claim ours
            where = engine.requeue(claim, dialect, "answered", by=by, answer=shown, **detail)
    except BaseException as exc:  # (then raised as it was)
        hand_back(engine, claim, dialect, saved, "answering it", exc)
        raise
    if where is not State.PENDING:
        raise InvalidTransition(f"handoff {handoff_id} was taken over while answering",
                                handoff_id=handoff_id)
    return entry


def _write_answer(doc: dict[str, Any], dialect: str, data: Any, by: str,
                  now: datetime) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the answer into the claimed ``doc`` (native: ``input.clarifications``, else
    ``handoffd.clarifications``): its entry, and what the ``answered`` event adds. A list of
    answers that is no list (``"clarifications": {}`` in a request's input) is replaced by
    one, and the event says what it was: appending to it failed after the claim."""
    block = book(doc)
    history = block.get("history")
    if (isinstance(history, list) and history and isinstance(history[-1], dict)
            and history[-1].get("event") == "claimed"):
        history.pop()  # claimed only to write the answer in; it did not run
    asked = block.pop("awaiting", None)
    awaiting: dict[str, Any] = asked if isinstance(asked, dict) else {}
    entry = {"at": iso(now), "by": by, "kind": awaiting.get("kind"), "answer": data}
    for key in ("questions", "blockers"):
        if awaiting.get(key):
            entry[key] = awaiting[key]
    if dialect == "native":
        inp = given if isinstance(given := doc.get("input"), dict) else {}
        doc["input"] = inp
        holder, where = inp, "input.clarifications"
    else:
        holder, where = block, "handoffd.clarifications"
    detail: dict[str, Any] = {}
    answers = holder.get("clarifications")
    if answers is not None and not isinstance(answers, list):
        detail["replaced"] = f"{where} was a {type(answers).__name__}, not a list of answers"
        answers = None
    if answers is None:
        answers = holder["clarifications"] = []
    answers.append(entry)
    return entry, detail


def _check_room(engine: "Engine", handoff_id: str, doc: dict[str, Any], data: Any) -> None:
    """InvalidDocument (DOCUMENT_TOO_LARGE) before anything is written when the document with
    the answer in it would be over ``max_document_bytes``: the daemon could not read it back,
    and the handoff would be set aside instead of resumed."""
    limit = engine.settings.max_document_bytes
    size = (len(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            + len(json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            + ANSWER_BOOKKEEPING_BYTES)
    if size > limit:
        raise InvalidDocument(f"the answer would make handoff {handoff_id} about {size} bytes, over "
                              f"the {limit}-byte limit; answer with less, or point to a file "
                              "(raise daemon.max_document_bytes in handoffd.toml if this is "
                              "intended)", handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)
