"""The PostgreSQL backend: the :class:`Backend` interface over one database, shared by every host.

Each handoff is one row of ``handoffd.handoffs``: the document as ``json`` (its text as written,
so it reads back with its keys in their own order; jsonb would sort them) and, beside it, the
columns scheduling needs (state, routing facts from ``describe``, due time, lease). Every
transition is one transaction that also appends its ``handoffd.events`` row and sends a
``NOTIFY`` (delivered at commit, so a woken reader always sees the new state).

:class:`PostgresBackend` opens the database (schema migrated on open), hands out the shared
records and logs, and carries the wake-ups; its other parts are mixins, one module per role:

* :mod:`~handoffd.backends.postgres.reading`: ``get``, ``list``, ``ids``, ``peek``.
* :mod:`~handoffd.backends.postgres.writes`: create, import, reopen, set aside, purge.
* :mod:`~handoffd.backends.postgres.claims`: claim-next in one statement, token-fenced renew,
  finish and requeue.
* :mod:`~handoffd.backends.postgres.recovery`: taking over claims whose lease expired or whose
  owner died.
* :mod:`~handoffd.backends.postgres.records`: the shared helpers, side records (cancel
  requests, seen ids, quarantine) and file origins.

Wake-ups: the writer's own subscribers are told at once; other processes hear the NOTIFY on a
dedicated LISTEN connection (a hint only: daemons keep their periodic rescans).
"""
from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Callable, Collection, Iterator

import psycopg

from ...core.errors import WaitTimeout
from ...core.states import State
from ...core.storage import LOST
from ..base import (
    Backend,
    Describe,
    Doc,
    FencedFiling,
    Subscribers,
    WakeupCallback,
    describe_native,
    only_kinds,
    wait_via_feed,
)
from ..files.store import BOOKKEEPING_MARGIN_BYTES, FILED_MARGIN_BYTES
from .claims import Claiming
from .connection import Conn, Database, Listener, Presence, StoreUnavailable, deadline, refusal
from .context import KIND as CONTEXT
from .context import PostgresContext, PostgresViolations
from .reading import Reading
from .records import T, FileOrigins, SideRecords
from .recovery import Recovery
from .holds import KeyHolds
from .schema import LATEST, current_version, migrate
from .schema import check as check_schema
from .shared import PostgresEventLog, PostgresRecords
from .writes import Writes

log = logging.getLogger("handoffd")


