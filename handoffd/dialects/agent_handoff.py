"""Seed 002 (Universal AgentHandoff): one JSON shape for every hop of an agent chain.

A handoff is routed to ``to_agent``. The answer is a new AgentHandoff from ``to_agent`` back to
``from_agent`` in the same ``conversation_id`` (``chain_position.step`` + 1), with status success /
partial / blocked / error, results, and blockers on anything but success. Artifact paths a handler
reports are verified: one that does not exist in the workspace turns the answer into an error with a
``validation_failed`` blocker (the seed's "unverified artifacts" anti-pattern) and files it in failed/.
"""
from __future__ import annotations

import copy
from datetime import datetime
from pathlib import Path
from typing import Any

from ..core.documents import Envelope, Outcome, check_id, priority_rank, random_uuid
from ..core.errors import ErrorCode, InvalidDocument
from ..core.formats import ArtifactSink
from ..core.timeutil import iso
from ..core.workspace import workspace_at
from . import _shared as sh
from .base import FiledState

SCHEMA = "agent_handoff.schema.json"
STATUSES = ("success", "partial", "blocked", "error")
ARTIFACT_TYPES = ("code", "document", "config", "data", "report")
DATA_KEYS = ("context", "results", "action_required", "blockers")
STATUS = {"completed": "success", "partial": "partial", "blocked": "blocked",
          "needs_clarification": "blocked", "failed": "error", "timeout": "error",
          "cancelled": "error"}
BLOCKER_TYPES: dict[str, str] = {ErrorCode.DEPENDENCY_MISSING: "dependency_failed",
                                 ErrorCode.VALIDATION_FAILED: "validation_failed",
                                 ErrorCode.SCHEMA_VALIDATION_FAILED: "validation_failed",
                                 ErrorCode.INVALID_DOCUMENT: "validation_failed",
                                 ErrorCode.UNSAFE_ID: "validation_failed",
                                 ErrorCode.NOT_A_REQUEST: "validation_failed",
                                 ErrorCode.CONTRACT_VIOLATION: "validation_failed",
                                 ErrorCode.NEEDS_CLARIFICATION: "missing_input",
                                 ErrorCode.BLOCKED: "unknown", ErrorCode.TIMEOUT: "resource_unavailable"}
# codes that always say the incoming request itself is at fault (its sender must fix it); a
# VALIDATION_FAILED is one too when it names a path of the request's results.artifacts (one
# outside the workspace is refused before the specialist starts: request_fault)
REQUEST_FAULTS = frozenset({ErrorCode.SCHEMA_VALIDATION_FAILED, ErrorCode.INVALID_DOCUMENT,
                            ErrorCode.UNSAFE_ID, ErrorCode.NOT_A_REQUEST})
RESOLUTIONS = {
    "validation_failed": ["Fix the specialist so its results pass validation", "Retry the handoff"],
    "dependency_failed": ["Complete the dependency first", "Retry the handoff"],
    "missing_input": ["Answer the open questions and send the handoff again"],
    "resource_unavailable": ["Retry when the resource is available", "Increase the time limit"],
    "unknown": ["Inspect the error and retry the handoff", "Escalate to the orchestrator"],
}
# A failure filed for good (``retry_available: false``: the daemon never retries it, and `handoff
# retry` refuses it without --force): the options of its built blocker say so instead of
# "Retry the handoff" ({id}: the request's handoff_id)
FINAL_RETRY = ("handoffd will not retry it: once the cause is fixed, run it again with "
               "handoff retry --force {id}")
FINAL_RESOLUTIONS = {
    "validation_failed": ["Fix the specialist so its results pass validation", FINAL_RETRY],
    "dependency_failed": ["Complete the dependency first", FINAL_RETRY],
    "missing_input": ["Answer the open questions and send the handoff again"],
    "resource_unavailable": ["Increase the time limit or free the resource", FINAL_RETRY],
    "unknown": ["Inspect the error", "Escalate to the orchestrator", FINAL_RETRY],
}
# ... and by code, where the type's options do not fit
FINAL_CODE_RESOLUTIONS: dict[str, list[str]] = {
    ErrorCode.CANCELLED: ["Send a new AgentHandoff if the work is still wanted: a cancelled "
                          "handoff is not run again"],
}
# a request at fault: retrying the same document fails the same way
REQUEST_RESOLUTIONS = ["Send the corrected request as a new AgentHandoff (a new handoff_id): a "
                       "retry of this one sends the same document again",
                       "Ask the sending agent (from_agent) to correct the request"]


