"""A request keeps room for the copies handoffd files of it (R14, session 18).

Intake took any document nesting up to 64 levels, but filing copies the request two or three
levels down (an answer's ``handoffd.request_snapshot``, a parked handoff's report in
``handoffd.awaiting.outcome``): a valid request 62 levels deep got a completed answer that no
command could read (`handoff show` and `wait` failed, its dependants failed "removed by
retention"), and a 62-level request that asked a question was quarantined with its question
lost. A request may now nest 56 levels (DOCUMENT_TOO_DEEP past that, at its claim), and what is
filed for one at the limit reads back.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from conftest import Workspace, new_workspace

ASK = """import json, os, sys
json.load(sys.stdin)
if os.environ.get("HANDOFF_CLARIFICATIONS"):
    print(json.dumps({"status": "completed", "output": {"ok": 1}}))
else:
    print(json.dumps({"status": "needs_clarification", "questions": ["which one?"]}))
"""


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def request(hid: str, agent: str, levels: int) -> dict[str, Any]:
    """A native request nesting ``3 + levels`` levels (the document, input, data, then lists)."""
    return {"handoff_id": hid, "target": {"agent_id": agent}, "input": {"data": {"v": nested(levels)}}}


def workspace(tmp_path: Path) -> Workspace:
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    return new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.05
expectations = "advisory"

[specialists."@ok"]
command = ["{sys.executable}", "-S", "-c", "import json,sys; json.load(sys.stdin); print(json.dumps({{'status': 'completed', 'output': {{'ok': 1}}}}))"]

[specialists."@ask"]
command = ["{sys.executable}", "-S", "{script}"]
""")


def test_a_request_past_the_margin_fails_and_one_at_it_reads_back(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    try:
        ws.drop("at.json", request("at", "@ok", 53))  # 56 levels: the most a request may have
        ws.drop("past.json", request("past", "@ok", 59))  # 62: its answer was unreadable
        ws.drop("ask.json", request("ask", "@ask", 53))  # parked with its question
        done = ws.handoffd("run")
        assert "Traceback" not in done.stderr, done.stderr
        assert ws.state_of("at") == ["completed"]
        assert ws.state_of("past") == ["failed"] and ws.state_of("ask") == ["pending"]
        past = ws.handoff("show", "past", "--json")
        assert past.returncode == 0, past.stderr
        assert "DOCUMENT_TOO_DEEP" in json.loads(past.stdout)["note"]  # set aside, a stub filed
        for hid in ("at", "ask"):
            shown = ws.handoff("show", hid)
            assert shown.returncode == 0, shown.stderr
        assert "which one?" in ws.handoff("show", "ask").stdout
        assert not list((ws.root / "handoffs" / ".quarantine").glob("*ask*"))
    finally:
        ws.cleanup()


def test_create_refuses_a_request_past_the_margin(tmp_path: Path) -> None:
    """`handoff create --file` and `--data` refuse what the daemon would set aside."""
    ws = workspace(tmp_path)
    try:
        doc = tmp_path / "deep.json"
        doc.write_text(json.dumps(request("deep", "@ok", 54)))  # 57 levels
        made = ws.handoff("create", "--file", str(doc))
        assert made.returncode != 0 and made.stderr.count("\n") == 1, made
        assert "nests more than 56 levels" in made.stderr
        made = ws.handoff("create", "--to", "@ok", "--data", json.dumps(nested(55)))
        assert made.returncode == 2 and "nests more than 54 levels" in made.stderr, made
        assert ws.handoff("create", "--to", "@ok", "--data", json.dumps(nested(54))).returncode == 0
    finally:
        ws.cleanup()


def test_the_deepest_answer_taken_reads_back_with_its_request(tmp_path: Path) -> None:
    """An answer sits in the request (input.clarifications[n].answer): `handoff answer` takes
    at most 52 levels, so the answered request keeps its 8 free and is never set aside."""
    ws = workspace(tmp_path)
    try:
        ws.drop("q.json", request("q", "@ask", 1))
        ws.handoffd("run")
        assert ws.state_of("q") == ["pending"]
        assert ws.handoff("answer", "q", "--data", json.dumps(nested(53))).returncode == 2
        answered = ws.handoff("answer", "q", "--data", json.dumps(nested(52)))
        assert answered.returncode == 0, answered.stderr
        done = ws.handoffd("run")
        assert "Traceback" not in done.stderr, done.stderr
        assert ws.state_of("q") == ["completed"], ws.state_of("q")
        assert ws.handoff("show", "q").returncode == 0
    finally:
        ws.cleanup()