class PostgresBackend(Claiming, Recovery, Reading, Writes, FencedFiling, SideRecords, FileOrigins,
                      Backend):
    """Handoffs in the PostgreSQL database at ``url`` (schema migrated on open).

    ``origin`` names this workspace (host and path) for documents ingested from its files;
    ``pool_size`` bounds the connections this process opens; ``max_document_bytes`` and
    ``max_output_bytes`` bound what is created and read, as in the files store."""

    #: daemons of other hosts work this store too: a handoff no specialist of ours serves is
    #: usually theirs (the daemon says so at info level, not as a warning)
    shared = True

    def __init__(self, url: str, *, describe: Describe = describe_native,
                 seen_ttl_seconds: float = 3600.0, pool_size: int = 8,
                 reconnect_seconds: float = 60.0, origin: str | None = None,
                 owner_grace_seconds: float = 10.0,
                 monotonic: Callable[[], float] = time.monotonic,
                 max_document_bytes: int = 4 * 1024 * 1024,
                 max_output_bytes: int = 16 * 1024 * 1024,
                 connect_timeout: float = 10.0) -> None:
        self.url = url
        # what a request may be, and what a row is read up to (as the files store reads a
        # file): a document over it is refused by create and set aside unread when pending
        self.max_bytes = max_document_bytes
        self.max_open_bytes = max_document_bytes + BOOKKEEPING_MARGIN_BYTES
        self.max_filed_bytes = max_document_bytes + max_output_bytes + FILED_MARGIN_BYTES
        self.describe = describe
        self.seen_ttl = timedelta(seconds=seen_ttl_seconds)
        self.origin = origin
        self.owner_grace = owner_grace_seconds
        self.monotonic = monotonic
        self.owner_key = secrets.randbits(62) + 1  # positive: it is split into two oids
        self._presence: Presence | None = None
        self._presence_lock = threading.Lock()
        self._absent: dict[tuple[str, str | None], float] = {}  # (Recovery)
        self._unheld: dict[tuple[str, str | None], float] = {}  # (Recovery, no key held)
        # (Recovery: dead-looking owners' keys; waiters let go of as often as an owner beats)
        # (idle 0.3 of a grace at most: a stalled holder's keys go, and a waiting owner takes
        # its key again, before its grace/2 fence stops its handlers)
        self._holds = KeyHolds(url, monotonic, beat=min(1.0, max(owner_grace_seconds / 10, 0.05)),
                               idle_seconds=0.3 * owner_grace_seconds,
                               connect_timeout=connect_timeout)
        self._stale: dict[tuple[str, str | None, datetime | None], float] = {}  # (Recovery)
        self._given_up: set[str] = set()  # (ClaimOwner.abandon)
        self._written: dict[tuple[str, str | None], tuple[datetime, float]] = {}  # (ClaimOwner)
        self._aside = threading.local()  # the last set_aside of each thread (Writes)
        self.db = Database(url, max_size=pool_size, reconnect_seconds=reconnect_seconds,
                           connect_timeout=connect_timeout)
        self.nonce = uuid.uuid4().hex[:12]  # our own notifications, told apart from others'
        self._subscribers = Subscribers()
        self._listener: Listener | None = None
        self._report_level = logging.WARNING  # of lost/back lines (see quiet_reconnects)
        try:
            self.schema_version = self.db.run(lambda conn, _: _ensure_schema(conn))
        except psycopg.Error as exc:  # e.g. a role that may not create or read the tables
            self.db.close()
            raise refusal(exc, url, "set up handoffd's tables") from None
        except BaseException:
            self.db.close()
            raise

    def maintain(self, now: datetime, *,
                 skip: Collection[str] = ()) -> dict[str, builtins.list[str]]:
        self.db.run(lambda conn, _: conn.execute("DELETE FROM handoffd.seen WHERE seen_at <= %s",
                                                 (now - self.seen_ttl,)))
        self.db.run(lambda conn, _: self.event_log().trim(conn))
        if self._listener is not None and len(self._subscribers) and not self._listener.alive():
            log.warning("the wake-up listener died; restarting it (and rescanning)")
            self._listener.start()
            self._subscribers.fire("", LOST)
        return {}

    def takeovers_left(self) -> builtins.list[tuple[str, str]]:
        """The claims whose owner its sweeps watched gone for a whole ``owner_grace`` and did
        not take over (:meth:`~.recovery.Recovery.takeover_watch`'s, come due), each with why,
        for a batch that ends without them: a row another session holds locked (a ``SELECT
        ... FOR UPDATE`` left open: the takeover skips a locked row), or not taken for another
        reason (a memory back-off, a row changed meanwhile). Found with ``FOR UPDATE SKIP
        LOCKED``, the takeover's own look, in a transaction that writes nothing (the locks
        it takes on free rows end with it)."""
        tick = self.monotonic()
        watched = sorted({(hid, token) for (hid, token), first in self._absent.items()
                          if tick - first >= self.owner_grace}, key=lambda w: (w[0], w[1] or ""))
        if not watched:
            return []
        due = [hid for hid, _ in watched]
        tokens = [token for _, token in watched]

        def op(conn: Conn, _retried: bool) -> tuple[set[str], set[str]]:
            # still held by the claim that was watched (a takeover since, whose own claim may
            # still run, is no claim left: the watch is only pruned by the next sweep's look)
            where = (f"SELECT t.id FROM {T} t JOIN unnest(%s::text[], %s::text[]) AS w(id, token)"
                     " ON t.id = w.id AND t.lease_token IS NOT DISTINCT FROM w.token"
                     " WHERE t.state = 'in-progress'")
            there = {row[0] for row in conn.execute(where, (due, tokens)).fetchall()}
            free = {row[0] for row in
                    conn.execute(where + " FOR UPDATE OF t SKIP LOCKED", (due, tokens)).fetchall()}
            return there, free

        there, free = self.db.run(op)
        return [(hid, "its row is locked by another database session" if hid not in free
                 else "it was not taken over in time") for hid in dict.fromkeys(due)
                if hid in there]

    def records(self) -> PostgresRecords:
        """Pauses and rate buckets, shared by every host (``handoffd.records``)."""
        return PostgresRecords(self.db)

    def event_log(self) -> PostgresEventLog:
        """The event stream every host appends to and reads (``handoffd.event_log``)."""
        return PostgresEventLog(self.db)

    def shared_context(self) -> PostgresContext:
        """The shared context every host reads and writes (``handoffd.context``); a write wakes
        every subscriber, here and on other hosts, with kind ``context`` and the key."""
        return PostgresContext(self.db, lambda conn, key: self._notify(conn, key, CONTEXT),
                               lambda key: self._subscribers.fire(key, CONTEXT))

    def violation_log(self) -> PostgresViolations:
        """The contract violations log of every host (``handoffd.violations``)."""
        return PostgresViolations(self.db)

    def wait_terminal(self, handoff_id: str, timeout: float | None) -> tuple[State, Doc]:
        with self.waiting(handoff_id, timeout):
            return wait_via_feed(self, handoff_id, timeout)

    @contextmanager
    def waiting(self, handoff_id: str, timeout: float | None) -> Iterator[None]:
        """A wait for ``handoff_id`` of at most ``timeout`` seconds (None: no limit): within the
        block, this thread's operations that lose the database give up when the wait's time is
        up rather than after the reconnect window, and the wait then ends as one that timed
        out (WaitTimeout, saying the store is unreachable): ``--timeout`` holds, store or not."""
        if timeout is None:
            yield
            return
        ends = time.monotonic() + timeout
        try:
            with deadline(timeout):
                yield
        except StoreUnavailable as exc:
            if time.monotonic() < ends:
                raise
            raise WaitTimeout(f"handoff {handoff_id}: no answer within {timeout:g}s: {exc}",
                              handoff_id=handoff_id) from None

    def quiet_reconnects(self) -> None:
        """From now on, losing and regaining the database (the pool's and the wake-up
        listener's lines) are logged at debug level: for a command whose own last line says the
        store was away (``handoff wait``), where a daemon's warnings came out as lines of their
        own before it."""
        self._report_level = self.db.report_level = logging.DEBUG
        for thread in (self._listener, self._presence):
            if thread is not None:
                thread.report_level = logging.DEBUG

    def interrupt(self, grace_seconds: float = 0.0) -> None:
        """This process is stopping: from now on an operation that has lost the database gives
        up within ``grace_seconds`` instead of retrying for the reconnect window, so that a
        daemon's stop (its hand-backs, its last writes) ends within its grace. Operations
        whose connection works are not affected."""
        self.db.interrupt(grace_seconds)

    def resume(self) -> None:
        """A daemon serves again: retries last the whole reconnect window (undoes interrupt)."""
        self.db.resume()

    def subscribe(self, callback: WakeupCallback, *,
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        remove = self._subscribers.add(only_kinds(callback, kinds))
        if self._listener is None:
            self._listener = Listener(self.url, self._heard,
                                      lambda: self._subscribers.fire("", LOST),
                                      connect_timeout=self.db.connect_timeout)
            self._listener.report_level = self._report_level
        self._listener.start()

        def unsubscribe() -> None:
            remove()
            if self._listener is not None and not len(self._subscribers):
                self._listener.stop()  # nobody listens: no thread or connection left behind
        return unsubscribe

    def _heard(self, payload: str) -> None:
        sender, _, rest = payload.partition("\t")
        kind, _, handoff_id = rest.partition("\t")
        if sender != self.nonce and kind:  # our own writes were announced when made
            self._subscribers.fire(handoff_id, kind)

    def close(self) -> None:
        self.db.interrupt()  # a thread still retrying a lost connection gives up now
        if self._listener is not None:
            self._listener.close()
        if self._presence is not None:
            self._presence.close()
        self._holds.close()  # (the keys we watched: their owners may take them again)
        self.db.close()


def _ensure_schema(conn: Conn) -> int:
    """The schema version, migrating first when the database is behind (a cheap check); then
    SchemaDamaged, naming what is missing, when a table was altered by hand (every statement
    would fail on it later, once per handoff and second)."""
    version = current_version(conn)
    conn.commit()
    if version != LATEST:  # behind: migrate; ahead: migrate() refuses with SchemaTooNew
        version, _ = migrate(conn)
    check_schema(conn, version)
    return version
