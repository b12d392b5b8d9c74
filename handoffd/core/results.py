"""What an attempt's result becomes: its input and output checked against the schemas the request
and the specialist name (:class:`JobChecks`), a handler's result read as an :class:`Outcome`
(:func:`read_result`), the end of the attempt (:func:`conclude`), and the failed Outcomes
everything else builds (:func:`failed`)."""
from __future__ import annotations

import re
import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol

from .documents import Envelope, Outcome
from .errors import ErrorCode, HandlerError, InvalidDocument, is_shortage, shortage_words
from .hooks import Hooks
from .jobs import Job
from .logs import log
from .settings import DaemonSettings
from .states import Status
from .timeutil import Clock
from .validation import Look, SchemaCache, more_errors
from .workspace import Workspace

# seed 003's CollaborationResult error_type, which a specialist's error block may carry
ERROR_TYPES = ("retryable", "permanent", "unknown")
ERROR_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")  # (fullmatch: "$" would take a final newline)
# a result whose check runs short (descriptors, memory: its output against its schema, its
# artifacts read and stored) is checked again after RECHECK_SECONDS, doubling, up to RECHECKS
# times (1 + 2 + 4 + 8 + 16 s), on its worker, its claim renewed (wait_to_check_again)
RECHECK_SECONDS = 1.0
RECHECKS = 5


def wait_short(waits: int, stopped: threading.Event, line: Callable[[float], str]) -> bool:
    """Wait out a passing shortage met ``waits`` times before this one (:data:`RECHECK_SECONDS`,
    doubling), saying ``line(delay)`` in one warning; True once waited. False when
    :data:`RECHECKS` waits are spent, or when ``stopped`` is set before or during the wait
    (whoever calls it says what a stop means there)."""
    if waits >= RECHECKS or stopped.is_set():
        return False
    delay = RECHECK_SECONDS * 2 ** waits
    log.warning("%s", line(delay))
    return not stopped.wait(delay)  # (woken early by a stop: a cancel, or the daemon's)


def wait_to_check_again(job: Job, what: str, words: str, rechecks: int) -> bool:
    """Checking ``job``'s result ran short (descriptors or memory: ``words``), ``rechecks``
    times before this one: wait (:data:`RECHECK_SECONDS`, doubling) to check the same result
    again, its claim still held and renewed; True once waited. ``what`` says what failed, in
    the one warning line of each wait. A passing shortage is no fault of the result's, nor the
    handler's, which ran and does not run again: a failed attempt, counted, once filed a
    completed handler's last allowed attempt in failed/. False after :data:`RECHECKS` waits
    (the caller fails the attempt, retryable: its retry policy bounds the runs of a result that
    exhausts memory at every check), or when the attempt is stopped meanwhile: a cancellation
    is raised as one (CANCELLED), a stop's hand-back is left to its caller."""
    ctx = job.context
    if wait_short(rechecks, ctx.cancelled, lambda delay: (
            f"handoff {job.handoff_id}: {what} for now: {words}; checked again in {delay:g}s "
            "(the handler does not run again)")):
        return True
    if ctx.stop_requested and not ctx.handback:
        from .watchdog import cancelled  # (loaded by whoever runs handlers)
        raise cancelled(ctx)
    return False


def failed(started: datetime, finished: datetime, code: str, message: str, *,
           retryable: bool | None = None, errors: list[dict[str, str]] | None = None,
           details: dict[str, Any] | None = None, result: dict[str, Any] | None = None) -> Outcome:
    """A failed Outcome with a seed-001 error block (``timeout`` or ``cancelled`` for those
    codes); ``result``: the handler's, whose output, warnings and metadata it keeps."""
    error: dict[str, Any] = {"code": code, "message": message}
    if retryable is not None:
        error["retryable"] = bool(retryable)
    if errors:
        error["errors"] = errors
    if details:
        error["details"] = details
    statuses: dict[str, str] = {ErrorCode.TIMEOUT: "timeout", ErrorCode.CANCELLED: "cancelled"}
    status = statuses.get(code, "failed")
    outcome = Outcome(status=status, started_at=started, finished_at=finished, error=error)
    if result:
        outcome.output = result.get("output")
        outcome.warnings = _list(result.get("warnings"))
        outcome.metadata = _dict(result.get("metadata"))
    return outcome


