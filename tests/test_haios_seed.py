"""Seed 003 (HAIOS) through a real daemon: a TIMEOUT returns the partial result with a warning
and is not retried; without `timeout_ms` the seed's 30 000 ms default applies."""
from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace
from dialect_examples import HAIOS_HANDOFF, fresh

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.dialects.haios import DEFAULT_TIMEOUT_SECONDS, HaiosDialect

# A command specialist: ingests slowly; on SIGTERM (its time is up) it prints what it has.
INGESTER = r'''
import json, signal, sys, time
def stop(signum, frame):
    print(json.dumps({"status": "partial", "output": {"entities_created": 1, "of": 3}}), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
json.load(sys.stdin)
time.sleep(60)
print(json.dumps({"status": "completed", "output": {"entities_created": 3}}))
'''

# the same, silent when stopped: nothing partial to return
MUTE = r'''
import json, sys, time
json.load(sys.stdin)
time.sleep(60)
'''


@pytest.fixture
def hws(tmp_path: Path) -> Workspace:
    (tmp_path / "ingester.py").write_text(INGESTER)
    (tmp_path / "mute.py").write_text(MUTE)
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(f"""
[daemon]
settle_seconds = 0.05
durability = "fast"

[retry]
max_retries = 3
retry_delay_seconds = 0.1

[specialists."ingester-v1"]
command = ["{sys.executable}", "{tmp_path / 'ingester.py'}"]

[specialists."mute-v1"]
command = ["{sys.executable}", "{tmp_path / 'mute.py'}"]

[specialists."quick-v1"]
command = ["{sys.executable}", "-c", "import json,sys; json.load(sys.stdin); print(json.dumps({{'status': 'completed', 'output': {{'ok': True}}}}))"]
""")
    HandoffdWorkspace(root).ensure()
    return ws


def handoff(hid: str, to: str, timeout_ms: int | None) -> dict[str, Any]:
    doc = fresh(HAIOS_HANDOFF)
    doc["handoff_id"], doc["to_agent"], doc["timeout_ms"] = hid, to, timeout_ms
    if timeout_ms is None:
        del doc["timeout_ms"]
    return doc


def claims(ws: Workspace, hid: str) -> int:
    return [e["event"] for e in ws.doc(hid)["handoffd"]["history"]].count("claimed")


def test_timeout_returns_the_partial_result_with_a_warning(hws: Workspace) -> None:
    hid = "6f1c2a9e-3b4d-4c5e-9f7a-000000000001"
    hws.drop(f"{hid}.json", handoff(hid, "ingester-v1", 3000))  # room for a loaded start
    hws.handoffd("run")
    answer = hws.doc(hid)
    assert answer["status"] == "partial", answer
    assert answer["result"] == {"entities_created": 1, "of": 3}
    assert answer["warnings"][0].startswith("TIMEOUT: ")
    assert claims(hws, hid) == 1  # max_retries = 3, yet a timeout is the answer


def test_timeout_without_a_partial_result_is_a_final_error(hws: Workspace) -> None:
    hid = "6f1c2a9e-3b4d-4c5e-9f7a-000000000002"
    hws.drop(f"{hid}.json", handoff(hid, "mute-v1", 800))
    hws.handoffd("run")
    answer = hws.doc(hid)
    assert answer["status"] == "error" and answer["error"]["code"] == "TIMEOUT", answer
    assert answer["result"] == {} and claims(hws, hid) == 1


def test_the_default_timeout_is_30_seconds() -> None:
    env = HaiosDialect().envelope(handoff("6f1c2a9e-3b4d-4c5e-9f7a-000000000003", "x", None))
    assert env.timeout_seconds is None and env.default_timeout_seconds == DEFAULT_TIMEOUT_SECONDS
    assert DEFAULT_TIMEOUT_SECONDS == 30.0 and env.final_timeout
    given = HaiosDialect().envelope(handoff("6f1c2a9e-3b4d-4c5e-9f7a-000000000004", "x", 5000))
    assert given.timeout_seconds == 5.0


def test_id_and_created_at_are_defaulted(hws: Workspace) -> None:
    """Seed 003 gives handoff_id (a UUID) and created_at defaults: a document without them is
    accepted, dropped (its file name is its id) or submitted (a new UUID)."""
    dropped = "6f1c2a9e-3b4d-4c5e-9f7a-000000000005"
    doc = handoff(dropped, "quick-v1", 5000)
    del doc["handoff_id"], doc["created_at"]
    hws.drop(f"{dropped}.json", doc)
    path = hws.root / "new.json"
    path.write_text(json.dumps(doc))
    created = hws.create("--file", str(path))
    assert uuid.UUID(created).version == 4 and created != dropped
    submitted = json.loads((hws.root / "handoffs" / "pending" / f"{created}.json").read_text())
    assert submitted["handoff_id"] == created and submitted["created_at"].endswith("Z")
    assert hws.handoffd("run").returncode == 0
    for hid in (dropped, created):
        answer = hws.doc(hid)
        assert answer["status"] == "success" and answer["handoff_id"] == hid, answer
        request = answer["handoffd"]["request_snapshot"]
        assert request["handoff_id"] == hid and request["created_at"]
