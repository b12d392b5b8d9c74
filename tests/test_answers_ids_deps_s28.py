"""Answers, ids and dependencies (session 28):

1. a hi_moe Outcome dropped into pending/ and refused NOT_A_REQUEST was filed as
   failed/{file name}.json answering its own id (or, copied from another workspace, the id it
   answered was lost for the Outcome's own): the dialect's ``render`` was not given the file
   name, and a raw claim's bookkeeping block named none. The refusal now answers the file
   name (``correlation_id``), and the block of a raw claim names it (``handoffd.id``);
2. a dependant looked at while its dependency was being set aside (out of pending/, its failure
   stub not yet in failed/) was failed DEPENDENCY_MISSING "removed by retention" (seen in CI).
   Its reason now names both ways (retention, or a set-aside);
3. ``restore_request`` stripped ``refused_answer`` from every retried document: a request
   carrying its own field of that name lost it on `handoff retry`. Only what handoffd moved
   there (its filing recorded an answer) is taken out.

Real `handoff` and `handoffd run` processes against tmp workspaces; the window of item 2 is
made in process as admission makes it (the set-aside first, the stub after).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import HI_MOE_FLEET_TO_DISPATCHER

from handoffd.core.errors import ErrorCode


def _command(code: str) -> str:
    """A specialist command line (TOML array) running ``code`` on the handoff from stdin."""
    return json.dumps([sys.executable, "-c", "import json,sys; json.load(sys.stdin); " + code])


QUICK = _command("print(json.dumps({'status': 'completed', 'output': {'ran': True}}))")
FAILS = _command("print(json.dumps({'status': 'failed', 'error': {'code': 'VALIDATION_FAILED', "
                 "'message': 'nope', 'retryable': False}}))")
CONFIG = f"""
[daemon]
settle_seconds = 0.05
durability = "fast"

[specialists."ROUTING_DISPATCHER"]
command = {QUICK}

[specialists."@react-specialist"]
command = {FAILS}

