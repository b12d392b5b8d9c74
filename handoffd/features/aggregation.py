"""Aggregation of a delegating parent's children (seed 000's AggregatedOutcome).

When the children-gate in :mod:`handoffd.features.orchestration` releases a parent, the engine calls
:func:`resume` instead of running the parent's handler again: it reads each child's outcome,
applies the parent's strategy (:func:`decide`), cancels children ``first_success`` no longer needs,
and returns the parent's Outcome with ``aggregated_outcome`` as the seed defines it.
"""
from __future__ import annotations

import copy
import functools
import json
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable

from ..core.documents import BOOK, Outcome, book, book_int, record
from ..core.errors import ErrorCode, HandoffdError, InvalidDocument, NotFound
from ..core.filing import final_answer
from ..core.formats import ArtifactSink
from ..core.logs import log
from ..core.states import State
from ..core.timeutil import parse_iso
from ..dialects import hi_moe
from . import artifacts, cancellation

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

DEADLINE_GRACE_SECONDS = 5.0
SUCCESS_LIKE = ("success", "partial")


def ready(engine: "Engine", wait: dict[str, Any], infos: list["ChildInfo"]) -> bool:
    """Children finished, or (first_success) one succeeded, or the parent's deadline passed."""
    if all(i.status is not None for i in infos):
        return True
    if wait.get("aggregation") == "first_success" and any(i.status == "success" for i in infos):
        return True
    return _past_deadline(engine, wait)


def _past_deadline(engine: "Engine", wait: dict[str, Any]) -> bool:
    deadline = deadline_of(wait)
    return deadline is not None and engine.clock() >= deadline


def deadline_of(wait: dict[str, Any]) -> datetime | None:
    """When a parent's wait for its children (its ``waiting_children`` block) ends whatever
    they do: its deadline plus a grace; None when it has none readable. Then its open children
    are cancelled and counted ``timeout``, and it is aggregated (the scheduler looks at it
    then)."""
    try:
        deadline = parse_iso(str(wait.get("deadline")))
    except ValueError:
        return None
    try:
        return deadline + timedelta(seconds=DEADLINE_GRACE_SECONDS)
    except OverflowError:  # (the calendar's last seconds: never)
        return None


# ---------------------------------------------------------------- aggregation
@dataclass
class ChildInfo:
    """A child as the aggregation sees it; ``status`` is seed 000's OutcomeStatus or None (open).
    ``output`` and ``artifacts`` are what it answered when held: :func:`child_info` never
    holds them, :func:`read_child` only within its :class:`Holding` (``reread``: let go)."""

    handoff_id: str
    state: str
    status: str | None
    confidence: float = 0.0
    specialist: str | None = None
    output: Any = None
    artifacts: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None
    finished_at: str | None = None
    asking: str | None = None  # an open child parked for its requester's answer: what it awaits
    # as read_child measured them (None: not measured; :func:`copies` measures what is held)
    output_size: int | None = None  # JSON bytes of its output
    artifacts_size: int | None = None  # JSON bytes of its artifacts as the parent lists them
    artifacts_count: int = 0
    # set when its output and artifacts were let go: its document read again (_read)
    reread: Callable[[], "ChildInfo"] | None = field(default=None, repr=False, compare=False)


def child_info(engine: "Engine", handoff_id: str) -> ChildInfo:
    """A child's status and facts without its output or artifacts: the children gate needs
    statuses only, and a hundred children's answers of 16 MiB each were held together at
    every look. One child's document is in memory at a time."""
    info = _read(engine, handoff_id)
    info.output, info.artifacts = None, []
    return info


@dataclass
class Holding:
    """How many bytes (as JSON) of its children's outputs and artifacts an aggregation may
    still hold in memory; the rest is measured, let go and read again only if copied."""

    left: int


