"""What every host of a PostgreSQL store shares besides the handoffs: the event stream
(``handoffd.event_log``, read by ``handoff stats``, the metrics, ``handoff top`` and ``ls
--watch`` on any host) and the small shared records (``handoffd.records``: pauses, rate-limit
buckets), so that a pause or a rate limit holds on every host.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Iterator

from ...core.events import START, Event
from .connection import Conn, Database
from .records import encode
from .values import Unloadable, plain

READ_BATCH = 10_000  # rows per query when reading the stream back
KEEP_EVENTS = 1_000_000  # the stream keeps about this many newest rows (maintain trims it)


class PostgresEventLog:
    """:class:`~handoffd.core.events.EventLog` over ``handoffd.event_log`` (cursor: a seq)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def append(self, event: Event) -> None:
        """Insert one event (its own short transaction, after the transition's)."""
        text = encode(event, strict=False)
        self.db.run(lambda conn, _: conn.execute(
            "INSERT INTO handoffd.event_log (at, event) VALUES (%s, %s::jsonb)",
            (str(event.get("at")), text)))

    def read(self, since: datetime | None = None) -> Iterator[Event]:
        """Every event kept, oldest first (those at or after ``since``)."""
        seq = 0
        while True:
            rows = self.db.run(lambda conn, _: conn.execute(
                "SELECT seq, event FROM handoffd.event_log WHERE seq > %s AND (%s::timestamptz "
                "IS NULL OR at >= %s) ORDER BY seq LIMIT %s",
                (seq, since, since, READ_BATCH)).fetchall())
            for row in rows:
                yield _event(row[1])
            if len(rows) < READ_BATCH:
                return
            seq = int(rows[-1][0])

    def tail(self, cursor: Any = None) -> tuple[list[Event], Any]:
        """Events after ``cursor`` (a seq; None: from now on; START: from the oldest)."""
        if cursor is None:
            last = self.db.run(lambda conn, _: conn.execute(
                "SELECT coalesce(max(seq), 0) FROM handoffd.event_log").fetchone())
            return [], int(last[0]) if last else 0
        seq = 0 if cursor == START else int(cursor)
        events: list[Event] = []
        while True:
            rows = self.db.run(lambda conn, _: conn.execute(
                "SELECT seq, event FROM handoffd.event_log WHERE seq > %s ORDER BY seq LIMIT %s",
                (seq, READ_BATCH)).fetchall())
            events += [_event(row[1]) for row in rows]
            if rows:
                seq = int(rows[-1][0])
            if len(rows) < READ_BATCH:
                return events, seq

    def trim(self, conn: Conn) -> int:
        """Drop all but the newest KEEP_EVENTS rows (called by the backend's maintain)."""
        cur = conn.execute("DELETE FROM handoffd.event_log WHERE seq <= (SELECT max(seq) - %s "
                           "FROM handoffd.event_log)", (KEEP_EVENTS,))
        return cur.rowcount or 0


def _event(value: Any) -> Event:
    if isinstance(value, dict):
        return value
    try:
        loaded = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


class PostgresRecords:
    """:class:`~handoffd.core.storage.Records` over ``handoffd.records`` (an update locks its
    row, so concurrent updates from any host are serialised)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def read(self, kind: str) -> dict[str, Any]:
        """Every record of ``kind``."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT key, value FROM handoffd.records WHERE kind = %s", (kind,)).fetchall())
        # a value no JSON Python can hold (a foreign row) is no record
        return {str(key): value for key, value in rows if not isinstance(value, Unloadable)}

    def update(self, kind: str, key: str, change: Callable[[Any], Any]) -> Any:
        """``change`` the record under its row lock (created first if absent)."""
        def op(conn: Conn, _retried: bool) -> Any:
            # a placeholder row makes the lock possible for a record that does not exist yet
            conn.execute("INSERT INTO handoffd.records (kind, key, value) VALUES (%s, %s, "
                         "'null'::jsonb) ON CONFLICT DO NOTHING", (kind, key))
            row = conn.execute("SELECT value FROM handoffd.records WHERE kind = %s AND key = %s "
                               "FOR UPDATE", (kind, key)).fetchone()
            new = change(plain(row[0]) if row else None)  # unloadable: replaced as absent
            if new is None:
                conn.execute("DELETE FROM handoffd.records WHERE kind = %s AND key = %s",
                             (kind, key))
            else:
                conn.execute("UPDATE handoffd.records SET value = %s::jsonb WHERE kind = %s "
                             "AND key = %s", (encode(new, strict=False), kind, key))
            return new
        return self.db.run(op)
