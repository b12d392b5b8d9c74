"""Seed 000's 1 KB rule where the handoff's artifact folder cannot be used (R13, defect 4).

An answer's content of 1 KB or more goes to ``artifacts/<id>/`` by reference. When that folder
cannot hold it, the sink kept the text inline (``artifacts/`` a symlink out of the workspace: an
answer ``handoff validate`` rejects) or raised out of the filing (a file at ``artifacts/<id>``:
"File exists", the claim given up, the handler run again and again until "interrupted 12 times
in a row" hid the cause). Now such an attempt fails once, ``VALIDATION_FAILED``, its one-line
message naming what to move: a valid answer, nothing written outside the workspace or through a
link, the handler run once. A full disk stays a passing reason: the claim is given up and the
handoff runs again once the disk takes it (docs/guarantees.md), with a valid answer then.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET

from handoffd import Workspace as HandoffdWorkspace
from handoffd.features.artifacts import text_sink

HANDLER = """\
import json, os, sys
doc = json.load(sys.stdin)
with open(sys.argv[1], "a") as runs:
    runs.write(os.environ.get("HANDOFF_ID", "?") + "\\n")
big = "x" * 3000
native = isinstance(doc.get("input"), dict)
output = {"content": big} if native else {"summary": "big", "code": big}
print(json.dumps({"status": "completed", "output": output}))
"""

CONFIG = """\
[daemon]
settle_seconds = 0.1
rescan_seconds = 0.5
sweep_seconds = 0.5
claim_grace_seconds = 0.0
durability = "fast"

[retry]
max_retries = 1
retry_delay_seconds = 0.2
backoff_multiplier = 1.0

[specialists."python-lora"]
command = [{command}]
timeout_seconds = 20

[specialists."@big"]
command = [{command}]
timeout_seconds = 20
"""

# a `handoffd` whose writes under the workspace's artifacts/ fail with ENOSPC the first time
FULL_ONCE = """\
import errno, sys
from handoffd.backends.files import fsio
from handoffd.cli.handoffd_cmd import main
real, artifacts, failed = fsio.replace, sys.argv[1], []
def replace(target, *args, **kwargs):
    if str(target).startswith(artifacts) and not failed:
        failed.append(target)
        raise OSError(errno.ENOSPC, "No space left on device", str(target))
    return real(target, *args, **kwargs)
fsio.replace = replace
sys.argv = ["handoffd", *sys.argv[2:]]
main()
"""


@pytest.fixture
def big(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose python-lora (hi_moe) and @big (native) answer with 3 KB of output,
    each run written to ``runs.txt`` outside the workspace."""
    script = tmp_path / "big.py"
    script.write_text(HANDLER)
    runs = tmp_path / "runs.txt"
    command = ", ".join(json.dumps(part) for part in (sys.executable, "-S", str(script), str(runs)))
    workspace = new_workspace(tmp_path / "ws", CONFIG.format(command=command))
    workspace.runs_file = runs  # type: ignore[attr-defined]
    yield workspace
    workspace.cleanup()