def read_child(engine: "Engine", handoff_id: str, holding: Holding) -> ChildInfo:
    """A child as the aggregation reads it: its output and artifacts (only a successful or
    partial child's are ever copied) measured, and held while ``holding`` has room for them;
    otherwise let go, for :func:`copies` to read again when it copies them."""
    info = _read(engine, handoff_id)
    if info.status not in SUCCESS_LIKE:
        info.output, info.artifacts = None, []
        return info
    items = [_from_child(item, handoff_id) for item in info.artifacts]
    info.output_size, info.artifacts_size = json_size(info.output), json_size(items)
    info.artifacts_count = len(items)
    if info.output_size + info.artifacts_size <= holding.left:
        holding.left -= info.output_size + info.artifacts_size
    else:
        info.output, info.artifacts = None, []
        info.reread = functools.partial(_read, engine, handoff_id)
    return info


def _read(engine: "Engine", handoff_id: str) -> ChildInfo:
    """A child's facts with its output and artifacts, from its document as stored now."""
    try:
        state, doc = engine.get(handoff_id)
    except (NotFound, InvalidDocument):
        return ChildInfo(handoff_id, "missing", "failed",
                         error={"code": ErrorCode.DEPENDENCY_MISSING, "message": "child handoff is missing"})
    except OSError:  # unreadable for now (permissions, disk): keep waiting
        return ChildInfo(handoff_id, "unreadable", None)
    target = given if isinstance(given := doc.get("target"), dict) else {}
    info = ChildInfo(handoff_id, state.value, None, specialist=target.get("agent_id"))
    if not state.terminal:
        awaiting = book(doc).get("awaiting") if isinstance(doc.get(BOOK), dict) else None
        if state is State.PENDING and isinstance(awaiting, dict):
            info.asking = str(awaiting.get("kind") or "needs_clarification")[:FACT_TEXT] \
                .replace("_", " ")
        return _bounded(info)
    reported = hi_moe.read_outcome(doc)  # a child that speaks seed 000 (a hi_moe parent's)
    if reported is not None:
        return _from_report(info, reported)
    error = given if isinstance(given := doc.get("error"), dict) else None
    if state is State.COMPLETED:
        info.status = "partial" if doc.get("status") == "partial" else "success"
        info.finished_at = doc.get("completed_at")
    else:
        code = (error or {}).get("code")
        info.status = ("cancelled" if doc.get("status") == "cancelled" or code == ErrorCode.CANCELLED
                       else "timeout" if code == ErrorCode.TIMEOUT else "failed")
        info.finished_at = doc.get("failed_at")
    info.output = doc.get("output")
    info.artifacts = given if isinstance(given := doc.get("artifacts"), list) else []
    info.error = _brief_error(error)
    info.confidence = _confidence(doc, info.status)
    return _bounded(info)


# what a child's facts keep of its own strings: an aggregation shows a child's error as its
# code and the first 200 characters of its message (_child_error), and a failed/ file placed
# in the workspace may hold megabytes in any of them (held once per child at every look)
FACT_TEXT = 200


def _brief_error(error: Any) -> dict[str, Any] | None:
    """The part of a child's ``error`` an aggregation uses: its code and the start of its
    message, as short strings (None: no error object)."""
    if not isinstance(error, dict):
        return None
    code, message = error.get("code"), error.get("message")
    return {"code": str(code)[:FACT_TEXT] if code is not None else None,
            "message": str(message)[:FACT_TEXT] if message is not None else None}


def _bounded(info: ChildInfo) -> ChildInfo:
    """``info`` with its specialist and finished_at kept only as short strings (a document's
    values, which a hostile file may make huge or of another type)."""
    info.specialist = info.specialist[:FACT_TEXT] if isinstance(info.specialist, str) else None
    info.finished_at = info.finished_at if isinstance(info.finished_at, str) \
        and len(info.finished_at) <= FACT_TEXT else None
    return info


def _weight(weights: dict[str, Any], handoff_id: str) -> float:
    """A child's weight as the delegation checked it (0 to 1e6); anything else counts 1 (the
    sum must stay finite: a NaN confidence cannot be filed as JSON)."""
    value = weights.get(handoff_id, 1.0)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1e6:
        return float(value)
    return 1.0


