"""Artifact destinations against the reviewer's session-31 findings (/tmp/rc/dest.py):

1. A destination the system refuses (a name over 255 bytes, a path over PATH_MAX, a permission,
   a read-only file system) is a recorded refusal, ``VALIDATION_FAILED`` in one line, not
   retried, the handler never started; its OSError once escaped the ``before_run`` hooks and
   stranded the claim in in-progress/ ("attempt 1 was interrupted" at the next run). A passing
   shortage there (descriptors, memory, space) hands the attempt back uncounted. The same
   refusal when ``output.content`` is written there.
2. A destination that is the file ``artifacts/<another handoff's id>`` (two parts) is refused as
   one inside that folder is: it made the other handoff fail ``VALIDATION_FAILED``.
3. The memory of shared destination folders no longer lets a destination into a folder that
   became another handoff's since it was looked at.
4. A destination ending in ``/`` is refused: handoffd wrote a file ``artifacts/p`` and filed
   ``artifacts/p/``, and a handler that wrote ``$HANDOFF_ARTIFACT_PATH`` was failed.
"""
from __future__ import annotations

import errno
import json
import os
import pathlib
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, Workspace, memory_engine, new_workspace

from handoffd.core.errors import ErrorCode, InvalidDocument
from handoffd.core.starts import not_started
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import artifact_paths

# a command specialist: records that it ran, then writes $HANDOFF_ARTIFACT_PATH itself ("self"),
# returns output.content ("content"), or returns 2 KB of it and no destination ("big": stored in
# its own folder artifacts/<id>/ by the 1 KB rule)
SPEC = """
import json, os, sys
doc = json.load(sys.stdin)
mode = doc["input"]["data"]["mode"]
with open(os.path.join(os.environ["HANDOFFD_ROOT"], "ran.txt"), "a") as f:
    f.write(doc["handoff_id"] + "\\n")
if mode == "self":
    with open(os.environ["HANDOFF_ARTIFACT_PATH"], "w") as f:
        f.write('{"self": 1}')
    print(json.dumps({"status": "completed", "output": {"note": "wrote"}}))
else:
    content = {"x": "y" * (2048 if mode == "big" else 1)}
    print(json.dumps({"status": "completed", "output": {"content": content}}))
"""
CONFIG = """
[daemon]
durability = "fast"
[specialists."@w"]
command = ["{python}", "{spec}"]
timeout_seconds = 20
retry = {{ max_retries = 2, retry_delay_seconds = 0.1 }}
"""


def _workspace(tmp_path: Path) -> Workspace:
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    return new_workspace(tmp_path / "ws", CONFIG.format(python=sys.executable, spec=spec))


def _request(ws: Workspace, handoff_id: str, destination: str | None, mode: str) -> None:
    doc: dict[str, Any] = {"handoff_id": handoff_id, "source": {"agent_id": "@cli"},
                           "target": {"agent_id": "@w"}, "input": {"data": {"mode": mode}}}
    if destination is not None:
        doc["expected_output"] = {"destination": destination}
    ws.handoff("create", "--file", "-", input=json.dumps(doc), check=True)


def _ran(ws: Workspace) -> list[str]:
    ran = ws.root / "ran.txt"
    return ran.read_text().split() if ran.exists() else []


def _error(ws: Workspace, handoff_id: str) -> dict[str, Any]:
    return ws.doc(handoff_id)["error"]


