"""The notifier: queues a notice per matching rule when a handoff is filed (recorded in the
outbox first), takes over what processes that died left undelivered, and drains at a stop.

Every notice is in exactly one place, under one lock: queued, in flight, or settled (delivered
or dead-lettered), and in the outbox (:mod:`.outbox`) until it is settled. Background threads
deliver, a lane per rule (:mod:`.delivery`), and another takes over what ended processes left
(:meth:`Notifier.take_over_soon`: never the daemon's main loop, which a sweep taking over
planted journals once stalled for minutes). A drain (a stopping daemon, or any process that
filed work, at its exit) waits for the deliveries a bounded time, then stops them and
dead-letters what is left: see :meth:`Notifier.drain`."""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ...core.config import NotifyRule
from ...core.documents import revision
from ...core.states import State
from . import leftovers
from .delivery import Deliveries
from .notices import MAYBE_DELIVERED, NEVER_TRIED, STOPPED, Notice, fingerprint
from .outbox import Entry

if TYPE_CHECKING:
    from ...core.engine import Engine

log = logging.getLogger("handoffd")
DRAIN_SECONDS = 10.0  # a stopping daemon waits at most this long for queued deliveries
SETTLE_SECONDS = 2.0  # then this long for the delivery it cut off to record itself
QUEUE_LIMIT = 10_000  # notices beyond this are dead-lettered at once (a webhook that is down)
# notices one sweep takes over at most (the rest stays in its journal for the next sweeps): what
# a takeover adds to the queue and to the dead letters is bounded by this a sweep
TAKE_PER_SWEEP = 1_000
FULL = "the notification queue is full"


