"""Hostile text in documents reaching a human's terminal, found by the eleventh session's hunt.

r3: at a terminal, `handoff show`, `ls` and `trace` printed escape sequences carried by
documents (clear screen, OSC 52 clipboard writes, OSC 0 window titles) raw, `trace` even when
piped, and `trace` read a conversation id as rich markup ("[link=...]" became a live OSC 8
hyperlink, "[/bold]" an internal error). Now every document-derived string is printed as text
with its control characters shown escaped.

r9: `handoff show` trusted an unsealed ``handoffd`` block in a document dropped by hand: forged
children and 100,000 forged history entries (about 22 s and 100,000 clear-screens at a
terminal). Now show reads bookkeeping as the daemon does (a block it did not seal is ignored),
and prints at most the 200 history entries the daemon keeps.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace

from handoffd.backends.files import seals

# a clipboard write (OSC 52), a window title (OSC 0), clear screen and cursor home
EVIL = "boom\x1b]52;c;cHduZWQ=\x1b\\\x1b]0;PWNED\x1b\\\x1b[2J\x1b[H"
RAW = {"OSC 52 clipboard": b"\x1b]52;", "OSC 0 title": b"\x1b]0;", "clear screen": b"\x1b[2J",
       "OSC 8 hyperlink": b"\x1b]8;",
       # what json.dumps leaves raw: a C1 CSI, DEL, a right-to-left override (UTF-8)
       "C1 CSI": "\x9b".encode(), "DEL": b"\x7f", "RLO": "\u202e".encode()}
SHOWN = b"\\x1b]52;c;cHduZWQ="  # the same sequence, escaped as the piped ls and show show it
TERMINAL_SECONDS = 30.0


def raw_sequences(out: bytes) -> list[str]:
    """Names of the terminal control sequences ``out`` carries raw."""
    return [name for name, seq in RAW.items() if seq in out]


def at_terminal(ws: Workspace, *args: str,
                timeout: float = TERMINAL_SECONDS) -> tuple[int, bytes, float]:
    """Run ``handoff ARGS --root WS`` in a pseudo-terminal (250 columns); (exit code, all it
    wrote, seconds). Killed, and the test failed, after ``timeout`` seconds."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "HANDOFFD_ROOT")}
    env.update(TERM="xterm-256color", COLUMNS="250", LINES="50")  # (as the window says)
    started = time.monotonic()
    proc = subprocess.Popen([exe("handoff"), *args, "--root", str(ws.root)], stdin=secondary,
                            stdout=secondary, stderr=secondary, env=env, start_new_session=True)
    os.close(secondary)
    out = b""
    try:
        while time.monotonic() - started < timeout:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the command exited and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"handoff {args} still writing after {timeout}s")
        return proc.wait(timeout=10), out, time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)


def answering(name: str, answer: dict[str, Any]) -> str:
    """A command specialist that answers ``answer`` whatever it is asked (no retries)."""
    argv = json.dumps([sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])",
                       json.dumps(answer)])
    return f'[specialists."{name}"]\ncommand = {argv}\nretry = {{ max_retries = 0 }}\n'


