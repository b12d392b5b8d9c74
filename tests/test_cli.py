"""The `handoff` command line: output, exit codes, one-line errors."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from conftest import FLAKY_TOML, Workspace, exe, new_workspace


def test_create_prints_the_id_alone_and_ls_show_json(ws: Workspace) -> None:
    proc = ws.handoff("create", "--to", "@flaky", "--data", '{"mode": "ok"}', "--id", "hoff-cli-1")
    assert proc.returncode == 0 and proc.stdout == "hoff-cli-1\n" and proc.stderr == ""
    rows = json.loads(ws.handoff("ls", "--json").stdout)
    assert [(r["id"], r["state"], r["to"], r["from"]) for r in rows] == [
        ("hoff-cli-1", "pending", "@flaky", "@cli")]
    shown = json.loads(ws.handoff("show", "hoff-cli-1", "--json").stdout)
    assert shown["state"] == "pending" and shown["document"]["input"]["data"] == {"mode": "ok"}
    assert shown["document"]["handoffd"]["history"][0]["event"] == "created"
    human = ws.handoff("show", "hoff-cli-1").stdout
    assert "history" in human and "created" in human


def test_input_from_stdin_and_file(ws: Workspace, tmp_path: Path) -> None:
    hid = ws.handoff("create", "--to", "@flaky", "--input", "-", input='{"mode": "ok", "k": 1}').stdout.strip()
    assert ws.doc(hid)["input"]["data"]["k"] == 1
    data = tmp_path / "in.json"
    data.write_text('{"mode": "ok", "k": 2}')
    hid2 = ws.create("--to", "@flaky", "--input", str(data), "--priority", "high", "--timeout-seconds", "9")
    doc = ws.doc(hid2)
    assert doc["input"]["data"]["k"] == 2 and doc["priority"] == "high" and doc["timeout_seconds"] == 9


def test_duplicate_id_names_the_existing_one(ws: Workspace) -> None:
    ws.create("--to", "@flaky", "--id", "taken")
    proc = ws.handoff("create", "--to", "@flaky", "--id", "taken")
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("handoff: error: handoff taken already exists in pending/; "
                                   "choose another id or `handoff retry` the existing one")


def test_usage_errors_exit_2_without_traceback(ws: Workspace) -> None:
    for args in (["create", "--to", "@x", "--data", "{nope"], ["create"], ["ls", "--state", "weird"],
                 ["create", "--to", "@x", "--id", "../escape"]):
        proc = ws.handoff(*args)
        assert proc.returncode in (1, 2), (args, proc.returncode)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(ws.root.parent.glob("escape*"))


def test_not_found_exits_3(ws: Workspace) -> None:
    for args in (["show", "nope"], ["wait", "nope", "--timeout", "1"], ["retry", "nope"]):
        proc = ws.handoff(*args)
        assert proc.returncode == 3, (args, proc.stderr)
        assert "no handoff nope" in proc.stderr


def test_wait_times_out_with_124_then_succeeds(ws: Workspace) -> None:
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    proc = ws.handoff("wait", hid, "--timeout", "0.5")
    assert proc.returncode == 124 and "still not finished" in proc.stderr
    daemon = ws.serve()
    proc = ws.handoff("wait", hid, "--timeout", "30")
    assert proc.returncode == 0 and proc.stdout.strip() == f"{hid} completed"
    ws.stop(daemon)


def test_create_wait_exit_codes(ws: Workspace) -> None:
    daemon = ws.serve()
    ok = ws.handoff("create", "--to", "@flaky", "--data", '{"mode": "ok"}', "--wait", "--wait-timeout", "30")
    assert ok.returncode == 0 and ok.stdout.startswith("hoff-")
    bad = ws.handoff("create", "--to", "@flaky", "--data", '{"mode": "permanent"}', "--wait")
    assert bad.returncode == 1
    ws.stop(daemon)


def test_retry_requeues_and_keeps_history(ws: Workspace) -> None:
    perm = ws.create("--to", "@flaky", "--data", '{"mode": "permanent"}')
    assert ws.handoffd("run").returncode == 1
    refused = ws.handoff("retry", perm)
    assert refused.returncode == 1 and "--force" in refused.stderr
    forced = ws.handoff("retry", perm, "--force")
    assert forced.returncode == 0 and forced.stdout.strip() == perm
    doc = ws.doc(perm)
    assert doc["status"] == "pending" and doc["retry_count"] == 1
    events = [e["event"] for e in doc["handoffd"]["history"]]
    assert events[:3] == ["created", "claimed", "failed"] and events[-1] == "retried"
    again = ws.handoff("retry", perm)
    assert again.returncode == 1 and "not failed" in again.stderr


def test_retry_all_failed(ws: Workspace) -> None:
    ids = [ws.create("--to", "@flaky", "--data", '{"mode": "fail"}') for _ in range(2)]
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text().replace("max_retries = 2", "max_retries = 0"))
    ws.handoffd("run")
    assert all(ws.state_of(i) == ["failed"] for i in ids)
    proc = ws.handoff("retry", "--all-failed")
    assert proc.returncode == 0 and sorted(proc.stdout.split()) == sorted(ids)
    assert all(ws.state_of(i) == ["pending"] for i in ids)


def test_validate_reports_every_error_with_its_path(ws: Workspace, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"handoff_id": "h1", "target": {"agent_id": "@x"}, "timestamp": "2026-01-13T10:00:00Z"}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"handoff_id": "h 1", "target": {}, "timestamp": "yesterday", "priority": "urgent"}))
    proc = ws.handoff("validate", str(good), str(bad))
    assert proc.returncode == 1
    assert f"{good}: valid (native)" in proc.stdout
    out = proc.stdout
    for path in ("handoff_id", "target", "timestamp", "priority"):
        assert f"\n  {path}: " in out, out
    js = json.loads(ws.handoff("validate", str(bad), "--json").stdout)
    assert js[0]["valid"] is False and len(js[0]["errors"]) >= 4
    assert ws.handoff("validate", str(good)).returncode == 0


def test_schemas_lists_builtins(ws: Workspace) -> None:
    names = ws.handoff("schemas").stdout.split()
    assert {"native.request.schema.json", "native.response.schema.json", "native.failure.schema.json"} <= set(names)


def test_run_exit_code_counts_documents_rejected_at_admission(ws: Workspace) -> None:
    ws.drop("rejected.json", {"handoff_id": "rejected", "target": {"agent_id": "@flaky"},
                              "priority": "whenever"})
    proc = ws.handoffd("run")
    assert ws.state_of("rejected") == ["failed"]
    assert proc.returncode == 1 and "failed 1" in proc.stderr


def test_bad_values_and_usage_errors_are_one_line(ws: Workspace, tmp_path: Path) -> None:
    cases = [
        (["create", "--to", "@flaky", "--timeout-seconds", "abc"], 2, "Invalid value for '--timeout-seconds'"),
        (["create", "--to", "@flaky", "--priority", "urgent"], 2, "priority"),
        (["create", "--to", "@flaky", "--timeout-seconds", "-5"], 2, "--timeout-seconds"),
        (["validate", "--dialect", "bogus", str(tmp_path)], 2, "unknown dialect 'bogus'"),
        (["validate"], 2, "Missing argument"),
    ]
    for args, code, needle in cases:
        proc = ws.handoff(*args)
        assert proc.returncode == code, (args, proc.returncode, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert json.loads(ws.handoff("ls", "--json").stdout) == []  # nothing invalid was submitted
    import subprocess

    from conftest import exe
    missing = subprocess.run([exe("handoff"), "create", "--to", "@flaky", "--root", str(tmp_path / "typo")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3 and "does not exist" in missing.stderr
    assert not (tmp_path / "typo").exists()
    workers = ws.handoffd("run", "--workers", "0")
    assert workers.returncode == 2 and len(workers.stderr.strip().splitlines()) == 1


def test_broken_pipe_is_quiet(ws: Workspace) -> None:
    import subprocess

    from conftest import exe
    for i in range(30):  # dropped as a foreign producer would: 30 CLI starts would cost ~15 s
        ws.drop(f"pipe-{i}.json", {"handoff_id": f"pipe-{i}", "target": {"agent_id": "@flaky"},
                                   "input": {"data": {}}})
    proc = subprocess.run(f"'{exe('handoff')}' ls --json --root '{ws.root}' | head -1",
                          shell=True, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[" and "error" not in proc.stderr


def test_unsafe_file_name_is_set_aside(ws: Workspace) -> None:
    ws.drop("-dash.json", {"handoff_id": "-dash", "target": {"agent_id": "@flaky"}})
    ws.handoffd("run")
    notes = [r["note"] for r in json.loads(ws.handoff("ls", "--state", "quarantined", "--json").stdout)]
    assert any(n.startswith("UNSAFE_ID") for n in notes)
    assert not list((ws.root / "handoffs" / "failed").glob("*.json"))


def test_specialist_cwd_outside_the_workspace_is_refused(ws: Workspace) -> None:
    """Refused when the configuration is loaded (one line, exit 2), no longer per handoff; the
    run-time check (a cwd turned into a link later) is test_dialect_config_review15's."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text() +
                    '\n[specialists."@escape"]\ncommand = ["pwd"]\ncwd = "../.."\n')
    made = ws.handoff("create", "--to", "@escape", check=False)
    assert made.returncode == 2 and made.stderr.count("\n") == 1, made.stderr
    assert "inside the workspace" in made.stderr
    ran = ws.handoffd("run")
    assert ran.returncode == 2 and "cwd" in ran.stderr


