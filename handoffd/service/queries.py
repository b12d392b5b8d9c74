"""Read-only questions about a workspace (listing, validating) for the CLI and the library API."""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import dialects
from ..backends.files.fsio import parse_document, read_bytes_safely
from ..core.documents import book, next_attempt_at
from ..core.engine import Engine
from ..core.errors import ErrorCode, InvalidDocument
from ..core.states import State
from ..core.timeutil import iso
from ..core.validation import SchemaCache
from ..dialects import Dialect
from ..features.lineage import conversation_of, parent_of

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# errors that say "not now" rather than "never": a file hit by them is looked at again later,
# never set aside
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR,
                              errno.ENOBUFS, errno.ESTALE, errno.EBUSY})


@dataclass
class ReadProblem:
    """Why a pending file cannot be read or routed.

    ``claimable``: an InvalidDocument, which claiming the file sets aside with ``code`` itself (it
    knows about half-written files). Otherwise ``transient`` says whether to look again later, and
    a problem that is neither (an OS refusal such as ENXIO or EACCES, or a reader crashing on the
    content) means the file must be set aside without being claimed."""

    code: str
    message: str
    claimable: bool = False
    transient: bool = False


def read_error(path: Path, exc: BaseException) -> ReadProblem:
    """Describe an unexpected error met while reading or routing the document at ``path``."""
    where = f"{path.parent.name}/{path.name}"
    if isinstance(exc, InvalidDocument):
        return ReadProblem(exc.code, str(exc), claimable=True)
    if isinstance(exc, OSError):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):  # a socket or device: open() fails (ENXIO) before fstat sees it
            kind = "socket" if stat.S_ISSOCK(mode) else "special file"
            return ReadProblem(ErrorCode.NOT_A_REGULAR_FILE,
                               f"{where} is a {kind}; documents must be regular files")
        name = errno.errorcode.get(exc.errno or 0, "error")
        return ReadProblem(ErrorCode.UNREADABLE_FILE, f"{where} cannot be read: {exc.strerror or exc} "
                           f"({name})", transient=exc.errno in TRANSIENT_ERRNOS)
    hint = " (it nests too deeply)" if isinstance(exc, RecursionError) else ""
    return ReadProblem(ErrorCode.UNPROCESSABLE_DOCUMENT, f"{where} could not be processed{hint}: "
                       f"{type(exc).__name__}: {str(exc)[:200]}")


def pending_problem(engine: Engine, handoff_id: str) -> ReadProblem | None:
    """Why ``pending/<handoff_id>.json`` cannot be read and routed; None when it can (or is gone).
    Never raises: it is what the daemon and ``handoff ls`` ask when :meth:`Engine.peek` says
    ``readable=False``."""
    path = engine.store.path(State.PENDING, handoff_id)
    try:
        doc = engine.store.read(State.PENDING, handoff_id)
        dialects.detect(doc).envelope(doc)
        next_attempt_at(doc)
    except FileNotFoundError:
        return None
    except Exception as exc:  # whatever it is, it is described, never raised
        return read_error(path, exc)
    return None


def _row(engine: Engine, state: State, handoff_id: str, doc: dict[str, Any], mtime: float) -> dict[str, Any]:
    target: str | None
    source: str | None
    try:
        dialect = dialects.detect(doc)
        env = dialect.envelope(doc)
        target, source = env.target, env.source
    except Exception:  # an answer, or a document a reader chokes on: listed without routing
        target = source = None
    block = book(doc)
    note = ""
    if state is State.PENDING:
        note = _pending_note(engine, handoff_id, doc, target)
    elif state is State.FAILED:
        error = block.get("final_error") or (given if isinstance(given := doc.get("error"), dict) else {})
        note = f"{error.get('code', '')}: {str(error.get('message', ''))}".strip(": ")
    elif state is State.IN_PROGRESS:
        lease = given if isinstance(given := block.get("lease"), dict) else {}
        owner = lease.get("owner") or {}
        note = f"owner {owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else ""
    return {"id": handoff_id, "state": state.value, "from": source, "to": target,
            "attempt": block.get("attempt", 0), "dialect": block.get("dialect"),
            "updated": iso(datetime.fromtimestamp(mtime, timezone.utc)), "note": note,
            "parent": parent_of(doc), "conversation": conversation_of(doc)}


def _pending_note(engine: Engine, handoff_id: str, doc: dict[str, Any], target: str | None) -> str:
    """Why a pending handoff is not running yet (empty when it is simply due)."""
    due = next_attempt_at(doc)
    if due is not None and due > engine.clock():
        return f"retry {book(doc).get('retries', 0)} at {iso(due)}"
    if target and engine.registry.get(target) is None:
        return f"waiting: no specialist registered for {target}"
    peek = engine.peek(handoff_id)
    if peek is not None and not peek.readable:
        problem = pending_problem(engine, handoff_id)
        return f"{problem.code}: {problem.message}" if problem else ""
    try:
        verdict = engine.gate(peek) if peek is not None else None
    except Exception as exc:  # a gate reading a broken dependency must not break the listing
        return f"cannot check its gates: {type(exc).__name__}: {str(exc)[:200]}"
    if verdict is None:
        return ""
    return verdict.reason if verdict.action == "wait" else f"will fail: {verdict.reason}"


