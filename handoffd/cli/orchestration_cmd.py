"""``handoff cancel | answer | context | trace``: the orchestration commands of the ``handoff`` CLI.

Registered on the ``handoff`` Typer app by :func:`register` (called from handoff_cmd.py).
"""
from __future__ import annotations

import sys
import time
from typing import Annotated, Any, Optional

import typer

from ..core.errors import UsageError, WaitTimeout
from . import context_ops
from .basics import text_arg
from .common import JsonOption, RootOption, engine, guarded
from .context_ops import agent_arg, context_store, key_arg, value_arg
from .render import STATE_STYLE, Out, Piece, clean, console, print_json, rich_text

PROG = "handoff"


# how deep an answer sits in the document it is filed in: document, input (or the handoffd
# block), clarifications, the entry, its answer (4); in the request, which keeps 8 levels free
# for the copies filed of it (core.documents.REQUEST_DEPTH_MARGIN)
ANSWER_DEPTH = 4 + 8


def register(app: typer.Typer) -> None:
    """Add the orchestration commands to ``app``."""
    app.command("cancel")(guarded(PROG)(cancel))
    app.command("answer")(guarded(PROG)(answer))
    app.command("trace")(guarded(PROG)(trace))
    ctx_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                          help="Read and write shared context (context/) with namespace permissions.")
    ctx_app.command("get")(guarded(PROG)(context_get))
    ctx_app.command("set")(guarded(PROG)(context_set))
    ctx_app.command("ls")(guarded(PROG)(context_ls))
    ctx_app.command("history")(guarded(PROG)(context_history))
    app.add_typer(ctx_app, name="context")


MAX_CANCEL_WAIT_SECONDS = 24 * 3600.0  # how long `cancel` may wait for running work to stop

