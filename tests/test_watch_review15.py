"""The file watch is never lost without a word (review R6, fixer FO): a folder inotify cannot
watch (no watches left: ENOSPC) is said once and the sweep tries it again; a watched folder moved
away or removed (``pending/`` replaced) is watched again at its path, by the reader at once or by
the next sweep, so pick-up does not drop to the rescans."""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace

from handoffd.backends.files import inotify
from handoffd.backends.files.backend import FilesBackend
from handoffd.core.storage import LOST, Wakeup
from handoffd.core.workspace import Workspace as HandoffdWorkspace

pytestmark = pytest.mark.skipif(not inotify.available(), reason="inotify is Linux only")
NOW = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


class NoWatchesLeft:
    """libc, except that inotify_add_watch fails with ENOSPC while ``full`` (as with
    max_user_watches used up)."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc
        self.full = True

    def inotify_add_watch(self, *args: Any) -> int:
        if self.full:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return int(self.libc.inotify_add_watch(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.libc, name)


class Heard:
    """Wake-ups received (on the watch's thread), waited for by predicate."""

    def __init__(self) -> None:
        self.wakeups: list[Wakeup] = []
        self.changed = threading.Condition()

    def __call__(self, wakeup: Wakeup) -> None:
        with self.changed:
            self.wakeups.append(wakeup)
            self.changed.notify_all()

    def wait(self, predicate: Any, timeout: float = 2.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: any(predicate(w) for w in self.wakeups),
                                         timeout)


def warnings_of(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and needle in r.getMessage()]


def test_unwatchable_pending_is_said_once_and_the_sweep_watches_it_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """(A) inotify_add_watch refused (ENOSPC): one warning, the watch reports itself unhealthy,
    each sweep retries quietly, and once watches are available again the next sweep adds them
    and asks for a rescan; from then on an arrival in pending/ is heard at once."""
    caplog.set_level(logging.INFO, logger="handoffd")
    libc = NoWatchesLeft(inotify._LIBC)
    monkeypatch.setattr(inotify, "_LIBC", libc)
    backend = FilesBackend.open(HandoffdWorkspace(tmp_path), durable=False)
    heard = Heard()
    unsubscribe = backend.subscribe(heard)
    try:
        said = warnings_of(caplog, "cannot watch")
        assert len(said) == 1, said
        assert str(tmp_path / "handoffs" / "pending") in said[0]
        assert "No space left on device" in said[0] and "seen at rescans" in said[0]
        watch = backend._watch
        assert watch is not None and not watch.alive()  # the sweep's repair runs

        backend.maintain(NOW)  # still refused: retried, not said again, the thread kept
        backend.maintain(NOW)
        assert len(warnings_of(caplog, "cannot watch")) == 1
        assert not warnings_of(caplog, "died")
        assert not watch.alive()

        libc.full = False  # watches available again
        backend.maintain(NOW)
        assert watch.alive()
        assert heard.wait(lambda w: w.kind == LOST)  # a rescan for what arrived meanwhile
        (tmp_path / "handoffs" / "pending" / "hoff-late.json").write_text("{}")
        assert heard.wait(lambda w: w.handoff_id == "hoff-late" and w.kind == "pending")
        assert not warnings_of(caplog, "died")
    finally:
        unsubscribe()
        backend.close()


def test_pending_replaced_by_another_folder_is_watched_again_at_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(B) a folder renamed over the watched pending/ (the old one is removed: IN_IGNORED):
    the reader watches the new one at once, says so once and asks for a rescan."""
    pending = tmp_path / "pending"
    pending.mkdir()
    events: list[tuple[str, str]] = []
    lost = threading.Event()
    heard = threading.Event()

    def on_event(kind: str, name: str, settled: bool) -> None:
        events.append((kind, name))
        if name == "hoff-new.json":
            heard.set()

    watch = inotify.FolderEvents({pending: "pending"}, on_event, lost.set)
    watch.start()
    try:
        fresh = tmp_path / "pending.new"
        fresh.mkdir()
        os.rename(fresh, pending)  # replaces the (empty) watched folder in one step
        assert lost.wait(2), "no rescan asked for after pending/ was replaced"
        assert watch.alive() and not watch.unwatched
        (pending / "hoff-new.json").write_text("{}")
        assert heard.wait(2), f"the new pending/ is not watched: {events}"
        said = warnings_of(caplog, "moved away or removed")
        assert len(said) == 1 and "watching the folder now at that path" in said[0], said
    finally:
        watch.stop()


def test_serve_picks_up_at_once_after_pending_is_renamed_away_and_recreated(
        ws: Workspace) -> None:
    """(B, a real daemon) pending/ renamed away, then a new one made: with the rescans an hour
    apart, a new handoff is still picked up promptly after at most one sweep (1 s here), and
    the daemon said what happened in one warning line."""
    ws.write_config(ws.root.joinpath("handoffd.toml").read_text()
                    .replace("rescan_seconds = 1.0", "rescan_seconds = 3600.0")
                    .replace("sweep_seconds = 0.5", "sweep_seconds = 1.0"))
    daemon = ws.serve()
    pending = ws.root / "handoffs" / "pending"
    os.rename(pending, ws.root / "handoffs" / "pending.old")
    time.sleep(0.3)  # the reader sees the folder gone before the new one exists
    pending.mkdir(exist_ok=True)  # (or the sweep made it again already)
    time.sleep(1.5)  # at most one sweep: it watches the new pending/
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    started = time.monotonic()  # (the create command's own start-up is not the daemon's)
    assert ws.wait_state(hid, timeout=60) == "completed"
    took = time.monotonic() - started
    # unwatched, it waits for the hourly rescan (bounds far apart: a loaded machine is slow)
    assert took < 30, f"picked up after {took:.2f}s: the new pending/ is not watched"
    assert ws.stop(daemon) == 0
    assert daemon.stderr is not None
    err = daemon.stderr.read()
    said = [line for line in err.splitlines() if "moved away or removed" in line]
    assert len(said) == 1 and "WARNING" in said[0], err
    assert "died" not in err, err
