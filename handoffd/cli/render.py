"""Human output for the ``handoff`` command; JSON output bypasses it.

At a terminal, :class:`Out` draws with rich (colour, styles). Piped into a file or another
program it writes the same lines as plain aligned text without importing rich (about 80 ms of a
one-shot command's start) and never folds a line: a script reading ``handoff ls`` sees one row
per handoff however long its note is.
"""
from __future__ import annotations

import codecs
import json
import os
import sys
import unicodedata
from typing import TYPE_CHECKING, Any, Sequence, Union

from ..core.shown import clean

if TYPE_CHECKING:  # rich loads when something is drawn on a terminal, not at start-up
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

STATE_STYLE = {"pending": "yellow", "in-progress": "cyan", "completed": "green",
               "failed": "red", "quarantined": "magenta"}
PIPED_WIDTH = 200  # rich's width when piped: ids are never folded at 80 columns

# a piece of a line or a table cell: plain text, or (text, rich style)
Piece = Union[str, tuple[str, str]]


def console() -> Console:
    """A stdout rich console; rich drops colour by itself when stdout is not a terminal."""
    from rich.console import Console
    out = Console(soft_wrap=False, highlight=False)
    if not out.is_terminal:  # piped: do not fold ids at 80 columns
        out = Console(soft_wrap=False, highlight=False, width=PIPED_WIDTH)
    return out


def print_json(data: Any) -> None:
    """Plain JSON on stdout: no colour, no wrapping (see :func:`json_text`)."""
    print(json_text(data))


def json_text(data: Any) -> str:
    """``data`` as indented JSON whose every character is printable: json.dumps escapes only
    the C0 controls, so DEL, C1 controls (``\\x9b`` is a CSI to some terminals), bidi overrides
    and lone surrogates (unprintable as UTF-8) from documents would reach the terminal raw.
    They can only stand inside strings, where a ``\\uXXXX`` escape is the same JSON value.
    On a stdout that does not take UTF-8 (``PYTHONIOENCODING=ascii``, ``LC_ALL=C``), every
    non-ASCII character is escaped so: the same JSON, which such a stream can carry."""
    text = json.dumps(data, indent=2, ensure_ascii=not stdout_takes_utf8())
    if text.isascii() and "\x7f" not in text:  # the usual case: all printable already
        return text
    return "\n".join(line if line.isprintable() else _json_escaped(line)
                     for line in text.split("\n"))


def stdout_takes_utf8() -> bool:
    """Whether stdout's encoding is UTF-8 (so too for a stream that names none: a test's)."""
    encoding = getattr(sys.stdout, "encoding", None)
    if not isinstance(encoding, str):
        return True
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def _json_escaped(line: str) -> str:
    return "".join(ch if ch.isprintable() else _json_escape(ch) for ch in line)


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000  # beyond the BMP: a UTF-16 surrogate pair, as JSON spells it
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def on_terminal() -> bool:
    """Whether stdout is a terminal (or rich is told to act as if: FORCE_COLOR, TTY_COMPATIBLE)."""
    if os.environ.get("FORCE_COLOR") or os.environ.get("TTY_COMPATIBLE") == "1":
        return True
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def state_cell(state: str) -> Piece:
    """A state, coloured at a terminal."""
    return (state, STATE_STYLE.get(state, ""))


class Out:
    """Lines, tables and JSON for a human: rich at a terminal, plain aligned text otherwise."""

    def __init__(self, terminal: bool | None = None) -> None:
        self.terminal = on_terminal() if terminal is None else terminal
        self._console: Console | None = None

    @property
    def rich(self) -> Console:
        """The rich console (terminal output only)."""
        if self._console is None:
            self._console = console()
        return self._console

    def line(self, *pieces: Piece) -> None:
        """One line assembled from ``pieces`` (text, never markup; control characters shown)."""
        if self.terminal:
            self.rich.print(rich_text(*pieces))
        else:
            print(clean("".join(p if isinstance(p, str) else p[0] for p in pieces)))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Piece]],
              title: str | None = None) -> None:
        """A table with a bold header and no borders (``title`` above it, left)."""
        if self.terminal:
            self.rich.print(rich_table(columns, rows, title))
        else:
            for text in plain_table(columns, rows, title):
                print(text)

    def json(self, data: Any) -> None:
        """``data`` as indented JSON (highlighted at a terminal)."""
        if self.terminal:  # rich's own print_json would write what json.dumps leaves raw
            from rich.highlighter import JSONHighlighter
            text = JSONHighlighter()(json_text(data))
            text.no_wrap = True
            self.rich.print(text)
        else:
            print_json(data)


