"""Hostile answers and bookkeeping found by the eighth session's bug hunt: each was a traceback, a
stuck handoff, a hot loop or a stalled daemon; each is now one line and a code, and the daemon
goes on serving (a control handoff completes beside them)."""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, reason_codes

PRINT = [sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])"]


def printing(name: str, answer: dict[str, Any]) -> str:
    """A command specialist that answers ``answer`` whatever it is asked."""
    argv = json.dumps([*PRINT, json.dumps(answer)])
    return f'[specialists."{name}"]\ncommand = {argv}\nretry = {{ max_retries = 0 }}\n'


def native(handoff_id: str, target: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": handoff_id, "target": {"agent_id": target}, "input": {"data": {}},
            **extra}


def events(ws: Workspace, handoff_id: str) -> list[str]:
    return [e["event"] for e in ws.doc(handoff_id)["handoffd"]["history"]]


@pytest.fixture
def hws(tmp_path: Path) -> Workspace:
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    ws = Workspace(root)
    ws.write_config('[daemon]\nsweep_seconds = 0.5\nrescan_seconds = 1.0\n\n'
                    + printing("@ok", {"status": "completed"})
                    + printing("@liststatus", {"status": ["completed"]})
                    + printing("@dictstatus", {"status": {"a": 1}})
                    + printing("@throttleneg", {"status": "throttled", "retry_after_seconds": -5})
                    + printing("@throttlezero", {"status": "throttled", "retry_after_seconds": 0}))
    yield ws
    ws.cleanup()


def test_a_status_that_is_not_a_string_fails_the_attempt(hws: Workspace) -> None:
    """`{"status": ["completed"]}` raised TypeError (unhashable) in the result check: a
    traceback, and the handoff stayed in in-progress/ until the daemon restarted."""
    for name in ("liststatus", "dictstatus"):
        hws.drop(f"c-{name}.json", native(f"c-{name}", f"@{name}"))
    hws.drop("c-ok.json", native("c-ok", "@ok"))
    proc = hws.handoffd("run")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert hws.state_of("c-ok") == ["completed"]
    for name in ("liststatus", "dictstatus"):
        assert hws.state_of(f"c-{name}") == ["failed"], proc.stderr
        error = hws.doc(f"c-{name}")["error"]
        assert error["code"] == "PROCESSING_ERROR" and "status" in error["message"], error


def test_throttled_with_no_or_a_negative_delay_backs_off(hws: Workspace) -> None:
    """`retry_after_seconds: -5` (or 0) requeued at once, thousands of times a minute. Now the
    delay is at least 0.1 s doubled for each throttle in a row: in 2 s, at most 5 throttles
    (0.1 + 0.2 + 0.4 + 0.8 = 1.5 s, the sixth would come after 3.1 s), however fast the machine."""
    hws.drop("t-neg.json", native("t-neg", "@throttleneg"))
    hws.drop("t-zero.json", native("t-zero", "@throttlezero"))
    daemon = hws.serve()
    try:
        hws.drop("t-ok.json", native("t-ok", "@ok"))
        assert hws.wait_state("t-ok") == "completed"
        time.sleep(2.0)
    finally:
        assert hws.stop(daemon) == 0
        err = daemon.stderr.read() if daemon.stderr else ""
    assert "Traceback" not in err, err
    for handoff_id in ("t-neg", "t-zero"):
        count = events(hws, handoff_id).count("throttled")
        assert 1 <= count <= 6, (handoff_id, count)  # 6: a slack for the first one's timing
        assert hws.state_of(handoff_id) == ["pending"]


def test_throttles_in_a_row_counts_back_to_the_last_other_event() -> None:
    from handoffd.core.documents import throttles_in_a_row
    history = [{"event": e} for e in ("created", "claimed", "throttled", "claimed", "throttled",
                                      "claimed")]
    assert throttles_in_a_row({"handoffd": {"history": history}}) == 2
    history += [{"event": "retry_scheduled"}, {"event": "claimed"}]
    assert throttles_in_a_row({"handoffd": {"history": history}}) == 0
    assert throttles_in_a_row({"handoffd": {"history": "x"}}) == 0
    assert throttles_in_a_row({"handoffd": {"history": [5, None, {"event": "throttled"}]}}) == 1
    assert throttles_in_a_row({}) == 0


