"""The PostgreSQL backend: the :class:`Backend` interface over one database, shared by every host.

Each handoff is one row of ``handoffd.handoffs``: the document as ``json`` (its text as written,
so it reads back with its keys in their own order; jsonb would sort them) and, beside it, the
columns scheduling needs (state, routing facts from ``describe``, due time, lease). Every
transition is one transaction that also appends its ``handoffd.events`` row and sends a
``NOTIFY`` (delivered at commit, so a woken reader always sees the new state).

* claim-next is one statement, ``UPDATE ... WHERE id = (SELECT ... ORDER BY priority, due_at,
  id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING ...``: concurrent claimers on any host skip each
  other's rows instead of waiting. The claimed document (attempt, lease, the format's marks from
  ``prepare``) is written in the same transaction, fenced by the new token.
* renew, finish and requeue are ``... WHERE id = %s AND lease_token = %s``: once a claim was
  requeued, finished or taken over by :meth:`expired_claims`, its writes change nothing.
* wake-ups: the writer's own subscribers are told at once; other processes hear the NOTIFY on a
  dedicated LISTEN connection (a hint only: daemons keep their periodic rescans).
* recovery: :meth:`expired_claims` takes over claims whose lease expired, and also claims whose
  owner died: a claimer holds a session-level advisory lock (its presence key, recorded with each
  claim) on a connection of its own, which the server releases when the process dies. A key no
  session has held for ``owner_grace_seconds`` (watched on this process's monotonic clock, so a
  server restart or a terminated connection, after which live owners take their key again,
  never ends a live claim) means its claims are recovered without waiting for their lease.
"""
from __future__ import annotations

import builtins
import copy
import logging
import secrets
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Callable, Collection, Iterator

import psycopg

from ...core.documents import BOOK, book, book_int
from ...core.errors import DuplicateHandoff, InvalidDocument, InvalidTransition, WaitTimeout
from ...core.states import State
from ...core.storage import LOST
from ...core.timeutil import iso, utc_now
from ..base import (
    Backend,
    Claim,
    Claims,
    Describe,
    Doc,
    FencedFiling,
    Meta,
    Order,
    Row,
    Rows,
    Subscribers,
    WakeupCallback,
    Where,
    describe_native,
    lease_block,
    only_kinds,
    stamp_claimed,
    stamp_created,
    wait_via_feed,
)
from .connection import Conn, Database, Listener, Presence, StoreUnavailable, deadline, refusal
from .context import KIND as CONTEXT
from .context import PostgresContext, PostgresViolations
from .records import FileOrigins, SideRecords, T, encode
from .schema import LATEST, current_version, migrate
from .schema import check as check_schema
from .shared import PostgresEventLog, PostgresRecords
from .values import document
from .values import unreadable as unreadable_doc

log = logging.getLogger("handoffd")
COLUMNS = "id, state, doc, target, priority, conversation, parent, due_at, updated_at"
# a claim of another process whose presence key no session of this database holds
OWNER_GONE = ("(h.lease_owner IS NOT NULL AND h.lease_owner <> %(me)s AND NOT EXISTS ("
              "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
              "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
              "WHERE datname = current_database()) "
              "AND ((l.classid::bigint << 32) | l.objid::bigint) = h.lease_owner))")


