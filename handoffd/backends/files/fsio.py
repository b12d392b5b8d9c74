"""Crash-safe file primitives: every document becomes visible whole or not at all.

Writes go to a temp file in the same filesystem (``handoffs/.tmp``), are flushed and fsynced, then
``link``-ed (never overwrites: EEXIST instead) or ``rename``-d (replace) into place, and the directory
is fsynced so the new name itself survives power loss. ``durable=False`` skips the fsyncs (the
``fast`` durability mode) but keeps atomicity. Documents are read back whole and bounded
(:func:`read_bytes_safely`); their JSON is parsed by :mod:`handoffd.core.jsontext`, and the
append-only logs and their locks live in :mod:`.logfiles`.
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ...core.errors import DuplicateHandoff, ErrorCode, InvalidDocument
from ...core.jsontext import encode_document
from ...core.ownfiles import START_UMASK
from . import dirsync, spares

TMP_SUFFIX = spares.TMP_SUFFIX
# A path as these functions take it: text, or a Path. The ones the filing of every handoff
# passes are text (each system call given a Path asks it for its text: two Python calls).
FilePath = str | Path


def fsync_dir(path: FilePath) -> None:
    """fsync a directory so a rename/link/unlink inside it is durable (one fsync covers the
    callers that arrive while another runs: :mod:`.dirsync`)."""
    dirsync.fsync_dir(path)


# Serialise a document the way every handoffd file is written: compact JSON on one line, UTF-8,
# ending in a newline (:func:`handoffd.core.jsontext.encode_document`, itself: a wrapper was one
# Python call more at each of a handoff's writes). Compact because the fast encoders only serve
# compact output, and every handoff is written two or three times (`handoff show` and `jq`
# indent for people). A float that is not finite raises ValueError rather than being written
# as the bare ``Infinity``/``NaN`` tokens, which are not JSON.
dump_json: Callable[[Any], bytes] = encode_document


def write_temp(tmp_dir: FilePath, data: bytes, *, durable: bool) -> str:
    """Write ``data`` to a temp file under ``tmp_dir`` (a spare, or a fresh one) and return its path."""
    return _write_temp(tmp_dir, data, durable=durable)[0]


def _write_temp(tmp_dir: FilePath, data: bytes, *, durable: bool,
                fresh: bool = False) -> tuple[str, int]:
    """(path, inode) of a temp file holding ``data``: a spare this process kept (see
    :mod:`.spares`) unless ``fresh`` or there is none, else a new file."""
    taken = None if fresh else spares.take(tmp_dir)
    if taken is not None:
        path, fd, old_size = taken
    else:
        folder = os.fspath(tmp_dir)
        path = spares.temp_name(folder)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the folder is gone (a sweep removed an idle one): make it
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        # the mode the process's umask gave at its start: a Python handler may have changed
        # the umask meanwhile (077: documents nobody else could read; 777: mode 000)
        os.fchmod(fd, FILE_MODE)
        old_size = 0
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if old_size > len(data):  # a spare's longer old content, beyond ours
            os.ftruncate(fd, len(data))
        if durable:
            os.fsync(fd)
        inode = os.fstat(fd).st_ino
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # EBADF: closed under us already (see _publish)
            pass
        _unlink_quietly(path)
        raise
    os.close(fd)
    return path, inode


def _publish(tmp_dir: FilePath, data: bytes, durable: bool, put: Callable[[str], None]) -> int:
    """Write ``data`` to a temp file and ``put`` it into place; the new inode number. A spare
    a sweeper removed between our write and the rename is written again as a fresh file."""
    for fresh in (False, True):
        try:
            tmp, inode = _write_temp(tmp_dir, data, durable=durable, fresh=fresh)
        except OSError as exc:
            # a spare's descriptor closed under us (a Python handler's os.closerange while this
            # worker wrote): the bytes went nowhere or were cut short, so write a fresh file
            # rather than leave the handoff in in-progress/ until the next sweep
            if fresh or exc.errno != errno.EBADF:
                raise
            continue
        try:
            put(tmp)
            return inode
        except FileNotFoundError:
            if fresh or os.path.lexists(tmp):  # not a vanished temp: the target's folder
                _unlink_quietly(tmp)
                raise
        except BaseException:
            _unlink_quietly(tmp)
            raise
    raise AssertionError("unreachable")


def create_exclusive(target: FilePath, data: bytes, tmp_dir: FilePath, *, durable: bool) -> None:
    """Publish ``data`` at ``target`` atomically; raise DuplicateHandoff if the name is taken."""
    try:
        _publish(tmp_dir, data, durable, lambda tmp: rename_noreplace(tmp, target))
    except FileExistsError:  # one step where link + unlink took two
        folder, name = os.path.split(target)
        raise DuplicateHandoff(f"{name} already exists in {os.path.basename(folder)}/") from None
    if durable:
        fsync_dir(os.path.dirname(target))


def replace(target: Path, data: bytes, tmp_dir: FilePath, *, durable: bool, sync_dir: bool = True) -> int:
    """Atomically replace (or create) ``target`` with ``data``; returns the new inode number.

    ``sync_dir=False`` keeps the data fsync (a renamed-in file must never surface empty after a
    crash) but skips making the rename itself durable, for writes whose loss recovery handles."""
    inode = _publish(tmp_dir, data, durable, lambda tmp: os.replace(tmp, target))
    if durable and sync_dir:
        fsync_dir(target.parent)
    return inode


def replace_exact(target: FilePath, data: bytes, tmp_dir: FilePath, *, durable: bool,
                  expect: int) -> tuple[int, str | None] | None:
    """Replace ``target`` with ``data`` only if it is still the file of inode ``expect``, never
    a file put there since: (the new inode, where the replaced file now is) or None when
    ``target`` is another file or gone (left as it is). No directory fsync (a claim's lease
    write: recovery handles its loss).

    The new file is exchanged with ``target`` in one ``renameat2(RENAME_EXCHANGE)``, so the
    replaced file moves to the temp name (returned: the caller keeps it as a spare or removes
    it) and is looked at there; if it is not ``expect``, it is exchanged back at once. Where the
    filesystem cannot exchange (NFS...), ``target``'s inode is compared just before a plain
    replace (a moment's race with a writer that takes no claim lock)."""
    for fresh in (False, True):
        tmp, inode = _write_temp(tmp_dir, data, durable=durable, fresh=fresh)
        try:
            err = _exchange(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if err == errno.ENOENT:
            if os.path.lexists(tmp):  # ``target`` is gone: moved on by someone else
                _unlink_quietly(tmp)
                return None
            if fresh:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(tmp))
            continue  # a spare a sweeper removed between our write and the exchange
        if err is not None:  # no exchange on this filesystem: compare, then replace
            return _replace_compared(tmp, target, inode, expect)
        if _inode(tmp) == expect:
            return inode, tmp
        _exchange_back(tmp, target, inode)
        return None
    raise AssertionError("unreachable")


def _replace_compared(tmp: str, target: FilePath, inode: int,
                      expect: int) -> tuple[int, str | None] | None:
    """:func:`replace_exact` without an exchange: ``target`` compared, then replaced, its inode
    kept under a second name in the temp folder where one can be made (:func:`spares.keep_link`)."""
    kept = None
    try:
        if _inode(target) != expect:
            _unlink_quietly(tmp)
            return None
        kept = spares.keep_link(target, os.path.dirname(tmp))
        os.replace(tmp, target)
    except BaseException:
        _unlink_quietly(tmp)
        if kept is not None:
            _unlink_quietly(kept)
        raise
    return inode, kept


def _exchange_back(tmp: str, target: FilePath, ours: int) -> None:
    """Undo an exchange that displaced another file than the one expected: it goes back to
    ``target`` and our new file (inode ``ours``) is removed. Were ``target`` changed in the
    moment between the two exchanges (a writer that takes no claim lock), what is at the temp
    name afterwards is not ours: it is left there, with one warning, not unlinked."""
    try:
        err: int | None = _exchange(tmp, target)
    except OSError as exc:
        err = exc.errno or errno.EIO
    if err is not None:  # ``target`` vanished meanwhile: put the other file back under its name
        try:
            rename_noreplace(tmp, target)
            return
        except OSError:
            pass
    elif _inode(tmp) == ours:
        _unlink_quietly(tmp)
        return
    from ...core.logs import (
        log,  # (not loaded by the one-shot commands that import fsio)
    )
    log.warning("%s changed while a claim gave it back; the file displaced is left at %s",
                target, tmp)


def _inode(path: FilePath) -> int:
    """The inode number of ``path`` itself (-1 when it is gone)."""
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return -1


def _exchange(a: FilePath, b: FilePath) -> int | None:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``): None when done, ENOENT
    when either is missing, another errno (EINVAL...) when this filesystem or kernel cannot
    exchange; OSError for anything else."""
    import ctypes

    func = _renameat2 if _renameat2 is not None else load_renameat2()
    if not func:
        return errno.ENOSYS
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return None
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return err
    raise OSError(err, os.strerror(err), str(b))


def unlink(path: FilePath, *, durable: bool) -> bool:
    """Remove ``path``; return False if it was already gone."""
    if not spares.remove(path):
        return False
    if durable:
        fsync_dir(os.path.dirname(path))
    return True


_unlink_quietly = spares.remove_quietly


@contextmanager
def discarded_on_failure(tmp: Path | str) -> Iterator[None]:
    """Around the writing and renaming of our temp file ``tmp`` into place: if the block
    raises, ``tmp`` is removed (a failed write leaves no temp file) and the error goes on."""
    try:
        yield
    except BaseException:
        _unlink_quietly(Path(tmp))
        raise


def open_unfollowed(path: Path | str, shown: str, rule: str, *, flags: int = 0,
                    dir_fd: int | None = None) -> int:
    """A descriptor of ``path`` (in the folder ``dir_fd`` when given) opened to read, ``flags``
    added, without following a link nor waiting on a FIFO: InvalidDocument (NOT_A_REGULAR_FILE)
    for a symlink (``rule`` says what it must be instead) and for a socket or a device, named
    ``shown``; any other OSError (FileNotFoundError...) as it comes. The caller checks what it
    opened (a folder, a FIFO) with ``fstat``."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidDocument(f"{shown} is a symlink; {rule}",
                                  code=ErrorCode.NOT_A_REGULAR_FILE) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket, a device...
            raise InvalidDocument(f"{shown} is not a regular file ({os.strerror(exc.errno)})",
                                  code=ErrorCode.NOT_A_REGULAR_FILE) from None
        raise


