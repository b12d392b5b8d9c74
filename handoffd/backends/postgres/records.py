"""What the PostgreSQL backend keeps beside the handoffs: the shared helpers of its parts, the
side records (cancel requests, seen ids, quarantine) and the file-origin bookkeeping that the
file bridge (:mod:`handoffd.backends.postgres.bridge`) relies on.

Mixins of :class:`handoffd.backends.postgres.backend.PostgresBackend`; each runs its
statements through the backend's :class:`~handoffd.backends.postgres.connection.Database`.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import logging
import re
import uuid
from datetime import datetime, timedelta
from typing import Any, Callable, NamedTuple

from ...core.documents import check_request_depth, check_request_size, first_use_undone
from ...core.errors import ErrorCode, InvalidDocument
from ...core.events import last_entry
from ...core.jsontext import load_json
from ...core.states import State
from ...core.storage import LOST
from ...core.timeutil import iso, utc_now
from ..base import Describe, Doc, Subscribers, due_of, safe_describe, updated_of
from .connection import CHANNEL, Conn, Database
from .values import capped, document, finite, loaded, plain

log = logging.getLogger("handoffd")

T = "handoffd.handoffs"
# handoffd.records kind (with the workspace's origin after it) of the ids whose terminal file the
# file bridge wrote into that workspace may be stale: its row was purged, archived or retried
RECHECK = "file-bridge recheck"
# handoffd.records kind (with the workspace's origin after it) of the receipt of each file that
# workspace's bridge ingested: the file (device, inode, change and modification times, size) and
# its document's digest, written in the insert's transaction. A file left in pending/ by an
# ingester killed between that commit and the file's removal is known by it, even once its row
# is gone (set aside before its stub was filed, set aside unanswered, run and purged): it is
# removed, never ingested (run) again. A receipt whose file is gone is pruned (FileOrigins)
RECEIPT = "file-bridge ingested"
MAX_PAYLOAD = 7000  # NOTIFY payloads stop at 8000 bytes: a longer id is announced as "lost"


def ingested_kind(origin: str) -> str:
    """The wake-up kind that tells ``origin``'s file bridge that another process (a command,
    the client) ingested a handoff from that workspace's files: its daemon then writes the
    result (or a parked copy) back as soon as there is one, not at its next scan. A digest of
    the origin (a host and a path, of any length) keeps it short; each bridge hears its own."""
    digest = hashlib.sha256(origin.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"ingested:{digest}"


# a NUL character as json.dumps writes it: ``\u0000`` after an even run of backslashes (an odd
# run is an escaped backslash followed by the plain text "u0000", which is kept). Linear: a
# match starts only where a run of backslashes starts
NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
SURROGATE = re.compile("[\ud800-\udfff]")  # lone ones: json.dumps(ensure_ascii=False) keeps them


def encode(doc: Doc, *, strict: bool) -> str:
    """``doc`` as JSON text that every PostgreSQL JSON type accepts (documents are kept as
    ``json``, other records as ``jsonb``, which cannot hold NUL characters; no UTF-8 text holds
    lone surrogates): ``strict`` refuses such a document (InvalidDocument), else they become
    U+FFFD. The text ``\\u0000`` (a backslash, then "u0000": source code, a regex) is no NUL
    and is kept as it is."""
    text = json.dumps(doc, ensure_ascii=False, allow_nan=False, default=str)
    clean = SURROGATE.sub("\ufffd", text)
    if "\\u0000" in clean:
        clean = NUL_ESCAPE.sub(r"\1\\ufffd", clean)
    if clean != text and strict:
        raise InvalidDocument("the document contains NUL characters or unpaired surrogates, "
                              "which the PostgreSQL store cannot hold",
                              code=ErrorCode.UNPROCESSABLE_DOCUMENT)
    return clean


def file_digest(doc: Doc) -> str:
    """What identifies a document ingested from a file: the digest of the text it is stored as
    (kept in the row's ``write_id``, so that the bridge can tell the very document it ingested
    from a different one dropped later under the same name)."""
    return "sha256:" + hashlib.sha256(encode(doc, strict=True).encode("utf-8")).hexdigest()


def _receipt(stamp: str, digest: str) -> str:
    """The :data:`RECEIPT` value of the file ``stamp`` holding a document of ``digest``."""
    return json.dumps({"file": stamp, "digest": digest})


class Moved(NamedTuple):
    """A row :meth:`StoreBase._quarantine` set aside."""

    origin: str | None  # the workspace that ingested it from a file (None: none did)


class StoreBase:
    """What every part of the backend shares: the database, wake-ups and the routing columns."""

    db: Database
    describe: Describe
    seen_ttl: timedelta
    nonce: str  # tells this process's notifications apart from others'
    _subscribers: Subscribers
    max_bytes: int  # max_document_bytes: what a request may be
    max_open_bytes: int  # a pending or running document read (the request and bookkeeping)
    max_filed_bytes: int  # a finished document read (the request, the answer, bookkeeping)

    def _capped(self) -> tuple[str, str]:
        """A row's document, capped, and its size (see :func:`values.capped`)."""
        return capped(self.max_open_bytes, self.max_filed_bytes)

    def _doc(self) -> str:
        """:meth:`_capped` as two result columns."""
        return ", ".join(self._capped())

    def _check_request(self, doc: Doc, size: int, handoff_id: str) -> None:
        """InvalidDocument (DOCUMENT_TOO_LARGE) when the request in the pending ``doc`` (of
        ``size`` bytes as stored) is over ``max_bytes``, as the files store reads a pending
        file (:func:`~handoffd.core.documents.check_request_size`)."""
        check_request_size(doc, size, self.max_bytes, f"handoff {handoff_id}",
                           handoff_id=handoff_id)
        check_request_depth(doc, None, f"handoff {handoff_id}", handoff_id=handoff_id)

    def _columns(self, doc: Doc, created_at: datetime) -> dict[str, Any]:
        # a row's created_at that is infinite (written past handoffd) is no time to fall back
        # on: a document without events would be due never, or sorted before every other
        created_at = finite(created_at) or utc_now()
        meta = safe_describe(self.describe, doc)
        return {"target": meta.target, "priority": meta.priority,
                "conversation": meta.conversation, "parent": meta.parent,
                "due_at": due_of(doc, created_at), "updated_at": updated_of(doc, created_at)}

    def _run_then_wake(self, op: Callable[[Conn, bool], bool], handoff_id: str, kind: str) -> bool:
        """Run ``op`` in one transaction; when it did something, wake this process's own
        subscribers (other processes hear the NOTIFY the transaction sent)."""
        done = self.db.run(op)
        if done:
            self._subscribers.fire(handoff_id, kind)
        return done

    def _notify(self, conn: Conn, handoff_id: str, kind: str) -> None:
        """Tell other processes, at commit (a hint: the id may be cut short to 'lost')."""
        payload = f"{self.nonce}\t{kind}\t{handoff_id}"
        if len(payload.encode()) > MAX_PAYLOAD:
            payload = f"{self.nonce}\t{LOST}\t"
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))

    @staticmethod
    def _quarantine(conn: Conn, handoff_id: str, state: str, code: str, message: str,
                    token: str | None = None) -> Moved | None:
        """Move the row ``handoff_id`` out of ``state`` (held by ``token`` when given) into the
        quarantine with its reason, its document copied as the database holds it (never loaded:
        it may be JSON Python cannot load). None when no such row was there."""
        fence = " AND lease_token = %(token)s" if token is not None else ""
        moved = conn.execute(
            f"WITH gone AS (DELETE FROM {T} WHERE id = %(id)s AND state = %(state)s{fence} "
            "RETURNING id, doc, origin) INSERT INTO handoffd.quarantine (id, from_state, code, "
            "message, at, document) SELECT id, %(state)s, %(code)s, %(message)s, %(at)s, doc "
            "FROM gone RETURNING (SELECT origin FROM gone)",
            {"id": handoff_id, "state": state, "token": token, "code": str(code),
             "message": message, "at": utc_now()}).fetchone()
        return None if moved is None else Moved(moved[0])

    @staticmethod
    def _recheck(conn: Conn, handoff_id: str, origin: str | None) -> None:
        """Tell the file bridge of ``origin`` (the workspace that ingested ``handoff_id`` from a
        file; None: none did, nothing to tell) that the terminal file it may have written for it
        is no longer the row's: it looks at that file at its next sync
        (:meth:`FileOrigins.rechecks`). A fresh nonce each time: a recheck asked again while
        the bridge handles the last one is not cleared with it."""
        if origin is None:
            return
        conn.execute("INSERT INTO handoffd.records (kind, key, value) VALUES (%s, %s, %s::jsonb) "
                     "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
                     (f"{RECHECK} {origin}", handoff_id,
                      json.dumps({"nonce": uuid.uuid4().hex})))

    @staticmethod
    def _seen_upsert(conn: Conn, handoff_id: str, now: datetime,
                     mark: str | None = None) -> None:
        """Record ``handoff_id`` as used at ``now`` (dedup keeps it for ``seen_ttl``), with the
        ``mark`` of the claim that records it (None: no claim's); one row an id, the last."""
        conn.execute("INSERT INTO handoffd.seen (id, seen_at, mark) VALUES (%s, %s, %s) "
                     "ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at, "
                     "mark = excluded.mark", (handoff_id, now, mark))

    @staticmethod
    def _event(conn: Conn, handoff_id: str, doc: Doc, state: State, fallback: str) -> None:
        """The audit row of a transition: the document's last history event."""
        event = last_entry(doc).get("event")
        conn.execute("INSERT INTO handoffd.events (handoff_id, at, event, state) "
                     "VALUES (%s, %s, %s, %s)",
                     (handoff_id, updated_of(doc, utc_now()), str(event or fallback)[:200],
                      state.value))


