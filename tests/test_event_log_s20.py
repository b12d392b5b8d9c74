"""The event log, session 20 (helper F7; reviews r24 #1 and #4, r21 #6).

- A follower (``handoff ls --watch``, ``handoff top``, the metrics) that found the file it was
  reading rotated read the rest of it and jumped to the current file: the files rotated in
  between were never read (two rotations between two looks: 22 of 45 events seen), and a cursor
  taken before the log existed skipped whatever was rotated before the first look. It now reads
  every newer file kept, each found by its inode; a file rotated past ``events_keep`` is a gap,
  said once and counted (``handoffd_event_log_gaps_total``).
- A write that stored part of its line (a full disk) went unnoticed: the event log and the
  seen-ids record were torn, and the next line was glued to the torn one (both lost). It is now
  an OSError (ENOSPC), and the next line starts a line of its own.
- ``handoff top``'s "FINISHED (10 min)" counted every finish since it started, and its buckets
  were never dropped.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import Clock, Workspace, exe, interrupted, new_workspace

from handoffd.backends.files.events import FileEventLog
from handoffd.backends.files.seen import SeenIds
from handoffd.core.events import START, tail_into
from handoffd.core.workspace import Workspace as HandoffdWorkspace

KEEP = 3


@pytest.fixture
def elog(tmp_path: Path) -> FileEventLog:
    ws = HandoffdWorkspace(tmp_path)
    ws.meta.mkdir(parents=True, exist_ok=True)
    return FileEventLog(ws, max_bytes=4096, keep=KEEP)


class Writer:
    """Appends numbered events to a log, and counts the rotations it caused."""

    def __init__(self, log: FileEventLog) -> None:
        self.log = log
        self.n = 0

    def one(self) -> str:
        self.n += 1
        hid = f"e{self.n:05d}"
        self.log.append({"at": "2026-11-26T10:00:00.000Z", "event": "created", "id": hid,
                         "state": "pending", "pad": "x" * 100})
        return hid

    def rotations(self, count: int) -> list[str]:
        """Append until the log has rotated ``count`` times; the ids appended."""
        out: list[str] = []
        for _ in range(count):
            before = _ino(self.log.rotated(1))  # (a rotation: a new file there)
            while _ino(self.log.rotated(1)) == before:
                out.append(self.one())
        out.append(self.one())  # one in the current file too
        return out


def _ino(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return 0


def kept_ids(log: FileEventLog) -> list[str]:
    return [str(e["id"]) for e in log.read()]


def follow(log: FileEventLog, cursor: Any) -> tuple[list[str], Any, list[int]]:
    """One look: the ids seen, the next cursor, and the gaps reported (one entry each)."""
    got: list[str] = []
    gaps: list[int] = []
    cursor = tail_into(log, cursor, lambda e: got.append(str(e["id"])), lambda: gaps.append(1))
    return got, cursor, gaps


# ------------------------------------------------------------------ 1: rotations between looks
@pytest.mark.parametrize("rotations", [1, 2, KEEP])  # (KEEP + 1: the inodes came round)
def test_every_event_is_seen_once_across_rotations_between_two_looks(
        elog: FileEventLog, rotations: int) -> None:
    """Up to ``keep`` rotations between two looks: nothing is missed, nothing is seen twice,
    and no gap is reported. (Two rotations: the follower saw 22 of 45.)"""
    writer = Writer(elog)
    writer.one()
    _, cursor = elog.tail(None)
    appended = writer.rotations(rotations)
    got, cursor, gaps = follow(elog, cursor)
    assert got == appended and gaps == []
    more = writer.rotations(1)
    got, cursor, gaps = follow(elog, cursor)
    assert got == more and gaps == []
    assert follow(elog, cursor)[0] == []


def test_a_file_rotated_past_keep_is_a_gap_said_once(
        elog: FileEventLog, caplog: pytest.LogCaptureFixture) -> None:
    """keep + 1 rotations: every event still kept is seen once, and the gap is reported (to the
    caller each time, in the log once)."""
    writer = Writer(elog)
    writer.one()
    _, cursor = elog.tail(None)
    caplog.set_level(logging.WARNING, logger="handoffd")
    appended = writer.rotations(KEEP + 1)
    got, cursor, gaps = follow(elog, cursor)
    kept = kept_ids(elog)
    assert got == kept and set(kept) < set(appended) and gaps == [1]
    appended = writer.rotations(KEEP + 1)
    got, cursor, gaps = follow(elog, cursor)
    assert got == kept_ids(elog) and gaps == [1]
    said = [r.getMessage() for r in caplog.records if "rotated past" in r.getMessage()]
    assert len(said) == 1 and "events_keep" in said[0], said


def test_a_cursor_from_before_the_log_existed_reads_every_file_rotated_since(
        elog: FileEventLog) -> None:
    """``ls --watch`` started on a fresh workspace: the files rotated before its first look
    are read (they were skipped), with no gap while rotations stayed within keep."""
    _, cursor = elog.tail(None)
    assert cursor[0] == 0
    appended = Writer(elog).rotations(2)
    got, cursor, gaps = follow(elog, cursor)
    assert got == appended and gaps == []


def test_a_cursor_from_before_the_log_existed_reports_a_possible_gap_when_all_names_are_taken(
        elog: FileEventLog) -> None:
    _, cursor = elog.tail(None)
    Writer(elog).rotations(KEEP + 1)
    got, _, gaps = follow(elog, cursor)
    assert got == kept_ids(elog) and gaps == [1]


def test_a_log_truncated_in_place_is_read_from_its_start_without_a_gap(
        elog: FileEventLog) -> None:
    """``: > events.jsonl`` with rotated files kept: the new events are read, the rotated
    files are not read again, and no gap is said (the file before it is still there)."""
    writer = Writer(elog)
    writer.rotations(1)
    _, cursor = elog.tail(None)
    os.truncate(elog.path, 0)
    fresh = [writer.one() for _ in range(3)]
    got, _, gaps = follow(elog, cursor)
    assert got == fresh and gaps == []


def test_a_copytruncate_rotation_is_read_on_from_the_copy(elog: FileEventLog) -> None:
    """logrotate's copytruncate (a copy rotated in before the file, which is then truncated
    in place and keeps its inode): what the copy holds past the cursor, then the new events."""
    writer = Writer(elog)
    writer.rotations(1)
    _, cursor = elog.tail(None)
    late = [writer.one() for _ in range(2)]
    os.replace(elog.rotated(1), elog.rotated(2))
    elog.rotated(1).write_bytes(elog.path.read_bytes())
    os.truncate(elog.path, 0)
    fresh = [writer.one() for _ in range(2)]
    got, _, gaps = follow(elog, cursor)
    assert got == late + fresh and gaps == []


def rotating_take(writer: Writer, at: int, rotations: int, got: list[str]) -> Callable[..., None]:
    """A ``take`` that makes the log rotate ``rotations`` times when it is handed its
    ``at``-th event: a rotation in the middle of a follower's read."""
    def take(event: Any) -> None:
        got.append(str(event["id"]))
        if len(got) == at:
            writer.rotations(rotations)
    return take


