"""Python handlers in a process of their own (handoffd.core.isolation, handoffd.core.isolated).

* A handler that crashes its process at every start takes the attempts beside it down once;
  their next attempts (and all of the crasher's) run isolated, so the innocent ones complete
  after one extra attempt and only the crasher is dead-lettered, with one clear line.
* ``isolate = "always"`` runs every attempt in a child: the handler gets what it gets in the
  daemon (ids, data, ``ctx.context``, ``report_partial``, cancellation), its result is checked
  the same way, a timeout kills it and is filed as in the daemon, and nothing the child does
  (prints, crashes, garbage, floods) reaches the daemon as more than one recorded line.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import alive, exe, new_workspace, wait_until

from handoffd import Registry, Workspace, build_engine
from handoffd.core.config import Config, DaemonSettings, specialist_from_table
from handoffd.core.documents import PROCESS_DIED as DIED
from handoffd.core.documents import Outcome
from handoffd.core.engine import Engine
from handoffd.core.errors import ConfigError
from handoffd.core.isolation import crashed_last, isolate
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import Specialist
from handoffd.core.states import State
from handoffd.core.suspects import KIND, SUSPECT_SECONDS, Suspects

PLUG = '''
import ctypes, json, os, sys, time
from handoffd.core.errors import HandlerError
from handoffd.core.specialists import HandlerCancelled

def _log(ctx, **fields):
    with open(os.environ["ISO_LOG"], "a") as log:
        log.write(json.dumps({"id": ctx.handoff_id, "pid": os.getpid(), "attempt": ctx.attempt,
                              "batch": os.environ.get("ISO_BATCH"), "at": time.time(),
                              **fields}) + "\\n")

def crash(handoff, ctx):  # ends its process at every start, whatever runs beside it
    _log(ctx, event="start")
    time.sleep(0.3)
    how = ctx.data.get("how") if isinstance(ctx.data, dict) else "exit"
    if how == "segv":
        ctypes.string_at(0)
    elif how == "kill":
        os.kill(os.getpid(), 9)
    os._exit(1)

def work(handoff, ctx):
    _log(ctx, event="start")
    time.sleep(0.6)
    _log(ctx, event="done")
    return {"status": "completed", "output": {"pid": os.getpid()}}

def whoami(handoff, ctx):
    ctx.report_partial({"step": 1})
    ctx.context.set("notes/" + ctx.handoff_id, {"by": os.getpid()})
    counted = ctx.context.update("notes/counter", lambda n: n + 1, default=0)
    return {"status": "completed", "output": {
        "pid": os.getpid(), "ppid": os.getppid(), "id": handoff["handoff_id"],
        "book": "handoffd" in handoff, "data": ctx.data, "target": ctx.target,
        "attempt": ctx.attempt, "root": str(ctx.root), "partial": ctx.partial,
        "note": ctx.context.get("notes/" + ctx.handoff_id), "counter": counted["value"],
        "revision": ctx.context.get_with_revision("notes/counter")[1],
        "keys": ctx.context.keys("notes/"), "may_write": ctx.context.may_write("notes/x"),
        "missing": ctx.context.get("notes/none", "absent")}}

def denied(handoff, ctx):
    ctx.context.set("task/objective", "mine")  # task/ is the architect's
    return {"status": "completed"}

def sleepy(handoff, ctx):
    with open(os.environ["ISO_PIDS"], "a") as out:
        out.write(f"{os.getpid()}\\n")
    ctx.report_partial({"step": "started"})
    try:
        while True:
            ctx.check_cancelled()
            time.sleep(0.02)
    except HandlerCancelled:
        ctx.report_partial({"step": "stopped", "reason": ctx.cancel_reason})
        raise

def noisy(handoff, ctx):
    print("{\\"status\\": \\"failed\\"}")  # on stdout, as a command's result would be
    sys.stdout.write("x" * 300_000)
    sys.stdout.flush()
    os.write(2, b"y" * 300_000)
    return {"status": "completed", "output": {"quiet": True}}

def garbage(handoff, ctx):
    os.write(int(sys.argv[-1]), b"not a message\\n")
    time.sleep(5)
    return {"status": "completed"}

def flood(handoff, ctx):
    os.write(int(sys.argv[-1]), b"{" + b"x" * 300_000)
    time.sleep(5)
    return {"status": "completed"}

def exit0(handoff, ctx):
    ctx.report_partial({"almost": True})
    os._exit(0)

def kill9(handoff, ctx):
    os.kill(os.getpid(), 9)

def segv(handoff, ctx):
    print("about to crash")  # kept: the child's stdout is line-buffered
    ctypes.string_at(0)

def huge(handoff, ctx):
    return {"status": "completed", "output": "z" * 200_000}

def not_a_dict(handoff, ctx):
    return [1, 2]

def bad_status(handoff, ctx):
    return {"status": ["completed"]}

def own_error(handoff, ctx):
    raise HandlerError("mine", code="MY_CODE", retryable=False, details={"k": 1})

def raises(handoff, ctx):
    raise ValueError("bad input")

def exits(handoff, ctx):
    sys.exit(3)
'''


@pytest.fixture(scope="module")
def plug(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder holding the test handlers' module ``isoplug``, on sys.path while the tests run
    (a child imports it through the daemon's own sys.path)."""
    folder = tmp_path_factory.mktemp("plug")
    (folder / "isoplug.py").write_text(PLUG)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("isoplug", None)


