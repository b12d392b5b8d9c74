"""The event stream and its views, driven as an operator would: the event log itself (one line per
transition, rotation, concurrent writers, torn lines), `handoff stats`, Prometheus metrics (a
real HTTP scrape of `handoffd serve --metrics`, the textfile), `handoff ls --watch` and
`handoff top` in a pseudo-terminal whose screen is read back."""
from __future__ import annotations

import json
import os
import pty
import queue
import re
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from conftest import Workspace, exe, interrupted, wait_until
from prometheus_client.parser import text_string_to_metric_families

from handoffd.backends.files.events import FileEventLog
from handoffd.core.events import START
from handoffd.core.workspace import Workspace as HandoffdWorkspace


def events_of(ws: Workspace) -> list[dict]:
    return list(FileEventLog(HandoffdWorkspace(ws.root)).read())


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_each_transition_is_logged_once(ws: Workspace) -> None:
    ok = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    bad = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    retried = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "fail_then_ok"}))
    for _ in range(3):  # the retry is due 0.2 s later
        ws.handoffd("run")
        if ws.state_of(retried) == ["completed"]:
            break
        time.sleep(0.3)
    names = [(e["id"], e["event"]) for e in events_of(ws)]
    assert [n for i, n in names if i == ok] == ["created", "claimed", "completed"]
    assert [n for i, n in names if i == bad] == ["created", "claimed", "failed"]
    assert [n for i, n in names if i == retried] == ["created", "claimed", "retry_scheduled",
                                                      "claimed", "completed"]
    events = events_of(ws)
    failed = next(e for e in events if e["id"] == bad and e["event"] == "failed")
    assert (failed["state"], failed["code"], failed["agent"]) == ("failed", "PROCESSING_ERROR",
                                                                  "@flaky")
    claimed = next(e for e in events if e["id"] == ok and e["event"] == "claimed")
    assert claimed["attempt"] == 1 and claimed["wait"] >= 0
    done = next(e for e in events if e["id"] == ok and e["event"] == "completed")
    assert done["seconds"] > 0


def test_event_log_rotates_and_is_followed_across_rotations(tmp_path: Path) -> None:
    ws = HandoffdWorkspace(tmp_path)
    log = FileEventLog(ws, max_bytes=4096, keep=2)
    _, cursor = log.tail(None)
    for i in range(200):
        log.append({"at": "2026-01-01T00:00:00Z", "event": "created", "id": f"h{i}", "pad": "x" * 40})
    assert log.rotated(1).exists() and log.rotated(2).exists() and not log.rotated(3).exists()
    assert all(p.stat().st_size <= 4096 + 200 for p in log.files())
    kept = [e["id"] for e in log.read()]
    assert kept == [f"h{i}" for i in range(200 - len(kept), 200)]  # the newest, in order
    log2 = FileEventLog(ws, max_bytes=4096, keep=2)
    assert [e["id"] for e in log2.tail(START)[0]] == kept
    # a follower that read up to a point sees everything after it, though the file rotated
    _, cursor = log.tail(None)
    for i in range(200, 260):
        log.append({"event": "created", "id": f"h{i}", "pad": "x" * 40})
    fresh, cursor = log.tail(cursor)
    assert [e["id"] for e in fresh] == [f"h{i}" for i in range(200, 260)]
    with open(log.path, "ab") as fh:  # a torn line (a crash mid-write) is skipped, not fatal
        fh.write(b'{"event": "crea')
    assert log.tail(cursor)[0] == []
    assert list(log.read())[-1]["id"] == "h259"