def rich_text(*pieces: Piece) -> Text:
    """``pieces`` as one rich Text, each cleaned (:func:`clean`): a document's text is never
    read as markup nor sends its escapes to the terminal."""
    from rich.text import Text
    text = Text()
    for piece in pieces:
        if isinstance(piece, tuple) and len(piece) == 2 and isinstance(piece[0], str):
            text.append(clean(piece[0]), style=piece[1])
        else:  # a str, or (defensively, as the plain table) any value written as a string
            text.append(clean(_cell_text(piece)))
    return text


def rich_table(columns: Sequence[str], rows: Sequence[Sequence[Piece]],
               title: str | None = None) -> Table:
    """The rich form of :meth:`Out.table` (cells are text, never markup, cleaned as the
    plain table's are)."""
    from rich.table import Table
    table = Table(box=None, pad_edge=False, header_style="bold",
                  title=None if title is None else rich_text(title), title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(rich_text(p) for p in row))
    return table


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[Piece]],
                title: str | None = None) -> list[str]:
    """The lines of :meth:`Out.table` without rich: what rich prints when piped (columns two
    spaces apart, each cell padded to its column's width), except that nothing is folded."""
    # measured as written: on a stdout that cannot take a character (LC_ALL=C, an ascii
    # PYTHONIOENCODING) the stream writes its escape (``\xe9``), four columns for one
    shown = as_stdout_writes
    columns = [shown(c) for c in columns]
    title = None if title is None else shown(title)
    cells = [[shown(clean(_cell_text(p))) for p in row] for row in rows]
    widths = [cell_width(c) for c in columns]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], cell_width(text))
    lines = ["  ".join(pad(text, widths[i]) for i, text in enumerate(row))
             for row in [list(columns), *cells]]
    if title is not None:
        lines.insert(0, pad(title, sum(widths) + 2 * (len(widths) - 1)))
    return lines


def as_stdout_writes(text: str) -> str:
    """``text`` as stdout writes it: what its encoding cannot take spelt as the backslash
    escape the stream writes instead (``errors="backslashreplace"``, set at start-up)."""
    if text.isascii():
        return text
    encoding = getattr(sys.stdout, "encoding", None)
    if not isinstance(encoding, str):
        return text
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding, "replace")
    except (LookupError, UnicodeError):
        return text


def _cell_text(piece: Any) -> str:
    """A cell's text: a str, the text of a (text, style) pair, or -- defensively, for a value
    a document put where a string belongs -- any other value written as a string (never a
    KeyError or TypeError that fails the whole table)."""
    if isinstance(piece, str):
        return piece
    if isinstance(piece, tuple) and len(piece) == 2 and isinstance(piece[0], str):
        return piece[0]
    return str(piece)


def cell_width(text: str) -> int:
    """Columns ``text`` takes in a terminal (wide East Asian characters take two)."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) else
               2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def pad(text: str, width: int) -> str:
    """``text`` padded with spaces to ``width`` columns."""
    return text + " " * (width - cell_width(text))


def handoff_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Piece]]]:
    """The ``handoff ls`` table: its columns and rows."""
    columns = ["ID", "PARENT", "STATE", "FROM", "TO", "ATTEMPT", "UPDATED", "NOTE"]
    return columns, [[row["id"], row.get("parent") or "-", state_cell(row["state"]),
                      row.get("from") or "-", row.get("to") or "-", str(row.get("attempt") or 0),
                      row.get("updated") or "-", short_note(row.get("note") or "")]  # all in --json
                     for row in rows]


def timeline_rows(history: list[dict[str, Any]]) -> tuple[list[str], list[list[Piece]]]:
    """The ``handoff show`` history, oldest first: its columns and rows."""
    rows: list[list[Piece]] = []
    for item in history if isinstance(history, list) else []:
        if not isinstance(item, dict):
            continue
        who = actor if isinstance(actor := item.get("actor"), dict) else {}
        detail = given if isinstance(given := item.get("detail"), dict) else {}
        text = ", ".join(f"{k}={short(v)}" for k, v in detail.items())
        rows.append([str(item.get("at", "")), str(item.get("event", "")),
                     f"{who.get('host', '?')}:{who.get('pid', '?')}", text])
    return ["AT", "EVENT", "BY", "DETAIL"], rows


def short(value: Any) -> str:
    """``value`` as text of at most 120 characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def short_note(value: Any, limit: int = 160) -> str:
    """A note of ``handoff ls`` cut to about ``limit`` characters, keeping its last clause
    whole (after its last "; ": what to do about it, such as "`handoff answer ID ...`
    answers it"), which a plain cut lost."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) <= limit:
        return text
    head, sep, tail = text.rpartition("; ")
    if not sep or len(tail) > limit // 2:
        return text[:limit - 3] + "..."
    return head[:limit - len(tail) - 5] + "...; " + tail
