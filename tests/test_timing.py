"""Rate limits and timing, as an operator drives them: `handoff create --at/--delay`,
`--expires-after` (EXPIRED when not started in time, also for work nobody can take), and a
specialist's `rate` shared by every daemon of the workspace. Lower bounds only: a slow machine
makes every gap longer, never shorter."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import FLAKY_TOML, Workspace

from handoffd.backends.files.records import FileRecords
from handoffd.core.config import ConfigError, Rate
from handoffd.core.timeutil import iso, parse_iso
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.rates import Buckets

T0 = datetime(2026, 3, 1, tzinfo=timezone.utc)


def events(ws: Workspace) -> list[dict]:
    path = ws.root / "handoffs" / ".meta" / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def at_of(ws: Workspace, hid: str, event: str) -> datetime:
    return parse_iso(next(e["at"] for e in events(ws) if e["id"] == hid and e["event"] == event))


def test_bucket_bursts_then_spaces_starts(tmp_path: Path) -> None:
    records = FileRecords(HandoffdWorkspace(tmp_path).meta)
    buckets, rate = Buckets(records), Rate(3, 6.0)  # 3 per 6 s
    assert [buckets.take("@a", rate, T0) for _ in range(3)] == [0.0, 0.0, 0.0]  # a full bucket
    assert buckets.take("@a", rate, T0) == pytest.approx(2.0)  # one token every 2 s
    assert buckets.take("@a", rate, T0 + timedelta(seconds=1)) == pytest.approx(1.0)
    assert buckets.take("@a", rate, T0 + timedelta(seconds=2)) == 0.0
    assert buckets.take("@a", rate, T0 - timedelta(hours=1)) > 0  # a clock step back refills nothing
    assert buckets.take("@b", rate, T0) == 0.0  # one bucket per specialist
    records.update("rates", "@a", lambda old: "not a bucket")
    assert buckets.take("@a", rate, T0) == 0.0  # unreadable: a full bucket, never a stuck queue
    records.path("rates").write_text("{not json")
    assert buckets.take("@a", rate, T0) == 0.0


def test_rate_parsing() -> None:
    assert (Rate.parse("30/m"), Rate.parse("5/s"), Rate.parse("10/90s")) == \
        (Rate(30, 60.0), Rate(5, 1.0), Rate(10, 90.0))
    assert Rate.parse(" 30 / m ") == Rate(30, 60.0)
    for bad in ("30", "x/m", "0/m", "3/0s", "3/q", 30, "1_000/m", "+5/m", "\u0663/m", "3.0/m"):
        with pytest.raises(ConfigError):
            Rate.parse(bad)


def test_delay_and_at(ws: Workspace) -> None:
    past = ws.create("--to", "@flaky", "--at", iso(datetime.now(timezone.utc) - timedelta(hours=1)))
    hour = ws.create("--to", "@flaky", "--delay", "1h")
    ws.handoffd("run")
    assert ws.state_of(past) == ["completed"] and ws.state_of(hour) == ["pending"]
    rows = json.loads(ws.handoff("ls", "--json", "--state", "pending").stdout)
    assert next(r for r in rows if r["id"] == hour)["note"].startswith("scheduled for ")
    later = ws.create("--to", "@flaky", "--delay", "2s")
    daemon = ws.serve()
    try:
        ws.wait_state(later, ("completed",), timeout=20)
    finally:
        ws.stop(daemon)
    waited = at_of(ws, later, "claimed") - at_of(ws, later, "created")
    assert waited >= timedelta(seconds=1.9) and ws.state_of(hour) == ["pending"]
    claimed = next(e for e in events(ws) if e["id"] == later and e["event"] == "claimed")
    # its queue wait counts from when it was due, not from its creation two seconds earlier
    assert claimed["wait"] <= waited.total_seconds() - 1.9
    for args, word in ((("--at", "tomorrow"), "--at"), (("--delay", "1x"), "--delay"),
                       (("--at", "2026-01-01T00:00:00Z", "--delay", "1s"), "not both")):
        bad = ws.handoff("create", "--to", "@flaky", *args)
        assert bad.returncode == 2 and word in bad.stderr and bad.stderr.count("\n") == 1


def test_expires_after(ws: Workspace) -> None:
    nobody = ws.create("--to", "@nobody", "--expires-after", "1s")  # nobody can run it
    ws.handoff("pause", "@flaky", check=True)
    paused = ws.create("--to", "@flaky", "--expires-after", "1s")  # held back by a pause
    in_time = ws.create("--to", "@other", "--expires-after", "1h")
    daemon = ws.serve()
    try:
        for hid in (nobody, paused):
            assert ws.wait_state(hid, timeout=20) == "failed"
            assert ws.doc(hid)["error"]["code"] == "EXPIRED"
    finally:
        ws.stop(daemon)
    assert ws.runs() == [] and ws.state_of(in_time) == ["pending"]
    assert ws.doc(paused)["retry_available"] is False  # permanent: a retry would expire again
    assert ws.handoff("wait", nobody).returncode == 1
    # a foreign producer's request with expires_at in the past is never started
    ws.handoff("resume", "@flaky", check=True)
    ws.drop("late-1.json", {"handoff_id": "late-1", "source": {"agent_id": "@x"},
                            "target": {"agent_id": "@flaky"}, "input": {"data": None},
                            "expires_at": "2020-01-01T00:00:00Z"})
    ws.handoffd("run")
    assert ws.state_of("late-1") == ["failed"] and ws.doc("late-1")["error"]["code"] == "EXPIRED"
    assert ws.runs() == []
    bad = ws.handoff("create", "--to", "@flaky", "--expires-after", "soon")
    assert bad.returncode == 2 and "--expires-after" in bad.stderr


def test_rate_is_shared_by_every_daemon(ws: Workspace) -> None:
    ws.write_config(FLAKY_TOML.replace("concurrency = 4", 'concurrency = 4\nrate = "1/s"'))
    ids = [ws.create("--to", "@flaky") for _ in range(4)]
    daemons = [ws.serve(), ws.serve()]
    try:
        for hid in ids:
            ws.wait_state(hid, ("completed",), timeout=30)
    finally:
        for daemon in daemons:
            assert ws.stop(daemon) == 0
    starts = sorted(at_of(ws, hid, "claimed") for hid in ids)
    gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:])]
    assert all(gap >= 0.9 for gap in gaps), gaps  # one token a second, burst of one


def test_a_bad_rate_stops_the_daemon_at_start(ws: Workspace) -> None:
    ws.write_config(FLAKY_TOML.replace("concurrency = 4", 'concurrency = 4\nrate = "fast"'))
    proc = ws.handoffd("run")
    assert proc.returncode == 2 and "rate 'fast'" in proc.stderr
