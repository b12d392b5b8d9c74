"""Seed 001's expectations of a request, through a real daemon: `expected_output.schema` checks
the output (VALIDATION_FAILED), a schema the request names must exist (SCHEMA_VALIDATION_FAILED,
before anything runs), `expected_output.destination` must end with an output artifact, and
`handoff wait` says why a handoff failed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import Workspace

ECHO_SCHEMA = {"type": "object", "required": ["echo"]}
STRICT_SCHEMA = {"type": "object", "required": ["summary"]}


SEED_EXAMPLE = Path(__file__).parent.parent / "examples" / "requests" / "react-userprofile.json"


def submit(ws: Workspace, hid: str, **extra: Any) -> str:
    """Seed 001's own example request, sent to the test specialist with only ``extra``'s
    expectations (its input.schema / expected_output are replaced)."""
    doc = json.loads(SEED_EXAMPLE.read_text())
    doc.update(handoff_id=hid, target={"agent_id": "@flaky"}, input={"data": {"mode": "ok"}})
    doc.pop("expected_output", None)
    for key, value in extra.items():
        if key == "input_schema":
            doc["input"]["schema"] = value
        else:
            doc[key] = value
    path = ws.root / f"{hid}.request.json"
    path.write_text(json.dumps(doc))
    return ws.create("--file", str(path))


def error_of(ws: Workspace, hid: str) -> dict[str, Any]:
    return ws.doc(hid)["error"]


def test_expected_output_schema_checks_the_output(ws: Workspace) -> None:
    (ws.root / "schemas" / "echo.schema.json").write_text(json.dumps(ECHO_SCHEMA))
    (ws.root / "schemas" / "strict.schema.json").write_text(json.dumps(STRICT_SCHEMA))
    submit(ws, "out-ok", expected_output={"schema": "echo.schema.json"})
    submit(ws, "out-bad", expected_output={"schema": "strict.schema.json"})
    ws.handoffd("run")
    assert ws.state_of("out-ok") == ["completed"]
    assert ws.state_of("out-bad") == ["failed"]
    error = error_of(ws, "out-bad")
    assert error["code"] == "VALIDATION_FAILED" and "summary" in json.dumps(error)
    assert len([r for r in ws.runs() if r["id"] == "out-bad"]) == 1  # not retried


def test_a_named_schema_that_does_not_exist_fails_before_running(ws: Workspace) -> None:
    submit(ws, "in-missing", input_schema="nowhere.input.schema.json")
    submit(ws, "out-missing", expected_output={"schema": "nowhere.output.schema.json"})
    ws.handoffd("run")
    for hid, field in (("in-missing", "input.schema"), ("out-missing", "expected_output.schema")):
        error = error_of(ws, hid)
        assert error["code"] == "SCHEMA_VALIDATION_FAILED", error
        assert field in error["message"] and "nowhere" in error["message"]
    assert ws.runs() == []  # the specialist never ran


def test_a_destination_needs_an_output_artifact(ws: Workspace) -> None:
    submit(ws, "no-artifact", expected_output={"destination": "artifacts/out/{handoff_id}.json"})
    ws.handoffd("run")
    error = error_of(ws, "no-artifact")
    assert error["code"] == "VALIDATION_FAILED" and "destination" in error["message"]
    assert not (ws.root / "artifacts" / "out" / "no-artifact.json").exists()


def test_wait_says_why_it_failed(ws: Workspace) -> None:
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent",
                                                             "message": "the disk is on fire"}))
    ws.handoffd("run")
    proc = ws.handoff("wait", hid)
    assert proc.returncode == 1 and proc.stdout == f"{hid} failed\n"
    assert proc.stderr.startswith(f"handoff: {hid}: PROCESSING_ERROR: ") and "fire" in proc.stderr


def test_advisory_expectations_file_the_result_with_warnings(ws: Workspace) -> None:
    """`[daemon] expectations = "advisory"`: the seed's own request, with its schemas absent and
    no artifact produced, completes, and every unmet expectation is a warning of the result."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text()
                    .replace("[daemon]", '[daemon]\nexpectations = "advisory"'))
    doc = json.loads(SEED_EXAMPLE.read_text())  # input.schema, expected_output as the seed has
    doc.update(handoff_id="advisory-1", target={"agent_id": "@flaky"})
    doc["input"]["data"] = {"mode": "ok"}
    path = ws.root / "advisory.json"
    for hid in ("advisory-1", "advisory-2"):
        path.write_text(json.dumps(dict(doc, handoff_id=hid)))
        ws.create("--file", str(path))
    proc = ws.handoffd("run")
    for hid in ("advisory-1", "advisory-2"):
        answer = ws.doc(hid)
        assert answer["status"] == "completed", answer.get("error")
        warnings = "\n".join(answer["warnings"])
        assert warnings.count("SCHEMA_VALIDATION_FAILED") == 2  # input.schema, expected_output.schema
        assert f"VALIDATION_FAILED: handoff {hid}: expected_output.destination" in warnings
    # the log says each kind of unmet expectation once, not once per handoff (cron mails it)
    assert proc.stderr.count("input.schema names") == 1, proc.stderr
    assert proc.stderr.count("expected_output.schema names") == 1, proc.stderr
    bad = ws.root / "handoffd.toml"
    bad.write_text(bad.read_text().replace('"advisory"', '"sometimes"'))
    assert ws.handoffd("run").returncode == 2
