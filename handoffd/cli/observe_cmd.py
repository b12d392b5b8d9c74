"""``handoff stats``, ``handoff top`` and ``handoff ls --watch``: views of the event log.

Each reads ``handoffs/.meta/events.jsonl`` (every transition, one line each) and, for the queue
as it is now, the store. ``top`` is a full-screen rich view that redraws when events arrive and
quits on ``q`` or Ctrl-C; ``ls --watch`` prints one line per event as it happens.
"""
from __future__ import annotations

import json
import os
import select
import sys
import time
from collections import deque
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Optional

import typer

from ..core.timeutil import parse_iso
from .common import JsonOption, RootOption, engine, guarded
from .render import STATE_STYLE, Out, clean, console, print_json

if TYPE_CHECKING:
    from rich.console import RenderableType

    from ..core.engine import Engine
    from ..core.events import Event

PROG = "handoff"
POLL_SECONDS = 0.25  # how often the log is looked at for new lines (a stat when nothing came)
SPARK = "▁▂▃▄▅▆▇█"
BUCKET_SECONDS = 10  # one sparkline character
BUCKETS = 60  # ten minutes of history
MAX_REFRESH_SECONDS = 3600.0  # `top --refresh`: the longest wait between redraws


def register(app: typer.Typer) -> None:
    """Add ``stats`` and ``top`` to ``app`` (``ls --watch`` calls :func:`watch`)."""
    app.command("stats")(guarded(PROG)(stats))
    app.command("top")(guarded(PROG)(top))


def _events(eng: Engine) -> Any:
    from ..features.build import event_log_of
    return event_log_of(eng)


def _since(text: str | None, now: datetime) -> datetime | None:
    from ..core.config import parse_duration
    from ..core.errors import ConfigError, UsageError
    if text is None:
        return None
    try:
        return now - timedelta(seconds=parse_duration(text))
    except ConfigError as exc:
        raise UsageError(f"--since: {exc}") from None


