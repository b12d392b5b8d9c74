"""The bounded walk of a directory tree that a snapshot lists its files with.

The walk opens each folder relative to its parent without following a symlink
(:meth:`Walker.walk`), so a symlinked folder is never entered, even one swapped in mid-walk, and
no folder a symlink points to is looked at. Directories are not listed themselves (an empty new
directory is not a change), except a folder the walk cannot open (no read permission): it is an
entry of its own, compared by its stat facts, so creating one, or changing its mode to write into
it, is a change. The folders named in :data:`SKIP_DIR_NAMES` and the paths the caller skips are
never listed.

Bounds: one listing (git's and every walk together, counted in one :class:`Tally`) looks at no
more than :data:`MAX_ENTRIES` files and folders and descends no more than :data:`MAX_DEPTH`
folders below the directory. Past either, or when a path cannot be looked at (a name too long for
the system), it raises :class:`Incomplete` with one line saying why: a tree too big to see is
never reported as unchanged, and no tree can make a listing take unbounded time or memory.
A passing shortage of the daemon's own (EMFILE opening a folder: ``is_shortage``) is no fact of
the tree's: the OSError itself is raised, for the caller to wait and list again.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...core.errors import is_shortage

SKIP_DIR_NAMES = frozenset({".git", ".venv", "__pycache__"})
MAX_ENTRIES = 200_000  # files and folders one snapshot looks at; more: it is incomplete
MAX_DEPTH = 128  # folder levels below the directory a snapshot descends; deeper: incomplete
LIMIT_HINT = (" (the snapshot limit: list large folders in the contract's scope_ignore, "
              "or narrow its cwd)")
REASON_CHARS = 160  # of a path named in a one-line reason
# a folder is opened relative to its parent, never through a symlink (O_NOFOLLOW)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Skip = Callable[[str], bool]


class Incomplete(Exception):
    """A snapshot cannot see the whole tree (more than MAX_ENTRIES entries, deeper than MAX_DEPTH,
    a path it cannot look at): one line saying why."""


@dataclass
class Tally:
    """What one listing met: its mode, the entries looked at (at most MAX_ENTRIES), and the
    folders it could not open (entries of their own)."""

    mode: str = "hash"
    seen: int = 0
    opaque: set[str] = field(default_factory=set)

    def count(self, number: int = 1) -> None:
        """Count ``number`` more entries; Incomplete past MAX_ENTRIES."""
        self.seen += number
        if self.seen > MAX_ENTRIES:
            raise Incomplete(f"the contract directory holds more than {MAX_ENTRIES} files and "
                             f"folders{LIMIT_HINT}")


class Walker:
    """Walks the tree under ``root`` with the caller's skips; ``tally`` counts the current
    listing (a new listing starts with :meth:`restart`)."""

    def __init__(self, root: Path, skip: Skip, skip_dir: Skip) -> None:
        self.root = root
        self.skip = skip
        self.skip_dir = skip_dir
        self.tally = Tally()

    def restart(self) -> Tally:
        """Start a new listing: a fresh tally (returned)."""
        self.tally = Tally()
        return self.tally

    def skipped(self, rel: str) -> bool:
        """Whether the walk would leave the file ``rel`` out (a skipped folder on its way, or
        skipped itself): the same rules for the paths another listing names."""
        parts = rel.split("/")
        if any(part in SKIP_DIR_NAMES for part in parts[:-1]):
            return True
        for i in range(1, len(parts)):
            if self.skip_dir("/".join(parts[:i])):
                return True
        return self.skip(rel)

    def walk(self, start: str = "") -> set[str]:
        """The files under ``start`` (relative; the root when empty), skips applied, counted in
        the listing's tally. Each folder is opened relative to its parent's descriptor with
        O_NOFOLLOW, so no symlinked folder is entered (even one swapped in mid-walk), and one
        descriptor is open per level (at most MAX_DEPTH). Raises Incomplete past the bounds."""
        found: set[str] = set()
        top = self._open_start(start, found)
        if top is None:
            return found
        stack: list[tuple[int, str, list[str]]] = [(top, start, [])]
        try:
            stack[-1][2].extend(self._scan(top, start, found))
            while stack:
                fd, _, pending = stack[-1]
                if not pending:
                    stack.pop()
                    os.close(fd)
                    continue
                rel = pending.pop()
                child = self._open_child(fd, rel, found)
                if child is not None:
                    stack.append((child, rel, []))
                    stack[-1][2].extend(self._scan(child, rel, found))
        finally:
            for fd, _, _ in stack:
                os.close(fd)
        return found

    def _open_start(self, start: str, found: set[str]) -> int | None:
        """A descriptor of the folder ``start`` (the root when empty), opened component by
        component without following a symlink; None when it is not a folder (any more)."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None  # the directory itself is gone: every file in it was deleted
        except OSError as exc:
            if is_shortage(exc):  # the daemon's descriptors, not the tree: the caller waits
                raise
            raise Incomplete("cannot read the contract directory: "
                             f"{exc.strerror or exc}") from None
        rel = ""
        for part in start.split("/") if start else ():
            rel = f"{rel}/{part}" if rel else part
            try:
                child = self._open_child(fd, rel, found)
            finally:
                os.close(fd)
            if child is None:
                return None
            fd = child
        return fd

    def _open_child(self, parent: int, rel: str, found: set[str]) -> int | None:
        """A descriptor of the folder ``rel`` inside ``parent`` (never through a symlink), or
        None: gone, no folder any more (then ``rel`` is looked at as a file), or not openable
        (then the folder is an entry of its own, compared by its stat facts)."""
        if rel.count("/") >= MAX_DEPTH:
            raise Incomplete(f"{cut(rel)} is nested more than {MAX_DEPTH} folders deep"
                             f"{LIMIT_HINT}")
        try:
            return os.open(rel.rsplit("/", 1)[-1], DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if is_shortage(exc):  # the daemon's descriptors, not an unreadable folder
                raise
            found.add(rel)  # a symlink or file swapped in: lstat says what it is
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                self.tally.opaque.add(rel)  # unreadable: the folder itself is watched
            return None

    def _scan(self, fd: int, rel_dir: str, found: set[str]) -> list[str]:
        """Add the files of the open folder ``fd`` (``rel_dir``) to ``found``, each entry counted;
        its subfolders to walk."""
        subdirs: list[str] = []
        try:
            with os.scandir(fd) as entries:
                for item in entries:
                    self.tally.count()
                    rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
                    try:
                        is_dir = item.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if item.name not in SKIP_DIR_NAMES and not self.skip_dir(rel):
                            subdirs.append(rel)
                    elif not self.skip(rel):
                        found.add(rel)
        except OSError as exc:  # a read error mid-folder: the folder itself is watched too
            if is_shortage(exc):  # (but not a shortage of the daemon's: the caller waits)
                raise
            if not rel_dir:
                raise Incomplete("cannot read the contract directory: "
                                 f"{exc.strerror or exc}") from None
            found.add(rel_dir)
            self.tally.opaque.add(rel_dir)
        return subdirs


def cut(rel: str) -> str:
    """``rel`` short enough for a one-line reason (its start, then an ellipsis)."""
    return rel if len(rel) <= REASON_CHARS else rel[:REASON_CHARS] + "..."
