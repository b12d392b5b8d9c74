"""Review 15 (fixer FL): forged records and hostile clients against the rate buckets and the
metrics. A 400-digit integer in ``handoffs/.meta/rates.json`` stalled a rate-limited specialist
for ever (a traceback every 5 s); a forged line in the event log (a 400-digit ``seconds``, a
lone surrogate in a label) failed every scrape and killed the textfile thread; 1,000 forged
agent ids took the configured specialists' labels for the life of the process, while 450 x 450
agents and codes made 202,503 series; 32 clients sending a byte every 5 s held the endpoint."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from conftest import SPECIALISTS, Clock, Workspace, memory_engine, new_workspace, wait_until
from prometheus_client.parser import text_string_to_metric_families

from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Rate
from handoffd.features import rates
from handoffd.service import metrics

HUGE = 10 ** 400  # no float holds it: float(HUGE) raises OverflowError
TOML = f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@echo"]
command = ["{sys.executable}", "-S", "{SPECIALISTS / 'flaky.py'}"]
timeout_seconds = 20
rate = "5/s"
"""


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", TOML)
    yield workspace
    workspace.cleanup()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(ws: Workspace, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """``handoffd serve --metrics 127.0.0.1:PORT`` (a free port); (the daemon, its URL)."""
    port = free_port()
    daemon = ws.serve("--metrics", f"127.0.0.1:{port}", *extra)
    return daemon, f"http://127.0.0.1:{port}/metrics"


def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def append_events(ws: Workspace, lines: list[str]) -> None:
    path = ws.root / "handoffs" / ".meta" / "events.jsonl"
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(line + "\n" for line in lines))


def stderr_of(ws: Workspace, daemon: subprocess.Popen[str]) -> str:
    """Stop the daemon (SIGTERM, bounded) and return what it wrote to stderr."""
    ws.stop(daemon)
    assert daemon.stderr is not None
    return daemon.stderr.read()


# --------------------------------------------------------------------------------- rate buckets
@pytest.mark.parametrize("bucket", [
    {"tokens": HUGE, "at": 0}, {"tokens": 0.5, "at": HUGE}, {"tokens": 0, "at": -HUGE},
    {"tokens": -HUGE, "at": 0}, {"tokens": False, "at": "now"}, {"tokens": 0.0, "at": True},
    {"tokens": "0", "at": "now"}, {"tokens": 0.0, "at": -5.0}, {"tokens": 0.0, "at": 1e300},
])
def test_a_bucket_that_does_not_read_as_sane_numbers_is_full(bucket: dict[str, Any]) -> None:
    """float(10**400) raised OverflowError out of the gate and the scheduler (only ValueError,
    KeyError and TypeError were caught); a bool or a string read as a number."""
    clock = Clock()
    stamp = clock().timestamp()
    forged = {k: (stamp if v == "now" else v) for k, v in bucket.items()}
    spec: Any = SimpleNamespace(agent="@e", config=SimpleNamespace(rate=Rate(1, 3600.0)))
    records = MemoryBackend().records()
    records.update("rates", "@e", lambda old: forged)
    limits = rates.RateLimits(records)
    assert limits.note(spec, clock()) is None  # a full bucket: a token is there
    assert limits.gate(spec, clock()) is None
    assert limits.limit(spec, clock()) == 0.0  # ... and the start takes it
    kept = records.read("rates")["@e"]
    assert kept["tokens"] == 0.0 and kept["at"] == stamp  # the record is sane again
    assert limits.limit(spec, clock()) == 3600.0  # and the rate holds from there


def test_a_sane_bucket_still_holds_starts_back() -> None:
    clock = Clock()
    stamp = clock().timestamp()
    spec: Any = SimpleNamespace(agent="@e", config=SimpleNamespace(rate=Rate(1, 3600.0)))
    records = MemoryBackend().records()
    records.update("rates", "@e", lambda old: {"tokens": 0, "at": int(stamp), "rate": "1/h"})
    limits = rates.RateLimits(records)
    assert limits.note(spec, clock()) == "rate 1/h: next start in 1h (at 2026-11-24T13:00:00.000Z)"
    assert limits.limit(spec, clock()) == 3600.0