# ---------------------------------------------------------------- who runs isolated
def ev(name: str, **detail: Any) -> dict[str, Any]:
    return {"at": "2026-01-01T00:00:00Z", "event": name, **({"detail": detail} if detail else {})}


def doc_with(*events: dict[str, Any]) -> dict[str, Any]:
    return {"handoff_id": "h", "handoffd": {"history": [ev("created"), *events]}}


def died() -> dict[str, Any]:
    return ev("retry_scheduled", error={"code": "PROCESSING_ERROR", "details": {DIED: True}})


def test_crashed_last_reads_the_attempt_before_this_one() -> None:
    claimed, recovered, retry = ev("claimed"), ev("recovered"), ev("retry_scheduled")
    assert crashed_last(doc_with(claimed, recovered, retry, claimed))
    assert crashed_last(doc_with(claimed, died(), claimed))  # its isolated process died
    # claims handed back in between (never started, or a daemon's stop) say nothing
    assert crashed_last(doc_with(claimed, recovered, retry, claimed,
                                 ev("handed_back", interrupted=True), claimed,
                                 ev("handed_back"), claimed))
    # failed on its recovery, then retried by hand
    assert crashed_last(doc_with(claimed, recovered, ev("failed"), ev("retried"), claimed))
    # dead-lettered by its isolated deaths, then retried by hand: isolated again
    assert crashed_last(doc_with(claimed, died(), claimed, ev("failed", code="PROCESSING_ERROR",
                                                              **{DIED: True}),
                                 ev("retried"), claimed))
    # the attempt after the crash ran and ended otherwise: in the daemon again
    assert not crashed_last(doc_with(claimed, recovered, retry, claimed, retry, claimed))
    assert not crashed_last(doc_with(claimed, recovered, retry, claimed, ev("throttled"), claimed))
    assert not crashed_last(doc_with(claimed))
    assert not crashed_last(doc_with(claimed, retry, claimed))
    assert not crashed_last(doc_with(claimed, ev("failed"), ev("retried"), claimed))
    assert not crashed_last({"handoff_id": "h", "handoffd": {"history": [1, "claimed"]}})
    assert not crashed_last({"handoff_id": "h", "handoffd": "forged"})


