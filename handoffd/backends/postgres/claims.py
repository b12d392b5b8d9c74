"""The PostgreSQL backend's claims (:class:`Claiming`, a mixin of
:class:`~handoffd.backends.postgres.backend.PostgresBackend`): claim-next and claim by id, lease
renewal, and the fenced release through which ``finish`` and ``requeue`` end a claim.

* claim-next is one statement, ``UPDATE ... WHERE id = (SELECT ... ORDER BY priority, due_at,
  id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING ...``: concurrent claimers on any host skip each
  other's rows instead of waiting. The claimed document (attempt, lease, the format's marks from
  ``prepare``) is written in the same transaction, fenced by the new token.
* renew, finish and requeue are ``... WHERE id = %s AND lease_token = %s``: once a claim was
  requeued, finished or taken over by ``expired_claims``, its writes change nothing.
* a claimer first holds this process's presence key (:class:`ClaimOwner`), by which recovery
  (:mod:`handoffd.backends.postgres.recovery`) tells a live owner's claims from a dead one's.
"""
from __future__ import annotations

import errno
import threading
import uuid
from datetime import datetime, timedelta
from typing import Any, Callable, Collection

import psycopg

from ...core.documents import BOOK, book, raw_book
from ...core.errors import InvalidDocument
from ...core.memorystrikes import claim_out_of_memory
from ...core.states import State
from ..base import Claim, Doc, check_due, lease_block, stamp_claimed
from .connection import Conn, Presence
from .records import StoreBase, T, encode
from .values import document, loaded
from .values import unreadable as unreadable_doc

MAX_GIVEN_UP = 10_000  # given-up tokens remembered (a full disk gives up many at once)
# why the lease keeper stops a handler whose claim rides on a presence this process is no longer
# sure of (see ClaimOwner.broken_claims)
PRESENCE_LOST_REASON = (
    "this process has not been able to prove to the database that it is alive (its presence "
    "connection was lost) for long enough that another host may soon take the handoff over; the "
    "handler is stopped and its result will be discarded")


RENEW_WAIT_FRACTION = 0.1  # of a lease: how long a renewal waits for its row's lock
RENEW_WAIT_MAX = 2.0  # seconds, at most


class _ShortInClaim(Exception):
    """A MemoryError inside a claim's transaction, before its commit (so rolled back: the row
    still pending), carried out of :meth:`Database.run` apart from one after the commit;
    ``handoff_id``: the row chosen (None: claim-next had chosen none yet)."""

    def __init__(self, handoff_id: str | None) -> None:
        super().__init__(handoff_id)
        self.handoff_id = handoff_id


class LeaseBusy(OSError):
    """A renewal found its row locked by another session for too long: not renewed this round
    (an OSError: the lease keeper logs it and tries again next round; its guard fences the
    claim only if that goes on for most of a lease)."""


def renew_wait(lease_seconds: float) -> float:
    """Seconds a renewal waits for its row's lock: a tenth of the lease, 50 ms to 2 s (a round
    renews every lease / 3, the guard fences at 0.8 of a lease)."""
    return min(max(lease_seconds * RENEW_WAIT_FRACTION, 0.05), RENEW_WAIT_MAX)


