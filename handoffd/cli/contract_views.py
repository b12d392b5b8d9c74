"""Human output of the contract commands: ``handoff violations`` tables, ``handoff render`` text."""
from __future__ import annotations

import json
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..features.contracts.violations import KINDS, MAX_TASKS
from .render import clean

MAX_RENDER_LINES = 49
SHORT = {"scope_creep": "SCOPE", "readonly_modified": "READONLY", "criteria_failed": "CRITERIA",
         "dependency_missing": "DEPS", "files_touched_mismatch": "TOUCHED"}


def violations_view(summary: dict[str, Any]) -> Group | str:
    """Per-agent and per-day tables plus the latest incidents."""
    if not summary["total"]:
        return "no contract violations recorded"
    kinds = list(KINDS) + sorted(k for k in summary["by_kind"] if k not in KINDS)
    agents = Table(box=None, pad_edge=False, header_style="bold", title="per agent",
                   title_justify="left")
    for column in ["AGENT", "TASKS", "TOTAL"] + [SHORT.get(k, k.upper()) for k in kinds]:
        agents.add_column(column, overflow="fold")
    for agent, counts in summary["by_agent"].items():
        agents.add_row(_text(agent), str(counts["tasks"]), str(counts["total"]),
                       *[str(counts.get(k, 0)) for k in kinds])
    days = Table(box=None, pad_edge=False, header_style="bold", title="per day (UTC)",
                 title_justify="left")
    for column in ["DAY", "TOTAL"] + [SHORT.get(k, k.upper()) for k in kinds]:
        days.add_column(column, overflow="fold")
    for day, counts in summary["by_day"].items():
        days.add_row(_text(day), str(counts["total"]), *[str(counts.get(k, 0)) for k in kinds])
    left_out = summary.get("recent_left_out") or 0
    title = "latest" if not left_out else (f"latest {len(summary['recent']):,} of "
                                           f"{summary['total']:,} (--limit N lists more)")
    recent = Table(box=None, pad_edge=False, header_style="bold", title=title,
                   title_justify="left")
    for column in ("TIME", "AGENT", "TASK", "KIND", "DETAIL"):
        recent.add_column(column, overflow="fold")
    for entry in summary["recent"]:
        details = entry.get("details") if isinstance(entry.get("details"), dict) else {}
        message = str(details.get("message", ""))
        recent.add_row(_text(entry.get("time", "")), _text(entry.get("agent") or "-"),
                       _text(entry.get("task_id") or "-"), _text(entry.get("kind", "")),
                       _text(message if len(message) <= 120 else message[:117] + "..."))
    totals = ", ".join(f"{k} {n}" for k, n in summary["by_kind"].items())
    if summary.get("tasks_capped"):  # (the summary's memory is bounded: see violations._Tally)
        totals += f"; TASKS stops counting past {MAX_TASKS:,} distinct (agent, task) pairs"
    return Group(f"{summary['total']} violation(s): {totals}", "", agents, "", days, "", recent)


def _text(value: Any) -> Text:
    """A cell from the violations log (anyone can append to it): never read as rich markup,
    control characters shown."""
    return Text(clean(str(value)))


def _value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_lines(doc: dict[str, Any], *, per_key: bool) -> list[str]:
    """The {contract, context, escalation} object as valid JSON, one inner key per line
    (``per_key``) or one section per line."""
    sections = [(name, doc.get(name) or {}) for name in ("contract", "context", "escalation")]
    lines = ["{"]
    for index, (name, body) in enumerate(sections):
        comma = "," if index < len(sections) - 1 else ""
        if not per_key or not body:
            lines.append(f"  {_value(name)}: {_value(body)}{comma}")
            continue
        lines.append(f"  {_value(name)}: {{")
        items = list(body.items())
        for i, (key, value) in enumerate(items):
            lines.append(f"    {_value(key)}: {_value(value)}{',' if i < len(items) - 1 else ''}")
        lines.append(f"  }}{comma}")
    lines.append("}")
    return lines


def render_envelope(envelope: dict[str, Any]) -> str:
    """The compact worker prompt block: a few lines of instructions around the JSON (< 50 lines)."""
    contract = envelope.get("contract") or {}
    escalation = envelope.get("escalation") or {}
    who = envelope.get("worker") or "the worker"
    source = f" for {envelope['from']}" if envelope.get("from") else ""
    head = [f"Task {contract.get('task_id')} — assigned to {who}{source}. The contract is enforced "
            "by handoffd; the context is advisory."]
    tail = ["Change only files matching files_owned; never change files_readonly. Anything else you "
            "create, modify or delete fails the task (CONTRACT_VIOLATION).",
            "Checkable success_criteria (Tests pass: / Type check passes: / Command succeeds:) are "
            "run in the contract directory after you finish; all must exit 0.",
            "Report the files you changed as output.files_touched."]
    if escalation:
        contact = escalation.get("blocked_contact") or "the coordinator"
        protocol = escalation.get("scope_change_protocol")
        tail.append(f"Blocked? Contact {contact}." + (f" Need more files? {protocol}." if protocol else ""))
    body = _json_lines(envelope, per_key=True)
    if len(head) + len(body) + len(tail) > MAX_RENDER_LINES:
        body = _json_lines(envelope, per_key=False)
    return "\n".join(head + body + tail)
