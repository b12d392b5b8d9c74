"""Gaps in the event log's followers and in the file watch (session 16, helper H4).

- A follower of ``handoffs/.meta/events.jsonl`` (``handoff ls --watch``, metrics, ``handoff
  top``) told a log truncated in place by the byte before its cursor alone: a log truncated and
  written again past the cursor with a newline there was read on from the cursor, and the new
  events before it were missed. The cursor now keeps the file's first bytes and those before it.
- inotify followed a symlink at a watched folder's path: a state folder swapped for a link was
  watched through it. Watches are added with ``IN_DONT_FOLLOW | IN_ONLYDIR``.
- A watch lost (a folder moved away with none at its path yet) was tried again at once and then
  only by the daemon's sweep: a one-shot ``handoff wait`` never had it back. The reader retries
  on its own; and a wait whose feed cannot be set up at all (no inotify instance left) polls
  instead of failing.
- ``handoffs/`` itself renamed away while ``serve`` runs left every watch on the old folders
  (no event reaches a folder whose parent moves): the parents are watched for that, and the
  folders are watched again at their paths.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, interrupted, wait_until

from handoffd.backends.base import WaitTimeout
from handoffd.backends.files import inotify
from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.files.events import FileEventLog
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service.waiting import wait_terminal

linux_only = pytest.mark.skipif(not inotify.available(), reason="inotify is Linux only")


def line(tag: str, n: int, width: int = 0) -> bytes:
    """One event line of ours, padded to ``width`` bytes (newline included) when given."""
    event = {"at": f"2026-11-26T10:00:{n % 60:02d}.{n:03d}Z", "event": "created",
             "id": f"{tag}{n:04d}", "pad": ""}
    raw = json.dumps(event, separators=(",", ":"))
    return (raw[:-2] + "x" * max(width - len(raw) - 1, 0) + '"}\n').encode()


def lines(tag: str, count: int) -> bytes:
    return b"".join(line(tag, n) for n in range(count))


def ids(events: list[Any]) -> list[str]:
    return [e["id"] for e in events]


# ---------------------------------------------------------------- 1: the event log's followers
@pytest.mark.parametrize("cursor_from", ["now", "a read"])
def test_a_log_truncated_and_written_past_the_cursor_is_read_from_its_start(
        tmp_path: Path, cursor_from: str) -> None:
    """Lines of one length: after the truncation and the new lines, the byte before the
    follower's cursor is a newline again, as it was. Every new event is read, none twice."""
    ws = HandoffdWorkspace(tmp_path)
    ws.meta.mkdir(parents=True)
    log = FileEventLog(ws)
    log.path.write_bytes(lines("old", 5))
    if cursor_from == "now":
        _, cursor = log.tail(None)
    else:
        read, cursor = log.tail(cursor=(0, 0, True))
        assert ids(read) == [f"old{n:04d}" for n in range(5)]
    os.truncate(log.path, 0)  # logrotate's copytruncate, then new events past the old end
    with open(log.path, "ab") as fh:
        fh.write(lines("new", 8))
    fresh, cursor = log.tail(cursor)
    assert ids(fresh) == [f"new{n:04d}" for n in range(8)]
    assert log.tail(cursor)[0] == []  # and nothing twice


def test_a_followed_log_is_read_once_and_old_cursors_still_work(tmp_path: Path) -> None:
    """The usual case is unchanged: appended events once each, across polls with nothing new
    (the print is kept) and past the first bytes the print holds; a cursor of an older handoffd
    (inode, offset, at a line's start) is still followed."""
    ws = HandoffdWorkspace(tmp_path)
    ws.meta.mkdir(parents=True)
    log = FileEventLog(ws)
    _, cursor = log.tail(None)
    seen: list[str] = []
    for n in range(40):
        log.append({"at": "2026-11-26T10:00:00.000Z", "event": "created", "id": f"a{n}"})
        for _ in range(2):
            events, cursor = log.tail(cursor)
            seen += ids(events)
    assert seen == [f"a{n}" for n in range(40)]
    old_style = tuple(cursor[:3])
    log.append({"event": "created", "id": "late"})
    assert ids(log.tail(old_style)[0]) == ["late"]


