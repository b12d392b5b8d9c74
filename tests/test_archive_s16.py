"""Found by the sixteenth session's review (R8): a torn gzip member lost everything archived
after it, and `handoff create --if-absent` refused a handoff retention had archived.

- A torn member's decompressor takes the members appended after it as its own data, often with
  no error, to the end of the file: the reader stopped there, and the batches archived after
  the tear (their documents deleted) were found by no reader. Planted (a 15-byte gzip head) or
  natural (a kill -9 mid-append, then another `handoff archive`), 6 of 21 cut points lost the
  later batch. The reader now looks for the next header after a tear, and a header found so
  must decode whole into lines of ours; and `append_archive` never appends after a tail that is
  not a whole member: it starts DATE-N.jsonl.gz, which every reader reads, newest last.
- `--if-absent` with the same request exited 5 "its request is gone" once retention archived
  the handoff (its id still refused by dedup), though `handoff show` found it there.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import FLAKY_TOML, Workspace, new_workspace

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import archive as archive_format

# what R8 planted: a gzip header, then a stored block that says 65,535 bytes follow
PLANTED_HEAD = b"\x1f\x8b\x08\0\0\0\0\0\0\xff\x00\xff\xff\x00\x00"


def today_file(root: Path, number: int = 0) -> Path:
    day = f"{utc_now():%Y-%m-%d}"
    name = f"{day}-{number}.jsonl.gz" if number else f"{day}.jsonl.gz"
    return root / "handoffs" / ".archive" / name


def finished_ids(ws: Workspace, *ids: str) -> None:
    """Create ``ids`` and run them to completed/ (one `handoffd run`)."""
    for hid in ids:
        ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}), "--id", hid)
    assert ws.handoffd("run").returncode == 0
    for hid in ids:
        assert ws.state_of(hid) == ["completed"], hid


def shown(ws: Workspace, hid: str) -> dict[str, Any]:
    proc = ws.handoff("show", hid, "--json")
    assert proc.returncode == 0, (hid, proc.stderr)
    found: dict[str, Any] = json.loads(proc.stdout)
    return found


def entries(lines: list[tuple[str, str]], payload: Any) -> list[bytes]:
    return [(json.dumps({"id": hid, "state": state, "archived_at": "2026-11-26T00:00:00Z",
                         "document": {"handoff_id": hid, "data": payload}}) + "\n").encode()
            for hid, state in lines]


def read_ids(data: bytes) -> list[str]:
    return [e.get("id", "?") for e in archive_format._entries(io.BytesIO(data))]


def test_a_planted_torn_head_loses_nothing_archived_after_it(ws: Workspace) -> None:
    """R8's reproduction, through the commands: `handoff archive` after a planted 15-byte head
    archived d-1..3 behind it, and `handoff show d-1` said "no handoff d-1" (exit 3)."""
    finished_ids(ws, "d-1", "d-2", "d-3")
    planted = today_file(ws.root)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(PLANTED_HEAD)
    out = ws.handoff("archive", "--older-than", "0", check=True).stdout
    assert "archived 3 handoff(s)" in out, out
    assert planted.read_bytes() == PLANTED_HEAD  # never appended after a torn tail
    assert today_file(ws.root, 1).is_file() and "-1.jsonl.gz" in out
    for hid in ("d-1", "d-2", "d-3"):
        assert shown(ws, hid)["archived"] is True and ws.state_of(hid) == []
    waited = ws.handoff("wait", "d-2", "--timeout", "5")
    assert waited.returncode == 0, waited.stderr
    # the next batch goes on in DATE-1 (its tail is whole), and reads back too
    finished_ids(ws, "d-4")
    out = ws.handoff("archive", "--older-than", "0", check=True).stdout
    assert "-1.jsonl.gz" in out and not today_file(ws.root, 2).exists(), out
    assert shown(ws, "d-4")["archived"] is True and shown(ws, "d-1")["archived"] is True


def test_the_reader_goes_on_after_a_planted_head_and_false_headers() -> None:
    """An archive written before DATE-N (appended after the tear) reads whole; a header that
    is not ours (inside a stored block, or a member holding foreign lines) is passed over."""
    first = archive_format._members(entries([("a-1", "completed")], "x"))
    after = archive_format._members(entries([("b-1", "completed"), ("b-2", "failed")], "y"))
    assert read_ids(first + PLANTED_HEAD + after) == ["a-1", "b-1", "b-2"]
    assert read_ids(PLANTED_HEAD * 3 + after) == ["b-1", "b-2"]
    # a whole gzip member of someone else's lines, found after a tear, is not taken as ours
    foreign = gzip.compress(b'{"not": "ours"}\n')
    assert read_ids(PLANTED_HEAD + foreign + after) == ["b-1", "b-2"]
    # (a member that follows a whole one is read as it is, as before: entries without an id)
    assert read_ids(first + foreign) == ["a-1", "?"]
    # a file that ends inside a header, or right after one
    assert read_ids(first + PLANTED_HEAD[:2]) == ["a-1"]
    assert read_ids(first + PLANTED_HEAD[:10]) == ["a-1"]


@pytest.mark.parametrize("kind", ["text", "random"])
def test_natural_tears_at_every_cut_point_lose_only_the_torn_batch(kind: str) -> None:
    """A batch torn at any byte, then another batch appended after it (as versions before
    DATE-N did): the batches before and after the tear all read back. (R8: 6 of 21 cut points
    lost the later batch; its reproduction's was 5 small entries, here there are two sizes.)"""
    def payload(i: int) -> Any:
        return "hello world " * 50 if kind == "text" else os.urandom(1500).hex()

    before = archive_format._members(entries([("a-0", "completed")], payload(0)))
    torn = archive_format._members(entries([(f"t-{i}", "completed") for i in range(40)], payload(1)))
    for later_ids in ([f"c-{i}" for i in range(3)], [f"c-{i}" for i in range(120)]):
        later = archive_format._members([(json.dumps({
            "id": hid, "state": "completed", "archived_at": "x",
            "document": {"data": payload(i)}}) + "\n").encode()
            for i, hid in enumerate(later_ids)])
        step = max(1, len(torn) // 150)
        for cut in [*range(1, 12), *range(12, len(torn), step), *range(len(torn) - 9, len(torn))]:
            got = read_ids(before + torn[:cut] + later)
            assert got == ["a-0", *later_ids], (kind, len(later_ids), cut, got[:3])


def test_append_never_goes_on_after_a_torn_tail(tmp_path: Path) -> None:
    """Each cut point of the last batch: the next append starts DATE-1 (the torn file is left
    as it is), unless the tail is whole (no cut, or the batch whole); every whole batch reads."""
    ws = HandoffdWorkspace(tmp_path)
    now = utc_now()
    path = archive_format.append_archive(ws, [(State.COMPLETED, "a", {"x": 1})], now)
    first_len = path.stat().st_size
    archive_format.append_archive(ws, [(State.COMPLETED, f"b-{i}", {"o": "k" * i}) for i in range(30)],
                                  now)
    whole = path.read_bytes()
    cuts = sorted({*range(first_len, first_len + 12), *range(first_len, len(whole), 7),
                   *range(len(whole) - 9, len(whole) + 1)})
    for cut in cuts:
        for extra in path.parent.glob("*-*.jsonl.gz"):
            extra.unlink()
        path.write_bytes(whole[:cut])
        written = archive_format.append_archive(ws, [(State.COMPLETED, "c", {"x": 3})], now)
        torn = cut not in (first_len, len(whole))
        assert written.name == (f"{now:%Y-%m-%d}-1.jsonl.gz" if torn else path.name), cut
        if torn:
            assert path.read_bytes() == whole[:cut]  # nothing appended after the tear
        ids = [e["id"] for e in archive_format.archived(ws)]
        assert "a" in ids and (ids[0] if torn else ids[-1]) == "c", (cut, ids)  # newest first
        assert ("b-29" in ids) == (cut == len(whole)), cut


def test_a_day_s_files_are_read_newest_last(tmp_path: Path) -> None:
    """DATE.jsonl.gz, DATE-1, DATE-2 ... DATE-10: by name DATE-1 sorted before DATE (and
    DATE-10 before DATE-2), so an older entry of a handoff was taken for its newest."""
    ws = HandoffdWorkspace(tmp_path)
    folder = archive_format.archive_dir(ws)
    folder.mkdir(parents=True)
    day = "2026-11-26"
    for number, state in ((0, "failed"), (1, "failed"), (2, "failed"), (10, "completed")):
        name = f"{day}-{number}.jsonl.gz" if number else f"{day}.jsonl.gz"
        (folder / name).write_bytes(archive_format._members(entries([("x", state)], number)))
    (folder / "2026-11-25-3.jsonl.gz").write_bytes(archive_format._members(entries([("x", "completed")], 9)))
    found = archive_format.find_archived(ws, "x")
    assert found is not None and found["state"] == "completed" and found["document"]["data"] == 10
    names = [p.name for p in archive_format.archive_files(ws)]
    assert names == ["2026-11-25-3.jsonl.gz", f"{day}.jsonl.gz", f"{day}-1.jsonl.gz",
                     f"{day}-2.jsonl.gz", f"{day}-10.jsonl.gz"]
    # the next append goes on in the newest (DATE-10), whose tail is whole
    written = archive_format.append_archive(ws, [(State.COMPLETED, "y", {})],
                                            utc_now().replace(year=2026, month=11, day=26))
    assert written.name == f"{day}-10.jsonl.gz"


def test_planted_headers_cost_a_bounded_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of planted heads, each one's stored block swallowing the rest: every header is
    a false start that reads to the end of the file. The reader passes over the rest once its
    false starts cost RESYNC_BUDGET (here made small), instead of reading the file once per
    header (quadratic)."""
    monkeypatch.setattr(archive_format, "RESYNC_BUDGET", 4 << 20)
    data = PLANTED_HEAD * 40_000  # 600 KB: 40,000 headers

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, size: int | None = -1) -> bytes:
            out = super().read(size)
            Counting.read_bytes += len(out)
            return out

    assert list(archive_format._entries(Counting(data))) == []
    assert Counting.read_bytes < 8 << 20  # (read whole once per header: 12 GB)


KILL_MID_APPEND = r"""
import os, signal, sys
from handoffd.features import archive
permille = int(sys.argv[1])

def torn(fd, data):  # the append reaches the disk up to a byte, then the process is killed
    cut = max(1, min(len(data) - 1, len(data) * permille // 1000))
    os.write(fd, bytes(data[:cut]))
    os.kill(os.getpid(), signal.SIGKILL)

archive._write_all = torn
sys.argv = ["handoff", *sys.argv[2:]]
from handoffd.cli.entry import handoff
handoff()
"""


@pytest.mark.heavy
def test_kill_9_of_handoff_archive_mid_append_loses_nothing(tmp_path: Path) -> None:
    """`handoff archive` killed (SIGKILL) mid-append at cut points from the header to the
    trailer: its batch is still in completed/, the next `handoff archive` archives it again
    into DATE-1 (never after the tear), and every handoff, archived before or after, is found."""
    base = new_workspace(tmp_path / "base", FLAKY_TOML)
    finished_ids(base, "a-1", "a-2")
    base.handoff("archive", "--older-than", "0", check=True)
    finished_ids(base, "b-1", "b-2", "b-3")
    for permille in (1, 20, 300, 900, 990, 999):
        ws = Workspace(tmp_path / f"cut-{permille}")
        shutil.copytree(base.root, ws.root)
        archive = today_file(ws.root)
        before = archive.read_bytes()
        killed = subprocess.run([sys.executable, "-c", KILL_MID_APPEND, str(permille), "archive",
                                 "--older-than", "0", "--root", str(ws.root)],
                                capture_output=True, text=True, timeout=60)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        torn = archive.read_bytes()
        assert len(torn) > len(before) and torn.startswith(before)
        assert all(ws.state_of(h) == ["completed"] for h in ("b-1", "b-2", "b-3"))  # not deleted
        again = ws.handoff("archive", "--older-than", "0", check=True).stdout
        assert "archived 3 handoff(s)" in again and "-1.jsonl.gz" in again, again
        assert archive.read_bytes() == torn  # the torn file is never appended to
        assert shown(ws, "b-2")["archived"] is True
        hws = HandoffdWorkspace(ws.root)
        for hid in ("a-1", "a-2", "b-1", "b-3"):
            assert archive_format.find_archived(hws, hid) is not None, (permille, hid)
        assert not list((ws.root / "handoffs" / "completed").glob("*.json"))
        with gzip.open(today_file(ws.root, 1)) as fh:  # gzip -dc reads the new file whole
            assert len(fh.read().splitlines()) == 3


def test_if_absent_compares_with_the_archived_copy(ws: Workspace) -> None:
    """`create --id X --if-absent` with X's own request, once retention archived X: exit 0 and
    X printed, nothing created (it exited 5 "its request is gone"); with another request, exit
    5 naming the archive; the Python API (Engine.submit, as the client makes it) agrees."""
    request = ("--to", "@flaky", "--data", json.dumps({"mode": "ok"}), "--id", "x-1")
    ws.create(*request)
    assert ws.handoffd("run").returncode == 0
    ws.handoff("archive", "--older-than", "0", check=True)
    assert ws.state_of("x-1") == []
    same = ws.handoff("create", *request, "--if-absent")
    assert same.returncode == 0 and same.stdout.strip() == "x-1", same.stderr
    assert ws.state_of("x-1") == [] and shown(ws, "x-1")["archived"] is True
    other = ws.handoff("create", "--to", "@flaky", "--data", json.dumps({"mode": "permanent"}),
                       "--id", "x-1", "--if-absent")
    assert other.returncode == 5 and "archived" in other.stderr, other.stderr
    assert other.stderr.count("\n") == 1 and "Traceback" not in other.stderr
    plain = ws.handoff("create", *request)  # without --if-absent: refused as before
    assert plain.returncode == 1, plain.stderr
    from handoffd.core.errors import Conflict
    from handoffd.features.build import build_engine, open_submitter
    engine = build_engine(HandoffdWorkspace(ws.root))
    doc = json.loads(json.dumps(shown(ws, "x-1")["document"]))
    assert engine.submit(_request_of(doc), if_absent=True) == "x-1"
    changed = _request_of(doc)
    changed["input"] = {"data": {"mode": "other"}}
    with pytest.raises(Conflict, match="archived"):
        engine.submit(changed, if_absent=True)
    submitter = open_submitter(HandoffdWorkspace(ws.root))
    assert submitter.submit(_request_of(doc), if_absent=True) == "x-1"
    assert ws.state_of("x-1") == []


def _request_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A seed 001 request as submitted again: the filed document without what its lifecycle
    added (same_request ignores those keys anyway)."""
    return {k: v for k, v in doc.items() if k in (
        "handoff_id", "source", "target", "input", "priority", "timeout_seconds", "metadata",
        "context", "expected_output", "conversation_id", "handoff_type", "version")}