class SideRecords(StoreBase):
    """Cancel requests, seen ids (dedup with a TTL) and the quarantine's reasons."""

    # ------------------------------------------------------------ cancel requests
    def request_cancel(self, handoff_id: str, request: Doc) -> None:
        text = encode(request, strict=False)

        def op(conn: Conn, _retried: bool) -> None:
            conn.execute("INSERT INTO handoffd.cancels (id, request) VALUES (%s, %s::json) "
                         "ON CONFLICT (id) DO UPDATE SET request = excluded.request, "
                         "created_at = now()", (handoff_id, text))
            self._notify(conn, handoff_id, "cancel")

        self.db.run(op)
        self._subscribers.fire(handoff_id, "cancel")

    def cancel_request(self, handoff_id: str) -> Doc | None:
        found = self.db.run(lambda conn, _: conn.execute(
            "SELECT request FROM handoffd.cancels WHERE id = %s", (handoff_id,)).fetchone())
        # a request that is no JSON object (a foreign row) asks for nothing
        return found[0] if found is not None and isinstance(found[0], dict) else None

    def cancel_requests(self) -> dict[str, Doc]:
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT id, request FROM handoffd.cancels ORDER BY created_at, id").fetchall())
        return {r[0]: r[1] for r in rows if isinstance(r[1], dict)}

    def clear_cancel(self, handoff_id: str) -> None:
        self.db.run(lambda conn, _: conn.execute("DELETE FROM handoffd.cancels WHERE id = %s",
                                                 (handoff_id,)))

    # ------------------------------------------------------------ dedup
    def seen_add(self, handoff_id: str, now: datetime, mark: str | None = None, *,
                 if_absent: bool = False) -> None:
        if not if_absent:
            self.db.run(lambda conn, _: self._seen_upsert(conn, handoff_id, now, mark))
            return
        # one statement: a row within the TTL (a running claim's, with its mark) is kept as it is
        self.db.run(lambda conn, _: conn.execute(
            "INSERT INTO handoffd.seen (id, seen_at, mark) VALUES (%s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at, mark = excluded.mark "
            "WHERE handoffd.seen.seen_at <= %s",
            (handoff_id, now, mark, now - self.seen_ttl)))

    def seen_marks(self, handoff_id: str, now: datetime) -> frozenset[str | None]:
        row = self.db.run(lambda conn, _: conn.execute(
            "SELECT mark FROM handoffd.seen WHERE id = %s AND seen_at > %s",
            (handoff_id, now - self.seen_ttl)).fetchone())
        return frozenset() if row is None else frozenset({row[0]})

    def seen_contains(self, handoff_id: str, now: datetime) -> bool:
        return self.db.run(lambda conn, _: self._seen_recently(conn, handoff_id, now))

    def _seen_recently(self, conn: Conn, handoff_id: str, now: datetime) -> bool:
        return conn.execute("SELECT 1 FROM handoffd.seen WHERE id = %s AND seen_at > %s",
                            (handoff_id, now - self.seen_ttl)).fetchone() is not None

    #: the reasons of the files this workspace's file bridge quarantined locally (its
    #: handoffs/.quarantine/), oldest first; set by the bridge's feature (None: none to merge)
    local_quarantine: Callable[[], builtins.list[Doc]] | None = None

    def quarantined(self) -> builtins.list[Doc]:
        """The database's quarantine, with the files this workspace's bridge set aside here
        (as the files store lists its own), oldest first."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT id, from_state, code, message, at, document FROM handoffd.quarantine "
            "ORDER BY seq").fetchall())
        held = [{"file": r[0], "from": r[1], "code": r[2], "message": r[3], "at": iso(r[4]),
                 "stored_as": r[0], "document": plain(r[5])} for r in rows]
        local = self.local_quarantine() if self.local_quarantine is not None else []
        if not local:
            return held
        # (a stable sort: each list keeps its own order among equal times)
        return sorted(held + local, key=lambda item: str(item.get("at") or ""))


class FileOrigins(StoreBase):
    """Handoffs ingested from a workspace's files, and the terminal copies owed to it."""

    def ingest(self, doc: Doc, handoff_id: str, now: datetime, origin: str, *,
               trusted: bool = False, stamp: str | None = None) -> bool:
        """Store a document dropped into a workspace's pending/ as a *raw* pending handoff
        (claimed raw: admission validates it and checks the seen ids, as for a file), noting
        the ``origin`` workspace that will want its terminal copy, and the document's
        :func:`file_digest` as the row's ``write_id``. ``trusted``: its ``handoffd`` block is
        handoffd's own (sealed in that workspace: a document ``handoffd db import`` moves in),
        so it is kept at the claim and the row is due when the document says (a scheduled
        retry, a parked parent keep their bookkeeping). False when the id exists in the
        database already (ingesting again is a no-op: :meth:`ingested` says by whom and what),
        or ``stamp`` (the file's identity, see :data:`RECEIPT`) and the digest are those of a
        file ingested before (:meth:`receipted` says so): its left-over copy."""
        text = encode(doc, strict=True)
        columns = self._columns(doc, now)
        digest = file_digest(doc)
        if not trusted:  # a raw document is due when it arrived, whatever it claims
            columns.update(due_at=now, updated_at=now)
        receipt = None if stamp is None else _receipt(stamp, digest)

        def op(conn: Conn, _retried: bool) -> bool:
            if receipt is not None and self._has_receipt(conn, origin, handoff_id, receipt):
                return False  # this very file was ingested before (its row may be gone since)
            inserted = conn.execute(
                f"INSERT INTO {T} (id, state, doc, target, priority, conversation, parent, due_at,"
                " updated_at, created_at, raw, origin, write_id) VALUES (%(id)s, 'pending',"
                " %(doc)s::json, %(target)s, %(priority)s, %(conversation)s, %(parent)s,"
                " %(due_at)s, %(updated_at)s, %(now)s, %(raw)s, %(origin)s, %(digest)s)"
                " ON CONFLICT (id) DO NOTHING RETURNING id",
                {**columns, "id": handoff_id, "doc": text, "now": now, "origin": origin,
                 "digest": digest, "raw": not trusted},
            ).fetchone()
            if inserted is None:
                return False
            # admitted in its workspace before: admission's seen check is skipped (unless a
            # hand-back there left it undone: the admission here does it, and would find the id
            # recorded now and set the document aside as its own duplicate)
            if trusted and not first_use_undone(doc):
                self._seen_upsert(conn, handoff_id, now)
            # (the receipt in the same statement as the event: no extra round trip)
            keep = ("WITH receipt AS (INSERT INTO handoffd.records (kind, key, value) VALUES "
                    "(%s, %s, %s::jsonb) ON CONFLICT (kind, key) DO UPDATE SET value = "
                    "excluded.value) ") if receipt is not None else ""
            conn.execute(keep + "INSERT INTO handoffd.events (handoff_id, at, event, state) "
                         "VALUES (%s, %s, 'ingested', 'pending')",
                         ((f"{RECEIPT} {origin}", handoff_id, receipt) if receipt is not None
                          else ()) + (handoff_id, now))
            # first (a listener hears a commit's NOTIFYs in order, and before those of any later
            # commit): the origin's daemon knows the id before its result or parking is told
            self._notify(conn, handoff_id, ingested_kind(origin))
            self._notify(conn, handoff_id, State.PENDING.value)
            return True

        return self._run_then_wake(op, handoff_id, State.PENDING.value)

    @staticmethod
    def _has_receipt(conn: Conn, origin: str, handoff_id: str, receipt: str) -> bool:
        return conn.execute(
            "SELECT 1 FROM handoffd.records WHERE kind = %s AND key = %s AND value = %s::jsonb",
            (f"{RECEIPT} {origin}", handoff_id, receipt)).fetchone() is not None

    def receipted(self, origin: str, handoff_id: str, doc: Doc, stamp: str) -> bool:
        """Whether ``origin``'s bridge ingested this very file (``stamp``, holding ``doc``)
        before: a copy left in pending/ by an ingester that died before removing it."""
        receipt = _receipt(stamp, file_digest(doc))
        return self.db.run(lambda conn, _: self._has_receipt(conn, origin, handoff_id, receipt))

    def prune_receipts(self, origin: str, is_gone: Callable[[str, str], bool],
                       limit: int = 500) -> int:
        """Delete ``origin``'s receipts whose file is gone from pending/ (``is_gone(id,
        stamp)``); a receipt only ever tells that very file, so one whose file is gone tells
        nothing more. Returns how many went."""
        rows = self.db.run(lambda conn, _: conn.execute(
            "SELECT key, value::text, value ->> 'file' FROM handoffd.records WHERE kind = %s "
            "ORDER BY key LIMIT %s", (f"{RECEIPT} {origin}", limit)).fetchall())
        gone = [(str(key), str(value)) for key, value, stamp in rows
                if is_gone(str(key), str(stamp))]
        if gone:  # (one that names the file again since, a newer ingest's, is kept)
            self.db.run(lambda conn, _: conn.execute(
                "DELETE FROM handoffd.records r USING unnest(%s::text[], %s::text[]) AS g(k, v) "
                "WHERE r.kind = %s AND r.key = g.k AND r.value = g.v::jsonb",
                ([k for k, _ in gone], [v for _, v in gone], f"{RECEIPT} {origin}")))
        return len(gone)

    def unexported(self, origin: str, *, ids: builtins.list[str] | None = None,
                   limit: int = 500) -> builtins.list[tuple[str, State, Doc]]:
        """Finished handoffs ingested by ``origin`` whose terminal file it has not written
        (``ids``: only among those). A row that can never become a file (an id that is no safe
        file name, which would name a path outside the workspace; a document Python cannot
        load) is set aside into the quarantine instead, with one log line."""
        among = " AND id = ANY(%s)" if ids is not None else ""
        params: builtins.list[Any] = [origin, *([ids] if ids is not None else []), limit]
        rows = self.db.run(lambda conn, _: conn.execute(
            f"SELECT id, state, {self._doc()} FROM {T} WHERE origin = %s AND NOT exported "
            f"AND state IN ('completed', 'failed'){among} ORDER BY updated_at LIMIT %s",
            params).fetchall())
        owed: builtins.list[tuple[str, State, Doc]] = []
        for handoff_id, state, value, size in rows:
            try:
                owed.append((handoff_id, State(state),
                             document(loaded(value), handoff_id, state, size)))
            except InvalidDocument as exc:
                self._refuse(handoff_id, state, exc)
            except MemoryError:  # "not now": left for the next export, never set aside
                continue
        return owed

    def _refuse(self, handoff_id: str, state: str, exc: InvalidDocument) -> None:
        """Set aside a finished row that cannot be written as a file (once: it is gone after)."""
        message = f"{exc}; its terminal file is never written"
        if self.db.run(lambda conn, _: self._quarantine(conn, handoff_id, state, exc.code,
                                                        message)) is not None:
            log.warning("set aside handoff %s (%s) into the database's quarantine table: "
                        "%s: %s", repr(handoff_id)[:80], state, exc.code, message)

    def origin_of(self, handoff_id: str) -> str | None:
        """The workspace that ingested ``handoff_id`` from a file (None: none did, or unknown)."""
        found = self.ingested(handoff_id)
        return None if found is None else found[0]

    def ingested(self, handoff_id: str) -> tuple[str | None, str | None] | None:
        """The workspace that ingested ``handoff_id`` from a file and the :func:`file_digest` of
        the document it ingested (None, None: not from a file, or before digests were kept);
        None when the id is unknown."""
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT origin, write_id FROM {T} WHERE id = %s", (handoff_id,)).fetchone())
        if found is None:
            return None
        digest = found[1] if isinstance(found[1], str) and found[1].startswith("sha256:") else None
        return found[0], digest

    def rechecks(self, origin: str, limit: int = 500) -> builtins.list[tuple[str, str]]:
        """(id, token) of the handoffs whose terminal file in ``origin`` may be stale (see
        :meth:`StoreBase._recheck`); pass the token to :meth:`recheck_done`."""
        return self.db.run(lambda conn, _: [(str(r[0]), str(r[1])) for r in conn.execute(
            "SELECT key, value::text FROM handoffd.records WHERE kind = %s ORDER BY key LIMIT %s",
            (f"{RECHECK} {origin}", limit)).fetchall()])

    def recheck_done(self, origin: str, handoff_id: str, token: str) -> None:
        """``origin``'s bridge looked at the file of ``handoff_id`` (unless asked again since)."""
        self.db.run(lambda conn, _: conn.execute(
            "DELETE FROM handoffd.records WHERE kind = %s AND key = %s AND value = %s::jsonb",
            (f"{RECHECK} {origin}", handoff_id, token)))

    def finished_entry(self, handoff_id: str) -> tuple[str, Any] | None:
        """(state, newest history entry of its document: {} when it has none) of the row
        ``handoff_id``, None when there is none: what tells the terminal file a bridge wrote
        for this very row from one it wrote for an earlier handoff under the same id. The
        entry is extracted by the database (a large document is not sent)."""
        found = self.db.run(lambda conn, _: conn.execute(
            f"SELECT state, (doc -> 'handoffd' -> 'history' -> -1)::text FROM {T} "
            "WHERE id = %s", (handoff_id,)).fetchone())
        if found is None:
            return None
        try:  # read as every stored document is (values.SafeJsonLoader)
            entry = load_json(found[1], "the stored entry") if found[1] is not None else None
        except Exception:  # JSON Python cannot load: no entry a file could match
            entry = None
        return str(found[0]), entry if isinstance(entry, dict) else {}

    def unfinished(self, origin: str, limit: int = 10_000) -> builtins.list[str]:
        """The ids of the handoffs ``origin`` ingested that are not finished yet (at most
        ``limit``): its bridge, starting, watches for their results as for those it ingests
        itself (a command may have ingested them while no daemon ran there)."""
        return [str(r[0]) for r in self.db.run(lambda conn, _: conn.execute(
            f"SELECT id FROM {T} WHERE origin = %s AND state IN ('pending', 'in-progress') "
            "LIMIT %s", (origin, limit)).fetchall())]

    def parked(self, origin: str, *, ids: builtins.list[str] | None = None,
               limit: int = 500) -> builtins.list[tuple[str, Any]]:
        """(id, newest history entry: {} when it has none) of the handoffs ``origin`` ingested
        that are parked (pending, waiting for their requester's answer: ``handoffd.awaiting``),
        ``ids``: only among those. The bridge writes their documents back into that workspace's
        pending/, where file readers find the outcome, as on a files store. The entries are
        extracted by the database (no document is sent)."""
        among = " AND id = ANY(%s)" if ids is not None else ""
        params: builtins.list[Any] = [origin, *([ids] if ids is not None else []), limit]
        rows = self.db.run(lambda conn, _: conn.execute(
            f"SELECT id, (doc -> 'handoffd' -> 'history' -> -1)::text FROM {T} WHERE origin = %s "
            "AND state = 'pending' AND NOT raw AND "
            f"json_typeof(doc -> 'handoffd' -> 'awaiting') = 'object'{among} ORDER BY id LIMIT %s",
            params).fetchall())
        found: builtins.list[tuple[str, Any]] = []
        for handoff_id, text in rows:
            try:  # read as every stored document is (values.SafeJsonLoader)
                entry = load_json(text, "the stored entry") if text is not None else None
            except Exception:  # JSON Python cannot load: its document is not written either
                continue
            found.append((str(handoff_id), entry if isinstance(entry, dict) else {}))
        return found

    def adopt(self, handoff_id: str, origin: str) -> None:
        """The failure stub ``handoff_id`` (filed without an origin) was written into
        ``origin``'s failed/ by its bridge: note it as that workspace's, exported, so that
        purging or retrying it removes that file too."""
        self.db.run(lambda conn, _: conn.execute(
            f"UPDATE {T} SET origin = %s, exported = true WHERE id = %s AND origin IS NULL "
            "AND state = 'failed'", (origin, handoff_id)))

    def mark_exported(self, handoff_id: str, state: State) -> None:
        """``origin`` wrote the terminal file of ``handoff_id`` (in ``state``)."""
        self.db.run(lambda conn, _: conn.execute(
            f"UPDATE {T} SET exported = true WHERE id = %s AND state = %s",
            (handoff_id, state.value)))
