"""Snapshots of a directory tree, to see what a handler really changed.

A snapshot records, for every file under a directory, its ``lstat`` facts (type, size, mtime,
ctime, inode, mode) and a SHA-256 of its content (of the link target for a symlink). Comparing the
snapshot taken before a handler with one taken after gives the files created, modified and deleted.

Cheap for big trees, and still correct:

* A persistent cache (``handoffs/.meta/contracts/``) keeps each file's hash with the stat facts it
  was computed for, so a file is hashed again only when its stat facts changed (the git index
  trick). ``ctime`` is in the key and cannot be set from user space, so no write goes unnoticed.
* After the handler, a file whose stat facts are unchanged is unchanged — unless it was "racy"
  (modified within :data:`RACY_NS` of the first snapshot, where a coarse filesystem clock could hide
  a second write); racy and changed files are hashed and compared by content, so ``touch`` alone,
  or rewriting identical bytes, is not a modification. A change of the executable bit is.

Which files are watched: in ``hash`` mode, everything under the directory except the folders named
in ``SKIP_DIR_NAMES`` and the paths the caller skips (handoffd's own ``handoffs/``, a contract's
``scope_ignore``), listed by the bounded walk (walk.py: no symlinked folder is entered, a folder
it cannot open is an entry of its own). In ``git`` mode (the directory is in a git work tree), the
files git lists, the folders git lists as one entry walked, and git's own ignore and config files
always (gitlist.py), compared the same way. ``auto`` picks ``git`` when git answers, else
``hash``. Directories are not tracked themselves (an empty new directory is not a change), nor is
anything a symlink points to.

Bounds: a snapshot looks at no more than ``MAX_ENTRIES`` files and folders (git's listing and
every walk together) and descends no more than ``MAX_DEPTH`` folders below the directory (see
walk.py). Past either, or when a path cannot be looked at (a name too long for the system), the
snapshot is *incomplete* (:class:`Incomplete`): it stops there, hashes nothing, and comparing with
it raises :class:`ScopeUnverifiable` naming the reason in one line. A tree too big to see is never
reported as unchanged, and no tree can make a snapshot take unbounded time or memory.
A file larger than :data:`MAX_HASHED_BYTES` (a sparse file can claim terabytes) is not
hashed: it is compared by its stat facts only, so rewriting it with identical bytes counts as a
modification (the safe side). So is every file met once a snapshot has hashed
:data:`MAX_HASHED_TOTAL_BYTES` (files the cache answers for cost nothing), so that no tree of many
large files makes one snapshot hash for minutes. The hash cache is one of handoffd's own files:
read only when ``handoffs/.meta/contracts`` is a plain folder and the cache a regular file of at
most :data:`MAX_CACHE_BYTES` (never a FIFO, never through a symlink); otherwise there is no cache.
"""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...backends.files.fsio import replace
from ...core.errors import is_shortage
from ...core.ownfiles import plain_folder, read_regular
from .gitlist import GitError, git_files, git_guarded
from .patterns import SCOPE_MODES
from .walk import Incomplete, Skip, Walker, cut

RACY_NS = 2_000_000_000
CHUNK = 1024 * 1024
CACHE_VERSION = 1
MAX_HASHED_BYTES = 1 << 30  # larger files: compared by stat facts only (see the module docstring)
# What one snapshot reads to hash, all files together (seconds of work, not minutes); past it,
# files are compared by stat facts only, like one over MAX_HASHED_BYTES
MAX_HASHED_TOTAL_BYTES = 4 << 30
MAX_CACHE_BYTES = 64 << 20  # about 300 000 files; a larger cache reads as none


class ScopeUnverifiable(Exception):
    """The tree cannot be compared with its snapshot (git answered before the handler, not after;
    or a snapshot is incomplete)."""


