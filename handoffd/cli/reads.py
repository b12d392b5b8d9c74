"""What ``handoff show``, ``ls`` and ``wait`` do and print, without typer: the quick path
(:mod:`handoffd.cli.quick`) and the full command line (:mod:`handoffd.cli.handoff_cmd`) both
call these, so the two cannot drift apart."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..core.errors import NotFound, UsageError
from ..core.states import State
from .basics import PROG, backend, open_workspace, opened_store
from .render import Out, clean, handoff_rows, print_json, state_cell, timeline_rows

if TYPE_CHECKING:
    from ..core.config import Config
    from ..core.engine import Engine
    from ..core.storage import Backend
    from ..core.workspace import Workspace

EXIT_AWAITING_ANSWER = 4  # `wait`: the handoff asks its requester (needs_clarification, blocked)
DEFAULT_LIMIT = 50  # `handoff ls` without --limit lists the newest 50 rows
STATES = [s.value for s in State] + ["quarantined"]
Opened = TypeVar("Opened")  # what open_within opens (a store, an engine)
# open_within starts no connection attempt with less time left than this: libpq's shortest
# attempt (psycopg enforces 2 s) then ends at most a second past the command's --timeout
LAST_TRY_SECONDS = 1.0


# ---------------------------------------------------------------- show
def show(root: str | Path | None, handoff_id: str, *, as_json: bool) -> None:
    """``handoff show``: a handoff's document, its history and its family (or its archive
    entry once retention archived it). What it reads of the ``handoffd`` bookkeeping is what
    the store vouches for (see :func:`handoffd.core.storage.trusted_doc`): a block dropped in
    by hand, or a finished document another consumer filed, shows no history as handoffd's.
    It reads the store without an Engine (its registry, hooks and run-time code are the bulk of
    what building one loads): only a pending handoff's note asks one (see :func:`show_note`)."""
    from ..core.storage import foreign_filing, get_handoff
    ws, config, store = opened_store(root)
    try:
        state, doc = get_handoff(store, handoff_id)  # the trusted view
    except NotFound:
        if show_archived(ws, store, handoff_id, as_json=as_json):
            return
        raise
    foreign = foreign_filing(state, doc)
    note = show_note(ws, config, store, state, handoff_id, doc)
    if as_json:
        print_json({"id": handoff_id, "state": state.value, "note": note, "document": doc,
                    "family": family(store, handoff_id, doc), "foreign_filing": foreign})
        return
    out = Out()
    path = document_path(store, state, handoff_id)
    out.line((handoff_id, "bold"), "  state: ", (state.value, "bold"),
             f"  file: {path}" if path else "  ")
    if note:
        out.line(f"note: {note}")
    print_family(out, store, handoff_id, doc)  # parent, children, waiting
    print_document(out, doc, foreign=foreign)


def show_note(ws: "Workspace", config: "Config", store: "Backend", state: State,
              handoff_id: str, doc: dict[str, Any]) -> str:
    """The NOTE ``handoff ls`` would give the handoff (why a pending one waits: its dependencies,
    a pause, its specialist's rate or concurrency, no specialist; a failure's code). An Engine
    on ``store``, with the features' gates, is built only for a pending handoff, as ``ls``
    installs the gates only for a pending row; any other note is read from the document."""
    from ..service.queries import note_of, settled_note
    if state is not State.PENDING:
        return settled_note(store, state, handoff_id, doc)
    from ..features.build import GATES, build_engine
    eng = build_engine(ws, config, backend=store, features=GATES.values())
    return note_of(eng, state, handoff_id, doc)


def show_archived(ws: "Workspace", store: "Backend", handoff_id: str, *, as_json: bool) -> bool:
    """``handoff show`` of a handoff retention archived; False when there is no such entry.
    The archived document is read by the rule the store reads its documents by."""
    from ..core.documents import BOOK
    from ..core.storage import foreign_filing
    from ..features.archive import entry_document, find_archived
    entry = find_archived(ws, handoff_id)
    if entry is None:
        return False
    found = entry_document(store, handoff_id, entry)
    kept = entry.get("document")
    # (an entry that is no finished document: shown, without any bookkeeping)
    doc = found[1] if found else {k: v for k, v in kept.items() if k != BOOK} \
        if isinstance(kept, dict) else {}
    foreign = found is not None and foreign_filing(*found)
    if as_json:
        print_json({"id": handoff_id, "state": entry.get("state"), "archived": True,
                    "archived_at": entry.get("archived_at"), "document": doc,
                    "foreign_filing": foreign})
        return True
    out = Out()
    out.line((handoff_id, "bold"), "  state: ", (str(entry.get("state")), "bold"),
             f"  archived at {entry.get('archived_at')}")
    print_document(out, doc, foreign=foreign)
    return True