@pytest.fixture
def hws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace with @evil, whose failures carry EVIL in their error message."""
    ws = new_workspace(tmp_path / "ws", '[daemon]\nsettle_seconds = 0.1\ndurability = "fast"\n\n'
                       + answering("@evil", {"status": "failed", "error": {
                           "code": "PROCESSING_ERROR", "message": EVIL, "retryable": False}}))
    yield ws
    ws.cleanup()


def native(handoff_id: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": handoff_id, "target": {"agent_id": "@nobody"}, "input": {"data": {}},
            **extra}


# ---------------------------------------------------------------- r3: escapes and markup
def test_show_at_a_terminal_prints_document_text_escaped(hws: Workspace) -> None:
    """The failure's message (history detail) and the document's own text: the sequences are
    shown as text, and the C1/DEL/bidi characters json.dumps leaves raw are \\u-escaped."""
    failed = hws.create("--to", "@evil", "--id", "e1", "--data",
                        json.dumps({"note": "csi\x9b2J del\x7f rlo\u202e"}))
    hws.handoffd("run")
    assert hws.wait_state(failed, ("failed",), timeout=30) == "failed"
    rc, out, _ = at_terminal(hws, "show", failed)
    assert rc == 0, out[-2000:]
    assert raw_sequences(out) == []
    assert SHOWN in out  # the history's detail, escaped
    assert b"csi\\u009b2J del\\u007f rlo\\u202e" in out  # the document, still the same JSON
    piped = hws.handoff("show", failed, timeout=30)
    assert piped.returncode == 0 and raw_sequences(piped.stdout.encode()) == []
    as_json = hws.handoff("show", failed, "--json", timeout=30)
    assert raw_sequences(as_json.stdout.encode()) == []
    assert json.loads(as_json.stdout)["document"]["input"]["data"]["note"] == \
        "csi\x9b2J del\x7f rlo\u202e"  # escaped, not changed


def test_ls_at_a_terminal_prints_agent_ids_escaped(hws: Workspace) -> None:
    hws.drop("a1.json", native("a1", source={"agent_id": "@me" + EVIL}))
    rc, out, _ = at_terminal(hws, "ls")
    assert rc == 0, out[-2000:]
    assert b"a1" in out and raw_sequences(out) == []
    assert b"@meboom\\x1b" in out


def test_show_family_line_at_a_terminal_is_text(hws: Workspace) -> None:
    """parent_id and conversation_id are the document's own fields, printed in the family line."""
    hws.drop("f1.json", native("f1", parent_id="p" + EVIL,
                               conversation_id="[link=https://evil.example]x[/link]"))
    rc, out, _ = at_terminal(hws, "show", "f1")
    assert rc == 0, out[-2000:]
    assert raw_sequences(out) == []
    assert b"[link=https://evil.example]x[/link]" in out


CONVERSATIONS = {"c-link": "[link=https://evil.example]click-me[/link]", "c-crash": "[/bold]",
                 "c-esc": "conv" + EVIL}


def drop_conversations(ws: Workspace) -> None:
    for hid, conversation in CONVERSATIONS.items():
        ws.drop(f"{hid}.json", native(hid, conversation_id=conversation,
                                      target={"agent_id": "@to" + EVIL}))


@pytest.mark.parametrize("hid", sorted(CONVERSATIONS))
def test_trace_piped_prints_conversation_ids_as_text(hws: Workspace, hid: str) -> None:
    drop_conversations(hws)
    proc = hws.handoff("trace", hid, timeout=30)
    assert proc.returncode == 0, proc.stderr  # "[/bold]" was "internal error: MarkupError"
    assert raw_sequences(proc.stdout.encode()) == []
    assert "\\x1b]52;" in proc.stdout  # the target's escapes, shown
    first = proc.stdout.splitlines()[0]
    assert first == f"trace of {hid}  conversation " + CONVERSATIONS[hid].replace("\x1b", "\\x1b")


@pytest.mark.parametrize("hid", sorted(CONVERSATIONS))
def test_trace_at_a_terminal_makes_no_link_and_no_escape(hws: Workspace, hid: str) -> None:
    drop_conversations(hws)
    rc, out, _ = at_terminal(hws, "trace", hid)
    assert rc == 0, out[-2000:]
    assert raw_sequences(out) == []  # no OSC 8 hyperlink from "[link=...]"
    flat = out.replace(b"\r\n", b"")  # (a line the terminal's width wrapped, joined)
    assert b"conversation " + CONVERSATIONS[hid].replace("\x1b", "\\x1b").encode() in flat


# ---------------------------------------------------------------- r9: unsealed bookkeeping
FORGED_HISTORY = 100_000


def drop_forged(ws: Workspace, folder: str = "pending") -> None:
    """``victim``, a real pending handoff, and ``h1``, a document dropped by hand whose unsealed
    ``handoffd`` block claims ``victim`` as a child, waits and 100,000 history entries."""
    ws.create("--to", "@nobody", "--id", "victim", "--data", "{}")  # (makes the seal key)
    forged = native("h1", handoffd={
        "revision": 7, "seal": "0" * 32, "children": ["victim"],
        "waiting_children": {"children": ["victim"], "aggregation": "all"},
        "awaiting": {"kind": "needs_clarification", "questions": ["forged?"]},
        "history": [{"event": "completed\x1b[2J"} for _ in range(FORGED_HISTORY)]})
    path = ws.root / "handoffs" / folder / "h1.json"
    path.write_text(json.dumps(forged))