def native_shape(doc: dict[str, Any]) -> bool:
    """A seed-001 request (handoff_id + target object) is never claimed by another dialect."""
    return "handoff_id" in doc and isinstance(doc.get("target"), dict)


def artifact_paths(outcome: Outcome) -> list[str]:
    """Every artifact path a handler reported (result artifacts, output.artifacts, artifact_path)."""
    paths: list[str] = []
    items = list(outcome.artifacts)
    output = outcome.output if isinstance(outcome.output, dict) else {}
    if isinstance(output.get("artifacts"), list):
        items.extend(output["artifacts"])
    if isinstance(output.get("artifact_path"), str):
        paths.append(output["artifact_path"])
    for item in items:
        if isinstance(item, dict):
            for key in ("path", "artifact_path"):
                if isinstance(item.get(key), str):
                    paths.append(item[key])
    # keys of other stores (seed 000's beads:..., URLs) are references, not workspace files
    return list(dict.fromkeys(p for p in paths if not p.startswith("beads:") and "://" not in p))


class AgentHandoffDialect:
    """Seed 002's AgentHandoff, validated with the seed's schema plus its status rules."""

    name = "agent_handoff"
    # matches() is never true without one of these keys (a ``$schema`` naming it, or an agent
    # field): detection passes over a document that has none without calling it
    match_keys = frozenset({"$schema", "from_agent", "to_agent"})

    # ------------------------------------------------------------ recognising
    def matches(self, doc: dict[str, Any]) -> bool:
        declared = doc.get("$schema")
        if isinstance(declared, str) and "agent_handoff" in declared.lower().replace("-", "_"):
            return True
        if native_shape(doc) or isinstance(doc.get("payload"), dict):
            return False  # a seed-001 request / a HAIOS CollaborationHandoff
        contract = doc.get("contract")
        if isinstance(contract, dict) and "task_id" in contract:
            # a seed-004 WorkerHandoff (seed 002 has no contract block, let alone a task_id)
            # that also names from_agent/to_agent is the swarm dialect's, tried after this one
            return False
        agents = ("from_agent" in doc) + ("to_agent" in doc)
        # one agent field missing or a wrong status must still be reported as AgentHandoff
        # errors (with their paths), not as an unknown format
        return (agents >= 1 and doc.get("status") in STATUSES) or agents == 2

    def is_answer(self, doc: dict[str, Any]) -> bool:
        """True for an answer handoffd filed (a new handoff id; the request is kept)."""
        request = sh.snapshot(doc)
        return request is not None and doc.get("handoff_id") != request.get("handoff_id")

    def _request(self, doc: dict[str, Any]) -> dict[str, Any]:
        return sh.snapshot(doc) if self.is_answer(doc) else doc  # type: ignore[return-value]

    def id_of(self, doc: dict[str, Any]) -> Any:
        return self._request(doc).get("handoff_id")

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        return [SCHEMA]

    # ------------------------------------------------------------ routing
    def envelope(self, doc: dict[str, Any]) -> Envelope:
        request = self._request(doc)
        handoff_id = check_id(request.get("handoff_id"))
        target = request.get("to_agent")
        if not isinstance(target, str) or not target:
            raise InvalidDocument(f"handoff {handoff_id} has no to_agent: name the agent that should "
                                  "receive it", handoff_id=handoff_id,
                                  code=ErrorCode.SCHEMA_VALIDATION_FAILED)
        action = given if isinstance(given := request.get("action_required"), dict) else {}
        source = request.get("from_agent")
        conversation = request.get("conversation_id")
        return Envelope(
            handoff_id=handoff_id, dialect=self.name, target=target,
            source=source if isinstance(source, str) else None,
            data={key: request[key] for key in DATA_KEYS if key in request},
            priority=priority_rank(action.get("priority")),
            conversation_id=conversation if isinstance(conversation, str) else None,
            input_artifacts=request_artifact_paths(request),
        )

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Nothing to default: the format names its id and times itself."""

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        """The status field describes the sender's task, not the queue: left alone."""

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Nothing to undo (see mark_claimed)."""

    # ------------------------------------------------------------ checking and answering
    def review(self, doc: dict[str, Any], outcome: Outcome, root: Path | None) -> Outcome:
        """Seed 002's "verify artifacts exist": a reported path missing from the workspace fails the
        handoff with VALIDATION_FAILED (permanent) before it may complete."""
        if not outcome.succeeded or root is None:
            return outcome
        ws = workspace_at(str(root))
        missing = []
        for path in artifact_paths(outcome):
            resolved = ws.inside(path)
            if resolved is None or not resolved.exists():
                missing.append(path)
        if not missing:
            return outcome
        shown = ", ".join(repr(p) for p in missing[:5]) + (" ..." if len(missing) > 5 else "")
        message = (f"unverified artifacts: {shown} "
                   f"{'does' if len(missing) == 1 else 'do'} not exist in the workspace "
                   f"{ws.root}; a handoff may only report artifacts that exist")
        return Outcome(
            status="failed", started_at=outcome.started_at, finished_at=outcome.finished_at,
            output=outcome.output, artifacts=outcome.artifacts, validation=outcome.validation,
            metadata=outcome.metadata, next_steps=outcome.next_steps, warnings=outcome.warnings,
            error={"code": ErrorCode.VALIDATION_FAILED, "message": message, "retryable": False,
                   "details": {"missing_artifacts": missing}},
            executed_by=outcome.executed_by, fields=outcome.fields, park=outcome.park)

    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        request = sh.without_book(self._request(doc))
        status = STATUS[sh.effective_status(outcome)]
        me = (given if isinstance(given := request.get("to_agent"), str)
              else outcome.executed_by or "handoffd")
        back = request.get("from_agent") if isinstance(request.get("from_agent"), str) else "unknown"
        onward = next_agent(outcome) if status in ("success", "partial") else None
        answer: dict[str, Any] = {"handoff_id": random_uuid()}
        if isinstance(request.get("conversation_id"), str):
            answer["conversation_id"] = request["conversation_id"]
        answer.update({"from_agent": me, "to_agent": onward or back, "status": status,
                       "timestamp": iso(outcome.finished_at)})
        if isinstance(request.get("context"), dict):
            answer["context"] = copy.deepcopy(request["context"])
        answer["results"] = self.results(outcome, me)
        if status != "success":
            answer["blockers"] = self.blockers(outcome, status, request,
                                               final=not filed.retry_available)
        answer["metadata"] = self.metadata(request, outcome, filed)
        answer["in_reply_to"] = request.get("handoff_id")
        if "context" in answer and sh.schema_errors(SCHEMA, answer):
            del answer["context"]  # a rejected request's malformed context is not repeated
        answer["handoffd"] = sh.copy_book(doc)
        return answer

    def results(self, outcome: Outcome, agent: str) -> dict[str, Any]:
        """The results object: summary, artifacts, metrics, verification and the raw output."""
        results: dict[str, Any] = {"summary": sh.summary_of(outcome, agent)}
        items = list(outcome.artifacts)
        out = outcome.output if isinstance(outcome.output, dict) else {}
        if isinstance(out.get("artifacts"), list):
            items.extend(out["artifacts"])
        artifacts = []
        for item in items:
            if isinstance(item, str):
                item = {"path": item}
            if not isinstance(item, dict):
                continue
            path = item.get("path") or item.get("artifact_path") or item.get("content_ref")
            if not isinstance(path, str) or not path:
                continue
            kind = next((k for k in (item.get("type"), item.get("artifact_type"))
                         if k in ARTIFACT_TYPES), "data")
            entry = {"name": str(item.get("name") or path.rstrip("/").rsplit("/", 1)[-1]),
                     "path": path, "type": kind}
            if isinstance(item.get("description"), str):
                entry["description"] = item["description"]
            artifacts.append(entry)
        results["artifacts"] = artifacts
        for key in ("metrics", "verification"):
            if isinstance(out.get(key), dict):
                results[key] = out[key]
        if outcome.validation and "verification" not in results:
            results["verification"] = {"verification_method": "handoffd result validation",
                                       **{k: v for k, v in outcome.validation.items()
                                          if k in ("tests_passed", "coverage", "execution_verified")}}
        if outcome.output is not None:
            results["output"] = outcome.output
        return results

    def blockers(self, outcome: Outcome, status: str, request: dict[str, Any] | None = None, *,
                 final: bool = False) -> list[dict[str, Any]]:
        """Blockers the handler reported (normalised), else one built from the error: its
        resolution options those of the blocker's type (for a ``final`` failure, one handoffd
        filed with ``retry_available: false``, options that promise no plain retry:
        :func:`resolutions`), or, when the incoming ``request`` was at fault
        (:func:`request_fault`), how to fix and send it."""
        request = request if request is not None else {}
        reported = reported_blockers(outcome)
        if reported:
            if status == "blocked" and not any(b.get("resolution_options") for b in reported):
                reported[0]["resolution_options"] = list(RESOLUTIONS[reported[0]["type"]])
            return reported
        code = sh.error_code(outcome) or status.upper()
        kind = BLOCKER_TYPES.get(code, "unknown")
        blocker: dict[str, Any] = {
            "blocker_id": f"blk-{code.lower().replace('_', '-')}",
            "type": kind,
            "description": f"{code}: {sh.error_message(outcome) or 'the task ended ' + status}",
            "resolution_options": (request_resolutions(outcome, request)
                                   if request_fault(outcome, code, request)
                                   else resolutions(kind, code, request, final)),
        }
        missing = sh.error_list(outcome, "missing_artifacts")
        if missing:
            blocker["blocking_tasks"] = [str(p) for p in missing]
        return [blocker]

    def metadata(self, request: dict[str, Any], outcome: Outcome, filed: FiledState) -> dict[str, Any]:
        """execution_time_ms, retry_count and the next chain position."""
        meta: dict[str, Any] = {"execution_time_ms": sh.milliseconds(outcome),
                                "retry_count": filed.retry_count}
        for key in ("tokens_used", "tool_calls"):
            value = sh.metadata_field(outcome, key)
            if isinstance(value, int) and not isinstance(value, bool):
                meta[key] = value
        old = given if isinstance(given := request.get("metadata"), dict) else {}
        position = old.get("chain_position")
        if isinstance(position, dict) and isinstance(position.get("step"), int):
            meta["chain_position"] = {**position, "step": position["step"] + 1}
        return meta


def resolutions(kind: str, code: str, request: dict[str, Any], final: bool) -> list[str]:
    """The resolution options of a blocker of type ``kind`` built from an error ``code``. Those
    of :data:`RESOLUTIONS` say "Retry the handoff": true of a failure `handoff retry` takes up
    as it is; for a ``final`` one (filed with ``retry_available: false``) they name the forced
    retry with the request's id instead, or a new handoff."""
    if not final:
        return list(RESOLUTIONS[kind])
    given = request.get("handoff_id")
    named = given if isinstance(given, str) and given else "<handoff_id>"
    options = FINAL_CODE_RESOLUTIONS.get(code) or FINAL_RESOLUTIONS[kind]
    return [option.format(id=named) if option is FINAL_RETRY else option for option in options]