def test_only_the_invoked_command_is_built_and_help_is_unchanged(ws: Workspace) -> None:
    """A start builds the invoked command alone; the listing, a mistyped name and a sub-group's
    help still see the whole app."""
    from handoffd.cli.common import click_command
    from handoffd.cli.handoff_cmd import app

    everything = set(click_command(app, []).commands)
    assert {"create", "ls", "show", "wait", "context", "cancel"} <= everything
    assert set(click_command(app, ["--help"]).commands) == everything
    assert set(click_command(app, ["lss"]).commands) == everything
    assert set(click_command(app, ["ls", "--json"]).commands) == {"ls"}
    assert set(click_command(app, ["context", "get"]).commands) == {"context"}
    listing = subprocess.run([exe("handoff"), "--help"], capture_output=True, text=True,
                             timeout=60).stdout
    assert all(name in listing for name in ("create", "ls", "show", "wait", "context"))
    wrong = ws.handoff("lss", check=False)
    assert wrong.returncode == 2 and "No such command 'lss'" in wrong.stderr
    assert "handoff context ls" in ws.handoff("context", "ls", "--help").stdout


def test_create_if_absent_is_idempotent(ws: Workspace, tmp_path: Path) -> None:
    """An orchestrator that restarts re-submits under a deterministic id: the same request gets
    its id back (exit 0) whether it is pending, running or finished; a different one is a
    conflict (exit 5), never an overwrite."""
    args = ("--to", "@flaky", "--id", "job-7", "--data", '{"mode": "ok"}', "--if-absent")
    assert ws.handoff("create", *args).stdout == "job-7\n"
    again = ws.handoff("create", *args)
    assert (again.returncode, again.stdout) == (0, "job-7\n"), again.stderr
    ws.handoffd("run")
    assert ws.state_of("job-7") == ["completed"]
    after = ws.handoff("create", *args)
    assert (after.returncode, after.stdout) == (0, "job-7\n"), after.stderr
    other = ws.handoff("create", "--to", "@flaky", "--id", "job-7", "--data", '{"mode": "fail"}',
                       "--if-absent")
    assert other.returncode == 5 and "different request" in other.stderr and other.stdout == ""
    plain = ws.handoff("create", "--to", "@flaky", "--id", "job-7", "--data", '{"mode": "ok"}')
    assert plain.returncode == 1 and "already exists" in plain.stderr  # without the flag: as ever
    doc = {"handoff_id": "file-1", "target": {"agent_id": "@flaky"}, "input": {"data": {}}}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(doc))
    for _ in range(2):
        proc = ws.handoff("create", "--file", str(path), "--if-absent")
        assert (proc.returncode, proc.stdout) == (0, "file-1\n"), proc.stderr
    assert len([r for r in ws.runs() if r["id"] == "job-7"]) == 1  # it never ran twice


