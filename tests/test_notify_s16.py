"""Notifications, found by the review of session 16 (through real `handoffd serve`, `run` and
`sweep` where it shows, in-process where a property needs holding still):

1. planted outbox journals (hundreds of thousands of valid lines for ids that do not exist,
   with the real rule's fingerprint) stalled the serving daemon for minutes: the takeover ran
   on the main loop's sweep, took every notice at once and dead-lettered the overflow one by
   one (a warning, an open and an append each). Now it runs on the notifier's own thread,
   takes TAKE_PER_SWEEP notices a sweep (the rest kept for the next sweeps), and a batch of
   dead letters is one append and one log line;
2. one hanging webhook held every other rule's notices (one delivery thread, one queue): a
   healthy command ran 47 s after its handoff was filed, and `handoffd run` dead-lettered it
   never tried. Now each rule has a lane of its own;
3. a notification command's background child (`sleep 345 &`) outlived the daemon. Now what a
   command leaves in its process group is killed once it exits.
"""
from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace, alive, wait_until, whole_json_lines

from handoffd.core.config import NotifyRule
from handoffd.core.states import State
from handoffd.features.notify import Notifier, delivery, install, leftovers, notices
from handoffd.features.notify import notifier as notifier_module
from handoffd.features.notify.leftovers import read_journal, read_left
from handoffd.features.notify.notices import fingerprint
from handoffd.features.notify.outbox import Entry

RECORD = [sys.executable, "-c", "import os, sys; sys.stdin.read(); open(os.path.join("
          "os.environ['HANDOFFD_ROOT'], 'got.txt'), 'a').write(os.environ['HANDOFF_ID'] + "
          "'\\n')"]
TAKEN = 1000  # notices one sweep takes over (notifier.TAKE_PER_SWEEP)
FAST = FLAKY_TOML.replace("[retry]", 'durability = "fast"\n\n[retry]')


def dead_letters(root: Path) -> list[dict[str, Any]]:
    """The dead letters written so far: whole lines only (a serving daemon may be appending one
    as it is read; a torn last line failed a fresh clone's run with a JSONDecodeError)."""
    return whole_json_lines(root / "handoffs" / ".meta" / "notify-dead-letters.jsonl")


def got(root: Path) -> list[str]:
    path = root / "got.txt"
    return path.read_text().split() if path.exists() else []


