"""Documents set aside while a move or a purge replaces them: ``handoffs/.meta/aside/<state>/``.

A move that is not a claim's own filing (`handoff retry`: failed/ -> pending/; the sweep's
recovery of a claim that died before its lease: in-progress/ -> pending/) and a purge first
rename the source document here, then write the new copy (or compare it with what was
archived), then delete the file they set aside. What they remove is exactly the copy they took,
never one filed in its place meanwhile: `handoff retry` once wrote pending/X, a daemon claimed,
ran and failed it again, and the retry's unlink of failed/X then removed the new failure (the
handoff was lost).

A process that dies in between leaves its file here. The sweep puts it back into its state
folder once it is :data:`AGE_SECONDS` old (a second copy of a moved handoff is then told apart
by revision, as after any crash between a move's write and its unlink), and quarantines it
when a copy was filed there meanwhile: a set-aside document is never deleted unread.

Until then, a document set aside from pending/ or in-progress/ is still live work: the store
lists it among the live handoffs (:func:`.reading.live_stamps`), and ``get`` finds it here, so
retention keeps its parent and what it depends on (they were purged in that minute once).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Protocol

from ...core.errors import ErrorCode
from ...core.ownfiles import plain_folder
from ...core.states import State
from ...core.workspace import Workspace
from . import fsio


class Store(Protocol):
    """What this module needs of :class:`.store.Store` (which imports this module)."""

    ws: Workspace

    def path(self, state: State, handoff_id: str) -> Path: ...

    def quarantine(self, path: Path, code: str, message: str) -> Path: ...

    def locate(self, handoff_id: str) -> list[State]: ...

AGE_SECONDS = 60.0  # a live mover holds a file aside for a rename, a write and an unlink
NAME = "aside"


def folder(store: Store, state: State) -> Path:
    """``.meta/aside/<state>``, made if missing. OSError when it (or ``.meta/aside``) is not a
    plain folder of the workspace: a symlink planted there once sent documents outside it."""
    top = store.ws.meta / NAME
    path = top / state.value
    for part in (top, path):
        try:
            part.mkdir(parents=part is top, exist_ok=True)
        except FileExistsError:
            pass  # a file or a symlink to one: refused just below
        if not plain_folder(part):
            raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?)", str(part))
    return path


def existing(ws: Workspace, state: State) -> Path | None:
    """``.meta/aside/<state>`` for a reader: None when it is missing or not a plain folder of
    the workspace (a symlink planted there must not lead a reader outside it). Never made."""
    top = ws.meta / NAME
    path = top / state.value
    return path if plain_folder(top) and plain_folder(path) else None


def take(store: Store, state: State, handoff_id: str) -> Path:
    """Rename ``handoff_id``'s document in ``state`` aside; the path it now has.
    FileNotFoundError when it is gone; FileExistsError when another process has it aside."""
    source = store.path(state, handoff_id)
    taken = folder(store, state) / source.name
    fsio.rename_noreplace(source, taken)
    return taken


def holds(store: Store, handoff_id: str) -> bool:
    """True when a document of ``handoff_id`` is set aside (a move or purge of it under way)."""
    name = f"{handoff_id}.json"
    return any(os.path.lexists(store.ws.meta / NAME / state.value / name) for state in State)


def put_back(store: Store, taken: Path, state: State) -> None:
    """Return a set-aside document to ``state``'s folder; should a copy have been written there
    meanwhile, the one set aside is quarantined, never deleted."""
    try:
        fsio.rename_noreplace(taken, store.ws.state_dir(state) / taken.name)
    except FileExistsError:
        store.quarantine(taken, ErrorCode.DUPLICATE_HANDOFF_ID.value,
                         f"set aside while another {taken.name} was written to {state.value}/")


def restore(store: Store, older_than: float) -> list[str]:
    """Put back what processes that died left aside (see the module docstring); what was put
    back, as ``state/name``. An entry that is no regular ``.json`` file is quarantined."""
    restored: list[str] = []
    top = store.ws.meta / NAME
    if not plain_folder(top):
        return restored
    for state in State:
        path = top / state.value
        if not plain_folder(path):
            continue
        for entry in list(os.scandir(path)):
            try:
                info = entry.stat(follow_symlinks=False)
                # the rename aside changed its ctime (its mtime is its writing's, maybe long ago)
                if info.st_ctime >= older_than:
                    continue  # its mover may still be at work
                if not stat.S_ISREG(info.st_mode) or not entry.name.endswith(".json"):
                    store.quarantine(Path(entry.path), ErrorCode.UNPROCESSABLE_DOCUMENT.value,
                                     "not a document handoffd set aside")
                    continue
                if store.locate(entry.name[:-5]):
                    # its mover wrote the new copy before it died: this one is the old one,
                    # which put back beside it would never be resolved (a retried handoff once
                    # sat in in-progress/ and failed/ for good); kept in quarantine, unread
                    store.quarantine(Path(entry.path), ErrorCode.DUPLICATE_HANDOFF_ID.value,
                                     "set aside by a move that wrote its new copy, then died")
                    continue
                put_back(store, Path(entry.path), state)
                restored.append(f"{state.value}/{entry.name}")
            except FileNotFoundError:
                continue
    return restored
