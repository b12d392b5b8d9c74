"""A workspace: the directory tree the README describes and where each thing lives in it."""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from .config import Config, load_config
from .errors import ConfigError, UsageError
from .states import State

CONFIG_NAME = "handoffd.toml"
# the paths of the handoffs in flight and in the ready window: each is asked for a few times
# within milliseconds. Not more: each kept path holds ~0.4 KB (4,096 of them made the serving
# daemon's RSS climb 1.6 MB between two clears)
DOC_PATHS_KEPT = 256
# Filesystems where flock is local-only or emulated, inotify misses other hosts' writes and
# renameat2(RENAME_NOREPLACE) is refused: handoffd still works there (leases, link fallback),
# but only lease expiry can tell that another host's daemon died.
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs",
                        "fuse.glusterfs", "fuse.sshfs", "lustre", "gpfs", "afs", "fuse.s3fs",
                        "fuse.rclone", "beegfs", "ocfs2", "gfs2"})


def resolve_root(option: str | Path | None = None) -> Path:
    """``--root``, else ``$HANDOFFD_ROOT``, else the current directory (absolute, symlinks
    resolved); UsageError (one line, exit 2) when its symlinks form a loop."""
    chosen = option or os.environ.get("HANDOFFD_ROOT") or os.getcwd()
    try:
        return Path(chosen).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # Python < 3.13 raises RuntimeError for a loop
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            raise
        raise UsageError(f"workspace directory {chosen} is a symlink loop") from None


@dataclass(frozen=True)
class Workspace:
    """Paths of one workspace. Bookkeeping lives in dot-folders of ``handoffs/``."""

    root: Path

    def __post_init__(self) -> None:
        # accept a str as well; paths inside are built from an absolute root
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())

    # cached_property writes the instance's __dict__ directly, so it works on a frozen
    # dataclass; paths are asked for a dozen times per handoff and pathlib joins are not free
    @cached_property
    def handoffs(self) -> Path:
        return self.root / "handoffs"

    @cached_property
    def _state_dirs(self) -> dict[State, Path]:
        return {state: self.handoffs / state.value for state in State}

    def state_dir(self, state: State) -> Path:
        """The folder holding documents in ``state``."""
        return self._state_dirs[state]

    def doc_path(self, state: State, handoff_id: str) -> Path:
        """Where the document of ``handoff_id`` lives when it is in ``state``."""
        # asked about nine times per handoff; a pathlib join parses its parts each time, so the
        # newest paths are kept (a bounded dict: cleared whole when full, refilled at once)
        key = (state, handoff_id)
        path = self._doc_paths.get(key)
        if path is None:
            if len(self._doc_paths) >= DOC_PATHS_KEPT:
                self._doc_paths.clear()
            path = self._doc_paths[key] = self._state_dirs[state] / f"{handoff_id}.json"
        return path

    @cached_property
    def _doc_paths(self) -> dict[tuple[State, str], Path]:
        return {}

    def doc_file(self, state: State, handoff_id: str) -> str:
        """:meth:`doc_path` as a str, for a caller that only hands it to ``os`` (a claim, a
        lookup for other copies): one string join, where a Path is a pathlib join to build
        (about seven Python calls) and a conversion back at every system call that takes it."""
        return f"{self._state_texts[state]}/{handoff_id}.json"

    @cached_property
    def _state_texts(self) -> dict[State, str]:
        return {state: str(folder) for state, folder in self._state_dirs.items()}

    @cached_property
    def tmp(self) -> Path:
        return self.handoffs / ".tmp"

    @cached_property
    def locks(self) -> Path:
        return self.handoffs / ".locks"

    @cached_property
    def quarantine(self) -> Path:
        return self.handoffs / ".quarantine"

    @cached_property
    def meta(self) -> Path:
        return self.handoffs / ".meta"

    @cached_property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @cached_property
    def context(self) -> Path:
        return self.root / "context"

    @cached_property
    def schemas(self) -> Path:
        return self.root / "schemas"

    @cached_property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    def ensure(self) -> None:
        """Create every folder the workspace needs (idempotent); ConfigError when a state
        folder is there but no plain folder of its own (see :meth:`check_state_folders`)."""
        self.check_state_folders()
        for state in State:
            self.state_dir(state).mkdir(parents=True, exist_ok=True)
        for path in (self.tmp, self.locks, self.quarantine, self.meta, self.artifacts,
                     self.context, self.schemas):
            path.mkdir(parents=True, exist_ok=True)

    def exists(self) -> bool:
        """True when the state folders are present."""
        return all(self.state_dir(s).is_dir() for s in State)

    @cached_property
    def own_folders(self) -> tuple[Path, ...]:
        """Every folder of ``handoffs/`` that must be a plain folder of the workspace itself:
        the bookkeeping folders (``.quarantine`` first: the others are set aside into it) and
        the four state folders. Through a symlink at any of them, what handoffd writes, moves
        or removes there would be written, moved or removed outside the workspace."""
        return (self.quarantine, self.tmp, self.meta, self.locks,
                *(self.state_dir(state) for state in State))

    def check_state_folders(self) -> None:
        """ConfigError (one line, exit 2) when one of :attr:`own_folders` that is there is a
        symlink, no folder, or the same folder as another: a symlinked ``completed/`` filed
        results outside the workspace (and retention purged files there), one linked to
        ``pending/`` made the sweep take a document for its own duplicate and delete it, and a
        symlinked ``.meta`` kept the seal key, the seen ids and the event log outside it. A
        missing folder is no error here (:meth:`ensure` makes it; :meth:`exists` tells). A
        symlinked ``handoffs/`` itself is allowed (its folders then live elsewhere, as plain
        folders). A folder swapped while a process runs is the files backend's to notice
        (:class:`handoffd.backends.files.quarantine.FolderGuard`)."""
        seen: dict[tuple[int, int], str] = {}
        for path in self.own_folders:
            try:
                info = os.lstat(path)
            except OSError:  # missing (or handoffs/ unreadable: what uses it says so)
                continue
            why = not_a_plain_folder(info)
            if why is None and (info.st_dev, info.st_ino) in seen:
                why = f"it is the same folder as handoffs/{seen[info.st_dev, info.st_ino]}"
            if why is None:
                seen[info.st_dev, info.st_ino] = path.name
                continue
            what = "a state folder" if not path.name.startswith(".") \
                else "a bookkeeping folder"
            raise ConfigError(f"{path} cannot be used as {what} of the workspace ({why}); "
                              f"make handoffs/{path.name} a plain folder of its own")

    def load_config(self) -> Config:
        """Parse this workspace's handoffd.toml (defaults when absent)."""
        return load_config(self.config_path)

    def inside(self, path: str | Path) -> Path | None:
        """Resolve ``path`` (relative to the root) and return it only if it stays inside the root."""
        # os.path on strings: what Path.resolve does, without pathlib's parsing at each step
        root = self._root_text
        try:
            joined = os.path.join(root, path)
            # the root was resolved when this Workspace was made: its own components (three
            # to six lstat calls a handoff from `/`) are not looked up again
            candidate = unlinked(joined, real=root) or os.path.realpath(joined)
        except (ValueError, TypeError):  # a NUL byte, or no path at all: nowhere inside
            return None
        if candidate == root or candidate.startswith(root.rstrip(os.sep) + os.sep):
            return Path(candidate)
        return None

    @cached_property
    def _root_text(self) -> str:
        return str(self.root)


