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
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
SETTLED = IN_MOVED_TO | IN_CLOSE_WRITE  # the writer is done with the name: complete
WATCHED = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
_BUFFER = 64 * 1024

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
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the descriptor, add a watch per folder (a folder that cannot be watched is left to
        the rescans) and start the reader thread. OSError when inotify itself is unavailable."""
        assert _LIBC is not None, "inotify is Linux only"
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        for folder, kind in self.folders.items():
            wd = _LIBC.inotify_add_watch(fd, os.fsencode(folder), WATCHED | IN_ONLYDIR)
            if wd < 0:
                log.debug("cannot watch %s: %s", folder, os.strerror(ctypes.get_errno()))
                continue
            self._kinds[wd] = kind
        self._fd = fd
        self._kill = os.pipe()
        self._idents = {n: _identity(n) for n in (fd, *self._kill)}
        self._thread = threading.Thread(target=self._run, name="handoffd-inotify", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """True while the reader thread runs."""
        return self._thread is not None and self._thread.is_alive()

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
            if kind is None or mask & (IN_ISDIR | IN_IGNORED):
                continue
            name = os.fsdecode(raw.rstrip(b"\0"))
            if name:
                self.on_event(kind, name, bool(mask & SETTLED))


def _identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of what ``fd`` refers to; (-1, -1) when it is closed."""
    try:
        info = os.fstat(fd)
    except OSError:
        return (-1, -1)
    return (info.st_dev, info.st_ino)
