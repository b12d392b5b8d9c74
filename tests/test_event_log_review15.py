"""Found by the fifteenth review (R4): the event log, ``handoffs/.meta/events.jsonl`` and its
rotations, and the seen-ids record's lock.

- A process holding ``.events.lock`` (stopped, or not handoffd's) froze every writer that found
  the log past ``events_max_bytes``: ``handoff create`` hung and ``serve`` stopped claiming and
  ignored SIGTERM (a blocking flock). The rotation now waits a moment for the lock, then is put
  off (one warning; the line is written either way). ``seen-ids.jsonl.lock`` held the same way
  froze creates and the sweep's compaction: an add now fails in one line after a bounded wait
  (a create that wrote its document warns and exits 0), a compaction is put off to a later sweep.
- Readers loaded whole files: a sparse 3 GB ``events.jsonl.1`` cost ``handoff stats`` and the
  first metrics scrape 3 GB of memory, and stats held every event in a list. Files are now read
  a block at a time, at most ``events_max_bytes`` + one line of each, and stats tallies as it
  reads. A forged 400-digit ``seconds`` failed ``handoff stats`` (OverflowError).
- A log truncated in place (``copytruncate``, ``: >``) blinded ``ls --watch`` and metrics.
- A folder at ``events.jsonl.1`` stopped rotation for good, said as "cannot write the event log".
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import (Workspace, exe, interrupted, new_workspace, reason_codes, run_python,
                      wait_until)

PRINT = [sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])"]


def config(max_bytes: int = 4096, keep: int = 2) -> str:
    return f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5
durability = "fast"
events_max_bytes = {max_bytes}
events_keep = {keep}

[specialists."@ok"]
command = {json.dumps([*PRINT, json.dumps({"status": "completed"})])}
retry = {{ max_retries = 0 }}
"""


@pytest.fixture
def ews(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", config())
    yield workspace
    workspace.cleanup()


def meta(ws: Workspace) -> Path:
    return ws.root / "handoffs" / ".meta"


def event_line(i: int, **extra: Any) -> str:
    event = {"at": "2026-11-26T10:00:00.000Z", "event": "completed", "id": f"h{i:08d}",
             "state": "completed", "agent": "@a", "attempt": 1, "seconds": 0.5, **extra}
    return json.dumps(event, separators=(",", ":")) + "\n"


def fill(path: Path, size: int) -> int:
    """Write events to ``path`` until it holds about ``size`` bytes; how many."""
    lines = []
    total = n = 0
    while total < size:
        lines.append(event_line(n))
        total += len(lines[-1])
        n += 1
    path.write_text("".join(lines))
    return n


def held(path: Path) -> int:
    """A descriptor holding an exclusive flock on ``path``, as a stopped process would."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def serve(ws: Workspace, log: Path) -> subprocess.Popen[bytes]:
    """``handoffd serve -v`` with its stderr in ``log``, once it says it is serving."""
    with open(log, "wb") as handle:
        proc = subprocess.Popen([exe("handoffd"), "serve", "-v", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=handle)
    ws.daemons.append(proc)  # type: ignore[arg-type]  # (cleanup kills it by pid)
    wait_until(lambda: "serving" in log.read_text() or proc.poll() is not None, timeout=30,
               what="serve started")
    assert proc.poll() is None, log.read_text()
    return proc


def stopped_within(proc: subprocess.Popen[bytes], seconds: float) -> int:
    """SIGTERM ``proc``; its exit status, which must come within ``seconds``."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve ignored SIGTERM for {seconds} s") from None


def native(hid: str) -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@t"}, "target": {"agent_id": "@ok"},
            "input": {"data": {}}}