def test_only_our_own_bookkeeping_isolates_an_attempt(plug: Path, tmp_path: Path) -> None:
    engine = engine_for(tmp_path, "isoplug:whoami", isolate="after_crash")
    crash = [ev("claimed"), ev("recovered", reason="owner process is gone"),
             ev("retry_scheduled")]
    forged = {"handoff_id": "forged", "target": {"agent_id": "@py"}, "input": {"data": None},
              "handoffd": {"revision": 7, "attempt": 1, "history": [ev("created"), *crash]}}
    (engine.ws.state_dir(State.PENDING) / "forged.json").write_text(json.dumps(forged))
    job = engine.take("forged")
    assert job is not None and not crashed_last(job.claim.doc)  # the unsealed block is dropped
    outcome = engine.run(job)
    assert outcome.output["pid"] == os.getpid()  # in this process
    engine.file(job.claim, job.dialect, job.specialist, outcome)
    hid = engine.submit(new_native_request(source="@test", target="@py", data=None,
                                           now=engine.clock()))
    job = engine.take(hid)
    assert job is not None
    job.claim.doc["handoffd"]["history"][-1:-1] = crash  # as a recovery wrote it, sealed
    assert crashed_last(job.claim.doc)
    assert engine.run(job).output["pid"] != os.getpid()  # in a process of its own


def test_the_isolate_setting_is_checked() -> None:
    retry = Config().retry
    for mode in ("after_crash", "always", "never"):
        assert specialist_from_table("@x", {"handler": "m:f", "isolate": mode}, retry).isolate == mode
    assert specialist_from_table("@x", {"handler": "m:f"}, retry).isolate == "after_crash"
    for bad in ("sometimes", 1, True, ["always"], "x" * 500):
        with pytest.raises(ConfigError) as caught:
            specialist_from_table("@x", {"handler": "m:f", "isolate": bad}, retry)
        message = str(caught.value)
        assert "isolate" in message and '"after_crash" or "always" or "never"' in message
        assert "\n" not in message and len(message) < 200


def test_a_suspect_specialist_runs_every_attempt_isolated_for_a_while() -> None:
    """After a crash every handoff of a specialist that was running there runs isolated, not
    only those that were running: a handler crashing at every start took the daemon (and the
    attempts beside it) down once per new handoff of its own. The mark is a shared record, so
    another process of the store (another of `run --processes N`) isolates it too."""
    from handoffd.backends.memory import MemoryRecords
    retry = Config().retry
    fresh = doc_with(ev("claimed"))  # no crash in its own history
    specs = {mode: Specialist(specialist_from_table("@x", {"handler": "isoplug:work",
                                                           "isolate": mode}, retry))
             for mode in ("after_crash", "always", "never")}
    command = Specialist(specialist_from_table("@c", {"command": ["true"]}, retry))
    unimportable = Specialist(specialist_from_table("@m", {"handler": "__main__:f"}, retry))
    now = [1000.0]
    shared = MemoryRecords()
    here, there = (Suspects(lambda: shared, clock=lambda: now[0]) for _ in range(2))
    assert not isolate(specs["after_crash"], fresh, "h1", here)
    assert not isolate(specs["after_crash"], fresh, "h1", there)  # (read: cached for a second)
    for spec in (*specs.values(), command, unimportable, None):
        here.mark(spec)
    assert isolate(specs["after_crash"], fresh, "h1", here)
    assert isolate(specs["always"], fresh, "h1", here)
    assert not isolate(specs["never"], fresh, "h1", here)
    assert set(shared.read(KIND)) == {"@x"}  # no command, no "never", none another can't import
    there.refresh()  # (as after its sweep; else within REFRESH_SECONDS)
    assert isolate(specs["after_crash"], fresh, "h1", there)
    now[0] += 599.0
    assert isolate(specs["after_crash"], fresh, "h1", here)
    now[0] += 2.0  # SUSPECT_SECONDS after the last crash: back in the daemon
    assert not isolate(specs["after_crash"], fresh, "h1", here)
    assert not isolate(specs["after_crash"], fresh, "h1", there)
    # a forged record isolates for SUSPECT_SECONDS at most, and garbage not at all
    for agent, until in (("@x", now[0] + SUSPECT_SECONDS), ("@y", 1e300), ("@z", "soon"),
                         ("@w", float("nan"))):
        shared.update(KIND, agent, lambda old, until=until: {"until": until})
    there.refresh()
    assert "@x" in there and all(a not in there for a in ("@y", "@z", "@w"))
    now[0] += SUSPECT_SECONDS + 1
    assert "@x" not in there


