"""``handoffd db import``: move a files workspace's handoffs into the PostgreSQL store.

Pending documents are ingested as the file bridge ingests new files (raw: admission validates
them; their results come back to this workspace's completed/ or failed/) and removed from
pending/. Finished documents are copied in with their state and kept where they are (agents may
still read them). Idempotent by id: what the database holds already is left alone, so the
command can be run again after an interruption. In-progress documents are not moved: stop the
files daemon (it hands them back to pending/) or let them finish, then import again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ...core.states import State
from ..files.backend import FilesBackend
from .backend import PostgresBackend
from .bridge import FileBridge


@dataclass
class ImportReport:
    """What one import did, by state."""

    imported: dict[str, int] = field(default_factory=lambda: {"pending": 0, "completed": 0,
                                                              "failed": 0})
    already: int = 0
    set_aside: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One summary line."""
        text = (f"imported {self.imported['pending']} pending, {self.imported['completed']} "
                f"completed, {self.imported['failed']} failed; {self.already} already there")
        if self.set_aside:
            text += f"; set aside {len(self.set_aside)}"
        if self.unreadable:
            text += f"; unreadable (left in place) {len(self.unreadable)}"
        if self.in_progress:
            text += (f"; {len(self.in_progress)} in progress left in place (stop the files "
                     "daemon or let them finish, then import again)")
        return text


def import_workspace(backend: PostgresBackend, files: FilesBackend, bridge: FileBridge,
                     now: datetime) -> ImportReport:
    """Move ``files``' pending and finished documents into ``backend`` (see the module doc)."""
    report = ImportReport()
    for handoff_id in files.ids(State.PENDING):
        outcome = bridge.ingest(handoff_id)
        if outcome == "ingested":
            report.imported["pending"] += 1
        elif outcome == "known":
            report.already += 1
        elif outcome == "set aside":
            report.set_aside.append(handoff_id)
        elif outcome == "later":
            report.unreadable.append(handoff_id)
    for state in (State.COMPLETED, State.FAILED):
        for row in files.list(state=state, order="oldest", unreadable=True):
            if row.problem is not None:
                report.unreadable.append(row.id)
            elif backend.import_finished(row.id, state, row.doc, row.updated_at):
                report.imported[state.value] += 1
            else:
                report.already += 1
    report.in_progress = files.ids(State.IN_PROGRESS)
    return report