class Notifier(Deliveries):
    """Queues a notice per matching rule when a handoff is filed; a thread delivers them."""

    def __init__(self, engine: Engine, *, sleep: Callable[[float], None] | None = None) -> None:
        super().__init__(engine, sleep=sleep)
        self.at_exit = False  # (a forked child inherits the atexit drain with the flag)
        self.prints = [fingerprint(rule) for rule in engine.config.on_filed]

    def _fresh(self) -> None:
        super()._fresh()
        self.draining = False
        self.drain_lock = threading.Lock()  # one drain at a time; the next finds nothing left
        self.taker: threading.Thread | None = None  # the takeover under way (take_over_soon)
        self.gave_up = 0  # drains whose time ran out: a takeover begun before one takes no more
        self.take_lock = threading.Lock()  # one takeover at a time

    # ------------------------------------------------------------ queueing
    def filed(self, handoff_id: str, where: State) -> None:
        """``on_filed`` listener: record the notices in the outbox and queue them (never raises,
        never waits for a delivery)."""
        if not where.terminal:
            return
        try:
            filed: tuple[State, dict[str, Any]] | None = self.engine.filed_document(handoff_id)
        except Exception:  # unreadable: no agent, no revision (only the state tells a refiling)
            filed = None
        rules = self._matching(filed, where)
        if rules:
            # the filing the notices are about: a later one is not delivered in its place
            number = revision(filed[1]) if filed and filed[0] is where \
                and isinstance(filed[1], dict) else None
            self._enqueue([Notice(rule, handoff_id, where, revision=number) for rule in rules])

    def _matching(self, filed: tuple[State, dict[str, Any]] | None,
                  where: State) -> list[NotifyRule]:
        rules = [r for r in self.engine.config.on_filed if where.value in r.states]
        if any(r.agents for r in rules):
            agent = self._agent_of(filed[1]) if filed else None
            rules = [r for r in rules if not r.agents or agent in r.agents]
        return rules

    def _agent_of(self, doc: dict[str, Any]) -> str | None:
        """The specialist the filed document ``doc`` was for (whatever its format)."""
        try:
            block = doc.get("handoffd")
            request = block.get("request_snapshot") if isinstance(block, dict) else None
            source = request if isinstance(request, dict) else doc
            env = self.engine.formats.detect(source).envelope(source)
        except Exception:  # an unreadable answer: it matches no agent filter
            return None
        spec = self.engine.specialist_for(env)
        return spec.agent if spec else env.target

    def _enqueue(self, notices: list[Notice], *, taken_over: bool = False) -> bool:
        """Record ``notices`` in the outbox and queue them (past QUEUE_LIMIT: dead-lettered).
        A notice the outbox cannot record is queued all the same (delivered from memory),
        unless it is ``taken_over`` from another journal: then nothing is queued (False)."""
        with self.lock:
            if self.stopping.is_set() and not self.draining and not self._outstanding():
                self.stopping.clear()  # an earlier drain is over: this engine files again
            if taken_over and self.stopping.is_set():
                return False  # a drain is giving up: the journal stays for the next process
            room = max(QUEUE_LIMIT - len(self.pending), 0)
            queued, overflow = notices[:room], notices[room:]
            seqs = self.outbox.record([self._entry(n) for n in queued]) if queued else []
            if seqs is None and taken_over:
                return False
            for index, notice in enumerate(queued):
                notice.seq = seqs[index] if seqs else None
                self.pending.append(notice)
            # in one append, said in one line (never recorded in the outbox: nothing to mark)
            self._dead_letter_all([(notice, FULL) for notice in overflow],
                                  summary=f"{FULL} ({QUEUE_LIMIT} wait)")
            self._ensure_thread()
            return True

    def _entry(self, notice: Notice) -> Entry:
        rules = self.engine.config.on_filed
        index = next((i for i, rule in enumerate(rules) if rule is notice.rule), -1)
        print_ = self.prints[index] if index >= 0 else fingerprint(notice.rule)
        return Entry(notice.handoff_id, notice.state, print_, max(index, 0), notice.kinds,
                     notice.filed_at, notice.revision)

    def take_over_soon(self, engine: object = None) -> None:
        """``on_sweep`` repair: take over, on a thread of its own, the notices that ended
        processes left undelivered (:meth:`take_over`); returns at once. A takeover still under
        way is not started again (the next sweep asks again), nor one while this notifier
        drains (the next process takes them); a drain waits for the one under way."""
        with self.lock:
            if self.draining or self.taker is not None:
                return
            self._at_exit()  # (`handoffd sweep`: its exit waits for it, and delivers)
            self.taker = threading.Thread(target=self._take_round, daemon=True,
                                          name="handoffd-notify-takeover")
            try:
                self.taker.start()
            except BaseException:
                self.taker = None
                raise

    def take_over(self, engine: object = None) -> int:
        """Queue the notices that ended processes left undelivered in their journals, now (the
        outbox sees that their processes are gone, and lets one process take each): how many
        were taken. Not while this notifier drains: the next process takes them. At most
        TAKE_PER_SWEEP notices: the rest stay for the next sweep. Those past QUEUE_LIMIT are
        dead-lettered, as when filed."""
        with self.lock:
            if self.draining:
                return 0
        return self._take_round()

    def _take_round(self) -> int:
        began = self.gave_up

        def adopt(entries: list[Entry], journal: str) -> bool:
            return self._adopt(entries, journal, began)

        try:
            with self.take_lock:
                return leftovers.take_over(self.outbox, adopt, limit=TAKE_PER_SWEEP)
        except Exception:  # a bug here must not end the thread silently, nor the sweep
            log.exception("taking over left-over notifications failed; the next sweep tries "
                          "again")
            return 0
        finally:
            with self.lock:
                if self.taker is threading.current_thread():
                    self.taker = None
                self.lock.notify_all()  # a drain waits for this

    def _adopt(self, entries: list[Entry], journal: str, began: int) -> bool:
        """Queue ``entries`` taken over from ``journal`` (False: not recorded, or a drain that
        began after this takeover gave up, ``began`` its count then: the journal stays)."""
        known = [(entry, self._rule_for(entry)) for entry in entries]
        notices = [Notice(rule, e.handoff_id, e.state, e.kinds, e.filed_at, revision=e.revision)
                   for e, rule in known if rule is not None]
        with self.lock:
            if self.gave_up != began:
                return False  # this process stops: the next one takes them
            if notices and not self._enqueue(notices, taken_over=True):
                return False
        log.warning("took over %d notification(s) that a process which ended left undelivered "
                    "(outbox %s)", len(entries), journal)
        orphans = [(Notice(NotifyRule(), e.handoff_id, e.state, e.kinds, e.filed_at,
                           revision=e.revision),
                    f"{', '.join(e.kinds)}: its [[on_filed]] rule is no longer in handoffd.toml "
                    "(it changed after a process that ended queued it): not delivered")
                   for e, rule in known if rule is None]
        with self.lock:  # (in one append, said in one line)
            self._dead_letter_all(orphans, summary=f"their [[on_filed]] rule is no longer in "
                                                   f"handoffd.toml (outbox {journal})")
        return True

    def _rule_for(self, entry: Entry) -> NotifyRule | None:
        """The rule ``entry`` names: the one at its place, else another with its targets."""
        rules = self.engine.config.on_filed
        if entry.index < len(rules) and self.prints[entry.index] == entry.rule:
            return rules[entry.index]
        return next((r for r, p in zip(rules, self.prints) if p == entry.rule), None)

    def held_bytes(self) -> int:
        """About what the queued notices and the delivery under way hold in memory: a few
        hundred bytes a notice, whatever the size of its document, plus the one document
        being delivered."""
        with self.lock:
            return (sum(notice.size() for notice in self.pending) + self.outbox.held_bytes()
                    + sum(len(flight.body) for flight in self.flights))

    def _ensure_thread(self) -> None:
        with self.lock:
            self._at_exit()
            self._ensure_workers()

    def _at_exit(self) -> None:
        with self.lock:
            if not self.at_exit:  # whatever process this is, it delivers before it exits
                atexit.register(self.drain)
                self.at_exit = True

    # ------------------------------------------------------------ the drain
    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Deliver what is queued, for at most ``timeout`` seconds (a stopping daemon, or any
        process that filed work, at its exit); True when nothing was left. Then a command still
        running is killed, a webhook attempt under way cut off, and every notice not delivered
        is dead-lettered: those never tried, and the one in flight. So a second drain (the stop
        hook, then ``atexit``) finds nothing left and returns at once. The outbox's journal is
        removed when nothing is left in it."""
        with self.drain_lock:
            with self.lock:
                self.draining = True
            try:
                try:
                    if self._wait_for_deliveries(time.monotonic() + timeout):
                        return True
                except KeyboardInterrupt:  # Ctrl-C while `handoff cancel` waits to deliver:
                    pass  # give up at once, but dead-letter what is left (it was lost)
                self._give_up_all()
                return False
            finally:
                with self.lock:
                    self.draining = False
                    if not self._outstanding():
                        self.outbox.release()

    def _wait_for_deliveries(self, deadline: float) -> bool:
        """Wait until every notice is delivered or dead-lettered, and the takeover under way
        has ended (True), or ``deadline``."""
        with self.lock:
            while self._outstanding() or self.taker is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ensure_thread()
                self.lock.wait(min(left, 0.1))
            return True

    def _give_up_all(self) -> None:
        """The drain's time is up: stop every delivery and dead-letter what is left."""
        with self.lock:
            never_tried = list(self.pending)
            self.pending.clear()  # (taken now: the thread must not start them)
            log.warning("%d notification(s) not delivered before the process stopped",
                        self._outstanding() + len(never_tried))
            self.stopping.set()  # the delivery under way ends with a dead letter, not a retry
            self.gave_up += 1  # (a takeover under way takes no more)
            # (in one append; a few said one by one, more in one line)
            self._dead_letter_all([(notice, NEVER_TRIED) for notice in never_tried],
                                  summary=NEVER_TRIED)
        self.kill_running()  # a command still running must not outlive the process
        deadline = time.monotonic() + SETTLE_SECONDS
        with self.lock:  # the thread records the delivery it was making, with its own reason
            while any(not flight.settled for flight in self.flights) \
                    and time.monotonic() < deadline:
                self.lock.wait(max(min(deadline - time.monotonic(), 0.1), 0.0))
            self._claim_flights()

    def _claim_flights(self) -> None:
        """Dead-letter what the threads have not recorded in time (call with the lock held): a
        delivery one still makes is never recorded twice, nor lost when the process exits."""
        for flight in self.flights:
            if flight.settled:
                continue
            flight.settled = True
            # that thread is held: it ends once its attempt does, and counts no more
            if flight.worker is not None:
                self.workers.discard(flight.worker)
            for index, kind in enumerate(flight.kinds):
                if index == 0 and flight.trying:
                    why = f"{kind}: {STOPPED} while it was being delivered"
                    if flight.may_have_delivered():
                        why += MAYBE_DELIVERED[kind]
                else:
                    why = f"{kind}: {NEVER_TRIED}"
                self._dead_letter(flight.notice, why, [kind])
