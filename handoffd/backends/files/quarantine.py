"""The quarantine (``handoffs/.quarantine``): moving an entry that cannot be used out of the way,
with a ``.reason.json`` beside it that ``handoff ls --state quarantined`` reads, and the entries
planted at the names of handoffd's own lock files (a folder, a link, a FIFO), which failed every
open of the lock and so every update it guards, set aside the same way.

One module below the store's writers (``writes``, ``records``, ``leases``, ``seen``, ``events``,
``context``) that each of them uses: it imports only :mod:`.fsio` and the core."""
from __future__ import annotations

import errno
import os
import stat
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ...core.documents import actor
from ...core.errors import ErrorCode
from ...core.logs import log
from ...core.ownfiles import plain_folder
from ...core.timeutil import iso, utc_now
from . import fsio


def quarantine_folder(folder: Path) -> Path:
    """``handoffs/.quarantine``, made if missing; OSError (ENOTDIR) when it is no plain folder
    of the workspace: through a symlink planted there, what is set aside (and its reason) would
    be moved and written outside it. The file then stays where it is, looked at again later."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling symlink: refused just below
    if not plain_folder(folder):
        raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?); nothing is "
                      "set aside there", str(folder))
    return folder


def move_to_quarantine(folder: Path, path: Path, code: str, message: str,
                       publish: Callable[[Path, bytes], Any], *,
                       now: datetime | None = None) -> Path:
    """Move the entry ``path`` into the quarantine ``folder`` (a plain folder: see
    :func:`quarantine_folder`) under a dated, safe name, and ``publish`` its ``.reason.json``
    beside it (what ``handoff ls --state quarantined`` reads); the moved path."""
    now = now or utc_now()
    quarantine_folder(folder)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.name)[:100] or "file"
    name = f"{now.strftime('%Y%m%dT%H%M%S')}-{os.urandom(4).hex()}-{safe}"
    target = folder / name
    os.rename(path, target)  # works for symlinks and fifos too: the entry moves, not its target
    reason = {"file": _readable(path.name), "from": path.parent.name, "code": code,
              "message": _readable(message), "at": iso(now), "actor": actor()}
    publish(folder / f"{name}.reason.json", fsio.dump_json(reason))
    return target


def _readable(text: str) -> str:
    """``text`` as UTF-8 can hold it: the bytes of a file name that is not UTF-8 (and any lone
    surrogate) written as ``\\x`` escapes, so that a reason naming it can be filed."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte stands for
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")


def publish_beside(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically. The temp file is created afresh without
    following a symlink: one planted under its name must not redirect the write. Its name is
    random, not the pid's: a folder planted under a name known ahead (nobody can unlink it)
    refused every update of the kind by that pid, and one per pid every update for good. A
    failed write removes its temp file; a process that dies in between leaves it (nothing
    sweeps ``.meta/``: one file, at most the kind's bound, per such crash)."""
    tmp = path.with_name(f".{path.stem}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with fsio.discarded_on_failure(tmp):
        try:
            os.fchmod(fd, fsio.FILE_MODE)  # the process's starting umask, not a handler's
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)


# how long set_aside_planted waits for another process's hold of the locks folder's own flock
FOLDER_LOCK_WAIT_SECONDS = 2.0


def clear_planted(path: Path, quarantine: Path | None = None) -> None:
    """:func:`set_aside_planted` when an entry that is no regular file is at ``path`` (one
    ``lstat`` otherwise): before a lock file of ours is opened (a folder or a link planted at
    its name failed every open, so every update the lock guards)."""
    if planted(path):
        set_aside_planted(path, quarantine)


def set_aside_planted(path: Path, quarantine: Path | None = None) -> None:
    """Move the entry at ``path`` (a lock file's name in ``handoffs/.locks`` or ``.meta``) to
    the workspace's quarantine (``quarantine``, default the ``.quarantine`` beside its folder:
    ``handoffs/.quarantine``, as the store sets files aside, which ``handoff ls`` lists) if it
    is no regular file, said in one warning line. Nothing is done to a regular file
    or to an entry gone meanwhile. OSError when it cannot be moved.

    Under the flock of the folder itself, the entry looked at again: two processes finding
    the plant at once must not both move "it", the second taking away the live lock file the
    first made in its place meanwhile (two holders). Nothing else renames an entry there."""
    folder = path.parent
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not fsio.flock_within(fd, FOLDER_LOCK_WAIT_SECONDS):  # a stopped or hostile
            raise OSError(errno.EWOULDBLOCK, f"{_shown(folder)}/ has been locked by "  # holder
                          f"another process for over {FOLDER_LOCK_WAIT_SECONDS:g} s; "
                          f"{path.name}, no regular file, is left there", str(path))
        if not planted(path):
            return  # moved by another process (a lock file may be there now), or gone
        what = "is not a regular file"
        target = move_to_quarantine(quarantine or folder.parent / ".quarantine", path,
                                    str(ErrorCode.NOT_A_REGULAR_FILE),
                                    f"{path.name} {what} (a lock file's name in {folder.name})",
                                    publish_reason)
    finally:
        os.close(fd)  # closing drops the lock
    log.warning("%s/%s %s: moved to %s/%s so that its lock can be taken [%s]", _shown(folder),
                path.name, what, _shown(target.parent), target.name,
                ErrorCode.NOT_A_REGULAR_FILE)


def publish_reason(dst: Path, data: bytes) -> None:
    """Write a quarantined entry's reason (a temp file of a random name beside it, never
    through a link, renamed into place); a failure is one warning: the entry moved already."""
    try:
        publish_beside(dst, data)
    except OSError as exc:
        log.warning("%s/%s: cannot record why it was moved (%s)", _shown(dst.parent), dst.name,
                    exc.strerror or exc)


def planted(path: Path) -> bool:
    """True when an entry that is no regular file (a folder, symlink, FIFO...) is at ``path``."""
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:  # absent, or its folder unusable: nothing to move
        return False


def _shown(folder: Path) -> str:
    """A folder of the workspace's ``handoffs/`` as a log line names it (``handoffs/.locks``)."""
    return f"{folder.parent.name}/{folder.name}"
