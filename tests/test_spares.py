"""Spare temp files (backends/files/spares.py): a filed handoff's in-progress inode is reused for
the next write, and never when it stopped being a plain file of ours."""
from __future__ import annotations

import json
import os
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
