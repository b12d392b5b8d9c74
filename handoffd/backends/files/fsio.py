"""Crash-safe file primitives: every document becomes visible whole or not at all.

Writes go to a temp file in the same filesystem (``handoffs/.tmp``), are flushed and fsynced, then
``link``-ed (never overwrites: EEXIST instead) or ``rename``-d (replace) into place, and the directory
is fsynced so the new name itself survives power loss. ``durable=False`` skips the fsyncs (the
``fast`` durability mode) but keeps atomicity.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from ...core.documents import MAX_DEPTH, nesting_depth  # noqa: F401 (fsio's API)
from ...core.errors import DuplicateHandoff, ErrorCode, InvalidDocument
from ...core.ownfiles import START_UMASK, open_reading, open_regular, read_regular  # noqa: F401 (fsio's API)
from . import dirsync, spares

TMP_SUFFIX = spares.TMP_SUFFIX


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename/link/unlink inside it is durable (one fsync covers the
    callers that arrive while another runs: :mod:`.dirsync`)."""
    dirsync.fsync_dir(path)


# How long a lock of handoffd's own (the event log's rotation, the seen-ids record, a shared
# record) is waited for by default. Every holder of ours keeps one for a few milliseconds, so one
# held longer is held by a process that is stopped or not handoffd's: a blocking flock on it froze
# `handoff create` and left the daemon deaf to SIGTERM (a signal does not end the wait). The wait
# polls (a blocking flock cannot be given a timeout), from 1 ms up to 50 ms between tries.
LOCK_WAIT_SECONDS = 2.0
FIRST_POLL_SECONDS, LAST_POLL_SECONDS = 0.001, 0.05


class LockHeld(TimeoutError):
    """A lock was held by another process for longer than the caller would wait (an OSError:
    callers that catch I/O failures catch it; its text is one line naming the lock)."""

    def __init__(self, path: Path | str, seconds: float) -> None:
        super().__init__(errno.EWOULDBLOCK, f"lock held by another process for over {seconds:g}"
                         " s (a stopped or hung one?)", os.fspath(path))
        self.seconds = seconds


def flock_within(fd: int, seconds: float, *, clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None) -> bool:
    """Take an exclusive flock on ``fd`` within ``seconds`` (0: one try): True when taken,
    False when another holder kept it that long; OSError (ENOLCK...) when it cannot be locked.
    ``clock``/``sleep``: time.monotonic and time.sleep unless given (tests move time by hand)."""
    clock = clock or time.monotonic
    sleep = sleep or time.sleep
    deadline = clock() + seconds
    pause = FIRST_POLL_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        sleep(min(pause, remaining))  # (a signal handler runs between tries)
        pause = min(pause * 2, LAST_POLL_SECONDS)


