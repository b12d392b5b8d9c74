"""What ``handoffd serve`` and ``handoffd run`` do, without typer: :func:`serve` and
:func:`run_batch` take the commands' options as plain values and return the exit code.

Both command lines call them: the quick path of the console script
(:func:`handoffd.cli.handoffd_cmd.main`, which parses the plain forms itself) and the full one
(:mod:`handoffd.cli.handoffd_app`, typer). A daemon under a supervisor and a batch started by cron
every minute pay their start-up each time; importing typer and click took longer than the
batch's own work on an empty queue. Errors are raised (the caller turns them into one stderr line
and an exit code with :func:`handoffd.cli.basics.failure_code`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from ..core.errors import StartStopped, UsageError
from ..core.logs import unlogged
from ..core.shown import clean  # (at the start: imported at a first log line, EMFILE lost it)
# (held from the console script's first instruction: core.starting, kept light for it)
from ..core.starting import HELD_SIGNALS, hold_stop_signals, starting_within  # noqa: F401
from ..core.workspace import network_filesystem
from .basics import engine

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..service.daemon import Daemon
    from ..service.report import BatchReport

PROG = "handoffd"
MAX_BATCH_SECONDS = 7 * 24 * 3600.0  # `run --max-seconds`: a week, far past any cron period


class JsonLines(logging.Formatter):
    """One JSON object per log record: time, level, event, message, and the handoff's facts a
    record carries (handoff_id, agent, attempt, state, seconds, code), for log shippers."""

    FIELDS = ("event", "handoff_id", "agent", "attempt", "state", "seconds", "duration", "code")

    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime, timezone
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(), "message": record.getMessage()}
        for name in self.FIELDS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        entry.update(getattr(record, "fields", None) or {})  # an announcement's own facts
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        # on a stderr that is not UTF-8 (LC_ALL=C) non-ASCII text is escaped as JSON escapes it:
        # the stream's own escapes (backslashreplace, \xe9) made the line invalid JSON
        return json.dumps(entry, ensure_ascii=not utf8(sys.stderr), default=str)


def utf8(stream: object) -> bool:
    """Whether ``stream`` writes UTF-8 (a text stream whose encoding says so)."""
    encoding = getattr(stream, "encoding", None)
    return isinstance(encoding, str) and encoding.lower().replace("-", "").replace("_", "") \
        in ("utf8", "utf8sig")


class StderrLines(logging.StreamHandler[TextIO]):
    """The daemon's log handler: a record that cannot be formatted or written for want of
    descriptors or memory is one plain line (:func:`handoffd.core.logs.unlogged`), not
    logging's "--- Logging error ---" traceback with the message lost."""

    def handleError(self, record: logging.LogRecord) -> None:
        """A shortage: the record as a plain line; any other error: logging's own report."""
        if not unlogged(record):
            super().handleError(record)


