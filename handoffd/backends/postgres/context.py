"""What the hosts of a PostgreSQL store share beside the handoffs, for the features: the shared
context (``handoffd.context`` and ``handoffd.context_history``) and the contract violations log
(``handoffd.violations``).

A context value is kept as the JSON text it was written with (``text``, not ``jsonb``: the text
is what every host's ``context/<key>.json`` mirror holds, byte for byte, and jsonb would reorder
its keys). A write is one transaction: a transaction-scoped advisory lock on the key (a key that
has no row yet cannot be row-locked), the read, the caller's change, the upsert at revision + 1,
the history row and a ``NOTIFY`` (kind ``context``) that wakes the other hosts' mirrors.
"""
from __future__ import annotations

import hashlib
import uuid
from typing import Any, Callable, Iterator

from ...core.storage import CONTEXT, HISTORY_LIMIT, ContextChange
from ..files.context import HISTORY_LINE
from ..files.violations import MAX_LINE as VIOLATION_LINE
from .connection import Conn, Database
from .records import encode

# the first half of the two-key advisory lock of a context key ("ctx\0"); two-key locks never
# meet the presence keys, which are one-key (bigint) locks
LOCK_CLASS = 0x63747800
KIND = CONTEXT  # the wake-up kind of a context write
PAGE = 500  # violations rows fetched at a time
# the rows read as entries: JSON objects no longer than the files store reads a line (%(line)s)
ENTRY = "json_typeof(entry) = 'object' AND octet_length(entry::text) <= %(line)s"


class PostgresContext:
    """:class:`~handoffd.core.storage.SharedContext` over the database ``db``. ``notify(conn,
    key)`` announces a write inside its transaction; ``written(key)`` tells this process's own
    subscribers after the commit."""

    def __init__(self, db: Database, notify: Callable[[Conn, str], None],
                 written: Callable[[str], None]) -> None:
        self.db = db
        self.notify = notify
        self.written = written

    def read(self, key: str) -> tuple[bytes | None, int]:
        """The value's bytes and revision (None, 0 when unset)."""
        row = self.db.run(lambda conn, _: conn.execute(
            "SELECT value, revision FROM handoffd.context WHERE key = %s", (key,)).fetchone())
        return (None, 0) if row is None else (row[0].encode("utf-8"), int(row[1]))

    def write(self, key: str, change: ContextChange) -> dict[str, Any]:
        """One transaction under the key's advisory lock (see the module docstring). A retry
        after a connection lost at commit first checks whether its write landed (``write_id``),
        so a write is never applied twice."""
        write_id = uuid.uuid4().hex
        done: dict[str, Any] = {}

        def op(conn: Conn, retried: bool) -> dict[str, Any]:
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_CLASS, _lock_key(key)))
            if retried and done and _landed(conn, key, write_id):
                return done["entry"]  # type: ignore[no-any-return]
            row = conn.execute("SELECT value, revision FROM handoffd.context WHERE key = %s",
                               (key,)).fetchone()
            old, revision = (None, 0) if row is None else (row[0].encode("utf-8"), int(row[1]))
            data, entry = change(old, revision)
            done["entry"] = entry
            conn.execute(
                "INSERT INTO handoffd.context (key, value, revision, updated_at, write_id) "
                "VALUES (%s, %s, %s, now(), %s) ON CONFLICT (key) DO UPDATE SET "
                "value = excluded.value, revision = excluded.revision, updated_at = now(), "
                "write_id = excluded.write_id",
                (key, data.decode("utf-8"), revision + 1, write_id))
            conn.execute("INSERT INTO handoffd.context_history (key, entry) VALUES (%s, %s::json)",
                         (key, encode(entry, strict=False)))
            self.notify(conn, key)
            return entry

        entry = self.db.run(op)
        self.written(key)
        return entry

    def keys(self, prefix: str = "") -> list[str]:
        """Every key (sorted), those starting with ``prefix`` when given."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT key FROM handoffd.context WHERE left(key, length(%s)) = %s ORDER BY key",
            (prefix, prefix)).fetchall())
        return [str(r[0]) for r in rows]

    def history(self, key: str | None = None, *,
                limit: int = HISTORY_LIMIT) -> list[dict[str, Any]]:
        """The newest ``limit`` history rows (``key``'s when given), oldest first: the database
        picks them (newest first, LIMIT), so no more are ever fetched. A row longer than any
        entry of ours (put there by hand) is skipped, as the files store skips such a line."""
        where = "" if key is None else "key = %(key)s AND "  # (each walks its index backwards)
        sql = (f"SELECT entry FROM handoffd.context_history WHERE {where}{ENTRY} "
               "ORDER BY seq DESC LIMIT %(limit)s")
        args = {"key": key, "line": HISTORY_LINE, "limit": max(limit, 0)}
        rows = self.db.run(lambda conn, _: conn.execute(sql, args).fetchall())
        return [r[0] for r in reversed(rows) if isinstance(r[0], dict)]

    def latest(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The newest history row of each of ``keys`` that has one."""
        if not keys:
            return {}
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT DISTINCT ON (key) key, entry FROM handoffd.context_history "
            f"WHERE key = ANY(%(keys)s) AND {ENTRY} ORDER BY key, seq DESC",
            {"keys": list(keys), "line": HISTORY_LINE}).fetchall())
        return {str(k): e for k, e in rows if isinstance(e, dict)}

    def revisions(self) -> dict[str, int]:
        """Every key's revision (what a mirror compares with its own before fetching values)."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT key, revision FROM handoffd.context").fetchall())
        return {str(k): int(r) for k, r in rows}

    def read_many(self, keys: list[str]) -> dict[str, tuple[bytes, int]]:
        """The values and revisions of ``keys`` (those set)."""
        if not keys:
            return {}
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT key, value, revision FROM handoffd.context WHERE key = ANY(%s)",
            (list(keys),)).fetchall())
        return {str(k): (v.encode("utf-8"), int(r)) for k, v, r in rows}


def _lock_key(key: str) -> int:
    """A signed 32-bit number from the key (a collision only serialises two keys' writes)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big", signed=True)


def _landed(conn: Conn, key: str, write_id: str) -> bool:
    return conn.execute("SELECT 1 FROM handoffd.context WHERE key = %s AND write_id = %s",
                        (key, write_id)).fetchone() is not None


class PostgresViolations:
    """:class:`~handoffd.core.storage.ViolationLog` over ``handoffd.violations`` (kept as
    ``json``: an entry reads back with its keys in the order written)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def append(self, entry: dict[str, Any]) -> None:
        """Insert one row (its own short transaction)."""
        text = encode(entry, strict=False)
        self.db.run(lambda conn, _: conn.execute(
            "INSERT INTO handoffd.violations (entry) VALUES (%s::json)", (text,)))

    def read(self) -> Iterator[dict[str, Any]]:
        """Every entry, in the order appended, fetched PAGE rows at a time (each page its own
        short statement, after the last seq seen): the whole table was fetched at once. A row
        longer than the files log reads (put there by hand) is skipped, as a line is there."""
        after = 0
        while True:
            rows = self.db.run(lambda conn, _: conn.execute(
                f"SELECT seq, entry FROM handoffd.violations WHERE seq > %(after)s AND {ENTRY} "
                "ORDER BY seq LIMIT %(page)s",
                {"after": after, "line": VIOLATION_LINE, "page": PAGE}).fetchall())
            for seq, entry in rows:
                after = seq
                if isinstance(entry, dict):
                    yield entry
            if len(rows) < PAGE:
                return
