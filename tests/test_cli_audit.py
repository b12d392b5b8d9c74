"""Command-line findings of the thirteenth session's docs audit, through the installed commands:
JSON logs that had plain "serving"/"stopped" lines, a missing workspace's exit code and message,
help texts whose "[store]" rich ate, `top` into a pipe that never ended, MCP's timeout and
version, `schemas --copy | head` that stopped copying, and `run -v -q`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace, exe, new_workspace

ROOT = Path(__file__).resolve().parent.parent
MISSING = "/nonexistent-handoffd-workspace"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """One workspace for the tests that only read it or refuse before touching it."""
    workspace = new_workspace(tmp_path_factory.mktemp("audit") / "ws", FLAKY_TOML)
    yield workspace
    workspace.cleanup()


def run(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """An installed command, bounded, its output captured as text."""
    return subprocess.run([exe(args[0]), *args[1:]], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, **kwargs)


# ------------------------------------------------------------------ 1. serve --log-format json
def serve_lines(root: Path, *args: str) -> tuple[int, list[str]]:
    """Start `handoffd serve`, stop it with SIGTERM once it serves; its exit code and stderr lines."""
    proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(root), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # (readline returns at once if the daemon dies)
            line = proc.stderr.readline()
            lines.append(line)
            if "serving" in line or not line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, [line for line in "".join(lines + [rest]).splitlines() if line]


def test_serve_json_says_serving_and_stopped_as_json_records(shared: Workspace) -> None:
    code, lines = serve_lines(shared.root, "--log-format", "json")
    assert code == 0, lines
    records = [json.loads(line) for line in lines]  # every line: a JSON object
    by_event = {r.get("event"): r for r in records}
    serving, stopped = by_event["serving"], by_event["stopped"]
    assert serving["root"] == str(shared.root) and serving["workers"] >= 1
    assert serving["processes"] == 1 and serving["limits"] == {"@flaky": 4}
    assert serving["message"].startswith(f"serving {shared.root}")
    assert stopped["completed"] == 0 and stopped["failed"] == 0 and stopped["lost"] == 0
    assert stopped["message"].startswith("stopped: completed 0")


def test_serve_text_lines_are_unchanged(shared: Workspace) -> None:
    code, lines = serve_lines(shared.root)
    assert code == 0, lines
    assert lines[0].startswith(f"handoffd: serving {shared.root} (")
    assert lines[-1] == "handoffd: stopped: completed 0, failed 0, retry scheduled 0"


# ------------------------------------------------------------------ 2. a missing workspace
@pytest.mark.parametrize("command", ["run", "serve", "sweep", "metrics"])
def test_a_missing_root_is_not_found_and_names_the_option(command: str) -> None:
    proc = run("handoffd", command, "--root", MISSING)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr
    assert "fix --root" in proc.stderr


def test_a_missing_root_from_the_environment_names_the_variable() -> None:
    proc = run("handoffd", "run", env={"HANDOFFD_ROOT": MISSING})
    assert proc.returncode == 3, proc.stderr
    assert "fix $HANDOFFD_ROOT" in proc.stderr and "--root" not in proc.stderr, proc.stderr
    shown = run("handoff", "ls", env={"HANDOFFD_ROOT": MISSING, "HANDOFFD_FULL_CLI": "1"})
    assert shown.returncode == 3 and "fix $HANDOFFD_ROOT" in shown.stderr, shown.stderr


def test_the_docs_give_run_its_not_found_exit() -> None:
    """DESIGN.md: 3 is "not found", for every command; README and commands.md said 0/1/2."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    commands = " ".join((ROOT / "docs" / "commands.md").read_text().split())
    assert "3 when the workspace directory does not exist" in readme
    assert "3 when the workspace directory" in commands


# ------------------------------------------------------------------ 3. help texts and rich
def test_bracketed_words_survive_in_help() -> None:
    wide = {"COLUMNS": "250", "HANDOFFD_FULL_CLI": "1"}
    assert "else [store] url" in run("handoffd", "run", "--help", env=wide).stdout
    assert "Needs handoffd[mcp]." in run("handoffd", "--help", env=wide).stdout


