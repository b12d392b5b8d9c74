"""The specialist registry: who runs a handoff addressed to a given agent id.

Specialists come from three places, later ones overriding earlier: the ``handoffd.specialists``
entry-point group (name = agent id, value = ``module:function``; DESIGN.md's name, and
``handoffd.core.specialists``, which the docs named for a while, before it), functions decorated with
:func:`specialist`, and the ``[specialists]`` tables of ``handoffd.toml``.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Protocol

from .config import Config, SpecialistConfig, specialist_from_table
from .errors import SHORTAGE_ERRNOS, ConfigError

Handler = Callable[[dict[str, Any], "HandlerContext"], dict[str, Any]]
ENTRY_POINT_GROUP = "handoffd.specialists"  # the interface contract's group
# the group's name in the docs for a while (a rename made by mistake): still read, before the
# contract's, so that an agent id in both is the contract group's
LEGACY_ENTRY_POINT_GROUP = "handoffd.core.specialists"

_DECORATED: dict[str, tuple[Handler, dict[str, Any]]] = {}


def specialist(agent: str, **options: Any) -> Callable[[Handler], Handler]:
    """Register a Python function as the specialist for ``agent``.

    ``options`` are the keys of a ``[specialists."@agent"]`` table (``timeout_seconds``,
    ``concurrency``, ``input_schema``, ``output_schema``, ``retry``, ``isolate``)::

        @specialist("@echo", concurrency=4)
        def echo(handoff, ctx):
            return {"status": "completed", "output": {"echo": ctx.data}}
    """
    def register(func: Handler) -> Handler:
        _DECORATED[agent] = (func, options)
        func.handoffd_agent = agent  # type: ignore[attr-defined]
        func.handoffd_options = options  # type: ignore[attr-defined]
        return func
    return register


class Wakeable(Protocol):
    """What a stopped attempt wakes: a threading.Event, or the watchdog's watch of the call."""

    def set(self) -> None: ...


@dataclass
class HandlerContext:
    """What a handler's attempt carries besides the document: ids, paths, a cancellation flag and
    the typed side channels the engine and its features fill in before the handler runs."""

    handoff_id: str
    attempt: int
    root: Path
    data: Any
    target: str
    deadline_monotonic: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # answers given so far with `handoff answer` (orchestration): {"at", "by", "kind", "answer", ...}
    clarifications: list[Any] = field(default_factory=list)
    # where expected_output.destination resolved to (artifacts): absolute, and workspace-relative
    artifact_path: Path | None = None
    artifact_rel: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment for a command handler
    max_output_bytes: int | None = None  # [daemon] max_output_bytes: a Python result's bound too
    partial: Any = None  # what the handler reported with report_partial()
    handback: bool = False  # the attempt was handed back (shutdown): it does not count
    # called by the runner once the handler is started (its child spawned and its threads up,
    # or just before a Python handler is called): the event log's `claimed` line then, not for
    # an attempt a passing shortage kept from starting (core.engine sets it)
    on_start: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    cancel_reason: str | None = None  # set by stop_handler(): why the attempt is being stopped
    cancel_logged: bool = False
    # per-attempt state a feature keeps between its before_run and after_run hooks, by feature name
    feature_state: dict[str, Any] = field(default_factory=dict)
    # set by the context feature (handoffd.features.build): (root, agent, handoff id) -> the handler's view
    context_factory: Callable[[Path, str, str], Any] | None = None
    _wake: list[Wakeable] = field(default_factory=list, repr=False)
    _context_view: Any = field(default=None, repr=False)

    @property
    def context(self) -> Any:
        """Shared context (``context/``) as this handler's agent: ``get(key)``, ``set(key, value)``,
        ``keys(prefix)``; writes outside the agent's namespaces raise (see features/context.py)."""
        if self._context_view is None:
            if self.context_factory is None:
                raise ConfigError("shared context is not installed on this engine (the "
                                  "'context' feature of handoffd.features.build.build_engine)")
            self._context_view = self.context_factory(self.root, self.target, self.handoff_id)
        return self._context_view

    def report_partial(self, output: Any) -> None:
        """Record partial results; if the handoff is cancelled they are filed with it."""
        self.partial = output

    def check_cancelled(self) -> None:
        """Raise :class:`HandlerCancelled` if the handoff was cancelled or timed out; long handlers
        should call this between steps (Python threads cannot be killed from outside)."""
        if self.cancelled.is_set():
            raise HandlerCancelled(f"handoff {self.handoff_id} was cancelled")

    @property
    def stop_requested(self) -> bool:
        """The attempt was stopped with a reason (:meth:`stop`: cancelled, or handed back), not
        merely flagged as past its time."""
        # (the reason first: :meth:`stop` sets it before the flag, and it is a plain attribute,
        # where the Event's is_set is a call, asked twice a handoff that no one stops)
        return bool(self.cancel_reason) and self.cancelled.is_set()

    def wake_on_cancel(self, event: Wakeable) -> None:
        """Set ``event`` when the attempt is stopped (a waiting runner wakes without polling)."""
        self._wake.append(event)

    def forget_wakers(self) -> None:
        """The attempt is over: nothing waits on its stop any more (:meth:`wake_on_cancel`)."""
        self._wake.clear()

    def stop(self, reason: str) -> None:
        """Ask the attempt to stop now: sets the flag and wakes whoever waits on it."""
        self.cancel_reason = reason
        self.cancelled.set()
        for event in tuple(self._wake):  # (forget_wakers may clear it meanwhile)
            event.set()


