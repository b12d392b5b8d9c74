"""`handoff cancel` / `handoff answer` (and Client.cancel / Client.answer) after review 15: a value
a document cannot hold is refused before anything is claimed, and whatever fails once the handoff
is claimed hands it back as it was. Before, the claim was stranded in in-progress/: the sweep
recovered it as a dead owner's claim, spent a retry and ran it (the cancel or the answer lost)."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace

from handoffd import Client
from handoffd.core.errors import UsageError

ASK = '''
import json, sys
doc = json.load(sys.stdin)
answers = (doc.get("input") or {}).get("clarifications")
if isinstance(answers, list) and answers:
    print(json.dumps({"status": "completed", "output": {"answer": answers[-1]["answer"]}}))
else:
    print(json.dumps({"status": "needs_clarification", "questions": ["which one?"]}))
'''


def config(script: Path) -> str:
    return f"""
[daemon]
settle_seconds = 0.1

[retry]
max_retries = 2
retry_delay_seconds = 0.2

[specialists."@ask"]
command = ["{sys.executable}", "-S", "{script}"]
timeout_seconds = 20
"""


@pytest.fixture
def aws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose @ask asks a question until it has an answer in input.clarifications."""
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    workspace = new_workspace(tmp_path / "ws", config(script))
    yield workspace
    workspace.cleanup()


def run(ws: Workspace) -> None:
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr


def park(ws: Workspace, *ids: str) -> None:
    """Create ``ids`` for @ask and run them once: each waits for an answer in pending/."""
    for hid in ids:
        ws.create("--to", "@ask", "--id", hid)
    run(ws)
    for hid in ids:
        assert ws.state_of(hid) == ["pending"] and "awaiting" in ws.doc(hid)["handoffd"], hid


def raw(ws: Workspace, hid: str) -> bytes:
    return (ws.root / "handoffs" / "pending" / f"{hid}.json").read_bytes()


def in_progress(ws: Workspace) -> list[str]:
    return sorted(p.name for p in (ws.root / "handoffs" / "in-progress").iterdir())


def spent(ws: Workspace, hid: str) -> tuple[Any, Any]:
    block = ws.doc(hid)["handoffd"]
    return block.get("attempt"), block.get("retries")


def handed_back_as_it_was(ws: Workspace, hid: str, before: dict[str, Any]) -> None:
    """``hid`` is back in pending/ alone, as parked as it was, its attempt and retries unspent,
    its last event a hand-back."""
    assert in_progress(ws) == [] and ws.state_of(hid) == ["pending"]
    doc = ws.doc(hid)
    block, was = doc["handoffd"], before["handoffd"]
    assert (block.get("attempt"), block.get("retries")) == (was.get("attempt"), was.get("retries"))
    assert block.get("awaiting") == was.get("awaiting")
    assert doc.get("input") == before.get("input")
    assert block["history"][-1]["event"] == "handed_back", block["history"][-1]
    assert "lease" not in block


