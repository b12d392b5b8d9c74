"""Review 15's dialect, config and artifact findings, through the installed commands.

- a native request whose ``source.agent_id`` is no string (an object, a number) no longer breaks
  ``handoff ls`` for the whole workspace (the envelope reads only a string as the requester, and
  the plain table writes any cell it is given as text);
- a seed-004 WorkerHandoff that also names ``from_agent`` / ``to_agent`` is a swarm handoff, not
  an AgentHandoff missing its ``handoff_id`` (it was set aside with ID_MISMATCH);
- a specialist's ``input_schema`` / ``output_schema`` that is no plain file name, and a ``cwd``
  outside the workspace, are refused when handoffd.toml is loaded (exit 2, one line), not by
  failing every handoff to it;
- a handoffd.toml that is a folder, a FIFO, unreadable, huge or nested too deeply is a one-line
  config error (exit 2): never exit 1, never a daemon blocked opening a FIFO;
- an artifact name too long for the file system is cut (its file stored), and a reference the
  file system refuses (File name too long) fails the attempt for good instead of retrying it.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, SWARM_HANDOFF, fresh

from conftest import Workspace, exe, handlers_workspace, new_workspace
from handoffd.cli.render import plain_table
from handoffd.core import config as config_module
from handoffd.core.config import load_config, specialist_from_table
from handoffd.core.errors import ConfigError
from handoffd.core.settings import RetryPolicy
from handoffd.features import artifact_paths

MAX_CONFIG_BYTES = getattr(config_module, "MAX_CONFIG_BYTES", 1 << 20)  # handoffd.toml's bound
FAST = '[daemon]\nsettle_seconds = 0\ndurability = "fast"\n'


def run(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    return ws.handoffd("run", "-q", *args, timeout=90)


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    """The single stderr line of a refused start (exit 2), holding each of ``words``."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- 2: source.agent_id not a string
@pytest.mark.parametrize("agent", [{"x": 1}, 123, ["a"], True])
def test_a_non_string_source_agent_never_breaks_handoff_ls(tmp_path: Path, agent: Any) -> None:
    ws = new_workspace(tmp_path / "ws", FAST + '[specialists."@t"]\ncommand = ["true"]\n')
    try:
        ws.drop("s1.json", {"handoff_id": "s1", "status": "pending", "source": {"agent_id": agent},
                            "target": {"agent_id": "@t"}, "input": {"data": {}}})
        ws.create("--to", "@nobody", "--id", "ok1")
        listed = ws.handoff("ls")
        assert listed.returncode == 0, listed.stderr
        assert "internal error" not in listed.stderr
        rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
        assert set(rows) == {"s1", "ok1"}
        assert rows["s1"][3] == "-" and rows["ok1"][3] == "@cli"  # FROM: no requester named
        as_json = ws.handoff("ls", "--json")
        assert as_json.returncode == 0, as_json.stderr
        by_id = {row["id"]: row for row in json.loads(as_json.stdout)}
        assert by_id["s1"]["from"] is None and by_id["ok1"]["from"] == "@cli"
        # the daemon refuses the request (the schema wants a string); the filed copy lists too
        run(ws)
        assert ws.state_of("s1") == ["failed"]
        assert ws.doc("s1")["handoffd"]["final_error"]["code"] == "SCHEMA_VALIDATION_FAILED"
        again = ws.handoff("ls", "--state", "failed")
        assert again.returncode == 0 and "s1" in again.stdout, again.stderr
    finally:
        ws.cleanup()


def test_the_plain_table_writes_any_cell_as_text() -> None:
    lines = plain_table(["A", "B"], [[{"x": 1}, 123], [("ok", "bold"), None], ["a\nb", ["l"]]])
    assert lines[1].split() == ["{'x':", "1}", "123"]
    assert lines[2].split() == ["ok", "None"]
    assert lines[3].split() == ["a\\nb", "['l']"]


# ---------------------------------------------------------------- 4: a swarm handoff with agents
def swarm_with_agents(task_id: str) -> dict[str, Any]:
    doc = fresh(SWARM_HANDOFF)
    doc["contract"]["task_id"] = task_id
    doc["contract"]["dependencies_completed"] = []
    doc["from_agent"], doc["to_agent"] = "coordinator", "@swarm-worker"
    return doc


