"""The daemon's plugin registrations, and calling them so that no feature's fault stops it.

Features register through the daemon's ``add_*`` methods (its plugin API, :class:`.daemon.Daemon`);
the lists live here, with the one way each kind is called: a hook that raises is logged and the
daemon goes on (a scan, the wake-up feed, a filing's count and a stop are never lost to it).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..core.engine import Engine
from ..core.states import State
from ..core.storage import Wakeup

log = logging.getLogger("handoffd")
# (a pending document's predicate, the function that claims and files it instead of a specialist)
MessageHandler = Callable[[Engine, str], State | None]


def hook_name(hook: Callable[..., Any]) -> str:
    """Who registered ``hook``, for a log line: "the pause feature" for a feature of handoffd
    (its module), the module's name for another plugin's (a closure's qualified name,
    ``install.<locals>.attach.<locals>.look``, said nothing to an operator)."""
    module = getattr(hook, "__module__", None)
    if not isinstance(module, str) or not module:
        return repr(hook)
    package, _, name = module.rpartition(".")
    return f"the {name} feature" if package == "handoffd.features" else module


class Hooks:
    """What features registered with one daemon."""

    def __init__(self) -> None:
        self.scan_hooks: list[Callable[[], None]] = []
        self.message_handlers: list[tuple[Callable[[dict[str, Any] | None], bool],
                                          MessageHandler]] = []
        self.filed_hooks: list[Callable[[str, State], None]] = []
        self.parked_checks: list[Callable[[str], bool]] = []
        self.wakeup_hooks: list[Callable[[Wakeup], None]] = []
        self.wakeup_kinds: set[str] | None = set()  # what the hooks need (None: everything)
        self.stop_hooks: list[Callable[[], None]] = []

    def message_handler(self, doc: dict[str, Any] | None) -> MessageHandler | None:
        """The handler that files ``doc`` instead of a specialist (e.g. a cancellation
        message), or None: it is routed to its target."""
        for predicate, handler in self.message_handlers:
            if predicate(doc):
                return handler
        return None

    def parked(self, handoff_id: str) -> bool:
        """True when a handoff filed back to pending/ waits by design (not a retry)."""
        return any(parked(handoff_id) for parked in self.parked_checks)

    def scanning(self) -> None:
        """A scan of pending/ begins (e.g. cancel requests: stop our handlers, queue pending)."""
        for hook in self.scan_hooks:
            try:
                hook()
            except OSError as exc:  # the store away (StoreUnavailable), a full disk: no bug
                log.error("scan hook of %s failed: %s; will try again at the next scan",
                          hook_name(hook), " ".join(str(exc).split())[:300])
            except Exception:  # a feature's hook must not stop the scan (a bug: its traceback)
                log.exception("scan hook %r failed", hook)

    def woken(self, wakeup: Wakeup) -> None:
        """A hint of the backend's wake-up feed arrived (on the feed's thread)."""
        for hook in self.wakeup_hooks:
            try:
                hook(wakeup)
            except Exception:  # a feature's hook must not break the feed
                log.exception("wake-up hook %r failed", hook)

    def filed(self, handoff_id: str, where: State) -> None:
        """The engine filed ``handoff_id`` to ``where`` (e.g. drop its cancel request)."""
        for hook in self.filed_hooks:
            try:
                hook(handoff_id, where)
            except Exception:  # a feature's hook must not lose the count
                log.exception("handoff %s: filed hook %r failed", handoff_id, hook)

    def stopped(self) -> None:
        """The daemon stopped, its work filed or handed back (e.g. deliver what is queued)."""
        for hook in self.stop_hooks:
            try:
                hook()
            except Exception:  # a feature's stop must not turn a clean stop into a crash
                log.exception("stop hook %r failed", hook)
