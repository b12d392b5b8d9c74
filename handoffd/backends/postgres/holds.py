"""The presence keys a sweep holds while it watches their owners' claims (:class:`KeyHolds`).

A sweep that sees an owner's presence key unheld takes that key itself, on a session of its
own, and takes the owner's claims over only once it has held the key for the whole owner grace.
Seeing the key unheld at every look was not enough (R56): an owner whose presence session was
cut every few hundredths of a second took its key again each time, so it kept proving alive and
kept its claims, while a sweep whose looks all landed in the gaps took them over beside it. With
the key held by the sweep, the owner cannot take it again, cannot prove its presence, and stops
its handlers at half the grace (:meth:`~handoffd.backends.postgres.claims.ClaimOwner.
broken_claims`), however its session flaps. Another sweep sees the key held and waits; a sweep
that dies lets go of it with its session, and the others start watching afresh.

A live owner whose session was merely cut (a server restart, ``pg_terminate_backend``) waits
for its key when it reconnects. A thread looks for such waiters every ``beat`` seconds while
keys are held and lets go of their keys at once: the owner takes its key again and keeps its
claims, as it did before sweeps held keys (a sweep lands in the gap of a restart often enough,
and sweeps come every ten seconds by default: a hold kept until then outlasted half the grace,
and the owner's running handlers were stopped).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import psycopg

from .connection import KEEPALIVES, SESSION_STOP_SECONDS, Conn, session_connect

log = logging.getLogger("handoffd")
MAX_HELD = 1000  # keys one process holds at once (each a dead-looking owner; more wait a sweep)
CLOSE_WAIT_SECONDS = 2.0  # a close waits this long for a round trip under way
# of the keys given (%s), those a session waits for (not granted: only their owners wait)
WAITED = ("SELECT DISTINCT (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks l "
          "WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND NOT l.granted "
          "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
          "AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY(%s::bigint[])")


class KeyHolds:
    """A dedicated session (opened at the first use, again after it is lost) holding presence
    keys: ``key -> since`` (this process's monotonic clock: when it took the key). A lost
    session lost its holds with it: they are forgotten, and each watch starts afresh."""

    def __init__(self, url: str, monotonic: Callable[[], float], beat: float = 1.0,
                 idle_seconds: float = 3.0, connect_timeout: float = 5.0) -> None:
        self.url = url
        self.connect_timeout = connect_timeout  # ([store] connect_timeout_seconds)
        self.monotonic = monotonic
        self.beat = beat  # how often waiters for the keys held are looked for
        # the server ends the holding session once it has been idle this long (the thread's
        # look each beat keeps it busy while keys are held): a holder that stalls (SIGSTOP, a
        # paused VM) lets go of its keys within it, and their owners take them again (R61: a
        # stopped holder kept a live owner from its key, and its claims, for the whole stall)
        self.idle_seconds = idle_seconds
        self._unheld_said = False  # "no session to hold keys" said (once till one is had)
        self.since: dict[int, float] = {}
        self.pid = 0  # the session's backend pid (0: none)
        self._conn: Conn | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def session(self) -> int:
        """The holding session's backend pid, proved alive by a round trip (so every key it
        holds has been held without a break since taken), or a new session when it was lost;
        0 when none can be had now (then no key is held and no owner is taken over for being
        gone: its claims wait for a later sweep)."""
        with self._lock:
            if self._closed.is_set():
                return 0
            if self._conn is not None:
                try:
                    self._conn.execute("SELECT 1")
                    return self.pid
                except (psycopg.Error, OSError):
                    self._drop()
            try:
                self._conn = psycopg.connect(
                    self.url, autocommit=True, connect_timeout=session_connect(self.connect_timeout),
                    **KEEPALIVES)
                self.pid = self._conn.info.backend_pid
                self._idle_bound(self._conn)
                if self._unheld_said:
                    self._unheld_said = False
                    log.warning("a session to hold dead-looking owners' keys is had again")
            except (psycopg.Error, OSError) as exc:
                if not self._unheld_said:  # (their claims are judged by their leases meanwhile)
                    self._unheld_said = True
                    log.warning("no session to hold dead-looking owners' keys (%s): their "
                                "owners are watched as before keys were held (a takeover "
                                "beside an owner whose session flaps is possible meanwhile)",
                                " ".join(str(exc).split())[:200] or type(exc).__name__)
                self._drop()
            return self.pid

    def _idle_bound(self, conn: Conn) -> None:
        """Have the server end ``conn``'s session once idle for :attr:`idle_seconds` (servers
        before PostgreSQL 14 know no such bound: their holds last while the session does)."""
        try:
            conn.execute(f"SET idle_session_timeout = {max(int(self.idle_seconds * 1000), 100)}")
        except psycopg.errors.UndefinedObject:
            pass

    def sessionless(self) -> bool:
        """Whether no holding session is had now (none could be opened, or it was lost)."""
        with self._lock:
            return self._conn is None

    def take(self, key: int) -> float | None:
        """When this session took ``key`` (taking it now if it is free); None when another
        session holds it (its owner, back, or another sweep), no session is had, or
        :data:`MAX_HELD` keys are held already."""
        with self._lock:
            if key in self.since:
                return self.since[key]
            if self._conn is None or len(self.since) >= MAX_HELD:
                return None
            try:
                row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            except (psycopg.Error, OSError):
                self._drop()
                return None
            if row is None or not row[0]:
                return None
            self.since[key] = self.monotonic()  # (after the lock: held at least since then)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._release_waited, daemon=True,
                                                name="handoffd-holds")
                self._thread.start()
            return self.since[key]

    def keep_only(self, keys: set[int]) -> None:
        """Let go of every key held but ``keys`` (their owners' claims were taken over, or none
        is left), so a living owner can take its key again and claim new work."""
        with self._lock:
            for key in [k for k in self.since if k not in keys]:
                del self.since[key]
                if self._conn is None:
                    continue
                try:
                    self._conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
                except (psycopg.Error, OSError):
                    self._drop()  # (the session, and every hold with it, is gone)

    def release_waited(self) -> None:
        """Let go of every key held that a session waits for: its owner, back, takes it."""
        with self._lock:
            if not self.since or self._conn is None:
                return
            try:
                waited = self._conn.execute(WAITED, (list(self.since),)).fetchall()
                for (key,) in waited:
                    del self.since[int(key)]
                    self._conn.execute("SELECT pg_advisory_unlock(%s)", (int(key),))
            except (psycopg.Error, OSError):
                self._drop()

    def _release_waited(self) -> None:
        """The thread: :meth:`release_waited` every ``beat`` until :meth:`close`."""
        while not self._closed.wait(self.beat):
            try:
                self.release_waited()
            except Exception:  # (a bug here must not end the thread: the sweep still lets go)
                log.exception("looking for owners waiting for their keys failed")

    def close(self) -> None:
        """Let go of every key: the session ends (and the thread that looks for waiters). Bounded:
        a round trip under way on a cut network (holding the lock) is cut by closing its
        connection from here (R61: a close waited for it for ever)."""
        self._closed.set()
        if self._lock.acquire(timeout=CLOSE_WAIT_SECONDS):
            try:
                self._drop()
            finally:
                self._lock.release()
        else:
            conn = self._conn
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # (whatever the connection's state: it is being left)
                    pass
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=SESSION_STOP_SECONDS)

    def _drop(self) -> None:
        """Forget the session and its holds (closed if it is still open)."""
        conn, self._conn = self._conn, None
        self.since.clear()
        self.pid = 0
        if conn is not None:
            try:
                conn.close()
            except Exception:  # (closing a broken connection: nothing more to do)
                pass
