"""``handoff``: create, list, inspect, wait on, retry, cancel and validate handoffs."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..core.errors import ErrorCode, InvalidDocument, UsageError
from ..core.states import State
from ..core.workspace import Workspace, resolve_root
from . import observe_cmd, ops_cmd, orchestration_cmd, reads
from .basics import failure_code, json_arg, read_json_arg, read_limited, warn

# Each command imports what it uses (dialects, the files backend, queries, the sweeper...) in its
# body: a one-shot command pays only for itself. (`handoff create --to`'s plain form does not
# even come here: see handoffd.cli.quick.)
from .common import JsonOption, RootOption, engine, guarded, new_app, run_app, workspace
from .quick import INPUT_DATA_DEPTH, submit_request
from .render import clean, console, print_json

PROG = "handoff"
app = new_app("Create and follow handoffs in a handoffd workspace.")


def _timing(now: Any, at: str | None, delay: str | None,
            expires_after: str | None) -> tuple[Any, str | None]:
    """``--at`` / ``--delay`` as a due time, ``--expires-after`` as an ``expires_at`` string."""
    from datetime import timedelta

    from ..core.config import parse_duration
    from ..core.errors import ConfigError
    from ..core.timeutil import iso, parse_iso
    if at is not None and delay is not None:
        raise UsageError("give --at or --delay, not both")
    due_at = None
    try:
        if at is not None:
            due_at = parse_iso(at)
        elif delay is not None:
            due_at = now + timedelta(seconds=parse_duration(delay))
        expires = (iso((due_at or now) + timedelta(seconds=parse_duration(expires_after)))
                   if expires_after is not None else None)
        if due_at is not None:
            iso(due_at)  # in UTC, as it is stored: 9999-12-31T23:00-14:00 is past the calendar
    except ValueError:
        raise UsageError(f"--at {at!r} is not an ISO 8601 time such as 2026-12-01T09:00:00Z") from None
    except OverflowError:  # e.g. --at 9999-12-31T23:59:59Z --expires-after 1h
        raise UsageError("--at / --delay / --expires-after fall outside the calendar (years 1 to 9999)") from None
    except ConfigError as exc:
        raise UsageError(f"{'--delay' if delay else '--expires-after'}: {exc}") from None
    return due_at, expires


@app.command()
@guarded(PROG)
def create(
    to: Annotated[Optional[str], typer.Option("--to", help="Target agent id, e.g. @react-specialist.")] = None,
    # (None, not "@cli": an explicit --from with --file is refused, not silently dropped)
    source: Annotated[Optional[str], typer.Option("--from", help="Requesting agent id (default @cli).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Input data as JSON (becomes input.data).")] = None,
    input_file: Annotated[Optional[str], typer.Option("--input", help="Read input data JSON from FILE or - (stdin).")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", help="Submit a whole document (any supported format); - reads stdin.")] = None,
    handoff_id: Annotated[Optional[str], typer.Option("--id", help="Use this handoff id.")] = None,
    if_absent: Annotated[bool, typer.Option("--if-absent", help="If this request already holds the id, print the id (exit 0); a different one holding it exits 5.")] = False,
    timeout_seconds: Annotated[Optional[float], typer.Option("--timeout-seconds", help="Handler time limit.")] = None,
    priority: Annotated[Optional[str], typer.Option("--priority", help="critical|high|normal|low or 0-4.")] = None,
    depends_on: Annotated[Optional[list[str]], typer.Option("--depends-on", help="Run only after this handoff completed (repeatable).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Block until the handoff is terminal; exit 1 if it failed.")] = False,
    wait_timeout: Annotated[Optional[float], typer.Option("--wait-timeout", help="With --wait: give up after S seconds (exit 124).")] = None,
    at: Annotated[Optional[str], typer.Option("--at", help="Not before this time (ISO 8601, e.g. 2026-12-01T09:00:00Z; no zone: UTC).")] = None,
    delay: Annotated[Optional[str], typer.Option("--delay", help="Not before this long from now: 45s, 10m, 2h...")] = None,
    expires_after: Annotated[Optional[str], typer.Option("--expires-after", help="Fail with EXPIRED if not started within this long (native requests).")] = None,
    root: RootOption = None,
) -> None:
    """Create a handoff and print its id alone on stdout."""
    from ..backends.files.fsio import read_bytes_safely
    from ..core.jsontext import parse_document
    from ..service.waiting import wait_terminal
    if wait_timeout is not None and not wait:  # it only bounds --wait: alone it did nothing
        raise UsageError("--wait-timeout applies to --wait; add --wait, or drop it")
    if wait_timeout is not None:  # before the submit: refused after it, a retry made another
        _check_wait_timeout(wait_timeout)
    # with --wait, a store away at the start ends as the wait would lose it: at its timeout
    eng, wait_timeout = reads.open_within(
        wait_timeout if wait else None, "no handoff created",
        lambda: engine(root, create=True, features=("dependencies",)))  # submit's check
    if wait:
        reads.quiet_reconnects(eng.backend)  # (the wait's last line says the store was away)
    due_at, expires_at = _timing(eng.clock(), at, delay, expires_after)
    if file is not None:
        # the document says all of these itself: given with it, each was silently dropped (a
        # --depends-on ungated, a --priority or --timeout-seconds ignored), so each is refused
        given = [name for name, value in (
            ("--to", to), ("--from", source), ("--data", data), ("--input", input_file),
            ("--id", handoff_id), ("--timeout-seconds", timeout_seconds),
            ("--priority", priority), ("--depends-on", depends_on)) if value is not None]
        if given:
            raise UsageError("--file submits a whole document; do not combine it with "
                             "--to/--from/--data/--input/--id/--priority/--timeout-seconds/"
                             f"--depends-on (given: {', '.join(given)})")
        if str(file) == "-":
            raw = read_limited("-", eng.settings.max_document_bytes, "--file")
        else:
            try:
                raw, _ = read_bytes_safely(file, eng.settings.max_document_bytes)
            except InvalidDocument as exc:  # what FILE names, not what it holds: exit 2
                if exc.code not in (ErrorCode.DOCUMENT_TOO_LARGE, ErrorCode.NOT_A_REGULAR_FILE):
                    raise
                raise UsageError(f"--file {file}: {exc}") from None
            except OSError as exc:
                raise UsageError(f"--file: cannot read {file}: {exc.strerror or exc}") from None
        submitted = parse_document(raw, str(file))
        if expires_at is not None:
            # the format as submit will detect it (a HAIOS or agent_handoff document has a
            # handoff_id too, and would have kept an expires_at nothing reads: never expiring);
            # a document of no known format is refused by detect as submit refuses it
            if not isinstance(submitted, dict) or eng.formats.detect(submitted).name != "native":
                raise UsageError("--expires-after applies to native (seed 001) requests; other "
                                 "formats carry their own deadlines")
            submitted["expires_at"] = expires_at
        new_id = eng.submit(submitted, if_absent=if_absent, due_at=due_at)
    else:
        if not to:
            raise UsageError("--to is required (or submit a whole document with --file)")
        if data is not None and input_file is not None:
            raise UsageError("give input with --data or --input, not both")
        payload: Any = None
        if data is not None:
            payload = json_arg(data, "--data", depth_below=INPUT_DATA_DEPTH)
        elif input_file is not None:
            payload = read_json_arg(input_file, eng.settings.max_document_bytes, "--input",
                                    depth_below=INPUT_DATA_DEPTH)
        new_id = submit_request(eng, to=to, source="@cli" if source is None else source,
                                payload=payload, handoff_id=handoff_id, timeout_seconds=timeout_seconds,
                                priority=priority, depends_on=depends_on,
                                expires_at=expires_at, if_absent=if_absent, due_at=due_at)
    print(new_id)
    sys.stdout.flush()
    if wait:
        from ..service.waiting import awaiting_answer
        state, filed = wait_terminal(eng.backend, new_id, wait_timeout, or_awaiting=True)
        awaiting = awaiting_answer(state, filed)
        if awaiting is not None:  # stdout keeps the id alone
            print(reads.asked_line(new_id, awaiting), file=sys.stderr)
            raise typer.Exit(reads.EXIT_AWAITING_ANSWER)
        reads.say_failure(new_id, state, filed)  # why, as `handoff wait` says it
        raise typer.Exit(reads.exit_for(state))


def _check_wait_timeout(seconds: float) -> None:
    """UsageError (exit 2, naming --wait-timeout) unless the wait that follows the submit will
    take ``seconds`` (:func:`~handoffd.backends.base.check_wait_timeout`): checked before the
    submit, so a bad value creates nothing."""
    from ..backends.base import check_wait_timeout
    try:
        check_wait_timeout(seconds)
    except UsageError as exc:
        raise UsageError(f"--wait-timeout: {exc}") from None


@app.command("ls")
@guarded(PROG)
def list_command(
    state: Annotated[Optional[str], typer.Option("--state", help="pending|in-progress|completed|failed|quarantined")] = None,
    to: Annotated[Optional[str], typer.Option("--to", help="Only handoffs to this agent.")] = None,
    source: Annotated[Optional[str], typer.Option("--from", help="Only handoffs from this agent.")] = None,
    # min=0: a negative limit listed nothing and exited 0, as if the queue were empty (the
    # quick path refuses it and hands it here, which now words the refusal: exit 2)
    limit: Annotated[int, typer.Option("--limit", min=0, help="Newest N rows (0: none; stderr says how many more there are).")] = reads.DEFAULT_LIMIT,
    conversation: Annotated[Optional[str], typer.Option("--conversation", help="Only handoffs of this conversation_id.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Then print each transition as it happens (Ctrl-C ends).")] = False,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """List handoffs, newest first (--watch: then follow them live)."""
    eng = engine(root)  # every feature: their gates say why a pending handoff waits
    reads.check_state(state)
    if watch and as_json:  # a stream of JSON lines, one per event (no table first)
        observe_cmd.watch(eng, state=state, to=to, as_json=True)
        return
    rows, note = reads.list_rows(eng, state=state, to=to, source=source, limit=limit,
                                 conversation=conversation)
    reads.print_rows(rows, as_json=as_json, note=note, ws=eng.ws)
    if watch:
        observe_cmd.watch(eng, state=state, to=to, as_json=False)


@app.command()
@guarded(PROG)
def show(
    handoff_id: Annotated[str, typer.Argument(help="The handoff id.")],
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Show a handoff's document and its history."""
    reads.show(root, handoff_id, as_json=as_json)