def test_a_file_name_that_is_not_utf8_is_set_aside_once(hws: Workspace) -> None:
    """`bad\\xff.json` in pending/: its id ('bad\\udcff' as Python reads the name) made sealing
    raise UnicodeEncodeError after the claim; the file cycled between in-progress/ and recovery
    with a traceback each time, and its quarantine reason could not be written. Now the name is
    refused before any claim, as UNSAFE_ID, and its reason names it with a \\x escape."""
    pending = os.fsencode(hws.root / "handoffs" / "pending")
    tmp = os.fsencode(hws.root / "x.tmp")
    with open(tmp, "w") as fh:
        json.dump(native("bad", "@ok"), fh)
    os.rename(tmp, pending + b"/bad\xff.json")
    hws.drop("c-ok.json", native("c-ok", "@ok"))
    proc = hws.handoffd("run")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert hws.state_of("c-ok") == ["completed"]
    assert os.listdir(pending) == []
    assert not os.listdir(hws.root / "handoffs" / "in-progress")
    assert list(reason_codes(hws.root).values()) == ["UNSAFE_ID"]
    listing = hws.handoff("ls", "--state", "quarantined", "--json")
    rows = json.loads(listing.stdout)
    assert len(rows) == 1 and "bad\\xff.json" in rows[0]["note"], rows