def test_a_log_rewritten_in_place_is_followed_by_ls_watch(ws: Workspace) -> None:
    """(A real ``handoff ls --watch``.) The log is written over in place with new events of
    one length, a newline just before the watcher's cursor at every moment: the watcher prints
    the new events from the first, not only those past where it was."""
    events = ws.root / "handoffs" / ".meta" / "events.jsonl"
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--json", "--root",
                                str(ws.root)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    ws.daemons.append(watcher)
    printed: queue.Queue[str] = queue.Queue()
    assert watcher.stdout is not None
    out = watcher.stdout
    threading.Thread(target=lambda: [printed.put(x) for x in out], daemon=True).start()
    seen: set[str] = set()

    def sees(hid: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while hid not in seen and time.monotonic() < deadline:
            try:
                seen.add(json.loads(printed.get(timeout=0.2))["id"])
            except queue.Empty:
                pass
        return hid in seen

    try:
        events.write_bytes(lines("old", 30))
        for n in range(40):  # the watcher follows from the end of what is there
            if sees(ws.create("--to", "@nobody", "--id", f"w{n}"), 1.0):
                break
        else:
            raise AssertionError("ls --watch never printed an event")
        size = events.stat().st_size
        width = len(line("new", 0))
        count = size // width + 5
        # the first line takes the odd bytes: a newline ends the new content's byte size-1
        first = line("new", 0, width + size % width)
        new = first + b"".join(line("new", n) for n in range(1, count))
        assert new[size - 1:size] == b"\n" and len(new) > size
        with open(events, "r+b") as fh:
            fh.write(new)
        assert sees("new0000", 10), f"the events before the cursor were missed: {sorted(seen)}"
        assert sees(f"new{count - 1:04d}", 10)
    finally:
        assert interrupted(watcher) == 0


# ---------------------------------------------------------------- 2: no watch through a symlink
class Recorder:
    """The callbacks of a FolderEvents: (kind, name) events and rescans asked for."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lost = threading.Event()
        self.changed = threading.Condition()

    def on_event(self, kind: str, name: str, settled: bool) -> None:
        with self.changed:
            self.events.append((kind, name))
            self.changed.notify_all()

    def heard(self, kind: str, name: str, timeout: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: (kind, name) in self.events, timeout)


@pytest.fixture
def watching(tmp_path: Path) -> Iterator[Any]:
    """Start FolderEvents on the given folders; stopped at the end."""
    started: list[inotify.FolderEvents] = []

    def start(folders: dict[Path, str]) -> tuple[inotify.FolderEvents, Recorder]:
        rec = Recorder()
        watch = inotify.FolderEvents(folders, rec.on_event, rec.lost.set)
        watch.start()
        started.append(watch)
        return watch, rec
    yield start
    for watch in started:
        watch.stop()


@linux_only
def test_a_state_folder_swapped_for_a_symlink_is_not_watched_through_it(
        tmp_path: Path, watching: Any, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pending, completed = tmp_path / "handoffs" / "pending", tmp_path / "handoffs" / "completed"
    completed.mkdir(parents=True)
    pending.symlink_to(elsewhere)  # there from the start
    watch, rec = watching({pending: "pending", completed: "completed"})
    assert pending in watch.unwatched
    said = [r.getMessage() for r in caplog.records if "cannot watch" in r.getMessage()]
    assert len(said) == 1 and "Not a directory" in said[0], said
    # and swapped in while watched: the folder now at the path is a link, not watched either
    os.rename(completed, tmp_path / "completed.old")
    completed.symlink_to(elsewhere)
    assert rec.lost.wait(5)
    assert completed in watch.unwatched
    (elsewhere / "hoff-x.json").write_text("{}")
    (tmp_path / "handoffs" / "marker.json").write_text("{}")  # (no folder of ours: unheard)
    time.sleep(0.2)  # (a negative: what would have been heard by now)
    assert not [e for e in rec.events if e[1] == "hoff-x.json"], rec.events


# ---------------------------------------------------------------- 3: a lost watch comes back
@linux_only
def test_a_lost_watch_is_tried_again_by_the_reader_without_a_sweep(
        tmp_path: Path, watching: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """pending/ moved away, none at its path when the reader looks: no sweep runs (a one-shot
    ``handoff wait``), yet once a folder is there again it is watched, and a rescan asked for."""
    monkeypatch.setattr(inotify, "FIRST_RETRY_SECONDS", 0.05, raising=False)
    pending = tmp_path / "handoffs" / "pending"
    pending.mkdir(parents=True)
    watch, rec = watching({pending: "pending"})
    os.rename(pending, tmp_path / "pending.old")
    assert rec.lost.wait(5)
    wait_until(lambda: pending in watch.unwatched, 5, "pending/ unwatched")
    rec.lost.clear()
    pending.mkdir()
    assert rec.lost.wait(10), "the folder back at its path was never watched again"
    (pending / "hoff-back.json").write_text("{}")
    assert rec.heard("pending", "hoff-back.json")
    assert not watch.unwatched


class NoInotify:
    """libc, except that inotify_init1 fails (EMFILE: no instance or descriptor left)."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc

    def inotify_init1(self, *args: Any) -> int:
        ctypes.set_errno(errno.EMFILE)
        return -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.libc, name)


