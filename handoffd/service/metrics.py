"""Prometheus metrics from the event log, in the official ``prometheus-client``'s exposition.

:class:`EventCollector` reads the workspace's event log (all of it on the first scrape, then what
was appended since) and the store's current queue, so every daemon, CLI and batch run of the
workspace counts, whichever process is scraped. ``handoffd serve --metrics [HOST:]PORT`` serves
it over HTTP; ``handoffd metrics --textfile PATH`` (and ``serve --metrics-textfile``) writes the
same text for node_exporter's textfile collector.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator

from ..core.errors import ErrorCode
from ..core.events import START, tail_into
from ..core.states import State
from ..core.shown import clean
from .stats import UNKNOWN, current_depth, number

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from ..core.engine import Engine
    from ..core.events import Event

log = logging.getLogger("handoffd")
BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
# label combinations each metric keeps (plus the configured specialists' own); a new one past
# this is counted under agent="other" (and code="other"): a flood of distinct agent ids or codes
# from outside bounds the scrape, and never takes the configured specialists' labels
MAX_SERIES = 1000
OTHER = "other"
MAX_LABEL = 64  # characters of a label value kept
# the events handoffd writes (docs/operations.md, "The event log"), and the state names an event
# falls back to: any other name is counted as event="other"
EVENT_NAMES = frozenset({
    "created", "claimed", "completed", "failed", "cancelled", "retry_scheduled", "handed_back",
    "throttled", "taken_over", "recovered", "needs_clarification", "blocked", "answered",
    "delegated", "still_waiting", "aggregated", "set_aside", "rejected", "retried", "purged",
    "archived", *(state.value for state in State)})
CODES = frozenset(code.value for code in ErrorCode)  # a configured specialist's own codes kept


class _Histogram:
    """Cumulative bucket counts and a sum, per label value."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, value: float) -> None:
        counts = self.counts.setdefault(label, [0] * (len(BUCKETS) + 1))
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self.sums[label] = self.sums.get(label, 0.0) + value


