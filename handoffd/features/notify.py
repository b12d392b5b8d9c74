"""Notifications when work is filed (``[[on_filed]]`` in handoffd.toml).

Each rule names a command (an argument list, never a shell; the filed document on its stdin)
and/or a webhook (an HTTP POST of the filed document). A webhook is signed when the rule has a
secret: ``X-Handoffd-Signature: sha256=<hex HMAC-SHA256 of the body>``, beside
``X-Handoffd-Id`` and ``X-Handoffd-State``. A delivery that fails (a non-2xx answer, a command
that exits non-zero, a timeout) is tried again ``retries`` times with exponential backoff from
``retry_delay_seconds``; after the last try one line is appended to the dead-letter record
``handoffs/.meta/notify-dead-letters.jsonl`` and a warning is logged.

``timeout_seconds`` bounds a whole attempt: a command is killed with its process group, and a
webhook (connect, send, and the answer's status line and headers) is cut off by shutting its
socket, even when the server trickles its answer a byte at a time (urllib's own timeout bounds
each socket read, so such a server once held the one delivery thread for as long as it liked).

Nothing here blocks the daemon's workers: filing only queues the notice, one background thread
delivers, and a stopping daemon gives it a bounded time to finish (:data:`DRAIN_SECONDS`). Any
other process that files work (`handoff cancel`, an MCP server, a program using the client)
drains the same way when it exits, so its notices are delivered, retried or dead-lettered too,
and no command it started outlives it. When the drain's time is up, the notice being delivered
is dead-lettered as well as those never tried (its dead letter says when it may have been
delivered all the same), and a second drain (a stop hook, then ``atexit``) finds nothing left.
"""
from __future__ import annotations

import atexit
import functools
import hmac
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..core.config import NotifyRule
from ..core.errors import HandoffdError
from ..core.states import State
from ..core.timeutil import iso, utc_now

if TYPE_CHECKING:
    from ..core.engine import Engine

log = logging.getLogger("handoffd")
DRAIN_SECONDS = 10.0  # a stopping daemon waits at most this long for queued deliveries
SETTLE_SECONDS = 2.0  # then this long for the delivery it cut off to record itself
QUEUE_LIMIT = 10_000  # notices beyond this are dead-lettered at once (a webhook that is down)
DEAD_LETTERS = "notify-dead-letters.jsonl"
STOPPED = "the process that filed it stopped"
NEVER_TRIED = f"{STOPPED} before it was delivered"
MAYBE_DELIVERED = {  # said in a dead letter when the target may have had the document all the same
    "webhook": "; it may have been delivered all the same: its request was sent and no answer "
               "came",
    "command": "; it may have been delivered all the same: the command was started and did not "
               "finish",
}


def shown_url(url: str | None) -> str | None:
    """``url`` as logs and dead letters show it: a password in it is replaced by ``***``."""
    if not url or "@" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unparsable url)"
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass
class Notice:
    """One delivery to make: a rule, and the filed handoff it is about."""

    rule: NotifyRule
    handoff_id: str
    state: State
    body: bytes


@dataclass(eq=False)
class _Flight:
    """A notice the delivery thread has taken. Whoever settles it first records it: the thread
    (delivered, or dead-lettered after its retries), or a drain whose time is up (dead-lettered
    while in flight); the other then records nothing, so a notice is never lost nor recorded
    twice. Fields other than ``notice`` change under :attr:`Notifier.lock`."""

    notice: Notice
    kinds: list[str] = field(default_factory=list)  # the targets not yet finished, in order
    trying: bool = False  # kinds[0] is being tried (or waits for its next try)
    exposed: bool = False  # the attempt under way has handed the document over (a command ran)
    maybe_delivered: bool = False  # an ended attempt of kinds[0] may have delivered it
    cutoff: _Cutoff | None = None  # the webhook attempt under way (or the last one)
    settled: bool = False  # a drain dead-lettered what was left of it

    def __post_init__(self) -> None:
        self.kinds = (["command"] if self.notice.rule.command else []) \
            + (["webhook"] if self.notice.rule.url else [])

    def may_have_delivered(self) -> bool:
        """True when the target being tried may have the document although no try succeeded."""
        answerless = self.cutoff is not None and self.cutoff.sent and not self.cutoff.answered
        return self.maybe_delivered or self.exposed or answerless


