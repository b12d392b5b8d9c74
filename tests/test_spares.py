"""Spare temp files (backends/files/spares.py): a filed handoff's in-progress inode is reused for
the next write, and never when it stopped being a plain file of ours."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from conftest import run_python

from handoffd.backends.files import fsio, spares
from handoffd.core.errors import InvalidDocument


@pytest.fixture()
def tmp_dir(tmp_path: Path) -> Iterator[Path]:
    spares.forget()
    folder = tmp_path / ".tmp"
    folder.mkdir()
    yield folder
    spares.forget()


def test_a_retired_file_is_the_next_temp_file(tmp_dir: Path, tmp_path: Path) -> None:
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b'{"old": "content, longer than what comes next"}')
    inode = doc.stat().st_ino
    assert spares.retire(doc, tmp_dir) and not doc.exists()
    target = tmp_path / "completed.json"
    fsio.create_exclusive(target, b'{"new": 1}', tmp_dir, durable=True)
    assert target.read_bytes() == b'{"new": 1}'  # written over, the longer rest cut off
    assert target.stat().st_ino == inode  # the same inode: nothing allocated
    assert list(tmp_dir.iterdir()) == []
    assert spares.retire(tmp_path / "gone.json", tmp_dir) is False


def test_a_spare_shorter_than_the_new_data_holds_it_all(tmp_dir: Path, tmp_path: Path) -> None:
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b"{}")
    assert spares.retire(doc, tmp_dir)
    target = tmp_path / "completed.json"
    data = json.dumps({"answer": "x" * 9000}).encode()  # over two blocks
    fsio.replace(target, data, tmp_dir, durable=False)
    assert target.read_bytes() == data
    again = tmp_path / "again.json"
    assert spares.retire(target, tmp_dir)
    fsio.replace(again, b"{}", tmp_dir, durable=False)
    assert again.read_bytes() == b"{}" and again.stat().st_size == 2


@pytest.mark.parametrize("spoil", ["removed", "symlink", "fifo", "hardlink"])
def test_a_spare_that_changed_is_never_written_through(tmp_dir: Path, tmp_path: Path,
                                                       spoil: str) -> None:
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b"ours")
    assert spares.retire(doc, tmp_dir)
    [spare] = list(tmp_dir.iterdir())
    victim = tmp_path / "victim"
    victim.write_bytes(b"not to be touched")
    if spoil != "hardlink":
        spare.unlink()
    if spoil == "symlink":
        spare.symlink_to(victim)
    elif spoil == "fifo":
        os.mkfifo(spare)
    elif spoil == "hardlink":
        spare.unlink()
        os.link(victim, spare)
    target = tmp_path / "answer.json"
    fsio.replace(target, b'{"answer": true}', tmp_dir, durable=False)
    assert target.read_bytes() == b'{"answer": true}'
    assert victim.read_bytes() == b"not to be touched"
    assert target.stat().st_ino != victim.stat().st_ino


def test_spares_are_bounded(tmp_dir: Path, tmp_path: Path) -> None:
    for n in range(spares.KEPT + 5):
        doc = tmp_path / f"d{n}.json"
        doc.write_bytes(b"x")
        assert spares.retire(doc, tmp_dir)
    assert len(list(tmp_dir.iterdir())) == spares.KEPT  # the rest were unlinked


def test_a_spare_swept_away_before_its_rename_is_written_again_fresh(
        tmp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b"ours")
    assert spares.retire(doc, tmp_dir)
    real_take = spares.take

    def take_then_sweep(folder: Path) -> tuple[Path, int, int] | None:
        taken = real_take(folder)
        if taken is not None:
            os.unlink(taken[0])  # a sweeper removes it between our open and our rename
        return taken

    monkeypatch.setattr(spares, "take", take_then_sweep)
    target = tmp_path / "filed.json"
    fsio.create_exclusive(target, b'{"filed": 1}', tmp_dir, durable=False)
    assert target.read_bytes() == b'{"filed": 1}'


def test_a_clean_exit_leaves_no_spares(tmp_path: Path) -> None:
    """A `handoffd run` that filed handoffs leaves handoffs/.tmp/ empty when it ends."""
    code = ("import sys; from pathlib import Path\n"
            "from handoffd.backends.files import spares\n"
            "tmp = Path(sys.argv[1]) / '.tmp'; tmp.mkdir()\n"
            "for n in range(3):\n"
            "    doc = Path(sys.argv[1]) / f'd{n}'; doc.write_text('x'); spares.retire(doc, tmp)\n"
            "print(len(list(tmp.iterdir())))\n")
    done = run_python(code, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == 3  # kept while it ran
    assert list((tmp_path / ".tmp").iterdir()) == []  # and gone when it ended


@pytest.mark.parametrize("held", ["spares", "dirsync"])
def test_a_fork_while_another_thread_holds_a_lock_does_not_hang_the_child(held: str) -> None:
    """The at-fork hooks run in the child (subprocess's fork for a preexec_fn too): taking a
    lock another thread of the parent held left the child waiting for ever, and the daemon's
    worker waiting for the child's exec (a handoff stuck, a SIGTERM unanswered)."""
    import signal
    import threading
    import time

    from handoffd.backends.files import dirsync
    lock = spares._lock if held == "spares" else dirsync._cv
    taken, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            taken.set()
            release.wait(20)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert taken.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: the hooks have run; leave at once
            os._exit(0)
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        release.set()
        thread.join(timeout=20)


# ---------------------------------------------------------------- reading documents

def test_a_document_is_read_in_one_read_of_its_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read of the fstat size plus a byte (a short read is the end of a regular file), not
    a fixed 1 MB buffer that glibc allocates whole for every document read."""
    path = tmp_path / "doc.json"
    path.write_bytes(b'{"a": 1}')
    asked: list[int] = []
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        asked.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    data, _ = fsio.read_bytes_safely(path, 4 << 20)
    assert data == b'{"a": 1}' and asked == [9]


@pytest.mark.parametrize("size", [0, 5, fsio.READ_STEP, 3 * fsio.READ_STEP + 7])
def test_a_document_that_grew_after_fstat_is_read_whole(tmp_path: Path, size: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "doc.json"
    path.write_bytes(b"x" * size + b"tail")
    real_fstat = os.fstat

    def stale(fd: int) -> os.stat_result:  # the size before the producer's last write
        info = real_fstat(fd)
        fields = list(info)
        fields[6] = size
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", stale)
    data, _ = fsio.read_bytes_safely(path, 4 << 20)
    assert data == b"x" * size + b"tail"
    with pytest.raises(InvalidDocument, match="grew over"):
        fsio.read_bytes_safely(path, size + 2)


# ---------------------------------------------------------------- a producer's inode, adopted
def producer_file(folder: Path, name: str, mode: int = 0o644) -> Path:
    path = folder / name
    path.write_bytes(b'{"from": "a producer"}')
    path.chmod(mode)
    return path


def test_a_closed_producer_file_of_ours_is_adopted_with_our_mode(tmp_dir: Path,
                                                                 tmp_path: Path) -> None:
    """What the claim does where the filesystem cannot exchange two files: a second name first,
    then the replace, then adopt (with an exchange: tests/test_claim_stall.py)."""
    doc = producer_file(tmp_path, "in-progress.json", 0o666)
    inode = doc.stat().st_ino
    kept = spares.keep_link(doc, tmp_dir)
    assert kept is not None
    fsio.replace(doc, b'{"leased": 1}', tmp_dir, durable=False)  # the producer's name is ours now
    assert spares.adopt(kept, tmp_dir)
    target = tmp_path / "completed.json"
    fsio.create_exclusive(target, b'{"answer": 1}', tmp_dir, durable=False)
    assert target.stat().st_ino == inode  # the producer's inode holds the answer: none created
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)  # never writable by others
    assert target.read_bytes() == b'{"answer": 1}'


def test_a_producer_file_still_open_elsewhere_is_never_adopted(tmp_dir: Path,
                                                               tmp_path: Path) -> None:
    """A producer that kept its descriptor could write through it later: the kernel refuses the
    write lease while any other open file description refers to the file, and it is unlinked."""
    doc = producer_file(tmp_path, "in-progress.json")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "f = open(sys.argv[1], 'r+b'); print('open', flush=True)\n"
                               "time.sleep(30)\n", str(doc)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        kept = spares.keep_link(doc, tmp_dir)
        assert kept is not None
        doc.unlink()  # (the replace)
        assert spares.adopt(kept, tmp_dir) is False
        assert list(tmp_dir.iterdir()) == []  # unlinked, as before adoption existed
    finally:
        holder.kill()
        holder.wait(10)
    with open(producer_file(tmp_path, "again.json"), "rb"):  # our own other descriptor too
        kept = spares.keep_link(tmp_path / "again.json", tmp_dir)
        assert kept is not None
        (tmp_path / "again.json").unlink()
        assert spares.adopt(kept, tmp_dir) is False


def test_a_producer_file_with_another_name_is_never_adopted(tmp_dir: Path, tmp_path: Path) -> None:
    doc = producer_file(tmp_path, "in-progress.json")
    os.link(doc, tmp_path / "the-producers-own-link")  # written through that name later
    kept = spares.keep_link(doc, tmp_dir)
    assert kept is not None
    doc.unlink()
    assert spares.adopt(kept, tmp_dir) is False
    assert list(tmp_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_producer_file_is_never_adopted(tmp_dir: Path, tmp_path: Path) -> None:
    doc = producer_file(tmp_path, "in-progress.json")
    os.chown(doc, 65534, 65534)
    kept = spares.keep_link(doc, tmp_dir)
    assert kept is not None
    doc.unlink()
    assert spares.adopt(kept, tmp_dir) is False


def test_a_late_write_through_a_producers_descriptor_never_reaches_a_filed_document(
        tmp_path: Path) -> None:
    """End to end through `handoffd run`: a producer keeps its descriptor on a request it renamed
    into pending/, then writes through it after the request was filed; every filed document,
    of that handoff and of those filed after it (the writes that might reuse its inode), is
    intact."""
    from conftest import Workspace, exe

    from handoffd.core.workspace import Workspace as Folders
    Folders(tmp_path).ensure()
    ws = Workspace(tmp_path)
    ws.write_config('[specialists."@echo"]\nhandler = "echoplug:echo"\n')
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "echoplug.py").write_text(
        "def echo(handoff, ctx):\n    return {'status': 'completed', 'output': {'ok': 1}}\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "plug"))
    request = {"handoff_id": "held", "target": {"agent_id": "@echo"}, "input": {"data": {}}}
    part = tmp_path / "handoffs" / ".held.part"
    part.write_text(json.dumps(request))
    held = open(part, "r+b")  # the producer keeps it open
    try:
        os.rename(part, tmp_path / "handoffs" / "pending" / "held.json")
        done = subprocess.run([exe("handoffd"), "run", "--root", str(tmp_path), "-q"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        held.seek(0)
        held.write(b"LATE" * 400)  # the late write
        held.flush()
    finally:
        held.close()
    for i in range(40):  # more handoffs, whose writes take the spares
        ws.drop(f"after-{i:02d}.json", dict(request, handoff_id=f"after-{i:02d}"))
    done = subprocess.run([exe("handoffd"), "run", "--root", str(tmp_path), "-q"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    filed = sorted((tmp_path / "handoffs" / "completed").glob("*.json"))
    assert len(filed) == 41
    for path in filed:
        text = path.read_text()
        assert "LATE" not in text
        assert json.loads(text)["handoff_id"] == path.stem


def test_an_open_while_the_lease_is_held_does_not_end_the_process(tmp_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process opening the file in the instant adopt holds its lease makes the kernel
    signal the lease holder: by default SIGIO, which would end the daemon. adopt asks for SIGURG
    (ignored by default): the opener waits for the lease to be given up, and nothing dies."""
    import fcntl
    import time
    doc = producer_file(tmp_path, "in-progress.json")
    kept = spares.keep_link(doc, tmp_dir)
    assert kept is not None
    doc.unlink()
    real = fcntl.fcntl
    opener: list[subprocess.Popen[str]] = []

    def slow(fd: int, cmd: int, arg: int = 0) -> int:
        result = real(fd, cmd, arg)
        if cmd == fcntl.F_SETLEASE and arg == fcntl.F_WRLCK:  # someone opens it now
            opener.append(subprocess.Popen([sys.executable, "-c", "import sys\n"
                                            "open(sys.argv[1]).close(); print('opened')\n",
                                            str(kept)], stdout=subprocess.PIPE, text=True))
            time.sleep(1.0)  # the open is waiting on the lease by now; the signal has been sent
        return int(result)

    monkeypatch.setattr(spares.fcntl, "fcntl", slow)
    assert spares.adopt(kept, tmp_dir) is True  # it was nobody's when the lease was granted
    out, _ = opener[0].communicate(timeout=30)
    assert out.strip() == "opened"  # the opener went on once the lease was given up


def test_without_leases_nothing_is_adopted(tmp_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot say that nobody has a file open, no producer's file is kept."""
    monkeypatch.setattr(spares, "LEASES", False)
    assert spares.keep_link(producer_file(tmp_path, "in-progress.json"), tmp_dir) is None


def test_a_spare_whose_descriptor_is_closed_under_the_write_is_written_again_fresh(
        tmp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python handler's os.closerange() can close a spare's descriptor between the take and
    the write (EBADF): the document is written to a fresh file, not left in in-progress/."""
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b"ours")
    assert spares.retire(doc, tmp_dir)
    real_take = spares.take

    def take_then_close(folder: Path) -> tuple[Path, int, int] | None:
        taken = real_take(folder)
        if taken is not None:
            os.close(taken[1])  # what os.closerange(3, 50) in a handler thread does
        return taken

    monkeypatch.setattr(spares, "take", take_then_close)
    target = tmp_path / "filed.json"
    fsio.create_exclusive(target, b'{"filed": 1}', tmp_dir, durable=True)
    assert target.read_bytes() == b'{"filed": 1}'
    assert list(tmp_dir.iterdir()) == []  # the spare written through nothing was removed


def test_a_spare_whose_descriptor_is_closed_before_its_fstat_is_passed_over(
        tmp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "in-progress.json"
    doc.write_bytes(b"ours")
    assert spares.retire(doc, tmp_dir)
    real_fstat = os.fstat

    def fstat_after_close(fd: int) -> os.stat_result:
        os.close(fd)
        return real_fstat(fd)  # EBADF

    with monkeypatch.context() as patched:  # os.fstat is the whole process's: patch briefly
        patched.setattr(spares.os, "fstat", fstat_after_close)
        taken = spares.take(tmp_dir)
    assert taken is None  # the only spare passed over, not written or closed
