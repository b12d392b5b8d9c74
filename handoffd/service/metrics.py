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
import stat
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator

from ..core.events import START
from ..core.states import State
from .stats import UNKNOWN, current_depth, number

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from ..core.engine import Engine
    from ..core.events import Event

log = logging.getLogger("handoffd")
BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
MAX_SERIES = 1000  # label values (agents, codes) beyond this are folded into "other"


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
        self.transitions: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.runs = _Histogram()
        self.waits = _Histogram()
        self.labels: set[str] = set()

    def _label(self, value: Any) -> str:
        text = str(value)[:64] if isinstance(value, str) and value else UNKNOWN
        if text not in self.labels and len(self.labels) >= MAX_SERIES:
            return "other"  # a flood of distinct agent ids must not blow up the scrape
        self.labels.add(text)
        return text

    def _add(self, event: Event) -> None:
        agent, name = self._label(event.get("agent")), self._label(event.get("event"))
        self.transitions[(name, agent)] += 1
        if name == "claimed" and (wait := number(event.get("wait"))) is not None:
            self.waits.observe(agent, wait)
        if event.get("state") in (State.COMPLETED.value, State.FAILED.value) \
                and name not in ("purged", "archived"):
            if (seconds := number(event.get("seconds"))) is not None:
                self.runs.observe(agent, seconds)
            if event.get("state") == State.FAILED.value and event.get("code"):
                self.errors[(agent, self._label(event.get("code")))] += 1

    def update(self) -> None:
        """Take in the events appended since the last scrape."""
        with self.lock:
            # the first scrape counts everything the log keeps, later ones what came since
            fresh, self.cursor = self.events.tail(self.cursor if self.started else START)
            self.started = True
            for event in fresh:
                self._add(event)

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
        with self.lock:
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
            for (state_name, agent), count in sorted(current_depth(self.engine.backend).items()):
                depth.add_metric([state_name, self._label(agent)], count)
        except OSError as exc:  # a scrape must answer even when the store is in trouble
            log.warning("metrics: cannot read the queue: %s", exc)
        yield states
        yield depth


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


HTTP_IDLE_SECONDS = 10.0  # a metrics connection that sends nothing for this long is closed
MAX_HTTP_CONNECTIONS = 32  # metrics connections served at once; more are closed at once


def serve_http(engine: Engine, address: str) -> tuple[Any, int]:
    """Serve the metrics over HTTP at ``address`` in a background thread; (server, port).

    prometheus-client's own server (a thread per connection, no timeout) let clients that
    connect and send nothing hold a thread and a descriptor each, for ever (3,000 slowloris
    connections: 452 threads). This one serves the same WSGI app with an idle timeout and at
    most :data:`MAX_HTTP_CONNECTIONS` connections at once."""
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    host, port = parse_address(address)
    slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)

    class Handler(WSGIRequestHandler):
        timeout = HTTP_IDLE_SECONDS  # (applied to the connection's socket)

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

    server = make_server(host, port, make_wsgi_app(registry_for(engine)), Server,
                         handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="handoffd-metrics", daemon=True).start()
    return server, server.server_address[1]


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
        while True:
            try:
                write_textfile(self.engine, self.path, self.registry)
            except OSError as exc:
                log.warning("metrics: cannot write %s: %s", self.path, exc)
            if self.stopped.wait(self.seconds):
                return

    def stop(self) -> None:
        """Write once more and stop."""
        self.stopped.set()
        self.thread.join(timeout=5)
