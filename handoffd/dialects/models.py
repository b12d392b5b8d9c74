"""Typed documents for every format handoffd speaks, so Python agents need not hand-write JSON.

Each class has ``from_dict`` and ``to_dict``; ``Model.from_dict(d).to_dict() == d`` for every valid
document (key order included): fields a document leaves out stay out, explicit ``null`` stays
``null``, and keys the class does not know are kept in ``extra`` and written back (seed 000: unknown
fields of a known version are accepted and preserved). Objects built in code write their fields
that are set, plus the ones their format always carries (e.g. a Message's ``correlation_id``).
``validate()`` returns the schema errors of the document (``[]`` when valid)::

    from handoffd.dialects.models import Message, DelegationPayload

    msg = Message.delegation("ABSTRACT_ARCHITECT", "ROUTING_DISPATCHER",
                             DelegationPayload(task_type="solve", objective="Binary search"))
    Path("handoffs/pending", msg.id + ".json").write_text(json.dumps(msg.to_dict()))

Enumerated values are plain strings (see the ``*_VALUES`` tuples and :class:`TierLevel`), so a
document round-trips exactly whatever spelling it used. The base class is in :mod:`.model_base`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from ..core.documents import random_uuid
from .model_base import (
    AGENT_HANDOFF_STATUSES,
    AGGREGATION_STRATEGIES,
    BLOCKER_TYPES,
    HAIOS_ERROR_TYPES,
    HAIOS_HANDOFF_STATUSES,
    HAIOS_RESULT_STATUSES,
    OUTCOME_STATUS_VALUES,
    Model,
    OutcomeStatus,
    TierLevel,
    native_id,
    now_text,
)

# =========================================================== seed 000: hi_moe
@dataclass(kw_only=True)
class Artifact(Model):
    """A concrete output: exactly one of ``content_ref`` / ``inline_content`` is non-null."""

    artifact_type: str
    content_ref: str | None = None
    inline_content: str | None = None
    metadata: dict[str, Any] | None = None
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"content_ref", "inline_content", "metadata"})

    @classmethod
    def of(cls, artifact_type: str, content: str, *, ref: str | None = None,
           metadata: dict[str, Any] | None = None) -> "Artifact":
        """Seed 000's 1 KB rule: ``content`` inline when under 1 KB, else ``ref`` (required then)."""
        if len(content.encode("utf-8")) < 1024:
            return cls(artifact_type=artifact_type, inline_content=content, metadata=metadata or {})
        if not ref:
            raise ValueError("content of 1 KB or more must be stored elsewhere: pass ref=")
        return cls(artifact_type=artifact_type, content_ref=ref, metadata=metadata or {})


@dataclass(kw_only=True)
class ParallelDelegation(Model):
    """A fan-out: the delegation that spawned the children and how outcomes combine."""

    parent_id: str
    child_ids: list[str]
    aggregation_strategy: str


@dataclass(kw_only=True)
class ChildOutcomeSummary(Model):
    """One child's line in an AggregatedOutcome."""

    message_id: str
    status: str
    confidence: float
    specialist: str


@dataclass(kw_only=True)
class AggregatedOutcome(Model):
    """The dispatcher's combined report after parallel execution."""

    strategy_used: str
    child_outcomes: list[ChildOutcomeSummary]
    aggregated_status: str
    aggregated_confidence: float
    NESTED: ClassVar[dict[str, Any]] = {"child_outcomes": ("list", ChildOutcomeSummary)}


@dataclass(kw_only=True)
class DelegationPayload(Model):
    """Work assigned down a tier."""

    task_type: str
    objective: str
    constraints: list[str] | None = None
    context_refs: list[str] | None = None
    priority: int | None = None
    timeout_ms: int | None = None
    deadline_hint: str | None = None
    specialist_hint: str | None = None
    task_data: dict[str, Any] | None = None
    parallel_delegation: ParallelDelegation | None = None
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"constraints", "context_refs", "priority",
                                                  "timeout_ms", "deadline_hint", "specialist_hint",
                                                  "task_data"})
    NESTED: ClassVar[dict[str, Any]] = {"parallel_delegation": ParallelDelegation}

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self._keys is None:  # built in code: the seed's defaults for list/dict/priority fields
            for key, default in (("constraints", []), ("context_refs", []), ("priority", 2),
                                 ("task_data", {})):
                if out.get(key) is None:
                    out[key] = default
        return out


@dataclass(kw_only=True)
class OutcomePayload(Model):
    """A report up a tier."""

    status: str
    summary: str
    result_refs: list[str] | None = None
    confidence: float | None = None
    execution_time_ms: int | None = None
    resources_used: dict[str, Any] | None = None
    surprise_flag: bool | None = None
    surprise_reason: str | None = None
    error_type: str | None = None
    error_detail: str | None = None
    recoverable: bool | None = None
    artifacts: list[Artifact] | None = None
    aggregated_outcome: AggregatedOutcome | None = None
    NESTED: ClassVar[dict[str, Any]] = {"artifacts": ("list", Artifact),
                                        "aggregated_outcome": AggregatedOutcome}