class ClaimOwner(StoreBase):
    """This process as the owner of claims: the presence key (``owner_key``, recorded with each
    claim) that it holds on a connection of its own once it claims or recovers anything.

    Another host takes our claims over once it has held our key itself (taken when it saw it
    unheld, :mod:`~handoffd.backends.postgres.holds`) for ``owner_grace`` seconds, however
    long their leases. So our claims are only as safe as our presence:
    :meth:`broken_claims` gives them all up to the lease keeper (which stops their handlers)
    once the presence session has not proved alive for half that grace, and no claim is made
    meanwhile. Half: the other half covers stopping a handler (SIGTERM, a 2 s grace, SIGKILL)
    and the round trips, before the earliest takeover."""

    url: str
    owner_key: int
    owner_grace: float  # seconds a presence key may be unheld before its claims are taken over
    monotonic: Callable[[], float]
    _presence: Presence | None
    _presence_lock: threading.Lock
    _given_up: set[str]  # tokens of claims this process ended without filing (abandon)
    # (id, token) -> (lease expiry, monotonic time) of each lease this process last wrote: its
    # own claims' leases are watched from then (see recovery: a wall clock stepped forward)
    _written: dict[tuple[str, str | None], tuple[datetime, float]]
    broken_reason = PRESENCE_LOST_REASON

    def _present(self) -> None:
        """Hold this process's presence key before it claims anything (see
        :mod:`handoffd.backends.postgres.recovery`)."""
        if self._presence is not None:
            return
        with self._presence_lock:
            if self._presence is None:
                # a round trip ten times a grace (at most each second): a stall shows in time
                beat = min(1.0, max(self.owner_grace / 10, 0.05))
                # (its own clock, never a test's leaping one: it times real round trips)
                presence = Presence(self.url, self.owner_key, beat=beat,
                                    connect_timeout=self.db.connect_timeout)
                presence.start()
                self._presence = presence

    def _wrote(self, handoff_id: str, token: str, expires: datetime) -> None:
        """This process wrote the lease ``token`` of ``handoff_id``, expiring at ``expires``,
        just now (on its monotonic clock)."""
        with self._presence_lock:
            self._written[(handoff_id, token)] = (expires, self.monotonic())

    def written_at(self, handoff_id: str, token: str | None, expires: datetime | None) -> float | None:
        """When (monotonic) this process wrote that very lease; None if it did not."""
        with self._presence_lock:
            found = self._written.get((handoff_id, token))
        return found[1] if found is not None and found[0] == expires else None

    def present_for_sure(self) -> bool:
        """True while the presence session proved alive within half the owner grace (before
        any claim: True, nothing rides on it)."""
        presence = self._presence
        return presence is None or presence.age() <= self.owner_grace / 2

    def broken_claims(self, claims: Collection[Claim]) -> list[Claim]:
        """Those of ``claims`` (this process's running ones) that another host may soon take
        over: all of them while :meth:`present_for_sure` is False. The caller (the lease
        keeper, several times a second) fences them, with :data:`broken_reason`."""
        return [] if self.present_for_sure() else list(claims)


