"""Folders of ``handoffs/`` swapped for a symlink (or a file) while handoffd runs (session 16, H5).

Every command and the daemon refuse, at start, a state folder that is a symlink, no folder or
another's. Two gaps remained:

A. A state folder swapped while ``handoffd serve`` ran was noticed only at the next start: until
   then the daemon filed into (and claimed from) wherever the link pointed. ``mv completed
   completed.old && ln -s /elsewhere completed``, then a dropped handoff: its result was
   written in /elsewhere. Now each claim, filing, move and removal of the store is preceded by
   one ``stat`` of ``handoffs/`` (its stamp changes with any swap), and every sweep looks at
   each folder: the link is moved into ``handoffs/.quarantine`` (never followed), a plain
   folder made in its place, one ERROR line with the code, and work in flight is filed into
   the new folder. What the link pointed to is left as it is.
B. A symlinked ``handoffs/.meta`` (the seal key, the seen ids, the event log) was not refused at
   all, and ``.locks``, ``.quarantine`` and ``.tmp`` only at each use: every command and the
   daemon now refuse them at start as the state folders (exit 2, one line).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, exe, new_workspace, reason_codes, wait_until

from handoffd.backends.files import quarantine
from handoffd.backends.files.store import Store
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace

# @gated waits (bounded) for the file named by its input to exist: the test decides when it ends
GATED = ("import json, os, sys, time\n"
         "doc = json.load(sys.stdin)\n"
         "root = os.environ['HANDOFFD_ROOT']\n"
         "open(os.path.join(root, 'artifacts', 'started-' + doc['handoff_id']), 'w').close()\n"
         "deadline = time.monotonic() + 60\n"
         "while not os.path.exists(os.path.join(root, 'artifacts', 'go')) "
         "and time.monotonic() < deadline:\n"
         "    time.sleep(0.02)\n"
         "print(json.dumps({'status': 'completed', 'output': {'x': 1}}))\n")
CONFIG = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@ok"]
command = [{sys.executable!r}, "-c", "import json,sys; json.load(sys.stdin); print(json.dumps({{'status':'completed','output':{{'x':1}}}}))"]
retry = {{ max_retries = 0 }}

[specialists."@gated"]
command = {json.dumps([sys.executable, "-c", GATED])}
timeout_seconds = 90
retry = {{ max_retries = 0 }}
"""
CODE = "NOT_A_REGULAR_FILE"


@pytest.fixture
def sws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def handoffs(ws: Workspace | HandoffdWorkspace) -> Path:
    return ws.root / "handoffs"


def outside(tmp_path: Path, files: dict[str, str]) -> Path:
    """A folder outside the workspace holding ``files``."""
    folder = tmp_path / "outside"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def swap_for_link(folder: Path, target: Path) -> Path:
    """What the review did: ``mv folder folder.old && ln -s target folder``; the old folder."""
    old = folder.with_name(folder.name + ".old")
    os.rename(folder, old)
    os.symlink(target, folder)
    return old


def serve(ws: Workspace, log: Path) -> subprocess.Popen[bytes]:
    """``handoffd serve`` with its stderr in ``log`` (read while it runs, never a full pipe),
    once it says it is serving."""
    with open(log, "wb") as handle:
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=handle)
    ws.daemons.append(proc)  # (cleanup kills it by pid if a test fails before stopping it)
    wait_until(lambda: "serving" in log.read_text(), 30, "the daemon's start")
    return proc


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def swapped_lines(log: Path, folder: str) -> list[str]:
    return [line for line in log.read_text().splitlines()
            if f"handoffs/{folder} was replaced by" in line]


