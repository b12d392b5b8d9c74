"""Gates: conditions checked before a pending handoff may be claimed.

A gate looks at a pending document and answers go (None), wait (with a reason shown by
``handoff ls``), or fail (with an error code). The daemon re-checks waiting handoffs whenever
another handoff is filed and at every rescan. Dependencies (``--depends-on``, seed 004's
``dependencies_completed``) are this module's gate (:func:`install`, one of the features
:func:`handoffd.features.build.build_engine` installs); orchestration and contracts add their own.

Long chains and wide fan-ins stay linear: a dependency's wait names the handoffs whose filing can
end it (``Verdict.wait(on=...)``), so the daemon re-checks a waiter only when one of them is
filed; and :class:`Graph` remembers what never changes (a completed handoff stays completed) and
which handoffs are known to lead to no cycle, so a walk stops where an earlier one ended.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection
from datetime import datetime
from typing import Any

from .. import dialects
from ..core.documents import BOOK, Envelope
from ..core.engine import (  # Gate and Verdict are the core's; re-exported
    Engine,
    Gate,
    Verdict,
)
from ..core.errors import ErrorCode, HandoffdError, InvalidDocument, NotFound
from ..core.states import State
from .removal import dependents_guard

# documents one cycle check reads at most. A walk cut short by it marks nothing cycle-free, so
# every later check of a longer chain would read as much again (`handoff ls` of a 1,100-long
# chain read 1,000 documents a row, 8 s); one that ends marks the whole chain at once
MAX_DEPENDENCY_WALK = 20_000
MAX_REMEMBERED = 100_000  # completed / cycle-free ids kept before the memory starts over
ACYCLIC_SECONDS = 300.0  # how long "leads to no cycle" is trusted (ids can be purged and reused)
SHOWN = 4  # dependencies named in a wait's reason
__all__ = ["Gate", "Graph", "Verdict", "dependencies_gate", "install", "check_new_dependencies"]


class Graph:
    """What the gate and the creation check know of the dependency graph, across calls.

    A completed handoff never runs again (only failed ones are retried), so its id is remembered
    and never read again. A handoff whose unfinished dependencies were all walked without finding
    a cycle or a missing document is remembered as cycle-free for :data:`ACYCLIC_SECONDS`: its
    ``depends_on`` cannot change, and the handoffs it leads to can only finish. A parked parent
    also waits for its children (an edge the walk follows); those edges appear when it
    delegates, and a delegation whose child would wait for its own parent is refused then, by a
    walk that trusts no memory (:meth:`path_to`, see :mod:`.delegation`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.completed: set[str] = set()
        self.acyclic: set[str] = set()
        self.acyclic_since: datetime | None = None
        self.lock = threading.Lock()

    def state(self, handoff_id: str) -> tuple[State | None, list[str]]:
        """(state, what it waits for) of a handoff: its ``depends_on``, and for a parent parked
        in pending/ the children it waits for; (None, []) when it is missing or unreadable."""
        if handoff_id in self.completed:
            return State.COMPLETED, []
        try:
            state, doc = self.engine.get(handoff_id)
        except (NotFound, InvalidDocument):
            return None, []
        if state is State.COMPLETED:
            self._remember(self.completed, handoff_id)
            return state, []
        try:
            deps = dialects.detect(doc).envelope(doc).depends_on
        except Exception:  # an unreadable pending document has no known dependencies
            deps = []
        if state is State.PENDING and isinstance(doc.get(BOOK), dict) \
                and isinstance(doc[BOOK].get("waiting_children"), dict):
            deps = deps + [c for c in self._children_waited_for(handoff_id) if c not in deps]
        return state, deps

    def _children_waited_for(self, handoff_id: str) -> list[str]:
        """The children a parked parent waits for, as handoffd's own (sealed) bookkeeping says:
        a ``waiting_children`` block anyone could write into a pending file is not believed."""
        try:
            trusted = self.engine.backend.peek(handoff_id)
        except (HandoffdError, OSError):
            return []
        given = trusted.get(BOOK) if isinstance(trusted, dict) else None
        wait = given.get("waiting_children") if isinstance(given, dict) else None
        children = wait.get("children") if isinstance(wait, dict) else None
        return [c for c in children if isinstance(c, str)] if isinstance(children, list) else []

    def _remember(self, where: set[str], handoff_id: str) -> None:
        with self.lock:
            if len(where) >= MAX_REMEMBERED:
                where.clear()
            where.add(handoff_id)

    def _known_acyclic(self) -> set[str]:
        """The cycle-free ids, forgotten every :data:`ACYCLIC_SECONDS` (or when the clock jumps)."""
        now = self.engine.clock()
        with self.lock:
            age = None if self.acyclic_since is None else (now - self.acyclic_since).total_seconds()
            if age is None or not 0 <= age <= ACYCLIC_SECONDS:
                self.acyclic.clear()
                self.acyclic_since = now
            return self.acyclic

    def find_cycle(self, start: str, deps: list[str], *, stored: bool = True) -> list[str] | None:
        """A path of unfinished handoffs from ``start`` through ``deps`` back to ``start``, or
        None. Completed handoffs end a path (they wait for nothing). Every handoff whose walk
        ended cleanly (no cycle, nothing missing, within the bound) is remembered as cycle-free;
        ``start`` too when it is ``stored`` (at creation it is not yet)."""
        known = self._known_acyclic()
        # a frame: (handoff, dependencies still to look at, [nothing unclean below it so far])
        frames: list[tuple[str, list[str], list[bool]]] = [(start, list(deps), [True])]
        on_path = {start}
        visited: set[str] = set()
        while frames:
            node, todo, ok = frames[-1]
            if not todo:
                frames.pop()
                on_path.discard(node)
                if ok[0] and (stored or node != start):
                    self._remember(known, node)
                elif frames:
                    frames[-1][2][0] = ok[0] and frames[-1][2][0]
                continue
            nxt = todo.pop()
            if nxt == start:
                return [frame[0] for frame in frames] + [start]
            if nxt in known:
                continue
            if nxt in on_path or nxt in visited or len(visited) >= MAX_DEPENDENCY_WALK:
                # another cycle (not through start), a handoff already walked and found not
                # clean, or the walk's bound: nothing above it is known to be cycle-free
                ok[0] = False
                continue
            visited.add(nxt)
            state, next_deps = self.state(nxt)
            if state is None:
                ok[0] = False  # a missing dependency may yet be created, leading anywhere
            elif state is not State.COMPLETED:
                on_path.add(nxt)
                frames.append((nxt, list(next_deps), [True]))
        return None

    def path_to(self, starts: list[str], targets: Collection[str]) -> list[str] | None:
        """A path of unfinished handoffs from one of ``starts`` to one of ``targets`` through
        what each waits for (its dependencies, a parked parent's children), or None; at most
        :data:`MAX_DEPENDENCY_WALK` documents are read. The cycle-free memory is not used: it
        answers another question (no path back to *that* handoff)."""
        came_from: dict[str, str | None] = {start: None for start in starts}
        queue = deque(starts)
        while queue:
            node = queue.popleft()
            if node in targets:
                path = [node]
                while (before := came_from[path[-1]]) is not None:
                    path.append(before)
                return path[::-1]
            if len(came_from) >= MAX_DEPENDENCY_WALK:
                continue  # the bound: what is queued is still compared with the targets
            state, after = self.state(node)
            if state is None or state is State.COMPLETED:
                continue
            for nxt in after:
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        return None

    def gate(self, engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        """The engine's gate: :func:`dependencies_gate` on this graph."""
        return dependencies_gate(self, env)

    def check_submitted(self, engine: "Engine", env: Envelope) -> None:
        """Engine.submit's check: what a new handoff depends on exists and leads nowhere back."""
        if env.depends_on:
            check_new_dependencies(self, env.handoff_id, env.depends_on)


def install(engine: "Engine") -> None:
    """The dependencies feature: hold a handoff back until what it depends on has completed."""
    graph = Graph(engine)
    engine.gates.append(graph.gate)
    engine.submit_checks.append(graph.check_submitted)
    engine.submit_guards.append(dependents_guard)  # no dependency purged under a new dependent


def dependencies_gate(graph: Graph, env: Envelope) -> Verdict | None:
    """Wait until every dependency completed; fail with DEPENDENCY_MISSING when one failed, was
    cancelled, does not exist, or the dependencies form a cycle."""
    if not env.depends_on:
        return None
    waiting: list[tuple[str, State]] = []
    for dep in env.depends_on:
        if dep in graph.completed:
            continue
        state, _ = graph.state(dep)
        if state is None:
            return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, _missing(graph, env.handoff_id, dep))
        if state is State.FAILED:
            return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {env.handoff_id} depends on {dep}, "
                                f"which {_ended(graph, dep)}; retry {dep} first, then this "
                                f"one with `handoff retry --force {env.handoff_id}`")
        if state is not State.COMPLETED:
            waiting.append((dep, state))
    if not waiting:
        return None
    # only a handoff that would wait can be waiting for ever: look for a cycle now
    cycle = graph.find_cycle(env.handoff_id, [dep for dep, _ in waiting])
    if cycle:
        return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {env.handoff_id} depends on itself "
                            f"through {' -> '.join(cycle)}; break the cycle")
    shown = ", ".join(f"{dep} ({state.value})" for dep, state in waiting[:SHOWN])
    more = f" and {len(waiting) - SHOWN} more" if len(waiting) > SHOWN else ""
    return Verdict.wait(f"waiting for dependency {shown}{more}", on=[dep for dep, _ in waiting])