if TYPE_CHECKING:  # for the type checker only: no class to build at each import
    class Checked(Protocol):
        """What :class:`JobChecks` reads of its engine, at each check."""

        schemas: SchemaCache
        ws: Workspace
        settings: DaemonSettings

    class Reading(Protocol):
        """What reading a result uses of an :class:`~handoffd.core.engine.Engine` (named here, not
        imported: engine.py imports this module)."""

        clock: Clock
        hooks: Hooks[Any]
        checks: JobChecks


def read_result(engine: Reading, job: Job, result: dict[str, Any], started: datetime) -> Outcome:
    """A handler's protocol result as an Outcome, its output and artifact paths checked. A
    status a feature owns (``result_interpreters``) is read by that feature."""
    now = engine.clock()
    status = result["status"]
    interpret = engine.hooks.result_interpreters.get(status)
    if interpret is not None:  # a status a feature owns (e.g. delegated: parked by its filer)
        return interpret(job, result, started)
    if status == Status.THROTTLED:  # nothing was done: no output to check
        return Outcome(status=status, started_at=started, finished_at=now,
                       park={"retry_after_seconds": result.get("retry_after_seconds")})
    if status == "failed":
        return reported_failure(result, started, engine.clock())
    engine.checks.check_output(job, result)
    return reported_outcome(status, result, started, now)


def conclude(job: Job, outcome: Outcome, started: datetime,
             after_run: list[Callable[[Job, Outcome], Outcome]]) -> Outcome:
    """The end of an attempt's run: who ran it, warnings, partial results, ``after_run`` hooks."""
    outcome.started_at = started
    outcome.executed_by = job.specialist.agent
    if job.warnings:  # expectations that were advisory and not met
        outcome.warnings = [*job.warnings, *outcome.warnings]
    if outcome.status in (Status.CANCELLED, Status.TIMEOUT):
        from .runner import keep_partial
        outcome = keep_partial(job.context, outcome)
    if job.envelope.final_timeout and outcome.status == Status.TIMEOUT and outcome.error:
        outcome.error["retryable"] = False  # the answer the sender waits for (seeds 000, 003)
    for check in after_run:
        try:
            outcome = check(job, outcome)
            continue
        except (OSError, MemoryError) as exc:
            if not is_shortage(exc):
                raise
            words = shortage_words(exc)
        # (out of the except block: a MemoryError's traceback holds what ran short)
        outcome = _checked_again(job, check, outcome, started, words)
    return outcome


def _checked_again(job: Job, check: Callable[[Job, Outcome], Outcome], outcome: Outcome,
                   started: datetime, words: str) -> Outcome:
    """``check(job, outcome)``, one ``after_run`` hook, after it met a passing shortage
    (descriptors, memory: ``words``). Raised, it escaped :func:`conclude` and stranded the
    claim in in-progress/, charged as a crash by the next process: the same outcome is checked
    again after a wait (:func:`wait_to_check_again`), the attempt not charged; one that
    outlasts every wait fails the attempt, retryable, as
    :meth:`~handoffd.core.engine.Engine._usable_outcome` does."""
    rechecks = 0
    while True:
        if not outcome.succeeded and job.context.cancelled.is_set():
            # the attempt ended failed already (its timeout, a cancel): that outcome stands, as
            # it was (a PROCESSING_ERROR, retryable, in its place made a final TIMEOUT a retry)
            return outcome
        try:
            again = wait_to_check_again(job, "its result could not be checked", words, rechecks)
        except HandlerError as exc:  # cancelled meanwhile: filed cancelled
            ended = failed(started, outcome.finished_at or started, exc.code, str(exc),
                           retryable=False)
            ended.executed_by = outcome.executed_by
            return ended
        if not again:
            ended = failed(started, outcome.finished_at or started, ErrorCode.PROCESSING_ERROR,
                           f"handoff {job.handoff_id}: its result could not be checked for now: "
                           f"{words}; a failed attempt, retryable", retryable=True)
            ended.executed_by = outcome.executed_by
            return ended
        rechecks += 1
        try:
            return check(job, outcome)
        except (OSError, MemoryError) as exc:
            if not is_shortage(exc):
                raise
            words = shortage_words(exc)


