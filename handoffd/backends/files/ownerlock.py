"""The files store's owner lock: the lock file in ``handoffs/.locks`` this process flocks for as
long as it lives, which every claim it makes names in its lease. Another process takes a claim
for abandoned once it can take that lock itself (see :mod:`.repair`).

A Python handler runs inside the process and may close descriptors it did not open
(``os.closerange(3, ...)``): that drops the lock silently. :class:`OwnerLock` remembers what the
descriptor is (its file's identity and an offset of its own) so the store can tell, cheaply at
every claim and fully from the lease keeper's lock check, that it no longer holds it.
"""
from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("handoffd")


@dataclass(frozen=True)
class OwnerLock:
    """A store's owner lock as this process holds it: the lock file ``name`` in
    ``handoffs/.locks``, flocked through descriptor ``fd`` by process ``pid``.

    ``dev`` and ``ino`` are the file's, and ``mark`` the descriptor's file offset, set when it
    was opened: a handler that closed the descriptor leaves its number free for any file the
    process opens next, even the lock file itself, which only this offset tells apart (a new
    opening starts at 0, and holds no lock)."""

    name: str
    fd: int
    pid: int
    dev: int
    ino: int
    mark: int

    @classmethod
    def mark_open(cls, name: str, fd: int) -> "OwnerLock":
        """The lock held through ``fd`` (just flocked), its offset set to a mark of its own."""
        mark = int.from_bytes(os.urandom(4), "big") | 1  # (never 0: where a new opening is)
        os.lseek(fd, mark, os.SEEK_SET)  # an empty file: the offset only, nothing is written
        info = os.fstat(fd)
        return cls(name, fd, os.getpid(), info.st_dev, info.st_ino, mark)

    def fd_intact(self) -> bool:
        """True while ``fd`` is still open on the lock file: one ``fstat``, cheap enough for
        every claim (a descriptor closed and reopened on the lock file itself passes; the full
        check, :meth:`problem`, runs from the lease keeper's lock check twice a second)."""
        try:
            info = os.fstat(self.fd)
        except OSError:  # EBADF: closed
            return False
        return (info.st_dev, info.st_ino) == (self.dev, self.ino)

    def fd_ours(self) -> bool:
        """True while ``fd`` is still the descriptor this process opened and flocked (so it may
        be closed): open on the lock file, at our mark."""
        if not self.fd_intact():
            return False
        try:
            return os.lseek(self.fd, 0, os.SEEK_CUR) == self.mark
        except OSError:
            return False

    def problem(self, folder: Path) -> str | None:
        """Why this process may no longer hold the lock (None: it does): another process
        judging our claims opens ``folder / name``, so the file there must still be the one
        our descriptor holds."""
        try:
            info = os.fstat(self.fd)
        except OSError:
            return "its descriptor was closed"
        if (info.st_dev, info.st_ino) != (self.dev, self.ino):
            return "its descriptor was closed and its number reused for another file"
        try:
            if os.lseek(self.fd, 0, os.SEEK_CUR) != self.mark:
                return "its descriptor was closed and the lock file opened again in its place"
        except OSError:
            return "its descriptor was closed and its number reused for another file"
        try:
            on_disk = os.stat(folder / self.name, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return "its file was removed"
        except OSError:  # (EACCES, EIO: the folder cannot be read; the descriptor is fine)
            return None
        if (on_disk.st_dev, on_disk.st_ino) != (self.dev, self.ino):
            return "its file was replaced"
        return None


def hold_again(lost: OwnerLock, folder: Path) -> OwnerLock | None:
    """``lost`` locked again under a new descriptor, if its file is still the one it was and
    nobody holds it; else None (another process took it, or removed it after taking it)."""
    path = folder / lost.name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        again = OwnerLock.mark_open(lost.name, fd)
        on_disk = os.stat(path, follow_symlinks=False)  # (not removed while we locked it)
    except OSError:
        close_quietly(fd)
        return None
    same = (again.dev, again.ino) == (lost.dev, lost.ino) == (on_disk.st_dev, on_disk.st_ino)
    if not same:
        close_quietly(fd)
        return None
    return again


def drop_lock(lock: OwnerLock, folder: Path) -> None:
    """Remove ``lock``'s file and close its descriptor, if the descriptor is still ours; never
    raises. A lost one is left alone: its file may be held (and removed) by whoever took it."""
    if not lock.fd_ours():
        return
    try:
        on_disk = os.stat(folder / lock.name, follow_symlinks=False)
        if (on_disk.st_dev, on_disk.st_ino) == (lock.dev, lock.ino):
            os.unlink(folder / lock.name)
    except OSError:
        pass  # gone already, or the folder cannot be read: a later sweep removes it
    close_quietly(lock.fd)


def say_lost(lost: OwnerLock, why: str, fresh: OwnerLock) -> None:
    """The one warning line for a lost owner lock."""
    log.warning("a handler closed the daemon's owner lock %s (%s): another process may take "
                "the handoffs running on it for abandoned, so they are stopped and retried; new "
                "claims hold %s (a handler must not close file descriptors it did not open)",
                lost.name, why, fresh.name)


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
