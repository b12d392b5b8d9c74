"""Four rough edges of the command line and the MCP server (a review's findings): `handoff ls`
cut its listing at 50 rows without a word; `handoff create --wait` gave no reason for a failure;
option values no handoff (or context key) can hold exited 1 instead of the usage error's 2; and
the MCP `create_handoff` answered a taken id with the generic HANDOFFD_ERROR."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace

FULL = {**os.environ, "HANDOFFD_FULL_CLI": "1"}
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}
PATHS = pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
LISTED = 53  # pending handoffs in the listing's workspace: more than the default 50


def run(ws: Workspace, *args: str, env: dict[str, str] | None = None,
        program: str = "handoff") -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe(program), *args, "--root", str(ws.root)], capture_output=True,
                          text=True, timeout=60, env=env or QUICK)


def refused(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    """One stderr line, no traceback, exit ``code``, holding ``words``."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].split(": ")[1] == "error", proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])


def request(hid: str, to: str = "@nobody") -> dict[str, Any]:
    return {"handoff_id": hid, "timestamp": "2026-11-26T00:00:00Z", "source": {"agent_id": "@cli"},
            "target": {"agent_id": to}, "input": {"data": {}}}


@pytest.fixture(scope="module")
def listed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """A workspace with LISTED pending handoffs (dropped in, as a foreign producer would), the
    first three to @one, the rest to @nobody. Only read by the tests that use it."""
    ws = new_workspace(tmp_path_factory.mktemp("polish") / "ls", "")
    for n in range(LISTED):
        ws.drop(f"p{n:02}.json", request(f"p{n:02}", "@one" if n < 3 else "@nobody"))
    yield ws
    ws.cleanup()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """An empty workspace for the refusals (each test checks that nothing was written)."""
    ws = new_workspace(tmp_path_factory.mktemp("polish") / "plain", "")
    yield ws
    ws.cleanup()


def pending(ws: Workspace) -> list[str]:
    return sorted(p.name for p in (ws.root / "handoffs" / "pending").iterdir())


# ---------------------------------------------------------------- 1: ls says what it left out
@PATHS
def test_ls_says_how_many_rows_the_default_limit_left_out(listed: Workspace,
                                                          env: dict[str, str]) -> None:
    proc = run(listed, "ls", env=env)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1 + 50  # header, 50 rows
    assert proc.stderr == f"handoff: 3 more not shown (--limit 50): --limit {LISTED} lists them all\n"
    every = run(listed, "ls", "--limit", str(LISTED), env=env)
    assert len(every.stdout.splitlines()) == 1 + LISTED and every.stderr == ""


@PATHS
def test_ls_json_stays_one_array_and_the_note_goes_to_stderr(listed: Workspace,
                                                             env: dict[str, str]) -> None:
    proc = run(listed, "ls", "--json", "--limit", "2", env=env)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) == 2
    assert proc.stderr == f"handoff: {LISTED - 2} more not shown (--limit 2): --limit {LISTED} lists them all\n"
    assert run(listed, "ls", "--json", "--state", "pending", "--limit", "60", env=env).stderr == ""


def test_ls_limit_0_still_lists_nothing_and_counts_the_rest(listed: Workspace) -> None:
    proc = run(listed, "ls", "--limit", "0")
    assert proc.stdout.split() == ["ID", "PARENT", "STATE", "FROM", "TO", "ATTEMPT", "UPDATED", "NOTE"]
    assert proc.stderr == f"handoff: {LISTED} more not shown (--limit 0): --limit {LISTED} lists them all\n"


def test_ls_with_a_filter_says_there_are_more_without_counting(listed: Workspace) -> None:
    """A filter's rows are counted only by reading every document: the note says "more"."""
    proc = run(listed, "ls", "--to", "@one", "--limit", "2")
    assert len(proc.stdout.splitlines()) == 1 + 2
    assert proc.stderr == "handoff: more not shown (--limit 2): raise --limit to list them\n"
    for limit in ("3", "4"):  # exactly all, and more than all: nothing left out
        assert run(listed, "ls", "--to", "@one", "--limit", limit).stderr == ""


# ---------------------------------------------------------------- 2: create --wait says why
FAILING = json.dumps([sys.executable, "-S", "-c", "import sys; sys.stdin.read(); print(sys.argv[1])",
                      json.dumps({"status": "failed", "error": {
                          "code": "PROCESSING_ERROR", "message": "boom \x1b[2J\nsecond line",
                          "retryable": False}})])


