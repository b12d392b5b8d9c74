"""Seed 004 (Swarm, ADR-008): WorkerHandoff in, completion report out.

The handoff id is ``contract.task_id``; the worker is the document's ``to_agent`` / ``worker`` (or
``contract.worker``), else ``@swarm-worker``. The handler gets the whole handoff as data; the
Envelope carries the contract (for contract enforcement) and ``dependencies_completed`` as
``depends_on``. The answer is the swarm_complete report: task id, status, files touched, summary,
success criteria results and violations (``valid`` is false whenever one was found, also when it
did not fail the handoff).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from ..core.documents import Envelope, Outcome, check_id, document_seconds, priority_rank
from ..core.errors import ErrorCode, InvalidDocument
from ..core.formats import ArtifactSink
from ..core.timeutil import iso
from . import _shared as sh
from .base import FiledState

HANDOFF_SCHEMA = "swarm.worker_handoff.schema.json"
REPORT_SCHEMA = "swarm.completion_report.schema.json"
DEFAULT_WORKER = "@swarm-worker"
CRITERION_STATES = ("passed", "failed", "unchecked")


class SwarmDialect:
    """Seed 004's WorkerHandoff envelope (contract / context / escalation)."""

    name = "swarm"
    # matches() is never true without one of these keys (a ``$schema`` naming it, a contract, or a
    # report's task_id): detection passes over a document that has none without calling it
    match_keys = frozenset({"$schema", "contract", "task_id"})

    # ------------------------------------------------------------ recognising
    def matches(self, doc: dict[str, Any]) -> bool:
        declared = doc.get("$schema")
        if isinstance(declared, str) and "swarm" in declared.lower():
            return True
        if "handoff_id" in doc and isinstance(doc.get("target"), dict):
            return False  # a seed-001 request that carries a contract block stays native
        contract = doc.get("contract")
        if isinstance(contract, dict) and ("task_id" in contract or "escalation" in doc):
            return True
        return self.is_answer(doc)

    def is_answer(self, doc: dict[str, Any]) -> bool:
        """True for a completion report (task_id and files_touched, no contract)."""
        return "contract" not in doc and "task_id" in doc and "files_touched" in doc

    def _request(self, doc: dict[str, Any]) -> dict[str, Any]:
        request = sh.snapshot(doc) if self.is_answer(doc) else None
        return request if request is not None else doc

    def id_of(self, doc: dict[str, Any]) -> Any:
        request = self._request(doc)
        contract = request.get("contract")
        if isinstance(contract, dict):
            return contract.get("task_id")
        return request.get("task_id")

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        return [REPORT_SCHEMA if self.is_answer(doc) else HANDOFF_SCHEMA]

    @staticmethod
    def worker(request: dict[str, Any]) -> str:
        """Who runs the task: to_agent / worker at the top or in the contract, else @swarm-worker."""
        contract = given if isinstance(given := request.get("contract"), dict) else {}
        for holder in (request, contract):
            for key in ("to_agent", "worker"):
                if isinstance(holder.get(key), str) and holder[key]:
                    return holder[key]
        return DEFAULT_WORKER

    # ------------------------------------------------------------ routing
    def envelope(self, doc: dict[str, Any]) -> Envelope:
        request = self._request(doc)
        if self.is_answer(request):
            raise InvalidDocument(
                f"{request.get('task_id')} is a completion report (an answer), not a WorkerHandoff: "
                "submit the handoff instead", code=ErrorCode.NOT_A_REQUEST)
        contract = request.get("contract")
        if not isinstance(contract, dict):
            raise InvalidDocument("a WorkerHandoff needs a contract block with a task_id",
                                  code=ErrorCode.SCHEMA_VALIDATION_FAILED)
        handoff_id = check_id(contract.get("task_id"))
        source = request.get("from_agent")
        return Envelope(
            handoff_id=handoff_id, dialect=self.name, target=self.worker(request),
            source=source if isinstance(source, str) else None,
            data=sh.without_book(request),
            timeout_seconds=document_seconds(request.get("timeout_seconds")),
            priority=priority_rank(request.get("priority")),
            depends_on=sh.strings(contract.get("dependencies_completed")),
            contract=contract,
        )

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Nothing to default: the format names its id and times itself."""

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        """A WorkerHandoff has no status field: claiming leaves it as written."""

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Nothing to undo (see mark_claimed)."""

    # ------------------------------------------------------------ answering
    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        request = self._request(doc)
        contract = given if isinstance(given := request.get("contract"), dict) else {}
        status = sh.effective_status(outcome)
        violations = report_violations(outcome, sh.strings(contract.get("dependencies_completed")))
        answer: dict[str, Any] = {
            "task_id": contract.get("task_id", request.get("task_id")),
            "status": status,
            "agent": outcome.executed_by or self.worker(request),
            "files_touched": sh.strings(sh.output_field(outcome, "files_touched")),
            "summary": sh.summary_of(outcome, outcome.executed_by),
            "success_criteria": self.criteria(contract, outcome),
            "valid": not violations,
            "violations": violations,
            "completed_at": iso(outcome.finished_at),
            "execution_time_ms": sh.milliseconds(outcome),
        }
        if outcome.output is not None:
            answer["output"] = outcome.output
        if not outcome.succeeded:
            code = sh.error_code(outcome) or status.upper()
            answer["error"] = {"code": code,
                               "message": sh.error_message(outcome) or answer["summary"],
                               # (a worker's own "not retryable" stays so: filing leaves
                               # every TIMEOUT retry_available for a hand-made retry)
                               "retryable": sh.retry_promised(outcome, filed.retry_available)}
        answer["handoffd"] = sh.copy_book(doc)
        return answer

    @staticmethod
    def criteria(contract: dict[str, Any], outcome: Outcome) -> list[dict[str, Any]]:
        """Each contract criterion with its result: what the handler (or a checker) reported,
        else ``unchecked`` — never assumed passed."""
        reported: dict[str, dict[str, Any]] = {}
        for source in (sh.output_field(outcome, "success_criteria"),
                       sh.metadata_field(outcome, "success_criteria")):
            if isinstance(source, list):
                for item in source:
                    if isinstance(item, dict) and isinstance(item.get("criterion"), str):
                        reported[item["criterion"]] = item
        out = []
        for criterion in sh.strings(contract.get("success_criteria")):
            item = dict(reported.pop(criterion, {}))
            item["criterion"] = criterion
            if item.get("status") not in CRITERION_STATES:
                passed = item.get("passed")
                item["status"] = ("passed" if passed is True else "failed" if passed is False
                                  else "unchecked")
            out.append(item)
        for criterion, item in reported.items():  # extra criteria a checker added
            item = dict(item)
            if item.get("status") not in CRITERION_STATES:
                item["status"] = "unchecked"
            out.append(item)
        return out