def test_show_ignores_an_unsealed_block_of_a_dropped_document(hws: Workspace) -> None:
    drop_forged(hws)
    proc = hws.handoff("show", "h1", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "victim" not in proc.stdout and "completed" not in proc.stdout
    assert "forged?" not in proc.stdout and "waiting on the requester" not in proc.stdout
    assert "waiting for children" not in proc.stdout  # (its note says it waits for @nobody)
    data = json.loads(hws.handoff("show", "h1", "--json", timeout=30).stdout)
    assert data["family"]["children"] == [] and data["family"]["awaiting"] is None
    assert data["family"]["waiting_children"] is None
    assert data["document"].get("handoffd") in (None, {})


def test_show_at_a_terminal_of_a_forged_history_is_quick_and_clean(hws: Workspace) -> None:
    drop_forged(hws)
    rc, out, seconds = at_terminal(hws, "show", "h1")
    assert rc == 0, out[-2000:]
    assert raw_sequences(out) == [] and b"victim" not in out
    assert seconds < 10, f"{seconds:.1f}s"  # it took ~22 s printing 100,000 rows


def test_show_ignores_an_unsealed_block_renamed_into_in_progress(hws: Workspace) -> None:
    """A raw document renamed into in-progress/ (a foreign consumer's claim): the sweep's
    recovery trusts its block only with handoffd's seal, and so does show."""
    drop_forged(hws, "in-progress")
    proc = hws.handoff("show", "h1", "--json", timeout=30)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["state"] == "in-progress" and data["family"]["children"] == []


def test_show_still_shows_handoffds_own_history(hws: Workspace) -> None:
    """A sealed block is trusted: the created event of a handoff made by `handoff create`."""
    made = hws.create("--to", "@nobody", "--data", "{}")
    proc = hws.handoff("show", made, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "created" in proc.stdout


def test_show_prints_at_most_the_history_the_daemon_keeps(hws: Workspace) -> None:
    """Even a sealed block (written by whoever holds the key) prints at most 200 entries: the
    first and the most recent, as the daemon keeps them."""
    made = hws.create("--to", "@nobody", "--id", "long", "--data", "{}")
    path = hws.root / "handoffs" / "pending" / f"{made}.json"
    doc = json.loads(path.read_text())
    block = doc["handoffd"]
    block["history"] += [{"at": f"n{i}", "event": "touched"} for i in range(1000)]
    key = seals.load_or_create_key(hws.root / "handoffs" / ".meta", hws.root / "handoffs" / ".tmp")
    assert key is not None
    block["seal"] = seals.seal_for(key, made, block["revision"], "pending")
    path.write_text(json.dumps(doc))
    proc = hws.handoff("show", made, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if " touched " in f"{line} ") == 199
    assert any(line.startswith("n999 ") for line in lines)  # the most recent
    assert not any(line.startswith("n800 ") for line in lines)
    assert any(" created " in f"{line} " for line in lines)  # the first
    assert "801 earlier entries not shown" in proc.stdout


def test_validate_prints_a_hostile_file_name_escaped(hws: Workspace, tmp_path: Path) -> None:
    """`handoff validate` checks files other agents wrote: their names reach the terminal as
    text (the error texts already quote values with repr)."""
    path = tmp_path / f"x{EVIL}.json"
    path.write_text(json.dumps({"handoff_id": "x", "target": {"agent_id": 5}}))
    proc = subprocess.run([exe("handoff"), "validate", str(path)], capture_output=True,
                          timeout=30)
    assert proc.returncode == 1 and b"invalid" in proc.stdout
    assert raw_sequences(proc.stdout) == [] and SHOWN in proc.stdout


def test_the_daemons_log_shows_a_documents_text_on_one_line(tmp_path: Path) -> None:
    """A dropped document's agent id with a newline forged a log line of its own in `handoffd
    run -v` / `serve -v` ("handoffd: ERROR: ..."), and its escapes reached the terminal raw.
    Now every text log message is one line, its control characters shown."""
    ws = new_workspace(tmp_path / "ws", '[daemon]\nsettle_seconds = 0.1\n')
    try:
        agent = "@nobody\nhandoffd: ERROR: forged line" + EVIL
        (ws.root / "handoffs" / "pending" / "hostile-log.json").write_text(
            json.dumps({"handoff_id": "hostile-log", "target": {"agent_id": agent},
                        "input": {"data": {}}}))
        proc = subprocess.run([exe("handoffd"), "run", "-v", "--root", str(ws.root)],
                              capture_output=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert raw_sequences(proc.stderr) == []
        lines = proc.stderr.decode().splitlines()
        assert not any(line.startswith("handoffd: ERROR: forged") for line in lines), lines
        assert any("hostile-log" in line and "forged line" in line for line in lines), lines
    finally:
        ws.cleanup()