def unlinked(path: str, real: str = "") -> str | None:
    """``path`` (absolute) when it is its own real path: no component is a symlink, ``.``,
    ``..`` or empty, as one ``lstat`` of each prefix shows (from the first that does not exist
    on, the rest is kept as written, as :func:`os.path.realpath` keeps it). None: it needs
    :func:`os.path.realpath`. A loop of ``lstat`` calls takes about a quarter of realpath's
    time, and the artifact checks resolve a destination for every handoff. ``real``: a folder
    known to be its own real path (a workspace's resolved root); when ``path`` lies under it,
    only the components below it are looked up."""
    parts = path.split("/")
    rest = parts[1:]  # (list membership: no generator resumed per component)
    if parts[0] or "" in rest or "." in rest or ".." in rest:
        return None
    prefix = ""
    if real and real != "/" and path.startswith(real + "/"):
        prefix = real
        parts = ["", *path[len(real) + 1:].split("/")]
    for part in parts[1:]:
        prefix += "/" + part
        try:
            if stat.S_ISLNK(os.lstat(prefix).st_mode):
                return None
        except OSError:  # missing (or not a folder, unreadable): realpath goes no further
            break
    return path


def not_a_plain_folder(info: os.stat_result) -> str | None:
    """Why an entry with ``info`` (its ``lstat``) is no plain folder (``it is a symlink``,
    ``it is not a folder``), or None when it is one."""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    return None


@lru_cache(maxsize=16)
def workspace_at(root: str) -> Workspace:
    """The :class:`Workspace` of ``root``, made once per root: making one resolves its root
    (a system call per path component), and features ask for it on every handoff."""
    return Workspace(Path(root))


def network_filesystem(path: Path, mounts: Path = Path("/proc/mounts")) -> str | None:
    """The type of the network filesystem ``path`` lives on, or None (local, or unknown)."""
    try:
        lines = mounts.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    best, best_type = "", None
    target = str(path)
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, parts[2]
    return best_type if best_type in NETWORK_FS else None
