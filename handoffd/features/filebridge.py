"""Files keep working with a shared PostgreSQL store (issue 13 item 3): a daemon plugin that
ingests the documents dropped into this workspace's ``handoffs/pending/`` into the database and
writes the terminal documents of those handoffs back into its ``completed/`` or ``failed/``.

Installed only when the engine's backend is the PostgreSQL one (a files store *is* the folders).
The bridge runs at every daemon scan (start-up, rescans), on a watch of pending/ (a new file is
ingested at once), on every wake-up saying a handoff was filed anywhere, and on every wake-up
saying one went back to pending (a retry: its old terminal file here is removed; parked: its
copy is written into pending/; answered: that copy goes). It also has the backend list the files
the bridge quarantined here with the database's quarantine (``handoff ls --state quarantined``).
A handoff a command ingested from this workspace is announced to its daemon (a wake-up of the
bridge's own kind, sent with the ingest), whose bridge then writes its result and its parked
copy back at once, as for one it ingested itself.

The ``handoff`` commands and the Python client ingest too (:func:`ingest_dropped`), before they
read or write the store, when the workspace's pending/ holds files: a file dropped there is a
handoff for every command at once, as on a files store, not only once a daemon found it, and
``create --id`` can never take a dropped file's id (its request would be set aside unanswered).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..core.documents import book, is_safe_id, record
from ..core.errors import DuplicateHandoff
from ..core.formats import FiledState
from ..core.states import State
from ..core.storage import Wakeup

if TYPE_CHECKING:  # (a command pays for the engine's import only if it builds one)
    from ..backends.postgres.bridge import FileBridge
    from ..core.settings import DaemonSettings
    from ..core.engine import Engine
    from ..core.formats import Formats
    from ..core.storage import Backend
    from ..core.submission import Submitter
    from ..core.workspace import Workspace

log = logging.getLogger("handoffd")


def install(engine: Engine) -> None:
    """Attach the bridge to daemons of an engine on the PostgreSQL store (else nothing)."""
    if not hasattr(engine.backend, "ingest"):  # not the PostgreSQL backend: nothing to bridge
        return
    engine.daemon_plugins.append(lambda daemon: attach(engine, daemon))


def bridge_for(engine: Engine) -> FileBridge:
    """A FileBridge between the engine's workspace and its PostgreSQL backend (its stubs are
    announced to the engine's ``on_filed`` listeners: a daemon counts them)."""
    return bridge_over(engine.ws, engine.backend, engine.formats, engine.clock,
                       settings=engine.settings, announce=engine.hooks.announce)


def bridge_over(ws: Workspace, backend: Backend, formats: Formats,
                clock: Callable[[], datetime], *, settings: DaemonSettings | None = None,
                announce: Callable[[str, State], None] | None = None,
                quiet: bool = False) -> FileBridge:
    """A FileBridge between ``ws`` and ``backend`` (a PostgreSQL one, under the event log's
    recorder when there is one) without an Engine: what a one-shot command has (``handoff
    create`` builds none). ``settings``: the workspace's ``[daemon]`` (default: read from its
    configuration); ``quiet``: no log line per file set aside (a command's ingest)."""
    from ..backends.files.store import Store
    from ..backends.postgres.bridge import FileBridge
    from ..core.events import SET_ASIDE
    from ..core.results import failed
    from .build import origin_of
    settings = settings or ws.load_config().daemon
    store = Store(ws, durable=settings.durable, max_document_bytes=settings.max_document_bytes,
                  settle_seconds=settings.settle_seconds)

    def stub(handoff_id: str, code: str, message: str) -> dict[str, Any]:
        """The failure document of a file that cannot be ingested (as admission's stubs)."""
        now = clock()
        doc: dict[str, Any] = {"handoff_id": handoff_id}
        record(doc, "rejected", now, code=code)
        book(doc)["dialect"] = "native"
        return formats.by_name("native").render(  # type: ignore[no-any-return]
            doc, failed(now, now, code, message), FiledState(0, 0, False))

    emit = getattr(backend, "emit", None)  # the event log's recorder (none: no event log)

    def noted(handoff_id: str, code: str, message: str) -> None:
        """The event log's record of a file set aside here, as the files store logs its own."""
        if emit is not None:
            emit("set_aside", handoff_id, SET_ASIDE, None, code=code, reason=message,
                 was=State.PENDING.value)

    return FileBridge(backend, store, origin_of(ws), stub=stub,  # type: ignore[arg-type]
                      clock=clock, announce=announce, noted=noted, quiet=quiet)


def has_drops(ws: Workspace) -> bool:
    """Whether ``ws``'s pending/ holds a file that may be a dropped document (one scandir,
    stopped at the first; a folder that cannot be read holds none for this question)."""
    try:
        with os.scandir(ws.state_dir(State.PENDING)) as entries:
            return any(e.name.endswith(".json") and not e.name.startswith(".") for e in entries)
    except OSError:
        return False


