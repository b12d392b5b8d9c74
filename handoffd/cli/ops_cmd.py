"""``handoff pause``, ``resume`` and ``paused``: hold back a specialist's (or all) new work."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..core.errors import UsageError
from .common import JsonOption, RootOption, guarded, workspace
from .render import print_json

PROG = "handoff"
AgentArg = Annotated[Optional[str], typer.Argument(help="The specialist, e.g. @coder.")]
AllOption = Annotated[bool, typer.Option("--all", help="The whole workspace.")]


def register(app: typer.Typer) -> None:
    """Add the operations commands to ``app``."""
    app.command("pause")(guarded(PROG)(pause))
    app.command("resume")(guarded(PROG)(resume))
    app.command("paused")(guarded(PROG)(paused))


def _pauses(root: Path | None) -> Any:
    from ..features.pause import pauses_of
    return pauses_of(workspace(root).root)


def _target(agent: str | None, everything: bool) -> str:
    from ..features.pause import ALL
    if everything == (agent is not None):
        raise UsageError("name one specialist, or pass --all")
    return ALL if everything else str(agent)


def _show(pauses: dict[str, Any]) -> None:
    if not pauses:
        print("nothing is paused")
    for agent, entry in sorted(pauses.items()):
        what = "everything (--all)" if agent == "*" else agent
        reason = f": {entry.get('reason')}" if entry.get("reason") else ""
        print(f"{what}  paused by {entry.get('by')} at {entry.get('at')}{reason}")


def pause(
    agent: AgentArg = None,
    everything: AllOption = False,
    reason: Annotated[str, typer.Option("--reason", help="Why (shown by `handoff ls`).")] = "",
    as_agent: Annotated[Optional[str], typer.Option("--as", help="Who pauses (default $HANDOFF_TARGET or @cli).")] = None,
    root: RootOption = None,
) -> None:
    """Hold back new work for a specialist (or --all): it stays pending; running work finishes."""
    who = as_agent or os.environ.get("HANDOFF_TARGET") or "@cli"
    _show(_pauses(root).set(_target(agent, everything), paused=True, by=who, reason=reason))


def resume(agent: AgentArg = None, everything: AllOption = False, root: RootOption = None) -> None:
    """Lift a pause (--all: the workspace pause, or every pause when there is none)."""
    _show(_pauses(root).set(_target(agent, everything), paused=False, by=""))


def paused(as_json: JsonOption = False, root: RootOption = None) -> None:
    """List the pauses in force."""
    pauses = _pauses(root).current()
    if as_json:
        print_json(pauses)
    else:
        _show(pauses)
