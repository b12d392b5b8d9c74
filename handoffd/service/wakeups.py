"""What a daemon hears from the backend's wake-up feed, and what each hint makes it do.

A new document in pending/ is looked at at once (a moment later while it may still be written);
a lost feed asks for a rescan; every hint goes on to the features' wake-up hooks (cancel
requests, the context mirror). A batch listens only when a feature asked, and only for the
kinds it named.
"""
from __future__ import annotations

import logging
from typing import Callable

from ..core.engine import Engine
from ..core.states import State
from ..core.storage import LOST, Wakeup
from .hooks import Hooks
from .scheduler import Scheduler

log = logging.getLogger("handoffd")
CREATED_DELAY = 0.05  # seconds before a document that may still be written is read


class WakeupFeed:
    """One daemon's subscription to its backend's wake-up hints."""

    def __init__(self, engine: Engine, scheduler: Scheduler, hooks: Hooks, *, watch: bool) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.hooks = hooks
        self.watch = watch  # serving: every arrival in pending/ is dispatched at once
        self._unsubscribe: Callable[[], None] | None = None

    def subscribe(self) -> None:
        """Listen to the backend's wake-up feed: always when watching (arrivals in pending are
        dispatched at once), in a batch only when a feature asked for it (cancel requests)."""
        if not (self.watch or self.hooks.wakeup_hooks) or self._unsubscribe is not None:
            return
        # a batch listens only for what its hooks need: watching every folder would wake it
        # for each file it writes itself
        kinds = None if self.watch else self.hooks.wakeup_kinds
        try:
            self._unsubscribe = self.engine.backend.subscribe(self.on_wakeup, kinds=kinds)
        except OSError as exc:  # e.g. no inotify left: rescans still see what changed
            log.warning("cannot subscribe to wake-ups (%s); changes are seen at rescans", exc)

    def on_wakeup(self, wakeup: Wakeup) -> None:
        """One hint of the feed (on the feed's thread)."""
        if wakeup.kind == LOST:
            self.scheduler.request_rescan()
        elif wakeup.kind == State.PENDING.value and self.watch and wakeup.handoff_id:
            # a document still being written is looked at a moment later (it is re-read anyway)
            self.scheduler.notify(wakeup.handoff_id, 0.0 if wakeup.settled else CREATED_DELAY)
        self.hooks.woken(wakeup)

    def unsubscribe(self) -> None:
        """Stop listening (a daemon that stops; idempotent)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
