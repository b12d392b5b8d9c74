"""What one attempt of a contract handoff found: the :class:`Run` the before hook hands the after
hook, the :class:`Findings` of its review, and the violation entries they hold (scope creep,
unauthorized ``files_touched``, failed criteria), each a dict with ``kind`` and ``message``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.documents import Outcome
from . import patterns
from .contract import Contract

if TYPE_CHECKING:  # snapshots: loaded by the first contract that checks its scope (a listing
    # that asks the gates never does)
    from .snapshots import Change, Snapshot, Snapshotter

MAX_LISTED = 200
MESSAGE_FILES = 10
# unauthorized_touched: the worker's own files_touched names a file outside files_owned, which
# seed 004's validateCompletion refuses ("Touched unauthorized files") whatever was observed
FATAL_KINDS = ("scope_creep", "readonly_modified", "unauthorized_touched")


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
    criteria_changes: list[Change] = field(default_factory=list)  # made by the criteria's commands
    excused: list[dict[str, str]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    criteria: list[dict[str, Any]] = field(default_factory=list)
    reported: list[str] | None = None

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [v for v in self.violations if v.get("kind") in kinds]


def unauthorized(contract: Any, reported: list[str] | None) -> list[dict[str, Any]]:
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


def reported_touched(outcome: Outcome, directory: Path) -> list[str] | None:
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


def scope_creep(change: "Change") -> dict[str, Any]:
    """The violation for a change outside files_owned. git's own files (only a git-mode check
    watches them) say why they count: they decide which files that check sees."""
    message = f"{change.path}: {change.change} outside files_owned"
    parts = change.path.split("/")
    if parts[0] == ".." or ".git" in parts:
        message += " (git's ignore rules and config decide which files are watched)"
    return {"kind": "scope_creep", "path": change.path, "change": change.change, "message": message}


def criterion_failure(item: dict[str, Any]) -> str:
    """The message of a failed criterion ``item`` (a result of
    :func:`~handoffd.features.contracts.criteria.check`): timed out, could not run, or its exit
    code."""
    if item.get("timed_out"):
        return f"{item['criterion']!r} timed out after {item.get('duration_seconds')}s"
    if item.get("exit_code") is None:
        return f"{item['criterion']!r} could not run: {str(item.get('output_tail', '')).strip()[:200]}"
    return f"{item['criterion']!r} exited {item['exit_code']}"

