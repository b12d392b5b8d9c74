"""A passing shortage (EMFILE, MemoryError) checking a handler's result costs no attempt.

Session 25: a shortage checking the result after its handler ran (its output against its
schema) failed the attempt retryable, counted: on the handoff's last allowed attempt
(``max_retries = 0``) a handler that had completed was filed in failed/. Now the result is
kept and checked again after a back-off (the handler does not run again); only a check that
still runs short after every wait fails the attempt, retryable, as before.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine, new_workspace, wait_for_words
from test_claim_shortage_s22 import COMMAND
from test_shortage_schemas_s23 import _engine, _events, _submit, emfile
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon
from handoffd.core import results as results_module
from handoffd.core.documents import book
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.features import artifacts, cancel_family, orchestration
from handoffd.service.sweeper import sweep


@pytest.fixture(autouse=True)
def quick_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits between two checks of a result, shortened (no test waits out a second)."""
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.01, raising=False)



def _completed_once(engine: Any, hid: str, report: Any) -> None:
    """The handler ran once, its attempt counted once: no retry, no hand-back, no failure."""
    state, stored = engine.get(hid)
    names = [e["event"] for e in _events(engine, hid)]
    assert state is State.COMPLETED, (state, names, book(stored).get("last_error"))
    assert names == ["created", "claimed", "completed"], names
    assert book(stored)["attempt"] == 1
    assert report.completed == 1 and report.failed == 0 and report.errors == 0, report

@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_checking_the_result_of_a_last_attempt_does_not_fail_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Any) -> None:
    engine = _engine(tmp_path / "ws", output_schema="out.json", retry={"max_retries": 0})
    hid = _submit(engine)
    check = FailFirst(engine.checks.schemas.errors_with, 1, error)
    monkeypatch.setattr(engine.checks.schemas, "errors_with", check)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert check.raised == 1
    _completed_once(engine, hid, report)




def test_a_stop_while_a_result_waits_to_be_checked_again_hands_it_back_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait ends with the batch (its --max-seconds): the attempt is handed back as a
    stop's interrupted one, uncounted, never left waiting out its back-off."""
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 600.0, raising=False)
    engine = _engine(tmp_path / "ws", output_schema="out.json", retry={"max_retries": 0})
    hid = _submit(engine)
    check = FailFirst(engine.checks.schemas.errors_with, 1, emfile)
    monkeypatch.setattr(engine.checks.schemas, "errors_with", check)
    # (5 s: the handler, a spawned interpreter, must have answered and its check run short
    # before the batch ends, however loaded the machine; R43 saw 1 s as too tight)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=5.0)
    assert check.raised == 1
    state, stored = engine.get(hid)
    events = _events(engine, hid)
    assert state is State.PENDING and book(stored)["attempt"] == 0, events
    assert events[-1]["event"] == "handed_back" and events[-1]["detail"]["interrupted"], events
    assert report.failed == 0 and report.handed_back == 1, report



def test_a_cancel_while_a_result_waits_to_be_checked_again_files_it_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 600.0, raising=False)
    engine = _engine(tmp_path / "ws", output_schema="out.json")
    hid = _submit(engine)

    def short_then_cancelled() -> OSError:
        # (cancelled from another thread while the worker waits, as `handoff cancel` does)
        threading.Thread(target=cancel_family.cancel, args=(engine, hid),
                         kwargs={"reason": "not needed"}, daemon=True).start()
        return emfile()
    check = FailFirst(engine.checks.schemas.errors_with, 1, short_then_cancelled)
    monkeypatch.setattr(engine.checks.schemas, "errors_with", check)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=60)
    assert check.raised == 1
    state, stored = engine.get(hid)
    assert state is State.FAILED and stored["status"] == "cancelled", _events(engine, hid)
    assert book(stored)["attempt"] == 1 and report.errors == 0, report