def test_version_and_shell_completion() -> None:
    import os

    import handoffd
    for program in ("handoff", "handoffd"):
        proc = subprocess.run([exe(program), "--version"], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (0, f"{program} {handoffd.__version__}\n")
    env = {**os.environ, "_HANDOFF_COMPLETE": "complete_bash", "COMP_WORDS": "handoff cr",
           "COMP_CWORD": "1"}
    done = subprocess.run([exe("handoff")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["create"], done
    # --show-completion detects the calling shell (CI runs under sh); the source_<shell>
    # instruction asks for one shell's script whatever the caller is
    script = subprocess.run([exe("handoff")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "_HANDOFF_COMPLETE": "source_bash"})
    assert "_handoff_completion" in script.stdout


# ------------------------------------------------------------------ the quick path
def _full(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    """``handoff ARGS`` through the full (typer) command line, never the quick path."""
    code = "import sys; from handoffd.cli.handoff_cmd import main; sys.argv[0] = 'handoff'; main()"
    return subprocess.run([exe("python"), "-c", code, *args, "--root", str(ws.root)],
                          capture_output=True, text=True, timeout=60)


def test_quick_create_matches_the_full_command_line(ws: Workspace) -> None:
    """`handoff create`'s plain form skips typer (handoffd.cli.quick); it must store the same
    document, print the same line and fail with the same line and exit code."""
    from handoffd.cli.quick import parse
    args = ("--to", "@flaky", "--from", "@me", "--data", '{"mode": "ok"}', "--priority", "high",
            "--timeout-seconds", "30")
    assert parse(["create", *args, "--id", "quick-1"]) is not None  # the quick path takes it
    quick = ws.handoff("create", *args, "--id", "quick-1", check=True)
    full = _full(ws, "create", *args, "--id", "full-1")
    assert (quick.stdout, full.stdout) == ("quick-1\n", "full-1\n") and full.returncode == 0

    def stored(hid: str) -> dict[str, Any]:
        doc = json.loads((ws.root / "handoffs" / "pending" / f"{hid}.json").read_text())
        for key in ("handoff_id", "timestamp", "handoffd"):
            doc.pop(key)
        return doc
    assert stored("quick-1") == stored("full-1")
    for bad in (("--to", "@x", "--data", "{bad"), ("--to", "@x", "--priority", "urgent"),
                ("--to", "@x", "--priority", "²"),  # (isdigit, and int() refuses it)
                ("--to", "@x", "--id", "quick-1"), ("--to", "@x", "--id", "../up")):
        assert parse(["create", *bad]) is not None
        q, f = ws.handoff("create", *bad), _full(ws, "create", *bad)
        assert (q.returncode, q.stderr, q.stdout) == (f.returncode, f.stderr, f.stdout), bad
        assert q.returncode != 0 and q.stderr.count("\n") == 1


def test_quick_show_ls_and_wait_match_the_full_command_line(ws: Workspace) -> None:
    """`show`, `ls` and `wait` in their plain forms skip typer and, piped, rich: every output,
    error line and exit code is the full command line's."""
    from handoffd.cli.quick import parse
    done = ws.handoff("create", "--to", "@flaky", "--data", '{"mode": "ok"}', "--id", "q-done",
                      check=True)
    assert done.returncode == 0
    ws.handoff("create", "--to", "@nobody", "--data", '{"note": "line one\\nline two"}',
               "--id", "q-waits", check=True)
    ws.handoff("create", "--to", "@flaky", "--data", '{"mode": "fail"}', "--id", "q-failed",
               check=True)
    assert ws.handoffd("run").returncode in (0, 1)  # one failed on purpose
    commands = [("show", "q-done"), ("show", "q-failed", "--json"), ("show", "q-waits"),
                ("show", "../x"), ("ls",), ("ls", "--json", "--limit", "2", "--from", "@cli"),
                ("ls", "--state", "bogus"), ("wait", "q-failed"), ("wait", "q-done", "--json"),
                ("wait", "q-waits", "--timeout", "0.2"), ("wait", "nope", "--timeout", "0")]
    for argv in commands:
        assert parse(list(argv)) is not None, argv  # the quick path takes it
        q, f = ws.handoff(*argv), _full(ws, *argv)
        assert (q.returncode, q.stdout, q.stderr) == (f.returncode, f.stdout, f.stderr), argv
    listing = ws.handoff("ls").stdout.splitlines()
    assert len(listing) == 4 and listing[0].split() == ["ID", "PARENT", "STATE", "FROM", "TO",
                                                        "ATTEMPT", "UPDATED", "NOTE"]


def test_quick_context_get_and_set_match_the_full_command_line(ws: Workspace,
                                                               tmp_path: Path) -> None:
    """`context get` and `context set` in their plain forms skip typer (agents call them
    between steps): the same commands on two like workspaces, one through the quick path and
    one through the full command line, give the same outputs, error lines and exit codes; what
    the quick path cannot take (a value that starts with '-', --input -) goes to the full one."""
    from handoffd.cli.quick import parse
    other = new_workspace(tmp_path / "full", FLAKY_TOML)
    commands = [("context", "set", "x/a", '{"n": 1}'), ("context", "get", "x/a"),
                ("context", "get", "x/a", "--with-revision"),
                ("context", "set", "x/a", "--data", "[2]", "--if-revision", "1"),
                ("context", "set", "x/a", "--data", "[3]", "--if-revision", "1"),  # a conflict
                ("context", "set", "x/b", "--data", '"x"', "--as", "@planner"),
                ("context", "set", "task/t", "1"),  # a namespace @cli may not write
                ("context", "set", "x/c", "1", "--data", "2"), ("context", "get", "nope"),
                ("context", "set", "bad key!", "1"), ("context", "get", "../up"),
                ("context", "set", "x/d", "{not json"), ("context", "set", "x/e")]
    try:
        for argv in commands:
            assert parse([f"context {argv[1]}", *argv[2:]]) is not None, argv
            q, f = ws.handoff(*argv), _full(other, *argv)
            assert (q.returncode, q.stdout, q.stderr) == (f.returncode, f.stdout, f.stderr), argv
    finally:
        other.cleanup()
    assert json.loads(ws.handoff("context", "get", "x/a").stdout) == [2]
    for argv in (["context", "set", "k", "-1"], ["context", "set", "k", "--input", "-"],
                 ["context", "ls"], ["context", "get", "k", "--help"],
                 ["context", "get", "k", "--root", ""], ["context", "get", "k", "--root="]):
        assert parse([f"context {argv[1]}", *argv[2:]]) is None, argv  # the full command's
    from handoffd.cli.quick import try_quick
    assert try_quick(["context get", "x/a"]) is None  # one word: no command of the full one
    # stdout closed: refused before anything is done, the same way on both command lines
    # (session 20: `ls >&-` failed with an AttributeError, `create >&-` printed its id nowhere)
    for full in ("", "HANDOFFD_FULL_CLI=1 "):
        closed = subprocess.run(["bash", "-c", f'{full}"$0" context set x/z 1 --root "$1" >&-',
                                 exe("handoff"), str(ws.root)], capture_output=True, text=True,
                                timeout=60)
        assert closed.returncode == 2 and closed.stderr.startswith("handoff: error: stdout "
                                                                   "is closed"), closed.stderr
    assert ws.handoff("context", "get", "x/z").returncode == 3  # nothing was written


def test_piped_tables_are_what_rich_prints_without_folding() -> None:
    """The plain renderer gives rich's piped lines for tables that fit (so output did not change
    when rich left the piped path), and one line per row for those that do not."""
    import io

    from rich.console import Console

    from handoffd.cli.render import plain_table, rich_table
    rows: list[list[Any]] = [["hoff-1", ("pending", "yellow"), "@a", ""],
                             ["hoff-22", ("failed", "red"), "@bb", "HANDLER_ERROR: boom [x]"],
                             ["h3", ("completed", "green"), "@été", "中文 wide"]]
    for title in (None, "history"):
        buffer = io.StringIO()
        Console(file=buffer, soft_wrap=False, highlight=False, width=200).print(
            rich_table(["ID", "STATE", "TO", "NOTE"], rows, title))
        assert plain_table(["ID", "STATE", "TO", "NOTE"], rows, title) == \
            buffer.getvalue().splitlines()
    long = plain_table(["ID", "NOTE"], [["h", "x" * 500 + "\nsecond line"]])
    assert len(long) == 2 and long[1].endswith("x\\nsecond line")


def test_anything_else_goes_to_the_full_command_line() -> None:
    from handoffd.cli.quick import parse
    for argv in (["create"], ["create", "--help"], ["create", "--to"], ["create", "--to="],
                 ["create", "--to", "@x", "--wait"], ["create", "--to", "@x", "--to", "@y"],
                 ["create", "--to", "@x", "--file", "d.json"], ["create", "--data", "{}"],
                 ["create", "--to", "--data"], ["create", "--to", "@x", "--depends-on", "a"],
                 ["show"], ["show", "a", "b"], ["show", "--help"], ["ls", "--watch"],
                 ["ls", "x"], ["wait", "a", "--json", "--json"], ["wait", "a", "-h"],
                 ["retry", "a"], ["cancel", "a"], []):
        assert parse(argv) is None, argv
    assert parse(["create", "--to=@x", "--data={}"]) == ("create", [], {"to": "@x", "data": "{}"})
    assert parse(["show", "a", "--json"]) == ("show", ["a"], {"as_json": True})
    assert parse(["ls", "--limit=5", "--state", "failed"]) == \
        ("ls", [], {"limit": "5", "state": "failed"})
    from handoffd.cli.quick import try_quick
    for argv in (["ls", "--limit", "x"], ["ls", "--limit", "2.5"], ["wait", "a", "--timeout", "nan"],
                 ["create", "--to", "@x", "--timeout-seconds", "soon"]):
        assert try_quick(argv) is None, argv  # values that do not convert: the full parser words it