def refused_inputs(outcome: Outcome, request: dict[str, Any]) -> list[str]:
    """The fields (``results.artifacts[i].path``) of the request's own artifact paths that a
    VALIDATION_FAILED refuses by name (``artifact reference '/etc/passwd' ...``: one that could
    reach outside the workspace, refused before the specialist starts). Empty for any other
    failure, and for unverified result artifacts (their error lists ``missing_artifacts``)."""
    message = sh.error_message(outcome)
    if sh.error_code(outcome) != ErrorCode.VALIDATION_FAILED or not message \
            or sh.error_list(outcome, "missing_artifacts"):
        return []
    return [f"results.artifacts[{index}].path"
            for index, ref in enumerate(all_request_artifact_paths(request))
            if ref is not None and f"artifact reference {ref!r}" in message]


def request_fault(outcome: Outcome, code: str, request: dict[str, Any]) -> bool:
    """True when ``outcome`` failed for a fault of the incoming request, not of a result: a code
    of :data:`REQUEST_FAULTS`, or a VALIDATION_FAILED refusing the request's own artifact paths
    (:func:`refused_inputs`). Its sender must act: a specialist's fix would not help."""
    return code in REQUEST_FAULTS or bool(refused_inputs(outcome, request))


def request_resolutions(outcome: Outcome, request: dict[str, Any]) -> list[str]:
    """Seed 002's actionable resolution options for a request at fault: fix each field the
    error names (the first three, once each, cut short), then send it again as a new handoff."""
    fixes: dict[str, str] = {}
    for entry in sh.error_list(outcome, "errors"):
        if isinstance(entry, dict) and isinstance(entry.get("field"), str) and len(fixes) < 3:
            given = entry.get("error")
            problem = given if isinstance(given, str) and given else "not valid"
            problem = problem if len(problem) <= 160 else problem[:155] + "..."
            fixes.setdefault(entry["field"], f"Fix the request's {entry['field'][:80]}: {problem}")
    for field in refused_inputs(outcome, request)[:3]:
        fixes.setdefault(field, f"Fix the request's {field}: name a file inside the workspace "
                                "(a relative path, no '..'), or an external URL")
    return list(fixes.values() or ["Fix the request as the description says"]) \
        + list(REQUEST_RESOLUTIONS)


