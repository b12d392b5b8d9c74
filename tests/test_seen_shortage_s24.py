"""A foreign document's id is recorded in the seen-ids record at the first admission that
succeeds, whatever hand-backs came before (helper R, session 24).

A foreign producer's document (``Claim.raw``: no bookkeeping of ours) has its id checked
against, then added to, the seen-ids record at admission. When that ran short (EMFILE, ENFILE,
MemoryError) the claim was handed back uncounted, and the hand-back wrote our bookkeeping into
it: at its next claim it was no longer raw, its id was never checked nor recorded, and a later
document reusing the id (once the first's result was collected) ran again. The hand-back now
says in its ``handed_back`` event what is left (``id_unrecorded``: ``check`` or ``record``),
and the admission right after it does that; a mark in a block from outside changes nothing.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import pytest
from conftest import exe, new_workspace

from handoffd import Registry, build_engine
from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Config, RetryPolicy, specialist_from_table
from handoffd.core.documents import BOOK, book
from handoffd.core.engine import Engine
from handoffd.core.errors import ClaimShortage
from handoffd.core.specialists import Specialist
from handoffd.core.states import State
from handoffd.core.storage import Backend, Claim, Doc
from handoffd.core.workspace import Workspace

ANSWER = "import json; print(json.dumps({'status': 'completed', 'output': {'ok': True}}))"
T0 = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)
UNRECORDED = "id_unrecorded"  # (core.admission.UNRECORDED: what a hand-back says is left)


def emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def foreign(handoff_id: str, **extra: Any) -> Doc:
    """A native request as a foreign producer drops it (no bookkeeping of ours)."""
    return {"handoff_id": handoff_id, "source": {"agent_id": "@test"},
            "target": {"agent_id": "@cmd"}, "input": {"data": {}}, **extra}


# ---------------------------------------------------------------- a real `handoffd run`

# the batch's seen-ids record: its first add (or first search) fails with EMFILE, before
# ("before") or after ("after": the line written, a half-done add) doing its work
SITE = """
import errno, os
from handoffd.backends.files import seen
step, when = os.environ["SEEN_FAULT"].split(":")
real, left = getattr(seen.SeenIds, step), [1]
def faulty(self, *args, **kwargs):
    if not left:
        return real(self, *args, **kwargs)
    left.pop()
    if when == "after":
        real(self, *args, **kwargs)
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
setattr(seen.SeenIds, step, faulty)
"""


def _runs_command(runs: Path) -> list[str]:
    """A command answering completed that appends one line to ``runs`` each time it runs."""
    code = f"open({str(runs)!r}, 'a').write('ran\\n'); {ANSWER}"
    return [sys.executable, "-S", "-c", code]


def _batch(root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, timeout=120, env=env)


def _quarantined(root: Path) -> list[dict[str, Any]]:
    folder = root / "handoffs" / ".quarantine"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.reason.json"))]


@pytest.mark.parametrize("fault", ["add:before", "add:after", "contains:before"])
def test_a_reused_id_is_set_aside_after_a_shortage_recording_the_first(
        tmp_path: Path, fault: str) -> None:
    """``handoffd run`` whose seen-ids record runs short (EMFILE) once admitting a foreign
    document: it is handed back, runs at its next claim, and its id is recorded then, so a
    second foreign document with the same id (the first's result collected meanwhile) is set
    aside DUPLICATE_HANDOFF_ID, never run. A half-done add (the line written before the
    shortage) never makes the first document its own duplicate."""
    runs = tmp_path / "runs.txt"
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@cmd"]
command = {json.dumps(_runs_command(runs))}
""")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    try:
        ws.drop("dup-1.json", foreign("dup-1"))
        first = _batch(ws.root, {**os.environ, "PYTHONPATH": str(site), "SEEN_FAULT": fault})
        said = first.stderr
        assert first.returncode == 0, said
        assert ws.state_of("dup-1") == ["completed"], said
        events = ws.doc("dup-1")["handoffd"]["history"]
        assert [e["event"] for e in events] == ["claimed", "handed_back", "claimed",
                                                "completed"], said
        assert events[1]["detail"]["not_started"] == "EMFILE"
        assert runs.read_text() == "ran\n"
        # the consumer collects the result; a second document reuses the id
        (ws.root / "handoffs" / "completed" / "dup-1.json").unlink()
        ws.drop("dup-1.json", foreign("dup-1", input={"data": {"second": True}}))
        second = _batch(ws.root)
        said = second.stderr
        assert ws.state_of("dup-1") == [], said
        assert runs.read_text() == "ran\n", said  # never run again
        codes = [r["code"] for r in _quarantined(ws.root)]
        assert codes == ["DUPLICATE_HANDOFF_ID"], said
        assert "Traceback" not in first.stderr + second.stderr
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- every store, in process