@linux_only
def test_a_wait_without_a_watch_polls_and_ends_on_time(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No inotify instance left: ``handoff wait`` failed with the OSError. It now says so in
    one line and looks again at a bounded interval: it times out when it should, and ends
    once the handoff is filed."""
    monkeypatch.setattr(inotify, "_LIBC", NoInotify(inotify._LIBC))
    backend = FilesBackend.open(HandoffdWorkspace(ws.root), durable=False)
    try:
        hid = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
        with pytest.raises(WaitTimeout):
            wait_terminal(backend, hid, 0.1)
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and "cannot watch" in said[0] and "every 2 s" in said[0], said
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(wait_terminal(backend, hid, 60)))
        waiter.start()
        ran = ws.handoffd("run")
        assert ran.returncode == 0, ran.stderr
        waiter.join(timeout=30)
        assert not waiter.is_alive() and result and result[0][0].value == "completed"
    finally:
        backend.close()


def test_a_subscription_whose_watch_cannot_start_leaves_no_callback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback was registered before the watch started, and stayed when the start failed:
    a long-running process (the MCP server) gathered one per failed wait."""
    monkeypatch.setattr(inotify, "_LIBC", NoInotify(inotify._LIBC))
    root = HandoffdWorkspace(tmp_path / "ws")
    root.ensure()
    backend = FilesBackend.open(root, durable=False)
    try:
        for _ in range(3):
            with pytest.raises(OSError):
                backend.subscribe(lambda wakeup: None)
        assert len(backend._subscribers) == 0
    finally:
        backend.close()


# ---------------------------------------------------------------- 4: handoffs/ renamed away
@linux_only
def test_handoffs_renamed_away_is_watched_again_at_its_paths(
        tmp_path: Path, watching: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The new folders are watched (at once, or by the reader's retry when they were not
    there yet), a rescan is asked for, the old folders are no longer watched; one line."""
    monkeypatch.setattr(inotify, "FIRST_RETRY_SECONDS", 0.05, raising=False)
    handoffs = tmp_path / "handoffs"
    folders = {handoffs / "pending": "pending", handoffs / "completed": "completed",
               handoffs / ".meta" / "cancel": "cancel"}
    for folder in folders:
        folder.mkdir(parents=True)
    watch, rec = watching(folders)
    os.rename(handoffs, tmp_path / "handoffs.old")
    for folder in folders:
        folder.mkdir(parents=True)
    assert rec.lost.wait(5), "no rescan asked for after handoffs/ was renamed away"
    wait_until(lambda: not watch.unwatched, 5, "the new folders watched")
    (handoffs / "pending" / "hoff-new.json").write_text("{}")
    (handoffs / ".meta" / "cancel" / "hoff-c.json").write_text("{}")
    assert rec.heard("pending", "hoff-new.json"), rec.events
    assert rec.heard("cancel", "hoff-c.json"), rec.events
    (tmp_path / "handoffs.old" / "pending" / "hoff-old.json").write_text("{}")
    (handoffs / "completed" / "hoff-done.json").write_text("{}")
    assert rec.heard("completed", "hoff-done.json")  # (after the old one, had it been heard)
    assert ("pending", "hoff-old.json") not in rec.events  # the old folders are not watched
    said = [r.getMessage() for r in caplog.records if "moved away" in r.getMessage()]
    assert len(said) == 1 and str(handoffs) in said[0], said
    assert watch.alive() and not watch.unwatched


@linux_only
def test_serve_picks_up_at_once_after_handoffs_is_restored_from_a_copy(ws: Workspace) -> None:
    """(A real daemon, rescans an hour apart.) handoffs/ renamed away and a copy put at its
    path (a restore): a new handoff is still picked up promptly, and the daemon said what
    happened in one warning line."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text()
                    .replace("rescan_seconds = 1.0", "rescan_seconds = 3600.0"))
    daemon = ws.serve()
    handoffs = ws.root / "handoffs"
    # the copy is made first and renamed into place: copied in place, the daemon (which
    # noticed handoffs/ gone) could make its folders again meanwhile, and copytree failed
    shutil.copytree(handoffs, ws.root / "handoffs.copy", symlinks=True)
    os.rename(handoffs, ws.root / "handoffs.bak")
    os.rename(ws.root / "handoffs.copy", handoffs)
    time.sleep(0.5)  # (the reader sees the rename before the first create below)
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    # (rescans are an hour apart; a folder the reader could not watch again at once, e.g. seen
    # missing between the two renames, is retried at 1 s, then growing intervals: a bound of
    # 30 s, not 10, which one run in nine came within a second of)
    assert ws.wait_state(hid, timeout=30) == "completed", "not picked up from the new pending/"
    assert ws.stop(daemon) == 0
    assert daemon.stderr is not None
    err = daemon.stderr.read()
    said = [x for x in err.splitlines() if "moved away or removed" in x]
    assert len(said) == 1 and "WARNING" in said[0], err
    assert f"{handoffs} was moved away or removed" in said[0], err
    assert "Traceback" not in err and "died" not in err, err


@linux_only
def test_a_read_out_of_memory_does_not_end_the_watch(
        tmp_path: Path, watching: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Helper S (session 24): under `prlimit --as`, the reader thread died of a MemoryError in
    its read (a traceback; changes then seen only at rescans). Nothing was read: it reads
    again after a short pause, and the event is heard."""
    folder = tmp_path / "pending"
    folder.mkdir()
    real, short = os.read, [2]

    def read(fd: int, size: int) -> bytes:
        if short[0] and size == inotify._BUFFER:
            short[0] -= 1
            raise MemoryError()
        return real(fd, size)

    monkeypatch.setattr(inotify.os, "read", read)
    watch, rec = watching({folder: "pending"})
    (folder / "a.json").write_text("{}")
    assert rec.heard("pending", "a.json"), rec.events
    assert short[0] == 0 and watch._thread is not None and watch._thread.is_alive()