def reported_blockers(outcome: Outcome) -> list[dict[str, Any]]:
    """The specialist's own blockers, as seed 002 Blockers: those of a parked ``blocked``
    answer (``outcome.park["blockers"]``, where orchestration keeps the result's ``blockers``),
    else ``output.blockers``. Empty when it gave none (then a generic one is made)."""
    for raw in (outcome.park.get("blockers") if isinstance(outcome.park, dict) else None,
                sh.output_field(outcome, "blockers")):
        found = normalised_blockers(raw)
        if found:
            return found
    return []


def normalised_blockers(raw: Any) -> list[dict[str, Any]]:
    """``raw`` as seed 002 Blockers: each needs a ``description``; ``type`` outside the seed's
    enum becomes ``unknown``; ``blocker_id`` is kept when it is a string; ``resolution_options``
    and ``blocking_tasks`` keep their strings. Anything else is left out, so that the answer
    stays valid against the seed's schema."""
    if not isinstance(raw, list):
        return []
    blockers = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("description"), str):
            continue
        entry: dict[str, Any] = {}
        if isinstance(item.get("blocker_id"), str):
            entry["blocker_id"] = item["blocker_id"]
        kind = item.get("type")
        entry["type"] = kind if isinstance(kind, str) and kind in RESOLUTIONS else "unknown"
        entry["description"] = item["description"]
        for key in ("resolution_options", "blocking_tasks"):
            if key in item:
                entry[key] = sh.strings(item[key])
        blockers.append(entry)
    return blockers


def all_request_artifact_paths(request: dict[str, Any]) -> list[str | None]:
    """Each ``results.artifacts[i].path`` of an incoming AgentHandoff by its index (None where
    there is no usable path)."""
    results = request.get("results")
    items = results.get("artifacts") if isinstance(results, dict) else None
    return [item["path"] if isinstance(item, dict) and isinstance(item.get("path"), str)
            and item["path"] else None for item in (items if isinstance(items, list) else [])]


def request_artifact_paths(request: dict[str, Any]) -> tuple[str, ...]:
    """The ``results.artifacts[].path`` values of an incoming AgentHandoff."""
    results = request.get("results")
    items = results.get("artifacts") if isinstance(results, dict) else None
    return tuple(item["path"] for item in (items if isinstance(items, list) else [])
                 if isinstance(item, dict) and isinstance(item.get("path"), str) and item["path"])


def next_agent(outcome: Outcome) -> str | None:
    """The agent a specialist hands its results on to (``output.next_agent``; seed 002: "create
    new handoff - pass results to next agent"), or None to answer the sender."""
    value = sh.output_field(outcome, "next_agent")
    return value if isinstance(value, str) and value.strip() and len(value) <= 200 else None
