"""The PostgreSQL store's removal lock (:class:`~handoffd.core.storage.RemovalLock`): one lock
for every host that works the database, where each workspace's file lock
(``handoffs/.meta/retention.lock``) ordered the processes of its own host only. A purge on one
host then removed a completed dependency between another host's create's check ("the
dependency exists") and its write, and the dependent failed ``DEPENDENCY_MISSING``; two hosts
archiving at once each archived every document (each into its own ``.archive``).

It is a session-level advisory lock on a fixed key, taken on a connection of its own, opened for
the block and closed after it (never a pooled one: a pooled connection handed back still holding
it would hold it for as long as the pool lives). The server ends a dead client's session, and
with it the lock: a killed process, a crashed host or a cut network never leaves it held for
ever. Waiters queue on the server, first come first served (a releasing session hands it to the
first waiter before it can take it again), and are visible in ``pg_locks``: a long pass lets a
waiting create in between two batches (:meth:`PostgresRemovalLock.waited_for`).

The holder's session can end under it (a restarted server, ``pg_terminate_backend``): the
holding thread's purges check, in their own transaction, that the session still holds the key
(:meth:`PostgresRemovalLock.check_held`), and the pass stops rather than remove anything while
another host may be in its turn.
"""
from __future__ import annotations

import select
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import psycopg

from .connection import (BACKOFF_FIRST, BACKOFF_MAX, KEEPALIVES, Conn, StoreUnavailable, redact,
                         scrubbed)

# the lock's key, in the two-int4 key space of advisory locks ("hand", 1): the presence locks of
# claim owners (connection.Presence) use the single-bigint space, which never overlaps it
KEY = (0x68616E64, 1)
RELEASE_WAIT = 1.0  # seconds the unlock's answer is waited for before the session is closed
# pg_locks shows a two-key advisory lock as classid, objid and objsubid 2
IN_PG_LOCKS = ("locktype = 'advisory' AND classid = %s AND objid = %s AND objsubid = 2 "
               "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")

# the server's side of the holder's connection (its own defaults are the kernel's: two hours
# before a dead client's session, and the lock, end); ignored on a Unix socket
SERVER_KEEPALIVES = ("SET tcp_keepalives_idle = 15; SET tcp_keepalives_interval = 5; "
                     "SET tcp_keepalives_count = 3")


_COUNT = threading.Lock()  # guards PostgresRemovalLock._waiting


class RemovalLockLost(StoreUnavailable):
    """The session holding the removal lock ended under the pass (its lock went with it)."""


