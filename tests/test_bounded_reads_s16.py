"""Session 16: two reads that held a whole log in memory, however long it grew.

- ``handoff context history`` (and ``context ls``, for each key's last writer) read
  ``context/.history.jsonl`` whole, decoded it whole and kept every entry: a 70 MB history took
  570 MB. The history is now streamed a line at a time (a line over ``HISTORY_LINE`` skipped as
  it is read), only the newest ``--limit N`` entries (default 1000, at most 10,000) are kept,
  and stderr says when older ones were left out; a PostgreSQL store picks them with ``ORDER BY
  seq DESC LIMIT``. ``context ls`` finds each key's last writer in one pass
  (``ContextBackend.latest``).
- ``handoff violations`` kept every entry of the violations log in one list (55 MB: 465 MB):
  the log is now handed out as a stream (``ViolationLog.read`` is an iterator; PostgreSQL reads
  it a page at a time), counted as it goes by, with bounded counts, and only the newest
  ``--limit N`` (default 10, at most 1000) are listed.
"""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, run_python

from handoffd.backends.files.context import HISTORY, FileContext
from handoffd.backends.files.violations import FileViolationLog

CONFIG = "[daemon]\nsettle_seconds = 0.2\n"
ENTRY = {"at": "2026-11-24T12:00:00.000Z", "key": "notes", "by": "@cli", "bytes": 13,
         "sha256": "ab" * 32, "actor": {"host": "h", "pid": 1}, "revision": 1,
         "previous_sha256": None}
VIOLATION = {"time": "2026-01-01T10:00:00.000Z", "kind": "scope_creep", "task_id": "t",
             "handoff_id": "t", "agent": "@w", "source": "@c", "attempt": 1,
             "details": {"count": 1, "message": "x"}}
MEASURE = ("import resource, subprocess, sys\n"
           "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
           "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
           "sys.stderr.write(p.stderr)\n")


