"""The seen-ids record's look-ups never wait behind its lock (session 28).

An add waits (bounded) for the record's flock, which another process may hold (a stopped one's
compaction). It used to wait holding the record's mutex, so every look-up of the process (the
claim path's `contains`) waited as long, and the adds of several threads each waited their
whole bound one after another."""
from __future__ import annotations

import fcntl
import os
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from handoffd.backends.files import logfiles
from handoffd.backends.files.seen import SeenIds

NOW = datetime(2026, 11, 28, 12, tzinfo=timezone.utc)
WAIT = 30.0  # the add's bound here: far longer than the test runs, unless something is wrong


def _held_by_another(seen: SeenIds) -> int:
    """The record's lock taken on a description of its own, as another process holds it."""
    fd = os.open(seen.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_look_up_is_answered_while_an_add_waits_for_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logfiles, "LOCK_WAIT_SECONDS", WAIT)
    seen = SeenIds(tmp_path / "seen-ids.jsonl", 3600)
    seen.add("first", NOW)
    assert seen.contains("first", NOW)
    other = _held_by_another(seen)
    waiting = threading.Event()
    real = logfiles.flock_within

    def flock_within(fd: int, seconds: float, **kw: object) -> bool:
        waiting.set()  # the add is at the lock now
        return real(fd, seconds)

    monkeypatch.setattr(logfiles, "flock_within", flock_within)
    errors: list[BaseException] = []

    def add() -> None:
        try:
            seen.add("second", NOW)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    adder = threading.Thread(target=add, daemon=True)
    adder.start()
    try:
        assert waiting.wait(WAIT)
        # answered while the add still waits (before: blocked until the add's bound ran out)
        assert seen.contains("first", NOW)
        assert not seen.contains("second", NOW)
        assert adder.is_alive(), "the look-up waited for the add to give up"
    finally:
        os.close(other)  # the other holder lets go: the add goes through
    adder.join(WAIT)
    assert not adder.is_alive() and not errors
    assert seen.contains("second", NOW)


def test_adds_queued_behind_a_held_lock_share_one_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second thread's add waits for its turn within the same bound (its turn is counted):
    it gives up without ever reaching the flock while the first holds the turn."""
    monkeypatch.setattr(logfiles, "LOCK_WAIT_SECONDS", 0.3)
    seen = SeenIds(tmp_path / "seen-ids.jsonl", 3600)
    other = _held_by_another(seen)
    calls: list[float] = []
    real = logfiles.flock_within

    def flock_within(fd: int, seconds: float, **kw: object) -> bool:
        calls.append(seconds)
        return real(fd, seconds)

    monkeypatch.setattr(logfiles, "flock_within", flock_within)
    failed: list[str] = []

    def add(name: str) -> None:
        try:
            seen.add(name, NOW)
        except logfiles.LockHeld:
            failed.append(name)

    threads = [threading.Thread(target=add, args=(f"id-{n}",), daemon=True) for n in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
    finally:
        os.close(other)
    assert sorted(failed) == ["id-0", "id-1"]
    # each flock wait is what is left of its add's bound, never a fresh whole bound: the
    # second add gave up at its turn, or came to the flock with less than the bound left
    # (before: each waited the mutex, then a whole 0.3 s at the flock)
    assert calls and all(seconds <= 0.3 for seconds in calls)
    assert len(calls) == 1 or min(calls) < 0.3, calls