# ---------------------------------------------------------------- cancel
def cancel(
    handoff_id: Annotated[str, typer.Argument(help="The handoff id.")],
    cascade: Annotated[bool, typer.Option("--cascade", help="Also cancel every descendant (children by parent_id).")] = False,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the filed document).")] = "cancelled by request",
    timeout: Annotated[float, typer.Option("--timeout", help="Wait up to S seconds for running handoffs to stop (0: do not wait).")] = 15.0,
    as_agent: Annotated[Optional[str], typer.Option("--as", help="Who cancels (default $HANDOFF_TARGET or @cli).")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Cancel a pending or running handoff (pending: filed at once; running: its daemon stops it)."""
    from ..features.cancel_family import cancel as do_cancel, reported_status
    from ..service.waiting import wait_terminal

    if not 0 <= timeout <= MAX_CANCEL_WAIT_SECONDS:  # (NaN fails both comparisons)
        raise UsageError(f"--timeout must be 0 to {MAX_CANCEL_WAIT_SECONDS:.0f} seconds, not {timeout:g}")
    # checked before anything is claimed: the reason is written into each filed document
    reason, by = text_arg(reason, "--reason"), agent_arg(as_agent)
    eng = engine(root)
    results = do_cancel(eng, handoff_id, reason=reason, cascade=cascade, by=by)
    started = time.monotonic()
    finals: dict[str, str] = {}
    for result in results:
        if result.action != "requested" or timeout <= 0:
            continue
        left = max(timeout - (time.monotonic() - started), 0.1)
        try:
            state, doc = wait_terminal(eng.backend, result.handoff_id, left)
            # (through its format: a hi_moe answer's status is its payload's)
            finals[result.handoff_id] = (f"{state.value} (status {reported_status(doc)}) after "
                                         f"{time.monotonic() - started:.2f}s")
            result.state = state.value
        except WaitTimeout:
            finals[result.handoff_id] = f"still running after {timeout:g}s; the request stays for its owner"
    # a descendant the store would not hand over was left (a cancel request waits for it)
    partial = any(r.action == "unreadable" for r in results)
    if as_json:
        print_json([dict(r.as_dict(), final=finals.get(r.handoff_id)) for r in results])
        if partial:
            raise typer.Exit(1)
        return
    own = results[0]
    # (cleaned: a detail quotes the document's status and the lease owner's host)
    if own.action == "finished":
        print(clean(f"{handoff_id}: {own.detail}"))
    for result in results:
        if result.handoff_id == handoff_id and own.action == "finished":
            continue
        line = {"cancelled": f"cancelled ({result.detail})",
                "requested": f"cancel requested ({result.detail})",
                "finished": result.detail, "unreadable": result.detail}[result.action]
        if result.handoff_id in finals:
            line += f" -> {finals[result.handoff_id]}"
        print(clean(f"{result.handoff_id}: {line}"))
    if partial:
        raise typer.Exit(1)


# ---------------------------------------------------------------- answer
def answer(
    handoff_id: Annotated[str, typer.Argument(help="A handoff waiting on its requester.")],
    data: Annotated[Optional[str], typer.Option("--data", help="The answer as JSON.")] = None,
    input_file: Annotated[Optional[str], typer.Option("--input", help="Read the answer JSON from FILE or -.")] = None,
    as_agent: Annotated[Optional[str], typer.Option("--as", help="Who answers (default $HANDOFF_TARGET or @cli).")] = None,
    root: RootOption = None,
) -> None:
    """Answer a handoff that asked for clarification or is blocked; it goes back to pending."""
    from ..features.orchestration import answer as do_answer

    eng = engine(root)
    do_answer(eng, handoff_id, value_arg(data, input_file, eng.settings.max_document_bytes,
                                     depth_below=ANSWER_DEPTH), by=agent_arg(as_agent))
    # a database store holds the pending handoff: nothing is written to pending/ (a parked
    # copy there goes once the bridge sees the answer)
    shared = getattr(eng.backend, "shared", False)
    print(f"{handoff_id}: answered; " + ("pending again in the shared store" if shared
                                         else "back in pending/"))


# ---------------------------------------------------------------- context
def context_get(
    key: Annotated[str, typer.Argument(help="e.g. task/current-objective or project-context")],
    with_revision: Annotated[bool, typer.Option("--with-revision", help="Print {\"key\", \"revision\", \"value\"} instead of the bare value (for `set --if-revision`).")] = False,
    root: RootOption = None,
) -> None:
    """Print a context value as JSON (exit 3 if the key is not set)."""
    context_ops.get(root, key, with_revision=with_revision)


def context_set(
    key: Annotated[str, typer.Argument(help="e.g. execution/outputs/hoff-1")],
    value: Annotated[Optional[str], typer.Argument(help="The value as JSON (or use --data / --input).", show_default=False)] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="The value as JSON.")] = None,
    input_file: Annotated[Optional[str], typer.Option("--input", help="Read the value JSON from FILE or -.")] = None,
    if_revision: Annotated[Optional[int], typer.Option("--if-revision", min=0, help="Compare-and-set: write only if the key is still at revision N (0: only if it is unset); otherwise print a 'conflict:' line and exit 1 without writing.")] = None,
    as_agent: Annotated[Optional[str], typer.Option("--as", help="Write as this agent or tier (default $HANDOFF_TARGET or @cli).")] = None,
    root: RootOption = None,
) -> None:
    """Write a context value atomically, if the agent may write that namespace.

    Every key has a revision: 0 while unset, +1 per write (`handoff context get KEY --with-revision` shows it). With --if-revision N the value is written only if the key is still at revision N (compare-and-set; N = 0: only if unset).

    Exit codes: 0 written; 1 conflict (nothing written; stderr reads "handoff: error: conflict: ...": read the key again and retry) or permission denied; 2 usage error.
    """
    context_ops.put(root, key, value, data=data, input_file=input_file, if_revision=if_revision,
                    as_agent=as_agent)


def context_ls(
    prefix: Annotated[str, typer.Argument(help="Only keys starting with this.")] = "",
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """List context keys with size, last writer and time."""
    rows = context_store(root).listing(prefix)
    if as_json:
        print_json(rows)
        return
    from rich.table import Table
    from rich.text import Text
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("KEY", "NAMESPACE", "BYTES", "WRITTEN BY", "AT"):
        table.add_column(column, overflow="fold")
    for row in rows:  # (Text: a history line may hold "[/]", never read as rich markup)
        table.add_row(*(Text(clean(str(v))) for v in (
            row["key"], row["namespace"] or "-", row["bytes"], row["written_by"] or "-",
            row["written_at"] or "-")))
    console().print(table)


def context_history(
    key: Annotated[Optional[str], typer.Argument(help="Only writes of this key.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=0, help="The newest N writes (default 1000, at most 10000; stderr says when older ones were left out).")] = None,
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """The recorded context writes (who, when, size, sha256), oldest first: the newest 1000
    unless --limit says otherwise."""
    from ..core.storage import HISTORY_LIMIT
    from ..features.context import MAX_HISTORY_LIMIT
    shown = HISTORY_LIMIT if limit is None else limit
    if shown > MAX_HISTORY_LIMIT:  # each record shown is held until the history's end
        raise UsageError(f"--limit {shown} is over {MAX_HISTORY_LIMIT}")
    items, more = context_store(root).history_window(None if key is None else key_arg(key), limit=shown)
    if as_json:
        print_json(items)
    # (cleaned: a writer names itself, and the record may be edited by hand)
    for item in [] if as_json else items:
        print(clean(f"{item.get('at')}  {item.get('key')}  by {item.get('by')}  {item.get('bytes')} bytes"
                    + (f"  (handoff {item['handoff_id']})" if item.get("handoff_id") else "")))
    if more:  # on stderr: stdout stays one write per line, or one JSON array
        sys.stdout.flush()
        print(f"{PROG}: older writes not shown (--limit {shown}): raise --limit (at most "
              f"{MAX_HISTORY_LIMIT}) to list more", file=sys.stderr)


# ---------------------------------------------------------------- trace
def trace(
    handoff_id: Annotated[str, typer.Argument(help="Any handoff of the chain.")],
    as_json: JsonOption = False,
    root: RootOption = None,
) -> None:
    """Show the chain a handoff belongs to: parent, children, what it triggered, its conversation."""
    from ..features.trace import build

    data = build(engine(root, features=()), handoff_id)
    if as_json:
        print_json(data)
        return
    # every line is built from cleaned pieces (rich Text at a terminal): a conversation id such
    # as "[/bold]" or "[link=...]" is shown as written, never read as markup, and no escape
    # reaches the terminal
    title: list[Piece] = ["trace of ", (handoff_id, "bold")]
    if data["conversation"]:
        title.append(f"  conversation {data['conversation']}")
    utf = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "").startswith("utf")
    lines = [title, *tree_lines(data["trees"], handoff_id, utf=utf)]
    out = Out()
    if not out.terminal:
        for pieces in lines:
            out.line(*pieces)
        return
    printer = console()
    for pieces in lines:  # soft wrap: never folded nor cropped (the terminal wraps a long one)
        printer.print(rich_text(*pieces), soft_wrap=True)


def tree_lines(trees: list[dict[str, Any]], focus: str, *, utf: bool = True) -> list[list[Piece]]:
    """The lines of ``handoff trace`` below its title: one per node, depth first, its guides
    (rich's tree guides; ``utf`` False: rich's ASCII ones) before its label.

    A rich Tree fitted every row into the console's width: past ~48 levels (100 are shown) the
    guides filled it, rows were folded a few letters a line and the deepest nodes, with the
    "deeper than 100 levels" note, were dropped. Each row here is one line, however deep."""
    space, bar, tee, corner = ("    ", "│   ", "├── ", "└── ") if utf else \
        ("    ", "|   ", "+-- ", "`-- ")
    lines: list[list[Piece]] = []
    stack = [(node, "", i == len(trees) - 1) for i, node in reversed(list(enumerate(trees)))]
    while stack:  # (not recursive: as deep as the trace goes)
        node, prefix, last = stack.pop()
        lines.append([prefix + (corner if last else tee), *_label(node, focus)])
        below = prefix + (space if last else bar)
        children = node["children"]
        stack.extend((child, below, i == len(children) - 1)
                     for i, child in reversed(list(enumerate(children))))
    return lines


def _label(node: dict[str, Any], focus: str) -> list[Piece]:
    """One node of ``handoff trace``: its id, target, state and times, from its document."""
    marker = {"child": "", "triggered": "→ ", "upstream": "", "conversation": "~ ", "root": ""}
    state = str(node["state"])
    pieces: list[Piece] = [marker.get(node["relation"], ""),
                           (str(node["id"]), "bold underline" if node["id"] == focus else "bold"),
                           f"  {node.get('to') or '-'}  ", (state, STATE_STYLE.get(state, ""))]
    if node.get("status") and node["status"] not in (state, state.replace("-", "_")):
        pieces.append(f" ({node['status']})")
    if node.get("seconds") is not None:
        pieces.append(f"  {node['seconds']:.2f}s")
    if node.get("started_at"):
        pieces.append((f"  started {node['started_at']}", "dim"))
    if node.get("finished_at"):
        pieces.append((f"  finished {node['finished_at']}", "dim"))
    if node.get("relation") == "triggered" and node.get("depends_on"):
        pieces.append(("  (depends on it)", "dim"))
    if node.get("note"):
        pieces.append((f"  {node['note']}", "italic"))
    return pieces


# ---------------------------------------------------------------- show helpers