@dataclass(frozen=True)
class Entry:
    """One file as seen by a snapshot."""

    kind: str  # file | link | folder (unreadable) | other
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    mode: int
    digest: str | None = None

    @property
    def key(self) -> tuple[str, int, int, int, int, int]:
        return (self.kind, self.size, self.mtime_ns, self.ctime_ns, self.ino, self.mode)

    def racy(self, moment_ns: int) -> bool:
        """Changed so close to ``moment_ns`` that an unchanged stat may hide a later write."""
        return max(self.mtime_ns, self.ctime_ns) >= moment_ns - RACY_NS


@dataclass(frozen=True)
class Change:
    """A file that differs between two snapshots: ``created``, ``modified`` or ``deleted``."""

    path: str
    change: str


@dataclass
class Snapshot:
    """The state of a tree at one moment."""

    root: Path
    mode: str
    taken_ns: int
    entries: dict[str, Entry] = field(default_factory=dict)
    note: str = ""
    guarded: tuple[str, ...] = ()  # git mode: git's own files, watched whatever git says
    incomplete: str = ""  # why the snapshot could not see the whole tree (then no entries)


class Snapshotter:
    """Takes and compares snapshots of ``root``; ``cache_dir`` holds the hash cache (optional)."""

    def __init__(self, root: Path, *, mode: str = "auto", skip: Skip | None = None,
                 skip_dir: Skip | None = None, cache_dir: Path | None = None,
                 tmp_dir: Path | None = None) -> None:
        if mode not in SCOPE_MODES:
            raise ValueError(f"scope_check must be one of {', '.join(SCOPE_MODES)}, not {mode!r}")
        self.root = root
        self.requested = mode
        self.skip = skip or (lambda _path: False)
        self.skip_dir = skip_dir or self.skip
        self.cache_dir = cache_dir
        self.tmp_dir = tmp_dir
        self._cache: dict[str, list[object]] | None = None
        self._walker = Walker(root, self.skip, self.skip_dir)  # its tally: the latest listing's
        self._hash_budget = MAX_HASHED_TOTAL_BYTES  # left to read for the snapshot being taken

    # ------------------------------------------------------------ public
    def take(self) -> Snapshot:
        """The state of the tree now, every file hashed (from the cache where it is still valid)."""
        taken = time.time_ns()
        self._hash_budget = MAX_HASHED_TOTAL_BYTES
        try:
            mode, note, paths, guarded = self._listing(None)
            infos = self._stat_all(paths)
        except Incomplete as exc:  # nothing hashed: comparing with it says "unverifiable"
            return Snapshot(self.root, self._walker.tally.mode, taken, note=str(exc),
                            incomplete=str(exc))
        # (a passing shortage, the only OSError the listing lets out, is raised: before the
        # handler, the contract's hook hands the attempt back uncounted; R44 saw it made the
        # snapshot incomplete, which refused the handoff for good, unrun)
        snap = Snapshot(self.root, mode, taken, note=note, guarded=guarded)
        cache = self._load_cache()
        for rel, info in infos.items():
            entry = _entry(info)
            cached = cache.get(rel)
            digest = None
            if isinstance(cached, list) and len(cached) == 3 and isinstance(cached[0], list) \
                    and cached[0] == list(entry.key) \
                    and isinstance(cached[2], int) and not entry.racy(cached[2]):
                digest = str(cached[1])
            if digest is None:
                digest = self._digest(rel, entry)
                if digest is not None:
                    cache[rel] = [list(entry.key), digest, time.time_ns()]
            snap.entries[rel] = _with_digest(entry, digest)
        self._save_cache(cache, snap.entries)
        return snap

    def changes(self, before: Snapshot) -> tuple[list[Change], Snapshot]:
        """What changed since ``before`` (sorted by path), and the snapshot taken now.
        Raises ScopeUnverifiable when git answered for ``before`` and no longer does, or when
        either snapshot is incomplete (too big or too deep to see whole: never "unchanged").
        A passing shortage (EMFILE opening a folder or starting git) raises its OSError: the
        comparison only reads, and the caller makes it again after a wait."""
        if before.incomplete:
            raise ScopeUnverifiable(f"the scope cannot be verified: before the handler ran, "
                                    f"{before.incomplete}")
        after = Snapshot(self.root, before.mode, time.time_ns(), note=before.note,
                         guarded=before.guarded)
        self._hash_budget = MAX_HASHED_TOTAL_BYTES
        try:
            _, _, paths, _ = self._listing(before)
            found = self._stat_all(paths | set(before.entries))
        except Incomplete as exc:
            raise ScopeUnverifiable(f"the scope cannot be verified: after the handler ran, "
                                    f"{exc}") from None
        changed: list[Change] = []
        cache = self._load_cache()
        for rel in sorted(set(found) | set(before.entries)):
            old = before.entries.get(rel)
            info = found.get(rel)
            if info is None:
                if old is not None:
                    changed.append(Change(rel, "deleted"))
                continue
            entry = _entry(info)
            if old is None:
                after.entries[rel] = entry
                changed.append(Change(rel, "created"))
                continue
            if entry.key == old.key and not old.racy(before.taken_ns):
                after.entries[rel] = _with_digest(entry, old.digest)
                continue
            digest = self._digest(rel, entry)
            if digest is not None:
                cache[rel] = [list(entry.key), digest, time.time_ns()]
            entry = _with_digest(entry, digest)
            after.entries[rel] = entry
            if _differs(old, entry):
                changed.append(Change(rel, "modified"))
        self._save_cache(cache, after.entries)
        return changed, after

    # ------------------------------------------------------------ listing
    def _listing(self, before: Snapshot | None) -> tuple[str, str, set[str], tuple[str, ...]]:
        """(mode used, note, relative paths to look at, git's own files among them).
        Raises Incomplete past the bounds (see the module docstring)."""
        mode = before.mode if before is not None else self.requested
        tally = self._walker.restart()
        if mode not in ("auto", "git"):
            return "hash", "", self._walk(), ()
        try:
            # after the handler, git's files are those found before: a handler that moved
            # .git or pointed it elsewhere must not choose what is looked at
            guarded = before.guarded if before is not None else git_guarded(self.root)
            tally.mode = "git"
            listed = git_files(self._walker)
        except (GitError, OSError) as exc:
            if isinstance(exc, OSError) and (before is not None or not is_shortage(exc)):
                raise  # a shortage after the handler: the caller waits and compares again
            if before is not None:
                raise ScopeUnverifiable("the scope cannot be verified: after the handler ran, "
                                        f"{exc}") from None
            note = "" if mode == "auto" else (
                f"git listing unavailable ({exc}); every file is watched instead")
            self._walker.restart()  # the walk is the whole listing
            return "hash", note, self._walk(), ()
        return "git", "", listed | set(guarded), guarded

    def _walk(self) -> set[str]:
        """The files of the whole tree, by the bounded walk (see walk.py), counted in the
        listing's tally. Raises Incomplete past the bounds."""
        return self._walker.walk()

    # ------------------------------------------------------------ stat and hash
    def _stat_all(self, paths: set[str]) -> dict[str, os.stat_result]:
        """The lstat facts of ``paths`` that exist. A path that cannot be looked at (too long for
        the system, a folder on the way without search permission) raises Incomplete: skipping it
        would report whatever was written there as unchanged."""
        found: dict[str, os.stat_result] = {}
        for rel in paths:
            try:
                info = os.lstat(self.root / rel)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if is_shortage(exc):  # (ENOMEM) no fact of the path's: the caller waits
                    raise
                raise Incomplete(f"cannot look at {cut(rel)}: {exc.strerror or exc}") from None
            if stat.S_ISDIR(info.st_mode) and rel not in self._walker.tally.opaque:
                continue  # a submodule's folder (its files are walked apart): not a file
            found[rel] = info
        return found

    def _digest(self, rel: str, entry: Entry) -> str | None:
        """The content hash of ``rel`` (of its target text for a symlink), or None: then it is
        compared by its stat facts only (special, unreadable, over MAX_HASHED_BYTES, or past
        what is left of the snapshot's MAX_HASHED_TOTAL_BYTES)."""
        import hashlib
        path = self.root / rel
        cap = min(MAX_HASHED_BYTES, self._hash_budget)
        try:
            if entry.kind == "link":
                return "link:" + hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest()
            if entry.kind != "file" or entry.size > cap:
                return None  # special, or too large to hash in bounded time: stat facts decide
            digest = hashlib.sha256()
            read = 0
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
            try:
                if os.fstat(fd).st_size > cap:  # grown since the lstat
                    return None
                while chunk := os.read(fd, CHUNK):
                    read += len(chunk)
                    if read > cap:  # growing while read: stat facts decide
                        return None
                    digest.update(chunk)
            finally:
                os.close(fd)
                self._hash_budget -= read  # what was read is spent, hashed or not
            return digest.hexdigest()
        except OSError:
            return None  # unreadable: compared by stat facts only

    # ------------------------------------------------------------ cache
    def _cache_path(self) -> Path | None:
        """Where the hash cache lives; None without a cache folder, or when the folder is not a
        plain folder (a symlink would send the tree's names and hashes out of the workspace)."""
        import hashlib
        if self.cache_dir is None:
            return None
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        if not plain_folder(self.cache_dir):
            return None
        name = hashlib.sha256(os.fsencode(str(self.root))).hexdigest()[:16]
        return self.cache_dir / f"hashes-{name}.json"

    def _load_cache(self) -> dict[str, list[object]]:
        if self._cache is not None:
            return self._cache
        path = self._cache_path()
        self._cache = {}
        if path is None:
            return self._cache
        try:
            # bounded, a regular file only: a FIFO put here must not freeze the worker
            data = json.loads(read_regular(path, MAX_CACHE_BYTES).decode("utf-8"))
            if data.get("version") == CACHE_VERSION and data.get("root") == str(self.root) \
                    and isinstance(data.get("entries"), dict):
                self._cache = data["entries"]
        except (OSError, ValueError, AttributeError, RecursionError):
            pass  # no usable cache: every file is hashed
        return self._cache

    def _save_cache(self, cache: dict[str, list[object]], present: dict[str, Entry]) -> None:
        path = self._cache_path()
        if path is None:
            return
        kept = {rel: value for rel, value in cache.items() if rel in present}
        self._cache = kept
        data = json.dumps({"version": CACHE_VERSION, "root": str(self.root), "entries": kept},
                          separators=(",", ":")).encode("utf-8")
        try:
            tmp = self.tmp_dir or path.parent
            tmp.mkdir(parents=True, exist_ok=True)
            replace(path, data, tmp, durable=False, sync_dir=False)
        except OSError:
            pass  # the cache only saves time



def _entry(info: os.stat_result) -> Entry:
    if stat.S_ISREG(info.st_mode):
        kind = "file"
    elif stat.S_ISLNK(info.st_mode):
        kind = "link"
    elif stat.S_ISDIR(info.st_mode):
        kind = "folder"  # one the walk could not open: compared by its stat facts
    else:
        kind = "other"
    return Entry(kind, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino,
                 stat.S_IMODE(info.st_mode))


def _with_digest(entry: Entry, digest: str | None) -> Entry:
    return Entry(entry.kind, entry.size, entry.mtime_ns, entry.ctime_ns, entry.ino, entry.mode, digest)


def _differs(old: Entry, new: Entry) -> bool:
    if old.kind != new.kind:
        return True
    if (old.mode & 0o111) != (new.mode & 0o111):
        return True
    if old.digest is not None and new.digest is not None:
        return old.digest != new.digest
    return old.key != new.key  # unreadable or special: stat facts decide
