"""handoffd: a durable, file-based handoff queue for multi-agent systems.

The library API::

    from handoffd import build_engine, Workspace, specialist, Daemon

    @specialist("@echo")
    def echo(handoff, ctx):
        return {"status": "completed", "output": {"echo": ctx.data}}
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below are loaded on first use (a CLI start must not pay for all)
    from .backends.files.store import Store
    from .core.config import Config, RetryPolicy
    from .core.documents import Envelope, Outcome
    from .core.engine import Engine
    from .core.errors import (
        ConfigError,
        DuplicateHandoff,
        ErrorCode,
        HandlerError,
        HandoffdError,
        InvalidDocument,
        NotFound,
        StoreUnavailable,
        UsageError,
        WaitTimeout,
    )
    from .core.native_format import new_native_request
    from .core.specialists import HandlerContext, Registry, specialist
    from .core.states import State
    from .core.workspace import Workspace
    from .dialects.models import (
        AgentHandoff,
        AggregatedOutcome,
        Artifact,
        CancellationPayload,
        ChildOutcomeSummary,
        CollaborationHandoff,
        CollaborationResult,
        CompletionReport,
        DelegationPayload,
        HandoffPayload,
        Message,
        NativeRequest,
        OutcomePayload,
        ParallelDelegation,
        WorkerContext,
        WorkerContract,
        WorkerEscalation,
        WorkerHandoff,
    )
    from .features.build import build_engine
    from .service.client import Client
    from .service.daemon import Daemon

_MODELS = ("AgentHandoff", "AggregatedOutcome", "Artifact", "CancellationPayload",
           "ChildOutcomeSummary", "CollaborationHandoff", "CollaborationResult", "CompletionReport",
           "DelegationPayload", "HandoffPayload", "Message", "NativeRequest", "OutcomePayload",
           "ParallelDelegation", "WorkerContext", "WorkerContract", "WorkerEscalation",
           "WorkerHandoff")
# public name -> the module that defines it
_HOME: dict[str, str] = {
    "build_engine": "features.build", "Client": "service.client",
    "Config": "core.config", "RetryPolicy": "core.config", "Daemon": "service.daemon", "Envelope": "core.documents",
    "Outcome": "core.documents", "new_native_request": "core.native_format", "ConfigError": "core.errors",
    "DuplicateHandoff": "core.errors", "HandlerError": "core.errors", "HandoffdError": "core.errors",
    "InvalidDocument": "core.errors", "NotFound": "core.errors", "UsageError": "core.errors",
    "StoreUnavailable": "core.errors",
    "WaitTimeout": "core.errors", "ErrorCode": "core.errors", "Engine": "core.engine",
    "HandlerContext": "core.specialists",
    "Registry": "core.specialists", "specialist": "core.specialists", "State": "core.states", "Store": "backends.files.store",
    "Workspace": "core.workspace", **{name: "dialects.models" for name in _MODELS},
}


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562)."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'handoffd' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])


__version__ = "0.1.0"

# The front door: what a user needs to embed handoffd. Every other name that used to be exported
# here (the other exceptions, Envelope, RetryPolicy, Store, the typed models of each format) still
# loads from ``handoffd`` for compatibility, but lives in its module (``handoffd.core.errors``,
# ``handoffd.dialects.models``, ...).
__all__ = [
    "Client", "Config", "Daemon", "Engine", "ErrorCode", "HandlerContext", "HandoffdError", "Outcome",
    "Registry", "State", "Workspace", "build_engine", "new_native_request", "specialist",
]
