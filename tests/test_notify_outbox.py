"""Notifications survive ``kill -9``, through real daemons: a webhook that is down while results
are filed, the daemon killed, the webhook back, a new daemon started: every notice is delivered
(at least once), none lost, and the journal the dead daemon left is taken over by one daemon
only, even when two start at once. Also what a daemon holds in memory for notices waiting on a
webhook that is down: not their documents (in-process, a real engine and store).

Found by the review of the notifications (third session): the queue lived in memory only, so a
``kill -9`` dropped every notice it held, with no dead letter; and each notice held its whole
document."""
from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace, exe, wait_until, whole_json_lines

from handoffd import Daemon, Registry, build_engine, new_native_request
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.notify import Notifier
from handoffd.features.notify.leftovers import read_journal

N = 6  # results filed per daemon while the webhook is down


def free_port() -> int:
    """A port nothing listens on (yet): connections to it are refused until the server starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Hooks:
    """A webhook server on ``port``, started by hand: records the id of every delivery (and
    its document's revision), each answered once ``gate`` is open (it is, unless cleared)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ids: list[str] = []
        self.arrived: list[str] = []  # ids of the requests received, answered or not yet
        self.revisions: list[tuple[str, Any]] = []  # (id, handoffd.revision) of each delivery
        self.gate = threading.Event()
        self.gate.set()
        self.httpd: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        ids, arrived, revisions, gate = self.ids, self.arrived, self.revisions, self.gate

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                doc = json.loads(body)
                assert doc["handoff_id"] == self.headers["X-Handoffd-Id"]
                arrived.append(doc["handoff_id"])
                gate.wait(60)
                revisions.append((doc["handoff_id"], (doc.get("handoffd") or {}).get("revision")))
                ids.append(self.headers["X-Handoffd-Id"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    server = Hooks(free_port())
    try:
        yield server
    finally:
        server.close()


def config(port: int) -> str:
    # the first try is refused at once, the next waits a minute: notices wait in the queue
    return FLAKY_TOML + f"""
[[on_filed]]
url = "http://127.0.0.1:{port}/hook"
retries = 10
retry_delay_seconds = 60
timeout_seconds = 5
"""


def left_in_journals(root: Path) -> list[str]:
    """The ids of the notices every journal leaves undelivered (read without taking them)."""
    found = []
    for path in sorted((root / "handoffs" / ".meta" / "notify").glob("*.jsonl")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            found += [entry.handoff_id for entry in read_journal(fd, path.name)]
        finally:
            os.close(fd)
    return found


def start_daemons(ws: Workspace, count: int) -> list[subprocess.Popen[str]]:
    """``count`` daemons started at the same moment, each waited for until it serves."""
    procs = [subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    ws.daemons += procs
    for proc in procs:
        assert proc.stderr is not None
        seen = [proc.stderr.readline() for _ in range(1)]
        while "serving" not in seen[-1] and seen[-1] and len(seen) < 50:
            seen.append(proc.stderr.readline())
        assert "serving" in seen[-1], "".join(seen)
    return procs


def file_and_kill(ws: Workspace, daemons: int) -> list[str]:
    """``daemons`` daemons file N results each while the webhook is down, and are killed with
    SIGKILL with every notice still queued; the ids filed."""
    procs = start_daemons(ws, daemons)
    ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok", "n": n}))
           for n in range(N * daemons)]
    for handoff_id in ids:
        ws.wait_state(handoff_id, ("completed",))
    wait_until(lambda: sorted(left_in_journals(ws.root)) == sorted(ids), 30,
               "every notice in a journal")
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    return ids


def stop_all(ws: Workspace, procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(60)


@pytest.mark.heavy
@pytest.mark.parametrize("restarted", [1, 2])
def test_notices_queued_at_a_kill_9_are_delivered_by_the_next_daemon(
        ws: Workspace, hooks: Hooks, restarted: int) -> None:
    """Killed daemons' journals are taken over by the daemons started next, each by one of
    them only: with two at once, every notice is still delivered exactly once (nothing fails
    once the webhook is back), and nothing is dead-lettered."""
    ws.write_config(config(hooks.port))
    ids = file_and_kill(ws, daemons=restarted)
    assert hooks.ids == []
    journal_folder = ws.root / "handoffs" / ".meta" / "notify"
    dead = {path.name for path in journal_folder.glob("*.jsonl")}
    # one per killed daemon that filed something, left behind (which daemon claims each
    # handoff is a race: with two, one of them may have filed them all)
    assert 1 <= len(dead) <= restarted
    hooks.start()
    procs = start_daemons(ws, restarted)
    try:
        wait_until(lambda: set(hooks.ids) == set(ids), 60, "every notice delivered")
        # each daemon marks a notice done after delivering it: once no journal holds any, a
        # second delivery of one would have been made already
        wait_until(lambda: left_in_journals(ws.root) == [], 30, "the journals settled")
        assert not dead & {path.name for path in journal_folder.glob("*.jsonl")}
    finally:
        stop_all(ws, procs)
    assert Counter(hooks.ids) == Counter({handoff_id: 1 for handoff_id in ids})
    assert not (ws.root / "handoffs" / ".meta" / "notify-dead-letters.jsonl").exists()
    assert list(journal_folder.glob("*.jsonl")) == []  # each daemon removed its own at its stop
    for proc in procs:
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()


def test_a_sweep_delivers_what_a_killed_daemon_left(ws: Workspace, hooks: Hooks) -> None:
    """Without a daemon: `handoffd sweep` takes the journal over and delivers before it exits."""
    ws.write_config(config(hooks.port))
    ids = file_and_kill(ws, daemons=1)
    hooks.start()
    swept = ws.handoffd("sweep", timeout=60)
    assert swept.returncode == 0, swept.stderr
    assert sorted(hooks.ids) == sorted(ids)
    assert list((ws.root / "handoffs" / ".meta" / "notify").glob("*.jsonl")) == []


def big_result(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"blob": "x" * 600_000}}


def test_a_daemon_waiting_on_a_webhook_holds_no_documents(tmp_path: Path) -> None:
    """A real engine and store: 60 results of 600 KB each (36 MB) filed while the webhook is
    down are queued as notices of a few hundred bytes; only the one being tried holds its
    document."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "handoffd.toml").write_text(
        '[daemon]\ndurability = "fast"\n\n[[on_filed]]\n'
        f'url = "http://127.0.0.1:{free_port()}/hook"\nretries = 10\nretry_delay_seconds = 60\n')
    ws = HandoffdWorkspace(root)
    ws.ensure()
    config = ws.load_config()
    registry = Registry()
    registry.add_function("@big", big_result, config=config)
    engine = build_engine(ws, config, registry, features=())
    notifier = Notifier(engine)  # (no stop hook: the queue is looked at after the batch)
    engine.on_filed.append(notifier.filed)
    for n in range(60):
        handoff_id = f"big-{n}"
        doc = new_native_request(source="@test", target="@big", data={}, now=engine.clock(),
                                 handoff_id=handoff_id)
        engine.backend.store.create(doc, handoff_id, now=engine.clock())
    report = Daemon(engine, workers=4, watch=False).run_batch()
    assert report.completed == 60, report.line()
    wait_until(lambda: notifier.flights and notifier.flights[0].body, 10, "the first try")
    held = notifier.held_bytes()
    one = len(notifier.flights[0].body)
    assert one > 600_000 and len(notifier.pending) == 59
    assert held < one + 60 * 2000, f"{held} bytes held for 60 notices"  # (was 60 documents)
    assert notifier.drain(timeout=0.1) is False  # the webhook is down: dead-lettered, none lost
    letters = (root / "handoffs" / ".meta" / "notify-dead-letters.jsonl").read_text().splitlines()
    assert len(letters) == 60


def dead_letters(root: Path) -> list[dict[str, Any]]:
    path = root / "handoffs" / ".meta" / "notify-dead-letters.jsonl"
    return whole_json_lines(path)


def held_hook(port: int) -> str:
    """A webhook tried once, with time to wait for the test's gate."""
    return FLAKY_TOML + f"""
[[on_filed]]
url = "http://127.0.0.1:{port}/hook"
retries = 0
timeout_seconds = 60
"""


def test_a_notice_delivers_its_own_filing_not_a_later_one(ws: Workspace, hooks: Hooks) -> None:
    """Found by the review of the outbox (fourth session): a handoff that failed, was retried
    with `handoff retry --force` and failed again before its first notice was delivered (the
    webhook busy): both notices delivered the second failure, the first never arrived. Now the
    first notice, whose filing is gone with no archived copy, is dead-lettered as superseded,
    and the second delivers its own filing once."""
    ws.write_config(held_hook(hooks.port))
    hooks.gate.clear()
    hooks.start()
    daemon = ws.serve()
    busy = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    wait_until(lambda: hooks.arrived == [busy], 30, "the first notice held at the webhook")
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "permanent"}')
    ws.wait_state(hid, ("failed",))
    first = ws.doc(hid)["handoffd"]["revision"]
    ws.handoff("retry", hid, "--force", check=True)
    wait_until(lambda: ws.state_of(hid) == ["failed"]
               and ws.doc(hid)["handoffd"]["revision"] > first, 30, "the second failure")
    second = ws.doc(hid)["handoffd"]["revision"]
    hooks.gate.set()
    wait_until(lambda: len(hooks.ids) + len(dead_letters(ws.root)) >= 3, 30, "all settled")
    assert ws.stop(daemon) == 0
    assert sorted(hooks.ids) == sorted([busy, hid])
    assert [rev for rev in hooks.revisions if rev[0] == hid] == [(hid, second)], hooks.revisions
    (letter,) = dead_letters(ws.root)
    assert letter["id"] == hid and "superseded" in letter["error"] \
        and f"this notice is about revision {first}" in letter["error"], letter


FORKING_CLIENT = """
import os, sys, time
from handoffd import Client
client = Client(sys.argv[1])
ids = [client.create(to="@flaky", data={"mode": "ok"}).id for _ in range(2)]
for handoff_id in ids:
    client.cancel(handoff_id)  # filed by this process: two notices, the first held at the hook
print(" ".join(ids), flush=True)
sys.stdin.readline()  # the test saw the first notice arrive
if os.fork() == 0:
    sys.exit(0)  # the child ends normally: its atexit handlers run
os.wait()
print("forked child done", flush=True)
sys.stdin.readline()  # the test opened the gate: this process drains at its exit
"""


def test_a_forked_child_of_a_client_program_leaves_its_notices_alone(
        ws: Workspace, hooks: Hooks) -> None:
    """Found by the review of the outbox (fourth session): a program that filed through the
    client (cancelling handoffs) then forked: the child's inherited atexit drain delivered the
    parent's queued notice again, dead-lettered the one in flight and held the child's exit for
    its 10 s. Now the child leaves them to the parent: each is delivered once, none is
    dead-lettered."""
    ws.write_config(held_hook(hooks.port))
    hooks.gate.clear()
    hooks.start()
    program = subprocess.Popen([sys.executable, "-c", FORKING_CLIENT, str(ws.root)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert program.stdin is not None and program.stdout is not None
        ids = program.stdout.readline().split()
        assert len(ids) == 2, program.stderr.read() if program.stderr else ""
        wait_until(lambda: hooks.arrived == ids[:1], 30, "the first notice held at the webhook")
        program.stdin.write("\n")
        program.stdin.flush()
        assert program.stdout.readline().strip() == "forked child done"
        assert dead_letters(ws.root) == [] and hooks.arrived == ids[:1]
        hooks.gate.set()
        program.stdin.write("\n")
        program.stdin.flush()
        assert program.wait(60) == 0
    finally:
        if program.poll() is None:
            program.kill()
            program.wait(10)
    assert sorted(hooks.ids) == sorted(ids)  # each once
    assert dead_letters(ws.root) == []
