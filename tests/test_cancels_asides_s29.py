"""A cancelled request's content and a dependency set aside unread (session 29):

1. a failed document whose ``final_error`` said CANCELLED without the held-answer flag was
   judged by its own ``refused_answer`` field: a cancel of a *request* wrote no flag at all
   (only True was ever written), so a native request carrying ``refused_answer: {"status":
   "completed"}`` (its producer's content), cancelled while pending, could never be retried,
   even forced, and its dependants were told so. A filing now says the flag True or False;
   only a cancel filed before the flag (no key) falls back to content, and then only to a
   ``refused_answer`` handoffd's ``keep_refused_answer`` could have moved there (a seed-001
   answer's fields and nothing else);
2. a file dropped into pending/ that handoffd could not read at all (not JSON...) was set
   aside without its id reaching the seen-ids record: a dependant looked at before its failure
   stub was filed (or without one) was told it "does not exist; create it first". Its id is
   now recorded as used before its stub is filed (files store, the PostgreSQL file bridge),
   never a name that is no safe id.

Real `handoff` and `handoffd run` processes against tmp workspaces; the moment between a
set-aside and its stub is made in process, as admission makes it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace
from test_answers_ids_deps_s28 import QUICK  # (a command specialist that completes)
from test_seen_recovery_s26 import clock, store  # noqa: F401  (every store, a test clock)

from handoffd.core.errors import ErrorCode
from handoffd.core.states import State

CONFIG = f"""
[daemon]
settle_seconds = 0.05
durability = "fast"

[specialists."@quick"]
command = {QUICK}
"""
CARRIER = "hoff-carrier-s29"  # a request carrying refused_answer, cancelled while pending
WAITER = "hoff-waiter-s29"  # a request depending on it
CARRIED = {"status": "completed"}  # the producer's own field, not an answer of ours


def _failed_dependant(ws: Workspace, waiter: str) -> dict[str, Any]:
    """One `handoffd run`, after which ``waiter`` is failed DEPENDENCY_MISSING, with no
    traceback said; its answer's error."""
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ws.state_of(waiter) == ["failed"], proc.stderr
    error: dict[str, Any] = ws.doc(waiter)["error"]
    assert error["code"] == ErrorCode.DEPENDENCY_MISSING, error
    return error


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def _create_carrier(ws: Workspace) -> None:
    """`handoff create --file` of a native request carrying ``refused_answer``."""
    path = ws.root / "request.json"
    path.write_text(json.dumps({"handoff_id": CARRIER, "status": "pending",
                                "timestamp": "2026-11-28T07:00:00Z",
                                "source": {"agent_id": "@cli"}, "target": {"agent_id": "@quick"},
                                "input": {"data": {}}, "refused_answer": CARRIED}))
    ws.handoff("create", "--file", str(path), check=True)


# ---------------------------------------------------------------- 1: our record decides
def test_a_cancelled_request_carrying_refused_answer_is_retried(ws: Workspace) -> None:
    """Cancelled while pending, its filing says it held no answer; `retry` asks for --force
    (a permanent error, as any cancel), and `retry --force` puts it back with its own field."""
    _create_carrier(ws)
    ws.handoff("cancel", CARRIER, check=True)
    filed = ws.doc(CARRIER)
    plain = ws.handoff("retry", CARRIER)
    assert plain.returncode == 1 and "cannot be retried, even forced" not in plain.stderr, plain
    assert "retry with --force" in plain.stderr, plain.stderr
    forced = ws.handoff("retry", "--force", CARRIER)
    assert forced.returncode == 0, forced.stderr
    assert ws.state_of(CARRIER) == ["pending"]
    assert ws.doc(CARRIER)["refused_answer"] == CARRIED  # the producer's, kept
    assert filed["handoffd"]["final_error"].get("answer") is False, filed["handoffd"]


def test_a_dependant_of_a_cancelled_carrier_is_told_to_retry_it(ws: Workspace) -> None:
    """Not "cannot be retried; submit the request it answers": it is a request."""
    _create_carrier(ws)
    ws.handoff("create", "--to", "@quick", "--id", WAITER, "--depends-on", CARRIER, check=True)
    ws.handoff("cancel", CARRIER, check=True)
    error = _failed_dependant(ws, WAITER)
    assert "cannot be retried" not in error["message"], error
    assert f"retry {CARRIER} first" in error["message"], error