def test_concurrent_writers_never_interleave(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path\n"
            "from handoffd.backends.files.events import FileEventLog\n"
            "from handoffd.core.workspace import Workspace\n"
            "log = FileEventLog(Workspace(Path(sys.argv[1])), max_bytes=20000, keep=50)\n"
            "for i in range(300): log.append({'id': sys.argv[2] + str(i), 'pad': 'y' * 300})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"w{n}-"])
             for n in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 4
    log = FileEventLog(HandoffdWorkspace(tmp_path), max_bytes=20000, keep=50)
    ids = [e["id"] for e in log.read()]
    assert sorted(ids) == sorted(f"w{n}-{i}" for n in range(4) for i in range(300))
    for path in log.files():  # every line whole
        for line in path.read_bytes().splitlines():
            json.loads(line)


def test_stats_per_specialist(ws: Workspace) -> None:
    for mode in ("ok", "ok", "permanent"):
        ws.create("--to", "@flaky", "--data", json.dumps({"mode": mode}))
    ws.create("--to", "@nobody")
    ws.handoffd("run")
    report = json.loads(ws.handoff("stats", "--json", "--since", "1h", check=True).stdout)
    by_agent = {a["agent"]: a for a in report["agents"]}
    flaky = by_agent["@flaky"]
    assert (flaky["created"], flaky["started"], flaky["completed"], flaky["failed"]) == (3, 3, 2, 1)
    assert flaky["errors"] == {"PROCESSING_ERROR": 1} and flaky["pending"] == 0
    assert flaky["run_p50"] > 0 and flaky["run_p95"] >= flaky["run_p50"]
    assert flaky["wait_p95"] >= flaky["wait_p50"] >= 0 and flaky["per_minute"] > 0
    assert by_agent["@nobody"]["pending"] == 1 and by_agent["@nobody"]["started"] == 0
    table = ws.handoff("stats", check=True).stdout
    assert "@flaky" in table and "PROCESSING_ERROR×1" in table
    bad = ws.handoff("stats", "--since", "yesterday")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--since" in bad.stderr


def test_metrics_endpoint_and_textfile(ws: Workspace, tmp_path: Path) -> None:
    textfile = tmp_path / "handoffd.prom"
    daemon = ws.serve("--metrics", "127.0.0.1:0", "--metrics-textfile", str(textfile))
    try:
        url = re.search(r"metrics on (http://\S+/metrics)", daemon.ready_line).group(1)  # type: ignore[attr-defined]
        hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
        ok = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
        ws.wait_state(hid)
        ws.wait_state(ok)
        labels = (("agent", "@flaky"), ("event", "completed"))
        scraped: dict[tuple[str, tuple], float] = {}

        def counted() -> bool:  # the file appears a moment before the filing is counted
            with urllib.request.urlopen(url, timeout=10) as response:
                scraped.update(samples(response.read().decode()))
            return ("handoffd_run_seconds_count", (("agent", "@flaky"),)) in scraped and \
                scraped[("handoffd_run_seconds_count", (("agent", "@flaky"),))] == 2 and \
                ("handoffd_transitions_total", labels) in scraped
        wait_until(counted, timeout=10, what="both filings counted")
        assert scraped[("handoffd_transitions_total", labels)] == 1
        assert scraped[("handoffd_failures_total", (("agent", "@flaky"),
                                                    ("code", "PROCESSING_ERROR")))] == 1
        assert scraped[("handoffd_run_seconds_count", (("agent", "@flaky"),))] == 2
        assert scraped[("handoffd_handoffs", (("state", "completed"),))] == 1
        ws.create("--to", "@nobody")  # counted by the next scrape, from another process
        with urllib.request.urlopen(url, timeout=10) as response:
            again = samples(response.read().decode())
        assert again[("handoffd_queue_depth", (("agent", "@nobody"), ("state", "pending")))] == 1
    finally:
        assert ws.stop(daemon) == 0
    assert "handoffd_transitions_total" in textfile.read_text()  # written at least on stop
    once = ws.handoffd("metrics")
    assert once.returncode == 0 and samples(once.stdout)[("handoffd_handoffs", (("state", "failed"),))] == 1


def test_ls_watch_prints_transitions_live(ws: Workspace) -> None:
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--json", "--root", str(ws.root)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    daemon = None
    try:
        seen: list[dict] = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in watcher.stdout], daemon=True).start()

        def until(hid: str, event: str, timeout: float = 30) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not any(
                    (e["id"], e["event"]) == (hid, event) for e in seen):
                try:
                    seen.append(json.loads(lines.get(timeout=0.5)))
                except queue.Empty:
                    pass
        # it prints what happens from the moment it starts: a first handoff shows it is following
        for _ in range(20):
            until(ws.create("--to", "@flaky"), "created", timeout=1.0)
            if seen:
                break
        hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
        daemon = ws.serve()
        until(hid, "completed")
        assert [e["event"] for e in seen if e["id"] == hid] == ["created", "claimed", "completed"]
        assert all(e["agent"] == "@flaky" for e in seen)
    finally:
        if daemon is not None:
            ws.stop(daemon)
        assert interrupted(watcher) == 0


def drain(fd: int) -> None:
    ready, _, _ = select.select([fd], [], [], 0.1)
    if ready:
        try:
            os.read(fd, 65536)
        except OSError:
            pass


def read_screen(fd: int, until: list[str], timeout: float = 20) -> str:
    """Read a pseudo-terminal until every text of ``until`` is on it (escape codes stripped)."""
    raw = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                raw += os.read(fd, 65536)
            except OSError:
                break
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r", "", raw.decode(errors="replace"))
        if all(u in text for u in until):
            return text
    raise AssertionError(f"{until} not all on the screen: {text[-2000:]!r}")


def test_top_in_a_terminal(ws: Workspace) -> None:
    bad = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    ws.handoffd("run")
    main, secondary = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"}
    proc = subprocess.Popen([exe("handoff"), "top", "--refresh", "0.5", "--root", str(ws.root)],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env,
                            start_new_session=True)
    os.close(secondary)
    try:
        screen = read_screen(main, ["handoffd top", "recent failures", bad, "PROCESSING_ERROR"])
        assert "queue" in screen and "running" in screen
        sleeper = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "sleep", "seconds": 2}))
        daemon = ws.serve()
        try:
            ws.wait_started(sleeper)
            read_screen(main, [sleeper])  # a running handoff appears by itself
        finally:
            ws.stop(daemon)
        os.write(main, b"q")
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            drain(main)  # a full terminal buffer would block its redraw, and the key with it
        assert proc.wait(timeout=1) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)



def test_idle_metrics_connections_are_bounded(ws: Workspace) -> None:
    """Found by the fourth session's hunt: prometheus-client's server gave every connection a
    thread and kept it with no timeout, so clients that connect and send nothing grew the
    daemon by a thread and a descriptor each (3,000 connections: 452 threads). At most 32 are
    served at once; the rest are closed at once."""
    import socket
    daemon = ws.serve("--metrics", "127.0.0.1:0")
    held: list[socket.socket] = []
    try:
        url = re.search(r"metrics on (http://\S+/metrics)", daemon.ready_line).group(1)  # type: ignore[attr-defined]
        port = int(url.rsplit(":", 1)[1].split("/")[0])

        def threads() -> int:
            status = Path(f"/proc/{daemon.pid}/status").read_text()
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads")))

        before = threads()
        for _ in range(150):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(1.0)  # (threads start as connections are accepted)
        # (32 connections served, plus the lease keeper's three threads and the sweeper's,
        # which may start meanwhile)
        assert threads() <= before + 32 + 4, (before, threads())
    finally:
        for sock in held:
            sock.close()
        ws.stop(daemon)