def install(engine: Engine) -> None:
    """The notify feature: only when handoffd.toml has ``[[on_filed]]`` rules."""
    if not engine.config.on_filed:
        return
    notifier = Notifier(engine)
    engine.on_filed.append(notifier.filed)
    engine.daemon_plugins.append(lambda daemon: daemon.add_stop_hook(notifier.drain))


class Notifier:
    """Queues a notice per matching rule when a handoff is filed; a thread delivers them."""

    def __init__(self, engine: Engine, *, sleep: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.stopping = threading.Event()  # set by drain(): no more retries, no new attempt
        self.sleep = sleep or self.stopping.wait  # (a backoff that a drain cuts short)
        self.at_exit = False
        # one re-entrant lock guards the queue, the flights and what is running, so that a
        # drain sees every notice in exactly one place: queued, in flight, or settled
        self.lock = threading.Condition()
        self.pending: deque[Notice] = deque()
        self.flights: list[_Flight] = []
        self.thread: threading.Thread | None = None
        self.draining = False
        self.drain_lock = threading.Lock()  # one drain at a time; the next finds nothing left
        self.running: set[subprocess.Popen[bytes]] = set()  # commands being delivered to
        self.cutoffs: set[_Cutoff] = set()  # webhook attempts under way

    def filed(self, handoff_id: str, where: State) -> None:
        """``on_filed`` listener: queue the notices (never raises, never waits)."""
        if not where.terminal:
            return
        try:
            rules = self._matching(handoff_id, where)
            if not rules:
                return
            _, doc = self.engine.get(handoff_id)
            body = json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except (HandoffdError, OSError) as exc:
            log.warning("handoff %s: cannot prepare its notification: %s", handoff_id, exc)
            return
        with self.lock:
            if self.stopping.is_set() and not self.draining and not self._outstanding():
                self.stopping.clear()  # an earlier drain is over: this engine files again
            for rule in rules:
                notice = Notice(rule, handoff_id, where, body)
                if len(self.pending) >= QUEUE_LIMIT:
                    self._dead_letter(notice, "the notification queue is full")
                    continue
                self.pending.append(notice)
            self.lock.notify_all()
            self._ensure_thread()

    def _matching(self, handoff_id: str, where: State) -> list[NotifyRule]:
        rules = [r for r in self.engine.config.on_filed if where.value in r.states]
        if any(r.agents for r in rules):
            agent = self._agent_of(handoff_id)
            rules = [r for r in rules if not r.agents or agent in r.agents]
        return rules

    def _agent_of(self, handoff_id: str) -> str | None:
        """The specialist the handoff was for (whatever its format)."""
        try:
            _, doc = self.engine.get(handoff_id)
            block = doc.get("handoffd")
            request = block.get("request_snapshot") if isinstance(block, dict) else None
            source = request if isinstance(request, dict) else doc
            env = self.engine.formats.detect(source).envelope(source)
        except Exception:  # an unreadable answer: it matches no agent filter
            return None
        spec = self.engine.specialist_for(env)
        return spec.agent if spec else env.target

    def _ensure_thread(self) -> None:
        with self.lock:
            if not self.at_exit:  # whatever process this is, it delivers before it exits
                atexit.register(self.drain)
                self.at_exit = True
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._deliver_all, daemon=True,
                                               name="handoffd-notify")
                self.thread.start()

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
                self._dead_letter_rest(flight, exc)
            finally:
                with self.lock:
                    self.flights.remove(flight)
                    self.lock.notify_all()  # a drain waits for this

    def _dead_letter_rest(self, flight: _Flight, exc: Exception) -> None:
        """Dead-letter what is left of a flight an unforeseen error ended (a secret that is no
        text, no thread to be had): such a notice was once dropped, neither sent nor recorded."""
        with self.lock:
            if flight.settled:
                return
            flight.settled = True
            for index, kind in enumerate(flight.kinds):
                why = f"{kind}: delivery failed ({type(exc).__name__}: {str(exc)[:160]})"
                if index == 0 and flight.may_have_delivered():
                    why += MAYBE_DELIVERED[kind]
                self._dead_letter(flight.notice, why)

    def _next_flight(self) -> _Flight | None:
        """The next queued notice, now in flight (taken and registered under one lock, so a
        drain never misses it); None after a second without one, when this thread ends."""
        with self.lock:
            if not self.pending:
                self.lock.wait(1.0)
            if not self.pending:
                if self.thread is threading.current_thread():
                    self.thread = None  # (under the lock: the next notice starts a new one)
                return None
            flight = _Flight(self.pending.popleft())
            self.flights.append(flight)
            return flight

    def deliver(self, notice: Notice) -> bool:
        """Make one delivery with its retries; True when every target of the rule took it."""
        return self._fly(_Flight(notice))

    def _fly(self, flight: _Flight) -> bool:
        sends: dict[str, Callable[[Notice, _Flight], str | None]] = {
            "command": self._run_command, "webhook": self._post}
        ok = True
        for kind in list(flight.kinds):
            ok = self._try_target(flight, kind, sends[kind]) and ok
        return ok

    def _try_target(self, flight: _Flight, kind: str,
                    send: Callable[[Notice, _Flight], str | None]) -> bool:
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

    def _halted(self, flight: _Flight) -> bool:
        """No more tries: a drain is stopping deliveries, or one already dead-lettered this
        notice (a later notice may have re-armed the notifier meanwhile: still no retry)."""
        return self.stopping.is_set() or flight.settled

    def _finish_target(self, flight: _Flight) -> bool:
        """The target being tried took the notice (True), unless a drain recorded it first."""
        with self.lock:
            if flight.settled:
                return False
            flight.kinds.pop(0)
            flight.trying = False
            return True

    def _give_up(self, flight: _Flight, why: str) -> bool:
        """Dead-letter the target being tried, unless a drain did it first; always False."""
        with self.lock:
            if flight.settled:
                return False
            kind = flight.kinds.pop(0)
            flight.trying = False
            if flight.may_have_delivered():
                why += MAYBE_DELIVERED[kind]
            self._dead_letter(flight.notice, why)
            return False

    def _run_command(self, notice: Notice, flight: _Flight) -> str | None:
        """Run the rule's command with the document on stdin, in a process group of its own:
        its stdout is discarded and only the tail of its stderr kept (a command writing without
        end once grew the daemon by hundreds of MB a second), and at its timeout, or when the
        daemon stops, the whole group is killed (a hanging one outlived the daemon)."""
        assert notice.rule.command is not None
        if self.stopping.is_set():
            return "not started: the process that filed it is stopping"
        env = {**os.environ, "HANDOFF_ID": notice.handoff_id, "HANDOFF_STATE": notice.state.value,
               "HANDOFFD_ROOT": str(self.engine.ws.root)}
        try:
            proc = subprocess.Popen(notice.rule.command, stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                    cwd=self.engine.ws.root, start_new_session=True)
        except OSError as exc:
            return f"{notice.rule.command[0]}: {exc}"
        with self.lock:
            self.running.add(proc)
            flight.exposed = True
        try:
            tail = _supervise(proc, notice.body, notice.rule.timeout_seconds)
        finally:
            with self.lock:
                self.running.discard(proc)
                flight.exposed = False
        return self._command_outcome(notice, flight, proc, tail)

    def _command_outcome(self, notice: Notice, flight: _Flight, proc: subprocess.Popen[bytes],
                         tail: str | None) -> str | None:
        """What a finished command says: None when it took the notice, else the problem. One
        that was killed (its timeout, a drain) may have acted on it before."""
        assert notice.rule.command is not None
        name = notice.rule.command[0]
        if tail is None or (proc.returncode or 0) < 0:
            with self.lock:
                flight.maybe_delivered = True
        if tail is None:
            return f"{name}: timed out after {notice.rule.timeout_seconds:g}s"
        if proc.returncode is not None and proc.returncode < 0:
            return f"{name} was killed by signal {-proc.returncode}: {tail}"
        if proc.returncode != 0:
            return f"{name} exited {proc.returncode}: {tail}"
        return None

    def kill_running(self) -> None:
        """Kill the process groups of the commands still running and cut off the webhook
        attempts under way (the process is stopping)."""
        with self.lock:
            running = list(self.running)
            cutoffs = list(self.cutoffs)
        for cutoff in cutoffs:
            cutoff.cut_off()
        for proc in running:
            _kill_group(proc)

    def _post(self, notice: Notice, flight: _Flight) -> str | None:
        """POST the document, the whole attempt bounded by the rule's ``timeout_seconds``."""
        shown = shown_url(notice.rule.url)
        request = _webhook_request(notice)
        if isinstance(request, str):
            return request
        if self.stopping.is_set():
            return "not sent: the process that filed it is stopping"
        cutoff = _Cutoff()
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

    def _dead_letter(self, notice: Notice, why: str) -> None:
        log.warning("handoff %s: notification given up: %s", notice.handoff_id, why)
        line = json.dumps({"at": iso(utc_now()), "id": notice.handoff_id,
                           "state": notice.state.value, "command": notice.rule.command,
                           "url": shown_url(notice.rule.url), "error": why}) + "\n"
        try:
            self.engine.ws.meta.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.engine.ws.meta / DEAD_LETTERS, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                         | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # a FIFO there: ENXIO, no wait
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot record the dead letter of %s: %s", notice.handoff_id, exc)

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Deliver what is queued, for at most ``timeout`` seconds (a stopping daemon, or any
        process that filed work, at its exit); True when nothing was left. Then a command still
        running is killed, a webhook attempt under way cut off, and every notice not delivered
        is dead-lettered: those never tried, and the one in flight. So a second drain (the stop
        hook, then ``atexit``) finds nothing left and returns at once."""
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

    def _wait_for_deliveries(self, deadline: float) -> bool:
        """Wait until every notice is delivered or dead-lettered (True), or ``deadline``."""
        with self.lock:
            while self._outstanding():
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
            for notice in never_tried:
                self._dead_letter(notice, NEVER_TRIED)
        self.kill_running()  # a command still running must not outlive the process
        deadline = time.monotonic() + SETTLE_SECONDS
        with self.lock:  # the thread records the delivery it was making, with its own reason
            while any(not flight.settled for flight in self.flights) \
                    and time.monotonic() < deadline:
                self.lock.wait(max(min(deadline - time.monotonic(), 0.1), 0.0))
            self._claim_flights()

    def _claim_flights(self) -> None:
        """Dead-letter what the thread has not recorded in time (call with the lock held): a
        delivery it still makes is never recorded twice, nor lost when the process exits."""
        for flight in self.flights:
            if flight.settled:
                continue
            flight.settled = True
            for index, kind in enumerate(flight.kinds):
                if index == 0 and flight.trying:
                    why = f"{kind}: {STOPPED} while it was being delivered"
                    if flight.may_have_delivered():
                        why += MAYBE_DELIVERED[kind]
                else:
                    why = f"{kind}: {NEVER_TRIED}"
                self._dead_letter(flight.notice, why)
        if any(flight.settled for flight in self.flights):
            self.thread = None  # that thread is held: a notice filed later gets a new one


def _webhook_request(notice: Notice) -> urllib.request.Request | str:
    """The signed POST of the notice's document, or why it cannot be sent."""
    import hashlib
    assert notice.rule.url is not None
    headers = {"Content-Type": "application/json", "User-Agent": "handoffd",
               "X-Handoffd-Id": notice.handoff_id, "X-Handoffd-State": notice.state.value}
    secret = notice.rule.secret or (os.environ.get(notice.rule.secret_env)
                                    if notice.rule.secret_env else None)
    if notice.rule.secret_env and not secret:  # never sent unsigned when a signature is asked
        return f"secret_env {notice.rule.secret_env} is not set: not sent unsigned"
    if secret:
        digest = hmac.new(secret.encode("utf-8"), notice.body, hashlib.sha256).hexdigest()
        headers["X-Handoffd-Signature"] = f"sha256={digest}"
    return urllib.request.Request(notice.rule.url, data=notice.body, headers=headers,
                                  method="POST")


