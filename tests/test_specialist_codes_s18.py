"""A specialist's error code is filed only in the shape every format's schema asks (R14, s18).

``{"status": "failed", "error": {"code": "oops", ...}}`` was filed with ``code: "oops"``, and
`handoff validate` rejected handoffd's own failure (``'oops' does not match
'^[A-Z][A-Z0-9_]*$'``); so for "5", "E-1", "x y" or a code of 1,000 characters. Such a code is
filed as PROCESSING_ERROR now, the specialist's named in the message (and kept in
``details.specialist_code`` where a format files details).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import new_workspace

ANSWER = """import json, sys
doc = json.load(sys.stdin)
code = doc["input"]["data"]["code"]
print(json.dumps({"status": "failed", "error": {"code": code, "message": "m", "retryable": False}}))
"""


@pytest.mark.parametrize("code, filed", [
    ("oops", "PROCESSING_ERROR"), ("E-1", "PROCESSING_ERROR"), ("x" * 1000, "PROCESSING_ERROR"),
    ("5", "PROCESSING_ERROR"), ("QUOTA_EXCEEDED", "QUOTA_EXCEEDED")])
def test_a_failure_is_filed_with_a_code_its_schema_takes(tmp_path: Path, code: str,
                                                         filed: str) -> None:
    script = tmp_path / "answer.py"
    script.write_text(ANSWER)
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.05

[specialists."@fails"]
command = ["{sys.executable}", "-S", "{script}"]
""")
    try:
        ws.drop("c1.json", {"handoff_id": "c1", "target": {"agent_id": "@fails"},
                            "input": {"data": {"code": code}}})
        assert ws.handoffd("run").returncode == 1
        path = ws.root / "handoffs" / "failed" / "c1.json"
        error = json.loads(path.read_text())["error"]
        assert error["code"] == filed, error
        if filed != code:  # said in the message (the native format files no details)
            assert repr(code[:100]) in error["message"], error
        checked = ws.handoff("validate", str(path))
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        ws.cleanup()
