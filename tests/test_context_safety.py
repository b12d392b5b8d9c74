"""Shared context and artifact safety (issue 9, item 7): compare-and-set and atomic updates under
real concurrency, case-insensitive namespace protection, confined artifact references, and a bad
``[namespaces]`` table refused when the daemon starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Workspace

from handoffd.core.config import load_config
from handoffd.core.errors import InvalidDocument
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.artifact_paths import confine_reference
from handoffd.features.artifacts import _one
from handoffd.features.context import (
    ContextConflict,
    ContextPermissionError,
    ContextStore,
    Permissions,
    normalise_key,
)

PROCESSES = 8
INCREMENTS = 25


def _store(root: Path, toml: str = "") -> ContextStore:
    if toml:
        (root / "handoffd.toml").write_text(toml)
    ws = HandoffdWorkspace(root)
    ws.ensure()
    return ContextStore(ws, durable=False)


def _run_workers(tmp_path: Path, script: str, root: Path) -> list[subprocess.CompletedProcess[str]]:
    """Start PROCESSES real processes running ``script ROOT`` at once; wait (bounded) for all."""
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(script))
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    env.pop("HANDOFF_TARGET", None)
    procs = [subprocess.Popen([sys.executable, str(path), str(root), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(PROCESSES)]
    time.sleep(0.5)
    go.write_text("go")  # every worker is imported and waiting: they start together
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    other.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


WAIT_FOR_GO = """
    import sys, time
    from pathlib import Path
    ROOT, GO = sys.argv[1], Path(sys.argv[2])
    deadline = time.monotonic() + 60
    while not GO.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


# ---------------------------------------------------------------- 1. compare-and-set / update
def test_cli_if_revision_from_8_processes_counts_exactly_200(tmp_path: Path) -> None:
    """8 processes x 25 increments through the `handoff` command (its Click command run in each
    worker process, so 200 increments fit the time bound; the real binary's exit code and message
    are checked below): get --with-revision, set --if-revision, retry on conflict."""
    root = tmp_path / "ws"
    root.mkdir()
    _store(root)
    script = WAIT_FOR_GO + f"""
    import contextlib, io, json, random
    import typer
    from handoffd.cli.handoff_cmd import app

    command = typer.main.get_command(app)  # built once: Typer's set-up is most of a call's cost

    def cli(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = command.main([*args, "--root", ROOT], prog_name="handoff", standalone_mode=False)
        return code or 0, out.getvalue(), err.getvalue()

    conflicts = 0
    for _ in range({INCREMENTS}):
        while True:
            code, out, err = cli("context", "get", "counter", "--with-revision")
            if code == 3:
                value, revision = 0, 0
            else:
                assert code == 0, (code, err)
                got = json.loads(out)
                value, revision = got["value"], got["revision"]
            code, out, err = cli("context", "set", "counter", json.dumps(value + 1),
                                 "--if-revision", str(revision))
            if code == 0:
                break
            assert code == 1 and err.startswith("handoff: error: conflict:"), (code, err)
            conflicts += 1
            time.sleep(random.uniform(0, 0.02))
    print(conflicts)
    """
    results = _run_workers(tmp_path, script, root)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    store = ContextStore(HandoffdWorkspace(root))
    assert store.get_with_revision("counter") == (PROCESSES * INCREMENTS, PROCESSES * INCREMENTS)
    history = store.history("counter")
    assert [h["revision"] for h in history] == list(range(1, PROCESSES * INCREMENTS + 1))


