"""The PostgreSQL schema and its versioned migrations.

Everything lives in the ``handoffd`` schema of the database the store URL names. Migrations are
numbered and applied in order, each in the transaction that records it in
``handoffd.schema_version``; a transaction-scoped advisory lock makes concurrent openers (several
daemons starting at once) apply each migration exactly once. Opening a store applies what is
missing; ``handoffd db init`` does the same and prints the version. Both then check that every
table and column handoffd uses is there (:func:`check`): a table someone altered by hand is
refused at open with one line naming what is missing, instead of failing every statement later.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import HandoffdError

if TYPE_CHECKING:
    import psycopg

SCHEMA = "handoffd"
MIGRATE_LOCK = 0x68616E64  # "hand": the advisory lock key that serialises migrations

# One entry per version; never edit a released entry, append a new one.
MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "handoffs, events, seen ids, cancel requests, quarantine", """
CREATE TABLE handoffd.handoffs (
    id               text COLLATE "C" PRIMARY KEY,
    state            text NOT NULL
                     CHECK (state IN ('pending', 'in-progress', 'completed', 'failed')),
    doc              jsonb NOT NULL,
    -- routing facts, computed from the document by the daemon's describe function
    target           text,
    priority         smallint NOT NULL DEFAULT 2,
    conversation     text,
    parent           text,
    due_at           timestamptz NOT NULL,   -- retry time, else creation (arrival) time
    updated_at       timestamptz NOT NULL,   -- the document's last history event
    created_at       timestamptz NOT NULL,   -- when the row arrived (a raw document's due time)
    lease_token      text,                   -- the claim that holds it (in-progress only)
    lease_expires_at timestamptz,
    last_token       text,      -- the claim that last ended here: a retried finish knows it won
    write_id         text,      -- the last create/reopen: a retried one knows it committed
    raw              boolean NOT NULL DEFAULT false,  -- ingested from a file, not yet claimed
    origin           text,      -- the workspace (host:path) that ingested it from a file
    exported         boolean NOT NULL DEFAULT false   -- origin wrote its terminal file
);
CREATE INDEX handoffs_due ON handoffd.handoffs (priority, due_at, id) WHERE state = 'pending';
CREATE INDEX handoffs_updated ON handoffd.handoffs (updated_at, id);
CREATE INDEX handoffs_state ON handoffd.handoffs (state, updated_at);
CREATE INDEX handoffs_leases ON handoffd.handoffs (lease_expires_at) WHERE state = 'in-progress';
CREATE INDEX handoffs_parent ON handoffd.handoffs (parent) WHERE parent IS NOT NULL;
CREATE INDEX handoffs_conversation ON handoffd.handoffs (conversation)
    WHERE conversation IS NOT NULL;
CREATE INDEX handoffs_unexported ON handoffd.handoffs (origin)
    WHERE origin IS NOT NULL AND NOT exported AND state IN ('completed', 'failed');

-- one row per transition, written in the transaction that makes it (an audit trail to query)
CREATE TABLE handoffd.events (
    seq        bigserial PRIMARY KEY,
    handoff_id text NOT NULL,
    at         timestamptz NOT NULL,
    event      text NOT NULL,
    state      text NOT NULL
);
CREATE INDEX events_handoff ON handoffd.events (handoff_id, seq);

CREATE TABLE handoffd.seen (
    id      text PRIMARY KEY,
    seen_at timestamptz NOT NULL
);
CREATE INDEX seen_at ON handoffd.seen (seen_at);

CREATE TABLE handoffd.cancels (
    id         text PRIMARY KEY,
    request    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE handoffd.quarantine (
    seq        bigserial PRIMARY KEY,
    id         text NOT NULL,
    from_state text NOT NULL,
    code       text NOT NULL,
    message    text NOT NULL,
    at         timestamptz NOT NULL,
    document   jsonb
);
"""),
    (2, "the claimer's presence key (a claim whose session died is recovered early)", """
ALTER TABLE handoffd.handoffs ADD COLUMN lease_owner bigint;
COMMENT ON COLUMN handoffd.handoffs.lease_owner IS
    'the session-level advisory lock key its claimer holds while it lives';
"""),
    (3, "the event stream every host reads, shared records (pauses, rate buckets)", """
-- handoffd's event stream (stats, metrics, top, ls --watch), appended by every host after each
-- transition: one JSON object per row, read in seq order
CREATE TABLE handoffd.event_log (
    seq   bigserial PRIMARY KEY,
    at    timestamptz NOT NULL,
    event jsonb NOT NULL
);
CREATE INDEX event_log_at ON handoffd.event_log (at);

-- small shared records by kind and key (pauses, rate-limit buckets), updated row-locked
CREATE TABLE handoffd.records (
    kind  text NOT NULL,
    key   text NOT NULL,
    value jsonb NOT NULL,
    PRIMARY KEY (kind, key)
);
"""),
    (4, "shared context (values, history) and the contract violations log", """
-- shared context (seed 001's context/ folder): each key's value as the JSON text it was written
-- with (what every host's context/<key>.json mirror holds, byte for byte) and its revision
CREATE TABLE handoffd.context (
    key        text COLLATE "C" PRIMARY KEY,
    value      text NOT NULL,
    revision   bigint NOT NULL CHECK (revision > 0),
    updated_at timestamptz NOT NULL,
    write_id   text NOT NULL     -- the last write: a retried one knows it committed
);

-- every context write (who, when, size, sha256, revision), read in seq order
CREATE TABLE handoffd.context_history (
    seq   bigserial PRIMARY KEY,
    key   text COLLATE "C" NOT NULL,
    entry json NOT NULL
);
CREATE INDEX context_history_key ON handoffd.context_history (key, seq);

-- the contract violations log (seed 004's learning signals) of every host
CREATE TABLE handoffd.violations (
    seq   bigserial PRIMARY KEY,
    entry json NOT NULL
);
"""),
    (5, "documents kept as json text: they read back with their keys in their own order", """
-- jsonb stores keys sorted (shorter first): a result file or `handoff show` would list a
-- document's keys in another order than it was submitted with. json keeps the text as written.
ALTER TABLE handoffd.handoffs ALTER COLUMN doc TYPE json USING doc::json;
ALTER TABLE handoffd.cancels ALTER COLUMN request TYPE json USING request::json;
ALTER TABLE handoffd.quarantine ALTER COLUMN document TYPE json USING document::json;
"""),
    (6, "the mark of the claim that recorded a seen id (its own record, after a crash)", """
-- a recovered document's admission tells its own claim's record from another document's
-- (NULL: no claim's, a create's or a purge's, or a row from before this version)
ALTER TABLE handoffd.seen ADD COLUMN mark text;
"""),
]
LATEST = MIGRATIONS[-1][0]

# The tables and columns that the migrations above create and handoffd's statements use; a test
# compares them with a freshly migrated database, so a new migration must update them.
REQUIRED: dict[str, tuple[str, ...]] = {
    "schema_version": ("version", "description", "applied_at"),
    "handoffs": ("id", "state", "doc", "target", "priority", "conversation", "parent", "due_at",
                 "updated_at", "created_at", "lease_token", "lease_expires_at", "last_token",
                 "write_id", "raw", "origin", "exported", "lease_owner"),
    "events": ("seq", "handoff_id", "at", "event", "state"),
    "seen": ("id", "seen_at", "mark"),
    "cancels": ("id", "request", "created_at"),
    "quarantine": ("seq", "id", "from_state", "code", "message", "at", "document"),
    "event_log": ("seq", "at", "event"),
    "records": ("kind", "key", "value"),
    "context": ("key", "value", "revision", "updated_at", "write_id"),
    "context_history": ("seq", "key", "entry"),
    "violations": ("seq", "entry"),
}


class SchemaTooNew(HandoffdError):
    """The database was migrated by a newer handoffd than this one."""


class SchemaDamaged(HandoffdError):
    """Tables or columns handoffd needs are missing although the schema version says they
    were created (altered or dropped by hand)."""


def current_version(conn: "psycopg.Connection[tuple[object, ...]]") -> int:
    """The schema version of the database (0: handoffd's tables are not there)."""
    found = conn.execute("SELECT to_regclass('handoffd.schema_version')").fetchone()
    if found is None or found[0] is None:
        return 0
    row = conn.execute("SELECT coalesce(max(version), 0) FROM handoffd.schema_version").fetchone()
    return int(row[0]) if row else 0  # type: ignore[call-overload]


def missing(conn: "psycopg.Connection[tuple[object, ...]]") -> list[str]:
    """What :data:`REQUIRED` names that the database lacks (``table`` or ``table.column``)."""
    rows = conn.execute(
        "SELECT c.relname, a.attname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')", (SCHEMA,)).fetchall()
    have: dict[str, set[str]] = {}
    for table, column in rows:
        have.setdefault(str(table), set()).add(str(column))
    lacking: list[str] = []
    for table, columns in REQUIRED.items():
        if table not in have:
            lacking.append(f"{SCHEMA}.{table}")
        else:
            lacking += [f"{SCHEMA}.{table}.{c}" for c in columns if c not in have[table]]
    return lacking


def check(conn: "psycopg.Connection[tuple[object, ...]]", version: int) -> None:
    """Raise SchemaDamaged, naming what is missing, unless every table and column handoffd
    uses is there (``version``: the schema version the database records)."""
    lacking = missing(conn)
    if not lacking:
        return
    shown = ", ".join(lacking[:6]) + (f" and {len(lacking) - 6} more" if len(lacking) > 6 else "")
    raise SchemaDamaged(
        f"the PostgreSQL store's schema (version {version}) lacks {shown}: it was altered "
        "by hand and handoffd cannot use it; restore what is missing (e.g. from a backup), or "
        "run `handoffd db init` on a new, empty database and point [store] url at it")


def migrate(conn: "psycopg.Connection[tuple[object, ...]]") -> tuple[int, list[int]]:
    """Apply every missing migration (idempotent, safe to run concurrently). Returns the version
    now and the versions applied by this call. Commits."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        conn.execute("CREATE SCHEMA IF NOT EXISTS handoffd")
        conn.execute("CREATE TABLE IF NOT EXISTS handoffd.schema_version ("
                     "version int PRIMARY KEY, description text NOT NULL, "
                     "applied_at timestamptz NOT NULL DEFAULT now())")
        version = current_version(conn)
        if version > LATEST:
            raise SchemaTooNew(f"the database schema is at version {version}, newer than this "
                               f"handoffd knows ({LATEST}); upgrade handoffd")
        applied = []
        for number, description, sql in MIGRATIONS:
            if number <= version:
                continue
            conn.execute(sql)  # type: ignore[arg-type]  # our own constant text
            conn.execute("INSERT INTO handoffd.schema_version (version, description) "
                         "VALUES (%s, %s)", (number, description))
            applied.append(number)
    return max([version, *applied]), applied