def check_new_dependencies(graph: Graph, handoff_id: str, deps: list[str]) -> None:
    """At creation: every dependency must exist and none may lead back here (InvalidDocument)."""
    for dep in deps:
        if dep == handoff_id:
            raise InvalidDocument(f"handoff {handoff_id} cannot depend on itself",
                                  handoff_id=handoff_id, code=ErrorCode.DEPENDENCY_MISSING)
        if dep not in graph.completed and graph.engine.backend.get(dep) is None:
            raise InvalidDocument(_missing(graph, handoff_id, dep), handoff_id=handoff_id,
                                  code=ErrorCode.DEPENDENCY_MISSING)
    cycle = graph.find_cycle(handoff_id, deps, stored=False)
    if cycle:
        raise InvalidDocument(f"dependency cycle: {' -> '.join(cycle)}", handoff_id=handoff_id,
                              code=ErrorCode.DEPENDENCY_MISSING)


def _missing(graph: Graph, handoff_id: str, dep: str) -> str:
    """Why ``dep``, not found, cannot be depended on: never created, or (the seen-ids record
    knows it) finished and removed by retention ("create it first" misled: it existed)."""
    try:
        seen = graph.engine.backend.seen_contains(dep, graph.engine.clock())
    except (HandoffdError, OSError):  # (the record unreadable: say only what is sure)
        seen = False
    if seen:
        return (f"handoff {handoff_id} depends on {dep}, which existed but was removed by "
                f"retention (archived or purged): `handoff show {dep}` finds an archived one")
    return f"handoff {handoff_id} depends on {dep}, which does not exist; create it first"


def _ended(graph: Graph, handoff_id: str) -> str:
    """How a failed dependency ended, for the message: its status (failed, cancelled...)."""
    try:
        status = graph.engine.get(handoff_id)[1].get("status")
    except (NotFound, InvalidDocument):
        status = None
    return status[:40] if isinstance(status, str) and status else "failed"