# ---------------------------------------------------------------- 1: the system refuses it
def test_a_destination_the_system_refuses_is_failed_once_not_stranded(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    try:
        long_name = "artifacts/p/" + "b" * 300 + ".json"  # a file name over NAME_MAX
        long_path = "artifacts/" + "/".join(["a" * 200] * 25) + "/x.json"  # over PATH_MAX
        _request(ws, "name", long_name, "content")
        _request(ws, "path", long_path, "self")
        proc = ws.handoffd("run", "-q", "--max-seconds", "60", timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "left where they were" not in proc.stderr, proc.stderr
        for handoff_id in ("name", "path"):
            assert ws.state_of(handoff_id) == ["failed"], (handoff_id, proc.stderr)
            error = _error(ws, handoff_id)
            assert error["code"] == ErrorCode.VALIDATION_FAILED, error
            assert "File name too long (ENAMETOOLONG)" in error["message"], error
            assert "\n" not in error["message"] and len(error["message"]) < 600, error
            assert ws.doc(handoff_id)["retry_available"] is False
        assert _ran(ws) == []  # refused before the handler started
        # the next run finds nothing interrupted
        again = ws.handoffd("run", "-q", "--max-seconds", "30", timeout=120)
        assert "interrupted" not in again.stderr, again.stderr
    finally:
        ws.cleanup()


def _job_with_mkdir_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            exc: OSError) -> tuple[Any, Any]:
    """(engine, job): a claimed request whose destination folder ``artifacts/deep/`` the
    system refuses to make with ``exc``."""
    engine, _ = memory_engine(tmp_path, Clock(), {
        "@w": lambda doc, ctx: {"status": "completed", "output": {"content": "x"}}})
    engine.submit({"handoff_id": "d1", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@w"}, "input": {"data": {}},
                   "expected_output": {"destination": "artifacts/deep/er/out.json"}})
    real_mkdir = pathlib.Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if "artifacts/deep" in str(self):
            raise exc
        real_mkdir(self, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    return engine, engine.take("d1")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENAMETOOLONG, errno.EPERM])
def test_a_refused_folder_fails_the_attempt_for_good(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     code: int) -> None:
    engine, job = _job_with_mkdir_failing(tmp_path, monkeypatch,
                                          OSError(code, os.strerror(code)))
    outcome = engine.run(job)  # it raised the OSError: the claim was stranded
    assert outcome.error["code"] == ErrorCode.VALIDATION_FAILED, outcome.error
    assert not engine.retryable(outcome)
    message = outcome.error["message"]
    assert f"({errno.errorcode[code]})" in message and "artifacts/deep/er/out.json" in message
    assert "\n" not in message and not_started(job.context) is None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENOMEM])
def test_a_passing_shortage_making_the_folder_hands_the_attempt_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    engine, job = _job_with_mkdir_failing(tmp_path, monkeypatch,
                                          OSError(code, os.strerror(code)))
    outcome = engine.run(job)
    shortage = not_started(job.context)
    assert shortage is not None and shortage.reason == errno.errorcode[code], outcome.error
    assert job.context.handback and outcome.error["retryable"] is True
    assert "artifacts/deep/er/out.json" in outcome.error["message"]


def test_an_io_error_making_the_folder_is_a_retried_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, job = _job_with_mkdir_failing(tmp_path, monkeypatch,
                                          OSError(errno.EIO, os.strerror(errno.EIO)))
    outcome = engine.run(job)
    assert outcome.error["code"] == ErrorCode.PROCESSING_ERROR, outcome.error
    assert engine.retryable(outcome) and not_started(job.context) is None


SITE = """
import errno, os, pathlib
_mkdir = pathlib.Path.mkdir
def mkdir(self, *args, **kwargs):
    mark = os.environ.get("FULL_MARK", "")
    if mark and "artifacts/full" in str(self) and not os.path.exists(mark):
        open(mark, "w").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _mkdir(self, *args, **kwargs)
pathlib.Path.mkdir = mkdir
"""


