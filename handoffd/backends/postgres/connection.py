"""Connections to the PostgreSQL store: a pool with reconnection, and the LISTEN thread.

:class:`Database` runs each operation on a pooled connection in one transaction. A lost
connection (a restarted server, ``pg_terminate_backend``, a network cut) is retried with backoff
for up to ``reconnect_seconds``, with one log line when it is lost and one when it is back; after
that the operation fails with :class:`StoreUnavailable` (an OSError: the daemon and the sweeper
already treat those as "try again later"). An operation whose commit may have happened before
the connection died is told so (``retried=True``) and checks its own fencing token first, so a
retry never applies a write twice.

:class:`Listener` holds one dedicated connection that LISTENs on the wake-up channel. What it
hears is a hint only: when the connection drops it reconnects with backoff and tells its reader
``lost`` (rescan), because notifications sent meanwhile are gone.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any, Callable, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from ...core.errors import HandoffdError

log = logging.getLogger("handoffd")
# psycopg_pool logs every failed (re)connection attempt, several lines each; handoffd says it in
# one line of its own (Database, SessionThread), so the pool's are kept out of every output
logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]
CHANNEL = "handoffd"
# a long-lived idle connection notices a server that vanished without closing it (a crashed host,
# a cut network) within about 30 s instead of the kernel's two hours
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 15, "keepalives_interval": 5,
                              "keepalives_count": 3}
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0


class StoreUnavailable(OSError):
    """The database could not be reached within the reconnection window."""


class StoreError(HandoffdError):
    """The store URL is unusable (bad URL, authentication, missing database)."""


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo
        parts = conninfo_to_dict(url)
    except Exception:  # not parseable: say nothing of it rather than leak a secret
        return "the store URL"
    if "password" in parts:
        parts["password"] = "***"
        return make_conninfo("", **parts)
    return url


def is_disconnect(exc: BaseException) -> bool:
    """True for errors that a new connection may cure (and that may be retried)."""
    return isinstance(exc, psycopg.OperationalError)


class Database:
    """A connection pool on ``url`` whose :meth:`run` survives lost connections."""

    def __init__(self, url: str, *, max_size: int = 8, reconnect_seconds: float = 60.0,
                 connect_timeout: float = 10.0) -> None:
        self.url = url
        self.reconnect_seconds = reconnect_seconds
        self._lost_since: float | None = None
        self._state_lock = threading.Lock()
        # one direct attempt first: a wrong URL, host or password fails at once with the
        # server's own words (the pool would retry quietly until its timeout)
        detail = _last_error(url, connect_timeout)
        if detail is not None:
            raise StoreError(f"cannot connect to the PostgreSQL store {redact(url)}: {detail}")
        self.pool: ConnectionPool[Conn] = ConnectionPool(
            url, min_size=1, max_size=max(max_size, 1), open=False, name="handoffd",
            timeout=connect_timeout, kwargs={"connect_timeout": max(int(connect_timeout), 1)})
        # no check on checkout (a round trip per operation): a connection that died while idle
        # fails its first statement, is discarded by the pool, and run() retries on a new one
        try:
            self.pool.open(wait=True, timeout=connect_timeout)
        except Exception as exc:
            self.pool.close(timeout=1.0)
            detail = _last_error(url) or str(exc)
            raise StoreError(f"cannot connect to the PostgreSQL store {redact(url)}: {detail}") \
                from None

    def run(self, operation: Callable[[Conn, bool], T]) -> T:
        """``operation(conn, retried)`` in one transaction (committed when it returns).
        ``retried`` is True when an earlier try lost its connection: it may have committed."""
        delay = BACKOFF_FIRST
        retried = False
        started = time.monotonic()
        while True:
            try:
                with self.pool.connection() as conn:
                    result = operation(conn, retried)
                self._back()
                return result
            except Exception as exc:
                if not is_disconnect(exc):
                    raise
                self._lost(exc)
                if time.monotonic() - started > self.reconnect_seconds:
                    raise StoreUnavailable(f"the PostgreSQL store {redact(self.url)} is "
                                           f"unreachable: {' '.join(str(exc).split())}") from None
                retried = True
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _lost(self, exc: BaseException) -> None:
        with self._state_lock:
            if self._lost_since is not None:
                return
            self._lost_since = time.monotonic()
        log.warning("lost the database connection (%s); reconnecting with backoff",
                    " ".join(str(exc).split())[:200] or type(exc).__name__)

    def _back(self) -> None:
        if self._lost_since is None:
            return
        with self._state_lock:
            since, self._lost_since = self._lost_since, None
        if since is not None:
            log.warning("reconnected to the database after %.1fs", time.monotonic() - since)

    def close(self) -> None:
        """Close every pooled connection."""
        self.pool.close(timeout=2.0)


def _last_error(url: str, timeout: float = 5.0) -> str | None:
    """Why a direct connection to ``url`` fails now (the pool's own error says only 'timeout');
    None when it connects."""
    try:
        psycopg.connect(url, connect_timeout=max(int(timeout), 1)).close()
    except Exception as exc:
        return " ".join(str(exc).split())[:300]
    return None


class SessionThread:
    """A thread holding one dedicated connection, set up by :meth:`_setup`, and re-established
    with backoff when it is lost (one log line when lost, one when back)."""

    what = "session"  # for the log lines
    thread_name = "handoffd-session"

    def __init__(self, url: str) -> None:
        self.url = url
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() interrupts the select at once
        os.set_blocking(self._wake_w, False)

    def _setup(self, conn: Conn) -> None:
        """Prepare a new connection (LISTEN, take a lock...)."""

    def _lost(self) -> None:
        """Called when the connection is lost and again when it is back."""

    def start(self) -> None:
        """Start the thread (returns once the first set-up is done, or after 5 s)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._ready.clear()
        self._drain_wake()
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread (at once: the pipe wakes its select) and close its connection."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: the thread is being woken already
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def close(self) -> None:
        """Stop the thread and release the wake-up pipe."""
        self.stop()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _loop(self) -> None:
        delay = BACKOFF_FIRST
        lost_at: float | None = None
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                                     **KEEPALIVES) as conn:
                    self._setup(conn)
                    self._ready.set()
                    if lost_at is not None:
                        log.warning("%s connection to the database is back after %.1fs",
                                    self.what, time.monotonic() - lost_at)
                        lost_at = None
                        self._lost()
                    delay = BACKOFF_FIRST
                    self._hold(conn)
            except Exception as exc:
                if self._stop.is_set():
                    break
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("lost the %s connection to the database (%s); reconnecting "
                                "with backoff", self.what, " ".join(str(exc).split())[:200])
                    self._lost()
                self._ready.set()  # nobody waits on a server that is down
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _hold(self, conn: Conn) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([conn.fileno(), self._wake_r], [], [], 5.0)
            if self._stop.is_set():
                return
            if conn.fileno() in readable:
                # notifications arrive with any result: a no-op round trip delivers them to the
                # handler (and raises at once when the server has closed the connection)
                conn.execute("SELECT 1")

    def _drain_wake(self) -> None:
        os.set_blocking(self._wake_r, False)
        try:
            while os.read(self._wake_r, 64):
                pass
        except OSError:  # empty
            pass