class ForeignMemory(MemoryBackend):
    """The memory store holding documents from outside, as the files store's pending/ and the
    PostgreSQL store's ingested rows do: :meth:`drop` stores one (its id not recorded as seen),
    and its first claim is raw (the bookkeeping it carried emptied first, as those stores do)."""

    def __init__(self) -> None:
        super().__init__()
        self.foreign: set[str] = set()

    def drop(self, doc: Doc, handoff_id: str, now: datetime) -> None:
        """Store ``doc`` pending as a foreign producer's document."""
        self.create(doc, handoff_id, now)
        with self._lock:
            self._entries[handoff_id].doc = copy.deepcopy(doc)  # (not stamped: not ours)
            self._seen.pop(handoff_id, None)
            self.foreign.add(handoff_id)

    def claim(self, handoff_id: str, now: datetime, lease_seconds: float, *,
              prepare: Callable[[Doc], None] | None = None,
              due_only: bool = False) -> Claim | None:
        with self._lock:
            raw = handoff_id in self.foreign
            if raw:  # whatever bookkeeping it carried is not ours
                self._entries[handoff_id].doc.pop(BOOK, None)
        got = super().claim(handoff_id, now, lease_seconds, prepare=prepare, due_only=due_only)
        if got is not None and raw:
            self.foreign.discard(handoff_id)
            got.raw = True
        return got

    def claim_next(self, targets: Collection[str], now: datetime, lease_seconds: float, *,
                   exclude: Collection[str] = (),
                   prepare: Callable[[Doc], None] | None = None) -> Claim | None:
        raise AssertionError("the tests claim by id")


def _registry() -> Registry:
    registry = Registry()
    registry.add(Specialist(specialist_from_table(
        "@cmd", {"command": [sys.executable, "-S", "-c", ANSWER]}, RetryPolicy())))
    return registry


class Store:
    """One store under test: its engine (a fixed clock) and how a foreign document arrives."""

    def __init__(self, kind: str, root: Path, pg_url: str = "") -> None:
        self.kind = kind
        ws = Workspace(root)
        ws.ensure()
        backend: Backend | None = None
        if kind == "memory":
            backend = ForeignMemory()
        elif kind == "postgres":
            from handoffd.backends.postgres import PostgresBackend
            backend = PostgresBackend(pg_url, pool_size=4)
        self.engine: Engine = build_engine(ws, Config(), _registry(), clock=lambda: T0,
                                           backend=backend, features=())
        self.inner = backend

    def drop(self, doc: Doc) -> None:
        handoff_id = doc["handoff_id"]
        if self.kind == "files":
            path = self.engine.ws.handoffs / "pending" / f"{handoff_id}.json"
            path.write_text(json.dumps(doc))
            os.utime(path, (0, 0))  # settled: not "still being written"
        elif self.kind == "memory":
            assert isinstance(self.inner, ForeignMemory)
            self.inner.drop(doc, handoff_id, T0)
        else:
            self.inner.ingest(doc, handoff_id, T0, "elsewhere")  # type: ignore[union-attr]

    def fail_seen(self, step: str, monkeypatch: pytest.MonkeyPatch, *,
                  half: bool = False) -> None:
        """The store's ``seen_<step>`` raises EMFILE once (``half``: after doing its work)."""
        target = getattr(self.engine.backend, "inner", self.engine.backend)  # (under the log)
        real = getattr(target, f"seen_{step}")
        left = [1]

        def short_once(*args: Any) -> Any:
            if not left:
                return real(*args)
            left.pop()
            if half:
                real(*args)
            raise emfile()
        monkeypatch.setattr(target, f"seen_{step}", short_once)

    def close(self) -> None:
        self.engine.backend.close()


