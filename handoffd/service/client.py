"""A small client for agents written in Python: create a handoff, wait for it, read the result.

::

    from handoffd import Client

    client = Client("/srv/agents")                  # the workspace (default: $HANDOFFD_ROOT or .)
    handle = client.create(to="@coder", data={"task": "binary search"})
    result = handle.wait(timeout=60)                 # a Result; WaitTimeout after 60 s
    if result.ok:
        print(result.output)
    else:
        print(result.error.code, result.error.message)

    handle = await client.create_async(to="@coder", data={...})       # asyncio
    result = await handle.wait_async(timeout=60)

The client works through the engine and its storage backend, not through file paths, so it keeps
working on whatever store the workspace uses. Every call is the same operation the ``handoff``
command makes (``create``, ``wait``, ``show``, ``ls``, ``cancel``, ``answer``, ``retry``).
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.documents import REQUEST_DEPTH_MARGIN, check_storable
from ..backends.base import UnreadableCopy
from ..core.errors import NotFound, UsageError
from ..core.native_format import new_native_request
from ..core.states import State
from ..core.storage import foreign_filing
from ..core.workspace import Workspace, resolve_root
from .waiting import WaitStop, awaiting_answer, dropped_here, wait_terminal

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.storage import Backend

log = logging.getLogger("handoffd")
DEFAULT_SOURCE = "@client"
# how deep a request's data sits in its document (document, input, data): as handoff create's
INPUT_DATA_DEPTH = 2 + REQUEST_DEPTH_MARGIN  # input.data, in a request (see core.documents)


@dataclass(frozen=True)
class ErrorInfo:
    """Why a handoff failed: its error code (an :class:`~handoffd.core.errors.ErrorCode` value)
    and message, whatever the document's format."""

    code: str
    message: str


@dataclass(frozen=True)
class Result:
    """Where a handoff stands: its state, the document (in its own format, its ``handoffd``
    block only when the store vouches for it: see :func:`handoffd.core.storage.trusted_doc`),
    and the format-neutral facts: ``ok`` (completed: its folder says so), ``output`` (a seed 001
    document's output), ``error`` (for a failure), ``asks`` (the questions or blockers it waits
    on) and ``foreign`` (filed by another consumer, not by handoffd)."""

    id: str
    state: State
    document: dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when the handoff completed (completed/ holds it)."""
        return self.state is State.COMPLETED

    @property
    def finished(self) -> bool:
        """True when it is completed or failed."""
        return self.state.terminal

    @property
    def status(self) -> str | None:
        """The document's own ``status`` (its format's word), if it has one."""
        status = self.document.get("status")
        return status if isinstance(status, str) else None

    @property
    def output(self) -> Any:
        """The result's ``output`` (seed 001 documents; other formats: see ``document``)."""
        return self.document.get("output")

    @property
    def error(self) -> ErrorInfo | None:
        """The recorded failure (code and message), for a failed handoff: handoffd's record,
        else the document's own ``error`` (a failure another consumer filed, or a stub)."""
        if self.state is not State.FAILED:
            return None
        block = self.document.get("handoffd")
        final = block.get("final_error") if isinstance(block, dict) else None
        if not isinstance(final, dict):
            final = self.document.get("error")
        final = final if isinstance(final, dict) else {}
        return ErrorInfo(str(final.get("code") or "ERROR"), str(final.get("message") or ""))

    @property
    def foreign(self) -> bool:
        """True when another consumer filed it (seed 001's own may write completed/ and
        failed/): its state is its folder's, and it carries no bookkeeping of handoffd's."""
        return foreign_filing(self.state, self.document)

    @property
    def asks(self) -> dict[str, Any] | None:
        """What a parked handoff asks its requester (``needs_clarification`` or ``blocked``,
        with ``questions`` / ``blockers``); None otherwise. :meth:`Client.answer` resumes it."""
        return awaiting_answer(self.state, self.document)