@app.command()
@guarded(PROG)
def wait(
    handoff_id: Annotated[str, typer.Argument(help="The handoff id.")],
    timeout: Annotated[Optional[float], typer.Option("--timeout", min=0, help="Give up after S seconds (exit 124).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the terminal document as JSON.")] = False,
    root: RootOption = None,
) -> None:
    """Block until the handoff is completed (exit 0) or failed (exit 1), or waits for an answer
    to its questions or blockers (exit 4: `handoff answer` resumes it)."""
    raise typer.Exit(reads.wait(root, handoff_id, timeout, as_json=as_json))


@app.command()
@guarded(PROG)
def retry(
    handoff_ids: Annotated[Optional[list[str]], typer.Argument(help="Failed handoff ids.")] = None,
    all_failed: Annotated[bool, typer.Option("--all-failed", help="Retry every failed handoff.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Also retry permanent (non-retryable) failures.")] = False,
    root: RootOption = None,
) -> None:
    """Move failed handoffs back to pending (retry_count + 1, history kept)."""
    from ..core.errors import InvalidTransition, NotFound
    from ..service.sweeper import requeue_failed
    eng = engine(root)
    ids = list(handoff_ids or [])
    named = set(ids)
    if all_failed:
        ids += eng.backend.ids(State.FAILED)
        if not ids:  # asked for every failed one, and there is none: nothing to do, not a misuse
            print(f"{PROG}: no failed handoffs to retry", file=sys.stderr)
            return
    if not ids:
        raise UsageError("name handoff ids to retry, or pass --all-failed")
    ids = list(dict.fromkeys(ids))  # (an id named twice, or named and failed: retried once)
    worst = gone = 0
    retried = []
    for handoff_id in ids:
        try:
            requeue_failed(eng, handoff_id, force=force)
            print(handoff_id)
            retried.append(handoff_id)
        except Exception as exc:  # report each, go on with the rest (a missing id stopped the
            # whole command, leaving the ids after it failed without a word); exit: the worst
            listed = all_failed and handoff_id not in named
            if listed and isinstance(exc, NotFound):  # purged or archived since the listing
                gone += 1
                continue
            if listed and isinstance(exc, InvalidTransition):
                # what --all-failed cannot retry (a permanent failure without --force, a stub,
                # a child already aggregated, one retried meanwhile): said, not a failure
                print(clean(f"{PROG}: skipped: {exc}"), file=sys.stderr)
                continue
            worst = max(worst, failure_code(PROG, exc))  # its line; 3: a missing id, else 1
    if gone:
        print(f"{PROG}: {gone} failed handoff(s) listed were gone before their retry (purged "
              "or archived meanwhile)", file=sys.stderr)
    if retried and getattr(eng.backend, "shared", False):
        from ..features.filebridge import retract_local
        try:
            retract_local(eng, retried)  # their failed/ files here answer no more
        except Exception as exc:  # retried all the same: the daemon removes them
            warn(f"cannot remove the old failed/ files: {exc} (a daemon of this workspace "
                 "removes them at its scans)")
    if worst:
        raise typer.Exit(worst)