def test_a_bad_isolate_value_is_one_config_line(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", '[specialists."@x"]\nhandler = "m:f"\nisolate = "maybe"\n')
    done = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "isolate = 'maybe'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# ---------------------------------------------------------------- isolate = "always", in-process engine
def engine_for(tmp_path: Path, handler: str, *, isolate: str = "always",
               timeout: float | None = None, max_output_bytes: int = 100_000) -> Engine:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(max_output_bytes=max_output_bytes))
    table: dict[str, Any] = {"handler": handler, "isolate": isolate}
    if timeout is not None:
        table["timeout_seconds"] = timeout
    registry = Registry()
    registry.add(Specialist(specialist_from_table("@py", table, config.retry)))
    return build_engine(ws, config, registry)


def attempt(engine: Engine, data: Any = None, *,
            during: Any = None) -> tuple[State, dict[str, Any], Outcome]:
    """Create a handoff for @py, run one attempt (``during(job)`` on a thread meanwhile) and
    file it without retries: (where it went, the filed document, the outcome)."""
    doc = new_native_request(source="@test", target="@py", data=data, now=engine.clock())
    doc["retry_policy"] = {"max_retries": 0}
    hid = engine.submit(doc)
    job = engine.take(hid)
    assert job is not None
    helper = threading.Thread(target=during, args=(job,), daemon=True) if during else None
    if helper:
        helper.start()
    outcome = engine.run(job)
    if helper:
        helper.join(timeout=30)
    state = engine.file(job.claim, job.dialect, job.specialist, outcome)
    found = engine.backend.get(hid)
    assert found is not None and found[0] is state
    assert not list(engine.ws.state_dir(State.IN_PROGRESS).iterdir())  # nothing stranded
    assert not list((engine.ws.meta / "procs").glob("*.json"))  # no process record left
    return state, found[1], outcome


def shown(doc: dict[str, Any]) -> str:
    """The filed error's message with the handoff's own id left out (for comparisons)."""
    return str(doc["error"]["message"]).replace(doc["handoff_id"], "<id>")


def test_always_runs_the_handler_in_a_child_with_what_the_daemon_gives(plug: Path,
                                                                      tmp_path: Path) -> None:
    engine = engine_for(tmp_path, "isoplug:whoami")
    (engine.ws.context / "notes").mkdir(parents=True)
    (engine.ws.context / "notes" / "counter.json").write_text("41\n")
    state, doc, _ = attempt(engine, {"n": 1})
    assert state is State.COMPLETED, doc.get("error")
    out = doc["output"]
    assert out["pid"] != os.getpid() and out["ppid"] == os.getpid()  # a child of this process
    assert (out["id"], out["book"], out["data"], out["target"], out["attempt"], out["root"]) == \
        (doc["handoff_id"], True, {"n": 1}, "@py", 1, str(engine.ws.root))
    assert out["partial"] == {"step": 1}
    assert out["note"] == {"by": out["pid"]} and out["counter"] == 42
    assert out["revision"] >= 1 and out["may_write"] is True and out["missing"] == "absent"
    assert sorted(out["keys"]) == ["notes/counter", f"notes/{doc['handoff_id']}"]
    written = json.loads((engine.ws.context / "notes" / f"{doc['handoff_id']}.json").read_text())
    assert written == {"by": out["pid"]}  # through the daemon's own store
    history = (engine.ws.context / ".history.jsonl").read_text()
    assert '"by": "@py"' in history or '"by":"@py"' in history


def test_a_context_permission_error_reaches_the_child_as_in_the_daemon(plug: Path,
                                                                     tmp_path: Path) -> None:
    results = {}
    for mode in ("always", "never"):
        state, doc, _ = attempt(engine_for(tmp_path / mode, "isoplug:denied", isolate=mode))
        results[mode] = (state, doc["error"]["code"], shown(doc),
                         doc["error"].get("retryable"))
    assert results["always"] == results["never"]
    assert results["always"][1] == "CONTEXT_PERMISSION_DENIED"