def test_api_update_from_8_processes_counts_exactly_200(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    _store(root)
    script = WAIT_FOR_GO + f"""
    from handoffd.features.context import ContextStore
    from handoffd.core.workspace import Workspace
    store = ContextStore(Workspace(Path(ROOT)), durable=False)
    for _ in range({INCREMENTS}):
        store.update("stats/counter", lambda v: v + 1, agent="@worker", default=0)
    """
    results = _run_workers(tmp_path, script, root)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    store = ContextStore(HandoffdWorkspace(root))
    assert store.get_with_revision("stats/counter") == (200, 200)


def test_cli_conflict_message_and_exit_code(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    HandoffdWorkspace(root).ensure()
    assert ws.handoff("context", "set", "k", "1", "--if-revision", "0").returncode == 0
    again = ws.handoff("context", "set", "k", "2", "--if-revision", "0")
    assert again.returncode == 1
    assert again.stderr.strip() == ("handoff: error: conflict: context key 'k' is at revision 1, "
                                    "not 0; nothing was written (read it again with `handoff "
                                    "context get --with-revision` and retry)")
    assert json.loads(ws.handoff("context", "get", "k").stdout) == 1
    got = json.loads(ws.handoff("context", "get", "k", "--with-revision").stdout)
    assert got == {"key": "k", "revision": 1, "value": 1}
    ok = ws.handoff("context", "set", "k", "--data", "2", "--if-revision", "1")
    assert ok.returncode == 0 and "revision 2" in ok.stdout
    both = ws.handoff("context", "set", "k", "3", "--data", "3")
    assert both.returncode == 2
    assert "--if-revision" in ws.handoff("context", "set", "--help").stdout


def test_revisions_are_backward_compatible_and_notice_foreign_writes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.revision("project-context") == 0
    # a value written before revisions existed (or by a seed-001 tool): plain JSON, revision 1
    (tmp_path / "context" / "project-context.json").write_text('{"project_id": "p1"}\n')
    assert store.get_with_revision("project-context") == ({"project_id": "p1"}, 1)
    entry = store.set("project-context", {"project_id": "p2"}, agent="@a", if_revision=1)
    assert entry["revision"] == 2
    # the stored value stays the bare JSON value
    assert json.loads((tmp_path / "context" / "project-context.json").read_text()) == {"project_id": "p2"}
    # a foreign tool rewrites the file: the revision moves on, so a stale CAS is refused
    (tmp_path / "context" / "project-context.json").write_text('{"project_id": "p3"}\n')
    assert store.get_with_revision("project-context") == ({"project_id": "p3"}, 3)
    with pytest.raises(ContextConflict):
        store.set("project-context", {"project_id": "stale"}, agent="@a", if_revision=2)
    assert store.get("project-context") == {"project_id": "p3"}
    assert store.set("project-context", 4, agent="@a", if_revision=3)["revision"] == 4
    # update: atomic, sees the default when unset, writes nothing when func raises
    assert store.update("n", lambda v: v + [1], agent="@a", default=[])["value"] == [1]

    def boom(_v: object) -> object:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        store.update("n", boom, agent="@a")
    assert store.get_with_revision("n") == ([1], 1)
    with pytest.raises(InvalidDocument):
        store.set("n", 1, agent="@a", if_revision=-1)
    # permission is checked before the revision: no conflict leaks for a key one may not write
    with pytest.raises(ContextPermissionError):
        store.set("task/x", 1, agent="@a", if_revision=5)
    with pytest.raises(ContextPermissionError):
        store.update("task/x", lambda v: 1, agent="@a")


def test_handler_view_offers_the_same_revision_api(tmp_path: Path) -> None:
    view = _store(tmp_path).view("@worker", "h1")
    assert view.update("stats/n", lambda v: v + 1, default=0)["revision"] == 1
    assert view.get_with_revision("stats/n") == (1, 1)
    with pytest.raises(ContextConflict):
        view.set("stats/n", 5, if_revision=0)
    assert view.set("stats/n", 5, if_revision=1)["handoff_id"] == "h1"
    assert view.get_with_revision("stats/n") == (5, 2)
    with pytest.raises(ContextPermissionError):
        view.update("TASK/x", lambda v: 1)


# ---------------------------------------------------------------- 2. namespace protection
BYPASSES = ["TASK/x", "Task/x", "tAsK/current-objective", "TASK", "task", "task.json",
            "beads:TASK/x", " task/x ", "\ttask/x\n", "task/x.json", "TASK/sub/deep"]
REFUSED_KEYS = ["/task/x", "./task/x", "task//x", "task/./x", "task/../task/x", "task /x",
                "task\n/x", "task/x\n/y", "ｔａｓｋ/x", "tаsk/x", "task\\x", "task/x/", ""]


@pytest.mark.parametrize("key", BYPASSES)
def test_protected_namespace_is_case_insensitive(tmp_path: Path, key: str) -> None:
    store = _store(tmp_path)
    with pytest.raises(ContextPermissionError, match="namespace task/"):
        store.set(key, "hijacked", agent="@cli")
    assert store.set(key, "ok", agent="ABSTRACT_ARCHITECT")["by"] == "ABSTRACT_ARCHITECT"


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_other_spellings_are_not_keys(tmp_path: Path, key: str) -> None:
    store = _store(tmp_path)
    with pytest.raises(InvalidDocument):
        store.set(key, "hijacked", agent="@cli")
    with pytest.raises(InvalidDocument):
        normalise_key(key)
    assert store.keys() == []


def test_configured_namespace_names_are_case_insensitive(tmp_path: Path) -> None:
    store = _store(tmp_path, '[namespaces."Reports/"]\nwriters = ["@reporter"]\n'
                             '[namespaces."TASK"]\nwriters = ["@architect"]\n')
    for key in ("reports/a", "REPORTS/a", "Reports/b/c"):
        with pytest.raises(ContextPermissionError):
            store.set(key, 1, agent="@cli")
        store.set(key, 1, agent="@reporter")
    with pytest.raises(ContextPermissionError):
        store.set("Task/x", 1, agent="ABSTRACT_ARCHITECT")  # replaced by the configured writers
    store.set("Task/x", 1, agent="@architect")
    # the CLI enforces the same through the real binary
    ws = Workspace(tmp_path)
    denied = ws.handoff("context", "set", "REPORTS/z", "1")
    assert denied.returncode == 1 and "may not write context key 'REPORTS/z'" in denied.stderr
    assert not (tmp_path / "context" / "REPORTS" / "z.json").exists()


def test_symlinked_folder_does_not_reach_a_protected_namespace(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.set("task/x", "original", agent="ABSTRACT_ARCHITECT")
    (tmp_path / "context" / "alias").symlink_to(tmp_path / "context" / "task")
    with pytest.raises(InvalidDocument, match="symlink"):
        store.set("alias/x", "hijacked", agent="@cli")
    assert store.get("task/x") == "original"


def test_permissions_come_from_the_validated_config(tmp_path: Path) -> None:
    (tmp_path / "handoffd.toml").write_text('[namespaces."Ops"]\nwriters = ["@ops"]\n'
                                            '[tiers]\n"@arch" = 3\n')
    perms = Permissions.load(HandoffdWorkspace(tmp_path))
    assert perms.namespaces["ops"] == ["@ops"]
    assert perms.may_write("@arch", "TASK/x")  # tier 3 = ABSTRACT_ARCHITECT
    assert perms.namespace_of("OPS/y") == "ops"
    assert load_config(tmp_path / "handoffd.toml").namespaces == {"ops": ["@ops"]}


# ---------------------------------------------------------------- 3. artifact references
TRAVERSALS = ["beads:../../x", "beads:../x", "beads:task/../../x", "beads:/etc/passwd",
              "beads:..", "beads:%2e%2e/x", "beads:%252e%252e/x", "beads:task//x",
              "beads:task\n/x", "beads:..\\..\\x", "file:../x", "file:///etc/passwd",
              "file:/etc/passwd", "file://localhost/etc/passwd", "file:~/x", "artifact:../../x",
              "artifact:a/%2e%2e/%2e%2e/x", "artifact:a/\uff0e\uff0e/x", "workspace:..",
              "x-store:a/../../../x", "C:\\Windows\\x", "../x", "/etc/passwd",
              "https://example.com/../x", "beads:"]
CONFINED = ["beads:task/x", "beads:execution/outputs/msg-002", "artifacts/a.txt",
            "file:artifacts/a.txt", "https://example.com/report.pdf"]


@pytest.mark.parametrize("ref", TRAVERSALS)
def test_traversing_artifact_references_are_refused(tmp_path: Path, ref: str) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    ws.ensure()
    with pytest.raises(InvalidDocument) as info:
        confine_reference(ws, ref, handoff_id="h1")
    assert info.value.code == "VALIDATION_FAILED"
    with pytest.raises(InvalidDocument):  # what a handler's artifacts[] go through
        _one(ws, "h1", 1, {"path": ref, "artifact_type": "data"}, set())
    with pytest.raises(InvalidDocument):
        _one(ws, "h1", 1, {"content_ref": ref}, set())


@pytest.mark.parametrize("ref", CONFINED)
def test_confined_artifact_references_are_accepted(tmp_path: Path, ref: str) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    ws.ensure()
    (ws.artifacts / "a.txt").write_text("hello")
    (ws.context / "task").mkdir()
    (ws.context / "task" / "x.json").write_text('"v"\n')
    target = confine_reference(ws, ref)
    assert target is None if ref.startswith("https:") else ws.root.resolve() in target.parents
    record = _one(ws, "h1", 1, {"path": ref}, set())
    assert record["content_ref"] == ref
    if ref in ("artifacts/a.txt", "file:artifacts/a.txt"):
        assert record["size_bytes"] == 5


def test_symlink_out_of_the_workspace_is_refused(tmp_path: Path) -> None:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    ws.ensure()
    (tmp_path / "secret.json").write_text("{}")
    (ws.context / "leak.json").symlink_to(tmp_path / "secret.json")
    (ws.artifacts / "leak").symlink_to(tmp_path)
    for ref in ("beads:leak", "file:artifacts/leak/secret.json", "artifacts/leak/secret.json"):
        with pytest.raises(InvalidDocument):
            confine_reference(ws, ref)


# ---------------------------------------------------------------- 4. [namespaces] at daemon start
BAD_NAMESPACES = [
    ('[namespaces."../etc"]\nwriters = ["@a"]\n', "is not a valid namespace"),
    ('[namespaces."task"]\nwriters = "@a"\n', "writers must be a list"),
    ('[namespaces."task"]\nwriters = [1]\n', "writers must be a list"),
    ('[namespaces."task"]\nwriter = ["@a"]\n', "unknown key 'writer'"),
    ('[namespaces."task"]\nwriters = ["@a"]\n[namespaces."TASK/"]\nwriters = ["@b"]\n',
     "configured twice"),
    ("namespaces = 3\n", "[namespaces] must be a table"),
]


@pytest.mark.parametrize("toml,message", BAD_NAMESPACES)
def test_bad_namespaces_refused_when_the_daemon_starts(ws: Workspace, toml: str, message: str) -> None:
    ws.write_config(toml)
    for command in ("run", "serve"):
        proc = ws.handoffd(command, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (command, proc.stderr)
        assert len(lines) == 1 and message in lines[0] and "handoffd.toml" in lines[0], lines
        assert "Traceback" not in proc.stderr
    # the CLI's context commands refuse the same file the same way
    proc = ws.handoff("context", "set", "reports/x", "1")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("spoiled", [".meta", ".tmp"])
def test_a_symlinked_context_folder_never_takes_a_write_outside(ws: Workspace, tmp_path: Path,
                                                               spoiled: str) -> None:
    """Found by the second bug hunt: context/.meta as a symlink to a folder outside the
    workspace made `handoff context set` write its revision records and locks there."""
    assert ws.handoff("context", "set", "seed/x", "0").returncode == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    target = ws.root / "context" / spoiled
    if target.exists():
        for child in target.iterdir():
            child.unlink()
        target.rmdir()
    target.symlink_to(outside)
    proc = ws.handoff("context", "set", "ok/a", "1")
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "symlink" in proc.stderr and list(outside.iterdir()) == []


def test_a_fifo_history_is_set_aside_and_the_write_goes_on(ws: Workspace) -> None:
    """A FIFO at context/.history.jsonl: `context set` said it failed, yet the value had been
    written; later every write was refused until someone removed it by hand. Now the planted
    entry is moved to the quarantine (one warning naming it) and the write goes on, its history
    with it. (A history that cannot be set aside refuses the write before making it:
    test_context_s16.py.)"""
    assert ws.handoff("context", "set", "seed/x", "0").returncode == 0
    history = ws.root / "context" / ".history.jsonl"
    history.unlink()
    os.mkfifo(history)
    proc = ws.handoff("context", "set", "ok/fifo", "6", timeout=30)
    assert proc.returncode == 0 and ".history.jsonl" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one warning
    got = ws.handoff("context", "get", "ok/fifo")
    assert got.returncode == 0 and got.stdout.strip() == "6", got
    assert history.is_file() and "ok/fifo" in history.read_text()
    assert any(p.name.endswith(".history.jsonl")
               for p in (ws.root / "handoffs" / ".quarantine").iterdir())


@pytest.mark.parametrize("make", ["missing", "fifo", "dir"])
def test_an_artifact_that_is_no_file_fails_the_attempt(tmp_path: Path, make: str) -> None:
    """Found by the second bug hunt: `artifacts: [{"path": "artifacts/nothere.txt"}]` (or a
    FIFO) was filed as completed with a record that had no size_bytes nor sha256, pointing at
    nothing. A workspace file an answer names must be a regular file (VALIDATION_FAILED)."""
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.root.mkdir()
    ws.ensure()
    path = ws.artifacts / "thing.txt"
    if make == "fifo":
        os.mkfifo(path)
    elif make == "dir":
        path.mkdir()
    with pytest.raises(InvalidDocument) as info:
        _one(ws, "h1", 1, {"path": "artifacts/thing.txt"}, set())
    assert info.value.code == "VALIDATION_FAILED" and "not a file" in str(info.value)
    record = _one(ws, "h1", 2, {"path": "beads:notes/later"}, set())  # shared context: on trust
    assert record["content_ref"] == "beads:notes/later"


@pytest.mark.parametrize("text, says", [
    ("NaN", "not finite JSON"), ("1e999", "not finite JSON"),
    # (found on the text since session 31: json's recursion limit said "nests too deeply")
    ("[" * 100_000 + "]" * 100_000, "nests more than 256 levels"),
    ("[" * 300 + "]" * 300, "nests more than 256 levels"),
    ('"\\ud800"', "lone UTF-16 surrogate"), ("{", "not valid JSON")])
def test_a_hostile_context_file_is_one_line_never_bad_json_out(tmp_path: Path, text: str,
                                                              says: str) -> None:
    """Found by the context hunt: a value a foreign tool wrote was read without the document
    limits (NaN printed as non-JSON, RecursionError and UnicodeEncodeError as internal errors)."""
    root = tmp_path / "ws"
    root.mkdir()
    HandoffdWorkspace(root).ensure()
    (root / "context").mkdir(exist_ok=True)
    (root / "context" / "k.json").write_text(text)
    got = Workspace(root).handoff("context", "get", "k")
    assert got.returncode == 1 and got.stdout == ""
    assert got.stderr.startswith("handoff: error: context/k.json ") and says in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1


def test_a_value_too_deep_to_read_back_is_never_written(tmp_path: Path) -> None:
    store = _store(tmp_path)
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidDocument, match="nests more than 256 levels"):
        store.set("k", deep, agent="@a")
    fine: list = ["fine"]
    for _ in range(100):  # deeper than a document may be: a context value is not one
        fine = [fine]
    store.set("k", fine, agent="@a")
    assert store.get("k") == fine
