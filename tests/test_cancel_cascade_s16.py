"""`handoff cancel P --cascade` reaches every descendant of P, including children P makes after
the canceller walked its family (session 16). Before, a cancel that landed while a fan-out parent
was still making its 100 children cancelled those it saw (up to kp.c87 in the review's run), filed
the parent CANCELLED, and the children made after its walk ran: nothing read the request's
``cascade`` again. Now the parent looks at its cancel request before each child it makes and
stops (cancelling, when cascading, the ones it made), a child whose parent carries a cascading
request never starts, and a cascading request is only dropped once the family of the handoff,
filed for good, has been walked again.

The window is made deterministic: ``handoffd serve`` runs with a hook (``sitecustomize``) that
holds the store's creation of ``kp.c2`` until the test says go, and the cancel is issued while
it is held, once ``kp.c1`` exists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, exe, new_workspace, wait_until

CHILDREN = 100

FAN = '''
import json, sys
doc = json.load(sys.stdin)
data = doc["input"]["data"]
print(json.dumps({"status": "delegated", "aggregation": "all_success",
                  "delegate": [{"to": "@leaf", "data": {"sleep": data["sleep"]}}
                               for _ in range(data.get("n", %d))]}))
''' % CHILDREN

LEAF = '''
import json, os, sys, time
doc = json.load(sys.stdin)
with open(os.path.join(os.environ["HANDOFFD_ROOT"], "leaf-runs.txt"), "a") as out:
    out.write(os.environ["HANDOFF_ID"] + "\\n")
time.sleep(float(doc["input"]["data"].get("sleep", 0)))
print(json.dumps({"status": "completed", "output": {"ok": True}}))
'''

# the daemon's store holds the creation of $TEST_HOLD_AT until $TEST_HOLD_DIR/go exists (60 s)
HOLD_HOOK = '''
import os, time
if os.environ.get("TEST_HOLD_DIR"):
    from pathlib import Path
    from handoffd.backends.files import backend as _backend
    _marks = Path(os.environ["TEST_HOLD_DIR"])
    _create = _backend.FilesBackend.create
    def _held_create(self, doc, handoff_id, now, **kwargs):
        if handoff_id == os.environ["TEST_HOLD_AT"]:
            (_marks / "held").write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not (_marks / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return _create(self, doc, handoff_id, now, **kwargs)
    _backend.FilesBackend.create = _held_create
'''


def config(tmp: Path) -> str:
    return f"""
[daemon]
settle_seconds = 0.1
rescan_seconds = 0.5
sweep_seconds = 1.0

[retry]
max_retries = 0

[specialists."@fan"]
command = ["{sys.executable}", "-S", "{tmp / 'fan.py'}"]
timeout_seconds = 60

[specialists."@leaf"]
command = ["{sys.executable}", "-S", "{tmp / 'leaf.py'}"]
timeout_seconds = 120
"""


@pytest.fixture
def fws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace with @fan (delegates 100 children to @leaf) and @leaf (records its start in
    leaf-runs.txt, sleeps ``data.sleep`` seconds, completes)."""
    (tmp_path / "fan.py").write_text(FAN)
    (tmp_path / "leaf.py").write_text(LEAF)
    workspace = new_workspace(tmp_path / "ws", config(tmp_path))
    yield workspace
    workspace.cleanup()


def children(ws: Workspace) -> set[str]:
    """Every kp.c* document, in any folder."""
    return {p.name[:-5] for state in ("pending", "in-progress", "completed", "failed")
            for p in (ws.root / "handoffs" / state).glob("kp.c*.json")}


def leaf_runs(ws: Workspace) -> list[str]:
    path = ws.root / "leaf-runs.txt"
    return path.read_text().split() if path.exists() else []