def test_create_wait_prints_the_reason_wait_prints(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", '[daemon]\nsettle_seconds = 0.1\ndurability = "fast"\n\n'
                       f'[specialists."@bad"]\ncommand = {FAILING}\nretry = {{ max_retries = 0 }}\n')
    try:
        waiting = subprocess.Popen([exe("handoff"), "create", "--to", "@bad", "--id", "w1", "--wait",
                                    "--wait-timeout", "60", "--root", str(ws.root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while pending(ws) != ["w1.json"]:  # created: now run it
            assert waiting.poll() is None and time.monotonic() < deadline, waiting.communicate()
            time.sleep(0.02)
        assert ws.handoffd("run").returncode == 1  # it failed, on purpose
        out, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait(timeout=10)
    said = "handoff: w1: PROCESSING_ERROR: boom \\x1b[2J\\nsecond line\n"  # escapes shown
    assert (waiting.returncode, out, err) == (1, "w1\n", said)
    assert ws.handoff("wait", "w1").stderr == said  # the very line `handoff wait` prints


# ---------------------------------------------------------------- 3: bad values exit 2
@PATHS
@pytest.mark.parametrize("args, words", [
    (("--priority", "urgent"), ("priority: 'urgent' is not one of",)),
    (("--priority", "9"), ("priority: 9 is not one of",)),
    (("--timeout-seconds", "1e400"), ("--timeout-seconds must be above 0", "not inf")),
    (("--timeout-seconds", "700000"), ("at most 604800 (one week)",)),
    (("--timeout-seconds", "-1"), ("--timeout-seconds must be above 0",)),
    (("--from", ""), ("source.agent_id: '' must be a non-empty string",)),
    (("--from", "@me\udcff"), ("--from is not UTF-8 text",)),
], ids=["priority-name", "priority-number", "timeout-inf", "timeout-week", "timeout-negative",
        "from-empty", "from-not-utf8"])
def test_create_option_values_no_handoff_can_hold_are_usage_errors(
        plain: Workspace, env: dict[str, str], args: tuple[str, ...], words: tuple[str, ...]) -> None:
    """They exited 1, as if the handoff had failed (a huge timeout even named a new id)."""
    refused(run(plain, "create", "--to", "@x", *args, env=env), 2, *words)
    assert pending(plain) == []


def test_failures_that_are_not_the_arguments_fault_keep_exit_1(plain: Workspace) -> None:
    assert run(plain, "create", "--to", "@x", "--id", "taken").returncode == 0
    refused(run(plain, "create", "--to", "@x", "--id", "taken"), 1, "taken already exists")
    refused(run(plain, "create", "--to", "@x", "--depends-on", "nothing-yet"), 1,
            "depends on nothing-yet, which does not exist")
    assert pending(plain) == ["taken.json"]
    (plain.root / "handoffs" / "pending" / "taken.json").unlink()


@pytest.mark.parametrize("args", [
    ("context", "get", "bad key"), ("context", "set", "bad key", "1"),
    ("context", "set", "../escape", "--data", "1"), ("context", "history", "a//b")])
def test_a_context_key_no_value_can_have_is_a_usage_error(plain: Workspace,
                                                         args: tuple[str, ...]) -> None:
    refused(run(plain, *args), 2, "is not a safe relative name")
    assert not list((plain.root / "context").glob("**/*.json"))


def test_context_set_values_and_agents_it_cannot_store_are_usage_errors(plain: Workspace,
                                                                         tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 300 + "]" * 300)
    refused(run(plain, "context", "set", "k", "--input", str(deep)), 2,
            "context value for 'k' nests more than 256 levels deep")
    refused(run(plain, "context", "set", "k", "1", "--as", "@a\udcff"), 2, "--as is not UTF-8 text")
    assert not list((plain.root / "context").glob("**/*.json"))


def test_other_options_out_of_range_are_usage_errors(plain: Workspace) -> None:
    for value in ("nan", "-1"):  # NaN never redrew, a negative value redrew at every poll
        refused(run(plain, "top", "--refresh", value), 2, "--refresh must be 0 to 3600 seconds")
    missing = plain.root / "no-such-folder" / "handoffd.prom"
    refused(run(plain, "metrics", "--textfile", str(missing), program="handoffd"), 2,
            "--textfile", "no folder")  # as serve --metrics-textfile says it


# ---------------------------------------------------------------- 4: MCP's duplicate id
def test_mcp_error_code_of_a_taken_id_is_the_specific_one() -> None:
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    from handoffd.core.errors import Conflict, DuplicateHandoff
    from handoffd.service.mcp_server import error_code
    assert error_code(DuplicateHandoff("handoff x already exists")) == "DUPLICATE_HANDOFF_ID"
    assert error_code(Conflict("a different request holds x")) == "CONFLICT"  # (a subclass)


def test_mcp_create_handoff_of_a_taken_id_says_duplicate_handoff_id(tmp_path: Path) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    from test_mcp_hostile import Server
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    server = Server(root)  # no daemon: what it creates stays pending
    try:
        server.tool(1, "create_handoff", {"to": "@echo", "data": {}, "handoff_id": "twice"})
        assert json.loads(server.text(1)) == {"id": "twice"}
        server.tool(2, "create_handoff", {"to": "@echo", "data": {}, "handoff_id": "twice"})
        said = server.error(2)  # (the SDK puts "Error executing tool create_handoff: " first)
        assert ": DUPLICATE_HANDOFF_ID: handoff twice already exists" in said, said
        server.tool(3, "create_handoff", {"to": "@echo", "data": {"other": 1},
                                          "handoff_id": "twice", "if_absent": True})
        assert ": CONFLICT: handoff twice already exists" in server.error(3), server.error(3)
    finally:
        server.proc.kill()
        server.proc.wait(timeout=10)


def test_ls_quarantined_keeps_its_limit_and_lists_the_newest_first(tmp_path: Path) -> None:
    """`--limit 0` listed every quarantined file ([-0:] is the whole list), and they came
    oldest first where every other listing is newest first."""
    from handoffd.core.config import Config
    from handoffd.core.specialists import Registry
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.features.build import build_engine as build
    from handoffd.service.queries import list_handoffs
    root = HandoffdWorkspace(tmp_path / "qws")
    root.ensure()
    engine = build(root, Config(), Registry())
    try:
        store = engine.backend.store
        for n in range(3):
            bad = root.root / "handoffs" / "pending" / f"bad-{n}.json"
            bad.write_text("{")
            store.quarantine(bad, "MALFORMED_JSON", f"number {n}",
                             now=datetime(2026, 1, 1, 0, 0, n, tzinfo=timezone.utc))
        assert list_handoffs(engine, state="quarantined", limit=0) == []
        rows = list_handoffs(engine, state="quarantined", limit=2)
        assert [row["note"] for row in rows] == ["MALFORMED_JSON: number 2",
                                                 "MALFORMED_JSON: number 1"]
    finally:
        engine.backend.close()


@PATHS
def test_show_says_why_a_pending_handoff_waits_as_ls_does(listed: Workspace,
                                                          env: dict[str, str]) -> None:
    """`handoff show` of a pending handoff said nothing of why it waits (ls's NOTE: no
    specialist, its dependencies, a pause, its rate); it gives the same note now, and --json
    carries it as "note"."""
    listed_rows = json.loads(run(listed, "ls", "--json", "--limit", str(LISTED), env=env).stdout)
    note = next(row["note"] for row in listed_rows if row["id"] == "p00")
    assert "no specialist" in note, note
    shown = run(listed, "show", "p00", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"note: {note}" in shown.stdout.splitlines()[1], shown.stdout
    as_json = json.loads(run(listed, "show", "p00", "--json", env=env).stdout)
    assert as_json["note"] == note


def test_a_filtered_listing_reads_the_documents_once(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`ls --to A` at its limit listed again with one more row to say whether there were
    more: every document read twice (17.9 s against 9.1 s over 100,000 finished documents)."""
    from handoffd.cli import reads
    from handoffd.core.config import Config
    from handoffd.core.specialists import Registry
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.features.build import build_engine as build
    from handoffd.service import queries
    root = HandoffdWorkspace(tmp_path / "fws")
    root.ensure()
    for n in range(5):
        (root.root / "handoffs" / "pending" / f"f{n}.json").write_text(
            json.dumps(request(f"f{n}", "@one")))
    engine = build(root, Config(), Registry())
    asked: list[int] = []
    real = queries.list_handoffs

    def counting(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        asked.append(kwargs["limit"])
        return real(*args, **kwargs)

    monkeypatch.setattr(queries, "list_handoffs", counting)
    try:
        rows, note = reads.list_rows(engine, to="@one", limit=3)
        assert len(rows) == 3 and note is not None and "more not shown" in note
        assert asked == [4]  # one pass, one row past the limit
        rows, note = reads.list_rows(engine, to="@one", limit=5)
        assert len(rows) == 5 and note is None
    finally:
        engine.backend.close()


def test_mcp_list_handoffs_says_whether_its_limit_left_rows_out(tmp_path: Path) -> None:
    """list_handoffs capped its limit (1 to 1,000) and never said it had left rows out: an
    agent could not tell a full listing from a cut one (ls says so on stderr)."""
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    from test_mcp_hostile import Server
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    server = Server(root)
    try:
        for n in range(3):
            server.tool(n + 1, "create_handoff", {"to": "@echo", "data": {},
                                                  "handoff_id": f"m{n}"})
            assert json.loads(server.text(n + 1))["id"] == f"m{n}"
        server.tool(10, "list_handoffs", {"limit": 2})
        listed = json.loads(server.text(10))
        assert len(listed["handoffs"]) == 2 and listed["more"] is True and listed["limit"] == 2
        server.tool(11, "list_handoffs", {"limit": 3})
        listed = json.loads(server.text(11))
        assert len(listed["handoffs"]) == 3 and listed["more"] is False
        server.tool(12, "list_handoffs", {"limit": 10**9})
        assert json.loads(server.text(12))["limit"] == 1000  # as kept, said
    finally:
        server.proc.kill()
        server.proc.wait(timeout=10)