class Listener(SessionThread):
    """LISTENs on :data:`CHANNEL` and calls ``on_payload(text)`` for each notification, or
    ``on_lost()`` when notifications may have been missed (lost connection: rescan)."""

    what = "wake-up"
    thread_name = "handoffd-listen"

    def __init__(self, url: str, on_payload: Callable[[str], None],
                 on_lost: Callable[[], None]) -> None:
        super().__init__(url)
        self.on_payload = on_payload
        self.on_lost = on_lost

    def _setup(self, conn: Conn) -> None:
        conn.add_notify_handler(lambda n: self._deliver(n.payload))
        conn.execute(f"LISTEN {CHANNEL}")

    def _lost(self) -> None:
        self.on_lost()

    def _deliver(self, payload: str) -> None:
        try:
            self.on_payload(payload)
        except Exception:  # a reader's bug must not end the listening thread
            log.exception("wake-up handler failed")


class Presence(SessionThread):
    """Holds the session-level advisory lock ``key`` while this process lives: claims record
    the key, and a claim whose key no session holds belongs to a process that died (the server
    ends a dead client's session, and with it the lock)."""

    what = "presence"
    thread_name = "handoffd-presence"

    def __init__(self, url: str, key: int) -> None:
        super().__init__(url)
        self.key = key

    def _setup(self, conn: Conn) -> None:
        conn.execute("SELECT pg_advisory_lock(%s)", (self.key,))