class EventCollector:
    """A prometheus-client collector over the event log and the store (see module docstring)."""

    def __init__(self, engine: Engine, events: Any) -> None:
        self.engine = engine
        self.events = events
        self.cursor: Any = None
        self.started = False
        self.lock = threading.Lock()
        self.transitions: Counter[tuple[str, ...]] = Counter()
        self.errors: Counter[tuple[str, ...]] = Counter()
        self.runs = _Histogram()
        self.waits = _Histogram()
        self.skipped = 0  # events that could not be counted (a forged line in the log)
        self.gaps = 0  # times the log rotated past the files kept between two scrapes
        self.configured: frozenset[str] = frozenset()  # specialists that keep their own label
        self._tail_failing = False

    def _keep(self, agent: str) -> bool:
        """True for a configured specialist: its series are never folded into "other"."""
        return agent in self.configured

    def _key(self, held: Any, key: tuple[str, ...], kept: tuple[bool, ...]) -> tuple[str, ...]:
        """``key`` as the label values of a metric holding ``held`` series: itself when it
        is there already or there is room (:data:`MAX_SERIES`), else each value that
        ``kept`` does not protect folded into "other"."""
        if key in held or len(held) < MAX_SERIES:
            return key
        return tuple(value if keep else OTHER for value, keep in zip(key, kept))

    def _add(self, event: Event) -> None:
        agent = _label(event.get("agent"))
        given = event.get("event")
        name = given if isinstance(given, str) and given in EVENT_NAMES else OTHER
        keep = self._keep(agent)
        self.transitions[self._key(self.transitions, (name, agent), (True, keep))] += 1
        if name == "claimed" and (wait := _number(event.get("wait"))) is not None:
            self.waits.observe(self._key(self.waits.counts, (agent,), (keep,))[0], wait)
        if event.get("state") in (State.COMPLETED.value, State.FAILED.value) \
                and name not in ("purged", "archived"):
            if (seconds := _number(event.get("seconds"))) is not None:
                self.runs.observe(self._key(self.runs.counts, (agent,), (keep,))[0], seconds)
            if event.get("state") == State.FAILED.value and event.get("code"):
                code = _label(event.get("code"))
                key = self._key(self.errors, (agent, code), (keep, keep and code in CODES))
                self.errors[key] += 1

    def update(self) -> None:
        """Take in the events appended since the last scrape. Never raises: an event that
        cannot be counted is skipped (and counted as skipped), a log that cannot be read now is
        read from the same place at the next scrape."""
        with self.lock:
            self.configured = self._configured()
            # the first scrape counts everything the log keeps, later ones what came since
            # each event counted as it is read: a first scrape of a full log (4 x 16 MiB) held
            # every event in one list, 583 MB
            try:
                cursor = tail_into(self.events, self.cursor if self.started else START,
                                   self._take, self._gap)
            except Exception as exc:  # the scrape answers with what was counted so far
                if not self._tail_failing:
                    self._tail_failing = True
                    log.warning("metrics: cannot read the event log: %s", _said(exc))
                return
            self._tail_failing = False
            self.cursor, self.started = cursor, True

    def _take(self, event: Event) -> None:
        """Count one event; one that cannot be counted is skipped (and counted as skipped)."""
        try:
            self._add(event)
        except Exception as exc:  # a forged line must not fail every scrape after it
            if not self.skipped:
                log.warning("metrics: an event that cannot be counted is skipped (%s); "
                            "handoffd_events_skipped_total counts them", _said(exc))
            self.skipped += 1

    def _gap(self) -> None:
        """The log rotated past the files it keeps since the last scrape: events in between
        were never counted (handoffd_event_log_gaps_total says how often)."""
        self.gaps += 1

    def _configured(self) -> frozenset[str]:
        """The specialists of the configuration (and of the registry, once it is loaded)."""
        agents = set(self.engine.config.specialists)
        registry = getattr(self.engine, "_registry", None)  # (loading it imports handlers)
        if registry is not None:
            agents.update(registry.specialists)
        return frozenset(_label(agent) for agent in agents)

    def collect(self) -> Iterator[Any]:
        """The metric families (called by prometheus-client on every scrape)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        self.update()
        transitions = CounterMetricFamily(
            "handoffd_transitions", "Handoff transitions by event (created, claimed, completed, "
            "failed, retry_scheduled...) and specialist", labels=["event", "agent"])
        errors = CounterMetricFamily("handoffd_failures", "Handoffs filed as failed, by error code",
                                     labels=["agent", "code"])
        skipped = CounterMetricFamily("handoffd_events_skipped", "Event log lines that could not "
                                      "be counted (not as handoffd writes them)")
        gaps = CounterMetricFamily("handoffd_event_log_gaps", "Times the event log rotated past "
                                   "the files it keeps between two reads: events in between "
                                   "were not counted (raise events_max_bytes or events_keep)")
        with self.lock:
            skipped.add_metric([], self.skipped)
            gaps.add_metric([], self.gaps)
            for (name, agent), count in sorted(self.transitions.items()):
                transitions.add_metric([name, agent], count)
            for (agent, code), count in sorted(self.errors.items()):
                errors.add_metric([agent, code], count)
            histograms = [self._histogram(HistogramMetricFamily, "handoffd_run_seconds",
                                          "Run time of finished handoffs", self.runs),
                          self._histogram(HistogramMetricFamily, "handoffd_queue_wait_seconds",
                                          "Time from due to claimed", self.waits)]
        yield transitions
        yield errors
        yield skipped
        yield gaps
        yield from histograms
        yield from self._queue(GaugeMetricFamily)

    @staticmethod
    def _histogram(family: Any, name: str, doc: str, data: _Histogram) -> Any:
        metric = family(name, doc, labels=["agent"])
        for agent, counts in sorted(data.counts.items()):
            buckets = [(str(b), counts[i]) for i, b in enumerate(BUCKETS)] + [("+Inf", counts[-1])]
            metric.add_metric([agent], buckets, data.sums[agent])
        return metric

    def _queue(self, family: Any) -> Iterator[Any]:
        states = family("handoffd_handoffs", "Handoffs in each state now", labels=["state"])
        depth = family("handoffd_queue_depth", "Pending and in-progress handoffs now, by "
                       "specialist", labels=["state", "agent"])
        try:
            for state in State:
                states.add_metric([state.value], len(self.engine.backend.ids(state)))
            shown: Counter[tuple[str, ...]] = Counter()
            for (state_name, agent), count in sorted(current_depth(self.engine.backend).items()):
                agent = _label(agent)
                shown[self._key(shown, (str(state_name), agent), (True, self._keep(agent)))] += count
            for labels, count in sorted(shown.items()):
                depth.add_metric(list(labels), count)
        except Exception as exc:  # a scrape must answer even when the store is in trouble
            log.warning("metrics: cannot read the queue: %s", _said(exc))
        yield states
        yield depth


def _label(value: Any) -> str:
    """A label value from an event field: its first :data:`MAX_LABEL` characters, UNKNOWN for
    a missing or non-text one; control characters escaped as the CLI prints them (an agent
    named with ESC [2J or OSC 52 cleared a terminal reading the scrape, and wrote its
    clipboard), and a character UTF-8 cannot encode (a lone surrogate from a forged line: it
    failed every scrape) becomes U+FFFD."""
    if not isinstance(value, str) or not value:
        return UNKNOWN
    text = clean(value[:MAX_LABEL])[:MAX_LABEL]
    try:
        text.encode()
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


def _number(value: Any) -> float | None:
    """:func:`~handoffd.service.stats.number`, None for a number no float holds."""
    try:
        return number(value)
    except (OverflowError, ValueError, TypeError):  # (a 400-digit integer in a forged line)
        return None


def _said(exc: BaseException) -> str:
    """``exc`` in one line: its type and message."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def registry_for(engine: Engine) -> CollectorRegistry:
    """A registry holding the workspace's collector (and nothing else)."""
    from prometheus_client import CollectorRegistry

    from ..features.build import event_log_of
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EventCollector(engine, event_log_of(engine)))
    return registry