def configure_logging(verbose: bool, *, quiet: bool = False, log_format: str = "text") -> None:
    """Log to stderr: info with -v, errors only with -q, else warnings; ``log_format`` text or
    json (:class:`JsonLines`)."""
    level = logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING
    if log_format not in ("text", "json"):
        from ..core.errors import UsageError
        raise UsageError(f"--log-format {log_format!r}: text or json")
    handler = StderrLines(sys.stderr)
    handler.setFormatter(JsonLines() if log_format == "json"
                         else OneLine("handoffd: %(levelname)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    logging.getLogger("watchdog").setLevel(logging.WARNING)


class OneLine(logging.Formatter):
    """The text log format, each message on one line with its control characters shown (``\\n``,
    ``\\x1b``): a document's agent id (or any text a message quotes from outside) with a
    newline forged log lines, and one with terminal escapes rewrote the operator's screen. A
    traceback still follows on lines of its own (handoffd's own, not a document's)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record, its message made safe for one line of a terminal or a log file."""
        message = record.getMessage()
        shown = clean(message)
        if shown == message:
            return super().format(record)
        saved = record.msg, record.args
        record.msg, record.args = shown, None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = saved


def announce(log_format: str, event: str, message: str,
             fields: dict[str, object] | None = None, *, level: int = logging.INFO) -> None:
    """A line ``serve`` and ``run`` always print on stderr, whatever the log level: ``handoffd:
    message`` (``handoffd: error: message`` at error level) in text format; with json, one
    :class:`JsonLines` record with ``event`` and ``fields``, as docs/operations.md promises of
    every line (a log shipper reading the systemd unit's json must not meet plain text)."""
    if log_format != "json":
        said = f"error: {message}" if level >= logging.ERROR else message
        print(f"{PROG}: {said}", file=sys.stderr, flush=True)
        return
    record = logging.LogRecord(PROG, level, __file__, 0, message, None, None)
    record.event, record.fields = event, fields or {}
    print(JsonLines().format(record), file=sys.stderr, flush=True)


def report_fields(report: BatchReport) -> dict[str, object]:
    """The counts of ``report`` as fields of the "stopped" / "batch_done" JSON record."""
    return {"completed": report.completed, "failed": report.failed,
            "retry_scheduled": report.retrying, "throttled": report.throttled,
            "recovered": report.recovered, "recovered_pending": report.recovered_pending,
            "handed_back": report.handed_back, "unroutable": len(report.unroutable),
            "waiting": len(report.waiting),
            "errors": report.errors, "stalls": report.stalls, "lost": len(report.lost),
            "set_aside": report.set_aside,
            "main_loop_error": report.error}


def warn_if_shared(root: Path, detect: Callable[[Path], str | None] = network_filesystem) -> None:
    """Say so when the workspace is on a network filesystem (``detect`` names it): file locks
    there are local or emulated and inotify misses other hosts' writes, so another host's claim
    is judged by its lease alone (docs/guarantees.md)."""
    fs = detect(root)
    if fs:
        from ..backends.files.backend import CLOCK_TOLERANCE_SECONDS
        logging.getLogger("handoffd").warning(
            "the workspace is on a network filesystem (%s): claims of other hosts are recovered "
            "only after their lease expires (+%gs clock tolerance), new files are found by "
            "rescans; keep host clocks in sync", fs, CLOCK_TOLERANCE_SECONDS)


def serve(root: Path | None = None, workers: int | None = None, verbose: bool = False,
          log_format: str = "text", store: str | None = None, metrics: str | None = None,
          metrics_textfile: Path | None = None, processes: int | None = None) -> int:
    """``handoffd serve``: run in the foreground until SIGTERM/SIGINT/SIGHUP, on ``processes`` (None:
    ``[daemon] processes``, where "auto" serves on one; see :mod:`handoffd.service.spread`);
    the exit code (1 when the main loop of one of its processes died, or a process ended)."""
    configure_logging(verbose, log_format=log_format)
    from ..service import allocator
    allocator.limit_arenas()  # before any thread: a long-lived daemon's memory stays flat
    from ..service.daemon import Daemon
    from ..service.spread import serve_processes_for, spread
    try:
        eng = engine(root, create=True, store=store, bridge=False)  # (its own bridge: counted)
    except StartStopped as exc:  # (a stop while it waited for the store: nothing claimed)
        announce(log_format, "stopped", f"stopped: {exc}")
        return 0
    eng.backend.prepare()  # what every write needs (the seal key): refused once, before forking
    if not getattr(eng.backend, "shared", False):  # a shared store does not rely on the files
        warn_if_shared(eng.ws.root)
    filings_logged = log_filings(eng)
    count = serve_processes_for(eng, processes)

    def make(stripe: tuple[int, int] = (0, 1)) -> Daemon:
        daemon = Daemon(eng, workers=workers, stripe=stripe)
        if not filings_logged:
            daemon.on_filed = (lambda hid, st: logging.getLogger("handoffd").info(
                "%s -> %s", hid, st.value, extra={"event": "filed", "handoff_id": hid,
                                                  "state": st.value}))
        return daemon

    def run(daemon: Daemon) -> BatchReport:  # in a forked process: no metrics, no systemd
        daemon.serve(install_signals=False)
        return daemon.report

    def run_parent(daemon: Daemon) -> BatchReport:
        serve_as_parent(eng, daemon, count, metrics, metrics_textfile, log_format)
        return daemon.report

    if count > 1:
        report = spread(count, eng, make, run_parent, serving=True, child_run=run,
                        early=HELD_SIGNALS)
    else:
        report = run_parent(make())
    for lost in report.lost:
        announce(log_format, "process_lost", f"{lost}; its claims are recovered by the sweep",
                 level=logging.ERROR)
    announce(log_format, "stopped", f"stopped: {report.line()}", report_fields(report))
    if report.error:
        announce(log_format, "main_loop_died",
                 f"the main loop died ({report.error}); restart the daemon", level=logging.ERROR)
    return 1 if report.error or report.lost else 0


def store_named(eng: Engine) -> str:
    """The store ``eng`` works on, for the "serving" line: its URL without the password
    (PostgreSQL), or ``files`` (the workspace's own handoffs/ folders)."""
    url = getattr(eng.backend, "url", None)
    if not isinstance(url, str):
        return "files"
    from ..backends.postgres.connection import redact
    return redact(url)


def serve_as_parent(eng: Engine, daemon: Daemon, count: int, metrics: str | None,
                    metrics_textfile: Path | None, log_format: str = "text") -> None:
    """The serving daemon of this process, with what only one process of a ``serve`` runs:
    the metrics endpoint and textfile, systemd's notifications, the "serving" line."""
    exposed = expose_metrics(eng, daemon, metrics, metrics_textfile)
    systemd = None
    if os.environ.get("NOTIFY_SOCKET"):  # Type=notify: READY, STOPPING, WATCHDOG
        from ..service.systemd import SystemdNotifier  # (and socket) only under systemd
        systemd = SystemdNotifier.from_env()
    if systemd is not None:
        daemon.add_scan_hook(systemd.watchdog)  # pinged from the main loop: a hang stops it
        daemon.add_stop_hook(systemd.stopping)

    def ready() -> None:
        spread_over = f"{count} processes of " if count > 1 else ""
        said = "".join(f"; {name.replace('_', ' ')} {value}" for name, value in exposed.items())
        # the store named: a host whose handoffd.toml lacks [store] serves its own files, quietly
        store = store_named(eng)
        line = (f"serving {eng.ws.root} (store: {store}; {spread_over}{daemon.workers} workers; "
                f"at once per specialist: {daemon.limits() or 'no specialists'}){said}")
        limits = {spec.agent: daemon.limit(spec) for spec in eng.registry.specialists.values()}
        announce(log_format, "serving", line, {"root": str(eng.ws.root), "store": store,
                                               "processes": count,
                                               "workers": daemon.workers, "limits": limits,
                                               **exposed})
        if systemd is not None:
            systemd.ready(line)

    daemon.serve(install_signals=count == 1, ready=ready, early=HELD_SIGNALS)


def run_batch(root: Path | None = None, workers: int | None = None, verbose: bool = False,
              quiet: bool = False, max_seconds: float | None = None, log_format: str = "text",
              store: str | None = None, processes: int | None = None) -> int:
    """``handoffd run``: one batch for cron, over ``processes`` (None: ``[daemon] processes``;
    see :mod:`handoffd.service.spread`); the exit code (1 when a handoff it processed failed or
    the main loop of one of its processes died)."""
    if verbose and quiet:  # the docs show [-v | -q]: which one was meant is not ours to guess
        raise UsageError("-v/--verbose and -q/--quiet contradict each other: give one")
    configure_logging(verbose, quiet=quiet, log_format=log_format)
    if max_seconds is not None and not 0 <= max_seconds <= MAX_BATCH_SECONDS:  # (and not NaN)
        raise UsageError(f"--max-seconds must be 0 to {MAX_BATCH_SECONDS:.0f}, not {max_seconds:g}")
    from ..service.daemon import Daemon
    from ..service.spread import processes_for, spread
    # the batch's bound counts from its start: waiting for a store that is away ends by it too
    # (a cron batch waited reconnect_seconds past it, and the next one overlapped it)
    ends = None if max_seconds is None else time.monotonic() + max_seconds
    try:
        with starting_within(max_seconds):
            eng = engine(root, create=True, store=store, bridge=False)  # (its own bridge)
            eng.backend.prepare()  # what every write needs (the seal key): refused once
    except StartStopped as exc:  # (a stop while it waited for the store: nothing claimed)
        if not quiet:  # said as serve says it (R50: a batch ended silently, exit 0)
            announce(log_format, "stopped", f"stopped: {exc}")
        return 0
    if not getattr(eng.backend, "shared", False):  # a shared store does not rely on the files
        warn_if_shared(eng.ws.root)
    log_filings(eng)
    count = processes_for(eng, processes)

    def make(stripe: tuple[int, int] = (0, 1)) -> Daemon:
        return Daemon(eng, workers=workers, watch=False, stripe=stripe)

    def run(daemon: Daemon) -> BatchReport:
        # what is left of the bound, from where the daemon counts it (a spread's start, before
        # its first sweep: counted from now, a slow sweep was taken off twice; R50)
        began = daemon.started if daemon.started is not None else time.monotonic()
        left = None if ends is None else max(ends - began, 0.0)
        return daemon.run_batch(install_signals=count == 1, max_seconds=left,
                                early=HELD_SIGNALS)

    if count > 1:
        logging.getLogger("handoffd").info("the batch runs on %d processes", count)
        report = spread(count, eng, make, run, early=HELD_SIGNALS)
    else:
        report = run(make())
    report.settle_recovered(eng.backend)  # (a takeover not run again yet: said so)
    for lost in report.lost:
        announce(log_format, "process_lost", f"{lost}; its claims are recovered by the next sweep",
                 level=logging.ERROR)
    if report.error:
        announce(log_format, "main_loop_died", f"the main loop died ({report.error})",
                 level=logging.ERROR)
    elif not quiet and (verbose or report.needs_a_look() or sys.stderr.isatty()):
        announce(log_format, "batch_done", f"batch done: {report.line()}",
                 report_fields(report))
    return 1 if report.failed or report.error or report.lost or report.errors else 0


FILINGS = frozenset({"completed", "failed", "cancelled", "retry_scheduled", "set_aside"})


def log_filings(eng: Engine) -> bool:
    """Log (at info: shown with -v) each filing, retry and set-aside with its agent, attempt,
    duration and error code, from the event stream; False when the engine logs no events."""
    from ..core.events import RecordingBackend
    if not isinstance(eng.backend, RecordingBackend):
        return False
    logger = logging.getLogger("handoffd")

    def filed(event: dict[str, object]) -> None:
        if event.get("event") not in FILINGS:
            return
        code = f" {event['code']}" if event.get("code") else ""
        took = f" in {event['seconds']}s" if event.get("seconds") is not None else ""
        logger.info("%s -> %s (%s)%s%s", event.get("id"), event.get("state"), event.get("event"),
                    code, took, extra={
                        "event": event.get("event"), "handoff_id": event.get("id"),
                        "agent": event.get("agent"), "attempt": event.get("attempt"),
                        "state": event.get("state"), "duration": event.get("seconds"),
                        "code": event.get("code")})

    eng.backend.listeners.append(filed)
    return True


def check_textfile(option: str, textfile: Path) -> None:
    """UsageError (exit 2) unless ``textfile`` can name a metrics file: not a folder, in a
    folder that exists (``serve --metrics-textfile``, ``metrics --textfile``)."""
    if textfile.is_dir():  # (an empty argument arrives as ".")
        raise UsageError(f"{option} {str(textfile)!r} is a folder: name a file in it, "
                         "e.g. /var/lib/node_exporter/handoffd.prom")
    if not textfile.absolute().parent.is_dir():
        raise UsageError(f"{option} {textfile}: no folder {textfile.absolute().parent}")


def expose_metrics(eng: Engine, daemon: Daemon, address: str | None,
                   textfile: Path | None) -> dict[str, str]:
    """Start the metrics endpoint and/or textfile writer of ``serve``; what to add to its
    start line (``metrics_on``: the URL, ``metrics_textfile``: the file)."""
    from ..core.errors import UsageError
    said: dict[str, str] = {}
    if address is not None:
        from ..service.metrics import serve_http
        try:
            server, port = serve_http(eng, address)
        except ValueError:
            raise UsageError(f"--metrics {address!r}: give [HOST:]PORT, e.g. :9464") from None
        except OSError as exc:
            raise UsageError(f"--metrics {address}: cannot listen: {exc.strerror}") from None
        daemon.add_stop_hook(server.shutdown)
        said["metrics_on"] = f"http://{address.rpartition(':')[0] or '0.0.0.0'}:{port}/metrics"
    if textfile is not None:
        from ..service.metrics import TextfileWriter
        check_textfile("--metrics-textfile", textfile)
        writer = TextfileWriter(eng, str(textfile))
        writer.start()
        daemon.add_stop_hook(writer.stop)
        said["metrics_textfile"] = str(textfile)
    return said