def set_aside_link(ws: Workspace | HandoffdWorkspace, folder: str, target: Path) -> None:
    """The link once at ``handoffs/<folder>`` is in the quarantine (as a link, to ``target``),
    with its reason; a plain folder is in its place."""
    assert (handoffs(ws) / folder).is_dir() and not (handoffs(ws) / folder).is_symlink()
    kept = [p for p in (handoffs(ws) / ".quarantine").iterdir()
            if p.name.endswith(f"-{folder}") and p.is_symlink()]
    assert len(kept) == 1 and os.readlink(kept[0]) == str(target)
    assert reason_codes(ws.root).get(folder) == CODE


# ------------------------------------------------------------------ A: swapped while serving
def test_a_completed_folder_swapped_while_serving_files_nothing_through_the_link(
        sws: Workspace, tmp_path: Path) -> None:
    """The brief's reproduction: the result of a handoff dropped after the swap was filed in
    the folder the link pointed to. Now into a new completed/, the link set aside."""
    target = outside(tmp_path, {"old-report.json": '{"keep": 1}\n'})
    log = tmp_path / "serve.log"
    daemon = serve(sws, log)
    try:
        first = sws.create("--to", "@ok", "--data", "{}", "--id", "first")
        assert sws.wait_state(first) == "completed"
        old = swap_for_link(handoffs(sws) / "completed", target)
        sws.drop("second.json", {"handoff_id": "second", "target": {"agent_id": "@ok"},
                                 "input": {"data": {}}})
        assert sws.wait_state("second") == "completed"
        wait_until(lambda: swapped_lines(log, "completed"), 15, "the set-aside line")
    finally:
        assert stop(daemon) == 0
    said = log.read_text()
    assert "Traceback" not in said, said
    assert contents(target) == {"old-report.json": '{"keep": 1}\n'}  # nothing filed there
    assert json.loads((handoffs(sws) / "completed" / "second.json").read_text())["status"] \
        == "completed"
    assert sorted(os.listdir(old)) == ["first.json"]  # what was moved away is left as it is
    [line] = swapped_lines(log, "completed")
    assert f"a symlink to {target}" in line and f"[{CODE}]" in line, line
    set_aside_link(sws, "completed", target)


def test_work_in_flight_is_filed_into_the_new_folder(sws: Workspace, tmp_path: Path) -> None:
    """A handoff running while completed/ is swapped: its result goes to the new completed/
    (the sweep notices within half a second, with nothing else happening)."""
    target = outside(tmp_path, {"keep.txt": "x\n"})
    log = tmp_path / "serve.log"
    daemon = serve(sws, log)
    try:
        hid = sws.create("--to", "@gated", "--data", "{}", "--id", "inflight")
        wait_until(lambda: (sws.root / "artifacts" / f"started-{hid}").exists(), 30,
                   "the handler's start")
        swap_for_link(handoffs(sws) / "completed", target)
        wait_until(lambda: swapped_lines(log, "completed"), 15, "the sweep's set-aside line")
        (sws.root / "artifacts" / "go").touch()
        assert sws.wait_state(hid) == "completed"
    finally:
        assert stop(daemon) == 0
    assert "Traceback" not in log.read_text()
    assert contents(target) == {"keep.txt": "x\n"}
    set_aside_link(sws, "completed", target)


def test_an_in_progress_folder_moved_out_and_linked_while_a_handoff_runs(
        sws: Workspace, tmp_path: Path) -> None:
    """``mv in-progress /elsewhere && ln -s /elsewhere in-progress`` while a handoff runs: the
    lease renewals and the filing went through the link (and the filing moved the document
    out of /elsewhere). Now the link is set aside, the running handoff's document is written
    again into the new in-progress/ and filed; what is in /elsewhere is left as it is."""
    log = tmp_path / "serve.log"
    daemon = serve(sws, log)
    moved = tmp_path / "moved-in-progress"
    try:
        hid = sws.create("--to", "@gated", "--data", "{}", "--id", "running")
        wait_until(lambda: (sws.root / "artifacts" / f"started-{hid}").exists(), 30,
                   "the handler's start")
        os.rename(handoffs(sws) / "in-progress", moved)
        os.symlink(moved, handoffs(sws) / "in-progress")
        before = contents(moved)
        assert list(before) == [f"{hid}.json"]
        wait_until(lambda: swapped_lines(log, "in-progress"), 15, "the sweep's set-aside line")
        (sws.root / "artifacts" / "go").touch()
        assert sws.wait_state(hid) == "completed"
        # (filing writes completed/ first, then removes the in-progress copy: a moment apart)
        wait_until(lambda: sws.state_of(hid) == ["completed"], 15, "the in-progress copy's removal")
    finally:
        assert stop(daemon) == 0
    assert "Traceback" not in log.read_text()
    assert contents(moved) == before  # left as it is: no renewal, no removal there
    assert sws.doc(hid)["output"] == {"x": 1}
    set_aside_link(sws, "in-progress", moved)