@dataclass(kw_only=True)
class CancellationPayload(Model):
    """Abort in-flight work (best effort)."""

    target_message_id: str
    reason: str
    cascade: bool


class _PayloadField:
    """Decodes a Message payload into the right payload class by its keys."""

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Model:
        if "target_message_id" in data:
            return CancellationPayload.from_dict(data)
        if "status" in data:
            return OutcomePayload.from_dict(data)
        return DelegationPayload.from_dict(data)


@dataclass(kw_only=True)
class Message(Model):
    """Seed 000's versioned envelope between tiers."""

    version: str
    id: str
    timestamp: str
    source_tier: str | int
    target_tier: str | int
    correlation_id: str | None = None
    payload: DelegationPayload | OutcomePayload | CancellationPayload
    SCHEMA: ClassVar[str | None] = "hi_moe.message.schema.json"
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"correlation_id"})
    NESTED: ClassVar[dict[str, Any]] = {"payload": _PayloadField}
    CURRENT_VERSION: ClassVar[str] = "1.0.0"

    @classmethod
    def create(cls, source_tier: str | int | TierLevel, target_tier: str | int | TierLevel,
               payload: DelegationPayload | OutcomePayload | CancellationPayload, *,
               correlation_id: str | None = None, id: str | None = None) -> "Message":
        """A new message (uuid4 id, current time, version 1.0.0)."""
        def tier(value: Any) -> str | int:
            return value.name if isinstance(value, TierLevel) else value
        return cls(version=cls.CURRENT_VERSION, id=id or random_uuid(), timestamp=now_text(),
                   source_tier=tier(source_tier), target_tier=tier(target_tier),
                   correlation_id=correlation_id, payload=payload)

    delegation = create  # Message.delegation(src, dst, DelegationPayload(...)) reads well


# =========================================================== seed 002: AgentHandoff
@dataclass(kw_only=True)
class AgentHandoff(Model):
    """Seed 002's Universal AgentHandoff. Nested objects (context, results, blockers...) are
    plain dicts shaped as the seed's schema says."""

    handoff_id: str = field(default_factory=random_uuid)
    conversation_id: str | None = None
    from_agent: str
    to_agent: str
    status: str
    timestamp: str = field(default_factory=now_text)
    context: dict[str, Any] | None = None
    results: dict[str, Any] | None = None
    action_required: dict[str, Any] | None = None
    blockers: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    SCHEMA: ClassVar[str | None] = "agent_handoff.schema.json"


# =========================================================== seed 003: HAIOS
@dataclass(kw_only=True)
class HandoffPayload(Model):
    """A CollaborationHandoff's task: the directive, optional context and original input."""

    directive: dict[str, Any]
    context: dict[str, Any] | None = None
    original_input: str | None = None
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"context", "original_input"})


@dataclass(kw_only=True)
class CollaborationHandoff(Model):
    """Seed 003's agent-to-agent handoff (defaults as the seed's dataclass)."""

    handoff_id: str = field(default_factory=random_uuid)
    from_agent: str
    to_agent: str
    created_at: str = field(default_factory=now_text)
    payload: HandoffPayload
    expected_output_schema: dict[str, Any] | None = None
    timeout_ms: int = 30000
    status: str = "pending"
    SCHEMA: ClassVar[str | None] = "haios.collaboration_handoff.schema.json"
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"expected_output_schema"})
    NESTED: ClassVar[dict[str, Any]] = {"payload": HandoffPayload}


@dataclass(kw_only=True)
class CollaborationResult(Model):
    """Seed 003's answer to a CollaborationHandoff."""

    handoff_id: str
    executed_by: str
    executed_at: str = field(default_factory=now_text)
    status: str
    result: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    SCHEMA: ClassVar[str | None] = "haios.collaboration_result.schema.json"
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"error"})


# =========================================================== seed 004: swarm
@dataclass(kw_only=True)
class WorkerContract(Model):
    """Machine-readable, enforced: what to do and where."""

    task_id: str
    files_owned: list[str] = field(default_factory=list)
    files_readonly: list[str] = field(default_factory=list)
    dependencies_completed: list[str] = field(default_factory=list)
    success_criteria: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class WorkerContext(Model):
    """Human-readable, advisory: why it matters and how it fits."""

    epic_summary: str = ""
    your_role: str = ""
    what_others_did: str = ""
    what_comes_next: str = ""


@dataclass(kw_only=True)
class WorkerEscalation(Model):
    """Where to turn when blocked or when the scope must change."""

    blocked_contact: str = "coordinator"
    scope_change_protocol: str = "swarmmail_send(subject='Scope Change', ack_required=true)"