READ_STEP = 1 << 16  # how much more read_bytes_safely asks for at a time, past the fstat size


def read_bytes_safely(path: Path | str, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """Read a regular file without following symlinks, refusing anything over ``max_bytes``.

    Raises FileNotFoundError if it vanished (another process claimed it) and InvalidDocument for
    symlinks, non-regular files and oversized or empty files.
    """
    shown = path.rpartition("/")[2] if isinstance(path, str) else path.name  # (its file name)
    fd = open_unfollowed(path, shown, "documents must be regular files")
    try:
        info = os.fstat(fd)
        return read_open(fd, info, max_bytes, shown), info
    finally:
        os.close(fd)


def read_open(fd: int, info: os.stat_result, max_bytes: int, name: str) -> bytes:
    """The whole of the regular file open at ``fd`` (``info``: its fstat; read from its current
    offset), refusing anything over ``max_bytes``: :func:`read_bytes_safely` once the file is
    open. InvalidDocument naming ``name`` for a file that is not regular or too large."""
    if not stat.S_ISREG(info.st_mode):
        raise InvalidDocument(f"{name} is not a regular file", code=ErrorCode.NOT_A_REGULAR_FILE)
    if info.st_size > max_bytes:
        raise InvalidDocument(
            f"{name} is {info.st_size} bytes, over the {max_bytes}-byte limit "
            "(raise daemon.max_document_bytes in handoffd.toml if this is intended)",
            code=ErrorCode.DOCUMENT_TOO_LARGE)
    chunks = []
    remaining = max_bytes + 1
    # one read of the size fstat gave, plus a byte: for a regular file a short read is its
    # end, so a document is one read. Not a fixed 1 MB buffer: each read would allocate it
    # whole (then shrink it), and glibc then serves those from its heap, which fragments
    # (a serving daemon's RSS climbed with the documents it read)
    ask = min(remaining, info.st_size + 1)
    while remaining > 0:
        chunk = os.read(fd, ask)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
        if len(chunk) < ask:
            break
        ask = min(remaining, READ_STEP)  # it grew since fstat: read on, a step at a time
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise InvalidDocument(f"{name} grew over the {max_bytes}-byte limit",
                              code=ErrorCode.DOCUMENT_TOO_LARGE)
    return data


FILE_MODE = 0o644 & ~START_UMASK  # a new document's mode, by the umask the process began with
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def load_renameat2() -> Any:
    """libc's renameat2, bound through ctypes on first use (~2 ms; False where it is missing)."""
    global _renameat2
    if _renameat2 is None:
        import ctypes

        try:  # the process's own symbols hold libc's (find_library would run ldconfig)
            libc = ctypes.CDLL(None, use_errno=True)
            func = libc.renameat2
            func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _renameat2 = func
        except (OSError, AttributeError):
            _renameat2 = False
    return _renameat2


def rename_noreplace(src: FilePath, dst: FilePath) -> None:
    """Atomically move ``src`` to ``dst`` unless ``dst`` exists (FileExistsError) or ``src`` is gone
    (FileNotFoundError). Uses renameat2(RENAME_NOREPLACE); where the kernel or filesystem lacks it,
    falls back to link + unlink, whose crash window leaves two copies that recovery resolves."""
    import ctypes

    func = _renameat2 if _renameat2 is not None else load_renameat2()  # (bound at the first)
    if func:
        if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(src))
    try:
        os.link(src, dst)
    except FileExistsError:
        # another mover linked this very file and has not unlinked ``src`` yet: it won the race,
        # exactly as a rename loser would see ENOENT (src gone) — not a second copy of the id
        if _same_file(src, dst):
            raise FileNotFoundError(errno.ENOENT, "moved by another process", str(src)) from None
        raise
    try:
        os.unlink(src)
    except FileNotFoundError:
        pass  # the winner of a concurrent fallback move already removed it


def _same_file(a: FilePath, b: FilePath) -> bool:
    """True when ``a`` is gone or is the same file as ``b`` (both cases: ``a`` was moved)."""
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return True
    except OSError:
        return False
