"""Findings of a review of the `handoff` command line and the Python client (the MCP server's
are in test_mcp_hostile.py): options `create --file` dropped without a word, a `--priority`
that was an internal error, escapes from file names, a deep `trace` folded and cut short, a
`retry` that stopped at the first missing id, a negative `ls --limit`, raw controls from
`ls --watch --json`, and a client that filed data too deep to read back or listed nothing for
an unknown state."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, exe

FULL = {**os.environ, "HANDOFFD_FULL_CLI": "1"}
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}


def handoff(ws: Workspace, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoff"), *args, "--root", str(ws.root)], capture_output=True,
                          text=True, timeout=60, env=env or QUICK)


def one_line(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The one stderr line of a refusal with exit ``code`` holding ``words`` (no traceback)."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("handoff: error: "), proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def native(hid: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": hid, "timestamp": "2026-11-26T00:00:00Z",
            "source": {"agent_id": "@cli"}, "target": {"agent_id": "@nobody"},
            "input": {"data": {}}, **extra}


def pending(ws: Workspace) -> list[str]:
    return sorted(p.name for p in (ws.root / "handoffs" / "pending").iterdir())


# ---------------------------------------------------------------- 1: create --file
@pytest.mark.parametrize("option", [
    ("--depends-on", "does-not-exist"), ("--priority", "critical"), ("--timeout-seconds", "5"),
    ("--from", "@zzz"), ("--from", "@cli"), ("--to", "@x"), ("--id", "other")])
def test_create_file_refuses_the_options_the_document_says_itself(ws: Workspace,
                                                                   option: tuple[str, str]) -> None:
    """They were dropped without a word: the handoff was due at once, ungated by --depends-on,
    at the document's priority and time limit. An explicit --from @cli is refused too."""
    (ws.root / "doc.json").write_text(json.dumps(native("filedoc1")))
    proc = handoff(ws, "create", "--file", str(ws.root / "doc.json"), *option)
    one_line(proc, 2, "--file submits a whole document", f"given: {option[0]}")
    assert proc.stdout == "" and pending(ws) == []


def test_wait_timeout_without_wait_is_refused(ws: Workspace) -> None:
    (ws.root / "doc.json").write_text(json.dumps(native("filedoc2")))
    for args in (("--file", str(ws.root / "doc.json")), ("--to", "@x")):
        proc = handoff(ws, "create", *args, "--wait-timeout", "5")
        one_line(proc, 2, "--wait-timeout applies to --wait")
    assert pending(ws) == []
    # with --wait it bounds the wait, as before (nothing runs it: exit 124)
    proc = handoff(ws, "create", "--file", str(ws.root / "doc.json"), "--wait",
                   "--wait-timeout", "0.2")
    assert (proc.returncode, proc.stdout) == (124, "filedoc2\n"), proc.stderr


def test_create_to_keeps_its_from_default_and_an_explicit_one(ws: Workspace) -> None:
    for env in (QUICK, FULL):
        tag = "q" if env is QUICK else "f"
        assert handoff(ws, "create", "--to", "@x", "--id", f"{tag}-default", env=env).returncode == 0
        assert handoff(ws, "create", "--to", "@x", "--from", "@me", "--id", f"{tag}-me",
                       env=env).returncode == 0
        assert ws.doc(f"{tag}-default")["source"] == {"agent_id": "@cli"}
        assert ws.doc(f"{tag}-me")["source"] == {"agent_id": "@me"}
        one_line(handoff(ws, "create", "--to", "@x", "--from", "", env=env), 2,
                 "source.agent_id")  # an empty one is still refused, not made @cli


# ---------------------------------------------------------------- 8: --priority ²
@pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
@pytest.mark.parametrize("priority", ["²", "١", "₃"])
def test_a_priority_of_unicode_digits_is_refused_by_name(ws: Workspace, env: dict[str, str],
                                                          priority: str) -> None:
    """str.isdigit() is true for them and int() refuses them: it was an internal error."""
    proc = handoff(ws, "create", "--to", "@x", "--priority", priority, env=env)
    one_line(proc, 2, f"priority: '{priority}' is not one of")
    assert pending(ws) == []