@pytest.mark.parametrize("start", [False, True])
def test_rotations_during_a_read_neither_skip_nor_repeat_an_event(
        elog: FileEventLog, start: bool) -> None:
    """The files are identified by inode, never by name alone: two rotations while a follower
    reads the first file (every name now holds another file) cost nothing, and the next look
    takes what came meanwhile."""
    writer = Writer(elog)
    cursor: Any = START
    if not start:
        writer.one()
        _, cursor = elog.tail(None)
    writer.rotations(2)
    got: list[str] = []
    gaps: list[int] = []
    cursor = tail_into(elog, cursor, rotating_take(writer, 3, 2, got), lambda: gaps.append(1))
    rest, _, more_gaps = follow(elog, cursor)
    assert got + rest == [f"e{n:05d}" for n in range(1 if start else 2, writer.n + 1)]
    assert gaps == more_gaps == []


# ------------------------------------------------------------------ 2: short writes
class HalfWrites:
    """os.write that stores half of what it is given for a file whose name ends with
    ``suffix`` (as a full disk does), while ``on``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
        self.real = os.write
        self.suffix = suffix
        self.on = False
        self.torn = 0
        monkeypatch.setattr(os, "write", self)

    def __call__(self, fd: int, data: Any) -> int:
        if self.on:
            try:
                name = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                name = ""
            if name.endswith(self.suffix):
                self.torn += 1
                return self.real(fd, bytes(data)[:len(data) // 2])
        return self.real(fd, data)


def test_a_short_write_to_the_event_log_is_an_error_and_the_next_line_stands_alone(
        elog: FileEventLog, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = Writer(elog)
    writer.one()
    half = HalfWrites(monkeypatch, "events.jsonl")
    half.on = True
    with pytest.raises(OSError) as raised:
        writer.one()
    half.on = False
    assert half.torn == 1 and raised.value.errno == errno.ENOSPC
    assert "cut short" in str(raised.value)
    writer.one()
    assert kept_ids(elog) == ["e00001", "e00003"]  # the torn one alone is lost


def test_a_short_write_to_the_seen_ids_record_fails_the_add_and_the_next_id_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "seen-ids.jsonl"
    now = datetime.now(timezone.utc)
    seen = SeenIds(path, 3600)
    seen.add("sx0", now)
    half = HalfWrites(monkeypatch, "seen-ids.jsonl")
    half.on = True
    with pytest.raises(OSError) as raised:
        seen.add("sx1", now)
    half.on = False
    assert raised.value.errno == errno.ENOSPC
    seen.add("sx2", now)
    fresh = SeenIds(path, 3600)  # another process: reads the record
    assert fresh.contains("sx2", now) and fresh.contains("sx0", now)
    assert not fresh.contains("sx1", now)
    assert path.read_bytes().count(b"\n") == 3  # sx0, the torn sx1, then sx2 on its own


def test_create_says_when_the_seen_ids_record_was_torn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``handoff create --id sx1`` on a full disk exited 0 without a word, the record ending
    ``{"id": "sx1", "at": ``: it now says the record could not take the id."""
    from handoffd import Client
    client = Client(tmp_path)
    client.create("@nobody", {"n": 0}, handoff_id="sx0")
    half = HalfWrites(monkeypatch, "seen-ids.jsonl")
    caplog.set_level(logging.WARNING, logger="handoffd")
    half.on = True
    try:
        client.create("@nobody", {"n": 1}, handoff_id="sx1")
    finally:
        half.on = False
    said = [r.getMessage() for r in caplog.records]
    assert any("sx1: created, but the seen-ids record could not take it" in m
               and "No space left" in m for m in said), said


