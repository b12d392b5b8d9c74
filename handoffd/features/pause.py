"""Pause and resume: hold back new work for one specialist, or for the whole workspace.

``handoff pause @agent`` / ``handoff pause --all`` record the pause in the workspace
(``handoffs/.meta/paused.json``), so it survives restarts and every daemon of the workspace obeys
it. A gate keeps paused work in pending/ ("paused: ..." in ``handoff ls``); handoffs already running
finish. ``handoff resume`` lifts it; serving daemons pick the work up at their next rescan.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.documents import Envelope
from ..core.engine import Verdict
from ..core.errors import UsageError
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace

if TYPE_CHECKING:
    from ..core.engine import Engine

ALL = "*"  # the key of a workspace-wide pause
FILE = "paused.json"


@dataclass
class _Cached:
    stamp: tuple[int, int]
    pauses: dict[str, Any]


class Pauses:
    """The workspace's pauses: agent id (or ``*``) -> ``{"at", "by", "reason"}``."""

    def __init__(self, ws: Workspace) -> None:
        self.path = ws.meta / FILE
        self._cache: _Cached | None = None

    def current(self) -> dict[str, Any]:
        """The pauses in force (re-read only when the file changed: a gate asks often)."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return {}
        stamp = (info.st_mtime_ns, info.st_size)
        if self._cache is None or self._cache.stamp != stamp:
            try:
                loaded = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                loaded = {}  # unreadable: nothing is paused (never a stuck queue by accident)
            self._cache = _Cached(stamp, loaded if isinstance(loaded, dict) else {})
        return self._cache.pauses

    def set(self, agent: str, *, paused: bool, by: str, reason: str = "") -> dict[str, Any]:
        """Pause (or resume) ``agent`` (``*``: everything); returns the pauses now in force."""
        if not agent or (agent != ALL and not agent.strip()):
            raise UsageError("name a specialist (e.g. @coder) or use --all")
        pauses = dict(self.current())
        if paused:
            pauses[agent] = {"at": iso(utc_now()), "by": by, "reason": reason}
        elif agent == ALL and not pauses.get(ALL):
            pauses = {}  # resume --all with no workspace pause: lift every pause
        else:
            pauses.pop(agent, None)
        self._write(pauses)
        return pauses

    def _write(self, pauses: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(pauses, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)  # readers see the old record or the new one, never half

    def why(self, agent: str) -> str | None:
        """Why ``agent``'s work is held back, or None."""
        pauses = self.current()
        for key, label in ((ALL, "the workspace is paused"), (agent, f"{agent} is paused")):
            entry = pauses.get(key)
            if isinstance(entry, dict):
                detail = f" by {entry.get('by')}" if entry.get("by") else ""
                reason = f": {entry['reason']}" if entry.get("reason") else ""
                return f"paused: {label}{detail} since {entry.get('at')}{reason}; " \
                       f"`handoff resume {'--all' if key == ALL else agent}` lifts it"
        return None


def install(engine: Engine) -> None:
    """The pause feature: a gate that holds back paused work."""
    pauses = Pauses(engine.ws)

    def pause_gate(engine: Engine, env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        spec = engine.specialist_for(env)
        why = pauses.why(spec.agent if spec else env.target)
        return Verdict.wait(why) if why else None

    engine.gates.insert(0, pause_gate)  # first: a paused handoff is not even looked at further


def pauses_of(root: Path) -> Pauses:
    """The pauses of the workspace at ``root`` (for the CLI)."""
    return Pauses(Workspace(root))
