"""What the sweep sets aside in ``handoffs/in-progress/`` is told and counted (session 16, H1).

* A document there over our size bound (``DOCUMENT_TOO_LARGE``) was never junk to the sweep
  (``repair.NOT_JUNK``: a daemon with a larger ``max_document_bytes`` may be running it), so it
  stayed for good: nobody ran it, ``handoff wait`` on it ended with a read error, nothing
  reported it. Now it is set aside (moved, never read) once nothing has changed it for
  ``repair.LARGE_QUIET_SECONDS``, with a failure stub under its id, code ``DOCUMENT_TOO_LARGE``.
  What the exclusion protected stays: a live claim is rewritten at every lease renewal, so a
  larger-limit daemon's running claim is never taken (tested with a lease renewed less often
  than the claim grace, where the grace alone would have taken it).
* The stub the sweep filed for in-progress junk went straight to the store: no ``on_filed``
  listener heard of it (notifications, a dependant's gate, the run's counts) and the event log
  had no line. Now it is filed as admission files its stubs.
* ``handoffd sweep`` and the ``handoffd run`` line count the documents set aside.

The ten-minute quiet time is shortened for these tests by running the real command line with
``repair.LARGE_QUIET_SECONDS`` set (:func:`handoffd_cmd`): a file's ctime cannot be put in the
past.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, new_workspace, reason_codes, wait_until

from handoffd.backends.files import repair
from handoffd.backends.files.store import Store
from handoffd.core.states import State
from handoffd.core.workspace import Workspace as HandoffdWorkspace

GRACE = 1.0
QUIET = 1.5  # repair.LARGE_QUIET_SECONDS in the commands these tests run
LIMIT = 1024  # max_document_bytes: a document over 525,312 bytes cannot be read in-progress
NOTIFY = """
[[on_filed]]
command = [{python!r}, "-c", "import json,sys; d=json.load(sys.stdin); open(sys.argv[1],'a').write(d['handoff_id']+'\\\\n')", {out!r}]
states = ["failed"]
retries = 0
"""
CONFIG = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = {GRACE}
sweep_seconds = 0.2
rescan_seconds = 60
durability = "fast"
max_document_bytes = {LIMIT}

[specialists."@ok"]
command = [{sys.executable!r}, "-c", "import json,sys; json.load(sys.stdin); print(json.dumps({{'status':'completed','output':{{'x':1}}}}))"]
"""


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    notified = tmp_path / "notified.txt"
    workspace = new_workspace(tmp_path / "ws", CONFIG + NOTIFY.format(python=sys.executable,
                                                                      out=str(notified)))
    yield workspace
    workspace.cleanup()  # (kills a daemon a failed test left running)


def folder(ws: Workspace, state: str) -> Path:
    return ws.root / "handoffs" / state


def handoffd_cmd(ws: Workspace, *args: str, quiet: float = QUIET) -> list[str]:
    """The ``handoffd`` command line with ``repair.LARGE_QUIET_SECONDS`` set to ``quiet``."""
    code = ("import sys; import handoffd.backends.files.repair as r; "
            "r.LARGE_QUIET_SECONDS = float(sys.argv.pop(1)); "
            "from handoffd.cli.handoffd_cmd import main; sys.argv[0] = 'handoffd'; "
            "sys.exit(main())")
    return [sys.executable, "-c", code, str(quiet), *args, "--root", str(ws.root)]


def run(ws: Workspace, *args: str, quiet: float = QUIET) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(handoffd_cmd(ws, *args, quiet=quiet), capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def plant_large(ws: Workspace, hid: str) -> Path:
    path = folder(ws, "in-progress") / f"{hid}.json"
    path.write_text(json.dumps({"handoff_id": hid, "target_agent": "@ok",
                                "input": {"x": "y" * 600_000}}))
    return path


def past_the_quiet_time() -> None:
    time.sleep(QUIET + 0.3)  # (the file's ctime cannot be set back)


def events(ws: Workspace, hid: str) -> list[dict[str, Any]]:
    path = ws.root / "handoffs" / ".meta" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("id") == hid]


def quarantined_inodes(ws: Workspace) -> set[int]:
    return {os.stat(p).st_ino for p in (ws.root / "handoffs" / ".quarantine").iterdir()
            if not p.name.endswith(".reason.json")}


