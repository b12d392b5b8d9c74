"""handoffd's own bookkeeping files as hostile input (review 15):

* a FIFO or symlink planted at a name the seen-ids compaction once used (``seen-ids.compact``)
  is never opened nor renamed over the record: the sweep neither stalls nor writes outside the
  workspace;
* the seen-ids record is read with a bound: a line with no newline in sight is skipped, never
  held whole, by the one-shot search, the daemon's incremental reads and the compaction;
* an entry that is no regular file planted at a lock name in ``handoffs/.locks`` (a handoff's
  ``.recover.lock``) is moved to the quarantine, and one handoff whose lock cannot be had is
  that handoff's problem alone: every other abandoned claim is still recovered.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Workspace, exe, new_workspace, reason_codes, run_python, wait_until
from handoffd.backends.files import seen as seen_module
from handoffd.backends.files.leases import try_lock
from handoffd.backends.files.seen import MAX_LINE, SeenIds

MIB = 1024 * 1024
NOW = datetime(2026, 11, 25, 12, tzinfo=timezone.utc)

SLOW_TOML = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 600
rescan_seconds = 0.5
lease_seconds = 30.0

[retry]
max_retries = 2
retry_delay_seconds = 0.2
backoff_multiplier = 1.0

[specialists."@slow"]
command = ["{sys.executable}", "-c", "import sys, time; sys.stdin.read(); time.sleep(15)"]
timeout_seconds = 60
concurrency = 3
"""


@pytest.fixture
def slow_ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", SLOW_TOML)
    yield workspace
    workspace.cleanup()


def line(handoff_id: str, at: datetime) -> bytes:
    return seen_module._line(handoff_id, at).encode()


def ids_in(path: Path) -> list[str]:
    return [json.loads(raw)["id"] for raw in path.read_bytes().splitlines()]


# ---------------------------------------------------------------- 1. the compaction's temp file
@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_planted_compaction_name_is_never_opened_nor_renamed_over_the_record(
        slow_ws: Workspace, tmp_path: Path, plant: str) -> None:
    meta = slow_ws.root / "handoffs" / ".meta"
    record = meta / "seen-ids.jsonl"
    now = datetime.now(timezone.utc)
    # an expired first line: the next sweep compacts the record
    record.write_bytes(line("old", datetime(2000, 1, 1, tzinfo=timezone.utc)) + line("kept", now))
    victim = tmp_path / "victim.txt"
    victim.write_text("not the workspace's\n")
    planted = meta / "seen-ids.compact"
    if plant == "symlink":
        planted.symlink_to(victim)
    else:
        os.mkfifo(planted)
    try:
        swept = slow_ws.handoffd("sweep", timeout=30)
    except subprocess.TimeoutExpired:  # (the old compaction blocked in open() on the FIFO)
        pytest.fail("handoffd sweep stalled on the FIFO planted at seen-ids.compact")
    assert swept.returncode == 0, swept.stderr
    assert "Traceback" not in swept.stderr
    assert victim.read_text() == "not the workspace's\n"  # nothing written through the link
    info = os.lstat(record)
    assert stat.S_ISREG(info.st_mode)  # the record is still a file of ours, not the link
    assert ids_in(record) == ["kept"]  # compacted: the expired line dropped
    kind = os.lstat(planted).st_mode  # the plant itself left alone
    assert stat.S_ISLNK(kind) if plant == "symlink" else stat.S_ISFIFO(kind)
    assert not [p.name for p in meta.iterdir() if p.name.endswith(".tmp")]  # no temp left
    # creates go on, and dedup holds
    made = slow_ws.handoff("create", "--to", "@slow", "--id", "fresh", input="{}")
    assert made.returncode == 0, made.stderr
    again = slow_ws.handoff("create", "--to", "@slow", "--id", "kept", input="{}")
    assert again.returncode != 0 and "kept" in again.stderr
    assert ids_in(record) == ["kept", "fresh"]


