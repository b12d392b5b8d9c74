"""Contracts that are enforced, not trusted (seed 004, ADR-008 WorkerHandoff).

A handoff carries a contract when its Envelope has one: a seed-004 WorkerHandoff's ``contract``
block, or a top-level ``contract`` object on a native document::

    {"task_id": "bd-123.2",                      # native: defaults to the handoff id
     "files_owned": ["src/auth/**"],              # globs; absent = scope not enforced
     "files_readonly": ["src/types/user.ts"],
     "dependencies_completed": ["bd-123.1"],      # checked by the shared dependencies gate
     "success_criteria": ["Tests pass: pytest -q tests/test_auth.py", "Login works"],
     "cwd": "services/api",                       # handoffd extension: the contract directory
     "criteria_timeout_seconds": 60,              # handoffd extension: per criterion
     "scope_check": "auto",                       # handoffd extension: auto | hash | git
     "scope_ignore": [".pytest_cache/**"]}        # handoffd extension: paths never watched

:func:`install` adds to an Engine:

* a gate: an invalid contract fails the handoff (``SCHEMA_VALIDATION_FAILED``); a handoff whose
  ``files_owned`` overlap a running handoff's waits ("waiting for files owned by X: pattern");
* a ``before_run`` hook: reserve ``files_owned`` atomically (a lost race hands the claim back to
  pending/ without counting an attempt), then snapshot the contract directory (one too big or
  too deep to snapshot fails ``CONTRACT_VIOLATION`` before the handler starts);
* an ``after_run`` hook: compare the tree with the snapshot (files created, modified or deleted
  outside ``files_owned``, or any change to ``files_readonly``, fail with ``CONTRACT_VIOLATION``,
  never retried), compare the worker's ``files_touched`` with what was observed (a mismatch is
  recorded, see :func:`Enforcer.review`), run the checkable success criteria (a failure is
  ``VALIDATION_FAILED``), file every result under ``validation``, release the reservation, and
  append each violation to the learning log (:mod:`handoffd.features.contracts.violations`);
* an ``on_rejected`` listener logging ``dependency_missing`` when a contract handoff is failed
  by the dependencies gate (a WorkerHandoff's completion report lists the same violation:
  :func:`handoffd.dialects.swarm.dependency_violation`).

Paths in a contract are relative to the contract directory (the workspace root unless ``cwd``).

The parts: :mod:`.contract` parses a contract, :mod:`.findings` holds what one attempt found,
:mod:`.review` turns it into the verdict; this module holds the gate, the hooks and
:func:`install`.
"""
from __future__ import annotations

import dataclasses
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...core.documents import Envelope, Outcome, book
from ...core.errors import (ErrorCode, HandlerError, HandoffdError, InvalidDocument, is_shortage,
                            shortage_words)
from ...core.logs import deferred
from ...core.results import failed, wait_to_check_again
from ...core.starts import check_shortage
from ...dialects.swarm import dependency_violation
from ..dependencies import Verdict
from . import patterns

if TYPE_CHECKING:  # .findings and .review: loaded by the first contract run, .contract and
    # .reservations by the first envelope that carries a contract (a listing that asks the
    # gates of plain handoffs never loads them)
    from ...core.engine import Engine, Job
    from ...core.storage import ViolationLog
    from .contract import Contract
    from .findings import Run
    from .reservations import Reservations
    from .review import Review

log = deferred("handoffd.contracts")

STATE_KEY = "handoffd.contract"


def parse(env: Envelope) -> Contract | None:
    """The envelope's contract, checked (:func:`.contract.parse`); None when it has none.
    Raises InvalidDocument. :mod:`.contract` is imported at the first envelope that carries a
    contract: `handoff ls` asks this gate about every pending row, most of them plain."""
    if env.contract is None:
        return None
    from .contract import parse as parse_contract
    return parse_contract(env)


