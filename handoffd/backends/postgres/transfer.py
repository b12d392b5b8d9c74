"""``handoffd db import``: move a files workspace's handoffs, shared context and violations log
into the PostgreSQL store.

Pending documents are ingested as the file bridge ingests new files (their results come back
to this workspace's completed/ or failed/) and removed from pending/: raw, admission validates
them, unless this workspace's seal says handoffd wrote their bookkeeping, which is then kept (a
scheduled retry stays due when it was, with its attempts; a parked parent stays parked). Finished documents are copied in with their state and kept where they are (agents may
still read them). Idempotent by id: what the database holds already is left alone, so the
command can be run again after an interruption. In-progress documents are not moved: stop the
files daemon (it hands them back to pending/) or let them finish, then import again.

Context values (``context/<key>.json``) are copied in byte for byte as revision 1 of each key the
database does not hold yet, by ``@import`` (an operator's move: namespace permissions are not
asked; the local ``.history.jsonl`` stays in the folder), so the daemon's mirror finds the files
already alike. Violations log entries are appended unless the database's log has them already.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...core.errors import ErrorCode, InvalidDocument
from ...core.keys import normalise_key
from ...core.states import State
from ...core.storage import trusted_doc
from ...core.timeutil import iso
from ..files.backend import FilesBackend
from ..files.context import FileContext
from ..files.violations import LOG_NAME, FileViolationLog
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
    context: int = 0  # context keys copied in
    context_already: int = 0
    violations: int = 0  # violations log entries copied in

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
        text += (f"; context: {self.context} keys ({self.context_already} already there); "
                 f"violations: {self.violations} entries")
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
            # the bookkeeping handoffd sealed, not a foreign consumer's block: the database
            # trusts every block it holds, so an unsealed one must not come in as ours
            elif backend.import_finished(row.id, state, trusted_doc(files, state, row.id, row.doc),
                                         row.updated_at):
                report.imported[state.value] += 1
            else:
                report.already += 1
    report.in_progress = files.ids(State.IN_PROGRESS)
    import_context(backend, FileContext(files.ws.context), now, report)
    log = backend.violation_log()
    have = {json.dumps(e, sort_keys=True) for e in log.read()}
    for entry in FileViolationLog(files.ws.meta / LOG_NAME).read():
        if json.dumps(entry, sort_keys=True) not in have:
            log.append(entry)
            report.violations += 1
    return report


def import_context(backend: PostgresBackend, local: FileContext, now: datetime,
                   report: ImportReport) -> None:
    """Copy each context value the database lacks (see the module doc); a file that is not a
    JSON value under a usable name is counted with the unreadable ones. A name no key may have
    (``a b.json``, a newline, 2,000 characters: put there by hand, never by handoffd) is one
    too: the database's keys are read back by every host as file names, so each is checked as
    a key written by ``handoff context set`` is (:func:`normalise_key`)."""
    shared = backend.shared_context()
    for key in local.keys():
        try:
            if normalise_key(key) != key:  # (another spelling of a key: not this file's)
                raise InvalidDocument(f"context file {key!r} is not named by its key",
                                      code=ErrorCode.INVALID_CONTEXT_KEY)
        except InvalidDocument:
            report.unreadable.append(f"context/{_printable(key)}.json")
            continue
        try:
            data, revision = local.read(key)
            if data is None:
                continue
            json.loads(data.decode("utf-8"))
        except (InvalidDocument, OSError, UnicodeDecodeError, ValueError):
            report.unreadable.append(f"context/{key}.json")
            continue
        if shared.read(key)[0] is not None:
            report.context_already += 1
            continue

        def change(old: bytes | None, at: int, data: bytes = data, key: str = key,
                   revision: int = revision) -> tuple[bytes, dict[str, Any]]:
            if old is not None:  # written meanwhile: the database's value stands
                raise _Taken()
            return data, {"at": iso(now), "key": key, "by": "@import", "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest(), "revision": at + 1,
                          "imported_revision": revision}

        try:
            shared.write(key, change)
            report.context += 1
        except _Taken:
            report.context_already += 1


def _printable(name: str) -> str:
    """``name`` as one short printable line (a file name may hold newlines, be very long)."""
    shown = repr(name)[1:-1]
    return shown if len(shown) <= 120 else shown[:117] + "..."


class _Taken(Exception):
    """A key got a value in the database while it was being imported."""
