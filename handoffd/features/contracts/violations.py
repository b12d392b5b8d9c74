"""The learning-signal log of contract violations (seed 004) and its summary.

One JSON object per incident, in the store's :class:`~handoffd.core.storage.ViolationLog`
(files: ``handoffs/.meta/violations.jsonl``, one ``O_APPEND`` line each; PostgreSQL: the table
``handoffd.violations``, one log for every host; see :func:`handoffd.features.build.violation_log_of`)::

    {"time": "...Z", "kind": "scope_creep", "task_id": "bd-123.2", "handoff_id": "bd-123.2",
     "agent": "@worker", "source": "@coordinator", "attempt": 1, "details": {...}}

Kinds: ``scope_creep``, ``readonly_modified``, ``criteria_failed``, ``dependency_missing``,
``files_touched_mismatch``. One entry is one incident: a kind of violation in one attempt of one
handoff (its ``details`` list the files or criteria concerned).
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

from ...core.storage import ViolationLog
from ...core.timeutil import iso, parse_iso, utc_now

KINDS = ("scope_creep", "readonly_modified", "criteria_failed", "dependency_missing",
         "files_touched_mismatch")
MAX_LINE_BYTES = 64 * 1024


def append(log: ViolationLog, entry: dict[str, Any]) -> None:
    """Append one violation to ``log`` (``time`` filled in when absent; bulky details are cut
    so that an entry stays under MAX_LINE_BYTES)."""
    entry = dict(entry)
    entry.setdefault("time", iso(utc_now()))
    line = json.dumps(entry, ensure_ascii=False, sort_keys=True)
    if len(line.encode("utf-8")) > MAX_LINE_BYTES:  # keep lines small: drop the bulky details
        details = given if isinstance(given := entry.get("details"), dict) else {}
        entry["details"] = {"truncated": True, "count": details.get("count"),
                            "message": str(details.get("message", ""))[:1000]}
    log.append(entry)


def read(log: ViolationLog, *, since: datetime | None = None,
         agent: str | None = None) -> list[dict[str, Any]]:
    """The logged violations, oldest first, filtered (an entry without a readable time is left
    out when ``since`` is given)."""
    out = []
    for entry in log.read():
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
