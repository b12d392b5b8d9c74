"""Hostile times and numbers in documents: an ``expires_at`` whose UTC time is outside the
calendar (``0001-01-01T00:00:00+14:00`` is in year 0 in UTC) and a timeout too large for a float
(a 401-digit ``timeout_ms``). Each used to be accepted by ``handoff validate`` / ``create
--file``, then raise OverflowError far from where it was read: a traceback in the daemon log, the
handoff stranded in in-progress/ until recovery, every retry burned. Now each is refused at once,
in one line, with SCHEMA_VALIDATION_FAILED — on the command line and in the daemon alike."""
from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, wait_until
from dialect_examples import HAIOS_HANDOFF, HI_MOE_DISPATCHER_TO_FLEET, SWARM_HANDOFF, fresh
from hypothesis import example, given, settings
from hypothesis import strategies as st

from handoffd.core.documents import (ARRIVAL_HEADROOM_SECONDS, MAX_TIMEOUT_SECONDS, Envelope,
                                     document_seconds, first_seen, next_attempt_at)
from handoffd.core.errors import ErrorCode, InvalidDocument
from handoffd.core.native_format import native_envelope
from handoffd.core.timeutil import OutsideCalendar, iso, parse_iso, parse_utc
from handoffd.dialects.haios import HaiosDialect
from handoffd.dialects.hi_moe import HiMoeDialect
from handoffd.dialects.swarm import SwarmDialect

# valid RFC 3339 (the schema's date-time format takes them), outside the calendar once in UTC
OUTSIDE = ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00.5+00:01")
HUGE = int("9" * 401)  # a JSON integer no float can hold

# ---------------------------------------------------------------- documents


def native(hid: str, **extra: Any) -> dict[str, Any]:
    doc = {"handoff_id": hid, "source": {"agent_id": "@x"}, "target": {"agent_id": "@flaky"},
           "input": {"data": {"mode": "ok"}}}
    doc.update(extra)
    return doc


def hi_moe(hid: str, timeout_ms: Any) -> dict[str, Any]:
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"] = hid
    doc["payload"]["specialist_hint"] = "@flaky"
    doc["payload"]["timeout_ms"] = timeout_ms
    return doc


def haios(hid: str, timeout_ms: Any) -> dict[str, Any]:
    doc = fresh(HAIOS_HANDOFF)
    doc["handoff_id"], doc["to_agent"], doc["timeout_ms"] = hid, "@flaky", timeout_ms
    return doc


def swarm(hid: str, timeout_seconds: Any) -> dict[str, Any]:
    doc = fresh(SWARM_HANDOFF)
    doc["contract"]["task_id"] = hid
    doc["contract"]["dependencies_completed"] = []
    doc["timeout_seconds"] = timeout_seconds
    return doc


def one_clean_line(text: str) -> None:
    """What a refusal prints: one line, no traceback, no raw OverflowError."""
    assert text.count("\n") == 1, text
    assert "Traceback" not in text and "OverflowError" not in text, text


def history_events(ws: Workspace, hid: str) -> list[str]:
    return [e["event"] for e in ws.doc(hid)["handoffd"]["history"]]


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("expires_at", OUTSIDE)
def test_validate_and_create_refuse_an_expires_at_outside_the_calendar(
        ws: Workspace, tmp_path: Path, expires_at: str) -> None:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(native("exp-out", expires_at=expires_at)))
    checked = ws.handoff("validate", str(path))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "expires_at" in checked.stdout and "outside years 1 to 9999" in checked.stdout
    assert "Traceback" not in checked.stdout + checked.stderr
    made = ws.handoff("create", "--file", str(path))
    assert made.returncode == 1 and not made.stdout, made.stdout + made.stderr
    one_clean_line(made.stderr)
    assert "expires_at" in made.stderr and "outside years 1 to 9999" in made.stderr
    assert ws.state_of("exp-out") == []  # refused before anything was written


def test_the_calendars_last_instant_is_still_a_valid_expires_at(ws: Workspace,
                                                                tmp_path: Path) -> None:
    """A far expiry ("never", in effect) stays accepted and runs: only unusable times are refused."""
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(native("exp-far", expires_at="9999-12-31T23:59:59.999999Z")))
    assert ws.handoff("create", "--file", str(path)).returncode == 0
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ws.state_of("exp-far") == ["completed"]