class HandlerCancelled(Exception):
    """Raised inside a Python handler by :meth:`HandlerContext.check_cancelled`."""


@dataclass
class Specialist:
    """A registered specialist: its settings and, for Python ones, the callable."""

    config: SpecialistConfig
    func: Handler | None = None
    # its config's agent id, and whether it is a command, kept beside it: asked about ten times
    # a handoff (as properties, a call each); set with every config (:meth:`__setattr__`)
    agent: str = field(init=False, repr=False, compare=False)
    is_command: bool = field(init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "config":  # (a new config, e.g. Registry.with_overrides: its facts too)
            super().__setattr__("agent", value.agent)
            super().__setattr__("is_command", value.command is not None)

    def callable(self) -> Handler:
        """The Python handler, importing ``module:function`` on first use."""
        if self.func is None:
            self.func = import_handler(self.config.handler or "", self.agent)
        return self.func


def handler_reference(spec: Specialist) -> str | None:
    """``module:qualname`` by which another process imports ``spec``'s handler, or None when
    it cannot (``__main__``, a function defined inside another, a registered function that is
    not what its name refers to)."""
    ref = spec.config.handler
    if not ref or ":" not in ref:
        return None
    module_name, _, qualname = ref.partition(":")
    if module_name == "__main__" or "<" in qualname or not qualname:
        return None
    if spec.func is None:  # named in handoffd.toml or an entry point: imported by name anyway
        return ref
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return ref if found is spec.func else None


def import_handler(ref: str, agent: str) -> Handler:
    """Import ``package.module:function``; ConfigError saying what failed, except for a
    shortage of descriptors or memory (OSError EMFILE, ENFILE, ENOMEM; MemoryError), raised
    as it is: that is no configuration problem, and passes."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
        func = getattr(module, attr)
    except MemoryError:
        raise  # a passing shortage: the caller hands the attempt back
    except Exception as exc:
        raise import_failure(exc, agent, ref) from None
    if not callable(func):
        raise ConfigError(f"specialist {agent}: {ref!r} is not callable")
    return func


def import_failure(exc: Exception, agent: str, ref: str) -> Exception:
    """What ``exc``, met importing the handler ``ref`` of ``agent``, is to its caller: the
    OSError of a passing shortage of descriptors or memory (EMFILE, ENFILE, ENOMEM; an extension
    module dlopen could not open for want of them, told by its words alone), to be raised as
    such (the attempt is handed back: a ConfigError failed it for good); else the ConfigError
    saying what failed (any other import-time failure is a configuration problem). The
    daemon's import (:func:`import_handler`) and an isolated handler's process
    (:mod:`.isolated`) both judge by it."""
    if isinstance(exc, OSError) and exc.errno in SHORTAGE_ERRNOS:
        return exc
    short = _shortage_in(exc) if isinstance(exc, ImportError) else None
    if short is not None:
        return OSError(short, os.strerror(short), str(exc))
    return ConfigError(f"specialist {agent}: cannot import handler {ref!r}: {exc}")


def _shortage_in(exc: ImportError) -> int | None:
    """The errno of a shortage of descriptors or memory behind ``exc``: an OSError it came from,
    or dlopen's message ("cannot open shared object file: Too many open files"), which is all an
    extension module's failed load says."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OSError) and cause.errno in SHORTAGE_ERRNOS:
        return cause.errno
    text = str(exc)
    return next((code for code in SHORTAGE_ERRNOS if os.strerror(code) in text), None)


def may_declare_entry_points(group: str) -> bool:
    """False when no distribution on ``sys.path`` declares entry points in ``group``; True when one
    does, or may (something this cannot look into cheaply).

    Looks where :mod:`importlib.metadata` looks by default: the ``*.dist-info`` and ``*.egg-info``
    folders (and a ``.egg`` folder's ``EGG-INFO``) in each directory of ``sys.path``, for an
    ``entry_points.txt`` with a ``[group]`` section. A zip archive on ``sys.path``, a
    ``sys.meta_path`` finder other than the standard one that finds distributions, or a file that
    is not UTF-8 counts as "may": the real scan then decides, and reports, as before.
    """
    # Importing importlib.metadata takes ~45 ms (email, zipfile, csv, ...): most of the start of a
    # one-shot command that loads the registry, and almost no installation declares specialists
    # as entry points. Listing sys.path's folders costs well under a millisecond. Only the
    # question "is there any?" is answered here: parsing and precedence stay importlib.metadata's.
    import importlib.machinery
    for finder in sys.meta_path:
        if finder is not importlib.machinery.PathFinder \
                and getattr(finder, "find_distributions", None) is not None:
            return True
    for entry in sys.path:
        if not isinstance(entry, str):
            return True
        root = entry or "."
        try:
            children = os.listdir(root)
        except OSError:
            if os.path.isfile(root):  # a zip archive: importlib.metadata reads those too
                return True
            continue  # missing, not a folder: nothing there for importlib.metadata either
        is_egg = os.path.basename(root).lower().endswith(".egg")
        for child in children:
            low = child.lower()
            if low.endswith((".dist-info", ".egg-info")) or (is_egg and low == "egg-info"):
                if _declares(os.path.join(root, child, "entry_points.txt"), group):
                    return True
    return False


def _declares(path: str, group: str) -> bool:
    """True when the ``entry_points.txt`` at ``path`` has a ``[group]`` section (whitespace
    allowed inside the brackets) or cannot be decoded; False when it is absent or has none."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:  # no such file (most distributions), or not readable
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    if group not in text:
        return False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]") and line.strip("[]").strip() == group:
            return True
    return False


class Registry:
    """Agent id → :class:`Specialist`."""

    def __init__(self, specialists: dict[str, Specialist] | None = None) -> None:
        self.specialists: dict[str, Specialist] = dict(specialists or {})

    @classmethod
    def load(cls, config: Config, *, use_entry_points: bool = True) -> "Registry":
        """Entry points, then decorated functions, then handoffd.toml tables."""
        registry = cls()
        for group in (LEGACY_ENTRY_POINT_GROUP, ENTRY_POINT_GROUP) if use_entry_points else ():
            if not may_declare_entry_points(group):
                continue
            from importlib.metadata import entry_points  # scanning them is for daemons
            for ep in entry_points(group=group):
                table = {"handler": ep.value}
                registry.add(Specialist(specialist_from_table(ep.name, table, config.retry,
                                                              "entry point")))
        for agent, (func, options) in _DECORATED.items():
            registry.add_function(agent, func, config=config, **options)
        for spec in config.specialists.values():
            registry.add(Specialist(spec))
        return registry

    def add(self, spec: Specialist) -> None:
        """Register (or replace) a specialist."""
        self.specialists[spec.agent] = spec

    def add_function(self, agent: str, func: Handler, *, config: Config | None = None,
                     **options: Any) -> Specialist:
        """Register a Python callable for ``agent`` with table-style ``options``."""
        table = {k: v for k, v in options.items()}
        table["handler"] = f"{func.__module__}:{func.__qualname__}"
        retry_default = config.retry if config else Config().retry
        spec = Specialist(specialist_from_table(agent, table, retry_default, "decorator"), func)
        self.add(spec)
        return spec

    def get(self, agent: str) -> Specialist | None:
        """The specialist for ``agent``, or None."""
        return self.specialists.get(agent)

    def with_overrides(self, agent: str, **changes: Any) -> None:
        """Change settings of a registered specialist (used by tests and benchmarks)."""
        spec = self.specialists[agent]
        spec.config = replace(spec.config, **changes)
