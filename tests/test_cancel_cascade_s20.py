"""`handoff cancel --cascade` reaches the children made after its walk, and no child of a family a
cascade cancels starts once its parent, or an ancestor, was cancelled (session 20).

Review r22 (daemon `serve --processes 2 --workers 4`, six trees of 4 levels, 3 children a node,
cancelled at once): children ran and ended completed after `handoff cancel --cascade` returned
(u5.c3.c3.c3.c3 claimed 1 s after it, its parent filed "(cascaded from u5)" 2.5 s before it).
Three holes:

* the family was walked once, before anything was cancelled: a member that delegated after that
  walk and was then filed cancelled from pending (a parked parent) left its children out;
* a member filed cancelled from pending left no cascading request, and a child looked only at
  its direct parent's request: a child claimed once its parent was filed started;
* nothing looked above the parent: a grandchild claimed before the walk reached its parent
  started, its grandparent filed cancelled already.

Now the walk goes on to a fixed point (the children each member's document names as it is
cancelled join it), a member filed from pending holds a cascading request from its claim to its
filing and keeps the cascade in its filed block, and a handoff about to start looks up its
``parent_id`` chain (bounded) for a cascading request or a block that keeps a cascade.

The in-process tests drive a files-store engine by hand (claim, run, file: what a daemon's
worker does) at the exact moment of each hole; the last test runs a real daemon."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import exe, handlers_workspace, wait_until

from handoffd import Registry, State, build_engine, new_native_request
from handoffd import Workspace as HandoffdWorkspace
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.engine import Engine
from handoffd.features import cancel_family, cancel_requests

RAN: list[str] = []  # the leaves whose handler started, in order


def fan(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Delegates ``data.kids`` (each {"to": agent, "data": ...})."""
    kids = (ctx.data or {}).get("kids", [])
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": kid["to"], "data": kid.get("data", {})} for kid in kids]}