def plant(folder: Path, rule: NotifyRule, count: int, name: str) -> Path:
    """A journal as a dead process would leave it: ``count`` valid notices for ghost ids (no
    such handoff) with ``rule``'s real fingerprint."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    kinds = ("command",) if rule.command else ("webhook",)
    path.write_bytes(b"".join(
        Entry(f"ghost-{name[:4]}-{n}", State.COMPLETED, fingerprint(rule), 0, kinds,
              "2026-11-24T12:00:00+00:00").line(n + 1) for n in range(count)))
    return path


def left_in(folder: Path, prefix: str) -> list[str]:
    """The ids the journals named ``prefix*`` leave undelivered (read without taking them)."""
    found: list[str] = []
    for path in sorted(folder.glob(f"{prefix}*.jsonl")):
        fd = os.open(path, os.O_RDONLY)
        try:
            match = leftovers.JOURNAL.fullmatch(path.name)
            if match and match.group(1):
                os.lseek(fd, int(match.group(1)), os.SEEK_SET)
            found += [entry.handoff_id for entry in read_journal(fd, path.name)]
        finally:
            os.close(fd)
    return found


# ---------------------------------------------------------------- 1. planted journals

def test_a_sweep_takes_a_bounded_number_of_planted_notices(ws: Workspace) -> None:
    """`handoffd sweep` with a planted journal of 2,500 ghost notices: it took all of them at
    once (2,500 dead letters from one sweep). Now one sweep takes TAKE_PER_SWEEP (1,000): they
    are dead-lettered (their handoffs do not exist), the other 1,500 stay in the journal,
    renamed to say where they start, for the next sweeps; none lost."""
    ws.write_config(FAST + f"[[on_filed]]\ncommand = {json.dumps(RECORD)}\n")
    folder = ws.root / "handoffs" / ".meta" / "notify"
    plant(folder, NotifyRule(command=RECORD), 2500, "4242-00000000000000aa")
    swept = ws.handoffd("sweep", timeout=120)
    assert swept.returncode == 0, swept.stderr
    assert "Traceback" not in swept.stderr
    letters = dead_letters(ws.root)
    assert len(letters) == TAKEN, swept.stderr[-2000:]
    assert all("filed document is gone" in letter["error"] for letter in letters)
    rest = left_in(folder, "4242-")
    assert len(rest) == 2500 - TAKEN
    assert not {letter["id"] for letter in letters} & set(rest)  # each taken once, none lost
    assert "the rest is kept" in swept.stderr
    assert got(ws.root) == []


def test_a_serving_daemon_works_through_planted_journals_in_parts(ws: Workspace) -> None:
    """A serving daemon with two planted journals (2,500 ghost notices each): new work is
    filed and notified meanwhile, each sweep takes a part of the plant, and every ghost notice
    ends dead-lettered exactly once; no traceback."""
    ws.write_config(FAST + f"[[on_filed]]\ncommand = {json.dumps(RECORD)}\n")
    folder = ws.root / "handoffs" / ".meta" / "notify"
    for name in ("4242-00000000000000aa", "4243-00000000000000bb"):
        plant(folder, NotifyRule(command=RECORD), 2500, name)
    proc = ws.serve()
    said: list[str] = []  # (read all along: a full pipe would hold the daemon's logging)
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: said.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        real = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
        ws.wait_state(real, ("completed",), timeout=60)
        wait_until(lambda: real in got(ws.root), 60, "the real handoff notified")
        wait_until(lambda: len(dead_letters(ws.root)) == 5000, 120, "the plant dead-lettered")
        assert left_in(folder, "424") == []
    finally:
        ws.stop(proc)
        reader.join(30)
    ids = [letter["id"] for letter in dead_letters(ws.root)]
    assert len(set(ids)) == 5000 and all(i.startswith("ghost-") for i in ids)
    log = "".join(said)
    assert "Traceback" not in log
    assert "holds more notices than one sweep takes" in log


class StandIn(SimpleNamespace):
    """A stand-in engine: every handoff reads back as filed (completed)."""

    def get(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        return State.COMPLETED, {"handoff_id": handoff_id}

    def filed_document(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        return self.get(handoff_id)


def stand_in(root: Path, *rules: NotifyRule) -> StandIn:
    return StandIn(config=SimpleNamespace(on_filed=list(rules)), on_filed=[], on_sweep=[],
                   daemon_plugins=[], settings=SimpleNamespace(durable=False),
                   ws=SimpleNamespace(root=root, meta=root / "meta", handoffs=root / "handoffs"))


def notifier_for(root: Path, *rules: NotifyRule) -> Notifier:
    return Notifier(stand_in(root, *rules))  # type: ignore[arg-type]


def test_the_sweep_never_waits_for_the_takeover(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's repair (a daemon's main loop) only starts the takeover, on the notifier's
    own thread: a takeover that takes its time (here: held until released) no longer holds
    the sweep; a drain waits for it, and another sweep meanwhile starts no second one."""
    rule = NotifyRule(command=RECORD, retries=0)
    plant(tmp_path / "meta" / "notify", rule, 3, "4242-00000000000000aa")
    engine = stand_in(tmp_path, rule)
    install(engine)  # type: ignore[arg-type]
    (repair,) = engine.on_sweep  # what each sweep runs
    notifier = engine.on_filed[0].__self__
    release, entered = threading.Event(), threading.Event()
    real_take_over = leftovers.take_over
    rounds: list[str] = []

    def slow(*args: Any, **kwargs: Any) -> int:
        rounds.append(threading.current_thread().name)
        entered.set()
        release.wait(30)
        return real_take_over(*args, **kwargs)

    monkeypatch.setattr(leftovers, "take_over", slow)
    swept = threading.Event()

    def sweeps() -> None:  # (two in a row: the second finds the first takeover under way)
        repair(engine)
        repair(engine)
        swept.set()

    threading.Thread(target=sweeps, daemon=True).start()
    try:
        assert swept.wait(10), "the sweep waited for the takeover"
        assert entered.wait(10)
    finally:
        release.set()
    assert notifier.drain(timeout=20) is True
    assert rounds == ["handoffd-notify-takeover"]
    assert sorted(got(tmp_path)) == ["ghost-4242-0", "ghost-4242-1", "ghost-4242-2"]