def _confidence(doc: dict[str, Any], status: str) -> float:
    for holder in (doc.get("metadata"), doc.get("output")):
        if isinstance(holder, dict):
            value = holder.get("confidence")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
                return float(value)
    return {"success": 1.0, "partial": 0.5}.get(status, 0.0)


def decide(strategy: str, statuses: list[str]) -> str:
    """Seed 000's aggregated status (success / partial / failed) for child statuses."""
    total = len(statuses)
    wins = statuses.count("success")
    partial = statuses.count("partial")
    if total == 0:
        return "failed"
    if strategy == "all_success":
        if wins == total:
            return "success"
        return "failed" if wins + partial == 0 else "partial"
    if strategy == "majority":
        return "success" if wins * 2 > total else "failed"
    # any_success and first_success
    if wins:
        return "success"
    return "partial" if partial else "failed"


def _from_report(info: ChildInfo, reported: dict[str, Any]) -> ChildInfo:
    """A child's facts from its hi_moe answer (:func:`handoffd.dialects.hi_moe.read_outcome`)."""
    status = reported.get("status")
    info.status = status if status in ("success", "partial", "failed", "timeout", "cancelled") \
        else "failed"
    info.finished_at = reported.get("finished_at")
    info.output = reported.get("output")
    info.artifacts = list(reported.get("artifacts") or [])
    info.error = _brief_error(reported.get("error"))
    info.specialist = reported.get("specialist") or info.specialist
    confidence = reported.get("confidence")
    info.confidence = float(confidence) if isinstance(confidence, (int, float)) \
        and not isinstance(confidence, bool) and 0 <= confidence <= 1 else _confidence({}, info.status)
    return _bounded(info)


@dataclass
class Family:
    """A parent's children as aggregated: the facts every answer drawn from them shares."""

    infos: list[ChildInfo]
    strategy: str
    status: str  # seed 000's aggregated status (success / partial / failed)
    winner: ChildInfo | None
    aggregated: dict[str, Any]  # seed 000's AggregatedOutcome
    summary: str
    first_start: datetime
    statuses: list[str] = field(default_factory=list)

    @property
    def failed_children(self) -> list[ChildInfo]:
        """The children that neither succeeded nor partially succeeded."""
        return [i for i in self.infos if i.status not in SUCCESS_LIKE]


def resume(engine: "Engine", job: "Job", started: datetime) -> Outcome | None:
    """Engine.run hook: a parent whose children are done is aggregated instead of run again.
    None: the handoff is not waiting for children (run the handler)."""
    doc = job.claim.doc
    wait = book(doc).get("waiting_children")
    if not isinstance(wait, dict):
        return None
    children = wait.get("children")
    # at most max_output_bytes of the children's answers held at once (what the first
    # copies can copy), one more child's document while it is read
    holding = Holding(engine.settings.max_output_bytes)
    infos = [read_child(engine, cid, holding)
             for cid in (children if isinstance(children, list) else []) if isinstance(cid, str)]
    if not ready(engine, wait, infos):
        return Outcome(status="delegated", started_at=started, finished_at=engine.clock(),
                       park={"kind": "rewait"})
    family = _family(engine, job, wait, infos, started)
    block = book(doc)
    block.pop("waiting_children", None)
    block["aggregated_outcome"] = family.aggregated
    record(doc, "aggregated", engine.clock(), strategy=family.strategy, status=family.status,
           confidence=family.aggregated["aggregated_confidence"])
    return readable_outcome(engine, job, family)