@pytest.mark.parametrize("make", [hi_moe, haios, swarm, lambda hid, t: native(hid, timeout_seconds=t)],
                         ids=["hi_moe", "haios", "swarm", "native"])
def test_create_refuses_a_timeout_too_large_for_a_float_like_any_over_the_bound(
        ws: Workspace, tmp_path: Path, make: Any) -> None:
    hid = "6f1c2a9e-3b4d-4c5e-9f7a-8b9c0d1e2f0a"  # (a UUID: haios ids must be one)
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(make(hid, HUGE)))
    made = ws.handoff("create", "--file", str(path))
    assert made.returncode == 1 and not made.stdout, made.stdout + made.stderr
    one_clean_line(made.stderr)
    assert "timeout" in made.stderr and "one week" in made.stderr, made.stderr
    checked = ws.handoff("validate", str(path))
    assert checked.returncode == 1 and "one week" in checked.stdout, checked.stdout
    assert ws.state_of(hid) == []


# ---------------------------------------------------------------- daemon


def test_a_dropped_expires_at_outside_the_calendar_is_filed_at_once(ws: Workspace) -> None:
    """The repro: a batch files it failed on its first claim, with SCHEMA_VALIDATION_FAILED, no
    traceback, nothing left in in-progress/ for recovery, no retry."""
    for n, expires_at in enumerate(OUTSIDE):
        ws.drop(f"exp-{n}.json", native(f"exp-{n}", expires_at=expires_at))
    ws.drop("exp-ok.json", native("exp-ok", expires_at="9999-12-31T23:59:59Z"))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
    assert ws.state_of("exp-ok") == ["completed"]
    for n, expires_at in enumerate(OUTSIDE):
        hid = f"exp-{n}"
        assert ws.state_of(hid) == ["failed"], (hid, ws.state_of(hid))
        error = ws.doc(hid)["error"]
        assert error["code"] == "SCHEMA_VALIDATION_FAILED" and expires_at in error["message"]
        assert "outside years 1 to 9999" in error["message"]
        assert history_events(ws, hid).count("claimed") == 1  # filed once, never retried
    assert not list((ws.root / "handoffs" / "in-progress").iterdir())


