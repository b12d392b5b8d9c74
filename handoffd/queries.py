"""Read-only questions about a workspace (listing, validating) for the CLI and the library API."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import dialects
from .dialects import Dialect
from .documents import book, next_attempt_at
from .errors import InvalidDocument
from .fsio import parse_document, read_bytes_safely
from .lifecycle import Engine
from .lineage import conversation_of, parent_of
from .states import State
from .validation import SchemaCache
from .timeutil import iso
from datetime import datetime, timezone

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


def _row(engine: Engine, state: State, handoff_id: str, doc: dict[str, Any], mtime: float) -> dict[str, Any]:
    try:
        dialect = dialects.detect(doc)
        env = dialect.envelope(doc)
        target, source = env.target, env.source
    except (InvalidDocument, KeyError):
        target = source = None
    block = book(doc)
    note = ""
    if state is State.PENDING:
        due = next_attempt_at(doc)
        if due is not None and due > engine.clock():
            note = f"retry {block.get('retries', 0)} at {iso(due)}"
        elif target and engine.registry.get(target) is None:
            note = f"waiting: no specialist registered for {target}"
        else:
            peek = engine.peek(handoff_id)
            verdict = engine.gate(peek) if peek is not None else None
            if verdict is not None:
                note = verdict.reason if verdict.action == "wait" else f"will fail: {verdict.reason}"
    elif state is State.FAILED:
        error = block.get("final_error") or (doc.get("error") if isinstance(doc.get("error"), dict) else {})
        note = f"{error.get('code', '')}: {str(error.get('message', ''))}".strip(": ")
    elif state is State.IN_PROGRESS:
        lease = block.get("lease") if isinstance(block.get("lease"), dict) else {}
        owner = lease.get("owner") or {}
        note = f"owner {owner.get('host', '?')}:{owner.get('pid', '?')}" if owner else ""
    return {"id": handoff_id, "state": state.value, "from": source, "to": target,
            "attempt": block.get("attempt", 0), "dialect": block.get("dialect"),
            "updated": iso(datetime.fromtimestamp(mtime, timezone.utc)), "note": note,
            "parent": parent_of(doc), "conversation": conversation_of(doc)}


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
            except FileNotFoundError:
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
            if conversation:
                continue
            rows.append({"id": handoff_id, "state": st.value, "from": None, "to": None, "attempt": 0,
                         "dialect": None, "updated": None, "note": f"{exc.code}: unreadable"})
            continue
        row = _row(engine, st, handoff_id, doc, mtime)
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
                              code="SCHEMA_VALIDATION_FAILED", errors=errors)
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