def _stop_open(engine: "Engine", job: "Job", strategy: str, infos: list[ChildInfo]) -> set[str]:
    """Cancel the children still open (first_success has its winner, or the deadline passed);
    the ids stopped."""
    stopped: set[str] = set()
    open_ = [i for i in infos if i.status is None]
    if not open_:
        return stopped
    winner_found = any(i.status == "success" for i in infos)
    why = ("first_success: another child succeeded" if strategy == "first_success" and winner_found
           else "the parent's deadline passed")
    for info in open_:
        try:
            cancellation.cancel(engine, info.handoff_id, reason=f"{why} ({job.handoff_id})",
                                cascade=True, by=job.handoff_id, via="aggregation")
        except (HandoffdError, OSError):
            pass
        info.status = "cancelled" if why.startswith("first_success") else "timeout"
        stopped.add(info.handoff_id)
    return stopped


def _family(engine: "Engine", job: "Job", wait: dict[str, Any], infos: list[ChildInfo],
            started: datetime) -> Family:
    """Decide a finished family: stop its open children, its status, confidence and summary."""
    strategy = str(wait.get("aggregation", "all_success"))
    weights = given if isinstance(given := wait.get("weights"), dict) else {}
    stopped = _stop_open(engine, job, strategy, infos)
    winner: ChildInfo | None = None
    if strategy == "first_success":
        wins = sorted((i for i in infos if i.status == "success"), key=lambda i: i.finished_at or "")
        winner = wins[0] if wins else None
    statuses = [i.status or "failed" for i in infos]
    status = decide(strategy, statuses)
    counted = [i for i in infos if i.handoff_id not in stopped or strategy != "first_success"]
    total_weight = sum(_weight(weights, i.handoff_id) for i in counted)
    confidence = (sum(_weight(weights, i.handoff_id) * i.confidence for i in counted)
                  / total_weight) if total_weight > 0 else 0.0
    aggregated: dict[str, Any] = {
        "strategy_used": strategy,
        "child_outcomes": [{"message_id": i.handoff_id, "status": i.status or "failed",
                            "confidence": round(i.confidence, 4), "specialist": i.specialist or ""}
                           for i in infos],
        "aggregated_status": status,
        "aggregated_confidence": round(confidence, 4),
    }
    failed_children = [i for i in infos if i.status not in SUCCESS_LIKE]
    summary = f"{statuses.count('success')}/{len(infos)} subtasks succeeded ({strategy})"
    if winner is not None:
        summary += f"; first success: {winner.handoff_id}"
    if failed_children:
        summary += ". " + "; ".join(f"{i.handoff_id} {i.status}" for i in failed_children[:5])
    try:
        first_start = parse_iso(str(wait.get("started")))
    except ValueError:
        first_start = started
    return Family(infos, strategy, status, winner, aggregated, summary, first_start, statuses)


# ---------------------------------------------------------------- the answer's size
# A first_success winner's output is also copied into ``output.result`` when at most this large
# (the small answers every parent gave); a larger one is not copied twice: ``result`` names
# where it is (``output.results[<winner>]``).
RESULT_COPY_BYTES = 64 * 1024
# The files store reads a finished document up to max_document_bytes + max_output_bytes + 1 MiB
# (its FILED_MARGIN_BYTES): an aggregated answer keeps within the first half MiB of that margin,
# leaving the rest to the bookkeeping written after it.
ANSWER_SLACK_BYTES = 512 * 1024


def answer_limit(engine: "Engine") -> int:
    """The most bytes a parent's filed aggregated answer may take, so that every reader of a
    finished document (`handoff wait`, `show`, dependants, the daemon) can read it."""
    settings = engine.settings
    return settings.max_document_bytes + settings.max_output_bytes + ANSWER_SLACK_BYTES


def json_size(value: Any) -> int:
    """Bytes ``value`` takes in a document (compact UTF-8 JSON, as documents are written); one
    that cannot be written counts as too large to copy."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError):  # (a lone surrogate: a ValueError)
        return sys.maxsize


@dataclass
class Copies:
    """What an aggregated answer copies of its children's answers within a byte budget;
    the rest is named, not copied (the children stay filed: `handoff show <child>`)."""

    results: dict[str, Any]  # output.results: each successful child's output (or its omission)
    result: Any  # output.result of first_success: the winner's output (or where it is)
    artifacts: list[Any]  # the children's artifacts (or one omission record per child)
    omitted: list[str]  # children something of which was not copied


def _omission(handoff_id: str, what: str, size: int, budget: int) -> str:
    shown = "too large to write" if size == sys.maxsize else f"{size} bytes"
    return (f"{what} ({shown}) is not copied: an aggregated answer copies at most {budget} bytes "
            f"of its children's answers; see `handoff show {handoff_id}`")


def _unread(handoff_id: str, what: str) -> str:
    """The omission of a child's answer that could not be read again as it was measured."""
    return (f"{what} is not copied: its document could not be read again as it was measured; "
            f"see `handoff show {handoff_id}`")