def test_a_timeout_kills_the_child_and_is_filed_as_in_the_daemon(plug: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("ISO_PIDS", str(pids))
    found = {}
    for mode in ("always", "never"):
        # (2 s: under load, a child's start and its handler's first report took over 0.5 s,
        # and it was stopped before it ran: no partial output to keep)
        engine = engine_for(tmp_path / mode, "isoplug:sleepy", isolate=mode, timeout=2.0)
        began = time.monotonic()
        state, doc, outcome = attempt(engine)
        assert time.monotonic() - began < 20
        found[mode] = (state, outcome.status, doc["error"]["code"], shown(doc))
        if mode == "always":
            # SIGTERM set ctx.cancelled in the child: what it reported as it stopped is kept
            assert doc["output"] == {"step": "stopped", "reason": "stopped by its daemon"}
            assert doc["metadata"]["partial"] is True
            child = int(pids.read_text().split()[0])
            assert child != os.getpid() and not alive(child)
    assert found["always"] == found["never"]
    assert found["always"][:3] == (State.FAILED, "timeout", "TIMEOUT")


def test_an_isolated_start_is_logged_while_its_handler_runs(plug: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The event log's `claimed` is written as the child starts (a follower, `ls --watch` or
    `top`, sees the run while it lasts), as for an in-process or command handler; it was written
    only once the child's answer was in."""
    monkeypatch.setenv("ISO_PIDS", str(tmp_path / "pids"))
    engine = engine_for(tmp_path, "isoplug:sleepy")
    seen: list[list[str]] = []

    def look_then_cancel(job: Any) -> None:
        wait_until(lambda: job.context.partial is not None, timeout=20, what="a partial report")
        log = engine.ws.meta / "events.jsonl"
        seen.append([json.loads(line)["event"] for line in log.read_text().splitlines()
                     if json.loads(line)["id"] == job.handoff_id])
        job.context.stop("cancelled by the test")

    state, _, _ = attempt(engine, during=look_then_cancel)
    assert state is State.FAILED
    assert seen == [["created", "claimed"]], seen


def test_a_cancelled_child_keeps_its_partial_result(plug: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISO_PIDS", str(tmp_path / "pids"))
    engine = engine_for(tmp_path, "isoplug:sleepy")

    def cancel(job: Any) -> None:
        wait_until(lambda: job.context.partial is not None, timeout=20, what="a partial report")
        job.context.stop("cancelled by the test")

    state, doc, outcome = attempt(engine, during=cancel)
    assert (state, outcome.status, doc["error"]["code"]) == (State.FAILED, "cancelled", "CANCELLED")
    assert doc["output"]["step"] in ("started", "stopped")
    assert not alive(int((tmp_path / "pids").read_text().split()[0]))


# the same result checks as in the daemon: compared with an in-process run of the same handler
SAME_AS_IN_PROCESS = ["huge", "not_a_dict", "bad_status", "own_error", "raises", "exits"]


@pytest.mark.parametrize("handler", SAME_AS_IN_PROCESS)
def test_results_and_errors_are_checked_as_in_the_daemon(plug: Path, tmp_path: Path,
                                                         handler: str) -> None:
    found = {}
    for mode in ("always", "never"):
        state, doc, _ = attempt(engine_for(tmp_path / mode, f"isoplug:{handler}", isolate=mode))
        error = doc["error"]
        found[mode] = (state, error["code"], shown(doc), error.get("retryable"),
                       error.get("details"))
    assert found["always"] == found["never"]
    assert found["always"][0] is State.FAILED


@pytest.mark.parametrize(("handler", "says", "retryable"), [
    ("exit0", "the handler's process exited with status 0 without a result", None),
    ("kill9", "the handler's process died (signal 9, SIGKILL)", None),
    ("segv", "the handler's process died (signal 11, SIGSEGV); its last output: "
             "'about to crash'", None),
    ("garbage", "the handler's process broke the protocol with its daemon (a message that is "
                "not JSON: b'not a message')", None),
    ("flood", "the handler's process sent a message of more than", False),
])
def test_a_hostile_child_is_one_line_and_a_code(plug: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture, handler: str,
                                                says: str, retryable: bool | None) -> None:
    caplog.set_level(logging.DEBUG, logger="handoffd")
    began = time.monotonic()
    state, doc, outcome = attempt(engine_for(tmp_path, f"isoplug:{handler}"))
    assert time.monotonic() - began < 20  # stopped, not left to its 5 s sleep... or more
    error = doc["error"]
    assert state is State.FAILED and error["code"] == "PROCESSING_ERROR"
    assert says in error["message"] and "\n" not in error["message"]
    assert error.get("retryable") is retryable
    if handler in ("exit0", "kill9", "segv"):
        assert outcome.error is not None and outcome.error["details"][DIED] is True
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_what_a_child_prints_never_reaches_its_result(plug: Path, tmp_path: Path) -> None:
    state, doc, _ = attempt(engine_for(tmp_path, "isoplug:noisy"))
    assert state is State.COMPLETED and doc["output"] == {"quiet": True}


def test_a_handler_no_other_process_can_import(plug: Path, tmp_path: Path) -> None:
    def local(handoff: dict, ctx: Any) -> dict:
        return {"status": "completed"}

    engine = engine_for(tmp_path, "isoplug:whoami")
    spec = engine.registry.add_function("@py", local, isolate="always")
    assert spec.config.isolate == "always"
    state, doc, _ = attempt(engine)
    assert state is State.FAILED and doc["error"].get("retryable") is False
    assert "cannot be imported by another process" in doc["error"]["message"]


def test_a_handler_that_cannot_be_imported_fails_as_in_the_daemon(plug: Path,
                                                                 tmp_path: Path) -> None:
    found = {}
    for mode in ("always", "never"):
        state, doc, _ = attempt(engine_for(tmp_path / mode, "no_such_module_xyz:f", isolate=mode))
        found[mode] = (state, doc["error"]["code"], shown(doc), doc["error"].get("retryable"))
    assert found["always"] == found["never"] and found["always"][3] is False
    assert "cannot import handler" in found["always"][2]


# ---------------------------------------------------------------- a crash loop in a real daemon
CONFIG = '''
[daemon]
durability = "fast"
settle_seconds = 0.05
workers = 4
sweep_seconds = 0.5
rescan_seconds = 0.5

[retry]
max_retries = 2
retry_delay_seconds = 0
backoff_multiplier = 1.0

[specialists."@crash"]
handler = "isoplug:crash"
[specialists."@work"]
handler = "isoplug:work"
'''
INNOCENT = 6


def crash_workspace(tmp_path: Path, plug: Path, how: str) -> tuple[Any, dict[str, str], list[str]]:
    ws = new_workspace(tmp_path / "ws", CONFIG)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(plug),
                                                                    os.environ.get("PYTHONPATH")))),
               ISO_LOG=str(tmp_path / "runs.jsonl"))
    ws.drop("crasher.json", {"handoff_id": "crasher", "target": {"agent_id": "@crash"},
                             "priority": 0,  # claimed first: it crashes beside three of them
                             "input": {"data": {"how": how}}})
    innocent = [f"work-{i}" for i in range(INNOCENT)]
    for hid in innocent:
        ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@work"},
                                "input": {"data": {}}})
    return ws, env, innocent