@contextmanager
def locked(path: Path, wait: float = LOCK_WAIT_SECONDS) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent, a regular file opened without
    following a link) for the block, waiting at most ``wait`` seconds for another holder:
    :class:`LockHeld` after that.

    Each call opens its own descriptor, so threads of one process exclude each other as
    processes do (flock locks belong to the open file, not the process). The file stays: removing
    a lock file while another process waits on it would let two holders in."""
    fd = open_creating(path, os.O_RDWR)
    try:
        if not flock_within(fd, wait):
            raise LockHeld(path, wait)
        yield
    finally:
        os.close(fd)  # closing drops the lock


class LineReader:
    """The lines of the binary file ``fh`` from where it stands (without their newline), read
    :data:`READ_STEP` bytes at a time: the JSON Lines logs that anyone who can write the
    workspace can write (the event log, the violations log).

    A line over ``max_line`` bytes is no line of ours: it is skipped as it is read, never held
    whole (so a reader holds one block and one line at most, however large the file). At most
    ``limit`` bytes are read (None: to the end). ``skip_first``: the bytes up to and including
    the first newline are dropped unread (the tail of a line a reader jumped into). The last
    line, unterminated, is given only at the end of the file and when ``partial`` (a line still
    being appended waits otherwise). ``consumed``: the bytes settled after the iteration (lines
    given, skipped or dropped), where a reader resumes next time."""

    def __init__(self, fh: BinaryIO, max_line: int, *, limit: int | None = None,
                 skip_first: bool = False, partial: bool = False) -> None:
        self.fh = fh
        self.max_line = max_line
        self.limit = limit
        self.skipping = skip_first
        self.partial = partial
        self.consumed = 0

    def __iter__(self) -> Iterator[bytes]:
        rest, held, left = b"", 0, self.limit  # held: len(rest)
        at_end = False
        while True:
            ask = READ_STEP if left is None else min(READ_STEP, left)
            block = self.fh.read(ask) if ask > 0 else b""
            if not block:
                at_end = ask > 0
                break
            if left is not None:
                left -= len(block)
            start = 0
            while (end := block.find(b"\n", start)) >= 0:
                size = held + end - start
                if not self.skipping and size <= self.max_line:
                    yield rest + block[start:end] if held else block[start:end]
                self.consumed += size + 1
                rest, held, self.skipping, start = b"", 0, False, end + 1
            if self.skipping:  # (inside a line over the bound: its bytes are settled)
                self.consumed += len(block) - start
            else:
                rest += block[start:]
                held += len(block) - start
                if held > self.max_line:
                    self.consumed += held
                    rest, held, self.skipping = b"", 0, True
        if held and at_end and self.partial:
            self.consumed += held
            yield rest


def open_creating(path: Path, flags: int) -> int:
    """:func:`open_regular` with ``O_CREAT``, creating the folder when it is missing (a
    workspace whose folder for it does not exist yet)."""
    flags |= os.O_CREAT
    try:
        return open_regular(path, flags)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open_regular(path, flags)


class Appender:
    """A file kept open for ``O_APPEND`` writes (the event log, the seen-ids record: opening and
    closing it for each line doubled their system calls), reopened when its path names another
    file: a rotation or compaction in another process replaced it. Callers hold their own lock
    around :meth:`ready` and the write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self._ino = -1
        self._end = -1  # the file's size after our last line (it ends with that newline)

    def ready(self) -> os.stat_result:
        """The stat of ``path`` (before the caller's write), with :attr:`fd` open on that file."""
        try:
            info: os.stat_result | None = os.stat(self.path)
        except FileNotFoundError:
            info = None
        if info is None or info.st_ino != self._ino or self.fd < 0:
            self.close()
            self.fd = open_creating(self.path, os.O_RDWR | os.O_APPEND)  # read: write_line
            info = os.fstat(self.fd)
            self._ino = info.st_ino
        return info

    def write_line(self, line: bytes, info: os.stat_result) -> int:
        """Append ``line`` (newline-terminated) in one write, given :meth:`ready`'s ``info``;
        the bytes written. A file that does not end with a newline (a line a crash cut short)
        gets one first: glued to the torn line, this one would be lost with it. Only a file
        that someone else wrote last is looked at (one pread). Only for files whose every
        writer holds one lock around its stat and write (the seen-ids record): otherwise the
        stat may see another writer's line half-written and take it for a torn one."""
        if info.st_size not in (0, self._end) and os.pread(self.fd, 1, info.st_size - 1) != b"\n":
            line = b"\n" + line
        os.write(self.fd, line)
        self._end = info.st_size + len(line)
        return len(line)

    def close(self) -> None:
        """Close the descriptor (the next :meth:`ready` opens it again)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self._ino, self._end = -1, -1, -1

    def __del__(self) -> None:  # an engine dropped in a long-lived process gives it back
        try:
            self.close()
        except (OSError, AttributeError):
            pass


def dump_json(doc: dict[str, Any]) -> bytes:
    """Serialise a document the way every handoffd file is written: compact JSON on one line,
    UTF-8, ending in a newline. Compact because the C encoder only serves compact output: an
    indented dump runs the pure-Python encoder, about four times slower, and every handoff is
    written two or three times (`handoff show` and `jq` indent for people).

    ``allow_nan=False``: a float that is not finite raises ValueError rather than being written as
    the bare ``Infinity``/``NaN`` tokens, which are not JSON (parse_document refuses them on input,
    so they can only come from a bug; failing loudly beats filing a document nobody can read)."""
    return (json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


def write_temp(tmp_dir: Path, data: bytes, *, durable: bool) -> Path:
    """Write ``data`` to a temp file under ``tmp_dir`` (a spare, or a fresh one) and return its path."""
    return _write_temp(tmp_dir, data, durable=durable)[0]


def _write_temp(tmp_dir: Path, data: bytes, *, durable: bool,
                fresh: bool = False) -> tuple[Path, int]:
    """(path, inode) of a temp file holding ``data``: a spare this process kept (see
    :mod:`.spares`) unless ``fresh`` or there is none, else a new file."""
    taken = None if fresh else spares.take(tmp_dir)
    if taken is not None:
        path, fd, old_size = taken
    else:
        path = tmp_dir / f"{os.urandom(16).hex()}{TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the folder is gone (a sweep removed an idle one): make it
            tmp_dir.mkdir(parents=True, exist_ok=True)
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


def _publish(tmp_dir: Path, data: bytes, durable: bool, put: Callable[[Path], None]) -> int:
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


def create_exclusive(target: Path, data: bytes, tmp_dir: Path, *, durable: bool) -> None:
    """Publish ``data`` at ``target`` atomically; raise DuplicateHandoff if the name is taken."""
    try:
        _publish(tmp_dir, data, durable, lambda tmp: rename_noreplace(tmp, target))
    except FileExistsError:  # one step where link + unlink took two
        raise DuplicateHandoff(f"{target.name} already exists in {target.parent.name}/") from None
    if durable:
        fsync_dir(target.parent)


def replace(target: Path, data: bytes, tmp_dir: Path, *, durable: bool, sync_dir: bool = True) -> int:
    """Atomically replace (or create) ``target`` with ``data``; returns the new inode number.

    ``sync_dir=False`` keeps the data fsync (a renamed-in file must never surface empty after a
    crash) but skips making the rename itself durable, for writes whose loss recovery handles."""
    inode = _publish(tmp_dir, data, durable, lambda tmp: os.replace(tmp, target))
    if durable and sync_dir:
        fsync_dir(target.parent)
    return inode


def replace_exact(target: Path, data: bytes, tmp_dir: Path, *, durable: bool,
                  expect: int) -> tuple[int, Path | None] | None:
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


def _replace_compared(tmp: Path, target: Path, inode: int,
                      expect: int) -> tuple[int, Path | None] | None:
    """:func:`replace_exact` without an exchange: ``target`` compared, then replaced, its inode
    kept under a second name in the temp folder where one can be made (:func:`spares.keep_link`)."""
    kept = None
    try:
        if _inode(target) != expect:
            _unlink_quietly(tmp)
            return None
        kept = spares.keep_link(target, tmp.parent)
        os.replace(tmp, target)
    except BaseException:
        _unlink_quietly(tmp)
        if kept is not None:
            _unlink_quietly(kept)
        raise
    return inode, kept


def _exchange_back(tmp: Path, target: Path, ours: int) -> None:
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
    from ...core.logs import log  # (not loaded by the one-shot commands that import fsio)
    log.warning("%s changed while a claim gave it back; the file displaced is left at %s",
                target, tmp)


def _inode(path: Path) -> int:
    """The inode number of ``path`` itself (-1 when it is gone)."""
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return -1


def _exchange(a: Path, b: Path) -> int | None:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``): None when done, ENOENT
    when either is missing, another errno (EINVAL...) when this filesystem or kernel cannot
    exchange; OSError for anything else."""
    import ctypes

    func = load_renameat2()
    if not func:
        return errno.ENOSYS
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return None
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return err
    raise OSError(err, os.strerror(err), str(b))