class _Cutoff:
    """One webhook attempt, made on a thread of its own so that it can be ended at its
    deadline or at a stop: urllib's timeout bounds each socket operation, not the attempt, and
    a server answering a byte a second held the delivery thread for as long as it liked. The
    attempt's sockets are shut down then (a duplicate of each is kept for that: shutting one
    down ends a read blocked on the other), which ends the attempt's thread too, and no socket
    is opened after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.cut: str | None = None  # why the attempt was ended, once it is
        self.outcome: list[str | None] = []  # what its thread found, if it ended before
        self.sent = False  # the whole request went out: it may have been delivered
        self.answered = False  # a status line came back (in the outcome kept)
        self.ended = threading.Event()  # the attempt finished, or was cut off

    def run(self, request: urllib.request.Request, timeout: float, shown: str) -> str | None:
        """Make the attempt, waiting at most ``timeout`` seconds: None when the webhook took
        it, else the problem."""
        threading.Thread(target=self._work, args=(request, timeout, shown),
                         name="handoffd-webhook", daemon=True).start()
        self.ended.wait(timeout)
        # from here its thread keeps nothing: an answer it still reads (headers cut short
        # read as complete to http.client) is no delivery
        self.cut_off(f"no answer within {timeout:g}s (timeout_seconds bounds the whole delivery)")
        with self.lock:
            if self.outcome:
                return self.outcome[0]
            return f"{shown}: {self.cut}"

    def _work(self, request: urllib.request.Request, timeout: float, shown: str) -> None:
        try:
            problem, answered = self._attempt(request, timeout, shown)
            with self.lock:
                if self.cut is None:  # (in time: the outcome counts)
                    self.outcome.append(problem)
                    self.answered = answered
        finally:
            self.ended.set()

    def _attempt(self, request: urllib.request.Request, timeout: float,
                 shown: str) -> tuple[str | None, bool]:
        """The problem (None: delivered), and whether the server answered at all."""
        opener = urllib.request.build_opener(_CutoffHTTPHandler(self), _CutoffHTTPSHandler(self))
        try:
            with opener.open(request, timeout=timeout) as answer:
                status = answer.status
        except urllib.error.HTTPError as exc:  # (before OSError: it is one)
            return f"{shown} answered {exc.code}", True
        except (OSError, ValueError, http.client.HTTPException) as exc:  # a bad status line too
            return f"{shown}: {exc or type(exc).__name__}", False
        except Exception as exc:  # on this thread a traceback would reach the user's terminal
            return f"{shown}: {type(exc).__name__}: {exc}", False
        return (None if 200 <= status < 300 else f"{shown} answered {status}"), True

    def opened(self, sock: socket.socket) -> socket.socket:
        """Keep a way to shut ``sock`` down; refuse it when the attempt is already over."""
        with self.lock:
            if self.cut is None:
                try:
                    self.socks.append(sock.dup())
                    return sock
                except OSError:
                    pass
        sock.close()
        raise ConnectionAbortedError("the delivery was cut off")

    def cut_off(self, why: str = "cut off before its answer came") -> None:
        """End the attempt (the first ``why`` is kept): its sockets are shut down, none is
        opened after, and what its thread finds later is not kept."""
        with self.lock:  # (shut under the lock: close() must not close one meanwhile)
            self.cut = self.cut or why
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.ended.set()

    def close(self) -> None:
        """The attempt is over, whatever its thread still does: cut it off, free the copies."""
        self.cut_off()
        with self.lock:
            socks, self.socks = self.socks, []
        for sock in socks:
            sock.close()


class _CutoffConnection(http.client.HTTPConnection):
    """An HTTP connection whose sockets its :class:`_Cutoff` can shut down, and which tells it
    when the whole request is out."""

    _create_connection: Callable[..., socket.socket]  # (http.client's own hook to open sockets)

    def __init__(self, *args: Any, cutoff: _Cutoff, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cutoff = cutoff
        opener = self._create_connection
        self._create_connection = lambda *a, **kw: cutoff.opened(opener(*a, **kw))

    def getresponse(self) -> http.client.HTTPResponse:
        self.cutoff.sent = True  # urllib asks for the answer once the request is sent
        return super().getresponse()


class _CutoffHTTPSConnection(_CutoffConnection, http.client.HTTPSConnection):
    """The same over TLS (a handshake blocked on a trickling server is cut off too)."""


class _CutoffHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, cutoff: _Cutoff) -> None:
        super().__init__()
        self.cutoff = cutoff

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_CutoffConnection, cutoff=self.cutoff), req)


class _CutoffHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, cutoff: _Cutoff) -> None:
        super().__init__()
        self.cutoff = cutoff

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_CutoffHTTPSConnection, cutoff=self.cutoff), req)


STDERR_TAIL = 200  # characters of a failing command's stderr kept in its dead letter


def _supervise(proc: "subprocess.Popen[bytes]", body: bytes, timeout: float) -> str | None:
    """Feed ``body`` to ``proc`` and wait at most ``timeout`` seconds, keeping only the tail of
    its stderr; the tail, or None (after killing its group) when time ran out."""
    import select

    def feed() -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(body)
            proc.stdin.close()
        except OSError:  # it exited without reading, or was killed
            pass

    threading.Thread(target=feed, name="notify-stdin", daemon=True).start()
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    tail = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # stderr closed: the command is ending
                tail = (tail + chunk)[-4 * STDERR_TAIL:]
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
    finally:
        proc.stderr.close()
    return tail.decode("utf-8", "replace").strip()[-STDERR_TAIL:]


def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
