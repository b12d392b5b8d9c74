"""A document whose id is not its file name: `handoff ls` and the daemon say the same code
(session 27, found by the helper of 21d6977; tests/test_answer_retries_s27.py is that fix's).

1. a request whose safe id differs from its file name (``pending/a-1.json`` holding
   ``b-2``): the daemon set it aside ID_MISMATCH when it claimed it, `ls` noted nothing (or
   "waiting: no specialist registered"); with no specialist here for its target nobody
   claimed it, so it stayed in pending/ unnoted for ever. Now `ls` notes ``ID_MISMATCH: ...``
   and the daemon sets it aside whether or not it serves the target;
2. an id that is no safe file name (a request's or an answer's): `ls` said UNSAFE_ID, the
   daemon ID_MISMATCH. Both now say ID_MISMATCH (the code the poison corpus and
   tests/test_bad_input.py expect), the message giving the rule UNSAFE_ID gave.

Answers come first (21d6977) only when they answer the request the file is named after (review
R53 #3): a hi_moe Outcome whose ``correlation_id`` is its file name (a filed answer copied
from another workspace) is refused NOT_A_REQUEST by both. A seed-001, HAIOS or swarm answer
carries its request's id as its own, so one whose id is not its file name answers another
request: it was filed as failed/X.json holding ``handoff_id: Y`` (seed 001 files
failed/{request id}.json, so a reader keying on content blamed Y, perhaps a live handoff
here); it is set aside ID_MISMATCH again, its stub named and holding X. So is an Outcome
answering another request, and (R53 #4) one of an unknown major version or a swarm report
whose task_id is no string, `ls` saying the same. Each case is listed by a real
`handoff ls --json` before one real `handoffd run` and listed again after it.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
from conftest import Clock, Workspace, memory_engine, new_workspace
from dialect_examples import HAIOS_RESULT, fresh
from test_answer_retries_s27 import CONFIG, _filed_answer, _response, _rows

from handoffd.core import engine as engine_module
from handoffd.core.errors import ErrorCode

SERVED, NOBODY = "@react-specialist", "@nobody-here"


def _request(hid: Any, agent: str = SERVED) -> dict[str, Any]:
    return {"handoff_id": hid, "target": {"agent_id": agent}, "input": {"data": {}}}


def _cases(answer: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str]]:
    """file name -> (the document dropped as it, the code both must give)."""
    served_answer = copy.deepcopy(answer)
    served_answer["target_tier"] = "SPECIALIZED_FLEET"  # (as filed: ROUTING_DISPATCHER, unserved)
    served_answer["correlation_id"] = "moe-other-served"  # copied as the request it answers
    other_response = _response("resp-elsewhere")
    unserved_response = _response("resp-elsewhere-2")
    unserved_response["target"] = {"agent_id": NOBODY}
    other_outcome = {**answer, "correlation_id": "req-elsewhere"}  # answers another request
    unknown_major = {**answer, "correlation_id": "moe-v9-own", "version": "9.0.0"}
    haios_result = {**fresh(HAIOS_RESULT), "handoff_id": "haios-elsewhere"}
    report = {"task_id": "swarm-elsewhere", "files_touched": [], "status": "success"}
    mismatch, not_a_request = ErrorCode.ID_MISMATCH, ErrorCode.NOT_A_REQUEST
    return {
        "req-other-served": (_request("b-2"), mismatch),
        "req-other-nobody": (_request("b-3", NOBODY), mismatch),
        "req-unsafe-served": (_request("../x"), mismatch),
        "req-unsafe-nobody": (_request("../y", NOBODY), mismatch),
        "req-number-nobody": (_request(5, NOBODY), mismatch),
        "moe-unsafe-served": ({**served_answer, "id": "../escape"}, mismatch),
        "moe-unsafe-nobody": ({**answer, "id": "../escape-2"}, mismatch),
        # answers first, as 21d6977, for the answer to the file name's request alone
        "moe-other-served": (served_answer, not_a_request),
        "moe-answers-another": (other_outcome, mismatch),
        "moe-other-v9": ({**answer, "id": "other-id", "version": "9.0.0"}, mismatch),  # R53 p05
        "moe-v9-own": (unknown_major, mismatch),
        "resp-other-served": (other_response, mismatch),
        "resp-other-nobody": (unserved_response, mismatch),
        "haios-other": (haios_result, mismatch),
        "swarm-other": (report, mismatch),
        "swarm-list-id": ({**report, "task_id": ["x"]}, mismatch),  # R53 p21
        # its id its file name, its target served: its claim refuses it, and `ls` said nothing
        "resp-own-served": (_response("resp-own-served"), not_a_request),
    }


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """Every case dropped, with one usual request, listed (``ws.before``), one `handoffd run`
    (``ws.proc``), listed again (``ws.after``); ``ws.cases`` holds the cases."""
    tmp = tmp_path_factory.mktemp("idmismatch27")
    answer = _filed_answer(tmp)
    ws = new_workspace(tmp / "b", CONFIG)
    ws.cases = _cases(answer)  # type: ignore[attr-defined]
    for name, (doc, _) in ws.cases.items():  # type: ignore[attr-defined]
        ws.drop(f"{name}.json", doc)
    ws.drop("req-usual.json", _request("req-usual"))
    ws.before = _rows(ws)  # type: ignore[attr-defined]
    ws.proc = ws.handoffd("run", timeout=60)  # type: ignore[attr-defined]
    assert "Traceback" not in ws.proc.stderr, ws.proc.stderr  # type: ignore[attr-defined]
    ws.after = _rows(ws)  # type: ignore[attr-defined]
    return ws


@pytest.mark.parametrize("name", list(_cases({})))  # (the names alone)
def test_ls_notes_what_the_daemon_files(ran: Workspace, name: str) -> None:
    code = ran.cases[name][1]  # type: ignore[attr-defined]
    before, after = ran.before[name], ran.after[name]  # type: ignore[attr-defined]
    assert before["state"] == "pending" and before["note"].startswith(f"{code}: "), before
    assert after["state"] == "failed" and after["note"] == before["note"], (before, after)
    assert ran.state_of(name) == ["failed"]  # nothing left in pending/, served or not
    set_aside = list((ran.root / "handoffs" / ".quarantine").glob(f"*{name}.json"))
    assert bool(set_aside) == (code == ErrorCode.ID_MISMATCH), set_aside
    if code == ErrorCode.ID_MISMATCH:  # the daemon's own line says the same
        stderr: str = ran.proc.stderr  # type: ignore[attr-defined]
        said = [line for line in stderr.splitlines() if f"{name}.json" in line]
        assert said and all(f"{code}: " in line for line in said), said
        # failed/NAME.json is its stub: it names the file, never the id the sender wrote
        assert ran.doc(name)["handoff_id"] == name, ran.doc(name)


def test_an_unsafe_id_is_told_as_one(ran: Workspace) -> None:
    """ID_MISMATCH for an unsafe id keeps what UNSAFE_ID said: the id is no safe file name,
    and what a safe one is."""
    for name in ("req-unsafe-served", "moe-unsafe-nobody", "req-number-nobody"):
        note = ran.before[name]["note"]  # type: ignore[attr-defined]
        assert "which is not a safe file name (use 1-128 letters" in note, note
        assert note.endswith("the file name must be the id"), note
    safe = ran.before["req-other-served"]["note"]  # type: ignore[attr-defined]
    assert "not a safe file name" not in safe, safe


def test_the_usual_request_still_runs(ran: Workspace) -> None:
    assert ran.before["req-usual"]["note"] == ""  # type: ignore[attr-defined]
    assert ran.state_of("req-usual") == ["completed"]
    summary = ran.proc.stderr.strip().splitlines()[-1]  # type: ignore[attr-defined]
    assert "left pending" not in summary, summary  # the unserved ones were set aside too


def test_peek_of_the_usual_document_asks_nothing_more(tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path: a document carrying its file's id costs peek one string compare, never
    the id refusal's questions (id_of, the answer checks)."""
    engine, _ = memory_engine(tmp_path, Clock(),
                              {SERVED: lambda handoff, ctx: {"status": "completed"}})
    hid = engine.submit(_request("usual-1"))
    asked: list[str] = []
    monkeypatch.setattr(engine_module, "id_refusal", lambda *args: asked.append(args[2]))
    peek = engine.peek(hid)
    assert peek is not None and peek.readable and peek.target == SERVED, peek
    assert asked == []