# ---------------------------------------------------------------- 1: a held rotation lock
def test_a_held_rotation_lock_never_stalls_a_create_or_the_daemon(
        ews: Workspace, tmp_path: Path) -> None:
    events = meta(ews) / "events.jsonl"
    fill(events, 10_000)  # past events_max_bytes: every append tries to rotate
    lock = held(meta(ews) / ".events.lock")
    try:
        started = time.monotonic()
        made = ews.handoff("create", "--to", "@ok", "--data", "{}", "--id", "c1", timeout=20)
        assert made.returncode == 0, made.stderr
        assert time.monotonic() - started < 10
        assert made.stderr.count("cannot rotate the event log") == 1, made.stderr
        assert ".events.lock has been held by another process" in made.stderr
        assert "cannot write the event log" not in made.stderr
        assert '"id":"c1"' in events.read_text()  # the line is written all the same
        log = tmp_path / "serve.log"
        daemon = serve(ews, log)
        for n in range(3):
            ews.drop(f"d{n}.json", native(f"d{n}"))
        for hid in ("c1", "d0", "d1", "d2"):
            assert ews.wait_state(hid, timeout=30) == "completed"
        assert stopped_within(daemon, 10) == 0
    finally:
        os.close(lock)
    said = log.read_text()
    assert said.count("cannot rotate the event log") == 1, said  # once, not per event
    assert "Traceback" not in said
    assert not (meta(ews) / "events.jsonl.1").exists()  # put off while the lock was held
    # let go: the next append rotates
    assert ews.handoff("create", "--to", "@ok", "--data", "{}", timeout=20).returncode == 0
    assert (meta(ews) / "events.jsonl.1").is_file()
    assert not events.exists() or events.stat().st_size < 4096


# ---------------------------------------------------------------- 1: the seen-ids lock
def test_a_held_seen_ids_lock_costs_a_create_a_warning_and_puts_compaction_off(
        ews: Workspace, tmp_path: Path) -> None:
    lock = held(meta(ews) / "seen-ids.jsonl.lock")
    try:
        started = time.monotonic()
        made = ews.handoff("create", "--to", "@ok", "--data", "{}", "--id", "s1", timeout=20)
        assert time.monotonic() - started < 10
        # created (its file keeps the id taken): exit 0 with one warning, never exit 1 after
        # the handoff was written (a script would submit it again)
        assert made.returncode == 0 and made.stdout.strip() == "s1", made.stderr
        lines = made.stderr.strip().splitlines()
        assert len(lines) == 1 and "seen-ids.jsonl.lock" in lines[0], made.stderr
        assert "held by another process" in lines[0] and "Traceback" not in made.stderr
        assert (ews.root / "handoffs" / "pending" / "s1.json").exists()
        swept = ews.handoffd("sweep", timeout=20)  # compacts the record: put off, not stuck
        assert swept.returncode == 0, swept.stderr
        assert "compaction is put off" in swept.stderr
        log = tmp_path / "serve.log"
        daemon = serve(ews, log)  # (its start-up sweep compacts too)
        assert stopped_within(daemon, 10) == 0
    finally:
        os.close(lock)
    # the lock let go: an id is recorded again, and the one whose add failed is still taken
    assert ews.handoff("create", "--to", "@ok", "--data", "{}", "--id", "s2").returncode == 0
    assert '"s2"' in (meta(ews) / "seen-ids.jsonl").read_text()
    assert ews.handoff("create", "--to", "@ok", "--data", "{}", "--id", "s1").returncode != 0


# ---------------------------------------------------------------- 5: bounded readers
MEASURE = """
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)
print(json.dumps({"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr,
                  "kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def measured(*command: str) -> dict[str, Any]:
    """Run ``command`` as the only child of a fresh interpreter: its exit status, output and
    peak memory (ru_maxrss of RUSAGE_CHILDREN, KiB: the children of this test process would
    count any earlier, larger child)."""
    done = run_python(MEASURE, *command)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_huge_rotated_file_is_read_in_part_and_a_forged_number_is_skipped(
        ews: Workspace) -> None:
    count = fill(meta(ews) / "events.jsonl", 2000)
    with open(meta(ews) / "events.jsonl", "a") as fh:  # a forged run time of 400 digits
        fh.write('{"event":"completed","state":"completed","agent":"@a","seconds":'
                 + "9" * 400 + "}\n")
    rotated = meta(ews) / "events.jsonl.1"
    with open(rotated, "wb") as fh:  # (a line so far from its end is not read)
        fh.write(event_line(99_999_999).encode())
    os.truncate(rotated, 256 * 1024 * 1024)  # sparse: nothing on disk, 256 MiB of zeros
    stats = measured(exe("handoff"), "stats", "--json", "--root", str(ews.root))
    assert stats["kib"] < 100 * 1024, stats["kib"]  # the whole file: 256 MiB and more
    assert stats["rc"] == 0, stats["err"]
    figures = json.loads(stats["out"])
    assert figures["events"] == count + 1  # (+ the forged line)
    scraped = measured(exe("handoffd"), "metrics", "--root", str(ews.root))
    assert scraped["kib"] < 100 * 1024, scraped["kib"]
    assert scraped["rc"] == 0 and "handoffd_transitions_total" in scraped["out"], scraped["err"]


def test_stats_tallies_as_it_reads(tmp_path: Path) -> None:
    """Within the bounds (two 4 MiB files here; 16 MiB x 5 by default) stats held every event
    as a dict: about 100 MB for these 8 MiB, 615 MB for the default bounds' 80."""
    ws = new_workspace(tmp_path / "ws", config(max_bytes=4 * 1024 * 1024, keep=1))
    count = fill(meta(ws) / "events.jsonl.1", 4 * 1024 * 1024 - 200)
    count += fill(meta(ws) / "events.jsonl", 4 * 1024 * 1024 - 200)
    stats = measured(exe("handoff"), "stats", "--json", "--root", str(ws.root))
    assert stats["rc"] == 0, stats["err"]
    figures = json.loads(stats["out"])
    assert figures["events"] == count
    assert figures["agents"][0]["completed"] == count
    assert stats["kib"] < 50 * 1024, stats["kib"]


