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
from typing import Any, Callable

from ...core.storage import CONTEXT, ContextChange
from .connection import Conn, Database
from .records import encode

# the first half of the two-key advisory lock of a context key ("ctx\0"); two-key locks never
# meet the presence keys, which are one-key (bigint) locks
LOCK_CLASS = 0x63747800
KIND = CONTEXT  # the wake-up kind of a context write


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

    def history(self, key: str | None = None) -> list[dict[str, Any]]:
        """The history rows, oldest first."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT entry FROM handoffd.context_history WHERE %s::text IS NULL OR key = %s "
            "ORDER BY seq", (key, key)).fetchall())
        return [r[0] for r in rows if isinstance(r[0], dict)]

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

    def read(self) -> list[dict[str, Any]]:
        """Every entry, in the order appended."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT entry FROM handoffd.violations ORDER BY seq").fetchall())
        return [r[0] for r in rows if isinstance(r[0], dict)]