@dataclass(kw_only=True)
class WorkerHandoff(Model):
    """Seed 004's WorkerHandoff envelope (routed to ``to_agent`` when set, else @swarm-worker)."""

    contract: WorkerContract
    context: WorkerContext = field(default_factory=WorkerContext)
    escalation: WorkerEscalation = field(default_factory=WorkerEscalation)
    to_agent: str | None = None
    SCHEMA: ClassVar[str | None] = "swarm.worker_handoff.schema.json"
    NESTED: ClassVar[dict[str, Any]] = {"contract": WorkerContract, "context": WorkerContext,
                                        "escalation": WorkerEscalation}


@dataclass(kw_only=True)
class CompletionReport(Model):
    """The swarm_complete report handoffd files as a WorkerHandoff's answer."""

    task_id: str
    status: str
    files_touched: list[str] = field(default_factory=list)
    summary: str = ""
    agent: str | None = None
    success_criteria: list[dict[str, Any]] | None = None
    valid: bool | None = None
    violations: list[Any] | None = None
    completed_at: str | None = None
    execution_time_ms: int | None = None
    output: Any = None
    error: dict[str, Any] | None = None
    SCHEMA: ClassVar[str | None] = "swarm.completion_report.schema.json"


# =========================================================== seed 001: native
@dataclass(kw_only=True)
class AgentRef(Model):
    """``source`` / ``target`` of a native request."""

    agent_id: str
    phase: int | None = None
    agent_type: str | None = None


@dataclass(kw_only=True)
class HandoffInput(Model):
    """A native request's ``input``: the data and the schema it follows."""

    schema: str | None = None
    data: Any = None
    ALWAYS: ClassVar[frozenset[str]] = frozenset({"data"})


@dataclass(kw_only=True)
class ExpectedOutput(Model):
    """A native request's ``expected_output``."""

    artifact_type: str | None = None
    schema: str | None = None
    destination: str | None = None


@dataclass(kw_only=True)
class RetrySpec(Model):
    """A native request's ``retry_policy``."""

    max_retries: int | None = None
    retry_delay_seconds: float | None = None
    backoff_multiplier: float | None = None


@dataclass(kw_only=True)
class NativeRequest(Model):
    """Seed 001's handoff request (what ``handoff create --to`` writes)."""

    handoff_id: str = field(default_factory=native_id)
    timestamp: str = field(default_factory=now_text)
    status: str = "pending"
    source: AgentRef | None = None
    target: AgentRef
    context: dict[str, Any] | None = None
    input: HandoffInput | None = None
    expected_output: ExpectedOutput | None = None
    timeout_seconds: float | None = None
    priority: str | int | None = None
    retry_policy: RetrySpec | None = None
    depends_on: list[str] | None = None
    SCHEMA: ClassVar[str | None] = "native.request.schema.json"
    NESTED: ClassVar[dict[str, Any]] = {"source": AgentRef, "target": AgentRef,
                                        "input": HandoffInput, "expected_output": ExpectedOutput,
                                        "retry_policy": RetrySpec}


FORMATS: dict[str, type[Model]] = {
    "hi_moe": Message, "agent_handoff": AgentHandoff, "haios": CollaborationHandoff,
    "swarm": WorkerHandoff, "native": NativeRequest,
}


def load(doc: Mapping[str, Any]) -> Model:
    """The typed document for any supported request format (detected as the daemon does)."""
    from .. import dialects

    dialect = dialects.detect(dict(doc))
    answer = getattr(dialect, "is_answer", lambda _d: False)(doc)
    if dialect.name == "haios" and answer:
        return CollaborationResult.from_dict(doc)
    if dialect.name == "swarm" and answer:
        return CompletionReport.from_dict(doc)
    return FORMATS[dialect.name].from_dict(doc)


__all__ = [
    "AgentHandoff", "AgentRef", "AggregatedOutcome", "Artifact", "CancellationPayload",
    "ChildOutcomeSummary", "CollaborationHandoff", "CollaborationResult", "CompletionReport",
    "DelegationPayload", "ExpectedOutput", "HandoffInput", "HandoffPayload", "Message", "Model",
    "NativeRequest", "OutcomePayload", "OutcomeStatus", "ParallelDelegation", "RetrySpec",
    "TierLevel", "WorkerContext", "WorkerContract", "WorkerEscalation", "WorkerHandoff", "load",
    "AGENT_HANDOFF_STATUSES", "AGGREGATION_STRATEGIES", "BLOCKER_TYPES", "HAIOS_ERROR_TYPES",
    "HAIOS_HANDOFF_STATUSES", "HAIOS_RESULT_STATUSES", "OUTCOME_STATUS_VALUES",
]
