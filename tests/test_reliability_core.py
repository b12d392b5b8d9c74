"""Issue 9 regressions in the core: hostile bookkeeping, unbounded numbers, recovery that one bad
document must not wedge, leases judged with clock steps and shared filesystems in mind."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, reason_codes
from test_core import FakeClock, make_engine, run_job, submit

from handoffd.backends.files import fsio
from handoffd.core.documents import book
from handoffd.core.errors import DocumentNotReady
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.workspace import network_filesystem
from handoffd.backends.files.backend import CLOCK_TOLERANCE_SECONDS
from handoffd.service.sweeper import sweep


def ok(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"ok": True}}


def native(hid: str, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "target": {"agent_id": "@flaky"},
                           "input": {"data": {"mode": "ok"}}}
    doc.update(extra)
    return doc


# ------------------------------------------------------------------ forged bookkeeping (item 4)
def test_forged_revision_never_destroys_a_finished_result(ws: Workspace) -> None:
    hid = ws.create("--to", "@flaky", "--id", "victim", "--data", '{"mode": "ok"}')
    assert ws.handoffd("run").returncode == 0
    finished = (ws.root / "handoffs" / "completed" / "victim.json").read_bytes()
    forged = native(hid, input={"data": {"mode": "fail"}},
                    handoffd={"revision": 99, "attempt": 1, "history": []})
    ws.drop("victim.json", forged)
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr
    assert (ws.root / "handoffs" / "completed" / "victim.json").read_bytes() == finished
    assert ws.state_of("victim") == ["completed"]
    assert "DUPLICATE_HANDOFF_ID" in reason_codes(ws.root).values()
    assert [r["id"] for r in ws.runs()] == ["victim"]  # the forged input never ran


def test_forged_revision_beside_a_failed_result_is_a_duplicate(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "failed", "error": {
        "code": "PROCESSING_ERROR", "message": "no", "retryable": False}})
    hid = submit(engine)
    job = engine.take(hid)
    assert job is not None and run_job(engine, job) is State.FAILED
    failed = engine.backend.store.path(State.FAILED, hid).read_bytes()
    forged = json.loads(failed)
    forged["handoffd"]["revision"] = 99  # the seal no longer matches: untrusted
    forged["status"] = "pending"
    (engine.backend.store.path(State.PENDING, hid)).write_text(json.dumps(forged))
    assert engine.backend.store.get(hid)[0] is State.FAILED
    assert engine.take(hid) is None
    assert engine.backend.store.locate(hid) == [State.FAILED]
    assert engine.backend.store.path(State.FAILED, hid).read_bytes() == failed


def test_raw_documents_lose_their_foreign_bookkeeping(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, ok)
    doc = new_native_request(source="@t", target="@py", data=None, now=engine.clock(),
                             handoff_id="poisoned")
    doc["handoffd"] = {"attempt": "abc", "history": "x", "revision": "7", "retries": 1e30,
                       "lease": {"token": 5}, "next_attempt_at": "never"}
    (engine.backend.store.path(State.PENDING, "poisoned")).write_text(json.dumps(doc))
    job = engine.take("poisoned")
    assert job is not None and job.claim.attempt == 1
    assert run_job(engine, job) is State.COMPLETED
    filed = engine.backend.store.read(State.COMPLETED, "poisoned")
    assert [e["event"] for e in book(filed)["history"]] == ["claimed", "completed"]


def test_create_discards_a_submitted_handoffd_block(ws: Workspace, tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(native("withbook", handoffd={"revision": 50, "attempt": "x"})))
    assert ws.create("--file", str(path)) == "withbook"
    block = json.loads((ws.root / "handoffs" / "pending" / "withbook.json").read_text())["handoffd"]
    assert block["revision"] == 1 and "attempt" not in block


# ------------------------------------------------------------------ numbers and types (item 3)
BAD_NUMBERS = {
    "delay": ({"retry_policy": {"retry_delay_seconds": 1e12}}, "SCHEMA_VALIDATION_FAILED"),
    "timeout": ({"timeout_seconds": 1e300}, "SCHEMA_VALIDATION_FAILED"),
    "negative-retries": ({"retry_policy": {"max_retries": -1}}, "SCHEMA_VALIDATION_FAILED"),
    "deps": ({"depends_on": [f"d{i}" for i in range(1001)]}, "SCHEMA_VALIDATION_FAILED"),
}


@pytest.mark.parametrize("name", sorted(BAD_NUMBERS))
def test_unbounded_numbers_are_refused_at_admission(ws: Workspace, name: str) -> None:
    extra, code = BAD_NUMBERS[name]
    ws.drop(f"{name}.json", native(name, **extra))
    ws.create("--to", "@flaky", "--id", "control", "--data", '{"mode": "ok"}')
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr
    assert ws.state_of(name) == ["failed"]
    assert ws.doc(name)["error"]["code"] == code
    assert ws.state_of("control") == ["completed"]


@pytest.mark.parametrize("token", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_numbers_are_not_json(ws: Workspace, token: str) -> None:
    ws.drop("inf.json", '{"handoff_id": "inf", "target": {"agent_id": "@flaky"}, '
                        f'"timeout_seconds": {token}}}')
    ws.handoffd("run")
    assert ws.state_of("inf") == ["failed"]  # a stub failure under the id, the file set aside
    assert reason_codes(ws.root) == {"inf.json": "MALFORMED_JSON"}
    for folder in ("completed", "failed"):
        for path in (ws.root / "handoffs" / folder).glob("*.json"):
            json.loads(path.read_text(), parse_constant=lambda t: pytest.fail(f"{t} in {path}"))


def test_create_refuses_unbounded_numbers(ws: Workspace, tmp_path: Path) -> None:
    proc = ws.handoff("create", "--to", "@flaky", "--timeout-seconds", "1e300")
    assert proc.returncode == 2 and "timeout" in proc.stderr and "Traceback" not in proc.stderr
    for text in ('{"handoff_id": "a", "target": {"agent_id": "@x"}, "timeout_seconds": Infinity}',
                 json.dumps(native("b", retry_policy={"retry_delay_seconds": 1e12}))):
        path = tmp_path / "doc.json"
        path.write_text(text)
        proc = ws.handoff("create", "--file", str(path))
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not list((ws.root / "handoffs" / "pending").glob("*.json"))


def test_deeply_nested_documents_are_set_aside(ws: Workspace) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"p": schema}}
    ws.drop("deep.json", native("deep", expected_output_schema=schema))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 1)
    assert reason_codes(ws.root) == {"deep.json": "DOCUMENT_TOO_DEEP"}


def test_retry_delay_never_overflows(tmp_path: Path) -> None:
    engine = make_engine(tmp_path, lambda h, c: {"status": "failed"},
                         retry={"max_retries": 900, "retry_delay_seconds": 86400,
                                "backoff_multiplier": 100})
    hid = submit(engine)
    for _ in range(3):
        job = engine.take(hid)
        assert job is not None and run_job(engine, job) is State.PENDING
        engine.clock.advance(8 * 86400)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ recovery isolation (item 3)
def test_one_poisoned_claim_never_wedges_recovery(tmp_path: Path, dead_owner_marks: None) -> None:
    clock = FakeClock()
    engine = make_engine(tmp_path, ok, clock)
    engine.backend.claim_grace_seconds = 0.0
    abandoned = [submit(engine) for _ in range(4)]
    claims = [engine.backend.store.claim(h, lease_seconds=30, now=clock.now) for h in abandoned]
    assert all(claim is not None for claim in claims)
    engine.backend.store.close()  # their owner died: the kernel freed its lock
    for name, block in {"p-attempt": {"attempt": "abc"}, "p-history": {"history": "x"},
                        "p-lease": {"lease": {"token": "t", "owner": "me", "expires_at": 5}}}.items():
        doc = new_native_request(source="@t", target="@py", data=None, now=clock.now,
                                 handoff_id=name, timeout_seconds=10)
        doc["handoffd"] = block
        engine.backend.store.path(State.IN_PROGRESS, name).write_text(json.dumps(doc))
    report = sweep(engine)
    assert sorted(report.recovered) == sorted(abandoned + ["p-attempt", "p-history", "p-lease"])
    for hid in abandoned:
        assert engine.backend.store.locate(hid) == [State.PENDING]
    for name in ("p-attempt", "p-history", "p-lease"):  # back as they came, raw, to be admitted
        assert engine.backend.store.locate(name) == [State.PENDING]
        job = engine.take(name)
        assert job is not None and run_job(engine, job) is State.COMPLETED


def test_a_failing_repair_step_is_logged_and_the_sweep_goes_on(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch, dead_owner_marks: None) -> None:
    engine = make_engine(tmp_path, ok)
    hid = submit(engine)
    claim = engine.backend.store.claim(hid, lease_seconds=30, now=engine.clock())
    assert claim is not None
    engine.backend.store.close()  # the owner died: the kernel freed its lock
    from handoffd.backends.files import repair

    def broken(*args: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(repair, "resolve_duplicates", broken)
    report = sweep(engine)
    assert report.recovered == [hid]
    assert "resolving duplicate copies failed" in caplog.text


# ------------------------------------------------------------------ leases and clocks (items 5, 6)
def test_a_sweeper_whose_clock_is_ahead_never_takes_a_live_claim(tmp_path: Path) -> None:
    owner = make_engine(tmp_path, ok)
    hid = submit(owner)
    job = owner.take(hid)
    assert job is not None
    ahead = FakeClock()
    ahead.now = owner.clock() + timedelta(seconds=120)
    sweeper_engine = make_engine(tmp_path, ok, ahead)
    sweeper_engine.ws.ensure()
    for _ in range(5):
        assert sweep(sweeper_engine).recovered == []  # watched on a clock that does not step
    assert run_job(owner, job) is State.COMPLETED


def test_a_stalled_owner_on_this_host_is_recovered_after_a_watched_lease(tmp_path: Path) -> None:
    clock = FakeClock()
    engine = make_engine(tmp_path, ok, clock)
    hid = submit(engine)
    claim = engine.backend.store.claim(hid, lease_seconds=30, now=clock.now)
    assert claim is not None
    clock.advance(40)
    assert sweep(engine).recovered == []  # expired, but not yet watched for a lease period
    clock.advance(31)
    assert sweep(engine).recovered == [hid]
    assert engine.backend.store.finish(claim, State.COMPLETED, claim.doc) is False


def _foreign_lease(engine: Any, hid: str, clock: FakeClock) -> None:
    """Make the in-progress claim of ``hid`` look owned by another host (no lock here)."""
    path = engine.backend.store.path(State.IN_PROGRESS, hid)
    doc = json.loads(path.read_text())
    doc["handoffd"]["lease"]["owner"] = {"host": "other-host.example", "pid": 1}
    path.write_bytes(engine.backend.store.encode(doc, State.IN_PROGRESS, hid))


def test_claims_of_another_host_count_only_by_lease_expiry(tmp_path: Path) -> None:
    clock = FakeClock()
    engine = make_engine(tmp_path, ok, clock)
    hid = submit(engine)
    claim = engine.backend.store.claim(hid, lease_seconds=30, now=clock.now)
    assert claim is not None
    engine.backend.store.close()  # a free lock here proves nothing about another host
    _foreign_lease(engine, hid, clock)
    assert sweep(engine).recovered == []
    clock.advance(30 + CLOCK_TOLERANCE_SECONDS / 2)
    assert sweep(engine).recovered == []  # within the clock tolerance
    clock.advance(CLOCK_TOLERANCE_SECONDS)
    assert sweep(engine).recovered == [hid]


def test_rename_noreplace_fallback_when_the_filesystem_says_einval(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def einval(*args: Any) -> int:  # what renameat2 returns on an NFS client
        calls.append(args)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(fsio, "_renameat2", einval)
    engine = make_engine(tmp_path, ok)
    ids = [submit(engine) for _ in range(20)]
    won: list[str] = []

    def claimer() -> None:
        for hid in ids:
            for _ in range(200):  # as the daemon does: a move in progress is looked at again
                try:
                    claim = engine.backend.store.claim(hid, lease_seconds=30)
                except DocumentNotReady:  # the other claimer's link + unlink is half done
                    time.sleep(0.005)
                    continue
                if claim is not None:
                    won.append(hid)
                break

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert calls and sorted(won) == sorted(ids)  # each claimed exactly once
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("a")
    b.write_text("b")
    with pytest.raises(FileExistsError):
        fsio.rename_noreplace(a, b)
    assert b.read_text() == "b" and a.exists()


def test_network_filesystems_are_recognised(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("server:/export /mnt/shared nfs4 rw 0 0\n"
                      "/dev/sda1 / ext4 rw 0 0\n"
                      "//box/share /mnt/smb cifs rw 0 0\n")
    assert network_filesystem(Path("/mnt/shared/ws"), mounts) == "nfs4"
    assert network_filesystem(Path("/mnt/smb"), mounts) == "cifs"
    assert network_filesystem(Path("/home/ws"), mounts) is None
    assert network_filesystem(Path("/x"), tmp_path / "absent") is None


def test_daemon_warns_when_the_workspace_is_on_a_network_filesystem(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from handoffd.cli.daemon_commands import warn_if_shared
    with caplog.at_level("WARNING", logger="handoffd"):
        warn_if_shared(tmp_path, lambda path: "nfs4")
    assert "network filesystem (nfs4)" in caplog.text and "lease" in caplog.text
    caplog.clear()
    warn_if_shared(tmp_path, lambda path: None)
    assert caplog.text == ""


def _nobody_can_run_handoffd() -> bool:
    if os.geteuid() != 0 or not shutil.which("runuser"):
        return False
    probe = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "import handoffd"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def test_a_file_the_daemon_cannot_read_is_set_aside(tmp_path: Path) -> None:
    """Mode 000 in pending/ with a daemon that lacks CAP_DAC_OVERRIDE (run as nobody): the file
    is set aside as UNREADABLE_FILE, the other handoff completes, `handoff ls` still works."""
    if not _nobody_can_run_handoffd():
        pytest.skip("needs root, runuser and a handoffd the nobody user can import")
    from conftest import FLAKY_TOML, exe
    base = Path("/tmp") / f"handoffd-nobody-{os.getpid()}-{tmp_path.name}"
    base.mkdir(mode=0o777)
    try:
        os.chmod(base, 0o777)
        (base / "handoffd.toml").write_text(FLAKY_TOML)
        for sub in ("pending", "in-progress", "completed", "failed"):
            (base / "handoffs" / sub).mkdir(parents=True)
        (base / "handoffs" / "pending" / "fine.json").write_text(json.dumps(native("fine")))
        locked = base / "handoffs" / "pending" / "locked.json"
        locked.write_text(json.dumps(native("locked")))
        for path in [base, *base.rglob("*")]:
            os.chmod(path, 0o777 if path.is_dir() else 0o666)
        os.chmod(locked, 0)
        as_nobody = ["runuser", "-u", "nobody", "--"]
        run = subprocess.run([*as_nobody, exe("handoffd"), "run", "--root", str(base)],
                             capture_output=True, text=True, timeout=120)
        assert "Traceback" not in run.stderr and run.returncode in (0, 1), run.stderr
        assert (base / "handoffs" / "completed" / "fine.json").exists()
        assert "UNREADABLE_FILE" in reason_codes(base).values()
        listing = subprocess.run([*as_nobody, exe("handoff"), "ls", "--root", str(base)],
                                 capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0 and "fine" in listing.stdout, listing.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("output", [float("nan"), float("inf"), "lone \ud800 surrogate",
                                    {"set": {1, 2}}], ids=["nan", "inf", "surrogate", "set"])
def test_a_result_that_is_not_strict_json_fails_the_attempt(tmp_path: Path, output: Any) -> None:
    """A handler result that cannot be written as UTF-8 JSON fails that handoff with
    PROCESSING_ERROR; it must never leave the claim stuck in in-progress/."""
    engine = make_engine(tmp_path, lambda h, c: {"status": "completed", "output": {"x": output}})
    hid = submit(engine)
    job = engine.take(hid)
    assert job is not None and run_job(engine, job) is State.FAILED
    doc = engine.backend.store.read(State.FAILED, hid)
    assert doc["error"]["code"] == "PROCESSING_ERROR" and "cannot be filed" in doc["error"]["message"]


def test_a_command_printing_nan_or_a_lone_surrogate_fails_cleanly(ws: Workspace, tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import sys\n"
                      "sys.stdout.write('{\"status\": \"completed\", \"output\": {\"a\": NaN}}' "
                      "if sys.argv[1] == 'nan' else "
                      "'{\"status\": \"completed\", \"output\": {\"a\": \"\\\\ud800\"}}')\n")
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text() +
                    f'\n[specialists."@nan"]\ncommand = ["{sys.executable}", "{script}", "nan"]\n'
                    f'\n[specialists."@sur"]\ncommand = ["{sys.executable}", "{script}", "sur"]\n')
    a = ws.create("--to", "@nan")
    b = ws.create("--to", "@sur")
    proc = ws.handoffd("run")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    for hid in (a, b):
        assert ws.state_of(hid) == ["failed"]
        assert ws.doc(hid)["error"]["code"] == "PROCESSING_ERROR"


def test_sweep_prunes_process_records_of_dead_attempts(tmp_path: Path) -> None:
    from handoffd.core import procrecords, procs
    engine = make_engine(tmp_path, ok)
    dead = procrecords.RunRecord.new("gone", procs.new_token(), 1)
    dead.daemon_pid = 2**22 + 7  # no such process: its daemon died
    procrecords.write_record(engine.ws.root, dead)
    live = procrecords.RunRecord.new("running", procs.new_token(), 1)  # our own pid: a live daemon
    procrecords.write_record(engine.ws.root, live)
    sweep(engine)
    assert procrecords.read_record(engine.ws.root, "gone") is None
    assert procrecords.read_record(engine.ws.root, "running") is not None
