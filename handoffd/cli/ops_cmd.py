"""``handoff pause``, ``resume`` and ``paused``: hold back a specialist's (or all) new work."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..core.errors import UsageError
from .basics import text_arg
from .common import JsonOption, RootOption, guarded
from .render import clean, print_json

PROG = "handoff"
AgentArg = Annotated[Optional[str], typer.Argument(help="The specialist, e.g. @coder.")]
AllOption = Annotated[bool, typer.Option("--all", help="The whole workspace.")]


def register(app: typer.Typer) -> None:
    """Add the operations commands to ``app``."""
    app.command("pause")(guarded(PROG)(pause))
    app.command("resume")(guarded(PROG)(resume))
    app.command("paused")(guarded(PROG)(paused))
    app.command("purge")(guarded(PROG)(purge))
    app.command("archive")(guarded(PROG)(archive))


def _pauses(root: Path | None) -> Any:
    from ..features.pause import pauses_of
    from .common import engine
    return pauses_of(engine(root, features=()))  # the store's records: files or PostgreSQL


def _target(agent: str | None, everything: bool) -> str:
    """The pause record's key; checked before the store is opened (an agent id that is not
    UTF-8 text was stored in paused.json as a lone surrogate)."""
    from ..features.pause import ALL
    if everything == (agent is not None):
        raise UsageError("name one specialist, or pass --all")
    return ALL if everything else text_arg(str(agent), "AGENT")


def _show(pauses: dict[str, Any]) -> None:
    if not pauses:
        print("nothing is paused")
    for agent, entry in sorted(pauses.items()):
        what = "everything (--all)" if agent == "*" else agent
        reason = f": {entry.get('reason')}" if entry.get("reason") else ""
        print(clean(f"{what}  paused by {entry.get('by')} at {entry.get('at')}{reason}"))


def pause(
    agent: AgentArg = None,
    everything: AllOption = False,
    reason: Annotated[str, typer.Option("--reason", help="Why (shown by `handoff ls`).")] = "",
    as_agent: Annotated[Optional[str], typer.Option("--as", help="Who pauses (default $HANDOFF_TARGET or @cli).")] = None,
    root: RootOption = None,
) -> None:
    """Hold back new work for a specialist (or --all): it stays pending; running work finishes."""
    target = _target(agent, everything)
    who = text_arg(as_agent or os.environ.get("HANDOFF_TARGET") or "@cli", "--as")
    reason = text_arg(reason, "--reason")
    _show(_pauses(root).set(target, paused=True, by=who, reason=reason))


def resume(agent: AgentArg = None, everything: AllOption = False, root: RootOption = None) -> None:
    """Lift a pause (--all: the workspace pause, or every pause when there is none)."""
    target = _target(agent, everything)
    pauses = _pauses(root)
    if target != "*" and target not in pauses.current():  # (a misspelt agent said nothing)
        print(clean(f"{PROG}: {target} was not paused; the pauses in force:"), file=sys.stderr)
    _show(pauses.set(target, paused=False, by=""))


def paused(as_json: JsonOption = False, root: RootOption = None) -> None:
    """List the pauses in force."""
    pauses = _pauses(root).current()
    if as_json:
        print_json(pauses)
    else:
        _show(pauses)


OlderThan = Annotated[str, typer.Option("--older-than", help="Age: 45s, 10m, 12h, 7d, 2w (last update before then).")]
StateOption = Annotated[Optional[str], typer.Option("--state", help="completed or failed (default: both).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")]


def _expire(root: Path | None, older_than: str, state: str | None, dry_run: bool,
            as_json: bool, *, archive: bool) -> None:
    from ..core.config import parse_duration
    from ..core.errors import ConfigError
    from ..core.states import State
    from .common import engine
    try:
        seconds = parse_duration(older_than)
    except ConfigError as exc:
        raise UsageError(f"--older-than: {exc}") from None
    if state not in (None, "completed", "failed"):
        raise UsageError("--state must be completed or failed")
    states = [State(state)] if state else [State.COMPLETED, State.FAILED]
    eng = engine(root, features=())
    removed, kept, where = _passes(eng, {s: seconds for s in states}, archive, dry_run)
    if as_json:
        print_json({"removed": [{"id": i, "state": s} for i, s in removed],
                    "kept": kept, "archive": str(where) if where else None,
                    "dry_run": dry_run})
        return
    verb = ("would archive" if archive else "would purge") if dry_run else \
        ("archived" if archive else "purged")
    # a name in completed/ or failed/ is whatever its producer chose: its escapes (a title,
    # the clipboard) are shown, never sent to the terminal, as `handoff ls` shows them
    for hid, st in removed:
        print(clean(f"{verb} {st}/{hid}"))
    for hid, why in sorted(kept.items()):
        print(clean(f"kept {hid}: {why}"))
    into = f" into {where}" if where else ""
    print(clean(f"{verb} {len(removed)} handoff(s){into}; kept {len(kept)}"))


def _passes(eng: Any, older_than: dict[Any, float], archive: bool, dry_run: bool
            ) -> tuple[list[tuple[str, str]], dict[str, str], Path | None]:
    """Every old one, in batches: (removed, kept, the archive file). Each state is listed once
    and each batch holds (and archives, as one gzip member) at most CLI_PASS_LIMIT documents or
    PASS_BYTES of them, so memory stays bounded whatever the backlog, and a kill costs at most
    one batch archived twice (see :func:`retention.expire_all`). A dry run is one pass that
    holds no document. HandoffdError (exit 1) when another process's pass held the lock past
    the wait: nothing more was done."""
    from ..core.errors import HandoffdError
    from ..features import retention
    if dry_run:
        result = retention.expire(eng, older_than=older_than, now=eng.clock(), dry_run=True,
                                  wait=retention.LOCK_WAIT_SECONDS)
    else:
        result = retention.expire_all(eng, older_than=older_than, now=eng.clock(),
                                      archive=archive, limit=retention.CLI_PASS_LIMIT,
                                      max_bytes=retention.PASS_BYTES,
                                      wait=retention.LOCK_WAIT_SECONDS)
    if result.busy:
        done = f" after {len(result.removed)} removed" if result.removed else ""
        from ..features.removal import store_lock  # (the store's: PostgreSQL's is the database's)
        raise HandoffdError(f"another process's retention pass held {store_lock(eng).name} for "
                            f"over {retention.LOCK_WAIT_SECONDS:g} s; stopped{done} (try again "
                            "later)")
    return result.removed, result.kept, result.archive


def purge(older_than: OlderThan, state: StateOption = None, dry_run: DryRun = False,
          as_json: JsonOption = False, root: RootOption = None) -> None:
    """Delete finished handoffs older than --older-than (never what live work depends on or
    reports to); their ids stay known to dedup."""
    _expire(root, older_than, state, dry_run, as_json, archive=False)


def archive(older_than: OlderThan, state: StateOption = None, dry_run: DryRun = False,
            as_json: JsonOption = False, root: RootOption = None) -> None:
    """Move finished handoffs older than --older-than into handoffs/.archive/DATE.jsonl.gz
    (`handoff show` still finds them)."""
    _expire(root, older_than, state, dry_run, as_json, archive=True)