# ------------------------------------------------------------------ 1. too large: set aside
def test_a_large_leftover_is_set_aside_told_and_counted_by_handoffd_run(ws: Workspace) -> None:
    path = plant_large(ws, "big1")
    inode = os.stat(path).st_ino
    past_the_quiet_time()
    proc = run(ws, "run")
    assert proc.returncode == 1, proc.stderr  # a failure filed: the batch needs a look
    assert not path.exists(), proc.stderr
    assert reason_codes(ws.root) == {"big1.json": "DOCUMENT_TOO_LARGE"}
    assert inode in quarantined_inodes(ws)  # moved, not read and copied
    said = [line for line in proc.stderr.splitlines() if "in-progress/big1.json" in line]
    assert len(said) == 1 and "set aside" in said[0], proc.stderr
    # 3. the run's line counts it (and 2. its stub as a failure the daemon heard of)
    done = [line for line in proc.stderr.splitlines() if "batch done" in line]
    assert done and "failed 1" in done[0] and "set aside 1" in done[0], proc.stderr
    stub = json.loads((folder(ws, "failed") / "big1.json").read_text())
    assert stub["status"] == "failed" and stub["error"]["code"] == "DOCUMENT_TOO_LARGE", stub
    wait = ws.handoff("wait", "big1", "--timeout", "10", timeout=60)
    assert wait.returncode == 1 and "big1: DOCUMENT_TOO_LARGE" in wait.stderr, wait.stderr
    assert "error:" not in wait.stderr, wait.stderr  # the stub's failure, not a read error
    show = ws.handoff("show", "big1", timeout=60)
    assert "DOCUMENT_TOO_LARGE" in show.stdout + show.stderr, show
    # 2. the event log has the set-aside and the stub, and [[on_filed]] was told
    assert [e["event"] for e in events(ws, "big1")] == ["set_aside", "rejected"], events(ws, "big1")
    assert all(e["code"] == "DOCUMENT_TOO_LARGE" for e in events(ws, "big1"))
    notified = ws.root.parent / "notified.txt"
    wait_until(lambda: notified.exists() and notified.read_text() == "big1\n", 30,
               "the [[on_filed]] command hears of the stub")
    again = run(ws, "sweep")  # nothing left to do, nothing said twice
    assert "set aside" not in again.stderr, again.stderr


def test_handoffd_sweep_counts_what_it_set_aside(ws: Workspace) -> None:
    plant_large(ws, "big2")
    (folder(ws, "in-progress") / "junk2.json").write_text("nope")
    past_the_quiet_time()
    proc = run(ws, "sweep")
    assert proc.returncode == 0, proc.stderr
    assert "set aside 2 unreadable document(s)" in proc.stderr, proc.stderr
    assert reason_codes(ws.root) == {"big2.json": "DOCUMENT_TOO_LARGE",
                                     "junk2.json": "MALFORMED_JSON"}
    assert ws.state_of("big2") == ["failed"] and ws.state_of("junk2") == ["failed"]


