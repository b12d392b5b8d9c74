"""Spare temp files: inodes handoffd made, kept for its next write instead of freed.

A handoff costs the files store two new files (the in-progress copy with its lease, the filed
answer) and removes one of them when it is filed. On ext4 creating a file is the dearest step of
all: the inode allocator skips every inode freed within the last minute (``recently_deleted``),
reading each one's block to check, so at a few hundred handoffs a second each creation scans
thousands of them (0.3-1 ms here, more than the rest of a handoff's system calls together).

So when a handoff is filed, its in-progress copy (a file this process wrote) is renamed into
``handoffs/.tmp/`` instead of unlinked, and the next temp file is that inode, truncated and
rewritten: no allocation and no free for it. Only inodes handoffd wrote itself are kept: a
producer's file may still be open in the producer, and a late write through that descriptor must
never land in a document filed later. A spare is an ordinary temp file (``*.tmp``): a process that
dies leaves its spares for the sweeper, which removes temp files after a few minutes; a spare
removed under a live process is simply not found, and a fresh file is made.
"""
from __future__ import annotations

import atexit
import os
import stat
import threading
from pathlib import Path

TMP_SUFFIX = ".tmp"
KEPT = 32  # spares kept per temp folder: a burst's worth; more are unlinked as before

OWN_PREFIX = "p"  # a process's own temp folder: handoffs/.tmp/p<pid>-<random>/ (see own_folder)

_lock = threading.Lock()
_pools: dict[Path, list[Path]] = {}
_folders: list[Path] = []  # this process's own temp folders, removed (when empty) as it ends


def take(tmp_dir: Path) -> tuple[Path, int, int] | None:
    """A spare of ``tmp_dir`` opened for writing at offset 0, with its current size, or None
    when there is none. The caller writes over it and cuts what is left beyond its own data:
    emptying it first cost a truncate that freed every block only for the write
    to allocate them again (~0.2 ms on ext4, a tenth of a no-op handoff).

    A spare that is no longer a plain regular file with one name (removed, replaced, linked
    elsewhere meanwhile) is dropped, never written through."""
    while True:
        with _lock:
            pool = _pools.get(tmp_dir)
            if not pool:
                return None
            path = pool.pop()
        try:  # O_NONBLOCK: a FIFO put in its place must not hang the write
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        info = os.fstat(fd)
        # written only once it is known to be ours alone: not O_TRUNC, which would empty a file
        # someone linked to it meanwhile (a backup's hard link of an in-progress copy)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return path, fd, info.st_size
        os.close(fd)
        remove_quietly(path)


def retire(path: Path, tmp_dir: Path) -> bool:
    """Remove ``path`` (a file this process wrote) from where it is, keeping its inode as a
    spare of ``tmp_dir``; False when it was already gone. Not durable, as an unlink is not."""
    with _lock:
        full = len(_pools.get(tmp_dir, ())) >= KEPT
    if not full:
        spare = tmp_dir / f"{os.urandom(16).hex()}{TMP_SUFFIX}"
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            if os.path.lexists(path):  # the temp folder is missing: unlink as before
                return remove(path)
            return False
        except OSError:  # e.g. EXDEV: a .tmp/ on another filesystem; unlink as before
            return remove(path)
        with _lock:
            _pools.setdefault(tmp_dir, []).append(spare)
        return True
    return remove(path)


def own_folder(parent: Path) -> Path:
    """A new temp folder under ``parent`` for this process alone, removed when the process ends
    (if empty: a temp file a crashed write left there is the sweeper's, and so is then the
    folder). Why a folder of its own: creating a file holds its folder's lock while ext4 looks
    for a free inode (0.1-0.3 ms here, see the top of this module), and processes that share one
    temp folder spin on that lock; a drain on two processes spent 7% of its CPU there."""
    path = parent / f"{OWN_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    path.mkdir(parents=True)
    with _lock:
        _folders.append(path)
    return path


def forget() -> None:
    """Drop every pool: a forked child must not write (nor, at exit, unlink) the spares its
    parent uses. Runs in the child right after fork, where another thread of the parent may
    have held the lock: a fresh lock and dict, never an acquire (that waited for ever)."""
    global _lock, _pools, _folders
    _lock = threading.Lock()
    _pools = {}
    _folders = []


def release() -> None:
    """Unlink every spare this process keeps, and remove its own temp folders: a process that
    ends cleanly leaves no temp files (left ones are a crash's, which the sweeper counts and
    removes)."""
    with _lock:
        kept = [path for pool in _pools.values() for path in pool]
        _pools.clear()
        folders = list(_folders)
        _folders.clear()
    for path in kept:
        remove_quietly(path)
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty, or gone: the sweeper's
            pass


def remove(path: Path) -> bool:
    """Unlink ``path``; False when it was already gone (not durable). :mod:`.fsio` uses it too."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_quietly(path: Path) -> None:
    """Unlink ``path`` if it can be; a temp file left behind is the sweeper's."""
    try:
        os.unlink(path)
    except OSError:
        pass


os.register_at_fork(after_in_child=forget)
atexit.register(release)
