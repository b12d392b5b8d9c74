"""Finished documents handoffd did not file: their `handoffd` block is not handoffd's record.

A document in completed/ or failed/ may be written by another consumer (seed 001's own writes
those folders itself), carrying whatever `handoffd` block it likes. Its block is handoffd's only
when its seal matches the folder it is in (`Backend.trusted_book`); otherwise every reader takes
its state from the folder and its status and error from its own fields, says it was filed by
another consumer, and no decision reads the block. Each test below was a repro of the filed-trust
hunt: a forged block in completed/ or failed/ made a reader present it as handoffd's own record
or decide on it."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, new_workspace, run_python

from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.memory import MemoryBackend
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.storage import FOREIGN_FILING, Backend, foreign_filing, trusted_doc
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace

PRINT = [sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])"]
CONFIG = "".join(
    f'[specialists."{name}"]\ncommand = {json.dumps([*PRINT, json.dumps(answer)])}\n'
    f"retry = {{ max_retries = 0 }}\n"
    for name, answer in (("@ok", {"status": "completed", "output": {"n": 1}}),
                         ("@no", {"status": "failed", "error": {"code": "PROCESSING_ERROR",
                                                                "message": "ours"}})))
MONTH = 30 * 86400


@pytest.fixture
def fws(tmp_path: Path) -> Any:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def native(handoff_id: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": handoff_id, "source": {"agent_id": "@o"},
            "target": {"agent_id": "@a"}, "input": {"data": {}}, **extra}


def forged(**extra: Any) -> dict[str, Any]:
    """A `handoffd` block as a hostile writer makes it: a seal that is no seal, a history, an
    attempt count, plus ``extra``."""
    actor = {"host": "forged-host", "pid": 1}
    return {"revision": 9, "attempt": 7, "dialect": "native", "seal": "0" * 32,
            "history": [{"at": "2020-01-01T00:00:00Z", "event": "created", "actor": actor},
                        {"at": "2020-01-01T00:00:01Z", "event": "claimed", "actor": actor},
                        {"at": "2020-01-01T00:00:02Z", "event": "completed", "actor": actor}],
            **extra}


def file_doc(ws: Workspace, folder: str, doc: dict[str, Any], *, age: float = 0.0) -> Path:
    """Write ``doc`` into ``folder`` as a foreign consumer would (``age``: seconds ago)."""
    path = ws.root / "handoffs" / folder / f"{doc['handoff_id']}.json"
    path.write_text(json.dumps(doc))
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def failed_doc(handoff_id: str, **block: Any) -> dict[str, Any]:
    """A failure whose own error differs from the one its forged block names."""
    return native(handoff_id, status="failed", retry_available=True,
                  error={"code": "PROCESSING_ERROR", "message": "the consumer's words"},
                  handoffd=forged(final_error={"code": "FORGED_CODE", "message": "never said"},
                                  **block))


# ------------------------------------------------------------------ what readers present
def test_show_says_another_consumer_filed_it_and_prints_no_forged_history(fws: Workspace) -> None:
    """R1: the forged history was printed as handoffd's timeline, its `children` as the
    handoff's family and its `aggregated_outcome` as an aggregation."""
    fws.create("--to", "@a", "--id", "victim", "--data", "{}")
    file_doc(fws, "completed", native("done1", status="completed", output={"x": 1}, handoffd=forged(
        children=["victim"], aggregated_outcome={"strategy_used": "all_success",
                                                 "aggregated_status": "success"})))
    proc = fws.handoff("show", "done1")
    assert proc.returncode == 0, proc.stderr
    assert FOREIGN_FILING in proc.stdout
    for forged_word in ("forged-host", "victim", "aggregated", "history"):
        assert forged_word not in proc.stdout, proc.stdout
    data = json.loads(fws.handoff("show", "done1", "--json").stdout)
    assert data["state"] == "completed" and data["foreign_filing"] is True
    assert data["document"]["output"] == {"x": 1} and data["family"]["children"] == []
    assert "history" not in data["document"]["handoffd"]
    assert data["family"]["aggregated_outcome"] is None


