"""Retention, driven as an operator would: `handoff purge` / `handoff archive` with their dry runs
and filters, what is never removed (what live work depends on, parents of live children), dedup
after a purge, `handoff show` reading the archive, and a serving daemon applying [retention]."""
from __future__ import annotations

import gzip
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from conftest import FLAKY_TOML, Workspace

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.archive import append_archive, archived


def finished(ws: Workspace, *modes: str) -> list[str]:
    ids = [ws.create("--to", "@flaky", "--data", json.dumps({"mode": m})) for m in modes]
    ws.handoffd("run")
    return ids


@pytest.mark.heavy
def test_purge_dry_run_filters_and_protection(ws: Workspace) -> None:
    done, dep, parent, bad = finished(ws, "ok", "ok", "ok", "permanent")
    waiting = ws.create("--to", "@nobody", "--depends-on", dep)  # live work depending on `dep`
    ws.drop("child-1.json", {"handoff_id": "child-1", "source": {"agent_id": "@x"},
                             "target": {"agent_id": "@nobody"}, "parent_id": parent,
                             "input": {"data": None}})
    time.sleep(2.1)  # the finished ones are now older than 2s
    fresh = finished(ws, "ok")[0]  # (the run also takes in the dropped child; nobody runs it)
    dry = json.loads(ws.handoff("purge", "--older-than", "2s", "--dry-run", "--json",
                                check=True).stdout)
    # (`fresh` joins them only when the machine is slow enough for it to age 2 s meanwhile)
    assert {done, bad} <= {r["id"] for r in dry["removed"]} <= {done, bad, fresh}
    assert dep in dry["kept"] and "depends on it" in dry["kept"][dep]
    assert parent in dry["kept"] and "parent of pending child-1" == dry["kept"][parent]
    assert ws.state_of(done) == ["completed"]  # a dry run removes nothing
    only_failed = ws.handoff("purge", "--older-than", "2s", "--state", "failed", check=True)
    assert f"purged failed/{bad}" in only_failed.stdout and ws.state_of(bad) == []
    assert ws.state_of(done) == ["completed"]
    young = json.loads(ws.handoff("purge", "--older-than", "1h", "--json", check=True).stdout)
    assert young["removed"] == [] and ws.state_of(fresh) == ["completed"]  # none is an hour old
    everything = ws.handoff("purge", "--older-than", "2s", check=True).stdout
    assert f"purged completed/{done}" in everything and "kept 2" in everything
    assert ws.state_of(done) == []
    assert ws.state_of(dep) == ["completed"] and ws.state_of(parent) == ["completed"]
    assert ws.state_of(waiting) == ["pending"]
    again = ws.handoff("create", "--to", "@flaky", "--id", done)  # dedup outlives the document
    assert again.returncode != 0 and "was used within" in again.stderr
    assert ws.handoff("show", done).returncode == 3  # purged: gone for good
    bad_age = ws.handoff("purge", "--older-than", "soon")
    assert bad_age.returncode == 2 and "--older-than" in bad_age.stderr


def test_archive_then_show(ws: Workspace) -> None:
    done, failed = finished(ws, "ok", "permanent")
    time.sleep(1.1)
    out = ws.handoff("archive", "--older-than", "1s", check=True).stdout
    assert "archived 2 handoff(s) into" in out and ".archive" in out
    assert ws.state_of(done) == [] and ws.state_of(failed) == []
    shown = json.loads(ws.handoff("show", done, "--json", check=True).stdout)
    assert shown["archived"] is True and shown["state"] == "completed"
    assert shown["document"]["output"]["echo"] == {"mode": "ok"}
    human = ws.handoff("show", failed, check=True).stdout
    assert "state: failed" in human and "archived at" in human
    # `handoff wait` of a handoff archived meanwhile ends as a finished one (it said "no such
    # handoff", exit 3): its archived answer, its exit code
    waited = ws.handoff("wait", done, "--timeout", "5")
    assert waited.returncode == 0 and waited.stdout.strip() == f"{done} completed", waited.stderr
    assert ws.handoff("wait", failed, "--timeout", "5").returncode == 1
    files = list((ws.root / "handoffs" / ".archive").glob("*.jsonl.gz"))
    assert len(files) == 1
    lines = gzip.decompress(files[0].read_bytes()).decode().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == sorted([done, failed])


