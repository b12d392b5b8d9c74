"""The real `handoffd serve` / `handoffd run` processes against temporary workspaces."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import Workspace

from handoffd.core.validation import load_builtin

FORMAT = jsonschema.FormatChecker()


def native_request(hid: str, data: Any, **extra: Any) -> dict[str, Any]:
    doc = {"handoff_id": hid, "timestamp": "2026-01-13T10:00:00Z", "status": "pending",
           "source": {"agent_id": "@orchestrator", "phase": 11, "agent_type": "orchestrator"},
           "target": {"agent_id": "@flaky", "phase": 13, "agent_type": "specialist"},
           "input": {"data": data}}
    doc.update(extra)
    return doc


def assert_valid_filed(ws: Workspace) -> int:
    """Every document in completed/ and failed/ validates against its shipped schema."""
    count = 0
    for state, name in (("completed", "native.response.schema.json"),
                        ("failed", "native.failure.schema.json")):
        schema = load_builtin(name)
        for path in (ws.root / "handoffs" / state).glob("*.json"):
            doc = json.loads(path.read_text())
            if doc.get("handoffd", {}).get("dialect", "native") != "native":
                continue
            errors = list(jsonschema.Draft202012Validator(schema, format_checker=FORMAT).iter_errors(doc))
            assert not errors, f"{path.name}: {[e.message for e in errors]}"
            count += 1
    return count


def test_foreign_producer_file_is_claimed_and_filed(ws: Workspace) -> None:
    daemon = ws.serve()
    ws.drop("hoff-raw-1.json", native_request("hoff-raw-1", {"mode": "ok", "n": 1}))
    assert ws.wait_state("hoff-raw-1") == "completed"
    doc = ws.doc("hoff-raw-1")
    assert doc["status"] == "completed" and doc["output"]["echo"]["n"] == 1
    assert [e["event"] for e in doc["handoffd"]["history"]] == ["claimed", "completed"]
    assert ws.stop(daemon) == 0
    assert assert_valid_filed(ws) == 1


def test_half_written_foreign_file_is_not_read_early(ws: Workspace) -> None:
    """A producer writing straight into pending/ (no temp file) with a pause mid-write."""
    daemon = ws.serve()
    body = json.dumps(native_request("hoff-slow", {"mode": "ok"})).encode()
    path = ws.root / "handoffs" / "pending" / "hoff-slow.json"
    with open(path, "wb") as fh:
        fh.write(body[:20])
        fh.flush()
        time.sleep(0.1)  # shorter than settle_seconds (0.2)
        fh.write(body[20:])
    assert ws.wait_state("hoff-slow") == "completed"
    assert not list((ws.root / "handoffs" / ".quarantine").glob("*"))
    ws.stop(daemon)


def test_pickup_is_event_driven(ws: Workspace) -> None:
    """With rescans an hour apart, only a filesystem event can get a new handoff picked up."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text()
                    .replace("rescan_seconds = 1.0", "rescan_seconds = 3600.0")
                    .replace("sweep_seconds = 0.5", "sweep_seconds = 3600.0"))
    daemon = ws.serve()  # its start-up scan is over before anything exists
    started = time.monotonic()
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    assert ws.wait_state(hid) == "completed"
    print(f"create -> pickup -> run -> file: {time.monotonic() - started:.3f}s")
    ws.stop(daemon)


def test_failure_retries_then_fails_with_seed_fields(ws: Workspace) -> None:
    daemon = ws.serve()
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "fail", "message": "upstream 503"}')
    assert ws.wait_state(hid, ("failed",)) == "failed"
    doc = ws.doc(hid)
    assert doc["status"] == "failed" and doc["error"]["code"] == "PROCESSING_ERROR"
    assert "upstream 503" in doc["error"]["message"]
    assert doc["retry_count"] == 2 and doc["max_retries"] == 2 and len(ws.runs()) == 3
    events = [e["event"] for e in doc["handoffd"]["history"]]
    assert events.count("retry_scheduled") == 2 and events[-1] == "failed"
    ws.stop(daemon)
    assert_valid_filed(ws)


@pytest.mark.parametrize("mode,needle", [
    ("garbage", "not JSON"),
    ("crash", "exited with status 3"),
    ("empty", "without printing a result"),
])
def test_bad_handler_output_is_a_processing_error(ws: Workspace, mode: str, needle: str) -> None:
    ws.drop(f"h-{mode}.json", native_request(f"h-{mode}", {"mode": mode}, retry_policy={"max_retries": 0}))
    proc = ws.handoffd("run")
    assert proc.returncode == 1, proc.stderr
    doc = ws.doc(f"h-{mode}")
    assert doc["error"]["code"] == "PROCESSING_ERROR" and needle in doc["error"]["message"]
    assert_valid_filed(ws)


