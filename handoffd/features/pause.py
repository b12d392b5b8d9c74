"""Pause and resume: hold back new work for one specialist, or for the whole workspace.

``handoff pause @agent`` / ``handoff pause --all`` record the pause in the store's shared records
(files: ``handoffs/.meta/paused.json``; PostgreSQL: a table every host reads), so it survives
restarts and every daemon of the store obeys it. A gate keeps paused work in pending/ ("paused:
..." in ``handoff ls``); handoffs already running finish. ``handoff resume`` lifts it; serving
daemons pick the work up at their next rescan. Until then a daemon does not read a paused
handoff again unless its document changes (a rescan compares its stamp): a resume is a change of
the records, which the daemon's scans look at, and queue what it lifts.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..core.documents import Envelope
from ..core.engine import Verdict
from ..core.errors import UsageError
from ..core.storage import Records
from ..core.timeutil import iso, utc_now

if TYPE_CHECKING:
    from ..core.engine import Engine

ALL = "*"  # the key of a workspace-wide pause
KIND = "paused"  # the records' kind (files: handoffs/.meta/paused.json)
CACHE_SECONDS = 0.5


class Pauses:
    """The store's pauses: agent id (or ``*``) -> ``{"at", "by", "reason"}``."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self._cached: tuple[float, dict[str, Any]] | None = None

    def current(self) -> dict[str, Any]:
        """The pauses in force. A gate asks for every dispatch: the answer is kept for
        CACHE_SECONDS, so a pause or resume reaches every daemon within that."""
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > CACHE_SECONDS:
            # an entry that is not an object (a hand-edited or damaged record) is no pause
            self._cached = (now, {agent: entry for agent, entry in self.records.read(KIND).items()
                                  if isinstance(entry, dict)})
        return self._cached[1]

    def set(self, agent: str, *, paused: bool, by: str, reason: str = "") -> dict[str, Any]:
        """Pause (or resume) ``agent`` (``*``: everything); returns the pauses now in force."""
        if not agent or (agent != ALL and not agent.strip()):
            raise UsageError("name a specialist (e.g. @coder) or use --all")
        self._cached = None
        if paused:
            entry = {"at": iso(utc_now()), "by": by, "reason": reason}
            self.records.update(KIND, agent, lambda _old: entry)
        elif agent == ALL and not self.current().get(ALL):
            for key in self.current():  # resume --all with no workspace pause: lift every pause
                self.records.update(KIND, key, lambda _old: None)
        else:
            self.records.update(KIND, agent, lambda _old: None)
        self._cached = None
        return self.current()

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


class QuietWaits(Protocol):
    """What the pause feature uses of a daemon's scheduler (see handoffd.service.scheduler)."""

    def add_quiet_check(self, check: Callable[[str], bool]) -> None: ...


class DaemonPlugins(Protocol):
    """What the pause feature uses of a daemon (its public plugin API, and its scheduler's)."""

    scheduler: QuietWaits

    def queue(self, handoff_id: str) -> None: ...
    def add_scan_hook(self, hook: Callable[[], None]) -> None: ...


def install(engine: Engine) -> None:
    """The pause feature: a gate that holds back paused work, and a daemon's look at it again
    once its pause is lifted."""
    pauses = Pauses(engine.backend.records())
    held: dict[str, str] = {}  # id -> agent: what the gate holds back (dropped once queued)
    lock = threading.Lock()

    def pause_gate(engine: Engine, env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        if not held and not pauses.current():  # nothing paused nor held back: the usual answer
            return None
        spec = engine.specialist_for(env)
        agent = spec.agent if spec else env.target
        why = pauses.why(agent)
        if not why:
            if env.handoff_id in held:  # rewritten for an agent that is not paused
                with lock:
                    held.pop(env.handoff_id, None)
            return None
        with lock:
            held[env.handoff_id] = agent
        # no filing ends a pause (on=None re-read every paused handoff at every filing: 10,000
        # paused ones made another specialist's pick-up 0.8 s): a resume is a change of the
        # records, which the daemon's scans look for (below)
        return Verdict.wait(why, on=())

    def attach(daemon: DaemonPlugins) -> None:
        def look() -> None:
            """At each scan, queue what the gate held back and is no longer paused (a rescan
            alone skips a waiter queued for its deadline, e.g. an ``expires_at``)."""
            now = pauses.current()
            if ALL in now:
                return
            with lock:
                lifted = [hid for hid, agent in held.items() if agent not in now]
                for handoff_id in lifted:
                    del held[handoff_id]
            for handoff_id in lifted:
                daemon.queue(handoff_id)

        def still_paused(handoff_id: str) -> bool:
            """The gate last held ``handoff_id`` back for a pause still in force: only a resume
            (``look`` queues it) or a change of its document (a rescan sees its stamp change)
            ends its wait, so a rescan need not read it again."""
            agent = held.get(handoff_id)
            if agent is None:
                return False
            now = pauses.current()
            return ALL in now or agent in now

        daemon.add_scan_hook(look)
        daemon.scheduler.add_quiet_check(still_paused)

    engine.gates.insert(0, pause_gate)  # first: a paused handoff is not even looked at further
    engine.daemon_plugins.append(attach)


def pauses_of(engine: Engine) -> Pauses:
    """The pauses of ``engine``'s store (for the CLI)."""
    return Pauses(engine.backend.records())