def test_a_serving_daemon_files_it_at_once_too(ws: Workspace) -> None:
    daemon = ws.serve()
    ws.drop("exp-srv.json", native("exp-srv", expires_at=OUTSIDE[0]))
    ws.drop("moe-srv.json", hi_moe("moe-srv", HUGE))
    assert ws.wait_state("exp-srv", ("failed",), timeout=20) == "failed"
    assert ws.wait_state("moe-srv", ("failed",), timeout=20) == "failed"
    wait_until(lambda: not (ws.root / "handoffs" / "in-progress" / "exp-srv.json").exists(),
               what="exp-srv out of in-progress/")
    ws.stop(daemon)
    assert daemon.stderr is not None
    log = daemon.stderr.read()
    assert "Traceback" not in log and "unexpected error" not in log, log
    assert ws.doc("exp-srv")["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert ws.doc("moe-srv")["payload"]["error_type"] == "schema_validation_failed"


def test_a_401_digit_timeout_ms_is_refused_like_any_timeout_over_the_bound(ws: Workspace) -> None:
    """It was set aside as UNPROCESSABLE_DOCUMENT with "OverflowError: int too large to convert
    to float"; now it is answered as a timeout_ms of 10**12 is."""
    ws.drop("moe-huge.json", hi_moe("moe-huge", HUGE))
    ws.drop("moe-over.json", hi_moe("moe-over", 10 ** 12))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr and "OverflowError" not in proc.stderr, proc.stderr
    assert not list((ws.root / "handoffs" / ".quarantine").glob("*moe-*"))
    answers = {hid: ws.doc(hid)["payload"] for hid in ("moe-huge", "moe-over")}
    for hid, payload in answers.items():
        assert ws.state_of(hid) == ["failed"], hid
        assert payload["error_type"] == "schema_validation_failed", payload
        assert "is outside 0 < t <= 604800s (one week)" in payload["error_detail"], payload
        assert payload["error_detail"].count("\n") == 0
    assert "OverflowError" not in answers["moe-huge"]["error_detail"]
    assert len(answers["moe-huge"]["error_detail"]) < 200  # not 401 digits either


# ---------------------------------------------------------------- parsing, swept

MAX_US = (datetime.max - datetime.min) // timedelta(microseconds=1)
OFFSET_MINUTES = 24 * 60 - 1  # fromisoformat takes offsets strictly inside a day


def text_of(moment: datetime, offset_minutes: int) -> str:
    sign = "-" if offset_minutes < 0 else "+"
    hours, minutes = divmod(abs(offset_minutes), 60)
    return f"{moment.isoformat()}{sign}{hours:02d}:{minutes:02d}"


def utc_microseconds(moment: datetime, offset_minutes: int) -> int:
    """The instant since 0001-01-01T00:00Z in exact integers (no datetime arithmetic to
    overflow): what the parser must agree with."""
    return ((moment - datetime.min) // timedelta(microseconds=1)
            - offset_minutes * 60 * 1_000_000)


extremes = st.one_of(
    st.datetimes(),
    st.datetimes(max_value=datetime(1, 1, 2)),
    st.datetimes(min_value=datetime(9999, 12, 30)),
)
offsets = st.one_of(st.integers(-OFFSET_MINUTES, OFFSET_MINUTES),
                    st.sampled_from([-OFFSET_MINUTES, -14 * 60, -1, 0, 1, 14 * 60, OFFSET_MINUTES]))


@settings(max_examples=200, deadline=None)
@given(extremes, offsets, st.sampled_from([0.0, 1.0, MAX_TIMEOUT_SECONDS, ARRIVAL_HEADROOM_SECONDS]))
@example(datetime(1, 1, 1), 14 * 60, 0.0)
@example(datetime(9999, 12, 31, 23, 59, 59), -14 * 60, 0.0)
@example(datetime(9999, 12, 31, 23, 59, 59), 0, MAX_TIMEOUT_SECONDS)
@example(datetime(9999, 12, 31, 23, 59, 59, 999999), 0, 0.0)
def test_parse_utc_never_overflows(moment: datetime, offset: int, headroom: float) -> None:
    """parse_utc either gives the instant in UTC, with room to add ``headroom``, or refuses it
    with OutsideCalendar (a ValueError); it agrees with exact integer arithmetic."""
    text = text_of(moment, offset)
    instant = utc_microseconds(moment, offset)
    fits = 0 <= instant and instant + int(headroom) * 1_000_000 <= MAX_US  # (exact: no float)
    try:
        value = parse_utc(text, headroom_seconds=headroom)
    except OutsideCalendar:
        assert not fits, text
        return
    assert fits, text
    assert value.utcoffset() == timedelta(0) and value == parse_iso(text)
    assert (value.replace(tzinfo=None) - datetime.min) // timedelta(microseconds=1) == instant
    iso(value)  # formats
    value + timedelta(seconds=headroom)  # and adds what it promised room for


@settings(max_examples=200, deadline=None)
@given(extremes, offsets)
@example(datetime(1, 1, 1), 14 * 60)
@example(datetime(9999, 12, 31, 23, 59, 59), -14 * 60)
def test_native_expires_at_is_usable_or_refused(moment: datetime, offset: int) -> None:
    """Whatever date-time a request gives, its Envelope's expiry formats and compares, or the
    request is refused with SCHEMA_VALIDATION_FAILED: never an OverflowError."""
    text = text_of(moment, offset)
    try:
        env = native_envelope(native("h-1", expires_at=text))
    except InvalidDocument as exc:
        assert exc.code == ErrorCode.SCHEMA_VALIDATION_FAILED
        assert "outside years 1 to 9999" in str(exc) and "\n" not in str(exc)
        assert not 0 <= utc_microseconds(moment, offset) <= MAX_US
        return
    assert env.expires_at is not None and env.expires_at.utcoffset() == timedelta(0)
    assert iso(env.expires_at).endswith("Z")
    assert (env.expires_at <= datetime.now(timezone.utc)) in (True, False)


@settings(max_examples=200, deadline=None)
@given(extremes, offsets)
def test_bookkeeping_times_never_overflow(moment: datetime, offset: int) -> None:
    """first_seen (a hard deadline is counted from it) and next_attempt_at are read as
    defensively as any bookkeeping: a time outside the calendar, or too near its end to count a
    time limit from, reads as absent."""
    text = text_of(moment, offset)
    doc = {"handoffd": {"next_attempt_at": text, "history": [{"at": text, "event": "created"}]}}
    arrived = first_seen(doc)
    if arrived is not None:
        iso(arrived + timedelta(seconds=ARRIVAL_HEADROOM_SECONDS))
    due = next_attempt_at(doc)
    if due is not None:
        iso(due)
    assert (due is None) == (not 0 <= utc_microseconds(moment, offset) <= MAX_US)


def test_parse_utc_messages() -> None:
    with pytest.raises(OutsideCalendar, match="outside years 1 to 9999"):
        parse_utc("0001-01-01T00:00:00+14:00")
    with pytest.raises(OutsideCalendar, match="too near the end"):
        parse_utc("9999-12-31T23:59:59Z", headroom_seconds=60)
    with pytest.raises(ValueError):
        parse_utc("not a time")
    assert parse_utc("2026-01-13T12:00:00+02:00") == datetime(2026, 1, 13, 10, tzinfo=timezone.utc)


# ---------------------------------------------------------------- numbers, swept

DIALECTS: dict[str, tuple[Any, Any, int]] = {
    "hi_moe": (HiMoeDialect(), hi_moe, 1000), "haios": (HaiosDialect(), haios, 1000),
    "swarm": (SwarmDialect(), swarm, 1)}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(DIALECTS)),
       st.one_of(st.integers(min_value=1, max_value=10 ** 400),
                 st.integers(min_value=1, max_value=10 ** 9),
                 st.floats(min_value=1e-3, max_value=1e300)))