def unlink(path: Path, *, durable: bool) -> bool:
    """Remove ``path``; return False if it was already gone."""
    if not spares.remove(path):
        return False
    if durable:
        fsync_dir(path.parent)
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


READ_STEP = 1 << 16  # how much more read_bytes_safely asks for at a time, past the fstat size


def read_bytes_safely(path: Path, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """Read a regular file without following symlinks, refusing anything over ``max_bytes``.

    Raises FileNotFoundError if it vanished (another process claimed it) and InvalidDocument for
    symlinks, non-regular files and oversized or empty files.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidDocument(f"{path.name} is a symlink; documents must be regular files",
                                  code=ErrorCode.NOT_A_REGULAR_FILE) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket, a device...
            raise InvalidDocument(f"{path.name} is not a regular file ({os.strerror(exc.errno)})",
                                  code=ErrorCode.NOT_A_REGULAR_FILE) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidDocument(f"{path.name} is not a regular file", code=ErrorCode.NOT_A_REGULAR_FILE)
        if info.st_size > max_bytes:
            raise InvalidDocument(
                f"{path.name} is {info.st_size} bytes, over the {max_bytes}-byte limit "
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
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise InvalidDocument(f"{path.name} grew over the {max_bytes}-byte limit",
                              code=ErrorCode.DOCUMENT_TOO_LARGE)
    return data, info


def parse_document(data: bytes, name: str) -> dict[str, Any]:
    """Decode UTF-8 JSON that must be an object; raise InvalidDocument saying what is wrong."""
    if not data.strip():
        raise InvalidDocument(f"{name} is empty", code=ErrorCode.EMPTY_DOCUMENT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidDocument(f"{name} is not UTF-8 (byte {exc.start})", code=ErrorCode.NOT_UTF8) from None
    doc = load_json(text, name, max_depth=None)
    if not isinstance(doc, dict):
        raise InvalidDocument(f"{name} holds a JSON {type(doc).__name__}, not an object",
                              code=ErrorCode.NOT_AN_OBJECT)
    _check_depth(text, doc, name, MAX_DEPTH)
    return doc


def load_json(text: str, name: str, *, max_depth: int | None = None) -> Any:
    """JSON ``text`` that a document can hold (what the daemon reads and what the command line
    takes as ``--data``): InvalidDocument, naming ``name``, for NaN, Infinity and numbers that
    overflow a float, invalid JSON, an integer past Python's digit limit, nesting that exhausts
    the recursion limit or passes ``max_depth``, and a ``\\u`` escape of a lone surrogate."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise InvalidDocument(f"{name} holds the number {exc.args[0]}, which is not finite JSON "
                              "(NaN, Infinity and overflowing numbers are refused)",
                              code=ErrorCode.MALFORMED_JSON) from None
    except json.JSONDecodeError as exc:
        raise InvalidDocument(f"{name} is not valid JSON: {exc.msg} (line {exc.lineno}, "
                              f"column {exc.colno})", code=ErrorCode.MALFORMED_JSON) from None
    except RecursionError:
        raise InvalidDocument(f"{name} nests too deeply", code=ErrorCode.MALFORMED_JSON) from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise InvalidDocument(f"{name} is not valid JSON: {str(exc)[:120]}",
                              code=ErrorCode.MALFORMED_JSON) from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise InvalidDocument(f"{name} holds a \\u escape of a lone UTF-16 surrogate, which is not "
                              "Unicode and cannot be written back as UTF-8", code=ErrorCode.NOT_UTF8)
    if max_depth is not None:
        _check_depth(text, value, name, max_depth)
    return value


