"""What `handoff ls` / `show` say of an answer dropped into pending/, and what the daemon files
for it, agree (session 26); a refused answer is filed the same way whatever the code.

1. a swarm completion report without ``status`` (seed 004's report has none: files_touched and
   summary): `ls` said NOT_A_REQUEST, the daemon filed SCHEMA_VALIDATION_FAILED (it checked the
   report schema before asking whether it was an answer). Both now say NOT_A_REQUEST;
2. a seed-001 Response with a future ``next_attempt_at``: the daemon refuses it at once, but
   `ls` said "scheduled for ..." (it looked at the due time first). It now says NOT_A_REQUEST;
3. a seed-001 Response breaking its schema was filed SCHEMA_VALIDATION_FAILED with the
   sender's ``output`` beside handoffd's error. It is refused NOT_A_REQUEST, and an answer filed
   as a failure with any code (also CANCELLED by `handoff cancel`) keeps the sender's fields
   under ``refused_answer``.

One workspace, one `handoff ls --json` and `handoff show` before one real `handoffd run`.
"""
from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from test_seed_fidelity_s24 import SEED_RESPONSE

from handoffd import dialects
from handoffd.core.documents import Outcome
from handoffd.core.errors import ErrorCode
from handoffd.core.native_format import apply_native_outcome

CONFIG = """
[daemon]
settle_seconds = 0.05
durability = "fast"
"""
REPORT = "bd-26.1"  # seed 004's CompletionReport as its swarm_complete takes it: no status
SCHEDULED = "hoff-sched-s26"  # a Response rewritten over a request created --delay 3600
BROKEN = "hoff-broken-s26"  # a Response whose execution_time_seconds breaks its schema
CANCELLED = "hoff-cancel-s26"  # a Response cancelled while pending
RESPONSES = (SCHEDULED, BROKEN, CANCELLED)


def _response(hid: str) -> dict[str, Any]:
    doc = copy.deepcopy(SEED_RESPONSE)
    doc["handoff_id"] = hid
    return doc


def _scheduled(ws: Workspace) -> None:
    """A request `handoff create --delay` schedules (handoffd's own sealed block, with its
    ``next_attempt_at`` an hour ahead), rewritten in place into a seed-001 Response."""
    ws.create("--to", "@nobody", "--id", SCHEDULED, "--delay", "3600", "--data", "{}")
    path = ws.root / "handoffs" / "pending" / f"{SCHEDULED}.json"
    doc = json.loads(path.read_text())
    assert doc["handoffd"]["next_attempt_at"], doc
    answer = {key: value for key, value in _response(SCHEDULED).items() if key != "target"}
    doc.update(answer)
    ws.drop(f"{SCHEDULED}.json", doc)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """The answers dropped into pending/ (nobody here serves their targets); the cancelled one
    cancelled; `handoff ls --json` (``ws.listed``) and `handoff show` of the scheduled one
    (``ws.shown``) before one `handoffd run` (``ws.proc``)."""
    ws = new_workspace(tmp_path_factory.mktemp("refusals26") / "ws", CONFIG)
    ws.drop(f"{REPORT}.json", {"task_id": REPORT, "files_touched": ["src/auth/service.ts"],
                               "summary": "AuthService done"})
    _scheduled(ws)
    broken = _response(BROKEN)
    broken["execution_time_seconds"] = "slow"
    ws.drop(f"{BROKEN}.json", broken)
    ws.drop(f"{CANCELLED}.json", _response(CANCELLED))
    ws.handoff("cancel", CANCELLED, check=True)
    listed = ws.handoff("ls", "--json", check=True)
    ws.listed = {row["id"]: row for row in json.loads(listed.stdout)}  # type: ignore[attr-defined]
    ws.shown = ws.handoff("show", SCHEDULED, check=True).stdout  # type: ignore[attr-defined]
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    ws.proc = proc  # type: ignore[attr-defined]
    return ws


def _filed_code(ws: Workspace, hid: str) -> str:
    assert ws.state_of(hid) == ["failed"], ws.state_of(hid)
    doc = ws.doc(hid)
    assert doc["handoffd"]["final_error"]["code"] == doc["error"]["code"], doc
    return str(doc["error"]["code"])