@example("hi_moe", HUGE)
@example("haios", HUGE)
@example("swarm", HUGE)
def test_a_timeout_is_usable_or_refused_with_the_bound(name: str, number: int | float) -> None:
    dialect, make, per_second = DIALECTS[name]
    hid = "6f1c2a9e-3b4d-4c5e-9f7a-8b9c0d1e2f0b"
    try:
        env = dialect.envelope(make(hid, number))
    except InvalidDocument as exc:
        assert exc.code == ErrorCode.SCHEMA_VALIDATION_FAILED
        assert "one week" in str(exc) and len(str(exc)) < 300
        assert number > MAX_TIMEOUT_SECONDS * per_second
        return
    assert env.timeout_seconds is not None and 0 < env.timeout_seconds <= MAX_TIMEOUT_SECONDS
    assert math.isclose(env.timeout_seconds * per_second, number, rel_tol=1e-9)


def test_document_seconds() -> None:
    assert document_seconds(HUGE) == math.inf
    assert document_seconds(HUGE, units_per_second=1000) == math.inf
    assert document_seconds(30000, units_per_second=1000) == 30.0
    assert document_seconds(True) is None and document_seconds(0) is None
    assert document_seconds("5") is None and document_seconds(None) is None


def test_a_huge_native_timeout_or_retry_policy_is_refused_not_raised() -> None:
    with pytest.raises(InvalidDocument, match="one week") as caught:
        native_envelope(native("h-1", timeout_seconds=HUGE))
    assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED
    for key in ("max_retries", "retry_delay_seconds", "backoff_multiplier"):
        with pytest.raises(InvalidDocument, match="retry_policy") as caught:
            Envelope(handoff_id="h-1", dialect="native", target="@x", retry_policy={key: HUGE})
        assert caught.value.code == ErrorCode.SCHEMA_VALIDATION_FAILED


def test_a_dropped_retry_policy_past_a_floats_range_is_filed_at_once(ws: Workspace) -> None:
    """A 401-digit max_retries: its finiteness check raised OverflowError while the failure was
    filed, and the handoff was stranded in in-progress/ with a traceback."""
    ws.drop("rp.json", dict(native("rp"), retry_policy={"max_retries": HUGE}))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
    assert ws.state_of("rp") == ["failed"]
    error = ws.doc("rp")["error"]
    assert error["code"] == "SCHEMA_VALIDATION_FAILED" and "outside 0..1000" in error["message"]
    assert len(error["message"]) < 400  # the number is shown by its start
    assert not list((ws.root / "handoffs" / "in-progress").iterdir())