# ---------------------------------------------------------------- cancel
def test_a_reason_or_canceller_that_is_not_text_is_refused_before_any_claim(aws: Workspace) -> None:
    aws.create("--to", "@none", "--id", "p1")
    before = raw(aws, "p1")
    client = Client(aws.root)
    with pytest.raises(UsageError, match="reason is not UTF-8 text"):
        client.cancel("p1", reason="bad\udcffreason")
    with pytest.raises(UsageError, match="who cancels is not UTF-8 text"):
        Client(aws.root, agent="@\udcff").cancel("p1")
    from handoffd.features.cancel_family import cancel
    with pytest.raises(UsageError, match="via is not UTF-8 text"):
        cancel(client.engine, "p1", reason="ok", via="\ud800")
    assert in_progress(aws) == [] and raw(aws, "p1") == before  # nothing was claimed
    # the command line says so in one line too (argv's undecodable byte), exit 2
    proc = subprocess.run([exe("handoff"), "cancel", "p1", "--reason", b"bad\xffreason",
                           "--root", str(aws.root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert in_progress(aws) == [] and raw(aws, "p1") == before
    # and it can still be cancelled
    assert client.cancel("p1", reason="changed my mind") == "cancelled"
    assert aws.state_of("p1") == ["failed"]
    assert aws.doc("p1")["handoffd"]["final_error"]["code"] == "CANCELLED"


def test_a_cancel_that_fails_after_its_claim_hands_the_handoff_back(
        aws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    park(aws, "q1")
    before = aws.doc("q1")
    client = Client(aws.root)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("filing broke")

    monkeypatch.setattr(client.engine, "file", broken)
    with pytest.raises(RuntimeError, match="filing broke"):
        client.cancel("q1")
    handed_back_as_it_was(aws, "q1", before)
    assert "RuntimeError: filing broke" in aws.doc("q1")["handoffd"]["history"][-1]["detail"]["reason"]
    # a sweep finds nothing to recover: no retry spent, it still waits for its answer
    proc = aws.handoffd("sweep", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert spent(aws, "q1") == (before["handoffd"].get("attempt"), before["handoffd"].get("retries"))
    assert aws.state_of("q1") == ["pending"] and "awaiting" in aws.doc("q1")["handoffd"]
    monkeypatch.undo()
    assert Client(aws.root).cancel("q1") == "cancelled"
    assert aws.state_of("q1") == ["failed"]


def test_a_cancel_whose_filing_finds_the_disk_full_hands_the_handoff_back(
        aws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real store's failure before it wrote anything in failed/ (ENOSPC): the claim stays
    the canceller's and goes back; before, the store gave it up and it stayed in in-progress/."""
    from handoffd.backends.files import fsio
    park(aws, "q2")
    before = aws.doc("q2")
    real = fsio.create_exclusive

    def full(target: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(target).parent.name == "failed":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(target, *args, **kwargs)

    monkeypatch.setattr(fsio, "create_exclusive", full)
    with pytest.raises(OSError):
        Client(aws.root).cancel("q2")
    handed_back_as_it_was(aws, "q2", before)


# ---------------------------------------------------------------- answer
def test_an_answer_to_a_request_whose_clarifications_is_no_list(aws: Workspace) -> None:
    for hid, clarifications in (("clar3", {}), ("clar4", 0)):
        aws.drop(f"{hid}.json", {"handoff_id": hid, "timestamp": "2026-11-26T10:00:00Z",
                                 "status": "pending", "source": {"agent_id": "@cli"},
                                 "target": {"agent_id": "@ask"},
                                 "input": {"data": {}, "clarifications": clarifications}})
    run(aws)
    for hid, kind in (("clar3", "dict"), ("clar4", "int")):
        assert aws.state_of(hid) == ["pending"] and "awaiting" in aws.doc(hid)["handoffd"]
        attempt = spent(aws, hid)
        proc = aws.handoff("answer", hid, "--data", '"yes"')
        assert proc.returncode == 0, proc.stderr
        assert in_progress(aws) == [] and aws.state_of(hid) == ["pending"]
        doc = aws.doc(hid)
        (entry,) = doc["input"]["clarifications"]
        assert entry["answer"] == "yes" and entry["questions"] == ["which one?"]
        assert spent(aws, hid) == attempt and "awaiting" not in doc["handoffd"]
        event = doc["handoffd"]["history"][-1]
        assert event["event"] == "answered"
        assert event["detail"]["replaced"] == (f"input.clarifications was a {kind}, not a list "
                                               "of answers")
    run(aws)
    for hid in ("clar3", "clar4"):
        assert aws.state_of(hid) == ["completed"]
        assert aws.doc(hid)["output"] == {"answer": "yes"}


def test_an_answer_a_document_cannot_hold_is_refused_before_any_claim(aws: Workspace) -> None:
    park(aws, "q3")
    before = raw(aws, "q3")
    client = Client(aws.root)
    deep: Any = "x"
    for _ in range(61):  # 61 levels: 4 more above it in the document make 65
        deep = [deep]
    for value in ({1, 2}, float("nan"), float("inf"), b"x", "\udcff", {"a": ["\ud800"]}, deep,
                  10 ** 5000):
        with pytest.raises(UsageError, match="^answer (must be JSON data|nests more)"):
            client.answer("q3", value)
        assert in_progress(aws) == [] and raw(aws, "q3") == before, repr(value)[:40]
    from handoffd.features.orchestration import answer
    for value in (float("nan"), "\udcff", deep):
        with pytest.raises(UsageError, match="^answer (must be JSON data|nests more)"):
            answer(client.engine, "q3", value)
    with pytest.raises(UsageError, match="who answers is not UTF-8 text"):
        answer(client.engine, "q3", "fine", by="@\udcff")
    assert in_progress(aws) == [] and raw(aws, "q3") == before
    client.answer("q3", {"pick": "the first"})  # a good answer still goes in
    run(aws)
    assert aws.doc("q3")["output"] == {"answer": {"pick": "the first"}}


def test_an_answer_that_fails_after_its_claim_hands_the_handoff_back(
        aws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    park(aws, "q4")
    before = aws.doc("q4")
    client = Client(aws.root)
    real = client.engine.requeue

    def requeue(claim: Any, dialect: Any, event: str, **kwargs: Any) -> Any:
        if event == "answered":
            raise RuntimeError("writing the answer broke")
        return real(claim, dialect, event, **kwargs)

    monkeypatch.setattr(client.engine, "requeue", requeue)
    with pytest.raises(RuntimeError, match="writing the answer broke"):
        client.answer("q4", "yes")
    handed_back_as_it_was(aws, "q4", before)
    monkeypatch.undo()
    proc = aws.handoff("answer", "q4", "--data", '"yes"')  # it can still be answered
    assert proc.returncode == 0, proc.stderr
    run(aws)
    assert aws.state_of("q4") == ["completed"] and aws.doc("q4")["output"] == {"answer": "yes"}
    assert json.loads(json.dumps(aws.doc("q4")["input"]["clarifications"]))[0]["answer"] == "yes"
