"""Spare temp files: inodes kept for the next write instead of freed.

A handoff costs the files store two files (the in-progress copy with its lease, the filed answer)
and frees one (the producer's, which the in-progress copy replaces). On ext4 creating a file is
the dearest step of all: the inode allocator skips every inode freed within the last minutes
(``recently_deleted``), reading each one's block to check, so at a few hundred handoffs a second
each creation scans thousands of them (0.1-1 ms here, more than the rest of a handoff's system
calls together), and every inode freed makes the next creations dearer.

So no inode is created or freed per handoff once a process runs:

- When a handoff is filed, its in-progress copy (a file this process wrote) is renamed into the
  temp folder instead of unlinked (:func:`retire`).
- When a claim replaces the producer's file with its leased copy, the producer's inode is kept
  too (the lease write exchanges the two, which leaves the producer's file at a temp name, and
  :func:`keep_displaced` adopts it; where no exchange can be made, :func:`keep_link` gives it
  a second name before a plain replace), but only when it can never be written by anyone else:
  a regular file we own, whose only name is now ours, and that no process has open. The kernel says the last: it grants a write lease (``F_SETLEASE``,
  ``F_WRLCK``) only on a file no other open file description refers to, and from then on the
  file has no name but ours, so a producer that kept its descriptor (a late write through it
  must never land in a document filed later) keeps the file from being adopted, and it is
  unlinked as before. An adopted inode gets mode 0644, as a file handoffd creates. (The lease
  is held for two system calls; an open in that instant makes the kernel signal us, and the
  signal asked for is SIGURG, ignored by default, not SIGIO, which would end the process.)

The next temp file is then one of these inodes, rewritten. A spare is an ordinary temp file
(``*.tmp``): a process that dies leaves its spares for the sweeper, which removes temp files
after a few minutes; a spare removed under a live process is simply not found, and a fresh file
is made.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import signal
import stat
import threading
from pathlib import Path

TMP_SUFFIX = ".tmp"
KEPT = 32  # spares kept per temp folder: a burst's worth; more are unlinked as before

# a producer's inode is adopted only where the kernel can say nobody has it open (Linux leases)
LEASES = hasattr(fcntl, "F_SETLEASE") and hasattr(fcntl, "F_SETSIG")
OWN_PREFIX = "p"  # a process's own temp folder: handoffs/.tmp/p<pid>-<random>/ (see own_folder)

_lock = threading.Lock()
# temp folder -> its spares, both as text: a filing takes a spare and keeps another, and a
# Path asks Python code for its hash and, at each system call, for its text
_pools: dict[str, list[str]] = {}
_folders: list[Path] = []  # this process's own temp folders, removed (when empty) as it ends


def temp_name(folder: str) -> str:
    """A new temp file's path in ``folder``: a random name no other file has."""
    return f"{folder}/{os.urandom(16).hex()}{TMP_SUFFIX}"


def take(tmp_dir: str | Path) -> tuple[str, int, int] | None:
    """A spare of ``tmp_dir`` opened for writing at offset 0, with its current size, or None
    when there is none. The caller writes over it and cuts what is left beyond its own data:
    emptying it first cost a truncate that freed every block only for the write
    to allocate them again (~0.2 ms on ext4, a tenth of a no-op handoff).

    A spare that is no longer a plain regular file with one name (removed, replaced, linked
    elsewhere meanwhile) is dropped, never written through."""
    while True:
        with _lock:
            pool = _pools.get(os.fspath(tmp_dir))
            if not pool:
                return None
            path = pool.pop()
        try:  # O_NONBLOCK: a FIFO put in its place must not hang the write
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
        except OSError:  # EBADF: a handler closed our descriptors (os.closerange) just now; the
            continue     # number is not ours any more, so it is neither written nor closed
        # written only once it is known to be ours alone: not O_TRUNC, which would empty a file
        # someone linked to it meanwhile (a backup's hard link of an in-progress copy)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return path, fd, info.st_size
        os.close(fd)
        remove_quietly(path)


