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

What the mirror last wrote or took in is recorded in ``handoffs/.meta/context-mirror.json``
(key -> revision and sha256), so a restart tells a local edit from a stale copy. The record is
sealed with the workspace's seal key (:mod:`handoffd.backends.files.seals`) and kept out of
``context/``: a record that anyone who writes ``context/`` could rewrite (it was
``context/.meta/mirror.json``) let a forged value of a protected key be recorded as the store's
and kept for good. A record whose seal does not match (or with no key to check it) is no record:
the round compares every file with the store's value, as at a first start. Several daemons of
one workspace serialise their rounds with a flock on ``context/.meta/mirror.lock``.

The mirror's own files are opened as handoffd's own files are (:mod:`handoffd.core.ownfiles`):
the record read only as a regular file of at most :data:`MAX_STATE_BYTES` (anything else reads
as no record), ``mirror.lock`` never through a symlink nor as a FIFO. Values and the copies kept
in ``.rejected`` are read and written through descriptors of ``context/`` and each folder on
the way (:meth:`ContextFolder.folder <handoffd.backends.files.contextfs.ContextFolder.folder>`), never
through a symlink, even one swapped in while a round runs; a file that cannot be written is one
log line, and the next round tries again.
"""
from __future__ import annotations

import json
import logging
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..backends.files import fsio, seals
from ..backends.files.context import FileContext
from ..core.errors import HandoffdError, InvalidDocument
from ..core.hashing import hmac_sha256_hex, same_text, sha256_hex
from ..core.keys import names_itself, normalise_key
from ..core.ownfiles import read_regular
from ..core.storage import SharedContext
from ..core.timeutil import utc_now
from .context import ContextStore

log = logging.getLogger("handoffd")
FILE_AGENT = "@file"  # who a change made through the folder is written by
STATE = "context-mirror.json"  # in handoffs/.meta
SEAL_DOMAIN = b"handoffd context mirror\0"  # no document's seal can stand for the record's
REJECTED = ".rejected"
UNUSABLE = "unusable"  # the state of a file that cannot be read as a value (and is not in the store)
MAX_STATE_BYTES = 64 << 20  # the record: key -> [revision, sha256], about 100 bytes a key


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
        self._seal_key: bytes | None = None
        self._unsealed_said = False

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
            for key in [k for k in state if names_itself(k) and not self._exists(k)]:
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
            state, trusted = self._load()
            # an untrusted record is replaced by a sealed one even when nothing changed
            before = json.dumps(state, sort_keys=True) if trusted else None
            try:
                yield state, report
            finally:  # what a round did before a failure (the database away) is remembered
                if json.dumps(state, sort_keys=True) != before:
                    self._save(state)

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
            if not names_itself(key):  # stored before keys were a bijection with files
                log.warning("context mirror: the store's key %r names no file of context/ "
                            "(not a key any more); not mirrored", key)
                state[key] = [revision, UNUSABLE]
                continue
            try:  # by descriptors: a symlink swapped in on the key's path is never followed
                self.local.put(f"{key}.json", data)
            except (OSError, InvalidDocument, ValueError) as exc:  # a file where a folder should be
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
            data, info = self.local.read_file(key)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return "same"  # no file of this key here (a folder of other keys, another key's file)
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
            copy = f"{REJECTED}/{key}.{stamp}.json"
            try:
                self.local.put(copy, data)
                kept = f"; the local copy is kept as context/{copy}"
            except (OSError, InvalidDocument, ValueError) as exc:
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
            return stat.S_ISREG(self.local.stat(key).st_mode)
        except (OSError, InvalidDocument):
            return False

    def _young(self, key: str) -> bool:
        try:
            return time.time() - self.local.stat(key).st_mtime < self.settle_seconds
        except (OSError, InvalidDocument):
            return False

    # ------------------------------------------------------------ the sealed record
    def _state_path(self) -> Path:
        return self.store.ws.meta / STATE

    def _key(self) -> bytes | None:
        """The workspace's seal key (made on first use); None when there is none to use."""
        if self._seal_key is None:
            try:
                self._seal_key = seals.load_or_create_key(self.store.ws.meta, self.store.ws.tmp)
            except HandoffdError as exc:  # an unusable seal.key: no record is trusted
                if not self._unsealed_said:
                    log.warning("context mirror: %s; every round compares each file with the "
                                "store's value", exc)
                    self._unsealed_said = True
        return self._seal_key

    def _load(self) -> tuple[dict[str, list[Any]], bool]:
        """(the sealed record (:data:`STATE`), whether it was one): ({}, False) when it is
        missing, unreadable, or its seal does not match: then every file is compared with the
        store's value this round."""
        key = self._key()
        try:  # bounded, a regular file only: a FIFO or /dev/zero here must not stall a round
            loaded = json.loads(read_regular(self._state_path(), MAX_STATE_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return {}, False
        except (OSError, ValueError, RecursionError):
            loaded = None
        keys = loaded.get("keys") if isinstance(loaded, dict) else None
        seal = loaded.get("seal") if isinstance(loaded, dict) else None
        if (key is None or not isinstance(keys, dict) or not isinstance(seal, str)
                or not same_text(seal, _seal(key, keys))):
            log.warning("context mirror: handoffs/.meta/%s is not a record sealed by this "
                        "workspace (written from outside?); not trusted: each file is compared "
                        "with the store's value", STATE)
            return {}, False
        return {k: v for k, v in keys.items() if isinstance(v, list) and len(v) == 2}, True

    def _save(self, state: dict[str, list[Any]]) -> None:
        key = self._key()
        if key is None:
            return  # nothing sealed would be trusted: every round compares with the store
        data = json.dumps({"keys": state, "seal": _seal(key, state)}, sort_keys=True).encode()
        self.store.ws.meta.mkdir(parents=True, exist_ok=True)
        fsio.replace(self._state_path(), data, self.store.ws.tmp, durable=self.durable)

    @contextmanager
    def _flock(self) -> Iterator[None]:
        # no symlink followed, no FIFO waited on: a round must never hang there
        with self.local.meta_lock("mirror.lock"):
            yield


def _seal(key: bytes, state: dict[str, Any]) -> str:
    """The seal of the mirror's record ``state`` (an HMAC under the workspace's seal key)."""
    return hmac_sha256_hex(key, SEAL_DOMAIN + json.dumps(state, sort_keys=True).encode())


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