def test_no_help_text_holds_unescaped_rich_markup() -> None:
    """Every command's and option's help of both programs: "[word]" is a rich tag (dropped)."""
    from rich.markup import RE_TAGS
    from typer.main import get_command

    from handoffd.cli.handoff_cmd import app as handoff_app
    from handoffd.cli.handoffd_app import app as handoffd_app

    def texts(command: Any, path: str) -> Iterator[tuple[str, str]]:
        yield path, command.help or ""
        for param in getattr(command, "params", []):
            yield f"{path} {param.name}", getattr(param, "help", None) or ""
        for name, sub in getattr(command, "commands", {}).items():
            yield from texts(sub, f"{path} {name}")

    eaten = [(where, tag.group(0)) for prog, app in (("handoff", handoff_app),
                                                     ("handoffd", handoffd_app))
             for where, text in texts(get_command(app), prog)
             for tag in RE_TAGS.finditer(text) if not tag.group(2)]  # (group 2: its escape)
    assert not eaten


# ------------------------------------------------------------------ 4. top without a terminal
def test_top_refuses_a_stdout_that_is_not_a_terminal(shared: Workspace, tmp_path: Path) -> None:
    out = tmp_path / "top.txt"
    with out.open("w") as sink:
        proc = subprocess.run([exe("handoff"), "top", "--root", str(shared.root)],
                              stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.PIPE,
                              text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "handoff ls --watch" in proc.stderr and out.read_text() == ""


# ------------------------------------------------------------------ 5. MCP
def mcp_session(root: Path, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`handoffd mcp` on stdio: initialize, then ``calls`` (tools/call params) in order; the
    replies, the initialize one first."""
    hello = {"protocolVersion": "2025-06-18", "capabilities": {},
             "clientInfo": {"name": "test", "version": "1"}}
    lines = [{"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": hello},
             {"jsonrpc": "2.0", "method": "notifications/initialized"}]
    lines += [{"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": call}
              for n, call in enumerate(calls, 1)]
    proc = subprocess.Popen([exe("handoffd"), "mcp", "--root", str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        replies = []
        for line in lines:  # one at a time: each call after the previous answer
            proc.stdin.write(json.dumps(line) + "\n")
            proc.stdin.flush()
            if "id" in line:
                replies.append(json.loads(proc.stdout.readline()))
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return replies


def test_mcp_reports_its_version_and_refuses_a_timeout_that_is_not_a_number(
        shared: Workspace) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")
    from handoffd import __version__
    hello, bad, numeric, flag = mcp_session(shared.root, [
        {"name": "wait_handoff", "arguments": {"handoff_id": "nope-1", "timeout": "x"}},
        {"name": "wait_handoff", "arguments": {"handoff_id": "nope-1", "timeout": "0"}},
        {"name": "wait_handoff", "arguments": {"handoff_id": "nope-1", "timeout": True}}])
    assert hello["result"]["serverInfo"] == {"name": "handoffd", "version": __version__}
    said = bad["result"]["content"][0]["text"]
    assert bad["result"]["isError"] and "USAGE_ERROR: timeout must be a number" in said, said
    assert "validation error" not in said
    assert "NOT_FOUND" in numeric["result"]["content"][0]["text"]  # "0" reads as 0 s, as before
    assert "USAGE_ERROR" in flag["result"]["content"][0]["text"]


# ------------------------------------------------------------------ 6. schemas --copy | head
def test_schemas_copy_completes_when_the_reader_leaves(tmp_path: Path) -> None:
    from handoffd.core.validation import builtin_schema_names
    root = tmp_path / "ws"
    root.mkdir()
    proc = subprocess.run(f"'{exe('handoff')}' schemas --copy --root '{root}' | head -1",
                          shell=True, capture_output=True, text=True, timeout=60)
    assert proc.stdout.count("\n") == 1, proc
    assert sorted(p.name for p in (root / "schemas").iterdir()) == sorted(builtin_schema_names())


# ------------------------------------------------------------------ 7. run -v -q
@pytest.mark.parametrize("full", [False, True])
def test_run_refuses_verbose_with_quiet(shared: Workspace, full: bool) -> None:
    env = {"HANDOFFD_FULL_CLI": "1"} if full else {}
    proc = run("handoffd", "run", "-v", "-q", "--root", str(shared.root), env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "-q" in proc.stderr and "Traceback" not in proc.stderr
