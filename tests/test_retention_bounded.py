"""`handoff purge` / `handoff archive` at their limits (review 14f): a full disk never costs a
document, a very compressible document stays readable from the archive, an archive of small
documents is compressed (review 14g), another process's pass
held past the wait is an error, an age is read with its unit as written, and a pass holds a
bounded number of documents whatever the backlog."""
from __future__ import annotations

import base64
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, Workspace, exe

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace


def _filed(root: Path, outputs: dict[str, Any]) -> Any:
    """An engine over ``root`` with a completed handoff per id of ``outputs`` (its output)."""
    from handoffd import build_engine
    ws = HandoffdWorkspace(root)
    engine = build_engine(ws, ws.load_config())
    for hid, output in outputs.items():
        engine.backend.create({"handoff_id": hid, "source": {"agent_id": "@o"},
                               "target": {"agent_id": "@a"}, "input": {"data": {}}}, hid, utc_now())
        held = engine.backend.claim(hid, utc_now(), 60)
        assert held is not None
        doc = dict(held.doc)
        doc.update(status="completed", output=output)
        assert engine.backend.finish(held, State.COMPLETED, doc)
    return engine


def _random(size: int) -> str:
    return base64.b64encode(os.urandom(size)).decode()


def _file_size_limit(limit: int) -> Any:
    def apply() -> None:  # (in the child: a write past the limit fails EFBIG, not SIGXFSZ)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_deletes_nothing_the_archive_does_not_hold(ws: Workspace) -> None:
    """Found by review 14f: on a full disk the archive's one write was short, unnoticed; the
    fsync succeeded, the documents were deleted, and the archive held a torn member."""
    _filed(ws.root, {"first": "small"})
    ws.handoff("archive", "--older-than", "0s", check=True)
    archive = next((ws.root / "handoffs/.archive").glob("*.jsonl.gz"))
    before = archive.read_bytes()
    ids = [f"big-{i}" for i in range(4)]
    _filed(ws.root, {hid: _random(150_000) for hid in ids})  # ~800 KB that does not compress
    proc = subprocess.run([exe("handoff"), "archive", "--older-than", "0s", "--root",
                           str(ws.root)], capture_output=True, text=True, timeout=60,
                          preexec_fn=_file_size_limit(len(before) + 300_000))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert all(ws.state_of(hid) == ["completed"] for hid in ids)  # nothing deleted
    assert archive.read_bytes() == before  # the partial append was cut off again
    assert [json.loads(line)["id"] for line in gzip.decompress(before).splitlines()] == ["first"]
    again = ws.handoff("archive", "--older-than", "0s", check=True)  # room again: it goes on
    assert "archived 4 handoff(s)" in again.stdout
    assert all(ws.handoff("show", hid).returncode == 0 for hid in ids)


