"""Recovery of abandoned claims in the PostgreSQL backend (:class:`Recovery`, a mixin of
:class:`~handoffd.backends.postgres.backend.PostgresBackend`).

:meth:`Recovery.expired_claims` takes over claims whose lease expired, and also claims whose
owner died: a claimer holds a session-level advisory lock (its presence key, recorded with each
claim) on a connection of its own, which the server releases when the process dies. A sweep
that sees a key unheld takes it itself, on a session of its own (:mod:`.holds`), and recovers
that owner's claims without waiting for their lease once it has held the key for
``owner_grace_seconds`` (on this process's monotonic clock): the owner, unable to take its key
again, has stopped its handlers by then, however often its session was cut (R56: a sweep that
only looked saw the key unheld in the gaps of a flapping session, and took the claims over
from an owner that kept proving alive). A key some other session holds (its owner, back after
a server restart or a terminated connection, or another sweep) is no sign of death. A lease that
looks expired while its owner's session lives (a stalled owner, or this host's wall clock ahead
of the owner's) is taken over only once this process has watched it unrenewed for a whole lease
period on its monotonic clock, as the files store does: clock skew never ends a live claim.
"""
from __future__ import annotations

import builtins
import errno
import logging
import uuid
from datetime import datetime, timedelta

from ...core.documents import book, book_int
from ...core.errors import InvalidDocument
from ...core.memorystrikes import memory_strikes, out_of_memory
from ...core.states import State
from ...core.storage import GIVEN_UP, LEASE_EXPIRED
from ...core.timeutil import iso
from ..base import Claim, Claims, lease_block
from .claims import ClaimOwner
from .connection import Conn
from .holds import KeyHolds
from .records import T, encode
from .values import document, finite, loaded

log = logging.getLogger("handoffd")
RECOVER = "recover"  # the memory strikes' stage of taking an abandoned claim over
# the presence key of row h held (l.granted) or waited for by a session of this database
KEY_LOCK = ("SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' "
            "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) "
            "AND ((l.classid::bigint << 32) | l.objid::bigint) = h.lease_owner")
# a claim of another process whose presence key no session of this database holds but ours
# that holds the keys we watch (%(holder)s, its backend pid: 0 when none)
OWNER_GONE = ("(h.lease_owner IS NOT NULL AND h.lease_owner <> %(me)s AND NOT EXISTS ("
              f"{KEY_LOCK} AND l.granted AND l.pid <> %(holder)s))")
# a session waits for the key of row h: its owner, back (only a presence waits for its key)
OWNER_BACK = f"EXISTS ({KEY_LOCK} AND NOT l.granted AND l.pid <> %(holder)s)"


def looking_short() -> OSError:
    """What the sweep's look for abandoned claims raises when it runs out of memory before
    handling any row: a passing shortage of the store (an OSError ENOMEM, as claim-next's
    before it chose a row), which the sweep says as one; nothing was taken over."""
    return OSError(errno.ENOMEM, "out of memory (MemoryError) reading the in-progress rows")


# a row of the first look: id, token, expiry, expired by our clock, its owner's key unheld (by
# another process), no owner recorded, owned by this process, the expiry as the server writes
# it, its owner's presence key, a session (its owner's) waits for that key
Seen = tuple[str, "str | None", "datetime | None", bool, bool, bool, bool, "str | None",
             "int | None", bool]
# why a row is taken over, with the token and expiry (as the server wrote it: an infinite one
# is clamped when loaded, and the clamped value would fence it out) it was seen with (the lock
# step's fence), and the backend pid of our session that must still hold its owner's key (an
# owner gone; None: no key to hold)
Verdict = tuple[str, "str | None", "str | None", "int | None"]