def runs_of(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_crash_loop(ws: Any, tmp_path: Path, innocent: list[str], daemons: set[int]) -> None:
    """Every innocent handoff completed with at most one extra attempt, the crasher failed after
    its three attempts with one clear line, and no handoff ran twice at once."""
    for hid in innocent:
        assert ws.state_of(hid) == ["completed"], (hid, ws.state_of(hid))
        block = ws.doc(hid)["handoffd"]
        assert block["attempt"] <= 2 and block.get("retries", 0) <= 1, (hid, block)
    assert ws.state_of("crasher") == ["failed"]
    crasher = ws.doc("crasher")
    assert crasher["handoffd"]["attempt"] == 3 and crasher["error"]["code"] == "PROCESSING_ERROR"
    assert "the handler's process" in crasher["error"]["message"]
    assert "\n" not in crasher["error"]["message"]
    runs = runs_of(tmp_path)
    # the crasher took its daemon down once; its later attempts ran in processes of their own
    starts = [r for r in runs if r["id"] == "crasher" and r["event"] == "start"]
    assert len(starts) == 3 and sum(r["pid"] in daemons for r in starts) == 1, starts
    # an innocent handoff recovered from that crash ran isolated, once, and completed
    recovered = [hid for hid in innocent if ws.doc(hid)["handoffd"]["attempt"] == 2]
    assert recovered, "no innocent handoff ran beside the crash"
    for hid in innocent:
        mine = [r for r in runs if r["id"] == hid]
        if ws.doc(hid)["handoffd"]["attempt"] == 2:
            (last,) = [r for r in mine if r["event"] == "done"]
            assert last["attempt"] == 2 and last["pid"] not in daemons
        running: set[str] = set()  # no second start before the first ended, within a daemon
        for run in mine:
            key = f"{run['batch']}"
            if run["event"] == "start":
                assert key not in running, (hid, mine)
                running.add(key)
            else:
                running.discard(key)
    held = list((ws.root / "handoffs" / "pending").glob("*.json")) + \
        list((ws.root / "handoffs" / "in-progress").glob("*.json"))
    assert not held, held  # nothing lost, nothing left behind


def run_batch(ws: Any, env: dict[str, str], batch: int) -> tuple[int, int, str]:
    """One `handoffd run --processes 1` (the test is its supervisor): its pid, exit status (a
    negative one: a signal ended it) and stderr, which never holds a traceback."""
    proc = subprocess.Popen([exe("handoffd"), "run", "--root", str(ws.root), "--processes", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env, ISO_BATCH=str(batch)))
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    return proc.pid, proc.returncode, err


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_a_crash_loop_beside_innocent_handoffs_in_batches(plug: Path, tmp_path: Path,
                                                          how: str) -> None:
    ws, env, innocent = crash_workspace(tmp_path, plug, how)
    daemons: set[int] = set()
    for batch in range(1, 6):  # the test is the supervisor that starts the next batch
        pid, code, err = run_batch(ws, env, batch)
        daemons.add(pid)
        if ws.state_of("crasher") == ["failed"] and \
                all(ws.state_of(hid) == ["completed"] for hid in innocent):
            break
    assert batch == 2, f"settled after {batch} batches"  # one crash, then the isolated round
    check_crash_loop(ws, tmp_path, innocent, daemons)


def test_a_crash_loop_beside_innocent_handoffs_under_serve(plug: Path, tmp_path: Path) -> None:
    ws, env, innocent = crash_workspace(tmp_path, plug, "kill")
    daemons: set[int] = set()
    deadline = time.monotonic() + 90
    proc = None
    try:
        while time.monotonic() < deadline:
            if proc is None or proc.poll() is not None:  # the test restarts a dead daemon
                proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env=dict(env, ISO_BATCH=str(len(daemons))))
                daemons.add(proc.pid)
            if ws.state_of("crasher") == ["failed"] and \
                    all(ws.state_of(hid) == ["completed"] for hid in innocent):
                break
            time.sleep(0.05)
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert len(daemons) == 2, "the crasher took one daemon down, and only one"
    check_crash_loop(ws, tmp_path, innocent, daemons)


