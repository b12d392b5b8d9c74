"""Linux inotify read directly (ctypes): the files backend's source of wake-up hints.

Why not watchdog here: its inotify emitter holds every rename-away event for half a second to pair
it with a rename-in, and events queue behind it; a daemon claiming documents (a rename out of
pending/) therefore saw the next arrival up to 0.5 s late, and stopping an observer waited for that
delay too. We need no pairing: a name appearing, changing or leaving a watched folder is a hint,
nothing more. :class:`FolderEvents` reads the kernel's events on one thread and calls back at once.
Elsewhere than Linux, :mod:`handoffd.backends.files.watch` falls back to watchdog.

A watch is added without following a symlink (``IN_DONT_FOLLOW | IN_ONLYDIR``): a state folder
swapped for a link is not watched through it (it is left to the rescans, said once). A watch
holds a folder's inode, not its path: a folder moved away or removed (``IN_MOVE_SELF``,
``IN_IGNORED``) is watched again at its path, and so are the folders below a parent of theirs
moved away (``handoffs/`` renamed while ``serve`` runs: each parent and grandparent is watched
for that alone). A folder that cannot be watched again then is retried by the reader itself,
at a growing interval (:data:`FIRST_RETRY_SECONDS` to :data:`LAST_RETRY_SECONDS`), so that a
one-shot command's watch (``handoff wait``), which has no sweep to retry it, comes back too.
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
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("handoffd")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000  # a symlink at a folder's path is not followed (ENOTDIR with ONLYDIR)
IN_ISDIR = 0x40000000
SETTLED = IN_MOVED_TO | IN_CLOSE_WRITE  # the writer is done with the name: complete
WATCHED = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
# the watched folder itself renamed away (then removed from the watch: the folder now at its path
# is watched instead); its removal is IN_IGNORED, which the kernel always sends
GONE = IN_MOVE_SELF | IN_IGNORED
# every watch: a folder, never through a symlink (a state folder swapped for one is not watched)
NO_LINK = IN_ONLYDIR | IN_DONT_FOLLOW
# the kind of a parent or grandparent of the watched folders, watched only for being renamed away
# or removed: the folders below it are then watched again at their paths (handoffs/ renamed away
# left every watch on the old folders, and arrivals in the new ones went unheard to the rescans)
ANCESTOR = ".."
ANCESTOR_EVENTS = IN_MOVE_SELF | IN_DELETE_SELF
# a folder left unwatched is retried by the reader after this long, doubled each time up to the
# last (a one-shot wait has no sweep to retry it; its hints come back without one)
FIRST_RETRY_SECONDS, LAST_RETRY_SECONDS = 1.0, 30.0
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
_BUFFER = 64 * 1024
_SHORT_PAUSE = 0.1  # seconds before a read that ran out of memory is tried again
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
        # the parents and grandparents of the folders (not watched folders themselves)
        self.ancestors = {up for folder in folders for up in (folder.parent, folder.parent.parent)
                          if up not in folders}
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
            watched = [*self.folders.items(), *((up, ANCESTOR) for up in sorted(self.ancestors))]
            for folder, kind in watched:
                wd = self._add(folder, kind)
                if wd < 0:
                    failed.setdefault(-wd, []).append(folder)
        for code, folders in failed.items():
            _cannot_watch(folders, code)
        try:
            self._kill = os.pipe()
        except OSError:  # (no descriptor left) the caller relies on rescans: none kept open
            os.close(fd)
            self._fd = -1
            raise
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
        mask = ANCESTOR_EVENTS if kind == ANCESTOR else WATCHED | IN_MOVE_SELF
        wd = _LIBC.inotify_add_watch(self._fd, os.fsencode(folder), mask | NO_LINK)
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
        retry = _Retry()
        while True:
            try:
                wait = retry.wait(bool(self.unwatched), time.monotonic())
                if wait == 0.0:  # a folder is not watched, and its retry is due
                    if not self._retry():
                        return
                    continue
                ready, _, _ = select.select([self._fd, kill_r], [], [], wait)
                if kill_r in ready:
                    return
                if not ready:
                    continue
                data = os.read(self._fd, _BUFFER)
            except InterruptedError:
                continue
            except MemoryError:  # (no memory for the read's buffer: nothing was read, the
                # events wait in the kernel; the thread once died of it, with a traceback)
                if select.select([kill_r], [], [], _SHORT_PAUSE)[0]:
                    return
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

    def _retry(self) -> bool:
        """The reader's own :meth:`rewatch` of the folders left unwatched (a rescan when any is
        watched again); False when the descriptor is no longer ours (the reader stops, and
        the sweep restarts the watch)."""
        again = self.rewatch()
        if again:
            self.on_overflow()
        return again is not None

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
            if kind == ANCESTOR:
                if mask & (ANCESTOR_EVENTS | IN_IGNORED):
                    self._ancestor_gone(wd)
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
        have arrived unseen meanwhile); when there is none yet, leave it to the retries (the
        reader's own, :class:`_Retry`, and the sweep's)."""
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

    def _ancestor_gone(self, wd: int) -> None:
        """A parent or grandparent of the watched folders was renamed away or removed
        (``handoffs/`` itself): the watches below it hold the old folders. Watch what is at
        each path now instead (the ancestor too), say so in one line, and ask for a rescan; a
        path with nothing to watch yet is left to the retries (not said again by them)."""
        assert _LIBC is not None
        failed: dict[int, list[Path]] = {}
        with self._lock:
            moved = self._paths.get(wd)
            if moved is None or self._fd < 0:
                return
            below = [(old, path, self._kinds[old]) for old, path in list(self._paths.items())
                     if path == moved or moved in path.parents]
            for old, path, kind in below:
                del self._paths[old], self._kinds[old]
                new = self._add(path, kind)
                if new != old:  # (the same: that folder is back at its path)
                    _LIBC.inotify_rm_watch(self._fd, old)  # (gone already: EINVAL, harmless)
                if new < 0:
                    failed.setdefault(-new, []).append(path)
        if failed:  # (one line, said for each folder: the retries' failures are not said again)
            _said.update((str(path), code) for code, paths in failed.items() for path in paths)
            why = "; ".join(f"[Errno {code}] {os.strerror(code)}" for code in failed)
            log.warning("%s was moved away or removed, and the folders below it cannot be "
                        "watched at their paths yet (%s); changes there are seen at rescans (the "
                        "watch tries again now and then)", moved, why)
        else:
            log.warning("%s was moved away or removed; watching the folders now at their "
                        "paths (and rescanning)", moved)
        self.on_overflow()