class Recovery(ClaimOwner):
    """``expired_claims``: the sweep that takes over expired claims and dead owners' claims."""

    # (id, token) -> since when (monotonic) we hold the key of its owner, seen gone
    _absent: dict[tuple[str, str | None], float]
    # (id, token) -> since when an owner's key is seen unheld at every look, watched without
    # holding it (no holding session to be had)
    _unheld: dict[tuple[str, str | None], float]
    _holds: KeyHolds  # the keys of owners seen gone, held by our own session
    # (id, token, expiry) -> when a live owner's lease was first seen expired by our clock
    _stale: dict[tuple[str, str | None, datetime | None], float]

    def expired_claims(self, now: datetime, lease_seconds: float) -> Claims:
        """See :meth:`Backend.expired_claims`. Running out of memory before any row is handled
        (the first look, judging what it found) is a passing shortage of the store, an OSError
        ENOMEM (:func:`looking_short`): the sweep says it as one, held back as its recurring
        problems are, and looks again at its next pass; nothing is taken over, set aside or
        charged. (A bare MemoryError once left the sweep's step with a traceback.)"""
        try:
            self._present()
            tick = self.monotonic()
        except MemoryError:
            raise looking_short() from None
        refused: builtins.list[str] = []  # rows set aside: said once, after the commit
        watched: set[int] = set()  # owners' keys to go on holding: claims of theirs are left

        def op(conn: Conn, _retried: bool) -> Claims:
            try:
                # (our holding session's holds are no owner's; it is opened, or proved alive by
                # a round trip, only when a look finds an owner gone: most sweeps find none)
                seen = self._look(conn, now, self._holds.pid)
                if any(row[4] for row in seen):
                    self._holds.session()
                why = self._abandoned(seen, tick, lease_seconds)
            except MemoryError:  # before any row is handled: rolled back, nothing taken
                raise looking_short() from None
            taken: Claims = []
            refused.clear()  # (a retried sweep starts again)
            watched.clear()
            # (an owner waiting for its key is alive: let go of it, it takes it at once)
            watched.update(row[8] for row in seen if row[4] and not row[9]
                           and row[8] is not None)
            for handoff_id in sorted(why):
                if memory_strikes.backoff(handoff_id, (RECOVER,)) > 0:
                    continue  # (it ran out of memory lately: after its memory back-off)
                claim = self._take_over(conn, handoff_id, why[handoff_id], now, lease_seconds,
                                        refused)
                if claim is not None:
                    taken.append(claim)
            # an owner all of whose claims we took over needs its key no more
            done = {claim.id for claim in taken}
            left = {row[8] for row in seen if row[4] and row[0] not in done}
            watched.intersection_update(left)
            return taken

        # a retry after a lost connection may miss claims the first try took over: their new
        # leases expire in turn and the next sweep takes them again (never two live holders)
        claims = self.db.run(op)
        # (let go at once: a living owner takes its key again, and claims new work)
        self._holds.keep_only(watched)
        for reason in refused:  # said once: the rows are in the quarantine now
            log.warning("set aside an abandoned claim: %s", reason)
        return claims

    def takeover_watch(self, lease_seconds: float) -> builtins.list[float]:
        """When (on this process's monotonic clock) each claim whose owner's key its sweeps saw
        unheld may be taken over: a whole ``owner_grace`` after it took that key itself. Empty:
        it watches none. Only the process that watched may take such a claim over, so a batch
        (``handoffd run``) waits for these before it ends: it would end before any of them came
        due, and the next batch would start watching anew. A live owner's stale lease is not
        waited for (R56: beside a live `serve` whose clock is behind, every batch waited a whole
        lease and said so): a `serve` takes a stalled owner's claim over. ``lease_seconds``:
        unused (the same signature as the stale watch's would need)."""
        return [first + self.owner_grace for first in self._absent.values()]

    def _look(self, conn: Conn, now: datetime, holder: int) -> builtins.list[Seen]:
        """The sweep's first look: which claims look abandoned (no lock taken: most sweeps find
        nothing). ``holder``: the backend pid of our session holding watched owners' keys (0:
        none), whose holds are no sign of their owners."""
        return conn.execute(
            f"SELECT h.id, h.lease_token, h.lease_expires_at, "
            f"coalesce(h.lease_expires_at <= %(now)s OR NOT isfinite(h.lease_expires_at), "
            f"true), {OWNER_GONE}, "
            f"h.lease_owner IS NULL, h.lease_owner IS NOT DISTINCT FROM %(me)s, "
            f"h.lease_expires_at::text, h.lease_owner, {OWNER_BACK} FROM {T} h "
            "WHERE h.state = 'in-progress' AND (h.lease_expires_at IS NULL OR "
            # (no lease handoffd writes is infinite: one written past it has expired)
            f"h.lease_expires_at <= %(now)s OR NOT isfinite(h.lease_expires_at) OR "
            f"{OWNER_GONE})",
            {"now": now, "me": self.owner_key, "holder": holder}).fetchall()

    def _abandoned(self, seen: builtins.list[Seen], tick: float,
                   lease_seconds: float) -> dict[str, Verdict]:
        """Which of the rows ``seen`` to take over, and why. A claim whose owner's key no other
        session holds: this process takes the key itself (:class:`KeyHolds`) and takes the
        claim over once it has held it for the owner grace (a key it cannot take, held again by
        its owner or by another sweep, is watched afresh; one its owner waits for, back after a
        cut, is let go at the end of the sweep: the owner lives). One whose lease looks
        expired while its owner's session lives (a stalled owner, or our wall clock ahead of
        its): once this process has watched that very lease (token and expiry) unrenewed for a
        whole lease period on its monotonic clock, so a clock ahead never ends a live claim.
        This process's own claims are judged so too (its wall clock may have stepped forward),
        except those it gave up (:meth:`abandon`), taken once expired. One of no recorded owner
        whose lease expired: now."""
        why: dict[str, Verdict] = {}
        gone_now: set[tuple[str, str | None]] = set()
        stale_now: set[tuple[str, str | None, datetime | None]] = set()
        for handoff_id, token, expiry, expired, gone, ownerless, mine, fence, owner, back in seen:
            # (an infinite or out-of-calendar expiry is no time to name)
            shown = finite(expiry)
            at = f"{LEASE_EXPIRED} at {iso(shown) if shown else 'unknown'}"
            if expired and mine and token in self._given_up:
                why[handoff_id] = (GIVEN_UP, token, fence, None)
            elif gone and not back and (watch := self._gone_since(
                    owner, (handoff_id, token), tick)) is not None:
                # (a key held by someone else now, or waited for by its owner: no death seen,
                # judged by its lease below)
                held, holder = watch
                gone_now.add((handoff_id, token))
                self._absent[(handoff_id, token)] = held
                if tick - held >= self.owner_grace:
                    why[handoff_id] = ("owner process is gone (its database session ended "
                                       f"{tick - held:.0f}s ago or more)", token, fence, holder)
            elif expired and not ownerless:
                mark = (handoff_id, token, expiry)
                stale_now.add(mark)
                # (a lease of ours has been watched since we wrote it)
                since = self.written_at(handoff_id, token, expiry) if mine else None
                first = self._stale.setdefault(mark, tick if since is None else since)
                if tick - first >= lease_seconds:
                    whose = ("its owner's key could not be held here" if gone
                             else "its owner's session is alive")
                    why[handoff_id] = (f"{at} ({whose}, but renewed nothing for "
                                       f"{tick - first:.0f}s: stalled)", token, fence, None)
            elif expired:
                why[handoff_id] = (at, token, fence, None)
        for key in set(self._absent) - gone_now:
            del self._absent[key]
        for key in set(self._unheld) - gone_now:
            del self._unheld[key]
        for mark in set(self._stale) - stale_now:
            del self._stale[mark]
        return why

    def _gone_since(self, owner: int | None, mark: tuple[str, str | None],
                    tick: float) -> tuple[float, int | None] | None:
        """Since when this process watches the claim ``mark`` of an owner seen gone, and the
        pid of our session whose hold of the owner's key the takeover must find (None: none);
        None when another session holds the key (its owner, back, or another sweep). The key
        is taken and held (:class:`KeyHolds`); with no holding session to be had (a role at its
        connection limit) the owner is watched as it was before keys were held, seen unheld at
        every look for the grace, from the first such look (R63: judged by its lease alone, a
        cron batch, which waits only for what :meth:`takeover_watch` lists, never took such a
        claim over). With a session had, a key not taken (another's, or this process at its
        :data:`~.holds.MAX_HELD` keys) is never watched so: its claim is judged by its lease."""
        if owner is not None:
            held = self._holds.take(owner)
            if held is not None:
                self._unheld.pop(mark, None)
                return held, self._holds.pid
            if not self._holds.sessionless():
                # (held by someone else, or this process at its MAX_HELD keys: judged by its
                # lease, never taken over unheld while a session is had, R65)
                return None
        # (a watch of its own, begun afresh: a since from a hold lost with its session is no
        # look's, R65)
        return self._unheld.setdefault(mark, tick), None

    def _take_over(self, conn: Conn, handoff_id: str, verdict: Verdict, now: datetime,
                   lease_seconds: float, refused: builtins.list[str]) -> Claim | None:
        """A new claim on ``handoff_id``, fenced by the token and expiry it was judged with:
        a row renewed, released or claimed again meanwhile is left alone, and so is one of an
        owner gone whose key our holding session no longer holds (lost with it: the watch
        starts afresh, the owner may be back). No token at all (a
        row written past handoffd) is never a live claim (every claim sets one): taken over
        too, or it stays for ever. A row nothing can read is set aside (``refused``)."""
        reason, seen_token, seen_expiry, holder = verdict
        row = conn.execute(
            f"SELECT {self._doc()} FROM {T} h WHERE id = %s AND state = 'in-progress' "
            "AND lease_token IS NOT DISTINCT FROM %s::text "
            "AND lease_expires_at::text IS NOT DISTINCT FROM %s::text "
            f"AND (%s::int IS NULL OR EXISTS ({KEY_LOCK} AND l.pid = %s::int)) "
            "FOR UPDATE SKIP LOCKED",
            (handoff_id, seen_token, seen_expiry, holder, holder)).fetchone()
        if row is None:
            return None
        try:
            doc = document(loaded(row[0]), handoff_id, State.IN_PROGRESS.value, row[1])
        except InvalidDocument as exc:  # nothing can run or file it: set it aside
            self._quarantine(conn, handoff_id, State.IN_PROGRESS.value, exc.code, str(exc))
            refused.append(f"{exc.code}: {exc}")
            return None
        except MemoryError:  # "not now": left as it is for a later sweep (a memory strike)
            self._short_of_memory(conn, handoff_id, refused)
            return None
        token = uuid.uuid4().hex
        try:
            with conn.transaction():  # a savepoint: running out of memory undoes this row only
                book(doc)["lease"] = lease_block(token, now, lease_seconds)
                conn.execute(
                    f"UPDATE {T} SET lease_token = %s, lease_expires_at = %s, lease_owner = %s, "
                    "doc = %s::json WHERE id = %s",
                    (token, now + timedelta(seconds=lease_seconds), self.owner_key,
                     encode(doc, strict=False), handoff_id))
        except MemoryError:
            self._short_of_memory(conn, handoff_id, refused)
            return None
        memory_strikes.clear(handoff_id, RECOVER)  # (a MemoryError row ends)
        self._given_up.discard(str(seen_token))
        with self._presence_lock:
            self._written.pop((handoff_id, seen_token), None)
        self._wrote(handoff_id, token, now + timedelta(seconds=lease_seconds))
        return Claim(handoff_id, doc, token, book_int(doc, "attempt", 1), recovered=reason)

    def _short_of_memory(self, conn: Conn, handoff_id: str,
                         refused: builtins.list[str]) -> None:
        """A MemoryError taking ``handoff_id``'s abandoned claim over (loading or rewriting its
        document): a memory strike in the :data:`RECOVER` stage. The row is left as it is, for a
        later sweep after the memory back-off (it was once set aside at once as unprocessable);
        only at the strikes' bound is it set aside (``refused``)."""
        where = f"handoff {handoff_id} (in-progress)"
        problem = out_of_memory(handoff_id, where, RECOVER)
        if problem.transient:
            log.warning("cannot take over an abandoned claim for now: %s; left for a later "
                        "sweep", problem)
            return
        self._quarantine(conn, handoff_id, State.IN_PROGRESS.value, problem.code, str(problem))
        refused.append(f"{problem.code}: {problem}")
