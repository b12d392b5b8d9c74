"""The delivery threads' side of the notifier: each one notice at a time, its document read from
the store when its flight starts (never held in the queue), each target of its rule tried with
the rule's retries and exponential backoff, then delivered or dead-lettered, and marked so in
the outbox. A drain (:class:`.notifier.Notifier`) may settle a flight first: whoever settles
it first records it, the other nothing.

The document delivered is the filing the notice is about: the state and the revision it was
filed in. A handoff filed again since (retried, ``handoff retry --force``, and filed anew) or
purged is delivered from its archived copy of that filing when there is one, else
dead-lettered: a notice never delivers a later filing in place of its own.

Each ``[[on_filed]]`` rule's notices wait in a lane of their own (:mod:`.lanes`), and up to
:data:`WORKERS` threads deliver, each serving one lane at a time: a rule whose target hangs or
fails holds only its own notices (and one thread), never another rule's.

A forked child (a program using the client that forks, ``handoffd run --processes N``) starts
with nothing queued, in flight or running, with locks of its own: the parent's notices are the
parent's to deliver (a child once delivered them again at its exit, and dead-lettered the one
its parent was delivering)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ...core.documents import revision
from ...core.errors import HandoffdError, NotFound
from ...core.states import State
from . import command
from .lanes import Lanes, lane_of
from .notices import MAYBE_DELIVERED, STOPPED, Flight, Notice, write_dead_letters
from .outbox import OUTBOX_DIR, Outbox
from .webhook import Cutoff, shown_url, webhook_request

if TYPE_CHECKING:
    from ...core.engine import Engine

log = logging.getLogger("handoffd")
Send = Callable[[Notice, Flight], "str | None"]
WORKERS = 8  # delivery threads at most: rules beyond that take turns (one notice at a time)
IDLE_SECONDS = 1.0  # a delivery thread with nothing to deliver for this long ends


class Deliveries:
    """The queue, the flights and the delivery threads' work (the notifier adds filing, taking
    over and draining)."""

    def __init__(self, engine: Engine, *, sleep: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.given_sleep = sleep
        self._fresh()
        self.outbox = Outbox(engine.ws.meta / OUTBOX_DIR, durable=engine.settings.durable)
        _ALL.add(self)

    def _fresh(self) -> None:
        """Nothing queued, in flight or running, and new locks: at the start, and in a forked
        child (whose parent's threads may have held the old ones when it forked)."""
        self.stopping = threading.Event()  # set by a drain: no more retries, no new attempt
        self.sleep = self.given_sleep or self.stopping.wait  # (a backoff a drain cuts short)
        # one re-entrant lock guards the queue, the flights and what is running, so that a
        # drain sees every notice in exactly one place: queued, in flight, or settled
        self.lock = threading.Condition()
        self.pending = Lanes()  # a lane per rule: one rule's failures never hold another's
        self.flights: list[Flight] = []
        # the delivery threads counted against WORKERS (one a drain cut off is dropped from it:
        # it ends once its attempt does), and how many of them are not delivering right now
        self.workers: set[threading.Thread] = set()
        self.free = 0
        self.running: set[subprocess.Popen[bytes]] = set()  # commands being delivered to
        self.cutoffs: set[Cutoff] = set()  # webhook attempts under way

    def _outstanding(self) -> int:
        """Notices neither delivered nor dead-lettered yet (call with the lock held)."""
        return len(self.pending) + sum(not flight.settled for flight in self.flights)

    def _deliver_all(self) -> None:
        """A delivery thread: one notice at a time from a lane nobody else serves, until there
        is none for IDLE_SECONDS (or a drain dropped this thread)."""
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
                    self.free += 1
                    self.lock.notify_all()  # a drain waits for this; a lane may be free now

    def _next_flight(self) -> Flight | None:
        """The next queued notice of a lane no other thread is delivering, now in flight (taken
        and registered under one lock, so a drain never misses it); None after IDLE_SECONDS
        without one, or when a drain dropped this thread: then it ends."""
        me = threading.current_thread()
        deadline = time.monotonic() + IDLE_SECONDS
        with self.lock:
            while True:
                notice = self.pending.take(self._busy()) if me in self.workers else None
                left = deadline - time.monotonic()
                if notice is not None or me not in self.workers or left <= 0:
                    break
                self.lock.wait(left)
            self.free -= 1
            if notice is None:
                self.workers.discard(me)  # (under the lock: the next notice starts a new one)
                return None
            flight = Flight(notice, worker=me)
            self.flights.append(flight)
            return flight

    def _busy(self) -> set[int]:
        """The lanes being delivered (call with the lock held): a lane is served by one thread
        at a time, so its notices go out in order and its failures hold it alone."""
        return {lane_of(flight.notice) for flight in self.flights if not flight.settled}

    def _ensure_workers(self) -> None:
        """Start delivery threads for the lanes waiting that no free thread will take (up to
        WORKERS in all; call with the lock held)."""
        wanted = self.pending.ready(self._busy()) - self.free
        while wanted > 0 and len(self.workers) < WORKERS:
            thread = threading.Thread(target=self._deliver_all, daemon=True,
                                      name="handoffd-notify")
            self.workers.add(thread)
            self.free += 1
            try:
                thread.start()
            except BaseException:  # (no thread to be had: the ones running deliver)
                self.workers.discard(thread)
                self.free -= 1
                raise
            wanted -= 1
        self.lock.notify_all()  # the free ones

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
        is none: a handoff retried, filed again or purged since is delivered from its archived
        copy of the filing the notice is about (its state and revision), when there is one."""
        try:
            state: State | None
            state, doc = self.engine.get(notice.handoff_id)
        except NotFound:
            state, doc = None, {}
        except (HandoffdError, OSError) as exc:
            return f"its filed document cannot be read: {exc}"
        if state is not notice.state or not _same_filing(notice, doc):
            archived = self._archived(notice)
            if archived is None:
                return _gone(notice, state, doc)
            doc = archived
        try:
            return json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except (ValueError, TypeError, RecursionError) as exc:
            return f"its filed document cannot be sent: {exc}"

    def _archived(self, notice: Notice) -> dict[str, Any] | None:
        """The archived copy of the filing ``notice`` is about: the newest entry of the
        handoff in that state (and revision, when the notice has one)."""
        from ..archive import archived_with_files
        wanted = b'"id": ' + json.dumps(notice.handoff_id).encode()  # (as archives write it)
        found: dict[str, Any] | None = None
        found_in: str | None = None
        try:
            for path, entry in archived_with_files(self.engine.ws, wanted):
                if found_in is not None and path != found_in:
                    break  # (newest file first; in a file, the last entry is the newest)
                doc = entry.get("document")
                if entry.get("id") == notice.handoff_id and isinstance(doc, dict) \
                        and entry.get("state") == notice.state.value and _same_filing(notice, doc):
                    found, found_in = doc, path
        except Exception:  # an archive that cannot be read: as if there were none
            log.debug("archive of %s unreadable", notice.handoff_id, exc_info=True)
            return None
        return found

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
        self._dead_letter_all([(notice, why)], kinds)

    def _dead_letter_all(self, letters: list[tuple[Notice, str]], kinds: list[str] | None = None,
                         *, summary: str | None = None) -> None:
        """Record the dead letters of ``letters`` ((notice, why) each: ``kinds`` of it, default
        all its targets) in one append, and that they are settled in the outbox. ``summary``:
        one log line says them all (many at once: a full queue, a taken-over journal), else
        one line each."""
        write_dead_letters(self.engine.ws.meta,
                           [(notice, why, shown_url(notice.rule.url)) for notice, why in letters],
                           summary=summary)
        for notice, _ in letters:
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

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's notices, flights, commands and webhook attempts
        are the parent's (and its locks may have been held by its threads)."""
        self._fresh()

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


def _same_filing(notice: Notice, doc: dict[str, Any]) -> bool:
    """``doc`` (in the state ``notice`` was filed in) is the filing the notice is about: its
    revision, when the notice knows it (a journal line from before revisions were recorded
    does not)."""
    return notice.revision is None or revision(doc) == notice.revision


def _gone(notice: Notice, state: State | None, doc: dict[str, Any]) -> str:
    """Why ``notice`` cannot be delivered: its filing is no longer the stored document (which
    is ``doc`` in ``state``) and has no archived copy."""
    if state is notice.state:
        return (f"its filing was superseded: the handoff was filed {state.value} again since "
                f"(revision {revision(doc)}; this notice is about revision {notice.revision}) "
                "and that filing has no archived copy")
    now = f"it is {state.value} now" if state else "it is no longer in the store"
    return f"its filed document is gone ({now}) and has no archived copy"


# a forked child must not deliver its parent's notices again (its atexit drain did), nor kill
# its commands, nor wait on a lock one of its threads held at the fork
_ALL: weakref.WeakSet[Deliveries] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for deliveries in list(_ALL):
        deliveries.forget_after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