def copies(infos: list[ChildInfo], winner: ChildInfo | None, budget: int) -> Copies:
    """The children's outputs and artifacts an aggregated answer copies, at most ``budget``
    bytes of them (JSON), the winner's first, then in child order; each that does not fit is
    replaced by an ``output_omitted`` entry (or an ``artifacts_omitted`` record) naming the
    child whose document holds it. Only what fits is in memory: a child's answer that
    :func:`read_child` let go is read again, one child at a time."""
    kept = [i for i in infos if i.status in SUCCESS_LIKE]
    left = budget
    outputs: dict[str, Any] = {}
    omitted: list[str] = []
    result: Any = None
    for info in sorted(kept, key=lambda i: i is not winner):  # (stable: the winner first)
        size = json_size(info.output) if info.output_size is None else info.output_size
        fits = size <= left
        got = _output_of(info, size) if fits else None
        if got is not None:
            outputs[info.handoff_id] = got[0]
            left -= size
        else:
            outputs[info.handoff_id] = {
                "output_omitted": _omission(info.handoff_id, "its output", size, budget) if not fits
                else _unread(info.handoff_id, "its output"),
                "handoff_id": info.handoff_id, "size_bytes": size}
            omitted.append(info.handoff_id)
        if info is winner:
            result, left = _winner_result(info, outputs[info.handoff_id], got is not None,
                                          size, left)
    records: list[Any] = []
    for info in kept:
        size, count = _artifacts_size(info)
        items = _artifacts_of(info, size) if size <= left else None
        if items is not None:
            records.extend(items)
            left -= size
            continue
        what = f"its {count} artifacts"
        records.append(artifacts._record(
            "artifacts_omitted", name=None, ref=None, facts=None,
            inline=_omission(info.handoff_id, what, size, budget) if size > left
            else _unread(info.handoff_id, what),
            metadata={"child_id": info.handoff_id, "count": count, "size_bytes": size}))
        omitted.append(info.handoff_id)
    return Copies({i.handoff_id: outputs[i.handoff_id] for i in kept}, result, records,
                  [i.handoff_id for i in kept if i.handoff_id in omitted])


def _reloaded(info: ChildInfo) -> ChildInfo | None:
    """``info`` with its output and artifacts in hand: itself when held, else its document read
    again; None when that fails or finds another answer (a filed child is final, but its file
    lies in a workspace others can write)."""
    if info.reread is None:
        return info
    try:
        again = info.reread()
    except (HandoffdError, OSError):
        return None
    return again if again.status == info.status else None


def _output_of(info: ChildInfo, size: int) -> tuple[Any] | None:
    """(the child's output,) to copy, measured ``size`` bytes; None when it cannot be had
    again as it was measured (the budget counts the measured size)."""
    again = _reloaded(info)
    if again is None or (again is not info and json_size(again.output) != size):
        return None
    return (again.output,)


def _artifacts_size(info: ChildInfo) -> tuple[int, int]:
    """(JSON bytes, count) of the child's artifacts as the parent lists them."""
    if info.artifacts_size is not None:
        return info.artifacts_size, info.artifacts_count
    return json_size([_from_child(item, info.handoff_id) for item in info.artifacts]), \
        len(info.artifacts)


