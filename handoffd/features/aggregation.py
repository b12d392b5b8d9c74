"""Aggregation of a delegating parent's children (seed 000's AggregatedOutcome).

When the children-gate in :mod:`handoffd.features.orchestration` releases a parent, the engine calls
:func:`resume` instead of running the parent's handler again: it reads each child's outcome,
applies the parent's strategy (:func:`decide`), cancels children ``first_success`` no longer needs,
and returns the parent's Outcome with ``aggregated_outcome`` as the seed defines it. How a child is
read (and how much of its answer is held) is :mod:`.childfacts`; what the parent's answer copies of
the children's answers, within a byte budget, is :mod:`.answer_copies`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.documents import Outcome, book, book_int, record
from ..core.errors import ErrorCode, HandoffdError
from ..core.filing import final_answer
from ..core.formats import ArtifactSink
from ..core.logs import log
from ..core.timeutil import parse_iso
from . import artifacts, cancel_family
from .answer_copies import ANSWER_SLACK_BYTES, Copies, answer_limit, copies
from .childfacts import SUCCESS_LIKE, ChildInfo, Holding, json_size, read_child

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

DEADLINE_GRACE_SECONDS = 5.0


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
def _weight(weights: dict[str, Any], handoff_id: str) -> float:
    """A child's weight as the delegation checked it (0 to 1e6); anything else counts 1 (the
    sum must stay finite: a NaN confidence cannot be filed as JSON)."""
    value = weights.get(handoff_id, 1.0)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1e6:
        return float(value)
    return 1.0


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
    for index, info in enumerate(infos):
        if info.status is not None:
            continue
        try:
            own = cancel_family.cancel(engine, info.handoff_id, reason=f"{why} ({job.handoff_id})",
                                       cascade=True, by=job.handoff_id, via="aggregation")[0]
        except (HandoffdError, OSError):
            own = None
        if own is not None and own.action == "finished":
            # it was filed between the children's read and this cancel: what it was filed as
            # counts (a success listed as "timeout" turned a family partial), read again (its
            # answer let go: copied, if it is, by a read of its own)
            fresh = read_child(engine, info.handoff_id, Holding(0))
            if fresh.status is not None:
                infos[index] = fresh
                continue
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
