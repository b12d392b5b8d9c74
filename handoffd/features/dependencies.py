"""Gates: conditions checked before a pending handoff may be claimed.

A gate looks at a pending document and answers go (None), wait (with a reason shown by
``handoff ls``), or fail (with an error code). The daemon re-checks waiting handoffs whenever
another handoff is filed and at every rescan. Dependencies (``--depends-on``, seed 004's
``dependencies_completed``) are this module's gate (:func:`install`, one of the features
:func:`handoffd.features.build.build_engine` installs); orchestration and contracts add their own.
"""
from __future__ import annotations

from typing import Any

from .. import dialects
from ..core.documents import Envelope
from ..core.engine import (  # Gate and Verdict are the core's; re-exported
    Engine,
    Gate,
    Verdict,
)
from ..core.errors import ErrorCode, InvalidDocument, NotFound
from ..core.states import State

MAX_DEPENDENCY_WALK = 1000
__all__ = ["Gate", "Verdict", "dependencies_gate", "install", "check_new_dependencies"]


def install(engine: "Engine") -> None:
    """The dependencies feature: hold a handoff back until what it depends on has completed."""
    engine.gates.append(dependencies_gate)
    engine.submit_checks.append(check_submitted)


def check_submitted(engine: "Engine", env: Envelope) -> None:
    """Engine.submit's check: what a new handoff depends on exists and leads nowhere back."""
    if env.depends_on:
        check_new_dependencies(engine, env.handoff_id, env.depends_on)


def dependencies_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """Wait until every dependency completed; fail with DEPENDENCY_MISSING when one failed, was
    cancelled, does not exist, or the dependencies form a cycle."""
    if not env.depends_on:
        return None
    cycle = find_cycle(engine, env.handoff_id, env.depends_on)
    if cycle:
        return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {env.handoff_id} depends on itself "
                            f"through {' -> '.join(cycle)}; break the cycle")
    waiting = []
    for dep in env.depends_on:
        try:
            state, dep_doc = engine.get(dep)
        except (NotFound, InvalidDocument):
            return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {env.handoff_id} depends on {dep}, "
                                "which does not exist; create it first")
        if state is State.FAILED:
            status = dep_doc.get("status", "failed")
            return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {env.handoff_id} depends on {dep}, "
                                f"which {status if status != 'failed' else 'failed'}; retry {dep} first")
        if state is not State.COMPLETED:
            waiting.append(f"{dep} ({state.value})")
    if waiting:
        return Verdict.wait("waiting for dependency " + ", ".join(waiting))
    return None


def dependencies_of(engine: "Engine", handoff_id: str) -> list[str]:
    """The depends_on list of an existing handoff ([] when unknown or unreadable)."""
    try:
        _, doc = engine.get(handoff_id)
        return dialects.detect(doc).envelope(doc).depends_on
    except Exception:  # any unreadable document simply has no known dependencies
        return []


def find_cycle(engine: "Engine", start: str, deps: list[str]) -> list[str] | None:
    """A dependency path leading back to ``start``, or None (bounded walk)."""
    stack = [(dep, [start, dep]) for dep in deps]
    seen: set[str] = set()
    while stack and len(seen) < MAX_DEPENDENCY_WALK:
        node, path = stack.pop()
        if node == start:
            return path
        if node in seen:
            continue
        seen.add(node)
        stack.extend((nxt, path + [nxt]) for nxt in dependencies_of(engine, node))
    return None


def check_new_dependencies(engine: "Engine", handoff_id: str, deps: list[str]) -> None:
    """At creation: every dependency must exist and none may lead back here (InvalidDocument)."""
    for dep in deps:
        if dep == handoff_id:
            raise InvalidDocument(f"handoff {handoff_id} cannot depend on itself",
                                  handoff_id=handoff_id, code=ErrorCode.DEPENDENCY_MISSING)
        if engine.backend.get(dep) is None:
            raise InvalidDocument(f"handoff {handoff_id} depends on {dep}, which does not exist; "
                                  "create it first", handoff_id=handoff_id, code=ErrorCode.DEPENDENCY_MISSING)
    cycle = find_cycle(engine, handoff_id, deps)
    if cycle:
        raise InvalidDocument(f"dependency cycle: {' -> '.join(cycle)}", handoff_id=handoff_id,
                              code=ErrorCode.DEPENDENCY_MISSING)