def _artifacts_of(info: ChildInfo, size: int) -> list[Any] | None:
    """The child's artifacts as the parent lists them (tagged with its id), measured ``size``
    bytes; None when they cannot be had again as they were measured."""
    if info.reread is not None and info.artifacts_count == 0:
        return []  # (none: nothing to read again)
    again = _reloaded(info)
    if again is None:
        return None
    items = [_from_child(item, info.handoff_id) for item in again.artifacts]
    return items if again is info or json_size(items) == size else None


def _winner_result(winner: ChildInfo, entry: Any, copied: bool, size: int,
                   left: int) -> tuple[Any, int]:
    """``output.result`` of first_success and the budget left: the winner's output again when
    small, else a note saying where it is (never a second copy of a large output). ``entry``
    is the winner's ``output.results`` entry, ``copied`` whether it is the output itself."""
    if not copied:  # not copied at all: the same omission
        return entry, left
    if size <= min(RESULT_COPY_BYTES, left):
        return entry, left - size
    return {"output_omitted": f"the winner's output ({size} bytes) is not copied twice: it is "
                              f"output.results[\"{winner.handoff_id}\"]",
            "handoff_id": winner.handoff_id, "size_bytes": size}, left


def _from_child(item: Any, handoff_id: str) -> Any:
    """A child's artifact as the parent lists it: tagged with the child's id."""
    if isinstance(item, dict):
        item = dict(item)
        meta = dict(item.get("metadata") or {}) if isinstance(item.get("metadata"), dict) else {}
        meta["child_id"] = handoff_id
        item["metadata"] = meta
    return item


def readable_outcome(engine: "Engine", job: "Job", family: Family) -> Outcome:
    """The parent's aggregated Outcome, such that its filed answer stays readable: copies of
    the children's answers within max_output_bytes, fewer when the answer as its format files
    it is still over :func:`answer_limit`, none after that; a readable failure
    (DOCUMENT_TOO_LARGE) if even that is over (a request near the limits)."""
    limit = answer_limit(engine)
    budget = engine.settings.max_output_bytes
    for attempt in range(3):
        outcome = aggregated_outcome(engine, job, family, copies(family.infos, family.winner, budget))
        size = filed_size(engine, job, outcome)
        if size <= limit or budget == 0:
            break
        # what the copies do not make stays (a request near max_document_bytes, a format
        # that keeps the request twice): a budget smaller by what is over, then none at all
        budget = max(0, budget - (size - limit) - ANSWER_SLACK_BYTES) if attempt == 0 else 0
    if size <= limit:
        return outcome
    log.warning("handoff %s: its aggregated answer would be %d bytes, over the %d-byte limit "
                "even without its children's outputs", job.handoff_id, size, limit)
    failure = engine.failure(family.first_start, ErrorCode.DOCUMENT_TOO_LARGE,
                             f"handoff {job.handoff_id}: {family.summary}; the aggregated answer "
                             f"would be {size} bytes, over the {limit}-byte limit of a filed "
                             "document: read each child with `handoff show <child>`",
                             retryable=False)
    failure.fields = {"aggregated_outcome": family.aggregated,
                      "children": [i.handoff_id for i in family.infos]}
    failure.executed_by = job.specialist.agent
    return failure


def filed_size(engine: "Engine", job: "Job", outcome: Outcome) -> int:
    """Bytes of the answer ``outcome`` files for the claimed parent, rendered by its format on
    a copy, with a sink that names large artifacts' files without writing them; 0 (not
    measured) when it cannot be rendered (filing reports that)."""
    doc = copy.deepcopy(job.claim.doc)
    sink: ArtifactSink | None = None
    if engine.artifact_sink is not None:
        def sink(handoff_id: str, index: int, text: str) -> str | None:
            return f"artifacts/{handoff_id}/{index}.txt"
    try:
        _, answer = final_answer(doc, job.dialect, outcome, engine.policy(doc, job.specialist),
                                 book_int(doc, "retries", 0), engine.clock(), sink)
    except Exception as exc:  # (the real filing meets it and says so)
        log.debug("handoff %s: cannot measure its aggregated answer: %s", job.handoff_id, exc)
        return 0
    return json_size(answer) + 1


