"""Contracts enforced by the daemon (seed 004 / issue 6): scope from what really changed,
exclusive ownership while running, success criteria, dependencies, violations log, render.

Subprocess tests drive the real ``handoff`` / ``handoffd`` commands against temporary workspaces
with a small command specialist (``WORKER`` below) whose behaviour comes from the handoff.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.contracts import patterns

WORKER = r'''
import json, os, sys, time
doc = json.load(sys.stdin)
data = (doc.get("input") or {}).get("data") if isinstance(doc.get("input"), dict) else None
if not isinstance(data, dict):
    data = doc.get("script") or {}
root = os.environ["HANDOFFD_ROOT"]
hid = os.environ["HANDOFF_ID"]

def path(rel):
    return rel if os.path.isabs(rel) else os.path.join(root, rel)

def note(event):
    if data.get("log"):
        fd = os.open(data["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (json.dumps({"id": hid, "event": event, "t": time.time()}) + "\n").encode())
        os.close(fd)

note("start")
if data.get("meet") and data.get("log"):  # wait (bounded) until the handoff named has started
    until = time.time() + 20
    while time.time() < until:
        with open(data["log"]) as seen:
            started = []
            for line in seen:
                try:
                    started.append(json.loads(line))
                except ValueError:  # (a line still being appended)
                    pass
        if {"id": data["meet"], "event": "start"} in [
                {"id": e.get("id"), "event": e.get("event")} for e in started]:
            note("met")
            break
        time.sleep(0.02)
time.sleep(float(data.get("sleep", 0)))
for rel, text in (data.get("write") or {}).items():
    os.makedirs(os.path.dirname(path(rel)) or ".", exist_ok=True)
    with open(path(rel), "w") as handle:
        handle.write(text)
for rel in data.get("delete") or []:
    os.unlink(path(rel))
note("end")
result = {"status": data.get("status", "completed"), "output": {"summary": "done"}}
if "files_touched" in data:
    result["output"]["files_touched"] = data["files_touched"]
if result["status"] == "failed":
    result["error"] = {"code": "PROCESSING_ERROR", "message": "asked to fail", "retryable": False}
print(json.dumps(result))
'''

CONFIG = """
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.3
lease_seconds = 30.0
grace_seconds = 5.0
workers = 4

[retry]
max_retries = 2
retry_delay_seconds = 0.2
backoff_multiplier = 1.0

[specialists."@worker"]
command = [{python}, {script}]
timeout_seconds = 30
concurrency = {concurrency}

[specialists."@other"]
command = [{python}, {script}]
timeout_seconds = 30
concurrency = 2
"""

PY = sys.executable


def make_workspace(tmp_path: Path, *, concurrency: int = 2) -> Workspace:
    root = tmp_path / "ws"
    root.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ws = Workspace(root)
    ws.write_config(CONFIG.format(python=json.dumps(PY), script=json.dumps(str(script)),
                                  concurrency=concurrency))
    HandoffdWorkspace(root).ensure()  # the folders, made in-process
    return ws


@pytest.fixture
def cws(tmp_path: Path) -> Iterator[Workspace]:
    ws = make_workspace(tmp_path)
    # a small project tree the contracts talk about
    for rel, text in {"src/auth/service.py": "def login(): pass\n", "src/lib/jwt.py": "SECRET = 1\n",
                      "src/types/user.py": "class User: pass\n", "docs/notes.md": "notes\n"}.items():
        target = ws.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    yield ws
    ws.cleanup()


def native(hid: str, contract: dict[str, Any] | None, data: dict[str, Any], *,
           to: str = "@worker", **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "source": {"agent_id": "@coordinator"},
                           "target": {"agent_id": to}, "input": {"data": data}}
    if contract is not None:
        doc["contract"] = contract
    doc.update(extra)
    return doc


def run_batch(ws: Workspace) -> subprocess.CompletedProcess[str]:
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return proc


def submit_and_run(ws: Workspace, doc: dict[str, Any]) -> dict[str, Any]:
    ws.drop(f"{doc['handoff_id']}.json", doc)
    run_batch(ws)
    return ws.doc(doc["handoff_id"])


def live_reservations(ws: Workspace) -> dict[str, Any]:
    """The live reservations, from the store's shared records (.meta/reservations.json)."""
    path = ws.root / "handoffs" / ".meta" / "reservations.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("live") or {}