def parse_address(text: str) -> tuple[str, int]:
    """``":9464"``, ``"9464"`` or ``"127.0.0.1:9464"`` as (host, port); ValueError else."""
    host, _, port = text.rpartition(":")
    number_ = int(port)
    if not 0 <= number_ <= 65535:
        raise ValueError(f"port {number_} is out of range")
    return host or "0.0.0.0", number_


# a metrics connection has this long in all to send its request (a byte every few seconds
# does not keep it: a timer shuts it down), and each wait for the socket is bounded by it too
HTTP_IDLE_SECONDS = 10.0
HTTP_ANSWER_SECONDS = 60.0  # ... and this long, once its request is read, to take the answer
MAX_HTTP_CONNECTIONS = 32  # metrics connections served at once; more are closed at once


def serve_http(engine: Engine, address: str) -> tuple[Any, int]:
    """Serve the metrics over HTTP at ``address`` in a background thread; (server, port).

    prometheus-client's own server (a thread per connection, no timeout) let clients that
    connect and send nothing hold a thread and a descriptor each, for ever (3,000 slowloris
    connections: 452 threads). This one serves the same WSGI app with a deadline per connection
    (:class:`_Watchdog`) and at most :data:`MAX_HTTP_CONNECTIONS` connections at once."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    host, port = parse_address(address)
    slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
    watchdog = _Watchdog()

    class Handler(WSGIRequestHandler):
        timeout = HTTP_IDLE_SECONDS  # (applied to the connection's socket: each recv and send)

        def setup(self) -> None:
            # for the whole request, however slowly it trickles in
            watchdog.watch(self.request, HTTP_IDLE_SECONDS)
            super().setup()

        def parse_request(self) -> bool:
            read = super().parse_request()
            watchdog.watch(self.request, HTTP_ANSWER_SECONDS)  # the request is in: the answer
            return read

        def finish(self) -> None:
            watchdog.forget(self.request)
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
            """Log nothing (a scrape every 15 s would fill the log)."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 64  # (the default 5 made a burst of connects wait for SYN retries)
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):  # too many at once: this one is closed
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            """No traceback on stderr (the stdlib printed one for each client gone, cut at its
            deadline or sending junk): one line at -v."""
            log.debug("metrics: a connection ended early: %s", _said(sys.exc_info()[1]
                                                                      or Exception()))

    server = make_server(host, port, make_wsgi_app(registry_for(engine)), Server,
                         handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="handoffd-metrics", daemon=True).start()
    return server, server.server_address[1]


class _Watchdog:
    """Deadlines of the metrics connections: one thread shuts each connection down when its
    deadline passes (its handler's blocked read or write then returns at once). A socket
    timeout alone bounds each wait, not the request: a client sending a byte every 5 s held
    its connection, and all 32 of them held the endpoint, for ever."""

    def __init__(self) -> None:
        self.deadlines: dict[Any, float] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._run, name="handoffd-metrics-deadlines", daemon=True).start()

    def watch(self, sock: Any, seconds: float) -> None:
        """Shut ``sock`` down ``seconds`` from now (replacing its deadline)."""
        with self.changed:
            self.deadlines[sock] = time.monotonic() + seconds
            self.changed.notify()

    def forget(self, sock: Any) -> None:
        """``sock`` is done with: no deadline (before it is closed, so never cut after)."""
        with self.changed:
            self.deadlines.pop(sock, None)

    def _run(self) -> None:
        while True:
            with self.changed:
                now = time.monotonic()
                due = [sock for sock, at in self.deadlines.items() if at <= now]
                for sock in due:
                    del self.deadlines[sock]
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already gone
                        pass
                nearest = min(self.deadlines.values(), default=None)
                self.changed.wait(None if nearest is None else max(nearest - now, 0.0) + 0.01)


def write_textfile(engine: Engine, path: str, registry: CollectorRegistry | None = None) -> None:
    """Write the metrics for node_exporter's textfile collector (atomically: a temp file and a
    rename, as node_exporter asks)."""
    from prometheus_client import write_to_textfile
    try:  # a rename over a FIFO or a device would replace it (as root, even /dev/null)
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file; the metrics textfile replaces only one",
                      path)
    write_to_textfile(path, registry or registry_for(engine))


class TextfileWriter:
    """Rewrite the textfile every ``seconds`` in a background thread until stopped."""

    def __init__(self, engine: Engine, path: str, seconds: float = 15.0) -> None:
        self.engine, self.path, self.seconds = engine, path, seconds
        self.registry = registry_for(engine)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="metrics-textfile", daemon=True)

    def start(self) -> None:
        """Start writing."""
        self.thread.start()

    def _run(self) -> None:
        said = None  # the failure last logged: said once until it changes or a write succeeds
        stopping = False
        while True:
            try:
                write_textfile(self.engine, self.path, self.registry)
                said = None
            except Exception as exc:  # the thread outlives any failure: written again later
                why = str(exc) if isinstance(exc, OSError) else _said(exc)
                if why != said:
                    said = why
                    log.warning("metrics: cannot write %s: %s", self.path, why)
            if stopping:
                return
            stopping = self.stopped.wait(self.seconds)  # stopped: written once more

    def stop(self) -> None:
        """Write once more and stop."""
        self.stopped.set()
        self.thread.join(timeout=5)
