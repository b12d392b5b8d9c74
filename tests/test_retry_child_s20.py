"""`handoff retry` of a child its parent has already aggregated (session 20, review R22 #4).

The child was run again and filed anew, while the parent's answer kept the child's old outcome
(a family left `partial` with every child completed). Now such a retry is refused, even with
--force, with one line naming the parent and what to do instead. A child whose parent still
waits may be retried (the parent counts the re-run), and a `parent_id` a document merely claims
refuses nothing: only a filed parent that lists the child does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Workspace, handlers_workspace
from test_children_gate_reads_s17 import CONFIG, HANDLERS  # (@boss delegates to @leaf)

from handoffd import new_native_request
from handoffd.core.timeutil import utc_now


def test_a_child_of_a_filed_parent_is_not_retried_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws: Workspace = handlers_workspace(tmp_path, monkeypatch, "cg17", HANDLERS, CONFIG)
    try:
        ws.create("--to", "@boss", "--id", "part", "--data",
                  json.dumps({"aggregation": "all_success", "n": 2, "fail": [1]}))
        ws.create("--to", "@boss", "--id", "none", "--data",
                  json.dumps({"aggregation": "first_success", "n": 2, "fail": [0, 1]}))
        # a failed handoff that claims a parent which never delegated it
        forged = new_native_request(source="@test", target="@leaf", data={"n": 9, "fail": True},
                                    now=utc_now(), handoff_id="forged")
        forged["parent_id"] = "part"
        ws.drop("forged.json", forged)
        ws.handoffd("run", timeout=120)
        assert ws.state_of("part") == ["completed"] and ws.state_of("none") == ["failed"]
        assert ws.state_of("part.c2") == ["failed"] and ws.state_of("forged") == ["failed"]

        proc = ws.handoff("retry", "--force", "part.c2")
        assert proc.returncode == 1, proc
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert "child of part, which is already completed" in proc.stderr, proc.stderr
        assert "submit the parent's request again" in proc.stderr, proc.stderr
        assert ws.state_of("part.c2") == ["failed"]  # left as it was

        proc = ws.handoff("retry", "--force", "none.c1")
        assert proc.returncode == 1 and "handoff retry --force none" in proc.stderr, proc.stderr
        assert ws.state_of("none.c1") == ["failed"]

        # the parent itself, and a document that only claims a parent, are retried as before
        assert ws.handoff("retry", "--force", "none").returncode == 0
        assert ws.state_of("none") == ["pending"]
        proc = ws.handoff("retry", "--force", "forged")
        assert proc.returncode == 0, proc.stderr
        assert ws.state_of("forged") == ["pending"]
    finally:
        ws.cleanup()
