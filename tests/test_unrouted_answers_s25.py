"""An answer dropped into pending/ whose target nobody here serves (session 25).

A seed-001 Response or Failure is refused NOT_A_REQUEST when a daemon claims it, but nothing
claims a handoff whose target has no specialist: such an answer stayed in pending/ for ever,
and `handoff ls` said it waited for a specialist, which could never run it. The daemon now
refuses it whatever its target (the other formats' answers already were: their reader refuses
them before any routing), and `ls` says it will be refused. An ordinary request for a target
nobody serves still waits, and a drain of ordinary requests never asks the question.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, Workspace, new_workspace
from dialect_examples import HAIOS_RESULT, HI_MOE_FLEET_TO_DISPATCHER, fresh
from test_answer_fidelity_s25 import _native
from test_seed_fidelity_s24 import SEED_FAILURE, SEED_RESPONSE

from handoffd import Registry, build_engine
from handoffd.core.errors import ErrorCode
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.dialects.native import NativeDialect

# no specialist at all: @react-specialist (the seed answers' target), ROUTING_DISPATCHER (the
# hi_moe outcome's) and nobody else is served
CONFIG = """
[daemon]
settle_seconds = 0.05
durability = "fast"
"""
WAITING = "hoff-waits-s25"  # an ordinary request for a target nobody serves: it still waits
ANSWERS = {SEED_RESPONSE["handoff_id"]: SEED_RESPONSE, SEED_FAILURE["handoff_id"]: SEED_FAILURE,
           HI_MOE_FLEET_TO_DISPATCHER["id"]: HI_MOE_FLEET_TO_DISPATCHER,
           HAIOS_RESULT["handoff_id"]: HAIOS_RESULT}
NATIVE = (SEED_RESPONSE["handoff_id"], SEED_FAILURE["handoff_id"])


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """Every answer and the waiting request dropped into pending/; `handoff ls --json` before
    one `handoffd run` (kept as ``ws.listed``; the run as ``ws.proc``)."""
    ws = new_workspace(tmp_path_factory.mktemp("unrouted25") / "ws", CONFIG)
    for hid, doc in ANSWERS.items():
        ws.drop(f"{hid}.json", fresh(doc))
    ws.drop(f"{WAITING}.json", _native(WAITING, "@nobody"))
    listed = ws.handoff("ls", "--json", check=True)
    ws.listed = {row["id"]: row for row in json.loads(listed.stdout)}  # type: ignore[attr-defined]
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    ws.proc = proc  # type: ignore[attr-defined]
    return ws


@pytest.mark.parametrize("hid", list(ANSWERS))
def test_an_answer_for_a_target_nobody_serves_is_refused(ran: Workspace, hid: str) -> None:
    assert ran.state_of(hid) == ["failed"]
    doc = ran.doc(hid)
    error = doc["payload"] if "payload" in doc else doc["error"]
    code = doc["handoffd"].get("final_error", {}).get("code") or error.get("code")
    assert code == ErrorCode.NOT_A_REQUEST, doc


@pytest.mark.parametrize("hid", NATIVE)
def test_a_refused_seed_answer_keeps_what_it_brought_apart(ran: Workspace, hid: str) -> None:
    doc = ran.doc(hid)
    assert doc["status"] == "failed" and doc["error"]["code"] == ErrorCode.NOT_A_REQUEST, doc
    assert doc["refused_answer"]["status"] == ANSWERS[hid]["status"], doc
    assert "output" not in doc and doc["retry_available"] is False, doc


def test_the_batch_fails_for_them_and_a_request_still_waits(ran: Workspace) -> None:
    proc = ran.proc  # type: ignore[attr-defined]
    assert proc.returncode == 1, proc.stderr  # docs/operations.md: a handoff filed in failed/
    assert "batch done: completed 0, failed 4, retry scheduled 0, left pending with no " \
           "specialist 1" in proc.stderr, proc.stderr
    assert ran.state_of(WAITING) == ["pending"]


@pytest.mark.parametrize("hid", NATIVE)
def test_ls_says_a_seed_answer_will_be_refused(ran: Workspace, hid: str) -> None:
    note = ran.listed[hid]["note"]  # type: ignore[attr-defined]
    assert note.startswith("NOT_A_REQUEST: ") and "an answer, not a request" in note, note
    assert ran.listed[WAITING]["note"] == "waiting: no specialist registered for @nobody"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the engine's read
def _engine(tmp_path: Path, served: str, *drops: dict[str, Any]) -> Any:
    """An engine (files store) on a fresh workspace serving ``served``, with ``drops`` dropped
    into pending/ as a foreign producer writes them (no history: not yet taken up)."""
    ws = new_workspace(tmp_path / "ws", CONFIG)
    for doc in drops:
        ws.drop(f"{doc['handoff_id']}.json", copy.deepcopy(doc))
    registry = Registry()
    registry.add_function(served, lambda doc, ctx: {})
    return build_engine(HandoffdWorkspace(ws.root), registry=registry, clock=Clock())


def test_the_engine_reads_an_unserved_answer_as_a_claimable_refusal(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "@ok", SEED_RESPONSE)
    hid = SEED_RESPONSE["handoff_id"]
    peek = engine.peek(hid)
    assert not peek.readable and peek.problem is not None, peek
    assert peek.problem.code == ErrorCode.NOT_A_REQUEST and peek.problem.claimable, peek.problem
    assert engine.take(hid) is None  # claimed, the refusal is filed
    state, doc = engine.get(hid)
    assert state.value == "failed" and doc["error"]["code"] == ErrorCode.NOT_A_REQUEST, doc


def test_a_served_target_never_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The question is asked only when nobody serves the target: never while a drain of
    ordinary requests is read (an answer for a served target is refused by its claim)."""
    asked: list[str] = []
    original = NativeDialect.refuse_unclaimed

    def counting(self: NativeDialect, doc: dict[str, Any], handoff_id: str) -> None:
        asked.append(handoff_id)
        original(self, doc, handoff_id)

    monkeypatch.setattr(NativeDialect, "refuse_unclaimed", counting)
    served, unserved = _native("hoff-served-s25", "@react-specialist"), _native(WAITING, "@nobody")
    engine = _engine(tmp_path, "@react-specialist", served, SEED_RESPONSE, unserved)
    assert engine.peek(served["handoff_id"]).readable
    assert engine.peek(SEED_RESPONSE["handoff_id"]).readable  # (its claim refuses it)
    assert asked == []
    peek = engine.peek(WAITING)
    assert peek.readable and peek.target == "@nobody" and asked == [WAITING], peek