# ---------------------------------------------------------------- 6: truncated in place
def test_a_log_truncated_in_place_is_followed_from_its_start(tmp_path: Path) -> None:
    ews = new_workspace(tmp_path / "ws", config(max_bytes=1024 * 1024))
    events = meta(ews) / "events.jsonl"
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--json", "--root",
                                str(ews.root)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    ews.daemons.append(watcher)
    lines: queue.Queue[str] = queue.Queue()
    assert watcher.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in watcher.stdout],  # type: ignore[union-attr]
                     daemon=True).start()
    seen: set[str] = set()

    def sees(hid: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while hid not in seen and time.monotonic() < deadline:
            try:
                seen.add(json.loads(lines.get(timeout=0.2))["id"])
            except queue.Empty:
                pass
        return hid in seen

    try:
        with open(events, "a") as fh:  # the follower's offset well past what follows
            fh.write("".join(event_line(n) for n in range(30)))
        for n in range(40):  # following from the moment it started
            if sees(ews.create("--to", "@nobody", "--id", f"w{n}"), 1.0):
                break
        else:
            raise AssertionError("ls --watch never printed an event")
        os.truncate(events, 0)  # logrotate's copytruncate
        hid = ews.create("--to", "@nobody", "--id", "after-truncate")
        assert sees(hid, 10), "the event appended after the truncation was missed"
    finally:
        try:
            assert interrupted(watcher) == 0
        finally:
            ews.cleanup()
    # and a follower never resumes in the middle of a line
    code = """
import os, sys
from pathlib import Path
from handoffd.backends.files.events import FileEventLog
from handoffd.core.workspace import Workspace
log = FileEventLog(Workspace(Path(sys.argv[1])))
_, cursor = log.tail(None)
os.truncate(log.path, 0)
log.append({"event": "created", "id": "x" * 300})
log.append({"event": "created", "id": "short"})
print([e["id"][:5] for e in log.tail(cursor)[0]])
"""
    done = run_python(code, str(ews.root))
    assert done.stdout.strip() == "['xxxxx', 'short']", done.stdout + done.stderr


# ---------------------------------------------------------------- 8: a folder in a slot
def test_a_folder_at_a_rotated_name_is_moved_aside_and_rotation_goes_on(
        ews: Workspace) -> None:
    events = meta(ews) / "events.jsonl"
    fill(events, 5000)
    (meta(ews) / "events.jsonl.1" / "x").mkdir(parents=True)
    made = ews.handoff("create", "--to", "@ok", "--data", "{}", "--id", "r1", timeout=30)
    assert made.returncode == 0, made.stderr
    assert "cannot write the event log" not in made.stderr
    assert "events.jsonl.1 is not a regular file: moved to handoffs/.quarantine/" in made.stderr
    assert (meta(ews) / "events.jsonl.1").is_file()
    assert '"id":"r1"' in (meta(ews) / "events.jsonl.1").read_text()
    assert list(reason_codes(ews.root).values()) == ["NOT_A_REGULAR_FILE"]
    for n in range(3):  # it keeps rotating within its bound
        fill(events, 5000)
        assert ews.handoff("create", "--to", "@ok", "--data", "{}").returncode == 0
        assert not events.exists() or events.stat().st_size < 4096
    assert (meta(ews) / "events.jsonl.2").is_file()
    stats = ews.handoff("stats", "--json")
    assert stats.returncode == 0, stats.stderr