class Handle:
    """A created handoff: wait for it, read it, cancel it."""

    def __init__(self, client: Client, handoff_id: str) -> None:
        self.client = client
        self.id = handoff_id

    def __repr__(self) -> str:
        return f"Handle({self.id!r})"

    def wait(self, timeout: float | None = None, *, or_asks: bool = True,
             stop: WaitStop | None = None) -> Result:
        """Block until the handoff is finished (or, with ``or_asks``, until it asks its
        requester something); WaitTimeout after ``timeout`` seconds, or as soon as another
        thread sets ``stop`` (a :class:`~handoffd.backends.base.WaitStop`)."""
        self.client._ingest_dropped()
        state, doc = wait_terminal(self.client._waited(), self.id, timeout,
                                   or_awaiting=or_asks, stop=stop)
        return Result(self.id, state, doc)

    def look(self) -> Result:
        """Where it stands now, as its :meth:`wait` sees it: :meth:`result`, except that a
        handoff whose file is still being written into pending/ stands pending with no document
        yet (on a files store :meth:`result` raises its read error; on a shared store,
        PostgreSQL, which does not hold it yet, NotFound), and one whose copy in in-progress/
        cannot be read stands in progress with no document (a daemon claimed it and is setting
        it aside, or its sweep will: a wait goes on there for a while, see
        :class:`~handoffd.backends.base.UnreadableCopy`). What a wait that timed out
        reports."""
        try:
            return self.result()
        except UnreadableCopy as exc:  # (as a wait reads it: still being written, or set aside)
            if exc.state is State.IN_PROGRESS:
                return Result(self.id, State.IN_PROGRESS, {})
            if exc.state is not State.PENDING and not exc.settling:
                raise
            return Result(self.id, State.PENDING, {})
        except NotFound:
            if self.client._waited().get(self.id) is None:
                raise
            return Result(self.id, State.PENDING, {})

    async def wait_async(self, timeout: float | None = None, *, or_asks: bool = True) -> Result:
        """:meth:`wait` for asyncio (runs in a worker thread; the event loop stays free). When
        the awaiting task is cancelled, the thread's wait ends too (it waited out its timeout,
        for ever with None, and ``asyncio.run`` returned only once it had)."""
        stop = WaitStop()
        try:
            return await asyncio.to_thread(self.wait, timeout, or_asks=or_asks, stop=stop)
        finally:
            stop.set()  # (done: a no-op)

    def result(self) -> Result:
        """Where it stands now (no waiting)."""
        return self.client.get(self.id)

    def cancel(self, *, reason: str = "cancelled by the client", cascade: bool = False) -> str:
        """Cancel it (and, with ``cascade``, its descendants); see :meth:`Client.cancel`."""
        return self.client.cancel(self.id, reason=reason, cascade=cascade)