def _spoil(path: Path, how: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "short":
        path.write_bytes(b"abc\n")
    elif how == "dir":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "zero":
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("how", ["empty", "short", "dir", "fifo", "zero"])
def test_an_unusable_seal_key_is_one_line_and_nothing_is_accepted(hws: Workspace, how: str) -> None:
    """An empty or directory seal.key left the store without a key: every handoff `handoff
    create` acknowledged was then taken for a foreign copy of a used id and set aside unrun. A
    FIFO there hung both the daemon and `create`; a symlink to /dev/zero read without end. Now
    both refuse at once with one line naming the file (exit 2), and nothing is written."""
    hws.handoffd("sweep")  # makes the workspace's folders and its key
    _spoil(hws.root / "handoffs" / ".meta" / "seal.key", how)
    for proc in (hws.handoff("create", "--to", "@ok", timeout=30), hws.handoffd("run", timeout=30)):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "seal.key" in lines[0] and "move it away" in lines[0], lines
    assert os.listdir(hws.root / "handoffs" / "pending") == []


@pytest.mark.parametrize("where", ["cancel/x.json", "cancel/c-ok.json", "procs/x.json",
                                   "procs/c-ok.json", "paused.json", "rates.json"])
@pytest.mark.parametrize("how", ["fifo", "zero"])
def test_a_fifo_or_dev_zero_among_the_records_is_passed_over(hws: Workspace, where: str,
                                                            how: str) -> None:
    """A FIFO in .meta/cancel/, .meta/procs/ or at .meta/paused.json froze the daemon in open()
    (deaf to SIGTERM); a symlink to /dev/zero made it read until memory ran out. Those records
    are now opened without following links or waiting, and only as regular files."""
    hws.handoffd("sweep")
    _spoil(hws.root / "handoffs" / ".meta" / where, how)
    hws.drop("c-ok.json", native("c-ok", "@ok"))
    proc = hws.handoffd("run", timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert hws.state_of("c-ok") == ["completed"]


@pytest.mark.parametrize("name", ["seen-ids.jsonl", "events.jsonl"])
def test_a_fifo_for_a_log_is_an_error_line_not_a_hang(hws: Workspace, name: str) -> None:
    """Opening a FIFO to append waits for a reader: `create` and the daemon hung on it."""
    hws.handoffd("sweep")
    _spoil(hws.root / "handoffs" / ".meta" / name, "fifo")
    made = hws.handoff("create", "--to", "@ok", "--id", "c-1", timeout=30)
    assert "Traceback" not in made.stderr and made.stderr.count("\n") <= 1, made.stderr
    if name == "events.jsonl":  # the event log is best-effort: the handoff is made and runs
        assert made.returncode == 0, made.stderr
        proc = hws.handoffd("run", timeout=60)
        assert hws.state_of("c-1") == ["completed"], proc.stderr
    else:  # without its duplicate check nothing is accepted
        assert made.returncode != 0 and name in made.stderr
        assert os.listdir(hws.root / "handoffs" / "pending") == []


def test_a_fifo_among_quarantine_reasons_does_not_hang_the_listing(hws: Workspace) -> None:
    hws.handoffd("sweep")
    quarantine = hws.root / "handoffs" / ".quarantine"
    quarantine.mkdir(parents=True, exist_ok=True)
    os.mkfifo(quarantine / "x.reason.json")
    proc = hws.handoff("ls", "--state", "quarantined", timeout=30)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_create_refuses_a_request_the_daemon_would_not_read(hws: Workspace, tmp_path: Path) -> None:
    """An --input just under max_document_bytes, wrapped in its request and bookkeeping, came
    out over it: `create` acknowledged a handoff the daemon then set aside unread. The store
    now refuses it before writing (DOCUMENT_TOO_LARGE, one line)."""
    hws.write_config("[daemon]\nmax_document_bytes = 2048\n\n" + printing("@ok", {"status": "completed"}))
    data = tmp_path / "data.json"
    data.write_text(json.dumps("x" * 1900))  # under the limit alone, over it as a request
    made = hws.handoff("create", "--to", "@ok", "--input", str(data))
    assert made.returncode != 0 and made.stderr.count("\n") == 1, made.stderr
    assert "2048-byte limit" in made.stderr and "Traceback" not in made.stderr
    assert os.listdir(hws.root / "handoffs" / "pending") == []


ASKING = {"status": "needs_clarification",
          "questions": ["\u001b[2J\u001b]0;pwned\u0007line1\nFAKE: handoff completed OK\r"]}


def test_wait_shows_a_specialists_question_on_one_line_with_escapes_visible(hws: Workspace) -> None:
    """`handoff wait` printed a parked handoff's questions raw: a specialist could clear the
    operator's screen, retitle the terminal, or print a line that looks like handoffd's own.
    It now shows them as `ls` and `show` do (control characters as \\x1b, \\n)."""
    hws.write_config(printing("@asker", ASKING))
    hws.drop("ask.json", native("ask", "@asker"))
    hws.handoffd("run")
    proc = hws.handoff("wait", "ask", "--timeout", "5")
    assert proc.returncode == 4, proc
    assert proc.stdout == "ask needs_clarification\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "\x1b" not in proc.stderr and "\r" not in proc.stderr, proc.stderr
    assert "\\x1b[2J" in lines[0] and "\\nFAKE" in lines[0]


def test_an_answer_the_document_cannot_hold_is_refused_before_writing(hws: Workspace) -> None:
    """An answer under max_document_bytes was written into the document twice (its
    clarifications and its history), and the document left in pending/ was over the limit:
    the daemon set it aside and the requester lost the handoff. The history now names a long
    answer by its first 300 characters, and an answer that would not fit is refused, one line,
    with nothing written."""
    hws.write_config("[daemon]\nmax_document_bytes = 8192\n\n" + printing("@asker", ASKING))
    hws.drop("ask.json", native("ask", "@asker"))
    hws.handoffd("run")
    before = (hws.root / "handoffs" / "pending" / "ask.json").read_bytes()
    proc = hws.handoff("answer", "ask", "--data", json.dumps("a" * 9000))
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert "8192-byte limit" in proc.stderr and "Traceback" not in proc.stderr
    assert (hws.root / "handoffs" / "pending" / "ask.json").read_bytes() == before
    fits = hws.handoff("answer", "ask", "--data", json.dumps("b" * 2500))
    assert fits.returncode == 0, fits.stderr
    doc = hws.doc("ask")
    assert doc["input"]["clarifications"][0]["answer"] == "b" * 2500
    answered = [e for e in doc["handoffd"]["history"] if e["event"] == "answered"]
    assert len(answered[0]["detail"]["answer"]) == 300


def test_markup_in_what_documents_say_never_stops_a_watcher(hws: Workspace) -> None:
    """An agent id or event id holding "[/]" made `handoff ls --watch` and `handoff top` die
    with rich's MarkupError: what documents and the event log say is now shown as text."""
    import queue
    import subprocess
    import threading

    from conftest import exe
    hws.handoffd("sweep")
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--root", str(hws.root)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in watcher.stdout or []],
                         daemon=True).start()
        log = hws.root / "handoffs" / ".meta" / "events.jsonl"
        seen = ""
        for _ in range(60):  # it follows from the moment it starts: append until one shows
            with log.open("a") as fh:
                fh.write(json.dumps({"at": "2026-11-26T02:00:00Z", "event": "completed",
                                     "id": "x[/]", "state": "completed", "agent": "@a[bold]"}) + "\n")
            try:
                while "x[/]" not in seen:  # (the listing of what exists comes first)
                    seen = lines.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        assert "x[/]" in seen and "@a[bold]" in seen, seen
        assert watcher.poll() is None  # still watching
    finally:
        watcher.kill()
        watcher.wait(10)
    from rich.console import Console

    from handoffd.cli.basics import engine
    from handoffd.cli.observe_cmd import TopModel
    hws.drop("mk1.json", native("mk1", "@nobody[/]"))
    model = TopModel(engine(hws.root))
    model.add({"at": "2026-11-26T02:00:00Z", "event": "failed", "state": "failed",
               "id": "y[/]", "agent": "@b[/]", "code": "[red]X"})
    model.refresh()
    screen = Console(record=True, width=200, file=open(os.devnull, "w"))
    screen.print(model.render(datetime.now(timezone.utc)))
    text = screen.export_text()
    assert "@nobody[/]" in text and "y[/]" in text and "[red]X" in text, text


def test_a_large_parked_handoff_is_not_doubled_by_its_report(hws: Workspace) -> None:
    """A parked handoff keeps the report it made in its own format (handoffd.awaiting.outcome),
    and for seed 001 that report repeats the whole request: after a 120 KB answer the specialist
    asked again, the document doubled past max_document_bytes and was set aside (the requester
    lost it; `wait` said "no error recorded"). A report over 64 KB now leaves out what it repeats
    of the document, and names it (`abridged`)."""
    hws.write_config("[daemon]\nmax_document_bytes = 200000\n\n" + printing("@asker", ASKING))
    hws.drop("ask.json", native("ask", "@asker"))
    hws.handoffd("run")
    assert hws.handoff("answer", "ask", "--data", json.dumps("b" * 120_000)).returncode == 0
    proc = hws.handoffd("run")
    assert hws.state_of("ask") == ["pending"], proc.stderr  # parked again, not set aside
    outcome = hws.doc("ask")["handoffd"]["awaiting"]["outcome"]
    assert "input" in outcome["abridged"] and "input" not in outcome
    assert hws.handoff("wait", "ask", "--timeout", "5").returncode == 4


def test_a_large_result_is_filed_readable_and_an_oversized_one_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 6 MB answer (under max_output_bytes, 16 MiB) was filed, but every reader bounded the
    finished document by max_document_bytes (4 MiB): `handoff show` refused it and `handoff wait`
    said "still not finished". Finished documents are now read with room for their answer; and
    a Python handler's result over max_output_bytes fails, as a command's stdout over it does."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "bigspec.py").write_text(
        "def big(handoff, ctx=None):\n"
        "    size = int((ctx.data or {}).get('mb', 1) * 1024 * 1024)\n"
        "    return {'status': 'completed', 'output': {'blob': 'x' * size}}\n")
    monkeypatch.setenv("PYTHONPATH", str(plug))
    root = tmp_path / "ws"
    (root / "handoffs" / "pending").mkdir(parents=True)
    ws = Workspace(root)
    ws.write_config('[daemon]\nmax_output_bytes = 8388608\n\n'
                    '[specialists."@big"]\nhandler = "bigspec:big"\n')
    try:
        fits = ws.create("--to", "@big", "--data", json.dumps({"mb": 6}))
        over = ws.create("--to", "@big", "--data", json.dumps({"mb": 9}))
        ws.handoffd("run")
        assert ws.handoff("wait", fits, "--timeout", "5").returncode == 0
        assert ws.handoff("show", fits).returncode == 0
        assert ws.state_of(over) == ["failed"]
        error = ws.doc(over)["error"]
        assert error["code"] == "PROCESSING_ERROR" and "max_output_bytes" in error["message"]
    finally:
        ws.cleanup()


