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
document round-trips exactly whatever spelling it used.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum, IntEnum
from typing import Any, ClassVar, Mapping, TypeVar

from ..core.documents import random_uuid
from ..core.timeutil import iso, utc_now

M = TypeVar("M", bound="Model")

OUTCOME_STATUS_VALUES = ("success", "partial", "failed", "blocked", "needs_clarification",
                         "timeout", "cancelled", "throttled")
AGGREGATION_STRATEGIES = ("all_success", "any_success", "majority", "first_success")
AGENT_HANDOFF_STATUSES = ("success", "partial", "blocked", "error")
BLOCKER_TYPES = ("missing_input", "resource_unavailable", "dependency_failed", "validation_failed",
                 "unknown")
HAIOS_HANDOFF_STATUSES = ("pending", "accepted", "completed", "failed", "timeout")
HAIOS_RESULT_STATUSES = ("success", "partial", "error")
HAIOS_ERROR_TYPES = ("retryable", "permanent", "unknown")


class TierLevel(IntEnum):
    """Seed 000's tiers; documents name them (``"ROUTING_DISPATCHER"``) or number them (2)."""

    PROGRESS_MONITOR = 4
    ABSTRACT_ARCHITECT = 3
    ROUTING_DISPATCHER = 2
    SPECIALIZED_FLEET = 1


class OutcomeStatus(str, Enum):
    """Seed 000's OutcomeStatus values."""

    SUCCESS = "success"
    PARTIAL = "partial"
    FAILED = "failed"
    BLOCKED = "blocked"
    NEEDS_CLARIFICATION = "needs_clarification"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    THROTTLED = "throttled"


def _now() -> str:
    return iso(utc_now())


def _native_id() -> str:
    return f"hoff-{random_uuid().replace('-', '')}"


def _encode(value: Any) -> Any:
    if isinstance(value, Model):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return copy.deepcopy(value)


@dataclass(kw_only=True)
class Model:
    """Base of every document class: exact round-trips and preserved unknown keys."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this class does not model, written back as they were."""
    _keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    SCHEMA: ClassVar[str | None] = None
    ALWAYS: ClassVar[frozenset[str]] = frozenset()  # written even when None (built in code)
    NESTED: ClassVar[dict[str, Any]] = {}  # field → Model class (or ("list", cls))

    @classmethod
    def _fields(cls) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(cls) if f.name not in ("extra", "_keys")]

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        spec = cls.NESTED.get(name)
        if spec is None:
            return copy.deepcopy(value)
        if isinstance(spec, tuple):
            item_cls = spec[1]
            if not isinstance(value, list):
                return copy.deepcopy(value)
            return [item_cls.from_dict(v) if isinstance(v, Mapping) else copy.deepcopy(v)
                    for v in value]
        if callable(getattr(spec, "from_dict", None)) and isinstance(value, Mapping):
            return spec.from_dict(value)
        return copy.deepcopy(value)

    @classmethod
    def from_dict(cls: type[M], data: Mapping[str, Any]) -> M:
        """Build from a parsed JSON object; ValueError names missing required fields."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict needs a JSON object, got {type(data).__name__}")
        known = cls._fields()
        names = {f.name for f in known}
        missing = [f.name for f in known if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{cls.__name__}: missing required field(s) {', '.join(missing)}")
        kwargs: dict[str, Any] = {}
        for f in known:
            if f.name in data:
                kwargs[f.name] = cls._decode(f.name, data[f.name])
            else:
                kwargs[f.name] = None  # absent stays absent: never invent ids or timestamps
        extra = {k: copy.deepcopy(v) for k, v in data.items() if k not in names}
        return cls(**kwargs, extra=extra, _keys=tuple(data.keys()))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (a fresh structure; safe to mutate)."""
        values = {f.name: getattr(self, f.name) for f in self._fields()}
        present: set[str] = set(self._keys or ())
        def wanted(name: str) -> bool:
            value = values[name]
            if self._keys is not None:
                return name in present or value is not None
            return value is not None or name in self.ALWAYS
        out: dict[str, Any] = {}
        for key in self._keys or ():
            if key in values and wanted(key):
                out[key] = _encode(values[key])
            elif key in self.extra:
                out[key] = _encode(self.extra[key])
        for name in values:
            if name not in out and wanted(name):
                out[name] = _encode(values[name])
        for key, value in self.extra.items():
            if key not in out:
                out[key] = _encode(value)
        return out

    def validate(self) -> list[dict[str, str]]:
        """Schema errors of ``to_dict()`` against the built-in schema ({field, error, schema_path})."""
        if self.SCHEMA is None:
            return []
        from ..core.validation import (
            builtin_schemas,  # jsonschema loads only for a document the quick check fails
        )
        return builtin_schemas().errors(self.SCHEMA, self.to_dict())


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
        return cls(version=cls.CURRENT_VERSION, id=id or random_uuid(), timestamp=_now(),
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
    timestamp: str = field(default_factory=_now)
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
    created_at: str = field(default_factory=_now)
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
    executed_at: str = field(default_factory=_now)
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

    handoff_id: str = field(default_factory=_native_id)
    timestamp: str = field(default_factory=_now)
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
]
