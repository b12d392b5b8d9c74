"""Read-only questions about a workspace (listing, validating) for the CLI and the library API."""
from __future__ import annotations

import errno
import os
import stat
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import dialects
from ..backends.files import seals
from ..backends.files.fsio import read_bytes_safely
from ..core import ownfiles
from ..core.documents import book, is_safe_id, next_attempt_at
from ..core.errors import ErrorCode, HandoffdError, InvalidDocument, UsageError
from ..core.jsontext import parse_document
from ..core.native_format import answer_fields_lacking, stub_code, stub_problems
from ..core.states import State
from ..core.storage import FOREIGN_FILING, Row, foreign_filing, trusted_doc
from ..core.timeutil import iso
from ..core.validation import builtin_schemas, check_document
from ..dialects import Dialect
from ..features.lineage import conversation_of, parent_of

if TYPE_CHECKING:  # (`handoff show` of a handoff that is not pending builds no Engine)
    from ..core.engine import Engine
    from ..core.storage import Backend

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


class InProgress:
    """How many handoffs each specialist has in progress, as one listing sees it: in-progress/
    is read once, at the first question (a listing of many pending rows asks for each), and
    only when a row asks (a listing with no pending row of a capped specialist reads nothing)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._counts: Counter[str] | None = None

    def __call__(self, agent: str) -> int:
        """How many handoffs ``agent`` runs (the specialist that runs each, as ``ls`` routes it)."""
        if self._counts is None:
            counts: Counter[str] = Counter()
            try:
                for row in self.engine.backend.list(state=State.IN_PROGRESS):
                    doc = trusted_doc(self.engine.backend, row.state, row.id, row.doc)
                    counts[_routing(self.engine, doc)[0] or ""] += 1
            except (OSError, HandoffdError):  # a store away: no count, never a failed listing
                counts.clear()
            self._counts = counts
        return self._counts[agent]


def _routing(engine: Engine, doc: dict[str, Any]) -> tuple[str | None, str | None]:
    """(target, source) of ``doc`` as ``ls`` shows them: the target is the specialist that runs
    it (a stand-in, seed 000's tier fleet, is who runs it); (None, None) for an answer, or a
    document a reader chokes on (listed without routing)."""
    try:
        env = dialects.detect(doc).envelope(doc)
        spec = engine.specialist_for(env)
        return (spec.agent if spec else env.target), env.source
    except Exception:  # an answer, or a document a reader chokes on: listed without routing
        return None, None


def _row(engine: Engine, state: State, handoff_id: str, stored: dict[str, Any],
         updated: datetime, in_progress: InProgress) -> dict[str, Any]:
    """One ``handoff ls`` row, read from the document's trusted view: a block the store does
    not vouch for gives no attempt, dialect or error, and a finished document another consumer
    filed says so in its note. ``in_progress``: the listing's counts of running handoffs (a
    pending row of a specialist at its concurrency limit says so)."""
    doc = trusted_doc(engine.backend, state, handoff_id, stored)
    target, source = _routing(engine, doc)
    block = book(doc)
    note = (_pending_note(engine, handoff_id, doc, target, in_progress)
            if state is State.PENDING else _settled_note(state, doc))
    return {"id": handoff_id, "state": state.value, "from": source, "to": target,
            "attempt": block.get("attempt", 0), "dialect": block.get("dialect"),
            "updated": iso(updated), "note": note,
            "parent": parent_of(doc), "conversation": conversation_of(doc)}


def _settled_note(state: State, doc: dict[str, Any]) -> str:
    """The NOTE of a handoff that is not pending (``doc``: its trusted view): a failure's code
    and message, an in-progress claim's owner, a foreign filing. It asks no gate nor the
    registry: :func:`settled_note` gives it without an Engine."""
    block = book(doc)
    note = ""
    if state is State.FAILED:
        error = block.get("final_error") or (given if isinstance(given := doc.get("error"), dict) else {})
        note = f"{error.get('code', '')}: {str(error.get('message', ''))}".strip(": ")
    elif state is State.IN_PROGRESS:
        lease = given if isinstance(given := block.get("lease"), dict) else {}
        owner = lease.get("owner") or {}
        note = f"owner {owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else ""
    if foreign_filing(state, doc):
        note = f"{note}; {FOREIGN_FILING}" if note else FOREIGN_FILING
    return note


def _pending_note(engine: Engine, handoff_id: str, doc: dict[str, Any], target: str | None,
                  in_progress: InProgress) -> str:
    """Why a pending handoff is not running yet (empty when it is simply due), asked in the
    order the daemon's dispatch asks (:meth:`~handoffd.service.dispatch.Dispatcher.dispatch`):
    what it cannot read or route (an answer nobody here serves too: refused) it settles at once,
    before any due time. Asked the other way round, an answer carrying a future
    ``next_attempt_at`` was listed "scheduled for" a time the daemon never waited for."""
    peek = engine.peek(handoff_id)
    if peek is not None and not peek.readable:
        return f"{peek.problem.code}: {peek.problem}" if peek.problem else ""
    refusal = _refused_at_claim(engine, handoff_id, doc)
    if refusal is not None:
        return f"{refusal.code}: {refusal}"
    due = next_attempt_at(doc)
    if due is not None and due > engine.clock():
        retries = book(doc).get("retries", 0)
        return f"retry {retries} at {iso(due)}" if retries else f"scheduled for {iso(due)}"
    if target and engine.registry.get(target) is None:
        if getattr(engine.backend, "shared", False):  # (a store several hosts serve)
            return (f"waiting: no specialist registered for {target} here (it may be another "
                    "host's work)")
        return f"waiting: no specialist registered for {target}"
    try:
        verdict = engine.gate(peek) if peek is not None else None
    except Exception as exc:  # a gate reading a broken dependency must not break the listing
        return f"cannot check its gates: {type(exc).__name__}: {str(exc)[:200]}"
    if verdict is None:  # (due, served and through the gates: its claim would check it)
        unfit = _answer_unfit(engine, handoff_id, doc)
        return f"{unfit.code}: {unfit}" if unfit else _concurrency_note(engine, target, in_progress)
    return verdict.reason if verdict.action == "wait" else f"will fail: {verdict.reason}"


def _refused_at_claim(engine: Engine, handoff_id: str, doc: dict[str, Any]) -> \
        InvalidDocument | None:
    """What the claim of a readable pending document refuses it for: a seed-001 answer, which
    the daemon's peek refuses only when nobody here serves its target (asked there off the
    path of every handoff that runs), is refused by its claim whatever its target: `ls` said
    nothing of one whose target a specialist here serves. Asked for `ls` only."""
    try:
        refuse = getattr(engine.formats.detect(doc), "refuse_unclaimed", None)
        if refuse is not None:
            refuse(doc, handoff_id)
    except InvalidDocument as exc:
        return exc if exc.code == ErrorCode.NOT_A_REQUEST else None
    except Exception:  # (a reader choking on a hostile document: the peek said what it could)
        return None
    return None


def _answer_unfit(engine: Engine, handoff_id: str, doc: dict[str, Any]) -> InvalidDocument | None:
    """What the claim of a pending seed-001 document whose status only an answer has, without
    that answer's fields (:func:`~handoffd.core.native_format.answer_fields_lacking`), files it
    for: its answer's schema check fails (SCHEMA_VALIDATION_FAILED), said as that check says it,
    with why. A whole answer was noted NOT_A_REQUEST, this one nothing. Asked for `ls` only,
    and the schema checked only for such a document (a request costs one dict look-up), once
    nothing keeps it waiting: it is checked when it is claimed, and a wait's note (a target
    nobody here serves, a dependency) is what holds it till then (RF)."""
    lacking = answer_fields_lacking(doc)
    if not lacking:
        return None
    try:
        dialect = engine.formats.detect(doc)
        if dialect.name != "native":
            return None
        engine.validate(doc, dialect, handoff_id=handoff_id,
                        subject=f"{handoff_id} has {lacking}: read as one when claimed, it is not "
                                "a valid one")
    except InvalidDocument as exc:
        if exc.code != ErrorCode.SCHEMA_VALIDATION_FAILED:
            return None
        # (what to do at the end, kept by the table's cut as NOT_A_REQUEST's is)
        return InvalidDocument(f"{exc}; submit the request instead (status pending)",
                               handoff_id=handoff_id, code=exc.code)
    except Exception:  # (a schema that cannot be used: the daemon says what it can)
        return None
    return None  # (a workspace schema that takes it: its claim runs it)


def _concurrency_note(engine: Engine, target: str | None, in_progress: InProgress) -> str:
    """Why a due handoff waits for a slot: every one its specialist's ``concurrency`` allows is
    taken by a handoff in progress (empty otherwise). A daemon keeps the cap per process, so
    with several daemons more may run than the cap: the note then says how many."""
    spec = engine.registry.get(target) if target else None
    if spec is None or not spec.config.concurrency:
        return ""  # (no cap: as many as a daemon has workers, which ls cannot know)
    limit, running = spec.config.concurrency, in_progress(spec.agent)
    if running < limit:
        return ""
    held = f"{running} of {limit} in progress" if running == limit \
        else f"{running} in progress, {limit} per daemon"
    return f"waits: {spec.agent} runs its concurrency limit ({held})"


def note_of(engine: Engine, state: State, handoff_id: str, doc: dict[str, Any]) -> str:
    """The NOTE ``handoff ls`` gives ``doc`` (read from ``state``): why a pending handoff waits
    (the engine's gates: install them first), a failure's code and message, an in-progress
    claim's owner, a foreign filing. ``handoff show`` prints it too."""
    try:
        return str(_row(engine, state, handoff_id, doc, engine.clock(), InProgress(engine))["note"])
    except Exception:  # one document a reader chokes on: no note, never a failed show
        return ""


def settled_note(backend: Backend, state: State, handoff_id: str, doc: dict[str, Any]) -> str:
    """:func:`note_of` for a handoff that is not pending, read from ``backend`` without an
    Engine (``handoff show``: building one, its registry and its hooks, was most of a show's
    own start-up). For a pending one, use :func:`note_of` (its gates say why it waits)."""
    if state is State.PENDING:
        raise ValueError("a pending handoff's note asks the engine's gates: use note_of")
    try:
        return _settled_note(state, trusted_doc(backend, state, handoff_id, doc))
    except Exception:  # one document a reader chokes on: no note, never a failed show
        return ""


def _unreadable_row(state: State, handoff_id: str, note: str) -> dict[str, Any]:
    return {"id": handoff_id, "state": state.value, "from": None, "to": None, "attempt": 0,
            "dialect": None, "updated": None, "note": note}


def list_handoffs(engine: Engine, *, state: str | None = None, to: str | None = None,
                  source: str | None = None, limit: int = 50, conversation: str | None = None,
                  before_pending: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Newest-first rows describing handoffs (and quarantined files), filtered.
    ``before_pending``: called once before the first pending row is described (only a pending
    row's note asks the features' gates: a caller may install them then, not before)."""
    described: dict[tuple[str, State], dict[str, Any]] = {}
    hooks = [before_pending] if before_pending else []
    in_progress = InProgress(engine)  # (in-progress/ read once for every row, if asked)

    def wanted(row: Row) -> bool:
        if row.state is State.PENDING and hooks:
            hooks.pop()()
        try:
            shown = _row(engine, row.state, row.id, row.doc, row.updated_at, in_progress)
        except Exception as exc:  # one document a reader chokes on is a row, never a failure
            shown = _unreadable_row(row.state, row.id, f"{ErrorCode.UNPROCESSABLE_DOCUMENT}: "
                                    f"{row.state.value}/{row.id}.json could not be processed: "
                                    f"{type(exc).__name__}: {str(exc)[:200]}")
            described[(row.id, row.state)] = shown
            return not conversation
        described[(row.id, row.state)] = shown
        return not ((to and shown["to"] != to) or (source and shown["from"] != source)
                    or (conversation and shown["conversation"] != conversation))

    wanted_state = next((s for s in State if s.value == state), None)
    if state is not None and wanted_state is None and state != "quarantined":
        # an unknown state listed nothing, as if the queue were empty (the MCP list_handoffs,
        # Client.list): refused as `handoff ls --state` refuses it
        known = ", ".join([s.value for s in State] + ["quarantined"])
        raise UsageError(f"state must be one of {known}; not {state!r}")
    rows: list[dict[str, Any]] = []
    if state is None or wanted_state is not None:
        for row in engine.backend.list(state=wanted_state, limit=limit, where=wanted,
                                       unreadable=not conversation):
            if row.problem is not None:
                problem = row.problem
                code = getattr(problem, "code", ErrorCode.UNREADABLE_FILE)
                note = (f"{code}: unreadable: {str(problem)[:200]}" if getattr(problem, "claimable", False)
                        else f"{code}: {problem}")
                rows.append(_unreadable_row(row.state, row.id, note))
            else:
                rows.append(described[(row.id, row.state)])
    if state in (None, "quarantined") and not to and not source and not conversation:
        # the newest ``limit`` of them (oldest first as stored), newest first as every row;
        # ``[-0:]`` would have been all of them for --limit 0, which lists nothing
        for item in reversed(engine.backend.quarantined()[-limit:] if limit > 0 else []):
            rows.append({"id": item.get("stored_as"), "state": "quarantined", "from": None, "to": None,
                         "attempt": 0, "dialect": None, "updated": item.get("at"),
                         "note": f"{item.get('code')}: {str(item.get('message', ''))}"})
    return rows[:limit] if state != "quarantined" else rows


def validate_document(engine: Engine | None, doc: dict[str, Any], dialect: Dialect) -> None:
    """Raise InvalidDocument (with every error) unless ``doc`` is valid in ``dialect`` and, in
    a workspace (``engine``), its input passes the checks a daemon there makes before its
    handler runs (:func:`check_request_input`)."""
    check_document(engine.schemas if engine else builtin_schemas(), dialect, doc)
    if not getattr(dialect, "is_answer", lambda _doc: False)(doc):  # answers are not routed
        envelope = dialect.envelope(doc)
        if engine is not None:
            check_request_input(engine, envelope)


def check_request_input(engine: Engine, envelope: Any) -> None:
    """What the workspace's daemon checks of a request before its handler runs, by its own
    check (:meth:`JobChecks.check_input <handoffd.core.results.JobChecks.check_input>`): its
    input data against the input schema (the target specialist's ``input_schema``, else the
    request's ``input.schema``), and that each schema the request names (``input.schema``,
    ``expected_output.schema``) exists as a plain name in schemas/ or built in. InvalidDocument
    (SCHEMA_VALIDATION_FAILED) when the daemon would fail it; with ``[daemon] expectations =
    "advisory"`` a missing named schema is only a warning (logged as the daemon logs it). A
    schema that cannot be used is InvalidDocument too (the daemon files PROCESSING_ERROR). The
    output itself is checked after a run, so never here."""
    from ..core.errors import ConfigError
    spec = engine.specialist_for(envelope)  # None: no specialist here (only what it names)
    try:
        engine.checks.check_request(envelope.handoff_id, envelope,
                                    spec.config.input_schema if spec else None, [])
    except ConfigError as exc:
        raise InvalidDocument(f"its input cannot be checked: {exc}",
                              handoff_id=envelope.handoff_id,
                              code=ErrorCode.PROCESSING_ERROR) from None


def validate_files(files: list[Path], engine: Engine | None, *, forced: str | None = None,
                   root: Path | None = None) -> list[dict[str, Any]]:
    """Validate each file; one result dict per file (``valid``, ``dialect``, ``headline``,
    ``errors``). Without ``engine`` (no workspace at ``root``), a request that names schemas is
    not called valid: those are found in a workspace's schemas/, so the item lists them under
    ``unchecked`` (a bare "valid" would claim checks that were not made)."""
    results = []
    limit = engine.settings.max_document_bytes if engine else DEFAULT_MAX_BYTES
    for path in files:
        item: dict[str, Any] = {"file": str(path), "valid": False, "dialect": None, "headline": "",
                                "errors": []}
        doc: dict[str, Any] | None = None
        stub: str | None = None
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # (a folder, a FIFO, /dev/null: no
                # document to call invalid: the argument's fault, as an unreadable file's)
                raise OSError(errno.EINVAL, "not a regular file (a folder, a FIFO, a device?)")
            raw, _ = read_bytes_safely(path, limit)
            doc = parse_document(raw, str(path))
            dialect = dialects.detect(doc, forced)
            item["dialect"] = dialect.name
            stub = filed_stub(engine, doc, dialect)
            if stub is not None and engine is not None:  # handoffd's own record of a file
                validate_stub(engine, doc, dialect, stub)  # set aside: no request in it
                item.update(valid=True, stub=stub)
            else:
                validate_document(engine, doc, dialect)
                named = [] if engine is not None else named_schemas(doc, dialect)
                if named:
                    _unchecked(item, named, root)
                else:
                    item["valid"] = True
        except InvalidDocument as exc:
            shaped = stub is None and doc is not None and stub_code(doc) is not None
            item["headline"] = str(exc) + (_stub_hint(engine) if shaped else "")
            # (every entry has a schema_path: a missing named schema's entry has none)
            item["errors"] = [{**e, "schema_path": e.get("schema_path", "")} for e in exc.errors] \
                or [{"field": "$", "error": str(exc), "schema_path": ""}]
        except KeyError as exc:
            item["headline"] = str(exc.args[0]) if exc.args else str(exc)
            item["errors"] = [{"field": "$", "error": item["headline"], "schema_path": ""}]
        except OSError as exc:  # (no document to judge: the argument's fault, not the file's)
            item["headline"] = f"cannot read: {exc.strerror or exc}"
            item["errors"] = [{"field": "$", "error": item["headline"], "schema_path": ""}]
            item["unreadable"] = "missing" if isinstance(exc, FileNotFoundError) else "unreadable"
        results.append(item)
    return results


def filed_stub(engine: Engine | None, doc: dict[str, Any], dialect: Dialect) -> str | None:
    """The code of the failure stub ``doc`` is (:func:`~handoffd.core.native_format.stub_code`)
    when the seal of ``engine``'s workspace says handoffd filed it in failed/; None otherwise: no
    workspace (no seal to check), another format, no stub, or a ``handoffd`` block handoffd did
    not seal (a document from outside that merely lacks a target is validated as any other).

    The seal is checked here, not through the store: a database store vouches for every block,
    while the stubs are files of this workspace, which its files store and the PostgreSQL
    bridge both seal with this workspace's key."""
    if engine is None or dialect.name != "native":
        return None
    code = stub_code(doc)
    handoff_id = doc.get("handoff_id")
    if code is None or not isinstance(handoff_id, str) or not is_safe_id(handoff_id):
        return None
    key = _seal_key(engine.ws.meta / seals.KEY_NAME)
    return code if seals.own_block(key, doc, handoff_id, (State.FAILED.value,)) else None


def _seal_key(path: Path) -> bytes | None:
    """The workspace's seal key if there is a usable one: never made here (validating writes
    nothing), and a missing or unusable key vouches for no document."""
    try:
        key = ownfiles.read_regular(path, seals.MAX_KEY_BYTES).strip()
    except OSError:
        return None
    return key if len(key) >= 32 else None


def validate_stub(engine: Engine, doc: dict[str, Any], dialect: Dialect, code: str) -> None:
    """Raise InvalidDocument (every error) unless the failure stub ``doc``, filed with ``code``,
    keeps the rules for a stub (:func:`~handoffd.core.native_format.stub_problems`) and the
    native failure schema. It is never routed, so it needs no target and no input check."""
    problems = stub_problems(doc, code)
    if problems:
        first = problems[0]
        raise InvalidDocument(f"not a valid failure stub: {first['field']}: {first['error']}",
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED, errors=problems)
    check_document(engine.schemas, dialect, doc, subject="not a valid failure stub")


def _stub_hint(engine: Engine | None) -> str:
    """Why a document whose ``handoffd`` block calls it a failure stub was not taken for one."""
    why = ("there is no workspace here to check its seal: --root names the one that filed it"
           if engine is None else f"the seal of the workspace at {engine.ws.root} does not "
           "vouch for it")
    return f" (its handoffd block calls it a failure stub, but {why})"


def named_schemas(doc: dict[str, Any], dialect: Dialect) -> list[tuple[str, str]]:
    """(field, name) of each schema the request ``doc`` names (seed 001's ``input.schema``,
    ``expected_output.schema``); none for an answer, which is not routed."""
    if getattr(dialect, "is_answer", lambda _doc: False)(doc):
        return []
    envelope = dialect.envelope(doc)
    return [(f, n) for f, n in (("input.schema", envelope.input_schema),
                                ("expected_output.schema", envelope.output_schema)) if n]


def _unchecked(item: dict[str, Any], named: list[tuple[str, str]], root: Path | None) -> None:
    """Mark ``item`` as not checked for want of a workspace: one error entry per named schema."""
    where = root if root is not None else "--root"
    more = f" (and {len(named) - 1} more)" if len(named) > 1 else ""
    item.update(valid=False, unchecked=[n for _, n in named], headline=(
        f"{named[0][0]} names {named[0][1]!r}{more}, but there is no workspace at {where} to "
        "find it in (--root DIR names one)"),
        errors=[{"field": f, "error": f"{n} not checked: no workspace at {where}",
                 "schema_path": ""} for f, n in named])