# a command that completes naming artifacts/a.txt (the test writes it) as its artifact
ARTIFACT = [sys.executable, "-S", "-c", "import json; print(json.dumps({'status': 'completed', "
            "'output': {'ok': True}, 'artifacts': [{'path': 'artifacts/a.txt'}]}))"]


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_reading_the_artifacts_of_a_last_attempt_does_not_fail_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Any) -> None:
    """Reading an artifact to record its size and sha256 ran short: an EMFILE failed the
    attempt, counted (a last one filed in failed/), and a MemoryError left the claim for the
    next process's recovery to charge; now the artifacts are read again after a wait."""
    engine = _engine(tmp_path / "ws", command=ARTIFACT, retry={"max_retries": 0})
    (engine.ws.root / "artifacts").mkdir(exist_ok=True)
    (engine.ws.root / "artifacts" / "a.txt").write_text("made by the handler")
    hid = _submit(engine)
    read = FailFirst(artifacts.open_reading, 1, error)
    monkeypatch.setattr(artifacts, "open_reading", read)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert read.raised == 1
    _completed_once(engine, hid, report)
    [recorded] = engine.get(hid)[1]["artifacts"]
    assert recorded["path"] == "artifacts/a.txt" and recorded["size_bytes"] == 19, recorded


# ---------------------------------------------------------------- a kept claim given up at a stop

# run as `handoffd ARGS`: its first admission of a claim (reading the claimed document's
# envelope) fails with EMFILE, and so does every write into pending/ (the claim's hand-back,
# kept, and its last try at the stop): the claim is given up as the daemon stops
KEPT_AT_STOP = """
import errno, os, sys
from pathlib import Path
from handoffd.core import admission
from handoffd.backends.files import store
def emfile():
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))
envelope, left = admission._envelope, [1]
def short_envelope(*args, **kwargs):
    if left:
        left.pop()
        raise emfile()
    return envelope(*args, **kwargs)
admission._envelope = short_envelope
create = store.fsio.create_exclusive
def create_exclusive(path, *args, **kwargs):
    if Path(path).parent.name == "pending":
        raise emfile()
    return create(path, *args, **kwargs)
store.fsio.create_exclusive = create_exclusive
from handoffd.cli.handoffd_cmd import main
sys.argv[0] = "handoffd"
sys.exit(main())
"""


def test_a_claim_kept_unrun_and_given_up_at_a_stop_is_not_charged_by_the_next_process(
        tmp_path: Path) -> None:
    """Its handler never ran: the next process's recovery hands it back uncounted (it took
    the given-up claim for a crash: an attempt charged, here the last allowed one)."""
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
durability = "fast"

