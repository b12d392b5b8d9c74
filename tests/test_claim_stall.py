"""A claim that stalls between its rename into in-progress/ and its lease write (SIGSTOP, a
stalled disk under fsync) keeps its claim: no sweep hands it back meanwhile (the claimer holds
the document's lock), and its lease write replaces only the file its own rename put there, never
one another claimer or writer put there since (it gives the claim up instead)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, wait_until

from handoffd.backends.files import crashpoints, fsio, leases, repair, spares
from handoffd.backends.files.store import Store
from handoffd.core.documents import book
from handoffd.core.states import State
from handoffd.core.workspace import Workspace as HandoffdWorkspace

# a daemon's first claim stops right after its rename into in-progress/ until the test says go
STALL_HOOK = '''
import os, time
if os.environ.get("TEST_STALL_DIR"):
    from pathlib import Path
    from handoffd.backends.files import crashpoints
    _marks = Path(os.environ["TEST_STALL_DIR"])
    def _stall(point):
        if point != "after-claim-rename" or (_marks / "stalled").exists():
            return
        (_marks / "stalled").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not (_marks / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        (_marks / "resumed").write_text(str(os.getpid()))
    crashpoints.crash_hook = _stall
'''


def test_a_claimer_stalled_before_its_lease_keeps_its_claim(ws: Workspace, tmp_path: Path) -> None:
    """Two daemons on one workspace; the first stalls inside its claim for longer than the claim
    grace while a sweep runs and the second daemon serves. Before the fix the sweep handed the
    handoff back, the second daemon ran it, and the first one's late lease write replaced the
    second one's claim: two owners, and the handoff ended failed. Now: run once, completed."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text()
                    .replace("claim_grace_seconds = 1.0", "claim_grace_seconds = 0.2"))
    hook, marks = tmp_path / "hook", tmp_path / "marks"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(STALL_HOOK)
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "exclusive", "seconds": 1.0}))
    env = {**os.environ, "TEST_STALL_DIR": str(marks),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    env.pop("HANDOFFD_CRASH_AT", None)
    stalled = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ws.daemons.append(stalled)
    try:
        wait_until(lambda: (marks / "stalled").exists(), 30, "the first daemon's claim")
        claimed = ws.root / "handoffs" / "in-progress" / f"{hid}.json"
        wait_until(lambda: time.time() - claimed.stat().st_ctime > 0.5, 10, "past the grace")
        swept = ws.handoffd("sweep")  # a whole sweep, past the grace, while the claimer stalls
        assert swept.returncode == 0, swept.stderr
        other = ws.serve()
        if ws.state_of(hid) != ["in-progress"]:  # handed back: let the other daemon run it
            ws.wait_started(hid, timeout=30)
        (marks / "go").write_text("")
        wait_until(lambda: (marks / "resumed").exists(), 30, "the first daemon's resumption")
        assert ws.wait_state(hid, timeout=60) == "completed", ws.doc(hid).get("error")
        assert ws.stop(other) == 0
    finally:
        (marks / "go").write_text("")
        assert ws.stop(stalled) == 0, stalled.stderr.read() if stalled.stderr else ""
    assert ws.state_of(hid) == ["completed"]  # filed once, in one folder
    assert [r["id"] for r in ws.runs()] == [hid]  # run once
    overlaps = ws.root / "artifacts" / "flaky-overlaps.jsonl"
    assert not overlaps.exists() or not overlaps.read_text().strip()
    events = [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]
    assert "handed_back" not in events and events.count("claimed") == 1, events


# ------------------------------------------------------------------ the store, in-process
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    made = Store(ws, durable=False)
    yield made
    made.close()


def producer_file(store: Store, hid: str) -> int:
    """A request written into pending/ as a foreign producer does; its inode."""
    path = store.path(State.PENDING, hid)
    path.write_text(json.dumps({"handoff_id": hid, "target": {"agent_id": "@x"},
                                "input": {"data": {"n": 1}}}))
    return path.stat().st_ino


def at_rename(monkeypatch: pytest.MonkeyPatch, act: Any) -> None:
    """Run ``act()`` once, where a claim stands between its rename and its lease write."""
    done: list[bool] = []

    def hook(point: str) -> None:
        if point == "after-claim-rename" and not done:
            done.append(True)
            act()

    monkeypatch.setattr(crashpoints, "crash_hook", hook)


def no_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without renameat2(RENAME_EXCHANGE) (NFS): the compared replace is used."""
    monkeypatch.setattr(fsio, "_exchange", lambda a, b: errno.EINVAL)


def test_no_sweep_hands_back_a_claim_whose_claimer_still_holds_it(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    producer_file(store, "h1")
    seen: dict[str, Any] = {}

    def sweep_past_the_grace() -> None:  # as if the claimer had stalled for minutes
        seen["done"] = {"recovered": [], "duplicates_resolved": []}
        repair.recover_unleased(store, "h1", 0.0, NOW, seen["done"])
        seen["where"] = store.locate("h1")

    at_rename(monkeypatch, sweep_past_the_grace)
    claim = store.claim("h1", lease_seconds=30, now=NOW)
    assert seen["where"] == [State.IN_PROGRESS] and seen["done"]["recovered"] == []
    assert claim is not None and store.owns(claim)
    assert book(store.read(State.IN_PROGRESS, "h1"))["lease"]["token"] == claim.token


def test_the_sweep_hands_back_an_unleased_claim_once_its_lock_is_gone(store: Store) -> None:
    """A claimer that died after its rename (its lock went with it) is still recovered."""
    producer_file(store, "h2")
    fsio.rename_noreplace(store.path(State.PENDING, "h2"), store.path(State.IN_PROGRESS, "h2"))
    done: dict[str, list[str]] = {"recovered": [], "duplicates_resolved": []}
    repair.recover_unleased(store, "h2", 0.0, NOW, done)
    assert done["recovered"] == ["h2"] and store.locate("h2") == [State.PENDING]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_lease_write_never_replaces_a_file_put_there_since(
        store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exchange: bool) -> None:
    """A writer that takes no claim lock (an older handoffd, a tool) hands the file back and
    another claimer's copy takes its place while this claim stands still: the claim is given up
    and the other copy is left exactly as it was (same inode, same bytes)."""
    if not exchange:
        no_exchange(monkeypatch)
    producer_file(store, "h3")
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"handoff_id": "h3", "theirs": true}')

    def replaced_meanwhile(doc: dict[str, Any]) -> None:  # after the read, before the write
        os.replace(theirs, store.path(State.IN_PROGRESS, "h3"))

    before = len(list(store.tmp.iterdir())) if store.tmp.exists() else 0
    assert store.claim("h3", lease_seconds=30, now=NOW, on_claim=replaced_meanwhile) is None
    path = store.path(State.IN_PROGRESS, "h3")
    assert json.loads(path.read_text()) == {"handoff_id": "h3", "theirs": True}
    assert store.locate("h3") == [State.IN_PROGRESS]
    assert len(list(store.tmp.iterdir())) == before  # our leased copy is not left behind


@pytest.mark.parametrize("exchange", [True, False])
def test_a_lease_write_never_brings_back_a_file_moved_on_since(
        store: Store, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:
        no_exchange(monkeypatch)
    producer_file(store, "h4")

    def moved_on(doc: dict[str, Any]) -> None:  # after the read, before the write
        os.rename(store.path(State.IN_PROGRESS, "h4"), store.path(State.PENDING, "h4"))

    assert store.claim("h4", lease_seconds=30, now=NOW, on_claim=moved_on) is None
    assert store.locate("h4") == [State.PENDING]  # not written back into in-progress/
    at_rename(monkeypatch, lambda: os.rename(store.path(State.IN_PROGRESS, "h4"),
                                             store.path(State.PENDING, "h4")))
    assert store.claim("h4", lease_seconds=30, now=NOW) is None  # moved before the read
    assert store.locate("h4") == [State.PENDING]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_claim_leases_the_file_it_renamed(store: Store, monkeypatch: pytest.MonkeyPatch,
                                            exchange: bool) -> None:
    """The usual case, either way: the claim is ours, and the producer's inode is kept as a
    spare (adopted) rather than freed (exchanged out, or linked before a plain replace)."""
    if not exchange:
        no_exchange(monkeypatch)
    producer = producer_file(store, "h5")
    claim = store.claim("h5", lease_seconds=30, now=NOW)
    assert claim is not None and store.owns(claim)
    assert store.locate("h5") == [State.IN_PROGRESS]
    kept = {os.stat(path).st_ino for path in spares._pools.get(os.fspath(store.tmp), [])}
    assert (producer in kept) is spares.LEASES


def test_a_document_another_claimer_holds_is_not_claimed(store: Store) -> None:
    producer_file(store, "h6")
    held = leases.lock_document(store.path(State.PENDING, "h6"))
    assert held is not None
    try:
        assert store.claim("h6", lease_seconds=30, now=NOW) is None
        assert store.locate("h6") == [State.PENDING]
    finally:
        os.close(held)
    assert store.claim("h6", lease_seconds=30, now=NOW) is not None


def test_a_stalled_claim_in_another_process_keeps_the_sweep_away(store: Store,
                                                                 tmp_path: Path) -> None:
    """The lock is the kernel's (flock on the document): a sweep in this process respects a
    claimer in another, and the claim completes after the sweep."""
    producer_file(store, "h7")
    marks = tmp_path / "m"
    marks.mkdir()
    code = f'''
import sys, time
from pathlib import Path
from handoffd.backends.files import crashpoints as sm
from handoffd.backends.files.store import Store
from handoffd.core.workspace import Workspace
marks = Path({str(marks)!r})
def hold(point):
    if point == "after-claim-rename":
        (marks / "stalled").write_text("")
        deadline = time.monotonic() + 30
        while not (marks / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
sm.crash_hook = hold
claim = Store(Workspace({str(store.ws.root)!r}), durable=False).claim("h7", lease_seconds=30)
print("claimed" if claim is not None else "lost")
'''
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (marks / "stalled").exists(), 30, "the other process's claim")
        done: dict[str, list[str]] = {"recovered": [], "duplicates_resolved": []}
        repair.recover_unleased(store, "h7", 0.0, NOW, done)
        assert done["recovered"] == [] and store.locate("h7") == [State.IN_PROGRESS]
    finally:
        (marks / "go").write_text("")
        out, _ = proc.communicate(timeout=30)
    assert out.strip() == "claimed"
    assert isinstance(book(store.read(State.IN_PROGRESS, "h7")).get("lease"), dict)