def test_huge_stdout_is_cut_off(ws: Workspace) -> None:
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text().replace(
        "[retry]", "max_output_bytes = 1048576\n\n[retry]"))
    ws.drop("h-huge.json", native_request("h-huge", {"mode": "huge", "seconds": 64},
                                          retry_policy={"max_retries": 0}))
    proc = ws.handoffd("run", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "more than 1048576 bytes" in ws.doc("h-huge")["error"]["message"]


def test_hung_handler_is_killed_at_its_timeout_and_daemon_goes_on(ws: Workspace) -> None:
    daemon = ws.serve()
    slow = ws.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 60}', "--timeout-seconds", "1")
    quick = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    assert ws.wait_state(quick) == "completed"
    # TIMEOUT is retryable: 3 attempts of 1 s each, then failed
    assert ws.wait_state(slow, ("failed",), timeout=40) == "failed"
    doc = ws.doc(slow)
    assert doc["error"]["code"] == "TIMEOUT" and doc["retry_count"] == 2
    pids = [r["pid"] for r in ws.runs() if r["id"] == slow]
    assert len(pids) == 3
    for pid in pids:  # every timed-out handler process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    ws.stop(daemon)


def test_invalid_input_never_reaches_handler(ws: Workspace) -> None:
    (ws.root / "schemas").mkdir(exist_ok=True)
    (ws.root / "schemas" / "flaky.input.schema.json").write_text(json.dumps({
        "type": "object", "required": ["mode"],
        "properties": {"mode": {"enum": ["ok", "fail"]}, "n": {"type": "integer"}}}))
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text().replace(
        "timeout_seconds = 20", 'timeout_seconds = 20\ninput_schema = "flaky.input.schema.json"'))
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "explode", "n": "x"}')
    proc = ws.handoffd("run")
    assert proc.returncode == 1
    doc = ws.doc(hid)
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED" and doc["retry_available"] is False
    fields = sorted(e["field"] for e in doc["validation"]["errors"])
    assert fields == ["mode", "n"] and ws.runs() == []
    assert_valid_filed(ws)


def test_no_specialist_stays_visible(ws: Workspace) -> None:
    hid = ws.create("--to", "@nobody", "--data", "{}")
    proc = ws.handoffd("run", "-v")  # a batch mentions it only when asked (cron mails output)
    assert proc.returncode == 0 and "no specialist" in proc.stderr
    assert ws.state_of(hid) == ["pending"]
    rows = json.loads(ws.handoff("ls", "--json").stdout)
    assert rows[0]["note"] == "waiting: no specialist registered for @nobody"


def test_run_batch_processes_everything_due(ws: Workspace) -> None:
    ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok", "i": i})) for i in range(8)]
    bad = ws.create("--to", "@flaky", "--data", '{"mode": "permanent"}')
    proc = ws.handoffd("run")
    assert proc.returncode == 1 and "completed 8, failed 1" in proc.stderr
    assert all(ws.state_of(i) == ["completed"] for i in ids) and ws.state_of(bad) == ["failed"]
    again = ws.handoffd("run")
    assert (again.returncode, again.stderr) == (0, "")  # nothing to do, nothing said


def test_sigterm_lets_inflight_work_finish(ws: Workspace) -> None:
    daemon = ws.serve()
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 1}')
    ws.wait_started(hid)
    assert ws.stop(daemon) == 0
    assert ws.state_of(hid) == ["completed"]


def test_second_sigterm_hands_work_back(ws: Workspace) -> None:
    daemon = ws.serve()
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 60}')
    ws.wait_started(hid)
    daemon.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    started = time.monotonic()
    assert ws.stop(daemon) == 0
    assert time.monotonic() - started < 10
    assert ws.state_of(hid) == ["pending"]
    doc = ws.doc(hid)
    assert doc["handoffd"]["history"][-1]["event"] == "handed_back"
    assert doc["handoffd"]["attempt"] == 0 and doc["status"] == "pending"


def test_serve_creates_missing_folders(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "fresh")
    ws.root.mkdir()
    daemon = ws.serve()
    for name in ("pending", "in-progress", "completed", "failed"):
        assert (ws.root / "handoffs" / name).is_dir()
    for name in ("artifacts", "context", "schemas"):
        assert (ws.root / name).is_dir()
    assert ws.stop(daemon) == 0
    ws.cleanup()
