"""The lifecycle engine: admit a claimed handoff, run its specialist, file the outcome.

This module holds the Engine's public API and the claim -> run -> file spine
(:meth:`Engine.take`, :meth:`Engine.run`, :meth:`Engine.file`). The steps' details live beside
it, each written against the engine's public members: :mod:`~handoffd.core.admission` (claiming,
the checks before a run, setting aside), :mod:`~handoffd.core.results` (a handler's result as an
Outcome, the schema checks of input and output), :mod:`~handoffd.core.filing` (retry or file,
back-off, what is permanent, the filed answer), :mod:`~handoffd.core.submission` (creating a
handoff) and :mod:`~handoffd.core.jobs` (Job, Peek). Storage comes in through the
:class:`~handoffd.core.storage.Backend` interface (files, memory, PostgreSQL) and the document
formats through :class:`~handoffd.core.formats.Formats`, both given by
:func:`handoffd.features.build.build_engine`; :mod:`handoffd.service.daemon` does the scheduling.

The engine imports no feature: dependencies, contracts, orchestration (delegation, aggregation,
cancellation, artifacts) install themselves through the hooks of :mod:`~handoffd.core.hooks`,
and :func:`handoffd.features.build.build_engine` assembles an engine with them. A bare
``Engine(...)`` runs plain handoffs only.
"""
from __future__ import annotations

import functools
import threading
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any, Callable, ContextManager

from .admission import admit, claim_pending, hand_back_short, set_aside, set_aside_claim
from .bounds import MAX_RETRY_DELAY_SECONDS
from .config import Config, RetryPolicy
from .documents import Envelope, Outcome, next_attempt_at, record
from .errors import (
    ClaimShortage,
    ConfigError,
    ErrorCode,
    HandlerError,
    InvalidDocument,
    UnreadableDocument,
    is_shortage,
    shortage_words,
)
from .filing import (
    MAX_THROTTLE_SECONDS,
    MIN_THROTTLE_SECONDS,
    PERMANENT_CODES,
    file_outcome,
    retry_policy,
    retryable,
)
from .formats import ArtifactSink, Dialect, Formats, id_refusal
from .hooks import Hook, Hooks, Verdict
from .jobs import Job, Peek, out_of_reach, unreadable
from .logs import log
from .native_format import RECOVERY_DETAIL
from .results import (
    ERROR_TYPES,
    JobChecks,
    conclude,
    failed,
    read_result,
    wait_to_check_again,
)
from .specialists import Registry, Specialist
from .starts import check_shortage
from .states import State
from .storage import Backend, Claim, Doc, get_handoff
from .submission import (
    NATIVE_LIFECYCLE_KEYS,
    SENT_KEYS,
    same_request,
    submit,
    without_book,
)
from .suspects import Suspects
from .timeutil import Clock, utc_now
from .validation import SchemaCache, check_document
from .workspace import Workspace

__all__ = [
    "Engine", "Gate", "Job", "Peek", "Verdict", "same_request", "without_book", "SENT_KEYS",
    "NATIVE_LIFECYCLE_KEYS", "PERMANENT_CODES", "ERROR_TYPES", "MAX_RETRY_DELAY_SECONDS",
    "MAX_THROTTLE_SECONDS", "MIN_THROTTLE_SECONDS", "MIN_TIMEOUT_SECONDS",
]

MIN_TIMEOUT_SECONDS = 0.01  # a job admitted just before its deadline still gets a last instant

Gate = Callable[["Engine", Envelope, dict[str, Any]], "Verdict | None"]


def _routable(dialect: Dialect, doc: dict[str, Any], handoff_id: str) -> Envelope:
    """``doc``'s Envelope to route it, pending as ``handoff_id``; InvalidDocument as its claim
    would refuse it. Admission asks about the id first (:func:`~.formats.id_refusal`), so a
    refusal of the envelope is asked again that way (an unsafe id: ID_MISMATCH, where `ls` said
    the envelope's UNSAFE_ID), and a readable envelope whose id is not its file name is refused
    too (`ls` noted nothing, and with no specialist here it was never claimed, so never set
    aside). The usual document, its id its file name, pays one string compare."""
    try:
        env = dialect.envelope(doc)
    except InvalidDocument as exc:
        raise (id_refusal(dialect, doc, handoff_id) or exc) from None
    if env.handoff_id != handoff_id:
        refusal = id_refusal(dialect, doc, handoff_id)
        if refusal is not None:
            raise refusal
    return env