def reported_failure(result: dict[str, Any], started: datetime, finished: datetime) -> Outcome:
    """A result whose status is ``failed``, with the specialist's own error block: its code,
    message and word on retrying (:func:`_specialist_retryable`)."""
    error = given if isinstance(given := result.get("error"), dict) else {}
    code, details = _error_code(error.get("code"))
    message = str(error.get("message") or "specialist reported failure")
    if details:  # (said in the message too: not every format files an error's details)
        message += (f" (its code {details['specialist_code']!r} is no error code: capitals, "
                    "digits and _, from a capital)")
    outcome = failed(started, finished, code, message,
                     retryable=_specialist_retryable(error), result=result, details=details)
    if error.get("error_type") in ERROR_TYPES and outcome.error is not None:
        # kept so that a format with this vocabulary (seed 003) reports the
        # specialist's own word, "unknown" included, instead of a derived one
        outcome.error["error_type"] = error["error_type"]
    return outcome


def _error_code(given: Any) -> tuple[str, dict[str, Any] | None]:
    """The code a specialist's failure is filed with: its own when it has the shape every
    format's schema asks (``^[A-Z][A-Z0-9_]*$``, at most 64 characters), else PROCESSING_ERROR
    with the given one kept in ``details.specialist_code`` (cut to 100 characters). A code such
    as ``oops`` or ``E-1`` was filed as it was, and the failure broke its own format's schema."""
    if not given:
        return ErrorCode.PROCESSING_ERROR, None
    code = str(given)
    if ERROR_CODE.fullmatch(code):
        return code, None
    return ErrorCode.PROCESSING_ERROR, {"specialist_code": code[:100]}


def reported_outcome(status: str, result: dict[str, Any], started: datetime,
                     finished: datetime) -> Outcome:
    """Any other result (``completed``...) as its Outcome, once its output passed the checks."""
    # (as _list and _dict read them, without their calls: every completed handoff comes here)
    artifacts, validation = result.get("artifacts"), result.get("validation")
    metadata, next_steps = result.get("metadata"), result.get("next_steps")
    warnings = result.get("warnings")
    return Outcome(status=status, started_at=started, finished_at=finished,
                   output=result.get("output"),
                   artifacts=list(artifacts) if isinstance(artifacts, list) else [],
                   validation=validation if isinstance(validation, dict) else None,
                   metadata=metadata if isinstance(metadata, dict) else None,
                   next_steps=list(next_steps) if isinstance(next_steps, list) else [],
                   warnings=list(warnings) if isinstance(warnings, list) else [])


