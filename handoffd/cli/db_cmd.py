"""``handoffd db``: set up the PostgreSQL store and move a files workspace into it.

Both open the store as every other command does: a database that is away (down, restarting) is
waited for up to ``[store] reconnect_seconds``, in one line, and a stop signal meanwhile ends
the wait with exit 0, as it ends ``serve``'s and ``run``'s (:func:`stop_ends_the_wait`)."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from ..core.errors import StartStopped, UsageError
from ..core.starting import ask_stop, release_stop_signals, say_at_once, stop_asked, stop_at_once
from .basics import text_arg
from .common import JsonOption, RootOption, StoreOption, guarded, workspace

PROG = "handoffd"
db_app = typer.Typer(help="The PostgreSQL store: create or upgrade its schema, import a "
                          "workspace's files.", no_args_is_help=True)


def _url(root: Path | None, store: str | None) -> tuple[Any, str]:
    """The workspace and the PostgreSQL URL chosen by --store, $HANDOFFD_STORE or [store] url.
    A given URL that is not UTF-8 text (argv's or the environment's undecodable bytes: an
    internal error later) or not PostgreSQL's is refused (exit 2) before the workspace is made."""
    import os

    from ..core.bounds import check_store_url
    from ..core.config import STORE_ENV
    from ..core.logs import prefix_lines, speak_as
    speak_as(PROG)  # the store's lines (waiting for the database, lost it) read "handoffd: ..."
    prefix_lines()
    given = [(store, "--store"), (os.environ.get(STORE_ENV), f"${STORE_ENV}")]
    for url, where in given:
        if url:  # (the first given is the one used, as in Config.store_url)
            check_store_url(text_arg(url, where), where)
            break
    ws = workspace(root, create=True)
    url = ws.load_config().store_url(store)
    if url is None:
        raise UsageError("no PostgreSQL store: pass --store postgresql://..., set "
                         "$HANDOFFD_STORE, or add [store] url = \"postgresql://...\" to "
                         "handoffd.toml")
    return ws, url


def _stop(signum: int, frame: object) -> None:
    """A stop signal while the store is opened: recorded, which ends a wait for the database
    (:func:`handoffd.core.starting.stop_asked`); a second one ends the command at once (exit 0:
    nothing is done yet), as a second one ends a daemon's start, in one line naming the store
    (:func:`~handoffd.core.starting.stop_at_once`: it once ended with no word)."""
    if stop_asked():
        stop_at_once()  # (its line, naming the store: said by stop_ends_the_wait)
    ask_stop(signum)


@contextmanager
def stop_ends_the_wait(url: str) -> Iterator[None]:
    """Within the block (opening the store at ``url``), SIGTERM, SIGINT and SIGHUP end a wait
    for a database that is away: one line (``handoffd: stopped: before it began, waiting for
    the database at ...``) and exit 0, as for ``serve`` and ``run``; a stop that came during
    the attempt that connected ends the command so too, before it changes anything, and one
    held since the command's start (:func:`~handoffd.core.starting.hold_stop_signals`: during
    its imports) before the store is opened at all. After the block the signals act as they do
    on any program (``db init``'s work is one transaction, rolled back when it
    is killed; ``db import`` is made to be run again after an interruption)."""
    import signal

    from ..backends.postgres.connection import redact
    from ..core.procs import STOP_SIGNALS
    # (a signal ignored by whoever started it, nohup's SIGHUP, stays ignored: R64)
    # (set before the handlers: a second signal during the wait says it, naming the store)
    say_at_once(f"{PROG}: stopped: before it began, at a second stop signal, waiting for the "
                f"database at {redact(url)}: nothing was done to the store")
    before = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS
              if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        try:
            if stop_asked():  # held since the command's start (its imports): the store unopened
                raise StartStopped(f"before it began, before opening the store at {redact(url)}")
            yield
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)
            release_stop_signals()  # (held by the console script: after the block, as before)
            say_at_once("")  # (no start left to stop at once)
        if stop_asked():
            raise StartStopped(f"before it began, waiting for the database at {redact(url)}")
    except StartStopped as exc:
        print(f"{PROG}: stopped: {exc}", file=sys.stderr)
        raise typer.Exit(0) from None


