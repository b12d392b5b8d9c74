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
  pending/ without counting an attempt), then snapshot the contract directory;
* an ``after_run`` hook: compare the tree with the snapshot (files created, modified or deleted
  outside ``files_owned``, or any change to ``files_readonly``, fail with ``CONTRACT_VIOLATION``,
  never retried), compare the worker's ``files_touched`` with what was observed (a mismatch is
  recorded, see :func:`Enforcer.review`), run the checkable success criteria (a failure is
  ``VALIDATION_FAILED``), file every result under ``validation``, release the reservation, and
  append each violation to the learning log (:mod:`handoffd.features.contracts.violations`);
* a wrapper around ``Engine.reject`` logging ``dependency_missing`` when a contract handoff is
  failed by the dependencies gate.

Paths in a contract are relative to the contract directory (the workspace root unless ``cwd``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...core.documents import Envelope, Outcome, book
from ...core.errors import ErrorCode, HandlerError, HandoffdError, InvalidDocument
from ...core.logs import deferred
from ..dependencies import Verdict
from ..stores import violation_log
from . import criteria as criteria_mod
from . import patterns, violations
from .patterns import SCOPE_MODES
from .reservations import Reservations

if TYPE_CHECKING:  # snapshots: loaded by the first contract that checks its scope (a listing
    # that asks the gates never does)
    from ...core.engine import Engine, Job
    from .snapshots import Change, Snapshot, Snapshotter

log = deferred("handoffd.contracts")

STATE_KEY = "handoffd.contract"
DEFAULT_CRITERIA_TIMEOUT = 60.0
MAX_CRITERIA_TIMEOUT = 24 * 3600.0
MAX_LISTED = 200
MESSAGE_FILES = 10
# unauthorized_touched: the worker's own files_touched names a file outside files_owned, which
# seed 004's validateCompletion refuses ("Touched unauthorized files") whatever was observed
FATAL_KINDS = ("scope_creep", "readonly_modified", "unauthorized_touched")


@dataclass(frozen=True)
class Contract:
    """A parsed, checked contract. Patterns are normalised and relative to the contract directory."""

    task_id: str
    files_owned: tuple[str, ...] | None
    files_readonly: tuple[str, ...]
    dependencies: tuple[str, ...]
    criteria: tuple[str, ...]
    cwd: str
    criteria_timeout: float
    scope_check: str
    scope_ignore: tuple[str, ...]

    @property
    def checks_scope(self) -> bool:
        """True when there is something to watch (owned or read-only files)."""
        return self.files_owned is not None or bool(self.files_readonly)

    def owned_in_workspace(self) -> list[str]:
        """``files_owned`` relative to the workspace root (what reservations compare)."""
        return [patterns.join(self.cwd, p) for p in self.files_owned or ()]

    def directory(self, root: Path) -> Path:
        """The contract directory, resolved; InvalidDocument when it escapes ``root`` or is missing."""
        root = root.resolve()
        target = (root / self.cwd).resolve() if self.cwd else root
        if target != root and root not in target.parents:
            raise _invalid(self.task_id, f"contract.cwd {self.cwd!r} resolves outside the workspace")
        if not target.is_dir():
            raise _invalid(self.task_id, f"contract.cwd {self.cwd!r} is not a directory in the workspace")
        return target

    def summary(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "directory": self.cwd or ".",
                "files_owned": list(self.files_owned) if self.files_owned is not None else None,
                "files_readonly": list(self.files_readonly)}


def _invalid(handoff_id: str, message: str) -> InvalidDocument:
    return InvalidDocument(f"handoff {handoff_id}: {message}", handoff_id=handoff_id,
                           code=ErrorCode.SCHEMA_VALIDATION_FAILED)


def parse(env: Envelope) -> Contract | None:
    """The Envelope's contract, checked; None when it has none. Raises InvalidDocument."""
    raw = env.contract
    if raw is None:
        return None
    hid = env.handoff_id
    if not isinstance(raw, dict):
        raise _invalid(hid, "contract must be an object")

    def string_list(key: str, *, pattern: bool = False) -> tuple[str, ...] | None:
        value = raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _invalid(hid, f"contract.{key} must be a list of strings")
        if not pattern:
            return tuple(value)
        if len(value) > patterns.MAX_PATTERNS:  # every file is matched against them
            raise _invalid(hid, f"contract.{key} holds {len(value)} globs; at most "
                           f"{patterns.MAX_PATTERNS} are allowed")
        try:
            return tuple(patterns.validate(v) for v in value)
        except patterns.PatternError as exc:
            raise _invalid(hid, f"contract.{key}: {exc}") from None

    cwd_raw = raw.get("cwd", "")
    if cwd_raw is None:
        cwd_raw = ""
    if not isinstance(cwd_raw, str):
        raise _invalid(hid, "contract.cwd must be a string (a directory inside the workspace)")
    try:
        cwd = "/".join(patterns.split(cwd_raw))
    except patterns.PatternError as exc:
        raise _invalid(hid, f"contract.cwd: {exc}") from None
    timeout = raw.get("criteria_timeout_seconds", DEFAULT_CRITERIA_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= MAX_CRITERIA_TIMEOUT:
        raise _invalid(hid, "contract.criteria_timeout_seconds must be a number of seconds "
                       f"between 0 and {MAX_CRITERIA_TIMEOUT:.0f}")
    mode = raw.get("scope_check", "auto")
    if mode not in SCOPE_MODES:
        raise _invalid(hid, f"contract.scope_check must be one of {', '.join(SCOPE_MODES)}")
    task_id = raw.get("task_id", hid)
    return Contract(
        task_id=task_id if isinstance(task_id, str) and task_id else hid,
        files_owned=string_list("files_owned", pattern=True),
        files_readonly=string_list("files_readonly", pattern=True) or (),
        dependencies=string_list("dependencies_completed") or (),
        criteria=string_list("success_criteria") or (),
        cwd=cwd, criteria_timeout=float(timeout), scope_check=mode,
        scope_ignore=string_list("scope_ignore", pattern=True) or (),
    )


@dataclass
class Run:
    """What the before hook hands the after hook for one attempt."""

    contract: Contract
    directory: Path
    started: float
    reserved: bool = False
    snapshotter: Snapshotter | None = None
    before: Snapshot | None = None


@dataclass
class Findings:
    """What one attempt's review found."""

    changes: list[Change] = field(default_factory=list)
    excused: list[dict[str, str]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    criteria: list[dict[str, Any]] = field(default_factory=list)
    reported: list[str] | None = None

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [v for v in self.violations if v.get("kind") in kinds]


class Enforcer:
    """The gate and hooks one Engine uses to enforce contracts."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.reservations = Reservations(engine)
        # the store's log (one for every host of a PostgreSQL store), else .meta/violations.jsonl
        self.log = violation_log(engine.ws, engine.backend)

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
        return Verdict.wait(conflict.reason()) if conflict is not None else None

    # ------------------------------------------------------------ before the handler
    def before(self, job: "Job") -> None:
        """Reserve files_owned (or hand the claim back) and snapshot the contract directory."""
        contract = parse(job.envelope)
        if contract is None:
            return
        directory = contract.directory(self.engine.ws.root)
        run = Run(contract, directory, time.time())
        owned = contract.owned_in_workspace()
        if owned:
            try:
                conflict = self.reservations.take(job.handoff_id, job.claim.token, owned,
                                                  agent=job.specialist.agent)
            except HandoffdError as exc:
                raise HandlerError(str(exc), handoff_id=job.handoff_id, retryable=True) from None
            if conflict is not None:
                self.engine.handback(job.claim, job.dialect, reason=conflict.reason())
                log.info("handoff %s: %s; handed back to pending/", job.handoff_id, conflict.reason())
                raise HandlerError(f"handoff {job.handoff_id}: {conflict.reason()}; handed back to "
                                   "pending/ (no attempt counted)", handoff_id=job.handoff_id,
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
            except (OSError, ValueError) as exc:
                raise HandlerError(f"handoff {job.handoff_id}: cannot snapshot the contract "
                                   f"directory: {exc}", handoff_id=job.handoff_id,
                                   retryable=True) from None

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
        self.record(job.envelope, "dependency_missing",
                    {"message": message, "dependencies": job.envelope.depends_on},
                    task_id=contract.task_id if contract else None, attempt=job.claim.attempt)

    def after(self, job: "Job", outcome: Outcome) -> Outcome:
        """Review the attempt against its contract; always releases the reservation."""
        run = job.context.feature_state.pop(STATE_KEY, None)
        if not isinstance(run, Run):
            return outcome
        try:
            if job.context.handback or outcome.status == "cancelled":
                return outcome  # the attempt does not count / the coordinator stopped it
            return self.review(job, run, outcome)
        except Exception as exc:  # a checking fault must not let unchecked work complete
            log.exception("handoff %s: contract check failed", job.handoff_id)
            return dataclasses.replace(outcome, status="failed", finished_at=self.engine.clock(),
                                       error={"code": ErrorCode.PROCESSING_ERROR, "retryable": True,
                                              "message": f"handoff {job.handoff_id}: the contract "
                                                         f"check failed: {type(exc).__name__}: {exc}"})
        finally:
            if run.reserved:
                try:
                    self.reservations.release(job.handoff_id, job.claim.token)
                except Exception:  # liveness is derived from the claim: it dies with it anyway
                    log.exception("handoff %s: cannot release its reservation", job.handoff_id)

    def review(self, job: "Job", run: Run, outcome: Outcome) -> Outcome:
        """Scope, files_touched, criteria; returns the (possibly replaced) outcome.

        Decision on ``files_touched``: a mismatch between the worker's report and what was observed
        is recorded (``validation.violations``, a warning, the learning log) but does not fail the
        handoff by itself. Every change it could hide is observed anyway, so an out-of-scope change
        fails as ``scope_creep`` whatever the worker reported.
        """
        contract = run.contract
        found = Findings(reported=_reported_touched(outcome, run.directory))
        found.violations += _unauthorized(contract, found.reported)
        if run.snapshotter is not None and run.before is not None:
            from .snapshots import ScopeUnverifiable  # loaded already: run.snapshotter is one
            try:
                found.changes, _ = run.snapshotter.changes(run.before)
            except ScopeUnverifiable as exc:  # fail closed, with the one line git gave
                log.error("handoff %s: %s", job.handoff_id, exc)
                found.violations.append({"kind": "scope_creep", "path": ".", "change": "unverifiable",
                                         "error": str(exc), "message": str(exc)})
            else:
                self._classify(job, run, found)
        fatal = found.of_kind(*FATAL_KINDS)
        if contract.criteria:
            if fatal:
                note = "not run: the contract was violated"
            elif not outcome.succeeded:
                note = f"not run: the handler ended {outcome.status}"
            else:
                note = ""
            found.criteria = self._criteria(job, run, note)
            for item in found.criteria:
                if item["status"] == "failed":
                    found.violations.append({
                        "kind": "criteria_failed", "criterion": item["criterion"],
                        "exit_code": item.get("exit_code"), "timed_out": bool(item.get("timed_out")),
                        "message": _criterion_failure(item)})
        self._log(job, run, found)
        return self._outcome(job, run, outcome, found)

    def _classify(self, job: "Job", run: Run, found: Findings) -> None:
        contract = run.contract
        neighbours = self.reservations.neighbours(job.handoff_id, run.started) \
            if contract.files_owned is not None else []
        observed: list[Change] = []
        for change in found.changes:
            if change.path.startswith("../"):  # git's own state, above the contract directory:
                observed.append(change)      # no pattern (relative to the directory) can own it
                if contract.files_owned is not None:
                    found.violations.append(_scope_creep(change))
                continue
            readonly = patterns.first_match(contract.files_readonly, change.path)
            if readonly is not None:
                found.violations.append({"kind": "readonly_modified", "path": change.path,
                                         "change": change.change, "pattern": readonly,
                                         "message": f"{change.path}: {change.change} (read-only)"})
                observed.append(change)
                continue
            if contract.files_owned is None or patterns.any_match(contract.files_owned, change.path):
                observed.append(change)
                continue
            ws_path = patterns.join(contract.cwd, change.path)
            owner = next((r["handoff_id"] for r in neighbours
                          if patterns.any_match(tuple(p for p in r["patterns"] if isinstance(p, str)),
                                                ws_path)), None)
            if owner is not None:  # owned by a handoff that ran meanwhile: its change, not ours
                found.excused.append({"path": change.path, "change": change.change, "owner": owner})
                continue
            observed.append(change)
            found.violations.append(_scope_creep(change))
        if found.reported is not None:
            seen = {c.path for c in observed}
            claimed = set(found.reported)
            unreported, unobserved = sorted(seen - claimed), sorted(claimed - seen)
            if unreported or unobserved:
                parts = []
                if unreported:
                    parts.append("changed but not reported: " + ", ".join(unreported[:MESSAGE_FILES]))
                if unobserved:
                    parts.append("reported but not changed: " + ", ".join(unobserved[:MESSAGE_FILES]))
                found.violations.append({"kind": "files_touched_mismatch",
                                         "not_reported": unreported[:MAX_LISTED],
                                         "not_observed": unobserved[:MAX_LISTED],
                                         "message": "files_touched does not match the observed "
                                                    "changes: " + "; ".join(parts)})

    def _criteria(self, job: "Job", run: Run, note: str) -> list[dict[str, Any]]:
        results = []
        env = dict(os.environ, HANDOFF_ID=job.handoff_id, HANDOFF_TASK_ID=run.contract.task_id,
                   HANDOFFD_ROOT=str(self.engine.ws.root), PYTHONDONTWRITEBYTECODE="1")
        for criterion in run.contract.criteria:
            if note and criteria_mod.parse(criterion) is not None:
                kind, command = criteria_mod.parse(criterion) or ("", "")
                results.append({"criterion": criterion, "kind": kind, "command": command,
                                "status": "unchecked", "note": note})
                continue
            results.append(criteria_mod.check(criterion, cwd=run.directory,
                                              timeout=run.contract.criteria_timeout, env=env))
        return results

    # ------------------------------------------------------------ filing the findings
    def _outcome(self, job: "Job", run: Run, outcome: Outcome, found: Findings) -> Outcome:
        contract = run.contract
        fatal = found.of_kind(*FATAL_KINDS)
        failed_criteria = found.of_kind("criteria_failed")
        errors = [{"field": v["path"], "error": v.get("error") or f"{v['change']} "
                   + ("(read-only file)" if v["kind"] == "readonly_modified" else "outside files_owned"),
                   "kind": v["kind"]} for v in fatal]
        errors += [{"field": v["criterion"], "error": v["message"], "kind": v["kind"]}
                   for v in failed_criteria]
        validation = dict(outcome.validation or {})
        validation.update({
            "status": "failed" if errors else "passed",
            "contract": contract.summary(),
            "criteria": found.criteria,
            "violations": found.violations[:MAX_LISTED],
            "errors": errors[:MAX_LISTED],
        })
        if run.before is not None:
            changes = [{"path": c.path, "change": c.change} for c in found.changes]
            validation["scope"] = {"checked": True, "mode": run.before.mode,
                                   "changes": changes[:MAX_LISTED], "excused": found.excused[:MAX_LISTED],
                                   "files_touched_reported": found.reported}
            if len(changes) > MAX_LISTED:
                validation["scope"]["changes_truncated"] = len(changes) - MAX_LISTED
            if run.before.note:
                validation["scope"]["note"] = run.before.note
        else:
            validation["scope"] = {"checked": False,
                                   "note": "the contract names neither files_owned nor files_readonly"}
        warnings = list(outcome.warnings)
        warnings += [f"contract: {v['message']}" for v in found.of_kind("files_touched_mismatch")]
        metadata = outcome.metadata
        if job.dialect.name != "native" and found.criteria:  # seed 004's report reads them here
            metadata = dict(metadata or {}, success_criteria=found.criteria)
        new = dataclasses.replace(outcome, validation=_printable(validation),
                                  warnings=_printable(warnings), metadata=metadata)
        if fatal:
            listed = "; ".join(v["message"] for v in fatal[:MESSAGE_FILES])
            more = f" (and {len(fatal) - MESSAGE_FILES} more)" if len(fatal) > MESSAGE_FILES else ""
            return self._fail(new, ErrorCode.CONTRACT_VIOLATION,
                              f"handoff {job.handoff_id} broke its contract: {listed}{more}",
                              found.violations)
        if failed_criteria:
            listed = "; ".join(v["message"] for v in failed_criteria)
            return self._fail(new, ErrorCode.VALIDATION_FAILED,
                              f"handoff {job.handoff_id}: success criteria failed: {listed}",
                              found.violations)
        return new

    def _fail(self, outcome: Outcome, code: str, message: str,
              found: list[dict[str, Any]]) -> Outcome:
        error = _printable({"code": code, "message": message, "retryable": False,
                            "violations": found[:MAX_LISTED]})
        return dataclasses.replace(outcome, status="failed", error=error,
                                   finished_at=self.engine.clock())

    def _log(self, job: "Job", run: Run, found: Findings) -> None:
        grouped: dict[str, list[dict[str, Any]]] = {}
        for item in found.violations:
            grouped.setdefault(item["kind"], []).append(item)
        for kind, items in grouped.items():
            details: dict[str, Any] = {"count": len(items),
                                       "message": "; ".join(i["message"] for i in items[:MESSAGE_FILES])}
            if kind in FATAL_KINDS:
                details["files"] = [{"path": i["path"], "change": i["change"]} for i in items[:50]]
            elif kind == "criteria_failed":
                details["criteria"] = [{"criterion": i["criterion"], "exit_code": i["exit_code"],
                                        "timed_out": i["timed_out"]} for i in items]
            else:
                details.update({k: v for k, v in items[0].items() if k in ("not_reported", "not_observed")})
            self.record(job.envelope, kind, details, attempt=job.claim.attempt,
                        task_id=run.contract.task_id, agent=job.specialist.agent)

    def record(self, env: Envelope, kind: str, details: dict[str, Any], *, attempt: int | None = None,
               task_id: str | None = None, agent: str | None = None) -> None:
        """Append one learning signal; a failing log write is reported, never fatal."""
        try:
            violations.append(self.log, {
                "kind": kind, "task_id": task_id or env.handoff_id, "handoff_id": env.handoff_id,
                "agent": agent or env.target, "source": env.source, "dialect": env.dialect,
                "attempt": attempt, "details": _printable(details)})
        except Exception as exc:  # a full disk, the database away: the outcome stands
            log.error("handoff %s: cannot append to the violations log: %s", env.handoff_id, exc)


def _unauthorized(contract: Any, reported: list[str] | None) -> list[dict[str, Any]]:
    """Seed 004's validateCompletion: each ``files_touched`` entry the worker reported outside
    ``files_owned`` is a violation ("Touched unauthorized files"), and a report with one cannot
    complete ("Can't complete with contract violations"), whether or not the file changed."""
    if reported is None or contract.files_owned is None:
        return []
    outside = [path for path in reported if not patterns.any_match(contract.files_owned, path)]
    return [{"kind": "unauthorized_touched", "path": path, "change": "reported",
             "error": "reported in files_touched, outside files_owned",
             "message": f"{path}: reported in files_touched, outside files_owned"}
            for path in outside[:MAX_LISTED]]


def _reported_touched(outcome: Outcome, directory: Path) -> list[str] | None:
    """The worker's own ``files_touched`` (output, else metadata), normalised; None if absent."""
    for holder in (outcome.output, outcome.metadata):
        if isinstance(holder, dict) and isinstance(holder.get("files_touched"), list):
            out = []
            for item in holder["files_touched"]:
                if not isinstance(item, str) or not item.strip():
                    continue
                text = item.strip()
                if os.path.isabs(text):
                    try:
                        text = Path(text).resolve().relative_to(directory).as_posix()
                    except ValueError:
                        pass
                try:
                    out.append("/".join(patterns.split(text)) or text)
                except patterns.PatternError:
                    out.append(text)
            return sorted(set(out))
    return None


def _scope_creep(change: "Change") -> dict[str, Any]:
    """The violation for a change outside files_owned. git's own files (only a git-mode check
    watches them) say why they count: they decide which files that check sees."""
    message = f"{change.path}: {change.change} outside files_owned"
    parts = change.path.split("/")
    if parts[0] == ".." or ".git" in parts:
        message += " (git's ignore rules and config decide which files are watched)"
    return {"kind": "scope_creep", "path": change.path, "change": change.change, "message": message}


def _printable(value: Any) -> Any:
    """``value`` with every string made encodable as UTF-8, for the filed document and the log.
    A file name that is not UTF-8 arrives with lone surrogates (``os.fsdecode``) and is shown
    with its bytes escaped (``src/\\xff.py``): one such name must not make the outcome unfileable."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no file name decodes to: escape it as text
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return raw.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(item) for item in value]
    return value


def _criterion_failure(item: dict[str, Any]) -> str:
    if item.get("timed_out"):
        return f"{item['criterion']!r} timed out after {item.get('duration_seconds')}s"
    if item.get("exit_code") is None:
        return f"{item['criterion']!r} could not run: {str(item.get('output_tail', '')).strip()[:200]}"
    return f"{item['criterion']!r} exited {item['exit_code']}"


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
    try:
        return Reservations(engine).prune()
    except OSError as exc:
        log.error("cannot prune file reservations: %s", exc)
        return 0
