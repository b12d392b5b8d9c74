"""Why a rate-limited handoff waits: ``handoff ls`` says so in its note (read from the store's
shared bucket record, never taking a token or writing the record), and a daemon says it once
at ``-v`` when its specialist's starts begin to wait."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Clock, exe, memory_engine, new_workspace, run_python, wait_until

from handoffd import Daemon, State, new_native_request
from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Rate
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace
from handoffd.features import rates
from handoffd.features.build import open_backend

# a command specialist that completes whatever it is given (a JSON list is a TOML array)
DONE = json.dumps([sys.executable, "-c", "import json, sys; json.load(sys.stdin); print(json."
                   "dumps({'status': 'completed', 'output': {'summary': 'done'}}))"])
TOML = f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@e"]
command = {DONE}
rate = "1/h"

[specialists."@free"]
command = {DONE}
"""
NOTE = re.compile(r"^rate 1/h: next start in (1h|59m( \d+s)?) \(at \d{4}-\d\d-\d\dT[0-9:.]+Z\)$")
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}
FULL = {**QUICK, "HANDOFFD_FULL_CLI": "1"}
LOADED = ("import sys\n"
          "from handoffd.cli.entry import handoff\n"
          "sys.argv = ['handoff', 'ls', '--root', sys.argv[1]]\n"
          "try:\n"
          "    handoff()\n"
          "finally:\n"
          "    loaded = 'handoffd.features.rates' in sys.modules\n"
          "    print('RATES LOADED' if loaded else 'NOT LOADED')\n")


def drain(root: Path, agent: str, rate: Rate) -> None:
    """Empty ``agent``'s bucket in the workspace's shared record, as a daemon's start does."""
    ws = Workspace(root)
    buckets = rates.Buckets(open_backend(ws, ws.load_config()).records())
    while buckets.take(agent, rate, utc_now()) == 0.0:
        pass


