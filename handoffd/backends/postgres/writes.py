"""The PostgreSQL backend's writes outside a claim (:class:`Writes`, a mixin of
:class:`~handoffd.backends.postgres.backend.PostgresBackend`): creating a handoff, storing a
finished one (a failure stub, a document imported from a files workspace), reopening a failed
one, setting one aside into the quarantine and purging a finished one.

Each is one transaction that also appends its ``handoffd.events`` row and sends its ``NOTIFY``.
An insert or a reopen carries a fresh ``write_id``, by which a try retried after its connection
died tells whether the first try had committed. A purge or a reopen of a row that a workspace
ingested from a file leaves, in the same transaction, a recheck record for that workspace's file
bridge (:meth:`~handoffd.backends.postgres.records.StoreBase._recheck`): the result file it wrote
there answers no more.
"""
from __future__ import annotations

import copy
import threading
import uuid
from datetime import datetime

from ...core.errors import DuplicateHandoff, ErrorCode, InvalidDocument, InvalidTransition
from ...core.states import State
from ...core.timeutil import utc_now
from ..base import Claim, Doc, stamp_created
from .connection import Conn
from .records import SideRecords, T, encode
from .removal import PostgresRemovalLock
from .values import document


class Writes(SideRecords):
    """``create``, ``import_finished``, ``create_failed``, ``reopen``, ``set_aside`` and
    ``purge``; a create and a purge consult and keep the seen ids of :class:`SideRecords`."""

    # per thread, the last set_aside: (id, the workspace that ingested it from a file)
    _aside: threading.local

    def create(self, doc: Doc, handoff_id: str, now: datetime, *,
               due_at: datetime | None = None) -> None:
        stored = copy.deepcopy(doc)
        stamp_created(stored, handoff_id, now, due_at)  # a later due_at: its next_attempt_at
        text = encode(stored, strict=True)
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:  # the daemon would set it aside unread: refuse it now
            raise InvalidDocument(
                f"handoff {handoff_id} would be {size} bytes, over the {self.max_bytes}-byte "
                "limit (raise daemon.max_document_bytes in handoffd.toml if this is intended)",
                handoff_id=handoff_id, code=ErrorCode.DOCUMENT_TOO_LARGE)
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

    def set_aside(self, handoff_id: str, state: State, code: str, message: str, *,
                  claim: Claim | None = None) -> bool:
        token = claim.token if claim is not None else None
        moved = self.db.run(lambda conn, _: self._quarantine(conn, handoff_id, state.value, code,
                                                             message, token))
        # the stub admission files next (create_failed, in this thread) goes back to the
        # workspace that ingested the document from a file, as its terminal document
        self._aside.last = (handoff_id, None if moved is None else moved.origin)
        return moved is not None

    @staticmethod
    def aside_place(state: State, handoff_id: str) -> str:
        """What :meth:`set_aside` did with ``handoff_id`` (read from ``state``), as the line
        that logs it says (admission's ``set aside ...``): its row went into the quarantine
        table. The files store's ``in-progress/ID.json`` named a folder this store never uses."""
        return f"handoff {handoff_id} ({state.value}) into the database's quarantine table"

    def create_failed(self, handoff_id: str, doc: Doc) -> bool:
        last = getattr(self._aside, "last", None)
        self._aside.last = None
        origin = last[1] if last is not None and last[0] == handoff_id else None
        return self.import_finished(handoff_id, State.FAILED, doc, utc_now(), origin=origin)

    def import_finished(self, handoff_id: str, state: State, doc: Doc, now: datetime, *,
                        origin: str | None = None) -> bool:
        """Store ``doc`` as a finished handoff (``state`` completed or failed) under an id
        nothing holds: a failure stub, or a finished document moved in from a files workspace
        (``handoffd db import``). ``origin``: the workspace whose file bridge writes it into its
        folders (the one that ingested the document a stub stands for). False when the id is
        taken."""
        text = encode(doc, strict=False)
        columns = self._columns(doc, now)
        write_id = uuid.uuid4().hex

        def op(conn: Conn, retried: bool) -> bool:
            if retried and _wrote(conn, handoff_id, write_id):
                return True
            inserted = conn.execute(
                f"INSERT INTO {T} (id, state, doc, target, priority, conversation, parent, due_at,"
                " updated_at, created_at, write_id, origin) VALUES (%(id)s, %(state)s,"
                " %(doc)s::json, %(target)s, %(priority)s, %(conversation)s, %(parent)s,"
                " %(due_at)s, %(updated_at)s, %(now)s, %(write_id)s, %(origin)s)"
                " ON CONFLICT (id) DO NOTHING RETURNING id",
                {**columns, "id": handoff_id, "state": state.value, "doc": text, "now": now,
                 "write_id": write_id, "origin": origin},
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
            found = conn.execute(f"SELECT created_at, origin FROM {T} WHERE id = %s AND "
                                 "state = 'failed' FOR UPDATE", (handoff_id,)).fetchone()
            if found is None:
                return False
            # its failed/ file in the workspace that dropped it answers no more: removed there
            self._recheck(conn, handoff_id, found[1])
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

        lock = self.removal_lock()

        def op(conn: Conn, _retried: bool) -> bool:
            # a pass deletes only while its session still holds the store's removal lock: one
            # that ended under it (a restart) may have let another host's create in meanwhile
            lock.check_held(conn)
            if expect is not None:  # compared under the row's lock, deleted in the same step
                held = conn.execute(f"SELECT doc FROM {T} WHERE id = %s AND state = %s FOR UPDATE",
                                    (handoff_id, state.value)).fetchone()
                try:
                    if held is None or document(held[0], handoff_id, state.value) != expect:
                        return False
                except InvalidDocument:
                    return False
            gone = conn.execute(f"DELETE FROM {T} WHERE id = %s AND state = %s RETURNING origin",
                                (handoff_id, state.value)).fetchone()
            if gone is None:
                return False  # (a retry after a lost commit lands here too: it is gone)
            self._seen_upsert(conn, handoff_id, now)  # dedup still says "used before"
            # the result file written back to the workspace that dropped it goes too (its
            # bridge removes it), or a later drop of the same id could be answered by it
            self._recheck(conn, handoff_id, gone[0])
            # retention means the handoff's trail goes too (else the table only ever grows)
            conn.execute("DELETE FROM handoffd.events WHERE handoff_id = %s", (handoff_id,))
            return True

        return self.db.run(op)

    def removal_lock(self) -> PostgresRemovalLock:
        """The store's removal lock, one for every host (:mod:`.removal`): a workspace's lock
        file ordered the processes of its own host only."""
        lock: PostgresRemovalLock | None = self.__dict__.get("_removal_lock")
        if lock is None:  # (made on first use: setdefault keeps one if two threads race)
            lock = self.__dict__.setdefault("_removal_lock", PostgresRemovalLock(
                self.db.url, connect_timeout=self.db.connect_timeout))
        return lock


def _wrote(conn: Conn, handoff_id: str, write_id: str) -> bool:
    return conn.execute(f"SELECT 1 FROM {T} WHERE id = %s AND write_id = %s",
                        (handoff_id, write_id)).fetchone() is not None
