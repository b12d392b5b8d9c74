"""Found by the fifteenth review: one line nested thirty thousand deep (``[[[...]]]``) in one of
handoffd's own bookkeeping files raised an uncaught RecursionError out of json's parser.

- ``handoffs/.meta/cancel/<id>.json``: the daemon logged two tracebacks per scan, the handoff
  never ran (``handoff ls``: "cannot check its gates"), and with ``serve`` running no other
  handoff could be cancelled (the poll over the requests stopped at the bad one).
- ``context/.meta/rev-<hash>.json``: ``handoff context get`` and ``set`` of the key exited 1
  with an internal error; ``context/.history.jsonl``: ``handoff context history`` did.
- ``handoffs/.meta/events.jsonl``: ``handoff stats``, ``handoffd metrics`` and ``handoff ls
  --watch`` died, and ``serve --metrics`` answered HTTP 500 to every scrape (its cursor never
  passed the line).
- ``handoffs/.meta/violations.jsonl``: ``handoff violations`` died (and read the whole file at
  once, however large).

Each is now read with one safe line parse (:func:`handoffd.core.jsontext.parse_line`): a
line that nests deeper than any of ours is skipped like a torn one, and a cancel request whose
body is unreadable is a bare request. A context write also encodes its history line before it
writes anything, so a history entry that cannot be encoded refuses the write instead of leaving
a value with no history.
"""
from __future__ import annotations

import hashlib
import json
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, run_python, wait_until
from test_meta_folders_review15 import CONFIG  # (@ok answers at once, @slow sleeps)

DEEP = "[" * 30000 + "]" * 30000  # the review's line: past the recursion limit