class Claiming(ClaimOwner):
    """``claim_next``, ``claim``, ``renew`` and ``abandon``, and the ``_release`` that
    :class:`~handoffd.backends.base.FencedFiling` files through."""

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
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        pick = f"SELECT id FROM {T} WHERE id = %(id)s AND state = 'pending' FOR UPDATE SKIP LOCKED"
        return self._claim(pick, {"id": handoff_id}, now, lease_seconds, prepare, due_only)

    def _claim(self, pick: str, params: dict[str, Any], now: datetime, lease_seconds: float,
               prepare: Callable[[Doc], None] | None, due_only: bool = False) -> Claim | None:
        """The claim statement (``pick`` chooses and locks the row), then the claimed document,
        written in the same transaction: ``prepare`` raising leaves the handoff pending. A
        MemoryError before the commit is a memory strike (the row rolled back, still pending:
        :func:`~handoffd.core.memorystrikes.claim_out_of_memory`); one after it (committing,
        returning the connection) never is: see :meth:`_after_commit`."""
        token = uuid.uuid4().hex
        expires = now + timedelta(seconds=lease_seconds)
        self._present()
        if not self.present_for_sure():  # it would be fenced at once (the presence logs why)
            return None
        values = {**params, "token": token, "expires": expires, "now": now,
                  "owner": self.owner_key}
        built: list[Claim] = []  # the claim the last try that got to its commit built
        chosen: list[str] = []  # the row each try chose (claim-next: known once it is locked)

        def op(conn: Conn, retried: bool) -> Claim | None:
            if retried:  # did the try that lost its connection commit our claim? (a
                # MemoryError asking is no "still pending": _after_commit asks again)
                if conn.execute(f"SELECT 1 FROM {T} WHERE state = 'in-progress' AND "
                                "lease_token = %s", (token,)).fetchone() is not None:
                    return self._committed(token, built)  # (ours, as we wrote it: not re-read)
            try:
                return self._claim_row(conn, pick, values, lease_seconds, prepare, built,
                                       chosen, due_only)
            except MemoryError:  # before the commit: rolled back, the row still pending
                raise _ShortInClaim(chosen[-1] if chosen else params.get("id")) from None

        try:
            claim = self.db.run(op)
        except _ShortInClaim as short:
            raise self._out_of_memory(short.handoff_id) from None
        except MemoryError:  # after a try got to its commit: did the commit hold?
            claim = self._after_commit(token, built, params.get("id"))
        if claim is not None:
            try:
                self._wrote(claim.id, token, expires)
            except MemoryError:  # (only times our own sweep's watch; each renewal records it)
                pass
        return claim

    def _claim_row(self, conn: Conn, pick: str, values: dict[str, Any], lease_seconds: float,
                   prepare: Callable[[Doc], None] | None, built: list[Claim],
                   chosen: list[str], due_only: bool = False) -> Claim | None:
        """One try of :meth:`_claim` in its transaction: the row ``pick`` chooses, claimed
        (its id appended to ``chosen`` once known) and its claimed document written; the
        Claim (appended to ``built``), or None when there is nothing to claim. ``due_only``:
        NotDue, rolled back, when the document's own retry time is still to come."""
        now, token = values["now"], values["token"]
        # the gate again at each try: one retried after the database came back would
        # otherwise claim before this process's presence session is back (its handler
        # started, to be stopped at once by the lease keeper: a wasted, counted attempt)
        if not self.present_for_sure():
            return None
        got = conn.execute(
            f"UPDATE {T} SET state = 'in-progress', lease_token = %(token)s, "
            f"lease_expires_at = %(expires)s, lease_owner = %(owner)s WHERE id = ({pick}) "
            f"RETURNING id, raw, created_at, {self._doc()}", values).fetchone()
        if got is None:
            return None
        handoff_id, raw, created_at, value, size = got
        chosen.append(handoff_id)
        try:
            doc = document(loaded(value), handoff_id, State.PENDING.value, size)
            self._check_request(doc, size, handoff_id)
        except InvalidDocument as exc:  # rolled back: still pending, for the caller to set
            raise unreadable_doc(exc, handoff_id) from None  # aside (as Engine.claim does)
        if raw:  # a document from a file: whatever bookkeeping it carried is not ours; ours
            doc[BOOK] = raw_book(handoff_id)  # names the file it was dropped as
        if due_only:  # (raising rolls the transaction back: still pending, untouched)
            check_due(doc, handoff_id, now)
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
        claim = Claim(handoff_id, doc, token, attempt, raw=bool(raw))
        built.append(claim)
        return claim

    def _committed(self, token: str, built: list[Claim]) -> Claim | None:
        """Our claim ``token``, found committed: the one the try that committed built (its
        document is what it wrote). None, the token given up (our sweep hands the row back
        uncounted once its lease ends), if no try got that far (which a commit needs)."""
        if built and built[-1].token == token:
            return built[-1]
        self._give_up(token)
        return None

    def _after_commit(self, token: str, built: list[Claim],
                      handoff_id: str | None) -> Claim | None:
        """A MemoryError after a try of :meth:`_claim` left its transaction (committing,
        returning the connection to the pool), or while asking whether a lost try committed:
        the claim when the row says it committed (held, recorded and renewed as any other: it
        once raised a ClaimShortage, "stays in pending/", with the row leased in-progress that
        nobody renewed, and its recovery charged an attempt); else, rolled back, the memory
        strike. When even asking fails, the token is given up (if it did commit, this
        process's sweep hands it back uncounted once its lease ends) and the strike raised."""
        if not built:  # no try got to its commit: nothing of ours was written
            raise self._out_of_memory(handoff_id)
        try:
            mine = self.db.run(lambda conn, _: conn.execute(
                f"SELECT 1 FROM {T} WHERE state = 'in-progress' AND lease_token = %s",
                (token,)).fetchone())
        except (MemoryError, OSError):
            self._give_up(token)
            raise self._out_of_memory(built[-1].id) from None
        if mine is None:
            raise self._out_of_memory(built[-1].id)
        return self._committed(token, built)

    @staticmethod
    def _out_of_memory(handoff_id: str | None) -> Exception:
        """What a claim whose transaction ran out of memory (rolled back) raises: the memory
        strike of ``handoff_id`` (:func:`~handoffd.core.memorystrikes.claim_out_of_memory`);
        when no row was chosen yet (claim-next), an OSError ENOMEM, a passing shortage of the
        store's (no document's to strike, nothing claimed)."""
        if handoff_id is None:
            return OSError(errno.ENOMEM, "out of memory (MemoryError) claiming the next "
                           "pending handoff; nothing was claimed")
        return claim_out_of_memory(handoff_id, f"handoff {handoff_id} (pending)")

    def renew(self, claim: Claim, now: datetime, lease_seconds: float) -> bool:
        """See :meth:`Backend.renew`. LeaseBusy (an OSError: not renewed this round, the lease
        keeper tries again and its guard decides) when another session holds the row locked
        for longer than :func:`renew_wait`: one row locked by hand held every renewal of the
        round behind it, and unrelated claims lapsed and ran again on another host."""
        stamp = lease_block(claim.token, now, lease_seconds)
        wait = renew_wait(lease_seconds)

        def op(conn: Conn, _retried: bool) -> bool | None:
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(wait * 1000)}ms",))
            # the stored text is rewritten whole (json keeps the document's own key order, and
            # PostgreSQL offers no json_set; jsonb_set would sort its keys): read under the row
            # lock, change the lease, write. A pending document is at most max_document_bytes
            # (and its bookkeeping): a larger one is never claimed
            try:
                with conn.transaction():  # a savepoint: a lock wait that times out ends only it
                    found = conn.execute(  # (one grown too large by hand: its lease only)
                        f"SELECT {self._doc()} FROM {T} WHERE id = %s AND state = "
                        "'in-progress' AND lease_token = %s FOR UPDATE",
                        (claim.id, claim.token)).fetchone()
            except psycopg.errors.LockNotAvailable:
                return None
            if found is None:
                return False
            doc = found[0]
            expires = now + timedelta(seconds=lease_seconds)
            if not isinstance(doc, dict):  # overwritten by someone else (or grown too large to
                # read): the lease still holds
                conn.execute(f"UPDATE {T} SET lease_expires_at = %s WHERE id = %s",
                             (expires, claim.id))
                return True
            book(doc)["lease"] = dict(stamp)
            conn.execute(f"UPDATE {T} SET lease_expires_at = %s, doc = %s::json WHERE id = %s",
                         (expires, encode(doc, strict=False), claim.id))
            return True

        renewed = self.db.run(op)
        if renewed is None:
            raise LeaseBusy(f"handoff {claim.id}: its row is locked by another database session "
                            f"(waited {wait:g}s); its lease is not renewed this round")
        if renewed:
            book(claim.doc)["lease"] = dict(stamp)
            if claim.token is not None:
                self._wrote(claim.id, claim.token, now + timedelta(seconds=lease_seconds))
        else:  # taken over: nothing of ours to watch
            with self._presence_lock:
                self._written.pop((claim.id, claim.token), None)
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

        try:
            return self._run_then_wake(op, claim.id, state.value)
        finally:  # filed, or lost: no lease of ours to watch either way
            with self._presence_lock:
                self._written.pop((claim.id, claim.token), None)

    def abandon(self, claim: Claim) -> None:
        """Nothing is held beyond the lease, which recovery takes over when it expires, as a
        claim this process gave up (handed back, not charged as a crash: see
        :data:`~handoffd.core.storage.GIVEN_UP`) once this process's own sweep takes it."""
        if claim.token is not None:
            self._give_up(claim.token)

    def _give_up(self, token: str) -> None:
        """The claim ``token`` is given up by this process (see :meth:`abandon`)."""
        with self._presence_lock:
            if len(self._given_up) >= MAX_GIVEN_UP:  # (each is taken over within a lease)
                self._given_up.clear()
            self._given_up.add(token)