# ---------------------------------------------------------------- 2. the record read with a bound
def test_one_create_over_a_forged_record_of_no_newline_stays_small(slow_ws: Workspace) -> None:
    """64 MB of 'x' with no newline: the old search kept the whole "line" (and copied it once
    a block), well over 100 MB of memory for one `handoff create`."""
    record = slow_ws.root / "handoffs" / ".meta" / "seen-ids.jsonl"
    with open(record, "wb") as out:
        block = b"x" * MIB
        for _ in range(64):
            out.write(block)
    code = ("import resource, subprocess, sys\n"
            "done = subprocess.run(sys.argv[1:], input='{}', capture_output=True, text=True,"
            " timeout=120)\n"
            "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "print(done.stdout.strip(), done.stderr.strip())\n")
    started = time.monotonic()
    done = run_python(code, exe("handoff"), "create", "--to", "@slow", "--id", "c1",
                      "--root", str(slow_ws.root))
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    rc, max_rss_kb = (int(x) for x in first.split())
    assert rc == 0, second
    assert max_rss_kb < 60 * 1024, f"handoff create peaked at {max_rss_kb // 1024} MB"
    assert took < 20
    assert slow_ws.state_of("c1") == ["pending"]
    # the line appended after the forged one is ours and is read (a second search finds it)
    dup = slow_ws.handoff("create", "--to", "@slow", "--id", "c1", input="{}")
    assert dup.returncode != 0
    assert SeenIds(record, 3600).contains("c1", datetime.now(timezone.utc))


def _forged(path: Path, size: int, *, then: bytes = b"") -> None:
    with open(path, "wb") as out:
        out.write(line("before", NOW))
        block = b"x" * MIB
        for _ in range(size // MIB):
            out.write(block)
        out.write(then)


def test_the_search_refresh_and_compaction_never_hold_an_over_long_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seen_module, "SEARCH_BLOCK", 64 * 1024)
    path = tmp_path / "seen-ids.jsonl"
    # an old line first (the compaction is due), the 16 MB line, then good ones
    with open(path, "wb") as out:
        out.write(line("ancient", NOW - timedelta(hours=3)))
    _forged(tmp_path / "tail", 16 * MIB, then=b"\n" + line("a", NOW) + line("b", NOW))
    with open(path, "ab") as out, open(tmp_path / "tail", "rb") as tail:
        while chunk := tail.read(MIB):
            out.write(chunk)
    (tmp_path / "tail").unlink()
    seen = SeenIds(path, 3600)
    tracemalloc.start()
    try:
        assert seen.contains("a", NOW)  # the search
        assert seen.contains("b", NOW) and seen.contains("before", NOW)  # the loaded index
        assert not seen.contains("ancient", NOW)
        assert seen.compact(NOW) == 3  # before, a, b; ancient and the long line dropped
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MIB, f"peak {peak // 1024} KB for a record with a 16 MB line"
    assert ids_in(path) == ["before", "a", "b"]
    assert SeenIds(path, 3600).contains("a", NOW)


def test_an_over_long_line_still_being_written_is_skipped_once_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line with no newline yet (a forged one at the end) is skipped to its end; the bytes
    skipped are not read again by the next refresh, and the lines after it are read."""
    path = tmp_path / "seen-ids.jsonl"
    _forged(path, 4 * MIB)
    parsed: list[int] = []
    real = seen_module._parse

    def counting(data: bytes) -> Any:
        parsed.append(len(data))
        return real(data)

    monkeypatch.setattr(seen_module, "_parse", counting)
    mine, other = SeenIds(path, 3600), SeenIds(path, 3600)
    assert mine.contains("before", NOW)  # the search
    assert not mine.contains("zzz", NOW)  # loads the index: the long line is skipped
    assert max(parsed) <= seen_module.SEARCH_BLOCK + MAX_LINE
    read = mine._offset
    assert read == path.stat().st_size  # skipped, not left waiting for its newline
    other.add("o1", NOW)  # another process ends the torn line and appends
    assert mine.contains("o1", NOW)
    mine.add("m1", NOW)  # our own add ends nothing: the next line of another is read too
    other.add("o2", NOW)
    assert mine.contains("o2", NOW) and mine.contains("m1", NOW)
    assert sum(parsed) < 2 * MIB  # the 4 MB were never parsed
    fresh = SeenIds(path, 3600)
    assert all(fresh.contains(i, NOW) for i in ("before", "o1", "m1", "o2"))


def test_an_own_add_ends_a_skipped_line(tmp_path: Path) -> None:
    path = tmp_path / "seen-ids.jsonl"
    _forged(path, 2 * MIB)
    mine, other = SeenIds(path, 3600), SeenIds(path, 3600)
    assert not mine.contains("x", NOW) and not mine.contains("x", NOW)  # skipping now
    mine.add("m1", NOW)  # "\n" then our line: the skipped line ends there
    other.add("o1", NOW)
    assert mine.contains("o1", NOW)


def test_well_formed_records_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "seen-ids.jsonl"
    path.write_bytes(b"".join(line(f"h-{i}", NOW - timedelta(seconds=i)) for i in range(30_000))
                     + b'{"id": "torn", "at": "2026-1')
    seen = SeenIds(path, 86400)
    assert seen.contains("h-29999", NOW) and not seen.contains("torn", NOW)
    assert len(seen._cache) == 30_000
    assert seen._offset == path.stat().st_size - len(b'{"id": "torn", "at": "2026-1')


# ---------------------------------------------------------------- 3. lock names in .locks
def _abandon(ws: Workspace, ids: list[str]) -> None:
    """Claims of ``ids`` whose daemon died (kill -9) while their specialist ran."""
    for handoff_id in ids:
        ws.handoff("create", "--to", "@slow", "--id", handoff_id, input="{}", check=True)
    daemon = ws.serve()
    in_progress = ws.root / "handoffs" / "in-progress"

    def leased() -> bool:
        try:
            return all("lease" in json.loads((in_progress / f"{i}.json").read_text())["handoffd"]
                       for i in ids)
        except (OSError, ValueError, KeyError):
            return False

    wait_until(leased, timeout=30, what="all claims leased")
    ws.stop(daemon, signal.SIGKILL)


def _plant(path: Path, kind: str, outside: Path) -> None:
    if kind == "dir":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["dir", "symlink"])
def test_an_entry_planted_at_a_recover_lock_stops_no_recovery(
        slow_ws: Workspace, tmp_path: Path, kind: str) -> None:
    ids = ["k1", "k2", "k3"]
    _abandon(slow_ws, ids)
    outside = tmp_path / "outside.lock"
    outside.write_text("")
    planted = slow_ws.root / "handoffs" / ".locks" / "k2.recover.lock"
    _plant(planted, kind, outside)
    swept = slow_ws.handoffd("sweep", timeout=60)
    assert swept.returncode == 0, swept.stderr
    assert "cannot look for abandoned claims" not in swept.stderr, swept.stderr
    assert "Traceback" not in swept.stderr
    for handoff_id in ids:  # every one recovered (retried or failed), k2 too
        assert "in-progress" not in slow_ws.state_of(handoff_id), (handoff_id, swept.stderr)
    assert not os.path.lexists(planted)
    assert "k2.recover.lock" in reason_codes(slow_ws.root)
    assert reason_codes(slow_ws.root)["k2.recover.lock"] == "NOT_A_REGULAR_FILE"
    assert outside.read_text() == ""
    warned = [x for x in swept.stderr.splitlines() if "k2.recover.lock" in x]
    assert len(warned) == 1 and "NOT_A_REGULAR_FILE" in warned[0], swept.stderr


def test_a_lock_that_cannot_be_had_is_that_handoffs_problem_alone(
        slow_ws: Workspace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The plant cannot be moved into the quarantine: k2 stays, said in a line, and the other
    abandoned claims are recovered all the same. (The quarantine once refused it by being a
    symlink out of the workspace; such a workspace is now refused at start, so the sweep runs
    in this process and the move fails by hand.)"""
    import errno

    from handoffd.backends.files import quarantine
    from handoffd.cli.basics import engine
    from handoffd.service.sweeper import sweep
    ids = ["k1", "k2", "k3"]
    _abandon(slow_ws, ids)
    planted = slow_ws.root / "handoffs" / ".locks" / "k2.recover.lock"
    planted.mkdir()
    real = quarantine.move_to_quarantine

    def refused(folder: Path, path: Path, *args: Any, **kwargs: Any) -> Path:
        if path.name.startswith("k2"):
            raise OSError(errno.EACCES, "Permission denied", str(folder))
        return real(folder, path, *args, **kwargs)

    monkeypatch.setattr(quarantine, "move_to_quarantine", refused)
    eng = engine(slow_ws.root)
    try:
        with caplog.at_level(logging.WARNING):
            sweep(eng)
    finally:
        eng.backend.close()
    said = [r.getMessage() for r in caplog.records]
    assert not any("cannot look for abandoned claims" in x for x in said), said
    assert slow_ws.state_of("k2") == ["in-progress"]
    for handoff_id in ("k1", "k3"):
        assert "in-progress" not in slow_ws.state_of(handoff_id), (handoff_id, said)
    assert planted.is_dir()  # not moved: said, and left
    assert any("k2" in x for x in said), said


def test_try_lock_moves_a_planted_fifo_aside(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO at a lock name opened (O_NONBLOCK) and "locked" without an error: it is moved
    aside before the lock is taken, and the lock taken is a regular file."""
    from handoffd.backends.files.leases import release_lock
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    path = ws.locks / "h1.recover.lock"
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING):
        lock = try_lock(path)
    assert lock is not None
    try:
        assert stat.S_ISREG(os.lstat(path).st_mode)
        assert try_lock(path) is None  # held: a second taker waits its turn
    finally:
        release_lock(lock)
    assert reason_codes(tmp_path) == {"h1.recover.lock": "NOT_A_REGULAR_FILE"}
    assert [r for r in caplog.records if "h1.recover.lock" in r.getMessage()]
