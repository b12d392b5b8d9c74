"""Where ``wait_handoff``'s blocking waits run: a daemon thread each, counted while it lives.

On the event loop's default pool (a few threads, shared with every other tool) a client with a
few long waits outstanding starved every later call, and the pool's threads are joined at exit,
so a long wait kept the server alive after its client had gone. So each wait has a thread of its
own, and the threads are capped: at most ``limit`` at once, and (over HTTP, where many clients
share one server) at most ``per_session`` for one MCP session, so that one client cannot take
every wait from the others.

A thread counts until it has ended, not until its caller stopped listening: the count was the
caller's, so a wait cancelled by its client (``notifications/cancelled``) left a thread waiting
out its whole timeout that no longer counted, and threads grew without bound. Now a caller that
goes away sets the wait's :class:`~handoffd.backends.base.WaitStop`, which wakes the thread and
ends it at once. (Over HTTP the SDK does not cancel a request whose client hung up; its wait
runs on to its timeout, within its session's share.)
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Hashable

from mcp.server.mcpserver.exceptions import ToolError

from .waiting import WaitStop

MAX_WAITS = 200  # wait_handoff calls in progress at once (a thread each)
MAX_WAITS_PER_SESSION = 50  # of those, for one session over HTTP (a quarter: never all of them)


class Waits:
    """Runs waits on threads of their own, at most ``limit`` alive at once (``per_session``:
    at most that many for one session key; None: no per-session cap)."""

    def __init__(self, limit: int = MAX_WAITS, per_session: int | None = None) -> None:
        self.limit = limit
        self.per_session = per_session
        self.running = 0  # threads alive (decremented by each thread as it ends)
        self._by_session: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def _take(self, session: Hashable) -> None:
        """Count one more thread for ``session``; ToolError (BUSY) past a cap."""
        with self._lock:
            if self.running >= self.limit:
                raise ToolError(f"BUSY: {self.running} waits are in progress (at most "
                                f"{self.limit}); wait for one to end, or use get_handoff")
            held = self._by_session.get(session, 0)
            if self.per_session is not None and held >= self.per_session:
                raise ToolError(f"BUSY: this session has {held} waits in progress (at most "
                                f"{self.per_session}); wait for one to end, or use get_handoff")
            self.running += 1
            self._by_session[session] = held + 1

    def _give_back(self, session: Hashable) -> None:
        with self._lock:
            self.running -= 1
            held = self._by_session.get(session, 1) - 1
            if held > 0:
                self._by_session[session] = held
            else:
                self._by_session.pop(session, None)

    async def run(self, wait: Callable[[float, WaitStop], Any], seconds: float,
                  session: Hashable = None) -> Any:
        """``wait(seconds, stop)`` on a thread of its own; ToolError (BUSY) past a cap. If this
        coroutine is cancelled (or ends any other way), ``stop`` is set: the thread ends."""
        self._take(session)
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
                self._give_back(session)

        try:
            threading.Thread(target=body, name="mcp-wait", daemon=True).start()
        except BaseException:  # no thread (e.g. the system's limit): nothing runs to give back
            self._give_back(session)
            raise
        try:
            return await future
        finally:
            stop.set()  # (cancelled: the thread stops waiting now; done: a no-op)
