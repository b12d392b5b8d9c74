"""Two things a new user hit (review R38, helper H4, session 24).

1. ``handoff wait`` (and the Python ``Client``'s wait) on a malformed document dropped into
   pending/ ended with a read error, ``handoff: error: in-progress/X.json is not valid JSON``
   (stdout empty, exit 1; the client raised UnreadableCopy), not with the failure stub the
   docs promise: the daemon claims the junk by renaming it into in-progress/, and only then
   sets it aside and files the stub, while the wait took an unreadable copy in in-progress/
   for final ("nothing ever moves it"). Now the wait goes on through such a copy for the claim
   grace plus a sweep period from when it first saw it (within its own timeout), and through
   the instant between the set-aside and the stub (the id found nowhere), and ends with the
   stub's failure (exit 1, ``MALFORMED_JSON``). Junk that nobody settles still ends the wait
   with its read error after that window, never past the wait's timeout.
2. ``handoffd serve`` reads handoffd.toml once, at its start, and nothing said so: a specialist
   added while it served was never served. Its sweep now logs one warning per change of the
   file ("handoffd.toml changed since this daemon started; restart it to apply the changes").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, wait_for_words

from handoffd import Client
from handoffd.backends import base
from handoffd.backends.base import STUB_FOLLOWS_SECONDS, UnreadableCopy, _Looks
from handoffd.core.errors import ErrorCode
from handoffd.core.states import State
from handoffd.service.sweeper import CONFIG_CHANGED, ConfigWatch

# a settle time the waits start within (the default is 0.5 s): the daemon claims the junk while
# the wait already looks, as it did for the user
CONFIG = """
[daemon]
settle_seconds = 1.0
sweep_seconds = 0.2
rescan_seconds = 0.5
durability = "fast"
"""
TRUNCATED = '{"handoff_id": "%s", "target": {"agent_id": "@x"}, "input": {"data": {}}'


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def serve(ws: Workspace, log: Path) -> subprocess.Popen[str]:
    """``handoffd serve`` with its stderr in ``log``, once it says it serves."""
    with open(log, "w") as sink:
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                                stdout=subprocess.DEVNULL, stderr=sink, text=True)
    ws.daemons.append(proc)
    said = wait_for_words(log, ["serving"])
    assert "serving" in said, said
    return proc


def drop_junk(ws: Workspace, hid: str) -> None:
    """A truncated document moved into pending/ whole, as the user did (write, then mv)."""
    tmp = ws.root / "handoffs" / ".tmp" / "x"
    tmp.write_text(TRUNCATED % hid)
    os.rename(tmp, ws.root / "handoffs" / "pending" / f"{hid}.json")


# ------------------------------------------------------------------ 1: the wait on dropped junk
def test_handoff_wait_on_junk_dropped_into_pending_ends_with_the_stub(ws: Workspace,
                                                                      tmp_path: Path) -> None:
    serve(ws, tmp_path / "serve.log")
    for n in range(4):  # (8 of 8 ended with the read error)
        hid = f"jk-{n}"
        drop_junk(ws, hid)
        wait = ws.handoff("wait", hid, "--timeout", "20", "--json", timeout=60)
        assert wait.returncode == 1, (hid, wait.returncode, wait.stderr)
        assert "error:" not in wait.stderr and "Traceback" not in wait.stderr, wait.stderr
        filed = json.loads(wait.stdout)
        assert filed["status"] == "failed", filed
        assert filed["error"]["code"] == ErrorCode.MALFORMED_JSON, filed
    hid = "jk-text"
    drop_junk(ws, hid)
    wait = ws.handoff("wait", hid, "--timeout", "20", timeout=60)
    assert wait.returncode == 1, (wait.returncode, wait.stderr)
    assert wait.stdout.strip() == f"{hid} failed", wait.stdout
    assert f"{hid}: MALFORMED_JSON" in wait.stderr and "error:" not in wait.stderr, wait.stderr


def test_client_wait_on_junk_dropped_into_pending_returns_the_stub(ws: Workspace,
                                                                   tmp_path: Path) -> None:
    serve(ws, tmp_path / "serve.log")
    client = Client(ws.root)
    for n in range(3):
        hid = f"jk-cl{n}"
        drop_junk(ws, hid)
        result = client.handle(hid).wait(timeout=20)  # (it raised UnreadableCopy)
        assert result.state is State.FAILED, result
        assert result.error is not None and result.error.code == ErrorCode.MALFORMED_JSON, result


def test_junk_nobody_settles_still_ends_with_its_read_error_within_the_timeout(
        ws: Workspace) -> None:
    (ws.root / "handoffs" / "in-progress" / "jk-old.json").write_text(TRUNCATED % "jk-old")
    started = time.monotonic()
    wait = ws.handoff("wait", "jk-old", "--timeout", "1", timeout=60)  # (no daemon runs)
    assert wait.returncode == 124, (wait.returncode, wait.stderr)  # its timeout, not for ever
    assert time.monotonic() - started < 30
    assert "Traceback" not in wait.stderr, wait.stderr


class _Junk:
    """A backend whose copy of the handoff is unreadable in ``state`` until ``gone``."""

    claim_grace_seconds = 1.0

    def __init__(self, state: State) -> None:
        self.state = state
        self.gone = False

    def get(self, handoff_id: str) -> tuple[State, dict[str, Any]] | None:
        if self.gone:
            return None
        raise UnreadableCopy(f"{self.state.value}/{handoff_id}.json is not valid JSON",
                             state=self.state, handoff_id=handoff_id,
                             code=ErrorCode.MALFORMED_JSON)


class _Seconds:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unreadable_in_progress_copy_is_waited_on_for_the_grace_and_a_sweep() -> None:
    store, clock = _Junk(State.IN_PROGRESS), _Seconds()
    look = _Looks(store, "jk", monotonic=clock)  # type: ignore[arg-type]
    window = 1.0 + base.DaemonSettings.sweep_seconds
    assert look.unsettled_seconds() == window
    assert look() == (State.IN_PROGRESS, {})
    clock.now += window - 0.01
    assert look() == (State.IN_PROGRESS, {})  # a claim of junk: its set-aside may still come
    clock.now += 0.01
    with pytest.raises(UnreadableCopy, match="in-progress/jk.json"):
        look()  # nobody settled it: its read error (it waited for ever)


def test_the_instant_between_the_set_aside_and_the_stub_is_no_not_found() -> None:
    store, clock = _Junk(State.IN_PROGRESS), _Seconds()
    look = _Looks(store, "jk", monotonic=clock)  # type: ignore[arg-type]
    assert look() == (State.IN_PROGRESS, {})
    store.gone = True  # moved to the quarantine; the stub is not filed yet
    assert look() == (State.PENDING, {})  # (it was "no handoff jk", exit 3)
    clock.now += STUB_FOLLOWS_SECONDS
    assert look() is None  # gone for good: not found


def test_junk_in_completed_or_failed_still_ends_the_wait_at_once() -> None:
    for state in (State.COMPLETED, State.FAILED):
        look = _Looks(_Junk(state), "jk", monotonic=_Seconds())  # type: ignore[arg-type]
        with pytest.raises(UnreadableCopy):
            look()


def test_client_look_at_junk_in_progress_stands_in_progress(ws: Workspace) -> None:
    (ws.root / "handoffs" / "in-progress" / "jk-look.json").write_text(TRUNCATED % "jk-look")
    seen = Client(ws.root).handle("jk-look").look()
    assert seen.state is State.IN_PROGRESS and seen.document == {}, seen


# ------------------------------------------------------------------ 2: handoffd.toml changed
def test_serve_says_once_that_handoffd_toml_changed(ws: Workspace, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc = serve(ws, log)
    time.sleep(0.6)  # (sweeps with nothing changed: nothing said)
    assert CONFIG_CHANGED not in log.read_text(), log.read_text()
    with open(ws.root / "handoffd.toml", "a") as config:
        config.write(f'\n[specialists."@new"]\ncommand = [{sys.executable!r}, "-c", "pass"]\n')
    said = wait_for_words(log, [CONFIG_CHANGED])
    assert CONFIG_CHANGED in said, said
    hid = ws.create("--to", "@new", "--data", "{}")
    wait_for_words(log, [f"{hid} waits in pending/"])
    time.sleep(0.6)  # several sweeps more: still one line for the one change
    assert log.read_text().count(CONFIG_CHANGED) == 1, log.read_text()
    with open(ws.root / "handoffd.toml", "a") as config:
        config.write("# another change\n")
    wait_until_count(log, CONFIG_CHANGED, 2)
    ws.stop(proc)
    assert log.read_text().count(CONFIG_CHANGED) == 2, log.read_text()
    assert "Traceback" not in log.read_text()


def wait_until_count(path: Path, words: str, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text().count(words) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_config_watch_one_line_a_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text("[daemon]\n")
    watch = ConfigWatch(path)
    assert not watch.check() and not watch.check()  # unchanged: nothing
    path.write_text("[daemon]\nworkers = 2\n")  # (another size)
    assert watch.check() and not watch.check()  # said once
    path.unlink()
    assert watch.check() and not watch.check()  # removed: a change too (defaults at a restart)
    assert [r.getMessage() for r in caplog.records].count(CONFIG_CHANGED) == 2
    assert ConfigWatch(tmp_path / "none.toml").check() is False  # none at the start, none now