def _unreadable_row(state: State, handoff_id: str, note: str) -> dict[str, Any]:
    return {"id": handoff_id, "state": state.value, "from": None, "to": None, "attempt": 0,
            "dialect": None, "updated": None, "note": note}


def list_handoffs(engine: Engine, *, state: str | None = None, to: str | None = None,
                  source: str | None = None, limit: int = 50,
                  conversation: str | None = None) -> list[dict[str, Any]]:
    """Newest-first rows describing handoffs (and quarantined files), filtered."""
    stamped: list[tuple[float, State, str]] = []
    states = [s for s in State if state in (None, s.value)]
    for st in states:
        for entry in engine.store.entries(st):
            if not entry.name.endswith(".json"):
                continue
            try:
                stamped.append((entry.stat(follow_symlinks=False).st_mtime, st, entry.name[:-5]))
            except OSError:  # gone since the listing (or unstattable): nothing to show
                continue
    stamped.sort(reverse=True)
    rows: list[dict[str, Any]] = []
    for mtime, st, handoff_id in stamped:
        if len(rows) >= limit:
            break
        try:
            doc = engine.store.read(st, handoff_id)
        except FileNotFoundError:
            continue
        except InvalidDocument as exc:
            if not conversation:
                rows.append(_unreadable_row(st, handoff_id, f"{exc.code}: unreadable: "
                                            f"{str(exc)[:200]}"))
            continue
        except Exception as exc:  # a socket, a file we may not read...: a row, never a failure
            if not conversation:
                problem = read_error(engine.store.path(st, handoff_id), exc)
                rows.append(_unreadable_row(st, handoff_id, f"{problem.code}: {problem.message}"))
            continue
        try:
            row = _row(engine, st, handoff_id, doc, mtime)
        except Exception as exc:  # one document a reader chokes on is a row, never a failure
            if not conversation:
                problem = read_error(engine.store.path(st, handoff_id), exc)
                rows.append(_unreadable_row(st, handoff_id, f"{problem.code}: {problem.message}"))
            continue
        if (to and row["to"] != to) or (source and row["from"] != source) \
                or (conversation and row["conversation"] != conversation):
            continue
        rows.append(row)
    if state in (None, "quarantined") and not to and not source and not conversation:
        for item in engine.store.quarantined()[-limit:]:
            rows.append({"id": item.get("stored_as"), "state": "quarantined", "from": None, "to": None,
                         "attempt": 0, "dialect": None, "updated": item.get("at"),
                         "note": f"{item.get('code')}: {str(item.get('message', ''))}"})
    return rows[:limit] if state != "quarantined" else rows


def validate_document(engine: Engine | None, doc: dict[str, Any], dialect: Dialect) -> None:
    """Raise InvalidDocument (with every error) unless ``doc`` is valid in ``dialect``."""
    schemas = engine.schemas if engine else SchemaCache(None)
    errors: list[dict[str, str]] = []
    for name in dialect.schema_names(doc):
        errors.extend(schemas.errors(name, {k: v for k, v in doc.items() if k != "handoffd"}))
    if errors:
        raise InvalidDocument(f"not a valid {dialect.name} document: {errors[0]['field']}: "
                              f"{errors[0]['error']}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED, errors=errors)
    if not getattr(dialect, "is_answer", lambda _doc: False)(doc):  # answers are not routed
        dialect.envelope(doc)


def validate_files(files: list[Path], engine: Engine | None, *, forced: str | None = None) -> list[dict[str, Any]]:
    """Validate each file; one result dict per file (``valid``, ``dialect``, ``headline``, ``errors``)."""
    results = []
    limit = engine.settings.max_document_bytes if engine else DEFAULT_MAX_BYTES
    for path in files:
        item: dict[str, Any] = {"file": str(path), "valid": False, "dialect": None, "headline": "",
                                "errors": []}
        try:
            raw, _ = read_bytes_safely(path, limit)
            doc = parse_document(raw, str(path))
            dialect = dialects.detect(doc, forced)
            item["dialect"] = dialect.name
            validate_document(engine, doc, dialect)
            item["valid"] = True
        except InvalidDocument as exc:
            item["headline"] = str(exc)
            item["errors"] = exc.errors or [{"field": "$", "error": str(exc), "schema_path": ""}]
        except KeyError as exc:
            item["headline"] = str(exc.args[0]) if exc.args else str(exc)
            item["errors"] = [{"field": "$", "error": item["headline"], "schema_path": ""}]
        except OSError as exc:
            item["headline"] = f"cannot read: {exc.strerror or exc}"
            item["errors"] = [{"field": "$", "error": item["headline"], "schema_path": ""}]
        results.append(item)
    return results