def message(hid: str = "msg-big") -> dict[str, Any]:
    doc = copy.deepcopy(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"] = hid
    return doc


def runs(ws: Workspace) -> list[str]:
    path: Path = ws.runs_file  # type: ignore[attr-defined]
    return path.read_text().split() if path.exists() else []


def answer_path(ws: Workspace, hid: str, state: str) -> Path:
    return ws.root / "handoffs" / state / f"{hid}.json"


def assert_valid(ws: Workspace, hid: str, state: str) -> dict[str, Any]:
    """The filed answer, which `handoff validate` accepts, with no inline content of 1 KB."""
    path = answer_path(ws, hid, state)
    checked = ws.handoff("validate", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    doc = json.loads(path.read_text())
    for item in (doc.get("payload") or {}).get("artifacts") or []:
        assert len((item.get("inline_content") or "").encode()) < 1024, item
    return doc


def assert_refused_once(ws: Workspace, hid: str, what: str) -> None:
    """Filed failed at the first attempt, VALIDATION_FAILED, the message naming ``what``."""
    assert ws.state_of(hid) == ["failed"], ws.state_of(hid)
    doc = assert_valid(ws, hid, "failed")
    error = doc["handoffd"]["final_error"]
    assert error["code"] == "VALIDATION_FAILED", error
    assert what in error["message"] and f"handoff retry --force {hid}" in error["message"], error
    assert "\n" not in error["message"]
    assert runs(ws) == [hid], runs(ws)  # the handler ran once


def test_a_file_where_its_folder_should_be_fails_the_attempt_once(big: Workspace) -> None:
    """The R13 reproduction (serve): the answer was lost twice and the handoff looped on "File
    exists" until "interrupted 12 times in a row". Moved away, `handoff retry` completes it."""
    (big.root / "artifacts" / "msg-big").write_text("I am a file, not a folder")
    big.serve()
    big.drop("msg-big.json", message())
    waited = big.handoff("wait", "msg-big", "--timeout", "40", timeout=60)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    assert "artifacts/msg-big is a regular file, not a folder: move it away" in waited.stderr
    assert_refused_once(big, "msg-big", "artifacts/msg-big is a regular file")
    assert (big.root / "artifacts" / "msg-big").read_text() == "I am a file, not a folder"

    (big.root / "artifacts" / "msg-big").unlink()
    assert big.handoff("retry", "--force", "msg-big").returncode == 0
    assert big.wait_state("msg-big") == "completed"
    doc = assert_valid(big, "msg-big", "completed")
    (output,) = [a for a in doc["payload"]["artifacts"] if a["artifact_type"] == "output"]
    assert output["inline_content"] is None and output["content_ref"] == "artifacts/msg-big/1.txt"
    assert len((big.root / output["content_ref"]).read_bytes()) >= 3000


@pytest.mark.parametrize("kind", ["fifo", "link-inside", "dangling-link"])
def test_a_fifo_or_a_link_where_its_folder_should_be(big: Workspace, kind: str) -> None:
    """A FIFO, or a symlink (to another handoff's folder, or to nothing): refused, never
    written through; before, a link inside the workspace was followed (the content landed in
    the other handoff's folder) and the others looped as a file does."""
    place = big.root / "artifacts" / "msg-big"
    other = big.root / "artifacts" / "other"
    other.mkdir()
    if kind == "fifo":
        os.mkfifo(place)
    else:
        place.symlink_to(other if kind == "link-inside" else big.root / "nowhere")
    big.drop("msg-big.json", message())
    done = big.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    what = {"fifo": "a FIFO", "link-inside": "a symbolic link",
            "dangling-link": "a symbolic link"}[kind]
    assert_refused_once(big, "msg-big", f"artifacts/msg-big is {what}, not a folder")
    assert list(other.iterdir()) == [] and not (big.root / "nowhere").exists()


def test_artifacts_leading_out_of_the_workspace_is_refused_not_inlined(
        big: Workspace, tmp_path: Path) -> None:
    """``artifacts`` a symlink out of the workspace: nothing is written there (as before), but
    the answer was filed with 3 KB inline, which `handoff validate` rejected."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (big.root / "artifacts").rmdir()
    (big.root / "artifacts").symlink_to(outside)
    big.drop("msg-big.json", message())
    done = big.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert_refused_once(big, "msg-big", "artifacts/ leads out of the workspace")
    assert list(outside.iterdir()) == []


def test_a_native_output_content_meets_the_same_rule(big: Workspace) -> None:
    """``output.content`` of 1 KB or more (the daemon moves it to artifacts/<id>/): a file in
    the folder's place failed the attempt PROCESSING_ERROR, retryable, so the handler ran again
    for the same "File exists"; now once, VALIDATION_FAILED, saying what to move."""
    (big.root / "artifacts" / "nat-big").write_text("in the way")
    big.handoff("create", "--to", "@big", "--id", "nat-big", "--data", "{}", check=True)
    done = big.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert big.state_of("nat-big") == ["failed"]
    error = json.loads(answer_path(big, "nat-big", "failed").read_text())["error"]
    assert error["code"] == "VALIDATION_FAILED", error
    assert "artifacts/nat-big is a regular file, not a folder: move it away" in error["message"]
    assert runs(big) == ["nat-big"], runs(big)


def test_a_full_disk_at_the_sink_is_a_passing_reason(big: Workspace) -> None:
    """ENOSPC storing the content (docs/guarantees.md: an artifact a format writes before its
    answer): the claim is given up, never an answer with the text inline, and the sweep hands
    it back free; the disk taking it then, a valid answer by reference is filed. (So on the old
    code too: the defect was the reasons that do not pass.)"""
    artifacts = str(HandoffdWorkspace(big.root).artifacts)
    daemon = subprocess.Popen(
        [sys.executable, "-c", FULL_ONCE, artifacts, "serve", "--root", str(big.root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    big.daemons.append(daemon)  # (killed by the fixture if the test fails first)
    big.drop("msg-big.json", message())
    assert big.wait_state("msg-big", timeout=60) == "completed"
    big.stop(daemon)
    assert daemon.stderr is not None
    said = daemon.stderr.read()
    assert "No space left on device" in said and "Traceback" not in said, said
    doc = assert_valid(big, "msg-big", "completed")
    (output,) = [a for a in doc["payload"]["artifacts"] if a["artifact_type"] == "output"]
    assert output["content_ref"] == "artifacts/msg-big/1.txt"
    events = [e["event"] for e in doc["handoffd"]["history"]]
    assert events.count("handed_back") == 1 and "retry_scheduled" not in events, events
    assert runs(big) == ["msg-big", "msg-big"]  # the documented cost: its handler ran again


def test_the_sink_never_answers_inline(tmp_path: Path) -> None:
    """The sink's None put the text inline; now it raises OSError (which filing handles as a
    failure before the answer) and writes nothing outside the workspace."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    ws.artifacts.symlink_to(outside)
    sink = text_sink(ws)
    with pytest.raises(OSError, match="leads out of the workspace"):
        sink("h1", 1, "x" * 2000)
    assert list(outside.iterdir()) == []
    ws.artifacts.unlink()
    ws.artifacts.mkdir()
    (ws.artifacts / "h1").write_text("in the way")
    with pytest.raises(OSError, match="artifacts/h1 is a regular file"):
        sink("h1", 1, "x" * 2000)
    assert sink("h2", 1, "y" * 2000) == "artifacts/h2/1.txt"
    assert (ws.artifacts / "h2" / "1.txt").read_text() == "y" * 2000


def test_a_destination_whose_folder_is_a_file_fails_before_the_handler(big: Workspace) -> None:
    """``expected_output.destination`` under a file (artifacts/blocked is a regular file): the
    folder's ``mkdir`` raised FileExistsError out of the before-run hook, and the handoff stayed
    in in-progress/ ("will retry in 5.0s" at every look). Now it fails before its handler runs,
    VALIDATION_FAILED, naming what is in the way."""
    (big.root / "artifacts" / "blocked").write_text("in the way")
    for hid, dest in (("d1", "artifacts/blocked/out-{handoff_id}.json"),
                      ("d2", "artifacts/blocked/deeper/out.json")):
        big.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": "@big"},
                                 "input": {"data": {}}, "expected_output": {"destination": dest}})
    done = big.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr and "will retry" not in done.stderr, done.stderr
    for hid in ("d1", "d2"):
        assert big.state_of(hid) == ["failed"], big.state_of(hid)
        error = json.loads(answer_path(big, hid, "failed").read_text())["error"]
        assert error["code"] == "VALIDATION_FAILED", error
        assert "artifacts/blocked is not a folder: move it away" in error["message"], error
    assert runs(big) == []  # no handler ran
    assert (big.root / "artifacts" / "blocked").read_text() == "in the way"


def test_a_destination_that_is_a_folder_fails_before_the_handler(big: Workspace) -> None:
    """``expected_output.destination`` naming an existing folder (R14): the handler ran at every
    attempt, each ending "cannot store artifacts: Is a directory" (retried as passing). Now it
    fails once, before the handler, VALIDATION_FAILED, naming the folder."""
    (big.root / "artifacts" / "sub").mkdir()
    big.drop("f1.json", {"handoff_id": "f1", "target": {"agent_id": "@big"},
                         "input": {"data": {}}, "expected_output": {"destination": "sub"},
                         "retry_policy": {"max_retries": 2, "retry_delay_seconds": 0}})
    done = big.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert big.state_of("f1") == ["failed"], big.state_of("f1")
    error = json.loads(answer_path(big, "f1", "failed").read_text())["error"]
    assert error["code"] == "VALIDATION_FAILED" and "is a folder" in error["message"], error
    assert runs(big) == []