def _as_before_the_flag(ws: Workspace, handoff_id: str) -> None:
    """Take the held-answer flag out of a filed cancel, as a handoffd before it filed it (its
    seal covers id, revision and folder: still ours)."""
    path = ws.root / "handoffs" / "failed" / f"{handoff_id}.json"
    doc = json.loads(path.read_text())
    doc["handoffd"]["final_error"].pop("answer", None)
    path.write_text(json.dumps(doc))


def test_a_carrier_cancelled_before_the_flag_is_retried(ws: Workspace) -> None:
    """No flag: content is read, but ``{"status": "completed"}`` is nothing handoffd's
    keep_refused_answer moves there (it moves a seed-001 answer: status and its marks)."""
    _create_carrier(ws)
    ws.handoff("cancel", CARRIER, check=True)
    _as_before_the_flag(ws, CARRIER)
    forced = ws.handoff("retry", "--force", CARRIER)
    assert forced.returncode == 0, forced.stderr
    assert ws.state_of(CARRIER) == ["pending"]


def test_content_is_read_only_for_a_cancel_filed_before_the_flag() -> None:
    """held_answer: a flag False is a request whatever it carries; without the key, only what
    keep_refused_answer could have moved there makes it an answer."""
    from handoffd import dialects as formats
    from handoffd.core.filing import HELD_ANSWER, held_answer
    moved = {"status": "completed", "timestamp_completed": "2026-11-28T07:00:00Z",
             "output": {"x": 1}}

    def failed(final: dict[str, Any], kept: Any) -> dict[str, Any]:
        return {"handoff_id": "x", "status": "cancelled", "source": {"agent_id": "@a"},
                "target": {"agent_id": "@b"}, "input": {"data": {}}, "refused_answer": kept,
                "handoffd": {"final_error": {"code": ErrorCode.CANCELLED, "message": "m",
                                             **final}}}

    assert held_answer(formats, failed({HELD_ANSWER: False}, moved)) is None
    assert held_answer(formats, failed({}, CARRIED)) is None
    assert held_answer(formats, failed({}, {**moved, "note": "not an answer field"})) is None
    assert held_answer(formats, failed({}, moved)) is not None  # an old cancel of an answer
    assert held_answer(formats, failed({HELD_ANSWER: True}, moved)) is not None


# ---------------------------------------------------------------- 2: a dependency set aside
DEP = "hoff-junk-dep-s29"
JUNK_WAITER = "hoff-junk-waiter-s29"
UNSAFE = "bad name s29"  # no safe id: never recorded


def _seen_ids(ws: Workspace) -> set[str]:
    path = ws.root / "handoffs" / ".meta" / "seen-ids.jsonl"
    if not path.exists():
        return set()
    return {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}


def test_a_file_set_aside_unread_has_its_id_recorded(ws: Workspace) -> None:
    """A real run sets aside a file that is not JSON: its id is used from then on (the gate
    reads that record); a file whose name is no safe id is set aside but never recorded."""
    ws.drop(f"{DEP}.json", "not json")
    ws.drop(f"{UNSAFE}.json", "not json either")
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ws.state_of(DEP) == ["failed"], proc.stderr  # its stub
    seen = _seen_ids(ws)
    assert DEP in seen, seen
    assert UNSAFE not in seen and not any(" " in i for i in seen), seen


