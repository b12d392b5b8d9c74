"""handoffd: a durable, file-based handoff queue for multi-agent systems.

The library API::

    from handoffd import Engine, Workspace, specialist, Daemon

    @specialist("@echo")
    def echo(handoff, ctx):
        return {"status": "completed", "output": {"echo": ctx.data}}
"""
from __future__ import annotations

from .config import Config, RetryPolicy
from .daemon import Daemon
from .documents import Envelope, Outcome, new_native_request
from .errors import (ConfigError, DuplicateHandoff, HandlerError, HandoffdError, InvalidDocument,
                     NotFound, UsageError, WaitTimeout)
from .lifecycle import Engine
from .models import (AgentHandoff, AggregatedOutcome, Artifact, CancellationPayload,
                     ChildOutcomeSummary, CollaborationHandoff, CollaborationResult,
                     CompletionReport, DelegationPayload, HandoffPayload, Message, NativeRequest,
                     OutcomePayload, ParallelDelegation, WorkerContext, WorkerContract,
                     WorkerEscalation, WorkerHandoff)
from .specialists import HandlerContext, Registry, specialist
from .states import State
from .store import Store
from .workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "Config", "ConfigError", "Daemon", "DuplicateHandoff", "Engine", "Envelope", "HandlerContext",
    "HandlerError", "HandoffdError", "InvalidDocument", "NotFound", "Outcome", "Registry",
    "RetryPolicy", "State", "Store", "UsageError", "WaitTimeout", "Workspace", "new_native_request",
    "specialist",
    # typed documents of every format (handoffd.models)
    "AgentHandoff", "AggregatedOutcome", "Artifact", "CancellationPayload", "ChildOutcomeSummary",
    "CollaborationHandoff", "CollaborationResult", "CompletionReport", "DelegationPayload",
    "HandoffPayload", "Message", "NativeRequest", "OutcomePayload", "ParallelDelegation",
    "WorkerContext", "WorkerContract", "WorkerEscalation", "WorkerHandoff",
]
