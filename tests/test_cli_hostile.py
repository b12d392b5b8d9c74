"""Hostile input to `handoff`: one clear stderr line and the documented exit code (2: a bad
argument), never a traceback, never an internal error, never unbounded memory or a hang."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, exe

FULL = {**os.environ, "HANDOFFD_FULL_CLI": "1"}
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def handoff(ws: Workspace, *args: str, env: dict[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoff"), *args, "--root", str(ws.root)], capture_output=True,
                          text=True, timeout=60, env=env or QUICK, **kwargs)


def refused(proc: subprocess.CompletedProcess[str], *words: str, code: int = 2,
            program: str = "handoff") -> str:
    """The one stderr line of ``program``'s refusal with exit ``code``, holding every one of
    ``words``."""
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def pending(ws: Workspace) -> list[str]:
    return sorted(p.name for p in (ws.root / "handoffs" / "pending").iterdir())


BAD_DATA = [  # (the argument, what the refusal says)
    ("1e400", "1e400, which is not finite"),
    ("-1e400", "-1e400, which is not finite"),
    ("NaN", "NaN, which is not finite"),
    ('{"x": Infinity}', "Infinity, which is not finite"),
    # found on the text (json's recursion limit said "nests too deeply", MALFORMED_JSON)
    (nested(5000), "nests more than 54 levels"),
    # input.data sits two levels in the document, which keeps 8 free (core.documents)
    (nested(55), "nests more than 54 levels"),
    ('"\\ud800"', "lone UTF-16 surrogate"),
    ('{"\\udfff": 1}', "lone UTF-16 surrogate"),
    ('"\udcff"', "not UTF-8"),  # the byte 0xff on the command line (surrogateescape)
    ("{", "not valid JSON"),
    ("9" * 5000, "not valid JSON"),  # over Python's integer digit limit
]
# one of each kind, for the other commands and the full command line (the check is shared)
SOME = [BAD_DATA[i] for i in (0, 3, 4, 6)]


@pytest.mark.parametrize("full", [False, True], ids=["quick", "full"])
def test_create_data_that_a_document_cannot_hold_is_a_usage_error(ws: Workspace,
                                                                  full: bool) -> None:
    for data, says in SOME if full else BAD_DATA:
        refused(handoff(ws, "create", "--to", "@flaky", "--data", data,
                        env=FULL if full else QUICK), "--data", says)
    assert pending(ws) == []
    # the edges of what is accepted: 54 levels, a surrogate pair, a large finite number
    for data in (nested(54), '"\\ud83d\\ude00"', "[1.5e300]"):
        made = handoff(ws, "create", "--to", "@flaky", "--data", data,
                       env=FULL if full else QUICK)
        assert made.returncode == 0 and made.stderr == "", made.stderr
        assert ws.doc(made.stdout.strip())["input"]["data"] == json.loads(data)


def test_input_files_are_checked_as_data_is(ws: Workspace, tmp_path: Path) -> None:
    for i, (data, says) in enumerate(SOME + [BAD_DATA[5]]):
        path = tmp_path / f"bad{i}.json"
        path.write_text(data)
        refused(handoff(ws, "create", "--to", "@flaky", "--input", str(path)), "--input", says)
    refused(handoff(ws, "create", "--to", "@flaky", "--input", "-", input="NaN"),
            "--input holds the number NaN")
    (tmp_path / "latin1.json").write_bytes(b'"\xe9"')
    refused(handoff(ws, "create", "--to", "@flaky", "--input", str(tmp_path / "latin1.json")),
            "not UTF-8")
    refused(handoff(ws, "create", "--to", "@flaky", "--input", str(tmp_path / "missing.json")),
            "--input: cannot read", "No such file")
    refused(handoff(ws, "create", "--to", "@flaky", "--input", str(tmp_path)), "Is a directory")
    refused(handoff(ws, "create", "--file", str(tmp_path / "missing.json")),
            "--file: cannot read", "No such file")
    assert pending(ws) == []


def test_answer_and_context_set_check_their_json(ws: Workspace, tmp_path: Path) -> None:
    for data, says in SOME:
        deep = data == nested(5000)  # (an answer sits 4 levels in; a context value is no document)
        refused(handoff(ws, "context", "set", "notes/x", "--data", data), "--data",
                "nests too deeply" if deep else says)
        refused(handoff(ws, "answer", "hoff-x", "--data", data), "--data",
                "nests more than 52 levels" if deep else says)
    refused(handoff(ws, "context", "set", "notes/x", "NaN"), "VALUE holds the number NaN")
    refused(handoff(ws, "answer", "hoff-x", "--data", nested(53)), "nests more than 52 levels")
    path = tmp_path / "v.json"
    path.write_text('{"x": -Infinity}')
    refused(handoff(ws, "context", "set", "notes/x", "--input", str(path)), "-Infinity")
    refused(handoff(ws, "answer", "hoff-x", "--input", "-", input="1e999"), "1e999")
    # context values are not documents: deep is fine there, as before
    assert handoff(ws, "context", "set", "notes/x", nested(100)).returncode == 0


@pytest.mark.parametrize("how", ["--input FILE", "--input -", "--file -", "--file FILE",
                                 "context --input", "answer --input"])
def test_an_endless_device_is_refused_at_once(ws: Workspace, how: str) -> None:
    """/dev/zero never ends: at most max_document_bytes + 1 bytes are read, then one line."""
    args = {"--input FILE": ("create", "--to", "@flaky", "--input", "/dev/zero"),
            "--input -": ("create", "--to", "@flaky", "--input", "-"),
            "--file -": ("create", "--file", "-"),
            "--file FILE": ("create", "--file", "/dev/zero"),
            "context --input": ("context", "set", "notes/x", "--input", "/dev/zero"),
            "answer --input": ("answer", "hoff-x", "--input", "/dev/zero")}[how]
    started = time.monotonic()
    with open("/dev/zero", "rb") as zero:
        proc = handoff(ws, *args, stdin=zero)
    assert time.monotonic() - started < 10
    refused(proc, "not a regular file" if how == "--file FILE" else "over the 4194304-byte limit")
    assert pending(ws) == []


def test_an_endless_fifo_is_refused_at_once(ws: Workspace, tmp_path: Path) -> None:
    fifo = tmp_path / "endless"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"exec cat /dev/zero > '{fifo}'"],
                              stderr=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        proc = handoff(ws, "create", "--to", "@flaky", "--input", str(fifo))
        assert time.monotonic() - started < 10
        refused(proc, "--input", "over the 4194304-byte limit")
    finally:
        writer.kill()
        writer.wait(timeout=10)
    refused(handoff(ws, "create", "--file", str(fifo)), "not a regular file")
    assert pending(ws) == []


def test_the_limit_is_the_workspaces(ws: Workspace, tmp_path: Path) -> None:
    (ws.root / "handoffd.toml").write_text("[daemon]\nmax_document_bytes = 1024\n")
    big = tmp_path / "big.json"
    big.write_text(json.dumps("x" * 2000))
    refused(handoff(ws, "create", "--to", "@flaky", "--input", str(big)), "1024-byte limit")
    refused(handoff(ws, "create", "--file", str(big)), "--file", "1024-byte limit")
    refused(handoff(ws, "create", "--file", "-", stdin=big.open("rb")), "1024-byte limit")
    small = tmp_path / "small.json"
    small.write_text('{"k": 1}')
    made = handoff(ws, "create", "--to", "@flaky", "--input", str(small))
    assert made.returncode == 0 and ws.doc(made.stdout.strip())["input"]["data"] == {"k": 1}


@pytest.mark.parametrize("record", ['{"*": [1]}', '{"*": "yes", "@a": null}', "[1]",
                                    nested(5000), '{"*": %s}' % nested(600), "{not json"])
def test_a_damaged_paused_record_is_no_pause(ws: Workspace, record: str) -> None:
    meta = ws.root / "handoffs" / ".meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "paused.json").write_text(record)
    for args in (("paused",), ("paused", "--json")):
        proc = handoff(ws, *args)
        said = proc.stderr.splitlines()  # a file that is no records: at most one line naming it
        assert proc.returncode == 0 and len(said) <= 1, proc.stderr
        assert all("paused.json" in line for line in said), proc.stderr
        assert proc.stdout in ("nothing is paused\n", "{}\n")
    ws.create("--to", "@flaky", "--id", "held")  # a pending row: `ls` asks the pause gate
    listed = handoff(ws, "ls")
    said = listed.stderr.splitlines()
    assert listed.returncode == 0 and len(said) <= 1 and "held" in listed.stdout, listed.stderr
    assert all("paused.json" in line for line in said), listed.stderr
    # pausing again replaces the damaged record
    assert handoff(ws, "pause", "@flaky").returncode == 0
    assert "@flaky  paused by" in handoff(ws, "paused").stdout


def test_a_paused_record_keeps_its_good_entries(ws: Workspace) -> None:
    meta = ws.root / "handoffs" / ".meta"
    meta.mkdir(parents=True, exist_ok=True)
    good = {"at": "2026-01-01T00:00:00Z", "by": "@ops", "reason": "maintenance"}
    (meta / "paused.json").write_text(json.dumps({"*": [1], "@flaky": good, "@b": 3}))
    proc = handoff(ws, "paused", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"@flaky": good}


@pytest.mark.parametrize("args", [
    ("show", "../x"), ("wait", "../x", "--timeout", "1"), ("cancel", "../x"), ("retry", "ok", "a/b"),
    ("trace", "../x"), ("answer", "../x", "--data", "{}"), ("create", "--to", "@x", "--id", "../x"),
    ("create", "--to", "@x", "--depends-on", "../x"),
])
@pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
def test_an_id_no_handoff_can_have_is_a_usage_error(ws: Workspace, args: tuple[str, ...],
                                                   env: dict[str, str]) -> None:
    """Found by the third bug hunt: `retry` and `cancel` of a malformed id exited 1 (a failed
    handoff) and `wait` waited for it; an argument is a usage error (exit 2), one line."""
    refused(handoff(ws, *args, env=env), "is not a safe file name")


@pytest.mark.parametrize("where", ["", ".", "nowhere/metrics.prom"])
def test_a_metrics_textfile_that_cannot_be_a_file_is_refused(ws: Workspace, where: str) -> None:
    """Found by the third bug hunt: `--metrics-textfile ''` was taken as "." and the daemon
    warned every 15 s that it could not write a folder."""
    proc = subprocess.run([exe("handoffd"), "serve", "--root", str(ws.root),
                           "--metrics-textfile", where], capture_output=True, text=True,
                          timeout=60, cwd=ws.root)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("handoffd: error: --metrics-textfile") and \
        len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("handoff_id", ["abc\n", "abc\r", "a" * 129, ".hidden", "a/b", "a..b"])
def test_check_id_takes_whole_safe_names_only(handoff_id: str) -> None:
    """Found by the fourth bug hunt: SAFE_ID ended in "$" and was used with match(), which also
    matches before a final newline, so "abc\\n" passed as a safe file name."""
    from handoffd.core.documents import check_id
    from handoffd.core.errors import InvalidDocument
    with pytest.raises(InvalidDocument):
        check_id(handoff_id)