def test_a_full_disk_making_the_folder_hands_back_and_the_run_finishes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    ws = _workspace(tmp_path)
    try:
        _request(ws, "full", "artifacts/full/out.json", "content")
        monkeypatch.setenv("PYTHONPATH", str(site))
        monkeypatch.setenv("FULL_MARK", str(tmp_path / "once"))
        proc = ws.handoffd("run", "--max-seconds", "60", timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert (tmp_path / "once").exists()  # the fault was met
        assert ws.state_of("full") == ["completed"], proc.stderr
        events = [e["event"] for e in ws.doc("full")["handoffd"]["history"]]
        assert "handed_back" in events, events
        assert _ran(ws) == ["full"]
        assert (ws.root / "artifacts" / "full" / "out.json").is_file()
    finally:
        ws.cleanup()


def test_writing_content_to_a_refused_destination_is_a_refusal_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.backends.files import fsio
    from handoffd.core import results as results_module
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.001)  # (a disk that stays full)
    engine, _ = memory_engine(tmp_path, Clock(), {
        "@w": lambda doc, ctx: {"status": "completed", "output": {"content": {"a": 1}}}})
    real_replace = fsio.replace
    fault = [errno.ENAMETOOLONG]

    def replace(target: Any, *args: Any, **kwargs: Any) -> Any:
        if str(target).endswith("out.json"):
            raise OSError(fault[0], os.strerror(fault[0]))
        return real_replace(target, *args, **kwargs)
    monkeypatch.setattr(fsio, "replace", replace)
    for n, code in enumerate((errno.ENAMETOOLONG, errno.ENOSPC)):
        fault[0] = code
        engine.submit({"handoff_id": f"w{n}", "source": {"agent_id": "@t"},
                       "target": {"agent_id": "@w"}, "input": {"data": {}},
                       "expected_output": {"destination": "artifacts/p/out.json"}})
        outcome = engine.run(engine.take(f"w{n}"))
        if code == errno.ENAMETOOLONG:  # every attempt's: refused, naming the destination
            assert outcome.error["code"] == ErrorCode.VALIDATION_FAILED, outcome.error
            assert not engine.retryable(outcome)
            assert "'artifacts/p/out.json' cannot be written" in outcome.error["message"]
        else:  # a full disk that stays full: the result checked again, then a retried failure
            assert outcome.error["code"] == ErrorCode.PROCESSING_ERROR, outcome.error
            assert engine.retryable(outcome)