@db_app.command("init")
@guarded(PROG)
def init(root: RootOption = None, store: StoreOption = None) -> None:
    """Create or upgrade handoffd's tables (idempotent); prints the schema version."""
    import psycopg

    from ..backends.postgres.connection import (cannot_connect, check_url, first_connection,
                                                refusal)
    from ..backends.postgres.schema import check, migrate
    ws, url = _url(root, store)
    check_url(url)  # a URL libpq cannot parse: one line (exit 2), never the parser's class name
    settings = ws.load_config().store  # ([store] reconnect_seconds, connect_timeout_seconds)
    with stop_ends_the_wait(url):  # a database that is away: waited for, as by every command
        first_connection(url, reconnect_seconds=settings.reconnect_seconds,
                         connect_timeout=settings.connect_timeout_seconds)
    try:
        with psycopg.connect(url, connect_timeout=max(int(settings.connect_timeout_seconds),
                                                      1)) as conn:
            version, applied = migrate(conn)
            check(conn, version)  # "up to date" only when every table and column is there
    except psycopg.OperationalError as exc:  # (libpq refusing an option: exit 2, as check_url)
        raise cannot_connect(url, " ".join(str(exc).split())) from None
    except psycopg.Error as exc:  # e.g. a role that may not create tables in the database
        raise refusal(exc, url, "create or upgrade handoffd's tables") from None
    print(f"schema version {version}")
    print(f"{PROG}: db init: " + (f"applied migration(s) {', '.join(map(str, applied))}"
                                  if applied else "already up to date"), file=sys.stderr)


@db_app.command("import")
@guarded(PROG)
def import_(root: RootOption = None, store: StoreOption = None, as_json: JsonOption = False) -> None:
    """Move this workspace's pending and finished handoff files, its context values and its
    violations log into the PostgreSQL store (idempotent: run it again after an interruption).
    Pending files are removed once in the database; finished ones and context files are copied
    and kept (the daemon keeps context/ as a mirror of the database's)."""
    from .. import dialects
    from ..backends.files.backend import FilesBackend
    from ..backends.postgres import PostgresBackend
    from ..backends.postgres.transfer import import_workspace
    from ..core.timeutil import utc_now
    from ..features.build import build_engine, origin_of
    from ..features.filebridge import bridge_for
    ws, url = _url(root, store)
    config = ws.load_config()
    settings = config.daemon
    with stop_ends_the_wait(url):  # a database that is away: waited for, as by every command
        backend = PostgresBackend(url, describe=dialects.describe,
                                  seen_ttl_seconds=settings.seen_ttl_seconds,
                                  origin=origin_of(ws),
                                  reconnect_seconds=config.store.reconnect_seconds,
                                  connect_timeout=config.store.connect_timeout_seconds,
                                  max_document_bytes=settings.max_document_bytes,
                                  max_output_bytes=settings.max_output_bytes)
        if stop_asked():  # (the block ends the command: its store is let go first)
            backend.close()
    files = FilesBackend.open(ws, describe=dialects.describe, watch=False, ensure=False,
                              durable=settings.durable, max_document_bytes=settings.max_document_bytes,
                              settle_seconds=settings.settle_seconds)
    try:
        engine = build_engine(ws, config, backend=backend, features=())
        report = import_workspace(backend, files, bridge_for(engine), utc_now())
    finally:
        files.close()
        backend.close()
    if as_json:
        print(json.dumps({"imported": report.imported, "already": report.already,
                          "set_aside": report.set_aside, "unreadable": report.unreadable,
                          "in_progress": report.in_progress, "context": report.context,
                          "context_already": report.context_already,
                          "violations": report.violations}))
    else:
        print(report.line())
