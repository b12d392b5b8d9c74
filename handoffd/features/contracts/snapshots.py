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
in :data:`SKIP_DIR_NAMES` and the paths the caller skips (handoffd's own ``handoffs/``, a contract's
``scope_ignore``). In ``git`` mode (the directory is in a git work tree), the files
``git ls-files --cached --others --exclude-standard`` lists (so git-ignored files are not watched),
compared the same way. git lists an untracked nested repository as its folder alone
(``hidden/``), and a submodule as one entry (its commit): such a folder is walked as in ``hash``
mode (every file of the submodule's working tree, whatever its own ignore rules say), so a file
created or changed inside it is seen. ``auto`` picks ``git`` when git answers, else ``hash``.
Directories are not tracked themselves (an empty new directory is not a change), nor is anything
a symlink points to: the walk opens each folder relative to its parent without following a symlink
(:meth:`Snapshotter._walk`), so a symlinked folder is never entered, even one swapped in mid-walk.
A folder the walk cannot open (no read permission) is an entry of its own, compared by its stat
facts, so creating one, or changing its mode to write into it, is a change.

git mode trusts git's ignore rules, and a handler could change them to hide its files. So it also
watches, always, the files those rules come from (:meth:`Snapshotter._git_guarded`): the
repository's ``info/exclude`` and ``config`` (``config.worktree``, ``commondir``), the ``.git``
entry, every ``.gitignore`` from the work tree's top down to the directory, and every ``.gitignore``
git ignores (one can ignore itself). Their paths are fixed before the handler and looked at again
after, so a change to any of them is a change like any other; one above the directory is keyed
``../...``. git itself runs with only the repository's own config, and with every setting that
could make it start a program, or read ignore rules from outside the repository, overridden on its
command line (:data:`GIT_SAFE_CONFIG`), bounded by :data:`GIT_TIMEOUT_SECONDS`.

Bounds: a snapshot looks at no more than :data:`MAX_ENTRIES` files and folders (git's listing
and every walk together) and descends no more than :data:`MAX_DEPTH` folders below the directory.
Past either, or when a path cannot be looked at (a name too long for the system), the snapshot is
*incomplete* (:class:`Incomplete`): it stops there, hashes nothing, and comparing with it raises
:class:`ScopeUnverifiable` naming the reason in one line. A tree too big to see is never reported
as unchanged, and no tree can make a snapshot take unbounded time or memory.
A file larger than :data:`MAX_HASHED_BYTES` (a sparse file can claim terabytes) is not
hashed: it is compared by its stat facts only, so rewriting it with identical bytes counts as a
modification (the safe side). The hash cache is one of handoffd's own files: read only when
``handoffs/.meta/contracts`` is a plain folder and the cache a regular file of at most
:data:`MAX_CACHE_BYTES` (never a FIFO, never through a symlink); otherwise there is no cache.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...backends.files.fsio import replace
from ...core.ownfiles import plain_folder, read_regular
from .patterns import SCOPE_MODES

SKIP_DIR_NAMES = frozenset({".git", ".venv", "__pycache__"})
RACY_NS = 2_000_000_000
CHUNK = 1024 * 1024
GIT_TIMEOUT_SECONDS = 120.0
# Command-line settings outrank every config file, so nothing written into the repository's
# config can make handoffd's git start a program or read ignore rules from outside the repository.
# ls-files and rev-parse run no filter, diff driver, hook or credential helper; these are the ways
# left (and the index extension a handler could forge to hide files).
GIT_SAFE_CONFIG = (
    "core.fsmonitor=",  # empty: "false" for git >= 2.36, "no hook" before; else a command it runs
    "core.hooksPath=/dev/null",
    "core.pager=cat",  # never started anyway: our stdout is a pipe, and --no-pager
    "core.untrackedCache=false",
    "core.excludesFile=/dev/null",  # ignore rules only from .gitignore files and info/exclude
)
CACHE_VERSION = 1
MAX_HASHED_BYTES = 1 << 30  # larger files: compared by stat facts only (see the module docstring)
MAX_CACHE_BYTES = 64 << 20  # about 300 000 files; a larger cache reads as none
MAX_ENTRIES = 200_000  # files and folders one snapshot looks at; more: it is incomplete
MAX_DEPTH = 128  # folder levels below the directory a snapshot descends; deeper: incomplete
LIMIT_HINT = (" (the snapshot limit: list large folders in the contract's scope_ignore, "
              "or narrow its cwd)")
REASON_CHARS = 160  # of a path named in a one-line reason
# a folder is opened relative to its parent, never through a symlink (O_NOFOLLOW)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Skip = Callable[[str], bool]


class GitError(Exception):
    """git did not answer: not installed, not a work tree, failed or too slow (one line)."""


class ScopeUnverifiable(Exception):
    """The tree cannot be compared with its snapshot (git answered before the handler, not after;
    or a snapshot is incomplete)."""


class Incomplete(Exception):
    """A snapshot cannot see the whole tree (more than MAX_ENTRIES entries, deeper than MAX_DEPTH,
    a path it cannot look at): one line saying why."""


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


@dataclass
class _Tally:
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
        self._tally = _Tally()  # of the latest listing

    # ------------------------------------------------------------ public
    def take(self) -> Snapshot:
        """The state of the tree now, every file hashed (from the cache where it is still valid)."""
        taken = time.time_ns()
        try:
            mode, note, paths, guarded = self._listing(None)
            infos = self._stat_all(paths)
        except Incomplete as exc:  # nothing hashed: comparing with it says "unverifiable"
            return Snapshot(self.root, self._tally.mode, taken, note=str(exc), incomplete=str(exc))
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
        either snapshot is incomplete (too big or too deep to see whole: never "unchanged")."""
        if before.incomplete:
            raise ScopeUnverifiable(f"the scope cannot be verified: before the handler ran, "
                                    f"{before.incomplete}")
        after = Snapshot(self.root, before.mode, time.time_ns(), note=before.note,
                         guarded=before.guarded)
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
        self._tally = _Tally()
        if mode not in ("auto", "git"):
            return "hash", "", self._walk(), ()
        try:
            # after the handler, git's files are those found before: a handler that moved
            # .git or pointed it elsewhere must not choose what is looked at
            guarded = before.guarded if before is not None else self._git_guarded()
            self._tally.mode = "git"
            listed = self._git_files()
        except GitError as exc:
            if before is not None:
                raise ScopeUnverifiable("the scope cannot be verified: after the handler ran, "
                                        f"{exc}") from None
            note = "" if mode == "auto" else (
                f"git listing unavailable ({exc}); every file is watched instead")
            self._tally = _Tally()  # the walk is the whole listing
            return "hash", note, self._walk(), ()
        return "git", "", listed | set(guarded), guarded

    def _skipped(self, rel: str) -> bool:
        parts = rel.split("/")
        if any(part in SKIP_DIR_NAMES for part in parts[:-1]):
            return True
        for i in range(1, len(parts)):
            if self.skip_dir("/".join(parts[:i])):
                return True
        return self.skip(rel)

    def _walk(self, start: str = "") -> set[str]:
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
            raise Incomplete(f"{_cut(rel)} is nested more than {MAX_DEPTH} folders deep"
                             f"{LIMIT_HINT}")
        try:
            return os.open(rel.rsplit("/", 1)[-1], DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            found.add(rel)  # a symlink or file swapped in: lstat says what it is
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                self._tally.opaque.add(rel)  # unreadable: the folder itself is watched
            return None

    def _scan(self, fd: int, rel_dir: str, found: set[str]) -> list[str]:
        """Add the files of the open folder ``fd`` (``rel_dir``) to ``found``, each entry counted;
        its subfolders to walk."""
        subdirs: list[str] = []
        try:
            with os.scandir(fd) as entries:
                for item in entries:
                    self._tally.count()
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
            if not rel_dir:
                raise Incomplete("cannot read the contract directory: "
                                 f"{exc.strerror or exc}") from None
            found.add(rel_dir)
            self._tally.opaque.add(rel_dir)
        return subdirs

    def _git_files(self) -> set[str]:
        """What git mode watches: the files git lists, the .gitignore files git ignores, and the
        files of the folders git lists as one entry (nested repositories, submodules)."""
        staged = _git(self.root, "ls-files", "-z", "--stage")  # with modes: 160000 = a submodule
        others = _git(self.root, "ls-files", "-z", "--others", "--exclude-standard")
        # a new .gitignore that ignores itself (and what it hides) is invisible to the listing
        # above: list the ignored ones too (--directory: an ignored folder is not descended)
        rules = _git(self.root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                     "--directory", "--", ":(glob)**/.gitignore")
        found: set[str] = set()
        for name, submodule in [*_staged(staged), *((name, False) for name in _names(others))]:
            if self._skipped(name):
                continue
            if name.endswith("/"):  # an untracked nested repository: git names only its folder,
                found |= self._walk(name.rstrip("/"))  # so its files are walked (hash mode's way)
                continue
            self._tally.count()
            found.add(name)  # (a submodule's folder is no file: _stat_all leaves it out)
            if submodule:  # git lists a submodule as its commit: its files are walked
                found |= self._walk(name)
        ignored_rules = {p for p in _names(rules)
                         if p.rsplit("/", 1)[-1] == ".gitignore" and not self._skipped(p)}
        self._tally.count(len(ignored_rules))
        return found | ignored_rules

    def _git_guarded(self) -> tuple[str, ...]:
        """git's own files that decide what git mode sees, relative to the root (see the module
        docstring); they need not exist. Raises GitError outside a work tree."""
        answer = os.fsdecode(_git(self.root, "rev-parse", "--is-inside-work-tree", "--show-toplevel",
                                  "--git-path", "info/exclude", "--git-path", "config",
                                  "--git-path", "config.worktree", "--git-path", "commondir"))
        lines = answer.split("\n")
        if len(lines) != 7 or lines[0] != "true" or lines[-1]:
            raise GitError("not a git work tree")
        top = Path(lines[1])
        files = [top / ".git", *(self.root / line for line in lines[2:6])]
        here = self.root.resolve()
        if here == top or top in here.parents:  # the .gitignore files above the directory
            files += [top / part / ".gitignore" for part in _ancestors(here.relative_to(top))]
        keys = {os.path.relpath(path, self.root).replace(os.sep, "/") for path in files}
        return tuple(sorted(keys))

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
                raise Incomplete(f"cannot look at {_cut(rel)}: {exc.strerror or exc}") from None
            if stat.S_ISDIR(info.st_mode) and rel not in self._tally.opaque:
                continue  # a submodule's folder (its files are walked apart): not a file
            found[rel] = info
        return found

    def _digest(self, rel: str, entry: Entry) -> str | None:
        import hashlib
        path = self.root / rel
        try:
            if entry.kind == "link":
                return "link:" + hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest()
            if entry.kind != "file" or entry.size > MAX_HASHED_BYTES:
                return None  # special, or too large to hash in bounded time: stat facts decide
            digest = hashlib.sha256()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
            try:
                if os.fstat(fd).st_size > MAX_HASHED_BYTES:  # grown since the lstat
                    return None
                while True:
                    chunk = os.read(fd, CHUNK)
                    if not chunk:
                        break
                    digest.update(chunk)
            finally:
                os.close(fd)
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


def _git(root: Path, *args: str) -> bytes:
    """Run ``git -C root ARGS`` safely (see GIT_SAFE_CONFIG), bounded by GIT_TIMEOUT_SECONDS;
    its output, or GitError with one line saying why not."""
    import subprocess  # only in git mode
    argv = ["git", "--no-pager", "-C", str(root)]
    for setting in GIT_SAFE_CONFIG:
        argv += ["-c", setting]
    # the daemon's own GIT_* variables (GIT_DIR, GIT_CONFIG_PARAMETERS...) must not steer it;
    # no system or user config: settings come from the repository and GIT_SAFE_CONFIG only
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0",
               GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    try:
        proc = subprocess.run([*argv, *args], capture_output=True, timeout=GIT_TIMEOUT_SECONDS,
                              env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise GitError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"git {args[0]} did not finish within {GIT_TIMEOUT_SECONDS:g} s") from None
    except OSError as exc:
        raise GitError(f"git {args[0]} could not start: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines() or ["(no message)"]
        raise GitError(f"git {args[0]} failed: {lines[-1][:200]}")
    return proc.stdout


def _names(output: bytes) -> list[str]:
    """The paths of a ``-z`` listing."""
    return [os.fsdecode(raw) for raw in output.split(b"\0") if raw]


def _staged(output: bytes) -> list[tuple[str, bool]]:
    """The paths of a ``ls-files -z --stage`` listing (``MODE OBJECT STAGE\tPATH``), each with
    whether it is a submodule (mode 160000, a gitlink)."""
    out = []
    for raw in output.split(b"\0"):
        meta, tab, path = raw.partition(b"\t")
        if tab and path:
            out.append((os.fsdecode(path), meta.split(b" ", 1)[0] == b"160000"))
    return out


def _cut(rel: str) -> str:
    """``rel`` short enough for a one-line reason (its start, then an ellipsis)."""
    return rel if len(rel) <= REASON_CHARS else rel[:REASON_CHARS] + "..."


def _ancestors(relative: Path) -> list[str]:
    """``a/b/c`` → ``["", "a", "a/b"]``: the directories from the top down to its parent."""
    parts = relative.parts
    return ["/".join(parts[:i]) for i in range(len(parts))]


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