class PostgresBackend(FencedFiling, SideRecords, FileOrigins, Backend):
    """Handoffs in the PostgreSQL database at ``url`` (schema migrated on open).

    ``origin`` names this workspace (host and path) for documents ingested from its files;
    ``pool_size`` bounds the connections this process opens."""

    #: daemons of other hosts work this store too: a handoff no specialist of ours serves is
    #: usually theirs (the daemon says so at info level, not as a warning)
    shared = True

    def __init__(self, url: str, *, describe: Describe = describe_native,
                 seen_ttl_seconds: float = 3600.0, pool_size: int = 8,
                 reconnect_seconds: float = 60.0, origin: str | None = None,
                 owner_grace_seconds: float = 10.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.describe = describe
        self.seen_ttl = timedelta(seconds=seen_ttl_seconds)
        self.origin = origin
        self.owner_grace = owner_grace_seconds
        self.monotonic = monotonic
        self.owner_key = secrets.randbits(62) + 1  # positive: it is split into two oids
        self._presence: Presence | None = None
        self._presence_lock = threading.Lock()
        self._absent: dict[tuple[str, str], float] = {}  # (id, token) -> owner first seen gone
        self.db = Database(url, max_size=pool_size, reconnect_seconds=reconnect_seconds)
        self.nonce = uuid.uuid4().hex[:12]  # our own notifications, told apart from others'
        self._subscribers = Subscribers()
        self._listener: Listener | None = None
        try:
            self.schema_version = self.db.run(lambda conn, _: _ensure_schema(conn))
        except psycopg.Error as exc:  # e.g. a role that may not create or read the tables
            self.db.close()
            raise refusal(exc, url, "set up handoffd's tables") from None
        except BaseException:
            self.db.close()
            raise

    @staticmethod
    def _row(record: tuple[Any, ...], unreadable: bool) -> Row | None:
        """A listed row; one that holds no usable document (see :func:`values.document`) is a
        row with its ``problem`` when ``unreadable``, else left out."""
        handoff_id, state, value, target, priority, conversation, parent, due_at, updated = record
        try:
            doc = document(value, handoff_id, state)
        except InvalidDocument as exc:
            return Row(handoff_id, State(state), {}, Meta(None), due_at, updated,
                       problem=unreadable_doc(exc, handoff_id)) if unreadable else None
        return Row(handoff_id, State(state), doc, Meta(target, priority, conversation, parent),
                   due_at, updated)

    # ------------------------------------------------------------ creating and reading
    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        stored = copy.deepcopy(doc)
        stamp_created(stored, handoff_id, now, due_at)  # a later due_at: its next_attempt_at
        text = encode(stored, strict=True)
        columns = self._columns(stored, now)
        write_id = uuid.uuid4().hex

        def op(conn: Conn, retried: bool) -> None:
            if retried and _wrote(conn, handoff_id, write_id):
                return  # the first try committed before its connection died
            found = conn.execute(f"SELECT state FROM {T} WHERE id = %s", (handoff_id,)).fetchone()
            if found is not None:
                raise DuplicateHandoff(f"handoff {handoff_id} already exists in {found[0]}/; "
                                       "choose another id or `handoff retry` the existing one",
                                       handoff_id=handoff_id)
            if self._seen_recently(conn, handoff_id, now):
                raise DuplicateHandoff(f"handoff id {handoff_id} was used within the last "
                                       f"{int(self.seen_ttl.total_seconds())}s; choose another id",
                                       handoff_id=handoff_id)
            inserted = conn.execute(
                f"INSERT INTO {T} (id, state, doc, target, priority, conversation, parent, due_at,"
                " updated_at, created_at, write_id) VALUES (%(id)s, 'pending', %(doc)s::json,"
                " %(target)s, %(priority)s, %(conversation)s, %(parent)s, %(due_at)s,"
                " %(updated_at)s, %(now)s, %(write_id)s) ON CONFLICT (id) DO NOTHING RETURNING id",
                {**columns, "id": handoff_id, "doc": text, "now": now, "write_id": write_id},
            ).fetchone()
            if inserted is None:  # a concurrent create won the race
                raise DuplicateHandoff(f"handoff {handoff_id} already exists; choose another id",
                                       handoff_id=handoff_id)
            self._seen_upsert(conn, handoff_id, now)
            self._event(conn, handoff_id, stored, State.PENDING, "created")
            self._notify(conn, handoff_id, State.PENDING.value)

        self.db.run(op)
        self._subscribers.fire(handoff_id, State.PENDING.value)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT state, doc FROM {T} WHERE id = %s", (handoff_id,)).fetchone())
        if found is None:
            return None
        # InvalidDocument (one line, with its code) for a row that holds no usable document
        return State(found[0]), document(found[1], handoff_id, found[0])

    def list(self, *, state: State | None = None, target: str | None = None,
             conversation: str | None = None, parent: str | None = None,
             since: datetime | None = None, limit: int | None = None,
             order: Order = "newest", where: Where | None = None,
             unreadable: bool = False, before: datetime | None = None) -> Rows:
        clauses: builtins.list[str] = []
        params: builtins.list[Any] = []
        for column, value in (("state", state.value if state else None), ("target", target),
                              ("conversation", conversation), ("parent", parent)):
            if value is not None:
                clauses.append(f"{column} = %s")
                params.append(value)
        if since is not None:
            clauses.append("updated_at >= %s")
            params.append(since)
        if before is not None:
            clauses.append("updated_at < %s")
            params.append(before)
        sort = {"due": "priority, due_at, id", "oldest": "updated_at, id"}.get(
            order, "updated_at DESC, id DESC")
        sql = f"SELECT {COLUMNS} FROM {T}" + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
        sql += f" ORDER BY {sort}"
        if limit is not None and where is None:  # ``where`` is ours to apply before the limit
            sql += " LIMIT %s"
            params.append(max(limit, 0))
        if limit is not None and limit <= 0:
            return []
        records = self.db.run(lambda conn, _: conn.execute(sql, params).fetchall())  # type: ignore[arg-type]
        rows = [row for r in records if (row := self._row(r, unreadable)) is not None]
        if where is not None:  # (never asked about a row with a problem)
            rows = [r for r in rows if r.problem is not None or where(r)]
            rows = rows if limit is None else rows[:max(limit, 0)]
        return rows

    # ------------------------------------------------------------ claims
    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        wanted = sorted(set(targets))
        if not wanted:
            return None
        pick = (f"SELECT id FROM {T} WHERE state = 'pending' AND target = ANY(%(targets)s) "
                "AND due_at <= %(now)s AND NOT (id = ANY(%(exclude)s)) "
                "ORDER BY priority, due_at, id LIMIT 1 FOR UPDATE SKIP LOCKED")
        return self._claim(pick, {"targets": wanted, "exclude": list(exclude)}, now,
                           lease_seconds, prepare)

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        pick = f"SELECT id FROM {T} WHERE id = %(id)s AND state = 'pending' FOR UPDATE SKIP LOCKED"
        return self._claim(pick, {"id": handoff_id}, now, lease_seconds, prepare)

    def _claim(self, pick: str, params: dict[str, Any], now: datetime, lease_seconds: float,
               prepare: Callable[[Doc], None] | None) -> Claim | None:
        """The claim statement (``pick`` chooses and locks the row), then the claimed document,
        written in the same transaction: ``prepare`` raising leaves the handoff pending."""
        token = uuid.uuid4().hex
        expires = now + timedelta(seconds=lease_seconds)
        self._present()

        def op(conn: Conn, retried: bool) -> Claim | None:
            if retried:  # did the try that lost its connection commit our claim?
                mine = conn.execute(f"SELECT id, doc FROM {T} WHERE state = 'in-progress' AND "
                                    "lease_token = %s", (token,)).fetchone()
                if mine is not None:
                    held = document(mine[1], mine[0], "in-progress")  # (we wrote it)
                    return Claim(mine[0], held, token, book_int(held, "attempt", 1))
            got = conn.execute(
                f"UPDATE {T} SET state = 'in-progress', lease_token = %(token)s, "
                f"lease_expires_at = %(expires)s, lease_owner = %(owner)s WHERE id = ({pick}) "
                "RETURNING id, doc, raw, created_at",
                {**params, "token": token, "expires": expires, "now": now,
                 "owner": self.owner_key}).fetchone()
            if got is None:
                return None
            handoff_id, value, raw, created_at = got
            try:
                doc = document(value, handoff_id, State.PENDING.value)
            except InvalidDocument as exc:  # rolled back: still pending, for the caller to set
                raise unreadable_doc(exc, handoff_id) from None  # aside (as Engine.claim does)
            if raw:  # a document from a file: whatever bookkeeping it carried is not ours
                doc[BOOK] = {}
            attempt = stamp_claimed(doc, token, now, lease_seconds)
            if prepare is not None:
                prepare(doc)  # raising rolls the transaction back: still pending, untouched
            columns = self._columns(doc, created_at)
            conn.execute(
                f"UPDATE {T} SET doc = %(doc)s::json, raw = false, target = %(target)s, "
                "priority = %(priority)s, conversation = %(conversation)s, parent = %(parent)s, "
                "updated_at = %(updated_at)s WHERE id = %(id)s AND lease_token = %(token)s",
                {**columns, "doc": encode(doc, strict=False), "id": handoff_id, "token": token})
            self._event(conn, handoff_id, doc, State.IN_PROGRESS, "claimed")
            return Claim(handoff_id, doc, token, attempt, raw=bool(raw))

        return self.db.run(op)

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        stamp = lease_block(claim.token, now, lease_seconds)

        def op(conn: Conn, _retried: bool) -> bool:
            # the stored text is rewritten whole (json keeps the document's own key order, and
            # PostgreSQL offers no json_set): read under the row lock, change the lease, write
            found = conn.execute(f"SELECT doc FROM {T} WHERE id = %s AND state = 'in-progress' "
                                 "AND lease_token = %s FOR UPDATE", (claim.id, claim.token)).fetchone()
            if found is None:
                return False
            doc = found[0]
            expires = now + timedelta(seconds=lease_seconds)
            if not isinstance(doc, dict):  # overwritten by someone else: the lease still holds
                conn.execute(f"UPDATE {T} SET lease_expires_at = %s WHERE id = %s",
                             (expires, claim.id))
                return True
            book(doc)["lease"] = dict(stamp)
            conn.execute(f"UPDATE {T} SET lease_expires_at = %s, doc = %s::json WHERE id = %s",
                         (expires, encode(doc, strict=False), claim.id))
            return True

        renewed = self.db.run(op)
        if renewed:
            book(claim.doc)["lease"] = dict(stamp)
        return bool(renewed)

    def _release(self, claim: Claim, state: State, doc: Doc, *, copied: bool = False) -> bool:
        stored = dict(doc)  # the caller's dict is left as it is: only the block is rebuilt
        stored[BOOK] = {k: v for k, v in book(doc).items() if k != "lease"} \
            if isinstance(doc.get(BOOK), dict) else {}
        text = encode(stored, strict=False)

        def op(conn: Conn, retried: bool) -> bool:
            if retried and conn.execute(f"SELECT 1 FROM {T} WHERE id = %s AND last_token = %s "
                                        "AND state = %s", (claim.id, claim.token,
                                                           state.value)).fetchone():
                return True  # the try that lost its connection had committed
            created = conn.execute(
                f"SELECT created_at FROM {T} WHERE id = %s AND state = 'in-progress' "
                "AND lease_token = %s FOR UPDATE", (claim.id, claim.token)).fetchone()
            if created is None:
                return False  # requeued, finished or taken over: this claim writes nothing
            columns = self._columns(stored, created[0])
            conn.execute(
                f"UPDATE {T} SET state = %(state)s, doc = %(doc)s::json, target = %(target)s, "
                "priority = %(priority)s, conversation = %(conversation)s, parent = %(parent)s, "
                "due_at = %(due_at)s, updated_at = %(updated_at)s, lease_token = NULL, "
                "lease_expires_at = NULL, last_token = %(token)s WHERE id = %(id)s",
                {**columns, "state": state.value, "doc": text, "token": claim.token,
                 "id": claim.id})
            self._event(conn, claim.id, stored, state, state.value)
            self._notify(conn, claim.id, state.value)
            return True

        return self._run_then_wake(op, claim.id, state.value)

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        self._present()
        tick = self.monotonic()
        refused: builtins.list[str] = []  # rows set aside: said once, after the commit

        def op(conn: Conn, _retried: bool) -> Claims:
            # which claims look abandoned (no lock taken: most sweeps find nothing)
            seen = conn.execute(
                f"SELECT h.id, h.lease_token, h.lease_expires_at, "
                f"coalesce(h.lease_expires_at <= %(now)s, true), {OWNER_GONE} FROM {T} h "
                "WHERE h.state = 'in-progress' AND (h.lease_expires_at IS NULL OR "
                f"h.lease_expires_at <= %(now)s OR {OWNER_GONE})",
                {"now": now, "me": self.owner_key}).fetchall()
            why: dict[str, str] = {}
            gone_now = set()
            for handoff_id, token, expiry, expired, gone in seen:
                if expired:
                    why[handoff_id] = f"lease expired at {iso(expiry) if expiry else 'unknown'}"
                elif gone:  # its owner's session is gone: for long enough?
                    gone_now.add((handoff_id, token))
                    first = self._absent.setdefault((handoff_id, token), tick)
                    if tick - first >= self.owner_grace:
                        why[handoff_id] = ("owner process is gone (its database session ended "
                                           f"{tick - first:.0f}s ago or more)")
            for key in set(self._absent) - gone_now:
                del self._absent[key]
            if not why:
                return []
            rows = conn.execute(
                f"SELECT id, doc FROM {T} WHERE id = ANY(%s) AND state = 'in-progress' "
                "AND lease_token = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED",
                (sorted(why), [t for _, t, *_ in seen])).fetchall()
            taken: Claims = []
            refused.clear()  # (a retried sweep starts again)
            for handoff_id, value in rows:
                try:
                    doc = document(value, handoff_id, State.IN_PROGRESS.value)
                except InvalidDocument as exc:  # nothing can run or file it: set it aside
                    self._quarantine(conn, handoff_id, State.IN_PROGRESS.value, exc.code,
                                     str(exc))
                    refused.append(f"{exc.code}: {exc}")
                    continue
                token = uuid.uuid4().hex
                book(doc)["lease"] = lease_block(token, now, lease_seconds)
                conn.execute(
                    f"UPDATE {T} SET lease_token = %s, lease_expires_at = %s, lease_owner = %s, "
                    "doc = %s::json WHERE id = %s",
                    (token, now + timedelta(seconds=lease_seconds), self.owner_key,
                     encode(doc, strict=False), handoff_id))
                taken.append(Claim(handoff_id, doc, token, book_int(doc, "attempt", 1),
                                   recovered=why[handoff_id]))
            return taken

        # a retry after a lost connection may miss claims the first try took over: their new
        # leases expire in turn and the next sweep takes them again (never two live holders)
        claims = self.db.run(op)
        for reason in refused:  # said once: the rows are in the quarantine now
            log.warning("set aside an abandoned claim: %s", reason)
        return claims

    def _present(self) -> None:
        """Hold this process's presence key before it claims anything (see the module doc)."""
        if self._presence is not None:
            return
        with self._presence_lock:
            if self._presence is None:
                presence = Presence(self.url, self.owner_key)
                presence.start()
                self._presence = presence

    # ------------------------------------------------------------ what the engine and sweeper add
    def ids(self, state: State) -> builtins.list[str]:
        sort = "priority, due_at, id" if state is State.PENDING else "id"
        return [r[0] for r in self.db.run(lambda conn, _: conn.execute(
            f"SELECT id FROM {T} WHERE state = %s ORDER BY {sort}", (state.value,)).fetchall())]

    def peek(self, handoff_id: str) -> Doc | None:
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT doc FROM {T} WHERE id = %s AND state = 'pending'", (handoff_id,)).fetchone())
        if found is None:
            return None
        try:
            return document(found[0], handoff_id, State.PENDING.value)
        except InvalidDocument as exc:  # the daemon sets it aside where it lies, once
            raise unreadable_doc(exc, handoff_id) from None

    def abandon(self, claim: Claim) -> None:
        """Nothing is held beyond the lease, which recovery takes over when it expires."""

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        token = claim.token if claim is not None else None
        return self.db.run(lambda conn, _: self._quarantine(conn, handoff_id, state.value, code,
                                                            message, token))

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        return self.import_finished(handoff_id, State.FAILED, doc, utc_now())

    def import_finished(self, handoff_id: str, state: State, doc: Doc, now: datetime) -> bool:
        """Store ``doc`` as a finished handoff (``state`` completed or failed) under an id
        nothing holds: a failure stub, or a finished document moved in from a files workspace
        (``handoffd db import``). False when the id is taken."""
        text = encode(doc, strict=False)
        columns = self._columns(doc, now)
        write_id = uuid.uuid4().hex

        def op(conn: Conn, retried: bool) -> bool:
            if retried and _wrote(conn, handoff_id, write_id):
                return True
            inserted = conn.execute(
                f"INSERT INTO {T} (id, state, doc, target, priority, conversation, parent, due_at,"
                " updated_at, created_at, write_id) VALUES (%(id)s, %(state)s, %(doc)s::json,"
                " %(target)s, %(priority)s, %(conversation)s, %(parent)s, %(due_at)s,"
                " %(updated_at)s, %(now)s, %(write_id)s) ON CONFLICT (id) DO NOTHING RETURNING id",
                {**columns, "id": handoff_id, "state": state.value, "doc": text, "now": now,
                 "write_id": write_id},
            ).fetchone()
            if inserted is None:
                return False
            self._event(conn, handoff_id, doc, state, state.value)
            self._notify(conn, handoff_id, state.value)
            return True

        return self._run_then_wake(op, handoff_id, state.value)

    def reopen(self, handoff_id: str, doc: Doc) -> bool:
        text = encode(doc, strict=False)
        write_id = uuid.uuid4().hex

        def op(conn: Conn, retried: bool) -> bool:
            if retried and _wrote(conn, handoff_id, write_id):
                return True
            found = conn.execute(f"SELECT created_at FROM {T} WHERE id = %s AND state = 'failed' "
                                 "FOR UPDATE", (handoff_id,)).fetchone()
            if found is None:
                return False
            columns = self._columns(doc, found[0])
            conn.execute(
                f"UPDATE {T} SET state = 'pending', doc = %(doc)s::json, target = %(target)s, "
                "priority = %(priority)s, conversation = %(conversation)s, parent = %(parent)s, "
                "due_at = %(due_at)s, updated_at = %(updated_at)s, lease_token = NULL, "
                "lease_expires_at = NULL, write_id = %(write_id)s, exported = false "
                "WHERE id = %(id)s", {**columns, "doc": text, "id": handoff_id,
                                      "write_id": write_id})
            self._event(conn, handoff_id, doc, State.PENDING, "retried")
            self._notify(conn, handoff_id, State.PENDING.value)
            return True

        return self._run_then_wake(op, handoff_id, State.PENDING.value)

    def purge(self, handoff_id: str, state: State, now: datetime, *,
              expect: Doc | None = None) -> bool:
        if not state.terminal:
            raise InvalidTransition(f"handoff {handoff_id}: only finished handoffs are purged",
                                    handoff_id=handoff_id)

        def op(conn: Conn, _retried: bool) -> bool:
            if expect is not None:  # compared under the row's lock, deleted in the same step
                held = conn.execute(f"SELECT doc FROM {T} WHERE id = %s AND state = %s FOR UPDATE",
                                    (handoff_id, state.value)).fetchone()
                try:
                    if held is None or document(held[0], handoff_id, state.value) != expect:
                        return False
                except InvalidDocument:
                    return False
            gone = conn.execute(f"DELETE FROM {T} WHERE id = %s AND state = %s RETURNING id",
                                (handoff_id, state.value)).fetchone()
            if gone is None:
                return False  # (a retry after a lost commit lands here too: it is gone)
            self._seen_upsert(conn, handoff_id, now)  # dedup still says "used before"
            # retention means the handoff's trail goes too (else the table only ever grows)
            conn.execute("DELETE FROM handoffd.events WHERE handoff_id = %s", (handoff_id,))
            return True

        return self.db.run(op)

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
                                      lambda: self._subscribers.fire("", LOST))
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
        self.db.close()


def _wrote(conn: Conn, handoff_id: str, write_id: str) -> bool:
    return conn.execute(f"SELECT 1 FROM {T} WHERE id = %s AND write_id = %s",
                        (handoff_id, write_id)).fetchone() is not None


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