@functools.cache
def _python_runners() -> tuple[ModuleType, ModuleType]:
    """The modules that run a Python handler (:mod:`.isolation`, :mod:`.runner`), loaded by
    whoever runs handlers (not by a command that only builds an engine), once: an import in
    :meth:`Engine.run` itself was a Python call of the import system's at every handoff."""
    from . import isolation, runner
    return isolation, runner


class Engine:
    """One workspace's lifecycle. Thread-safe for concurrent jobs on different handoffs.

    Its extension points are :attr:`hooks` (:class:`~handoffd.core.hooks.Hooks`), each also an
    attribute of its own name: ``engine.gates`` is ``engine.hooks.gates``. Extend it there, not
    by overriding methods: the steps (admission, results, filing) call one another as module
    functions, so methods such as ``retryable``, ``failure`` or ``set_aside`` are front doors
    for callers, and replacing one changes what its callers get, not what the steps do."""

    gates: Hook[list[Gate]] = Hook()
    submit_checks: Hook[list[Callable[[Engine, Envelope], None]]] = Hook()
    submit_guards: Hook[list[Callable[[Engine, Envelope], ContextManager[Any]]]] = Hook()
    on_filed: Hook[list[Callable[[str, State], None]]] = Hook()
    on_rejected: Hook[list[Callable[[Job, str, str], None]]] = Hook()
    resumers: Hook[list[Callable[[Job, datetime], Outcome | None]]] = Hook()
    before_run: Hook[list[Callable[[Job], None]]] = Hook()
    after_run: Hook[list[Callable[[Job, Outcome], Outcome]]] = Hook()
    result_interpreters: Hook[dict[str, Callable[[Job, dict[str, Any], datetime],
                                                 Outcome]]] = Hook()
    filers: Hook[dict[str, Callable[[Claim, Dialect, Specialist | None, Outcome], State]]] = Hook()
    on_sweep: Hook[list[Callable[[Engine], object]]] = Hook()
    start_limits: Hook[list[Callable[[Specialist, datetime], float]]] = Hook()
    daemon_plugins: Hook[list[Callable[[Any], None]]] = Hook()

    def __init__(self, workspace: Workspace, config: Config | None, registry: Registry | None, *,
                 backend: Backend, formats: Formats, clock: Clock = utc_now) -> None:
        self.ws = workspace
        self.config = config or workspace.load_config()
        self.settings = self.config.daemon
        # loaded on first use: scanning entry points and importing handler modules is for the
        # daemon, not for a command that only reads or creates a handoff
        self._registry = registry
        self._registry_lock = threading.Lock()
        self.clock = clock
        self.backend = backend
        # specialists whose attempts run isolated after a crash (shared by the store's processes)
        self.suspects = Suspects(lambda: self.backend.records())
        self.formats = formats
        self.artifact_sink: ArtifactSink | None = None  # the artifacts feature installs one
        self.schemas = SchemaCache(workspace.schemas)
        self.checks = JobChecks(self)
        # the extension points; features add to them (features.build.build_engine installs them)
        self.hooks: Hooks[Engine] = Hooks()

    @property
    def registry(self) -> Registry:
        """The specialists this engine runs (from the config, entry points and decorators)."""
        if self._registry is None:
            with self._registry_lock:
                if self._registry is None:
                    self._registry = Registry.load(self.config)
        return self._registry

    @registry.setter
    def registry(self, registry: Registry) -> None:
        self._registry = registry

    def gate(self, peek: Peek) -> Verdict | None:
        """The first gate verdict that stops ``peek`` from being claimed now (None: go)."""
        if peek.envelope is None or peek.doc is None:
            return None
        for gate in self.hooks.gates:
            verdict = gate(self, peek.envelope, peek.doc)
            if verdict is not None:
                return verdict
        return None

    def reject(self, handoff_id: str, code: str, message: str,
               recovery: tuple[str, ...] = ()) -> State | None:
        """Claim a pending handoff and file it as failed without running it (a gate said fail).
        ``recovery``: the gate's own advice, filed as the answer's ``recovery_actions`` in
        formats that have them (:data:`~.native_format.RECOVERY_DETAIL`); (): the code's."""
        job = self.take(handoff_id)
        if job is None:
            return None
        outcome = self.failure(self.clock(), code, message, retryable=False,
                               details={RECOVERY_DETAIL: list(recovery)} if recovery else None)
        where = self.file(job.claim, job.dialect, job.specialist, outcome)
        if where is State.FAILED:
            for listener in self.hooks.on_rejected:
                listener(job, code, message)
        return where

    # ------------------------------------------------------------ scheduling aids
    def get(self, handoff_id: str) -> tuple[State, Doc]:
        """The current state and a copy of the document of ``handoff_id``; NotFound if none."""
        return get_handoff(self.backend, handoff_id)

    def peek(self, handoff_id: str) -> Peek | None:
        """Read a pending document to route it; None if it is gone. Never raises: whatever stops
        the document from being read or routed (an invalid document, an OS error such as ENXIO on
        a socket or EACCES, a RecursionError inside a reader) gives ``readable=False`` with the
        ``problem``, and the daemon sets it aside (or claims it, when claiming sets it aside).
        An OSError the backend raises itself (it describes a document's own trouble as an
        UnreadableDocument) is the store out of reach: a transient ``problem``, looked at again."""
        try:
            doc = self.backend.peek(handoff_id)
        except UnreadableDocument as exc:
            return Peek(handoff_id, readable=False, problem=exc)
        except OSError as exc:  # e.g. StoreUnavailable: the database restarting, not the document
            return Peek(handoff_id, readable=False, problem=out_of_reach(handoff_id, exc))
        except Exception as exc:  # one bad document must never stop the scheduler or `handoff ls`
            return Peek(handoff_id, readable=False, problem=unreadable(handoff_id, exc))
        if doc is None:
            return None
        try:
            dialect = self.formats.detect(doc)
            dialect.complete(doc, handoff_id, self.clock())
            env = _routable(dialect, doc, handoff_id)
            due_at = next_attempt_at(doc)
        except Exception as exc:  # e.g. InvalidDocument, or RecursionError on an absurd schema
            return Peek(handoff_id, readable=False, problem=unreadable(handoff_id, exc))
        spec = self.specialist_for(env)
        if spec is None:
            # nobody here claims it, so a refusal its claim would make never comes: an answer
            # (NOT_A_REQUEST) would wait in pending/ for ever, listed as waiting for a
            # specialist. Asked only here, off the path of every handoff that runs
            refuse = getattr(dialect, "refuse_unclaimed", None)
            try:
                if refuse is not None:
                    refuse(doc, handoff_id)
            except InvalidDocument as exc:  # claimable: the claim files the refusal
                return Peek(handoff_id, readable=False, problem=unreadable(handoff_id, exc))
        return Peek(handoff_id, spec.agent if spec else env.target, env.priority, due_at, True, env,
                    doc)

    # ------------------------------------------------------------ admission
    def claim(self, handoff_id: str, *, due_only: bool = False) -> tuple[Claim, Dialect] | None:
        """Claim a pending handoff and detect its format. None when there is nothing to claim:
        another process won, or the document was unusable and has been set aside (with a failure
        filed under its name when that is a safe id). Raises DocumentNotReady (NotDue with
        ``due_only``: see :func:`~.admission.claim_pending`)."""
        return claim_pending(self, handoff_id, due_only=due_only)

    def take(self, handoff_id: str, *, arrived: datetime | None = None,
             keep_short: bool = False, due_only: bool = False) -> Job | None:
        """Claim ``handoff_id`` and admit it. None when there is nothing to run (another process
        won, or the document was filed as failed / set aside). Raises DocumentNotReady.
        ``arrived``: when the caller first saw it pending, if earlier than its history says (a
        foreign document's history starts at its claim); hard timeouts count from then.
        A ClaimShortage met admitting it is handed back here, uncounted, unless ``keep_short``:
        then the claim it carries is still held, the caller's to hand back
        (:func:`~.admission.hand_back_short`), as a daemon does to keep it when that write runs
        short too. ``due_only``: a claim to run it now, refused (NotDue, nothing counted nor
        written) when the document's own retry time, as the claim reads it, is still to come:
        what the caller read of it before may predate a back-off another process set since."""
        claimed = self.claim(handoff_id, due_only=due_only)
        if claimed is None:
            return None
        claim, dialect = claimed
        try:
            return admit(self, claim, dialect, self.clock(), arrived)
        except ClaimShortage as short:
            if short.claim is None:  # (admission's carry their claim, or handed it back)
                if not short.handed_back:
                    self.backend.abandon(claim)
            elif not keep_short:
                try:  # (a write that fails gives the claim up: the sweep hands it back)
                    hand_back_short(self, short)
                except BaseException:
                    self.backend.abandon(claim)
                    raise
                finally:
                    short.claim = short.dialect = None  # no longer held
            raise
        except BaseException:
            self.backend.abandon(claim)
            raise

    def start_wait(self, spec: Specialist) -> float:
        """Seconds until ``spec`` may start another handoff (0.0: now, and the start is
        counted against its limits)."""
        now = self.clock()
        return max((limit(spec, now) for limit in self.hooks.start_limits), default=0.0)

    def specialist_for(self, envelope: Envelope) -> Specialist | None:
        """The specialist that runs ``envelope``: its target's, else the first registered of its
        ``fallback_targets``; None when nobody here can."""
        # (the registry once loaded: no property call, twice a handoff)
        registry = self._registry if self._registry is not None else self.registry
        for agent in (envelope.target, *envelope.fallback_targets):
            spec = registry.get(agent)
            if spec is not None:
                return spec
        return None

    def deadline(self, envelope: Envelope, spec: Specialist | None,
                 arrived: datetime) -> datetime | None:
        """When a handoff with a hard timeout must have its answer (None without one)."""
        if not envelope.hard_timeout:
            return None
        return arrived + timedelta(seconds=self.time_limit(envelope, spec))

    def validate(self, doc: dict[str, Any], dialect: Dialect, *, subject: str | None = None,
                 handoff_id: str | None = None) -> None:
        """Check ``doc`` against the schemas of its format (this workspace's schemas/ first):
        InvalidDocument (SCHEMA_VALIDATION_FAILED, every error listed) when it fails."""
        check_document(self.schemas, dialect, doc, subject=subject, handoff_id=handoff_id)

    def submit(self, doc: dict[str, Any] | Any, *, forced: str | None = None,
               prechecked: bool = False, if_absent: bool = False,
               due_at: datetime | None = None) -> str:
        """Create a new handoff from ``doc`` (a dict in any supported format, or a typed model
        from :mod:`handoffd.dialects.models`, anything with ``to_dict()``) and return its id.

        The same checks ``handoff create`` makes: the format is detected (or ``forced``), the
        document validated and routed as admission will, then each of the features'
        :attr:`submit_checks` runs (dependencies: every one exists, no cycle). Raises
        InvalidDocument with its code, or DuplicateHandoff when the id is taken or was used
        recently; nothing is stored unless every check passed. ``if_absent``: when the id is
        taken by the same request (pending, running or finished), return its id instead (an
        orchestrator that restarts re-submits safely); Conflict when a different one holds it.
        ``prechecked``: ``doc`` is what
        :func:`~handoffd.core.native_format.new_native_request` built, whose own checks equal the
        schema's (so `handoff create --to` skips loading a schema validator, ~80 ms).
        ``due_at``: not claimed before then (``handoff create --at/--delay``)."""
        return submit(self, doc, forced=forced, prechecked=prechecked, if_absent=if_absent,
                      due_at=due_at)

    def set_aside_claim(self, claim: Claim, code: str, message: str) -> None:
        """Set aside a claimed document that must never run (the claim ends with it)."""
        set_aside_claim(self, claim, code, message)

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None, stub: bool = True) -> bool:
        """Set aside an unusable document; if its name is a free, safe id, file a failure stub
        under that id too so that `handoff wait` on it ends. False when it was already gone."""
        return set_aside(self, handoff_id, state, code, message, claim=claim, stub=stub)

    # ------------------------------------------------------------ execution
    def time_limit(self, envelope: Envelope, spec: Specialist | None) -> float:
        """Document timeout, else the specialist's, else the format's default, else the daemon
        default."""
        return (envelope.timeout_seconds or (spec.config.timeout_seconds if spec else None)
                or envelope.default_timeout_seconds or self.settings.default_timeout_seconds)

    def timeout_for(self, job: Job) -> float:
        """The job's time limit (:meth:`time_limit`), never past its hard deadline."""
        limit = self.time_limit(job.envelope, job.specialist)
        if job.deadline is not None:
            left = (job.deadline - self.clock()).total_seconds()
            limit = min(limit, max(left, MIN_TIMEOUT_SECONDS))
        return limit

    def run(self, job: Job) -> Outcome:
        """Validate input, run the handler, validate its output; never raises for handler faults
        (TakenOver: a daemon's worker whose attempt the watchdog ended, see :attr:`Job.takeover`)."""
        started = self.clock()
        reached = False
        try:
            for resumer in self.hooks.resumers:  # e.g. a parent whose children are done
                resumed = resumer(job, started)
                if resumed is not None:
                    return resumed  # as it stands: no after_run checks
            self._check_before_start(job)
            for hook in self.hooks.before_run:
                hook(job)
            # only once its handler starts is the claim a start (the event log's `claimed`, its
            # queue wait and run time): a resumed aggregation, a cancel found before the run, an
            # input that fails its schema, a spawn a passing shortage refused ran no handler.
            # The runner says when (after the spawn); what it did not say is said below
            reached = True
            job.context.on_start = functools.partial(self.backend.handler_starts, job.claim,
                                                     started)
            if job.specialist.is_command:
                from .runner import run_command  # loaded by whoever runs handlers
                result = run_command(job.specialist, without_book(job.claim.doc), job.context,
                                     self.timeout_for(job),
                                     max_output_bytes=self.settings.max_output_bytes)
            else:
                isolation, runner = _python_runners()
                if isolation.isolate(job.specialist, job.claim.doc, job.handoff_id,
                                     self.suspects):
                    result = isolation.run_isolated(
                        job.specialist, job.claim.doc, job.context, self.timeout_for(job),
                        max_output_bytes=self.settings.max_output_bytes, suspects=self.suspects)
                else:
                    result = runner.run_python(job.specialist, job.claim.doc, job.context,
                                               self.timeout_for(job), self._takeover(job, started))
            outcome = self._usable_outcome(job, result, started)
        except HandlerError as exc:
            outcome = self._failed(exc, started)
        except InvalidDocument as exc:
            outcome = self.failure(started, exc.code, str(exc), errors=exc.errors)
        except ConfigError as exc:
            outcome = self.failure(started, ErrorCode.PROCESSING_ERROR, f"handoff {job.handoff_id}: {exc}",
                                   retryable=False)
        if reached and job.context.on_start is not None:  # (None: said by the runner)
            self._started_unless_short(job)
        return conclude(job, outcome, started, self.hooks.after_run)

    def _check_before_start(self, job: Job) -> None:
        """The job's input checked, and the schemas its result will be checked against loaded,
        before its handler starts. A passing shortage loading one (descriptors, memory) is a
        start shortage: the attempt is handed back uncounted (an EMFILE reading the specialist's
        input schema once left the claim in in-progress/, charged as a crash by the next
        process; one loading its output schema failed the handler's result for good)."""
        try:
            # the schemas check_input found missing are not looked up again a moment later
            self.checks.load_output_schemas(job, self.checks.check_input(job))
        except (OSError, MemoryError) as exc:
            if not is_shortage(exc):
                raise
            raise check_shortage(job.context, f"{job.specialist.agent}'s handler",
                                 "loading its schemas", exc) from None

    def _started_unless_short(self, job: Job) -> None:
        """The handler ran (or failed to as its own fault), though the runner did not say when
        it started (an isolated run, a command refused before its spawn): say so now, unless a
        passing shortage kept it from starting (handed back: no start)."""
        if job.context.on_start is None:
            return  # (said by the runner, as it started)
        from .starts import not_started
        on_start, job.context.on_start = job.context.on_start, None
        if not_started(job.context) is None:
            on_start()

    def _usable_outcome(self, job: Job, result: dict[str, Any], started: datetime) -> Outcome:
        """:meth:`outcome_from_result`; a result that defeats it in a way no check foresaw fails
        the attempt (an uncaught error here once left the claim in in-progress/ for a lease,
        re-ran the handler at every recovery and filed a misleading "interrupted"). A passing
        shortage checking it is no fault of the result's: the same result is checked again
        after a wait (:func:`~.results.wait_to_check_again`), the attempt not charged for it
        (it once failed the attempt, counted: a completed handler's last allowed attempt was
        filed in failed/), and the handler does not run again. Each check starts from the
        job's warnings as they were before the first (an advisory one the check notes was filed
        once per check that ran short)."""
        rechecks = 0
        given = list(job.warnings)
        while True:
            job.warnings[:] = given  # (in place: whoever holds the list sees the same one)
            try:
                return read_result(self, job, result, started)  # (outcome_from_result's)
            except (HandlerError, InvalidDocument, ConfigError):
                raise
            except Exception as exc:
                if not (isinstance(exc, (OSError, MemoryError)) and is_shortage(exc)):
                    log.debug("handoff %s: its result defeated the checks", job.handoff_id,
                              exc_info=True)
                    return self.failure(started, ErrorCode.PROCESSING_ERROR,
                                        f"handoff {job.handoff_id}: the handler's result cannot "
                                        f"be used ({type(exc).__name__}: {str(exc)[:200]})",
                                        retryable=False)
                words = shortage_words(exc)
            # (waited for outside the except block: a MemoryError's traceback, dropped at its
            # end, holds the frames that ran short)
            if wait_to_check_again(job, "its handler's result could not be checked", words,
                                   rechecks):
                rechecks += 1
                continue
            # still short after every wait: a retryable failure, which the retry policy counts
            # and bounds (handing it back uncounted re-ran a handler that completed up to 30
            # times, its side effects with it, when the result itself exhausts memory being
            # checked)
            return self.failure(started, ErrorCode.PROCESSING_ERROR,
                                f"handoff {job.handoff_id}: the handler's result could not be "
                                f"checked for now: {words}; a failed attempt, retryable",
                                retryable=True)

    def _failed(self, exc: HandlerError, started: datetime) -> Outcome:
        return self.failure(started, exc.code, str(exc), retryable=exc.retryable,
                            details=exc.details)

    def _takeover(self, job: Job, started: datetime) -> Callable[[HandlerError], None] | None:
        """What the watchdog calls, on its own thread, to end ``job``'s overrunning attempt: the
        daemon's ``job.takeover``, given the rest of :meth:`run` with ``error``."""
        finish = job.takeover
        if finish is None:
            return None
        return lambda error: finish(lambda: conclude(job, self._failed(error, started), started,
                                                     self.hooks.after_run))

    def expectation_unmet(self, job: Job, problem: InvalidDocument, key: str) -> None:
        """A request's expectation is not met: raise ``problem`` (``[daemon] expectations =
        "enforce"``, the default), or note it as a warning of the filed result ("advisory"), logged
        once per ``key`` (:meth:`JobChecks.expectation_unmet
        <handoffd.core.results.JobChecks.expectation_unmet>`)."""
        self.checks.expectation_unmet(job, problem, key)

    def outcome_from_result(self, job: Job, result: dict[str, Any], started: datetime) -> Outcome:
        """Turn a protocol result into an Outcome, validating output and artifact paths
        (:func:`results.read_result <handoffd.core.results.read_result>`)."""
        return read_result(self, job, result, started)

    def failure(self, started: datetime, code: str, message: str, *, retryable: bool | None = None,
                errors: list[dict[str, str]] | None = None, details: dict[str, Any] | None = None,
                result: dict[str, Any] | None = None) -> Outcome:
        """A failed Outcome with a seed-001 error block, finished now (:func:`results.failed
        <handoffd.core.results.failed>`)."""
        return failed(started, self.clock(), code, message, retryable=retryable, errors=errors,
                      details=details, result=result)

    # ------------------------------------------------------------ filing
    def policy(self, doc: dict[str, Any], spec: Specialist | None) -> RetryPolicy:
        """Retry policy: the document's, else the specialist's, else the configured default."""
        return retry_policy(doc, spec, self.config.retry)

    def retryable(self, outcome: Outcome) -> bool:
        """Seed 003's error_type: permanent codes, ``retryable: false`` and ``error_type:
        permanent`` are never retried; ``unknown`` (the seed's table has no row for it) is."""
        return retryable(outcome)

    def file(self, claim: Claim, dialect: Dialect, spec: Specialist | None, outcome: Outcome) -> State:
        """Retry or file ``outcome`` for a claimed handoff; returns where it went (IN_PROGRESS:
        nothing was written because the claim was lost). Listeners in ``on_filed`` hear of it."""
        where = file_outcome(self, claim, dialect, spec, outcome)
        if where is State.PENDING and self.hooks.just_filed(claim.id) is None:
            # back in pending/ (a retry, a throttle, a parked handoff): the listeners get the
            # document as requeued, the event that put it there last in its history, unread
            self.hooks.filed(claim.id, where, claim.doc)
        if where is not State.IN_PROGRESS:
            self.hooks.announce(claim.id, where)
        return where

    def filed_document(self, handoff_id: str) -> tuple[State, Doc]:
        """For ``on_filed`` listeners: the answer this thread just filed for ``handoff_id`` (no
        read), else the stored document as :meth:`get` returns it. Treat it as read-only."""
        just = self.hooks.just_filed(handoff_id)
        return just if just is not None else self.get(handoff_id)

    def _file(self, claim: Claim, dialect: Dialect, spec: Specialist | None, outcome: Outcome) -> State:
        """:meth:`file` without telling the listeners (a feature's filer files through it)."""
        return file_outcome(self, claim, dialect, spec, outcome)

    # ------------------------------------------------------------ transitions back to pending
    def requeue(self, claim: Claim, dialect: Dialect, event: str, *, due_at: datetime | None = None,
                count_attempt: bool = False, **detail: Any) -> State:
        """Put a claimed handoff back in pending: the one way back, for retries, hand-backs,
        parked handoffs and answers. Records ``event`` with ``detail``, lets the format mark the
        document pending again and requeues it due at ``due_at`` (None: now, in its place in
        line); ``count_attempt`` False gives the claim's attempt back. Returns PENDING, or
        IN_PROGRESS when the claim was lost (nothing written). Filing (:meth:`file`) tells the
        ``on_filed`` listeners; a bare requeue does not."""
        record(claim.doc, event, self.clock(), **detail)
        dialect.mark_pending(claim.doc)
        if self.backend.requeue(claim, claim.doc, due_at, count_attempt=count_attempt):
            return State.PENDING
        return State.IN_PROGRESS

    def handback(self, claim: Claim, dialect: Dialect, *, reason: str) -> None:
        """Return a claimed handoff to pending without counting an attempt (graceful stop)."""
        self.requeue(claim, dialect, "handed_back", reason=reason)
