"""A foreign document reusing an id is set aside even when its claim was cut by a crash before
its admission, and a document cut after its admission recorded its id is never its own
duplicate (helper A, session 27; review R46 #2).

Each claim that has a foreign document's first use to do carries a mark in its ``claimed``
event (``id_mark``), and its admission records the id with it. After a recovery the next
admission searches again: a record bearing one of the document's own marks is its own (it
runs), any other record is an earlier document's (DUPLICATE_HANDOFF_ID). Before, a recovery
left "record" (a search could not tell the two apart), and a second document reusing an id,
cut before its admission, ran.
"""
from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import exe
from test_seen_recovery_s26 import (Store, _events, clock, crash_workspace,  # noqa: F401
                                    store)
from test_seen_shortage_s24 import _quarantined, foreign

from handoffd.backends.files.seen import SeenIds
from handoffd.core.documents import CHECK, RECORD, book, first_use_left
from handoffd.core.errors import NotFound
from handoffd.core.states import State
from handoffd.service.sweeper import sweep

# ---------------------------------------------------------------- a real daemon, killed

# the batch dies (as kill -9) right after its first add to the seen-ids record: a foreign
# document's admission recorded its id, and the claim is cut before the handler starts
DIE_AFTER_ADD = """
import os
from handoffd.backends.files import seen
real = seen.SeenIds.add
def add_then_die(self, *args, **kwargs):
    real(self, *args, **kwargs)
    os._exit(99)
seen.SeenIds.add = add_then_die
"""


def _batch(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def _until(root: Path, ws: Any, handoff_id: str, done: list[str]) -> str:
    """Run batches (at most five) until ``handoff_id`` is where ``done`` says; their stderr."""
    said = ""
    for _ in range(5):  # recovered, then claimed again: its retry is due at once
        said += _batch(root).stderr
        if ws.state_of(handoff_id) == done:
            break
    return said


def test_two_documents_reusing_an_id_each_cut_by_a_crash(tmp_path: Path) -> None:
    """The first document's batch dies right after its admission recorded the id: recovered,
    it runs once (its own record is no duplicate). Its result collected, a second document
    reusing the id has its batch die right after the claim, before admission: recovered, it
    is set aside DUPLICATE_HANDOFF_ID, never run. It once ran."""
    runs = tmp_path / "runs.txt"
    ws = crash_workspace(tmp_path / "ws", runs)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DIE_AFTER_ADD)
    try:
        ws.drop("dup-1.json", foreign("dup-1"))
        crashed = _batch(ws.root, PYTHONPATH=str(site))
        assert crashed.returncode == 99, crashed.stderr  # died right after recording the id
        assert ws.state_of("dup-1") == ["in-progress"]
        assert not runs.exists()
        record = (ws.root / "handoffs" / ".meta" / "seen-ids.jsonl").read_text().splitlines()
        assert [json.loads(line)["id"] for line in record] == ["dup-1"]
        said = _until(ws.root, ws, "dup-1", ["completed"])
        assert ws.state_of("dup-1") == ["completed"], said
        assert runs.read_text() == "ran\n", said  # run once after its recovery
        events = [e["event"] for e in ws.doc("dup-1")["handoffd"]["history"]]
        assert events[0] == "claimed" and "recovered" in events, events
        assert _quarantined(ws.root) == [], said
        # the consumer collects the result; a second document reuses the id
        (ws.root / "handoffs" / "completed" / "dup-1.json").unlink()
        ws.drop("dup-1.json", foreign("dup-1", input={"data": {"second": True}}))
        cut = _batch(ws.root, HANDOFFD_CRASH_AT="after-claim-lease")
        assert cut.returncode == 99, cut.stderr  # died after the claim, before admission
        assert ws.state_of("dup-1") == ["in-progress"]
        said += _until(ws.root, ws, "dup-1", [])
        assert runs.read_text() == "ran\n", said  # never run again
        assert ws.state_of("dup-1") == [], said
        assert [r["code"] for r in _quarantined(ws.root)] == ["DUPLICATE_HANDOFF_ID"], said
        assert "Traceback" not in said
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- every store, in process

def _cut_and_recovered(store: Store, handoff_id: str, *, admitted: bool) -> None:
    """Claim ``handoff_id`` (and admit it, when ``admitted``: its id recorded), then give the
    claim up (its claimer "died") and let a sweep recover it once its lease has passed."""
    engine = store.engine
    if admitted:
        job = engine.take(handoff_id)
        assert job is not None, engine.get(handoff_id)
        claim = job.claim
    else:
        claimed = engine.claim(handoff_id)
        assert claimed is not None
        claim = claimed[0]
    engine.backend.abandon(claim)
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == [handoff_id]
    store.clock.advance(600)  # (past any retry delay)
    assert engine.get(handoff_id)[0] is State.PENDING


def _collected(store: Store, handoff_id: str) -> None:
    """The consumer takes the finished document away (no purge: its record stays the one its
    admission made)."""
    state, _doc = store.engine.get(handoff_id)
    assert state.terminal
    if store.kind == "files":
        (store.engine.ws.handoffs / state.value / f"{handoff_id}.json").unlink()
    elif store.kind == "memory":
        with store.inner._lock:  # type: ignore[union-attr]
            del store.inner._entries[handoff_id]  # type: ignore[union-attr]
    else:
        store.inner.db.run(lambda conn, _: conn.execute(  # type: ignore[union-attr]
            "DELETE FROM handoffd.handoffs WHERE id = %s", (handoff_id,)))
    with pytest.raises(NotFound):
        store.engine.get(handoff_id)


def _drop_reused(store: Store, doc: dict[str, Any]) -> None:
    """Drop ``doc``, whose id was recorded: the memory store's foreign drop goes through its
    create, which would refuse it, and forget the record (a file in pending/ does neither)."""
    if store.kind != "memory":
        store.drop(doc)
        return
    inner: Any = store.inner
    with inner._lock:
        kept = {name: dict(getattr(inner, name)) for name in ("_seen", "_seen_mark")
                if hasattr(inner, name)}
        inner._seen.clear()
    store.drop(doc)
    with inner._lock:
        for name, value in kept.items():
            getattr(inner, name).update(value)


def test_a_second_document_cut_before_its_admission_is_set_aside(store: Store) -> None:
    engine = store.engine
    store.drop(foreign("m-1"))
    job = engine.take("m-1")
    assert job is not None
    engine.file(job.claim, job.dialect, job.specialist,
                engine.failure(store.clock(), "PROCESSING_ERROR", "done with", retryable=False))
    _collected(store, "m-1")
    store.clock.advance(60)
    _drop_reused(store, foreign("m-1", input={"data": {"second": True}}))
    _cut_and_recovered(store, "m-1", admitted=False)
    assert engine.take("m-1") is None  # never run
    assert [e["code"] for e in engine.backend.quarantined()] == ["DUPLICATE_HANDOFF_ID"]


def test_a_document_cut_after_its_admission_runs_after_its_recoveries(store: Store) -> None:
    """Its id recorded by its first claim; a second claim cut before admission too: the third
    finds the record its first claim made, its own, and runs (recorded once)."""
    engine = store.engine
    store.drop(foreign("m-2"))
    _cut_and_recovered(store, "m-2", admitted=True)
    _cut_and_recovered(store, "m-2", admitted=False)
    job = engine.take("m-2")
    assert job is not None, engine.get("m-2")
    assert engine.backend.quarantined() == []
    first = book(job.claim.doc)["history"][0]
    assert first["event"] == "claimed" and first["detail"]["id_mark"]
    assert engine.backend.seen_marks("m-2", store.clock()) == {first["detail"]["id_mark"]}


def test_an_id_recorded_by_a_create_is_no_claim_of_its_own(store: Store) -> None:
    """A record with no mark (a create's, or one from before marks) is another's: a recovered
    document finding it is set aside."""
    engine = store.engine
    store.drop(foreign("m-3"))
    _cut_and_recovered(store, "m-3", admitted=False)
    engine.backend.seen_add("m-3", store.clock() - timedelta(seconds=5))
    assert engine.take("m-3") is None
    assert [e["code"] for e in engine.backend.quarantined()] == ["DUPLICATE_HANDOFF_ID"]


# ---------------------------------------------------------------- the rule, on histories

MARKED = ("claimed", {"attempt": 1, "id_mark": "5eed"})


@pytest.mark.parametrize("history, left", [
    # a marked claim recovered: searched again (its own record tells itself apart)
    ((MARKED, "recovered", "retry_scheduled"), CHECK),
    ((MARKED, "recovered", "handed_back", MARKED, "recovered", "handed_back"), CHECK),
    # ... and the claim after it admitted: done
    ((MARKED, "recovered", "retry_scheduled", MARKED, "retry_scheduled"), None),
    # searched and found free before (a hand-back said so): only the record is left
    ((MARKED, ("handed_back", {"id_unrecorded": "record"}), MARKED, "recovered"), RECORD),
    # a claim an older handoffd made (no mark): recorded without a search, as then
    (("claimed", "recovered", "retry_scheduled"), RECORD),
    ((MARKED, ("handed_back", {"id_unrecorded": "check"}), "claimed", "recovered"), RECORD),
])
def test_what_is_left_after_a_recovery(history: tuple[Any, ...], left: str | None) -> None:
    assert first_use_left(_events(*history)) == left


# ---------------------------------------------------------------- the files store's record