@app.command()
@guarded(PROG)
def validate(
    files: Annotated[list[Path], typer.Argument(help="Documents to check.")],
    dialect: Annotated[Optional[str], typer.Option("--dialect", help="Force a format instead of detecting it.")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Detect each document's format, validate it, print every error with its JSON path."""
    from .. import dialects
    if dialect is not None:
        try:
            dialects.by_name(dialect)
        except KeyError as exc:
            raise UsageError(str(exc.args[0])) from None
    from ..service.queries import validate_files
    # inside a workspace, its schemas/ (e.g. edited copies from `schemas --copy`) take precedence
    where = resolve_root(root)
    eng = engine(root, features=()) if Workspace(where).exists() else None
    results = validate_files(files, eng, forced=dialect, root=where)
    if as_json:
        print_json(results)
    else:
        for item in results:
            if item["valid"]:
                kind = (f"a failure stub: the dropped file was set aside as {item['stub']}"
                        if item.get("stub") else item["dialect"])
                print(clean(f"{item['file']}: valid ({kind})"))
                continue
            if item.get("unreadable"):  # (no document: nothing to call invalid)
                print(clean(f"{item['file']}: {item['headline']}"))
                continue
            verdict = "not checked" if item.get("unchecked") else "invalid"
            # (the file may come from another agent: its text is shown, never sent to the terminal)
            print(clean(f"{item['file']}: {verdict} ({item.get('dialect') or 'unknown format'}): "
                        f"{item['headline']}"))
            for err in item["errors"]:
                at = f"  [{err['schema_path']}]" if err["schema_path"] else ""
                print(clean(f"  {err['field']}: {err['error']}{at}"))
    raise typer.Exit(_validate_code(results))


def _validate_code(results: list[dict[str, Any]]) -> int:
    """`validate`'s exit code: 1 when a document is invalid; else 3 for a schema it names that
    cannot be looked for (no workspace) or a file that does not exist, 2 for a file that cannot
    be read (it was "invalid", exit 1, as if the document were at fault); else 0."""
    from ..core.errors import NotFound
    if any(not i["valid"] and not i.get("unchecked") and not i.get("unreadable")
           for i in results):
        return 1
    if any(i.get("unchecked") or i.get("unreadable") == "missing" for i in results):
        return NotFound.exit_code
    return UsageError.exit_code if any(i.get("unreadable") for i in results) else 0


@app.command()
@guarded(PROG)
def schemas(
    copy: Annotated[bool, typer.Option("--copy", help="Copy every built-in schema into the workspace's schemas/ (existing files are kept) and print each copied path.")] = False,
    root: RootOption = None,
) -> None:
    """List the JSON Schemas shipped with handoffd (--copy: copy them into schemas/ to extend)."""
    from ..core.validation import builtin_schema_names
    if not copy:
        for name in builtin_schema_names():
            print(name)
        return
    from importlib import resources

    from ..backends.files.fsio import create_exclusive
    from ..core.errors import DuplicateHandoff
    from ..core.ownfiles import plain_folder
    ws = workspace(root, create=True)
    ws.schemas.mkdir(parents=True, exist_ok=True)
    if not plain_folder(ws.schemas):  # a symlink would take the copies out of the workspace
        raise UsageError(f"{ws.schemas} is not a folder of the workspace (a symlink?); nothing copied")
    copied, kept = [], []
    for name in builtin_schema_names():  # every copy first: a reader of the listing that
        target = ws.schemas / name  # leaves early (`| head`) must not stop the copying
        data = (resources.files("handoffd") / "schemas" / name).read_bytes()
        try:
            create_exclusive(target, data, ws.tmp, durable=True)
        except DuplicateHandoff:
            kept.append(target)
            continue
        copied.append(target)
    for target in kept:
        print(f"{PROG}: kept existing {target}", file=sys.stderr)
    for target in copied:
        print(target)


@app.command()
@guarded(PROG)
def violations(
    as_json: JsonOption = False,
    since: Annotated[Optional[str], typer.Option("--since", help="Only violations at or after this ISO time/date.")] = None,
    agent: Annotated[Optional[str], typer.Option("--agent", help="Only this worker agent.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=0, help="List the newest N violations (default 10, at most 1000; all are counted).")] = None,
    root: RootOption = None,
) -> None:
    """Summarise contract violations (seed 004 learning signals) per agent, kind and day."""
    from ..core.timeutil import parse_iso
    from ..features.contracts import violations as vlog
    from ..features.stores import violation_log
    from .contract_views import violations_view

    recent = vlog.DEFAULT_RECENT if limit is None else limit
    if recent > vlog.MAX_RECENT:  # each listed entry is held until the log's end
        raise UsageError(f"--limit {recent} is over {vlog.MAX_RECENT} (every violation is "
                         "counted whatever the limit; only the listing is cut)")
    eng = engine(root, features=())
    try:
        start = parse_iso(since) if since else None
    except ValueError:
        raise UsageError(f"--since {since!r} is not an ISO 8601 time or date") from None
    # streamed: the log is counted as it is read, and only the newest `recent` entries are held
    summary = vlog.summarise(vlog.read(violation_log(eng.ws, eng.backend), since=start,
                                       agent=agent), recent=recent)
    if as_json:
        print_json(summary)
    else:
        console().print(violations_view(summary))


@app.command("render")
@guarded(PROG)
def render_command(
    handoff_id: Annotated[str, typer.Argument(help="The handoff id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Only the JSON envelope.")] = False,
    root: RootOption = None,
) -> None:
    """Print a handoff's contract, context and escalation compactly, for a worker's prompt."""
    from ..features.contracts.feature import worker_envelope
    from .contract_views import render_envelope

    envelope = worker_envelope(engine(root), handoff_id)
    if as_json:
        print_json({k: envelope[k] for k in ("contract", "context", "escalation")})
    else:
        print(render_envelope(envelope))


orchestration_cmd.register(app)  # cancel, answer, context, trace
ops_cmd.register(app)  # pause, resume, paused
observe_cmd.register(app)  # stats, top


def main() -> None:
    """Console-script entry point."""
    # watchdog (used by wait/cancel) warns about harmless shutdown races; keep stderr to our lines
    logging.getLogger("watchdog").setLevel(logging.ERROR)
    run_app(app, PROG)