def print_document(out: Out, doc: dict[str, Any], *, foreign: bool = False) -> None:
    """The history timeline (bounded as the daemon bounds it), then the document without
    handoffd's bookkeeping. A foreign filing has no history of ours: it is said so instead."""
    from ..core.documents import BOOK, book
    from ..core.storage import FOREIGN_FILING
    if foreign:
        out.line(FOREIGN_FILING)
    else:
        history, left_out = shown_history(book(doc).get("history", []))
        title = "history" if not left_out else f"history ({left_out} earlier entries not shown)"
        out.table(*timeline_rows(history), title=title)
    out.json({k: v for k, v in doc.items() if k != BOOK})


def shown_history(history: Any) -> tuple[list[Any], int]:
    """The history entries ``handoff show`` prints and how many it leaves out: at most
    MAX_HISTORY, the first and the most recent, as the daemon keeps them (a sealed block written
    by whoever holds the workspace's key may hold any number)."""
    from ..core.documents import MAX_HISTORY
    if not isinstance(history, list):
        return [], 0
    if len(history) <= MAX_HISTORY:
        return history, 0
    return history[:1] + history[len(history) - MAX_HISTORY + 1:], len(history) - MAX_HISTORY


def document_path(store: "Backend", state: State, handoff_id: str) -> Path | None:
    """Where the file store keeps the document (None for another store)."""
    from ..backends.files import FilesBackend
    store = getattr(store, "inner", store)  # (under the event log's recorder, an engine's)
    return store.store.path(state, handoff_id) if isinstance(store, FilesBackend) else None


def family(store: "Backend", handoff_id: str, doc: dict[str, Any]) -> dict[str, Any]:
    """Parent, conversation and children (with their states) of a handoff, for ``handoff show``."""
    from ..core.storage import get_handoff
    from ..features.lineage import children_of, conversation_of, parent_of
    kids = []
    for kid in children_of(doc):
        try:
            state, kid_doc = get_handoff(store, kid)
            status = kid_doc.get("status")
            target = kid_doc["target"].get("agent_id") if isinstance(kid_doc.get("target"), dict) else None
        except NotFound:
            state, status, target = None, None, None
        kids.append({"id": kid, "state": state.value if isinstance(state, State) else "missing",
                     "status": status, "to": target})
    block = given if isinstance(given := doc.get("handoffd"), dict) else {}  # a trusted view's
    return {"parent_id": parent_of(doc), "conversation_id": conversation_of(doc), "children": kids,
            "waiting_children": block.get("waiting_children"), "awaiting": block.get("awaiting"),
            "aggregated_outcome": block.get("aggregated_outcome")}


def print_family(out: Out, store: "Backend", handoff_id: str, doc: dict[str, Any]) -> None:
    """The family lines of ``handoff show`` (nothing for a handoff with no relations)."""
    fam = family(store, handoff_id, doc)
    if fam["parent_id"] or fam["conversation_id"]:
        out.line(f"parent: {fam['parent_id'] or '-'}  conversation: {fam['conversation_id'] or '-'}")
    aw = fam["awaiting"]
    if isinstance(aw, dict):
        out.line(f"waiting on the requester ({aw.get('kind')}): "
                 + "; ".join(map(str, asked(aw)))[:500])
    if not fam["children"]:
        return
    out.table(["ID", "TO", "STATE", "STATUS"],
              [[kid["id"], kid["to"] or "-", state_cell(kid["state"]), str(kid["status"] or "-")]
               for kid in fam["children"]], title="children")
    agg = fam["aggregated_outcome"]
    if isinstance(agg, dict):
        out.line(f"aggregated ({agg.get('strategy_used')}): {agg.get('aggregated_status')}, "
                 f"confidence {agg.get('aggregated_confidence')}")
    elif isinstance(fam["waiting_children"], dict):
        out.line(f"waiting for children ({fam['waiting_children'].get('aggregation')})")


# ---------------------------------------------------------------- ls
def check_state(state: str | None) -> None:
    """UsageError unless ``state`` is a state ``handoff ls --state`` knows."""
    if state is not None and state not in STATES:
        raise UsageError(f"--state must be one of {', '.join(STATES)}")


