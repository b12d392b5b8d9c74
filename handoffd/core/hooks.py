"""The engine's extension points: what a feature installs into an Engine, and when each is called.

The core imports no feature. Dependencies, contracts, orchestration (delegation, aggregation,
cancellation, artifacts), rates, retention and notifications each add to an engine's
:class:`Hooks` in their ``install(engine)``, and :func:`handoffd.features.build.build_engine`
assembles an engine with them; a bare ``Engine(...)`` has empty hooks and runs plain handoffs
only. Features reach each hook under its own name (``engine.gates`` is ``engine.hooks.gates``,
see :class:`Hook`); the engine's own steps call them through ``engine.hooks``.
"""
from __future__ import annotations

import sys

import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, ContextManager, Generic, Iterable, TypeVar, overload

from .documents import Envelope, Outcome
from .formats import Dialect
from .jobs import Job
from .specialists import Specialist
from .states import State
from .storage import Claim, Doc

# the Engine, as a type parameter: engine.py imports this module, so this one cannot import it
E = TypeVar("E")
T = TypeVar("T")


@dataclass(frozen=True)
class Verdict:
    """A gate's answer: ``wait`` (with reason) or ``fail`` (with code and message)."""

    action: str
    reason: str
    code: str = ""
    # a wait that only the filing of these handoffs can end (a scheduler re-checks it then, and at
    # its rescans, unless a feature's quiet check says the wait ends only when the handoff's own
    # document changes or the feature queues it: a pause); None: any filing may end it
    on: frozenset[str] | None = None
    # handoffs whose filing into failed/ may end the wait too (a later dependency failing fails
    # the waiter at once, where only its first unfinished one's filing re-checked it): a few,
    # in a tuple of interned ids (a scheduler keeps it per waiter for as long as it waits)
    fails_on: tuple[str, ...] = ()
    # a failure's own advice (seed 001's ``recovery_actions``), when the code's usual steps
    # would mislead (a dependency that holds an answer cannot be retried): () for the usual
    recovery: tuple[str, ...] = ()

    @classmethod
    def wait(cls, reason: str, on: Iterable[str] | None = None,
             fails_on: Iterable[str] = ()) -> "Verdict":
        """Hold the handoff back, saying why; ``on``: the handoffs whose filing may end it;
        ``fails_on``: those whose filing into failed/ may end it too."""
        return cls("wait", reason, on=None if on is None else frozenset(on),
                   fails_on=tuple(dict.fromkeys(sys.intern(i) for i in fails_on)))

    @classmethod
    def fail(cls, code: str, reason: str, recovery: Iterable[str] = ()) -> "Verdict":
        """Fail the handoff with ``code``, saying why; ``recovery``: the steps to advise
        instead of the code's usual ones (none: the usual)."""
        return cls("fail", reason, code, recovery=tuple(recovery))


class Hooks(Generic[E]):
    """One engine's hook lists, each in the order features installed into it."""

    def __init__(self) -> None:
        # checked before a claim (features.dependencies, contracts, pause...): the first verdict
        # that is not None holds the handoff back or fails it
        self.gates: list[Callable[[E, Envelope, dict[str, Any]], Verdict | None]] = []
        # checked by Engine.submit before a new handoff is stored (features.dependencies)
        self.submit_checks: list[Callable[[E, Envelope], None]] = []
        # entered around Engine.submit's checks and store, in order (features.dependencies: the
        # workspace's removal lock for a create that names dependencies, see features.removal)
        self.submit_guards: list[Callable[[E, Envelope], ContextManager[Any]]] = []
        self.on_filed: list[Callable[[str, State], None]] = []  # told of every filing
        self.on_rejected: list[Callable[[Job, str, str], None]] = []  # a gate failed a handoff
        # before the handler: the first resumer that returns an Outcome replaces the run
        # (aggregation: a parent whose children are done)
        self.resumers: list[Callable[[Job, datetime], Outcome | None]] = []
        self.before_run: list[Callable[[Job], None]] = []
        self.after_run: list[Callable[[Job, Outcome], Outcome]] = []  # may replace the outcome
        # a handler result whose status is a key here is turned into an Outcome by the feature
        # that owns the status (orchestration: delegated, needs_clarification, blocked)
        self.result_interpreters: dict[str, Callable[[Job, dict[str, Any], datetime],
                                                     Outcome]] = {}
        # an Outcome whose status is a key here is filed by that feature (orchestration parks it)
        self.filers: dict[str, Callable[[Claim, Dialect, Specialist | None, Outcome], State]] = {}
        self.on_sweep: list[Callable[[E], object]] = []  # extra repairs run by each sweep
        # asked before a specialist starts a handoff: seconds to wait (0: go, and the start is
        # counted). features.rates: the specialist's rate limit
        self.start_limits: list[Callable[[Specialist, datetime], float]] = []
        # called with each daemon built on the engine: features register scan hooks, message
        # handlers and the like through the daemon's plugin API (the core knows no daemon)
        self.daemon_plugins: list[Callable[[Any], None]] = []
        self._just_filed = threading.local()  # (id, state, answer) while on_filed listeners run

    def filed(self, handoff_id: str, state: State, answer: Doc) -> None:
        """``answer`` was just filed in ``state`` by this thread: what :meth:`just_filed` gives
        the ``on_filed`` listeners until :meth:`announce` is done."""
        self._just_filed.value = (handoff_id, state, answer)

    def announce(self, handoff_id: str, where: State) -> None:
        """Tell the ``on_filed`` listeners that ``handoff_id`` was filed in ``where``."""
        try:
            for listener in self.on_filed:
                listener(handoff_id, where)
        finally:
            self._just_filed.value = None

    def just_filed(self, handoff_id: str) -> tuple[State, Doc] | None:
        """The state and answer this thread is announcing for ``handoff_id`` (None: none)."""
        just = getattr(self._just_filed, "value", None)
        if just is not None and just[0] == handoff_id:
            return just[1], just[2]
        return None


class Hook(Generic[T]):
    """An Engine attribute that is one of its :class:`Hooks` under the same name, so that
    ``engine.gates.append(gate)`` (what features and the daemon have always written) installs
    into ``engine.hooks.gates``."""

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, engine: None, owner: type | None = None) -> "Hook[T]": ...

    @overload
    def __get__(self, engine: Any, owner: type | None = None) -> T: ...

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine.hooks, self.name)

    def __set__(self, engine: Any, value: T) -> None:
        setattr(engine.hooks, self.name, value)
