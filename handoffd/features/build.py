"""Assemble an Engine with its features: the one place that knows which features exist.

The core (:class:`handoffd.core.engine.Engine`) imports no feature; each feature module offers an
``install(engine)`` that adds its gates, run hooks, result interpreters, filers, sweep repairs and
daemon plugins to the engine's hook lists. ``build_engine`` makes an Engine and installs the
features in order; ``features=()`` gives a bare engine that runs plain handoffs only.
"""
from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, cast

from .. import dialects
from ..backends.files import FilesBackend
from ..core.config import Config
from ..core.documents import hostname
from ..core.storage import Backend
from ..core.timeutil import Clock, utc_now
from ..core.workspace import Workspace

if TYPE_CHECKING:  # loaded by build_engine: a command that only reads needs open_backend alone
    from ..core.documents import Envelope
    from ..core.engine import Engine, Job, Verdict
    from ..core.events import EventLog
    from ..core.specialists import Registry, Specialist
    from ..core.submission import Submitter
    from .context import ContextStore
    from .rates import RateLimits

Feature = Callable[["Engine"], object]


def _installer(module: str, function: str = "install",
               needed: Callable[[Engine], bool] | None = None) -> Feature:
    """``module.function`` as a Feature, imported when it is installed (an engine without a
    feature, such as a one-shot command's, never loads its code). ``needed``: whether the
    engine's configuration or store asks for the feature at all; when it does not, the module,
    whose install would add nothing, is not even imported (a daemon's start loads less)."""
    def install(engine: Engine) -> object:
        if needed is not None and not needed(engine):
            return None
        return getattr(importlib.import_module(module, __package__), function)(engine)
    install.__name__ = install.__qualname__ = f"install_{module.rsplit('.', 1)[-1]}"
    return install


def retention_configured(engine: Engine) -> bool:
    """``[retention]`` names an age for completed or failed work (else retention does nothing)."""
    policy = engine.config.retention
    return policy.completed is not None or policy.failed is not None


def store_ingests(engine: Engine) -> bool:
    """The store ingests the files dropped into pending/ (PostgreSQL's: the file bridge)."""
    return hasattr(engine.backend, "ingest")


def install_artifacts(engine: Engine) -> None:
    """Artifacts (seed 002 expected_output): resolve the destination before the handler runs and
    write or check what it produced after; large artifact contents of an answer are kept as files
    under artifacts/ (seed 000's 1 KB rule). Installed after contracts: their checks see only what
    the handler itself wrote."""
    from . import artifacts
    engine.before_run.append(artifacts.check_inputs)
    engine.before_run.append(artifacts.prepare)
    # a missing output artifact fails the handoff unless [daemon] expectations = "advisory"
    # on a store several hosts share, a file artifact names the host whose workspace holds it
    host = hostname() if getattr(engine.backend, "shared", False) else None
    engine.after_run.append(lambda job, outcome: artifacts.collect(
        job, outcome, enforce=engine.settings.expectations == "enforce", host=host))
    engine.artifact_sink = artifacts.text_sink(engine.ws)  # seed 000: large contents by reference


def install_context(engine: Engine) -> None:
    """Shared context: a Python handler's ``ctx.context`` is its agent's view of the store's
    context (``context/``, or the table every host of a PostgreSQL store shares, which each
    daemon then mirrors into its ``context/``: :mod:`handoffd.features.context_mirror`). On the
    files store the context's code is loaded when a handler first asks for ``ctx.context``: a
    daemon whose handlers never do, and an empty batch, never load it."""
    made: list[ContextStore] = []
    lock = threading.Lock()  # (handlers of several workers may ask at once)

    def store() -> ContextStore:
        with lock:
            if not made:
                made.append(context_store(engine))
        return made[0]

    def give_view(job: Job) -> None:
        job.context.context_factory = (
            lambda _root, agent, handoff_id: store().view(agent, handoff_id))

    engine.before_run.append(give_view)
    if callable(getattr(engine.backend, "shared_context", None)):  # (what context_backend asks)
        from .stores import is_shared
        if is_shared(store().backend):  # mirrored into context/ from the daemon's start
            from . import context_mirror
            context_mirror.install(engine, store())