def test_new_handoffs_of_a_crasher_after_a_crash_run_isolated_too(plug: Path,
                                                                  tmp_path: Path) -> None:
    """Crashers that arrive after the first crash: each used to run its first attempt in the
    daemon and take it down with the innocent attempts beside it, so innocent handoffs were
    dead-lettered. The batch that recovers the first crash runs them isolated."""
    ws, env, innocent = crash_workspace(tmp_path, plug, "kill")
    daemons: set[int] = set()
    later = [f"crasher-{i}" for i in range(1, 4)]
    for batch in range(1, 6):  # the test is the supervisor that starts the next batch
        pid, code, err = run_batch(ws, env, batch)
        daemons.add(pid)
        if batch == 1:  # the first crash is behind us: new crashers come, never run before
            assert code < 0, err
            for hid in later:
                ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@crash"},
                                        "input": {"data": {"how": "kill"}}})
        elif all(ws.state_of(h) == ["failed"] for h in ("crasher", *later)) and \
                all(ws.state_of(hid) == ["completed"] for hid in innocent):
            break
    assert batch == 2, f"settled after {batch} batches"  # only the first crash took one down
    check_crash_loop(ws, tmp_path, innocent, daemons)
    for hid in later:
        assert ws.doc(hid)["handoffd"]["attempt"] == 3
        assert "the handler's process died" in ws.doc(hid)["error"]["message"]