def test_a_short_write_is_followed_by_the_rest(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The archive's append writes all: a write that takes only part is followed by more."""
    from handoffd.features import archive
    real = os.write
    calls: list[int] = []

    def short(fd: int, data: Any) -> int:
        calls.append(len(data))
        return real(fd, bytes(data[:max(len(data) // 3, 1)]))
    monkeypatch.setattr(archive.os, "write", short)
    docs = [(State.COMPLETED, f"h{i}", {"output": _random(20_000)}) for i in range(3)]
    path = archive.append_archive(HandoffdWorkspace(tmp_path), docs, utc_now())
    assert len(calls) > 1
    assert [json.loads(line)["id"] for line in gzip.decompress(path.read_bytes()).splitlines()] \
        == ["h0", "h1", "h2"]


@pytest.mark.heavy
def test_a_very_compressible_document_stays_readable_from_the_archive(ws: Workspace) -> None:
    """Found by review 14f: 4 MB of "ok\\n" output compressed 600-fold, and the reader took the
    whole day's archive for a gzip bomb: `show` and `wait` exit 3 for every handoff in it."""
    _filed(ws.root, {"small-a": "fine"})
    _filed(ws.root, {"big": {"log": "ok\n" * 1_400_000}})
    _filed(ws.root, {"small-b": "fine"})
    ws.handoff("archive", "--older-than", "0s", check=True)
    _filed(ws.root, {"later": "fine"})  # appended after it, in the same file
    ws.handoff("archive", "--older-than", "0s", check=True)
    for hid in ("small-a", "big", "small-b", "later"):
        shown = ws.handoff("show", hid, "--json")
        assert shown.returncode == 0, shown.stderr
        waited = ws.handoff("wait", hid, "--timeout", "5")
        assert waited.returncode == 0, waited.stderr


def _bomb(size: int) -> bytes:
    """A gzip member of ``size`` bytes of one newline-free line, built a MiB at a time."""
    import zlib
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    block = b"o" * (1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


def test_the_archive_reader_still_refuses_a_foreign_bomb(tmp_path: Path) -> None:
    """What handoffd writes stays under the reader's guard; a foreign member expanding past its
    budget (here a newline-free line, skipped as too long while it expands) is refused, with
    the entries before it kept."""
    from handoffd.features import archive
    ws = HandoffdWorkspace(tmp_path)
    folder = archive.archive_dir(ws)
    folder.mkdir(parents=True)
    first = json.dumps({"id": "w", "state": "completed", "document": {}}).encode() + b"\n"
    after = json.dumps({"id": "z", "state": "completed", "document": {}}).encode() + b"\n"
    (folder / "2026-01-01.jsonl.gz").write_bytes(
        gzip.compress(first) + _bomb(archive.MEMBER_BUDGET + (2 << 20)) + gzip.compress(after))
    assert [e["id"] for e in archive.archived(ws)] == ["w"]
    archive.append_archive(ws, [(State.COMPLETED, "y", {"o": "ok\n" * 3_000_000})],
                           utc_now().replace(year=2026, month=1, day=2))
    assert [e["id"] for e in archive.archived(ws)] == ["y", "w"]


def test_an_archive_of_many_small_similar_documents_is_compressed(tmp_path: Path) -> None:
    """Found by review 14g: a pass's documents, each expanding more than 50-fold alone, were
    stored uncompressed one member each: 2,000 small documents took 400 times one member's
    size. A pass is one member again, and reads back whole."""
    from handoffd.features import archive
    ws = HandoffdWorkspace(tmp_path)
    docs = [(State.COMPLETED, f"hoff-20261126-{i:06d}", {
        "handoff_id": f"hoff-20261126-{i:06d}", "status": "completed", "source": {"agent_id": "@planner"},
        "target": {"agent_id": "@worker"}, "output": {"result": "ok", "n": i},
        "input": {"data": {"objective": "summarise the ticket, then file the summary with the "
                                        "support team", "ticket": i}},
        "history": [{"at": "2026-11-26T10:00:01.000Z", "state": state}
                    for state in ("pending", "in_progress", "completed")],
        "handoffd": {"attempts": 1, "claimed_by": "host-1:1234", "retry_count": 0},
        "metadata": {"priority": "normal", "tags": ["support", "summary", "ticket"]}})
        for i in range(2000)]
    raw = sum(len(json.dumps(doc)) for _, _, doc in docs)
    path = archive.append_archive(ws, docs, utc_now())
    assert path.stat().st_size < raw / 10
    assert [e["id"] for e in archive.archived(ws)] == [hid for _, hid, _ in docs]
    assert archive.find_archived(ws, "hoff-20261126-001234")["document"]["output"]["n"] == 1234


def _busy_cli(ws: Workspace, *args: str) -> subprocess.CompletedProcess[str]:
    """``handoff ARGS`` in a subprocess whose retention lock wait is 0.2 s, not a minute."""
    code = ("import sys\nfrom handoffd.features import retention\n"
            "retention.LOCK_WAIT_SECONDS = 0.2\nfrom handoffd.cli.entry import handoff\n"
            "sys.argv = ['handoff', *sys.argv[1:]]\nhandoff()\n")
    return subprocess.run([sys.executable, "-c", code, *args, "--root", str(ws.root)],
                          capture_output=True, text=True, timeout=60)


def test_a_pass_held_by_another_process_past_the_wait_is_an_error(ws: Workspace) -> None:
    """Found by review 14f: `handoff purge` (and --dry-run) waited a minute for another pass,
    then printed "purged 0 handoff(s)" and exited 0 with the old ones still there."""
    from filelock import FileLock
    _filed(ws.root, {"old": "done"})
    with FileLock(str(ws.root / "handoffs/.meta/retention.lock")):
        for args in (("purge", "--dry-run"), ("purge",), ("archive", "--json")):
            proc = _busy_cli(ws, *args, "--older-than", "0s")
            assert proc.returncode == 1, proc.stdout + proc.stderr
            (line,) = proc.stderr.strip().splitlines()
            assert "retention.lock" in line and proc.stdout == ""
    assert ws.state_of("old") == ["completed"]
    assert "purged 1 handoff(s)" in _busy_cli(ws, "purge", "--older-than", "0s").stdout


@pytest.mark.parametrize("age, why", [
    ("6M", "use m for minutes; months are not supported"),
    ("1.5 M", "use m for minutes; months are not supported"),
    ("1_0s", "45s, 10m, 12h, 7d or 2w"), ("\u0661\u0660s", "45s, 10m, 12h, 7d or 2w"),
    ("inf", "45s, 10m, 12h, 7d or 2w"), ("d", "45s, 10m, 12h, 7d or 2w"),
    ("7y", "45s, 10m, 12h, 7d or 2w"), ("-1s", "between 0 and 10 years")])
def test_an_age_is_refused_only_when_it_was_misread(age: str, why: str) -> None:
    from handoffd.core.config import ConfigError, parse_duration
    with pytest.raises(ConfigError, match=why):
        parse_duration(age)


def test_the_documented_ages_are_read() -> None:
    """Review 14g: the upper-case units, an exponent and a space before the unit, accepted
    before 14f, failed every command of a workspace whose handoffd.toml used them."""
    from handoffd.core.config import parse_duration
    assert [parse_duration(a) for a in ("45s", "10m", "12h", "7d", "2w", "1.5h", "30", " 5s")] \
        == [45, 600, 43200, 604800, 1209600, 5400, 30, 5]
    assert [parse_duration(a) for a in ("45S", "12H", "7D", "2W", "1e3", "5 d", "1.5E1s")] \
        == [45, 43200, 604800, 1209600, 1000, 432000, 15]


def test_a_month_is_refused_not_read_as_minutes(ws: Workspace) -> None:
    """Found by review 14f: `--older-than 6M` (meant: six months) purged what was 6 minutes old."""
    _filed(ws.root, {"recent": "done"})
    for age, why in (("6M", "months are not supported"), ("1_0s", "45s, 10m, 12h, 7d or 2w"),
                     ("\u0661\u0660m", "45s, 10m, 12h, 7d or 2w")):
        proc = ws.handoff("purge", "--older-than", age)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert why in line
    ws.write_config(FLAKY_TOML + '\n[retention]\ncompleted = "6M"\n')
    proc = ws.handoffd("run")
    assert proc.returncode == 2 and "use m for minutes" in proc.stderr
    assert ws.state_of("recent") == ["completed"]


def test_a_pass_holds_a_bounded_number_of_documents(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review 14f: `purge --dry-run` held every old document at once (275 MiB) and
    `archive` them all and their one gzip member (915 MiB over 320 MiB of documents)."""
    from handoffd.cli import ops_cmd
    from handoffd.features import retention
    from handoffd.features.archive import archived
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    ids = [f"doc-{i:02d}" for i in range(20)]
    engine = _filed(tmp_path, {hid: _random(30_000) for hid in ids})
    monkeypatch.setattr(retention, "PASS_BYTES", 100_000)  # three documents a pass
    held: list[int] = []
    real = engine.backend.list

    def listing(**kwargs: Any) -> Any:
        rows = real(**kwargs)
        held.append(len(rows))
        return rows
    engine.backend.list = listing  # (this engine only: it is closed at the end)
    removed, kept, _ = ops_cmd._passes(engine, {State.COMPLETED: 0}, True, True)
    assert sorted(hid for hid, _ in removed) == ids and kept == {}
    assert max(held) <= 1  # a dry run keeps no listed document (1: is any old enough?)
    held.clear()
    removed, kept, where = ops_cmd._passes(engine, {State.COMPLETED: 0}, True, False)
    assert sorted(hid for hid, _ in removed) == ids and where is not None
    assert max(held) <= 8  # never the whole backlog
    assert sorted(e["id"] for e in archived(ws)) == ids
    assert engine.backend.ids(State.COMPLETED) == []
    members = where.read_bytes().count(b"\x1f\x8b\x08")
    assert members >= 6  # one member a pass: a kill re-archives at most one pass's batch
    engine.backend.close()