def aggregated_outcome(engine: "Engine", job: "Job", family: Family, copied: Copies) -> Outcome:
    """The parent's Outcome as seed 000 defines it (``aggregated_outcome``), with ``copied``
    of its children's answers."""
    infos, strategy, status = family.infos, family.strategy, family.status
    statuses, winner, aggregated = family.statuses, family.winner, family.aggregated
    failed_children = family.failed_children
    summary = family.summary
    if copied.omitted:
        summary += (f"; not copied (too large): {', '.join(copied.omitted[:5])}"
                    + (f" and {len(copied.omitted) - 5} more" if len(copied.omitted) > 5 else "")
                    + " (`handoff show <child>`)")
    details = "; ".join(_child_error(i) for i in failed_children)
    output: dict[str, Any] = {
        "summary": summary, "strategy": strategy, "succeeded": statuses.count("success"),
        "partial": statuses.count("partial"), "failed": len(failed_children),
        "results": copied.results,
    }
    if winner is not None:
        output["winner"] = winner.handoff_id
        output["result"] = copied.result
    if copied.omitted:
        output["outputs_omitted"] = copied.omitted
    records = [_summary_record(strategy, statuses.count("success"), len(failed_children),
                               aggregated)] + copied.artifacts
    confidence = aggregated["aggregated_confidence"]
    metadata = {"confidence": confidence, "aggregated_outcome": aggregated, "summary": summary,
                "resources_used": {"parallel_tasks": len(infos),
                                   "specialists_used": sorted({i.specialist for i in infos if i.specialist})}}
    if status == "partial" and len(failed_children) * 2 > len(infos):
        # seed 000's partial success rules: "majority failed: PARTIAL, flag for strategy
        # revision" (hi_moe carries it as surprise_flag / surprise_reason)
        output["strategy_revision"] = True
        metadata["strategy_revision"] = True
        metadata["surprise_flag"] = True
        metadata["surprise_reason"] = (f"{len(failed_children)} of {len(infos)} subtasks failed: "
                                       "flag for strategy revision")
    warnings = [_child_error(i) for i in failed_children]
    now = engine.clock()
    if status == "failed":
        outcome = engine.failure(family.first_start, ErrorCode.CHILDREN_FAILED,
                                 f"handoff {job.handoff_id}: {summary}" + (f": {details}" if details else ""),
                                 retryable=False)
        outcome.output, outcome.metadata, outcome.warnings = output, metadata, warnings
        outcome.artifacts = records
    else:
        outcome = Outcome(status="completed" if status == "success" else "partial",
                          started_at=family.first_start, finished_at=now, output=output,
                          artifacts=records, metadata=metadata, warnings=warnings)
        if status == "partial":
            outcome.error = {"code": ErrorCode.PARTIAL_COMPLETION, "message": details or summary,
                             "retryable": True}
    outcome.fields = {"aggregated_outcome": aggregated, "children": [i.handoff_id for i in infos]}
    outcome.executed_by = job.specialist.agent
    return outcome


def _summary_record(strategy: str, succeeded: int, failed: int,
                    aggregated: dict[str, Any]) -> dict[str, Any]:
    """Seed 000's ``aggregation_summary`` artifact."""
    text = f'{{"strategy": "{strategy}", "succeeded": {succeeded}, "failed": {failed}}}'
    return artifacts._record("aggregation_summary", name=None, ref=None, inline=text,
                             facts=artifacts.digest(text.encode()),
                             metadata={"child_outcomes": [
                                 {"id": c["message_id"], "status": c["status"],
                                  "specialist": c["specialist"]} for c in aggregated["child_outcomes"]]})


def _child_error(info: ChildInfo) -> str:
    error = info.error or {}
    code = error.get("code") or (info.status or "failed").upper()
    message = str(error.get("message") or "")[:200]
    return f"{info.handoff_id} ({info.specialist}) {info.status}: {code}" + (f": {message}" if message else "")
