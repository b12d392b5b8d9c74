"""The notifications' outbox journal, in-process: what a queued notice holds in memory (not its
document), the journal kept small, a left-over journal taken over by exactly one process, and
hostile journals (corrupt lines, a FIFO, a symlink, an oversized file) skipped with one log
line each, never a traceback or a stall. Also a command that leaves a ``setsid`` grandchild
holding its stderr: judged by its own exit status, not timed out.

The real-process cases (``kill -9`` of a daemon, two daemons restarting) are in
test_notify_outbox.py."""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import wait_until, whole_json_lines

from handoffd.core.config import NotifyRule
from handoffd.core.states import State
from handoffd.features.notify import Notifier, leftovers, outbox
from handoffd.features.notify import notifier as notifier_module
from handoffd.features.notify.notices import NOTICE_BYTES, fingerprint
from handoffd.features.notify.leftovers import read_journal
from handoffd.features.notify.outbox import Entry, Outbox

DOWN = "http://127.0.0.1:9/hook"  # (the discard port: nothing listens, the connection is refused)
RECORD = [sys.executable, "-c", "import os; open(os.path.join(os.environ['HANDOFFD_ROOT'], "
          "'got.txt'), 'a').write(os.environ['HANDOFF_ID'] + '\\n')"]


class StandIn(SimpleNamespace):
    """A stand-in engine: what filing, delivering and dead-lettering read. A handoff reads back
    in the state it was filed in (completed when it was never filed here) with ``document``,
    at the revision ``revisions`` gives it (none: no handoffd block)."""

    def get(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        doc: dict[str, Any] = {"handoff_id": handoff_id, "output": self.document}
        if handoff_id in self.revisions:
            doc["handoffd"] = {"revision": self.revisions[handoff_id]}
        return self.filed_in.get(handoff_id, State.COMPLETED), doc

    def filed_document(self, handoff_id: str) -> tuple[State, dict[str, Any]]:
        return self.get(handoff_id)


def notifier_for(root: Path, *rules: NotifyRule, document: str = "") -> Notifier:
    engine = StandIn(config=SimpleNamespace(on_filed=list(rules)), filed_in={}, revisions={},
                     document=document, settings=SimpleNamespace(durable=False),
                     ws=SimpleNamespace(root=root, meta=root / "meta",
                                        handoffs=root / "handoffs"))
    return Notifier(engine)  # type: ignore[arg-type]


def journals(root: Path) -> list[Path]:
    folder = root / "meta" / "notify"
    return sorted(folder.glob("*.jsonl")) if folder.is_dir() else []


def letters(root: Path) -> list[dict[str, Any]]:
    path = root / "meta" / "notify-dead-letters.jsonl"
    return whole_json_lines(path)


def got(root: Path) -> list[str]:
    path = root / "got.txt"
    return path.read_text().split() if path.exists() else []


def left_over(folder: Path, entries: list[Entry], *, name: str = "4242-00000000000000aa",
              extra: bytes = b"") -> Path:
    """A journal as a process that died would leave it (nobody holds its lock)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_bytes(b"".join(entry.line(seq) for seq, entry in enumerate(entries, 1)) + extra)
    return path


def entry(handoff_id: str, rule: NotifyRule, state: State = State.COMPLETED) -> Entry:
    return Entry(handoff_id, state, fingerprint(rule), 0, ("command",) if rule.command
                 else ("webhook",), "2026-11-24T12:00:00+00:00")


def test_a_queued_notice_holds_no_document(tmp_path: Path) -> None:
    """The first defect: each queued notice held its whole document (1,500 results of 1 MB took
    a daemon to 1.5 GB while its webhook was down). Now a notice holds a few hundred bytes and
    only the delivery under way holds its document: 1,500 notices about 1 MB documents hold
    about 1 MB in all (the counter), and Python's own allocations agree."""
    import tracemalloc
    megabyte = "x" * (1 << 20)
    notifier = notifier_for(tmp_path, NotifyRule(url=DOWN, retries=20, retry_delay_seconds=60),
                            document=megabyte)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(1500):
            notifier.filed(f"big-{n}", State.COMPLETED)
        wait_until(lambda: notifier.flights and notifier.flights[0].body, 10, "the first try")
        held = notifier.held_bytes()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(notifier.pending) == 1499
    per_notice = NOTICE_BYTES + outbox.LIVE_BYTES + 200  # (the notice, its record, its line)
    assert held < (1 << 20) + 100 + 1500 * per_notice, held
    assert grown < 16 << 20, f"queueing 1,500 notices grew Python's heap by {grown} bytes"
    assert notifier.drain(timeout=0.1) is False  # (dead-letters them: nothing is left behind)
    assert len(letters(tmp_path)) == 1500 and journals(tmp_path) == []


def test_the_journal_stays_small_and_is_removed_when_all_is_delivered(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "notify", durable=True)
    rule = NotifyRule(url=DOWN)
    for round_ in range(3):  # everything settled: the journal is truncated, not grown
        seqs = box.record([entry(f"h{round_}-{n}", rule) for n in range(50)])
        assert seqs is not None
        for seq in seqs:
            box.done(seq, ["webhook"])
        (path,) = list((tmp_path / "notify").glob("*.jsonl"))
        assert path.stat().st_size == 0
    keep = box.record([entry("kept", rule)])
    assert keep is not None
    for _ in range(40):  # one notice left while thousands come and go: rewritten, not grown
        seqs = box.record([entry(f"churn-{n}", rule) for n in range(100)])
        assert seqs is not None
        for seq in seqs:
            box.done(seq, ["webhook"])
    (path,) = list((tmp_path / "notify").glob("*.jsonl"))
    assert path.stat().st_size < outbox.COMPACT_BYTES + 64 * 1024
    with open(path, "rb") as fh:
        assert [e.handoff_id for e in read_journal(fh.fileno(), path.name)] == ["kept"]
    box.release()  # one left: kept
    assert list((tmp_path / "notify").glob("*.jsonl")) == [path]
    box.done(keep[0], ["webhook"])
    box.release()
    assert list((tmp_path / "notify").glob("*")) == []


def test_a_left_over_journal_is_delivered_and_removed(tmp_path: Path) -> None:
    """What a process that died left undelivered is delivered by the next sweep, the targets
    it finished are not delivered again, and the old journal is gone."""
    rule = NotifyRule(command=RECORD, url=DOWN, retries=0)
    notifier = notifier_for(tmp_path, rule)
    both = Entry("both", State.COMPLETED, fingerprint(rule), 0, ("command", "webhook"), "t")
    half = Entry("half", State.COMPLETED, fingerprint(rule), 0, ("command", "webhook"), "t")
    path = left_over(tmp_path / "meta" / "notify", [both, half],
                     extra=b'{"done":2,"kind":"command"}\n')
    assert notifier.take_over() == 2
    assert not path.exists()
    assert notifier.drain(timeout=20) is True
    assert got(tmp_path) == ["both"]  # "half" had its command done already
    assert sorted((letter["id"], letter["error"].split(":")[0]) for letter in letters(tmp_path)) \
        == [("both", "webhook"), ("half", "webhook")]  # (the webhook is down)
    assert journals(tmp_path) == []


def test_the_journal_of_a_live_process_is_not_taken(tmp_path: Path) -> None:
    rule = NotifyRule(command=RECORD)
    path = left_over(tmp_path / "meta" / "notify", [entry("alive", rule)])
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # its process lives
        notifier = notifier_for(tmp_path, rule)
        assert notifier.take_over() == 0 and path.exists() and not notifier.pending
    finally:
        os.close(fd)
    assert notifier.take_over() == 1 and not path.exists()
    assert notifier.drain(timeout=20) is True and got(tmp_path) == ["alive"]


def test_each_left_over_notice_is_taken_by_exactly_one_process(tmp_path: Path) -> None:
    """Eight outboxes (as eight daemons would) take over twenty left-over journals at once:
    every notice is taken, none twice."""
    folder = tmp_path / "notify"
    rule = NotifyRule(url=DOWN)
    expected = []
    for j in range(20):
        ids = [f"j{j}-{n}" for n in range(5)]
        expected += ids
        left_over(folder, [entry(i, rule) for i in ids], name=f"{1000 + j}-{j:016x}")
    taken: list[str] = []
    start = threading.Barrier(8)

    def daemon() -> None:
        box = Outbox(folder, durable=False)

        def take(entries: list[Entry], name: str) -> bool:
            assert box.record(entries) is not None
            taken.extend(e.handoff_id for e in entries)
            return True

        start.wait(10)
        leftovers.take_over(box, take)

    threads = [threading.Thread(target=daemon) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(taken) == sorted(expected)  # each exactly once


def test_hostile_journals_are_skipped_with_one_line_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Corrupt lines (not JSON, too long, nested, an unsafe id, a bad state, a torn end), a FIFO
    and a symlink named like journals, and a journal larger than the bound: the good notices
    are delivered, each bad journal gets one warning, nothing blocks or raises."""
    rule = NotifyRule(command=RECORD, retries=0)
    folder = tmp_path / "meta" / "notify"
    good = [entry("good-1", rule), entry("good-2", rule), entry("was-retried", rule, State.FAILED)]
    bad_lines = b"".join([
        b"not json at all\n", b"\x00\xff\xfe binary\n",
        b'{"n": 9, "id": "x"' + b" " * 9000 + b"}\n",
        b"[" * 5000 + b"]" * 5000 + b"\n", b'"a string"\n', b'{"done": "x", "kind": "webhook"}\n',
        entry("../../etc/passwd", rule).line(20).replace(b"../../etc/passwd", b"../../etc/pw"),
        entry("bad-state", rule).line(21).replace(b'"completed"', b'"pending"'),
        entry("good-1", rule).line(1),  # a number used twice
        b'{"n": 30, "id": "torn", "state": "comp',  # (its process died writing it)
    ])
    left_over(folder, good, extra=bad_lines)
    os.mkfifo(folder / "4243-00000000000000bb.jsonl")
    (folder / "4244-00000000000000cc.jsonl").symlink_to("/dev/zero")
    monkeypatch.setattr(leftovers, "MAX_JOURNAL_BYTES", 64 * 1024)
    huge = folder / "4245-00000000000000dd.jsonl"
    huge.write_bytes(entry("in-huge", rule).line(1) + b"x" * 200_000 + b"\n")
    notifier = notifier_for(tmp_path, rule)
    caplog.set_level(logging.WARNING, logger="handoffd")
    done = threading.Event()
    threading.Thread(target=lambda: (notifier.take_over(), done.set()), daemon=True).start()
    assert done.wait(10), "taking over hostile journals stalled"  # (the FIFO: never opened)
    assert notifier.drain(timeout=20) is True
    assert sorted(got(tmp_path)) == ["good-1", "good-2", "in-huge"]
    (gone,) = letters(tmp_path)  # filed as failed, completed since: no copy of what was filed
    assert gone["id"] == "was-retried" and "filed document is gone" in gone["error"]
    warnings = [r.getMessage() for r in caplog.records if "notification outbox" in r.getMessage()]
    assert len([w for w in warnings if "4242-" in w and "skipped 10 line(s)" in w]) == 1, warnings
    assert len([w for w in warnings if "4243-" in w and "left alone" in w]) == 1, warnings
    assert len([w for w in warnings if "4244-" in w and "left alone" in w]) == 1, warnings
    # (larger than one sweep reads: the rest is kept for the next sweeps, renamed, not dropped)
    assert len([w for w in warnings if "4245-" in w and "the rest is kept" in w]) == 1, warnings
    assert not any(r.exc_info for r in caplog.records)
    assert (folder / "4243-00000000000000bb.jsonl").exists()  # left alone, never opened
    for _ in range(10):  # the next sweeps: the FIFO said once, not at every sweep
        notifier.take_over()
    assert len([r for r in caplog.records if "4243-" in r.getMessage()]) == 1
    assert not list(folder.glob("4245-*")), "the rest of the large journal was not taken"
    assert notifier.drain(timeout=20) is True and sorted(got(tmp_path)).count("in-huge") == 1


def test_a_notice_whose_rule_is_gone_is_dead_lettered(tmp_path: Path) -> None:
    old = NotifyRule(command=[sys.executable, "-c", "pass", "old"])
    left_over(tmp_path / "meta" / "notify", [entry("orphan", old)])
    notifier = notifier_for(tmp_path, NotifyRule(command=RECORD))
    assert notifier.take_over() == 1
    assert notifier.drain(timeout=5) is True
    (letter,) = letters(tmp_path)
    assert letter["id"] == "orphan" and "no longer in handoffd.toml" in letter["error"]
    assert got(tmp_path) == []


def test_an_unwritable_outbox_still_delivers_from_memory(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "notify").symlink_to(tmp_path)  # never written through
    notifier = notifier_for(tmp_path, NotifyRule(command=RECORD))
    caplog.set_level(logging.ERROR, logger="handoffd")
    notifier.filed("h1", State.COMPLETED)
    notifier.filed("h2", State.COMPLETED)
    assert notifier.drain(timeout=20) is True
    assert sorted(got(tmp_path)) == ["h1", "h2"]
    assert len([r for r in caplog.records if "cannot record notifications" in r.getMessage()]) == 1


def grandchild_command(pid_file: Path, code: int) -> list[str]:
    """A command that starts a setsid grandchild holding its stderr, then exits ``code``."""
    script = ("import subprocess, sys\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
              " start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "sys.stderr.write('boom\\n'); sys.stderr.flush()\n"
              f"sys.exit({code})\n")
    return [sys.executable, "-c", script]


@pytest.mark.parametrize("code", [0, 3])
def test_a_command_is_judged_by_its_exit_not_by_a_grandchild_holding_its_stderr(
        tmp_path: Path, code: int) -> None:
    """The third defect: a command whose setsid grandchild kept its stderr open was counted as
    timed out although it had exited 0. Its pipes now get a short grace after it exits."""
    pid_file = tmp_path / f"grandchild-{code}.pid"
    notifier = notifier_for(tmp_path, NotifyRule(command=grandchild_command(pid_file, code),
                                                 retries=0, timeout_seconds=30))
    try:
        notifier.filed("g1", State.COMPLETED)
        assert notifier.drain(timeout=25) is True
        found = letters(tmp_path)
        if code == 0:
            assert found == []
        else:
            (letter,) = found
            assert "exited 3: boom" in letter["error"] and "timed out" not in letter["error"]
            assert "may have been delivered" not in letter["error"]
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # (the grandchild we started)


def test_a_journal_its_maker_died_making_is_removed_once_stale(tmp_path: Path) -> None:
    """A new journal is made under a temp name (locked before it is renamed into place); one
    left by a process that died making it is removed by a sweep, not while it may be made."""
    folder = tmp_path / "meta" / "notify"
    folder.mkdir(parents=True)
    stale = folder / ".77-00000000000000ee.jsonl.new"
    fresh = folder / ".78-00000000000000ff.jsonl.new"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    old = time.time() - leftovers.STALE_TEMP_SECONDS - 5
    os.utime(stale, (old, old))
    notifier = notifier_for(tmp_path, NotifyRule(command=RECORD))
    assert notifier.take_over() == 0
    assert not stale.exists() and fresh.exists()


# ---------------------------------------------------------------- the review of the outbox
# (fourth session): a notice lost past QUEUE_LIMIT, a later filing delivered in place of the one
# a notice is about, a forked child delivering its parent's notices, and names that cannot be
# taken hiding a left-over journal.

def test_a_left_over_journal_past_the_queue_limit_loses_no_notice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal left with more notices than QUEUE_LIMIT (a daemon killed with its queue full
    and one in flight): its reading stopped at QUEUE_LIMIT and the journal was removed, so the
    rest were neither delivered nor dead-lettered. Now every notice is taken: those the queue
    has no room for are dead-lettered at once, saying so."""
    monkeypatch.setattr(notifier_module, "QUEUE_LIMIT", 5)
    rule = NotifyRule(command=RECORD, retries=0)
    ids = [f"n{n}" for n in range(8)]
    path = left_over(tmp_path / "meta" / "notify", [entry(i, rule) for i in ids])
    notifier = notifier_for(tmp_path, rule)
    assert notifier.take_over() == 8
    assert not path.exists()
    assert notifier.drain(timeout=20) is True
    full = [letter["id"] for letter in letters(tmp_path)
            if "the notification queue is full" in letter["error"]]
    assert len(got(tmp_path)) == 5 and len(full) == 3
    assert sorted(got(tmp_path) + full) == sorted(ids)  # each delivered or dead-lettered, once


def test_a_journal_larger_than_one_sweep_reads_is_taken_in_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A journal past MAX_JOURNAL_BYTES (none handoffd writes is): what one sweep reads is
    taken, the rest kept for the next sweeps (renamed to say where it starts), never dropped."""
    monkeypatch.setattr(leftovers, "MAX_JOURNAL_BYTES", 8192)
    caplog.set_level(logging.WARNING, logger="handoffd")
    rule = NotifyRule(url=DOWN)
    folder = tmp_path / "notify"
    ids = [f"part-{n:03d}" for n in range(200)]  # about 40 KB of lines
    left_over(folder, [entry(i, rule) for i in ids], name="4250-00000000000000ee")
    box = Outbox(folder, durable=False)
    taken: list[str] = []

    def take(entries: list[Entry], name: str) -> bool:
        assert box.record(entries) is not None
        taken.extend(e.handoff_id for e in entries)
        return True

    sweeps = 0
    while list(folder.glob("4250-*")) and sweeps < 20:
        leftovers.take_over(box, take)
        sweeps += 1
    assert not list(folder.glob("4250-*")) and sweeps > 1
    assert sorted(taken) == ids  # each once, none lost
    assert len([r for r in caplog.records if "the rest is kept" in r.getMessage()]) == sweeps - 1


RECORD_FILING = [sys.executable, "-c", """
import json, os, sys, time
doc = json.load(sys.stdin)
root, handoff = os.environ['HANDOFFD_ROOT'], os.environ['HANDOFF_ID']
gate, deadline = os.path.join(root, 'open'), time.monotonic() + 60
while handoff == 'busy' and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.01)
revision = (doc.get('handoffd') or {}).get('revision')
open(os.path.join(root, 'got.txt'), 'a').write(f"{handoff}@{revision}\\n")
"""]


def test_a_notice_delivers_the_filing_it_is_about(tmp_path: Path) -> None:
    """A handoff that failed, was retried by hand and failed again before its first notice was
    delivered: both notices delivered the second failure (the document was read at delivery and
    only its state compared), the first never arrived. Each notice now carries the revision it
    was filed at: a later filing is delivered only by its own notice; the earlier one comes
    from its archived copy, or is dead-lettered as superseded."""
    rule = NotifyRule(command=RECORD_FILING, retries=0, timeout_seconds=60)
    notifier = notifier_for(tmp_path, rule)
    engine: Any = notifier.engine  # (the stand-in)
    engine.filed_in.update(superseded=State.FAILED, archived=State.FAILED)
    revisions = engine.revisions
    notifier.filed("busy", State.COMPLETED)  # held until the gate opens: the others wait
    revisions.update(superseded=3, archived=2)
    notifier.filed("superseded", State.FAILED)
    notifier.filed("archived", State.FAILED)
    from handoffd.features.archive import append_archive
    archived_filing = {"handoff_id": "archived", "handoffd": {"revision": 2}}
    append_archive(engine.ws, [(State.FAILED, "archived", archived_filing)],
                   datetime.now(timezone.utc))
    revisions.update(superseded=5, archived=4)  # retried, and failed again
    notifier.filed("superseded", State.FAILED)
    notifier.filed("archived", State.FAILED)
    (tmp_path / "open").touch()
    assert notifier.drain(timeout=30) is True
    assert sorted(got(tmp_path)) == ["archived@2", "archived@4", "busy@None", "superseded@5"]
    (letter,) = letters(tmp_path)
    assert letter["id"] == "superseded" and "superseded" in letter["error"] \
        and "revision 5; this notice is about revision 3" in letter["error"], letter


def test_journal_lines_carry_the_revision_and_old_lines_are_read(tmp_path: Path) -> None:
    rule = NotifyRule(url=DOWN)
    new = Entry("new", State.FAILED, fingerprint(rule), 0, ("webhook",), "t", 7)
    old = entry("old", rule)  # (a line written before revisions were recorded has none)
    assert b'"revision":7' in new.line(1) and b"revision" not in old.line(2)
    path = left_over(tmp_path, [new, old])
    with open(path, "rb") as fh:
        assert [(e.handoff_id, e.revision) for e in read_journal(fh.fileno(), path.name)] \
            == [("new", 7), ("old", None)]


def forked(child: Any, timeout: float = 15) -> int:
    """Run ``child()`` in a forked child of this process: its exit code (killed past
    ``timeout``: it hung)."""
    pid = os.fork()
    if pid == 0:  # (the child never returns into pytest)
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # (the child we forked)
    os.waitpid(pid, 0)
    return -1


def test_a_forked_child_leaves_its_parents_notices_alone(tmp_path: Path) -> None:
    """A program that files (a client cancelling handoffs) then forks: the child inherited the
    queue and the atexit drain, delivered the parent's queued notice again, dead-lettered the
    one in flight and waited for it. Now the child starts with nothing queued, new locks (the
    fork happens here while another thread holds the notifier's lock), and its own notices."""
    notifier = notifier_for(tmp_path, NotifyRule(command=RECORD_FILING, retries=0,
                                                 timeout_seconds=60))
    notifier.filed("busy", State.COMPLETED)  # in flight until the gate opens
    notifier.filed("queued", State.COMPLETED)
    wait_until(lambda: notifier.flights, 10, "the first notice in flight")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with notifier.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)

    def child() -> int:
        inherited = bool(notifier.pending or notifier.flights or notifier.running)
        notifier.filed("child", State.COMPLETED)  # its own notice: delivered by itself
        drained = notifier.drain(timeout=10)  # (what its atexit does)
        return (1 if inherited else 0) | (0 if drained else 2) | (4 if letters(tmp_path) else 0)

    try:
        code = forked(child)
    finally:
        release.set()
        holder.join(10)
    assert code == 0, f"the child: {code} (1 inherited, 2 not drained, 4 dead letters; -1 hung)"
    assert got(tmp_path) == ["child@None"]
    (tmp_path / "open").touch()
    assert notifier.drain(timeout=30) is True
    assert sorted(got(tmp_path)) == ["busy@None", "child@None", "queued@None"]
    assert letters(tmp_path) == [] and journals(tmp_path) == []


def test_names_it_cannot_take_never_hide_a_left_over_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Names like journals that no sweep can take (folders, a FIFO, journals of live
    processes) counted against JOURNALS_PER_SWEEP and came first at every sweep: a left-over
    journal behind them was never taken over, and each unusable name was logged at every
    process's start. Now only journals taken count, the scan goes on where the last one
    stopped (past SCAN_LIMIT names too), and a name is said once, a few per sweep."""
    monkeypatch.setattr(leftovers, "SCAN_LIMIT", 6)
    monkeypatch.setattr(leftovers, "JOURNALS_PER_SWEEP", 2)
    caplog.set_level(logging.WARNING, logger="handoffd")
    rule = NotifyRule(command=RECORD, retries=0)
    folder = tmp_path / "meta" / "notify"
    real = left_over(folder, [entry("hidden", rule)])
    live = [left_over(folder, [entry(f"live-{n}", rule)], name=f"{5000 + n}-{n:016x}")
            for n in range(3)]
    fds = [os.open(path, os.O_RDONLY) for path in live]
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_EX)  # their processes live
    os.mkfifo(folder / "5100-00000000000000ff.jsonl")
    junk = 0
    while [item.name for item in os.scandir(folder)].index(real.name) < 12 or junk < 12:
        (folder / f"{900000 + junk}-{junk:016x}.jsonl").mkdir()  # (listed before it)
        junk += 1
    names = len(os.listdir(folder))
    notifier = notifier_for(tmp_path, rule)
    try:
        for _ in range(-(-names // leftovers.SCAN_LIMIT) + 2):  # once round the folder
            notifier.take_over()
        assert not real.exists(), "the left-over journal was never taken over"
        assert all(path.exists() for path in live)
        for _ in range(2 * names):  # round again, and again: nothing said twice
            notifier.take_over()
    finally:
        for fd in fds:
            os.close(fd)
    assert notifier.drain(timeout=20) is True and got(tmp_path) == ["hidden"]
    said = [r.getMessage() for r in caplog.records
            if "not a journal handoffd wrote" in r.getMessage() or "more name(s)" in r.getMessage()]
    for number in range(junk):
        assert len([line for line in said if f"{900000 + number}-" in line]) <= 1, said
    assert len([line for line in said if "5100-" in line]) <= 1, said
    assert not any("live-" in r.getMessage() for r in caplog.records)


def test_a_name_with_an_offset_past_its_end_never_ends_the_sweep(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`1-0123456789abcdef+999999999999999.jsonl`: seeking there raised EINVAL out of the whole
    take-over, at every sweep, and the journals behind it were never taken."""
    caplog.set_level(logging.WARNING, logger="handoffd")
    rule = NotifyRule(command=RECORD, retries=0)
    folder = tmp_path / "meta" / "notify"
    hostile = left_over(folder, [entry("bait", rule)], name="1-0123456789abcdef+999999999999999")
    real = [left_over(folder, [entry(f"real-{n}", rule)], name=f"{7000 + n}-{n:016x}")
            for n in range(3)]
    notifier = notifier_for(tmp_path, rule)
    for _ in range(3):
        notifier.take_over()
    assert notifier.drain(timeout=20) is True
    assert sorted(got(tmp_path)) == ["real-0", "real-1", "real-2"]
    assert not any(path.exists() for path in real) and hostile.exists()
    said = [r.getMessage() for r in caplog.records if hostile.name in r.getMessage()]
    assert len(said) == 1 and "past its end" in said[0], said


def test_a_journal_that_cannot_be_opened_now_is_taken_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open that failed for a passing reason (EMFILE at the descriptor limit) marked the
    journal as 'not a journal handoffd wrote' for the process's whole life: a serving daemon
    never delivered it. Only a name that is no regular file is remembered so."""
    import errno
    rule = NotifyRule(command=RECORD, retries=0)
    folder = tmp_path / "meta" / "notify"
    path = left_over(folder, [entry("later", rule)])
    notifier = notifier_for(tmp_path, rule)
    real_open = leftovers.open_regular

    def out_of_descriptors(name: Any, flags: int, mode: int = 0o644) -> int:
        raise OSError(errno.EMFILE, "Too many open files", str(name))

    monkeypatch.setattr(leftovers, "open_regular", out_of_descriptors)
    notifier.take_over()
    assert path.exists()
    monkeypatch.setattr(leftovers, "open_regular", real_open)
    notifier.take_over()
    assert notifier.drain(timeout=20) is True and got(tmp_path) == ["later"]
    assert not path.exists()
