"""``handoffd``: serve a workspace, run one batch, or sweep."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..backends.files.backend import CLOCK_TOLERANCE_SECONDS
from ..backends.files.store import inject_crash_at
from ..core.workspace import network_filesystem
from ..service.daemon import Daemon
from ..service.sweeper import sweep as sweep_once
from ..service.systemd import SystemdNotifier
from .common import RootOption, StoreOption, engine, guarded, new_app, run_app, workspace
from .db_cmd import db_app

if TYPE_CHECKING:
    from ..core.engine import Engine

PROG = "handoffd"
app = new_app("The handoffd daemon: claims handoffs and runs their specialists.")
app.add_typer(db_app, name="db")  # handoffd db init / import: the PostgreSQL store

Workers = Annotated[Optional[int], typer.Option("--workers", min=1, help="Worker threads (default: [daemon] workers).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every transition.")]


LogFormat = Annotated[str, typer.Option("--log-format", help="text (default) or json: one object per line.")]


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
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def _logging(verbose: bool, *, quiet: bool = False, log_format: str = "text") -> None:
    level = logging.INFO if verbose else logging.ERROR if quiet else logging.WARNING
    if log_format not in ("text", "json"):
        from ..core.errors import UsageError
        raise UsageError(f"--log-format {log_format!r}: text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if log_format == "json"
                         else logging.Formatter("handoffd: %(levelname)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    logging.getLogger("watchdog").setLevel(logging.WARNING)


def _warn_if_shared(root: Path) -> None:
    """Say so when the workspace is on a network filesystem: file locks there are local or
    emulated and inotify misses other hosts' writes, so another host's claim is judged by its
    lease alone (docs/guarantees.md)."""
    fs = network_filesystem(root)
    if fs:
        logging.getLogger("handoffd").warning(
            "the workspace is on a network filesystem (%s): claims of other hosts are recovered "
            "only after their lease expires (+%gs clock tolerance), new files are found by "
            "rescans; keep host clocks in sync", fs, CLOCK_TOLERANCE_SECONDS)


@app.command()
@guarded(PROG)
def serve(root: RootOption = None, workers: Workers = None, verbose: Verbose = False,
          log_format: LogFormat = "text", store: StoreOption = None,
          metrics: Annotated[Optional[str], typer.Option(
              "--metrics", help="Serve Prometheus metrics over HTTP at [HOST:]PORT, e.g. :9464.")] = None,
          metrics_textfile: Annotated[Optional[Path], typer.Option(
              "--metrics-textfile", help="Rewrite the metrics into FILE every 15 s (node_exporter).")] = None,
          ) -> None:
    """Run in the foreground until SIGTERM/SIGINT; then finish or hand back work and exit 0.

    Exits 1 if the main loop dies of an unexpected error (after logging it with a traceback
    and handing in-flight work back), so that a supervisor restarts it.
    """
    _logging(verbose, log_format=log_format)
    from ..service import allocator
    allocator.limit_arenas()  # before any thread: a long-lived daemon's memory stays flat
    eng = engine(root, create=True, store=store)
    if not getattr(eng.backend, "shared", False):  # a shared store does not rely on the files
        _warn_if_shared(eng.ws.root)
    daemon = Daemon(eng, workers=workers)
    exposed = _expose_metrics(eng, daemon, metrics, metrics_textfile)
    if not _log_filings(eng):
        daemon.on_filed = (lambda hid, st: logging.getLogger("handoffd").info(
            "%s -> %s", hid, st.value, extra={"event": "filed", "handoff_id": hid,
                                              "state": st.value}))
    systemd = SystemdNotifier.from_env()  # Type=notify: READY, STOPPING, WATCHDOG
    if systemd is not None:
        daemon.add_scan_hook(systemd.watchdog)  # pinged from the main loop: a hang stops it
        daemon.add_stop_hook(systemd.stopping)

    def ready() -> None:
        line = (f"serving {eng.ws.root} ({daemon.workers} workers; at once per specialist: "
                f"{daemon.limits() or 'no specialists'}){exposed}")
        print(f"{PROG}: {line}", file=sys.stderr, flush=True)
        if systemd is not None:
            systemd.ready(line)

    code = daemon.serve(ready=ready)
    print(f"{PROG}: stopped: {daemon.report.line()}", file=sys.stderr)
    if daemon.report.error:
        print(f"{PROG}: error: the main loop died ({daemon.report.error}); restart the daemon",
              file=sys.stderr)
    raise typer.Exit(code or (1 if daemon.report.error else 0))


FILINGS = frozenset({"completed", "failed", "cancelled", "retry_scheduled", "set_aside"})


def _log_filings(eng: "Engine") -> bool:
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


def _expose_metrics(eng: "Engine", daemon: Daemon, address: str | None,
                    textfile: Path | None) -> str:
    """Start the metrics endpoint and/or textfile writer of ``serve``; what to add to its
    start line."""
    from ..core.errors import UsageError
    said = ""
    if address is not None:
        from ..service.metrics import serve_http
        try:
            server, port = serve_http(eng, address)
        except ValueError:
            raise UsageError(f"--metrics {address!r}: give [HOST:]PORT, e.g. :9464") from None
        except OSError as exc:
            raise UsageError(f"--metrics {address}: cannot listen: {exc.strerror}") from None
        daemon.add_stop_hook(server.shutdown)
        said += f"; metrics on http://{address.rpartition(':')[0] or '0.0.0.0'}:{port}/metrics"
    if textfile is not None:
        from ..service.metrics import TextfileWriter
        writer = TextfileWriter(eng, str(textfile))
        writer.start()
        daemon.add_stop_hook(writer.stop)
        said += f"; metrics textfile {textfile}"
    return said


@app.command()
@guarded(PROG)
def metrics(root: RootOption = None,
            textfile: Annotated[Optional[Path], typer.Option(
                "--textfile", help="Write into FILE atomically (node_exporter) instead of stdout.")] = None,
            ) -> None:
    """Print the workspace's Prometheus metrics once (from the event log and the queue)."""
    from ..service.metrics import registry_for, write_textfile
    eng = engine(root, features=())
    if textfile is not None:
        write_textfile(eng, str(textfile))
        return
    from prometheus_client import generate_latest
    sys.stdout.write(generate_latest(registry_for(eng)).decode())


