"""Answers dropped into pending/, two consistency defects (session 27, review R46 #4):

1. a hi_moe answer copied from another workspace (its file keeps the request's name, the
   answer's own ``id`` differs; the seal, and with it the request the answer kept, does not
   travel): `handoff ls` noted it NOT_A_REQUEST, but the daemon set it aside ID_MISMATCH (its
   file-name check ran first). Both now say NOT_A_REQUEST with the same reason, and the daemon
   files it in failed/ under its name; an id that is no safe file name is still set aside;
2. `handoff retry --force` of a refused seed-001 answer (its fields kept under
   ``refused_answer``) dropped them and ran the request part as work. A retry of a document
   that holds an answer (any format) is refused, forced or not: one line, exit 1; one whose
   answer the user took out (``refused_answer`` removed) is retried as any other.

Review R53 #1-2: the refusal of a retry is decided by handoffd's own sealed bookkeeping (the
filing's ``final_error``: NOT_A_REQUEST, or an answer cancelled while pending), never by a
``refused_answer`` the document merely carries (a request submitted with one, failed as any
request may, could never be retried); a dependent of a refused answer is told to submit the
request the answer answers and a new dependent, not to retry the answer first (a dead end).

Workspace A files a real hi_moe answer; workspace B gets the copy and the seed-001 answers,
one `handoff ls --json` before one real `handoffd run`, then real `handoff retry` commands.
"""
from __future__ import annotations

import copy
import json
import sys
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh
from test_seed_fidelity_s24 import SEED_RESPONSE

from handoffd.core.errors import ErrorCode


def _command(code: str) -> str:
    """A specialist command line (TOML array) running ``code`` on the handoff from stdin."""
    return json.dumps([sys.executable, "-c", "import json,sys; json.load(sys.stdin); " + code])


QUICK = _command("print(json.dumps({'status': 'completed', 'output': {'ran': True}}))")
FAILS = _command("print(json.dumps({'status': 'failed', 'error': {'code': 'VALIDATION_FAILED', "
                 "'message': 'nope', 'retryable': False}}))")
DAEMON = """
[daemon]
settle_seconds = 0.05
durability = "fast"
"""
CONFIG = f"""{DAEMON}
[specialists."SPECIALIZED_FLEET"]
command = {QUICK}

[specialists."@react-specialist"]
command = {QUICK}
"""
COPIED = "moe-copied-s27"  # the request's name; the copied answer inside has its own id
UNSAFE = "moe-unsafe-s27"  # an answer whose id is no safe file name
REFUSED = "hoff-refused-s27"  # a seed-001 Response, refused NOT_A_REQUEST
CANCELLED = "hoff-cancelled-s27"  # a seed-001 Response cancelled while pending
FIXED = "hoff-fixed-s27"  # refused, then its answer taken out by hand


def _response(hid: str) -> dict[str, Any]:
    doc = copy.deepcopy(SEED_RESPONSE)
    doc["handoff_id"] = hid
    return doc


def _filed_answer(tmp: Any) -> dict[str, Any]:
    """A hi_moe answer as another workspace files it (completed/COPIED.json), by a real run."""
    ws = new_workspace(tmp / "a", CONFIG)
    request = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    request["id"], request["target_tier"] = COPIED, "SPECIALIZED_FLEET"
    request["payload"]["specialist_hint"] = None
    ws.drop(f"{COPIED}.json", request)
    proc = ws.handoffd("run", timeout=60)
    assert ws.state_of(COPIED) == ["completed"], proc.stderr
    return json.loads((ws.root / "handoffs" / "completed" / f"{COPIED}.json").read_text())


def _rows(ws: Workspace) -> dict[str, dict[str, Any]]:
    listed = ws.handoff("ls", "--json", check=True)
    return {row["id"]: row for row in json.loads(listed.stdout)}


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """Workspace B: the copied answer, one with an unsafe id and the seed-001 answers dropped
    (one cancelled), listed (``ws.before``), one `handoffd run` (``ws.proc``), listed again
    (``ws.after``)."""
    tmp = tmp_path_factory.mktemp("retries27")
    answer = _filed_answer(tmp)
    ws = new_workspace(tmp / "b", CONFIG)
    assert answer["id"] != COPIED and answer["correlation_id"] == COPIED, answer
    ws.drop(f"{COPIED}.json", answer)  # as `cp a/handoffs/completed/X.json b/handoffs/pending/`
    ws.drop(f"{UNSAFE}.json", {**answer, "id": "../escape"})
    for hid in (REFUSED, CANCELLED, FIXED):
        ws.drop(f"{hid}.json", _response(hid))
    ws.handoff("cancel", CANCELLED, check=True)
    ws.before = _rows(ws)  # type: ignore[attr-defined]
    ws.proc = ws.handoffd("run", timeout=60)  # type: ignore[attr-defined]
    assert "Traceback" not in ws.proc.stderr, ws.proc.stderr  # type: ignore[attr-defined]
    ws.after = _rows(ws)  # type: ignore[attr-defined]
    return ws


