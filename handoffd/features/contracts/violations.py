"""The learning-signal log of contract violations (seed 004) and its summary.

``handoffs/.meta/violations.jsonl`` gets one JSON object per line, each appended with a single
``O_APPEND`` write (several daemons may append at once)::

    {"time": "...Z", "kind": "scope_creep", "task_id": "bd-123.2", "handoff_id": "bd-123.2",
     "agent": "@worker", "source": "@coordinator", "attempt": 1, "details": {...}}

Kinds: ``scope_creep``, ``readonly_modified``, ``criteria_failed``, ``dependency_missing``,
``files_touched_mismatch``. One line is one incident: a kind of violation in one attempt of one
handoff (its ``details`` list the files or criteria concerned).
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from ...core.timeutil import iso, parse_iso, utc_now
from ...core.workspace import Workspace

KINDS = ("scope_creep", "readonly_modified", "criteria_failed", "dependency_missing",
         "files_touched_mismatch")
LOG_NAME = "violations.jsonl"
MAX_LINE_BYTES = 64 * 1024


def log_path(ws: Workspace) -> Path:
    """Where the violations log lives."""
    return ws.meta / LOG_NAME


def append(ws: Workspace, entry: dict[str, Any]) -> None:
    """Append one violation with a single O_APPEND write (``time`` filled in when absent)."""
    entry = dict(entry)
    entry.setdefault("time", iso(utc_now()))
    line = json.dumps(entry, ensure_ascii=False, sort_keys=True)
    if len(line.encode("utf-8")) > MAX_LINE_BYTES:  # keep lines small: drop the bulky details
        details = given if isinstance(given := entry.get("details"), dict) else {}
        entry["details"] = {"truncated": True, "count": details.get("count"),
                            "message": str(details.get("message", ""))[:1000]}
        line = json.dumps(entry, ensure_ascii=False, sort_keys=True)
    path = log_path(ws)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def read(ws: Workspace, *, since: datetime | None = None, agent: str | None = None) -> list[dict[str, Any]]:
    """The logged violations, oldest first, filtered (unparseable lines are skipped)."""
    try:
        raw = log_path(ws).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if agent is not None and entry.get("agent") != agent:
            continue
        if since is not None:
            try:
                if parse_iso(str(entry.get("time"))) < since:
                    continue
            except ValueError:
                continue
        out.append(entry)
    return out


def summarise(entries: list[dict[str, Any]], *, recent: int = 10) -> dict[str, Any]:
    """Counts per agent (by kind), per kind, per day (UTC, by kind) and the latest entries."""
    by_agent: dict[str, Counter[str]] = defaultdict(Counter)
    by_day: dict[str, Counter[str]] = defaultdict(Counter)
    by_kind: Counter[str] = Counter()
    tasks: dict[str, set[str]] = defaultdict(set)
    for entry in entries:
        kind = str(entry.get("kind", "unknown"))
        agent = str(entry.get("agent") or "-")
        day = str(entry.get("time", ""))[:10] or "-"
        by_agent[agent][kind] += 1
        by_day[day][kind] += 1
        by_kind[kind] += 1
        tasks[agent].add(str(entry.get("task_id") or entry.get("handoff_id")))
    return {
        "total": len(entries),
        "by_kind": dict(sorted(by_kind.items())),
        "by_agent": {a: {"total": sum(c.values()), "tasks": len(tasks[a]), **dict(sorted(c.items()))}
                     for a, c in sorted(by_agent.items())},
        "by_day": {d: {"total": sum(c.values()), **dict(sorted(c.items()))}
                   for d, c in sorted(by_day.items())},
        "recent": entries[-recent:] if recent else [],
    }
