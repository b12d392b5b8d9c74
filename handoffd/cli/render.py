"""Human output for the ``handoff`` command (rich tables and timelines); JSON output bypasses it."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich loads when something is printed for a human, not at start-up
    from rich.console import Console
    from rich.table import Table

STATE_STYLE = {"pending": "yellow", "in-progress": "cyan", "completed": "green",
               "failed": "red", "quarantined": "magenta"}


def console() -> Console:
    """A stdout console; rich drops colour by itself when stdout is not a terminal."""
    from rich.console import Console
    out = Console(soft_wrap=False, highlight=False)
    if not out.is_terminal:  # piped: do not fold ids at 80 columns
        out = Console(soft_wrap=False, highlight=False, width=200)
    return out


def print_json(data: Any) -> None:
    """Plain JSON on stdout: no colour, no wrapping."""
    print(json.dumps(data, indent=2, ensure_ascii=False))


def handoff_table(rows: list[dict[str, Any]]) -> Table:
    """The ``handoff ls`` table."""
    from rich.table import Table
    from rich.text import Text
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("ID", "PARENT", "STATE", "FROM", "TO", "ATTEMPT", "UPDATED", "NOTE"):
        table.add_column(column, overflow="fold")
    for row in rows:
        state = row["state"]
        table.add_row(row["id"], row.get("parent") or "-", Text(state, style=STATE_STYLE.get(state, "")),
                      row.get("from") or "-",
                      row.get("to") or "-", str(row.get("attempt") or 0), row.get("updated") or "-",
                      _short(row.get("note") or ""))  # the full note is in --json
    return table


def timeline(history: list[dict[str, Any]]) -> Table:
    """The ``handoff show`` history as a table, oldest first."""
    from rich.table import Table
    table = Table(box=None, pad_edge=False, header_style="bold", title="history", title_justify="left")
    for column in ("AT", "EVENT", "BY", "DETAIL"):
        table.add_column(column, overflow="fold")
    for item in history:
        who = item.get("actor") or {}
        detail = item.get("detail") or {}
        text = ", ".join(f"{k}={_short(v)}" for k, v in detail.items())
        table.add_row(str(item.get("at", "")), str(item.get("event", "")),
                      f"{who.get('host', '?')}:{who.get('pid', '?')}", text)
    return table


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."
