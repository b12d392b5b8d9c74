"""The lifecycle engine: admit a claimed handoff, run its specialist, file the outcome.

This is where policy lives (retry or fail, what is permanent, what is set aside); storage comes
in through the :class:`~handoffd.core.storage.Backend` interface (files, memory, PostgreSQL) and
the document formats through :class:`~handoffd.core.formats.Formats`, both given by
:func:`handoffd.features.build.build_engine`; :mod:`handoffd.service.daemon` does the scheduling.

The engine imports no feature: dependencies, contracts, orchestration (delegation, aggregation,
cancellation, artifacts) install themselves through the hook lists below, and
:func:`handoffd.features.build.build_engine` assembles an engine with them. A bare ``Engine(...)`` runs
plain handoffs only.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable

from .config import Config, RetryPolicy
from .documents import (
    BOOK,
    Envelope,
    Outcome,
    book,
    book_int,
    check_id,
    first_seen,
    next_attempt_at,
    record,
    throttles_in_a_row,
)
from .errors import (
    ConfigError,
    Conflict,
    DuplicateHandoff,
    ErrorCode,
    HandlerError,
    InvalidDocument,
    NotFound,
    UnreadableDocument,
)
from .formats import ArtifactSink, Dialect, FiledState, Formats
from .logs import log
from .specialists import HandlerContext, Registry, Specialist
from .states import State, Status
from .storage import Backend, Claim, Doc
from .timeutil import Clock, iso, utc_now
from .validation import SchemaCache, check_document
from .workspace import Workspace

MAX_RETRY_DELAY_SECONDS = 7 * 24 * 3600.0
MAX_THROTTLE_SECONDS = 3600.0  # a throttled handoff is looked at again within the hour
# ... and not sooner than this, doubled for each throttle in a row: a specialist answering
# `throttled` with no delay (or a negative one) would otherwise be polled in a hot loop
MIN_THROTTLE_SECONDS = 0.1
MIN_TIMEOUT_SECONDS = 0.01  # a job admitted just before its deadline still gets a last instant
# seed 003's CollaborationResult error_type, which a specialist's error block may carry
ERROR_TYPES = ("retryable", "permanent", "unknown")
PERMANENT_CODES = frozenset({
    ErrorCode.SCHEMA_VALIDATION_FAILED, ErrorCode.VALIDATION_FAILED, ErrorCode.CONTRACT_VIOLATION,
    ErrorCode.CANCELLED, ErrorCode.DEPENDENCY_MISSING, ErrorCode.INVALID_DOCUMENT, ErrorCode.UNSAFE_ID,
    ErrorCode.UNKNOWN_VERSION, ErrorCode.NEEDS_CLARIFICATION, ErrorCode.BLOCKED,
    ErrorCode.NOT_A_REQUEST, ErrorCode.EXPIRED,
})


@dataclass(frozen=True)
class Verdict:
    """A gate's answer: ``wait`` (with reason) or ``fail`` (with code and message)."""

    action: str
    reason: str
    code: str = ""
    # a wait that only the filing of these handoffs can end (a scheduler re-checks it then, and at
    # its rescans); None: any filing may end it
    on: frozenset[str] | None = None

    @classmethod
    def wait(cls, reason: str, on: Iterable[str] | None = None) -> "Verdict":
        """Hold the handoff back, saying why; ``on``: the handoffs whose filing may end it."""
        return cls("wait", reason, on=None if on is None else frozenset(on))

    @classmethod
    def fail(cls, code: str, reason: str) -> "Verdict":
        return cls("fail", reason, code)


Gate = Callable[["Engine", Envelope, dict[str, Any]], "Verdict | None"]


@dataclass
class Job:
    """A claimed, admitted handoff ready to run."""

    claim: Claim
    dialect: Dialect
    envelope: Envelope
    specialist: Specialist
    context: HandlerContext
    started_at: datetime = field(default_factory=utc_now)
    deadline: datetime | None = None  # when a hard timeout (Envelope.hard_timeout) runs out
    warnings: list[str] = field(default_factory=list)  # unmet expectations, when advisory
    # set when the attempt is being filed or handed back: a lease renewal that fails from then
    # on met the filing (the claim is finished), not another process's takeover
    ending: bool = False
    # when its lease was last extended (time.monotonic(): the claim, then each renewal's start),
    # and whether a daemon stopped its handler for a lease it could not keep (service.leases)
    renewed_at: float = field(default_factory=time.monotonic)
    fenced: bool = False
    # set by a daemon's worker: how an attempt whose Python handler overran (or was cancelled)
    # is finished by another thread while the handler still runs (core.watchdog). It is given
    # the rest of run() as a function returning the outcome to file. Unset, the handler runs in
    # a thread of its own and run() waits for it
    takeover: Callable[[Callable[[], Outcome]], None] | None = None

    @property
    def handoff_id(self) -> str:
        return self.claim.id


