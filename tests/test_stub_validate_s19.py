"""Failure stubs validate (session 19, S1): the native failure document handoffd files under the
name of a dropped file it set aside unread has no ``target`` (nobody read one), and ``handoff
validate`` rejected it with "has no target.agent_id", though every document handoffd writes must
validate. A stub is now its own kind of document: recognised by handoffd's sealed bookkeeping
(the one ``rejected`` event), checked by the rules for a stub, never routed. A document from
outside that merely lacks a target, or looks like a stub without this workspace's seal, is
rejected as before."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace, exe, new_workspace
from test_postgres import pg_workspace

from handoffd.core.native_format import STUB_RECOVERY, stub_code, stub_problems

DEEP = "[" * 70 + "]" * 70
# file name -> (what is dropped, the code it is set aside with)
DROPS: dict[str, tuple[bytes, str]] = {
    "bad": (b'{"handoff_id": ', "MALFORMED_JSON"),
    "junk": (b"\xff\xfe", "NOT_UTF8"),
    "mism": (json.dumps({"handoff_id": "other", "target": {"agent_id": "@flaky"}}).encode(),
             "ID_MISMATCH"),
    "deep": (('{"handoff_id": "deep", "target": {"agent_id": "@flaky"}, "input": {"data": '
              + DEEP + "}}").encode(), "DOCUMENT_TOO_DEEP"),
}


@pytest.fixture(scope="module")
def stubbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """A workspace where one batch set aside each of :data:`DROPS` and filed its stub."""
    space = new_workspace(tmp_path_factory.mktemp("s1") / "ws", FLAKY_TOML)
    for name, (data, _) in DROPS.items():
        space.drop(f"{name}.json", data)
    ran = space.handoffd("run")
    assert "Traceback" not in ran.stderr, ran.stderr
    yield space
    space.cleanup()


def validate(space: Workspace, *args: Path | str, root: Path | None = None) -> Any:
    """``handoff validate ARGS --root ROOT`` (the workspace's by default)."""
    return subprocess.run([exe("handoff"), "validate", *map(str, args), "--root",
                           str(root or space.root)], capture_output=True, text=True, timeout=60)


def failed(space: Workspace, handoff_id: str) -> Path:
    return space.root / "handoffs" / "failed" / f"{handoff_id}.json"


def test_every_stub_handoffd_files_validates_as_a_stub(stubbed: Workspace) -> None:
    files = [failed(stubbed, name) for name in DROPS]
    shown = validate(stubbed, *files)
    assert shown.returncode == 0, shown.stdout + shown.stderr  # was 1: "has no target.agent_id"
    assert "Traceback" not in shown.stderr
    for name, (_, code) in DROPS.items():
        assert (f"{failed(stubbed, name)}: valid (a failure stub: the dropped file was set aside "
                f"as {code})") in shown.stdout.splitlines(), shown.stdout
    as_json = json.loads(validate(stubbed, "--json", *files).stdout)
    assert [(i["valid"], i["dialect"], i["stub"]) for i in as_json] == [
        (True, "native", code) for _, code in DROPS.values()]


def test_a_stub_advises_resubmitting_the_file_not_retrying(stubbed: Workspace) -> None:
    doc = json.loads(failed(stubbed, "bad").read_text())
    assert "target" not in doc and doc["status"] == "failed"
    assert doc["error"]["code"] == "MALFORMED_JSON" and doc["retry_available"] is False
    # was "Inspect the error and retry the handoff": a retry has no request to run
    assert doc["recovery_actions"] == STUB_RECOVERY
    shown = stubbed.handoff("show", "bad")
    assert shown.returncode == 0 and "MALFORMED_JSON" in shown.stdout, shown.stderr


def test_a_document_from_outside_lacking_a_target_is_rejected(stubbed: Workspace,
                                                               tmp_path: Path) -> None:
    genuine = json.loads(failed(stubbed, "bad").read_text())
    # a seal handoffd never made; a genuine seal for another id; no bookkeeping at all
    forged = dict(genuine, handoffd=dict(genuine["handoffd"], seal="0" * 32))
    renamed = dict(genuine, handoff_id="renamed")
    unsealed = {k: v for k, v in genuine.items() if k != "handoffd"}
    for name, doc in (("forged", forged), ("renamed", renamed), ("unsealed", unsealed)):
        path = failed(stubbed, name)
        path.write_text(json.dumps(doc))
        try:
            shown = validate(stubbed, path)
        finally:
            path.unlink()
        assert shown.returncode == 1, (name, shown.stdout)
        if name == "unsealed":  # native only by its bookkeeping: in no format without it
            assert "invalid (unknown format)" in shown.stdout, shown.stdout
            continue
        assert "invalid (native)" in shown.stdout and "has no target.agent_id" in shown.stdout
        assert "calls it a failure stub" in shown.stdout, shown.stdout
    # a genuine stub copied elsewhere: with no workspace to check its seal, or another's, refused
    copy = tmp_path / "copy.json"
    shutil.copy(failed(stubbed, "bad"), copy)
    nowhere = validate(stubbed, copy, root=tmp_path / "no-workspace")
    assert nowhere.returncode == 1 and "no workspace here to check its seal" in nowhere.stdout
    other = new_workspace(tmp_path / "other", FLAKY_TOML)
    other.handoffd("sweep")  # (makes its own seal key)
    elsewhere = validate(stubbed, copy, root=other.root)
    assert elsewhere.returncode == 1 and "does not vouch for it" in elsewhere.stdout
    # and in its own workspace the copy is the stub it is
    assert validate(stubbed, copy).returncode == 0


def test_a_sealed_stub_that_breaks_the_rules_for_a_stub_is_invalid(stubbed: Workspace) -> None:
    genuine = json.loads(failed(stubbed, "junk").read_text())
    edits: dict[str, Any] = {
        "error.code": dict(genuine, error=dict(genuine["error"], code="PROCESSING_ERROR")),
        "status": dict(genuine, status="cancelled"),
        "retry_count": dict(genuine, retry_count="none"),  # the failure schema's rules hold too
    }
    path = failed(stubbed, "junk")
    try:
        for field, doc in edits.items():
            path.write_text(json.dumps(doc))  # (the seal covers id, revision and folder only)
            shown = validate(stubbed, path)
            assert shown.returncode == 1, (field, shown.stdout)
            assert "not a valid failure stub" in shown.stdout and f"  {field}:" in shown.stdout
    finally:
        path.write_text(json.dumps(genuine))
    assert validate(stubbed, path).returncode == 0


def _stub(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "handoff_id": "x", "status": "failed", "error": {"code": "NOT_UTF8"},
        "handoffd": {"revision": 1, "dialect": "native", "history": [
            {"at": "2026-11-27T00:00:00Z", "event": "rejected", "detail": {"code": "NOT_UTF8"}}]}}
    doc.update(changes)
    return doc


def test_stub_code_reads_only_the_one_rejected_event_of_a_document_with_no_target() -> None:
    assert stub_code(_stub()) == "NOT_UTF8"
    assert stub_code(_stub(target={"agent_id": "@a"})) is None  # a request's failure
    claimed = _stub()
    claimed["handoffd"]["history"].append({"at": "2026-11-27T00:00:01Z", "event": "claimed"})
    assert stub_code(claimed) is None  # a retried stub, claimed since: no stub any more
    assert stub_code(_stub(handoffd={"history": [{"event": "rejected"}]})) is None
    assert stub_code(_stub(handoffd={"history": "rejected"})) is None
    assert stub_code(_stub(handoffd=None)) is None
    assert stub_problems(_stub(), "NOT_UTF8") == []
    assert [p["field"] for p in stub_problems(_stub(status="cancelled"), "NOT_UTF8")] == ["status"]
    assert [p["field"] for p in stub_problems(_stub(error={"code": "NOT_UTF8"}), "MADE_UP")] == [
        "error.code", "error.code"]
    assert [p["field"] for p in stub_problems(_stub(handoffd={}), "NOT_UTF8")] == [
        "handoffd.dialect"]


def test_the_postgres_bridge_stub_validates_as_a_stub(tmp_path: Path, pg_url: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url)
    space.drop("pgbad.json", b'{"handoff_id": ')
    ran = space.handoffd("run")
    assert "Traceback" not in ran.stderr, ran.stderr
    doc = json.loads(failed(space, "pgbad").read_text())
    assert doc["recovery_actions"] == STUB_RECOVERY
    shown = validate(space, failed(space, "pgbad"))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert ("valid (a failure stub: the dropped file was set aside as MALFORMED_JSON)"
            in shown.stdout), shown.stdout


def test_retry_refuses_a_stub_even_with_force(tmp_path: Path) -> None:
    """A stub has no request to run: `retry --force` requeued it, and the next batch filed it
    again as SCHEMA_VALIDATION_FAILED ("Missing required field 'target'"), replacing the stub."""
    space = new_workspace(tmp_path / "ws", FLAKY_TOML)
    space.drop("bad.json", DROPS["bad"][0])
    space.handoffd("run")
    before = failed(space, "bad").read_bytes()
    for args in (("bad",), ("bad", "--force"), ("--all-failed", "--force")):
        tried = space.handoff("retry", *args)
        # (--all-failed says it skipped what it cannot retry, exit 0: session 20)
        assert tried.returncode == (0 if "--all-failed" in args else 1), (args, tried.stderr)
        assert "failure stub" in tried.stderr and "MALFORMED_JSON" in tried.stderr, tried.stderr
        assert "Traceback" not in tried.stderr and tried.stdout == ""
    assert space.state_of("bad") == ["failed"]
    assert failed(space, "bad").read_bytes() == before
