"""The machinery under :mod:`.models`: the :class:`Model` base class (exact round-trips of a
document, unknown keys preserved) and the enumerated values the formats share."""
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


def now_text() -> str:
    """The current UTC time as the documents write it."""
    return iso(utc_now())


def native_id() -> str:
    """A fresh native handoff id."""
    return f"hoff-{random_uuid().replace('-', '')}"


def _encode(value: Any) -> Any:
    """``value`` as JSON holds it: models, enums and datetimes encoded, the rest copied."""
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
