"""An answer dropped into pending/ stays an answer when its claim goes back before its admission
(helper Q, session 26).

A claimed seed-001 Response (``status: completed``, its claim leaves the status as written) was
handed back by a passing shortage at its admission (EMFILE searching the seen-ids record) or
recovered by the sweeper after its claimer died (a crash point): the native dialect's
``mark_pending`` set ``status: pending``, so at its next claim it read as a request and ran,
the sender's ``output`` handed to the specialist. HAIOS did the same to a CollaborationResult's
``status`` (still refused, but no valid result any more, and its refusal kept a status nobody
wrote). Now going back to pending/ leaves an answer's status alone in every dialect: it is
refused NOT_A_REQUEST, a seed-001 answer's fields kept under ``refused_answer``.

Each case: one real ``handoffd run`` that crashes at ``after-claim-lease`` (then more runs), or
one whose seen-ids search runs short once (test_seen_shortage_s24's site hook).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import exe, new_workspace
from dialect_examples import AGENT_SUCCESS, HAIOS_RESULT, HI_MOE_FLEET_TO_DISPATCHER, fresh
from test_seed_fidelity_s24 import SEED_FAILURE, SEED_RESPONSE
from test_seen_shortage_s24 import SITE

from handoffd import dialects
from handoffd.core.errors import ErrorCode
from handoffd.core.timeutil import utc_now

REPORT = {"task_id": "bd-26.9", "files_touched": ["src/auth/service.ts"], "summary": "done"}
# an answer as each dialect's sender writes it, with the id (file name) it is dropped under
ANSWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "native-response": (SEED_RESPONSE["handoff_id"], SEED_RESPONSE),
    "native-failure": (SEED_FAILURE["handoff_id"], SEED_FAILURE),
    "haios-result": (HAIOS_RESULT["handoff_id"], HAIOS_RESULT),
    "swarm-report": (REPORT["task_id"], REPORT),
    "hi_moe-outcome": (HI_MOE_FLEET_TO_DISPATCHER["id"], HI_MOE_FLEET_TO_DISPATCHER),
}


def _config(runs: Path) -> str:
    """Every agent the answers name is served by a command that leaves a line in ``runs``:
    an answer that is refused must leave none."""
    code = (f"import json,sys; json.load(sys.stdin); open({str(runs)!r}, 'a').write('ran\\n'); "
            "print(json.dumps({'status': 'completed', 'output': {'ran': True}}))")
    command = json.dumps([sys.executable, "-S", "-c", code])
    served = ("@react-specialist", "ingester-v1", "@swarm-worker", "fleet", "dispatcher")
    return ("[daemon]\nsettle_seconds = 0.05\nclaim_grace_seconds = 0.0\ndurability = \"fast\"\n"
            "[retry]\nretry_delay_seconds = 0.0\n"
            + "".join(f'[specialists."{agent}"]\ncommand = {command}\n' for agent in served))


def _batch(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


@pytest.mark.parametrize("how", ["crash", "shortage"])
@pytest.mark.parametrize("kind", list(ANSWERS))
def test_an_answer_handed_back_before_admission_is_still_refused(
        tmp_path: Path, kind: str, how: str) -> None:
    hid, sent = ANSWERS[kind]
    runs = tmp_path / "runs.txt"
    ws = new_workspace(tmp_path / "ws", _config(runs))
    try:
        ws.drop(f"{hid}.json", fresh(sent))
        if how == "crash":  # dies (as kill -9) with the answer claimed: the next run recovers it
            first = _batch(ws.root, HANDOFFD_CRASH_AT="after-claim-lease")
            assert first.returncode == 99, first.stderr
            assert ws.state_of(hid) == ["in-progress"]
        else:  # its first admission runs short: handed back uncounted, claimed again
            site = tmp_path / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(SITE)
            first = _batch(ws.root, PYTHONPATH=str(site), SEEN_FAULT="contains:before")
            assert first.returncode in (0, 1), first.stderr  # (1: a handoff failed)
        said = first.stderr
        for _ in range(4):  # (bounded) recovered, then claimed again at once
            if ws.state_of(hid) in (["failed"], ["completed"]):
                break
            said += _batch(ws.root).stderr
        assert "Traceback" not in said, said
        events = [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]
        assert ("recovered" if how == "crash" else "handed_back") in events, (events, said)
        assert not runs.exists(), said  # never run
        assert ws.state_of(hid) == ["failed"], said
        filed = ws.doc(hid)
        assert ErrorCode.NOT_A_REQUEST in json.dumps(filed["handoffd"]["final_error"]), filed
        if kind.startswith("native"):  # the sender's fields kept apart, status as written
            answer = {k: v for k, v in sent.items() if k not in ("handoff_id", "source", "target")}
            assert filed["refused_answer"] == answer, filed
        if kind == "haios-result":  # the refused result, kept as sent (its status too)
            assert filed["handoffd"]["request_snapshot"]["status"] == sent["status"], filed
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- unit: claim, then back

def _filed_agent_answer() -> dict[str, Any]:
    """An AgentHandoff answer as handoffd files one: a new id, its request kept."""
    request = fresh(AGENT_SUCCESS)
    return {**request, "handoff_id": "5d0e8f7a-1b2c-4d3e-8f9a-000000000026",
            "handoffd": {"request_snapshot": request}}


@pytest.mark.parametrize("kind", [*ANSWERS, "agent_handoff-answer"])
def test_a_claim_given_back_leaves_an_answer_as_it_was(kind: str) -> None:
    """``mark_claimed`` then ``mark_pending`` (a hand-back, a recovery) leave every dialect's
    answer as its sender wrote it, still an answer."""
    sent = _filed_agent_answer() if kind == "agent_handoff-answer" else fresh(ANSWERS[kind][1])
    dialect = dialects.detect(sent)
    assert dialect.is_answer(sent)  # type: ignore[attr-defined]
    doc = copy.deepcopy(sent)
    dialect.mark_claimed(doc, utc_now())
    dialect.mark_pending(doc)
    assert doc == sent
    assert dialect.is_answer(doc)  # type: ignore[attr-defined]


def test_a_retried_native_failure_reads_pending_again() -> None:
    """`handoff retry` strips a filed failure's answer fields before ``mark_pending``: it is
    a request again, ``status: pending`` (the answer's status is kept only while it is one)."""
    from handoffd.core.filing import restore_request
    doc = {"handoff_id": "h-26", "status": "failed", "target": {"agent_id": "@a"},
           "timestamp_failed": "2026-11-27T00:00:00Z", "error": {"code": "TIMEOUT"},
           "started_at": "2026-11-27T00:00:00Z"}
    restore_request(doc)
    dialects.by_name("native").mark_pending(doc)
    assert doc["status"] == "pending", doc
    assert not {"timestamp_failed", "error", "started_at"} & set(doc), doc


# ---------------------------------------------------------------- `handoff validate` agrees

def test_validate_calls_a_status_less_report_valid_as_it_does_a_response(tmp_path: Path) -> None:
    """Seed 004's completion report (task_id, files_touched, summary: no ``status``) is a
    valid swarm answer, as a seed-001 Response is a valid native one: `handoff validate` said
    "invalid: Missing required field 'status'" while the daemon and `ls` called it an answer
    (NOT_A_REQUEST). A report whose status is no report status stays invalid."""
    ws = new_workspace(tmp_path / "ws", "")
    files = {"report.json": REPORT, "response.json": SEED_RESPONSE,
             "bad.json": {**REPORT, "status": "done"}}
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    try:
        for where in (ws.root, tmp_path / "nowhere"):  # in a workspace, and outside any
            proc = subprocess.run([exe("handoff"), "validate", "--json", "--root", str(where),
                                   *(str(tmp_path / name) for name in files)],
                                  capture_output=True, text=True, timeout=60)
            said = {Path(i["file"]).name: i for i in json.loads(proc.stdout)}
            assert said["report.json"]["valid"] and said["report.json"]["dialect"] == "swarm", said
            assert said["response.json"]["valid"], said
            assert not said["bad.json"]["valid"] and "status" in said["bad.json"]["headline"], said
            assert proc.returncode == 1  # (bad.json)
        plain = ws.handoff("validate", str(tmp_path / "report.json"))
        assert plain.returncode == 0 and plain.stdout.strip().endswith(": valid (swarm)"), plain
    finally:
        ws.cleanup()


@pytest.mark.parametrize("status", ["garbage", 7, "", {"a": 1}, ["x"]])
def test_a_request_status_the_schema_refuses_survives_a_hand_back(status: Any) -> None:
    """A seed-001 request whose ``status`` no seed-001 document has is handed back (a passing
    shortage before its admission) as written: ``mark_pending`` set it to pending, and its next
    claim's schema check passed a request it would have refused (session 26)."""
    native = dialects.by_name("native")
    doc = {"handoff_id": "h-26", "status": status, "target": {"agent_id": "@a"}}
    native.mark_claimed(doc, utc_now())
    native.mark_pending(doc)
    assert doc["status"] == status, doc
    mine = {"handoff_id": "h-27", "target": {"agent_id": "@a"}}  # (no status: pending, as before)
    native.mark_claimed(mine, utc_now())
    native.mark_pending(mine)
    assert mine["status"] == "pending", mine