@app.command()
@guarded(PROG)
def run(root: RootOption = None, workers: Workers = None, verbose: Verbose = False,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
        max_seconds: Annotated[Optional[float], typer.Option(
            "--max-seconds", min=0.0, help="Stop after S seconds: hand back what still runs.")] = None,
        log_format: LogFormat = "text", store: StoreOption = None,
        ) -> None:
    """One batch for cron: recover, process everything due, wait for it, exit.

    Says nothing when nothing needs a look (cron mails whatever a job prints) unless stderr is
    a terminal or -v is given; a failure, a set-aside or handed-back handoff, or an error is
    always summarised (-q silences that too). SIGTERM/SIGINT stop it as they stop `serve`.
    Exit 0 when nothing it processed failed, 1 when at least one handoff was filed in failed/
    or the main loop died of an unexpected error (logged with a traceback; work handed back).
    """
    _logging(verbose, quiet=quiet, log_format=log_format)
    eng = engine(root, create=True, store=store)
    if not getattr(eng.backend, "shared", False):  # a shared store does not rely on the files
        _warn_if_shared(eng.ws.root)
    _log_filings(eng)
    report = Daemon(eng, workers=workers, watch=False).run_batch(install_signals=True,
                                                                 max_seconds=max_seconds)
    if report.error:
        print(f"{PROG}: error: the main loop died ({report.error})", file=sys.stderr)
    elif not quiet and (verbose or report.needs_a_look() or sys.stderr.isatty()):
        if log_format == "json":  # the summary as one more record (at warning: always shown)
            logging.getLogger("handoffd").warning("batch done: %s", report.line(),
                                                  extra={"event": "batch_done"})
        else:
            print(f"{PROG}: batch done: {report.line()}", file=sys.stderr)
    raise typer.Exit(1 if report.failed or report.error else 0)


@app.command()
@guarded(PROG)
def mcp(root: RootOption = None,
        http: Annotated[Optional[str], typer.Option(
            "--http", help="Serve streamable HTTP on HOST:PORT (default: stdio).")] = None,
        as_agent: Annotated[str, typer.Option(
            "--as", help="The agent identity it acts as (source, context permissions).")] = "@mcp",
        ) -> None:
    """Serve the workspace as an MCP server (tools: create/wait/get/list/cancel/answer/retry
    handoffs, context, trace; resources: the formats' JSON Schemas). Needs handoffd[mcp]."""
    from ..core.errors import UsageError
    try:
        from ..service.mcp_server import build_server
    except ImportError as exc:
        raise UsageError(f"handoffd mcp needs the MCP SDK ({exc.name} is missing): "
                         "pip install 'handoffd[mcp]'") from None
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,  # stdout is the protocol's
                        format="handoffd: %(levelname)s: %(message)s")
    ws = workspace(root, create=True)
    server = build_server(ws.root, agent=as_agent)
    if http is None:
        server.run("stdio")
        return
    host, _, port = http.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--http {http!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    server.run("streamable-http", host=host or "127.0.0.1", port=int(port))


@app.command()
@guarded(PROG)
def sweep(root: RootOption = None, verbose: Verbose = False, store: StoreOption = None) -> None:
    """Recover stale claims, repair interrupted moves, clean temp files, then exit."""
    _logging(verbose)
    eng = engine(root, create=True, store=store)
    report = sweep_once(eng)
    print(f"{PROG}: sweep: {report.summary()}", file=sys.stderr)


def main() -> None:
    """Console-script entry point. ``$HANDOFFD_CRASH_AT`` (a step of claim or finish, for
    recovery tests) makes the daemon die there as if killed."""
    point = os.environ.get("HANDOFFD_CRASH_AT", "")
    if point:
        inject_crash_at(point)
    run_app(app, PROG)