def cancel_requests(ws: Workspace) -> list[str]:
    folder = ws.root / "handoffs" / ".meta" / "cancel"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def serve_held(ws: Workspace, marks: Path, hold_at: str) -> subprocess.Popen[str]:
    """``handoffd serve`` (3 workers) whose store holds the creation of ``hold_at``."""
    hook = marks.parent / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_HOOK)
    env = {**os.environ, "TEST_HOLD_DIR": str(marks), "TEST_HOLD_AT": hold_at,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    env.pop("HANDOFFD_ROOT", None)
    with open(marks.parent / "serve.log", "w") as log:  # (a pipe nobody reads could fill)
        proc = subprocess.Popen([exe("handoffd"), "serve", "--workers", "3", "--root",
                                 str(ws.root)], env=env, stdout=subprocess.DEVNULL, stderr=log,
                                text=True)
    ws.daemons.append(proc)
    return proc


def cancel_while_delegating(ws: Workspace, tmp_path: Path, *flags: str,
                            sleep: float) -> subprocess.Popen[str]:
    """Create kp (100 children sleeping ``sleep`` s), serve it, and run `handoff cancel kp
    FLAGS --timeout 0` while the daemon has made kp.c1 and is held making kp.c2."""
    ws.create("--to", "@fan", "--id", "kp", "--data", json.dumps({"sleep": sleep}))
    marks = tmp_path / "marks"
    marks.mkdir()
    daemon = serve_held(ws, marks, "kp.c2")
    try:
        wait_until(lambda: (marks / "held").exists() or daemon.poll() is not None, 60,
                   "the daemon making kp.c2")
        assert (marks / "held").exists(), (tmp_path / "serve.log").read_text()
        assert ws.state_of("kp.c1"), "kp.c1 is made before kp.c2"
        assert ws.state_of("kp") == ["in-progress"]
        done = ws.handoff("cancel", "kp", *flags, "--timeout", "0")
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        (marks / "go").write_text("")
    return daemon


def test_cascade_during_creation_cancels_every_child_made(fws: Workspace, tmp_path: Path) -> None:
    """The review's reproduction: the cancel lands after kp.c1 is made. Before: kp.c2..kp.c100
    were made after the canceller's walk and ran. Now: kp stops making children at kp.c2, both
    are cancelled, and no child but kp.c1 (claimed before the cancel, perhaps) ever starts."""
    daemon = cancel_while_delegating(fws, tmp_path, "--cascade", sleep=30)
    # (before, kp was parked in pending/ with its 100 children made)
    fws.wait_state("kp", ("pending", "failed"), timeout=60)
    assert children(fws) == {"kp.c1", "kp.c2"}, f"{len(children(fws))} children made"
    assert fws.wait_state("kp", timeout=10) == "failed"  # (mid-move, in two folders a moment)
    parent = fws.doc("kp")
    assert parent["error"]["code"] == "CANCELLED", parent["error"]
    assert parent["handoffd"]["children"] == ["kp.c1", "kp.c2"]  # the record names them
    for cid in ("kp.c1", "kp.c2"):  # (kp.c1 may have started: a running child's cancel)
        assert fws.wait_state(cid, timeout=60) == "failed", cid
        assert fws.doc(cid)["error"]["code"] == "CANCELLED", fws.doc(cid)["error"]
    assert set(leaf_runs(fws)) <= {"kp.c1"}, leaf_runs(fws)
    wait_until(lambda: not cancel_requests(fws), 30, "the cancel requests dropped")
    assert fws.stop(daemon) == 0
    assert children(fws) == {"kp.c1", "kp.c2"}


def test_plain_cancel_during_creation_makes_no_more_children(fws: Workspace,
                                                             tmp_path: Path) -> None:
    """Without --cascade: kp is cancelled and makes no more children; the ones it made run
    (a plain cancel leaves the children). Before: all 100 were made, kp was cancelled once
    parked, and 100 children ran for a parent that waited for none of them."""
    daemon = cancel_while_delegating(fws, tmp_path, sleep=0)
    fws.wait_state("kp", ("pending", "failed"), timeout=60)
    assert children(fws) == {"kp.c1", "kp.c2"}, f"{len(children(fws))} children made"
    assert fws.wait_state("kp", timeout=10) == "failed"  # (mid-move, in two folders a moment)
    assert fws.doc("kp")["error"]["code"] == "CANCELLED"
    assert "while delegating" in fws.doc("kp")["error"]["message"]
    for cid in ("kp.c1", "kp.c2"):
        assert fws.wait_state(cid, timeout=60) == "completed", cid
    assert fws.stop(daemon) == 0


def native(hid: str, to: str, *, parent: str | None = None) -> dict[str, object]:
    doc: dict[str, object] = {"handoff_id": hid, "timestamp": "2026-01-01T00:00:00Z",
                              "source": {"agent_id": "@test"}, "target": {"agent_id": to},
                              "input": {"data": {"sleep": 0}}}
    if parent is not None:
        doc["parent_id"] = parent
    return doc


def plant_request(ws: Workspace, hid: str) -> None:
    """A cascading cancel request for ``hid``, as `handoff cancel --cascade` leaves it for a
    running handoff."""
    folder = ws.root / "handoffs" / ".meta" / "cancel"
    folder.mkdir(parents=True, exist_ok=True)
    part = ws.root / "handoffs" / f".{hid}.cancel.part"  # written atomically, as handoffd does
    part.write_text(json.dumps({"handoff_id": hid, "reason": "stop it all", "cascade": True,
                                "requested_by": "@test", "via": "cli"}))
    os.replace(part, folder / f"{hid}.json")


def test_a_cascading_request_left_on_a_filed_parent_reaches_its_children(fws: Workspace) -> None:
    """A parent filed for good whose cascading request is still there (the daemon that filed
    it stopped before walking its family again; here: a plain cancel filed it, then the
    request is planted): a daemon's poll cancels the child its children list names, running,
    before it drops the request. Before: the request was dropped and the child ran on."""
    fws.create("--to", "@fan", "--id", "p", "--data", json.dumps({"sleep": 30, "n": 1}))
    daemon = fws.serve()
    wait_until(lambda: leaf_runs(fws) == ["p.c1"], 30, "p.c1 running")
    done = fws.handoff("cancel", "p", "--timeout", "10")  # p is parked: filed at once
    assert done.returncode == 0, done.stdout + done.stderr
    assert fws.state_of("p") == ["failed"] and fws.state_of("p.c1") == ["in-progress"]
    plant_request(fws, "p")
    assert fws.wait_state("p.c1", timeout=20) == "failed"
    error = fws.doc("p.c1")["error"]
    assert error["code"] == "CANCELLED" and "cascaded from p" in error["message"], error
    wait_until(lambda: not cancel_requests(fws), 30, "the cancel requests dropped")
    assert fws.stop(daemon) == 0
    assert leaf_runs(fws) == ["p.c1"]


def test_a_child_of_a_parent_with_a_cascading_request_never_starts(fws: Workspace) -> None:
    """A child claimed while its parent carries a cascading request (the parent not yet filed:
    here a foreign consumer holds its claim, as seed 001's Example 2 does, which handoffd
    honours for its timeout) is cancelled before its handler starts. Before: it ran."""
    from datetime import datetime, timezone
    parent = native("p", "@elsewhere")
    parent.update(status="in_progress", timeout_seconds=300,
                  started_at=datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"))
    claimed = fws.root / "handoffs" / "in-progress" / "p.json"
    part = fws.root / "handoffs" / ".p.claim.part"
    part.write_text(json.dumps(parent))
    os.rename(part, claimed)
    plant_request(fws, "p")
    daemon = fws.serve()
    fws.drop("c.json", native("c", "@leaf", parent="p"))
    assert fws.wait_state("c", timeout=30) == "failed"
    assert fws.stop(daemon) == 0
    error = fws.doc("c")["error"]
    assert error["code"] == "CANCELLED" and "cascaded from p" in error["message"], error
    assert leaf_runs(fws) == []
    assert fws.state_of("p") == ["in-progress"]  # the foreign consumer's, left to it


def test_a_batch_files_the_cancel_of_a_pending_handoff_no_specialist_here_runs(
        tmp_path: Path) -> None:
    """The daemon's poll queued a pending handoff with a cancel request for its cancel gate at
    every rescan; with no specialist here for it the gate was never reached, so `handoffd run`
    never ended (and spun a core). Now the poll files that cancel itself."""
    ws = new_workspace(tmp_path / "ws", '[specialists."@ok"]\nhandler = "json:dumps"\n')
    try:
        ws.handoff("create", "--to", "@nobody", "--id", "lonely", "--data", "{}", check=True)
        code = ("import sys\nfrom handoffd.cli.basics import engine\n"
                "from handoffd.features import cancel_requests\n"
                "e = engine(sys.argv[1])\n"
                "cancel_requests.request(e, 'lonely', reason='stop', cascade=False, by='me', "
                "via='test')\n")
        made = subprocess.run([sys.executable, "-c", code, str(ws.root)], capture_output=True,
                              text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        ran = ws.handoffd("run", "--max-seconds", "30", timeout=60)
        assert "Traceback" not in ran.stderr, ran.stderr
        assert "failed 1" in ran.stderr, ran.stderr  # filed, not waited on until --max-seconds
        doc = json.loads((ws.root / "handoffs" / "failed" / "lonely.json").read_text())
        assert doc["error"]["code"] == "CANCELLED" and "stop" in doc["error"]["message"], doc
        assert not list((ws.root / "handoffs" / ".meta" / "cancel").glob("*.json"))
    finally:
        ws.cleanup()