def test_a_crasher_retried_by_hand_after_its_isolated_deaths_runs_isolated(plug: Path,
                                                                           tmp_path: Path) -> None:
    """Its last attempt died isolated and it was dead-lettered: `handoff retry` ran it in the
    daemon again, which it took down with the innocent attempt beside it."""
    ws, env, _ = crash_workspace(tmp_path, plug, "kill")
    for hid in [f"work-{i}" for i in range(INNOCENT)]:
        (ws.root / "handoffs" / "pending" / f"{hid}.json").unlink()
    for batch in (1, 2):  # the crash, then its isolated deaths until it is dead-lettered
        run_batch(ws, env, batch)
    assert ws.state_of("crasher") == ["failed"]
    assert ws.doc("crasher")["handoffd"]["history"][-1]["detail"][DIED] is True
    assert ws.handoff("retry", "crasher", "--force").returncode == 0
    ws.drop("beside.json", {"handoff_id": "beside", "target": {"agent_id": "@work"},
                            "input": {"data": {}}})
    pid, code, err = run_batch(ws, env, 3)
    assert code >= 0, err  # the batch was not taken down
    assert ws.state_of("beside") == ["completed"] and ws.doc("beside")["handoffd"]["attempt"] == 1
    assert ws.state_of("crasher") == ["failed"]
    third = [r for r in runs_of(tmp_path) if r["id"] == "crasher" and r["batch"] == "3"]
    assert third and all(r["pid"] != pid for r in third)  # each in a process of its own


def test_after_a_crash_no_process_of_a_forked_batch_runs_a_crasher_in_itself(
        plug: Path, tmp_path: Path) -> None:
    """`run --processes 2` after a crash: the process that did not recover it had no mark and
    ran new crashers in itself, and was killed. Its children now start after the parent's
    first sweep, and the mark is shared through the store's records."""
    ws, env, innocent = crash_workspace(tmp_path, plug, "kill")
    _, code, err = run_batch(ws, env, 1)
    assert code < 0, err  # the crash
    later = [f"crasher-{i}" for i in range(1, 7)]
    for hid in later:
        ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@crash"},
                                "input": {"data": {"how": "kill"}}})
    proc = subprocess.Popen([exe("handoffd"), "run", "--root", str(ws.root), "--processes", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env, ISO_BATCH="2"))
    _, err = proc.communicate(timeout=90)
    assert proc.returncode in (0, 1) and "without a report" not in err, err
    assert "Traceback" not in err, err
    starts = [r for r in runs_of(tmp_path) if r["batch"] == "2" and r["event"] == "start"
              and r["id"].startswith("crasher")]
    pids = [r["pid"] for r in starts]
    assert starts and len(set(pids)) == len(pids), starts  # each in a process of its own
    for hid in ["crasher", *later]:
        assert ws.state_of(hid) == ["failed"], hid
    for hid in innocent:
        assert ws.state_of(hid) == ["completed"], hid


def test_hostile_or_stale_marks_neither_crash_nor_shadow_a_real_one() -> None:
    """A 4,000-digit `until` raised OverflowError out of every attempt's check (claims stranded
    with a traceback); a record further ahead than a mark can be (a skewed clock, a hand edit)
    was kept by a real mark's update, which every other process then ignored."""
    from handoffd.backends.memory import MemoryRecords
    retry = Config().retry
    spec = Specialist(specialist_from_table("@x", {"handler": "isoplug:work"}, retry))
    now = [1000.0]
    shared = MemoryRecords()
    shared.update(KIND, "@big", lambda old: {"until": 10 ** 4000})
    shared.update(KIND, "@x", lambda old: {"until": now[0] + 7200})  # two hours ahead
    here, there = (Suspects(lambda: shared, clock=lambda: now[0]) for _ in range(2))
    assert "@big" not in there and "@x" not in there  # ignored, and no exception
    here.mark(spec)
    assert shared.read(KIND)["@x"]["until"] == now[0] + SUSPECT_SECONDS  # the real mark
    there.refresh()
    assert "@x" in there
