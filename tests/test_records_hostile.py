"""The shared records (``handoffs/.meta/<kind>.json``) as hostile input: a forged 16 MB
``suspects.json`` or ``paused.json`` is parsed once per version of the file (not once per read)
and read as empty with one log line; reads hand out the one parse without copying it; an update
never writes over a file it cannot read (it moves it to the quarantine, or refuses); and no
content of a records file makes a read raise."""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Workspace, new_workspace, reason_codes, wait_until
from handoffd.backends.files import records as records_mod
from handoffd.backends.files.records import FileRecords, UnusableRecords, limit_of
from handoffd.core.suspects import Suspects
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import pause as pause_mod
from handoffd.features.pause import Pauses

MIB = 1024 * 1024
HOSTILE = b'{"@a": {"until": 1}, "pad": "' + b"x" * (16 * MIB) + b'"}'  # valid JSON, 16 MB


@pytest.fixture
def meta(tmp_path: Path) -> Path:
    """A workspace's ``handoffs/.meta`` (its folders made)."""
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    return ws.meta


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every call of the records' loader (one per parse of a file), by path."""
    calls: list[Path] = []
    real = records_mod._load

    def counting(path: Path, info: os.stat_result, limit: int) -> Any:
        calls.append(path)
        return real(path, info, limit)

    monkeypatch.setattr(records_mod, "_load", counting)
    return calls


def warnings_about(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and name in r.getMessage()]


