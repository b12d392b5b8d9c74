"""Where the features keep what every daemon of a store must share beyond the handoffs: the
shared context and the contract violations log. The store's own when it has one that every host
shares (the PostgreSQL backend's ``shared_context()`` / ``violation_log()``), else the
workspace's files (``context/``, ``handoffs/.meta/violations.jsonl``). The features use the
seams (:class:`~handoffd.core.storage.ContextBackend`, :class:`~handoffd.core.storage.ViolationLog`)
and never a backend's code."""
from __future__ import annotations

from typing import Any, cast

from ..backends.files.violations import LOG_NAME, FileViolationLog
from ..core.storage import ContextBackend, SharedContext, ViolationLog
from ..core.workspace import Workspace


def context_backend(workspace: Workspace, backend: Any = None, *,
                    durable: bool = True) -> ContextBackend:
    """The shared context of ``backend``'s store, else the workspace's ``context/`` folder."""
    shared = getattr(backend, "shared_context", None)
    if callable(shared):
        return cast(ContextBackend, shared())
    from ..backends.files.context import FileContext  # (contracts need the violations log alone)
    return FileContext(workspace.context, durable=durable)


def is_shared(context: ContextBackend) -> bool:
    """True when ``context`` lives outside this workspace (its ``context/`` folder is a mirror)."""
    return isinstance(context, SharedContext)


def violation_log(workspace: Workspace, backend: Any = None) -> ViolationLog:
    """The violations log of ``backend``'s store, else ``handoffs/.meta/violations.jsonl``."""
    shared = getattr(backend, "violation_log", None)
    if callable(shared):
        return cast(ViolationLog, shared())
    return FileViolationLog(workspace.meta / LOG_NAME)