def test_third_hunt_command_line_cases(hws: Workspace, tmp_path: Path) -> None:
    """Each was a traceback, a silent replacement or an unreadable document: `paused` printed
    control characters raw; `create --at` past the calendar was an OverflowError; `cancel
    --timeout nan` and `run --max-seconds inf` were taken; a metrics textfile replaced a FIFO;
    `schemas --copy` followed a symlinked schemas/ out of the workspace; a long cancel reason
    pushed a document past max_document_bytes."""
    hws.handoffd("sweep")
    assert hws.handoff("pause", "@a\nFAKE", "--reason", "x\x1b[2J").returncode == 0
    listed = hws.handoff("paused")
    assert "\x1b" not in listed.stdout and "@a\\nFAKE" in listed.stdout, listed.stdout
    for at in ("9999-12-31T23:00:00-14:00", "0001-01-01T00:00:00+14:00"):
        made = hws.handoff("create", "--to", "@ok", "--at", at)
        assert made.returncode == 2 and "outside the calendar" in made.stderr, made.stderr
    hid = hws.create("--to", "@nobody")
    for value in ("nan", "1e400", "-5"):
        proc = hws.handoff("cancel", hid, "--timeout", value)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for value in ("nan", "inf"):
        proc = hws.handoffd("run", "--max-seconds", value)
        assert proc.returncode == 2 and "--max-seconds" in proc.stderr, proc.stderr
    fifo = tmp_path / "metrics.prom"
    os.mkfifo(fifo)
    proc = hws.handoffd("metrics", "--textfile", str(fifo))
    assert proc.returncode != 0 and stat_is_fifo(fifo), proc.stderr
    outside = tmp_path / "outside"
    outside.mkdir()
    schemas = hws.root / "schemas"
    if schemas.exists():
        for child in schemas.iterdir():
            child.unlink()
        schemas.rmdir()
    schemas.symlink_to(outside)
    proc = hws.handoff("schemas", "--copy")
    assert proc.returncode == 2 and list(outside.iterdir()) == [], proc.stderr
    assert hws.handoff("cancel", hid, "--reason", "r" * 100_000).returncode == 0
    reason = hws.doc(hid)["error"]["message"]
    assert len(reason) < 2000 and hws.handoff("show", hid).returncode == 0


