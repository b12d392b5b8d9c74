"""The after-run half of a contract's enforcement: :class:`Review` checks one attempt (scope,
``files_touched``, success criteria), turns its findings into the verdict filed with the outcome
(``CONTRACT_VIOLATION``, ``VALIDATION_FAILED`` or passed, under ``validation``) and appends them
to the learning log (:mod:`handoffd.features.contracts.violations`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ...core.documents import Envelope, Outcome
from ...core.errors import ErrorCode, is_shortage
from ...core.logs import deferred
from . import criteria as criteria_mod
from . import patterns, violations
from .findings import (FATAL_KINDS, MAX_LISTED, MESSAGE_FILES, Findings, Run, criterion_failure,
                       reported_touched, scope_creep, unauthorized)

if TYPE_CHECKING:  # snapshots: loaded by the first contract that checks its scope (a listing
    # that asks the gates never does)
    from ...core.engine import Engine, Job
    from ...core.storage import ViolationLog
    from .reservations import Reservations
    from .snapshots import Change, Snapshot

log = deferred("handoffd.contracts")
CRITERIA_SUFFIX = " while the success criteria ran"


class Review:
    """The verdict on a contract's attempts, for the
    :class:`~handoffd.features.contracts.feature.Enforcer` that made it (at its first use)."""

    def __init__(self, engine: Engine, reservations: Reservations, log: ViolationLog) -> None:
        self.engine = engine
        self.reservations = reservations
        self.log = log  # the violations log (the module's ``log`` is the logger)

    def review(self, job: "Job", run: Run, outcome: Outcome) -> Outcome:
        """Scope, files_touched, criteria; returns the (possibly replaced) outcome.

        Decision on ``files_touched``: a mismatch between the worker's report and what was observed
        is recorded (``validation.violations``, a warning, the learning log) but does not fail the
        handoff by itself. Every change it could hide is observed anyway, so an out-of-scope change
        fails as ``scope_creep`` whatever the worker reported.
        """
        contract = run.contract
        found = Findings(reported=reported_touched(outcome, run.directory))
        found.violations += unauthorized(contract, found.reported)
        after = None
        if run.snapshotter is not None and run.before is not None:
            from .snapshots import ScopeUnverifiable  # loaded already: run.snapshotter is one
            try:
                found.changes, after = self._changes(job, run, run.before)
            except ScopeUnverifiable as exc:  # fail closed, with the one line git gave
                log.error("handoff %s: %s", job.handoff_id, exc)
                found.violations.append(_unverifiable(str(exc)))
            else:
                self._compare_reported(found, self._classify(job, run, found, found.changes))
        fatal = found.of_kind(*FATAL_KINDS)
        if contract.criteria:
            if fatal:
                note = "not run: the contract was violated"
            elif not outcome.succeeded:
                note = f"not run: the handler ended {outcome.status}"
            else:
                note = ""
            found.criteria = self._criteria(job, run, note)
            if after is not None and any("argv" in item for item in found.criteria):
                self._after_criteria(job, run, found, after)
            for item in found.criteria:
                if item["status"] == "failed":
                    found.violations.append({
                        "kind": "criteria_failed", "criterion": item["criterion"],
                        "exit_code": item.get("exit_code"), "timed_out": bool(item.get("timed_out")),
                        "message": criterion_failure(item)})
        self._log(job, run, found)
        return self._outcome(job, run, outcome, found)

    def _after_criteria(self, job: "Job", run: Run, found: Findings, after: "Snapshot") -> None:
        """Look at the tree again once the criteria ran: their commands are the worker's code
        (its tests), and what they change is judged like the handler's own changes, each
        violation saying it happened while the success criteria ran."""
        from .snapshots import ScopeUnverifiable
        assert run.snapshotter is not None
        first = len(found.violations)
        try:
            changes, _ = self._changes(job, run, after)
        except ScopeUnverifiable as exc:
            found.violations.append(_unverifiable(str(exc)))
        else:
            found.criteria_changes = changes
            self._classify(job, run, found, changes)
        for violation in found.violations[first:]:
            violation["message"] += CRITERIA_SUFFIX
            if violation.get("error"):
                violation["error"] += CRITERIA_SUFFIX
            else:
                violation["error"] = (f"{violation['change']} (read-only file)"
                                      if violation["kind"] == "readonly_modified"
                                      else f"{violation['change']} outside files_owned") + CRITERIA_SUFFIX

    @staticmethod
    def _changes(job: "Job", run: Run, before: "Snapshot") -> tuple[list["Change"], "Snapshot"]:
        """``run.snapshotter.changes(before)``, made again after a wait while it runs short
        (EMFILE opening a folder or starting git: the daemon's shortage, no fact of the tree's).
        Only the comparison is made again, which only reads: never the criteria, nor the whole
        review. Still short after every wait (or stopped meanwhile): ScopeUnverifiable, as an
        unreadable tree is."""
        from .shortages import wait_out
        from .snapshots import ScopeUnverifiable
        assert run.snapshotter is not None
        waits = 0
        while True:
            try:
                return run.snapshotter.changes(before)
            except OSError as exc:
                if not is_shortage(exc):
                    raise
                if not wait_out(exc, waits, f"handoff {job.handoff_id}: its scope could not be "
                                "compared", job.context.cancelled):
                    raise ScopeUnverifiable("the scope cannot be verified: after the handler "
                                            f"ran, cannot read the contract directory: "
                                            f"{exc.strerror or exc}") from None
                waits += 1

    def _classify(self, job: "Job", run: Run, found: Findings, changes: list["Change"]) -> list["Change"]:
        """Judge ``changes`` (violations and excuses into ``found``); the changes counted as
        this attempt's own."""
        contract = run.contract
        neighbours = self.reservations.neighbours(job.handoff_id, run.started) \
            if contract.files_owned is not None else []
        observed: list[Change] = []
        confirmed: dict[str, tuple[str, ...]] = {}

        def owns(record: dict[str, Any]) -> tuple[str, ...]:
            hid = record["handoff_id"]
            if hid not in confirmed:
                confirmed[hid] = self.reservations.confirmed(record)
            return confirmed[hid]
        for change in changes:
            if change.path.startswith("../"):  # git's own state, above the contract directory:
                observed.append(change)      # no pattern (relative to the directory) can own it
                if contract.files_owned is not None:
                    found.violations.append(scope_creep(change))
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
            # a record's patterns only point at a candidate (the records lie in the workspace,
            # where a worker can write): the owner is one whose own document owns the path
            owner = next((r["handoff_id"] for r in neighbours
                          if patterns.any_match(tuple(p for p in r["patterns"] if isinstance(p, str)),
                                                ws_path)
                          and patterns.any_match(owns(r), ws_path)), None)
            if owner is not None:  # owned by a handoff that ran meanwhile: its change, not ours
                found.excused.append({"path": change.path, "change": change.change, "owner": owner})
                continue
            observed.append(change)
            found.violations.append(scope_creep(change))
        return observed

    @staticmethod
    def _compare_reported(found: Findings, observed: list["Change"]) -> None:
        """A ``files_touched_mismatch`` when the worker's report differs from ``observed``."""
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
                                              timeout=run.contract.criteria_timeout, env=env,
                                              cancelled=job.context.cancelled))
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
            if found.criteria_changes:
                validation["scope"]["changes_by_criteria"] = [
                    {"path": c.path, "change": c.change} for c in found.criteria_changes][:MAX_LISTED]
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


def _unverifiable(message: str) -> dict[str, Any]:
    """The violation of a scope git can no longer list (fail closed, git's one line)."""
    return {"kind": "scope_creep", "path": ".", "change": "unverifiable", "error": message,
            "message": message}


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