# ---------------------------------------------------------------- 1: ls and the daemon agree
def test_a_copied_hi_moe_answer_is_refused_as_ls_says(ran: Workspace) -> None:
    before, after = ran.before[COPIED], ran.after[COPIED]  # type: ignore[attr-defined]
    assert before["state"] == "pending" and after["state"] == "failed", (before, after)
    assert before["note"].startswith(f"{ErrorCode.NOT_A_REQUEST}: "), before
    assert after["note"] == before["note"], (before, after)  # the same code and reason
    stderr: str = ran.proc.stderr  # type: ignore[attr-defined]
    said = [line for line in stderr.splitlines() if COPIED in line]
    assert not [line for line in said if ErrorCode.ID_MISMATCH in line], said
    filed = ran.doc(COPIED)
    assert filed["payload"]["error_type"] == "not_a_request", filed
    assert not list((ran.root / "handoffs" / ".quarantine").glob(f"*{COPIED}*")), "set aside"


def test_an_answer_whose_id_is_no_file_name_is_still_set_aside(ran: Workspace) -> None:
    note = ran.after[UNSAFE]["note"]  # type: ignore[attr-defined]
    assert note.startswith(f"{ErrorCode.ID_MISMATCH}: "), note
    assert list((ran.root / "handoffs" / ".quarantine").glob(f"*{UNSAFE}*")), "not set aside"


# ---------------------------------------------------------------- 2: no retry of an answer
@pytest.mark.parametrize("args", [("retry",), ("retry", "--force")], ids=["plain", "forced"])
@pytest.mark.parametrize("hid", [REFUSED, CANCELLED, COPIED])
def test_a_retry_of_an_answer_is_refused(ran: Workspace, hid: str, args: tuple[str, ...]) -> None:
    proc = ran.handoff(*args, hid)
    assert proc.returncode == 1 and proc.stdout == "", proc
    said = proc.stderr.strip()
    assert "\n" not in said and "Traceback" not in said, said
    assert f"handoff {hid} cannot be retried, even forced: " in said, said
    assert ("refused_answer" in said) if hid != COPIED else ("is an Outcome" in said), said
    assert ran.state_of(hid) == ["failed"]
    if hid != COPIED:  # the answer it holds is kept as it was
        assert ran.doc(hid)["refused_answer"]["output"] == SEED_RESPONSE["output"]


def test_all_failed_skips_the_answers(ran: Workspace) -> None:
    proc = ran.handoff("retry", "--all-failed", "--force")
    assert proc.returncode == 0, proc
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("handoff: skipped: ")]
    for hid in (REFUSED, CANCELLED, COPIED):
        assert sum(f"handoff {hid} cannot be retried" in line for line in skipped) == 1, proc.stderr
        assert ran.state_of(hid) == ["failed"]


def test_an_answer_taken_out_by_hand_is_retried_as_a_request(ran: Workspace) -> None:
    path = ran.root / "handoffs" / "failed" / f"{FIXED}.json"
    doc = json.loads(path.read_text())
    assert doc["error"]["code"] == ErrorCode.NOT_A_REQUEST, doc
    del doc["refused_answer"]
    doc["input"] = {"data": {"fixed": True}}
    path.write_text(json.dumps(doc))
    ran.handoff("retry", "--force", FIXED, check=True)
    proc = ran.handoffd("run", timeout=60)
    assert ran.state_of(FIXED) == ["completed"], proc.stderr
    assert ran.doc(FIXED)["output"] == {"ran": True}


# ---------------------------------------------------------------- R53: our bookkeeping decides
CARRIER = "hoff-carrier-s27"  # a request submitted with a refused_answer field, failed
ANSWER_DEP = "hoff-answer-dep-s27"  # a seed-001 Response, refused NOT_A_REQUEST
WAITER = "hoff-waiter-s27"  # a request depending on it
FAILS_CONFIG = f"""{DAEMON}
[specialists."@react-specialist"]
command = {FAILS}
"""


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """A workspace whose specialist fails every request: a request carrying the fields of a
    refused answer under ``refused_answer`` (as a user rebuilds one from failed/), given to a
    real `handoff create --file`; a refused answer and a dependent of it; one `handoffd run`."""
    ws = new_workspace(tmp_path_factory.mktemp("carried27") / "ws", FAILS_CONFIG)
    answer = _response(CARRIER)
    request = {key: answer[key] for key in ("handoff_id", "source", "target")}
    request.update(status="pending", input={"data": {}},
                   refused_answer={key: answer[key] for key in ("status", "output")})
    path = ws.root / "request.json"
    path.write_text(json.dumps(request))
    ws.handoff("create", "--file", str(path), check=True)
    ws.drop(f"{ANSWER_DEP}.json", _response(ANSWER_DEP))
    ws.drop(f"{WAITER}.json", {"handoff_id": WAITER, "status": "pending",
                               "source": {"agent_id": "@cli"},
                               "target": {"agent_id": "@react-specialist"},
                               "input": {"data": {}}, "depends_on": [ANSWER_DEP]})
    ws.proc = ws.handoffd("run", timeout=60)  # type: ignore[attr-defined]
    assert "Traceback" not in ws.proc.stderr, ws.proc.stderr  # type: ignore[attr-defined]
    return ws