def test_a_pending_folder_linked_to_a_project_moves_nothing_out_of_it(
        sws: Workspace, tmp_path: Path) -> None:
    """pending/ swapped for a link to a project folder: its JSON files (one shaped like a
    handoff) were claimed, run or set aside, i.e. moved out of the project. Now nothing there
    is touched, and a handoff dropped into the new pending/ runs."""
    files = {"package.json": '{"name": "proj"}\n',
             "p1.json": json.dumps({"handoff_id": "p1", "target": {"agent_id": "@ok"},
                                    "input": {"data": {}}})}
    target = outside(tmp_path, files)
    log = tmp_path / "serve.log"
    daemon = serve(sws, log)
    try:
        swap_for_link(handoffs(sws) / "pending", target)
        wait_until(lambda: swapped_lines(log, "pending"), 15, "the set-aside line")
        sws.drop("p2.json", {"handoff_id": "p2", "target": {"agent_id": "@ok"},
                             "input": {"data": {}}})
        assert sws.wait_state("p2") == "completed"
    finally:
        assert stop(daemon) == 0
    assert "Traceback" not in log.read_text()
    assert contents(target) == files
    assert sws.state_of("p1") == []
    set_aside_link(sws, "pending", target)


# ------------------------------------------------------------------ A: the store's guard itself
@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    opened = Store(root, durable=False)
    yield opened
    opened.close()


def new_doc(store: Store, handoff_id: str) -> str:
    doc = new_native_request(source="@t", target="@x", data={}, now=utc_now(),
                             handoff_id=handoff_id)
    return store.create(doc, handoff_id)


def test_a_state_folder_swapped_for_a_file_is_set_aside_and_made_again(store: Store) -> None:
    failed = store.ws.state_dir(State.FAILED)
    failed.rmdir()
    failed.write_text("not a folder\n")
    new_doc(store, "f1")
    assert failed.is_dir() and store.locate("f1") == [State.PENDING]
    [kept] = [p for p in store.ws.quarantine.iterdir() if p.name.endswith("-failed")]
    assert kept.read_text() == "not a folder\n"  # moved whole, not read into anything
    assert reason_codes(store.ws.root) == {"failed": CODE}


def test_the_link_is_never_written_through_before_a_filing(store: Store, tmp_path: Path) -> None:
    """Unit form of A: between a claim and its filing, completed/ becomes a link; the filing
    sets it aside and files into a new folder, without waiting for a sweep."""
    new_doc(store, "c1")
    claim = store.claim("c1", lease_seconds=30)
    assert claim is not None
    target = outside(tmp_path, {})
    swap_for_link(store.ws.state_dir(State.COMPLETED), target)
    assert store.finish(claim, State.COMPLETED, dict(claim.doc, status="completed"))
    assert list(target.iterdir()) == []
    assert store.locate("c1") == [State.COMPLETED]
    set_aside_link(store.ws, "completed", target)