class PostgresRemovalLock:
    """The removal lock of the database at ``url``, for every host (see the module docstring).
    One per backend; each :meth:`hold` is a session of its own, so two threads of one process
    exclude each other too (a session's advisory locks are re-entrant within it)."""

    name = "the PostgreSQL store's removal lock"

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self._mine = threading.local()  # the connection whose session holds it, per thread
        # the threads of this process take turns here first, so that one process holds one
        # session for the lock at most: 150 creates with dependencies at once each opened a
        # session and queued it on the server (99 connections: every slot the server had)
        self._turn = threading.RLock()
        self._waiting = 0  # threads of this process waiting for their turn (waited_for)

    @contextmanager
    def hold(self, wait: float) -> Iterator[bool]:
        """Hold the lock for the block; yields False when another session holds it past
        ``wait`` seconds (0: not waited for). StoreUnavailable when the database cannot be
        reached within that time (one try at least), or is lost while waiting."""
        ends = time.monotonic() + max(wait, 0.0)
        with self._turn_within(wait) as turn:
            if not turn:  # another thread of this process held it past the wait
                yield False
                return
            conn = self._connect(ends)
            try:
                if not _acquire(conn, ends - time.monotonic(), wait > 0):
                    yield False
                    return
                self._mine.conn = conn
                try:
                    yield True
                finally:
                    self._mine.conn = None
                    _release(conn)
            finally:
                conn.close()  # (the session ends, and its lock with it: no unlock to forget)

    @contextmanager
    def _turn_within(self, wait: float) -> Iterator[bool]:
        """This process's turn at the lock (see ``_turn``), waited for at most ``wait``
        seconds (0: not waited for); whether it was had."""
        with self._count_waiting():
            had = self._turn.acquire(timeout=wait) if wait > 0 \
                else self._turn.acquire(blocking=False)
        try:
            yield had
        finally:
            if had:
                self._turn.release()

    @contextmanager
    def _count_waiting(self) -> Iterator[None]:
        """Count this thread among those waiting for their turn while it waits."""
        with _COUNT:
            self._waiting += 1
        try:
            yield
        finally:
            with _COUNT:
                self._waiting -= 1

    def held(self) -> bool:
        """This thread holds the lock (within :meth:`hold`)."""
        return getattr(self._mine, "conn", None) is not None

    def check_held(self, conn: Conn) -> None:
        """When this thread holds the lock: RemovalLockLost unless its session still holds it,
        as seen by ``conn``'s transaction (a purge's: it deletes only while the lock is ours)."""
        mine = getattr(self._mine, "conn", None)
        if mine is None:
            return
        try:
            pid = mine.info.backend_pid  # (known locally: no round trip on a dead session)
        except psycopg.Error:
            pid = 0
        found = conn.execute(f"SELECT 1 FROM pg_locks WHERE {IN_PG_LOCKS} AND granted "
                             "AND pid = %s", (*KEY, pid)).fetchone()
        if found is None:
            raise RemovalLockLost("the session holding the PostgreSQL store's removal lock "
                                  "ended (a restart, a cut connection): the pass stops, "
                                  "nothing more removed")

    def waited_for(self) -> bool:
        """Another session waits for the lock now: the holder lets it in between two batches.
        Asked on the holder's own session (False when this thread holds none, or it is lost:
        the pass's next purge then stops it)."""
        mine = getattr(self._mine, "conn", None)
        if mine is None:
            return False
        if self._waiting:  # a thread of this process waits for its turn (never on the server)
            return True
        try:
            found = mine.execute(f"SELECT 1 FROM pg_locks WHERE {IN_PG_LOCKS} AND NOT granted "
                                 "LIMIT 1", KEY).fetchone()
        except psycopg.Error:
            return False
        return found is not None

    def _connect(self, ends: float) -> Conn:
        """A connection of its own (autocommit: the lock is the session's, no transaction stays
        open), tried again with backoff until ``ends`` while the server is unreachable."""
        delay = BACKOFF_FIRST
        while True:
            timeout = max(min(self.connect_timeout, ends - time.monotonic()), 1.0)
            try:
                conn = psycopg.connect(self.url, autocommit=True,
                                       connect_timeout=int(timeout), **KEEPALIVES)
                try:  # the server too notices a holder whose host died or was cut off within
                    conn.execute(SERVER_KEEPALIVES)  # a minute, not its kernel's two hours
                except BaseException:
                    conn.close()
                    raise
                return conn
            except psycopg.OperationalError as exc:
                left = ends - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(
                        f"the PostgreSQL store {redact(self.url)} is unreachable (its removal "
                        f"lock): {scrubbed(' '.join(str(exc).split()), self.url)[:200]}"
                    ) from None
                time.sleep(min(delay, left))
                delay = min(delay * 2, BACKOFF_MAX)


def _release(conn: Conn) -> None:
    """Unlock before the session is closed: a closed session's lock goes only once the server's
    backend has exited, and the next turn's new session, queued behind that, showed in
    ``pg_locks`` as a waiter (a test's "1 sessions queued"). Its answer is waited for
    :data:`RELEASE_WAIT` seconds at most (a cut network never holds a removal pass here: the
    close that follows ends the session, and its lock, in any case). Best effort: a lost session
    took its lock with it."""
    pg = conn.pgconn
    ends = time.monotonic() + RELEASE_WAIT
    try:
        pg.send_query(b"SELECT pg_advisory_unlock(%d, %d)" % KEY)
        while True:
            unsent = pg.flush()  # (0: all of it sent)
            if not unsent:
                pg.consume_input()
                if not pg.is_busy():
                    return  # answered: the lock is free
            left = ends - time.monotonic()
            if left <= 0:
                return
            select.select([pg.socket], [pg.socket] if unsent else [], [], left)
    except (psycopg.Error, OSError):
        pass


def _acquire(conn: Conn, left: float, waits: bool) -> bool:
    """Take the lock on ``conn``'s session: at once or not at all (``waits`` False), else
    queued for at most ``left`` seconds (the server's lock_timeout ends the wait). A connection
    lost meanwhile: StoreUnavailable."""
    try:
        if not waits or left <= 0:
            row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", KEY).fetchone()
            return bool(row and row[0])
        conn.execute(f"SET lock_timeout = {max(int(left * 1000), 1)}")
        conn.execute("SELECT pg_advisory_lock(%s, %s)", KEY)
        return True
    except psycopg.errors.LockNotAvailable:
        return False
    except psycopg.OperationalError as exc:
        raise StoreUnavailable("lost the PostgreSQL store while waiting for its removal lock: "
                               f"{' '.join(str(exc).split())[:200]}") from None
