"""One shared context and one violations log for every host of a PostgreSQL store (issue 13):
two daemons with workspaces of their own on one database. A specialist on host A sets a context
key and a handoff on host B reads it, from the database and from B's ``context/`` mirror; a
compare-and-set conflicts across hosts; a file-only agent's ``context/<key>.json`` on B reaches
A; a contract violation on A is listed by ``handoff violations`` on B."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import FLAKY_TOML, Workspace, exe

from handoffd.core.workspace import Workspace as HandoffdWorkspace

DAEMON = FLAKY_TOML.split('[specialists."@flaky"]')[0]
NAMESPACES = '\n[namespaces."plans"]\nwriters = ["@setter"]\n'  # every host: the same table

HANDLERS = '''
def setter(doc, ctx):
    entry = ctx.context.set("plans/current", doc["input"]["data"]["value"])
    return {"status": "completed", "output": {"revision": entry["revision"]}}
'''

READER = f'''
import json, os, subprocess, sys
json.load(sys.stdin)
root = os.environ["HANDOFFD_ROOT"]
with open(os.path.join(root, "context", "plans", "current.json"), "rb") as handle:
    text = handle.read().decode()
got = subprocess.run([{exe("handoff")!r}, "context", "get", "plans/current", "--with-revision",
                      "--root", root], capture_output=True, text=True, timeout=30)
print(json.dumps({{"status": "completed",
                   "output": {{"file": text, "cli": json.loads(got.stdout or "null")}}}}))
'''

WORKER = '''
import json, os, sys
json.load(sys.stdin)
path = os.path.join(os.environ["HANDOFFD_ROOT"], "src", "lib", "jwt.py")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as handle:
    handle.write("SECRET = 2\\n")
print(json.dumps({"status": "completed", "output": {"summary": "done"}}))
'''


def host(root: Path, url: str, specialists: str = "") -> Workspace:
    root.mkdir(parents=True)
    space = Workspace(root)
    space.write_config(DAEMON + specialists + NAMESPACES + f'\n[store]\nurl = "{url}"\n')
    HandoffdWorkspace(root).ensure()
    return space


def command(script: Path) -> str:
    return f"command = [{json.dumps(sys.executable)}, {json.dumps(str(script))}]\n"


def eventually(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """Poll ``check`` (bounded) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.heavy
def test_one_context_for_every_host(tmp_path: Path, pg_url: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ctx_handlers.py").write_text(HANDLERS)
    (tmp_path / "reader.py").write_text(READER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    host_a = host(tmp_path / "a", pg_url, '[specialists."@setter"]\nhandler = "ctx_handlers:setter"\n')
    host_b = host(tmp_path / "b", pg_url, '[specialists."@reader"]\n'
                  + command(tmp_path / "reader.py"))
    try:
        host_a.serve()
        host_b.serve()
        # a specialist on A sets a key (the handoff is created on B: the database routes it)
        value = {"zeta": 1, "a": [1, 2]}
        setting = host_b.create("--from", "@t", "--to", "@setter", "--data",
                                json.dumps({"value": value}))
        assert host_b.handoff("wait", setting, "--timeout", "30").returncode == 0
        # a handoff on B reads it: from its context/ mirror, and through the database
        reading = host_b.create("--from", "@t", "--to", "@reader")
        assert host_b.handoff("wait", reading, "--timeout", "30").returncode == 0
        output = json.loads(host_b.handoff("show", reading, "--json", check=True).stdout)[
            "document"]["output"]
        assert json.loads(output["file"]) == value and list(json.loads(output["file"])) == ["zeta", "a"]
        assert output["cli"] == {"key": "plans/current", "revision": 1, "value": value}
        assert read_json(host_b.root / "context" / "plans" / "current.json") == value
        eventually(lambda: read_json(host_a.root / "context" / "plans" / "current.json") == value,
                   "A's own mirror")
        # compare-and-set across hosts: B wins at revision 1, A's stale write conflicts
        cas = ("context", "set", "plans/current", "--as", "@setter", "--if-revision", "1", "--data")
        assert host_b.handoff(*cas, '{"v": 2}').returncode == 0
        lost = host_a.handoff(*cas, '{"v": 3}')
        assert lost.returncode == 1 and "conflict: context key 'plans/current' is at revision 2" \
            in lost.stderr
        refused = host_a.handoff("context", "set", "plans/current", "--as", "@other", "--data", "1")
        assert refused.returncode == 1 and "may not write" in refused.stderr
        history = json.loads(host_a.handoff("context", "history", "plans/current", "--json",
                                            check=True).stdout)
        assert [(h["by"], h["revision"]) for h in history] == [("@setter", 1), ("@setter", 2)]
        assert history[0]["handoff_id"] == setting
        eventually(lambda: read_json(host_a.root / "context" / "plans" / "current.json")
                   == {"v": 2}, "B's write in A's mirror (NOTIFY)")
        # seed 001: a file-only agent on B writes context/project-context.json; A reads it
        tmp = host_b.root / "context" / ".project-context.part"
        tmp.write_text('{"project_id": "proj-001"}')
        os.replace(tmp, host_b.root / "context" / "project-context.json")
        got = eventually(lambda: host_a.handoff("context", "get", "project-context",
                                                "--with-revision").stdout, "B's file on A")
        assert json.loads(got) == {"key": "project-context", "revision": 1,
                                   "value": {"project_id": "proj-001"}}
        eventually(lambda: read_json(host_a.root / "context" / "project-context.json")
                   == {"project_id": "proj-001"}, "B's file in A's folder")
        listed = json.loads(host_a.handoff("context", "ls", "--json", check=True).stdout)
        assert {(r["key"], r["written_by"]) for r in listed} == {("plans/current", "@setter"),
                                                                 ("project-context", "@file")}
    finally:
        host_a.cleanup()
        host_b.cleanup()


def test_one_violations_log_for_every_host(tmp_path: Path, pg_url: str) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    host_a = host(tmp_path / "a", pg_url, '[specialists."@worker"]\n'
                  + command(tmp_path / "worker.py"))
    host_b = host(tmp_path / "b", pg_url)
    (host_a.root / "src" / "lib").mkdir(parents=True)
    (host_a.root / "src" / "lib" / "jwt.py").write_text("SECRET = 1\n")
    doc = {"handoff_id": "creep", "source": {"agent_id": "@coordinator"},
           "target": {"agent_id": "@worker"}, "input": {"data": {}},
           "contract": {"files_owned": ["src/auth/**"]}}
    (tmp_path / "creep.json").write_text(json.dumps(doc))
    try:
        host_a.serve()
        assert host_b.create("--file", str(tmp_path / "creep.json")) == "creep"
        assert host_b.handoff("wait", "creep", "--timeout", "30").returncode == 1  # out of scope
        summary = json.loads(host_b.handoff("violations", "--json", check=True).stdout)
        assert summary["total"] == 1 and summary["by_kind"] == {"scope_creep": 1}
        [entry] = summary["recent"]
        assert (entry["handoff_id"], entry["agent"]) == ("creep", "@worker")
        assert "src/lib/jwt.py" in entry["details"]["message"]
        for space in (host_a, host_b):  # the database holds it, no host's file
            assert not (space.root / "handoffs" / ".meta" / "violations.jsonl").exists()
    finally:
        host_a.cleanup()
        host_b.cleanup()