def logged(ws: Workspace) -> list[dict[str, Any]]:
    path = ws.root / "handoffs" / ".meta" / "violations.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SCOPE = {"files_owned": ["src/auth/**"], "files_readonly": ["src/types/user.py"]}


# ---------------------------------------------------------------- scope
def test_staying_in_scope_completes_and_records_what_changed(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("in-scope", SCOPE, {
        "write": {"src/auth/service.py": "def login(): return 'jwt'\n", "src/auth/new.py": "x = 1\n"},
        "files_touched": ["src/auth/service.py", "./src/auth/new.py"]}))
    assert cws.state_of("in-scope") == ["completed"], doc.get("error")
    scope = doc["validation"]["scope"]
    assert scope["checked"] is True and scope["mode"] == "hash"
    assert scope["changes"] == [{"path": "src/auth/new.py", "change": "created"},
                                {"path": "src/auth/service.py", "change": "modified"}]
    assert doc["validation"]["violations"] == [] and doc["validation"]["status"] == "passed"
    assert logged(cws) == []
    assert live_reservations(cws) == {}


def test_an_extra_file_fails_with_contract_violation_naming_it(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("creep", SCOPE, {
        "write": {"src/auth/service.py": "ok\n", "src/lib/jwt.py": "SECRET = 2\n",
                  "src/extra.py": "oops\n"}}))
    assert cws.state_of("creep") == ["failed"]
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    message = doc["error"]["message"]
    assert "src/extra.py: created outside files_owned" in message
    assert "src/lib/jwt.py: modified outside files_owned" in message
    assert "src/auth/service.py" not in message
    fields = {(e["field"], e["error"]) for e in doc["validation"]["errors"]}
    assert fields == {("src/extra.py", "created outside files_owned"),
                      ("src/lib/jwt.py", "modified outside files_owned")}
    assert doc["retry_available"] is False and doc["retry_count"] == 0
    assert doc["handoffd"]["attempt"] == 1  # never retried
    (entry,) = logged(cws)
    assert entry["kind"] == "scope_creep" and entry["task_id"] == "creep"
    assert entry["agent"] == "@worker" and entry["source"] == "@coordinator"
    assert {f["path"] for f in entry["details"]["files"]} == {"src/extra.py", "src/lib/jwt.py"}


def test_editing_a_readonly_file_is_a_violation(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("ro", SCOPE, {"write": {"src/types/user.py": "class User: x = 1\n"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    assert "src/types/user.py: modified (read-only)" in doc["error"]["message"]
    assert doc["validation"]["errors"] == [{"field": "src/types/user.py", "kind": "readonly_modified",
                                            "error": "modified (read-only file)"}]
    assert [e["kind"] for e in logged(cws)] == ["readonly_modified"]


def test_deleting_an_owned_file_is_allowed_but_not_an_unowned_one(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("del-ok", SCOPE, {"delete": ["src/auth/service.py"]}))
    assert cws.state_of("del-ok") == ["completed"]
    assert doc["validation"]["scope"]["changes"] == [{"path": "src/auth/service.py", "change": "deleted"}]
    doc = submit_and_run(cws, native("del-bad", SCOPE, {"delete": ["docs/notes.md"]}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    assert "docs/notes.md: deleted outside files_owned" in doc["error"]["message"]


def test_rewriting_identical_content_is_not_a_change(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("same", {"files_owned": []},
                                     {"write": {"src/lib/jwt.py": "SECRET = 1\n"}}))
    assert cws.state_of("same") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes"] == []


def test_lying_in_files_touched_is_reported(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("liar", SCOPE, {
        "write": {"src/auth/a.py": "a\n", "src/auth/b.py": "b\n"},
        "files_touched": ["src/auth/a.py", "src/auth/never.py"]}))
    # a mismatch alone does not fail the handoff (every change was observed and in scope) ...
    assert cws.state_of("liar") == ["completed"]
    (mismatch,) = doc["validation"]["violations"]
    assert mismatch["kind"] == "files_touched_mismatch"
    assert mismatch["not_reported"] == ["src/auth/b.py"] and mismatch["not_observed"] == ["src/auth/never.py"]
    assert any("files_touched does not match" in w for w in doc["warnings"])
    # ... but it is a learning signal
    (entry,) = logged(cws)
    assert entry["kind"] == "files_touched_mismatch" and entry["details"]["not_reported"] == ["src/auth/b.py"]


def test_a_lie_cannot_hide_an_out_of_scope_change(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("hider", SCOPE, {
        "write": {"src/auth/a.py": "a\n", "src/lib/jwt.py": "SECRET = 3\n"},
        "files_touched": ["src/auth/a.py"]}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    kinds = sorted(v["kind"] for v in doc["validation"]["violations"])
    assert kinds == ["files_touched_mismatch", "scope_creep"]
    assert sorted(e["kind"] for e in logged(cws)) == ["files_touched_mismatch", "scope_creep"]


def test_contract_cwd_scopes_paths_and_cannot_escape(cws: Workspace) -> None:
    contract = {"cwd": "src", "files_owned": ["auth/*.py"], "files_readonly": ["types/**"]}
    doc = submit_and_run(cws, native("sub", contract, {"write": {"src/auth/x.py": "x\n",
                                                                 "docs/outside.md": "not watched\n"}}))
    assert cws.state_of("sub") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes"] == [{"path": "auth/x.py", "change": "created"}]
    doc = submit_and_run(cws, native("escape", {"cwd": "../..", "files_owned": []}, {}))
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert "contract.cwd" in doc["error"]["message"]
    doc = submit_and_run(cws, native("abs", {"files_owned": ["/etc/passwd"]}, {}))
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED" and "absolute" in doc["error"]["message"]


def test_git_work_tree_watches_what_git_sees(cws: Workspace) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(cws.root)], check=True, timeout=30)
    (cws.root / ".gitignore").write_text("build/\nhandoffs/\n")
    doc = submit_and_run(cws, native("git-ok", SCOPE, {"write": {"build/out.bin": "ignored\n",
                                                                 "src/auth/y.py": "y\n"}}))
    assert cws.state_of("git-ok") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["mode"] == "git"
    assert doc["validation"]["scope"]["changes"] == [{"path": "src/auth/y.py", "change": "created"}]
    doc = submit_and_run(cws, native("git-bad", SCOPE, {"write": {"notes.txt": "untracked\n"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION" and "notes.txt: created" in doc["error"]["message"]


# ---------------------------------------------------------------- criteria
def _cmd(code: str) -> str:
    return f"{PY} -c \"{code}\""


def test_each_criterion_form_passes_and_prose_stays_unchecked(cws: Workspace) -> None:
    exists = _cmd("import os; assert os.path.isfile('src/auth/ok')")
    criteria = [f"Tests pass: {_cmd('import sys; print(1+1); sys.exit(0)')}",
                f"Type check passes: {exists}",
                f"command succeeds: {PY} -c pass",
                "AuthService.login() returns a JWT token"]
    doc = submit_and_run(cws, native("crit-ok", dict(SCOPE, success_criteria=criteria),
                                     {"write": {"src/auth/ok": "yes\n"}}))
    assert cws.state_of("crit-ok") == ["completed"], doc.get("error")
    results = doc["validation"]["criteria"]
    assert [(r["kind"], r["status"]) for r in results] == [
        ("tests", "passed"), ("type_check", "passed"), ("command", "passed"), ("prose", "unchecked")]
    first = results[0]
    assert first["exit_code"] == 0 and first["output_tail"].strip() == "2"
    assert first["duration_seconds"] >= 0 and first["argv"][0] == PY
    assert logged(cws) == []


@pytest.mark.parametrize("prefix", ["Tests pass:", "Type check passes:", "Command succeeds:"])
def test_each_criterion_form_fails_with_validation_failed(cws: Workspace, prefix: str) -> None:
    hid = "crit-" + prefix.split()[0].lower()
    criteria = [f"{prefix} {_cmd('import sys; print(42); sys.exit(3)')}", "Looks nice"]
    doc = submit_and_run(cws, native(hid, {"success_criteria": criteria}, {}))
    assert doc["error"]["code"] == "VALIDATION_FAILED"
    assert "exited 3" in doc["error"]["message"]
    failed, prose = doc["validation"]["criteria"]
    assert failed["status"] == "failed" and failed["exit_code"] == 3 and "42" in failed["output_tail"]
    assert prose["status"] == "unchecked"
    assert doc["retry_available"] is False and doc["handoffd"]["attempt"] == 1
    (entry,) = logged(cws)
    assert entry["kind"] == "criteria_failed" and entry["details"]["criteria"][0]["exit_code"] == 3


def test_criteria_time_limit_missing_command_and_scope_first(cws: Workspace) -> None:
    contract = {"success_criteria": [f"Tests pass: {_cmd('import time; time.sleep(30)')}",
                                     "Command succeeds: no-such-program-xyz --flag"],
                "criteria_timeout_seconds": 0.5}
    started = time.monotonic()
    doc = submit_and_run(cws, native("crit-slow", contract, {}))
    assert time.monotonic() - started < 20
    slow, missing = doc["validation"]["criteria"]
    assert slow["status"] == "failed" and slow["timed_out"] is True
    assert missing["status"] == "failed" and missing["exit_code"] is None
    assert "timed out" in doc["error"]["message"]
    # criteria are not run when the scope was broken
    doc = submit_and_run(cws, native("crit-scope", dict(SCOPE, success_criteria=[f"Tests pass: {PY} -c pass"]),
                                     {"write": {"stray.txt": "x"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    assert doc["validation"]["criteria"][0]["status"] == "unchecked"


def test_criteria_never_use_a_shell(cws: Workspace) -> None:
    marker = cws.root / "src" / "auth" / "pwned"
    doc = submit_and_run(cws, native("noshell", dict(SCOPE, success_criteria=[
        f"Command succeeds: {PY} -c pass ; touch {marker}"]), {}))
    assert not marker.exists()
    assert doc["validation"]["criteria"][0]["argv"][2:] == ["pass", ";", "touch", str(marker)]


# ---------------------------------------------------------------- dependencies
def test_unmet_dependency_fails_with_dependency_missing(cws: Workspace) -> None:
    contract = dict(SCOPE, dependencies_completed=["bd-0"])
    doc = submit_and_run(cws, native("needs-dep", contract, {"write": {"src/auth/z.py": "z"}}))
    assert doc["error"]["code"] == "DEPENDENCY_MISSING" and "bd-0" in doc["error"]["message"]
    assert not (cws.root / "src" / "auth" / "z.py").exists()  # never ran
    (entry,) = logged(cws)
    assert entry["kind"] == "dependency_missing" and entry["details"]["dependencies"] == ["bd-0"]
    # a completed dependency lets it run (created through the CLI, which checks it exists)
    submit_and_run(cws, native("bd-1", None, {}))
    path = cws.root / "dep.json"
    path.write_text(json.dumps(native("with-dep", dict(SCOPE, dependencies_completed=["bd-1"]), {})))
    assert cws.create("--file", str(path)) == "with-dep"
    run_batch(cws)
    assert cws.state_of("with-dep") == ["completed"]
    path.write_text(json.dumps(native("bad-dep", dict(SCOPE, dependencies_completed=["nope"]), {})))
    proc = cws.handoff("create", "--file", str(path))
    assert proc.returncode == 1 and "nope" in proc.stderr


# ---------------------------------------------------------------- exclusive ownership
def _intervals(log: Path) -> dict[str, tuple[float, float]]:
    spans: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        item = json.loads(line)
        spans.setdefault(item["id"], {})[item["event"]] = item["t"]
    return {hid: (s["start"], s["end"]) for hid, s in spans.items()}


def _overlapping(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_overlapping_contracts_never_run_at_once(cws: Workspace, tmp_path: Path) -> None:
    log = tmp_path / "times.jsonl"
    owned = {"a1": ["src/auth/**"], "a2": ["src/auth/service.py"], "a3": ["src/*/service.py"],
             "b1": ["docs/**"], "b2": ["src/lib/**"]}
    for hid, files in owned.items():
        cws.drop(f"{hid}.json", native(hid, {"files_owned": files},
                                       {"sleep": 0.5, "log": str(log)}))
    for _ in range(5):  # a handed-back claim waits for the next batch (another process held it)
        run_batch(cws)
        if all(cws.state_of(h) == ["completed"] for h in owned):
            break
    assert all(cws.state_of(h) == ["completed"] for h in owned), {h: cws.state_of(h) for h in owned}
    spans = _intervals(log)
    for x, y in (("a1", "a2"), ("a1", "a3"), ("a2", "a3")):
        assert not _overlapping(spans[x], spans[y]), (x, y, spans)
    # every attempt counted once: a lost reservation race hands the claim back uncounted
    assert all(cws.doc(h)["handoffd"]["attempt"] == 1 for h in owned)
    assert live_reservations(cws) == {}