def test_a_claim_whose_copy_went_with_in_progress_is_written_again(store: Store,
                                                                    tmp_path: Path) -> None:
    new_doc(store, "r1")
    claim = store.claim("r1", lease_seconds=30)
    assert claim is not None
    moved = tmp_path / "moved"
    os.rename(store.ws.state_dir(State.IN_PROGRESS), moved)
    os.symlink(moved, store.ws.state_dir(State.IN_PROGRESS))
    before = contents(moved)
    assert store.renew(claim, lease_seconds=30)  # written again into the new in-progress/
    assert store.locate("r1") == [State.IN_PROGRESS]
    assert store.finish(claim, State.COMPLETED, dict(claim.doc, status="completed"))
    assert store.locate("r1") == [State.COMPLETED]
    assert contents(moved) == before
    set_aside_link(store.ws, "in-progress", moved)


def test_a_claim_lost_otherwise_is_not_written_again(store: Store) -> None:
    """Only a copy that went with the swapped folder is written again: one that someone moved
    on (here back to pending/) stays theirs, and the claim is lost as before."""
    new_doc(store, "r2")
    claim = store.claim("r2", lease_seconds=30)
    assert claim is not None
    in_progress = store.ws.state_dir(State.IN_PROGRESS)
    os.rename(in_progress, in_progress.with_name("in-progress.old"))
    os.symlink(in_progress.with_name("in-progress.old"), in_progress)
    store.folders.check()
    os.rename(in_progress.with_name("in-progress.old") / "r2.json",
              store.path(State.PENDING, "r2"))
    assert not store.renew(claim, lease_seconds=30)
    assert store.locate("r2") == [State.PENDING]


def test_a_seal_key_outside_never_replaces_ours(store: Store, tmp_path: Path) -> None:
    """``.meta`` swapped for a link to a folder holding a key of someone else's: the new
    ``.meta`` gets this process's key (0600), and nothing is written where the link points."""
    key = store.key
    assert key is not None
    target = outside(tmp_path, {"seal.key": "f" * 64 + "\n"})
    swap_for_link(store.ws.meta, target)
    new_doc(store, "k1")
    made = store.ws.meta / "seal.key"
    assert made.read_bytes().strip() == key and (made.stat().st_mode & 0o777) == 0o600
    assert contents(target) == {"seal.key": "f" * 64 + "\n"}
    set_aside_link(store.ws, ".meta", target)


def test_a_quarantine_swapped_for_a_link_is_set_aside_into_a_new_one(store: Store,
                                                                      tmp_path: Path) -> None:
    target = outside(tmp_path, {})
    swap_for_link(store.ws.quarantine, target)
    new_doc(store, "q1")
    assert list(target.iterdir()) == []
    set_aside_link(store.ws, ".quarantine", target)


def test_two_processes_noticing_at_once_set_aside_only_the_link(store: Store,
                                                                tmp_path: Path) -> None:
    """The second, having seen the link before the first put it right, finds a folder under
    the lock: the folder the first made (and what was filed there) is not moved."""
    other = Store(store.ws, durable=False)
    try:
        target = outside(tmp_path, {})
        swap_for_link(store.ws.state_dir(State.COMPLETED), target)
        store.folders.check()
        filed = store.ws.state_dir(State.COMPLETED) / "x.json"
        filed.write_text("{}")
        other.folders._set_aside(store.ws.state_dir(State.COMPLETED))
        assert filed.exists()
        assert len(list(store.ws.quarantine.glob("*.reason.json"))) == 1
    finally:
        other.close()


@contextmanager
def counted_stats() -> Iterator[list[str]]:
    """The ``stat`` and ``lstat`` calls made in the block, as "stat PATH" / "lstat PATH"."""
    calls: list[str] = []
    real_stat, real_lstat = os.stat, os.lstat
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", lambda p, *a, **k: calls.append(f"stat {p}")
                      or real_stat(p, *a, **k))
        patch.setattr(os, "lstat", lambda p, *a, **k: calls.append(f"lstat {p}")
                      or real_lstat(p, *a, **k))
        yield calls


