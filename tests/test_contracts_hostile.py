"""Contracts against hostile workers and hostile documents (the tester's r7, r8 and r9).

* r8: handoffd's git must never run a program a worker wrote into the repository's config, and a
  git that fails or hangs ends in one clear line, never a traceback or a stalled worker.
* r7: a worker cannot hide a change from a git-mode scope check by changing git's ignore rules or
  config during its run: those files are watched too.
* r9: contract globs come from documents and are matched in linear time (RE2), with bounded size
  and count, so no glob can freeze the daemon.

Like ``test_contracts.py``, the scenario tests drive the real ``handoff`` / ``handoffd`` commands
against a temporary workspace (here a git work tree) with a small command specialist.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.contracts import gitlist, patterns, snapshots

PY = sys.executable

# data: {"run": [[argv...]], "append": {rel: text}, "write": {rel: text}, "write_hex": {hex: text}},
# in that order, in the root; "{root}" in an argument is the root's path, "write_hex" names a file
# by the hex of its bytes (a name that is not UTF-8 cannot travel in a document)
WORKER = r'''
import json, os, subprocess, sys
doc = json.load(sys.stdin)
data = doc["input"]["data"]
root = os.environ["HANDOFFD_ROOT"]
for argv in data.get("run") or []:
    argv = [arg.replace("{root}", root) for arg in argv]
    subprocess.run(argv, cwd=root, check=True, stdin=subprocess.DEVNULL, timeout=60)
for mode, files in (("a", data.get("append") or {}), ("w", data.get("write") or {})):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, mode) as handle:
            handle.write(text)
for name, text in (data.get("write_hex") or {}).items():
    with open(os.path.join(os.fsencode(root), bytes.fromhex(name)), "w") as handle:
        handle.write(text)
print(json.dumps({"status": "completed", "output": {"summary": "done"}}))
'''

CONFIG = """
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.3
workers = 4

[specialists."@worker"]
command = [{python}, {script}]
timeout_seconds = 60

[specialists."@other"]
command = [{python}, {script}]
timeout_seconds = 60
"""

GIT_ID = ["-c", "user.email=t@example.invalid", "-c", "user.name=t"]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str) -> None:
    """Run git in the test's own repository (as a user would, not through handoffd)."""
    subprocess.run(["git", "-C", str(root), *GIT_ID, *args], check=True, timeout=60,
                   capture_output=True)


def make_workspace(tmp_path: Path, *, repo: bool) -> Workspace:
    """A workspace with a small project tree; committed to a git repository when ``repo``."""
    root = tmp_path / "ws"
    root.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ws = Workspace(root)
    ws.write_config(CONFIG.format(python=json.dumps(PY), script=json.dumps(str(script))))
    HandoffdWorkspace(root).ensure()
    for rel, text in {"src/auth/service.py": "def login(): pass\n", "src/lib/jwt.py": "SECRET = 1\n",
                      ".gitignore": "handoffs/\n*.pyc\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    if repo:
        git(root, "init", "-q")
        git(root, "add", "-A")
        git(root, "commit", "-qm", "init")
    return ws


@pytest.fixture
def gws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace that is a git work tree (contracts check it in git mode)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    ws = make_workspace(tmp_path, repo=True)
    yield ws
    ws.cleanup()


def native(hid: str, contract: dict[str, Any] | None, data: dict[str, Any],
           to: str = "@worker") -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "source": {"agent_id": "@coordinator"},
                           "target": {"agent_id": to}, "input": {"data": data}}
    if contract is not None:
        doc["contract"] = contract
    return doc


