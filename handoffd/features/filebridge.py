"""Files keep working with a shared PostgreSQL store (issue 13 item 3): a daemon plugin that
ingests the documents dropped into this workspace's ``handoffs/pending/`` into the database and
writes the terminal documents of those handoffs back into its ``completed/`` or ``failed/``.

Installed only when the engine's backend is the PostgreSQL one (a files store *is* the folders).
The bridge runs at every daemon scan (start-up, rescans), on a watch of pending/ (a new file is
ingested at once), and on every wake-up saying a handoff was filed anywhere.
"""
from __future__ import annotations

import logging
from typing import Any

from ..core.documents import book, record
from ..core.engine import Engine
from ..core.formats import FiledState
from ..core.states import State
from ..core.storage import Wakeup

log = logging.getLogger("handoffd")


def install(engine: Engine) -> None:
    """Attach the bridge to daemons of an engine on the PostgreSQL store (else nothing)."""
    if not hasattr(engine.backend, "ingest"):  # not the PostgreSQL backend: nothing to bridge
        return
    engine.daemon_plugins.append(lambda daemon: attach(engine, daemon))


def bridge_for(engine: Engine) -> Any:
    """A FileBridge between the engine's workspace and its PostgreSQL backend."""
    from ..backends.files.store import Store
    from ..backends.postgres.bridge import FileBridge
    from .build import origin_of
    settings = engine.settings
    store = Store(engine.ws, durable=settings.durable,
                  max_document_bytes=settings.max_document_bytes,
                  settle_seconds=settings.settle_seconds)

    def stub(handoff_id: str, code: str, message: str) -> dict[str, Any]:
        """The failure document of a file that cannot be ingested (as Engine.set_aside)."""
        now = engine.clock()
        doc: dict[str, Any] = {"handoff_id": handoff_id}
        record(doc, "rejected", now, code=code)
        book(doc)["dialect"] = "native"
        return engine.formats.by_name("native").render(  # type: ignore[no-any-return]
            doc, engine.failure(now, code, message), FiledState(0, 0, False))

    return FileBridge(engine.backend, store, origin_of(engine.ws), stub=stub,  # type: ignore[arg-type]
                      clock=engine.clock)


def attach(engine: Engine, daemon: Any) -> None:
    """Register the bridge's hooks on ``daemon`` and start watching pending/."""
    from ..backends.files.watch import FolderWatch
    bridge = bridge_for(engine)
    engine.ws.ensure()

    def guarded(what: str, func: Any, *args: Any) -> None:
        try:
            func(*args)
        except Exception as exc:  # the database may be away: the next scan tries again
            log.error("file bridge: %s failed: %s; will try again at the next scan", what, exc)

    def on_file(handoff_id: str, kind: str, settled: bool) -> None:
        if kind == State.PENDING.value and handoff_id:
            guarded(f"ingesting pending/{handoff_id}.json", bridge.ingest, handoff_id)

    def on_wakeup(wakeup: Wakeup) -> None:
        if wakeup.kind in (State.COMPLETED.value, State.FAILED.value) and wakeup.handoff_id:
            guarded(f"writing the result of {wakeup.handoff_id}", bridge.export,
                    [wakeup.handoff_id])

    watch = FolderWatch({engine.ws.state_dir(State.PENDING): State.PENDING.value}, on_file)
    try:
        watch.start()
    except OSError as exc:  # e.g. no inotify instances left: the rescans still ingest
        log.warning("file bridge: cannot watch pending/ (%s); new files are found by rescans", exc)
    daemon.add_scan_hook(lambda: guarded("syncing the workspace's files", bridge.sync))
    daemon.add_wakeup_hook(on_wakeup, kinds={State.COMPLETED.value, State.FAILED.value})

    def stop() -> None:
        from ..backends.postgres.connection import deadline
        watch.stop()
        # a stop hook bounds its own time: with the database away, the last export gives up
        # within the daemon's grace instead of retrying for the store's reconnect window
        with deadline(engine.settings.grace_seconds):
            guarded("writing the last results", bridge.export)

    daemon.add_stop_hook(stop)