def test_two_daemons_share_the_rule_and_ls_shows_the_wait(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, concurrency=2)
    log = tmp_path / "times.jsonl"
    try:
        # (6 s: ls below must meet it running; on a loaded machine 2 s once ran out first)
        ws.drop("first.json", native("first", {"files_owned": ["shared/**"]},
                                     {"sleep": 6.0, "log": str(log), "write": {"shared/a": "1"}}))
        one = ws.serve()
        ws.wait_state("first", ("in-progress",), timeout=20)
        deadline = time.monotonic() + 10
        while "first" not in live_reservations(ws) and time.monotonic() < deadline:
            time.sleep(0.02)
        ws.drop("second.json", native("second", {"files_owned": ["shared/a"]},
                                      {"sleep": 0.3, "log": str(log), "write": {"shared/a": "2"}}))
        rows = {r["id"]: r for r in json.loads(ws.handoff("ls", "--json").stdout)}
        assert rows["second"]["state"] == "pending"
        assert rows["second"]["note"] == "waiting for files owned by first: shared/** (overlaps shared/a)"
        two = ws.serve()
        for hid in ("third", "fourth"):
            ws.drop(f"{hid}.json", native(hid, {"files_owned": ["shared/**"]},
                                          {"sleep": 0.3, "log": str(log), "write": {f"shared/{hid}": hid}}))
        for hid in ("first", "second", "third", "fourth"):
            assert ws.wait_state(hid, timeout=40) == "completed", ws.doc(hid).get("error")
        ws.stop(one)
        ws.stop(two)
    finally:
        ws.cleanup()
    spans = _intervals(log)
    ids = sorted(spans)
    for i, x in enumerate(ids):
        for y in ids[i + 1:]:
            assert not _overlapping(spans[x], spans[y]), (x, y, spans)