def quarantined(meta: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(moved file, its reason) for each file in the workspace's quarantine."""
    folder = meta.parent / ".quarantine"
    return [(folder / reason.name[: -len(".reason.json")], json.loads(reason.read_text()))
            for reason in sorted(folder.glob("*.reason.json"))]


# ---------------------------------------------------------------- the 16 MB files, by their readers
def test_a_forged_suspects_file_is_parsed_once_not_per_read(
        meta: Path, loads: list[Path], caplog: pytest.LogCaptureFixture) -> None:
    records = FileRecords(meta)
    (meta / "suspects.json").write_bytes(HOSTILE)
    now = [1000.0]
    suspects = Suspects(lambda: records, clock=lambda: now[0])
    for _ in range(30):  # each check a second apart: each one reads the shared marks
        now[0] += 1.0
        assert "@a" not in suspects
        suspects.refresh()  # as after every sweep
    assert len(loads) == 1  # one look at the file (its size), for 60 reads
    lines = warnings_about(caplog, "suspects.json")
    assert len(lines) == 1 and f"over the {limit_of('suspects')}-byte limit" in lines[0]
    assert "DOCUMENT_TOO_LARGE" in lines[0] and "moves it to handoffs/.quarantine/)" in lines[0]
    # a new version of the file is read again, at once
    (meta / "suspects.json").write_text(json.dumps({"@a": {"until": now[0] + 60}}))
    now[0] += 1.0
    assert "@a" in suspects and len(loads) == 2


def test_a_forged_paused_file_is_parsed_once_not_per_claim(
        meta: Path, loads: list[Path], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pause_mod, "CACHE_SECONDS", -1.0)  # every gate asks the records
    records = FileRecords(meta)
    (meta / "paused.json").write_bytes(b"\x00junk" * (4 * MIB))  # 20 MB, not even JSON
    pauses = Pauses(records)
    assert all(pauses.why("@a") is None for _ in range(50))
    assert len(loads) == 1
    assert len(warnings_about(caplog, "paused.json")) == 1
    # a pause set meanwhile moves the file aside (nothing in it could be read) and holds
    pauses.set("@a", paused=True, by="@ops", reason="incident")
    assert pauses.why("@a") is not None and "incident" in str(pauses.why("@a"))
    [(moved, reason)] = quarantined(meta)
    assert reason["file"] == "paused.json" and reason["code"] == "DOCUMENT_TOO_LARGE"
    assert moved.stat().st_size == 20 * MIB  # its bytes kept


def test_a_bad_file_is_logged_once_per_version(meta: Path, loads: list[Path],
                                               caplog: pytest.LogCaptureFixture) -> None:
    records = FileRecords(meta)
    path = meta / "paused.json"
    path.write_text("{not json")
    assert [records.read("paused") for _ in range(5)] == [{}] * 5
    path.write_text("[1, 2]")  # another bad version: said again, once
    assert [records.read("paused") for _ in range(5)] == [{}] * 5
    lines = warnings_about(caplog, "paused.json")
    assert len(lines) == 2 and len(loads) == 2
    assert "MALFORMED_JSON" in lines[0] and "NOT_AN_OBJECT" in lines[1]


def test_reads_share_one_parse_without_copying(meta: Path, loads: list[Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    records = FileRecords(meta)
    records.update("paused", "@a", lambda old: {"by": "@ops", "tags": ["x"]})
    records.update("paused", "@b", lambda old: {"by": "@ops"})
    loads.clear()  # (each update parsed the file under the lock)

    def no_copy(value: Any, memo: Any = None) -> Any:
        raise AssertionError("a read deep-copied the records")

    monkeypatch.setattr(records_mod.copy, "deepcopy", no_copy)
    first, second = records.read("paused"), records.read("paused")
    assert first == {"@a": {"by": "@ops", "tags": ["x"]}, "@b": {"by": "@ops"}}
    assert first["@a"] is second["@a"]  # the one parse, shared
    first.pop("@b")  # the dict itself is the caller's
    assert "@b" in records.read("paused") and len(loads) == 1


# ---------------------------------------------------------------- updates never lose a record
@pytest.mark.parametrize("content, code", [
    (b"{not json", "MALFORMED_JSON"),
    (b'["a list"]', "NOT_AN_OBJECT"),
    (b"[" * 100_000, "DOCUMENT_TOO_DEEP"),
    (b'{"a": ' * 70 + b"1" + b"}" * 70, "DOCUMENT_TOO_DEEP"),
    (b'{"\xff": 1}', "NOT_UTF8"),
    (b"x" * (300 * 1024), "DOCUMENT_TOO_LARGE"),
])
def test_an_update_moves_a_bad_file_aside_first(meta: Path, content: bytes, code: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    records = FileRecords(meta)
    (meta / "rates.json").write_bytes(content)
    assert records.read("rates") == {}
    assert records.update("rates", "@a", lambda old: {"tokens": 1.0, "was": old}) == \
        {"tokens": 1.0, "was": None}
    assert records.read("rates") == {"@a": {"tokens": 1.0, "was": None}}
    [(moved, reason)] = quarantined(meta)
    assert moved.read_bytes() == content and reason["code"] == code
    assert reason["from"] == ".meta" and reason["message"].startswith("rates.json ")
    moves = [m for m in warnings_about(caplog, "rates.json") if "moved to" in m]
    assert len(moves) == 1 and "handoffs/.quarantine/" in moves[0]


@pytest.mark.parametrize("make", ["fifo", "folder", "symlink"])
def test_an_update_moves_a_non_regular_entry_aside(meta: Path, make: str) -> None:
    path = meta / "suspects.json"
    if make == "fifo":
        os.mkfifo(path)
    elif make == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    records = FileRecords(meta)
    assert records.read("suspects") == {}
    records.update("suspects", "@a", lambda old: {"until": 5})
    assert records.read("suspects") == {"@a": {"until": 5}}
    [(moved, reason)] = quarantined(meta)
    assert reason["code"] == "NOT_A_REGULAR_FILE" and os.path.lexists(moved)


def test_an_update_that_cannot_read_the_file_now_refuses(
        meta: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = FileRecords(meta)
    records.update("reservations", "live", lambda old: {"h1": {"handoff_id": "h1"}})
    before = (meta / "reservations.json").read_bytes()

    def failing(path: Any, flags: int, mode: int = 0o644) -> int:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(records_mod, "open_regular", failing)
    with pytest.raises(UnusableRecords, match="cannot be read") as caught:
        records.update("reservations", "released", lambda old: {"h2": {}})
    assert caught.value.code == "UNREADABLE_FILE"
    assert (meta / "reservations.json").read_bytes() == before and quarantined(meta) == []


def test_an_update_too_large_for_its_readers_is_refused(meta: Path) -> None:
    records = FileRecords(meta)
    records.update("paused", "@a", lambda old: {"by": "@ops"})
    with pytest.raises(UnusableRecords, match="over their 262144-byte limit") as caught:
        records.update("paused", "@b", lambda old: {"reason": "x" * limit_of("paused")})
    assert caught.value.code == "DOCUMENT_TOO_LARGE"
    with pytest.raises(UnusableRecords, match="levels"):
        deep: Any = 1
        for _ in range(80):
            deep = [deep]
        records.update("paused", "@c", lambda old: deep)
    assert records.read("paused") == {"@a": {"by": "@ops"}}  # nothing lost, nothing written


def test_a_passing_read_failure_is_tried_again_at_the_next_read(
        meta: Path, loads: list[Path], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    records = FileRecords(meta)
    records.update("paused", "@a", lambda old: {"by": "@ops"})
    loads.clear()
    real = records_mod.open_regular

    def failing(path: Any, flags: int, mode: int = 0o644) -> int:
        raise OSError(errno.EMFILE, "Too many open files", str(path))

    monkeypatch.setattr(records_mod, "open_regular", failing)
    assert [records.read("paused") for _ in range(3)] == [{}] * 3
    assert len(loads) == 3  # not kept: the file itself may be fine
    [line] = warnings_about(caplog, "paused.json")
    assert "cannot be read now" in line and "UNREADABLE_FILE" in line
    monkeypatch.setattr(records_mod, "open_regular", real)
    assert records.read("paused") == {"@a": {"by": "@ops"}}


def test_a_file_its_mode_forbids_reading_is_moved_aside_by_an_update(
        meta: Path, loads: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    records = FileRecords(meta)
    (meta / "suspects.json").write_text('{"@a": {"until": 1}}')

    def forbidden(path: Any, flags: int, mode: int = 0o644) -> int:
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(records_mod, "open_regular", forbidden)
    assert [records.read("suspects") for _ in range(3)] == [{}] * 3
    assert len(loads) == 1  # kept until the file changes (a chmod changes its ctime)
    records.update("suspects", "@b", lambda old: {"until": 2})
    [(_, reason)] = quarantined(meta)
    assert reason["code"] == "UNREADABLE_FILE"
    assert json.loads((meta / "suspects.json").read_text()) == {"@b": {"until": 2}}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_nobody_may_read_reads_as_empty_until_its_mode_changes(meta: Path) -> None:
    records = FileRecords(meta)
    records.update("paused", "@a", lambda old: {"by": "@ops"})
    path = meta / "paused.json"
    path.chmod(0)
    assert records.read("paused") == {}
    path.chmod(0o644)  # the same content, readable again: read again (its ctime changed)
    assert records.read("paused") == {"@a": {"by": "@ops"}}


# ---------------------------------------------------------------- any content: a read never raises
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)
CONTENTS = st.one_of(
    st.binary(max_size=400),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=6).map(
        lambda v: json.dumps(v).encode()),
    st.integers(min_value=60, max_value=3000).map(lambda n: b'{"a":' + b"[" * n + b"]" * n + b"}"),
    st.integers(min_value=4300, max_value=6000).map(lambda n: b'{"a": ' + b"9" * n + b"}"),
    st.sampled_from([b'{"a": NaN}', b'{"a": 1e999}', b'{"\\ud800": 1}', b"\xef\xbb\xbf{}",
                     b"   ", b"{}" + b" " * 10, b'{"a": 1} trailing']),
)


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(content=CONTENTS)
def test_no_records_file_makes_a_read_raise_or_an_update_lose_a_record(content: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="records-fuzz-") as root:
        meta = HandoffdWorkspace(Path(root)).meta
        meta.mkdir(parents=True)
        (meta / "paused.json").write_bytes(content)
        records = FileRecords(meta)
        before = records.read("paused")
        assert isinstance(before, dict)
        records.update("paused", "@new", lambda old: {"by": "@fuzz"})
        after = records.read("paused")
        expected = {**before, "@new": {"by": "@fuzz"}}  # every readable record kept
        assert json.dumps(after, sort_keys=True) == json.dumps(expected, sort_keys=True)  # (NaN)
        moved = quarantined(meta)
        if moved:  # set aside whole: nothing a reader could see was in it
            assert before == {} and moved[0][0].read_bytes() == content


# ---------------------------------------------------------------- a daemon with a forged file
def test_a_batch_with_a_forged_paused_file_completes_its_handoffs(ws: Workspace) -> None:
    (ws.root / "handoffs" / ".meta" / "paused.json").write_bytes(b"junk " * (16 * MIB // 5))
    ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"})) for _ in range(3)]
    run = ws.handoffd("run")
    assert run.returncode == 0, run.stderr
    assert all(ws.state_of(hid) == ["completed"] for hid in ids)
    output = run.stdout + run.stderr
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if "paused.json" in line]
    assert len(lines) == 1 and "limit" in lines[0], output


def test_a_rate_bucket_that_cannot_be_updated_holds_starts_back_and_never_raises(
        caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's loop asks the rate limit before each start: an update refused (a
    records file unreadable for a passing reason, a full disk) must not stop the daemon. Starts
    wait and ask again a second later; one line says why, until the bucket works again."""
    from types import SimpleNamespace

    from handoffd.core.config import Rate
    from handoffd.core.timeutil import utc_now
    from handoffd.core.errors import ErrorCode
    from handoffd.features import rates

    class Refusing:
        fail = True

        def read(self, kind: str) -> dict[str, Any]:
            return {}

        def update(self, kind: str, key: str, change: Any) -> Any:
            if self.fail:
                raise UnusableRecords("rates.json cannot be read", code=ErrorCode.UNREADABLE_FILE)
            return change(None)

    records = Refusing()
    engine = SimpleNamespace(backend=SimpleNamespace(records=lambda: records), start_limits=[])
    rates.install(engine)  # type: ignore[arg-type]
    limit = engine.start_limits[0]
    spec = SimpleNamespace(agent="@r", config=SimpleNamespace(rate=Rate(5, 1.0)))
    with caplog.at_level("ERROR", logger="handoffd"):
        waits = [limit(spec, utc_now()) for _ in range(3)]
    assert waits == [rates.UNREADABLE_WAIT_SECONDS] * 3
    assert len([r for r in caplog.records if "rate bucket" in r.getMessage()]) == 1
    records.fail = False
    assert limit(spec, utc_now()) == 0.0  # working again: a token taken


# ---------------------------------------------------------------- the kind's lock and temp file
@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The lock wait's clock and sleep, moved by hand (no real waiting): each sleep is recorded
    and advances the clock by its length."""
    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(records_mod, "_monotonic", lambda: now[0], raising=False)
    monkeypatch.setattr(records_mod, "_sleep", sleep, raising=False)
    return slept


def held(path: Path) -> int:
    """A descriptor holding an exclusive flock on ``path`` (as another process would)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def bounded(call: Any) -> Any:
    """``call()`` in a thread, joined within 10 s (an update that waits for ever fails the test
    rather than hanging it): its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert out, "the update still waits after 10 s"
    return out[0]


def test_an_update_waits_a_bounded_time_for_a_lock_another_process_holds(
        meta: Path, fake_time: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """R3: a process holding ``.rates.lock`` (hostile, or stopped with SIGSTOP mid-update) froze
    the scheduler's loop in flock and made the daemon deaf to SIGTERM. The update now gives up
    after LOCK_WAIT_SECONDS with one line naming the lock, and writes nothing."""
    records = FileRecords(meta)
    records.update("rates", "@r", lambda old: {"tokens": 1.0})
    before = (meta / "rates.json").read_bytes()
    holder = held(meta / ".rates.lock")
    try:
        outcome = bounded(lambda: records.update("rates", "@r", lambda old: {"tokens": 0.0}))
    finally:
        os.close(holder)
    assert isinstance(outcome, UnusableRecords), outcome
    assert outcome.code == "TIMEOUT"
    assert "handoffs/.meta/.rates.lock" in str(outcome) and "\n" not in str(outcome)
    assert sum(fake_time) == pytest.approx(records_mod.LOCK_WAIT_SECONDS)
    assert (meta / "rates.json").read_bytes() == before
    # a holder that lets go within the bound: the update waits for it and goes through
    fake_time.clear()
    holder = held(meta / ".rates.lock")
    real_sleep = records_mod._sleep

    def letting_go(seconds: float) -> None:
        real_sleep(seconds)
        if len(fake_time) == 3:
            os.close(holder)

    monkeypatch.setattr(records_mod, "_sleep", letting_go)
    assert records.update("rates", "@r", lambda old: {"tokens": 0.5}) == {"tokens": 0.5}
    assert len(fake_time) == 3 and records.read("rates") == {"@r": {"tokens": 0.5}}


# a command specialist that completes whatever it is given (a JSON list is a TOML array)
DONE = json.dumps([sys.executable, "-c", "import json, sys; json.load(sys.stdin); print(json."
                   "dumps({'status': 'completed', 'output': {'summary': 'done'}}))"])
RATED_TOML = f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5

[specialists."@r"]
command = {DONE}
rate = "100/s"
"""


def test_a_daemon_whose_rate_lock_is_held_holds_starts_back_and_stops_on_sigterm(
        tmp_path: Path) -> None:
    """R3 end to end: with ``.rates.lock`` held by another process, ``serve`` says once why the
    rate-limited handoff waits, stops on SIGTERM, and the handoff runs once the lock is free."""
    ws = new_workspace(tmp_path / "ws", RATED_TOML)
    holder = held(ws.root / "handoffs" / ".meta" / ".rates.lock")
    try:
        hid = ws.create("--to", "@r", "--data", "{}")
        proc = ws.serve()
        lines: list[str] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
        reader.start()
        wait_until(lambda: any("rate bucket cannot be updated" in line for line in lines),
                   timeout=20, what="the held rate lock said")
        assert ws.stop(proc, signal.SIGTERM, timeout=20) == 0
        reader.join(10)
        assert ws.state_of(hid) == ["pending"]
    finally:
        os.close(holder)
        ws.cleanup()
    output = "".join(lines)
    assert "Traceback" not in output
    said = [line for line in lines if "rates.lock" in line]
    assert len(said) == 1 and "held by another process" in said[0], output
    run = ws.handoffd("run")
    assert run.returncode == 0, run.stderr
    assert ws.state_of(hid) == ["completed"]


def test_a_folder_planted_at_a_predictable_temp_name_blocks_no_update(meta: Path) -> None:
    """R2: the temp file was ``.<kind>.<pid>.tmp``, unlinked before use: a folder planted under
    that name (EISDIR) refused every update of the kind by that pid, one per pid for good."""
    for kind in ("paused", "rates"):
        (meta / f".{kind}.{os.getpid()}.tmp").mkdir()
    records = FileRecords(meta)
    for n in range(3):
        assert records.update("paused", f"@{n}", lambda old: {"by": "@ops"}) == {"by": "@ops"}
    records.update("rates", "@r", lambda old: {"tokens": 1.0})
    assert sorted(records.read("paused")) == ["@0", "@1", "@2"]
    # each update's temp file is gone (renamed into place); the plants are left alone
    assert sorted(p.name for p in meta.glob(".*.tmp")) == sorted(
        f".{kind}.{os.getpid()}.tmp" for kind in ("paused", "rates"))


def test_an_update_that_cannot_write_refuses_in_one_error_type_and_leaves_no_temp(
        meta: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R2c: a failed write (a full disk) is an UnusableRecords (a HandoffdError with a code), not
    a bare OSError: the contracts feature's reservations catch HandoffdError only."""
    records = FileRecords(meta)
    records.update("reservations", "live", lambda old: {"h1": {"handoff_id": "h1"}})
    before = (meta / "reservations.json").read_bytes()

    def full(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(src))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(UnusableRecords, match="No space left") as caught:
        records.update("reservations", "live", lambda old: {"h2": {"handoff_id": "h2"}})
    monkeypatch.undo()
    assert caught.value.code == "PROCESSING_ERROR"
    assert "handoffs/.meta/reservations.json" in str(caught.value)
    assert (meta / "reservations.json").read_bytes() == before
    assert list(meta.glob(".*.tmp")) == []


@pytest.mark.parametrize("make", ["folder", "symlink", "dangling symlink", "fifo"])
def test_a_lock_that_is_no_regular_file_is_moved_aside_never_followed(
        meta: Path, tmp_path: Path, make: str, caplog: pytest.LogCaptureFixture) -> None:
    """R2b: a folder, symlink or FIFO at ``.<kind>.lock`` refused every update of the kind for
    good. It is moved to the quarantine with its reason (nobody can hold a lock on it), once;
    a symlink is never followed (its target neither created nor locked)."""
    lock = meta / ".rates.lock"
    outside = tmp_path / "outside.lock"
    if make == "folder":
        lock.mkdir()
    elif make == "symlink":
        outside.write_text("not ours\n")
        lock.symlink_to(outside)
    elif make == "dangling symlink":
        lock.symlink_to(outside)
    else:
        os.mkfifo(lock)
    records = FileRecords(meta)
    for n in range(3):
        assert records.update("rates", "@r", lambda old: {"tokens": float(n)}) == \
            {"tokens": float(n)}
    assert records.read("rates") == {"@r": {"tokens": 2.0}}
    [(moved, reason)] = quarantined(meta)
    assert reason["file"] == ".rates.lock" and reason["code"] == "NOT_A_REGULAR_FILE"
    assert os.path.lexists(moved) and lock.is_file() and not lock.is_symlink()
    assert (outside.read_text() == "not ours\n") if make == "symlink" else not outside.exists()
    [line] = [m for m in warnings_about(caplog, ".rates.lock") if "moved to" in m]
    assert "handoffs/.quarantine/" in line and "NOT_A_REGULAR_FILE" in line


def test_a_planted_lock_that_cannot_be_moved_refuses_the_update_in_one_line(
        meta: Path) -> None:
    """R2c: when the plant cannot be moved (the quarantine is unusable) the update refuses with
    an UnusableRecords, never an IsADirectoryError escaping a caller that catches
    HandoffdError (a claimed contract handoff was left unfiled in in-progress/)."""
    (meta / ".reservations.lock").mkdir()
    (meta.parent / ".quarantine").rmdir()
    (meta.parent / ".quarantine").write_text("not a folder\n")
    records = FileRecords(meta)
    with pytest.raises(UnusableRecords) as caught:
        records.update("reservations", "live", lambda old: {"h1": {"handoff_id": "h1"}})
    assert caught.value.code == "NOT_A_REGULAR_FILE"
    assert "handoffs/.meta/.reservations.lock" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not (meta / "reservations.json").exists()


CONTRACT_TOML = f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5

[specialists."@worker"]
command = {DONE}
timeout_seconds = 30
"""


def test_a_contract_handoff_runs_with_a_folder_planted_at_the_reservations_lock(
        tmp_path: Path) -> None:
    """R2c end to end: the planted ``.reservations.lock`` folder is moved aside and the claimed
    contract handoff runs and is filed (it was left in in-progress/ by a batch that exited 0)."""
    ws = new_workspace(tmp_path / "ws", CONTRACT_TOML)
    try:
        (ws.root / "src" / "auth").mkdir(parents=True)
        (ws.root / "handoffs" / ".meta" / ".reservations.lock").mkdir()
        ws.drop("c1.json", {"handoff_id": "c1", "source": {"agent_id": "@coordinator"},
                            "target": {"agent_id": "@worker"}, "input": {"data": {}},
                            "contract": {"files_owned": ["src/auth/**"]}})
        run = ws.handoffd("run")
    finally:
        ws.cleanup()
    assert run.returncode == 0, run.stderr
    assert ws.state_of("c1") == ["completed"], run.stderr
    assert "Traceback" not in run.stderr
    assert reason_codes(ws.root) == {".reservations.lock": "NOT_A_REGULAR_FILE"}


def test_the_sweep_removes_a_records_temp_file_a_dead_update_left(tmp_path: Path) -> None:
    """An update writes .<kind>.<random>.tmp and renames it over the kind's file; a process
    killed in between left it in .meta for good. The sweep removes it once it is old, and
    nothing else of .meta."""
    import time

    from handoffd.backends.files import orphans
    from handoffd.backends.files.store import Store
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    meta = ws.meta
    meta.mkdir(parents=True, exist_ok=True)
    old, young = meta / ".paused.0123456789abcdef.tmp", meta / ".rates.fedcba9876543210.tmp"
    other = meta / ".not-ours.tmp"
    for path in (old, young, other):
        path.write_text("{}")
    an_hour_ago = time.time() - 3600
    for path in (old, other):
        os.utime(path, (an_hour_ago, an_hour_ago))
    store = Store(ws, durable=False)
    try:
        done: Any = {"temp_files_removed": [], "locks_removed": []}
        orphans.remove_orphans(store, done)
    finally:
        store.close()
    assert done["temp_files_removed"] == [old.name]
    assert not old.exists() and young.exists() and other.exists()