@pytest.fixture
def nws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def serve(ws: Workspace, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``handoffd serve -v`` with its stderr in ``log`` (read while it runs, never a full pipe),
    once it says it is serving."""
    with open(log, "wb") as handle:
        proc = subprocess.Popen([exe("handoffd"), "serve", "-v", "--root", str(ws.root), *extra],
                                stdout=subprocess.DEVNULL, stderr=handle)
    ws.daemons.append(proc)  # (cleanup kills it by pid if a test fails before stopping it)
    wait_until(lambda: "serving" in log.read_text() or proc.poll() is not None, timeout=30,
               what="serve started")
    assert proc.poll() is None, log.read_text()
    return proc


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text and "RecursionError" not in text, text[-3000:]


def append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


# ---------------------------------------------------------------- cancel requests
def test_a_nested_cancel_marker_is_a_bare_request_and_run_goes_on(nws: Workspace) -> None:
    """The review's first reproduction: ``handoffd run -v`` logged two tracebacks and never ran
    c1. Now the marker is a bare cancel request: c1 is filed cancelled, c2 runs."""
    nws.create("--to", "@ok", "--data", "{}", "--id", "c1")
    nws.create("--to", "@ok", "--data", "{}", "--id", "c2")
    marker = nws.root / "handoffs" / ".meta" / "cancel" / "c1.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(DEEP)
    listed = nws.handoff("ls", timeout=60)
    no_traceback(listed.stdout, listed.stderr)
    assert listed.returncode == 0 and "cannot check its gates" not in listed.stdout + listed.stderr
    ran = nws.handoffd("run", "-v", timeout=120)
    no_traceback(ran.stdout, ran.stderr)
    assert "batch done: completed 1, failed 1" in ran.stderr, ran.stderr[-3000:]  # (exit 1: one failed)
    assert nws.state_of("c1") == ["failed"], ran.stderr[-3000:]
    assert nws.doc("c1")["error"]["code"] == "CANCELLED"
    assert nws.state_of("c2") == ["completed"]
    assert not marker.exists()  # met and cleared


def test_serve_still_cancels_beside_a_nested_marker(nws: Workspace, tmp_path: Path) -> None:
    """With a nested marker in .meta/cancel, ``handoff cancel`` of a running handoff was never
    delivered (the poll raised before it reached any request)."""
    nws.create("--to", "@ok", "--data", "{}", "--id", "bad-marker")  # filed by its cancel gate
    marker = nws.root / "handoffs" / ".meta" / "cancel" / "bad-marker.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(DEEP)
    log = tmp_path / "serve.log"
    daemon = serve(nws, log)
    try:
        hid = nws.create("--to", "@slow", "--data", "{}", "--id", "c-slow")
        nws.wait_state(hid, ("in-progress",), timeout=30)
        started = time.monotonic()
        done = nws.handoff("cancel", hid, "--timeout", "20", timeout=60)
        assert done.returncode == 0, done.stderr
        assert nws.wait_state(hid, timeout=20) == "failed"
        assert time.monotonic() - started < 20  # stopped by the request, not the 60 s sleep
        assert nws.wait_state("bad-marker", timeout=20) == "failed"
    finally:
        assert stop(daemon) == 0
    said = log.read_text()
    no_traceback(said)
    assert nws.doc(hid)["error"]["code"] == "CANCELLED"
    assert nws.doc("bad-marker")["error"]["code"] == "CANCELLED"


# ---------------------------------------------------------------- shared context
def rev_record(root: Path, key: str) -> Path:
    return root / "context" / ".meta" / ("rev-" + hashlib.sha256(key.encode()).hexdigest()[:24]
                                         + ".json")


def test_a_nested_revision_record_neither_blocks_reading_nor_writing_the_key(
        nws: Workspace) -> None:
    assert nws.handoff("context", "set", "proj/k", '"v1"').returncode == 0
    record = rev_record(nws.root, "proj/k")
    assert record.exists()
    record.write_text(DEEP)
    got = nws.handoff("context", "get", "proj/k")
    no_traceback(got.stdout, got.stderr)
    assert got.returncode == 0 and json.loads(got.stdout) == "v1", got.stderr
    put = nws.handoff("context", "set", "proj/k", '"v2"')
    no_traceback(put.stdout, put.stderr)
    assert put.returncode == 0, put.stderr
    again = nws.handoff("context", "get", "proj/k", "--with-revision")
    assert again.returncode == 0 and '"v2"' in again.stdout, again.stderr
    assert json.loads(record.read_text())["key"] == "proj/k"  # written afresh, ours again


def test_a_nested_history_line_is_skipped_like_a_torn_one(nws: Workspace) -> None:
    assert nws.handoff("context", "set", "proj/a", '"1"').returncode == 0
    append_line(nws.root / "context" / ".history.jsonl", DEEP)
    assert nws.handoff("context", "set", "proj/b", '"2"').returncode == 0
    shown = nws.handoff("context", "history")
    no_traceback(shown.stdout, shown.stderr)
    assert shown.returncode == 0, shown.stderr
    assert "proj/a" in shown.stdout and "proj/b" in shown.stdout
    one = nws.handoff("context", "history", "proj/b")
    assert one.returncode == 0 and "proj/b" in one.stdout and "proj/a" not in one.stdout


def test_a_history_entry_that_cannot_be_encoded_refuses_the_write_before_making_it(
        tmp_path: Path) -> None:
    """The store wrote the value and its revision record, then failed to encode the history
    line (a writer id with a lone surrogate): a value with no history. It is now refused first
    (the command line refuses such an id itself; this is the store's own guarantee)."""
    from handoffd.backends.files.context import HISTORY, FileContext
    from handoffd.core.errors import InvalidDocument

    root = tmp_path / "context"
    store = FileContext(root, durable=False)
    store.write("k", lambda old, rev: (b'"ok"\n', {"key": "k", "by": "@w", "revision": rev + 1}))
    before = (root / "k.json").read_bytes(), (root / HISTORY).read_bytes()
    record = rev_record(tmp_path, "k").read_bytes()

    def change(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
        return b'"new"\n', {"key": "k", "by": "@w\udcff", "revision": revision + 1}
    with pytest.raises(InvalidDocument) as refused:
        store.write("k", change)
    assert refused.value.code == "NOT_UTF8" and "not written" in str(refused.value)
    assert ((root / "k.json").read_bytes(), (root / HISTORY).read_bytes()) == before
    assert rev_record(tmp_path, "k").read_bytes() == record
    with pytest.raises(InvalidDocument):
        store.write("fresh", change)
    assert not (root / "fresh.json").exists() and not rev_record(tmp_path, "fresh").exists()


def test_a_history_entry_holding_a_line_separator_is_read_whole(tmp_path: Path) -> None:
    """History lines are JSON written with ensure_ascii=False: text may hold U+2028 or U+0085,
    where str.splitlines() also breaks, so such an entry was torn in two and dropped."""
    from handoffd.backends.files.context import FileContext

    store = FileContext(tmp_path / "context", durable=False)
    for key, by in (("k", "@w\u2028x"), ("j", "@v\x85y"), ("i", "@plain")):
        store.write(key, lambda old, rev, k=key, b=by: (b'"ok"\n', {"key": k, "by": b,
                                                                    "revision": rev + 1}))
    assert [(e["key"], e["by"]) for e in store.history()] == [
        ("k", "@w\u2028x"), ("j", "@v\x85y"), ("i", "@plain")]


# ---------------------------------------------------------------- the event log
def events_file(ws: Workspace) -> Path:
    return ws.root / "handoffs" / ".meta" / "events.jsonl"


def test_stats_and_metrics_skip_a_nested_event_line(nws: Workspace) -> None:
    nws.create("--to", "@ok", "--data", "{}", "--id", "e1")
    append_line(events_file(nws), DEEP)
    nws.create("--to", "@ok", "--data", "{}", "--id", "e2")
    ran = nws.handoffd("run")
    assert ran.returncode == 0 and nws.state_of("e2") == ["completed"], ran.stderr
    stats = nws.handoff("stats", "--json")
    no_traceback(stats.stdout, stats.stderr)
    assert stats.returncode == 0, stats.stderr
    assert '"@ok"' in stats.stdout
    once = nws.handoffd("metrics")
    no_traceback(once.stdout, once.stderr)
    assert once.returncode == 0, once.stderr
    assert re.search(r'handoffd_run_seconds_count\{agent="@ok"\} 2(\.0)?$', once.stdout, re.M), \
        once.stdout


def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_serve_metrics_answers_past_a_nested_event_line(nws: Workspace, tmp_path: Path) -> None:
    """``serve --metrics`` answered HTTP 500 to every scrape once the line was appended, and
    never counted what came after it."""
    log = tmp_path / "serve.log"
    daemon = serve(nws, log, "--metrics", "127.0.0.1:0")
    try:
        found = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
        assert found, log.read_text()
        url = found.group(1)
        first = nws.create("--to", "@ok", "--data", "{}", "--id", "m1")
        nws.wait_state(first, timeout=30)
        assert scrape(url)[0] == 200
        append_line(events_file(nws), DEEP)
        status, body = scrape(url)
        assert status == 200, body[-2000:]
        nws.create("--to", "@ok", "--data", "{}", "--id", "m2")
        nws.wait_state("m2", timeout=30)
        counted = re.compile(r'handoffd_run_seconds_count\{agent="@ok"\} 2(\.0)?$', re.M)

        def both() -> bool:  # the file appears a moment before the filing is counted
            status, body = scrape(url)
            assert status == 200, body[-2000:]
            return bool(counted.search(body))
        wait_until(both, timeout=15, what="the filing after the line counted")
    finally:
        assert stop(daemon) == 0
    no_traceback(log.read_text())


def test_ls_watch_follows_past_a_nested_event_line(nws: Workspace) -> None:
    watcher = subprocess.Popen([exe("handoff"), "ls", "--watch", "--json", "--root", str(nws.root)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        assert watcher.stdout is not None
        threading.Thread(target=lambda: [lines.put(x) for x in watcher.stdout],  # type: ignore[union-attr]
                         daemon=True).start()
        seen: list[dict[str, Any]] = []

        def until(hid: str, timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if any(e.get("id") == hid for e in seen):
                    return True
                try:
                    seen.append(json.loads(lines.get(timeout=0.2)))
                except queue.Empty:
                    if watcher.poll() is not None:
                        return False
            return False
        # it prints what happens from the moment it starts: a first handoff shows it follows
        for n in range(20):
            if until(nws.create("--to", "@nobody", "--id", f"w{n}"), timeout=1.0):
                break
        assert seen, "the watcher never followed"
        append_line(events_file(nws), DEEP)
        after = nws.create("--to", "@nobody", "--id", "after")
        assert until(after, timeout=15), watcher.poll()
        assert watcher.poll() is None
    finally:
        if watcher.poll() is None:
            watcher.send_signal(signal.SIGINT)
            try:
                watcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                watcher.kill()
                watcher.wait(timeout=30)
    err = watcher.stderr.read() if watcher.stderr else ""
    no_traceback(err)


# ---------------------------------------------------------------- the violations log
def violation(kind: str, agent: str, n: int) -> str:
    return json.dumps({"time": f"2026-01-0{n}T10:00:00.000Z", "kind": kind, "task_id": f"t{n}",
                       "handoff_id": f"t{n}", "agent": agent, "source": "@c", "attempt": 1,
                       "details": {"count": 1, "message": "x"}}, sort_keys=True)


def test_violations_skip_a_nested_line_and_show_the_rest(nws: Workspace) -> None:
    path = nws.root / "handoffs" / ".meta" / "violations.jsonl"
    append_line(path, violation("scope_creep", "@a", 1))
    before = nws.handoff("violations", "--json")
    assert before.returncode == 0, before.stderr
    append_line(path, DEEP)
    append_line(path, "x" * (300 * 1024))  # longer than any entry: skipped as it is read
    append_line(path, violation("readonly_modified", "@b", 2))
    path.open("a").write(violation("criteria_failed", "@a", 3))  # an unterminated last line
    for args in (("violations",), ("violations", "--json")):
        shown = nws.handoff(*args)
        no_traceback(shown.stdout, shown.stderr)
        assert shown.returncode == 0, shown.stderr
    summary = json.loads(nws.handoff("violations", "--json").stdout)
    assert summary["total"] == 3
    assert summary["by_kind"] == {"criteria_failed": 1, "readonly_modified": 1, "scope_creep": 1}
    assert summary["by_agent"]["@a"]["total"] == 2


def test_violations_never_hold_a_huge_line_whole(nws: Workspace) -> None:
    """The whole file was read, then decoded, at once: a 96 MiB line took twice that. Now a
    line over the bound is skipped as it is read: the command's peak memory stays near what it
    takes for a small file."""
    path = nws.root / "handoffs" / ".meta" / "violations.jsonl"
    append_line(path, violation("scope_creep", "@a", 1))
    measure = ("import resource, subprocess, sys\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
               "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
               "sys.stderr.write(p.stderr)\n")
    command = [exe("handoff"), "violations", "--json", "--root", str(nws.root)]
    small = run_python(measure, *command)
    rc, small_kib = map(int, small.stdout.split())
    assert rc == 0, small.stderr
    with open(path, "ab") as handle:
        block = b"x" * (1 << 20)
        for _ in range(96):
            handle.write(block)
        handle.write(b"\n")
    append_line(path, violation("readonly_modified", "@b", 2))
    big = run_python(measure, *command)
    rc, big_kib = map(int, big.stdout.split())
    assert rc == 0, big.stderr
    no_traceback(big.stderr)
    assert big_kib - small_kib < 48 * 1024, (small_kib, big_kib)
    summary = json.loads(nws.handoff("violations", "--json").stdout)
    assert summary["total"] == 2


# ---------------------------------------------------------------- the shared line parse
def test_parse_line_bounds_depth_and_never_raises() -> None:
    from handoffd.core.documents import MAX_DEPTH
    from handoffd.core.jsontext import parse_line

    assert parse_line(DEEP) is None and parse_line(DEEP.encode()) is None
    assert parse_line("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)) is None
    assert parse_line("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert parse_line('{"a": "[[[[' + "[" * 200 + '"}') == {"a": "[[[[" + "[" * 200}
    assert parse_line(b'{"a": 1}\n') == {"a": 1} and parse_line('{"a": 1') is None
    assert parse_line(b'{"a": "\xff"}') is None and parse_line("1" * 5000) is None
