"""Contract snapshots, session 17: the work of one snapshot is bounded, and a tree too big to see
stops the handoff before its handler starts.

* git's listing is read as it comes and capped (``gitlist.MAX_LISTING_BYTES``, git's messages
  ``gitlist.MAX_ANSWER_BYTES``): past the cap git is killed and reaped, and the snapshot is
  incomplete (a listing too big is a tree too big to see), never a daemon holding git's whole
  output in memory until git's timeout.
* One snapshot hashes at most ``snapshots.MAX_HASHED_TOTAL_BYTES``; past it files are compared
  by their stat facts, like a file over ``MAX_HASHED_BYTES``.
* A contract directory already too big or too deep to snapshot before the handler fails the
  handoff ``CONTRACT_VIOLATION`` without starting the handler (it used to run, and fail after).

The git and hashing tests are fast unit tests (bounds lowered with monkeypatch, a fake ``git`` on
PATH); the last ones drive the real ``handoffd run`` (``test_contracts_hostile``'s worker and
workspace) and the in-process daemon.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine
from test_contract_snapshots_s16 import files, many, plain_git
from test_contracts_hostile import PY, make_workspace, native, submit_and_run

from handoffd import Daemon, State, new_native_request
from handoffd.features.contracts import gitlist, snapshots, walk
from handoffd.features.contracts.snapshots import ScopeUnverifiable, Snapshotter
from handoffd.features.contracts.walk import Incomplete, Walker

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

# A fake git: records its pid, writes ``size`` bytes to ``stream`` as fast as the pipe takes
# them, then hangs (as a git on a huge or forged index would keep writing, or never end).
FAKE_GIT = """#!{python}
import os, sys, time
open({pidfile!r}, "w").write(str(os.getpid()))
out = getattr(sys, {stream!r}).buffer
chunk = b"0123456789abcdef" * 4095 + b"012345678901234\\0"
for _ in range({size} // len(chunk) + 1):
    out.write(chunk)
out.flush()
time.sleep(60)
"""


def fake_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: str, size: int) -> Path:
    """Put a fake ``git`` (:data:`FAKE_GIT`) first on PATH; the file its pid will be in."""
    pidfile = tmp_path / "git.pid"
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text(FAKE_GIT.format(python=PY, pidfile=str(pidfile), stream=stream, size=size))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return pidfile


def reaped(pidfile: Path) -> bool:
    """Whether the fake git is gone and reaped (a zombie still answers signal 0)."""
    try:
        os.kill(int(pidfile.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------- git's output is capped
def test_a_listing_past_the_byte_cap_is_incomplete_and_git_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitlist, "MAX_LISTING_BYTES", 256 << 10, raising=False)
    monkeypatch.setattr(gitlist, "GIT_TIMEOUT_SECONDS", 4.0)  # (the old code waited it out)
    pidfile = fake_git(tmp_path, monkeypatch, "stdout", 8 << 20)
    (tmp_path / "tree").mkdir()
    with pytest.raises(Incomplete) as caught:
        gitlist.git_files(Walker(tmp_path / "tree", lambda _: False, lambda _: False))
    assert str(caught.value) == (
        "git's listing of the contract directory holds more than 262144 bytes (the snapshot "
        "limit: list large folders in the contract's scope_ignore, or narrow its cwd)")
    assert reaped(pidfile)


def test_git_messages_past_their_cap_are_a_git_error_and_git_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitlist, "MAX_ANSWER_BYTES", 64 << 10, raising=False)
    monkeypatch.setattr(gitlist, "GIT_TIMEOUT_SECONDS", 4.0)
    pidfile = fake_git(tmp_path, monkeypatch, "stderr", 8 << 20)
    (tmp_path / "tree").mkdir()
    with pytest.raises(gitlist.GitError) as caught:
        gitlist.git_guarded(tmp_path / "tree")
    assert str(caught.value) == "git rev-parse wrote more than 65536 bytes of messages"
    assert reaped(pidfile)


# A fake git whose `ls-files --stage` lists ``count`` files (``prefix``N) and ends; its other
# calls list nothing
FAKE_LISTING = """#!{python}
import sys
if "--stage" in sys.argv:
    out = sys.stdout.buffer
    for start in range(0, {count}, 10000):
        out.write(b"".join(b"100644 e69de29bb2d1d6434b8b29ae775ad8c2e48c5391 0\\t%s%d\\0"
                           % ({prefix!r}.encode(), n) for n in range(start, min(start + 10000, {count}))))
"""


def fake_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str,
                 count: int) -> None:
    """Put a fake ``git`` (:data:`FAKE_LISTING`) first on PATH."""
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text(FAKE_LISTING.format(python=PY, prefix=prefix, count=count))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")


def test_a_listing_of_many_paths_stops_at_the_entry_bound_without_holding_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged index of a million paths (about 60 MB of listing): the snapshot is incomplete
    once MAX_ENTRIES paths are kept, and what was held meanwhile is a chunk or two, not the
    listing, nor a list of every path in it (review R11: 250 MB for a 49 MB listing)."""
    import tracemalloc
    monkeypatch.setattr(walk, "MAX_ENTRIES", 1000)
    fake_listing(tmp_path, monkeypatch, "f/", 1_000_000)
    (tmp_path / "tree").mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(Incomplete, match="more than 1000 files and folders"):
            gitlist.git_files(Walker(tmp_path / "tree", lambda _: False, lambda _: False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_skipped_paths_count_against_no_entry_bound(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracked folder the contract's scope_ignore skips (a vendored tree) is parsed and
    dropped as it streams by: its paths are neither counted nor held (review R11: a 420,000-file
    vendor/ made every contract on its repository fail before its handler)."""
    monkeypatch.setattr(walk, "MAX_ENTRIES", 1000)
    fake_listing(tmp_path, monkeypatch, "vendor/", 200_000)
    (tmp_path / "tree").mkdir()
    walker = Walker(tmp_path / "tree", lambda name: name.startswith("vendor/"), lambda _: False)
    assert gitlist.git_files(walker) == set() and walker.tally.seen == 0
    assert gitlist.MAX_LISTING_BYTES >= 512 << 20  # room for a monorepo's listing to stream by


@needs_git
def test_a_real_listing_past_the_cap_makes_the_snapshot_incomplete_in_git_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    many(tmp_path, "src", 40)
    plain_git(tmp_path, "init", "-q")
    plain_git(tmp_path, "add", "-A")
    snapper = Snapshotter(tmp_path, mode="auto")
    first = snapper.take()  # 40 entries of ~60 bytes: a listing under 3 KB
    assert first.mode == "git" and not first.incomplete and len(first.entries) >= 40
    monkeypatch.setattr(gitlist, "MAX_LISTING_BYTES", 2000, raising=False)
    before = snapper.take()
    # incomplete, and still git's: no fall back to a hash walk that watches other files
    assert before.mode == "git" and not before.entries
    assert before.incomplete.startswith("git's listing of the contract directory holds more "
                                        "than 2000 bytes")
    with pytest.raises(ScopeUnverifiable, match="before the handler ran, git's listing"):
        snapper.changes(before)


# ---------------------------------------------------------------- hashing is capped in total
def test_one_snapshot_hashes_no_more_than_its_total_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "MAX_HASHED_TOTAL_BYTES", 100, raising=False)
    files(tmp_path, {"a.bin": "a" * 60, "b.bin": "b" * 60, "c.bin": "c" * 60, "d.bin": "d" * 30})
    read: list[int] = []
    real_read = os.read

    def counting_read(fd: int, size: int) -> bytes:
        chunk = real_read(fd, size)
        read.append(len(chunk))
        return chunk
    monkeypatch.setattr(snapshots.os, "read", counting_read)
    snapper = Snapshotter(tmp_path, mode="hash")
    before = snapper.take()
    hashed = sorted(rel for rel, entry in before.entries.items() if entry.digest is not None)
    # whichever 60-byte file comes first, and d.bin: 90 bytes (which ones: the listing's order)
    assert sum(read) <= 100 and len(hashed) == 2 and "d.bin" in hashed
    assert sum(before.entries[rel].size for rel in hashed) <= 100
    # the others are compared by stat facts alone, as a file over MAX_HASHED_BYTES is
    unhashed = next(rel for rel in sorted(before.entries) if rel not in hashed)
    (tmp_path / unhashed).write_text((tmp_path / unhashed).read_text())  # same bytes
    os.utime(tmp_path / unhashed, ns=(1, 1))
    read.clear()
    changes, _ = snapper.changes(before)  # a new snapshot: a new budget
    assert [(c.path, c.change) for c in changes] == [(unhashed, "modified")]
    assert sum(read) <= 100


# ---------------------------------------------------------------- too big before: never run
def test_a_tree_too_deep_before_the_handler_fails_without_running_it(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path, repo=False)
    os.makedirs(ws.root / "deep" / os.path.join(*["d"] * (walk.MAX_DEPTH + 12)))
    ran, criterion_ran = tmp_path / "handler-ran", tmp_path / "criterion-ran"
    contract: dict[str, Any] = {
        "files_owned": ["src/auth/**"],
        "success_criteria": [f"Command succeeds: {PY} -c \"open('{criterion_ran}', 'w')\""]}
    try:
        doc, stderr = submit_and_run(ws, native("too-deep", contract, {
            "run": [[PY, "-c", f"open({str(ran)!r}, 'w').write('ran')"]]}))
        assert not ran.exists() and not criterion_ran.exists()
        assert ws.state_of("too-deep") == ["failed"]
        assert doc["error"]["code"] == "CONTRACT_VIOLATION" and doc["retry_available"] is False
        message = doc["error"]["message"]
        assert message.startswith("handoff too-deep broke its contract: the scope cannot be "
                                  "verified: before the handler ran, deep/d/d/")
        assert message.endswith(f"is nested more than {walk.MAX_DEPTH} folders deep (the snapshot "
                                "limit: list large folders in the contract's scope_ignore, or "
                                "narrow its cwd); the handler was not run")
        assert [c["status"] for c in doc["validation"]["criteria"]] == ["unchecked"]
        lines = [line for line in stderr.splitlines() if "too-deep" in line]
        assert len(lines) == 1 and lines[0].startswith("handoffd: ERROR: handoff too-deep: the "
                                                       "scope cannot be verified: before")
        assert lines[0].endswith("the handler was not run") and "Traceback" not in stderr
        logged = [json.loads(line) for line in
                  (ws.root / "handoffs/.meta/violations.jsonl").read_text().splitlines()]
        assert [(e["kind"], e["handoff_id"]) for e in logged] == [("scope_creep", "too-deep")]
    finally:
        ws.cleanup()


def test_a_tree_too_big_before_the_handler_fails_without_running_it_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(walk, "MAX_ENTRIES", 50)
    calls: list[str] = []

    def handler(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
        calls.append(ctx.handoff_id)
        return {"status": "completed", "output": {}}
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": handler})
    many(tmp_path, "big", 60)
    doc = new_native_request(source="@test", target="@w", data={}, now=engine.clock(),
                             handoff_id="too-big")
    doc["contract"] = {"files_owned": ["src/**"]}
    assert engine.submit(doc) == "too-big"
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="handoffd.contracts"):
        assert Daemon(engine, workers=1, watch=False).run_batch().error is None
    assert time.monotonic() - started < 30
    state, filed = engine.get("too-big")
    assert calls == [] and state is State.FAILED
    assert filed["error"]["code"] == "CONTRACT_VIOLATION"
    assert filed["error"]["message"] == (
        "handoff too-big broke its contract: the scope cannot be verified: before the handler "
        "ran, the contract directory holds more than 50 files and folders (the snapshot limit: "
        "list large folders in the contract's scope_ignore, or narrow its cwd); the handler was "
        "not run")
    said = [r for r in caplog.records if r.name == "handoffd.contracts"]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
