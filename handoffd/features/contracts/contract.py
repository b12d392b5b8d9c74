"""A contract read from a handoff's Envelope (seed 004): :func:`parse` checks it into a
:class:`Contract`, or raises InvalidDocument (``SCHEMA_VALIDATION_FAILED``).

The fields and handoffd's extensions are listed in :mod:`handoffd.features.contracts.feature`.
Patterns are normalised and relative to the contract directory (the workspace root unless
``cwd``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.documents import Envelope
from ...core.errors import ErrorCode, InvalidDocument
from . import patterns
from .patterns import SCOPE_MODES

DEFAULT_CRITERIA_TIMEOUT = 60.0
MAX_CRITERIA_TIMEOUT = 24 * 3600.0


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
        own = (root / "handoffs").resolve()  # (handoffs/ may be a link to elsewhere)
        if target == own or own in target.parents:  # handoffd's own files change at every filing
            raise _invalid(self.task_id, f"contract.cwd {self.cwd!r} is inside handoffs/, "
                           "handoffd's own folder: a contract watches the project's files")
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