def test_a_look_costs_one_stat_of_handoffs_while_nothing_changed(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-handoff cost: each claim and filing looks with one stat of handoffs/ (no
    lstat of each folder, no realpath) while nothing was renamed there."""
    monkeypatch.setattr(quarantine, "SETTLED_NS", 0)  # (the stamp just made is trusted)
    store.folders.check()
    with counted_stats() as calls:
        store.folders.check()
    assert calls == [f"stat {store.ws.handoffs}"]
    os.rename(store.ws.state_dir(State.FAILED), store.ws.handoffs / "failed.tmp")
    os.rename(store.ws.handoffs / "failed.tmp", store.ws.state_dir(State.FAILED))
    with counted_stats() as calls:
        store.folders.check()  # handoffs/ changed: every folder is looked at
    assert len([c for c in calls if c.startswith("lstat")]) == len(store.ws.own_folders)


def test_a_look_while_the_stamp_is_unsettled_stats_handoffs_once(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a second of a change to handoffs/ (a daemon's first second in a
    workspace it completed) every check looks at every folder; the stat that found the stamp
    unsettled is the look's own, not taken again. A swap then is still put right."""
    monkeypatch.setattr(quarantine, "SETTLED_NS", 10**18)  # (no stamp is ever settled)
    store.folders.check()
    with counted_stats() as calls:
        store.folders.check()
    assert calls == [f"stat {store.ws.handoffs}",
                     *(f"lstat {path}" for path in store.ws.own_folders)]
    target = outside(tmp_path, {})
    swap_for_link(store.ws.state_dir(State.FAILED), target)
    store.folders.check()
    assert store.ws.state_dir(State.FAILED).is_dir() and list(target.iterdir()) == []
    set_aside_link(store.ws, "failed", target)


# ------------------------------------------------------------------ B: refused at start
@pytest.mark.parametrize("folder", [".meta", ".locks", ".quarantine", ".tmp"])
def test_a_symlinked_bookkeeping_folder_is_refused_at_start(sws: Workspace, tmp_path: Path,
                                                            folder: str) -> None:
    hid = sws.create("--to", "@ok", "--data", "{}")
    target = tmp_path / "outside"
    os.rename(handoffs(sws) / folder, target)
    os.symlink(target, handoffs(sws) / folder)
    before = sorted(os.listdir(target))
    daemon = subprocess.run([exe("handoffd"), "serve", "--root", str(sws.root)],
                            capture_output=True, text=True, timeout=60)
    for proc in (daemon, sws.handoff("ls"), sws.handoff("create", "--to", "@ok", "--data", "{}")):
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"handoffs/{folder}" in lines[0] and "symlink" in lines[0], lines
    assert sorted(os.listdir(target)) == before  # nothing written there
    assert sws.state_of(hid) == ["pending"]


def test_a_bookkeeping_folder_that_is_a_file_is_refused_at_start(sws: Workspace) -> None:
    meta = handoffs(sws) / ".meta"
    os.rename(meta, handoffs(sws) / "meta.old")
    meta.write_text("")
    proc = sws.handoffd("run", timeout=60)
    assert proc.returncode == 2 and "not a folder" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_sweep_makes_a_removed_state_folder_again(tmp_path: Path) -> None:
    """A removed completed/ failed every filing, and its handoff ran again at each sweep; the
    sweep now makes it again (between sweeps a missing folder is left for ``mv`` + ``ln -s``)."""
    from handoffd.backends.files.backend import FilesBackend
    root = HandoffdWorkspace(tmp_path / "ws")
    backend = FilesBackend.open(root, watch=False)
    try:
        root.state_dir(State.COMPLETED).rmdir()
        backend.store.folders.check()
        assert not root.state_dir(State.COMPLETED).exists()
        backend.maintain(utc_now())
        assert root.state_dir(State.COMPLETED).is_dir()
        assert list(root.quarantine.iterdir()) == []
    finally:
        backend.close()