def parse_line(line: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of one line of handoffd's own bookkeeping (a line of a ``.jsonl`` log, a
    small record file), or None when it cannot be one of ours: not UTF-8, not JSON (a torn
    line), an integer past Python's digit limit, or nesting deeper than ``max_depth``. Never
    raises: a line of ``[`` thirty thousand deep, whose parse exhausts the recursion limit, is
    one more line that is not ours, not a RecursionError out of a command or the daemon loop."""
    try:
        value = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError: ValueErrors)
        return None
    if isinstance(value, (dict, list)):
        # no line of ours nests deep: what its readers do with it must not recurse past the
        # limit either (a value cannot nest deeper than it has brackets: most need no walk)
        brackets = (line.count(b"[") + line.count(b"{") if isinstance(line, bytes)
                    else line.count("[") + line.count("{"))
        if brackets > max_depth and nesting_depth(value, max_depth) > max_depth:
            return None
    return value


def _check_depth(text: str, value: Any, name: str, limit: int) -> None:
    # a value cannot nest deeper than it has brackets: most need no walk at all
    if text.count("{") + text.count("[") > limit and nesting_depth(value, limit) > limit:
        raise InvalidDocument(f"{name} nests more than {limit} levels deep; flatten it",
                              code=ErrorCode.DOCUMENT_TOO_DEEP)




class _NotFinite(ValueError):
    pass


def _refuse_constant(token: str) -> Any:
    raise _NotFinite(token)


def _finite_float(token: str) -> float:
    value = float(token)
    if value != value or value in (float("inf"), float("-inf")):
        raise _NotFinite(token[:40])
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a surrogate gets into decoded text


def _has_lone_surrogate(value: Any) -> bool:
    """True if a string (key or value) anywhere in ``value`` holds a surrogate code point: json
    decodes ``"\\ud800"`` to one, and no UTF-8 encoder will write it back (iterative)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:  # (no regex: compiling a class of surrogates cost each command 0.5 ms)
                item.encode("utf-8")
            except UnicodeEncodeError:  # UTF-8 refuses exactly the surrogate code points
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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


def rename_noreplace(src: Path, dst: Path) -> None:
    """Atomically move ``src`` to ``dst`` unless ``dst`` exists (FileExistsError) or ``src`` is gone
    (FileNotFoundError). Uses renameat2(RENAME_NOREPLACE); where the kernel or filesystem lacks it,
    falls back to link + unlink, whose crash window leaves two copies that recovery resolves."""
    import ctypes

    func = load_renameat2()
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


def _same_file(a: Path, b: Path) -> bool:
    """True when ``a`` is gone or is the same file as ``b`` (both cases: ``a`` was moved)."""
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return True
    except OSError:
        return False
