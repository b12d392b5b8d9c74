"""The delivery thread's side of the notifier: one notice at a time, its document read from
the store when its flight starts (never held in the queue), each target of its rule tried with
the rule's retries and exponential backoff, then delivered or dead-lettered, and marked so in
the outbox. A drain (:class:`.notifier.Notifier`) may settle a flight first: whoever settles
it first records it, the other nothing."""
from __future__ import annotations

import json
import logging
import subprocess
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ...core.errors import HandoffdError, NotFound
from ...core.states import State
from . import command
from .notices import MAYBE_DELIVERED, STOPPED, Flight, Notice, write_dead_letter
from .outbox import OUTBOX_DIR, Outbox
from .webhook import Cutoff, shown_url, webhook_request

if TYPE_CHECKING:
    from ...core.engine import Engine

log = logging.getLogger("handoffd")
Send = Callable[[Notice, Flight], "str | None"]


class Deliveries:
    """The queue, the flights and the delivery thread's work (the notifier adds filing, taking
    over and draining)."""

    def __init__(self, engine: Engine, *, sleep: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.stopping = threading.Event()  # set by a drain: no more retries, no new attempt
        self.sleep = sleep or self.stopping.wait  # (a backoff that a drain cuts short)
        # one re-entrant lock guards the queue, the flights and what is running, so that a
        # drain sees every notice in exactly one place: queued, in flight, or settled
        self.lock = threading.Condition()
        self.pending: deque[Notice] = deque()
        self.flights: list[Flight] = []
        self.thread: threading.Thread | None = None
        self.running: set[subprocess.Popen[bytes]] = set()  # commands being delivered to
        self.cutoffs: set[Cutoff] = set()  # webhook attempts under way
        self.outbox = Outbox(engine.ws.meta / OUTBOX_DIR, durable=engine.settings.durable)

    def _outstanding(self) -> int:
        """Notices neither delivered nor dead-lettered yet (call with the lock held)."""
        return len(self.pending) + sum(not flight.settled for flight in self.flights)

    def _deliver_all(self) -> None:
        while True:
            flight = self._next_flight()
            if flight is None:
                return  # started again by the next notice
            try:
                self._fly(flight)
            except Exception as exc:  # a bug here must not kill the deliveries behind it
                log.exception("handoff %s: notification failed", flight.notice.handoff_id)
                self._dead_letter_rest(flight, f"delivery failed ({type(exc).__name__}: "
                                               f"{str(exc)[:160]})")
            finally:
                flight.body = b""
                with self.lock:
                    self.flights.remove(flight)
                    self.lock.notify_all()  # a drain waits for this

    def _next_flight(self) -> Flight | None:
        """The next queued notice, now in flight (taken and registered under one lock, so a
        drain never misses it); None after a second without one, when this thread ends."""
        with self.lock:
            if not self.pending:
                self.lock.wait(1.0)
            if not self.pending:
                if self.thread is threading.current_thread():
                    self.thread = None  # (under the lock: the next notice starts a new one)
                return None
            flight = Flight(self.pending.popleft())
            self.flights.append(flight)
            return flight

    def deliver(self, notice: Notice) -> bool:
        """Make one delivery with its retries; True when every target of the rule took it."""
        return self._fly(Flight(notice))

    def _fly(self, flight: Flight) -> bool:
        body = self._document(flight.notice)
        if isinstance(body, str):
            self._dead_letter_rest(flight, f"not delivered: {body}")
            return False
        flight.body = body
        sends: dict[str, Send] = {"command": self._run_command, "webhook": self._post}
        ok = True
        for kind in list(flight.kinds):
            ok = self._try_target(flight, kind, sends[kind]) and ok
        return ok

    def _document(self, notice: Notice) -> bytes | str:
        """The filed document to deliver, read now (never held in the queue), or why there
        is none: a handoff retried or purged since is delivered from its archived copy, when
        there is one in the state it was filed in."""
        try:
            state: State | None
            state, doc = self.engine.get(notice.handoff_id)
        except NotFound:
            state, doc = None, {}
        except (HandoffdError, OSError) as exc:
            return f"its filed document cannot be read: {exc}"
        if state is not notice.state:
            archived = self._archived(notice)
            if archived is None:
                now = f"it is {state.value} now" if state else "it is no longer in the store"
                return f"its filed document is gone ({now}) and has no archived copy"
            doc = archived
        try:
            return json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except (ValueError, TypeError, RecursionError) as exc:
            return f"its filed document cannot be sent: {exc}"

    def _archived(self, notice: Notice) -> dict[str, Any] | None:
        from ..retention import find_archived
        try:
            entry = find_archived(self.engine.ws, notice.handoff_id)
        except Exception:  # an archive that cannot be read: as if there were none
            log.debug("archive of %s unreadable", notice.handoff_id, exc_info=True)
            return None
        if entry is None or entry.get("state") != notice.state.value:
            return None
        doc = entry.get("document")
        return doc if isinstance(doc, dict) else None

    def _try_target(self, flight: Flight, kind: str, send: Send) -> bool:
        """Deliver to one target with the rule's retries; False when it was dead-lettered."""
        with self.lock:
            if flight.settled:
                return False  # a drain recorded it already
            flight.trying, flight.maybe_delivered, flight.cutoff = True, False, None
        rule = flight.notice.rule
        delay = rule.retry_delay_seconds
        problem: str | None = None
        for attempt in range(rule.retries + 1):
            if attempt:  # back off first; a drain cuts the wait short
                self.sleep(delay)
                delay *= 2
                if self._halted(flight):
                    return self._give_up(flight, f"{kind}: {problem}; not tried again: {STOPPED}")
            problem = send(flight.notice, flight)
            if problem is None:
                return self._finish_target(flight)
            if self._halted(flight):
                return self._give_up(flight, f"{kind}: {problem}; not tried again: {STOPPED}")
        return self._give_up(flight, f"{kind}: {problem}")

    def _halted(self, flight: Flight) -> bool:
        """No more tries: a drain is stopping deliveries, or one already dead-lettered this
        notice (a later notice may have re-armed the notifier meanwhile: still no retry)."""
        return self.stopping.is_set() or flight.settled

    def _finish_target(self, flight: Flight) -> bool:
        """The target being tried took the notice (True), unless a drain recorded it first."""
        with self.lock:
            if flight.settled:
                return False
            kind = flight.kinds.pop(0)
            flight.trying = False
            self.outbox.done(flight.notice.seq, [kind])
            return True

    def _give_up(self, flight: Flight, why: str) -> bool:
        """Dead-letter the target being tried, unless a drain did it first; always False."""
        with self.lock:
            if flight.settled:
                return False
            kind = flight.kinds.pop(0)
            flight.trying = False
            if flight.may_have_delivered():
                why += MAYBE_DELIVERED[kind]
            self._dead_letter(flight.notice, why, [kind])
            return False

    def _dead_letter_rest(self, flight: Flight, why: str) -> None:
        """Dead-letter what is left of a flight that cannot go on (its document is gone, an
        unforeseen error: a secret that is no text, no thread to be had, once dropped the
        notice, neither sent nor recorded)."""
        with self.lock:
            if flight.settled:
                return
            flight.settled = True
            for index, kind in enumerate(flight.kinds):
                text = f"{kind}: {why}"
                if index == 0 and flight.may_have_delivered():
                    text += MAYBE_DELIVERED[kind]
                self._dead_letter(flight.notice, text, [kind])

    def _dead_letter(self, notice: Notice, why: str, kinds: list[str] | None = None) -> None:
        """Record the dead letter of ``kinds`` of ``notice`` (default: all its targets), and
        that they are settled in the outbox."""
        write_dead_letter(self.engine.ws.meta, notice, why, shown_url(notice.rule.url))
        self.outbox.done(notice.seq, notice.kinds if kinds is None else kinds)

    # ------------------------------------------------------------ the targets
    def _run_command(self, notice: Notice, flight: Flight) -> str | None:
        """Run the rule's command with the document on stdin (:mod:`.command`)."""
        assert notice.rule.command is not None
        if self.stopping.is_set():
            return "not started: the process that filed it is stopping"
        proc = command.spawn(notice, self.engine.ws.root)
        if isinstance(proc, str):
            return proc
        with self.lock:
            self.running.add(proc)
            flight.exposed = True
        try:
            tail = command.supervise(proc, flight.body, notice.rule.timeout_seconds)
        finally:
            with self.lock:
                self.running.discard(proc)
                flight.exposed = False
        problem, killed = command.judge(notice.rule.command[0], proc, tail,
                                        notice.rule.timeout_seconds)
        if killed:  # one that was killed (its timeout, a drain) may have acted on it before
            with self.lock:
                flight.maybe_delivered = True
        return problem

    def _post(self, notice: Notice, flight: Flight) -> str | None:
        """POST the document, the whole attempt bounded by the rule's ``timeout_seconds``."""
        shown = shown_url(notice.rule.url)
        request = webhook_request(notice.rule, notice.handoff_id, notice.state, flight.body)
        if isinstance(request, str):
            return request
        if self.stopping.is_set():
            return "not sent: the process that filed it is stopping"
        cutoff = Cutoff()
        with self.lock:
            self.cutoffs.add(cutoff)
            flight.cutoff = cutoff
        try:
            problem = cutoff.run(request, notice.rule.timeout_seconds, str(shown))
        finally:
            cutoff.close()
            with self.lock:
                self.cutoffs.discard(cutoff)
        if problem is not None and cutoff.sent and not cutoff.answered:
            with self.lock:
                flight.maybe_delivered = True
        return problem

    def kill_running(self) -> None:
        """Kill the process groups of the commands still running and cut off the webhook
        attempts under way (the process is stopping)."""
        with self.lock:
            running = list(self.running)
            cutoffs = list(self.cutoffs)
        for cutoff in cutoffs:
            cutoff.cut_off()
        for proc in running:
            command.kill_group(proc)
