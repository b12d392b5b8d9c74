"""Running out of memory reading a document, and an answer too large to write (session 20, F6).

A MemoryError while reading a valid pending document said "never" (set aside for good, a
failure stub `retry --force` refuses); it says "not now": the document is read again after a
back-off, and set aside only after MEMORY_STRIKES in a row over MEMORY_PATIENCE_SECONDS, while
the others proceed. An answer beyond the daemon's file size limit (EFBIG) ran the handler again
and again and never said why; it is filed as a small failure saying so, the handler run once.
"""
from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import Clock, exe

from handoffd import Daemon, Engine, Registry, State, Workspace, build_engine, new_native_request
from handoffd.core import jsontext
from handoffd.core import memorystrikes as jobs
from handoffd.core.config import Config, DaemonSettings
from handoffd.core.documents import book


class Ticks:
    """The strikes' monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Ticks:
    clock = Ticks()
    monkeypatch.setattr(jobs.memory_strikes, "clock", clock)
    monkeypatch.setattr(jobs.memory_strikes, "_rows", OrderedDict())
    return clock


@pytest.fixture
def wall() -> Clock:
    return Clock()


@pytest.fixture
def engine(tmp_path: Path, wall: Clock) -> Iterator[Engine]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(sweep_seconds=0.2, rescan_seconds=0.2))
    registry = Registry()
    registry.add_function("@t", lambda data, ctx: {"status": "completed", "output": data},
                          config=config, isolate="never")
    eng = build_engine(ws, config, registry, clock=wall)
    yield eng
    eng.backend.close()


def submit(engine: Engine, handoff_id: str) -> None:
    doc = new_native_request(source="@test", target="@t", data={"n": 1}, now=engine.clock(),
                             handoff_id=handoff_id)
    assert engine.submit(doc) == handoff_id


def short_of_memory(monkeypatch: pytest.MonkeyPatch, victim: str, times: float) -> list[int]:
    """Reading ``pending/<victim>.json`` raises MemoryError its first ``times`` times; returns
    a one-item list counting the reads that did."""
    real: Callable[[bytes, str], dict[str, Any]] = jsontext.parse_document
    failed = [0]

    def parse(data: bytes, name: str) -> dict[str, Any]:
        if name == f"pending/{victim}.json" and failed[0] < times:
            failed[0] += 1
            raise MemoryError()
        return real(data, name)

    monkeypatch.setattr(jsontext, "parse_document", parse)
    return failed


def batch(engine: Engine) -> None:
    assert Daemon(engine, workers=2, watch=False).run_batch().error is None


def where(engine: Engine, handoff_id: str) -> tuple[State, dict[str, Any]]:
    """Its state and document, read past the injected MemoryErrors."""
    for state in (State.COMPLETED, State.FAILED, State.IN_PROGRESS, State.PENDING):
        path = engine.ws.root / "handoffs" / state.value / f"{handoff_id}.json"
        if path.exists():
            return state, json.loads(path.read_text())
    raise AssertionError(f"no {handoff_id}")


def test_a_document_read_out_of_memory_stays_pending_and_completes_later(
        engine: Engine, ticks: Ticks, monkeypatch: pytest.MonkeyPatch) -> None:
    submit(engine, "big")
    failed = short_of_memory(monkeypatch, "big", 2)
    batch(engine)
    assert failed[0] == 1
    assert where(engine, "big")[0] is State.PENDING  # before: set aside, a failure stub
    assert not list((engine.ws.root / "handoffs" / ".quarantine").glob("big*"))
    batch(engine)  # backing off: not read at all
    assert failed[0] == 1 and where(engine, "big")[0] is State.PENDING
    ticks.now += jobs.MEMORY_BACKOFF_SECONDS
    batch(engine)  # read again, short of memory again: still pending
    assert failed[0] == 2 and where(engine, "big")[0] is State.PENDING
    ticks.now += 2 * jobs.MEMORY_BACKOFF_SECONDS
    batch(engine)
    state, doc = where(engine, "big")
    assert state is State.COMPLETED, doc
    assert doc["status"] == "completed"
    assert book(doc)["attempt"] == 1


def test_a_document_always_out_of_memory_is_set_aside_after_the_bound_others_proceed(
        engine: Engine, ticks: Ticks, monkeypatch: pytest.MonkeyPatch) -> None:
    submit(engine, "hostile")
    submit(engine, "fine")
    failed = short_of_memory(monkeypatch, "hostile", float("inf"))
    batch(engine)
    assert where(engine, "fine")[0] is State.COMPLETED  # not stalled behind it
    looks = 1
    while where(engine, "hostile")[0] is State.PENDING:
        assert looks < 20, failed
        ticks.now += jobs.MEMORY_BACKOFF_MAX_SECONDS
        submit(engine, f"other{looks}")  # new work keeps flowing meanwhile
        batch(engine)
        assert where(engine, f"other{looks}")[0] is State.COMPLETED
        looks += 1
    # not before MEMORY_STRIKES reads in a row spanning MEMORY_PATIENCE_SECONDS
    assert looks - 1 >= jobs.MEMORY_PATIENCE_SECONDS / jobs.MEMORY_BACKOFF_MAX_SECONDS
    assert failed[0] >= jobs.MEMORY_STRIKES
    state, stub = where(engine, "hostile")
    assert state is State.FAILED
    assert stub["error"]["code"] == "UNPROCESSABLE_DOCUMENT"
    assert "ran out of memory (MemoryError) reading it" in stub["error"]["message"]


def test_a_read_that_succeeds_ends_the_row(engine: Engine, ticks: Ticks,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Strikes count in a row, MEMORY_STRIKES of them over MEMORY_PATIENCE_SECONDS; one good
    read (or a long quiet) starts the count afresh."""
    step = jobs.MEMORY_PATIENCE_SECONDS / jobs.MEMORY_STRIKES
    for _ in range(jobs.MEMORY_STRIKES):
        assert jobs.out_of_memory("x", "pending/x.json").transient
        ticks.now += step
    problem = jobs.out_of_memory("x", "pending/x.json")
    assert not problem.transient and problem.code == "UNPROCESSABLE_DOCUMENT"
    jobs.memory_strikes.clear("x", "read")
    assert jobs.out_of_memory("x", "pending/x.json").transient
    assert jobs.memory_backoff("x") == jobs.MEMORY_BACKOFF_SECONDS
    ticks.now += jobs.MEMORY_FORGET_SECONDS + jobs.MEMORY_BACKOFF_SECONDS + 1
    assert jobs.memory_backoff("x") == 0
    assert jobs.memory_strikes.strike("x", "read")[0] == 1