def test_a_huge_integer_in_the_rates_file_neither_stalls_nor_fails_a_serving_daemon(
        ws: Workspace) -> None:
    (ws.root / "handoffs" / ".meta" / "rates.json").write_text(
        '{"@echo": {"tokens": 1' + "0" * 400 + ', "at": 0, "rate": "5/1s"}}')
    hid = ws.create("--to", "@echo", "--data", json.dumps({"mode": "ok"}))
    listing = ws.handoff("ls")
    assert listing.returncode == 0 and "cannot check its gates" not in listing.stdout + \
        listing.stderr, listing
    daemon = ws.serve()
    try:
        assert ws.wait_state(hid, timeout=20) == "completed"
    finally:
        err = stderr_of(ws, daemon)
    assert "Traceback" not in err and "could not be scheduled" not in err, err


# ------------------------------------------------------------------------- forged event lines
FORGED = [
    '{"at": "2026-01-01T00:00:00Z", "event": "completed", "id": "f1", "state": "completed", '
    '"agent": "@echo", "seconds": 1' + "0" * 400 + '}',
    '{"at": "2026-01-01T00:00:00Z", "event": "claimed", "id": "f2", "state": "in-progress", '
    '"agent": "@echo", "wait": 1' + "0" * 400 + '}',
    '{"at": "2026-01-01T00:00:00Z", "event": "failed", "id": "f3", "state": "failed", '
    '"agent": "@a\\ud800", "code": "X\\udfff", "seconds": 1}',
]


@pytest.mark.parametrize("line", FORGED, ids=["huge-seconds", "huge-wait", "surrogates"])
def test_one_forged_event_line_never_fails_handoffd_metrics(ws: Workspace, line: str) -> None:
    """Each failed the whole command before: OverflowError, UnicodeEncodeError."""
    append_events(ws, [line])
    once = ws.handoffd("metrics")
    assert once.returncode == 0 and once.stderr == "", once.stderr
    assert sum(v for (name, _), v in samples(once.stdout).items()
               if name == "handoffd_transitions_total") == 1  # counted, not dropped


def test_forged_event_lines_are_counted_safely_by_handoffd_metrics(ws: Workspace) -> None:
    append_events(ws, FORGED)
    once = ws.handoffd("metrics")
    assert once.returncode == 0, once.stderr
    got = samples(once.stdout)
    assert got[("handoffd_transitions_total", (("agent", "@echo"), ("event", "completed")))] == 1
    assert got[("handoffd_transitions_total", (("agent", "@echo"), ("event", "claimed")))] == 1
    # the lone surrogates are shown escaped, as the CLI shows them (UTF-8 cannot encode them)
    assert got[("handoffd_failures_total", (("agent", "@a\\ud800"), ("code", "X\\udfff")))] == 1
    assert ("handoffd_run_seconds_count", (("agent", "@echo"),)) not in got  # no sane duration


def test_a_serving_daemon_scrapes_and_writes_its_textfile_past_forged_lines(
        ws: Workspace, tmp_path: Path) -> None:
    textfile = tmp_path / "handoffd.prom"
    daemon, url = serve(ws, "--metrics-textfile", str(textfile))
    try:
        wait_until(textfile.exists, timeout=10, what="the first textfile")
        append_events(ws, FORGED)
        hid = ws.create("--to", "@echo", "--data", json.dumps({"mode": "ok"}))
        assert ws.wait_state(hid, timeout=20) == "completed"
        for _ in range(3):  # every scrape answers, the forged lines' included
            status, text = scrape(url)
            assert status == 200
        got: dict[tuple[str, tuple], float] = {}

        def counted() -> bool:
            status, text = scrape(url)
            got.update(samples(text) if status == 200 else {})
            return got.get(("handoffd_transitions_total",
                            (("agent", "@echo"), ("event", "completed")))) == 2
        wait_until(counted, timeout=10, what="the real completion counted")
        assert got[("handoffd_failures_total", (("agent", "@a\\ud800"), ("code", "X\\udfff")))] == 1
    finally:
        err = stderr_of(ws, daemon)
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert 'agent="@a\\\\ud800"' in textfile.read_text(encoding="utf-8")  # written past them