def test_a_full_disk_storing_content_is_waited_out_without_running_the_handler_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC writing the returned content: the result is stored again after a wait, as after
    a shortage of descriptors; the handler ran once, nothing counted (it was a counted
    PROCESSING_ERROR and the handler, whose work was done, ran again: review RG)."""
    from handoffd.backends.files import fsio
    from handoffd.core import results as results_module
    monkeypatch.setattr(results_module, "RECHECK_SECONDS", 0.01)
    ran: list[str] = []

    def handler(doc: Any, ctx: Any) -> dict[str, Any]:
        ran.append(doc["handoff_id"])
        return {"status": "completed", "output": {"content": {"a": 1}}}
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": handler})
    real_replace = fsio.replace
    full = [2]

    def replace(target: Any, *args: Any, **kwargs: Any) -> Any:
        if str(target).endswith("out.json") and full[0]:
            full[0] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(target, *args, **kwargs)
    monkeypatch.setattr(fsio, "replace", replace)
    engine.submit({"handoff_id": "w", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@w"}, "input": {"data": {}},
                   "expected_output": {"destination": "artifacts/p/out.json"}})
    outcome = engine.run(engine.take("w"))
    assert outcome.status == "completed" and outcome.error is None, outcome.error
    assert ran == ["w"] and full == [0]
    assert outcome.output["artifact_path"] == "artifacts/p/out.json", outcome.output


def test_a_destination_folder_swapped_for_a_symlink_is_not_written_through(
        tmp_path: Path) -> None:
    """/tmp/rc/swap.py: a handler that swaps artifacts/p for a symlink into handoffs/pending/
    while it runs had its output.content written there (a document planted in pending/)."""
    def swap(doc: Any, ctx: Any) -> dict[str, Any]:
        root = Path(ctx.root)
        os.rename(root / "artifacts" / "p", root / "artifacts" / "p-old")
        os.symlink("../handoffs/pending", root / "artifacts" / "p")
        return {"status": "completed", "output": {"content": {"handoff_id": "x"}}}
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": swap})
    (tmp_path / "artifacts" / "p").mkdir(parents=True)
    (tmp_path / "handoffs" / "pending").mkdir(parents=True, exist_ok=True)
    engine.submit({"handoff_id": "s1", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@w"}, "input": {"data": {}},
                   "expected_output": {"destination": "artifacts/p/x.json"}})
    outcome = engine.run(engine.take("s1"))
    assert outcome.error["code"] == ErrorCode.VALIDATION_FAILED, outcome.error
    assert "resolves outside artifacts/" in outcome.error["message"], outcome.error
    assert not (tmp_path / "handoffs" / "pending" / "x.json").exists()


# ---------------------------------------------------------------- 2: a file as its folder
def test_a_destination_named_as_another_handoffs_folder_is_refused(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    try:
        _request(ws, "thief", "artifacts/victim-1", "content")
        _request(ws, "victim-1", None, "big")  # its 2 KB go to artifacts/victim-1/
        proc = ws.handoffd("run", "-q", "--max-seconds", "60", timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert ws.state_of("thief") == ["failed"], proc.stderr
        error = _error(ws, "thief")
        assert error["code"] == ErrorCode.SCHEMA_VALIDATION_FAILED, error
        assert "where the artifact folder of handoff victim-1" in error["message"], error
        assert ws.state_of("victim-1") == ["completed"], _error(ws, "victim-1")
        assert (ws.root / "artifacts" / "victim-1").is_dir()
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- 3: the shared folders' memory
def test_a_remembered_shared_folder_that_becomes_a_handoffs_is_refused(tmp_path: Path) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()

    def resolve(template: str, handoff_id: str) -> str:
        return artifact_paths.resolve_destination(ws, template, handoff_id=handoff_id,
                                                  attempt=1, agent="@w")[0]
    for n in range(3):  # a drain of handoffs all naming the shared folder (and a file)
        resolve(f"artifacts/shared/r-{n}.json", f"h{n}")
        resolve("artifacts/late", f"h{n}")
    # a handoff named as that folder is created meanwhile (well within the old 5 s), and moves
    for state in ("pending", "in-progress", "completed"):
        doc = ws.handoffs / state / "shared.json"
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text("{}")
        for template in ("artifacts/shared/r-9.json", "artifacts/shared/deeper/r.json"):
            with pytest.raises(InvalidDocument) as caught:
                resolve(template, "h9")
            assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED
            assert "lies in artifacts/shared/" in str(caught.value)
        assert resolve("artifacts/shared/mine.json", "shared")  # its own folder: usable
        doc.unlink()
    # a file named as a finished handoff is no one's way (it makes no folder any more: RG);
    # as one not finished yet, it is refused
    (ws.handoffs / "failed" / "late.json").write_text("{}")
    assert resolve("artifacts/late", "h9") == "artifacts/late"
    (ws.handoffs / "pending" / "late.json").write_text("{}")
    with pytest.raises(InvalidDocument):
        resolve("artifacts/late", "h9")
    # a shared folder of a name no handoff bears stays usable, and remembered
    assert resolve("artifacts/shared/r-10.json", "h10") == "artifacts/shared/r-10.json"
    assert (str(ws.root), "shared") in artifact_paths._SHARED


# ---------------------------------------------------------------- 4: a trailing slash
@pytest.mark.parametrize("mode", ["content", "self"])
def test_a_destination_ending_in_a_slash_is_refused(tmp_path: Path, mode: str) -> None:
    ws = _workspace(tmp_path)
    try:
        _request(ws, "slash", "artifacts/p/", mode)
        proc = ws.handoffd("run", "-q", "--max-seconds", "60", timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert ws.state_of("slash") == ["failed"], proc.stderr
        error = _error(ws, "slash")
        assert error["code"] == ErrorCode.SCHEMA_VALIDATION_FAILED, error
        assert "ends in '/'" in error["message"] and "\n" not in error["message"], error
        assert "artifacts/p/out.json" in error["message"]
        assert not (ws.root / "artifacts" / "p").exists()  # no file p written
        assert _ran(ws) == []
    finally:
        ws.cleanup()


@pytest.mark.parametrize("template", ["artifacts/p/", "p/sub/", "artifacts\\p\\", "artifacts/p/.",
                                      "artifacts/p/q/..", "artifacts/", "/", "artifacts/p/x\x00"])
def test_a_destination_naming_no_file_is_refused(tmp_path: Path, template: str) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    with pytest.raises(InvalidDocument) as caught:
        artifact_paths.resolve_destination(ws, template, handoff_id="h1", attempt=1, agent="@w")
    assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED
