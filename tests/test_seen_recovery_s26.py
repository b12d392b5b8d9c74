"""A foreign document whose claim is recovered before its admission recorded its id in the
seen-ids record has its id recorded when it next runs, as an admitted one's is (helper O,
session 26).

A foreign producer's document (``Claim.raw``) has its id searched in, then added to, the seen-ids
record at its admission. A claimer that died (or gave the claim up) between its claim and that
admission left the claim for recovery, whose hand-back or retry wrote our bookkeeping into the
document: at its next claim it was no longer raw, its id was never recorded, and a later
document reusing the id (once the first's result was collected) ran again. The history now
tells: a document whose first event is a ``claimed`` one came from outside, and a claim of it
that a ``recovered`` event ended before anything else did may not have recorded the id; the
next admission records it (never searches for it: it may find its own id, recorded by the dead
claimer, and set itself aside).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, exe, new_workspace
from test_seen_shortage_s24 import ForeignMemory, _quarantined, _registry, _runs_command, foreign

from handoffd import build_engine
from handoffd.core.config import Config
from handoffd.core.documents import CHECK, RECORD, book, claim_mark
from handoffd.core.engine import Engine
from handoffd.core.states import State
from handoffd.core.storage import Backend
from handoffd.core.workspace import Workspace
from handoffd.service.sweeper import sweep


# ---------------------------------------------------------------- a real daemon, killed

def _batch(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def crash_workspace(root: Path, runs: Path) -> Any:
    """A workspace for batches that crash on purpose: a claim recovered at once (no grace), its
    retry due at once; its specialist @cmd appends a line to ``runs`` each time it runs."""
    return new_workspace(root, f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 0.0

[retry]
max_retries = 2
retry_delay_seconds = 0.0

[specialists."@cmd"]
command = {json.dumps(_runs_command(runs))}
""")


def test_a_reused_id_is_set_aside_after_a_crash_before_admission(tmp_path: Path) -> None:
    """``handoffd run`` dies (as kill -9) right after its claim of a foreign document wrote
    the lease, before admission: the next batch recovers the claim and runs it, and records its
    id then, so a second foreign document with the same id (the first's result collected
    meanwhile) is set aside DUPLICATE_HANDOFF_ID, never run. It once ran again."""
    runs = tmp_path / "runs.txt"
    ws = crash_workspace(tmp_path / "ws", runs)
    try:
        ws.drop("dup-1.json", foreign("dup-1"))
        crashed = _batch(ws.root, HANDOFFD_CRASH_AT="after-claim-lease")
        assert crashed.returncode == 99, crashed.stderr  # died at the injected point
        assert ws.state_of("dup-1") == ["in-progress"]
        said = ""
        for _ in range(5):  # (bounded) recovered, then run: its retry is due at once
            said += _batch(ws.root).stderr
            if ws.state_of("dup-1") == ["completed"]:
                break
        assert ws.state_of("dup-1") == ["completed"], said
        events = [e["event"] for e in ws.doc("dup-1")["handoffd"]["history"]]
        assert events[0] == "claimed" and "recovered" in events, events
        assert runs.read_text() == "ran\n"
        # the consumer collects the result; a second document reuses the id
        (ws.root / "handoffs" / "completed" / "dup-1.json").unlink()
        ws.drop("dup-1.json", foreign("dup-1", input={"data": {"second": True}}))
        second = _batch(ws.root)
        said += second.stderr
        assert runs.read_text() == "ran\n", said  # never run again
        assert ws.state_of("dup-1") == [], said
        assert [r["code"] for r in _quarantined(ws.root)] == ["DUPLICATE_HANDOFF_ID"], said
        assert "Traceback" not in said
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- every store, in process

class Store:
    """One store under test: its engine (a clock moved by hand) and how a foreign document
    arrives (as in test_seen_shortage_s24, whose fixed clock no recovery passes)."""

    def __init__(self, kind: str, root: Path, clock: Clock, pg_url: str = "") -> None:
        self.kind = kind
        ws = Workspace(root)
        ws.ensure()
        backend: Backend | None = None
        if kind == "memory":
            backend = ForeignMemory()
        elif kind == "postgres":
            from handoffd.backends.postgres import PostgresBackend
            backend = PostgresBackend(pg_url, pool_size=4)
        self.engine: Engine = build_engine(ws, Config(), _registry(), clock=clock,
                                           backend=backend, features=())
        self.inner = backend
        self.clock = clock

    def drop(self, doc: dict[str, Any]) -> None:
        handoff_id, now = doc["handoff_id"], self.clock()
        if self.kind == "files":
            path = self.engine.ws.handoffs / "pending" / f"{handoff_id}.json"
            path.write_text(json.dumps(doc))
            os.utime(path, (0, 0))  # settled: not "still being written"
        elif self.kind == "memory":
            assert isinstance(self.inner, ForeignMemory)
            self.inner.drop(doc, handoff_id, now)
        else:
            self.inner.ingest(doc, handoff_id, now, "elsewhere")  # type: ignore[union-attr]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "files", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[Store]:
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else ""
    made = Store(request.param, tmp_path / "ws", clock, url)
    yield made
    made.engine.backend.close()


def _recovered_then_taken(store: Store, handoff_id: str) -> Any:
    """Claim ``handoff_id`` raw and give the claim up before its admission (its claimer
    "died"), let a sweep recover it once its lease has passed, then take it again: that Job."""
    engine = store.engine
    claimed = engine.claim(handoff_id)
    assert claimed is not None and claimed[0].raw
    engine.backend.abandon(claimed[0])
    store.clock.advance(engine.settings.lease_seconds * 2)
    report = sweep(engine)
    assert report.recovered == [handoff_id], report
    store.clock.advance(3600)  # (past any retry delay)
    assert engine.get(handoff_id)[0] is State.PENDING
    return engine.take(handoff_id)


def test_a_recovered_foreign_claim_records_its_id_when_it_runs(store: Store) -> None:
    store.drop(foreign("r-1"))
    job = _recovered_then_taken(store, "r-1")
    assert job is not None, store.engine.get("r-1")  # (never its own duplicate)
    assert store.engine.backend.seen_contains("r-1", store.clock())


def test_its_own_id_recorded_before_the_crash_never_sets_it_aside(store: Store) -> None:
    """The dead claimer had recorded the id already: the next admission finds it recorded with
    the mark of its own earlier claim (session 27: before, it recorded it again unsearched)
    and runs it (a search that could not tell would set it aside as its own duplicate)."""
    store.drop(foreign("r-2"))
    engine = store.engine
    claimed = engine.claim("r-2")
    assert claimed is not None
    mark = claim_mark(book(claimed[0].doc)["history"][-1])  # (as its admission records it)
    engine.backend.seen_add("r-2", store.clock(), mark)  # its admission got that far, died
    engine.backend.abandon(claimed[0])
    store.clock.advance(engine.settings.lease_seconds * 2)
    assert sweep(engine).recovered == ["r-2"]
    store.clock.advance(600)
    assert engine.take("r-2") is not None, engine.get("r-2")
    assert engine.backend.quarantined() == []


# ---------------------------------------------------------------- the rule, on histories

def _events(*kinds: str | tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for kind in kinds:
        name, detail = kind if isinstance(kind, tuple) else (kind, None)
        out.append({"at": "2026-11-27T12:00:00.000Z", "event": name,
                    **({"detail": detail} if detail else {})})
    return out


@pytest.mark.parametrize("history, left", [
    # our own document (created here): nothing to do, whatever happened to its claims
    (("created", "claimed", "recovered", "retry_scheduled"), None),
    # from outside, its first claim admitted: done
    (("claimed", "retry_scheduled"), None),
    (("claimed", "handed_back"), None),
    # from outside, its first claim (an older handoffd's: no mark) recovered: whether the id
    # was recorded cannot be told (session 27: a marked claim leaves CHECK, test_seen_marks_s27)
    (("claimed", "recovered", "retry_scheduled"), RECORD),
    (("claimed", "recovered", "handed_back"), RECORD),
    (("claimed", "recovered", "failed", "retried"), RECORD),
    # ... and the claim after that one admitted: done
    (("claimed", "recovered", "retry_scheduled", "claimed", "retry_scheduled"), None),
    # a hand-back's own mark (a shortage at admission), then a recovery of the next claim
    (("claimed", ("handed_back", {"id_unrecorded": "check"})), CHECK),
    (("claimed", ("handed_back", {"id_unrecorded": "check"}), "handed_back"), CHECK),
    (("claimed", ("handed_back", {"id_unrecorded": "check"}), "claimed", "recovered",
      "handed_back"), RECORD),
    (("claimed", ("handed_back", {"id_unrecorded": "record"}), "claimed", "completed"), None),
])
def test_what_is_left_of_the_first_use(history: tuple[Any, ...], left: str | None) -> None:
    from handoffd.core.documents import first_use_left  # (new in session 26)
    assert first_use_left(_events(*history)) == left
