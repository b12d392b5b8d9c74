"""The shared records (``handoffs/.meta/<kind>.json``) as hostile input: a forged 16 MB
``suspects.json`` or ``paused.json`` is parsed once per version of the file (not once per read)
and read as empty with one log line; reads hand out the one parse without copying it; an update
never writes over a file it cannot read (it moves it to the quarantine, or refuses); and no
content of a records file makes a read raise."""
from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Workspace
from handoffd.backends.files import records as records_mod
from handoffd.backends.files.records import FileRecords, UnusableRecords, limit_of
from handoffd.core.specialists import Specialist
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