def report_violations(outcome: Outcome, dependencies: list[str] | None = None) -> list[Any]:
    """Every contract violation of the attempt, once each: those that failed it (``error``),
    those the contract checks recorded without failing it (``validation.violations``: a
    ``files_touched`` that names a file the worker did not change, e.g. one outside
    ``files_owned``, which seed 004's validateCompletion counts as a violation too), those
    the worker reported itself (``output.violations``), and a ``dependency_missing`` when the
    dependencies gate failed the handoff before it ran (:func:`gate_dependency_violation`;
    ``dependencies``: the contract's ``dependencies_completed``). ``valid`` is true only when
    it is empty."""
    violations = sh.error_list(outcome, "violations")
    recorded = outcome.validation.get("violations") if isinstance(outcome.validation, dict) else None
    for source in (recorded, sh.output_field(outcome, "violations")):
        if isinstance(source, list):
            violations.extend(v for v in source if v not in violations)
    gated = gate_dependency_violation(outcome, dependencies or [])
    if gated is not None and gated not in violations:
        violations.insert(0, gated)
    return violations


def gate_dependency_violation(outcome: Outcome, dependencies: list[str]) -> dict[str, Any] | None:
    """The ``dependency_missing`` violation of a handoff the dependencies gate failed (error
    ``DEPENDENCY_MISSING`` with no handler run: nothing executed it), else None. A handler
    that answers DEPENDENCY_MISSING itself states what it believes, as any failure: its
    ``output.violations`` are how it reports one. It is what the contracts feature appends to
    the violations log for the same rejection, so the report and the log agree."""
    if outcome.executed_by is not None or sh.error_code(outcome) != ErrorCode.DEPENDENCY_MISSING:
        return None
    return dependency_violation(sh.error_message(outcome) or "", dependencies)


def dependency_violation(message: str, dependencies: list[str]) -> dict[str, Any]:
    """Seed 004's dependency check as a violation: the dependencies gate failed a contract's
    handoff with ``message``, which names the dependency that is missing or failed (or the
    cycle through them). ``missing``: the ones of ``dependencies`` (``dependencies_completed``)
    it names, all of them when it names none."""
    deps = list(dict.fromkeys(dependencies))
    words = set(message.split())  # (ids hold no space; the gate writes "on X, which", "X;")
    missing = [d for d in deps if not words.isdisjoint((d, d + ",", d + ";"))]
    return {"kind": "dependency_missing", "missing": missing or deps, "dependencies": deps,
            "message": message}
