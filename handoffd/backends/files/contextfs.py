"""The ``context/`` folder by descriptors: the files under it reached safely, for
:class:`~.context.FileContext` (values, revisions, history) and the context mirror.

Every file of ``context/`` is reached one folder at a time from a descriptor of ``context/``
itself (``O_NOFOLLOW`` at each step, the next step relative to it with ``dir_fd=``), and a value
is published by a rename between two such descriptors: a symlink planted on a key's path, even
one swapped in between a check and the write (``renameat2(RENAME_EXCHANGE)`` in a loop), is never
followed, so nothing is read from or written outside ``context/``. An entry planted at the name
of the history, a lock or a revision record (a folder, a link, a FIFO) is set aside into the
quarantine first, as the store's planted lock files are.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator, Sequence

from ...core import ownfiles
from ...core.errors import ErrorCode, InvalidDocument
from ...core.keys import MAX_KEY, SEGMENT, names_itself
from ...core.logs import log
from ...core.ownfiles import plain_folder
from . import fsio, logfiles

META = ".meta"
TMP = ".tmp"
MAX_VALUE_BYTES = 4 * 1024 * 1024
# the most folders a key's file can be under (segments of at least one character and a "/"):
# a listing descends no deeper, however deep a tree is planted
MAX_FOLDERS = MAX_KEY // 2
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ContextFolder:
    """The files of the ``context/`` folder at ``root``, reached by descriptor (``durable``:
    fsync each write)."""

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root
        self.durable = durable

    @contextmanager
    def folder(self, parts: Sequence[str], *, make: bool = False) -> Iterator[int]:
        """A descriptor of ``context/<parts...>``, reached a folder at a time from ``context/``
        itself, never through a symlink (:func:`walk`); made as it goes when ``make``.
        FileNotFoundError when one is missing (``make`` false), NotADirectoryError when one is
        a file, InvalidDocument (INVALID_CONTEXT_KEY) when one is a symlink."""
        root = self._open_root(make)
        try:
            fd = walk(root, parts, make=make)
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_root(self, make: bool) -> int:
        if make:
            _plain_folder(self.root)  # context/ itself: a symlink would take every write elsewhere
        try:
            return os.open(self.root, FOLDER_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _not_plain(self.root) from None
            raise

    def read_file(self, key: str) -> tuple[bytes, os.stat_result]:
        """The bytes and the status of ``context/<key>.json`` as it is (no revision):
        FileNotFoundError when it is missing, IsADirectoryError when it is a folder,
        NotADirectoryError when a file is on its path, InvalidDocument when it or a folder on
        its path is a symlink, or it is no regular file or over MAX_VALUE_BYTES."""
        with self.folder(folders_of(key)) as folder:
            return read_value(folder, leaf_of(key), f"context/{key}.json")

    def stat(self, key: str) -> os.stat_result:
        """The status of ``context/<key>.json`` itself (a symlink's own); OSError or
        InvalidDocument as :meth:`folder` and ``lstat`` say."""
        with self.folder(folders_of(key)) as folder:
            return os.stat(leaf_of(key), dir_fd=folder, follow_symlinks=False)

    def keys(self, prefix: str = "") -> list[str]:
        """The key of every ``*.json`` file under ``context/`` that a key names (dot files and
        folders are handoffd's; ``a.json.json``, ``my notes.json`` are no key's file and are not
        listed: each listed key reads back its own file). Folders are descended by descriptor,
        never through a symlink, and no deeper than a key can reach."""
        out: list[str] = []
        try:
            root = self._open_root(make=False)
        except (OSError, InvalidDocument):
            return out
        try:
            _scan(root, "", prefix, out)
        finally:
            os.close(root)
        return sorted(out)

    def put(self, relative: str, data: bytes) -> None:
        """Publish ``data`` atomically at ``context/<relative>`` (``task/x.json``,
        ``.rejected/task/x.<stamp>.json``), its folders made as needed, with no revision record
        and no history entry (a mirror's copy of a store's value). Every folder is reached by
        descriptor, never through a symlink; InvalidDocument for an empty, ``.`` or ``..``
        segment, NotADirectoryError or IsADirectoryError when a file or folder is in the way."""
        parts = relative.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise InvalidDocument(f"context/{relative} is not a path inside context/",
                                  code=ErrorCode.INVALID_CONTEXT_KEY)
        with self.folder([], make=True) as root, \
                opened(walk(root, parts[:-1], make=True)) as folder, \
                opened(own(root, TMP)) as tmp:
            publish(tmp, folder, parts[-1], data, durable=self.durable)

    @contextmanager
    def meta_lock(self, name: str, wait: float | None = None) -> Iterator[None]:
        """Hold the flock of ``context/.meta/<name>`` (made if missing; never through a symlink,
        never a FIFO's wait: OSError for either, nothing set aside), waiting ``wait`` seconds at
        most (None: as long as it takes)."""
        with self.folder([], make=True) as root, opened(own(root, META)) as meta, \
                self._flock(meta, name, wait, set_aside=False):
            yield

    @contextmanager
    def _flock(self, meta: int, name: str, wait: float | None, *,
               set_aside: bool = True) -> Iterator[None]:
        """The lock file ``name`` in ``context/.meta`` (``meta``, its descriptor) held. A
        folder or link planted at its name is quarantined first (in ``handoffs/.quarantine``)
        when ``set_aside``: it failed every write of the key, said as a clash with another
        key's file."""
        if set_aside:
            from .quarantine import clear_planted
            clear_planted(self.root / META / name, self._quarantine())
        fd = ownfiles.open_regular(name, os.O_RDWR | os.O_CREAT, dir_fd=meta)
        try:
            _take(fd, f"context/{META}/{name}", wait)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _quarantine(self) -> Path:
        return self.root.parent / "handoffs" / ".quarantine"

    def _set_aside(self, relative: str, role: str) -> None:
        """Quarantine what is planted at ``context/<relative>`` (``role`` says what the name
        is for) when it is no regular file (a folder, a link, a FIFO), as the store's planted
        lock files are (:func:`~.quarantine.set_aside_planted`, whose folder flock it takes:
        two processes must not both move "it"); one warning line. OSError when it cannot be."""
        from . import quarantine
        path = self.root / relative
        if not quarantine.planted(path):
            return
        with opened(os.open(path.parent, FOLDER_FLAGS)) as folder:
            if not logfiles.flock_within(folder, quarantine.FOLDER_LOCK_WAIT_SECONDS):
                raise OSError(errno.EWOULDBLOCK, "its folder is locked by another process", str(path))
            try:
                what = _what(os.lstat(path).st_mode)
            except FileNotFoundError:
                return  # set aside by another process meanwhile
            if what == "a regular file":
                return
            code = ErrorCode.NOT_A_REGULAR_FILE
            target = quarantine.move_to_quarantine(
                self._quarantine(), path, str(code),
                f"context/{relative} is {what}, not a regular file ({role})",
                quarantine.publish_reason)
        log.warning("context/%s is %s, not a regular file (%s): moved to handoffs/.quarantine/%s "
                    "[%s]", relative, what, role, target.name, code)


def _plain_folder(folder: Path) -> Path:
    """``folder``, made if missing; InvalidDocument when it is a symlink or not a folder (it
    would take context writes, locks and records out of the workspace)."""
    with suppress(FileExistsError):  # a file or a dangling link: refused just below
        folder.mkdir(parents=True, exist_ok=True)
    if not plain_folder(folder):
        raise _not_plain(folder)
    return folder


def _not_plain(folder: Path | str) -> InvalidDocument:
    return InvalidDocument(f"{folder} is not a folder of the workspace (a symlink?); context "
                           "is neither read nor written through it",
                           code=ErrorCode.INVALID_CONTEXT_KEY)


def folders_of(key: str) -> list[str]:
    """The folders of ``key``'s file under ``context/`` (``task/a/b`` -> ``[task, a]``)."""
    return key.split("/")[:-1]


def leaf_of(key: str) -> str:
    """The name of ``key``'s file in its folder (``task/a/b`` -> ``b.json``)."""
    return key.rsplit("/", 1)[-1] + ".json"


@contextmanager
def opened(fd: int) -> Iterator[int]:
    """``fd``, closed when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)


def walk(root: int, parts: Sequence[str], *, make: bool = False) -> int:
    """A new descriptor of the folder ``parts`` under the folder ``root`` (a descriptor), each
    segment opened relative to its parent with ``O_NOFOLLOW`` (and made first when missing and
    ``make``): a symlink on the way is refused, however late it was swapped in. The caller
    closes it; ``root`` stays open."""
    fd = os.dup(root)
    try:
        for at, part in enumerate(parts):
            child = _step(fd, part, "/".join(parts[:at + 1]), make)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _what(mode: int) -> str:
    """What an entry of ``mode`` is, as a warning names it."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return what
    return "a special file"


def own(root: int, name: str) -> int:
    """A descriptor of handoffd's folder ``context/<name>`` (``.meta``, ``.tmp``), made if
    missing; InvalidDocument when it is a symlink or a file (never said as a key's clash)."""
    try:
        return walk(root, [name], make=True)
    except (NotADirectoryError, FileExistsError):
        raise _not_plain(f"context/{name}") from None


def _step(parent: int, name: str, shown: str, make: bool) -> int:
    """The folder ``name`` in the folder ``parent``, opened without following a link."""
    for attempt in (1, 2):
        try:
            return os.open(name, FOLDER_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not make or attempt == 2:
                raise
            with suppress(FileExistsError):  # made meanwhile by another writer
                os.mkdir(name, dir_fd=parent)
        except OSError as exc:  # a symlink opened with O_DIRECTORY | O_NOFOLLOW: ENOTDIR
            # a folder now: it was a link as it was opened (swapped back since), not a file
            # of another key in the way
            if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _link_or_folder(parent, name):
                raise InvalidDocument(f"context/{shown} is a symlink (or was, as it was opened); "
                                      "context keys are never read or written through one (make "
                                      "it a plain folder)", code=ErrorCode.INVALID_CONTEXT_KEY) from None
            raise
    raise AssertionError("unreachable")


def _link_or_folder(parent: int, name: str) -> bool:
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        return False
    return stat.S_ISLNK(mode) or stat.S_ISDIR(mode)


def read_value(folder: int, name: str, shown: str) -> tuple[bytes, os.stat_result]:
    """The bytes and status of the regular file ``name`` in ``folder``, opened without
    following a link nor waiting on a FIFO, at most MAX_VALUE_BYTES (InvalidDocument
    otherwise); IsADirectoryError for a folder."""
    fd = fsio.open_unfollowed(name, shown, "a context value must be a regular file",
                              flags=os.O_CLOEXEC, dir_fd=folder)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a folder", shown)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidDocument(f"{shown} is not a regular file", code=ErrorCode.NOT_A_REGULAR_FILE)
        # refused by its size before a byte is read (a sparse file of terabytes), and by what
        # was read when it grew meanwhile
        data = b"" if info.st_size > MAX_VALUE_BYTES else ownfiles.read_at_most(fd, MAX_VALUE_BYTES + 1)
        if info.st_size > MAX_VALUE_BYTES or len(data) > MAX_VALUE_BYTES:
            raise InvalidDocument(f"{shown} is over the {MAX_VALUE_BYTES:,}-byte limit of a "
                                  "context value", code=ErrorCode.DOCUMENT_TOO_LARGE)
    finally:
        os.close(fd)
    return data, info


def publish(tmp: int, folder: int, name: str, data: bytes, *, durable: bool) -> None:
    """Replace ``name`` in ``folder`` with ``data`` atomically: a fresh temp file in ``tmp``
    (the ``context/.tmp`` folder, on the same filesystem), renamed between the two descriptors,
    so no path is resolved again between the check of the folders and the rename."""
    staged = f"{os.urandom(16).hex()}{fsio.TMP_SUFFIX}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=tmp)
    try:
        try:
            os.fchmod(fd, fsio.FILE_MODE)  # the process's starting umask, not a handler's
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staged, name, src_dir_fd=tmp, dst_dir_fd=folder)
    except BaseException:
        with suppress(OSError):
            os.unlink(staged, dir_fd=tmp)
        raise
    if durable:
        os.fsync(folder)


def _take(fd: int, shown: str, wait: float | None) -> None:
    """An exclusive flock on ``fd``, within ``wait`` seconds (None: blocking)."""
    if wait is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    elif not logfiles.flock_within(fd, wait):
        raise logfiles.LockHeld(shown, wait)


def _scan(folder: int, rel: str, prefix: str, out: list[str]) -> None:
    """Add to ``out`` the key of every file under ``folder`` (``context/<rel>``) that names one
    and starts with ``prefix``; only the folders on the way are held open."""
    with os.scandir(folder) as entries:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_folder in found:
        if not is_folder:
            key = rel + name[:-len(".json")]
            if name.endswith(".json") and key.startswith(prefix) and names_itself(key):
                out.append(key)
            continue
        below = f"{rel}{name}/"
        if (not SEGMENT.fullmatch(name) or below.count("/") > MAX_FOLDERS
                or not (below.startswith(prefix) or prefix.startswith(below))):
            continue  # a dot folder (handoffd's), no key's folder, or outside the prefix
        try:
            child = _step(folder, name, below, make=False)
        except (OSError, InvalidDocument):  # gone, or swapped for a link meanwhile
            continue
        try:
            _scan(child, below, prefix, out)
        finally:
            os.close(child)