def handoff(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``handoff ARGS`` (``env``: the plain form or the full command line)."""
    proc = subprocess.run([exe("handoff"), *args], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def ls(root: Path, env: dict[str, str]) -> dict[str, str]:
    """``handoff ls --json``'s notes, by id."""
    listed = handoff(env, "ls", "--json", "--root", str(root))
    return {row["id"]: row["note"] for row in json.loads(listed.stdout)}


# ---------------------------------------------------------------- handoff ls, as a user runs it
def test_ls_says_a_handoff_waits_for_its_rate_and_leaves_the_bucket_alone(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", TOML)
    try:
        rated, free = ws.create("--to", "@e"), ws.create("--to", "@free")
        drain(ws.root, "@e", Rate(1, 3600.0))
        record = ws.root / "handoffs" / ".meta" / "rates.json"
        before = (record.read_bytes(), record.stat().st_mtime_ns)
        for env in (QUICK, FULL):  # the plain form and the full command line say the same
            notes = ls(ws.root, env)
            assert NOTE.match(notes[rated]), notes
            assert notes[free] == "", notes  # a specialist without a rate: due, no note
        table = handoff(QUICK, "ls", "--root", str(ws.root))
        assert "rate 1/h: next start in" in table.stdout, table.stdout
        assert (record.read_bytes(), record.stat().st_mtime_ns) == before  # no token taken
    finally:
        ws.cleanup()


def test_ls_loads_the_rates_feature_only_for_a_pending_row_with_a_rate(tmp_path: Path) -> None:
    """A listing whose pending rows' specialists have no rate imports no rate code; one with
    a rated specialist's pending row does (and says why it waits, or nothing when a token is
    there)."""
    ws = new_workspace(tmp_path / "ws", TOML)
    try:
        ws.create("--to", "@free")
        assert run_python(LOADED, str(ws.root), env=QUICK).stdout.endswith("NOT LOADED\n")
        rated = ws.create("--to", "@e")
        listing = run_python(LOADED, str(ws.root), env=QUICK).stdout
        assert listing.endswith("RATES LOADED\n") and "rate 1/h" not in listing  # a full bucket
        assert ls(ws.root, QUICK)[rated] == ""
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- the daemon's one line
def test_a_serving_daemon_says_once_that_starts_wait_for_the_rate(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", TOML)
    lines: list[str] = []
    try:
        ids = [ws.create("--to", "@e") for _ in range(3)]
        proc = ws.serve("-v")
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
        reader.start()
        said = lambda: [line for line in lines if "wait for its rate" in line]  # noqa: E731
        ran = lambda: [hid for hid in ids if ws.state_of(hid) == ["completed"]]  # noqa: E731
        wait_until(lambda: said() and ran(), timeout=30,
                   what="one handoff ran and the daemon said the others wait for the rate")
        # another process's listing, while the daemon serves, says why the others wait
        notes = ls(ws.root, QUICK)
        waiting = [hid for hid in ids if hid not in ran()]
        assert len(waiting) == 2 and all(NOTE.match(notes[hid]) for hid in waiting), notes
        assert ws.stop(proc) == 0
        reader.join(10)
    finally:
        ws.cleanup()
    assert [ws.state_of(hid) for hid in waiting] == [["pending"]] * 2
    assert len(said()) == 1, lines
    assert "specialist @e" in said()[0] and "1/h" in said()[0] and "INFO" in said()[0], lines
    assert "Traceback" not in "".join(lines)


# ---------------------------------------------------------------- in-process
def rated(tmp_path: Path, clock: Clock) -> Any:
    """A memory engine with @e (rate 1/h) and three pending handoffs for it."""
    engine, backend = memory_engine(tmp_path, clock, {"@e": lambda ctx, data: {}})
    engine.registry.with_overrides("@e", rate=Rate(1, 3600.0))
    for _ in range(3):
        engine.submit(new_native_request(source="@t", target="@e", data={}, now=clock()))
    return engine, backend


class Counted:
    """A store's records, counting reads and refusing updates."""

    def __init__(self, records: Any) -> None:
        self.records, self.reads = records, 0

    def read(self, kind: str) -> dict[str, Any]:
        self.reads += 1
        return dict(self.records.read(kind))

    def update(self, kind: str, key: str, change: Any) -> Any:
        raise AssertionError(f"a listing wrote the {kind} record of {key}")


def test_a_listing_reads_the_buckets_once_and_never_takes_a_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.service.queries import list_handoffs
    monkeypatch.setattr(rates, "CACHE_SECONDS", 3600.0)  # (a slow machine: still one listing)
    clock = Clock()
    engine, backend = rated(tmp_path, clock)
    spec = engine.registry.get("@e")
    assert rates.Buckets(backend.records()).take("@e", spec.config.rate, clock()) == 0.0
    counted = Counted(backend.records())
    monkeypatch.setattr(backend, "records", lambda: counted)
    rows = list_handoffs(engine, state="pending")
    assert len(rows) == 3 and counted.reads == 1
    at = clock.now + timedelta(hours=1)
    assert {row["note"] for row in rows} == {
        f"rate 1/h: next start in 1h (at {at.strftime('%Y-%m-%dT%H:%M:%S.000Z')})"}


def test_the_gate_stands_aside_in_an_engine_a_daemon_serves(tmp_path: Path) -> None:
    """The daemon's scheduler holds rate-limited work itself and looks again when the next
    token is due; a gate's wait would be looked at again only at a filing or rescan."""
    clock = Clock()
    engine, backend = rated(tmp_path, clock)
    rates.Buckets(backend.records()).take("@e", Rate(1, 3600.0), clock())
    handoff_id = backend.ids(State.PENDING)[0]
    peek = engine.peek(handoff_id)
    assert peek is not None
    verdict = engine.gate(peek)
    assert verdict is not None and verdict.action == "wait" and "rate 1/h" in verdict.reason
    Daemon(engine, watch=False)
    assert engine.gate(peek) is None


def test_the_limit_says_once_while_starts_wait(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    limits = rates.RateLimits(MemoryBackend().records(),
                              monotonic=lambda: clock().timestamp())
    spec: Any = SimpleNamespace(agent="@e", config=SimpleNamespace(rate=Rate(1, 3600.0)))
    with caplog.at_level(logging.INFO, logger="handoffd"):
        assert limits.limit(spec, clock()) == 0.0
        waits = [limits.limit(spec, clock()) for _ in range(3)]
        clock.advance(3600)
        assert limits.limit(spec, clock()) == 0.0  # a token again: the next wait is said anew
        assert limits.limit(spec, clock()) > 0
    assert waits == [pytest.approx(3600.0)] * 3
    said = [r.getMessage() for r in caplog.records if "wait for its rate" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("specialist @e: its handoffs wait for its "
                                                 "rate 1/h; next start in 1h (at "), said


def test_notes_read_as_a_user_writes_rates_and_waits() -> None:
    assert [rates.spelled(Rate(*r)) for r in ((1, 3600.0), (30, 60.0), (5, 1.0), (10, 90.0),
                                              (2, 86400.0))] == ["1/h", "30/m", "5/s",
                                                                 "10/90s", "2/d"]
    assert [rates.span(s) for s in (0.2, 45, 3599.2, 3600, 7505, 93784)] == [
        "<1s", "45s", "1h", "1h", "2h 5m", "1d 2h"]
    assert rates.span(3540.5) == "59m 1s"


def test_a_hostile_bucket_record_gives_a_note_or_none_never_a_failure() -> None:
    clock = Clock()
    spec: Any = SimpleNamespace(agent="@e", config=SimpleNamespace(rate=Rate(1, 3600.0)))

    class Fixed:
        """Records whose @e bucket is ``value`` (an exception: raised by every read)."""

        def __init__(self, value: Any) -> None:
            self.value = value

        def read(self, kind: str) -> dict[str, Any]:
            if isinstance(self.value, Exception):
                raise self.value
            return {"@e": self.value}

        def update(self, kind: str, key: str, change: Any) -> Any:
            raise AssertionError("a note wrote a record")

    for value in ("not a bucket", [1], {"tokens": "nan", "at": 0}, {"tokens": 1e308, "at": 0},
                  {"tokens": 0.5, "at": float("inf")}, {"tokens": -1e308, "at": -1e308}):
        note = rates.RateLimits(Fixed(value)).note(spec, clock())
        assert note is None or note.startswith("rate 1/h: next start in "), (value, note)
    forged = rates.RateLimits(Fixed({"tokens": -5.0, "at": clock().timestamp()}))
    assert forged.note(spec, clock()) is None  # never ours (a bucket never goes below 0): full
    empty = rates.RateLimits(Fixed({"tokens": 0.0, "at": clock().timestamp()}))
    assert empty.note(spec, clock()) == "rate 1/h: next start in 1h (at 2026-11-24T13:00:00.000Z)"
    broken = rates.RateLimits(Fixed(OSError(5, "Input/output error")))
    assert broken.note(spec, clock()) == \
        "rate 1/h: its bucket cannot be read ([Errno 5] Input/output error)"


def test_a_backlog_paced_by_its_rate_is_said_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    """A backlog that the rate paces waits before almost every start: it was said at each
    (18 lines for 20 starts of a 2/s specialist under serve -v); once a minute now."""
    clock = Clock()
    limits = rates.RateLimits(MemoryBackend().records(),
                              monotonic=lambda: clock().timestamp())
    spec: Any = SimpleNamespace(agent="@e", config=SimpleNamespace(rate=Rate(2, 1.0)))
    with caplog.at_level(logging.INFO, logger="handoffd"):
        for _ in range(40):  # 20 s of starts, each waiting for its token
            wait = limits.limit(spec, clock())
            clock.advance(wait if wait > 0 else 0.0)
    said = [r for r in caplog.records if "wait for its rate" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_a_bucket_stamped_far_in_the_future_is_taken_as_full() -> None:
    """{"tokens": 0.5, "at": 9e15} held the specialist for ever (a clock behind its stamp
    refills nothing), while ls said 'next start in 30m'."""
    clock = Clock()
    records = MemoryBackend().records()
    records.update("rates", "@h", lambda old: {"tokens": 0.5, "at": 9e15, "rate": "1/3600s"})
    limits = rates.RateLimits(records)
    spec: Any = SimpleNamespace(agent="@h", config=SimpleNamespace(rate=Rate(1, 3600.0)))
    assert limits.note(spec, clock()) is None  # a token is there
    assert limits.limit(spec, clock()) == 0.0