def keep_link(path: str | Path, tmp_dir: str | Path) -> str | None:
    """A second name for ``path`` in ``tmp_dir`` (a hard link), made before ``path`` is replaced
    so that its inode outlives the replace; None when the pool is full or no link can be made.
    Give it to :func:`adopt` once ``path`` is replaced (or :func:`remove_quietly` on failure)."""
    if not LEASES:
        return None
    folder = os.fspath(tmp_dir)
    with _lock:
        if len(_pools.get(folder, ())) >= KEPT:
            return None
    spare = temp_name(folder)
    try:
        os.link(path, spare)
    except OSError:  # no hard links here (or protected_hardlinks refuses a file not ours)
        return None
    return spare


def adopt(spare: str | Path, tmp_dir: str | Path) -> bool:
    """Keep ``spare`` (from :func:`keep_link`, its old name since replaced) as a spare of
    ``tmp_dir`` when nobody else can ever write it: a regular file we own, with no other name,
    that no other open file description refers to (the kernel grants a write lease only then).
    Else unlink it. True when kept."""
    try:
        fd = os.open(spare, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        remove_quietly(spare)
        return False
    try:
        # were anyone to open it while the lease is held, the kernel would signal this process
        # (SIGIO by default, which ends it): ask for SIGURG instead, which is ignored by default
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # EAGAIN: someone has it open
        try:
            # looked at under the lease: with no descriptor left anywhere, no new name can be
            # made for it but through ours (a linkat of a descriptor closed just before the
            # lease shows here)
            info = os.fstat(fd)
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        if not (stat.S_ISREG(info.st_mode) and info.st_nlink == 1
                and info.st_uid == os.geteuid()):
            raise PermissionError("not ours alone")
        if stat.S_IMODE(info.st_mode) != 0o644:
            os.fchmod(fd, 0o644)  # as a file we create: never writable by others
    except OSError:  # (EINVAL, ENOLCK: a filesystem without leases, such as NFS)
        os.close(fd)
        remove_quietly(spare)
        return False
    os.close(fd)
    with _lock:
        _pools.setdefault(os.fspath(tmp_dir), []).append(os.fspath(spare))
    return True


def keep_displaced(path: str | Path, tmp_dir: str | Path) -> bool:
    """Keep ``path``, a file a claim's lease write displaced to a temp name of ``tmp_dir`` (or
    kept there by :func:`keep_link`; see :func:`.fsio.replace_exact`), as a spare when :func:`adopt` allows it and the pool has room;
    else unlink it. True when kept."""
    with _lock:
        full = len(_pools.get(os.fspath(tmp_dir), ())) >= KEPT
    if full or not LEASES:
        remove_quietly(path)
        return False
    return adopt(path, tmp_dir)


def retire(path: str | Path, tmp_dir: str | Path) -> bool:
    """Remove ``path`` (a file this process wrote) from where it is, keeping its inode as a
    spare of ``tmp_dir``; False when it was already gone. Not durable, as an unlink is not."""
    folder = os.fspath(tmp_dir)
    with _lock:
        full = len(_pools.get(folder, ())) >= KEPT
    if not full:
        spare = temp_name(folder)
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            if os.path.lexists(path):  # the temp folder is missing: unlink as before
                return remove(path)
            return False
        except OSError:  # e.g. EXDEV: a .tmp/ on another filesystem; unlink as before
            return remove(path)
        with _lock:
            _pools.setdefault(folder, []).append(spare)
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


def remove(path: str | Path) -> bool:
    """Unlink ``path``; False when it was already gone (not durable). :mod:`.fsio` uses it too."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_quietly(path: str | Path) -> None:
    """Unlink ``path`` if it can be; a temp file left behind is the sweeper's."""
    try:
        os.unlink(path)
    except OSError:
        pass


os.register_at_fork(after_in_child=forget)
atexit.register(release)
