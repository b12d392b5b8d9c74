"""Opening handoffd's own files (its records, logs, locks, keys, archives) so that nothing placed
where one of them lives can hang or mislead a process: never through a symlink, never blocking on
a FIFO or a device, only a regular file, and read with a bound.

A FIFO dropped where a record lives once froze the daemon in ``open()``, deaf even to SIGTERM; a
symlink to ``/dev/zero`` made it read until memory ran out; a symlinked archive sent an append
outside the workspace. Every layer opens these files here (the files backend, the features that
keep files of their own, the process records of the core)."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Sequence

from .errors import SHORTAGE_ERRNOS, shortage_words

READ_STEP = 1 << 16
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: Path | str, flags: int, mode: int = 0o644, *,
                 dir_fd: int | None = None) -> int:
    """``os.open`` with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` added, for a regular file only:
    anything else is an OSError (ELOOP for a symlink, ENXIO for a FIFO opened to write with no
    reader, EINVAL for what opened but is no regular file). ``dir_fd``: ``path`` is a name in
    that folder (see :func:`open_folder`)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_reading(path: Path | str) -> BinaryIO:
    """One of handoffd's own files opened for reading, as a file object (:func:`open_regular`)."""
    return os.fdopen(open_regular(path, os.O_RDONLY), "rb")


def read_at_most(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd`` (fewer only at its end), read a step at a time: a caller
    that asks one more byte than it accepts tells a file over its bound."""
    chunks, remaining = [], size
    while remaining > 0:
        chunk = os.read(fd, min(remaining, READ_STEP))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_regular(path: Path | str, max_bytes: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of one of handoffd's own files (:func:`open_regular`); OSError (EFBIG) when it
    holds more than ``max_bytes``."""
    fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        data = read_at_most(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", os.fspath(path))
    return data


def plain_folder(path: Path) -> bool:
    """True when ``path`` is a folder itself (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_folder(path: Path | str, *, make: bool = False) -> int:
    """A descriptor of the folder ``path`` itself, opened without following a symlink, to read,
    write and remove records through (names relative to it, ``dir_fd=``): FileNotFoundError
    when it is missing; another OSError (ELOOP, ENOTDIR) for a symlink or anything but a folder.
    A folder swapped for a link after it was opened is not followed either. ``make``: made
    first (with its parents) when missing."""
    if make:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # a file or a dangling symlink: refused by the open
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def open_beneath(base: Path | str, parts: Sequence[str], *, make: bool = False) -> int:
    """A descriptor of the folder ``base/<parts...>``, each of ``parts`` opened relative to the
    one before with ``O_NOFOLLOW`` (made first, by ``mkdirat``, when missing and ``make``): a
    symlink at any of them, even one swapped in a moment before, is an OSError (ENOTDIR or
    ELOOP; FileNotFoundError for a missing one), never followed. :func:`open_folder`'s
    ``mkdir(parents=True)`` followed a symlinked parent and made folders (and then records) outside
    the workspace. ``base`` itself is opened as it is: a symlinked ``handoffs/`` is the user's
    choice (:meth:`~handoffd.core.workspace.Workspace.check_state_folders`). The OSError names
    the path of the part that failed."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for at, part in enumerate(parts):
            try:
                try:
                    child = os.open(part, _FOLDER_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not make:
                        raise
                    try:  # (mkdirat: a symlink at that name is never followed, EEXIST)
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile, or a link or file: refused by the open
                    child = os.open(part, _FOLDER_FLAGS, dir_fd=fd)
            except OSError as exc:
                exc.filename = os.path.join(base, *parts[:at + 1])
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def not_a_folder(path: Path | str, what: str, exc: OSError | None = None) -> OSError:
    """The error for a records folder that is no plain folder of the workspace (a symlink planted
    there would take reads, writes and removals outside it); ``what``: what is refused. When
    opening it failed for a passing shortage (``exc``: EMFILE, ENFILE, ENOMEM), that shortage,
    with its errno, named as such: a folder is no symlink for want of a descriptor."""
    if exc is not None and exc.errno in SHORTAGE_ERRNOS:
        return OSError(exc.errno, f"cannot open it: {shortage_words(exc)}; {what} for now",
                       os.fspath(path))
    return OSError(errno.ENOTDIR, f"not a folder of the workspace (a symlink?); {what}",
                   os.fspath(path))


def folder_refusal(path: Path | str, exc: OSError | None, refused: str) -> str:
    """The line for a folder of the workspace that cannot be used (``exc``: why opening it
    failed), ``refused`` saying what is not done through it: "cannot open <path>: Too many open
    files (EMFILE: the daemon's limit on open files, ulimit -n); <refused> for now" when it is
    a passing shortage of descriptors or memory, else "<path> is not a folder of the workspace
    (a symlink?): <refused> until it is one (<the error>)". The one wording for every such
    line: a descriptor shortage was once called a symlink."""
    if exc is not None and exc.errno in SHORTAGE_ERRNOS:
        return f"cannot open {os.fspath(path)}: {shortage_words(exc)}; {refused} for now"
    detail = f" ({exc.strerror or exc})" if exc is not None else ""
    return (f"{os.fspath(path)} is not a folder of the workspace (a symlink?): {refused} until "
            f"it is one{detail}")


def _umask_now() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# the process's umask as it started: a Python handler may change it later (077: documents only
# we can read; 777: mode 000), and what handoffd writes keeps this one
START_UMASK = _umask_now()