def stats(
    since: Annotated[Optional[str], typer.Option("--since", help="Only the last 45s, 10m, 1h, 7d... (default: everything the log keeps).")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Per specialist: queue depth, started, completed, failed, retries, error codes, throughput
    and p50/p95 of queue wait and run time, from the event log."""
    from ..service.stats import current_depth, report
    eng = engine(root, features=())
    now = eng.clock()
    start = _since(since, now)
    depth = current_depth(eng.backend)
    figures = report(_events(eng).read(start), depth, since=start, now=now)
    if as_json:
        print_json(figures)
        return
    from rich.table import Table
    from rich.text import Text
    table = Table(box=None, pad_edge=False, header_style="bold",
                  title=f"{figures['events']} events over {figures['minutes']:g} min",
                  title_justify="left")
    for column in ("AGENT", "PENDING", "RUNNING", "STARTED", "DONE", "FAILED", "RETRIES",
                   "PER MIN", "WAIT p50/p95", "RUN p50/p95", "ERRORS"):
        table.add_column(column)
    for a in figures["agents"]:
        errors = ", ".join(f"{code}×{n}" for code, n in list(a["errors"].items())[:3])
        table.add_row(Text(clean(str(a["agent"]))), str(a["pending"]), str(a["running"]),
                      str(a["started"]), str(a["completed"]), str(a["failed"]), str(a["retries"]),
                      _num(a["per_minute"]), f"{_num(a['wait_p50'])}/{_num(a['wait_p95'])}s",
                      f"{_num(a['run_p50'])}/{_num(a['run_p95'])}s", Text(clean(errors or "-")))
    console().print(table)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


# ---------------------------------------------------------------------------- ls --watch
def follow(log: Any, stop: Callable[[], bool] = lambda: False) -> Iterator[Event]:
    """Events as they are appended from now on, until ``stop()`` (or Ctrl-C)."""
    _, cursor = log.tail(None)
    while not stop():
        events, cursor = log.tail(cursor)
        yield from events
        if not events:
            time.sleep(POLL_SECONDS)


def watch(eng: Engine, *, state: str | None, to: str | None, as_json: bool) -> None:
    """``handoff ls --watch``: one line per transition as it happens, until Ctrl-C."""
    out = Out(terminal=True)  # rich Text, never markup: an id or agent may hold "[/]"
    try:
        for event in follow(_events(eng)):
            if (state and event.get("state") != state) or (to and event.get("agent") != to):
                continue
            if as_json:
                # ASCII, as every --json output is printable: an id or agent's C1 controls
                # (U+009B is a CSI) and bidi overrides are \uXXXX escapes (the same JSON
                # value), and so is DEL, which ensure_ascii leaves raw
                print(json.dumps(event, ensure_ascii=True).replace("\x7f", "\\u007f"), flush=True)
                continue
            extra = " ".join(f"{k}={event[k]}" for k in ("attempt", "code", "seconds", "wait")
                             if event.get(k) is not None)
            color = STATE_STYLE.get(str(event.get("state")), "")
            out.line(clean(f"{str(event.get('at', ''))[11:23]}  {event.get('id')}  "),
                     (clean(str(event.get("event"))), color),
                     clean(f"  {event.get('agent') or '-'}  {extra}".rstrip()))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass


# ---------------------------------------------------------------------------- top
class TopModel:
    """What ``handoff top`` shows, kept up to date from the event log."""

    def __init__(self, eng: Engine, clock: Callable[[], datetime] | None = None) -> None:
        self.eng = eng
        self.clock = clock or eng.clock  # (tests move time by hand)
        self.failures: deque[Event] = deque(maxlen=8)
        # bucket number -> agent -> handoffs finished in it: the ten minutes shown (and as many
        # ahead, another host's clock); older ones are dropped as time goes by (:meth:`finished`)
        self.buckets: dict[int, dict[str, int]] = {}
        self.rows: list[Any] = []
        self.depth: dict[tuple[str, str], int] = {}

    def add(self, event: Event) -> None:
        """Count one event."""
        if event.get("state") not in ("completed", "failed") or event.get("event") == "purged":
            return
        try:
            at = parse_iso(str(event.get("at")))
        except ValueError:
            return
        bucket = int(at.timestamp() // BUCKET_SECONDS)
        last = int(self.clock().timestamp() // BUCKET_SECONDS)
        if last - BUCKETS < bucket <= last + BUCKETS:  # (a forged time far off: not counted)
            counts = self.buckets.setdefault(bucket, {})
            agent = str(event.get("agent") or "-")
            counts[agent] = counts.get(agent, 0) + 1
        if event.get("state") == "failed":
            self.failures.appendleft(event)

    def refresh(self) -> None:
        """Re-read the queue from the store (pending and running handoffs)."""
        from ..core.states import State
        from ..service.stats import current_depth
        self.rows = self.eng.backend.list(state=State.IN_PROGRESS, order="oldest")
        self.depth = current_depth(self.eng.backend, (State.PENDING,))  # (counted, not held)

    def finished(self, now: float) -> dict[str, int]:
        """Handoffs finished over the ten minutes before ``now`` (epoch seconds), by agent;
        the buckets older than that are dropped (they only grew: a `top` left open for days
        counted every finish since it started, and held a bucket for every ten seconds)."""
        last = int(now // BUCKET_SECONDS)
        for old in [b for b in self.buckets if b <= last - BUCKETS]:
            del self.buckets[old]
        totals: dict[str, int] = {}
        for bucket, counts in self.buckets.items():
            if bucket <= last:
                for agent, count in counts.items():
                    totals[agent] = totals.get(agent, 0) + count
        return totals

    def sparkline(self, now: float) -> str:
        """Handoffs finished per ten seconds over the last ten minutes."""
        last = int(now // BUCKET_SECONDS)
        counts = [sum(self.buckets.get(b, {}).values())
                  for b in range(last - BUCKETS + 1, last + 1)]
        top = max(counts) or 1
        return "".join(SPARK[min(int(c / top * (len(SPARK) - 1) + (c > 0)), len(SPARK) - 1)]
                       if c else " " for c in counts)

    def render(self, now: datetime) -> RenderableType:
        """The whole screen."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text
        finished = self.finished(now.timestamp())
        agents = sorted({a for _, a in self.depth} | {r.meta.target or "-" for r in self.rows}
                        | set(finished))
        queue = Table(title="queue", title_justify="left", box=None, header_style="bold")
        for column in ("AGENT", "PENDING", "RUNNING", "FINISHED (10 min)"):
            queue.add_column(column)
        for agent in agents:  # (Text: what documents say is never read as rich markup)
            running = sum(1 for r in self.rows if (r.meta.target or "-") == agent)
            queue.add_row(Text(clean(agent)), str(self.depth.get(("pending", agent), 0)),
                          str(running), str(finished.get(agent, 0)))
        running_table = Table(title="running", title_justify="left", box=None,
                              header_style="bold")
        for column in ("ID", "AGENT", "ATTEMPT", "AGE"):
            running_table.add_column(column)
        from ..core.storage import trusted_doc
        for row in self.rows[:15]:
            doc = trusted_doc(self.eng.backend, row.state, row.id, row.doc)  # (sealed only)
            block = given if isinstance(given := doc.get("handoffd"), dict) else {}
            age = max((now - row.updated_at).total_seconds(), 0.0)
            running_table.add_row(Text(clean(row.id)), Text(clean(row.meta.target or "-")),
                                  Text(clean(str(block.get("attempt", "-")))), f"{age:.0f}s")
        failures = Table(title="recent failures", title_justify="left", box=None,
                         header_style="bold")
        for column in ("AT", "ID", "AGENT", "CODE"):
            failures.add_column(column)
        for event in self.failures:
            failures.add_row(Text(clean(str(event.get("at", ""))[11:19])),
                             Text(clean(str(event.get("id")))),
                             Text(clean(str(event.get("agent") or "-"))),
                             Text(clean(str(event.get("code") or "-")), style="red"))
        header = Text(f"handoffd top  {self.eng.ws.root}  {now:%H:%M:%S}  (q quits)", style="bold")
        rate = Text(f"finished per 10 s, last 10 min  |{self.sparkline(now.timestamp())}|",
                    style=STATE_STYLE["completed"])
        return Group(header, rate, Text(""), queue, Text(""), running_table, Text(""), failures)


def top(
    refresh: Annotated[float, typer.Option("--refresh", help="Redraw at least every S seconds.")] = 2.0,
    root: RootOption = None,
) -> None:
    """A live full-screen view: queue depth per specialist, running handoffs with their age and
    attempt, recent failures with their code, a throughput sparkline. q or Ctrl-C quits."""
    from ..core.errors import UsageError
    # (NaN fails both comparisons: it never redrew; a negative value redrew at every poll)
    if not 0 <= refresh <= MAX_REFRESH_SECONDS:
        raise UsageError(f"--refresh must be 0 to {MAX_REFRESH_SECONDS:g} seconds, not {refresh:g}")
    if not sys.stdout.isatty():  # a full-screen view into a file or pipe drew nothing, forever
        raise UsageError("top needs a terminal on stdout; use `handoff ls --watch` to follow "
                         "the queue in a pipe or file")
    from rich.live import Live
    eng = engine(root, features=())
    log = _events(eng)
    model = TopModel(eng)
    now = model.clock()
    for event in log.read(now - timedelta(seconds=BUCKET_SECONDS * BUCKETS)):
        model.add(event)
    _, cursor = log.tail(None)
    model.refresh()
    keys = _Keys()
    try:
        with Live(model.render(eng.clock()), screen=True, auto_refresh=False,
                  console=console()) as live:
            last_draw = time.monotonic()
            while True:
                if keys.pressed(POLL_SECONDS) in ("q", "Q"):
                    break
                events, cursor = log.tail(cursor)
                for event in events:
                    model.add(event)
                if events or time.monotonic() - last_draw >= refresh:
                    model.refresh()
                    live.update(model.render(eng.clock()), refresh=True)
                    last_draw = time.monotonic()
    except KeyboardInterrupt:
        pass
    finally:
        keys.close()


class _Keys:
    """Single key presses from a terminal (cbreak mode while ``top`` runs)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin and sys.stdin.isatty() else None
        self.saved: Any = None
        if self.fd is not None:
            import termios
            import tty
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)

    def pressed(self, timeout: float) -> str | None:
        """The key pressed within ``timeout`` seconds, or None."""
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return os.read(self.fd, 1).decode(errors="replace") if ready else None

    def close(self) -> None:
        """Give the terminal its settings back."""
        if self.fd is not None and self.saved is not None:
            import termios
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