@dataclass
class Peek:
    """What the scheduler learns from a pending document without claiming it."""

    handoff_id: str
    target: str | None = None
    priority: int = 2
    due_at: datetime | None = None
    readable: bool = True
    envelope: Envelope | None = None
    doc: dict[str, Any] | None = None
    problem: UnreadableDocument | None = None  # why it is not readable


class Engine:
    """One workspace's lifecycle. Thread-safe for concurrent jobs on different handoffs."""

    def __init__(self, workspace: Workspace, config: Config | None, registry: Registry | None, *,
                 backend: Backend, formats: Formats, clock: Clock = utc_now) -> None:
        self.ws = workspace
        self.config = config or workspace.load_config()
        self.settings = self.config.daemon
        # loaded on first use: scanning entry points and importing handler modules is for the
        # daemon, not for a command that only reads or creates a handoff
        self._registry = registry
        self._registry_lock = threading.Lock()
        self._warned: set[str] = set()  # advisory problems already logged (expectation_unmet)
        self.clock = clock
        self.backend = backend
        self.formats = formats
        self.artifact_sink: ArtifactSink | None = None  # the artifacts feature installs one
        self.schemas = SchemaCache(workspace.schemas)
        # extension points; features add to them (handoffd.features.build.build_engine installs them)
        self.gates: list[Gate] = []  # checked before a claim (features.dependencies, contracts...)
        # checked by submit() before a new handoff is stored (features.dependencies)
        self.submit_checks: list[Callable[[Engine, Envelope], None]] = []
        self.on_filed: list[Callable[[str, State], None]] = []  # told of every filing
        self._just_filed = threading.local()  # (id, state, answer) while on_filed listeners run
        self.on_rejected: list[Callable[[Job, str, str], None]] = []  # a gate failed a handoff
        # before the handler: the first resumer that returns an Outcome replaces the run
        # (aggregation: a parent whose children are done)
        self.resumers: list[Callable[[Job, datetime], Outcome | None]] = []
        self.before_run: list[Callable[[Job], None]] = []
        self.after_run: list[Callable[[Job, Outcome], Outcome]] = []
        # a handler result whose status is a key here is turned into an Outcome by the feature
        # that owns the status (orchestration: delegated, needs_clarification, blocked)
        self.result_interpreters: dict[str, Callable[[Job, dict[str, Any], datetime], Outcome]] = {}
        # an Outcome whose status is a key here is filed by that feature (orchestration parks it)
        self.filers: dict[str, Callable[[Claim, Dialect, Specialist | None, Outcome], State]] = {}
        self.on_sweep: list[Callable[[Engine], object]] = []  # extra repairs run by each sweep
        # asked before a specialist starts a handoff: seconds to wait (0: go, and the start is
        # counted). features.rates: the specialist's rate limit
        self.start_limits: list[Callable[[Specialist, datetime], float]] = []
        # called with each daemon built on this engine: features register scan hooks, message
        # handlers and the like through the daemon's plugin API (the core knows no daemon)
        self.daemon_plugins: list[Callable[[Any], None]] = []

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
        for gate in self.gates:
            verdict = gate(self, peek.envelope, peek.doc)
            if verdict is not None:
                return verdict
        return None

    def reject(self, handoff_id: str, code: str, message: str) -> State | None:
        """Claim a pending handoff and file it as failed without running it (a gate said fail)."""
        job = self.take(handoff_id)
        if job is None:
            return None
        outcome = self.failure(self.clock(), code, message, retryable=False)
        where = self.file(job.claim, job.dialect, job.specialist, outcome)
        if where is State.FAILED:
            for listener in self.on_rejected:
                listener(job, code, message)
        return where

    # ------------------------------------------------------------ scheduling aids
    def get(self, handoff_id: str) -> tuple[State, Doc]:
        """The current state and a copy of the document of ``handoff_id``; NotFound if none."""
        check_id(handoff_id)
        found = self.backend.get(handoff_id)
        if found is None:
            raise NotFound(f"no handoff {handoff_id}; `handoff ls` lists them",
                           handoff_id=handoff_id)
        return found

    def peek(self, handoff_id: str) -> Peek | None:
        """Read a pending document to route it; None if it is gone. Never raises: whatever stops
        the document from being read or routed (an invalid document, an OS error such as ENXIO on
        a socket or EACCES, a RecursionError inside a reader) gives ``readable=False`` with the
        ``problem``, and the daemon sets it aside (or claims it, when claiming sets it aside)."""
        try:
            doc = self.backend.peek(handoff_id)
        except UnreadableDocument as exc:
            return Peek(handoff_id, readable=False, problem=exc)
        except Exception as exc:  # one bad document must never stop the scheduler or `handoff ls`
            return Peek(handoff_id, readable=False, problem=_problem(handoff_id, exc))
        if doc is None:
            return None
        try:
            dialect = self.formats.detect(doc)
            dialect.complete(doc, handoff_id, self.clock())
            env = dialect.envelope(doc)
            due_at = next_attempt_at(doc)
        except Exception as exc:  # e.g. InvalidDocument, or RecursionError on an absurd schema
            return Peek(handoff_id, readable=False, problem=_problem(handoff_id, exc))
        spec = self.specialist_for(env)
        return Peek(handoff_id, spec.agent if spec else env.target, env.priority, due_at, True, env,
                    doc)

    # ------------------------------------------------------------ admission
    def claim(self, handoff_id: str) -> tuple[Claim, Dialect] | None:
        """Claim a pending handoff and detect its format. None when there is nothing to claim:
        another process won, or the document was unusable and has been set aside (with a failure
        filed under its name when that is a safe id). Raises DocumentNotReady."""
        now = self.clock()
        found: list[Dialect] = []
        try:  # a name that is no safe id (one not even UTF-8) is set aside before any claim
            check_id(handoff_id)
        except InvalidDocument as exc:
            self.set_aside(handoff_id, State.PENDING, ErrorCode.UNSAFE_ID,
                           f"file pending/{handoff_id}.json: {exc}", stub=False)
            return None

        def on_claim(doc: dict[str, Any]) -> None:
            dialect = self.formats.detect(doc)
            found.append(dialect)
            book(doc)["dialect"] = dialect.name
            dialect.complete(doc, handoff_id, now)
            dialect.mark_claimed(doc, now)

        try:
            claim = self.backend.claim(handoff_id, now, self.settings.lease_seconds,
                                       prepare=on_claim)
        except DuplicateHandoff as exc:  # an in-progress copy exists: never run a second one
            self.set_aside(handoff_id, State.PENDING, ErrorCode.DUPLICATE_HANDOFF_ID, str(exc),
                           stub=False)
            return None
        except (InvalidDocument, UnreadableDocument) as exc:  # claimed, then unreadable
            if not self.set_aside(handoff_id, State.IN_PROGRESS, exc.code, str(exc)):
                self.set_aside(handoff_id, State.PENDING, exc.code, str(exc))
            return None
        return None if claim is None else (claim, found[0])

    def take(self, handoff_id: str, *, arrived: datetime | None = None) -> Job | None:
        """Claim ``handoff_id`` and admit it. None when there is nothing to run (another process
        won, or the document was filed as failed / set aside). Raises DocumentNotReady.
        ``arrived``: when the caller first saw it pending, if earlier than its history says (a
        foreign document's history starts at its claim); hard timeouts count from then."""
        claimed = self.claim(handoff_id)
        if claimed is None:
            return None
        claim, dialect = claimed
        try:
            return self._admit(claim, dialect, self.clock(), arrived)
        except BaseException:
            self.backend.abandon(claim)
            raise

    def _admit(self, claim: Claim, dialect: Dialect, now: datetime,
               arrived: datetime | None = None) -> Job | None:
        doc, handoff_id = claim.doc, claim.id  # (its name was checked before the claim: claim())
        if claim.raw:  # a document from a foreign producer
            if self.backend.seen_contains(handoff_id, now):
                self.set_aside_claim(claim, ErrorCode.DUPLICATE_HANDOFF_ID,
                                     f"handoff id {handoff_id} was already used recently; "
                                     "a second document never re-runs the first")
                return None
            self.backend.seen_add(handoff_id, now)
        try:
            doc_id = dialect.id_of(doc)
            if doc_id != handoff_id:
                raise InvalidDocument(
                    f"file pending/{handoff_id}.json carries handoff id {str(doc_id)[:80]!r}; the "
                    "file name must be the id", handoff_id=handoff_id, code=ErrorCode.ID_MISMATCH)
            self.validate(doc, dialect, handoff_id=handoff_id, subject=f"handoff {handoff_id} is not a "
                          f"valid {dialect.name} document")
            envelope = dialect.envelope(doc)
        except InvalidDocument as exc:
            if exc.code in (ErrorCode.ID_MISMATCH, ErrorCode.UNSAFE_ID):
                self.set_aside_claim(claim, exc.code, str(exc))
            else:
                self.file(claim, dialect, None, self.failure(now, exc.code, str(exc), errors=exc.errors))
            return None
        except (RecursionError, MemoryError, ValueError, TypeError, ArithmeticError) as exc:
            # a document that defeats a reader (absurd nesting or sizes in an inline schema...)
            # is a bad document, filed with a code; it must never stay claimed for recovery
            log.warning("handoff %s: unreadable document: %s: %s", handoff_id,
                        type(exc).__name__, str(exc)[:200])
            self.file(claim, dialect, None, self.failure(
                now, ErrorCode.INVALID_DOCUMENT, f"handoff {handoff_id} cannot be read as a "
                f"{dialect.name} document: {type(exc).__name__}: {str(exc)[:200]}", retryable=False))
            return None
        spec = self.specialist_for(envelope)
        if envelope.expires_at is not None and now >= envelope.expires_at:
            self.file(claim, dialect, spec, self.failure(
                now, ErrorCode.EXPIRED, f"handoff {handoff_id} was not started before it expired "
                f"at {iso(envelope.expires_at)}", retryable=False))
            return None
        deadline = self.deadline(envelope, spec, min(filter(None, (first_seen(doc), arrived)),
                                                     default=now))
        if deadline is not None and now >= deadline:
            self.file(claim, dialect, spec, self.failure(
                now, ErrorCode.TIMEOUT, f"handoff {handoff_id} was not started before its "
                f"deadline {iso(deadline)} (a hard timeout counts from its arrival)",
                retryable=False))
            return None
        if spec is None:
            self.handback(claim, dialect, reason=f"no specialist registered for {envelope.target}")
            return None
        ctx = HandlerContext(handoff_id=handoff_id, attempt=claim.attempt, root=self.ws.root,
                             data=envelope.data, target=envelope.target,
                             max_output_bytes=self.settings.max_output_bytes)
        return Job(claim, dialect, envelope, spec, ctx, started_at=now, deadline=deadline)

    def start_wait(self, spec: Specialist) -> float:
        """Seconds until ``spec`` may start another handoff (0.0: now, and the start is
        counted against its limits)."""
        now = self.clock()
        return max((limit(spec, now) for limit in self.start_limits), default=0.0)

    def specialist_for(self, envelope: Envelope) -> Specialist | None:
        """The specialist that runs ``envelope``: its target's, else the first registered of its
        ``fallback_targets``; None when nobody here can."""
        for agent in (envelope.target, *envelope.fallback_targets):
            spec = self.registry.get(agent)
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
        :func:`~handoffd.core.documents.new_native_request` built, whose own checks equal the
        schema's (so `handoff create --to` skips loading a schema validator, ~80 ms).
        ``due_at``: not claimed before then (``handoff create --at/--delay``)."""
        if not isinstance(doc, dict) and callable(getattr(doc, "to_dict", None)):
            doc = doc.to_dict()
        if not isinstance(doc, dict):
            raise InvalidDocument(f"a handoff is a JSON object, not {type(doc).__name__}")
        dialect = self.formats.detect(doc, forced)
        dialect.complete(doc, None, self.clock())
        if not (prechecked and dialect.name == "native"):
            self.validate(doc, dialect)
        envelope = dialect.envelope(doc)
        if if_absent and self._already_submitted(doc, dialect, envelope.handoff_id):
            return envelope.handoff_id
        for check in self.submit_checks:
            check(self, envelope)
        try:
            self.backend.create(doc, envelope.handoff_id, self.clock(), due_at=due_at)
        except DuplicateHandoff:
            if if_absent and self._already_submitted(doc, dialect, envelope.handoff_id):
                return envelope.handoff_id  # the same request won a race with this one
            if if_absent:
                raise Conflict(f"handoff id {envelope.handoff_id} was used recently and its "
                               "request is gone, so it cannot be compared; choose another id",
                               handoff_id=envelope.handoff_id) from None
            raise
        return envelope.handoff_id

    def _already_submitted(self, doc: dict[str, Any], dialect: Dialect, handoff_id: str) -> bool:
        """True when ``handoff_id`` holds the same request as ``doc``; Conflict when it holds a
        different one; False when nothing holds it."""
        found = self.backend.get(handoff_id)
        if found is None:
            return False
        if same_request(found[1], doc, dialect.name):
            return True
        raise Conflict(f"handoff {handoff_id} already exists ({found[0].value}) with a different "
                       "request; `handoff show` it, or choose another id", handoff_id=handoff_id)

    def set_aside_claim(self, claim: Claim, code: str, message: str) -> None:
        """Set aside a claimed document that must never run (the claim ends with it)."""
        self.set_aside(claim.id, State.IN_PROGRESS, code, message, claim=claim,
                       stub=code != ErrorCode.DUPLICATE_HANDOFF_ID)

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None, stub: bool = True) -> bool:
        """Set aside an unusable document; if its name is a free, safe id, file a failure stub
        under that id too so that `handoff wait` on it ends. False when it was already gone."""
        if not self.backend.set_aside(handoff_id, state, code, message, claim=claim):
            return False
        log.warning("set aside %s/%s.json: %s: %s", state.value, handoff_id, code, message)
        if not stub:
            return True
        try:
            check_id(handoff_id)
        except InvalidDocument:
            return True
        now = self.clock()
        doc: dict[str, Any] = {"handoff_id": handoff_id}
        record(doc, "rejected", now, code=code)
        book(doc)["dialect"] = "native"
        answer = self.formats.by_name("native").render(
            doc, self.failure(now, code, message), FiledState(0, 0, False))
        if self.backend.create_failed(handoff_id, answer):
            self._announce(handoff_id, State.FAILED)
        return True

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
        try:
            for resumer in self.resumers:  # e.g. a parent whose children are done
                resumed = resumer(job, started)
                if resumed is not None:
                    return resumed  # as it stands: no after_run checks
            self._check_input(job)
            for hook in self.before_run:
                hook(job)
            if job.specialist.is_command:
                from .runner import run_command  # loaded by whoever runs handlers
                result = run_command(job.specialist, without_book(job.claim.doc), job.context,
                                     self.timeout_for(job),
                                     max_output_bytes=self.settings.max_output_bytes)
            else:
                from .isolation import isolate, run_isolated
                from .runner import run_python
                if isolate(job.specialist, job.claim.doc, job.handoff_id):  # after a crash
                    result = run_isolated(job.specialist, job.claim.doc, job.context,
                                          self.timeout_for(job),
                                          max_output_bytes=self.settings.max_output_bytes)
                else:
                    result = run_python(job.specialist, job.claim.doc, job.context,
                                        self.timeout_for(job), self._takeover(job, started))
            outcome = self._usable_outcome(job, result, started)
        except HandlerError as exc:
            outcome = self._failed(exc, started)
        except InvalidDocument as exc:
            outcome = self.failure(started, exc.code, str(exc), errors=exc.errors)
        except ConfigError as exc:
            outcome = self.failure(started, ErrorCode.PROCESSING_ERROR, f"handoff {job.handoff_id}: {exc}",
                                   retryable=False)
        return self._conclude(job, outcome, started)

    def _usable_outcome(self, job: Job, result: dict[str, Any], started: datetime) -> Outcome:
        """:meth:`outcome_from_result`; a result that defeats it in a way no check foresaw fails
        the attempt (an uncaught error here once left the claim in in-progress/ for a lease,
        re-ran the handler at every recovery and filed a misleading "interrupted")."""
        try:
            return self.outcome_from_result(job, result, started)
        except (HandlerError, InvalidDocument, ConfigError):
            raise
        except Exception as exc:
            log.debug("handoff %s: its result defeated the checks", job.handoff_id, exc_info=True)
            return self.failure(started, ErrorCode.PROCESSING_ERROR,
                                f"handoff {job.handoff_id}: the handler's result cannot be used "
                                f"({type(exc).__name__}: {str(exc)[:200]})", retryable=False)

    def _failed(self, exc: HandlerError, started: datetime) -> Outcome:
        return self.failure(started, exc.code, str(exc), retryable=exc.retryable,
                            details=exc.details)

    def _takeover(self, job: Job, started: datetime) -> Callable[[HandlerError], None] | None:
        """What the watchdog calls, on its own thread, to end ``job``'s overrunning attempt: the
        daemon's ``job.takeover``, given the rest of :meth:`run` with ``error``."""
        finish = job.takeover
        if finish is None:
            return None
        return lambda error: finish(lambda: self._conclude(job, self._failed(error, started),
                                                           started))

    def _conclude(self, job: Job, outcome: Outcome, started: datetime) -> Outcome:
        """The end of an attempt's run: who ran it, warnings, partial results, after_run hooks."""
        outcome.started_at = started
        outcome.executed_by = job.specialist.agent
        if job.warnings:  # expectations that were advisory and not met
            outcome.warnings = [*job.warnings, *outcome.warnings]
        if outcome.status in (Status.CANCELLED, Status.TIMEOUT):
            from .runner import keep_partial
            outcome = keep_partial(job.context, outcome)
        if job.envelope.final_timeout and outcome.status == Status.TIMEOUT and outcome.error:
            outcome.error["retryable"] = False  # the answer the sender waits for (seeds 000, 003)
        for check in self.after_run:
            outcome = check(job, outcome)
        return outcome

    def expectation_unmet(self, job: Job, problem: InvalidDocument, key: str) -> None:
        """A request's expectation is not met: raise ``problem`` (``[daemon] expectations =
        "enforce"``, the default), or note it as a warning of the filed result ("advisory"), logged
        once per ``key`` (the kind of problem, without the handoff's id)."""
        if self.settings.expectations == "enforce":
            raise problem
        job.warnings.append(f"{problem.code}: {problem}")
        # the same unmet expectation on every handoff of a batch would flood the log (cron mails
        # it): the log says it once per process and kind; each result keeps its own warning
        with self._registry_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s (expectations are advisory: filed with a warning; further handoffs with "
                    "the same problem are warned in their results only)", problem)

    def _missing_schemas(self, job: Job) -> set[str]:
        """The schemas the request names that do not exist (each an unmet expectation)."""
        missing = set()
        for field_name, named in (("input.schema", job.envelope.input_schema),
                                  ("expected_output.schema", job.envelope.output_schema)):
            if named and not self.schemas.has(named):  # found out before the handler runs
                missing.add(named)
                self.expectation_unmet(job, InvalidDocument(
                    f"handoff {job.handoff_id}: {field_name} names {named!r}, which is neither in "
                    "schemas/ nor built in (`handoff schemas` lists them)",
                    handoff_id=job.handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                    errors=[{"field": field_name, "error": f"no schema {named}"}]),
                    key=f"missing {field_name} {named}")
        return missing

    def _check_input(self, job: Job) -> None:
        missing = self._missing_schemas(job)
        name = job.specialist.config.input_schema or job.envelope.input_schema
        if not name or name in missing:
            return
        errors = self.schemas.errors(name, job.envelope.data)
        if errors:
            first = errors[0]
            raise InvalidDocument(
                f"Input validation failed: {first['field']}: {first['error']}"
                + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                handoff_id=job.handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED, errors=errors)

    def outcome_from_result(self, job: Job, result: dict[str, Any], started: datetime) -> Outcome:
        """Turn a protocol result into an Outcome, validating output and artifact paths."""
        now = self.clock()
        status = result["status"]
        interpret = self.result_interpreters.get(status)
        if interpret is not None:  # a status a feature owns (e.g. delegated: parked by its filer)
            return interpret(job, result, started)
        if status == Status.THROTTLED:  # nothing was done: no output to check
            return Outcome(status=status, started_at=started, finished_at=now,
                           park={"retry_after_seconds": result.get("retry_after_seconds")})
        if status == "failed":
            error = given if isinstance(given := result.get("error"), dict) else {}
            outcome = self.failure(started, str(error.get("code") or ErrorCode.PROCESSING_ERROR),
                                   str(error.get("message") or "specialist reported failure"),
                                   retryable=_specialist_retryable(error), result=result)
            if error.get("error_type") in ERROR_TYPES and outcome.error is not None:
                # kept so that a format with this vocabulary (seed 003) reports the
                # specialist's own word, "unknown" included, instead of a derived one
                outcome.error["error_type"] = error["error_type"]
            return outcome
        self._check_output(job, result)
        return Outcome(status=status, started_at=started, finished_at=now,
                       output=result.get("output"), artifacts=_list(result.get("artifacts")),
                       validation=_dict(result.get("validation")),
                       metadata=_dict(result.get("metadata")),
                       next_steps=_list(result.get("next_steps")), warnings=_list(result.get("warnings")))

    def _check_output(self, job: Job, result: dict[str, Any]) -> None:
        output = result.get("output")
        checks: list[tuple[str, Any, bool]] = []  # (label, validator, the request's own)
        if job.specialist.config.output_schema:
            checks.append(("output schema " + job.specialist.config.output_schema,
                           self.schemas.validator(job.specialist.config.output_schema), False))
        named = job.envelope.output_schema
        if named and named != job.specialist.config.output_schema and self.schemas.has(named):
            checks.append(("expected_output.schema " + named, self.schemas.validator(named), True))
        if job.envelope.expected_output_schema:
            key = "inline:" + job.handoff_id
            checks.append(("expected_output_schema",
                           self.schemas.for_schema(key, job.envelope.expected_output_schema), False))
        for label, validator, requested in checks:
            errors = self.schemas.errors_with(validator, output)
            if errors:
                problem = InvalidDocument(f"handoff {job.handoff_id}: output fails {label}: "
                                          f"{errors[0]['field']}: {errors[0]['error']}",
                                          handoff_id=job.handoff_id,
                                          code=ErrorCode.VALIDATION_FAILED, errors=errors)
                if not requested:
                    raise problem  # the specialist's own schema, or HAIOS's: always enforced
                self.expectation_unmet(job, problem, key=f"output fails {label}")
        for path in _artifact_paths(result):
            if self.ws.inside(path) is None:
                raise InvalidDocument(f"handoff {job.handoff_id}: artifact path {path!r} points "
                                      "outside the workspace", handoff_id=job.handoff_id,
                                      code=ErrorCode.VALIDATION_FAILED)

    def failure(self, started: datetime, code: str, message: str, *, retryable: bool | None = None,
                errors: list[dict[str, str]] | None = None, details: dict[str, Any] | None = None,
                result: dict[str, Any] | None = None) -> Outcome:
        """A failed Outcome with a seed-001 error block."""
        error: dict[str, Any] = {"code": code, "message": message}
        if retryable is not None:
            error["retryable"] = bool(retryable)
        if errors:
            error["errors"] = errors
        if details:
            error["details"] = details
        statuses: dict[str, str] = {ErrorCode.TIMEOUT: "timeout", ErrorCode.CANCELLED: "cancelled"}
        status = statuses.get(code, "failed")
        outcome = Outcome(status=status, started_at=started, finished_at=self.clock(), error=error)
        if result:
            outcome.output = result.get("output")
            outcome.warnings = _list(result.get("warnings"))
            outcome.metadata = _dict(result.get("metadata"))
        return outcome

    # ------------------------------------------------------------ filing
    def policy(self, doc: dict[str, Any], spec: Specialist | None) -> RetryPolicy:
        """Retry policy: the document's, else the specialist's, else the configured default."""
        base = (spec.config.retry if spec and spec.config.retry else None) or self.config.retry
        raw = doc.get("retry_policy")
        if isinstance(raw, dict):
            try:
                return RetryPolicy.from_dict(raw, base)
            except ConfigError:
                return base
        return base

    def retryable(self, outcome: Outcome) -> bool:
        """Seed 003's error_type: permanent codes, ``retryable: false`` and ``error_type:
        permanent`` are never retried; ``unknown`` (the seed's table has no row for it) is."""
        error = outcome.error or {}
        return (error.get("code") not in PERMANENT_CODES and error.get("retryable") is not False
                and error.get("error_type") != "permanent")

    def file(self, claim: Claim, dialect: Dialect, spec: Specialist | None, outcome: Outcome) -> State:
        """Retry or file ``outcome`` for a claimed handoff; returns where it went (IN_PROGRESS:
        nothing was written because the claim was lost). Listeners in ``on_filed`` hear of it."""
        where = self._file(claim, dialect, spec, outcome)
        if where is not State.IN_PROGRESS:
            self._announce(claim.id, where)
        return where

    def _announce(self, handoff_id: str, where: State) -> None:
        try:
            for listener in self.on_filed:
                listener(handoff_id, where)
        finally:
            self._just_filed.value = None

    def filed_document(self, handoff_id: str) -> tuple[State, Doc]:
        """For ``on_filed`` listeners: the answer this thread just filed for ``handoff_id`` (no
        read), else the stored document as :meth:`get` returns it. Treat it as read-only."""
        just = getattr(self._just_filed, "value", None)
        if just is not None and just[0] == handoff_id:
            return just[1], just[2]
        return self.get(handoff_id)

    def _file(self, claim: Claim, dialect: Dialect, spec: Specialist | None, outcome: Outcome) -> State:
        filer = self.filers.get(outcome.status)
        if filer is not None:  # e.g. a parked handoff goes back to pending (orchestration)
            return filer(claim, dialect, spec, outcome)
        if outcome.status == Status.THROTTLED:
            return self._throttled(claim, dialect, spec, outcome)
        doc = claim.doc
        block = book(doc)
        retries = book_int(doc, "retries", 0)
        policy = self.policy(doc, spec)
        now = self.clock()
        if not outcome.succeeded and self.retryable(outcome) and retries < policy.max_retries:
            delay = min(policy.delay(retries + 1), MAX_RETRY_DELAY_SECONDS)  # never overflows
            block["retries"] = retries + 1
            block["last_error"] = outcome.error
            return self.requeue(claim, dialect, "retry_scheduled",
                                due_at=now + timedelta(seconds=delay), count_attempt=True,
                                retry=retries + 1, delay_seconds=delay, error=outcome.error)
        dst = State.COMPLETED if outcome.succeeded else State.FAILED
        event = "completed" if outcome.succeeded else ("cancelled" if outcome.status == "cancelled"
                                                       else "failed")
        detail: dict[str, Any] = {"seconds": outcome.seconds}
        if outcome.error:
            detail["code"] = outcome.error.get("code")
            detail["message"] = str(outcome.error.get("message"))[:500]
        record(doc, event, now, **detail)
        block.pop("next_attempt_at", None)
        filed = FiledState(retries, policy.max_retries, self.retryable(outcome) or
                           (outcome.error or {}).get("code") == ErrorCode.TIMEOUT)
        # format-neutral facts `handoff retry` and `handoff ls` read, whatever the answer's format
        block["retry_available"] = filed.retry_available
        if outcome.error:
            block["final_error"] = {"code": outcome.error.get("code"),
                                    "message": str(outcome.error.get("message"))[:500]}
        else:
            block.pop("final_error", None)
        if dialect.name != "native":  # its answer replaces the request: keep it for retries
            block.setdefault("request_snapshot", without_book(doc))
        answer = dialect.render(doc, outcome, filed, artifacts=self.artifact_sink)
        if self.backend.finish(claim, dst, answer):
            self._just_filed.value = (claim.id, dst, answer)
            return dst
        return State.IN_PROGRESS

    def _throttled(self, claim: Claim, dialect: Dialect, spec: Specialist | None,
                   outcome: Outcome) -> State:
        """Seed 000's THROTTLED: the specialist was too busy to start. Back to pending, due after
        its ``retry_after_seconds`` (bounded) or the retry policy's first delay; not an attempt
        and not a failure, so it never uses up retries."""
        asked = (outcome.park or {}).get("retry_after_seconds")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked == asked:
            # bounded before the conversion: a 401-digit integer overflows a float
            delay = float(min(max(asked, 0), MAX_THROTTLE_SECONDS))
        else:
            delay = self.policy(claim.doc, spec).delay(1)
        floor = MIN_THROTTLE_SECONDS * 2 ** min(throttles_in_a_row(claim.doc), 16)
        delay = min(max(delay, floor), MAX_THROTTLE_SECONDS)
        log.info("handoff %s: %s is throttled; trying again in %gs", claim.id,
                 spec.agent if spec else "its specialist", delay)
        return self.requeue(claim, dialect, "throttled", due_at=self.clock() + timedelta(seconds=delay),
                            delay_seconds=delay)

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