# ------------------------------------------------------------------ 2. junk's stub is told
def test_a_dependant_hears_of_the_stub_at_once(ws: Workspace) -> None:
    # rescan_seconds = 60: without the filing's notice the dependant would wait for the rescan
    dep = ws.create("--to", "@nobody", "--data", "{}")  # (no specialist: it waits in pending/)
    child = ws.create("--to", "@ok", "--data", "{}", "--depends-on", dep)
    daemon = subprocess.Popen(handoffd_cmd(ws, "serve"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    ws.daemons.append(daemon)
    try:
        assert daemon.stderr is not None
        while "serving" not in (line := daemon.stderr.readline()):
            assert line, "the daemon ended before serving"
        time.sleep(1.0)  # (it looked at the dependant and holds it until its dependency is filed)
        # a claimer that died mid-write of its claim left the dependency unreadable in-progress/
        (folder(ws, "in-progress") / f"{dep}.json").write_text('{"handoff_id": "')
        (folder(ws, "pending") / f"{dep}.json").unlink()
        wait_until(lambda: ws.state_of(dep) == ["failed"], 30, "the junk's stub is filed")
        wait_until(lambda: ws.state_of(child) == ["failed"], 10,
                   "the dependant fails at the notice, not at the next rescan")
        assert ws.doc(child)["error"]["code"].startswith("DEPENDENCY"), ws.doc(child)
        assert [e["event"] for e in events(ws, dep)][-2:] == ["set_aside", "rejected"]
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=60)
    assert "Traceback" not in err, err


# ------------------------------------------------------------------ what NOT_JUNK protected
def test_a_live_claim_of_a_daemon_with_a_larger_limit_is_never_taken(tmp_path: Path) -> None:
    # daemon A runs with the default limit and a 4.5 s lease (renewed every 1.5 s: longer than
    # the claim grace, well within the quiet time of 5 s given to the sweeps); the limit is then
    # lowered under it and sweeps run all along its handler's run: they cannot read its claim,
    # and must leave it to A (with a quiet time under 1.5 s they took it: the grace is no guard)
    slow = (f"[specialists.\"@slow\"]\ncommand = [{sys.executable!r}, \"-c\", \"import json,sys,"
            "time; json.load(sys.stdin); time.sleep(7); print(json.dumps({'status':'completed',"
            "'output':{'x':1}}))\"]\n")
    config = CONFIG.replace(f"max_document_bytes = {LIMIT}\n", "lease_seconds = 4.5\n").replace(
        f"claim_grace_seconds = {GRACE}", "claim_grace_seconds = 0.5") + slow
    ws = new_workspace(tmp_path / "ws", config)
    try:
        data = tmp_path / "data.json"
        data.write_text(json.dumps({"x": "y" * 600_000}))
        hid = ws.create("--to", "@slow", "--input", str(data))
        ws.serve()
        path = folder(ws, "in-progress") / f"{hid}.json"
        wait_until(path.exists, 30, "daemon A claims it")
        ws.write_config(config.replace("lease_seconds = 4.5\n",
                                       f"lease_seconds = 4.5\nmax_document_bytes = {LIMIT}\n"))
        deadline = time.monotonic() + 5.5  # sweeps of the lowered limit while A runs it
        while time.monotonic() < deadline and path.exists():
            proc = run(ws, "sweep", quiet=5.0)
            assert proc.returncode == 0, proc.stderr
            assert f"in-progress/{hid}.json" not in proc.stderr, proc.stderr
            time.sleep(0.3)  # a sweep every half second or so: several per renewal
        assert reason_codes(ws.root) == {}
        wait_until(lambda: ws.state_of(hid) == ["completed"], 60, "daemon A files its result")
    finally:
        ws.cleanup()


# ------------------------------------------------------------------ the quiet time itself
class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


def test_a_large_document_waits_the_quiet_time_and_junk_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    store = Store(ws, max_document_bytes=LIMIT, settle_seconds=0.1)
    big = ws.doc_path(State.IN_PROGRESS, "big3")
    big.write_text(json.dumps({"handoff_id": "big3", "input": "y" * 600_000}))
    ws.doc_path(State.IN_PROGRESS, "junk3").write_text("[1, 2]")
    clock = Clock()
    monkeypatch.setattr(repair, "time", clock)
    now = datetime.now(timezone.utc)
    clock.now += 60  # past the grace: junk, not yet a large document nobody renews
    done = repair.repair(store, now, claim_grace_seconds=10.0)
    assert done["set_aside"] == ["junk3"] and big.exists(), done
    notes = [json.loads(n) for n in done[repair.NOTES]]
    assert notes == [{"id": "junk3", "code": "NOT_AN_OBJECT", "stub": True,
                      "message": notes[0]["message"]}], notes
    assert repair.LARGE_QUIET_SECONDS >= repair.FOREIGN_LEASE_SECONDS
    clock.now += repair.LARGE_QUIET_SECONDS
    done = repair.repair(store, now, claim_grace_seconds=10.0)
    assert done["set_aside"] == ["big3"] and not big.exists(), done
    assert json.loads(done[repair.NOTES][0])["code"] == "DOCUMENT_TOO_LARGE"
    assert not ws.doc_path(State.FAILED, "big3").exists()  # the sweep files the stub


def test_every_sweep_of_a_run_counts_what_it_set_aside(ws: Workspace) -> None:
    """The run's line counted only its first sweep's set-asides: junk found by a later sweep of
    a long batch or a serving daemon was filed as a failure but not said to be set aside."""
    from handoffd.cli.basics import engine
    from handoffd.service.daemon import Daemon
    eng = engine(ws.root)
    daemon = Daemon(eng, watch=False)
    try:
        assert daemon.sweep().set_aside == [] and daemon.report.set_aside == 0
        for hid in ("junk-a", "junk-b"):
            (folder(ws, "in-progress") / f"{hid}.json").write_text("{ torn")
        time.sleep(GRACE + 0.3)  # unchanged for the claim grace (its ctime cannot be set back)
        assert sorted(daemon.sweep().set_aside) == ["junk-a", "junk-b"]
        assert daemon.sweep().set_aside == []  # (nothing left: nothing counted twice)
        assert daemon.report.set_aside == 2
        assert "set aside 2 unreadable document(s)" in daemon.report.line()
        assert daemon.report.needs_a_look()
    finally:
        eng.backend.close()