@pytest.fixture
def bws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def write_lines(path: Path, lines: Iterator[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line + "\n")


def history_lines(count: int, start: int = 1, key: str = "notes") -> Iterator[str]:
    for n in range(start, start + count):
        yield json.dumps(dict(ENTRY, key=key, by=f"@w{n}", revision=n))


def violation_lines(count: int, **fields: Any) -> Iterator[str]:
    for n in range(count):
        yield json.dumps(dict(VIOLATION, task_id=f"t{n}", **fields))


def peak_bytes(func: Callable[[], Any]) -> tuple[Any, int]:
    """(``func()``, the most memory Python held while it ran)."""
    tracemalloc.start()
    try:
        result = func()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text, text


# ---------------------------------------------------------------- the history, in process
def test_file_history_keeps_only_the_newest_entries_and_streams_the_file(tmp_path: Path) -> None:
    """50,000 entries (12 MB): the newest 10 come back, and the read held a few blocks, not
    the file, its text and every entry (tens of MB)."""
    context = FileContext(tmp_path / "context", durable=False)
    write_lines(tmp_path / "context" / HISTORY, history_lines(50_000))
    kept, peak = peak_bytes(lambda: context.history(limit=10))
    assert [e["revision"] for e in kept] == list(range(49_991, 50_001))
    assert peak < 2 * 1024 * 1024, peak
    default, peak = peak_bytes(context.history)  # the default keeps 1000
    assert len(default) == 1000 and default[-1]["revision"] == 50_000
    assert peak < 8 * 1024 * 1024, peak


def test_file_history_skips_a_planted_huge_line_without_holding_it(tmp_path: Path) -> None:
    context = FileContext(tmp_path / "context", durable=False)
    path = tmp_path / "context" / HISTORY
    write_lines(path, history_lines(2))
    with open(path, "ab") as handle:  # 32 MiB in one line, a valid JSON object at that
        handle.write(b'{"key": "notes", "by": "' + b"x" * (32 << 20) + b'"}\n')
    write_lines(path, history_lines(1, start=3))
    kept, peak = peak_bytes(lambda: context.history("notes"))
    assert [e["revision"] for e in kept] == [1, 2, 3]
    assert peak < 2 * 1024 * 1024, peak


def test_latest_finds_each_keys_last_writer_in_one_bounded_pass(tmp_path: Path) -> None:
    context = FileContext(tmp_path / "context", durable=False)
    path = tmp_path / "context" / HISTORY
    write_lines(path, history_lines(1, key="old"))
    write_lines(path, history_lines(30_000, start=2))
    last, peak = peak_bytes(lambda: context.latest(["old", "notes", "gone"]))
    assert (last["old"]["by"], last["notes"]["by"], "gone" in last) == ("@w1", "@w30001", False)
    assert peak < 2 * 1024 * 1024, peak


def test_a_write_whose_history_record_no_reader_would_read_is_refused(tmp_path: Path) -> None:
    """A writer id so long that its record is over HISTORY_LINE: every store's history read
    skips such a record, so the write is refused (nothing written) on every store."""
    from handoffd.backends.files.context import HISTORY_LINE
    from handoffd.backends.memory import MemoryContext
    from handoffd.core.errors import ErrorCode, InvalidDocument
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.features.context import ContextStore, Permissions
    for backend in (MemoryContext(), FileContext(tmp_path / "context", durable=False)):
        store = ContextStore(HandoffdWorkspace(tmp_path), Permissions({}, {}), durable=False,
                             backend=backend)
        with pytest.raises(InvalidDocument) as caught:
            store.set("k", 1, agent="@" + "a" * HISTORY_LINE)
        assert caught.value.code == ErrorCode.INVALID_CONTEXT_VALUE
        assert backend.read("k") == (None, 0) and store.history("k") == []
        store.set("k", 2, agent="@" + "a" * 1000)  # a long one that fits is kept
        assert [e["revision"] for e in store.history("k")] == [1]


def test_the_feature_checks_the_limit_and_says_when_older_records_were_left_out(
        tmp_path: Path) -> None:
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.features.context import MAX_HISTORY_LIMIT, ContextStore, Permissions
    store = ContextStore(HandoffdWorkspace(tmp_path), Permissions({}, {}), durable=False)
    for n in range(4):
        store.set("k", n, agent="@a")
    assert [e["revision"] for e in store.history_window("k", limit=2)[0]] == [3, 4]
    assert store.history_window("k", limit=2)[1] is True
    assert store.history_window("k", limit=4) == (store.history("k"), False)
    assert store.history_window("k", limit=0) == ([], True)
    for bad in (-1, MAX_HISTORY_LIMIT + 1, True, 1.5, "3"):
        with pytest.raises(ValueError):
            store.history("k", limit=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the violations log, in process
def test_violations_are_streamed_and_summarised_without_holding_the_log(tmp_path: Path) -> None:
    from handoffd.features.contracts import violations as vlog
    log = FileViolationLog(tmp_path / "violations.jsonl")
    write_lines(log.path, violation_lines(50_000))
    stream = log.read()
    assert not isinstance(stream, list)
    summary, peak = peak_bytes(lambda: vlog.summarise(vlog.read(log), recent=3))
    assert summary["total"] == 50_000 and summary["by_agent"]["@w"]["tasks"] == 50_000
    assert [e["task_id"] for e in summary["recent"]] == ["t49997", "t49998", "t49999"]
    assert summary["recent_left_out"] == 49_997 and "tasks_capped" not in summary
    assert peak < 8 * 1024 * 1024, peak  # (the 50,000 task hashes: ~4 MB)


def test_a_summary_holds_bounded_counts_whatever_the_log_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinct agents, days and kinds past the caps are counted under "(others)", names are
    cut, and the distinct-task counts stop past MAX_TASKS pairs (said by ``tasks_capped``)."""
    from handoffd.features.contracts import violations as vlog
    monkeypatch.setattr(vlog, "MAX_GROUPS", 3)
    monkeypatch.setattr(vlog, "MAX_KINDS", 2)
    monkeypatch.setattr(vlog, "MAX_TASKS", 5)
    entries = [dict(VIOLATION, agent=f"@a{n}" + "z" * 500, kind=f"k{n}", task_id=f"t{n}",
                    time=f"2026-01-0{n + 1}T00:00:00Z") for n in range(8)]
    summary = vlog.summarise(iter(entries), recent=0)
    assert summary["total"] == 8 and summary["recent"] == [] and summary["recent_left_out"] == 8
    assert len(summary["by_agent"]) == 4 and summary["by_agent"][vlog.OTHERS]["total"] == 5
    assert all(len(a) <= vlog.MAX_NAME + 1 for a in summary["by_agent"])
    assert summary["by_kind"] == {"k0": 1, "k1": 1, vlog.OTHERS: 6}
    assert len(summary["by_day"]) == 4 and summary["tasks_capped"] is True
    assert sum(a["tasks"] for a in summary["by_agent"].values()) == 5
    with pytest.raises(ValueError):
        vlog.summarise(iter(entries), recent=vlog.MAX_RECENT + 1)


# ---------------------------------------------------------------- the commands
def test_context_history_limit_lists_the_newest_and_says_what_it_left_out(bws: Workspace) -> None:
    for n in range(3):
        bws.handoff("context", "set", "notes", str(n), check=True)
    shown = bws.handoff("context", "history", "--limit", "2")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 2 and all("notes  by @cli" in line for line in lines)
    assert shown.stderr.strip() == ("handoff: older writes not shown (--limit 2): raise --limit "
                                    "(at most 10000) to list more")
    as_json = bws.handoff("context", "history", "notes", "--limit", "2", "--json")
    assert [e["revision"] for e in json.loads(as_json.stdout)] == [2, 3]
    assert "older writes not shown" in as_json.stderr
    every = bws.handoff("context", "history", "--json")  # default 1000: nothing left out
    assert len(json.loads(every.stdout)) == 3 and every.stderr == ""
    assert bws.handoff("context", "history", "--limit", "0").stdout == ""


@pytest.mark.parametrize("value", ["-1", "10001", "abc", "1.5", "99999999999999999999999"])
def test_context_history_refuses_a_bad_limit_as_a_usage_error(bws: Workspace, value: str) -> None:
    shown = bws.handoff("context", "history", "--limit", value)
    assert shown.returncode == 2, (shown.stdout, shown.stderr)
    no_traceback(shown.stdout, shown.stderr)
    assert shown.stderr.startswith("handoff: error:") and "--limit" in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1


def test_context_ls_names_a_keys_last_writer_past_the_newest_thousand(bws: Workspace) -> None:
    """``ls`` finds each key's last writer however far back (it read the whole history for it;
    a listing from the newest 1000 would have lost it)."""
    bws.handoff("context", "set", "old", "1", "--as", "@first", check=True)
    bws.handoff("context", "set", "notes", "1", check=True)
    write_lines(bws.root / "context" / HISTORY, history_lines(1500, start=2))
    rows = json.loads(bws.handoff("context", "ls", "--json", check=True).stdout)
    assert {r["key"]: r["written_by"] for r in rows} == {"old": "@first", "notes": "@w1501"}


def test_context_history_of_a_huge_history_stays_small(bws: Workspace) -> None:
    """~14 MB of valid history: ``handoff context history`` held all of it (about 8.5 times
    its size: ~300 MB for 35 MB); now its peak stays near a small history's."""
    bws.handoff("context", "set", "notes", "1", check=True)
    command = [exe("handoff"), "context", "history", "--root", str(bws.root)]
    small = run_python(MEASURE, *command)
    rc, small_kib = map(int, small.stdout.split())
    assert rc == 0, small.stderr
    write_lines(bws.root / "context" / HISTORY, history_lines(60_000, start=2))
    big = run_python(MEASURE, *command)
    rc, big_kib = map(int, big.stdout.split())
    assert rc == 0, big.stderr
    no_traceback(big.stderr)
    assert big_kib - small_kib < 40 * 1024, (small_kib, big_kib)
    assert "older writes not shown (--limit 1000)" in big.stderr


def test_violations_limit_lists_the_newest_and_counts_them_all(bws: Workspace) -> None:
    write_lines(bws.root / "handoffs" / ".meta" / "violations.jsonl", violation_lines(12))
    summary = json.loads(bws.handoff("violations", "--json", "--limit", "3", check=True).stdout)
    assert summary["total"] == 12 and summary["recent_left_out"] == 9
    assert [e["task_id"] for e in summary["recent"]] == ["t9", "t10", "t11"]
    default = json.loads(bws.handoff("violations", "--json", check=True).stdout)
    assert len(default["recent"]) == 10 and default["recent_left_out"] == 2
    human = bws.handoff("violations", "--limit", "3", check=True).stdout
    assert "latest 3 of 12 (--limit N lists more)" in human
    assert "t11" in human and "t8" not in human
    for value in ("-1", "1001", "x"):
        bad = bws.handoff("violations", "--limit", value)
        assert bad.returncode == 2 and "--limit" in bad.stderr, (value, bad.stderr)
        no_traceback(bad.stdout, bad.stderr)


def test_violations_of_a_huge_log_stay_small(bws: Workspace) -> None:
    """~11 MB of valid violations (60,000 entries): held in one list (about 9 times their
    size: ~350 MB for 40 MB); now counted as they stream by."""
    path = bws.root / "handoffs" / ".meta" / "violations.jsonl"
    write_lines(path, violation_lines(1))
    command = [exe("handoff"), "violations", "--json", "--root", str(bws.root)]
    small = run_python(MEASURE, *command)
    rc, small_kib = map(int, small.stdout.split())
    assert rc == 0, small.stderr
    write_lines(path, violation_lines(60_000))
    big = run_python(MEASURE, *command)
    rc, big_kib = map(int, big.stdout.split())
    assert rc == 0, big.stderr
    assert big_kib - small_kib < 48 * 1024, (small_kib, big_kib)


# ---------------------------------------------------------------- PostgreSQL
def test_postgres_history_and_violations_through_the_commands(tmp_path: Path, pg_url: str) -> None:
    """On a shared store the database picks the newest rows (``ORDER BY seq DESC LIMIT``),
    skips a row no files log would read, and hands the violations out a page at a time."""
    from handoffd.backends.postgres import PostgresBackend
    from handoffd.backends.postgres import context as pgcontext
    space = new_workspace(tmp_path / "ws", CONFIG + f'\n[store]\nurl = "{pg_url}"\n')
    try:
        for n in range(4):
            space.handoff("context", "set", "notes", str(n), "--as", f"@w{n}", check=True)
        shown = space.handoff("context", "history", "--limit", "2", "--json", check=True)
        assert [e["by"] for e in json.loads(shown.stdout)] == ["@w2", "@w3"]
        assert "older writes not shown (--limit 2)" in shown.stderr
        backend = PostgresBackend(pg_url, pool_size=2)
        try:
            backend.violation_log().append(dict(VIOLATION, task_id="huge", big="x" * (300 << 10)))
            for n in range(pgcontext.PAGE + 5):
                backend.violation_log().append(dict(VIOLATION, task_id=f"t{n}"))
            context = backend.shared_context()
            assert [e["by"] for e in context.history("notes", limit=1)] == ["@w3"]
            assert context.latest(["notes"])["notes"]["by"] == "@w3"
        finally:
            backend.close()
        summary = json.loads(space.handoff("violations", "--json", "--limit", "1",
                                           check=True).stdout)
        assert summary["total"] == pgcontext.PAGE + 5  # the overlong row skipped, as on files
        assert [e["task_id"] for e in summary["recent"]] == [f"t{pgcontext.PAGE + 4}"]
        rows = json.loads(space.handoff("context", "ls", "--json", check=True).stdout)
        assert [(r["key"], r["written_by"]) for r in rows] == [("notes", "@w3")]
    finally:
        space.cleanup()

