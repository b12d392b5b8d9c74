"""Reading the PostgreSQL backend's handoffs (:class:`Reading`, a mixin of
:class:`~handoffd.backends.postgres.backend.PostgresBackend`): one handoff (``get``, ``peek``)
and the listings (``list``, ``ids``).

A listing is one ``SELECT`` over ``handoffd.handoffs``, filtered and ordered by the columns kept
beside each document (state, routing facts, due time); a row that holds no usable document is
left out, or listed with its problem when the caller asks for unreadable rows.

Stamps (``stamp_of``, ``live_stamps``: what lets a rescan, retention and the children gate skip
a document that did not change) are each row's state, ``xmin`` and ``updated_at`` (see
:data:`STAMP`), read without the document.
"""
from __future__ import annotations

import builtins
from datetime import datetime
from typing import Any, Collection

from ...core.documents import is_safe_id
from ...core.errors import ErrorCode, InvalidDocument, UnreadableDocument
from ...core.states import State
from ...core.storage import LiveStamp
from ..base import Doc, Meta, Order, Row, Rows, Where
from .records import StoreBase, T
from .values import document, loaded
from .values import unreadable as unreadable_doc

NAMES = ("id", "state", "doc", "target", "priority", "conversation", "parent", "due_at",
         "updated_at")
COLUMN_INDEX = {name: i for i, name in enumerate(NAMES)}
# each order's sort keys (every one NOT NULL) and how the next row compares with the last
SORTS: dict[str, tuple[tuple[str, ...], str]] = {
    "due": (("priority", "due_at", "id"), ">"),
    "oldest": (("updated_at", "id"), ">"),
    "newest": (("updated_at", "id"), "<"),
}
FILTER_BATCH = 500  # rows a filtered listing reads at once (and holds besides what it keeps)
# A row's stamp: its state, the id of the transaction that wrote this version of it (``xmin``)
# and its last event's time. Everything ``get`` returns is that one row (state and document), and
# every UPDATE, ours or anyone's (psql), writes a new version with its own transaction's id, so
# the stamp changes with every committed change; a row deleted and written again is a new
# version too. Locks (SELECT ... FOR UPDATE) write xmax, not xmin: no change, as nothing changed.
# Transaction ids are 32 bits and come round again after 2**32 transactions: two versions of
# one row stamped alike would need the same id that far apart, and the same state and event
# time (every handoffd write to a live document adds an event); the daemon's five-minute full
# re-check bounds what a rescan could miss even then. A version column would need a schema
# migration, and every handoffd of a shared store upgraded at once (an older one refuses a newer
# schema). VACUUM FULL, a dump and restore give new ids: a stamp that changes costs a read only.
STAMP = "concat_ws(' ', state, xmin, updated_at)"
STAMP_BATCH = 5000  # ids :meth:`Reading.stamps_of` looks up in one query
LIVE = "state IN ('pending', 'in-progress')"  # (a move is one transaction: nothing held aside)


def _select(clauses: list[str], keys: tuple[str, ...], after: str,
            doc: tuple[str, str]) -> str:
    """The listing's SELECT: ``clauses`` joined, ordered by ``keys`` (descending for ``<``);
    ``doc``: the capped document and its size (see :func:`values.capped`), the size last."""
    columns = ", ".join(doc[0] if name == "doc" else name for name in NAMES)
    sql = f"SELECT {columns}, {doc[1]} FROM {T}" + (f" WHERE {' AND '.join(clauses)}"
                                                     if clauses else "")
    direction = " DESC" if after == "<" else ""
    return sql + " ORDER BY " + ", ".join(f"{key}{direction}" for key in keys)


