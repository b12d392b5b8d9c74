"""Notifications when work is filed (``[[on_filed]]`` in handoffd.toml).

Each rule names a command (an argument list, never a shell; the filed document on its stdin:
:mod:`.command`) and/or a webhook (an HTTP POST of the filed document: :mod:`.webhook`). A
webhook is signed when the rule has a secret: ``X-Handoffd-Signature: sha256=<hex HMAC-SHA256
of the body>``, beside ``X-Handoffd-Id`` and ``X-Handoffd-State``. A delivery that fails (a
non-2xx answer, a command that exits non-zero, a timeout) is tried again ``retries`` times with
exponential backoff from ``retry_delay_seconds``; after the last try one line is appended to the
dead-letter record ``handoffs/.meta/notify-dead-letters.jsonl`` and a warning is logged.

``timeout_seconds`` bounds a whole attempt: a command is killed with its process group (and
judged by its own exit status, whatever it left holding its pipes), and a webhook is cut off
even when the server trickles its answer a byte at a time.

Nothing here blocks the daemon's workers: filing only queues the notice (a few hundred bytes:
the document is read when it is delivered) and records it in the process's outbox journal
(:mod:`.outbox`); background threads deliver, each rule's notices in a lane of their own so
that one rule's failing target never holds another's (:mod:`.lanes`, :mod:`.delivery`), and a
stopping daemon gives them a bounded time to finish (:data:`DRAIN_SECONDS`). Any other
process that files work (`handoff cancel`, an MCP server, a program using the client) drains
the same way when it exits, so its notices are delivered, retried or dead-lettered too, and no
command it started outlives it. When the drain's time is up, the notice being delivered is
dead-lettered as well as those never tried (its dead letter says when it may have been
delivered all the same), and a second drain (a stop hook, then ``atexit``) finds nothing left.

A process that dies without draining (``kill -9``, a crash, a power loss) leaves its journal:
the next sweep (a daemon's start, its periodic sweeps, ``handoffd sweep``) of any process on the
workspace takes it over once that process is gone (on the notifier's own thread, a bounded
number of notices a sweep), and delivers what it left, at least once.
The one window left: a crash after a handoff's document is filed and before its notice is in
the journal (the few microseconds between the two writes) loses that notice silently.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .notices import DEAD_LETTERS, MAYBE_DELIVERED, NEVER_TRIED, STOPPED, Flight, Notice
from .notifier import DRAIN_SECONDS, QUEUE_LIMIT, SETTLE_SECONDS, Notifier
from .outbox import OUTBOX_DIR
from .webhook import shown_url

if TYPE_CHECKING:
    from ...core.engine import Engine


def install(engine: Engine) -> None:
    """The notify feature: only when handoffd.toml has ``[[on_filed]]`` rules. Each sweep
    has the notices of processes that ended without delivering them taken over, on the
    notifier's own thread (never the sweep's: a daemon's main loop)."""
    if not engine.config.on_filed:
        return
    notifier = Notifier(engine)
    engine.on_filed.append(notifier.filed)
    engine.on_sweep.append(notifier.take_over_soon)
    engine.daemon_plugins.append(lambda daemon: daemon.add_stop_hook(notifier.drain))


__all__ = ["DEAD_LETTERS", "DRAIN_SECONDS", "MAYBE_DELIVERED", "NEVER_TRIED", "OUTBOX_DIR",
           "QUEUE_LIMIT", "SETTLE_SECONDS", "STOPPED", "Flight", "Notice", "Notifier", "install",
           "shown_url"]