[specialists."@cmd"]
command = {json.dumps(COMMAND)}
retry = {{ max_retries = 0 }}
""")
    said = tmp_path / "serve.err"
    try:
        hid = ws.create("--to", "@cmd", "--data", "{}")
        with said.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-c", KEPT_AT_STOP, "serve", "--root",
                                     str(ws.root)], stdout=subprocess.DEVNULL, stderr=err)
        ws.daemons.append(proc)  # (cleanup kills it, by pid, should the test fail)
        first = wait_for_words(said, ["its claim is kept"])
        assert "its claim is kept" in first, first
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        stopped = said.read_text()
        assert "the sweep recovers it" in stopped, stopped  # (given up: still leased)
        assert ws.state_of(hid) == ["in-progress"], stopped
        done = ws.handoffd("run")
    finally:
        ws.cleanup()
    assert ws.state_of(hid) == ["completed"], (done.stderr, ws.doc(hid))
    block = ws.doc(hid)["handoffd"]
    assert block["attempt"] == 1, block["history"]
    names = [e["event"] for e in block["history"]]
    assert "retry_scheduled" not in names and "failed" not in names, names
    assert names[-2:] == ["claimed", "completed"], names
    back = block["history"][names.index("recovered") + 1]
    assert back["event"] == "handed_back" and back["detail"]["not_started"] == "GIVEN_UP", back
    assert done.returncode == 0, done.stderr
    # the mark that said so went with the lease it named
    assert not list((ws.root / "handoffs" / ".meta" / "unrun").iterdir())


def test_a_claim_given_up_unrun_is_handed_back_uncounted_by_the_memory_stores_sweep(
        tmp_path: Path) -> None:
    """The memory store says so too: its recovery, once the lease ran out, hands the claim back
    uncounted (it took it for an interrupted attempt and charged it)."""
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@py": lambda doc, ctx: {}})
    doc = new_native_request(source="@test", target="@py", data={}, now=clock())
    hid = engine.submit(doc)
    job = engine.take(hid)
    assert job is not None and job.claim.attempt == 1
    backend.abandon_unrun(job.claim)  # (what KeptClaims does when its hand-back runs short)
    clock.advance(engine.settings.lease_seconds + 1)
    report = sweep(engine)
    assert report.recovered == [hid], report
    state, stored = engine.get(hid)
    events = book(stored)["history"]
    assert state is State.PENDING and book(stored)["attempt"] == 0, events
    assert [e["event"] for e in events][-2:] == ["recovered", "handed_back"], events
    assert events[-1]["detail"]["not_started"] == "GIVEN_UP", events[-1]


# ---------------------------------------------------------------- parked results, after_run hooks

# a command that answers blocked, with a blocker seed 002 accepts
BLOCKED = [sys.executable, "-S", "-c", "import json; print(json.dumps({'status': 'blocked', "
           "'blockers': [{'description': 'no key', 'resolution_options': ['send one']}]}))"]


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logged = [r for r in caplog.records if r.exc_info]
    assert not logged, [r.getMessage() for r in logged]


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_reading_a_blocked_result_parks_it_all_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Any) -> None:
    """Reading a blocked (delegated, needs_clarification) result ran short: it was filed
    VALIDATION_FAILED, for good, as though the result were malformed; now it is read again
    after a wait and parked for its requester's answer."""
    engine = _engine(tmp_path / "ws", command=BLOCKED, retry={"max_retries": 0})
    hid = _submit(engine)
    read = FailFirst(orchestration._blocked, 1, error)
    monkeypatch.setattr(orchestration, "_blocked", read)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert read.raised == 1
    state, stored = engine.get(hid)
    names = [e["event"] for e in _events(engine, hid)]
    assert state is State.PENDING, (state, names, book(stored).get("last_error"))
    assert names == ["created", "claimed", "blocked"], names
    assert book(stored)["awaiting"]["kind"] == "blocked"
    assert report.failed == 0 and report.errors == 0, report
    _no_traceback(caplog)


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_in_an_after_run_hook_does_not_strand_or_charge_a_last_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Any) -> None:
    """A shortage in a hook run on the outcome (a dialect's review, first_success's) escaped
    `conclude`: the claim was left in in-progress/, for the next process to charge as a crash.
    Now the hook runs again on the same outcome after a wait."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    hid = _submit(engine)
    hook = FailFirst(lambda job, outcome: outcome, 1, error)
    engine.after_run.insert(0, hook)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=10)
    assert hook.raised == 1
    _completed_once(engine, hid, report)
    _no_traceback(caplog)


def test_a_shortage_in_a_hook_after_a_timeout_leaves_the_timeout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """R43: the timeout had set the attempt's cancel flag, so the hook's wait ended at once and
    a PROCESSING_ERROR, retryable, replaced the TIMEOUT."""
    sleeper = [sys.executable, "-S", "-c", "import time; time.sleep(30)"]
    engine = _engine(tmp_path / "ws", command=sleeper, timeout_seconds=0.5,
                     retry={"max_retries": 0})
    hid = _submit(engine)
    hook = FailFirst(lambda job, outcome: outcome, 1, emfile)
    engine.after_run.insert(0, hook)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=20)
    assert hook.raised == 1
    state, stored = engine.get(hid)
    assert state is State.FAILED, _events(engine, hid)
    assert book(stored)["final_error"]["code"] == "TIMEOUT", book(stored)["final_error"]
    assert report.failed == 1 and report.errors == 0, report
    _no_traceback(caplog)


@pytest.mark.parametrize("error", [emfile, MemoryError])
def test_a_shortage_checking_a_contract_does_not_fail_a_last_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Any) -> None:
    """The contract check (the tree against its snapshot, the criteria) ran short: the attempt
    failed, counted, with a traceback; now the work is checked again after a wait."""
    engine = _engine(tmp_path / "ws", retry={"max_retries": 0})
    doc = new_native_request(source="@test", target="@cmd", data={}, now=engine.clock())
    doc["contract"] = {"files_owned": ["src/**"]}
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    [enforcer] = [getattr(h, "__self__") for h in engine.after_run
                  if getattr(h, "__name__", "") == "after"]
    review = FailFirst(enforcer.reviewer.review, 1, error)
    monkeypatch.setattr(enforcer.reviewer, "review", review)
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=30)
    assert review.raised == 1
    state, stored = engine.get(hid)
    names = [e["event"] for e in _events(engine, hid)]
    assert state is State.COMPLETED, (state, names, book(stored).get("last_error"))
    assert names == ["created", "claimed", "completed"], names
    assert book(stored)["attempt"] == 1 and stored["validation"]["scope"]["checked"], stored
    assert report.completed == 1 and report.failed == 0 and report.errors == 0, report
    _no_traceback(caplog)


def test_a_memory_shortage_planning_children_is_retried_not_filed_malformed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError planning a delegation's children (as it is filed, after the checks) filed
    the parent VALIDATION_FAILED for good, "its delegation cannot be turned into child
    handoffs", as though the delegation were malformed: now a failed attempt, retryable."""
    clock = Clock()

    def boss(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        return {"status": "delegated", "aggregation": "all_success",
                "delegate": [{"to": "@echo", "data": {"n": 1}}]}
    engine, _ = memory_engine(tmp_path, clock, {"@boss": boss,
                                                "@echo": lambda doc, ctx: {"status": "completed"}})
    hid = engine.submit(new_native_request(source="@test", target="@boss", data={}, now=clock()))
    plan = FailFirst(orchestration._plan_children, 1, MemoryError)
    monkeypatch.setattr(orchestration, "_plan_children", plan)
    Daemon(engine, workers=1, watch=False).run_batch()
    assert plan.raised == 1
    state, stored = engine.get(hid)
    error = book(stored).get("last_error") or {}
    assert state is State.PENDING and book(stored)["retries"] == 1, (state, error)
    assert error.get("code") == "PROCESSING_ERROR" and "MemoryError" in error["message"], error
    clock.advance(3600)
    for _ in range(3):  # delegate again, run the child, aggregate
        Daemon(engine, workers=1, watch=False).run_batch()
    assert engine.get(hid)[0] is State.COMPLETED, _events(engine, hid)


def test_claims_given_up_unrun_are_handed_back_free_only_so_many_times_in_a_row(
        tmp_path: Path) -> None:
    """R42: a mark is an empty folder anyone who can read the lease token can make, and each
    one made a recovery free: a handler ending its own daemon at every start, marked so, was
    handed back for ever, uncharged. Bounded as start shortages are (FREE_SHORTAGES)."""
    from handoffd.service.handbacks import FREE_SHORTAGES
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@py": lambda doc, ctx: {}})
    hid = engine.submit(new_native_request(source="@test", target="@py", data={}, now=clock()))
    for _ in range(FREE_SHORTAGES + 1):
        job = engine.take(hid)
        assert job is not None
        backend.abandon_unrun(job.claim)
        clock.advance(engine.settings.lease_seconds + 1)
        assert sweep(engine).recovered == [hid]
    state, stored = engine.get(hid)
    events = book(stored)["history"]
    freed = [e for e in events if e["event"] == "handed_back"
             and (e.get("detail") or {}).get("not_started") == "GIVEN_UP"]
    assert len(freed) == FREE_SHORTAGES, [e["event"] for e in events]
    assert events[-1]["event"] != "handed_back" or \
        events[-1].get("detail", {}).get("not_started") != "GIVEN_UP", events[-1]