def leaf(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Notes its start and completes."""
    RAN.append(ctx.handoff_id)
    return {"status": "completed", "output": {"ok": True}}


LEAVES = {"to": "@leaf"}
MID = {"to": "@fan", "data": {"kids": [LEAVES, LEAVES]}}
TREE = {"kids": [MID, MID]}  # R -> R.c1, R.c2 (@fan) -> R.cN.c1, R.cN.c2 (@leaf)
FAMILY = ["R", "R.c1", "R.c2", "R.c1.c1", "R.c1.c2", "R.c2.c1", "R.c2.c2"]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """A files-store engine with @fan and @leaf (in-thread handlers, no retries)."""
    RAN.clear()
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(durability="fast"), retry=RetryPolicy(max_retries=0))
    registry = Registry()
    for agent, func in (("@fan", fan), ("@leaf", leaf)):
        registry.add_function(agent, func, config=config, isolate="never")
    yield build_engine(ws, config, registry)


def submit(engine: Engine, hid: str, to: str, data: Any, **extra: Any) -> None:
    doc = new_native_request(source="@test", target=to, data=data, now=engine.clock(),
                             handoff_id=hid)
    doc.update(extra)
    assert engine.submit(doc) == hid


def process(engine: Engine, handoff_id: str) -> State:
    """Claim, run and file one handoff, as a daemon's worker does."""
    job = engine.take(handoff_id)
    assert job is not None, handoff_id
    return engine.file(job.claim, job.dialect, job.specialist, engine.run(job))


def parked_tree(engine: Engine) -> None:
    """R and its two @fan children parked, their four leaves pending (none claimed yet)."""
    submit(engine, "R", "@fan", TREE)
    for hid in ("R", "R.c1", "R.c2"):
        assert process(engine, hid) is State.PENDING, hid
    assert all(engine.get(h)[0] is State.PENDING for h in FAMILY)


def error_of(engine: Engine, hid: str) -> dict[str, Any]:
    state, doc = engine.get(hid)
    assert state is State.FAILED, (hid, state)
    error: dict[str, Any] = doc["error"]
    return error


def after_cancel_one(monkeypatch: pytest.MonkeyPatch, hid: str,
                     then: Callable[[], None]) -> None:
    """Run ``then`` once, as soon as the cascade's walk has cancelled ``hid`` (a daemon that
    claims a handoff at that moment)."""
    real = cancel_family.cancel_one

    def wrapped(engine: Engine, handoff_id: str, **kwargs: Any) -> Any:
        result = real(engine, handoff_id, **kwargs)
        if handoff_id == hid:
            then()
        return result

    monkeypatch.setattr(cancel_family, "cancel_one", wrapped)


def test_children_a_member_made_after_the_walk_are_cancelled(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """R.c1's handler ran before the cancel, and it is filed (parked with two children) just
    after the canceller walked R's family: the walk did not see those children. Before: the
    cancel filed R.c1 from pending and left R.c1.c1 and R.c1.c2 pending, to run; its output
    did not name them. Now the children R.c1's filed document names join the walk."""
    submit(engine, "R", "@fan", TREE)
    assert process(engine, "R") is State.PENDING
    job = engine.take("R.c1")
    assert job is not None
    outcome = engine.run(job)  # delegates: its children are made when it is filed
    real = cancel_family.descendants

    def walk_then_park(backend: Any, handoff_id: str, **kwargs: Any) -> list[str]:
        found = real(backend, handoff_id, **kwargs)
        if handoff_id == "R":
            assert "R.c1.c1" not in found
            assert engine.file(job.claim, job.dialect, job.specialist, outcome) is State.PENDING
        return found

    monkeypatch.setattr(cancel_family, "descendants", walk_then_park)
    results = cancel_family.cancel(engine, "R", reason="stop", cascade=True)
    family = ["R", "R.c1", "R.c2", "R.c1.c1", "R.c1.c2"]  # (R.c2 never ran: no children)
    assert [(r.handoff_id, r.action) for r in results] == [(h, "cancelled") for h in family]
    for hid in family:
        assert error_of(engine, hid)["code"] == "CANCELLED", hid
    assert "(cascaded from R)" in error_of(engine, "R.c1.c1")["message"]
    assert engine.take("R.c1.c1") is None and RAN == []
    assert not engine.backend.cancel_requests()  # nothing left for the daemons to walk again


def test_a_child_claimed_while_its_parent_is_filed_from_pending_never_starts(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon claims R.c1.c1 while the canceller holds its parent R.c1 (claimed, not filed
    yet). Before: R.c1 carried no request, and R.c1.c1 ran. Now the canceller holds a cascading
    request on R.c1 from its claim to its filing."""
    parked_tree(engine)
    real = engine.file
    seen: list[State] = []

    def file(claim: Any, dialect: Any, spec: Any, outcome: Any) -> State:
        if claim.id == "R.c1" and outcome.status == "cancelled" and not seen:
            seen.append(process(engine, "R.c1.c1"))  # (its filing goes through here too)
        return real(claim, dialect, spec, outcome)

    monkeypatch.setattr(engine, "file", file)
    cancel_family.cancel(engine, "R", reason="stop", cascade=True)
    assert seen == [State.FAILED] and RAN == []
    error = error_of(engine, "R.c1.c1")
    assert error["code"] == "CANCELLED" and "(cascaded from R.c1)" in error["message"], error
    assert all(engine.get(h)[0] is State.FAILED for h in FAMILY)
    assert not engine.backend.cancel_requests()


def test_a_child_claimed_after_its_parent_was_filed_by_the_cascade_never_starts(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon claims R.c1.c1 just after the canceller filed its parent R.c1 cancelled, before
    the walk reaches R.c1.c1; and, once the cancel is over, a producer drops a child of R.c1.
    Before: both ran (R.c1 left no request). Now R.c1's filed block keeps the cascade."""
    parked_tree(engine)
    states: list[State] = []
    after_cancel_one(monkeypatch, "R.c1", lambda: states.append(process(engine, "R.c1.c1")))
    results = cancel_family.cancel(engine, "R", reason="stop", cascade=True)
    assert states == [State.FAILED] and RAN == []
    error = error_of(engine, "R.c1.c1")
    assert error["code"] == "CANCELLED", error
    assert error["message"] == ("handoff R.c1.c1 cancelled: stop (cascaded from R) (by @cli) "
                                "(cascaded from R.c1)")
    assert {r.handoff_id: r.action for r in results}["R.c1.c1"] == "finished"
    kept = engine.get("R.c1")[1]["handoffd"][cancel_requests.CASCADE_KEY]
    assert kept == {"cascade": True, "reason": "stop (cascaded from R)", "requested_by": "@cli",
                    "retries": 0}
    submit(engine, "late", "@leaf", {}, parent_id="R.c1")
    assert process(engine, "late") is State.FAILED and RAN == []
    assert "(cascaded from R.c1)" in error_of(engine, "late")["message"]


def test_a_grandchild_claimed_after_its_grandparent_was_cancelled_never_starts(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon claims R.c2.c1 once R is filed cancelled, before the walk reaches its parent
    R.c2 (still parked, no request). Before: only the parent was looked at, and it ran."""
    parked_tree(engine)
    states: list[State] = []
    after_cancel_one(monkeypatch, "R", lambda: states.append(process(engine, "R.c2.c1")))
    cancel_family.cancel(engine, "R", reason="stop", cascade=True)
    assert states == [State.FAILED] and RAN == []
    error = error_of(engine, "R.c2.c1")
    assert error["message"] == "handoff R.c2.c1 cancelled: stop (by @cli) (cascaded from R)"
    assert all(engine.get(h)[0] is State.FAILED for h in FAMILY)


def test_a_plain_cancel_still_leaves_the_children_to_run(engine: Engine) -> None:
    """Without --cascade the parked parent is filed cancelled and its children run, as
    docs/orchestration.md says; its block keeps no cascade."""
    submit(engine, "P", "@fan", {"kids": [LEAVES]})
    assert process(engine, "P") is State.PENDING
    results = cancel_family.cancel(engine, "P", reason="stop")
    assert [r.action for r in results] == ["cancelled"]
    assert cancel_requests.CASCADE_KEY not in engine.get("P")[1]["handoffd"]
    assert process(engine, "P.c1") is State.COMPLETED and RAN == ["P.c1"]


def test_the_check_reads_nothing_more_for_a_handoff_without_a_parent(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path: a handoff without a parent costs its own request's lookup, as before; a
    child one request and one document a step up its chain."""
    submit(engine, "solo", "@leaf", {})
    submit(engine, "P", "@fan", {"kids": [LEAVES]})
    assert process(engine, "P") is State.PENDING
    reads: list[tuple[str, str]] = []
    backend = getattr(engine.backend, "inner", engine.backend)  # (under the event recorder)
    for name in ("get", "cancel_request"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda hid, _n=name, _r=real: (
            reads.append((_n, hid)), _r(hid))[1])
    for hid in ("solo", "P.c1"):
        job = engine.take(hid)
        assert job is not None
        reads.clear()
        cancel_requests.check_before_run(engine, job)
        if hid == "solo":
            assert reads == [("cancel_request", "solo")]
        else:
            assert reads == [("cancel_request", "P.c1"), ("cancel_request", "P"), ("get", "P")]


def test_a_parent_id_chain_that_loops_or_names_no_file_stops_the_look(engine: Engine) -> None:
    """Ancestry written by a producer: a loop (a -> b -> a) and a parent id no file may be named
    after end the look up the chain; the handoffs run."""
    submit(engine, "a", "@leaf", {}, parent_id="b")
    submit(engine, "b", "@leaf", {}, parent_id="a")
    submit(engine, "c", "@leaf", {}, parent_id="../../etc/passwd")
    for hid in ("a", "b", "c"):
        assert process(engine, hid) is State.COMPLETED, hid
    assert RAN == ["a", "b", "c"]


def test_a_cascade_kept_by_a_block_from_outside_or_before_a_retry_stops_nothing(
        engine: Engine) -> None:
    """Only handoffd's own record of this filing counts: a document written into failed/ by
    hand with a cascade in its block (its seal missing) and a record from before a `handoff
    retry` (stamped with fewer retries) leave a child to run."""
    forged = {"handoff_id": "F", "status": "cancelled", "error": {"code": "CANCELLED"},
              "handoffd": {"history": [{"event": "cancelled"}],
                           cancel_requests.CASCADE_KEY: {"cascade": True, "retries": 0}}}
    (engine.ws.handoffs / "failed" / "F.json").write_text(json.dumps(forged))
    submit(engine, "F.c1", "@leaf", {}, parent_id="F")
    assert process(engine, "F.c1") is State.COMPLETED and RAN == ["F.c1"]
    kept = {"cascade": True, "reason": "stop", "requested_by": "@cli", "retries": 0}
    doc = {"handoffd": {"retries": 1, cancel_requests.CASCADE_KEY: kept}}
    assert cancel_requests.cascaded(State.FAILED, doc) is None
    doc["handoffd"]["retries"] = 0
    assert cancel_requests.cascaded(State.FAILED, doc) == kept
    assert cancel_requests.cascaded(State.PENDING, doc) is None


# ---------------------------------------------------------------- a real daemon
HANDLERS = '''
import json, time

def _log(data, **kw):
    kw["t"] = time.time()
    with open(data["log"], "a") as out:
        out.write(json.dumps(kw) + "\\n")

def fan(doc, ctx):
    data = ctx.data or {}
    _log(data, ev="start", id=ctx.handoff_id)
    time.sleep(0.05)
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": k["to"], "data": k["data"]} for k in data["kids"]]}

def leaf(doc, ctx):
    data = ctx.data or {}
    _log(data, ev="start", id=ctx.handoff_id)
    if ctx.cancelled.wait(data["sleep"]):
        return {"status": "failed", "error": {"code": "CANCELLED", "message": "stopped"}}
    _log(data, ev="end", id=ctx.handoff_id)
    return {"status": "completed", "output": {"ok": True}}
'''

CONFIG = """
[daemon]
settle_seconds = 0.05
rescan_seconds = 1.0
sweep_seconds = 0.5
durability = "fast"

[retry]
max_retries = 0

[specialists."@fan"]
handler = "cc20h:fan"
timeout_seconds = 60
concurrency = 8

[specialists."@leaf"]
handler = "cc20h:leaf"
timeout_seconds = 60
concurrency = 8
"""

# `handoff cancel` holds on once it has walked the family of $TEST_HOLD_WALK, until the daemon
# has nothing of it in in-progress/ and its documents stop changing (at most 30 s): what a
# daemon does meanwhile is what it does while a slow walk goes on (r22's: seconds)
HOLD_HOOK = '''
import os, time
if os.environ.get("TEST_HOLD_WALK"):
    from pathlib import Path
    from handoffd.features import cancel_family as _family
    _walk = _family.descendants
    def _members(folder):
        root = os.environ["TEST_HOLD_WALK"]
        return sorted((p.parent.name, p.name) for p in folder.glob("*/" + root + "*.json"))
    def _held(backend, handoff_id, **kwargs):
        found = _walk(backend, handoff_id, **kwargs)
        if handoff_id == os.environ["TEST_HOLD_WALK"]:
            folder = Path(os.environ["TEST_HOLD_FOLDER"])
            seen, since, deadline = None, time.monotonic(), time.monotonic() + 30
            while time.monotonic() < deadline:
                now = _members(folder)
                if now != seen:
                    seen, since = now, time.monotonic()
                elif time.monotonic() - since > 0.5 and not any(
                        state == "in-progress" for state, _ in now):
                    break
                time.sleep(0.05)
        return found
    _family.descendants = _held
'''


def tree(log: Path, depth: int) -> dict[str, Any]:
    """The data of a @fan of ``depth`` levels below it, 3 children a node, leaves 0.5 s."""
    if depth == 1:
        kids = [{"to": "@leaf", "data": {"log": str(log), "sleep": 0.5}}] * 3
    else:
        kids = [{"to": "@fan", "data": tree(log, depth - 1)}] * 3
    return {"log": str(log), "kids": kids}


def iso_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.heavy
def test_no_member_starts_after_a_cascading_cancel_of_a_real_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """r22's reproduction, bounded and made deterministic: a tree of 3 levels below its root
    (3 children a node, 40 members) served by `handoffd serve --processes 2 --workers 4`,
    cancelled with `handoff cancel --cascade` as its first child starts; the cancel walks the
    family and then holds on until the daemon has settled. No member starts after the cancel
    returned; none that started after the root was filed cancelled ends completed. Before: the
    children the walk had not seen were made, ran and completed, their parents filed from
    pending by the walk without a look at them."""
    ws = handlers_workspace(tmp_path, monkeypatch, "cc20h", HANDLERS, CONFIG)
    log = tmp_path / "runs.jsonl"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_HOOK)

    def runs() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    try:
        ws.create("--to", "@fan", "--id", "t", "--data", json.dumps(tree(log, 3)))
        with open(tmp_path / "serve.log", "w") as out:
            daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root),
                                       "--processes", "2", "--workers", "4"],
                                      stdout=subprocess.DEVNULL, stderr=out)
        ws.daemons.append(daemon)
        wait_until(lambda: any(r["id"].startswith("t.c") for r in runs())
                   or daemon.poll() is not None, 60, "the first child of t started")
        env = {**os.environ, "TEST_HOLD_WALK": "t",
               "TEST_HOLD_FOLDER": str(ws.root / "handoffs"),
               "PYTHONPATH": os.pathsep.join([str(hook), os.environ["PYTHONPATH"]])}
        done = subprocess.run([exe("handoff"), "cancel", "t", "--cascade", "--json", "--root",
                               str(ws.root)], capture_output=True, text=True, timeout=120,
                              env=env)
        returned = time.time()
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)[0]["id"] == "t"
        wait_until(lambda: not any(any((ws.root / "handoffs" / s).glob("t*.json"))
                                   for s in ("pending", "in-progress")), 60,
                   "every member filed")
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        ws.cleanup()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    history = ws.doc("t")["handoffd"]["history"]
    filed = [e["at"] for e in history if e["event"] == "cancelled"]
    assert filed, f"t was not filed cancelled: {history}"
    cancelled = iso_time(filed[0])
    late = [r["id"] for r in runs() if r["ev"] == "start" and r["t"] > returned]
    assert late == [], f"started after the cancel returned: {late}"
    after = {r["id"] for r in runs() if r["ev"] == "start" and r["t"] > cancelled + 0.001}
    ended = sorted(h for h in after if (ws.root / "handoffs" / "completed" / f"{h}.json").exists())
    assert ended == [], f"started after t was cancelled, and completed: {ended}"
    members = {p.stem for p in (ws.root / "handoffs").glob("*/t*.json")}
    assert len(members) <= 40 and all(ws.state_of(h) in (["failed"], ["completed"])
                                      for h in members)
    assert not list((ws.root / "handoffs" / ".meta" / "cancel").glob("*.json"))