def ingest_dropped(opened: Engine | Submitter) -> None:
    """Before a command or the client reads or writes a shared store: ingest the documents
    dropped into the workspace's pending/ (the bridge's own ingest and rules; the stale result
    files of purged or retried handoffs are removed first), and guard every create of this
    ``opened`` engine or submitter against the id of a file still there (one being written).
    Nothing for a files store, nor when pending/ holds no file. The stubs it files are told to
    an engine's ``on_filed`` listeners (a submitter has none); no line is logged per file. What
    fails (the database away, a pending/ where this user may not remove files) is raised: the
    caller says so and goes on (a daemon of this workspace ingests the files at its scans)."""
    if not getattr(opened.backend, "shared", False) or not hasattr(opened.backend, "ingest"):
        return
    list_local_quarantine(opened.ws, opened.backend)
    made: list[FileBridge] = []

    def bridge() -> FileBridge:
        if not made:
            announce = getattr(getattr(opened, "hooks", None), "announce", None)
            made.append(bridge_over(opened.ws, opened.backend, opened.formats, opened.clock,
                                    announce=announce, quiet=True))
        return made[0]

    guards = opened.submit_guards
    if not any(getattr(g, "dropped_files_guard", False) for g in guards):
        guards.append(_dropped_guard(opened.ws, bridge))
    if has_drops(opened.ws):
        bridge().recheck()
        bridge().ingest_all()


def list_local_quarantine(ws: Workspace, backend: Backend) -> None:
    """Have ``backend`` (a PostgreSQL one) list the files its bridge quarantined in ``ws``'s
    handoffs/.quarantine/ with its own (``handoff ls --state quarantined``), as a files store
    lists them: they are in no database."""
    from ..backends.files.reading import quarantined

    def local() -> list[dict[str, Any]]:
        """The reasons recorded in the workspace's .quarantine/, oldest first."""
        return quarantined(ws)

    backend.local_quarantine = local  # type: ignore[attr-defined]


def _dropped_guard(ws: Workspace, bridge: Callable[[], FileBridge]
                   ) -> Callable[[object, Any], Any]:
    """A submit guard: a create under the id of a file in pending/ (dropped since the command
    started, or still being written) ingests it first, and is refused while it is there."""
    @contextmanager
    def guard(_submitting: object, envelope: Any) -> Iterator[None]:
        handoff_id = envelope.handoff_id
        if is_safe_id(handoff_id) and ws.doc_path(State.PENDING, handoff_id).exists():
            # ingested, or the copy of a parked handoff ("known"): the store refuses the id
            known = bridge().ingest(handoff_id) == "known"
            if not known and ws.doc_path(State.PENDING, handoff_id).exists():
                raise DuplicateHandoff(
                    f"handoff {handoff_id} already exists in pending/ (a dropped file not in "
                    "the shared store yet); choose another id", handoff_id=handoff_id)
        yield

    guard.dropped_files_guard = True  # type: ignore[attr-defined]
    return guard


def retract_local(engine: Engine, handoff_ids: list[str]) -> None:
    """After ``handoff retry`` on a shared store: remove this workspace's terminal files of
    ``handoff_ids`` that answer no more (two stats an id when there is none). What fails is
    raised: the caller says so and goes on (this workspace's daemon removes them at its scans)."""
    if not getattr(engine.backend, "shared", False) or not hasattr(engine.backend, "ingest"):
        return
    ids = [handoff_id for handoff_id in handoff_ids if is_safe_id(handoff_id)]
    if any(engine.ws.doc_path(s, i).exists() for i in ids for s in (State.COMPLETED, State.FAILED)):
        bridge_over(engine.ws, engine.backend, engine.formats, engine.clock,
                    settings=engine.settings, quiet=True).recheck()


def attach(engine: Engine, daemon: Any) -> None:
    """Register the bridge's hooks on ``daemon`` and start watching pending/."""
    from ..backends.files.watch import FolderWatch
    bridge = bridge_for(engine)
    list_local_quarantine(engine.ws, engine.backend)
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
        if not wakeup.handoff_id:
            return
        if wakeup.kind == State.PENDING.value:  # a retry, on any host: its old result goes
            guarded(f"removing the old result of {wakeup.handoff_id}", bridge.retracted,
                    wakeup.handoff_id)
            # parked (its copy goes into pending/), or answered (its copy there goes)
            guarded(f"writing the parked copy of {wakeup.handoff_id}", bridge.reparked,
                    wakeup.handoff_id)
        elif wakeup.kind in (State.COMPLETED.value, State.FAILED.value):
            guarded(f"writing the result of {wakeup.handoff_id}", bridge.export,
                    [wakeup.handoff_id])
        elif wakeup.kind == bridge.heard_kind:  # a command here ingested it: ours to write back
            bridge.heard(wakeup.handoff_id)

    watch = FolderWatch({engine.ws.state_dir(State.PENDING): State.PENDING.value}, on_file)
    try:
        watch.start()
    except OSError as exc:  # e.g. no inotify instances left: the rescans still ingest
        log.warning("file bridge: cannot watch pending/ (%s); new files are found by rescans", exc)
    daemon.add_scan_hook(lambda: guarded("syncing the workspace's files", bridge.sync))
    daemon.add_wakeup_hook(on_wakeup, kinds={State.COMPLETED.value, State.FAILED.value,
                                             State.PENDING.value, bridge.heard_kind})

    def stop() -> None:
        from ..backends.postgres.connection import deadline
        watch.stop()
        # a stop hook bounds its own time: with the database away, the last export gives up
        # within the daemon's grace instead of retrying for the store's reconnect window
        with deadline(engine.settings.grace_seconds):
            guarded("writing the last results", bridge.export)

    daemon.add_stop_hook(stop)