def test_a_dependant_of_a_file_set_aside_unread_is_not_told_to_create_it(
        ws: Workspace) -> None:
    """Looked at after the set-aside, before its stub (admission's order: the file moved into
    the quarantine, then the stub filed; here the stub is not there yet), it was told the
    dependency "does not exist; create it first"."""
    from handoffd.cli.basics import engine as open_engine
    ws.drop(f"{DEP}.json", "not json")
    engine = open_engine(ws.root)
    try:
        engine.backend.create_failed = lambda *_args: False  # (its stub: not yet filed)
        assert engine.set_aside(DEP, State.PENDING, ErrorCode.MALFORMED_JSON, "test: junk")
    finally:
        engine.backend.close()
    assert ws.state_of(DEP) == []
    ws.drop(f"{JUNK_WAITER}.json", {"handoff_id": JUNK_WAITER, "status": "pending",
                                    "source": {"agent_id": "@cli"},
                                    "target": {"agent_id": "@quick"},
                                    "input": {"data": {}}, "depends_on": [DEP]})
    error = _failed_dependant(ws, JUNK_WAITER)
    assert "does not exist" not in error["message"], error
    assert "set aside unread" in error["message"], error


def test_the_postgres_bridge_records_a_file_it_cannot_ingest(pg_url: str,
                                                             tmp_path: Path) -> None:
    """The bridge sets aside a file it cannot read, its stub not yet filed (a bridge without
    one): the shared store's seen record has its id; an unsafe name stays out of it."""
    from test_postgres import backend
    from test_postgres_hostile import local_store

    from handoffd.backends.postgres.bridge import FileBridge
    from handoffd.core.timeutil import utc_now
    store_db = backend(pg_url)
    try:
        local = local_store(tmp_path / "ws")
        pending = tmp_path / "ws" / "handoffs" / "pending"
        for name in (DEP, UNSAFE):
            (pending / f"{name}.json").write_text("not json")
            old = time.time() - 60  # settled: not a file still being written
            os.utime(pending / f"{name}.json", (old, old))
        files = FileBridge(store_db, local, "host:a")
        assert files.ingest(DEP) == "set aside"
        assert files.ingest(UNSAFE) == "set aside"
        assert store_db.seen_contains(DEP, utc_now())
        assert not store_db.seen_contains(UNSAFE, utc_now())
    finally:
        store_db.close()


def test_a_stub_refused_under_a_running_id_keeps_its_claims_mark(store: Any) -> None:
    """R-RA: junk set aside under the id of a handoff that runs (its stub refused: the id
    exists) recorded the id again with no mark; a store keeping one record an id (PostgreSQL,
    memory) then forgot the running claim's mark, and once its claimer died the recovered
    handoff was set aside as its own duplicate, in no state. The record is only added when the
    id is not in it: the recovered handoff is taken again."""
    from test_seen_shortage_s24 import foreign

    from handoffd.core.admission import file_stub
    from handoffd.service.sweeper import sweep

    engine = store.engine
    store.drop(foreign("live-1"))
    job = engine.take("live-1")  # admitted: its id recorded with its claim's mark
    assert job is not None
    marks = engine.backend.seen_marks("live-1", store.clock())
    assert file_stub(engine, "live-1", "MALFORMED_JSON", "junk under a live id") is False
    assert engine.backend.seen_marks("live-1", store.clock()) == marks  # (no None added)
    engine.backend.abandon(job.claim)  # its claimer dies
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == ["live-1"]
    store.clock.advance(600)
    again = engine.take("live-1")
    assert again is not None, engine.backend.quarantined()


def test_a_stub_refused_under_a_long_running_id_keeps_its_claim(store: Any) -> None:
    """RD: the same, once the running claim's record is older than the seen-ids TTL (a handoff
    running longer than an hour): the junk's id is not recorded while a document holds it, so
    the recovered handoff is taken again, not set aside as its own duplicate."""
    from test_seen_shortage_s24 import foreign

    from handoffd.core.admission import file_stub
    from handoffd.service.sweeper import sweep

    engine = store.engine
    store.drop(foreign("live-2"))
    job = engine.take("live-2")
    assert job is not None
    store.clock.advance(engine.settings.seen_ttl_seconds + 1)  # (its record aged out)
    assert file_stub(engine, "live-2", "MALFORMED_JSON", "junk under a live id") is False
    assert not engine.backend.seen_contains("live-2", store.clock())  # (nothing recorded)
    engine.backend.abandon(job.claim)
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == ["live-2"]
    store.clock.advance(600)
    assert engine.take("live-2") is not None, engine.backend.quarantined()