# when a request was sent, and the queue's marks on it: not part of what it asks
SENT_KEYS = frozenset({BOOK, "status", "timestamp", "created_at", "started_at"})
# what a seed 001 handoff gains in place on its way (its answer is the request document itself)
NATIVE_LIFECYCLE_KEYS = SENT_KEYS | frozenset({
    "completed_at", "failed_at", "timestamp_completed", "timestamp_failed",
    "execution_time_seconds", "output", "artifacts", "validation", "metadata", "next_steps",
    "warnings", "errors", "error", "retry_count", "retry_available", "max_retries",
    "recovery_actions"})


def same_request(stored: dict[str, Any], submitted: dict[str, Any], dialect: str) -> bool:
    """Whether a stored handoff (pending, running or filed) was made from the ``submitted``
    request: the request as first stored (a filed answer's ``request_snapshot`` when the format
    answers with a new document), without what its lifecycle added. A ``conversation_id`` the
    queue gave a delegating parent is ignored when the submission has none."""
    block = stored.get(BOOK)
    snapshot = block.get("request_snapshot") if isinstance(block, dict) else None
    original = snapshot if isinstance(snapshot, dict) else stored
    ignored = NATIVE_LIFECYCLE_KEYS if dialect == "native" else SENT_KEYS
    if "conversation_id" not in submitted:
        ignored = ignored | {"conversation_id"}
    return _asked(original, ignored) == _asked(submitted, ignored)