def test_mcp_http_port_of_unicode_digits_is_a_usage_error(ws: Workspace) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    proc = subprocess.run([exe("handoffd"), "mcp", "--http", "127.0.0.1:²", "--root",
                           str(ws.root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give HOST:PORT" in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr


# ---------------------------------------------------------------- 4: purge / archive names
@pytest.mark.parametrize("command", [("purge",), ("purge", "--dry-run"), ("archive",),
                                     ("archive", "--dry-run")])
def test_purge_and_archive_show_a_file_name_escaped(ws: Workspace, command: tuple[str, ...]) -> None:
    name = "z\x1b]0;PWNED\x07"
    (ws.root / "handoffs" / "completed" / f"{name}.json").write_text(
        json.dumps(native("done1", status="completed")))
    proc = handoff(ws, *command, "--older-than", "0s")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout, proc.stdout
    assert "completed/z\\x1b]0;PWNED\\x07" in proc.stdout, proc.stdout


# ---------------------------------------------------------------- 5: a deep trace
def test_a_deep_trace_prints_one_line_per_node_to_its_note(ws: Workspace) -> None:
    """Piped, rich fitted a 150-long chain into 200 columns: rows were folded ("pend"/"ing")
    and the nodes past ~48 dropped, with the "deeper than 100 levels" note."""
    for i in range(150):
        doc = native(f"ch{i}", **({"parent_id": f"ch{i - 1}"} if i else {}))
        (ws.root / "handoffs" / "pending" / f"ch{i}.json").write_text(json.dumps(doc))
    proc = handoff(ws, "trace", "ch149")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "trace of ch149" and len(lines) == 102  # the title, ch0 .. ch100
    for depth, line in enumerate(lines[1:]):
        assert line == " " * 4 * depth + f"└── ch{depth}  @nobody  pending" + (
            "  deeper than 100 levels: `handoff trace ch100` goes on" if depth == 100 else "")


def test_trace_lines_are_what_rich_draws_for_a_tree_that_fits() -> None:
    """The plain lines are rich's piped tree (the output did not change) for a tree that fits,
    with rich's ASCII guides where stdout is not UTF-8."""
    import io

    from rich.console import Console
    from rich.tree import Tree

    from handoffd.cli.orchestration_cmd import _label, tree_lines
    from handoffd.cli.render import rich_text

    class Ascii(io.StringIO):
        encoding = "ascii"  # type: ignore[assignment]  # (rich then draws ASCII guides)

    def node(hid: str, *children: dict[str, Any], **more: Any) -> dict[str, Any]:
        return {"id": hid, "relation": "child", "state": "pending", "to": "@x",
                "children": list(children), **more}

    def grow(parent: Tree, item: dict[str, Any]) -> None:
        branch = parent.add(rich_text(*_label(item, "b")))
        for child in item["children"]:
            grow(branch, child)
    trees = [node("a", node("b", node("c")), node("d", relation="triggered", depends_on=["a"],
                                                    note="a [/bold] note")),
             node("e", node("f"), state="failed", status="error", seconds=1.5)]
    for buffer, utf in ((io.StringIO(), True), (Ascii(), False)):
        tree = Tree("trace of b")
        for item in trees:
            grow(tree, item)
        Console(file=buffer, soft_wrap=False, highlight=False, width=200).print(tree)
        ours = ["trace of b"] + ["".join(p if isinstance(p, str) else p[0] for p in line)
                                 for line in tree_lines(trees, "b", utf=utf)]
        assert ours == [line.rstrip() for line in buffer.getvalue().splitlines()], utf
        assert utf or not any(ch in "".join(ours) for ch in "│├└─")


# ---------------------------------------------------------------- 9: retry goes on
def test_retry_reports_each_id_and_goes_on(ws: Workspace) -> None:
    failed = native("x", status="failed", error={"code": "PROCESSING_ERROR", "message": "x",
                                                 "retryable": True})
    for hid in ("a", "b"):
        (ws.root / "handoffs" / "failed" / f"{hid}.json").write_text(
            json.dumps({**failed, "handoff_id": hid}))
    ws.create("--to", "@x", "--id", "still-pending")
    proc = handoff(ws, "retry", "a", "missing", "still-pending", "b")
    assert proc.stdout.split() == ["a", "b"], proc.stdout  # b was never tried
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and "no handoff missing" in lines[0] and "still-pending is pending" in lines[1]
    assert proc.returncode == 3  # the worst: a missing id (3) over a refusal (1)
    assert ws.state_of("a") == ws.state_of("b") == ["pending"]
    proc = handoff(ws, "retry", "still-pending", "a")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 2, proc.stderr


# ---------------------------------------------------------------- 10: ls --limit
@pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
def test_ls_refuses_a_negative_limit(ws: Workspace, env: dict[str, str]) -> None:
    ws.create("--to", "@x", "--id", "one")
    for args in (("--limit", "-1"), ("--limit=-5",)):
        proc = handoff(ws, "ls", *args, env=env)
        one_line(proc, 2, "--limit", "-")
        assert proc.stdout == ""
    none = handoff(ws, "ls", "--limit", "0", env=env)  # 0 is still a (header-only) listing
    assert none.returncode == 0 and len(none.stdout.splitlines()) == 1


# ---------------------------------------------------------------- 7: ls --watch --json
def test_watch_json_escapes_what_is_not_printable(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every --json output writes controls as \\uXXXX; the watch stream wrote U+009B (a CSI to
    some terminals), U+202E and DEL raw."""
    from handoffd.cli import observe_cmd
    event = {"at": "2026-11-26T00:00:00.000Z", "id": "c1test", "event": "created",
             "state": "pending", "agent": "@c1\x9b2J\u202eevil\x7f", "note": "été"}
    monkeypatch.setattr(observe_cmd, "_events", lambda eng: None)
    monkeypatch.setattr(observe_cmd, "follow", lambda log: iter([event]))
    observe_cmd.watch(None, state=None, to=None, as_json=True)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.isascii() and "\x7f" not in out and out.count("\n") == 1, repr(out)
    assert json.loads(out) == event  # the same JSON value


# ---------------------------------------------------------------- 2, 3: the Python client
@pytest.fixture
def client(tmp_path: Path) -> Any:
    from handoffd import Client
    (tmp_path / "ws").mkdir()  # (a root that does not exist is NotFound, as for --root)
    return Client(tmp_path / "ws")


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def test_client_refuses_data_or_a_document_too_deep_to_read_back(client: Any) -> None:
    """Filed anyway, `handoff show` could not read it and the daemon set it aside as
    DOCUMENT_TOO_DEEP; `handoff create` refuses the same data (exit 2)."""
    from handoffd.core.errors import UsageError
    with pytest.raises(UsageError, match="data nests more than 54 levels"):
        client.create("@x", deep(55), handoff_id="deep1")
    with pytest.raises(UsageError, match="document nests more than 56 levels"):
        client.create(document={**native("deep2"), "input": {"data": deep(55)}})
    assert client.list() == []
    # the deepest that reads back, with what is filed for it (a request keeps 8 levels free)
    client.create("@x", deep(54), handoff_id="deep-ok")
    assert client.get("deep-ok").document["input"]["data"] == deep(54)


def test_client_list_refuses_an_unknown_state(client: Any) -> None:
    from handoffd.core.errors import UsageError
    client.create("@x", {}, handoff_id="one")
    for state in ("bogus", "Pending", ""):
        with pytest.raises(UsageError, match="state must be one of pending"):
            client.list(state=state)
    assert [r["id"] for r in client.list(state="pending")] == ["one"]
    assert client.list(state="quarantined") == []
