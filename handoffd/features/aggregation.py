"""Aggregation of a delegating parent's children (seed 000's AggregatedOutcome).

When the children-gate in :mod:`handoffd.features.orchestration` releases a parent, the engine calls
:func:`resume` instead of running the parent's handler again: it reads each child's outcome,
applies the parent's strategy (:func:`decide`), cancels children ``first_success`` no longer needs,
and returns the parent's Outcome with ``aggregated_outcome`` as the seed defines it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..core.documents import BOOK, Outcome, book, record
from ..core.errors import ErrorCode, HandoffdError, InvalidDocument, NotFound
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
    """A child as the aggregation sees it; ``status`` is seed 000's OutcomeStatus or None (open)."""

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


def child_info(engine: "Engine", handoff_id: str) -> ChildInfo:
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
            info.asking = str(awaiting.get("kind") or "needs_clarification").replace("_", " ")
        return info
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
    info.error = error
    info.confidence = _confidence(doc, info.status)
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
    info.error = reported.get("error")
    info.specialist = reported.get("specialist") or info.specialist
    confidence = reported.get("confidence")
    info.confidence = float(confidence) if isinstance(confidence, (int, float)) \
        and not isinstance(confidence, bool) and 0 <= confidence <= 1 else _confidence({}, info.status)
    return info


def resume(engine: "Engine", job: "Job", started: datetime) -> Outcome | None:
    """Engine.run hook: a parent whose children are done is aggregated instead of run again.
    None: the handoff is not waiting for children (run the handler)."""
    doc = job.claim.doc
    wait = book(doc).get("waiting_children")
    if not isinstance(wait, dict):
        return None
    children = wait.get("children")
    infos = [child_info(engine, cid) for cid in (children if isinstance(children, list) else [])
             if isinstance(cid, str)]
    if not ready(engine, wait, infos):
        return Outcome(status="delegated", started_at=started, finished_at=engine.clock(),
                       park={"kind": "rewait"})
    strategy = str(wait.get("aggregation", "all_success"))
    weights = given if isinstance(given := wait.get("weights"), dict) else {}
    stopped: set[str] = set()
    open_ = [i for i in infos if i.status is None]
    if open_:
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
    confidence = round(confidence, 4)
    aggregated: dict[str, Any] = {
        "strategy_used": strategy,
        "child_outcomes": [{"message_id": i.handoff_id, "status": i.status or "failed",
                            "confidence": round(i.confidence, 4), "specialist": i.specialist or ""}
                           for i in infos],
        "aggregated_status": status,
        "aggregated_confidence": confidence,
    }
    succeeded = statuses.count("success")
    failed_children = [i for i in infos if i.status not in SUCCESS_LIKE]
    summary = f"{succeeded}/{len(infos)} subtasks succeeded ({strategy})"
    if winner is not None:
        summary += f"; first success: {winner.handoff_id}"
    if failed_children:
        summary += ". " + "; ".join(f"{i.handoff_id} {i.status}" for i in failed_children[:5])
    details = "; ".join(_child_error(i) for i in failed_children)
    output: dict[str, Any] = {
        "summary": summary, "strategy": strategy, "succeeded": succeeded,
        "partial": statuses.count("partial"), "failed": len(failed_children),
        "results": {i.handoff_id: i.output for i in infos if i.status in SUCCESS_LIKE},
    }
    if winner is not None:
        output["winner"] = winner.handoff_id
        output["result"] = winner.output
    summary_text = f'{{"strategy": "{strategy}", "succeeded": {succeeded}, "failed": {len(failed_children)}}}'
    records = [artifacts._record("aggregation_summary", name=None, ref=None, inline=summary_text,
                                 facts=artifacts.digest(summary_text.encode()),
                                 metadata={"child_outcomes": [
                                     {"id": c["message_id"], "status": c["status"],
                                      "specialist": c["specialist"]} for c in aggregated["child_outcomes"]]})]
    for info in infos:
        if info.status in SUCCESS_LIKE:
            for item in info.artifacts:
                if isinstance(item, dict):
                    item = dict(item)
                    meta = dict(item.get("metadata") or {}) if isinstance(item.get("metadata"), dict) else {}
                    meta["child_id"] = info.handoff_id
                    item["metadata"] = meta
                records.append(item)
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
    try:
        first_start = parse_iso(str(wait.get("started")))
    except ValueError:
        first_start = started
    block = book(doc)
    block.pop("waiting_children", None)
    block["aggregated_outcome"] = aggregated
    record_kw = {"strategy": strategy, "status": status, "confidence": confidence}
    record(doc, "aggregated", engine.clock(), **record_kw)
    fields = {"aggregated_outcome": aggregated, "children": [i.handoff_id for i in infos]}
    warnings = [_child_error(i) for i in failed_children]
    now = engine.clock()
    if status == "failed":
        outcome = engine.failure(first_start, ErrorCode.CHILDREN_FAILED,
                                 f"handoff {job.handoff_id}: {summary}" + (f": {details}" if details else ""),
                                 retryable=False)
        outcome.output, outcome.metadata, outcome.warnings = output, metadata, warnings
        outcome.artifacts = records
    else:
        outcome = Outcome(status="completed" if status == "success" else "partial",
                          started_at=first_start, finished_at=now, output=output,
                          artifacts=records, metadata=metadata, warnings=warnings)
        if status == "partial":
            outcome.error = {"code": ErrorCode.PARTIAL_COMPLETION, "message": details or summary,
                             "retryable": True}
    outcome.fields = fields
    outcome.executed_by = job.specialist.agent
    return outcome


def _child_error(info: ChildInfo) -> str:
    error = info.error or {}
    code = error.get("code") or (info.status or "failed").upper()
    message = str(error.get("message") or "")[:200]
    return f"{info.handoff_id} ({info.specialist}) {info.status}: {code}" + (f": {message}" if message else "")