class Client:
    """One workspace, seen by an agent. ``root``: the workspace directory (default
    ``$HANDOFFD_ROOT``, else the current directory); or pass a ready ``engine``."""

    def __init__(self, root: str | Path | None = None, *, engine: Engine | None = None,
                 agent: str = DEFAULT_SOURCE) -> None:
        if engine is None:
            from ..features.build import (
                build_engine,  # every feature: cancel, answer, gates
            )
            ws = _workspace(root)
            ws.ensure()
            engine = build_engine(ws)
        self.engine = engine
        self.agent = agent

    def _ingest_dropped(self) -> None:
        """On a shared store (PostgreSQL), ingest the documents dropped into the workspace's
        pending/ first (one scandir when there are none; nothing on a files store, whose
        folders are the store): every call sees a dropped file as the handoff it is, and a
        create never takes its id (see :func:`handoffd.features.filebridge.ingest_dropped`).
        Each call of the client makes it."""
        if getattr(self.engine.backend, "shared", False):
            from ..features.filebridge import ingest_dropped
            try:
                ingest_dropped(self.engine)
            except Exception as exc:  # e.g. a pending/ this process may not remove files from
                log.warning("cannot ingest the files dropped into pending/: %s (a daemon of "
                            "this workspace ingests them at its scans)", exc)

    def _waited(self) -> Backend:
        """The store as a wait reads it (see :func:`~handoffd.service.waiting.dropped_here`):
        on a shared store, a file still being written into this workspace's pending/ is a
        handoff on its way, not one that does not exist."""
        return dropped_here(self.engine.backend, self.engine.ws)

    # ------------------------------------------------------------ creating
    def create(self, to: str | None = None, data: Any = None, *, document: dict[str, Any] | Any = None,
               handoff_id: str | None = None, priority: str | int | None = None,
               timeout_seconds: float | None = None, depends_on: list[str] | None = None,
               if_absent: bool = False) -> Handle:
        """Submit a handoff: a seed 001 request to ``to`` with ``data``, or a whole ``document``
        in any supported format (a dict, or a typed model). ``if_absent``: idempotent under
        ``handoff_id`` (the same request gets its id back; a different one raises Conflict).
        InvalidDocument for a document the format refuses."""
        self._ingest_dropped()
        if document is not None:
            given = [name for name, value in (
                ("to", to), ("data", data), ("handoff_id", handoff_id), ("priority", priority),
                ("timeout_seconds", timeout_seconds), ("depends_on", depends_on))
                if value is not None]
            if given:  # (the document says all of these itself: they were dropped unread)
                raise UsageError("give a whole document, or to/data/handoff_id/priority/"
                                 f"timeout_seconds/depends_on, not both (given: {', '.join(given)})")
            if not isinstance(document, dict) and callable(getattr(document, "to_dict", None)):
                document = document.to_dict()  # (as submit would: its depth is checked below)
            if isinstance(document, dict):  # (not one: the format's own INVALID_DOCUMENT)
                check_storable(document, "document", depth_below=REQUEST_DEPTH_MARGIN)
            return Handle(self, self.engine.submit(document, if_absent=if_absent))
        if not to:
            raise UsageError("name the target agent (to=...) or give a whole document")
        check_storable(data, "data", depth_below=INPUT_DATA_DEPTH)  # it sits in input.data
        doc = new_native_request(source=self.agent, target=to, data=data, now=self.engine.clock(),
                                 handoff_id=handoff_id, timeout_seconds=timeout_seconds,
                                 priority=priority, depends_on=depends_on)
        return Handle(self, self.engine.submit(doc, forced="native", prechecked=True,
                                               if_absent=if_absent))

    async def create_async(self, to: str | None = None, data: Any = None, **options: Any) -> Handle:
        """:meth:`create` for asyncio."""
        return await asyncio.to_thread(lambda: self.create(to, data, **options))

    def run(self, to: str, data: Any = None, *, timeout: float | None = None,
            **options: Any) -> Result:
        """Create and wait: seed 003's synchronous execute-and-wait in one call."""
        return self.create(to, data, **options).wait(timeout)

    # ------------------------------------------------------------ reading
    def handle(self, handoff_id: str) -> Handle:
        """A handle on an existing handoff (no check that it exists)."""
        return Handle(self, handoff_id)

    def get(self, handoff_id: str) -> Result:
        """Where ``handoff_id`` stands now; NotFound if it does not exist."""
        self._ingest_dropped()
        state, doc = self.engine.get(handoff_id)
        return Result(handoff_id, state, doc)

    def list(self, *, state: str | None = None, to: str | None = None, limit: int = 50,
             conversation: str | None = None) -> list[dict[str, Any]]:
        """Newest-first rows, as `handoff ls --json` prints them."""
        from .queries import list_handoffs
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise UsageError(f"limit must be a whole number, 0 or more; not {limit!r}")
        self._ingest_dropped()
        return list_handoffs(self.engine, state=state, to=to, limit=limit,
                             conversation=conversation)

    # ------------------------------------------------------------ acting
    def cancel(self, handoff_id: str, *, reason: str = "cancelled by the client",
               cascade: bool = False) -> str:
        """Cancel ``handoff_id``; returns what happened to it: ``cancelled`` (it was pending),
        ``requested`` (running: its daemon stops it) or ``finished`` (nothing to do).
        UsageError for a ``reason`` that is not UTF-8 text (a lone surrogate): the feature
        refuses it before anything is claimed."""
        from ..features.cancel_family import cancel
        if not isinstance(reason, str):
            raise UsageError(f"reason must be text; not {type(reason).__name__}")
        self._ingest_dropped()
        return cancel(self.engine, handoff_id, reason=reason, cascade=cascade,
                      by=self.agent, via="client")[0].action

    def answer(self, handoff_id: str, answer: Any) -> None:
        """Answer what a parked handoff asks (``Result.asks``); it runs again with the answer.
        UsageError unless ``answer`` is JSON data a document can hold where it goes (as
        :meth:`create` checks its data): nothing is claimed or written then."""
        from ..features.orchestration import answer as give_answer
        self._ingest_dropped()
        give_answer(self.engine, handoff_id, answer, by=self.agent)  # (which checks the answer)

    def retry(self, handoff_id: str, *, force: bool = False) -> None:
        """Move a failed handoff back to pending (``force``: also a permanent failure)."""
        from .sweeper import requeue_failed
        self._ingest_dropped()
        requeue_failed(self.engine, handoff_id, force=force)
        if getattr(self.engine.backend, "shared", False):
            from ..features.filebridge import retract_local
            try:
                retract_local(self.engine, [handoff_id])  # its failed/ file answers no more
            except Exception as exc:  # retried all the same: the daemon removes it
                log.warning("cannot remove the old failed/%s.json: %s (a daemon of this "
                            "workspace removes it at its scans)", handoff_id, exc)


def _workspace(root: Any) -> Workspace:
    """The workspace at ``root`` (default ``$HANDOFFD_ROOT``, else the current directory): its
    directory must exist, as for ``--root`` (NotFound; a typo silently made a new workspace), and
    ``root`` must be a path (UsageError; ``Client(5)`` was a TypeError)."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise UsageError(f"root must be a path (str or Path), not {type(root).__name__}")
    try:
        ws = Workspace(resolve_root(Path(root) if root is not None else None))
    except FileNotFoundError:  # no current directory (deleted under the process)
        raise NotFound("the current directory no longer exists; pass the workspace's root") from None
    if not ws.root.is_dir():
        raise NotFound(f"workspace directory {ws.root} does not exist; create it or fix the root")
    return ws


