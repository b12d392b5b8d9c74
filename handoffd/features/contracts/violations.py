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
from collections import Counter, defaultdict, deque
from datetime import datetime
from typing import Any, Iterable, Iterator, Mapping

from ...core.storage import ViolationLog
from ...core.timeutil import iso, parse_iso, utc_now

KINDS = ("scope_creep", "readonly_modified", "criteria_failed", "dependency_missing",
         "files_touched_mismatch")
MAX_LINE_BYTES = 64 * 1024
# `handoff violations --limit N`: how many of the newest entries are listed (all are counted)
DEFAULT_RECENT, MAX_RECENT = 10, 1000
# what a summary holds, however long the log (see _Tally)
MAX_GROUPS = 1000  # agents and days each counted by name; the rest under OTHERS
MAX_KINDS = 50  # kinds likewise (a count per agent and per day for each: 100,000 at most)
MAX_NAME = 200  # characters of an agent or kind name counted by
MAX_TASKS = 200_000  # (agent, task) pairs remembered (as hashes) for the distinct-task counts
OTHERS = "(others)"


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
         agent: str | None = None) -> Iterator[dict[str, Any]]:
    """The logged violations, oldest first, filtered (an entry without a readable time is left
    out when ``since`` is given), streamed from the log: none is held here."""
    for entry in log.read():
        if agent is not None and entry.get("agent") != agent:
            continue
        if since is not None:
            try:
                if parse_iso(str(entry.get("time"))) < since:
                    continue
            except ValueError:
                continue
        yield entry


def summarise(entries: Iterable[dict[str, Any]], *, recent: int = DEFAULT_RECENT) -> dict[str, Any]:
    """Counts per agent (by kind, with its distinct tasks), per kind, per day (UTC, by kind) and
    the newest ``recent`` entries (0..MAX_RECENT), counted as ``entries`` stream by: however long
    the log, what is held is bounded (see :class:`_Tally`). ``recent_left_out``: how many older
    entries the counts include but ``recent`` does not list."""
    if not 0 <= recent <= MAX_RECENT:
        raise ValueError(f"recent must be 0..{MAX_RECENT}, not {recent!r}")
    tally = _Tally()
    newest: deque[dict[str, Any]] = deque(maxlen=recent)
    for entry in entries:
        tally.add(entry)
        newest.append(entry)
    return {**tally.summary(), "recent": list(newest), "recent_left_out": tally.total - len(newest)}


class _Tally:
    """The counts of :func:`summarise`, bounded: at most MAX_GROUPS agents and days and
    MAX_KINDS kinds are counted by name (names cut to MAX_NAME characters; the rest are counted
    under OTHERS),
    and at most MAX_TASKS (agent, task) pairs are remembered, as hashes, for the distinct-task
    counts (past that, a new pair is not counted; ``tasks_capped`` says so). The log is
    appendable by anyone who can write the workspace: a million distinct agent names or task ids
    each 64 KiB long must not take the command's memory with it."""

    def __init__(self) -> None:
        self.total = 0
        self.by_agent: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_day: dict[str, Counter[str]] = defaultdict(Counter)
        self.by_kind: Counter[str] = Counter()
        self.tasks: Counter[str] = Counter()  # distinct tasks per agent
        self.pairs: set[int] = set()
        self.capped = False

    def add(self, entry: dict[str, Any]) -> None:
        """Count one entry."""
        self.total += 1
        kind = _group(self.by_kind, str(entry.get("kind", "unknown")), MAX_KINDS)
        agent = _group(self.by_agent, str(entry.get("agent") or "-"), MAX_GROUPS)
        day = _group(self.by_day, str(entry.get("time", ""))[:10] or "-", MAX_GROUPS)
        self.by_agent[agent][kind] += 1
        self.by_day[day][kind] += 1
        self.by_kind[kind] += 1
        pair = hash((agent, str(entry.get("task_id") or entry.get("handoff_id"))))
        if pair not in self.pairs:
            if len(self.pairs) >= MAX_TASKS:
                self.capped = True
                return
            self.pairs.add(pair)
            self.tasks[agent] += 1

    def summary(self) -> dict[str, Any]:
        """The counts as :func:`summarise` gives them."""
        out: dict[str, Any] = {
            "total": self.total,
            "by_kind": dict(sorted(self.by_kind.items())),
            "by_agent": {a: {"total": sum(c.values()), "tasks": self.tasks[a],
                             **dict(sorted(c.items()))}
                         for a, c in sorted(self.by_agent.items())},
            "by_day": {d: {"total": sum(c.values()), **dict(sorted(c.items()))}
                       for d, c in sorted(self.by_day.items())},
        }
        if self.capped:
            out["tasks_capped"] = True
        return out


def _group(groups: Mapping[str, Any], name: str, most: int) -> str:
    """The name ``name`` is counted under in ``groups``: itself cut to MAX_NAME characters, or
    OTHERS once ``groups`` holds ``most`` names and not this one."""
    if len(name) > MAX_NAME:
        name = name[:MAX_NAME] + "…"
    if name in groups or len(groups) < most:
        return name
    return OTHERS