def _asked(doc: dict[str, Any], ignored: frozenset[str]) -> dict[str, Any]:
    """``doc`` without ``ignored`` keys, nor the answers ``handoff answer`` added to a seed 001
    request's input (``input.clarifications``)."""
    out = {k: v for k, v in doc.items() if k not in ignored}
    if isinstance(out.get("input"), dict) and "clarifications" in out["input"]:
        out["input"] = {k: v for k, v in out["input"].items() if k != "clarifications"}
    return out


def without_book(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without its ``handoffd`` bookkeeping block (what formats and handlers see)."""
    return {k: v for k, v in doc.items() if k != "handoffd"}


def _specialist_retryable(error: dict[str, Any]) -> Any:
    """What a specialist's error block says about retrying: its ``retryable``, overruled by
    seed 003's ``error_type: "permanent"`` ("fail immediately"), whatever the request's format:
    it is the result's vocabulary, not the request's. None: the specialist did not say."""
    if error.get("error_type") == "permanent":
        return False
    return error.get("retryable")


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _artifact_paths(result: dict[str, Any]) -> list[str]:
    paths: list[str] = []
    output = result.get("output")
    if isinstance(output, dict) and isinstance(output.get("artifact_path"), str):
        paths.append(output["artifact_path"])
    for item in _list(result.get("artifacts")):
        if isinstance(item, dict):
            for key in ("path", "artifact_path"):
                if isinstance(item.get(key), str):
                    paths.append(item[key])
    return paths


def _problem(handoff_id: str, exc: BaseException) -> UnreadableDocument:
    """A routing failure as the daemon acts on it: an invalid document is set aside by claiming
    it; anything else a reader chokes on is set aside where it lies."""
    if isinstance(exc, InvalidDocument):
        return UnreadableDocument(str(exc), handoff_id=handoff_id, code=exc.code, claimable=True)
    hint = " (it nests too deeply)" if isinstance(exc, RecursionError) else ""
    return UnreadableDocument(f"pending/{handoff_id}.json could not be processed{hint}: "
                              f"{type(exc).__name__}: {str(exc)[:200]}", handoff_id=handoff_id,
                              code=ErrorCode.UNPROCESSABLE_DOCUMENT)