# ------------------------------------------------------------------ 3: top's ten minutes
def test_top_counts_the_finishes_of_the_last_ten_minutes_only(tmp_path: Path) -> None:
    from rich.console import Console

    from handoffd import build_engine
    from handoffd.cli.observe_cmd import BUCKET_SECONDS, BUCKETS, TopModel
    clock = Clock()
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    engine = build_engine(ws, features=(), clock=clock)
    model = TopModel(engine)

    def finished(agent: str) -> None:
        model.add({"at": clock().isoformat().replace("+00:00", "Z"), "event": "completed",
                   "state": "completed", "id": f"{agent}-{clock().timestamp()}", "agent": agent})

    def column() -> dict[str, str]:
        screen = Console(record=True, width=200, file=open(os.devnull, "w"))
        screen.print(model.render(clock()))
        rows = {}
        for row in screen.export_text().splitlines():
            cells = row.split()
            if len(cells) == 4 and cells[0].startswith("@"):
                rows[cells[0]] = cells[3]
        return rows

    try:
        for _ in range(3):
            finished("@old")
        clock.advance(5 * 60)
        finished("@new")
        assert column() == {"@new": "1", "@old": "3"}
        clock.advance(5 * 60 + BUCKET_SECONDS)  # @old's finishes are over ten minutes old
        assert column() == {"@new": "1"}
        clock.advance(10 * 60)
        assert column() == {}
        for _ in range(BUCKETS * 3):  # a top left open: the buckets are bounded
            clock.advance(BUCKET_SECONDS)
            finished("@busy")
            column()
        assert len(model.buckets) <= BUCKETS
        assert column() == {"@busy": str(BUCKETS)}
    finally:
        engine.backend.close()