def test_out_of_memory_admitting_a_claim_hands_it_back_uncounted(
        engine: Engine, ticks: Ticks, wall: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    submit(engine, "wide")
    real = engine.validate
    failed = [0]

    def validate(doc: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if doc.get("handoff_id") == "wide" and failed[0] < 1:
            failed[0] += 1
            raise MemoryError()
        real(doc, *args, **kwargs)

    monkeypatch.setattr(engine, "validate", validate)
    batch(engine)
    state, doc = where(engine, "wide")
    assert failed[0] == 1 and state is State.PENDING, doc  # before: filed INVALID_DOCUMENT
    assert book(doc).get("attempt", 0) == 0
    assert book(doc)["history"][-1]["event"] == "handed_back"
    assert "out of memory" in book(doc)["history"][-1]["detail"]["reason"]
    batch(engine)  # backing off, in every process: due at its next_attempt_at
    assert where(engine, "wide")[0] is State.PENDING
    ticks.now += jobs.MEMORY_BACKOFF_SECONDS
    wall.advance(jobs.MEMORY_BACKOFF_SECONDS)
    batch(engine)
    state, doc = where(engine, "wide")
    assert state is State.COMPLETED, doc
    assert book(doc)["attempt"] == 1


# ------------------------------------------------------------ EFBIG filing the answer
GROW = """
import json, os, sys
doc = json.load(sys.stdin)
with open(os.path.join(os.environ["HANDOFFD_ROOT"], "artifacts", "runs.txt"), "a") as f:
    f.write("run\\n")
print(json.dumps({"status": "completed", "output": {"blob": "x" * 300000}}))
"""


def limited(max_bytes: int) -> Callable[[], None]:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (Python ignores it at start-up too)
    return preexec


def test_an_answer_beyond_the_file_size_limit_is_filed_failed_once(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "artifacts").mkdir(parents=True)
    (tmp_path / "grow.py").write_text(GROW)
    (root / "handoffd.toml").write_text(f"""
[daemon]
workers = 2
rescan_seconds = 0.5
sweep_seconds = 0.5
claim_grace_seconds = 1.0
[specialists."@grow"]
command = ["{sys.executable}", "-S", "{tmp_path / 'grow.py'}"]
timeout_seconds = 30
retry = {{ max_retries = 2, retry_delay_seconds = 0.2, backoff_multiplier = 1.0 }}
""")
    Workspace(root).ensure()
    made = subprocess.run([exe("handoff"), "create", "--root", str(root), "--id", "f2", "--to",
                           "@grow", "--data", "{}"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=limited(100_000))
    try:
        failed = root / "handoffs" / "failed" / "f2.json"
        deadline = time.monotonic() + 30
        while not failed.exists() and time.monotonic() < deadline and daemon.poll() is None:
            time.sleep(0.05)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            _, err = daemon.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            _, err = daemon.communicate(timeout=10)
    runs = (root / "artifacts" / "runs.txt").read_text().split()
    assert failed.exists(), err
    doc = json.loads(failed.read_text())
    assert doc["error"]["code"] == "PROCESSING_ERROR", doc["error"]
    assert "could not be written: File too large" in doc["error"]["message"]
    assert "300" in doc["error"]["message"]  # its size (about 300,000 bytes)
    assert runs == ["run"], err  # before: run again after every recovery, 13 times
    assert [e["event"] for e in book(doc)["history"]].count("claimed") == 1
    assert "Traceback" not in err