def test_disjoint_contracts_run_in_parallel_without_blaming_each_other(cws: Workspace, tmp_path: Path) -> None:
    log = tmp_path / "times.jsonl"
    # each waits (up to 20 s) until the other has started: both meet only if they run at once
    # (timed spans flaked on a loaded machine, where one's process started 0.6 s late)
    cws.drop("p1.json", native("p1", {"files_owned": ["src/auth/**"]},
                               {"meet": "p2", "log": str(log), "write": {"src/auth/p1": "1"}}))
    cws.drop("p2.json", native("p2", {"files_owned": ["src/lib/**"]},
                               {"meet": "p1", "log": str(log), "write": {"src/lib/p2": "2"}}))
    run_batch(cws)
    for hid in ("p1", "p2"):
        doc = cws.doc(hid)
        assert cws.state_of(hid) == ["completed"], doc.get("error")
    met = {e["id"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "met"}
    assert met == {"p1", "p2"}, log.read_text()  # concurrency 2: they ran together
    excused = cws.doc("p1")["validation"]["scope"]["excused"] + cws.doc("p2")["validation"]["scope"]["excused"]
    assert {(e["path"], e["owner"]) for e in excused} <= {("src/lib/p2", "p2"), ("src/auth/p1", "p1")}


def test_a_dead_owners_reservation_does_not_block_and_is_swept(cws: Workspace) -> None:
    records = cws.root / "handoffs" / ".meta" / "reservations.json"
    records.parent.mkdir(parents=True, exist_ok=True)
    # its handoff is not in progress: the owner is gone
    records.write_text(json.dumps({"live": {"ghost": {
        "handoff_id": "ghost", "token": "t0", "patterns": ["src/**"],
        "taken_at": time.time() - 5}}}))
    doc = submit_and_run(cws, native("after-ghost", {"files_owned": ["src/auth/**"]},
                                     {"write": {"src/auth/g.py": "g"}}))
    assert cws.state_of("after-ghost") == ["completed"], doc.get("error")
    assert "ghost" not in live_reservations(cws)  # the batch's sweep retired it


def test_scope_ignore_is_not_watched(cws: Workspace) -> None:
    doc = submit_and_run(cws, native("ign", {"files_owned": ["src/auth/**"],
                                             "scope_ignore": [".cache", "**/*.log"]},
                                     {"write": {".cache/x/y": "1", "src/lib/run.log": "2"}}))
    assert cws.state_of("ign") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes"] == []


# ---------------------------------------------------------------- seed 004 documents
def worker_handoff(task: str, contract: dict[str, Any], script: dict[str, Any]) -> dict[str, Any]:
    return {
        "contract": dict({"task_id": task, "files_owned": [], "files_readonly": [],
                          "dependencies_completed": [], "success_criteria": []}, **contract),
        "context": {"epic_summary": "Add OAuth authentication to user service",
                    "your_role": "Implement AuthService with JWT token generation",
                    "what_others_did": "bd-123.1 created User schema",
                    "what_comes_next": "bd-123.3 will integrate this service into API routes"},
        "escalation": {"blocked_contact": "coordinator",
                       "scope_change_protocol": "swarmmail_send(subject='Scope Change', ack_required=true)"},
        "to_agent": "@worker", "script": script,
    }


def test_swarm_worker_handoff_reports_violations_and_criteria(cws: Workspace, tmp_path: Path) -> None:
    doc = worker_handoff("bd-9.1", {"files_owned": ["src/auth/service.py"],
                                    "files_readonly": ["src/types/user.py"],
                                    "success_criteria": [f"Tests pass: {PY} -c pass", "Works"]},
                         {"write": {"src/auth/service.py": "v2\n", "src/lib/jwt.py": "SECRET = 9\n"},
                          "files_touched": ["src/auth/service.py"]})
    path = tmp_path / "wh.json"
    path.write_text(json.dumps(doc))
    assert cws.create("--file", str(path)) == "bd-9.1"
    run_batch(cws)
    report = cws.doc("bd-9.1")
    assert cws.state_of("bd-9.1") == ["failed"]
    assert report["error"]["code"] == "CONTRACT_VIOLATION" and report["valid"] is False
    assert any(isinstance(v, dict) and v.get("path") == "src/lib/jwt.py" for v in report["violations"])
    kinds = {e["kind"] for e in logged(cws)}
    assert kinds == {"scope_creep", "files_touched_mismatch"}
    ok = worker_handoff("bd-9.2", {"files_owned": ["src/auth/**"],
                                   "success_criteria": [f"Tests pass: {PY} -c pass", "Works"]},
                        {"write": {"src/auth/service.py": "v3\n"}, "files_touched": ["src/auth/service.py"]})
    path.write_text(json.dumps(ok))
    cws.create("--file", str(path))
    run_batch(cws)
    report = cws.doc("bd-9.2")
    assert cws.state_of("bd-9.2") == ["completed"], report.get("error")
    assert [(c["criterion"].split(":")[0], c["status"]) for c in report["success_criteria"]] == [
        ("Tests pass", "passed"), ("Works", "unchecked")]


# ---------------------------------------------------------------- CLI: violations, render
def test_violations_command_summarises_per_agent_kind_and_day(cws: Workspace) -> None:
    submit_and_run(cws, native("v1", SCOPE, {"write": {"x.txt": "1"}}))
    submit_and_run(cws, native("v2", {"success_criteria": [f"Command succeeds: {PY} -c 'raise SystemExit(1)'"]},
                               {}, to="@other"))
    submit_and_run(cws, native("v3", SCOPE, {"write": {"src/types/user.py": "changed"}}))
    proc = cws.handoff("violations", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["total"] == 3
    assert summary["by_kind"] == {"criteria_failed": 1, "readonly_modified": 1, "scope_creep": 1}
    assert summary["by_agent"]["@worker"] == {"total": 2, "tasks": 2, "readonly_modified": 1, "scope_creep": 1}
    assert summary["by_agent"]["@other"]["criteria_failed"] == 1
    (day,) = summary["by_day"]
    assert summary["by_day"][day]["total"] == 3
    only = json.loads(cws.handoff("violations", "--json", "--agent", "@other").stdout)
    assert only["total"] == 1 and list(only["by_agent"]) == ["@other"]
    later = json.loads(cws.handoff("violations", "--json", "--since", "2999-01-01").stdout)
    assert later["total"] == 0
    human = cws.handoff("violations").stdout
    assert "per agent" in human and "@worker" in human and "scope_creep" in human
    bad = cws.handoff("violations", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "--since" in bad.stderr


def test_render_prints_a_compact_envelope(cws: Workspace, tmp_path: Path) -> None:
    doc = worker_handoff("bd-123.2", {"files_owned": ["src/auth/service.py", "src/auth/service.test.ts"],
                                      "files_readonly": ["src/types/user.ts", "src/lib/jwt.ts"],
                                      "dependencies_completed": [],
                                      "success_criteria": ["AuthService.login() returns JWT token",
                                                           "Tests pass: bun test src/auth/service.test.ts",
                                                           "Type check passes: tsc --noEmit"]}, {})
    path = tmp_path / "wh.json"
    path.write_text(json.dumps(doc))
    cws.create("--file", str(path))
    proc = cws.handoff("render", "bd-123.2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) < 50
    start = lines.index("{")
    end = len(lines) - 1 - lines[::-1].index("}")
    envelope = json.loads("\n".join(lines[start:end + 1]))
    assert envelope["contract"] == doc["contract"]
    assert envelope["context"] == doc["context"] and envelope["escalation"] == doc["escalation"]
    assert "@worker" in lines[0] and "files_touched" in proc.stdout and "coordinator" in proc.stdout
    as_json = json.loads(cws.handoff("render", "bd-123.2", "--json").stdout)
    assert set(as_json) == {"contract", "context", "escalation"}
    # a native document with a contract renders too; one without a contract is an error
    cws.drop("nat.json", native("nat", SCOPE, {}, context={"your_role": "fix login"}))
    nat = json.loads(cws.handoff("render", "nat", "--json").stdout)
    assert nat["contract"]["task_id"] == "nat" and nat["context"] == {"your_role": "fix login"}
    cws.drop("plain.json", native("plain", None, {}))
    proc = cws.handoff("render", "plain")
    assert proc.returncode == 1 and "no contract" in proc.stderr
    assert cws.handoff("render", "missing").returncode == 3


# ---------------------------------------------------------------- patterns (in-process)
@pytest.mark.parametrize("pattern,path,expected", [
    ("src/auth/**", "src/auth/a/b.py", True), ("src/auth", "src/auth/x", True),
    ("src/*.py", "src/a.py", True), ("src/*.py", "src/d/a.py", False),
    ("**/*.py", "a.py", True), ("a/**/b", "a/x/y/b", True), ("out/**", "outx", False),
    (".", "anything", True), ("[!a]b", "ab", False),
])
def test_pattern_matching(pattern: str, path: str, expected: bool) -> None:
    assert patterns.matches(pattern, path) is expected


@pytest.mark.parametrize("a,b,expected", [
    ("src/auth/**", "src/auth/service.py", True), ("src/*.py", "src/*.ts", False),
    ("src/a*", "src/b*", False), ("src/*/service.py", "src/auth/**", True),
    ("docs/**", "src/**", False), ("**", "x", True), ("a/**/x", "a/b/y", True),
])
def test_pattern_overlap_is_conservative(a: str, b: str, expected: bool) -> None:
    assert patterns.overlap(a, b) is expected and patterns.overlap(b, a) is expected