class Reading(StoreBase):
    """``get``, ``list``, ``ids`` and ``peek`` (see :class:`~handoffd.core.storage.Backend`)."""

    @staticmethod
    def _row(record: tuple[Any, ...], unreadable: bool) -> Row | None:
        """A listed row; one that holds no usable document (see :func:`values.document`) is a
        row with its ``problem`` when ``unreadable``, else left out (one whose loading ran out
        of memory too: its problem transient, "cannot be read now")."""
        handoff_id, state, value, target, priority, conversation, parent, due_at, updated, \
            size = record
        try:
            doc = document(loaded(value), handoff_id, state, size)
        except InvalidDocument as exc:
            return Row(handoff_id, State(state), {}, Meta(None), due_at, updated,
                       problem=unreadable_doc(exc, handoff_id)) if unreadable else None
        except MemoryError:  # "not now", never a problem of the document's (no strike: a
            # listing decides nothing about it)
            return Row(handoff_id, State(state), {}, Meta(None), due_at, updated,
                       problem=UnreadableDocument(
                           f"handoff {handoff_id} ({state}) cannot be read now: out of memory "
                           "(MemoryError)", handoff_id=handoff_id,
                           code=ErrorCode.UNPROCESSABLE_DOCUMENT, transient=True)) \
                if unreadable else None
        return Row(handoff_id, State(state), doc, Meta(target, priority, conversation, parent),
                   due_at, updated)

    def get(self, handoff_id: str) -> tuple[State, Doc] | None:
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT state, {self._doc()} FROM {T} WHERE id = %s", (handoff_id,)).fetchone())
        if found is None:
            return None
        # InvalidDocument (one line, with its code) for a row that holds no usable document;
        # a MemoryError loading it is raised as such, as the file store's read raises it: "not
        # now", never "damaged" (retention took a live row that ran out of memory for one
        # that protects nothing, and purged what it depended on)
        return State(found[0]), document(loaded(found[1]), handoff_id, found[0], found[2])

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
        if limit is not None and limit <= 0:
            return []
        keys, after = SORTS.get(order, SORTS["newest"])
        if where is not None:  # ``where`` is ours to apply, before the limit
            return self._filtered(clauses, params, keys, after, where, limit, unreadable)
        sql = _select(clauses, keys, after, self._capped()) + (" LIMIT %s" if limit is not None
                                                               else "")
        params += [] if limit is None else [limit]
        records = self.db.run(lambda conn, _: conn.execute(sql, params).fetchall())  # type: ignore[arg-type]
        return [row for r in records if (row := self._row(r, unreadable)) is not None]

    def _filtered(self, clauses: builtins.list[str], params: builtins.list[Any],
                  keys: tuple[str, ...], after: str, where: Where, limit: int | None,
                  unreadable: bool) -> Rows:
        """:meth:`list` with ``where``: read :data:`FILTER_BATCH` rows at a time, each batch
        from where the last ended (by the sort keys), keeping what ``where`` takes, until
        ``limit`` rows are kept or the rows run out. One query fetched every row's document
        before the filter: ``purge --dry-run`` or ``ls --to`` over a large store held them all.
        A row moved past the batches meanwhile is listed once (by id)."""
        kept: Rows = []
        seen: set[str] = set()
        last: tuple[Any, ...] | None = None
        while True:
            batch = [*clauses, f"({', '.join(keys)}) {after} ({', '.join(['%s'] * len(keys))})"] \
                if last is not None else clauses
            sql = _select(batch, keys, after, self._capped()) + " LIMIT %s"
            args = [*params, *(last or ()), FILTER_BATCH]
            records = self.db.run(lambda conn, _: conn.execute(sql, args).fetchall())  # type: ignore[arg-type]
            for record in records:
                row = self._row(record, unreadable)
                if row is None or row.id in seen:
                    continue
                if row.problem is not None or where(row):  # (never asked about a problem row)
                    seen.add(row.id)
                    kept.append(row)
                    if limit is not None and len(kept) >= limit:
                        return kept
            if len(records) < FILTER_BATCH:
                return kept
            last = tuple(records[-1][COLUMN_INDEX[key]] for key in keys)

    def live_stamps(self) -> dict[str, LiveStamp | None]:
        """See :meth:`Backend.live_stamps`: every pending and in-progress row's :data:`STAMP`, in
        one query (the state index), no document fetched. The time of each is 0: a stamp here
        changes with every committed write, however soon after the last, so there is no tick
        within which a change keeps it (the files store's settle rule has nothing to wait for)."""
        rows = self.db.run(lambda conn, _: conn.execute(
            f"SELECT id, {STAMP} FROM {T} WHERE {LIVE}").fetchall())
        return {str(handoff_id): (str(stamp).encode(), 0) for handoff_id, stamp in rows}

    def stamp_of(self, handoff_id: str) -> LiveStamp | None:
        """See :meth:`Backend.stamp_of`: ``handoff_id``'s row's :data:`STAMP` (one lookup by the
        primary key, no document fetched; its time 0, as :meth:`live_stamps` says). None when
        no row has that id, and for an id no handoff can have (a NUL: PostgreSQL refuses the
        text)."""
        if not is_safe_id(handoff_id):
            return None
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT {STAMP} FROM {T} WHERE id = %s", (handoff_id,)).fetchone())
        return (str(found[0]).encode(), 0) if found is not None else None

    def stamps_of(self, handoff_ids: Collection[str]) -> dict[str, LiveStamp | None]:
        """:meth:`stamp_of` of each of ``handoff_ids`` (None where it gives None) in one query
        per :data:`STAMP_BATCH` ids: a rescan stamps every id a waiter waits for, and one
        query each (a chain of 5,000 dependants) cost the daemon 10 s of CPU a minute."""
        stamps: dict[str, LiveStamp | None] = dict.fromkeys(handoff_ids)
        asked = [handoff_id for handoff_id in stamps if is_safe_id(handoff_id)]
        for start in range(0, len(asked), STAMP_BATCH):
            for handoff_id, stamp in self._stamp_rows(asked[start:start + STAMP_BATCH]):
                stamps[str(handoff_id)] = (str(stamp).encode(), 0)
        return stamps

    def _stamp_rows(self, batch: builtins.list[str]) -> builtins.list[tuple[Any, ...]]:
        """(id, :data:`STAMP`) of the rows of ``batch``'s ids (one query, the primary key)."""
        return self.db.run(lambda conn, _: conn.execute(
            f"SELECT id, {STAMP} FROM {T} WHERE id = ANY(%s)", (batch,)).fetchall())

    def ids(self, state: State) -> builtins.list[str]:
        sort = "priority, due_at, id" if state is State.PENDING else "id"
        return [r[0] for r in self.db.run(lambda conn, _: conn.execute(
            f"SELECT id FROM {T} WHERE state = %s ORDER BY {sort}", (state.value,)).fetchall())]

    def peek(self, handoff_id: str) -> Doc | None:
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT {self._doc()} FROM {T} WHERE id = %s AND state = 'pending'",
            (handoff_id,)).fetchone())
        if found is None:
            return None
        try:
            doc = document(loaded(found[0]), handoff_id, State.PENDING.value, found[1])
            self._check_request(doc, found[1], handoff_id)
            return doc
        except InvalidDocument as exc:  # the daemon sets it aside where it lies, once
            raise unreadable_doc(exc, handoff_id) from None