def test_overflow_dead_letters_are_one_append_and_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Notices taken over past QUEUE_LIMIT were dead-lettered one by one: a warning, an open
    and an append each (800,000 of them stalled a daemon). Now in one append, said in one
    line; each is still recorded, none lost."""
    monkeypatch.setattr(notifier_module, "QUEUE_LIMIT", 5)
    rule = NotifyRule(command=RECORD, retries=0)
    plant(tmp_path / "meta" / "notify", rule, 40, "4242-00000000000000aa")
    opened: list[str] = []
    real_open = notices.open_regular

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(notices, "open_regular", counting)
    caplog.set_level(logging.WARNING, logger="handoffd")
    notifier = notifier_for(tmp_path, rule)
    with notifier.lock:  # (nothing delivered yet: the queue's room is QUEUE_LIMIT)
        assert notifier.take_over() == 40
    full = [line for line in (tmp_path / "meta" / "notify-dead-letters.jsonl").read_text()
            .splitlines() if "the notification queue is full" in line]
    assert len(full) == 35 and len(opened) == 1
    said = [r.getMessage() for r in caplog.records if "queue is full" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("35 notification(s) given up"), said
    assert notifier.drain(timeout=20) is True
    assert len(got(tmp_path)) == 5


def test_a_part_taken_never_takes_again_what_was_delivered(tmp_path: Path) -> None:
    """A journal read in parts (a limit on the notices taken): those taken are its first
    notices undelivered once every line read is counted (a target marked finished after the
    cut is not delivered again), and the rest starts at the first undelivered one not taken."""
    rule = NotifyRule(command=RECORD)
    entries = [Entry(f"n{n}", State.COMPLETED, fingerprint(rule), 0, ("command",), "t")
               for n in range(1, 6)]
    path = tmp_path / "4242-00000000000000aa.jsonl"
    path.write_bytes(b"".join(e.line(n) for n, e in enumerate(entries, 1))
                     + b'{"done":1,"kind":"command"}\n{"done":4,"kind":"command"}\n')
    fd = os.open(path, os.O_RDONLY)
    try:
        first, rest_at, counted = read_left(fd, path.name, 2)
        assert [e.handoff_id for e in first] == ["n2", "n3"] and counted and rest_at
        os.lseek(fd, rest_at, os.SEEK_SET)
        second, end, _ = read_left(fd, path.name, 2)
    finally:
        os.close(fd)
    assert [e.handoff_id for e in second] == ["n5"] and end is None


def test_no_journal_handoffd_writes_reaches_the_reading_bound() -> None:
    """Reading a journal stops once LIVE_MAX more notices are undelivered than a sweep takes:
    a journal handoffd writes never holds that many (QUEUE_LIMIT queued, one in flight per
    delivery thread), so it is never cut there."""
    assert notifier_module.QUEUE_LIMIT + delivery.WORKERS < leftovers.LIVE_MAX
    assert notifier_module.TAKE_PER_SWEEP == TAKEN


# ---------------------------------------------------------------- 2. a hanging webhook

class Hanging(http.server.BaseHTTPRequestHandler):
    """Reads the request, never answers (until the test ends)."""

    gate = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.gate.wait(120)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hanging() -> Iterator[str]:
    gate = threading.Event()
    handler = type("Hang", (Hanging,), {"gate": gate})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/hook"
    finally:
        gate.set()
        httpd.shutdown()
        httpd.server_close()


def two_rules(url: str) -> str:
    return FAST + f"""