def test_an_event_that_cannot_be_counted_is_skipped_and_the_scrape_goes_on(
        tmp_path: Path) -> None:
    class Hostile(dict):  # (no line the parser gives does this; the collector must not care)
        def get(self, key: Any, default: Any = None) -> Any:
            raise RuntimeError("a bad event")

    class Log:
        def __init__(self) -> None:
            self.batches = [[Hostile(), {"event": "created", "agent": "@a", "state": "pending"}],
                            [{"event": "created", "agent": "@a", "state": "pending"}]]
            self.cursors: list[Any] = []

        def tail(self, cursor: Any) -> tuple[list[Any], Any]:
            self.cursors.append(cursor)
            return (self.batches.pop(0) if self.batches else []), len(self.cursors)

    engine, _ = memory_engine(tmp_path, Clock(), {"@a": lambda handoff, ctx: {}})
    events = Log()
    collector = metrics.EventCollector(engine, events)
    collector.update()
    collector.update()
    assert events.cursors == ["start", 1]  # the cursor moved past the batch with the bad event
    assert collector.skipped == 1
    assert collector.transitions[("created", "@a")] == 2


def test_metrics_count_an_event_whose_number_no_float_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against stats.number as it was (math.isfinite(10**400) raises OverflowError): the
    transition is counted, the duration dropped, nothing raised."""
    import math

    def old_number(value: Any) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value) if math.isfinite(value) and value >= 0 else None

    monkeypatch.setattr(metrics, "number", old_number)

    class Log:
        def tail(self, cursor: Any) -> tuple[list[Any], Any]:
            return ([{"event": "completed", "agent": "@a", "state": "completed", "seconds": HUGE},
                     {"event": "claimed", "agent": "@a", "state": "in-progress", "wait": HUGE},
                     {"event": "completed", "agent": "@a", "state": "completed", "seconds": 2}]
                    if cursor == "start" else []), 1

    engine, _ = memory_engine(tmp_path, Clock(), {"@a": lambda handoff, ctx: {}})
    collector = metrics.EventCollector(engine, Log())
    collector.update()
    assert collector.transitions[("completed", "@a")] == 2
    assert collector.transitions[("claimed", "@a")] == 1
    assert collector.runs.counts["@a"][-1] == 1 and "@a" not in collector.waits.counts


def test_the_textfile_thread_outlives_any_failure(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def write(engine: Any, path: str, registry: Any = None) -> None:
        calls.append(1)
        if len(calls) <= 3:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(metrics, "registry_for", lambda engine: None)
    monkeypatch.setattr(metrics, "write_textfile", write)
    writer = metrics.TextfileWriter(None, "/nonexistent/handoffd.prom", seconds=0.02)  # type: ignore[arg-type]
    writer.start()
    try:
        wait_until(lambda: len(calls) >= 5, timeout=10, what="writes after the failures")
        assert writer.thread.is_alive()
    finally:
        writer.stop()
    said = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(said) == 1 and "UnicodeEncodeError" in said[0], said  # one line, not three


# --------------------------------------------------------------------------------- label bounds
def test_forged_agents_and_codes_neither_take_the_configured_labels_nor_grow_the_scrape(
        ws: Workspace) -> None:
    lines = [json.dumps({"at": "2026-01-01T00:00:00Z", "event": "created", "id": f"c{i}",
                         "state": "pending", "agent": f"@t{i}"}) for i in range(1500)]
    lines += [json.dumps({"at": "2026-01-01T00:00:00Z", "event": "failed", "id": f"x{a}-{c}",
                          "state": "failed", "agent": f"@f{a}", "code": f"CODE_{c}",
                          "seconds": 1}) for a in range(50) for c in range(50)]
    lines += [json.dumps({"at": "2026-01-01T00:00:00Z", "event": f"bogus{i}", "id": f"b{i}",
                          "state": "pending", "agent": "@echo"}) for i in range(50)]
    append_events(ws, lines)
    daemon, url = serve(ws)
    try:
        status, _ = scrape(url)  # the flood is counted first, in the serving process
        assert status == 200
        ok = ws.create("--to", "@echo", "--data", json.dumps({"mode": "ok"}))
        bad = ws.create("--to", "@echo", "--data", json.dumps({"mode": "permanent"}))
        ws.wait_state(ok, timeout=20)
        ws.wait_state(bad, timeout=20)
        got: dict[tuple[str, tuple], float] = {}
        text = ""

        def counted() -> bool:
            nonlocal text
            status, text = scrape(url)
            got.clear()
            got.update(samples(text) if status == 200 else {})
            return got.get(("handoffd_transitions_total",
                            (("agent", "@echo"), ("event", "failed")))) == 1
        wait_until(counted, timeout=10, what="@echo's failure counted under its own label")
    finally:
        ws.stop(daemon)
    for name in ("created", "claimed", "completed"):
        assert got[("handoffd_transitions_total", (("agent", "@echo"), ("event", name)))] >= 1
    assert got[("handoffd_failures_total", (("agent", "@echo"),
                                            ("code", "PROCESSING_ERROR")))] == 1
    assert got[("handoffd_run_seconds_count", (("agent", "@echo"),))] == 2
    # unknown event names are "other", never a label of their own
    assert got[("handoffd_transitions_total", (("agent", "@echo"), ("event", "other")))] == 50
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("handoffd_transitions", "handoffd_failures"):
        series = {tuple(sorted(s.labels.items())) for s in families[name].samples}
        assert len(series) <= metrics.MAX_SERIES + 50, (name, len(series))
    assert got[("handoffd_failures_total", (("agent", "other"), ("code", "other")))] == \
        50 * 50 - metrics.MAX_SERIES  # the combinations past the cap, folded
    assert got[("handoffd_transitions_total", (("agent", "other"), ("event", "created")))] == \
        1500 - metrics.MAX_SERIES
    assert len(text) < 2_000_000


def test_the_queue_depth_keeps_the_configured_specialists_past_a_flood_of_agents(
        tmp_path: Path) -> None:
    """`handoff create --to @t1 ... @t1100`: @zz's depth (sorted after them) was counted as
    agent="other"."""
    from handoffd import new_native_request
    clock = Clock()
    engine, _ = memory_engine(tmp_path, clock, {"@zz": lambda handoff, ctx: {}})
    for i in range(metrics.MAX_SERIES + 100):
        doc = new_native_request(source="@test", target=f"@t{i:05d}", data=i, now=clock())
        engine.backend.create(doc, doc["handoff_id"], now=clock())
    doc = new_native_request(source="@test", target="@zz", data=0, now=clock())
    engine.backend.create(doc, doc["handoff_id"], now=clock())
    collector = metrics.EventCollector(engine, SimpleNamespace(tail=lambda cursor: ([], 0)))
    depth = next(f for f in collector.collect() if f.name == "handoffd_queue_depth")
    got = {tuple(sorted(s.labels.items())): s.value for s in depth.samples}
    assert got[(("agent", "@zz"), ("state", "pending"))] == 1
    # the 100 agents past the first MAX_SERIES are folded; the configured one never is
    assert got[(("agent", "other"), ("state", "pending"))] == 100
    assert len(got) == metrics.MAX_SERIES + 2
    assert sum(got.values()) == metrics.MAX_SERIES + 101


# -------------------------------------------------------------------------- slow HTTP clients
def test_clients_dripping_a_byte_at_a_time_hold_the_endpoint_no_longer_than_the_deadline(
        ws: Workspace) -> None:
    """A read timeout bounds each recv, not the request: 32 clients each sending a byte
    every 2 s held every slot for ever, and scrapes got no answer."""
    daemon, url = serve(ws)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    held: list[socket.socket] = []
    try:
        assert scrape(url)[0] == 200
        for _ in range(metrics.MAX_HTTP_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(sock)
        start = time.monotonic()
        cut: set[int] = set()
        answered = None
        while time.monotonic() - start < metrics.HTTP_IDLE_SECONDS + 15:
            for i, sock in enumerate(held):  # drip: one byte each, well within the idle limit
                if i not in cut:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        cut.add(i)
            try:
                with urllib.request.urlopen(url, timeout=1.5) as response:
                    if response.status == 200:
                        answered = time.monotonic() - start
                        break
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        assert answered is not None, "no scrape answered while the drippers held on"
        assert answered < metrics.HTTP_IDLE_SECONDS + 5, answered
        # the drippers' connections were shut down: each reads to its end at once
        for sock in held:
            sock.settimeout(5)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionError:
                pass
    finally:
        for sock in held:
            sock.close()
        err = stderr_of(ws, daemon)
    assert "Traceback" not in err, err