def test_wait_takes_the_folder_and_the_documents_own_error(fws: Workspace) -> None:
    """R2: wait named the forged block's `final_error` as the failure; and a pending drop with a
    forged `awaiting` ended the wait with exit 4 ("asks its requester") and could be answered."""
    file_doc(fws, "failed", failed_doc("bad1"))
    proc = fws.handoff("wait", "bad1", "--timeout", "5")
    assert proc.returncode == 1 and proc.stdout == "bad1 failed\n", proc
    assert "FORGED_CODE" not in proc.stderr and "never said" not in proc.stderr
    assert "PROCESSING_ERROR: the consumer's words" in proc.stderr
    assert FOREIGN_FILING in proc.stderr
    file_doc(fws, "completed", native("done1", status="failed", handoffd=forged()))
    proc = fws.handoff("wait", "done1", "--timeout", "5")
    assert proc.returncode == 0 and proc.stdout == "done1 completed\n", proc  # the folder decides
    file_doc(fws, "pending", native("asks1", handoffd={
        "awaiting": {"kind": "needs_clarification", "questions": ["forged?"]}}))
    proc = fws.handoff("wait", "asks1", "--timeout", "0.5")
    assert proc.returncode == 124 and "forged?" not in proc.stderr, proc
    proc = fws.handoff("answer", "asks1", "--data", '"x"')
    assert proc.returncode == 1 and "not waiting for an answer" in proc.stderr, proc


def test_trace_attaches_no_forged_child_and_shows_no_forged_times(fws: Workspace) -> None:
    """R3: a forged `parent_id` in the block hung the document under a real handoff, with its
    forged timings and aggregation note."""
    fws.create("--to", "@a", "--id", "parent1", "--data", "{}")
    file_doc(fws, "completed", native("intruder", status="completed", handoffd=forged(
        parent_id="parent1", aggregated_outcome={"strategy_used": "all_success",
                                                 "aggregated_status": "success"})))
    tree = json.loads(fws.handoff("trace", "parent1", "--json").stdout)["trees"]
    assert [t["id"] for t in tree] == ["parent1"] and tree[0]["children"] == []
    (node,) = json.loads(fws.handoff("trace", "intruder", "--json").stdout)["trees"]
    assert node["parent_id"] is None and node["note"] == FOREIGN_FILING
    assert node["created_at"] is node["started_at"] is node["finished_at"] is node["seconds"] is None
    proc = fws.handoff("trace", "intruder")
    assert proc.returncode == 0 and FOREIGN_FILING in proc.stdout and "2020-" not in proc.stdout


def test_ls_shows_no_forged_attempt_dialect_error_or_time(fws: Workspace) -> None:
    """R4: the row took its attempt, dialect and error note from the block, and its `updated`
    from a forged history ending in 2099."""
    file_doc(fws, "failed", failed_doc("bad1", attempt=42, dialect="haios",
                                       history=[{"at": "2099-01-01T00:00:00Z", "event": "failed"}]))
    (row,) = json.loads(fws.handoff("ls", "--json").stdout)
    assert row["attempt"] == 0 and row["dialect"] is None and row["to"] == "@a"
    assert not row["updated"].startswith("2099")
    assert row["note"] == f"PROCESSING_ERROR: the consumer's words; {FOREIGN_FILING}"
    proc = fws.handoff("ls")
    assert "FORGED_CODE" not in proc.stdout and " 42 " not in proc.stdout, proc.stdout


def test_client_and_mcp_view_take_the_documents_own_error(fws: Workspace) -> None:
    """R8: the Python client's `Result.error` (and so the MCP server's `error`) was the forged
    `final_error`, and its document carried the forged history."""
    file_doc(fws, "failed", failed_doc("bad1"))
    proc = run_python(
        "import json, sys\n"
        "from handoffd import Client\n"
        "from handoffd.service.mcp_server import _view\n"
        "c = Client(sys.argv[1])\n"
        "r = c.handle('bad1').wait(timeout=5)\n"
        "print(json.dumps([r.ok, r.foreign, r.error.code, r.error.message,\n"
        "                  r.document['handoffd'], _view(c.get('bad1'))['error']]))\n",
        str(fws.root))
    assert proc.returncode == 0, proc.stderr
    ok, foreign, code, message, block, view = json.loads(proc.stdout)
    assert (ok, foreign, code, message) == (False, True, "PROCESSING_ERROR", "the consumer's words")
    assert block == {"revision": 9}  # only the token `retry` compares; never trusted
    assert view == {"code": "PROCESSING_ERROR", "message": "the consumer's words"}


