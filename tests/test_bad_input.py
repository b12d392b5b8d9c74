"""Hostile and broken input: each gets a clear recorded error, the daemon keeps serving, nothing is
written outside the workspace, nothing is lost."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from conftest import Workspace


def good(hid: str, **extra: object) -> dict:
    doc = {"handoff_id": hid, "target": {"agent_id": "@flaky"}, "input": {"data": {"mode": "ok"}}}
    doc.update(extra)
    return doc


def snapshot(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if "ws" not in p.relative_to(path).parts[:1]}


CASES = {
    # file name -> (content, expected error code)
    "malformed.json": (b'{"handoff_id": "malformed", "target": ', "MALFORMED_JSON"),
    "empty.json": (b"", "EMPTY_DOCUMENT"),
    "latin1.json": (b'{"handoff_id": "latin1", "note": "caf\xe9"}', "NOT_UTF8"),
    "array.json": (b'[1, 2, 3]', "NOT_AN_OBJECT"),
    "dotdot.json": (json.dumps(good("../x")).encode(), "ID_MISMATCH"),
    "absolute.json": (json.dumps(good("/abs/x")).encode(), "ID_MISMATCH"),
    "nul.json": (json.dumps(good("a\u0000b")).encode(), "ID_MISMATCH"),
    "mismatch.json": (json.dumps(good("something-else")).encode(), "ID_MISMATCH"),
    "noschema.json": (json.dumps({"handoff_id": "noschema", "target": {"agent_id": ""}}).encode(),
                      "SCHEMA_VALIDATION_FAILED"),
}


def test_each_bad_file_is_set_aside_with_a_clear_error(ws: Workspace, tmp_path: Path) -> None:
    before = snapshot(tmp_path)
    for name, (content, _) in CASES.items():
        ws.drop(name, content)
    long_id = "a" * 300
    ws.drop("toolong.json", json.dumps(good(long_id)))
    ws.drop("ok-1.json", good("ok-1"))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr
    assert ws.state_of("ok-1") == ["completed"]  # the daemon kept serving
    assert not list((ws.root / "handoffs" / "pending").iterdir())
    assert not list((ws.root / "handoffs" / "in-progress").iterdir())
    rows = json.loads(ws.handoff("ls", "--state", "quarantined", "--json").stdout)
    by_file = {r["id"].split("-", 2)[-1]: r["note"] for r in rows}
    for name, (_, code) in CASES.items():
        if code == "SCHEMA_VALIDATION_FAILED":
            continue  # a readable document with a valid id is filed in failed/ instead
        assert any(k.endswith(name) and v.startswith(code) for k, v in by_file.items()), (name, by_file)
    assert any(k.endswith("toolong.json") and v.startswith("ID_MISMATCH") for k, v in by_file.items())
    # files whose name is a safe id also get a failure document, so `handoff wait NAME` ends
    for name in ("malformed", "empty", "latin1", "array", "dotdot", "mismatch"):
        doc = ws.doc(name)
        assert doc["status"] == "failed" and doc["error"]["code"] == CASES[name + ".json"][1]
    schema_fail = ws.doc("noschema")
    assert schema_fail["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert any(e["field"] == "target.agent_id" for e in schema_fail["validation"]["errors"])
    assert snapshot(tmp_path) == before  # nothing written outside the workspace


def test_oversized_document(ws: Workspace) -> None:
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text().replace(
        "[retry]", "max_document_bytes = 2048\n\n[retry]"))
    ws.drop("big.json", good("big", padding="x" * 5000))
    ws.handoffd("run")
    assert ws.doc("big")["error"]["code"] == "DOCUMENT_TOO_LARGE"
    assert "2048" in ws.doc("big")["error"]["message"]
    proc = ws.handoff("create", "--to", "@flaky", "--data", json.dumps("y" * 5000))
    # refused before it is written: acknowledged, the daemon would only have set it aside
    assert proc.returncode == 1 and "2048-byte limit" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and not proc.stdout


def test_symlinks_and_fifos_are_never_followed(ws: Workspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(good("link")))
    pending = ws.root / "handoffs" / "pending"
    os.symlink(secret, pending / "link.json")
    os.mkfifo(pending / "fifo.json")
    ws.drop("ok-2.json", good("ok-2"))
    proc = ws.handoffd("run", timeout=60)
    assert "Traceback" not in proc.stderr
    assert ws.state_of("ok-2") == ["completed"]
    assert secret.read_text() == json.dumps(good("link"))  # target untouched
    notes = [r["note"] for r in json.loads(ws.handoff("ls", "--state", "quarantined", "--json").stdout)]
    assert sum(n.startswith("NOT_A_REGULAR_FILE") for n in notes) == 2
    assert ws.doc("link")["error"]["code"] == "NOT_A_REGULAR_FILE"


def test_duplicate_raw_document_is_set_aside(ws: Workspace) -> None:
    ws.drop("dup.json", good("dup"))
    ws.handoffd("run")
    assert ws.state_of("dup") == ["completed"]
    ws.drop("dup.json", good("dup", note="second"))
    ws.handoffd("run")
    assert ws.state_of("dup") == ["completed"]
    assert len([r for r in ws.runs() if r["id"] == "dup"]) == 1  # never re-run
    notes = [r["note"] for r in json.loads(ws.handoff("ls", "--state", "quarantined", "--json").stdout)]
    assert any(n.startswith("DUPLICATE_HANDOFF_ID") for n in notes)


def test_artifact_paths_outside_the_workspace_are_rejected(ws: Workspace, tmp_path: Path) -> None:
    script = tmp_path / "escape.py"
    script.write_text(
        "import json, sys\n"
        "json.load(sys.stdin)\n"
        "print(json.dumps({'status': 'completed', 'output': {'artifact_path': '../../etc/passwd'}}))\n")
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text() +
                    f'\n[specialists."@escape"]\ncommand = ["{sys.executable}", "{script}"]\n')
    hid = ws.create("--to", "@escape", "--data", "{}")
    assert ws.handoffd("run").returncode == 1
    doc = ws.doc(hid)
    assert doc["error"]["code"] == "VALIDATION_FAILED" and "outside the workspace" in doc["error"]["message"]


def test_daemon_survives_a_stream_of_garbage(ws: Workspace) -> None:
    daemon = ws.serve()
    for i in range(20):
        ws.drop(f"junk-{i}.json", os.urandom(64))
    ws.drop("after.json", good("after"))
    assert ws.wait_state("after") == "completed"
    assert daemon.poll() is None
    for i in range(20):
        ws.wait_state(f"junk-{i}", ("failed",))
    assert ws.stop(daemon) == 0
