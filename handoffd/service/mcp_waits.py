"""Where ``wait_handoff``'s blocking waits run: a daemon thread each, counted while it lives.

On the event loop's default pool (a few threads, shared with every other tool) a client with a
few long waits outstanding starved every later call, and the pool's threads are joined at exit,
so a long wait kept the server alive after its client had gone. So each wait has a thread of its
own, and the threads are capped: at most ``limit`` at once, and (over HTTP, where many clients
share one server) at most ``per_session`` for one MCP session and as many for one peer address,
so that one client cannot take every wait from the others. (Requests of the 2026-07-28 protocol
carry no session id, and a client of the older one can open sessions at will: capped by session
alone, one client took all 200.)

A thread counts until it has ended, not until its caller stopped listening: the count was the
caller's, so a wait cancelled by its client (``notifications/cancelled``) left a thread waiting
out its whole timeout that no longer counted, and threads grew without bound. Now a caller that
goes away sets the wait's :class:`~handoffd.backends.base.WaitStop`, which wakes the thread and
ends it at once. (Over HTTP, on the older session protocol, the SDK does not cancel a request
whose client hung up; its wait runs on to its timeout, within its client's share.)
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, Hashable

from mcp.server.mcpserver.exceptions import ToolError

from ..core.errors import WaitTimeout
from .waiting import WaitStop

Client = tuple[str, Hashable]  # ("session", its id) or ("peer", its address)
MAX_WAITS = 200  # wait_handoff calls in progress at once (a thread each)
MAX_WAITS_PER_SESSION = 50  # of those, for one session over HTTP (a quarter: never all of them)
# once a wait timed out, reading where its handoff stands may take this long: with the store
# away (PostgreSQL retries for its reconnect window, a minute) the answer is then the timeout
LOOK_SECONDS = 2.0
# and the tool answers this long past its timeout at the latest, whatever a store does
ANSWER_MARGIN_SECONDS = 5.0


class Waits:
    """Runs waits on threads of their own, at most ``limit`` alive at once (``per_session``:
    at most that many for one session, and for one peer; None: no per-client cap)."""

    def __init__(self, limit: int = MAX_WAITS, per_session: int | None = None) -> None:
        self.limit = limit
        self.per_session = per_session
        self.running = 0  # threads alive (decremented by each thread as it ends)
        self._by_client: dict[Client, int] = {}  # ("session", id) or ("peer", host) -> waits
        self._lock = threading.Lock()

    def _take(self, clients: tuple[Client, ...]) -> None:
        """Count one more thread for each of ``clients``; ToolError (BUSY) past a cap."""
        with self._lock:
            if self.running >= self.limit:
                raise ToolError(f"BUSY: {self.running} waits are in progress (at most "
                                f"{self.limit}); wait for one to end, or use get_handoff")
            for client in clients:
                held = self._by_client.get(client, 0)
                if self.per_session is not None and held >= self.per_session:
                    who = "this session" if client[0] == "session" else \
                        f"this client ({client[1]})"
                    raise ToolError(f"BUSY: {who} has {held} waits in progress (at most "
                                    f"{self.per_session}); wait for one to end, or use "
                                    f"get_handoff")
            self.running += 1
            for client in clients:
                self._by_client[client] = self._by_client.get(client, 0) + 1

    def _give_back(self, clients: tuple[Client, ...]) -> None:
        with self._lock:
            self.running -= 1
            for client in clients:
                held = self._by_client.get(client, 1) - 1
                if held > 0:
                    self._by_client[client] = held
                else:
                    self._by_client.pop(client, None)

    async def run(self, wait: Callable[[float, WaitStop], Any], seconds: float,
                  session: Hashable = None, peer: Hashable = None) -> Any:
        """``wait(seconds, stop)`` on a thread of its own; ToolError (BUSY) past a cap (the
        caller's ``session``, its ``peer`` address: each capped when given). If this coroutine
        is cancelled (or ends any other way), ``stop`` is set: the thread ends."""
        clients: tuple[Client, ...] = tuple(
            key for key in (("session", session), ("peer", peer)) if key[1] is not None)
        self._take(clients)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        stop = WaitStop()

        def settle(value: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        def body() -> None:
            try:
                try:
                    value, error = wait(seconds, stop), None
                except BaseException as exc:  # handed to the caller's coroutine
                    value, error = None, exc
                try:
                    loop.call_soon_threadsafe(settle, value, error)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass
            finally:
                self._give_back(clients)

        try:
            threading.Thread(target=body, name="mcp-wait", daemon=True).start()
        except BaseException:  # no thread (e.g. the system's limit): nothing runs to give back
            self._give_back(clients)
            raise
        try:
            return await future
        finally:
            stop.set()  # (cancelled: the thread stops waiting now; done: a no-op)


def wait_then_look(wait: Callable[[float, WaitStop], Any], look: Callable[[], Any],
                   backend: Any, handoff_id: str) -> Callable[[float, WaitStop], Any]:
    """A wait for :meth:`Waits.run` that, when it times out, reads where ``handoff_id`` stands
    (``look()``) on the same thread within LOOK_SECONDS. That read ran on the event loop, with
    no deadline: with the store away it froze every other request (a ``ping`` took a minute)
    and ended a 3-second wait after 63 s. Now an unreadable store ends it as the timeout it is
    (WaitTimeout, saying why)."""

    def run(seconds: float, stop: WaitStop) -> Any:
        try:
            return wait(seconds, stop)
        except WaitTimeout:
            if stop.is_set():  # its caller went away: nobody reads the answer
                raise
        waiting = getattr(backend, "waiting", None)  # (a store that can be away bounds it)
        within = waiting(handoff_id, LOOK_SECONDS) if callable(waiting) \
            else contextlib.nullcontext()
        try:
            with within:
                return look()
        except (WaitTimeout, OSError) as exc:
            raise WaitTimeout(f"handoff {handoff_id}: no answer within {seconds:g}s, and where it "
                              f"stands cannot be read now: {_cause(exc, handoff_id)}",
                              handoff_id=handoff_id) from None

    return run


def _cause(exc: BaseException, handoff_id: str) -> str:
    """``exc``'s text on one line, without the "handoff x: no answer within Ns: " that a
    store's own bounded read puts first (it would say the wait's timeout twice)."""
    text = " ".join(str(exc).split())
    prefix = f"handoff {handoff_id}: no answer within "
    if isinstance(exc, WaitTimeout) and text.startswith(prefix):
        text = text[len(prefix):].partition(": ")[2] or text
    return text[:400]