@pytest.mark.parametrize("hid", [REPORT, SCHEDULED, BROKEN])
def test_ls_and_the_daemon_both_refuse_an_answer(ran: Workspace, hid: str) -> None:
    note = ran.listed[hid]["note"]  # type: ignore[attr-defined]
    assert note.startswith(f"{ErrorCode.NOT_A_REQUEST}: "), note
    assert _filed_code(ran, hid) == ErrorCode.NOT_A_REQUEST


def test_show_says_a_scheduled_answer_is_refused_not_scheduled(ran: Workspace) -> None:
    shown = ran.shown  # type: ignore[attr-defined]
    assert ErrorCode.NOT_A_REQUEST in shown and "scheduled for" not in shown, shown


def test_a_status_less_report_is_refused_before_its_schema(ran: Workspace) -> None:
    doc = ran.doc(REPORT)
    assert doc["status"] == "failed" and "completion report" in doc["error"]["message"], doc
    assert ErrorCode.SCHEMA_VALIDATION_FAILED not in json.dumps(doc), doc


@pytest.mark.parametrize("hid", RESPONSES)
def test_a_filed_answer_keeps_what_it_brought_apart(ran: Workspace, hid: str) -> None:
    doc = ran.doc(hid)
    assert doc["status"] in ("failed", "cancelled"), doc
    kept = doc["refused_answer"]
    assert kept["status"] == "completed" and kept["output"] == SEED_RESPONSE["output"], doc
    assert "output" not in doc and "metadata" not in doc and "validation" not in doc, doc
    assert doc["retry_available"] is False, doc


def test_a_cancelled_answer_keeps_its_code(ran: Workspace) -> None:
    assert _filed_code(ran, CANCELLED) == ErrorCode.CANCELLED


# ---------------------------------------------------------------- the one decision, unit
def test_answer_refusal_is_the_envelopes_refusal() -> None:
    """A status-less report is refused; a filed report being retried (it keeps its request)
    and a request are not; a seed-001 answer not yet claimed is left to its claim."""
    from handoffd.core.formats import answer_refusal  # (here: new in session 26)
    swarm, native = dialects.by_name("swarm"), dialects.by_name("native")
    report = {"task_id": REPORT, "files_touched": [], "summary": "done"}
    refusal = answer_refusal(swarm, report)
    assert refusal is not None and refusal.code == ErrorCode.NOT_A_REQUEST, refusal
    request = {"contract": {"task_id": REPORT, "files_owned": []}}
    retried = {**report, "status": "failed", "handoffd": {"request_snapshot": request}}
    assert answer_refusal(swarm, retried) is None
    assert answer_refusal(swarm, request) is None
    assert answer_refusal(native, _response(BROKEN)) is None  # (no history: not taken up)
    claimed = {**_response(BROKEN), "handoffd": {"history": [{"event": "claimed"}]}}
    assert answer_refusal(native, claimed) is not None


def test_an_answer_failed_with_any_code_keeps_its_fields_apart() -> None:
    """apply_native_outcome sets the answer's fields aside for any failure, not NOT_A_REQUEST
    alone; a request's failure keeps its fields where they are."""
    now = datetime(2026, 11, 27, tzinfo=timezone.utc)
    failure = Outcome(status="failed", started_at=now, finished_at=now, output={"x": 1},
                      error={"code": ErrorCode.TIMEOUT, "message": "late"})
    answer = _response(BROKEN)
    apply_native_outcome(answer, failure, retry_count=0, max_retries=0, retry_available=False)
    assert answer["refused_answer"]["output"] == SEED_RESPONSE["output"], answer
    assert answer["output"] == {"x": 1} and answer["error"]["code"] == ErrorCode.TIMEOUT, answer
    request = {"handoff_id": "h", "status": "in_progress", "target": {"agent_id": "@a"}}
    apply_native_outcome(request, failure, retry_count=0, max_retries=0, retry_available=False)
    assert "refused_answer" not in request and request["output"] == {"x": 1}, request