class JobChecks:
    """One engine's checks of its jobs against schemas: the input before the handler runs, the
    output after, and what becomes of an expectation a request states that is not met."""

    def __init__(self, owner: Checked) -> None:
        # the engine's own attributes, read at each check (a caller that replaces
        # engine.settings after building it changes the checks too, as it did inline)
        self._owner = owner
        self._warned: set[str] = set()  # advisory problems already logged (expectation_unmet)
        self._lock = threading.Lock()

    @property
    def schemas(self) -> SchemaCache:
        return self._owner.schemas

    @property
    def ws(self) -> Workspace:
        return self._owner.ws

    @property
    def settings(self) -> DaemonSettings:
        return self._owner.settings

    def expectation_unmet(self, job: Job, problem: InvalidDocument, key: str) -> None:
        """A request's expectation is not met: raise ``problem`` (``[daemon] expectations =
        "enforce"``, the default), or note it as a warning of the filed result ("advisory"), logged
        once per ``key`` (the kind of problem, without the handoff's id)."""
        if self._owner.settings.expectations == "enforce":
            raise problem
        self._note_unmet(job.warnings, problem.code, str(problem), key)

    def _note_unmet(self, warnings: list[str], code: str, message: str, key: str) -> None:
        """An advisory unmet expectation (``code``: ``message``) noted in ``warnings``."""
        warnings.append(f"{code}: {message}")
        # the same unmet expectation on every handoff of a batch would flood the log (cron mails
        # it): the log says it once per process and kind; each result keeps its own warning
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s (expectations are advisory: filed with a warning; further handoffs with "
                    "the same problem are warned in their results only)", message)

    def check_input(self, job: Job) -> set[str]:
        """The job's input against its schema (the specialist's, else the one the request
        names): InvalidDocument (SCHEMA_VALIDATION_FAILED) when it fails. Returns the schemas
        the request names that do not exist (for :meth:`load_output_schemas`)."""
        return self.check_request(job.handoff_id, job.envelope,
                                  job.specialist.config.input_schema, job.warnings)

    def check_request(self, handoff_id: str, envelope: Envelope, input_schema: str | None,
                      warnings: list[str]) -> set[str]:
        """:meth:`check_input` of a request with no job yet (``handoff validate``): its input
        against ``input_schema`` (its specialist's), else the schema the request names; an
        advisory unmet expectation is noted in ``warnings``. Returns the schemas the request
        names that do not exist. The specialist's own schema is always used, also when it does
        not exist and the request names it too: the request's expectation is warned of
        (advisory) and the handoff fails as when the request names no schema (it once ran
        unchecked)."""
        look = Look()  # (each file of schemas/ looked at once for both checks)
        missing = self._missing_schemas(handoff_id, envelope, warnings, look)
        name = input_schema or envelope.input_schema
        if not name or (name in missing and not input_schema):
            return missing
        errors = self.schemas.errors(name, envelope.data, look)
        if errors:
            first = errors[0]
            raise InvalidDocument(
                f"Input validation failed: {first['field']}: {first['error']}" + more_errors(errors),
                handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED, errors=errors)
        return missing

    def _missing_schemas(self, handoff_id: str, envelope: Envelope, warnings: list[str],
                         look: Look) -> set[str]:
        """The schemas the request names that do not exist (each an unmet expectation), as
        ``look`` (the request's) finds schemas/."""
        named = (envelope.input_schema, envelope.output_schema)
        # both looked up at once (one stat of schemas/), found out before the handler runs
        missing = self._owner.schemas.absent(filter(None, named), look)
        if not missing:
            return missing
        enforce = self._owner.settings.expectations == "enforce"
        for field_name, name in zip(("input.schema", "expected_output.schema"), named):
            if name and name in missing:
                message = (f"handoff {handoff_id}: {field_name} names {name!r}, which is "
                           "neither in schemas/ nor built in (`handoff schemas` lists them)")
                if enforce:
                    raise InvalidDocument(
                        message, handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                        errors=[{"field": field_name, "error": f"no schema {name}"}])
                # (advisory, on most handoffs of a workspace without those schemas: its
                # warning alone, no exception made)
                self._note_unmet(warnings, ErrorCode.SCHEMA_VALIDATION_FAILED, message,
                                 key=f"missing {field_name} {name}")
        return missing

    def load_output_schemas(self, job: Job, absent: Collection[str] = ()) -> None:
        """Load (compile) the schemas :meth:`check_output` will check the job's result against,
        before its handler runs: a passing shortage of descriptors or memory loading one
        raises then, when the attempt can still be handed back without a run. Anything else
        wrong with one is left for :meth:`check_output` to say, as it always did. ``absent``:
        names :meth:`check_input` has just found missing, not looked up again (one that
        appears before the handler ends is still loaded and checked by :meth:`check_output`,
        which looks again)."""
        named = {job.specialist.config.output_schema, job.envelope.output_schema}
        inline = job.envelope.expected_output_schema
        try:
            for name in sorted(filter(None, named)):
                if name not in absent and self.schemas.has(name):
                    self.schemas.validator(name)
            if inline:
                self.schemas.for_schema("inline:" + job.handoff_id, inline)
        except Exception as exc:
            if is_shortage(exc):
                raise

    def check_output(self, job: Job, result: dict[str, Any]) -> None:
        """A result's output against the specialist's output schema (always enforced) and those
        the request names (an expectation); its artifact paths must be inside the workspace."""
        output = result.get("output")
        schemas = self._owner.schemas
        checks: list[tuple[str, Any, bool]] = []  # (label, validator, the request's own)
        if job.specialist.config.output_schema:
            checks.append(("output schema " + job.specialist.config.output_schema,
                           schemas.validator(job.specialist.config.output_schema), False))
        named = job.envelope.output_schema
        if named and named != job.specialist.config.output_schema and schemas.has(named):
            checks.append(("expected_output.schema " + named, schemas.validator(named), True))
        if job.envelope.expected_output_schema:
            key = "inline:" + job.handoff_id
            checks.append(("expected_output_schema",
                           schemas.for_schema(key, job.envelope.expected_output_schema), False))
        for label, validator, requested in checks:
            errors = schemas.errors_with(validator, output)
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
    items = result.get("artifacts")
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            for key in ("path", "artifact_path"):
                if isinstance(item.get(key), str):
                    paths.append(item[key])
    return paths