def context_store(engine: Engine) -> ContextStore:
    """The shared context of ``engine``'s store, with the permissions of its configuration."""
    from .context import ContextStore, Permissions
    from .stores import context_backend
    return ContextStore(engine.ws, Permissions.from_config(engine.config),
                        durable=engine.settings.durable,
                        backend=context_backend(engine.ws, engine.backend,
                                                durable=engine.settings.durable))


def install_notify(engine: Engine) -> None:
    """Notifications when work is filed: loaded only for a workspace with ``[[on_filed]]``."""
    if engine.config.on_filed:
        from . import notify
        notify.install(engine)


def install_rates(engine: Engine) -> None:
    """Rate limits (a specialist's ``rate = "30/m"``): the start limit a daemon's scheduler asks
    before each start, and a gate that says why a pending handoff waits for its rate (``handoff
    ls``). Their code (:mod:`.rates`) is loaded when a specialist with a rate is first asked
    about: a listing of other specialists' work never imports it. In an engine a daemon serves,
    the gate stands aside: the scheduler holds rate-limited work itself and looks again when
    the next token is due (a gate's wait is looked at again only at a filing or a rescan)."""
    made: list[RateLimits] = []
    serving: list[bool] = []  # [True] once a daemon is built on this engine
    lock = threading.Lock()

    def limits() -> RateLimits:
        with lock:
            if not made:
                from .rates import RateLimits
                made.append(RateLimits(engine.backend.records()))
        return made[0]

    def rate_limit(spec: Specialist, now: datetime) -> float:
        return limits().limit(spec, now) if spec.config.rate is not None else 0.0

    def rate_gate(gated: Engine, env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        spec = None if serving else gated.specialist_for(env)
        return None if spec is None or spec.config.rate is None else \
            limits().gate(spec, gated.clock())

    def serve(_daemon: object) -> None:
        serving[:] = [True]

    engine.start_limits.append(rate_limit)
    engine.gates.append(rate_gate)
    engine.daemon_plugins.append(serve)


# by name, in installation order (the order of each hook list follows from it)
FEATURES: dict[str, Feature] = {
    "pause": _installer(".pause"),  # handoff pause / resume: its gate goes first
    "dependencies": _installer(".dependencies"),  # depends_on: wait for, or fail on, other handoffs
    "contracts": _installer(".contracts.feature"),  # seed 004: contract gate, reservations, scope, criteria
    "orchestration": _installer(".orchestration"),  # delegation, clarification, aggregation
    "cancellation": _installer(".cancellation"),  # its gate and hooks put themselves first
    "context": install_context,  # ctx.context for Python handlers
    "artifacts": install_artifacts,  # last: artifacts.collect must run after every other check
    "notify": install_notify,  # [[on_filed]]: command / webhook notices of filed handoffs
    # [retention]: purge / archive old finished work
    "retention": _installer(".retention", needed=retention_configured),
    "rates": install_rates,  # specialists' rate = "30/m": a shared token bucket each
    # a PostgreSQL store: files dropped into this workspace's pending/ in, their results out
    "filebridge": _installer(".filebridge", needed=store_ingests),
}
DEFAULT_FEATURES: tuple[Feature, ...] = tuple(FEATURES.values())
# the features with gates (Engine.gate), in FEATURES' order, each by what installs its gates:
# what `handoff ls` and `show` install to say why a pending handoff waits, without loading the
# rest. The gates are the very ones the whole feature installs, in the same order; where the
# feature is much more than its gates, they are installed alone (orchestration's three gates,
# without its aggregation and the making of children; cancellation's gate, without the family
# walk). The others' install is small, or is mostly their gate.
GATES: dict[str, Feature] = {
    "pause": FEATURES["pause"],
    "dependencies": FEATURES["dependencies"],
    "contracts": FEATURES["contracts"],
    "orchestration": _installer(".parked_gates"),
    "cancellation": _installer(".cancel_requests", "install_gate"),
    "rates": FEATURES["rates"],
}
GATE_FEATURES = tuple(GATES)


def origin_of(workspace: Workspace) -> str:
    """How a shared store names this workspace (host and path): the files dropped into its
    pending/ are ingested under it, and their terminal documents come back to it."""
    return f"{hostname()}:{workspace.root}"


def open_backend(workspace: Workspace, config: Config, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 store: str | None = None, workers: int | None = None) -> Backend:
    """The store for ``workspace``: the PostgreSQL database that ``store`` (``--store``),
    ``$HANDOFFD_STORE`` or ``[store] url`` names, else the files backend (its handoffs/
    folders). Either routes documents of every format (``dialects.describe``). ``workers``:
    the daemon's worker threads (the connection pool is sized for them)."""
    settings = config.daemon
    url = config.store_url(store)
    if url is not None:  # psycopg is imported only here: a files workspace never loads it
        from ..backends.postgres import PostgresBackend
        from ..core.logs import prefix_lines
        prefix_lines()  # (a command's: its store's lines as its own, "handoff: ...")
        return PostgresBackend(url, describe=dialects.describe,
                               seen_ttl_seconds=settings.seen_ttl_seconds,
                               pool_size=max(config.store.pool_size,
                                             (workers or settings.workers) + 2),
                               reconnect_seconds=config.store.reconnect_seconds,
                               connect_timeout=config.store.connect_timeout_seconds,
                               origin=origin_of(workspace), monotonic=monotonic,
                               # a dead claimer's session: recovered after this long
                               owner_grace_seconds=settings.claim_grace_seconds,
                               max_document_bytes=settings.max_document_bytes,
                               max_output_bytes=settings.max_output_bytes)
    return FilesBackend.open(workspace, describe=dialects.describe, monotonic=monotonic,
                             ensure=False, claim_grace_seconds=settings.claim_grace_seconds,
                             sweep_seconds=settings.sweep_seconds,
                             durable=settings.durable,
                             max_document_bytes=settings.max_document_bytes,
                             max_output_bytes=settings.max_output_bytes,
                             settle_seconds=settings.settle_seconds,
                             seen_ttl_seconds=settings.seen_ttl_seconds)


def open_event_log(workspace: Workspace, config: Config, backend: Backend | None = None) -> EventLog:
    """The event log: the store's own when it has one that every host shares (PostgreSQL's
    ``handoffd.event_log``), else the workspace's ``handoffs/.meta/events.jsonl`` as ``config``
    sizes it."""
    shared = getattr(backend, "event_log", None)
    if callable(shared):
        return cast("EventLog", shared())
    from ..backends.files.events import FileEventLog
    return FileEventLog(workspace, max_bytes=config.daemon.events_max_bytes,
                        keep=config.daemon.events_keep)


def open_recorded(workspace: Workspace, config: Config, *, backend: Backend | None = None,
                  events: EventLog | None = None, clock: Clock = utc_now,
                  monotonic: Callable[[], float] = time.monotonic,
                  store: str | None = None) -> Backend:
    """The store (``backend``, default :func:`open_backend`) logging each transition to
    ``events`` (default :func:`open_event_log`, unless ``[daemon] events = false``)."""
    from ..core.events import RecordingBackend
    if backend is None:
        backend = open_backend(workspace, config, monotonic=monotonic, store=store)
    if events is None and config.daemon.events:
        events = open_event_log(workspace, config, backend)
    if events is not None:
        backend = cast(Backend, RecordingBackend(backend, events, dialects.describe, clock))
    return backend


def open_submitter(workspace: Workspace, *, store: str | None = None) -> Submitter:
    """A :class:`~handoffd.core.submission.Submitter` over ``workspace``'s store: what
    ``handoff create --to`` without ``--depends-on`` needs, without an Engine."""
    from ..core.submission import Submitter
    backend = open_recorded(workspace, workspace.load_config(), store=store)
    submitter = Submitter(workspace, backend, dialects, utc_now)
    submitter.submit_guards.append(archived_request_guard(workspace, backend))
    return submitter


def archived_request_guard(workspace: Workspace, backend: Backend
                           ) -> Callable[[object, Envelope], ContextManager[None]]:
    """A submit guard that settles ``--if-absent`` where the store refuses the id but holds
    no document to compare with (:class:`~handoffd.core.submission.RequestGone`): against the
    newest copy retention archived in ``workspace``, as ``handoff show`` finds it. The same
    request: no error (its id is the answer); a different one: Conflict (exit 5); none
    archived (or the archive unreadable now): RequestGone stands. The archive's code is
    imported only then (a plain create never loads it)."""
    from ..core.errors import Conflict
    from ..core.submission import RequestGone, same_request

    @contextmanager
    def guard(_submitting: object, envelope: Envelope) -> Iterator[None]:
        try:
            yield
        except RequestGone as gone:
            from .archive import find_archived_document
            try:
                found = find_archived_document(workspace, backend, envelope.handoff_id)
            except OSError:  # (an archive that cannot be read now: as if there were none)
                found = None
            if found is None:
                raise
            if not same_request(found[1], gone.doc, gone.dialect):
                raise Conflict(f"handoff {envelope.handoff_id} was archived by retention "
                               f"({found[0].value}) with a different request; `handoff show` "
                               "it, or choose another id", handoff_id=envelope.handoff_id
                               ) from None
            # (the same request: the exception ends here, and submit answers the id)

    return guard


def build_engine(workspace: Workspace, config: Config | None = None,
                 registry: Registry | None = None, *, clock: Clock = utc_now,
                 monotonic: Callable[[], float] = time.monotonic,
                 backend: Backend | None = None, store: str | None = None,
                 features: Iterable[Feature | str] = DEFAULT_FEATURES,
                 events: EventLog | None = None) -> Engine:
    """An Engine for ``workspace`` with ``features`` installed (callables, or names from
    :data:`FEATURES`). ``backend``: the store (default: :func:`open_backend`); ``monotonic``
    judges how long another process's lease went unrenewed (a clock that never steps).
    ``events``: where every transition is logged (default: :func:`open_event_log`, unless
    ``[daemon] events = false``); ``store``: a store URL that beats the configuration's
    (``--store``)."""
    from ..core.engine import Engine
    config = config or workspace.load_config()
    backend = open_recorded(workspace, config, backend=backend, events=events, clock=clock,
                            monotonic=monotonic, store=store)
    engine = Engine(workspace, config, registry, backend=backend, formats=dialects, clock=clock)
    # whatever its features: `--if-absent` compares with what retention archived
    engine.submit_guards.append(archived_request_guard(workspace, backend))
    # formats review results before any feature's checks (seed 002: reported artifacts exist)
    engine.after_run.append(dialects.review_outcome)
    install_features(engine, features)
    return engine


def install_features(engine: Engine, features: Iterable[Feature | str] = DEFAULT_FEATURES) -> None:
    """Install ``features`` (callables, or names from :data:`FEATURES`) on ``engine``, in order:
    also later, on an engine built with ``features=()`` that turns out to need them."""
    for feature in features:
        install = FEATURES[feature] if isinstance(feature, str) else feature
        install(engine)


def install_gates(engine: Engine) -> None:
    """Install the features' gates alone (:data:`GATES`) on ``engine`` (one built with
    ``features=()``): enough for :meth:`~handoffd.core.engine.Engine.gate` to say why a pending
    handoff waits, as an engine with every feature says it. Not for an engine that runs work."""
    install_features(engine, GATES.values())


def event_log_of(engine: Engine) -> EventLog:
    """The event log ``engine`` writes to (readers: stats, metrics, top, ls --watch)."""
    logged = getattr(engine.backend, "events", None)
    return cast("EventLog", logged) if logged is not None else open_event_log(
        engine.ws, engine.config, engine.backend)


__all__ = ["DEFAULT_FEATURES", "FEATURES", "GATES", "GATE_FEATURES", "Feature", "build_engine",
           "install_features", "install_gates",
           "install_artifacts",
           "install_context", "install_rates", "open_backend", "open_event_log", "event_log_of",
           "open_recorded", "open_submitter",
           "origin_of"]
