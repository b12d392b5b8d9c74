"""The sweep's removal of orphaned files (:func:`remove_orphans`, one of the repairs of
:mod:`.repair`): temp files older than :data:`TMP_MAX_AGE_SECONDS` in ``.tmp`` (and a process's
own temp folder in it), the shared records' temp files a dead update left in ``.meta``, lock files
in ``.locks`` that no claim uses, and new owner locks left under their staging name by a process
that died.

Nothing is followed out of the workspace: each folder is opened once without following a link
and everything in it is looked at, locked and removed through that descriptor (:func:`_opened`);
:func:`_plain_folder` tells whether a folder of the workspace is one. :data:`Repairs` is the
report every repair appends to (here, below the repairs that share it).
"""
from __future__ import annotations

import fcntl
import os
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ...core import recurring
from ...core.errors import SHORTAGE_ERRNOS
from ...core.logs import log
from ...core.ownfiles import folder_refusal
from ...core.states import State
from .leases import STAGED_OWNER_LOCK_NAME
from .records import TEMP_NAME
from .store import Store

TMP_MAX_AGE_SECONDS = 300.0
Repairs = dict[str, list[str]]


def remove_orphans(store: Store, done: Repairs) -> None:
    """Delete temp files older than a few minutes, lock files no claim uses, and new owner locks
    whose process died before naming them (see :meth:`.leases.OwnerLocks._take`).

    A ``.tmp``, ``.meta`` or ``.locks`` that is not a plain folder of the workspace is skipped
    with one error line: the sweep once followed a symlink planted there and deleted old files
    and unlocked ``*.lock`` files (``Cargo.lock``) outside the workspace. Each folder is opened
    once without following a link, and everything in it is looked at, locked and removed
    through that descriptor: a folder swapped for a link *during* the sweep is not followed
    either (it keeps sweeping the folder it opened, now out of the workspace's way)."""
    ws = store.ws
    cutoff = time.time() - TMP_MAX_AGE_SECONDS
    with _opened(ws.tmp) as fd:
        if fd is not None:
            _remove_old_temps(fd, cutoff, done)
    with _opened(ws.meta, quiet=True) as fd:  # (a shared record's temp file a dead update left)
        if fd is not None:
            _remove_old_record_temps(fd, cutoff, done)
    with _opened(ws.locks) as fd:
        if fd is None:
            return
        active = set(store.ids(State.IN_PROGRESS))
        for entry in _scan(fd):
            if STAGED_OWNER_LOCK_NAME.fullmatch(entry.name):
                _remove_dead_staged(fd, entry, cutoff, done)
                continue
            handoff_id = entry.name.rsplit(".", 2)[0] if entry.name.endswith(".lock") else None
            if handoff_id is None or handoff_id in active:
                continue
            if _remove_unlocked(fd, entry.name):
                done["locks_removed"].append(entry.name)


def _remove_dead_staged(folder: int, entry: os.DirEntry[str], cutoff: float,
                        done: Repairs) -> None:
    """Remove a new owner lock left under its staging name, once it was made before ``cutoff``
    and nobody holds it: its process died between making it and naming it (a live one flocks it
    at once and renames it a moment later)."""
    try:
        if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
            return  # its process may be naming it right now
    except FileNotFoundError:
        return  # named meanwhile
    if _remove_unlocked(folder, entry.name):
        done["locks_removed"].append(entry.name)


def _remove_unlocked(folder: int, name: str) -> bool:
    """Remove the lock file ``name`` of ``folder`` (a descriptor) if nobody holds it (flock, as
    the lock's owners take it) and it is still the file we locked; True if removed. Never
    created, never followed: a symlink or anything but a regular file is left alone."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=folder)
    except OSError:  # gone, a symlink (ELOOP), not ours to open: not a lock to remove
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its claim (or staged owner) is alive
            return False
        try:
            now = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return False  # replaced meanwhile by a lock someone else may hold
        os.unlink(name, dir_fd=folder)
        return True
    finally:
        os.close(fd)  # (releases the flock)


@contextmanager
def _opened(folder: Path, *, quiet: bool = False) -> Iterator[int | None]:
    """A descriptor of ``folder`` when it is a folder of the workspace itself, to sweep through;
    None when it is missing (nothing to sweep) or anything else, a symlink above all (one error
    line unless ``quiet``)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:  # ELOOP (a symlink), ENOTDIR (a file), EACCES; EMFILE: no descriptor
        if quiet:
            pass
        elif exc.errno in SHORTAGE_ERRNOS:  # passing: a WARNING, said once while it lasts
            recurring.error(f"opening {folder}", exc, "sweep: %s",  # (not every sweep)
                            folder_refusal(folder, exc, "nothing in it is removed"))
        else:
            log.error("sweep: %s", folder_refusal(folder, exc, "nothing in it is removed"))
        yield None
        return
    recurring.ok(f"opening {folder}")  # (a shortage said before: its end is said)
    try:
        yield fd
    finally:
        os.close(fd)


def _plain_folder(folder: Path, *, quiet: bool = False) -> bool:
    """True when ``folder`` is a folder of the workspace itself; False when it is missing or
    anything else, a symlink above all (one error line unless ``quiet``)."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        return True
    if not quiet:  # (an lstat: no descriptor to run short of)
        log.error("sweep: %s", folder_refusal(folder, None, "nothing in it is removed"))
    return False


def _remove_old_record_temps(folder: int, cutoff: float, done: Repairs) -> None:
    """Delete the shared records' temp files (:data:`.records.TEMP_NAME`) in ``folder`` (a
    descriptor) last changed before ``cutoff``: an update writes one and renames it over the
    kind's file, so one left there is a dead process's (nothing else in ``.meta`` is touched)."""
    for entry in _scan(folder):
        if not TEMP_NAME.fullmatch(entry.name):
            continue
        try:
            if entry.is_file(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.name, dir_fd=folder)
                done["temp_files_removed"].append(entry.name)
        except FileNotFoundError:
            continue


def _remove_old_temps(folder: int, cutoff: float, done: Repairs, *, depth: int = 0) -> None:
    """Delete the files in ``folder`` (a descriptor) last changed before ``cutoff``; in its
    subfolders (a process's own temp folder, see :func:`spares.own_folder`) too, and such a
    folder itself once it is empty and was idle since ``cutoff`` (its process ended, or makes it
    again)."""
    for entry in _scan(folder):
        try:
            if entry.is_dir(follow_symlinks=False):
                if depth == 0:  # one level: nothing handoffd makes goes deeper
                    idle = entry.stat(follow_symlinks=False).st_mtime < cutoff
                    _remove_in_subfolder(folder, entry.name, cutoff, done)
                    if idle:
                        _rmdir_quietly(folder, entry.name)
            elif entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.name, dir_fd=folder)
                done["temp_files_removed"].append(entry.name)
        except FileNotFoundError:
            continue


def _remove_in_subfolder(folder: int, name: str, cutoff: float, done: Repairs) -> None:
    try:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=folder)
    except OSError:  # gone, or swapped for a link meanwhile: not followed
        return
    try:
        _remove_old_temps(sub, cutoff, done, depth=1)
    finally:
        os.close(sub)


def _rmdir_quietly(folder: int, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=folder)
    except OSError:  # not empty (a young temp file in it), or gone
        pass


def _scan(folder: int) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