def test_a_request_carrying_refused_answer_is_retried(carried: Workspace) -> None:
    """Its failure is the specialist's (VALIDATION_FAILED), as handoffd recorded it: the
    ``refused_answer`` it carries is content, and no reason to refuse the retry."""
    filed = carried.doc(CARRIER)
    assert filed["error"]["code"] == "VALIDATION_FAILED" and "refused_answer" in filed, filed
    proc = carried.handoff("retry", "--force", CARRIER)
    assert proc.returncode == 0 and "cannot be retried" not in proc.stderr, proc
    assert carried.state_of(CARRIER) == ["pending"]


def test_a_dependent_of_an_answer_is_told_a_way_that_works(carried: Workspace) -> None:
    """Not "retry the dependency first": `handoff retry` refuses it, even forced."""
    assert carried.state_of(WAITER) == ["failed"], carried.proc.stderr  # type: ignore[attr-defined]
    filed = carried.doc(WAITER)
    message, steps = filed["error"]["message"], filed["recovery_actions"]
    assert filed["error"]["code"] == ErrorCode.DEPENDENCY_MISSING, filed
    assert f"retry {ANSWER_DEP} first" not in message, message
    assert "cannot be retried" in message and "submit the request it answers" in message, message
    assert not [step for step in steps if "handoff retry --force" in step], steps
    assert any(f"The dependency {ANSWER_DEP} cannot be retried" in step for step in steps), steps
    assert any("depends_on" in step for step in steps), steps
    said = carried.handoff("retry", "--force", ANSWER_DEP)  # the advice it no longer gives
    assert said.returncode == 1 and "cannot be retried, even forced" in said.stderr, said


# ---------------------------------------------------------------- R55
OLD_CANCEL = "hoff-old-cancel-s27"  # a seed-001 answer cancelled by a handoffd before the flag
STUB_DEP = "hoff-stub-dep-s27"  # set aside unread (its id no file name): a failure stub
STUB_WAITER = "hoff-stub-waiter-s27"
V9 = "moe-v9-s27"  # a hi_moe Outcome of an unknown major version, refused with the flag


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    tmp = tmp_path_factory.mktemp("older27")
    answer = _filed_answer(tmp)
    ws = new_workspace(tmp / "ws", CONFIG)
    ws.drop(f"{OLD_CANCEL}.json", _response(OLD_CANCEL))
    ws.handoff("cancel", OLD_CANCEL, check=True)
    path = ws.root / "handoffs" / "failed" / f"{OLD_CANCEL}.json"
    doc = json.loads(path.read_text())
    assert doc["handoffd"]["final_error"].pop("answer") is True, doc  # as filed before the flag
    path.write_text(json.dumps(doc))  # (its seal covers id, revision and folder: still ours)
    ws.drop(f"{STUB_DEP}.json", _response("another-id-s27"))
    ws.drop(f"{V9}.json", {**answer, "id": V9, "version": "9.0.0"})
    first = ws.handoffd("run", timeout=60)
    # the waiter after the stub is filed: while it is set aside (out of pending/, its stub not
    # yet in failed/) a gate reads it as removed by retention (the first CI run's failure)
    ws.drop(f"{STUB_WAITER}.json", {"handoff_id": STUB_WAITER, "status": "pending",
                                    "source": {"agent_id": "@cli"},
                                    "target": {"agent_id": "@react-specialist"},
                                    "input": {"data": {}}, "depends_on": [STUB_DEP]})
    ws.proc = ws.handoffd("run", timeout=60)  # type: ignore[attr-defined]
    said = first.stderr + ws.proc.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in said, said
    ws.proc.stderr = said  # type: ignore[attr-defined]
    return ws


def test_an_answer_cancelled_before_the_flag_is_still_refused(older: Workspace) -> None:
    """R55: its final_error says CANCELLED with no held-answer flag (a handoffd before it
    filed none): retried, the seed-001 answer it kept ran as work."""
    proc = older.handoff("retry", "--force", OLD_CANCEL)
    assert proc.returncode == 1 and "cannot be retried, even forced" in proc.stderr, proc
    assert older.state_of(OLD_CANCEL) == ["failed"]


def test_a_flagged_answer_is_refused_whatever_its_format_says_now(older: Workspace) -> None:
    """R55: an Outcome of an unknown major version, filed holding an answer, was put back by
    `retry --force` only to be refused again."""
    assert older.state_of(V9) == ["failed"], older.proc.stderr  # type: ignore[attr-defined]
    proc = older.handoff("retry", "--force", V9)
    assert proc.returncode == 1 and "cannot be retried, even forced" in proc.stderr, proc


def test_a_dependent_of_a_stub_is_told_a_way_that_works(older: Workspace) -> None:
    """R55: "retry the dependency first", though retry refuses a stub even forced."""
    assert older.state_of(STUB_WAITER) == ["failed"], older.proc.stderr  # type: ignore[attr-defined]
    message = older.doc(STUB_WAITER)["error"]["message"]
    assert f"retry {STUB_DEP} first" not in message, message
    assert "is a failure stub" in message and "cannot be retried" in message, message