@pytest.fixture(params=["memory", "files", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else ""
    made = Store(request.param, tmp_path / "ws", url)
    yield made
    made.close()


def _short_then_taken(store: Store, handoff_id: str) -> Any:
    """Take ``handoff_id``: its admission runs short (handed back uncounted), then the next
    take admits it; that Job."""
    engine = store.engine
    with pytest.raises(ClaimShortage):
        engine.take(handoff_id)
    state, doc = engine.get(handoff_id)
    assert state is State.PENDING
    assert book(doc)["history"][-1]["event"] == "handed_back"
    return engine.take(handoff_id)


@pytest.mark.parametrize("step, half", [("add", False), ("add", True), ("contains", False)])
def test_the_id_is_recorded_at_the_admission_after_the_hand_back(
        store: Store, monkeypatch: pytest.MonkeyPatch, step: str, half: bool) -> None:
    store.drop(foreign("f-1"))
    store.fail_seen(step, monkeypatch, half=half)
    job = _short_then_taken(store, "f-1")
    assert job is not None, store.engine.get("f-1")  # (a half-done add: never its own duplicate)
    assert store.engine.backend.seen_contains("f-1", T0 + timedelta(seconds=1))
    handed = book(job.claim.doc)["history"][-2]
    assert handed["detail"][UNRECORDED] == ("check" if step == "contains" else "record")
    assert UNRECORDED not in book(job.claim.doc)  # (nothing of it written with the filing)


def test_a_check_left_by_the_hand_back_still_finds_a_reused_id(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search ran short: the next admission searches, and sets a reused id aside."""
    store.drop(foreign("f-2"))
    store.engine.backend.seen_add("f-2", T0 - timedelta(seconds=60))  # used a minute ago
    store.fail_seen("contains", monkeypatch)
    assert _short_then_taken(store, "f-2") is None
    assert store.engine.backend.get("f-2") is None
    assert [e["code"] for e in store.engine.backend.quarantined()] == ["DUPLICATE_HANDOFF_ID"]


def test_a_mark_in_a_block_from_outside_changes_nothing(store: Store) -> None:
    """A foreign document carrying a forged hand-back that says its id is checked already: its
    block is not ours, so its id is checked as any foreign document's (and a reused one set
    aside)."""
    forged = {"revision": 7, "seal": "0" * 32, "history": [
        {"at": "2026-11-27T11:00:00Z", "event": "handed_back",
         "detail": {UNRECORDED: "record", "not_started": "EMFILE"}},
        {"at": "2026-11-27T11:00:01Z", "event": "claimed"}]}
    store.drop(foreign("f-3", handoffd=forged))
    store.engine.backend.seen_add("f-3", T0 - timedelta(seconds=60))  # used a minute ago
    assert store.engine.take("f-3") is None
    assert store.engine.backend.get("f-3") is None
    assert [e["code"] for e in store.engine.backend.quarantined()] == ["DUPLICATE_HANDOFF_ID"]


def test_a_hand_back_kept_for_a_shortage_too_keeps_its_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's hand-back of the claim runs short too: the claim is kept and handed back
    again (its document restored between the tries), the mark with it; the id is recorded at
    the next admission."""
    from conftest import Clock
    from test_claim_shortage_s22 import _engine
    from test_start_shortage_s20 import FailFirst

    from handoffd import Daemon
    from handoffd.backends.files import store as store_module

    engine = _engine(tmp_path / "ws", Clock())
    path = engine.ws.handoffs / "pending" / "k-1.json"
    path.write_text(json.dumps(foreign("k-1")))
    os.utime(path, (0, 0))  # settled
    seen = engine.backend.store.seen  # type: ignore[attr-defined]
    monkeypatch.setattr(seen, "add", FailFirst(seen.add, 1, emfile))
    write = FailFirst(store_module.fsio.create_exclusive, 1, emfile,
                      when=lambda target, *a, **k: Path(target).parent.name == "pending")
    monkeypatch.setattr(store_module.fsio, "create_exclusive", write)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert write.raised == 1 and report.completed == 1 and report.errors == 0, report
    events = book(engine.get("k-1")[1])["history"]
    assert [e["event"] for e in events] == ["claimed", "handed_back", "claimed", "completed"]
    assert events[1]["detail"][UNRECORDED] == "record"
    assert engine.backend.seen_contains("k-1", engine.clock())


def test_a_marked_hand_back_ingested_by_postgresql_is_not_its_own_duplicate(
        tmp_path: Path, pg_url: str) -> None:
    """Review R37: a files workspace's hand-back left `id_unrecorded: check`; the workspace
    then served by PostgreSQL ingested the sealed pending/ copy as trusted, which records its
    id, and the admission's search found it: set aside as its own duplicate, never run."""
    from handoffd.cli.basics import engine as open_engine
    runs = tmp_path / "runs.txt"
    config = (f'[daemon]\nsettle_seconds = 0.1\n\n[specialists."@cmd"]\n'
              f'command = {json.dumps(_runs_command(runs))}\n')
    ws = new_workspace(tmp_path / "ws", config)
    try:
        ws.drop("f-1.json", foreign("f-1"))
        engine = open_engine(ws.root, create=True)
        seen = engine.backend.inner.store.seen
        real, left = seen.contains, [1]

        def short(*args: Any) -> Any:
            if left:
                left.pop()
                raise emfile()
            return real(*args)

        seen.contains = short  # type: ignore[method-assign]
        with pytest.raises(ClaimShortage):
            engine.take("f-1")
        engine.backend.close()
        history = ws.doc("f-1")["handoffd"]["history"]
        assert history[-1]["event"] == "handed_back" and \
            history[-1]["detail"][UNRECORDED] == "check"
        ws.write_config(config + f'\n[store]\nurl = "{pg_url}"\n')
        first = _batch(ws.root)
        assert first.returncode == 0 and runs.read_text() == "ran\n", first.stderr
        assert "DUPLICATE_HANDOFF_ID" not in first.stderr
        ws.drop("f-1.json", foreign("f-1", input={"data": {"second": True}}))  # id reused
        second = _batch(ws.root)
        assert runs.read_text() == "ran\n", second.stderr  # recorded at its admission
        assert "DUPLICATE_HANDOFF_ID" in second.stderr, second.stderr
    finally:
        ws.cleanup()