# ------------------------------------------------------------------ what decides on it
def test_retention_ages_a_foreign_filing_from_its_file_and_ignores_its_parent(
        fws: Workspace) -> None:
    """R5: a forged history ending in 2099 kept a month-old filing for ever, and a forged
    `parent_id` naming a live handoff kept another as its child."""
    fws.create("--to", "@a", "--id", "live1", "--data", "{}")
    file_doc(fws, "completed", native("old1", status="completed", handoffd=forged(
        history=[{"at": "2099-01-01T00:00:00Z", "event": "completed"}])), age=MONTH)
    file_doc(fws, "completed", native("old2", status="completed",
                                      handoffd=forged(parent_id="live1")), age=MONTH)
    file_doc(fws, "completed", native("new1", status="completed", handoffd=forged()))
    proc = fws.handoff("purge", "--older-than", "7d", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert sorted(r["id"] for r in result["removed"]) == ["old1", "old2"] and result["kept"] == {}
    assert fws.state_of("new1") == ["completed"]  # filed just now: young, whatever it claims


def test_an_archived_foreign_filing_is_still_shown_as_one(fws: Workspace) -> None:
    """R10: archived as stored, the forged history came back through `show` and the forged
    error through `wait`."""
    file_doc(fws, "failed", failed_doc("old1"), age=MONTH)
    assert fws.handoff("archive", "--older-than", "7d").returncode == 0
    assert fws.state_of("old1") == []
    proc = fws.handoff("show", "old1")
    assert proc.returncode == 0 and FOREIGN_FILING in proc.stdout, proc
    assert "forged-host" not in proc.stdout
    assert json.loads(fws.handoff("show", "old1", "--json").stdout)["foreign_filing"] is True
    proc = fws.handoff("wait", "old1", "--timeout", "5")
    assert proc.returncode == 1 and "FORGED_CODE" not in proc.stderr, proc
    assert "the consumer's words" in proc.stderr


def test_cancel_cascade_follows_no_forged_children(fws: Workspace) -> None:
    """R6: `cancel --cascade` of a completed document whose forged block listed `children`
    cancelled a pending handoff it never delegated."""
    fws.create("--to", "@a", "--id", "victim1", "--data", "{}")
    file_doc(fws, "completed", native("done1", status="completed",
                                      handoffd=forged(children=["victim1"])))
    proc = fws.handoff("cancel", "done1", "--cascade")
    assert proc.returncode == 0 and "victim1" not in proc.stdout, proc
    assert fws.state_of("victim1") == ["pending"]


def test_retry_restores_the_documents_own_request_and_starts_our_history(fws: Workspace) -> None:
    """R7: `retry` put the forged `request_snapshot` (another target, other data) back as the
    request and sealed the forged history as handoffd's; a forged `retry_available: false`
    refused a retry the document itself allows."""
    file_doc(fws, "failed", failed_doc("bad1", request_snapshot=native(
        "bad1", target={"agent_id": "@evil"}, input={"data": {"rm": "-rf"}})))
    assert fws.handoff("retry", "bad1").returncode == 0
    doc = fws.doc("bad1")
    assert fws.state_of("bad1") == ["pending"]
    assert doc["target"] == {"agent_id": "@a"} and doc["input"] == {"data": {}}
    assert [e["event"] for e in doc["handoffd"]["history"]] == ["retried"]
    proc = fws.handoff("show", "bad1")
    assert "forged-host" not in proc.stdout and "retried" in proc.stdout, proc.stdout
    file_doc(fws, "failed", failed_doc("bad2", retry_available=False))
    proc = fws.handoff("retry", "bad2")
    assert proc.returncode == 0 and fws.state_of("bad2") == ["pending"], proc.stderr


def test_create_if_absent_compares_the_filed_document_not_a_forged_snapshot(
        fws: Workspace) -> None:
    """R12: a forged `request_snapshot` equal to what a producer then submitted made
    `create --if-absent` answer "already there" (exit 0) for a request nobody ran."""
    wanted = native("job7", source={"agent_id": "@cli"}, status="pending", input={"data": {"q": 1}})
    file_doc(fws, "completed", native("job7", status="completed", input={"data": {"other": 2}},
                                      handoffd=forged(request_snapshot=wanted)))
    proc = fws.handoff("create", "--to", "@a", "--id", "job7", "--if-absent", "--data", '{"q": 1}')
    assert proc.returncode == 5 and "different request" in proc.stderr, proc


def test_a_parent_adopts_no_child_by_a_forged_created_event(tmp_path: Path) -> None:
    """R9: a delegating parent's crash replay adopts an existing child id only when handoffd's
    own bookkeeping says an interrupted attempt of the parent made it; a completed/ document
    whose forged block holds such a `created` event was adopted (and its forged completion
    aggregated as the child's)."""
    from handoffd import build_engine
    from handoffd.features.children import (
        _made_by_interrupted_attempt as made_by_interrupted_attempt,
    )
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    actor = {"host": "h1", "pid": 100}
    parent = native("job", handoffd={"history": [
        {"at": "2026-01-01T00:00:00Z", "event": "created", "actor": actor},
        {"at": "2026-01-01T00:00:01Z", "event": "claimed", "actor": actor},
        {"at": "2026-01-01T00:00:09Z", "event": "recovered", "actor": {"host": "h2", "pid": 1}}]})
    ws.doc_path(State.COMPLETED, "job.c1").write_text(json.dumps(native(
        "job.c1", parent_id="job", status="completed", handoffd={"revision": 3, "history": [
            {"at": "2026-01-01T00:00:02Z", "event": "created", "actor": actor}]})))
    engine = build_engine(ws)
    try:
        state, existing = engine.get("job.c1")
        assert state is State.COMPLETED and foreign_filing(state, existing)
        assert not made_by_interrupted_attempt(engine, "job.c1", state, existing, parent, "job")
    finally:
        engine.backend.close()


# ------------------------------------------------------------------ handoffd's own stays its own
def test_handoffds_own_filings_keep_their_history(fws: Workspace) -> None:
    """What handoffd filed itself (sealed for the folder it is in) is read as before: history,
    attempt, its own error record; no foreign note anywhere."""
    fws.create("--to", "@ok", "--id", "good", "--data", "{}")
    fws.create("--to", "@no", "--id", "bad", "--data", "{}")
    assert "completed 1, failed 1" in fws.handoffd("run").stderr
    assert fws.state_of("good") == ["completed"] and fws.state_of("bad") == ["failed"]
    proc = fws.handoff("show", "good")
    assert "completed" in proc.stdout and "claimed" in proc.stdout
    assert FOREIGN_FILING not in proc.stdout
    assert json.loads(fws.handoff("show", "good", "--json").stdout)["foreign_filing"] is False
    rows = {r["id"]: r for r in json.loads(fws.handoff("ls", "--json").stdout)}
    assert rows["good"]["attempt"] == 1 and rows["good"]["dialect"] == "native"
    assert rows["bad"]["note"] == "PROCESSING_ERROR: ours"
    proc = fws.handoff("wait", "bad", "--timeout", "5")
    assert proc.returncode == 1 and proc.stderr == "handoff: bad: PROCESSING_ERROR: ours\n", proc
    (node,) = json.loads(fws.handoff("trace", "good", "--json").stdout)["trees"]
    assert node["started_at"] and node["finished_at"] and FOREIGN_FILING not in node["note"]
    # the same bytes moved to the other finished folder are not handoffd's filing there
    os.rename(fws.root / "handoffs" / "completed" / "good.json",
              fws.root / "handoffs" / "failed" / "good.json")
    data = json.loads(fws.handoff("show", "good", "--json").stdout)
    assert data["state"] == "failed" and data["foreign_filing"] is True


# ------------------------------------------------------------------ the rule, per backend
def test_the_rule_in_the_files_backend(tmp_path: Path) -> None:
    """One check (`trusted_book`) behind `get`, `peek` and what `list` derives: a block is
    vouched for only with a seal for the folder it is read from (in-progress/ also takes a
    pending seal: a claim is a rename first); a row keeps the document as stored."""
    backend = FilesBackend.open(HandoffdWorkspace(tmp_path), watch=False, durable=False)
    try:
        now = utc_now()
        backend.create(new_native_request(source="@o", target="@a", data=None, now=now,
                                          handoff_id="h1"), "h1", now)
        pending = backend.store.path(State.PENDING, "h1")
        sealed = json.loads(pending.read_text())
        assert backend.trusted_book(State.PENDING, "h1", sealed) == sealed["handoffd"]
        assert backend.trusted_book(State.IN_PROGRESS, "h1", sealed) == sealed["handoffd"]
        for state in (State.COMPLETED, State.FAILED):
            assert backend.trusted_book(state, "h1", sealed) is None
            view = trusted_doc(backend, state, "h1", sealed)
            assert view["handoffd"] == {"revision": 1} and foreign_filing(state, view)
            assert trusted_doc(backend, state, "h1", view) == view  # a view of a view: the same
        assert trusted_doc(backend, State.PENDING, "h1", dict(sealed, handoffd=forged())) \
            ["handoffd"] == {}
        os.rename(pending, backend.store.path(State.COMPLETED, "h1"))  # a consumer's filing
        found = backend.get("h1")
        assert found is not None and found[0] is State.COMPLETED
        assert found[1]["handoffd"] == {"revision": 1}
        (row,) = backend.list(state=State.COMPLETED)
        assert row.doc == sealed  # as stored: retention archives and compares exactly this
        hostile = native("h2", status="completed", handoffd=forged(
            parent_id="p1", history=[{"at": "2099-01-01T00:00:00Z", "event": "completed"}]))
        backend.store.path(State.COMPLETED, "h2").write_text(json.dumps(hostile))
        (row,) = backend.list(state=State.COMPLETED, where=lambda r: r.id == "h2")
        assert row.doc == hostile and row.meta.parent is None and row.updated_at.year < 2099
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["memory", "postgres"])
def test_a_database_vouches_for_every_block_it_holds(kind: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    """With a database (or in memory) every document was written through the store: its block
    is handoffd's, and what handoffd finished there is never a foreign filing."""
    backend: Backend
    if kind == "postgres":
        from handoffd.backends.postgres import PostgresBackend
        backend = PostgresBackend(request.getfixturevalue("pg_url"), pool_size=2)
    else:
        backend = MemoryBackend()
    try:
        now = utc_now()
        backend.create(new_native_request(source="@o", target="@a", data=None, now=now,
                                          handoff_id="d1"), "d1", now)
        claim = backend.claim("d1", now, 30.0)
        assert claim is not None
        assert backend.finish(claim, State.COMPLETED, claim.doc)
        found = backend.get("d1")
        assert found is not None
        state, doc = found
        assert state is State.COMPLETED and backend.trusted_book(state, "d1", doc) == doc["handoffd"]
        assert trusted_doc(backend, state, "d1", doc) is doc and not foreign_filing(state, doc)
        assert foreign_filing(State.COMPLETED, {"handoff_id": "x"})  # no record of ours at all
    finally:
        backend.close()


def test_db_import_brings_no_forged_block_into_the_database(fws: Workspace, pg_url: str) -> None:
    """The database vouches for every block it holds, so `handoffd db import` must carry a
    foreign filing's unsealed block over as nothing of ours: it stays a foreign filing there."""
    file_doc(fws, "failed", failed_doc("bad1"))
    imported = fws.handoffd("db", "import", "--store", pg_url, "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["imported"]["failed"] == 1
    (fws.root / "handoffd.toml").write_text(CONFIG + f'\n[store]\nurl = "{pg_url}"\n')
    shown = fws.handoff("show", "bad1")
    assert shown.returncode == 0, shown.stderr
    assert FOREIGN_FILING in shown.stdout and "forged-host" not in shown.stdout
    waited = fws.handoff("wait", "bad1", "--timeout", "2")
    assert waited.returncode == 1
    assert "the consumer's words" in waited.stderr and "FORGED_CODE" not in waited.stderr
