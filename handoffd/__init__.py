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
    from .build import build_engine
    from .config import Config, RetryPolicy
    from .daemon import Daemon
    from .documents import Envelope, Outcome, new_native_request
    from .errors import (ConfigError, DuplicateHandoff, ErrorCode, HandlerError, HandoffdError,
                         InvalidDocument, NotFound, UsageError, WaitTimeout)
    from .lifecycle import Engine
    from .models import (AgentHandoff, AggregatedOutcome, Artifact, CancellationPayload,
                         ChildOutcomeSummary, CollaborationHandoff, CollaborationResult,
                         CompletionReport, DelegationPayload, HandoffPayload, Message,
                         NativeRequest, OutcomePayload, ParallelDelegation, WorkerContext,
                         WorkerContract, WorkerEscalation, WorkerHandoff)
    from .specialists import HandlerContext, Registry, specialist
    from .states import State
    from .store import Store
    from .workspace import Workspace

_MODELS = ("AgentHandoff", "AggregatedOutcome", "Artifact", "CancellationPayload",
           "ChildOutcomeSummary", "CollaborationHandoff", "CollaborationResult", "CompletionReport",
           "DelegationPayload", "HandoffPayload", "Message", "NativeRequest", "OutcomePayload",
           "ParallelDelegation", "WorkerContext", "WorkerContract", "WorkerEscalation",
           "WorkerHandoff")
# public name -> the module that defines it
_HOME: dict[str, str] = {
    "build_engine": "build",
    "Config": "config", "RetryPolicy": "config", "Daemon": "daemon", "Envelope": "documents",
    "Outcome": "documents", "new_native_request": "documents", "ConfigError": "errors",
    "DuplicateHandoff": "errors", "HandlerError": "errors", "HandoffdError": "errors",
    "InvalidDocument": "errors", "NotFound": "errors", "UsageError": "errors",
    "WaitTimeout": "errors", "ErrorCode": "errors", "Engine": "lifecycle",
    "HandlerContext": "specialists",
    "Registry": "specialists", "specialist": "specialists", "State": "states", "Store": "store",
    "Workspace": "workspace", **{name: "models" for name in _MODELS},
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
# loads from ``handoffd`` for compatibility, but lives in its module (``handoffd.errors``,
# ``handoffd.models``, ...).
__all__ = [
    "Config", "Daemon", "Engine", "ErrorCode", "HandlerContext", "HandoffdError", "Outcome",
    "Registry", "State", "Workspace", "build_engine", "new_native_request", "specialist",
]
