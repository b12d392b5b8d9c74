"""The ``context/`` folder of a workspace on a shared store: a mirror of the store's context.

On a PostgreSQL store the database holds the shared context, and every host must still offer
seed 001's file interface (file-only agents read ``context/<key>.json``). So each host's daemon
keeps its ``context/`` folder a copy of the store's values:

* **store to files**: at start, before every handler runs (so a handoff started after a write
  on any host sees it in the file), on every ``context`` wake-up (a NOTIFY from the writing
  host) and every ``rescan_seconds``, each key whose revision changed is fetched and written
  into ``context/<key>.json`` atomically (a temp file and a rename), exactly as stored;
* **files to the store**: a file that a file-only agent changed or added on this host is taken
  in as a new revision of its key, written by the agent ``@file`` with a compare-and-set against
  the revision the file was mirrored at. Namespace permissions apply as to anyone (``@file`` may
  write keys outside the protected namespaces unless ``[namespaces]`` says otherwise). A change
  that cannot be taken in (``@file`` may not write the key, the key changed elsewhere meanwhile,
  the file is not JSON) is logged as a warning, the file is kept as
  ``context/.rejected/<key>.<time>.json``, and the store's value replaces it. A file younger than
  ``settle_seconds`` is left for the next round (it may still be being written); a deleted file
  is written again (keys are never deleted through the folder).

What the mirror last wrote or took in is recorded in ``context/.meta/mirror.json`` (key ->
revision and sha256), so a restart tells a local edit from a stale copy. Several daemons of one
workspace serialise their rounds with a flock on ``context/.meta/mirror.lock``.

The mirror's own files are opened as handoffd's own files are (:mod:`handoffd.core.ownfiles`):
``mirror.json`` read only as a regular file of at most :data:`MAX_STATE_BYTES` (anything else
reads as no record), ``mirror.lock`` never through a symlink nor as a FIFO, and ``.tmp``,
``.rejected`` and ``context/`` itself used only as plain folders, never symlinks (which would
take the mirror's writes out of the workspace); a round that meets one of them fails in one
log line, and the next tries again.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..backends.files import fsio
from ..backends.files.context import MAX_VALUE_BYTES, FileContext
from ..core.errors import HandoffdError, InvalidDocument
from ..core.hashing import sha256_hex
from ..core.keys import normalise_key
from ..core.ownfiles import open_regular, plain_folder, read_regular
from ..core.storage import SharedContext
from ..core.timeutil import utc_now
from .context import ContextStore

log = logging.getLogger("handoffd")
FILE_AGENT = "@file"  # who a change made through the folder is written by
STATE = "mirror.json"
REJECTED = ".rejected"
UNUSABLE = "unusable"  # the state of a file that cannot be read as a value (and is not in the store)
MAX_STATE_BYTES = 64 << 20  # mirror.json: key -> [revision, sha256], about 100 bytes a key


class ContextMirror:
    """Keeps ``store``'s workspace folder and its shared context (``store.backend``) alike."""

    def __init__(self, store: ContextStore, *, settle_seconds: float = 0.5,
                 durable: bool = True) -> None:
        if not isinstance(store.backend, SharedContext):
            raise TypeError("a context mirror needs a shared context store")
        self.store = store
        self.shared: SharedContext = store.backend
        self.local = FileContext(store.root, durable=durable)
        self.settle_seconds = settle_seconds
        self.durable = durable
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the two directions
    def pull(self) -> dict[str, list[str]]:
        """Write every key whose revision in the store differs from the mirrored one (one query
        when nothing changed). A local edit of such a key is taken in (or set aside) first."""
        with self._round() as (state, report):
            self._pull(state, report)
        return report

    def sync(self) -> dict[str, list[str]]:
        """A full round: take in every file changed on this host, then :meth:`pull`."""
        with self._round() as (state, report):
            for key in self.local.keys():
                self._look_at(key, state, report)
            for key in [k for k in state if not self._exists(k)]:
                # deleted here: written again below (keys are never deleted through files)
                if state.pop(key)[0]:
                    report["restored"].append(key)
            self._pull(state, report)
        return report

    # ------------------------------------------------------------ one round
    @contextmanager
    def _round(self) -> Iterator[tuple[dict[str, list[Any]], dict[str, list[str]]]]:
        report: dict[str, list[str]] = {"written": [], "ingested": [], "rejected": [],
                                        "restored": []}
        with self._lock, self._flock():
            state = self._load()
            before = json.dumps(state, sort_keys=True)
            try:
                yield state, report
            finally:  # what a round did before a failure (the database away) is remembered
                if json.dumps(state, sort_keys=True) != before:
                    fsio.replace(self.local.meta(STATE), json.dumps(state, sort_keys=True).encode(),
                                 self._tmp(), durable=self.durable)

    def _pull(self, state: dict[str, list[Any]], report: dict[str, list[str]]) -> None:
        remote = self.shared.revisions()
        stale = [k for k, rev in remote.items() if (state.get(k) or [None])[0] != rev]
        # a key changed in the store and here: take the local edit in (or set it aside) first;
        # one still being written here waits for the next round
        done = set(report["rejected"]) | set(report["ingested"])  # looked at in this round
        young = {k for k in stale
                 if k not in done and self._look_at(k, state, report) == "young"}
        remote = self.shared.revisions() if report["ingested"] else remote
        stale = [k for k, rev in remote.items() if (state.get(k) or [None])[0] != rev
                 and k not in young]
        for key, (data, revision) in self.shared.read_many(stale).items():
            try:
                path = self.local.write_path(key)
                path.parent.mkdir(parents=True, exist_ok=True)
                fsio.replace(path, data, self._tmp(), durable=self.durable)
            except (OSError, InvalidDocument) as exc:  # e.g. a file where a folder should be
                log.warning("context mirror: cannot write context/%s.json: %s", key, exc)
                continue
            state[key] = [revision, _sha(data)]
            report["written"].append(key)

    def _look_at(self, key: str, state: dict[str, list[Any]],
                 report: dict[str, list[str]]) -> str:
        """Take in ``key``'s file if it changed here. Returns ``same``, ``young`` (changed, too
        recent to judge), ``ingested`` or ``rejected``."""
        try:
            key = normalise_key(key)
            data, info = fsio.read_bytes_safely(self.local.path(key), MAX_VALUE_BYTES)
        except FileNotFoundError:
            return "same"
        except InvalidDocument as exc:  # empty (being written), a symlink, too big, a bad name
            if state.get(key) == [0, UNUSABLE]:
                return "same"  # said once already
            if self._young(key):
                return "young"
            return self._reject(key, None, str(exc), state, report)
        known = state.get(key)
        digest = _sha(data)
        if known is not None and known[1] == digest:
            return "same"
        if time.time() - info.st_mtime < self.settle_seconds:
            return "young"
        if known is None:
            current, revision = self.shared.read(key)
            if current is not None:
                if _sha(current) == digest:  # already the store's value: nothing to take in
                    state[key] = [revision, digest]
                    return "same"
                return self._reject(key, data, "it differs from the store's value and was never "
                                    "mirrored here (the store is the truth)", state, report)
        return self._ingest(key, data, 0 if known is None else int(known[0]), state, report)

    def _ingest(self, key: str, data: bytes, expected: int, state: dict[str, list[Any]],
                report: dict[str, list[str]]) -> str:
        try:
            value = json.loads(data.decode("utf-8"))
            entry = self.store.set(key, value, agent=FILE_AGENT, if_revision=expected)
        except (UnicodeDecodeError, ValueError) as exc:
            return self._reject(key, data, f"it is not valid JSON ({exc})", state, report)
        except HandoffdError as exc:  # no permission, a conflict, an unstorable value
            return self._reject(key, data, str(exc), state, report)
        log.info("context mirror: context/%s.json changed on this host; stored as revision %s "
                 "by %s", key, entry["revision"], FILE_AGENT)
        state.pop(key, None)  # the new revision is written back in handoffd's layout
        report["ingested"].append(key)
        return "ingested"

    def _reject(self, key: str, data: bytes | None, why: str, state: dict[str, list[Any]],
                report: dict[str, list[str]]) -> str:
        kept = ""
        if data is not None:
            stamp = utc_now().strftime("%Y%m%dT%H%M%S%fZ")
            copy = self.local.root / REJECTED / f"{key}.{stamp}.json"
            try:
                _own_folder(copy.parent, self.local.root)
                fsio.replace(copy, data, self._tmp(), durable=self.durable)
                kept = f"; the local copy is kept as {copy.relative_to(self.local.root.parent)}"
            except (OSError, InvalidDocument) as exc:
                kept = f"; keeping a copy failed: {exc}"
        current, revision = self.shared.read(key)
        if current is None:  # nothing to put back: leave the file, do not try it again
            state[key] = [0, _sha(data) if data is not None else UNUSABLE]
            outcome = "it stays as it is, outside the store"
        else:
            state.pop(key, None)  # the store's value replaces it in this round
            outcome = f"the store's revision {revision} replaces it"
        log.warning("context mirror: context/%s.json was changed on this host but is not taken "
                    "in: %s; %s%s", key, why, outcome, kept)
        report["rejected"].append(key)
        return "rejected"

    # ------------------------------------------------------------ helpers
    def _exists(self, key: str) -> bool:
        try:
            return self.local.path(key).is_file()
        except InvalidDocument:
            return False

    def _young(self, key: str) -> bool:
        try:
            return time.time() - os.lstat(self.local.path(key)).st_mtime < self.settle_seconds
        except (OSError, InvalidDocument):
            return False

    def _tmp(self) -> Any:
        """``context/.tmp``, made if missing; OSError when it (or ``context/``) is no plain
        folder: temporary files must never be made outside the workspace."""
        return _own_folder(self.local.root / ".tmp", self.local.root)

    def _load(self) -> dict[str, list[Any]]:
        try:  # bounded, a regular file only: a FIFO or /dev/zero here must not stall a round
            loaded = json.loads(read_regular(self.local.meta(STATE), MAX_STATE_BYTES).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(loaded, dict):
            return {}
        return {k: v for k, v in loaded.items() if isinstance(v, list) and len(v) == 2}

    @contextmanager
    def _flock(self) -> Iterator[None]:
        # no symlink followed, no FIFO waited on (open_regular): a round must never hang there
        fd = open_regular(self.local.meta("mirror.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _own_folder(folder: Path, root: Path) -> Path:
    """``folder`` (under ``root``, the context folder), made if missing; OSError when it, or
    any folder from ``root`` down to it, is not a plain folder (a symlink would take the
    mirror's writes elsewhere)."""
    root.mkdir(parents=True, exist_ok=True)
    for path in (root, *(root / part for part in _prefixes(folder.relative_to(root)))):
        path.mkdir(exist_ok=True)
        if not plain_folder(path):
            raise OSError(errno.ENOTDIR, "not a plain folder of the workspace (a symlink?)",
                          os.fspath(path))
    return folder


def _prefixes(relative: Path) -> list[Path]:
    """``a/b/c`` -> ``[a, a/b, a/b/c]``."""
    parts = relative.parts
    return [Path(*parts[:i]) for i in range(1, len(parts) + 1)]


def _sha(data: bytes) -> str:
    return sha256_hex(data)


def install(engine: Any, store: ContextStore) -> None:
    """Mirror ``store`` (on a shared store) into ``engine``'s workspace: before every handler
    runs, and in every daemon built on the engine (at start, on wake-ups, every rescan)."""
    mirror = ContextMirror(store, settle_seconds=engine.settings.settle_seconds,
                           durable=engine.settings.durable)

    def before_run(job: Any) -> None:
        guarded("refreshing context/ before the handler runs", mirror.pull)

    engine.before_run.append(before_run)
    engine.daemon_plugins.append(lambda daemon: attach(mirror, daemon,
                                                       engine.settings.rescan_seconds))


def attach(mirror: ContextMirror, daemon: Any, every: float) -> None:
    """A full round now, then one on every ``context`` wake-up and every ``every`` seconds, on
    a thread of the mirror's own (a wake-up hook must be quick); stopped with the daemon."""
    from ..core.storage import CONTEXT, LOST
    wake = threading.Event()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            wake.wait(every)
            wake.clear()
            if not stop.is_set():
                guarded("refreshing context/", mirror.sync)

    guarded("refreshing context/ at start", mirror.sync)
    thread = threading.Thread(target=loop, name="handoffd-context-mirror", daemon=True)
    thread.start()
    daemon.add_wakeup_hook(lambda w: wake.set() if w.kind in (CONTEXT, LOST) else None,
                           kinds={CONTEXT})

    def halt() -> None:
        stop.set()
        wake.set()
        thread.join(timeout=10.0)

    daemon.add_stop_hook(halt)


def guarded(what: str, func: Any) -> None:
    """Run one mirror round; a failure (the database away, a full disk) is one log line and the
    next round tries again: the mirror never stops a daemon or a handler."""
    try:
        func()
    except Exception as exc:
        log.error("context mirror: %s failed: %s; will try again", what, exc)
