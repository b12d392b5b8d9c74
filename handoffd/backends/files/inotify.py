"""Linux inotify read directly (ctypes): the files backend's source of wake-up hints.

Why not watchdog here: its inotify emitter holds every rename-away event for half a second to pair
it with a rename-in, and events queue behind it; a daemon claiming documents (a rename out of
pending/) therefore saw the next arrival up to 0.5 s late, and stopping an observer waited for that
delay too. We need no pairing: a name appearing, changing or leaving a watched folder is a hint,
nothing more. :class:`FolderEvents` reads the kernel's events on one thread and calls back at once.
Elsewhere than Linux, :mod:`handoffd.backends.files.watch` falls back to watchdog.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import sys
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("handoffd")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
SETTLED = IN_MOVED_TO | IN_CLOSE_WRITE  # the writer is done with the name: complete
WATCHED = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
# the watched folder itself renamed away (then removed from the watch: the folder now at its path
# is watched instead); its removal is IN_IGNORED, which the kernel always sends
GONE = IN_MOVE_SELF | IN_IGNORED
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
_BUFFER = 64 * 1024
# (folder, errno) already said "cannot watch" in this process: once each, however many sweeps
# retry it; forgotten when the folder is watched again (a new failure is said again)
_said: set[tuple[str, int]] = set()

# (folder kind, file name, settled) for each event; called on the reader thread
OnEvent = Callable[[str, str, bool], None]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:  # the process's own symbols hold libc's (find_library would run ldconfig: ~15 ms)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - present?
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def available() -> bool:
    """True where inotify can be used (Linux)."""
    return _LIBC is not None


class FolderEvents:
    """Watch ``folders`` (path -> kind, non-recursive) with one inotify descriptor and one reader
    thread; ``on_overflow`` is called when the kernel dropped events (rescan to catch up)."""

    def __init__(self, folders: dict[Path, str], on_event: OnEvent,
                 on_overflow: Callable[[], None]) -> None:
        self.folders = folders
        self.on_event = on_event
        self.on_overflow = on_overflow
        self._fd = -1
        self._kill: tuple[int, int] | None = None
        self._idents: dict[int, tuple[int, int]] = {}  # fd -> (st_dev, st_ino) when opened
        self._kinds: dict[int, str] = {}
        self._paths: dict[int, Path] = {}  # wd -> folder
        # folders not watched now (the add failed, or the folder was moved away or removed and
        # the one now at its path could not be added): alive() is False until rewatch() adds them
        self.unwatched: dict[Path, str] = {}
        self._lock = threading.Lock()  # _kinds, _paths and unwatched change on two threads
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the descriptor, add a watch per folder (a folder that cannot be watched is left to
        the rescans, said once, and listed in ``unwatched`` for :meth:`rewatch`) and start the
        reader thread. OSError when inotify itself is unavailable."""
        assert _LIBC is not None, "inotify is Linux only"
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self._fd = fd
        failed: dict[int, list[Path]] = {}
        with self._lock:
            for folder, kind in self.folders.items():
                wd = self._add(folder, kind)
                if wd < 0:
                    failed.setdefault(-wd, []).append(folder)
        for code, folders in failed.items():
            _cannot_watch(folders, code)
        self._kill = os.pipe()
        self._idents = {n: _identity(n) for n in (fd, *self._kill)}
        self._thread = threading.Thread(target=self._run, name="handoffd-inotify", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """True while the reader thread runs (see ``unwatched`` for the folders it misses)."""
        return self._thread is not None and self._thread.is_alive()

    def rewatch(self) -> int | None:
        """Try again to watch each folder in ``unwatched`` (a sweep's retry; a failure is said
        once): the number now watched again (the caller asks for a rescan when it is not 0);
        None when the descriptor is no longer ours (a handler closed it: restart the watch)."""
        again: list[Path] = []
        with self._lock:
            if self._fd < 0 or not self._ours(self._fd):
                return None
            for folder, kind in list(self.unwatched.items()):
                wd = self._add(folder, kind)
                if wd < 0:
                    _cannot_watch([folder], -wd)
                else:
                    again.append(folder)
        for folder in again:
            log.info("watching %s again", folder)
        return len(again)

    def _add(self, folder: Path, kind: str) -> int:
        """Add the watch of ``folder`` (under ``_lock``): its descriptor, or minus the errno that
        refused it (the folder is then in ``unwatched``)."""
        assert _LIBC is not None
        wd = _LIBC.inotify_add_watch(self._fd, os.fsencode(folder),
                                     WATCHED | IN_MOVE_SELF | IN_ONLYDIR)
        if wd < 0:
            self.unwatched[folder] = kind
            return -(ctypes.get_errno() or errno.EIO)
        self.unwatched.pop(folder, None)
        self._kinds[wd] = kind
        self._paths[wd] = folder
        key = str(folder)
        for said in [s for s in _said if s[0] == key]:
            _said.discard(said)
        return wd

    def stop(self) -> None:
        """Stop the reader thread and close the descriptors (prompt: no delay to wait out)."""
        thread, self._thread = self._thread, None
        # a Python handler may have closed our descriptors and the numbers gone to other files
        # (once a retry's temp file got our wake-up byte): each is used only if still ours
        if self._kill is not None and self._ours(self._kill[1]):
            try:
                os.write(self._kill[1], b"x")
            except OSError:
                pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        with self._lock:  # (not while a sweep's rewatch() adds to the descriptor)
            for fd in (self._fd, *(self._kill or ())):
                if fd >= 0 and self._ours(fd):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._fd, self._kill, self._idents = -1, None, {}

    def _ours(self, fd: int) -> bool:
        """``fd`` still refers to the file this watch opened under that number."""
        return fd in self._idents and _identity(fd) == self._idents[fd]

    def _run(self) -> None:
        assert self._kill is not None
        kill_r = self._kill[0]
        while True:
            try:
                ready, _, _ = select.select([self._fd, kill_r], [], [])
                if kill_r in ready:
                    return
                data = os.read(self._fd, _BUFFER)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    continue
                log.warning("inotify reader stopped: %s; changes are seen at rescans", exc)
                return
            try:
                self._dispatch(data)
            except Exception:  # a callback's bug must not end the watch
                log.exception("inotify event handling failed")

    def _dispatch(self, data: bytes) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
            offset += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                self.on_overflow()
                continue
            kind = self._kinds.get(wd)
            if kind is None:
                continue
            if mask & (IN_ISDIR | GONE):
                if mask & GONE:
                    self._replaced(wd, mask)
                continue
            name = os.fsdecode(raw.rstrip(b"\0"))
            if name:
                self.on_event(kind, name, bool(mask & SETTLED))

    def _replaced(self, wd: int, mask: int) -> None:
        """The watched folder of ``wd`` was renamed away or removed (``pending/`` replaced by a
        new folder): watch the folder now at its path instead, and ask for a rescan (names may
        have arrived unseen meanwhile); when there is none yet, leave it to the sweep's retry."""
        assert _LIBC is not None
        with self._lock:
            folder = self._paths.pop(wd, None)
            kind = self._kinds.pop(wd, None)
            if folder is None or kind is None or self._fd < 0:
                return
            new = self._add(folder, kind)
            if mask & IN_MOVE_SELF and new != wd:  # (the same: it is back at its path)
                _LIBC.inotify_rm_watch(self._fd, wd)  # the folder moved away is none of ours
        if new < 0:
            _cannot_watch([folder], -new, moved=True)
        else:
            log.warning("%s was moved away or removed; watching the folder now at that path "
                        "(and rescanning)", folder)
        self.on_overflow()


def _cannot_watch(folders: list[Path], code: int, *, moved: bool = False) -> None:
    """Say once (per folder and error, in this process) that ``folders`` are not watched."""
    new = [f for f in folders if (str(f), code) not in _said]
    if not new:
        return
    _said.update((str(f), code) for f in new)
    names = ", ".join(str(f) for f in new)
    what = (f"{names} was moved away or removed, and the folder now at that path cannot be "
            "watched" if moved else f"cannot watch {names}")
    log.warning("%s ([Errno %d] %s); changes there are seen at rescans (each sweep tries "
                "again)", what, code, os.strerror(code))


def _identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of what ``fd`` refers to; (-1, -1) when it is closed."""
    try:
        info = os.fstat(fd)
    except OSError:
        return (-1, -1)
    return (info.st_dev, info.st_ino)