def list_rows(eng: "Engine", *, state: str | None = None, to: str | None = None,
              source: str | None = None, limit: int = DEFAULT_LIMIT,
              conversation: str | None = None,
              before_pending: Callable[[], None] | None = None,
              ) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of ``handoff ls``, newest first (``before_pending``: see list_handoffs), and
    the line that says how many more ``limit`` left out (None when it left none out)."""
    from ..service.queries import list_handoffs
    check_state(state)
    filtered = bool(to or source or conversation)
    # rows a filter keeps cannot be counted without reading every document: one row past the
    # limit, in the same pass, says whether there are more (a second pass read them all again)
    asked = limit + 1 if filtered and limit > 0 else limit
    rows = list_handoffs(eng, state=state, to=to, source=source, limit=asked,
                         conversation=conversation, before_pending=before_pending)
    if filtered:
        more = len(rows) > limit
        return rows[:limit], (f"{PROG}: more not shown (--limit {limit}): raise --limit to "
                              "list them" if more else None)
    if len(rows) < limit:  # (fewer than asked for: nothing was left out)
        return rows, None
    total = count_rows(eng, state)
    if total <= len(rows):
        return rows, None
    return rows, (f"{PROG}: {total - len(rows):,} more not shown (--limit {limit}): "
                  f"--limit {total} lists them all")


def count_rows(eng: "Engine", state: str | None) -> int:
    """How many rows ``handoff ls --state STATE`` would list without a limit: the ids in that
    state (in every state, and the quarantined files, for None), counted without reading a
    document."""
    store = eng.backend
    if state == "quarantined":
        return len(store.quarantined())
    if state is not None:
        return len(store.ids(State(state)))
    return sum(len(store.ids(one)) for one in State) + len(store.quarantined())


def print_rows(rows: list[dict[str, Any]], *, as_json: bool, note: str | None = None,
               ws: Workspace | None = None) -> None:
    """``handoff ls``'s output: the table, or the rows as JSON; then on stderr, so that stdout
    stays one row per line, or one JSON array: ``note`` (what the limit left out) and, given
    the workspace ``ws``, a line when a daemon serving it started with an older handoffd.toml
    (:func:`~handoffd.service.daemon_records.stale_line`: its log alone said so)."""
    if as_json:
        print_json(rows)
    else:
        Out().table(*handoff_rows(rows))
    from ..service.daemon_records import stale_line
    lines = [note, stale_line(ws, PROG) if ws is not None else None]
    if any(line is not None for line in lines) and sys.stdout is not None:
        # (None: started with it closed, as a library's caller may)
        sys.stdout.flush()  # (the notes come after the table at a terminal)
    for line in lines:
        if line is not None:
            print(line, file=sys.stderr)


# ---------------------------------------------------------------- wait
def wait(root: str | Path | None, handoff_id: str, timeout: float | None, *,
         as_json: bool) -> int:
    """``handoff wait``: block until the handoff is finished or asks its requester; the exit
    code (0 completed, 1 failed, 4 awaiting an answer; WaitTimeout after ``timeout``)."""
    from ..service.waiting import dropped_here, wait_terminal
    # (a store away at the start ends as one lost midway: at the timeout, exit 124)
    store, timeout = open_within(timeout, f"handoff {handoff_id}: no answer",
                                 lambda: backend(root))
    quiet_reconnects(store)
    looked = dropped_here(store, open_workspace(root))  # (a file being written is on its way)
    try:  # the store hands out trusted views: the exit code is the folder's
        state, doc = wait_terminal(looked, handoff_id, timeout, or_awaiting=True)
    except NotFound:  # finished, and archived since (retention): its archived answer
        found = archived_state(root, store, handoff_id)
        if found is None:
            raise
        state, doc = found
    return report_wait(handoff_id, state, doc, as_json=as_json)


def open_within(timeout: float | None, gave_up: str,
                opener: Callable[[], Opened]) -> tuple[Opened, float | None]:
    """``(opener(), the seconds left of timeout)``: the store (or an engine on it) for a wait
    of at most ``timeout`` seconds. A store that cannot be reached now (a StoreError whose
    ``unreachable`` says why: a database restarting) is tried again, with backoff, until the
    time is up; then WaitTimeout (exit 124), ``gave_up`` and why, as a wait that lost the store
    midway ends (it exited 1 at once). Each connection attempt is bounded by the time left (a
    path that drops packets once held it for the store's whole connect timeout, 10 s), and
    none starts with less than LAST_TRY_SECONDS left (libpq's shortest attempt is 2 s): the
    call ends within ``timeout`` plus a second. None: one try, errors as they are."""
    import time

    from ..core.errors import HandoffdError, WaitTimeout
    from ..core.timeutil import connecting_within
    ends = time.monotonic() + (timeout or 0.0)
    pause, retried = 0.1, False
    while True:
        try:  # (a connection attempt ends with the time left, at least 1 s: libpq's unit)
            with connecting_within(None if timeout is None else ends - time.monotonic()):
                opened = opener()
        except HandoffdError as exc:
            why = getattr(exc, "unreachable", None)
            left = ends - time.monotonic()
            if timeout is None or not isinstance(why, str):
                raise
            time.sleep(max(min(pause, left), 0.0))
            if ends - time.monotonic() < LAST_TRY_SECONDS:  # (the rest slept out first)
                time.sleep(max(ends - time.monotonic(), 0.0))
                raise WaitTimeout(f"{gave_up} within {timeout:g}s: {why}") from None
            pause, retried = min(pause * 2, 2.0), True  # (the store's own reconnect backoff)
            continue
        if not retried or timeout is None:  # opened at once: the whole time is the wait's
            return opened, timeout
        return opened, round(max(ends - time.monotonic(), 0.0), 1)


def quiet_reconnects(store: Any) -> None:
    """A store that can be away (PostgreSQL) logs losing and regaining the database at debug
    level: a wait's last line says so itself (as a daemon's log, they were lines of their own,
    without the ``handoff:`` prefix, before the wait's error)."""
    quiet = getattr(store, "quiet_reconnects", None)
    if callable(quiet):
        quiet()


def archived_state(root: str | Path | None, store: "Backend",
                   handoff_id: str) -> tuple[State, dict[str, Any]] | None:
    """(state, trusted view of the document) of a finished handoff retention archived, or None."""
    from ..features.archive import find_archived_document
    return find_archived_document(open_workspace(root), store, handoff_id)


def report_wait(handoff_id: str, state: State, doc: dict[str, Any], *, as_json: bool) -> int:
    """Print what a wait ended on; return its exit code (from ``state``, the folder, alone)."""
    from ..service.waiting import awaiting_answer
    awaiting = awaiting_answer(state, doc)
    if awaiting is not None:  # reported up at once (seed 000), in the document's own format
        if as_json:
            print_json(awaiting.get("outcome") or awaiting)
        else:
            print(f"{handoff_id} {clean(str(awaiting.get('kind', 'awaiting')))[:60]}")
            print(asked_line(handoff_id, awaiting), file=sys.stderr)
        return EXIT_AWAITING_ANSWER
    if as_json:
        print_json(doc)
    else:
        print(f"{handoff_id} {state.value}")
        say_failure(handoff_id, state, doc)  # why, on stderr (stdout keeps the one line)
    return exit_for(state)


def say_failure(handoff_id: str, state: State, doc: dict[str, Any]) -> None:
    """When a wait ended failed (``handoff wait``, ``create --wait``): one stderr line,
    ``handoff: ID: CODE: message``, the message's control characters shown escaped."""
    if state is State.FAILED:
        print(f"{PROG}: {handoff_id}: {failure_line(state, doc)}", file=sys.stderr)


def exit_for(state: State) -> int:
    """The exit code of a wait that ended in ``state``."""
    return 0 if state is State.COMPLETED else 1


def asked(awaiting: dict[str, Any]) -> list[Any]:
    """The questions, or the blockers' descriptions, a parked handoff asks."""
    return awaiting.get("questions") or [b.get("description") for b in
                                         awaiting.get("blockers") or [] if isinstance(b, dict)]


def asked_line(handoff_id: str, awaiting: dict[str, Any]) -> str:
    """One stderr line: what a parked handoff asks, and how to answer."""
    # the specialist's words, one line with its control characters shown (as ls and show do):
    # a terminal must not take escapes from them, nor a script a line that looks like ours
    said = clean("; ".join(map(str, asked(awaiting)))[:500])
    return f"{PROG}: {handoff_id} waits for an answer: {said} (`handoff answer {handoff_id} --data JSON`)"


def failure_line(state: State, doc: dict[str, Any]) -> str:
    """``CODE: message`` of a filed failure (a trusted view), whatever its format: the
    bookkeeping's copy, else the document's own ``error`` (a stub filed for a document set
    aside, or a failure another consumer filed: then said so)."""
    from ..core.storage import FOREIGN_FILING, foreign_filing
    book = doc.get("handoffd")
    final = book.get("final_error") if isinstance(book, dict) else None
    if not isinstance(final, dict):
        final = doc.get("error") if isinstance(doc.get("error"), dict) else None
    said = "no error recorded" if not isinstance(final, dict) else \
        f"{final.get('code') or 'ERROR'}: {str(final.get('message') or '')[:500]}"
    return clean(f"{said}; {FOREIGN_FILING}" if foreign_filing(state, doc) else said)