def test_the_record_keeps_marks_and_reads_lines_without_one(tmp_path: Path) -> None:
    """A line from before marks (no ``mark``) still reads, as no claim's; marks outlive a
    compaction; a line past the TTL is not counted."""
    now = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
    path = tmp_path / "seen-ids.jsonl"
    path.write_text(json.dumps({"id": "gone", "at": "2026-11-28T01:00:00.000Z", "mark": "aa"})
                    + "\n" + json.dumps({"id": "old", "at": "2026-11-28T02:59:00.000Z"}) + "\n")
    seen = SeenIds(path, 3600)
    seen.add("new", now, "bb")
    seen.add("new", now + timedelta(seconds=1))
    assert seen.marks("old", now) == {None}
    assert seen.contains("old", now)
    assert seen.marks("new", now) == {"bb", None}
    assert seen.marks("gone", now) == frozenset() and not seen.contains("gone", now)
    assert seen.marks("nobody", now) == frozenset()
    # ("gone", the oldest, is over 1.25 TTLs old: the record is rewritten without it)
    assert seen.compact(now + timedelta(minutes=30)) == 3
    assert seen.marks("new", now + timedelta(minutes=30)) == {"bb", None}
    assert json.loads(path.read_text().splitlines()[1]) == {
        "id": "new", "at": "2026-11-28T03:00:00.000Z", "mark": "bb"}


def test_a_database_from_before_marks_is_migrated_and_its_rows_read(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PostgreSQL store at schema version 5 (no ``mark`` column) gains it when a store opens
    it; the rows recorded before read as no claim's."""
    import psycopg

    from handoffd.backends.postgres import PostgresBackend, schema
    now = datetime.now(timezone.utc)
    with psycopg.connect(pg_url) as conn:
        monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:5])
        assert schema.migrate(conn) == (5, [1, 2, 3, 4, 5])
        conn.execute("INSERT INTO handoffd.seen (id, seen_at) VALUES ('old', %s)", (now,))
        conn.commit()
    monkeypatch.undo()
    store = PostgresBackend(pg_url, pool_size=1)
    try:
        assert store.schema_version == 6
        later = now + timedelta(seconds=1)
        assert store.seen_contains("old", later) and store.seen_marks("old", later) == {None}
        store.seen_add("new", later, "c0ffee")
        assert store.seen_marks("new", later) == {"c0ffee"}
    finally:
        store.close()


# ---------------------------------------------------------------- R52's review

def _take_short(store: Store, step: str) -> None:
    """One claim of "t" whose admission runs short (EMFILE) at the store's ``step``, its claim
    handed back uncounted (as a daemon's worker does)."""
    import errno

    from handoffd.core.admission import hand_back_short
    from handoffd.core.errors import ClaimShortage
    engine = store.engine

    def short(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    real = getattr(engine.backend, step)
    setattr(engine.backend, step, short)
    try:
        with pytest.raises(ClaimShortage) as caught:
            engine.take("t")
        if caught.value.claim is not None:
            hand_back_short(engine, caught.value)
    finally:
        setattr(engine.backend, step, real)


@pytest.mark.parametrize("store", ["files", "memory"], indirect=True)
def test_its_own_mark_outlives_a_history_trimmed_by_many_hand_backs(store: Store) -> None:
    """R52: each claim had a mark of its own, and a history keeps its first event and its
    last 200: after ~100 passing shortages the claim that recorded the id (not the first) was
    trimmed away, its mark with it, and the document was set aside as its own duplicate. A
    document keeps one mark, carried by each claim."""
    engine = store.engine
    store.drop(foreign("t"))
    _take_short(store, "seen_contains")  # its first claim: short before the search
    store.clock.advance(120)
    job = engine.take("t")  # its second: searched, free, recorded with its mark
    assert job is not None
    engine.backend.abandon(job.claim)  # its claimer dies after recording it
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == ["t"]
    store.clock.advance(600)
    for _ in range(110):  # passing shortages at the search of its own marks
        _take_short(store, "seen_marks")
        store.clock.advance(5)
    job = engine.take("t")
    assert job is not None, "set aside as its own duplicate"


@pytest.mark.parametrize("store", ["files", "memory"], indirect=True)
def test_a_record_gone_between_the_search_and_its_marks_is_made_again(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """R52: the search found the id, the look at its marks a moment later found none (the
    record ran out meanwhile: a cleanup, a compaction): an empty answer read as another
    document's record, and the document was set aside unrun. It is recorded again, and runs."""
    engine = store.engine
    store.drop(foreign("t"))
    job = engine.take("t")
    assert job is not None
    engine.backend.abandon(job.claim)  # recorded, then its claimer died
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == ["t"]
    monkeypatch.setattr(engine.backend.inner, "seen_marks", lambda *args: frozenset())
    job = engine.take("t")
    assert job is not None, "set aside though no record was found"
