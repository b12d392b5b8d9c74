"""Exclusive file ownership while a contract handoff runs.

A running handoff whose contract names ``files_owned`` holds a *reservation*:
``handoffs/.meta/reservations/{handoff_id}.json`` with its patterns (relative to the workspace
root), its claim's lease token and when it was taken. Reservations are created and released under
one workspace-wide lock (``handoffs/.meta/reservations.lock``), so two processes can never both
reserve overlapping patterns: the second one sees the first and backs off.

A reservation is *live* while its handoff is in ``in-progress/`` carrying the same lease token;
when the owner dies the sweeper recovers the claim and the reservation dies with it (the sweeper
also deletes the file). Released reservations are kept for a while under ``released/`` so that a
scope check can tell which other handoffs owned a path during its run (their writes are theirs).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...backends.files.fsio import replace
from ...core.documents import actor, book
from ...core.errors import HandoffdError, InvalidDocument
from ...core.states import State
from ...core.timeutil import iso, utc_now
from . import patterns

if TYPE_CHECKING:
    from filelock import FileLock

    from ...core.engine import Engine

LOCK_TIMEOUT_SECONDS = 60.0
RELEASED_KEEP_SECONDS = 120.0


@dataclass(frozen=True)
class Conflict:
    """Another live reservation overlapping ours."""

    holder: str
    theirs: str
    ours: str

    def reason(self) -> str:
        mine = "" if self.theirs == self.ours else f" (overlaps {self.ours})"
        return f"waiting for files owned by {self.holder}: {self.theirs}{mine}"


class Reservations:
    """The reservation records of one workspace."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.dir = engine.ws.meta / "reservations"
        self.released_dir = self.dir / "released"
        self.lock_path = engine.ws.meta / "reservations.lock"

    # ------------------------------------------------------------ reading
    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("handoff_id"), str) \
                or not isinstance(data.get("patterns"), list):
            return None
        return data

    def records(self) -> list[dict[str, Any]]:
        """Every reservation file (live or not yet known dead), unordered."""
        out = []
        try:
            names = [e.name for e in os.scandir(self.dir) if e.name.endswith(".json")]
        except FileNotFoundError:
            return []
        for name in names:
            data = self._read(self.dir / name)
            if data is not None:
                out.append(data)
        return out

    def alive(self, record: dict[str, Any]) -> bool:
        """True while the record's handoff is in progress under the same claim."""
        try:
            found = self.engine.backend.get(record["handoff_id"])
        except InvalidDocument:
            return False
        if found is None or found[0] is not State.IN_PROGRESS:
            return False
        held = book(found[1]).get("lease")
        return isinstance(held, dict) and held.get("token") == record.get("token")

    def live(self) -> list[dict[str, Any]]:
        """The reservations whose handoff still runs."""
        return [r for r in self.records() if self.alive(r)]

    @staticmethod
    def conflict(handoff_id: str, owned: list[str], others: list[dict[str, Any]]) -> Conflict | None:
        """The first reservation among ``others`` (not ``handoff_id``'s) overlapping ``owned``."""
        for record in sorted(others, key=lambda r: (r.get("taken_at", 0), r["handoff_id"])):
            if record["handoff_id"] == handoff_id:
                continue
            for theirs in record["patterns"]:
                for ours in owned:
                    if isinstance(theirs, str) and patterns.overlap(theirs, ours):
                        return Conflict(record["handoff_id"], theirs, ours)
        return None

    def first_conflict(self, handoff_id: str, owned: list[str]) -> Conflict | None:
        """Lock-free check for gates: a live reservation overlapping ``owned``."""
        return self.conflict(handoff_id, owned, self.live())

    # ------------------------------------------------------------ taking and releasing
    def _lock(self, timeout: float = LOCK_TIMEOUT_SECONDS) -> "FileLock":
        from filelock import (
            FileLock,  # imported where a lock is taken (`handoff ls` takes none)
        )
        self.engine.ws.meta.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.lock_path), timeout=timeout)

    def take(self, handoff_id: str, token: str | None, owned: list[str], *,
             agent: str | None) -> Conflict | None:
        """Reserve ``owned`` for this claim atomically; the conflict instead if one exists."""
        try:
            with self._lock():
                found = self.conflict(handoff_id, owned, self.live())
                if found is not None:
                    return found
                record = {"handoff_id": handoff_id, "token": token, "patterns": list(owned),
                          "agent": agent, "taken_at": time.time(), "taken": iso(utc_now()),
                          "owner": actor()}
                self._write(self.dir / f"{handoff_id}.json", record)
                return None
        except TimeoutError:  # filelock.Timeout is one
            raise HandoffdError(f"handoff {handoff_id}: the reservation lock {self.lock_path} was "
                                f"busy for {LOCK_TIMEOUT_SECONDS:.0f}s", handoff_id=handoff_id) from None

    def release(self, handoff_id: str, token: str | None) -> None:
        """Drop this claim's reservation (kept a while under released/ for scope attribution)."""
        with self._lock():
            path = self.dir / f"{handoff_id}.json"
            record = self._read(path)
            if record is None or record.get("token") != token:
                return
            self._retire(path, record, "released")
            self._prune_released()

    def prune(self) -> int:
        """Sweeper: retire the reservations of handoffs no longer in progress under that claim."""
        dropped = 0
        try:
            with self._lock(timeout=5):
                for record in self.records():
                    if not self.alive(record):
                        self._retire(self.dir / f"{record['handoff_id']}.json", record, "owner gone")
                        dropped += 1
                self._prune_released()
        except (TimeoutError, FileNotFoundError):  # filelock.Timeout is a TimeoutError
            return dropped
        return dropped

    def neighbours(self, handoff_id: str, since: float) -> list[dict[str, Any]]:
        """Other reservations (live or released) that existed at some time since ``since``."""
        out = []
        for record in self.records():
            if record["handoff_id"] != handoff_id:
                out.append(record)
        try:
            names = [e.name for e in os.scandir(self.released_dir) if e.name.endswith(".json")]
        except FileNotFoundError:
            names = []
        for name in names:
            found = self._read(self.released_dir / name)
            if found is None or found["handoff_id"] == handoff_id:
                continue
            released = found.get("released_at")
            if isinstance(released, (int, float)) and released < since:
                continue
            out.append(found)
        return out

    # ------------------------------------------------------------ internals
    def _write(self, path: Path, record: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.engine.ws.tmp.mkdir(parents=True, exist_ok=True)
        replace(path, json.dumps(record, indent=2).encode("utf-8"), self.engine.ws.tmp,
                durable=self.engine.settings.durable)

    def _retire(self, path: Path, record: dict[str, Any], why: str) -> None:
        record = dict(record, released_at=time.time(), released=iso(utc_now()), why=why)
        token = str(record.get("token") or "none")
        self._write(self.released_dir / f"{record['handoff_id']}.{token}.json", record)
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def _prune_released(self) -> None:
        """Forget released records nobody running can still need."""
        starts = [r.get("taken_at") for r in self.records()]
        oldest = min([s for s in starts if isinstance(s, (int, float))], default=time.time())
        cutoff = min(oldest, time.time()) - RELEASED_KEEP_SECONDS
        try:
            entries = list(os.scandir(self.released_dir))
        except FileNotFoundError:
            return
        for entry in entries:
            record = self._read(Path(entry.path))
            released = record.get("released_at") if record else None
            if record is None or (isinstance(released, (int, float)) and released < cutoff):
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
