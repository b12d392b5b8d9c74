"""Quiet waits: the waiters a scheduler's rescan does not read again while their document is the
same (a pause, a question to the requester), by the stamps of the store's live documents.

:class:`QuietWaits` is a part of :class:`~handoffd.service.scheduler.Scheduler` (which it is
mixed into): features register their checks with it (:meth:`QuietWaits.add_quiet_check`), and
the scheduler's rescan (``listed``) asks it which waiters it may leave alone. Everything here is
guarded by the scheduler's ``cv``.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..core.engine import Engine
from ..core.storage import LiveStamp

log = logging.getLogger("handoffd")


class QuietWaits:
    """The quiet waits of a scheduler (mixed into it), guarded by its ``cv``: ``quiet_checks``,
    what features registered, and ``quiet_stamps``, the waiters a rescan does not read again
    while their document is the same, each with its document's stamp."""

    # what the quiet waits use of the scheduler they are part of
    engine: Engine
    cv: threading.Condition
    # handoff id -> the ids whose filing may end its wait (absent: any filing may; empty: none)
    waits_on: dict[str, frozenset[str]]

    def __init__(self) -> None:
        super().__init__()
        self.quiet_checks: list[Callable[[str], bool]] = []
        # quiet waiter id -> the stamp of its document when a rescan last queued it to be read
        # again: while the stamp is the same, what it was read as is what is stored
        self.quiet_stamps: dict[str, LiveStamp] = {}

    def add_quiet_check(self, check: Callable[[str], bool]) -> None:
        """``check(id)`` true: the wait of the waiter ``id``, held with ``on=()`` (no filing
        ends it), ends only with a change of its own document or when the feature holding it
        queues it itself (a resume: ``Daemon.queue``). A rescan then reads it again only when
        its document's stamp changed: 5,000 paused handoffs were read and parsed again at each
        rescan, for ever (0.35 s of CPU every 5 s). Asked at each rescan, for each such waiter."""
        with self.cv:
            self.quiet_checks.append(check)

    def _stamps_for_quiet(self) -> dict[str, LiveStamp | None] | None:
        """The stamps of the live documents (one listing, none read) when a waiter may be quiet;
        None when none may be, or when the store has no stamps or cannot give them now (every
        waiter is read again then). Taken before the rescan's ``cv`` section, where a quiet
        waiter's stamp is recorded only as it is queued to be read: that read comes after it."""
        with self.cv:
            wanted = bool(self.quiet_checks) and any(not on for on in self.waits_on.values())
        if not wanted:
            return None
        try:
            return self.engine.backend.live_stamps()
        except Exception as exc:  # e.g. EMFILE: they are all read again, as before; not fatal
            log.warning("cannot stamp the pending documents (%s); the waiting ones are read "
                        "again", exc)
            return None

    def _quiet_and_unchanged(self, handoff_id: str,
                             stamps: dict[str, LiveStamp | None] | None) -> bool:
        """True when the waiter ``handoff_id`` is quiet (:meth:`add_quiet_check`) and its
        document's stamp in ``stamps`` is the one recorded when a rescan last queued it: the read
        that holds it back came after that, so it saw what is stored now. Otherwise the stamp
        (if any) is recorded for the read the caller queues now (called under ``cv``)."""
        stamp = stamps.get(handoff_id) if stamps is not None else None
        on = self.waits_on.get(handoff_id)
        if stamp is None or on is None or on or not self._quiet(handoff_id):
            self.quiet_stamps.pop(handoff_id, None)
            return False
        if self.quiet_stamps.get(handoff_id) == stamp:
            return True
        self.quiet_stamps[handoff_id] = stamp
        return False

    def _quiet(self, handoff_id: str) -> bool:
        """What the quiet checks say of the waiter ``handoff_id`` (False when one fails, e.g.
        its records cannot be read: the gate, which says why, runs on the read queued now)."""
        try:
            return any(check(handoff_id) for check in self.quiet_checks)
        except Exception:
            return False