class Enforcer:
    """The gate and hooks one Engine uses to enforce contracts."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    @cached_property
    def log(self) -> ViolationLog:
        """The violations log: the store's (one for every host of a PostgreSQL store), else
        .meta/violations.jsonl. Made with the reviewer, at the first contract run (a listing
        that asks the gate never loads its code)."""
        from ..stores import violation_log
        return violation_log(self.engine.ws, self.engine.backend)

    @cached_property
    def reservations(self) -> Reservations:
        """The files_owned reservations (:class:`.reservations.Reservations`), made at their
        first use: a contract that owns files (a listing of plain handoffs never loads them)."""
        from .reservations import Reservations
        return Reservations(self.engine)

    @cached_property
    def reviewer(self) -> Review:
        """The verdict on an attempt (:class:`.review.Review`), made at the first use."""
        from .review import Review
        return Review(self.engine, self.reservations, self.log)

    # ------------------------------------------------------------ gate
    def gate(self, engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        """Fail an unusable contract; hold a handoff whose files_owned are reserved by another."""
        if env.contract is None:
            return None
        try:
            contract = parse(env)
            if contract is None:
                return None
            contract.directory(engine.ws.root)
        except InvalidDocument as exc:
            return Verdict.fail(exc.code, str(exc))
        owned = contract.owned_in_workspace()
        if not owned:
            return None
        conflict = self.reservations.first_conflict(env.handoff_id, owned)
        # the holder releases its reservation before its answer is filed: that filing is what
        # may end the wait (another overlapping holder is found at that re-check; a holder that
        # dies or is retried instead is seen at the next rescan)
        return Verdict.wait(conflict.reason(), on=(conflict.holder,)) \
            if conflict is not None else None

    # ------------------------------------------------------------ before the handler
    def before(self, job: "Job") -> None:
        """Reserve files_owned (or hand the claim back) and snapshot the contract directory."""
        contract = parse(job.envelope)
        if contract is None:
            return
        directory = contract.directory(self.engine.ws.root)
        from .findings import Run
        run = Run(contract, directory, time.time())
        owned = contract.owned_in_workspace()
        if owned:
            try:
                conflict = self.reservations.take(job.handoff_id, job.claim.token, owned,
                                                  agent=job.specialist.agent)
            except (HandoffdError, OSError) as exc:  # the records refused or unusable now:
                # a retryable failure of this attempt, never an error escaping the claim
                raise HandlerError(f"handoff {job.handoff_id}: cannot reserve its files_owned: "
                                   f"{_said(exc)}", handoff_id=job.handoff_id,
                                   retryable=True) from None
            if conflict is not None:
                self.engine.handback(job.claim, job.dialect, reason=conflict.reason())
                log.info("handoff %s: %s; handed back (pending again)", job.handoff_id, conflict.reason())
                raise HandlerError(f"handoff {job.handoff_id}: {conflict.reason()}; handed back "
                                   "(pending again, no attempt counted)", handoff_id=job.handoff_id,
                                   code=ErrorCode.OWNERSHIP_CONFLICT, retryable=True)
            run.reserved = True
        job.context.feature_state[STATE_KEY] = run  # from here on, the after hook releases
        if contract.checks_scope:
            from .snapshots import Snapshotter
            run.snapshotter = Snapshotter(directory, mode=contract.scope_check,
                                          skip=self._skipper(contract, directory),
                                          cache_dir=self.engine.ws.meta / "contracts",
                                          tmp_dir=self.engine.ws.tmp)
            try:
                run.before = run.snapshotter.take()
            except (OSError, MemoryError) as exc:
                if not is_shortage(exc):
                    raise HandlerError(f"handoff {job.handoff_id}: cannot snapshot the contract "
                                       f"directory: {exc}", handoff_id=job.handoff_id,
                                       retryable=True) from None
                # the daemon's shortage, no fact of the tree's: handed back uncounted, as a
                # start shortage (it made the snapshot incomplete, which refused it for good)
                raise check_shortage(job.context, f"{job.specialist.agent}'s handler",
                                     "taking its contract's snapshot", exc) from None
            except ValueError as exc:
                raise HandlerError(f"handoff {job.handoff_id}: cannot snapshot the contract "
                                   f"directory: {exc}", handoff_id=job.handoff_id,
                                   retryable=True) from None
            if run.before.incomplete:
                self._refuse_unseeable(job, run)

    @staticmethod
    def _refuse_unseeable(job: "Job", run: "Run") -> None:
        """The directory is already too big or too deep to snapshot (walk.py's bounds): nothing
        the handler changes could be checked, so it is not started. The after hook files the
        attempt as an unverifiable scope always is (``CONTRACT_VIOLATION``, never retried, one
        log line, one ``scope_creep`` in the violations log), the snapshot's reason saying the
        handler was not run."""
        assert run.before is not None
        why = f"{run.before.incomplete}; the handler was not run"
        run.before = dataclasses.replace(run.before, incomplete=why, note=why)
        raise HandlerError(f"handoff {job.handoff_id} broke its contract: the scope cannot be "
                           f"verified: before the handler ran, {why}", handoff_id=job.handoff_id,
                           code=ErrorCode.CONTRACT_VIOLATION, retryable=False)

    def _skipper(self, contract: Contract, directory: Path) -> Callable[[str], bool]:
        handoffs = self.engine.ws.handoffs.resolve()
        own: str | None = None
        if handoffs == directory or directory in handoffs.parents:
            own = handoffs.relative_to(directory).as_posix()
        ignore = contract.scope_ignore

        def skip(rel: str) -> bool:
            if own is not None and (rel == own or rel.startswith(own + "/")):
                return True
            return patterns.any_match(ignore, rel)
        return skip

    # ------------------------------------------------------------ after the handler
    def rejected(self, job: "Job", code: str, message: str) -> None:
        """Engine listener: log ``dependency_missing`` when the dependencies gate fails a
        handoff that carries a contract."""
        if code != ErrorCode.DEPENDENCY_MISSING or job.envelope.contract is None:
            return
        try:
            contract = parse(job.envelope)
        except InvalidDocument:
            contract = None
        # the facts a WorkerHandoff's completion report lists for the same rejection (and its
        # ``valid`` is false): the log and the report must never disagree
        details = dependency_violation(message, list(job.envelope.depends_on))
        details.pop("kind")
        self.reviewer.record(job.envelope, "dependency_missing", details,
                             task_id=contract.task_id if contract else None,
                             attempt=job.claim.attempt)

    def after(self, job: "Job", outcome: Outcome) -> Outcome:
        """Review the attempt against its contract; always releases the reservation."""
        run = job.context.feature_state.pop(STATE_KEY, None)
        if run is None:  # (every attempt passes here: most carry no contract)
            return outcome
        from .findings import Run
        if not isinstance(run, Run):
            return outcome
        rechecks = 0
        try:
            while True:
                if job.context.handback or outcome.status == "cancelled":
                    return outcome  # the attempt does not count / the coordinator stopped it
                try:
                    return self.reviewer.review(job, run, outcome)
                except Exception as exc:  # a checking fault must not let unchecked work complete
                    if not is_shortage(exc):
                        log.exception("handoff %s: contract check failed", job.handoff_id)
                        return self._unchecked(job, outcome, f"the contract check failed: "
                                                             f"{type(exc).__name__}: {exc}")
                    words = shortage_words(exc)
                # a passing shortage (descriptors, memory) is no fault of the work's: it failed
                # the attempt, counted, with a traceback; the same work is checked again after
                # a wait, the handler not run again
                try:
                    again = wait_to_check_again(job, "its contract could not be checked", words,
                                                rechecks)
                except HandlerError as exc:  # cancelled meanwhile: filed cancelled
                    return failed(outcome.started_at or job.started_at, self.engine.clock(),
                                  exc.code, str(exc), retryable=False)
                if not again:
                    return self._unchecked(job, outcome, f"its contract could not be checked "
                                                         f"for now: {words}")
                rechecks += 1
        finally:
            if run.reserved:
                try:
                    self.reservations.release(job.handoff_id, job.claim.token)
                except (HandoffdError, OSError) as exc:  # the records refused or unusable now:
                    # one line (liveness is derived from the claim: it dies with it anyway, and
                    # the sweep's prune retires the record)
                    log.error("handoff %s: cannot release its reservation: %s", job.handoff_id,
                              _said(exc))
                except Exception:  # a bug: its traceback
                    log.exception("handoff %s: cannot release its reservation", job.handoff_id)

    def _unchecked(self, job: "Job", outcome: Outcome, why: str) -> Outcome:
        """``outcome`` failed, retryable: its contract check did not pass for ``why``."""
        return dataclasses.replace(outcome, status="failed", finished_at=self.engine.clock(),
                                   error={"code": ErrorCode.PROCESSING_ERROR, "retryable": True,
                                          "message": f"handoff {job.handoff_id}: {why}"})


def install(engine: "Engine") -> Enforcer:
    """Enforce contracts on ``engine``: its gate, before/after hooks and rejection logging."""
    enforcer = Enforcer(engine)
    engine.gates.append(enforcer.gate)
    engine.before_run.append(enforcer.before)
    engine.after_run.append(enforcer.after)
    engine.on_rejected.append(enforcer.rejected)
    engine.on_sweep.append(prune)  # drop reservations of handoffs no longer running
    return enforcer


# ------------------------------------------------------------ the compact worker envelope
def worker_envelope(engine: "Engine", handoff_id: str) -> dict[str, Any]:
    """``handoff render``: contract + context + escalation of a handoff, as seed 004 shapes them.
    Raises NotFound, or HandoffdError when the handoff carries no contract."""
    from ... import dialects

    state, doc = engine.get(handoff_id)
    block = book(doc)
    request = given if isinstance(given := block.get("request_snapshot"), dict) else doc
    try:
        env = dialects.detect(doc).envelope(doc)
    except (InvalidDocument, KeyError) as exc:
        raise HandoffdError(f"handoff {handoff_id} cannot be read as a request: {exc}",
                            handoff_id=handoff_id) from None
    if not isinstance(env.contract, dict):
        raise HandoffdError(f"handoff {handoff_id} carries no contract; add a top-level "
                            "\"contract\" block (or submit a seed-004 WorkerHandoff)",
                            handoff_id=handoff_id)
    contract = {"task_id": env.contract.get("task_id") or handoff_id}
    contract.update({k: v for k, v in env.contract.items() if k != "task_id"})
    context = given if isinstance(given := request.get("context"), dict) else {}
    escalation = given if isinstance(given := request.get("escalation"), dict) else {}
    return {"handoff_id": handoff_id, "state": state.value, "worker": env.target,
            "from": env.source, "contract": contract, "context": context, "escalation": escalation}


def prune(engine: "Engine") -> int:
    """Sweeper hook: drop the reservations of handoffs that are no longer running."""
    from .reservations import Reservations
    try:
        return Reservations(engine).prune()
    except (HandoffdError, OSError) as exc:  # the records refused or unusable now: one line
        # (not a traceback in every sweep), and the next sweep tries again
        log.error("cannot prune file reservations: %s; the next sweep tries again", _said(exc))
        return 0


def _said(exc: HandoffdError | OSError) -> str:
    """``exc`` as one log line says it, with its error code when it has one."""
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    code = getattr(exc, "code", None)
    return f"{exc} [{code}]" if code else str(exc)