def submit_and_run(ws: Workspace, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Drop ``doc`` into pending/, run one batch; (the filed document, the daemon's stderr)."""
    ws.drop(f"{doc['handoff_id']}.json", doc)
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return ws.doc(doc["handoff_id"]), proc.stderr


OWN_AUTH = {"files_owned": ["src/auth/**"]}


# ---------------------------------------------------------------- r8: no program from git config
def test_a_program_planted_in_git_config_never_runs_in_the_daemon(gws: Workspace, tmp_path: Path) -> None:
    marker = tmp_path / "planted-ran"
    planted = f"echo ran >> {marker}; echo"
    # a worker plants the command itself: its own change of .git/config is a violation ...
    doc, _ = submit_and_run(gws, native("plant", OWN_AUTH, {
        "run": [["git", "config", "core.fsmonitor", planted]],
        "append": {"src/auth/service.py": "# in scope\n"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION", doc.get("error")
    assert ".git/config: modified outside files_owned" in doc["error"]["message"]
    # ... and every other door to a program stays shut for the contracts that follow
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("post-index-change", "pre-commit", "post-checkout", "fsmonitor-watchman"):
        (hooks / name).write_text(f"#!/bin/sh\necho {name} >> {marker}\n")
        (hooks / name).chmod(0o755)
    for key, value in {"core.hooksPath": str(hooks), "core.pager": planted, "pager.ls-files": planted,
                       "filter.evil.clean": planted, "filter.evil.process": planted,
                       "diff.external": planted, "core.sshCommand": planted}.items():
        git(gws.root, "config", key, value)
    (gws.root / ".git" / "info" / "attributes").write_text("* filter=evil diff=evil\n")
    for hid in ("honest-1", "honest-2"):
        doc, stderr = submit_and_run(gws, native(hid, {"files_owned": ["src/lib/**"]},
                                                 {"append": {"src/lib/jwt.py": f"# {hid}\n"}}))
        assert gws.state_of(hid) == ["completed"], doc.get("error")
        assert doc["validation"]["scope"]["mode"] == "git"
        assert doc["validation"]["scope"]["changes"] == [{"path": "src/lib/jwt.py", "change": "modified"}]
    assert not marker.exists(), marker.read_text()


def test_a_repository_broken_by_the_handler_fails_closed_in_one_line(gws: Workspace) -> None:
    # git answered before the handler; a corrupt index makes it fail after: the scope cannot be
    # verified, so the handoff fails (never "no changes seen"), with git's reason on one line
    doc, stderr = submit_and_run(gws, native("breaker", OWN_AUTH, {"write": {".git/index": "garbage"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION", doc.get("error")
    message = doc["error"]["message"]
    assert "the scope cannot be verified: after the handler ran, git ls-files failed: " in message
    assert "\n" not in message and "Traceback" not in stderr
    assert doc["retry_available"] is False


def test_a_hanging_git_is_bounded_and_said_in_one_line(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 30\n")  # exec: the timeout kills the sleeper itself
    fake.chmod(0o755)
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f").write_text("x")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gitlist, "GIT_TIMEOUT_SECONDS", 0.5)
    started = time.monotonic()
    snap = snapshots.Snapshotter(tree, mode="git").take()
    assert time.monotonic() - started < 10
    assert snap.mode == "hash" and list(snap.entries) == ["a/f"]
    assert snap.note == ("git listing unavailable (git rev-parse did not finish within 0.5 s); "
                         "every file is watched instead")


# ---------------------------------------------------------------- r7: git's ignore state is watched
@pytest.mark.parametrize("contract,script,culprit", [
    (OWN_AUTH, {"append": {".git/info/exclude": "\n/backdoor.sh\n"}, "write": {"backdoor.sh": "x"}},
     ".git/info/exclude: modified outside files_owned"),
    (OWN_AUTH, {"run": [["git", "config", "core.excludesFile", "{root}/.git/hide"]],
                "write": {".git/hide": "backdoor.sh\n", "backdoor.sh": "x"}},
     ".git/config: modified outside files_owned"),
    (OWN_AUTH, {"write": {"hidden/.gitignore": "*\n", "hidden/backdoor.sh": "x"}},
     "hidden/.gitignore: created outside files_owned"),
    (OWN_AUTH, {"write": {".gitignore": "handoffs/\n*.pyc\n.gitignore\nbackdoor.sh\n", "backdoor.sh": "x"}},
     ".gitignore: modified outside files_owned"),
    ({"cwd": "src", "files_owned": ["auth/**"]},
     {"append": {".gitignore": "src/backdoor.sh\n"}, "write": {"src/backdoor.sh": "x"}},
     "../.gitignore: modified outside files_owned"),
], ids=["info-exclude", "config", "self-ignoring-gitignore", "tracked-gitignore", "gitignore-above-cwd"])
def test_changing_what_git_ignores_cannot_hide_a_change(gws: Workspace, contract: dict[str, Any],
                                                        script: dict[str, Any], culprit: str) -> None:
    doc, _ = submit_and_run(gws, native("hider", contract, script))
    assert gws.state_of("hider") == ["failed"], doc["validation"]["scope"]
    assert doc["error"]["code"] == "CONTRACT_VIOLATION"
    assert culprit in doc["error"]["message"], doc["error"]["message"]
    assert doc["validation"]["scope"]["mode"] == "git"


def test_a_worker_may_still_commit_its_owned_work(gws: Workspace) -> None:
    # the index, objects and refs are not git's ignore state: committing stays allowed
    edit = "open('src/auth/service.py', 'a').write('# v2\\n'); open('src/auth/new.py', 'w').write('x')"
    doc, _ = submit_and_run(gws, native("committer", OWN_AUTH, {"run": [
        [PY, "-c", edit], ["git", "add", "src/auth"], ["git", *GIT_ID, "commit", "-qm", "auth"]]}))
    assert gws.state_of("committer") == ["completed"], doc.get("error")
    assert doc["validation"]["scope"]["changes"] == [{"path": "src/auth/new.py", "change": "created"},
                                                     {"path": "src/auth/service.py", "change": "modified"}]


# ---------------------------------------------------------------- r9: globs in linear time, bounded
HOSTILE = "*?*?*?*?*?*?*?*?*?*?*?*Z"
LONG_NAME = "this_is_a_rather_long_file_name_for_tests.txt"


def test_hostile_globs_match_in_linear_time() -> None:
    # in a child process: before the fix each call backtracked for minutes holding the GIL
    code = f"""
import time
from handoffd.features.contracts import patterns
started = time.monotonic()
name = {LONG_NAME!r} * 20
assert not patterns.matches({HOSTILE!r}, name)
assert not patterns.any_match(({HOSTILE!r}, "src/**/" + {HOSTILE!r}), "src/a/" + name)
assert not patterns.overlap("src/" + {HOSTILE!r}, "src/" + name)
assert not patterns.matches("**/**/**/**/**/**/**/**/**/**/x", "a/" * 2000 + "y")
assert time.monotonic() - started < 30, time.monotonic() - started  # (was minutes)
"""
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_hostile_glob_does_not_stall_the_daemon(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, repo=False)
    (ws.root / LONG_NAME).write_text("x")
    try:
        daemon = ws.serve()
        ws.drop("hostile.json", native("hostile", {"files_owned": ["src/**"], "scope_check": "hash",
                                                   "scope_ignore": [HOSTILE]}, {}))
        ws.drop("plain.json", native("plain", None, {}, to="@other"))
        assert ws.wait_state("plain", timeout=20) == "completed"
        assert ws.wait_state("hostile", timeout=20) == "completed", ws.doc("hostile").get("error")
        assert ws.stop(daemon, timeout=20) == 0
    finally:
        ws.cleanup()


@pytest.mark.parametrize("field,value,says", [
    ("scope_ignore", [f"build{i}/**" for i in range(patterns.MAX_PATTERNS + 1)],
     f"contract.scope_ignore holds {patterns.MAX_PATTERNS + 1} globs; at most {patterns.MAX_PATTERNS}"),
    ("files_owned", ["src/" + "?" * patterns.MAX_PATTERN_CHARS],
     "contract.files_owned: 'src/????"),
    ("files_readonly", ["src/[z-a].py"], "contract.files_readonly: 'src/[z-a].py': character range z-a is reversed"),
], ids=["too-many", "too-long", "reversed-range"])
def test_oversized_or_malformed_globs_are_refused_naming_the_field(
        tmp_path: Path, field: str, value: list[str], says: str) -> None:
    ws = make_workspace(tmp_path, repo=False)
    doc, _ = submit_and_run(ws, native("bad-globs", {field: value}, {"write": {"src/x": "never"}}))
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED", doc.get("error")
    assert says in doc["error"]["message"]
    assert len(doc["error"]["message"]) < 400  # a 512-character glob is not echoed whole
    assert not (ws.root / "src" / "x").exists()  # refused before the handler


@pytest.mark.parametrize("pattern,path,expected", [
    ("src/?x", "src/\udcffx", True), ("src/\udcff*", "src/\udcffabc", True),
    ("src/[!a]x", "src/\udcffx", True), ("src/*.py", "src/\udcff.txt", False),
    ("src/[--0]", "src/.", True), ("src/[--0]", "src/0", True), ("src/a?b", "src/a/b", False),
    ("src/**", "src/a\nb/c", True), ("src/auth", "src/auth/a\nb", True), ("[!]a]x", "bx", True),
    ("[!]a]x", "]x", False), ("f[.]py", "f.py", True), ("f(x)+", "f(x)+", True),
])
def test_glob_semantics_on_re2(pattern: str, path: str, expected: bool) -> None:
    # undecodable file names (lone surrogates from os.fsdecode) and regex metacharacters included
    assert patterns.matches(pattern, path) is expected
    assert patterns.any_match((pattern, "never/**"), path) is expected


def test_undecodable_file_names_are_checked_like_any_other(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, repo=False)
    # names that are not UTF-8: lone surrogates once os.fsdecode'd (before the fix the daemon
    # could not file the outcome and left the handoff in-progress/)
    owned, stray = b"src/auth/\xff.py", b"src/\xfe.py"
    doc, _ = submit_and_run(ws, native("bytes-ok", OWN_AUTH, {"write_hex": {owned.hex(): "x"}}))
    assert ws.state_of("bytes-ok") == ["completed"], doc.get("error")
    # shown with the byte escaped: a name that is not UTF-8 cannot go into a JSON document as is
    assert doc["validation"]["scope"]["changes"] == [{"path": "src/auth/\\xff.py", "change": "created"}]
    doc, _ = submit_and_run(ws, native("bytes-bad", OWN_AUTH, {"write_hex": {stray.hex(): "x"}}))
    assert doc["error"]["code"] == "CONTRACT_VIOLATION", doc.get("error")
    assert "src/\\xfe.py: created outside files_owned" in doc["error"]["message"]
