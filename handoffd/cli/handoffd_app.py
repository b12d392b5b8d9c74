"""``handoffd``'s full command line (typer): serve a workspace, run one batch, sweep, metrics,
mcp, db. The console script (:func:`handoffd.cli.handoffd_cmd.main`) comes here for anything its
quick path does not take; ``serve`` and ``run`` run :mod:`handoffd.cli.daemon_commands`, as the
quick path does."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.bounds import MAX_WORKERS
from .common import RootOption, StoreOption, engine, guarded, new_app, run_app, workspace
from .daemon_commands import PROG, check_textfile, configure_logging, run_batch
from .daemon_commands import serve as serve_workspace
from .db_cmd import db_app

app = new_app("The handoffd daemon: claims handoffs and runs their specialists.")
app.add_typer(db_app, name="db")  # handoffd db init / import: the PostgreSQL store

Workers = Annotated[Optional[int], typer.Option("--workers", min=1, max=MAX_WORKERS, help="Worker threads, 1 to 1024 (default: \\[daemon] workers).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log every transition.")]


LogFormat = Annotated[str, typer.Option("--log-format", help="text (default) or json: one object per line.")]
Processes = Annotated[Optional[str], typer.Option(
    "--processes", metavar="N|auto",
    help="Processes to fork (default: \\[daemon] processes; auto: one per CPU for a large batch, "
         "one for serve).")]


@app.command()
@guarded(PROG)
def serve(root: RootOption = None, workers: Workers = None, verbose: Verbose = False,
          log_format: LogFormat = "text", store: StoreOption = None,
          metrics: Annotated[Optional[str], typer.Option(
              "--metrics", help="Serve Prometheus metrics over HTTP at [HOST:]PORT, e.g. :9464.")] = None,
          metrics_textfile: Annotated[Optional[Path], typer.Option(
              "--metrics-textfile", help="Rewrite the metrics into FILE every 15 s (node_exporter).")] = None,
          processes: Processes = None,
          ) -> None:
    """Run in the foreground until SIGTERM/SIGINT/SIGHUP; then finish or hand back work and exit 0.

    Exits 1 if the main loop dies of an unexpected error (after logging it with a traceback
    and handing in-flight work back), or one of its --processes ends, so that a supervisor
    restarts it.
    """
    raise typer.Exit(serve_workspace(root, workers, verbose, log_format, store, metrics,
                                     metrics_textfile, processes_arg(processes)))


@app.command()
@guarded(PROG)
def metrics(root: RootOption = None,
            textfile: Annotated[Optional[Path], typer.Option(
                "--textfile", help="Write into FILE atomically (node_exporter) instead of stdout.")] = None,
            ) -> None:
    """Print the workspace's Prometheus metrics once (from the event log and the queue)."""
    from ..service.metrics import registry_for, write_textfile
    if textfile is not None:  # a missing folder is a bad argument, as for serve --metrics-textfile
        check_textfile("--textfile", textfile)
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
        processes: Processes = None,
        ) -> None:
    """One batch for cron: recover, process everything due, wait for it, exit.

    Says nothing when nothing needs a look (cron mails whatever a job prints) unless stderr is
    a terminal or -v is given; a failure, a set-aside or handed-back handoff, or an error is
    always summarised (-q silences that too). SIGTERM/SIGINT/SIGHUP stop it as they stop `serve`.
    Exit 0 when nothing it processed failed, 1 when at least one handoff was filed in failed/,
    one could not be handled for a passing reason (a full disk: left for the next run), or the
    main loop died of an unexpected error (logged with a traceback; work handed back).
    """
    raise typer.Exit(run_batch(root, workers, verbose, quiet, max_seconds, log_format, store,
                               processes_arg(processes)))


def processes_arg(text: str | None) -> int | None:
    """``--processes`` as :func:`handoffd.core.config.processes_value` reads it; None when not
    given; UsageError (exit 2) for anything else."""
    from ..core.config import MAX_PROCESSES, processes_value
    from ..core.errors import UsageError
    if text is None:
        return None
    try:
        return processes_value(text)
    except ValueError:
        raise UsageError(f"--processes {text!r}: auto or 1..{MAX_PROCESSES}") from None


@app.command()
@guarded(PROG)
def mcp(root: RootOption = None,
        http: Annotated[Optional[str], typer.Option(
            "--http", help="Serve streamable HTTP on HOST:PORT (default: stdio).")] = None,
        as_agent: Annotated[str, typer.Option(
            "--as", help="The agent identity it acts as (source, context permissions).")] = "@mcp",
        ) -> None:
    """Serve the workspace as an MCP server (tools: create/wait/get/list/cancel/answer/retry
    handoffs, context, trace; resources: the formats' JSON Schemas). Needs handoffd\\[mcp]."""
    from ..core.errors import UsageError
    from ..service.mcp_http import parse_listen
    # the values are checked before the SDK is imported (about a second of CPU)
    if not as_agent.strip() or any(ord(c) < 32 or ord(c) == 127 for c in as_agent):
        raise UsageError(f"--as {as_agent!r}: give the agent id it acts as, e.g. @planner")
    if http is not None:
        parse_listen(http)  # a bad value is refused before anything starts
    try:
        from ..service.mcp_server import build_server
    except ImportError as exc:
        raise UsageError(f"handoffd mcp needs the MCP SDK ({exc.name} is missing): "
                         "pip install 'handoffd[mcp]'") from None
    # the daemon's logging, on stderr (stdout is the protocol's): one line per record, and a
    # record stderr cannot take for want of descriptors or memory a plain line, not a traceback
    configure_logging(False)
    ws = workspace(root, create=True)
    if http is None:
        from ..service.mcp_stdio import run_stdio
        run_stdio(build_server(ws.root, agent=as_agent))  # the SDK's transport, every request answered
        return
    from ..service.mcp_http import run_http
    from ..service.mcp_waits import MAX_WAITS_PER_SESSION
    run_http(build_server(ws.root, agent=as_agent, waits_per_session=MAX_WAITS_PER_SESSION), http)


@app.command()
@guarded(PROG)
def sweep(root: RootOption = None, verbose: Verbose = False, store: StoreOption = None) -> None:
    """Recover stale claims, repair interrupted moves, clean temp files, then exit."""
    from ..service.sweeper import sweep as sweep_once
    configure_logging(verbose)
    eng = engine(root, create=True, store=store)
    report = sweep_once(eng)
    print(f"{PROG}: sweep: {report.summary()}", file=sys.stderr)


def main() -> None:
    """The full command line alone (no quick path): what :func:`handoffd_cmd.main` falls
    back to, and what tests compare the quick path with."""
    run_app(app, PROG)
