"""Two more differences of the PostgreSQL store's file bridge from a files store (session 18,
R16 C and E): a parked handoff (needs_clarification, blocked) a workspace's file agent dropped is
written back into that workspace's pending/, its report in ``handoffd.awaiting.outcome`` where
file readers find it, and goes from there when the handoff leaves pending (nothing was written:
a file-only agent never saw the question); and ``handoff ls --state quarantined`` lists the files
the bridge quarantined in the workspace's .quarantine/ (it listed only the database's).

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from conftest import Workspace, reason_codes
from test_postgres import pg_workspace, request

ASK = '''
import json, sys
doc = json.load(sys.stdin)
answers = (doc.get("input") or {}).get("clarifications")
if isinstance(answers, list) and answers:
    print(json.dumps({"status": "completed", "output": {"answer": answers[-1]["answer"]}}))
elif (doc.get("input") or {}).get("data", {}).get("mode") == "block":
    print(json.dumps({"status": "blocked", "blockers": [{"blocker_id": "b1",
          "type": "resource_unavailable", "description": "no gpu",
          "resolution_options": ["wait"]}]}))
else:
    print(json.dumps({"status": "needs_clarification", "questions": ["which one?"]}))
'''


def ask_workspace(tmp_path: Path, pg_url: str) -> Workspace:
    """A PostgreSQL workspace whose @ask asks its requester until it has an answer (or, for
    ``{"mode": "block"}``, says it is blocked)."""
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    space = pg_workspace(tmp_path / "ws", pg_url)
    with open(space.root / "handoffd.toml", "a") as config:
        config.write(f'\n[specialists."@ask"]\ncommand = ["{sys.executable}", "-S", "{script}"]\n'
                     "timeout_seconds = 20\n")
    return space


def ok(proc: Any) -> Any:
    """``proc`` when it exited 0 without a traceback (else the assertion shows its stderr)."""
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def pending_files(space: Workspace) -> list[str]:
    return sorted(p.name for p in (space.root / "handoffs" / "pending").iterdir())


def parked_copy(space: Workspace, handoff_id: str) -> dict[str, Any]:
    return json.loads((space.root / "handoffs" / "pending" / f"{handoff_id}.json").read_text())


def listed(space: Workspace, *args: str) -> dict[str, str]:
    """id -> state, as ``handoff ls --json ARGS`` lists them."""
    return {r["id"]: r["state"] for r in json.loads(ok(space.handoff("ls", "--json", *args)).stdout)}


# ---------------------------------------------------------------- 1: parked copies
def test_a_parked_handoff_is_written_back_into_pending_and_goes_when_it_leaves(
        tmp_path: Path, pg_url: str) -> None:
    space = ask_workspace(tmp_path, pg_url)
    space.drop("q2.json", request("q2", "@ask", {"mode": "ask"}))
    space.drop("b1.json", request("b1", "@ask", {"mode": "block"}))
    space.handoffd("run")
    # where a file reader finds the report, as on a files store (pending/ was empty)
    assert pending_files(space) == ["b1.json", "q2.json"]
    outcome = parked_copy(space, "q2")["handoffd"]["awaiting"]["outcome"]
    assert outcome["status"] == "needs_clarification" and outcome["questions"] == ["which one?"]
    assert parked_copy(space, "b1")["handoffd"]["awaiting"]["kind"] == "blocked"
    # the copies are the handoffs' own: never ingested again, nor set aside as duplicates
    assert listed(space) == {"q2": "pending", "b1": "pending"}
    ok(space.handoffd("run"))
    assert pending_files(space) == ["b1.json", "q2.json"]
    assert reason_codes(space.root) == {}
    assert space.handoff("wait", "q2", "--timeout", "1").returncode == 4
    taken = space.handoff("create", "--to", "@ask", "--id", "q2", "--data", "{}")
    assert taken.returncode == 1 and "already exists" in taken.stderr, taken.stderr
    # answered and cancelled: the copies go, the results come back
    ok(space.handoff("answer", "q2", "--data", '"the first"'))
    ok(space.handoff("cancel", "b1", "--reason", "no gpu here"))
    ok(space.handoffd("run"))
    assert pending_files(space) == []
    assert space.state_of("q2") == ["completed"] and space.state_of("b1") == ["failed"]
    assert space.doc("q2")["output"]["answer"] == "the first"
    assert reason_codes(space.root) == {}
    assert listed(space) == {"q2": "completed", "b1": "failed"}


def test_a_parked_copy_its_handoff_moved_on_from_is_removed_never_ingested(
        tmp_path: Path, pg_url: str) -> None:
    space = ask_workspace(tmp_path, pg_url)
    space.drop("q3.json", request("q3", "@ask", {"mode": "ask"}))
    space.handoffd("run")
    assert pending_files(space) == ["q3.json"]
    ok(space.handoff("answer", "q3", "--data", '"yes"'))  # no daemon: the copy is stale now
    assert listed(space) == {"q3": "pending"}  # a command's ingest removes it, unread
    assert pending_files(space) == [] and reason_codes(space.root) == {}
    ok(space.handoffd("run"))
    assert space.doc("q3")["output"]["answer"] == "yes"
    assert reason_codes(space.root) == {}


def test_a_serving_daemon_writes_the_parked_copy_and_removes_it_once_answered(
        tmp_path: Path, pg_url: str) -> None:
    space = ask_workspace(tmp_path, pg_url)
    try:
        space.serve()
        space.drop("q4.json", request("q4", "@ask", {"mode": "ask"}))
        copy = space.root / "handoffs" / "pending" / "q4.json"
        deadline = time.monotonic() + 30
        while not (copy.exists() and "awaiting" in copy.read_text()):
            assert time.monotonic() < deadline, "no parked copy in pending/"
            time.sleep(0.05)
        ok(space.handoff("answer", "q4", "--data", '"ok"'))
        assert ok(space.handoff("wait", "q4", "--timeout", "30")).returncode == 0
        deadline = time.monotonic() + 30
        while space.state_of("q4") != ["completed"]:
            assert time.monotonic() < deadline, space.state_of("q4")
            time.sleep(0.05)
        assert reason_codes(space.root) == {}
    finally:
        space.cleanup()


# ---------------------------------------------------------------- 2: local quarantine listed
def test_ls_quarantined_lists_the_files_the_bridge_set_aside_here(
        tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("arr.json", "[1, 2]")
    ok(space.handoff("create", "--to", "@flaky", "--id", "dup1", "--data", "{}"))
    space.drop("dup1.json", request("dup1", "@flaky", {"mode": "ok"}))
    space.handoffd("run")
    codes = reason_codes(space.root)
    assert sorted(codes.values()) == ["DUPLICATE_HANDOFF_ID", "NOT_AN_OBJECT"]
    rows = json.loads(ok(space.handoff("ls", "--state", "quarantined", "--json")).stdout)
    assert sorted(r["note"].split(":")[0] for r in rows) == sorted(codes.values())
    assert all(r["state"] == "quarantined" for r in rows)
    # under the names they are kept as (time-nonce-file name), as on a files store
    assert {r["id"].split("-", 2)[-1] for r in rows} == set(codes)
    everything = listed(space)
    assert {i.split("-", 2)[-1] for i, s in everything.items() if s == "quarantined"} == set(codes)
