"""Recovery of abandoned claims in the PostgreSQL backend (:class:`Recovery`, a mixin of
:class:`~handoffd.backends.postgres.backend.PostgresBackend`).

:meth:`Recovery.expired_claims` takes over claims whose lease expired, and also claims whose
owner died: a claimer holds a session-level advisory lock (its presence key, recorded with each
claim) on a connection of its own, which the server releases when the process dies. A key no
session has held for ``owner_grace_seconds`` (watched on this process's monotonic clock, so a
server restart or a terminated connection, after which live owners take their key again, never
ends a live claim) means its claims are recovered without waiting for their lease.
"""
from __future__ import annotations

import builtins
import logging
import uuid
from datetime import datetime, timedelta
from typing import Callable

from ...core.documents import book, book_int
from ...core.errors import InvalidDocument
from ...core.states import State
from ...core.storage import LEASE_EXPIRED
from ...core.timeutil import iso
from ..base import Claim, Claims, lease_block
from .claims import ClaimOwner
from .connection import Conn
from .records import T, encode
from .values import document

log = logging.getLogger("handoffd")
# a claim of another process whose presence key no session of this database holds
OWNER_GONE = ("(h.lease_owner IS NOT NULL AND h.lease_owner <> %(me)s AND NOT EXISTS ("
              "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
              "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
              "WHERE datname = current_database()) "
              "AND ((l.classid::bigint << 32) | l.objid::bigint) = h.lease_owner))")


class Recovery(ClaimOwner):
    """``expired_claims``: the sweep that takes over expired claims and dead owners' claims."""

    _absent: dict[tuple[str, str], float]  # (id, token) -> owner first seen gone

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
                    why[handoff_id] = f"{LEASE_EXPIRED} at {iso(expiry) if expiry else 'unknown'}"
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
            # fenced by the tokens seen above: a row released and claimed again meanwhile has
            # a new token and a live lease. No token at all (a row written past handoffd) is
            # never a live claim (every claim sets one): taken over too, or it stays for ever
            rows = conn.execute(
                f"SELECT id, doc FROM {T} WHERE id = ANY(%s) AND state = 'in-progress' "
                "AND (lease_token = ANY(%s) OR lease_token IS NULL) ORDER BY id "
                "FOR UPDATE SKIP LOCKED",
                (sorted(why), [t for _, t, *_ in seen if t is not None])).fetchall()
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