class _Retry:
    """When the reader tries again the folders it does not watch: :data:`FIRST_RETRY_SECONDS`
    after it first found one, then at doubling intervals up to :data:`LAST_RETRY_SECONDS`, by a
    deadline (events from the folders it does watch do not put it off)."""

    def __init__(self) -> None:
        self.interval, self.due = 0.0, 0.0

    def wait(self, unwatched: bool, now: float) -> float | None:
        """How long the reader may wait for events (None: for ever, nothing is unwatched; 0.0:
        the retry is due now, and the next is scheduled)."""
        if not unwatched:
            self.interval = 0.0
            return None
        if not self.interval:
            self.interval, self.due = FIRST_RETRY_SECONDS, now + FIRST_RETRY_SECONDS
        if now < self.due:
            return self.due - now
        self.interval = min(self.interval * 2, LAST_RETRY_SECONDS)
        self.due = now + self.interval
        return 0.0


def _cannot_watch(folders: list[Path], code: int, *, moved: bool = False) -> None:
    """Say once (per folder and error, in this process) that ``folders`` are not watched."""
    new = [f for f in folders if (str(f), code) not in _said]
    if not new:
        return
    _said.update((str(f), code) for f in new)
    names = ", ".join(str(f) for f in new)
    what = (f"{names} was moved away or removed, and the folder now at that path cannot be "
            "watched" if moved else f"cannot watch {names}")
    log.warning("%s ([Errno %d] %s); changes there are seen at rescans (the watch tries "
                "again now and then)", what, code, os.strerror(code))


def _identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of what ``fd`` refers to; (-1, -1) when it is closed."""
    try:
        info = os.fstat(fd)
    except OSError:
        return (-1, -1)
    return (info.st_dev, info.st_ino)