# ------------------------------------------------------------------ the real `ls --watch`
@pytest.fixture
def small_log_ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", "[daemon]\nevents_max_bytes = 4096\n"
                              "events_keep = 50\n")
    yield workspace
    workspace.cleanup()


def test_ls_watch_prints_every_event_of_a_burst_that_rotated_the_log_many_times(
        small_log_ws: Workspace) -> None:
    """The watcher is held (SIGSTOP) while 150 handoffs are created and the log rotates several
    times, then let go: it prints every ``created`` (it printed those of the last two files)."""
    ws = small_log_ws
    meta = ws.root / "handoffs" / ".meta"
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--json", "--root",
                                str(ws.root)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    ws.daemons.append(watcher)
    printed: queue.Queue[str] = queue.Queue()
    assert watcher.stdout is not None
    out = watcher.stdout
    threading.Thread(target=lambda: [printed.put(x) for x in out], daemon=True).start()
    seen: list[str] = []

    def take_until(done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            try:
                event = json.loads(printed.get(timeout=0.2))
            except queue.Empty:
                continue
            if event.get("event") == "created":
                seen.append(event["id"])

    from handoffd import Client
    client = Client(ws.root)
    try:
        for n in range(60):  # the watcher is following once it prints one
            client.create("@nobody", {"n": n}, handoff_id=f"ready{n}")
            take_until(lambda: bool(seen), 1.0)
            if seen:
                break
        assert seen, "ls --watch never printed an event"
        os.kill(watcher.pid, signal.SIGSTOP)
        try:
            burst = [f"b{n:03d}" for n in range(150)]
            for hid in burst:
                client.create("@nobody", {"pad": "x" * 200}, handoff_id=hid)
        finally:
            os.kill(watcher.pid, signal.SIGCONT)
        assert (meta / "events.jsonl.3").exists()  # several rotations while it was held
        take_until(lambda: burst[-1] in seen, 30)
        got = [hid for hid in seen if hid.startswith("b")]
        assert got == burst, f"{len(got)} of {len(burst)} printed"
    finally:
        assert interrupted(watcher) == 0


def test_metrics_count_every_event_across_rotations_and_the_gaps(tmp_path: Path) -> None:
    """A scrape after two rotations counts every event (it counted those of the last two
    files: transitions_total 3.0 for 200 created); one after keep + 1 rotations counts what is
    kept and the gap (handoffd_event_log_gaps_total)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from handoffd import build_engine
    from handoffd.service.metrics import EventCollector
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    log = FileEventLog(ws, max_bytes=4096, keep=KEEP)
    engine = build_engine(ws, features=())
    try:
        collector = EventCollector(engine, log)
        registry = CollectorRegistry()
        registry.register(collector)

        def scrape() -> tuple[float, float]:
            created = gaps = 0.0
            for family in text_string_to_metric_families(generate_latest(registry).decode()):
                for sample in family.samples:
                    if sample.name == "handoffd_transitions_total" \
                            and sample.labels.get("event") == "created":
                        created += sample.value
                    if sample.name == "handoffd_event_log_gaps_total":
                        gaps = sample.value
            return created, gaps

        writer = Writer(log)
        writer.one()
        assert scrape() == (1.0, 0.0)
        writer.rotations(2)
        assert scrape() == (float(writer.n), 0.0)
        counted = writer.n
        writer.rotations(KEEP + 1)
        assert kept_ids(log)[0] > f"e{counted + 1:05d}"  # some were never read
        created, gaps = scrape()
        assert gaps == 1.0 and created == counted + len(kept_ids(log))
    finally:
        engine.backend.close()