[[on_filed]]
url = "{url}"

[[on_filed]]
command = {json.dumps(RECORD)}
"""


def test_a_hanging_webhook_does_not_hold_another_rules_command_in_a_run(
        ws: Workspace, hanging: str) -> None:
    """Rule 1 a webhook that never answers (default timeout and retries), rule 2 a command:
    `handoffd run` of three handoffs dead-lettered all three commands never tried (its drain's
    time ran out behind the webhook). Now the commands are delivered; only the webhook's
    notices are dead-lettered."""
    ws.write_config(two_rules(hanging))
    ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok", "n": n}))
           for n in range(3)]
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(got(ws.root)) == sorted(ids), proc.stderr[-2000:]
    letters = dead_letters(ws.root)
    assert letters and all(letter["url"] == hanging for letter in letters), letters
    assert sorted({letter["id"] for letter in letters}) == sorted(ids)  # none lost


def test_a_hanging_webhook_does_not_delay_another_rules_command_when_serving(
        ws: Workspace, hanging: str) -> None:
    """The same under `serve`: the command ran 47 s after filing (behind the webhook's
    timeouts and backoffs); now it runs while the webhook still hangs."""
    ws.write_config(two_rules(hanging))
    proc = ws.serve()
    try:
        ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok", "n": n}))
               for n in range(2)]
        for handoff_id in ids:
            ws.wait_state(handoff_id, ("completed",), timeout=60)
        wait_until(lambda: sorted(got(ws.root)) == sorted(ids), 20,
                   "the commands delivered while the webhook hangs")
        assert dead_letters(ws.root) == []  # (the webhook is still being tried)
    finally:
        ws.stop(proc)


# ---------------------------------------------------------------- 3. a command's children

BACKGROUND = ["sh", "-c", 'cat >/dev/null; sleep 345 & echo $! > "$HANDOFFD_ROOT/bg.pid"; exit 0']


def background_pid(root: Path) -> int:
    wait_until(lambda: (root / "bg.pid").exists() and (root / "bg.pid").read_text().strip(),
               30, "the command's background child started")
    return int((root / "bg.pid").read_text())


def kill_if_alive(pid: int) -> None:
    if alive(pid):
        os.kill(pid, signal.SIGKILL)  # (the child this test's command started)


def test_a_commands_background_child_dies_with_it_after_a_run(ws: Workspace) -> None:
    """A command that leaves `sleep 345 &` in its process group and exits 0: the sleep
    outlived `handoffd run`. Now it is killed once the command exits; the delivery counts."""
    ws.write_config(FAST + f"[[on_filed]]\ncommand = {json.dumps(BACKGROUND)}\n")
    ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    proc = ws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    pid = background_pid(ws.root)
    try:
        wait_until(lambda: not alive(pid), 10, "the background child killed")
    finally:
        kill_if_alive(pid)
    assert dead_letters(ws.root) == []


def test_a_commands_background_child_dies_with_it_while_serving(ws: Workspace) -> None:
    """Under `serve`, the child is killed when the command exits, not left to the daemon's
    end (nor past it)."""
    ws.write_config(FAST + f"[[on_filed]]\ncommand = {json.dumps(BACKGROUND)}\n")
    proc = ws.serve()
    pid = 0
    try:
        ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
        pid = background_pid(ws.root)
        wait_until(lambda: not alive(pid), 10, "the background child killed")
        assert proc.poll() is None
    finally:
        ws.stop(proc)
        if pid:
            kill_if_alive(pid)
    assert dead_letters(ws.root) == []
