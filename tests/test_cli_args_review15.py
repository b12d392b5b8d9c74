"""Review 15's command-line defects: a bad argument value is exit 2, one line, refused before
anything is written (a handoff created, a claim taken, a record stored), and `handoff validate`
says "invalid" for what the daemon would fail before running it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import SPECIALISTS, Workspace, exe, new_workspace
from test_cli_hostile import pending, refused

FULL = {**os.environ, "HANDOFFD_FULL_CLI": "1"}
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}
ENVS = pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
BAD = "\udcff"  # the byte 0xff on the command line or in the environment (surrogateescape)


def run(program: str, root: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe(program), *args, "--root", str(root)], capture_output=True,
                          text=True, timeout=timeout, env=env or QUICK)


# ------------------------------------------------------------------ cancel --reason
def test_cancel_with_a_reason_that_is_not_utf8_claims_nothing(ws: Workspace) -> None:
    hid = ws.create("--to", "@nobody")
    proc = run("handoff", ws.root, "cancel", hid, "--reason", f"bad{BAD}reason", env=FULL)
    refused(proc, "--reason", "not UTF-8")
    assert ws.state_of(hid) == ["pending"]  # not claimed, not filed
    assert list((ws.root / "handoffs" / "in-progress").iterdir()) == []
    done = run("handoff", ws.root, "cancel", hid, "--reason", "a good one")
    assert done.returncode == 0 and ws.state_of(hid) == ["failed"], done.stderr


# ------------------------------------------------------------------ create --wait-timeout
@ENVS
@pytest.mark.parametrize("seconds", ["nan", "-1", "inf", "-inf", "1e400"])
def test_a_bad_wait_timeout_creates_nothing(ws: Workspace, env: dict[str, str],
                                            seconds: str) -> None:
    """It was checked by the wait, after the submit: the id printed, then exit 2, and a script
    retrying on exit 2 made a duplicate each time."""
    proc = run("handoff", ws.root, "create", "--to", "@nobody", "--wait",
               f"--wait-timeout={seconds}", env=env)
    refused(proc, "--wait-timeout", "0 or more")
    assert pending(ws) == []


@ENVS
def test_a_good_wait_timeout_still_waits(ws: Workspace, env: dict[str, str]) -> None:
    proc = run("handoff", ws.root, "create", "--to", "@nobody", "--wait", "--wait-timeout",
               "0.2", env=env)
    assert proc.returncode == 124, proc.stderr
    assert pending(ws) == [f"{proc.stdout.strip()}.json"]


# ------------------------------------------------------------------ create --file --expires-after
HAIOS = {"handoff_id": "6f1c2a9e-3b4d-4c5e-9f7a-8b9c0d1e2f3a", "from_agent": "interpreter-v1",
         "to_agent": "ingester-v1", "created_at": "2025-12-02T21:55:34Z",
         "payload": {"directive": {"action": "ingest", "type": "episteme"},
                     "context": {"confidence": 0.85}, "original_input": "Store this"},
         "expected_output_schema": None, "timeout_ms": 30000, "status": "pending"}
AGENT_HANDOFF = {"handoff_id": "a1b2c3d4-e5f6-7890-abcd-ef1234567890",
                 "conversation_id": "conv-1", "from_agent": "code-generator",
                 "to_agent": "code-quality-reviewer", "status": "success",
                 "timestamp": "2026-01-15T10:30:00Z",
                 "context": {"objective": "Implement it"},
                 "results": {"summary": "done"},
                 "action_required": {"task": "Review", "priority": "high"}}


@ENVS
@pytest.mark.parametrize("doc", [HAIOS, AGENT_HANDOFF], ids=["haios", "agent_handoff"])
def test_expires_after_is_refused_for_a_format_that_never_reads_it(
        ws: Workspace, tmp_path: Path, env: dict[str, str], doc: dict[str, Any]) -> None:
    """Both have a handoff_id, which was taken for "native": written with an expires_at that
    only native requests honour, they never expired."""
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    proc = run("handoff", ws.root, "create", "--file", str(path), "--expires-after", "1s",
               env=env)
    refused(proc, "--expires-after", "native")
    assert pending(ws) == []
    made = run("handoff", ws.root, "create", "--file", str(path), env=env)  # without: accepted
    assert made.returncode == 0 and made.stdout.strip() == doc["handoff_id"], made.stderr


def test_expires_after_still_applies_to_a_native_file(ws: Workspace, tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({"handoff_id": "n1", "timestamp": "2026-11-26T10:00:00Z",
                                "status": "pending", "source": {"agent_id": "@cli"},
                                "target": {"agent_id": "@nobody"}, "input": {"data": {}}}))
    proc = run("handoff", ws.root, "create", "--file", str(path), "--expires-after", "1h")
    assert proc.returncode == 0 and proc.stdout.strip() == "n1", proc.stderr
    assert "expires_at" in ws.doc("n1")


# ------------------------------------------------------------------ context set and $HANDOFF_ID
@pytest.mark.parametrize("given", [BAD, "a" * 100_000, "../x", "has space"],
                         ids=["not-utf8", "100kB", "path", "space"])
def test_context_set_refuses_a_handoff_id_no_handoff_can_have(ws: Workspace,
                                                              given: str) -> None:
    proc = run("handoff", ws.root, "context", "set", "hid/a", "1",
               env={**QUICK, "HANDOFF_ID": given})
    refused(proc, "$HANDOFF_ID", "not a safe file name")
    assert not (ws.root / "context" / "hid").exists()
    assert json.loads(run("handoff", ws.root, "context", "history", "--json").stdout) == []


def test_context_set_records_a_good_handoff_id_and_none_for_an_empty_one(ws: Workspace) -> None:
    assert run("handoff", ws.root, "context", "set", "hid/a", "1",
               env={**QUICK, "HANDOFF_ID": ""}).returncode == 0
    assert run("handoff", ws.root, "context", "set", "hid/a", "2",
               env={**QUICK, "HANDOFF_ID": "hoff-1"}).returncode == 0
    history = json.loads(run("handoff", ws.root, "context", "history", "--json").stdout)
    assert [item.get("handoff_id") for item in history] == [None, "hoff-1"]


# ------------------------------------------------------------------ pause, resume, db --store
@pytest.mark.parametrize("args, what", [
    (("pause", BAD), "AGENT"),
    (("pause", "@ask", "--reason", BAD), "--reason"),
    (("pause", "@ask", "--as", BAD), "--as"),
    (("resume", BAD), "AGENT"),
])
def test_pause_arguments_that_are_not_utf8_store_nothing(ws: Workspace, args: tuple[str, ...],
                                                         what: str) -> None:
    refused(run("handoff", ws.root, *args), what, "not UTF-8")
    assert not (ws.root / "handoffs" / ".meta" / "paused.json").exists()
    assert json.loads(run("handoff", ws.root, "paused", "--json").stdout) == {}


def test_a_paused_by_from_the_environment_is_checked_too(ws: Workspace) -> None:
    proc = run("handoff", ws.root, "pause", "@ask", env={**QUICK, "HANDOFF_TARGET": BAD})
    refused(proc, "--as", "not UTF-8")
    assert json.loads(run("handoff", ws.root, "paused", "--json").stdout) == {}


@pytest.mark.parametrize("command", ["init", "import"])
@pytest.mark.parametrize("where", ["--store", "$HANDOFFD_STORE"])
@pytest.mark.parametrize("url, words", [(f"postgresql://{BAD}@h/db", "not UTF-8"),
                                        ("mysql://h/db", "give a postgresql://")],
                         ids=["not-utf8", "not-postgresql"])
def test_a_bad_store_url_is_a_usage_error_before_the_workspace_is_made(
        tmp_path: Path, command: str, where: str, url: str, words: str) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    if where == "--store":
        proc = run("handoffd", root, "db", command, "--store", url)
    else:
        proc = run("handoffd", root, "db", command, env={**QUICK, "HANDOFFD_STORE": url})
    refused(proc, where, words, program="handoffd")
    assert list(root.iterdir()) == []  # refused before the workspace was made


# ------------------------------------------------------------------ validate
VALIDATE_TOML = f"""
[daemon]
settle_seconds = 0.1