def stat_is_fifo(path: Path) -> bool:
    import stat as stat_module
    return stat_module.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("rule", ['url = "http://127.0.0.1:18777/a b"', 'url = "http://127.0.0.1:abc/"',
                                  'url = "http://[::1"', 'url = "http://h/a\\r\\nX-Inj: 1"',
                                  'command = ["python3\\u0000x"]'])
def test_an_on_filed_rule_every_delivery_would_fail_is_refused_at_start(hws: Workspace,
                                                                        rule: str) -> None:
    """Found by the third bug hunt: these passed the config check, then each delivery logged a
    traceback and wrote no dead letter."""
    hws.write_config(printing("@ok", {"status": "completed"}) + f"\n[[on_filed]]\n{rule}\n")
    proc = hws.handoffd("run")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "[[on_filed]] #1" in proc.stderr


def test_a_webhook_password_is_never_logged() -> None:
    from handoffd.features.notify import shown_url
    assert shown_url("https://hook:s3cret@example.com:8443/x?y=1") == \
        "https://hook:***@example.com:8443/x?y=1"
    assert shown_url("https://example.com/x") == "https://example.com/x"
    assert shown_url("https://only-user@example.com/") == "https://only-user@example.com/"


def test_trace_of_a_long_dependency_chain_and_retry_of_nothing(tmp_path: Path) -> None:
    """Found by the third bug hunt: `handoff trace` of a 600-long depends_on chain was an
    internal RecursionError (the tree now shows 100 levels and says how to go on: a 150-long
    chain shows it, in a few seconds), and `retry --all-failed` with nothing failed was a usage
    error (it says so and exits 0)."""
    import subprocess

    from conftest import exe

    from handoffd.cli.basics import engine
    from handoffd.cli.quick import submit_request
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    root = tmp_path / "ws"
    root.mkdir()
    HandoffdWorkspace(root).ensure()
    eng = engine(root, create=True)
    previous = None
    for i in range(150):
        previous = submit_request(eng, to="@x", handoff_id=f"c{i:04d}",
                                  depends_on=[previous] if previous else None)
    traced = subprocess.run([exe("handoff"), "trace", "c0000", "--root", str(root)],
                            capture_output=True, text=True, timeout=120)
    assert traced.returncode == 0 and "internal error" not in traced.stderr, traced.stderr
    as_json = subprocess.run([exe("handoff"), "trace", "c0000", "--json", "--root", str(root)],
                             capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 0 and "goes on" in as_json.stdout
    retried = subprocess.run([exe("handoff"), "retry", "--all-failed", "--root", str(root)],
                             capture_output=True, text=True, timeout=60)
    assert retried.returncode == 0 and "no failed handoffs" in retried.stderr, retried.stderr


@pytest.mark.heavy
def test_a_notification_command_is_bounded_and_never_outlives_the_daemon(hws: Workspace) -> None:
    """Found by the third bug hunt: an [[on_filed]] command writing without end grew the
    daemon by hundreds of MB a second (its whole output was kept); a hanging one outlived the
    daemon, re-parented to init, and its notifications left no dead letter. Now its stdout is
    discarded, its stderr tail kept, its group killed at its timeout or the daemon's stop, and
    every notice not delivered is dead-lettered."""
    import signal
    import subprocess
    flood = json.dumps([sys.executable, "-c",
                        "import sys\nwhile True: sys.stdout.write('x' * 65536)"])
    marker = f"hang-marker-{os.urandom(6).hex()}"  # (pgrep must see no other test's process)
    hang = json.dumps([sys.executable, "-c", "import time; time.sleep(600)", marker])
    hws.write_config("[daemon]\ngrace_seconds = 1.0\n\n" + printing("@ok", {"status": "completed"})
                     + f"\n[[on_filed]]\ncommand = {flood}\nretries = 0\ntimeout_seconds = 2\n"
                     + f"\n[[on_filed]]\ncommand = {hang}\nretries = 0\ntimeout_seconds = 600\n")
    daemon = hws.serve()
    try:
        hws.drop("n1.json", native("n1", "@ok"))
        hws.wait_state("n1")
        deadline = time.monotonic() + 30
        letters = hws.root / "handoffs" / ".meta" / "notify-dead-letters.jsonl"
        while time.monotonic() < deadline and not (letters.exists() and "timed out" in letters.read_text()):
            rss = int(next(line.split()[1] for line in
                           Path(f"/proc/{daemon.pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS")))
            assert rss < 300_000, f"the daemon grew to {rss} KiB"  # (it reached GBs)
            time.sleep(0.2)
        assert "timed out after 2s" in letters.read_text()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    finally:
        hws.cleanup()
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert found.stdout.strip() == "", f"a notification command outlived the daemon: {found.stdout}"
    hang_letters = [line for line in letters.read_text().splitlines() if marker in line]
    assert len(hang_letters) == 1, letters.read_text()  # the killed delivery is dead-lettered


def test_a_webhook_asked_to_be_signed_is_never_sent_unsigned(hws: Workspace,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the third bug hunt: with secret_env naming a variable that is not set, the
    webhook went out without its signature and nothing said so. It is now not sent: the
    delivery fails, is retried and dead-lettered naming the variable."""
    monkeypatch.delenv("HANDOFFD_TEST_UNSET_SECRET", raising=False)
    hws.write_config(printing("@ok", {"status": "completed"})
                     + '\n[[on_filed]]\nurl = "http://127.0.0.1:9/hook"\n'
                     + 'secret_env = "HANDOFFD_TEST_UNSET_SECRET"\nretries = 0\n')
    hws.drop("s1.json", native("s1", "@ok"))
    hws.handoffd("run")
    letters = (hws.root / "handoffs" / ".meta" / "notify-dead-letters.jsonl").read_text()
    assert "HANDOFFD_TEST_UNSET_SECRET is not set: not sent unsigned" in letters


def test_a_request_at_the_size_limit_survives_its_own_retries(hws: Workspace) -> None:
    """Found in the fifth session: `create` accepted a request just under max_document_bytes,
    then the daemon's own bookkeeping (history, lease) pushed the pending copy over the bound
    it read pending documents with, and the first retry set the handoff aside as
    DOCUMENT_TOO_LARGE. The bound now holds for the request; our bookkeeping may add up to
    512 KiB. A foreign request over the bound is still refused."""
    argv = json.dumps([sys.executable, "-c", "import sys; sys.stdin.read()"])  # prints nothing
    hws.write_config("[daemon]\nmax_document_bytes = 8192\n\n"
                     f'[specialists."@flaky"]\ncommand = {argv}\n'
                     "retry = { max_retries = 3, retry_delay_seconds = 0.01 }\n")
    hws.create("--to", "@flaky", "--id", "near", "--data", json.dumps("a" * 7800))
    hws.drop("over.json", native("over", "@flaky", padding="b" * 9000))
    for _ in range(8):
        hws.handoffd("run")
        if hws.state_of("near") == ["failed"]:
            break
        time.sleep(0.1)
    doc = hws.doc("near")
    assert doc["error"]["code"] == "PROCESSING_ERROR", doc["error"]  # its own failure, retried
    assert [e["event"] for e in doc["handoffd"]["history"]].count("claimed") == 4
    over = hws.doc("over")
    assert over["error"]["code"] == "DOCUMENT_TOO_LARGE", over["error"]