def test_a_torn_archive_member_loses_only_itself(tmp_path: Path) -> None:
    ws = HandoffdWorkspace(tmp_path)
    now = utc_now()
    path = append_archive(ws, [(State.COMPLETED, "a", {"x": 1})], now)
    append_archive(ws, [(State.COMPLETED, "b", {"x": 2})], now)
    path.write_bytes(path.read_bytes()[:-7])  # a crash in the middle of the second append
    assert [e["id"] for e in archived(ws)] == ["a"]


def test_daemon_applies_retention(ws: Workspace) -> None:
    ws.write_config(FLAKY_TOML + '\n[retention]\ncompleted = "1s"\nmode = "archive"\nevery = "1s"\n')
    daemon = ws.serve()
    try:
        kept = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
        hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
        ws.wait_state(kept, ("failed",))
        deadline = time.monotonic() + 30  # completed, then archived a second later or so
        while not (ws.root / "handoffs" / ".archive").exists() or ws.state_of(hid):
            assert time.monotonic() < deadline, ws.state_of(hid)
            time.sleep(0.1)
        assert ws.state_of(hid) == []  # archived by the daemon's sweep
        assert ws.state_of(kept) == ["failed"]  # no failed = ...: failures are kept
    finally:
        assert ws.stop(daemon) == 0
    shown = json.loads(ws.handoff("show", hid, "--json", check=True).stdout)
    assert shown["archived"] is True
    events = [json.loads(x) for x in
              (ws.root / "handoffs" / ".meta" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["id"] == hid][-1] == "purged"


def test_the_archive_is_never_followed_out_nor_waited_on(ws: Workspace, tmp_path: Path) -> None:
    """Found by the second bug hunt: a symlink at today's archive file (or at .archive) led
    `handoff archive` to append the documents outside the workspace; a FIFO there froze the
    sweep and `handoff show` of any id; a symlink to /dev/zero made show read without end."""
    done = finished(ws, "ok")[0]
    time.sleep(1.1)
    folder = ws.root / "handoffs" / ".archive"
    folder.mkdir(parents=True, exist_ok=True)
    today = folder / f"{utc_now():%Y-%m-%d}.jsonl.gz"
    outside = tmp_path / "outside.gz"
    outside.write_bytes(b"")
    today.symlink_to(outside)
    proc = ws.handoff("archive", "--older-than", "1s", timeout=30)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert outside.read_bytes() == b"" and ws.state_of(done) == ["completed"]  # nothing lost
    for make in (lambda p: p.symlink_to("/dev/zero"), lambda p: os.mkfifo(p)):
        today.unlink()
        make(today)
        shown = ws.handoff("show", "no-such-id", timeout=30)
        assert shown.returncode == 3 and "Traceback" not in shown.stderr, shown.stderr
    today.unlink()
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder.symlink_to(elsewhere)
    proc = ws.handoff("archive", "--older-than", "1s", timeout=30)
    assert proc.returncode != 0 and list(elsewhere.iterdir()) == [], proc.stderr


def test_a_gzip_bomb_in_the_archive_is_passed_over_quickly(tmp_path: Path) -> None:
    """200 MB of zeros in 200 KB: read as an archive, it expands hundreds of times over what
    handoffd's JSON does; the file is passed over instead of decompressed (the whole of it, a
    line of zeros, took 45 s and growing memory), and a real archive beside it still reads."""
    ws = HandoffdWorkspace(tmp_path)
    append_archive(ws, [(State.COMPLETED, "a", {"x": 1})], utc_now())
    bomb = tmp_path / "handoffs" / ".archive" / "2000-01-01.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as fh:
        for _ in range(200):
            fh.write(bytes(1 << 20))
    assert [e["id"] for e in archived(ws)] == ["a"]  # (pytest-timeout bounds it)


def test_appends_after_a_torn_member_stay_readable(tmp_path: Path) -> None:
    """Found by the fourth session's retention hunt: after a torn member (a crash or kill -9
    mid-append), the next `handoff archive` appended after the tear; the reader fed that
    member's header into the torn one's decompressor and stopped, so every handoff archived
    afterwards (and already deleted) was found nowhere. The reader now skips to the next
    member after a tear, and an append after a torn tail goes to the day's next file."""
    from handoffd.features.archive import find_archived
    ws = HandoffdWorkspace(tmp_path)
    now = utc_now()
    path = append_archive(ws, [(State.COMPLETED, "a", {"x": 1})], now)
    append_archive(ws, [(State.COMPLETED, "b", {"x": 2})], now)
    path.write_bytes(path.read_bytes()[:-7])  # a crash in the middle of the second append
    later = append_archive(ws, [(State.COMPLETED, "c", {"x": 3}), (State.FAILED, "d", {"x": 4})],
                           now)
    assert later != path and later.name.endswith("-1.jsonl.gz")  # never appended after a tear
    assert sorted(e["id"] for e in archived(ws)) == ["a", "c", "d"]
    found = find_archived(ws, "d")
    assert found is not None and found["document"] == {"x": 4}


def test_an_archive_file_over_a_read_chunk_is_read_whole_and_once(tmp_path: Path) -> None:
    """Found by the retention hunt: at a member's end the reader took the decompressor's
    unconsumed tail and its unused data, the same bytes twice; past 1 MiB a read then ended
    inside the doubled bytes and everything after was lost (3,000 of 18,000 entries)."""
    import hashlib
    ws = HandoffdWorkspace(tmp_path)
    now = utc_now()
    count = 0
    for batch in range(8):  # compressible, as documents are: the decompressor fills its output
        docs = []           # limit and keeps input back, which is where the bytes were doubled
        for i in range(3000):
            hid = f"hoff-{batch}-{i}"
            docs.append((State.COMPLETED, hid, {"handoff_id": hid, "status": "completed",
                                                "digest": hashlib.sha256(hid.encode()).hexdigest(),
                                                "output": {"summary": "done " * 20}}))
        append_archive(ws, docs, now)
        count += len(docs)
    (path,) = (ws.handoffs / ".archive").glob("*.jsonl.gz")
    assert path.stat().st_size > 1024 * 1024
    ids = [e["id"] for e in archived(ws)]
    assert len(ids) == count and len(set(ids)) == count


def test_the_newest_entry_of_a_handoff_archived_twice_is_shown(tmp_path: Path) -> None:
    """Found by the retention hunt: a failure archived, then retried, completed and archived
    again: `handoff show` gave the old failure (the first match in the file)."""
    from handoffd.features.archive import find_archived
    ws = HandoffdWorkspace(tmp_path)
    now = utc_now()
    append_archive(ws, [(State.FAILED, "x", {"status": "failed"})], now)
    append_archive(ws, [(State.COMPLETED, "x", {"status": "completed"})], now)
    found = find_archived(ws, "x")
    assert found is not None and found["state"] == "completed"


def test_a_document_filed_again_while_being_purged_is_kept(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry filed again in the instant the purge compares the document with what it archived
    (here: as that comparison reads it) keeps its new document: the compare and the delete are
    one step. The earlier look-then-delete removed it, the archive holding only the old one."""
    from handoffd import build_engine
    from handoffd.backends.files import fsio
    from handoffd.features import retention
    from handoffd.features.archive import find_archived
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    engine = build_engine(ws)
    engine.backend.create({"handoff_id": "r1", "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@a"}, "input": {"data": {}}}, "r1", utc_now())
    held = engine.backend.claim("r1", utc_now(), 60)
    assert held is not None
    assert engine.backend.finish(held, State.FAILED, dict(held.doc, status="failed"))
    path = ws.doc_path(State.FAILED, "r1")
    refiled = dict(json.loads(path.read_text()), note="filed again")  # the retry's new failure
    real_append, real_read = retention.append_archive, fsio.read_bytes_safely
    armed = []

    def append(*args: Any, **kwargs: Any) -> Path:
        armed.append(True)  # listed and archived: the purge's own reads come next
        return real_append(*args, **kwargs)

    def read(target: Path, *args: Any, **kwargs: Any) -> Any:
        got = real_read(target, *args, **kwargs)
        if armed and Path(target).name == "r1.json":
            armed.clear()
            path.write_text(json.dumps(refiled))
        return got

    monkeypatch.setattr(retention, "append_archive", append)
    monkeypatch.setattr(fsio, "read_bytes_safely", read)
    later = utc_now() + timedelta(days=30)
    retention.expire(engine, older_than={State.FAILED: 1.0}, now=later, archive=True)
    assert json.loads(path.read_text()) == refiled  # the new failure is still filed
    assert not list((ws.meta / "aside").rglob("*.json"))  # nothing left aside
    monkeypatch.setattr(retention, "append_archive", real_append)
    result = retention.expire(engine, older_than={State.FAILED: 1.0}, now=later, archive=True)
    assert result.removed == [("r1", "failed")] and not path.exists()  # archived, then purged
    found = find_archived(ws, "r1")
    assert found is not None and found["document"]["note"] == "filed again"
    engine.backend.close()


def test_a_document_a_dead_mover_left_aside_is_put_back(tmp_path: Path) -> None:
    """A purge or move killed between setting a document aside and deleting it: the sweep puts
    it back, quarantines it (never deletes it) if another copy was filed meanwhile, and
    quarantines what is not a document at all."""
    from handoffd.backends.files import aside
    from handoffd.backends.files.store import Store
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    store = Store(ws)
    for name, state in (("a1", State.COMPLETED), ("a2", State.FAILED), ("a3", State.PENDING)):
        (aside.folder(store, state) / f"{name}.json").write_text(
            json.dumps({"handoff_id": name, "status": state.value}))
    os.mkfifo(aside.folder(store, State.FAILED) / "odd.json")
    ws.doc_path(State.FAILED, "a2").write_text(json.dumps({"handoff_id": "a2", "status": "x"}))
    assert aside.restore(store, time.time() - 60) == []  # too young: its mover may be at work
    # (a2 has a copy in failed/: its mover wrote the new one, so the one aside is the old one)
    assert sorted(aside.restore(store, time.time() + 1)) == ["completed/a1.json", "pending/a3.json"]
    assert json.loads(ws.doc_path(State.COMPLETED, "a1").read_text())["status"] == "completed"
    assert json.loads(ws.doc_path(State.PENDING, "a3").read_text())["status"] == "pending"
    assert json.loads(ws.doc_path(State.FAILED, "a2").read_text())["status"] == "x"
    kept = {q["file"]: q["code"] for q in store.quarantined()}
    assert kept == {"a2.json": "DUPLICATE_HANDOFF_ID", "odd.json": "UNPROCESSABLE_DOCUMENT"}
    assert not list((ws.meta / "aside").rglob("*.json"))


def test_a_symlinked_aside_folder_is_refused(tmp_path: Path) -> None:
    """Found by the retention hunt: `.meta/purging` planted as a symlink made purges rename
    documents outside the workspace, and the sweep pull files from there into failed/."""
    from handoffd.backends.files import aside
    from handoffd.backends.files.store import Store
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    store = Store(ws)
    outside = tmp_path / "outside"
    (outside / "failed").mkdir(parents=True)
    (outside / "failed" / "planted.json").write_text("{}")
    ws.meta.mkdir(parents=True, exist_ok=True)
    (ws.meta / "aside").symlink_to(outside)
    ws.doc_path(State.FAILED, "f1").write_text(json.dumps({"handoff_id": "f1"}))
    with pytest.raises(OSError, match="a symlink"):
        store.remove_if(State.FAILED, "f1", {"handoff_id": "f1"})
    assert ws.doc_path(State.FAILED, "f1").exists()
    assert aside.restore(store, time.time() + 1) == []
    assert (outside / "failed" / "planted.json").exists() and not ws.doc_path(State.FAILED, "planted").exists()

def test_a_finished_child_of_a_waiting_parent_is_kept(ws: Workspace) -> None:
    """Found by the context/fan-out hunt: a purge took a fan-out's finished child while the
    parent still waited for its sibling; the parent then reported it as missing."""
    ws.create("--to", "@nobody", "--id", "P")  # the live parent (nobody serves it)
    ws.drop("P.c1.json", {"handoff_id": "P.c1", "source": {"agent_id": "@x"},
                          "target": {"agent_id": "@flaky"}, "parent_id": "P",
                          "input": {"data": {"mode": "ok"}}})
    done = finished(ws, "ok")[0]
    assert ws.state_of("P.c1") == ["completed"]
    out = json.loads(ws.handoff("purge", "--older-than", "0s", "--json", check=True).stdout)
    assert out["kept"]["P.c1"] == "child of pending P"
    assert ws.state_of("P.c1") == ["completed"] and ws.state_of(done) == []


def _finished_engine(tmp_path: Path, count: int, toml: str = "",
                     prefix: str = "old") -> tuple[Any, list[str]]:
    """An engine over a workspace holding ``count`` completed handoffs, and a clock two days on
    (so that every one of them is old)."""
    from handoffd import build_engine
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    (tmp_path / "handoffd.toml").write_text(toml)
    later = utc_now() + timedelta(days=2)
    engine = build_engine(ws, ws.load_config(), clock=lambda: later)
    ids = [f"{prefix}-{i}" for i in range(count)]
    for hid in ids:
        engine.backend.create({"handoff_id": hid, "source": {"agent_id": "@o"},
                               "target": {"agent_id": "@a"}, "input": {"data": {}}}, hid, utc_now())
        held = engine.backend.claim(hid, utc_now(), 60)
        assert held is not None and engine.backend.finish(held, State.COMPLETED, held.doc)
    return engine, ids


def test_a_daemon_retention_pass_is_bounded_and_the_next_sweep_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the retention hunt: one pass over 50,000 old documents held the serving
    daemon's loop (no claim for 12 s) and made `run --max-seconds 1` overrun by seconds."""
    from handoffd.features import retention
    monkeypatch.setattr(retention, "PASS_LIMIT", 2)
    engine, ids = _finished_engine(tmp_path, 5, '[retention]\ncompleted = "1d"\nevery = "1h"\n')
    (apply,) = [h for h in engine.on_sweep if "retention" in getattr(h, "__module__", "")]
    left = []
    for _ in range(3):
        apply(engine)
        left.append(len(engine.backend.ids(State.COMPLETED)))
    assert left == [3, 1, 0]  # two per pass; the interval waits until all that was due went
    _finished_engine(tmp_path, 1, prefix="later")
    apply(engine)
    assert len(engine.backend.ids(State.COMPLETED)) == 1  # now the interval holds
    engine.backend.close()


def test_one_retention_pass_at_a_time(tmp_path: Path) -> None:
    """Found by the retention hunt: the processes of one batch each ran a pass over the same
    documents, and the archive held every document three times."""
    from filelock import FileLock

    from handoffd.features import retention
    engine, ids = _finished_engine(tmp_path, 3)
    busy = FileLock(str(engine.ws.meta / "retention.lock"))
    with busy:
        result = retention.expire(engine, older_than={State.COMPLETED: 3600}, now=engine.clock(),
                                  archive=True, wait=0)
    assert result.busy and result.removed == [] and len(engine.backend.ids(State.COMPLETED)) == 3
    result = retention.expire(engine, older_than={State.COMPLETED: 3600}, now=engine.clock(),
                              archive=True, wait=0)
    assert sorted(hid for hid, _ in result.removed) == ids
    assert sorted(e["id"] for e in archived(engine.ws)) == ids  # each archived once
    engine.backend.close()


def test_a_document_filed_by_a_foreign_consumer_ages_from_its_filing(tmp_path: Path) -> None:
    """Found by the retention hunt: a handoff that waited a week, then was completed by seed
    001's own consumer (writing completed/ itself), was purged the moment it completed: its
    age came from our last event, its creation."""
    from handoffd import build_engine
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    engine = build_engine(ws)
    week_ago = utc_now() - timedelta(days=7)
    engine.backend.create({"handoff_id": "f1", "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@a"}, "input": {"data": {}}}, "f1", week_ago)
    pending = ws.doc_path(State.PENDING, "f1")
    doc = json.loads(pending.read_text())
    ws.doc_path(State.COMPLETED, "f1").write_text(json.dumps(dict(doc, status="completed")))
    pending.unlink()
    (row,) = engine.backend.list(state=State.COMPLETED)
    assert row.updated_at > utc_now() - timedelta(minutes=1)  # its filing, not its creation
    from handoffd.features import retention
    result = retention.expire(engine, older_than={State.COMPLETED: 3600}, now=utc_now())
    assert result.removed == [] and ws.doc_path(State.COMPLETED, "f1").exists()
    engine.backend.close()


def test_a_live_handoff_seen_in_any_round_of_listings_protects_its_dependency(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the retention hunt: a dependant retried over and over moved between pending/
    and in-progress/ while they were listed one after the other, was in neither listing, and
    its dependency was purged. Here the listings catch it only once in six."""
    from handoffd.features import retention
    engine, (dep,) = _finished_engine(tmp_path, 1)
    engine.backend.create({"handoff_id": "live", "source": {"agent_id": "@o"}, "depends_on": [dep],
                           "target": {"agent_id": "@a"}, "input": {"data": {}}}, "live", utc_now())
    store = engine.backend.inner  # (under the event log's recorder)
    real_ids, calls = store.ids, []

    def ids(state: State) -> list[str]:
        calls.append(state)
        return [i for i in real_ids(state) if i != "live" or len(calls) == 3]

    monkeypatch.setattr(store, "ids", ids)
    monkeypatch.setattr(store, "list", lambda **kw: [])  # (a listing that missed it)
    keep, live = retention.protected(engine)
    assert keep == {dep: "pending live depends on it"} and live == {"live": State.PENDING}
    engine.backend.close()


def test_an_archive_of_millions_of_tiny_lines_is_passed_over_quickly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the retention hunt: a 1.5 MB archive of `{}` lines made every lookup of an
    unknown id take 28 s and 700 MB. A member of more lines than handoffd ever writes is passed
    over, and a lookup parses only the lines that name its id."""
    import gzip

    from handoffd.features import archive
    from handoffd.features.archive import find_archived
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    now = utc_now()
    append_archive(ws, [(State.COMPLETED, "real", {"status": "completed"})], now)
    folder = ws.handoffs / ".archive"
    monkeypatch.setattr(archive, "MAX_MEMBER_LINES", 100_000)  # (2,000,000 in use)
    (folder / "2000-01-01.jsonl.gz").write_bytes(gzip.compress(b"{}\n" * 100_001, 1))
    many = b"".join(json.dumps({"id": f"other-{i}", "state": "completed", "document": {}})
                    .encode() + b"\n" for i in range(20_000))
    (folder / "2000-01-02.jsonl.gz").write_bytes(gzip.compress(
        many + b'{"id": "late", "state": "failed", "document": {"n": 1}}\n', 1))
    parsed: list[bytes] = []
    real_entry = archive._entry
    def counted(line: bytes) -> Any:
        parsed.append(line)
        return real_entry(line)

    monkeypatch.setattr(archive, "_entry", counted)
    assert find_archived(ws, "nowhere") is None
    assert parsed == []  # no line named it: none was parsed, and the 100,001 were passed over
    found = find_archived(ws, "late")
    assert found is not None and found["document"] == {"n": 1} and len(parsed) == 1
    assert find_archived(ws, "real") is not None


def test_kept_children_never_fill_a_bounded_pass(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review: the finished children of a waiting parent, the oldest documents,
    filled every bounded pass, and nothing else was ever purged while the parent waited."""
    from handoffd.features import retention
    monkeypatch.setattr(retention, "PASS_LIMIT", 2)
    engine, _ = _finished_engine(tmp_path, 0, '[retention]\ncompleted = "1d"\nevery = "1h"\n')
    engine.backend.create({"handoff_id": "P", "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@nobody"}, "input": {"data": {}}}, "P",
                          utc_now())
    for hid in [f"P.c{i}" for i in range(8)] + ["other-1", "other-2"]:
        doc = {"handoff_id": hid, "source": {"agent_id": "@o"}, "target": {"agent_id": "@a"},
               "input": {"data": {}}}
        if hid.startswith("P."):
            doc["parent_id"] = "P"
        engine.backend.create(doc, hid, utc_now())
        held = engine.backend.claim(hid, utc_now(), 60)
        assert held is not None and engine.backend.finish(held, State.COMPLETED, held.doc)
    (apply,) = [h for h in engine.on_sweep if "retention" in getattr(h, "__module__", "")]
    apply(engine)
    left = sorted(engine.backend.ids(State.COMPLETED))
    assert left == sorted(f"P.c{i}" for i in range(8))  # the two others went in one pass
    engine.backend.close()


# ---------------------------------------------------------------------------- the live refs cache
def _live(engine: Any, hid: str, **fields: Any) -> None:
    engine.backend.create({"handoff_id": hid, "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@nobody"}, "input": {"data": {}}, **fields},
                          hid, utc_now())


def _count_reads(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids the files store's get() is asked for from now on."""
    store = engine.backend.inner  # (under the event log's recorder)
    real_get, reads = store.get, []

    def get(handoff_id: str) -> Any:
        reads.append(handoff_id)
        return real_get(handoff_id)

    monkeypatch.setattr(store, "get", get)
    return reads


def _settled_clock() -> float:
    return time.time() + 60  # every file there looks a minute old: settled


def test_unchanged_live_documents_are_not_read_again(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review: every pass read every live document to learn what it needs (1.5 s
    for 20,000 pending); a document whose files did not change is now stat'ed, not read."""
    from handoffd.features.liverefs import LiveRefs
    from handoffd.features.retention import protected
    engine, (dep, parent) = _finished_engine(tmp_path, 2)
    _live(engine, "L0", depends_on=[dep])
    _live(engine, "L1", parent_id=parent)
    for i in range(2, 6):
        _live(engine, f"L{i}")
    reads = _count_reads(engine, monkeypatch)
    refs = LiveRefs(clock=_settled_clock)
    first = protected(engine, refs)
    assert sorted(reads) == [f"L{i}" for i in range(6)] and len(refs) == 6
    assert first == ({dep: "pending L0 depends on it", parent: "parent of pending L1"},
                     {f"L{i}": State.PENDING for i in range(6)})
    reads.clear()
    assert protected(engine, refs) == first and reads == []  # nothing read the second time
    engine.backend.close()


def test_a_changed_live_document_is_read_again(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A live document rewritten in place, replaced by a file of the same size, or moved (a
    claim) since it was remembered is read again, and what it references now counts."""
    from handoffd.features.liverefs import LiveRefs
    from handoffd.features.retention import protected
    engine, (dep, other) = _finished_engine(tmp_path, 2)
    for i in range(4):
        _live(engine, f"L{i}")
    refs = LiveRefs(clock=_settled_clock)
    assert protected(engine, refs) == ({}, {f"L{i}": State.PENDING for i in range(4)})
    reads = _count_reads(engine, monkeypatch)
    in_place = engine.ws.doc_path(State.PENDING, "L0")  # same inode, another size
    in_place.write_text(json.dumps(dict(json.loads(in_place.read_text()), depends_on=[dep])))
    replaced = engine.ws.doc_path(State.PENDING, "L1")  # same size, another inode
    text = replaced.read_text()
    swapped = text.replace('"@nobody"', '"@nobodz"')
    assert len(swapped) == len(text) and swapped != text
    (tmp_path / "new.json").write_text(swapped)
    os.replace(tmp_path / "new.json", replaced)
    assert engine.backend.claim("L2", utc_now(), 60) is not None  # moved to in-progress/
    stale = engine.ws.doc_path(State.PENDING, "L3")  # a child now, its mtime put back
    before = stale.stat()
    child = stale.read_text().replace('"input"', '"parent_id": "' + other + '", "input"')
    stale.write_text(child)
    os.utime(stale, ns=(before.st_atime_ns, before.st_mtime_ns))
    keep, live = protected(engine, refs)
    assert sorted(reads) == ["L0", "L1", "L2", "L3"]
    assert keep == {dep: "pending L0 depends on it", other: "parent of pending L3"}
    assert live["L2"] == State.IN_PROGRESS
    reads.clear()
    assert protected(engine, refs) == (keep, live) and reads == []  # remembered again
    engine.backend.close()


def test_a_live_document_changed_just_now_is_not_remembered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file changed within the settle window may change again with the same identity (the
    same timestamp tick): it is read on every pass until it settles."""
    from handoffd.features.liverefs import LiveRefs
    from handoffd.features.retention import protected
    engine, _ = _finished_engine(tmp_path, 0)
    started = time.time() - 1  # the clock stands before the files were written
    _live(engine, "L0")
    reads = _count_reads(engine, monkeypatch)
    refs = LiveRefs(clock=lambda: started)
    for _ in range(2):
        assert protected(engine, refs)[1] == {"L0": State.PENDING}
    assert reads == ["L0", "L0"] and len(refs) == 0
    engine.backend.close()


def test_the_live_refs_are_bounded_and_forget_finished_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache holds at most MAX_KEPT entries, and only the handoffs listed live in its last
    pass: memory stays flat however many documents came and went."""
    from handoffd.features import liverefs
    from handoffd.features.retention import protected
    monkeypatch.setattr(liverefs, "MAX_KEPT", 2)
    engine, _ = _finished_engine(tmp_path, 0)
    for i in range(3):
        _live(engine, f"L{i}")
    refs = liverefs.LiveRefs(clock=_settled_clock)
    protected(engine, refs)
    assert len(refs) == 2
    reads = _count_reads(engine, monkeypatch)
    protected(engine, refs)
    assert len(reads) == 1  # the one left out is read again, the two held are not
    for i in range(3):
        held = engine.backend.claim(f"L{i}", utc_now(), 60)
        assert held is not None and engine.backend.finish(held, State.COMPLETED, held.doc)
    assert protected(engine, refs) == ({}, {}) and len(refs) == 0
    engine.backend.close()


def test_a_pass_with_nothing_old_enough_reads_no_live_document(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`handoff purge --dry-run` and a daemon's passes read every live document even when no
    finished one was old enough to go; now a pass reads them only when one is."""
    from handoffd.features import retention
    engine, (dep,) = _finished_engine(tmp_path, 1)  # (its clock: two days on)
    _live(engine, "L0", depends_on=[dep])
    reads = _count_reads(engine, monkeypatch)
    month = {State.COMPLETED: 30 * 86400.0, State.FAILED: 1.0}  # (no failed one at all)
    result = retention.expire(engine, older_than=month, now=engine.clock(), dry_run=True)
    assert result.removed == [] and result.kept == {} and reads == []
    result = retention.expire(engine, older_than={State.COMPLETED: 3600}, now=engine.clock(),
                              dry_run=True)
    assert result.kept == {dep: "pending L0 depends on it"} and "L0" in reads
    engine.backend.close()


def test_a_daemon_remembers_live_references_from_pass_to_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[retention]'s passes share what they learnt: a live document is read once, not twice per
    pass (before and after archiving) at every pass."""
    from handoffd.features import liverefs, retention
    monkeypatch.setattr(retention, "PASS_LIMIT", 1)
    monkeypatch.setattr(liverefs, "SETTLE_SECONDS", -3600.0)  # every file counts as settled
    engine, ids = _finished_engine(tmp_path, 3, '[retention]\ncompleted = "1d"\nevery = "1h"\n')
    _live(engine, "L0", depends_on=[ids[0]])
    (apply,) = [h for h in engine.on_sweep if "retention" in getattr(h, "__module__", "")]
    reads = _count_reads(engine, monkeypatch)
    removed = []
    for _ in range(3):
        result = apply(engine)
        assert isinstance(result, retention.Result)
        removed += [hid for hid, _ in result.removed]
    assert removed == ids[1:] and engine.backend.ids(State.COMPLETED) == [ids[0]]
    assert reads.count("L0") == 1
    engine.backend.close()


def test_another_store_is_read_each_pass(tmp_path: Path) -> None:
    """Only the files store gives a document an identity to remember it by: with another store
    every live document is read on each pass, as before."""
    from handoffd import build_engine
    from handoffd.backends.memory import MemoryBackend
    from handoffd.features.liverefs import LiveRefs
    from handoffd.features.retention import protected
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    engine = build_engine(ws, backend=MemoryBackend(), features=())
    _live(engine, "L0", depends_on=["d"])
    refs = LiveRefs(clock=_settled_clock)
    for _ in range(2):
        assert protected(engine, refs) == ({"d": "pending L0 depends on it"},
                                           {"L0": State.PENDING})
    assert len(refs) == 0