[specialists."@flaky"]
command = ["{sys.executable}", "-S", "{SPECIALISTS / 'flaky.py'}"]
timeout_seconds = 20

[specialists."@strict"]
command = ["{sys.executable}", "-S", "{SPECIALISTS / 'flaky.py'}"]
input_schema = "req.json"
timeout_seconds = 20
"""


def request(hid: str, to: str, *, schema: str | None = None,
            output_schema: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "timestamp": "2026-11-26T10:00:00Z",
                           "status": "pending", "source": {"agent_id": "@cli"},
                           "target": {"agent_id": to}, "input": {"data": {"mode": "ok"}}}
    if schema is not None:
        doc["input"]["schema"] = schema
    if output_schema is not None:
        doc["expected_output"] = {"schema": output_schema}
    return doc


# what the daemon fails before the handler runs, and what it runs (ok)
REQUESTS = {
    "named": request("named", "@flaky", schema="req.json"),  # the data lacks "need"
    "missing": request("missing", "@flaky", schema="nope.json"),
    "traversal": request("traversal", "@flaky", schema="../../etc/passwd"),
    "up": request("up", "@flaky", schema="../handoffd.toml", output_schema="../handoffd.toml"),
    "specialist": request("specialist", "@strict"),  # its own input_schema
    "no-output": request("no-output", "@flaky", output_schema="nope.json"),
    "ok": request("ok", "@flaky"),
}


@pytest.fixture
def vws(tmp_path: Path) -> Any:
    workspace = new_workspace(tmp_path / "vws", VALIDATE_TOML)
    (workspace.root / "schemas" / "req.json").write_text(
        json.dumps({"type": "object", "required": ["need"]}))
    for name, doc in REQUESTS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    yield workspace
    workspace.cleanup()


def test_validate_applies_the_input_schema_the_daemon_applies(vws: Workspace,
                                                              tmp_path: Path) -> None:
    """It said "valid (native)" for each, and the daemon then failed them
    SCHEMA_VALIDATION_FAILED: validate now says so, and agrees with the daemon on each."""
    files = [str(tmp_path / f"{name}.json") for name in REQUESTS]
    proc = run("handoff", vws.root, "validate", "--json", *files)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    results = {Path(r["file"]).stem: r for r in json.loads(proc.stdout)}
    assert {name for name, r in results.items() if r["valid"]} == {"ok"}
    for name, item in results.items():
        for error in item["errors"]:  # every entry as every other: field, error, schema_path
            assert set(error) >= {"field", "error", "schema_path"}, (name, error)
    assert "need" in results["named"]["headline"] and "need" in results["specialist"]["headline"]
    assert "nope.json" in results["missing"]["headline"]
    assert "expected_output.schema" in results["no-output"]["headline"]
    text = run("handoff", vws.root, "validate", *files)  # the human form: no internal error
    assert text.returncode == 1 and "internal error" not in text.stderr, text.stderr
    assert f"{tmp_path / 'ok.json'}: valid (native)" in text.stdout
    # the daemon: fails each before running it, runs the valid one
    for name, doc in REQUESTS.items():
        vws.drop(f"{name}.json", doc)
    batch = run("handoffd", vws.root, "run", timeout=120)  # (exit 1: some failed)
    assert "completed 1, failed 6" in batch.stderr, batch.stderr
    for name in REQUESTS:
        state = vws.state_of(name)
        assert state == (["completed"] if name == "ok" else ["failed"]), (name, state)
        if name != "ok":
            assert vws.doc(name)["error"]["code"] == "SCHEMA_VALIDATION_FAILED", name


def test_validate_follows_advisory_expectations(vws: Workspace, tmp_path: Path) -> None:
    """With expectations advisory a missing named schema is a warning of the result, never
    its failure: valid (the input schema's errors still fail it)."""
    config = (vws.root / "handoffd.toml").read_text()
    (vws.root / "handoffd.toml").write_text(
        config.replace("settle_seconds = 0.1", 'settle_seconds = 0.1\nexpectations = "advisory"'))
    proc = run("handoff", vws.root, "validate", str(tmp_path / "missing.json"),
               str(tmp_path / "no-output.json"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert run("handoff", vws.root, "validate", str(tmp_path / "named.json")).returncode == 1


def test_validate_reports_an_unusable_input_schema_per_file(vws: Workspace,
                                                            tmp_path: Path) -> None:
    (vws.root / "schemas" / "bad.json").write_text("{bad")
    (tmp_path / "bad.json").write_text(json.dumps(request("bad", "@flaky", schema="bad.json")))
    proc = run("handoff", vws.root, "validate", "--json", str(tmp_path / "bad.json"),
               str(tmp_path / "ok.json"))
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    results = json.loads(proc.stdout)
    assert [r["valid"] for r in results] == [False, True]
    assert "schemas/bad.json is not valid JSON" in results[0]["headline"]


@pytest.mark.parametrize("program, args", [("handoffd", ("sweep",)), ("handoff", ("ls",))])
def test_a_store_url_that_is_not_utf8_is_refused_everywhere(ws: Workspace, program: str,
                                                             args: tuple[str, ...]) -> None:
    """`--store` or $HANDOFFD_STORE with an undecodable byte was an internal error (exit 1)
    outside `handoffd db`: the store URL check itself refuses it (exit 2, one line)."""
    url = f"postgresql://{BAD}@h/db"
    if program == "handoffd":
        refused(run(program, ws.root, *args, "--store", url), "not UTF-8", program=program)
    else:
        refused(run(program, ws.root, *args, env={**QUICK, "HANDOFFD_STORE": url}), "not UTF-8")