def test_a_worker_handoff_naming_its_agents_is_swarm(tmp_path: Path) -> None:
    path = tmp_path / "swft.json"
    path.write_text(json.dumps(swarm_with_agents("swft")))
    done = subprocess.run([exe("handoff"), "validate", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "valid (swarm)" in done.stdout, done.stdout


def test_the_daemon_routes_it_to_its_worker_instead_of_setting_it_aside(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", FAST)  # no @swarm-worker registered: it waits
    try:
        ws.drop("swft.json", swarm_with_agents("swft"))
        done = run(ws)
        assert "ID_MISMATCH" not in done.stderr, done.stderr
        assert ws.state_of("swft") == ["pending"]
        assert not list((ws.root / "handoffs" / ".quarantine").glob("*"))
        rows = json.loads(ws.handoff("ls", "--json", check=True).stdout)
        assert [(r["id"], r["to"], r["from"]) for r in rows] == [("swft", "@swarm-worker",
                                                                 "coordinator")]
        assert "no specialist registered for @swarm-worker" in rows[0]["note"]
    finally:
        ws.cleanup()


def test_a_real_agent_handoff_is_still_one() -> None:
    from dialect_examples import AGENT_SUCCESS

    from handoffd import dialects
    assert dialects.detect(fresh(AGENT_SUCCESS)).name == "agent_handoff"
    # a contract block without a task_id does not make it a swarm handoff
    doc = fresh(AGENT_SUCCESS)
    doc["contract"] = {"note": "x"}
    assert dialects.detect(doc).name == "agent_handoff"


# ---------------------------------------------------------------- 5: specialist settings at load
SPECIALIST = '[specialists."@x"]\ncommand = ["true"]\n'
BAD_SPECIALIST = [
    ('input_schema = "../../../../etc/passwd"\n', "input_schema"),
    ('output_schema = "/etc/passwd"\n', "output_schema"),
    ('input_schema = "sub/x.json"\n', "input_schema"),
    ('input_schema = ".hidden.json"\n', "input_schema"),
    ('output_schema = ""\n', "output_schema"),
    ('input_schema = "a\\\\b.json"\n', "input_schema"),
    ('input_schema = "a\\u0000.json"\n', "input_schema"),
    ('cwd = "../../.."\n', "cwd"),
    ('cwd = "sub/../../x"\n', "cwd"),
    ('cwd = "/etc"\n', "cwd"),
    ('cwd = "a\\u0000b"\n', "cwd"),
]


@pytest.mark.parametrize("line, key", BAD_SPECIALIST, ids=[c[0].strip() for c in BAD_SPECIALIST])
def test_a_bad_schema_name_or_cwd_is_refused_at_start(tmp_path: Path, line: str, key: str) -> None:
    ws = new_workspace(tmp_path / "ws", FAST + SPECIALIST + line)
    try:
        ws.drop("h1.json", {"handoff_id": "h1", "source": {"agent_id": "@t"},
                            "target": {"agent_id": "@x"}, "input": {"data": {}}})
        one_line_error(run(ws), key, "handoffd.toml", "@x")
        assert ws.state_of("h1") == ["pending"]  # never claimed, never failed
    finally:
        ws.cleanup()


def test_a_cwd_symlink_leading_out_is_refused_like_the_runner_does(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    ws = new_workspace(root, FAST + SPECIALIST + 'cwd = "out"\n')
    try:
        (root / "out").symlink_to(tmp_path)
        with pytest.raises(ConfigError, match="cwd = 'out' must be a folder inside the workspace"):
            load_config(root / "handoffd.toml")
    finally:
        ws.cleanup()


def test_a_cwd_turned_into_a_way_out_after_the_start_still_fails_its_handoff(
        tmp_path: Path) -> None:
    """The runner keeps its own check: a cwd made a symlink out after the daemon loaded its
    config fails the handoff (not retried) instead of running the command outside."""
    root = tmp_path / "ws"
    ws = new_workspace(root, FAST + "rescan_seconds = 0.2\n"
                       '[specialists."@escape"]\ncommand = ["pwd"]\ncwd = "later"\n')
    try:
        ws.serve()
        (root / "later").symlink_to(tmp_path)
        ws.drop("esc1.json", {"handoff_id": "esc1", "source": {"agent_id": "@t"},
                              "target": {"agent_id": "@escape"}, "input": {"data": {}}})
        assert ws.wait_state("esc1", timeout=30) == "failed"
        doc = ws.doc("esc1")
        assert "outside the workspace" in doc["error"]["message"]
        assert doc["retry_available"] is False
    finally:
        ws.cleanup()


def test_good_schema_names_and_cwds_still_load(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    ws = new_workspace(root, FAST + SPECIALIST + 'input_schema = "in.schema.json"\n'
                       'output_schema = "out.json"\ncwd = "sub/dir"\n'
                       '[specialists."@y"]\ncommand = ["true"]\ncwd = "."\n'
                       '[specialists."@z"]\ncommand = ["true"]\ncwd = ""\n'
                       f'[specialists."@abs"]\ncommand = ["true"]\ncwd = "{root}/inner"\n'
                       '[specialists."@back"]\ncommand = ["true"]\ncwd = "a/../b"\n')
    try:
        config = load_config(root / "handoffd.toml")
        assert config.specialists["@x"].input_schema == "in.schema.json"
        assert config.specialists["@x"].cwd == "sub/dir"
        assert {config.specialists[a].cwd for a in ("@y", "@z", "@back")} == {".", "", "a/../b"}
        done = run(ws)
        assert done.returncode == 0, done.stderr
    finally:
        ws.cleanup()


def test_without_a_workspace_a_relative_cwd_climbing_out_is_refused() -> None:
    retry = RetryPolicy()
    with pytest.raises(ConfigError, match="cwd = '../x' must be a folder inside the workspace"):
        specialist_from_table("@d", {"handler": "m:f", "cwd": "../x"}, retry, "decorator")
    assert specialist_from_table("@d", {"handler": "m:f", "cwd": "sub"}, retry).cwd == "sub"
    # an absolute one is left to the runner, which knows the workspace
    assert specialist_from_table("@d", {"handler": "m:f", "cwd": "/srv/ws"}, retry).cwd == "/srv/ws"


# ---------------------------------------------------------------- 6: an unreadable handoffd.toml
def bare(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    for state in ("pending", "in-progress", "completed", "failed"):
        (root / "handoffs" / state).mkdir(parents=True)
    return root


def handoffd_run(root: Path) -> subprocess.CompletedProcess[str]:
    # (bounded: a FIFO once blocked the daemon in open() for good)
    return subprocess.run([exe("handoffd"), "run", "-q", "--root", str(root)],
                          capture_output=True, text=True, timeout=30)


def test_a_folder_at_handoffd_toml_is_a_config_error(tmp_path: Path) -> None:
    root = bare(tmp_path)
    (root / "handoffd.toml").mkdir()
    one_line_error(handoffd_run(root), "handoffd.toml", "cannot read", "Is a directory")


def test_a_fifo_at_handoffd_toml_never_blocks(tmp_path: Path) -> None:
    root = bare(tmp_path)
    os.mkfifo(root / "handoffd.toml")
    one_line_error(handoffd_run(root), "handoffd.toml", "not a regular file")


def test_a_device_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    root = bare(tmp_path)
    (root / "handoffd.toml").symlink_to("/dev/zero")
    one_line_error(handoffd_run(root), "handoffd.toml", "not a regular file")


def test_a_huge_handoffd_toml_is_refused_unparsed(tmp_path: Path) -> None:
    root = bare(tmp_path)
    (root / "handoffd.toml").write_text("[daemon]\n" + "#" * (MAX_CONFIG_BYTES + 10) + "\n")
    one_line_error(handoffd_run(root), "handoffd.toml", f"larger than {MAX_CONFIG_BYTES} bytes")


def test_a_deeply_nested_handoffd_toml_is_a_config_error(tmp_path: Path) -> None:
    root = bare(tmp_path)
    (root / "handoffd.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    one_line_error(handoffd_run(root), "handoffd.toml", "nest too deeply")


def test_a_permission_denied_handoffd_toml_is_a_config_error(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text("[daemon]\nworkers = 2\n")
    if os.geteuid() != 0:  # (root reads a mode-000 file: then the open itself is refused)
        path.chmod(0)
    else:
        real_open = os.open

        def denied(name: Any, *args: Any, **kwargs: Any) -> int:
            if os.fspath(name) == os.fspath(path):
                raise PermissionError(13, "Permission denied", os.fspath(name))
            return real_open(name, *args, **kwargs)
        monkeypatch.setattr(config_module.os, "open", denied)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: cannot read: Permission denied"


def test_a_readable_handoffd_toml_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_bytes(b'[daemon]\r\nworkers = 3\r\n[specialists."@x"]\r\ncommand = ["true"]\r\n')
    config = load_config(path)
    assert config.daemon.workers == 3 and config.specialists["@x"].command == ["true"]
    assert load_config(tmp_path / "missing.toml").daemon.workers == config_module.Config().daemon.workers
    path.write_bytes(b"[daemon]\nworkers = \xff\n")
    with pytest.raises(ConfigError, match="can't decode"):
        load_config(path)


# ---------------------------------------------------------------- 7: artifacts too long a name
HANDLERS = '''
def strref(doc, ctx):
    return {"status": "completed", "output": {"ok": 1}, "artifacts": ["a" * 3000]}

def longname(doc, ctx):
    return {"status": "completed", "output": {"ok": 1},
            "artifacts": [{"name": "n" * 3000 + ".md", "content": "y" * 2000}]}
'''


def moe_message(msg_id: str) -> dict[str, Any]:
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"], doc["target_tier"] = msg_id, "SPECIALIZED_FLEET"
    doc["payload"]["specialist_hint"] = None
    return doc


def moe_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str) -> Workspace:
    return handlers_workspace(tmp_path, monkeypatch, "review15_handlers", HANDLERS,
                              FAST + "[retry]\nmax_retries = 3\nretry_delay_seconds = 0.05\n"
                              '[specialists."SPECIALIZED_FLEET"]\n'
                              f'handler = "review15_handlers:{handler}"\n')


def test_a_reference_too_long_for_the_file_system_fails_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ws = moe_workspace(tmp_path, monkeypatch, "strref")
    try:
        ws.drop("m7.json", moe_message("m7"))
        run(ws)
        assert ws.state_of("m7") == ["failed"]
        book = ws.doc("m7")["handoffd"]
        events = [e["event"] for e in book["history"]]
        assert events.count("claimed") == 1 and "retry_scheduled" not in events, events
        assert book["final_error"]["code"] == "PROCESSING_ERROR"
        assert "File name too long" in book["final_error"]["message"]
        assert ws.doc("m7")["payload"]["recoverable"] is False
    finally:
        ws.cleanup()


def test_an_artifact_name_too_long_for_a_file_is_cut(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ws = moe_workspace(tmp_path, monkeypatch, "longname")
    try:
        ws.drop("m8.json", moe_message("m8"))
        run(ws)
        assert ws.state_of("m8") == ["completed"], ws.doc("m8")["handoffd"].get("final_error")
        stored = [p for p in (ws.root / "artifacts" / "m8").iterdir()]
        assert len(stored) == 1 and stored[0].read_text() == "y" * 2000
        assert len(stored[0].name) <= artifact_paths.MAX_DERIVED_NAME
        assert stored[0].name.startswith("nnnn") and stored[0].name.endswith(".md")
    finally:
        ws.cleanup()


def test_derived_file_names_are_bounded_and_distinct() -> None:
    short = artifact_paths._file_name("report.md")
    assert short == "report.md"
    a, b = artifact_paths._file_name("x" * 500 + "1.txt"), artifact_paths._file_name("x" * 500 + "2.txt")
    assert a != b and len(a) == len(b) == artifact_paths.MAX_DERIVED_NAME and a.endswith(".txt")
    assert len(artifact_paths._file_name("é" * 4000)) <= artifact_paths.MAX_DERIVED_NAME