[specialists."@quick"]
command = {QUICK}
"""
COPIED = "moe-copied-s28"  # an Outcome answering the file name, with an id of its own
OWN = "moe-own-s28"  # an Outcome dropped under its own id, answering another message
CARRIER = "hoff-carrier-s28"  # a request carrying a user field named refused_answer
USERS = {"note": "the user's own field", "status": "kept"}


def _outcome(own_id: str, answers: str) -> dict[str, Any]:
    doc = copy.deepcopy(HI_MOE_FLEET_TO_DISPATCHER)
    doc["id"], doc["correlation_id"] = own_id, answers
    return doc


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """Two hi_moe Outcomes and a request carrying ``refused_answer`` dropped, one real
    `handoffd run`."""
    ws = new_workspace(tmp_path_factory.mktemp("s28") / "ws", CONFIG)
    ws.drop(f"{COPIED}.json", _outcome("moe-its-own-id-s28", COPIED))
    ws.drop(f"{OWN}.json", _outcome(OWN, "moe-another-s28"))
    ws.drop(f"{CARRIER}.json", {"handoff_id": CARRIER, "status": "pending",
                                "source": {"agent_id": "@cli"},
                                "target": {"agent_id": "@react-specialist"},
                                "input": {"data": {}}, "refused_answer": USERS})
    ws.proc = ws.handoffd("run", timeout=60)  # type: ignore[attr-defined]
    assert "Traceback" not in ws.proc.stderr, ws.proc.stderr  # type: ignore[attr-defined]
    yield ws
    ws.cleanup()


# ---------------------------------------------------------------- 1: the refusal names the file
@pytest.mark.parametrize("hid", [COPIED, OWN])
def test_a_refused_outcome_answers_the_file_it_was_dropped_as(ran: Workspace, hid: str) -> None:
    assert ran.state_of(hid) == ["failed"], ran.proc.stderr  # type: ignore[attr-defined]
    filed = ran.doc(hid)
    assert filed["payload"]["error_type"] == "not_a_request", filed
    assert filed["correlation_id"] == hid, filed  # (the copy's: its own id, before)
    assert filed["handoffd"]["id"] == hid, filed["handoffd"]  # (a raw claim's block: none)
    listed = json.loads(ran.handoff("show", hid, "--json", check=True).stdout)
    assert listed["id"] == hid and listed["state"] == "failed", listed


# ---------------------------------------------------------------- 3: a user's refused_answer
def test_a_retry_keeps_a_users_refused_answer(ran: Workspace) -> None:
    filed = ran.doc(CARRIER)
    assert filed["error"]["code"] == "VALIDATION_FAILED", filed
    assert filed["refused_answer"] == USERS, filed
    ran.handoff("retry", "--force", CARRIER, check=True)
    assert ran.state_of(CARRIER) == ["pending"]
    assert ran.doc(CARRIER)["refused_answer"] == USERS  # (stripped, before)
    proc = ran.handoffd("run", timeout=60)
    assert ran.state_of(CARRIER) == ["failed"], proc.stderr
    assert ran.doc(CARRIER)["refused_answer"] == USERS


def test_handoffds_own_refused_answer_is_still_taken_out() -> None:
    """What handoffd moved there (its filing recorded an answer) goes, as before."""
    from handoffd.core.filing import HELD_ANSWER, restore_request
    own = {"handoff_id": "x", "status": "failed", "refused_answer": {"status": "completed"},
           "handoffd": {"final_error": {"code": ErrorCode.NOT_A_REQUEST, HELD_ANSWER: True}}}
    restore_request(own)
    assert "refused_answer" not in own, own
    users = {"handoff_id": "x", "status": "failed", "refused_answer": USERS,
             "handoffd": {"final_error": {"code": "VALIDATION_FAILED"}}}
    restore_request(users)
    assert users["refused_answer"] == USERS, users


# ---------------------------------------------------------------- 2: a dependency set aside
DEP = "hoff-aside-dep-s28"
WAITER = "hoff-aside-waiter-s28"


def _waiter(ws: Workspace) -> None:
    ws.drop(f"{WAITER}.json", {"handoff_id": WAITER, "status": "pending",
                               "source": {"agent_id": "@cli"}, "target": {"agent_id": "@quick"},
                               "input": {"data": {}}, "depends_on": [DEP]})


@pytest.fixture
def aside(tmp_path: Path) -> Iterator[tuple[Workspace, Any]]:
    """A workspace whose dependency DEP is half set aside, as admission leaves it for a moment:
    its id used (seen), its file moved into the quarantine, its failure stub not yet filed;
    and the in-process engine that did it."""
    from handoffd.cli.basics import engine as open_engine
    from handoffd.core.states import State
    ws = new_workspace(tmp_path / "ws", CONFIG)
    ws.drop(f"{DEP}.json", {"handoff_id": "another-id-s28", "status": "pending",
                            "source": {"agent_id": "@cli"}, "target": {"agent_id": "@quick"},
                            "input": {"data": {}}})
    engine = open_engine(ws.root)
    engine.backend.seen_add(DEP, engine.clock())
    assert engine.backend.set_aside(DEP, State.PENDING, ErrorCode.ID_MISMATCH, "test: mismatch")
    _waiter(ws)
    yield ws, engine
    engine.backend.close()
    ws.cleanup()


def test_a_dependant_of_a_dependency_being_set_aside_is_told_it_may_be(
        aside: tuple[Workspace, Any]) -> None:
    """Failed DEPENDENCY_MISSING (its stub, a moment later, would fail it too), the reason
    naming both ways a used id leaves every state: retention, or a set-aside (it said
    "removed by retention" alone). The quarantine is not read on the gate's path (R59: a
    listing per missing dependency, twice, cost a batch 81 s with 2,900 entries; a forged
    record held dependants)."""
    ws, _engine = aside
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ws.state_of(WAITER) == ["failed"], proc.stderr
    error = ws.doc(WAITER)["error"]
    assert error["code"] == ErrorCode.DEPENDENCY_MISSING, error
    assert "or it was set aside unread: `handoff ls --state quarantined` lists it" \
        in error["message"], error
