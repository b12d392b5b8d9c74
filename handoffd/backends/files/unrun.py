"""Claims given up before their handler ran: ``handoffs/.meta/unrun/<id>.<lease token>``.

A claim whose admission ran short of descriptors or memory, and whose hand-back to pending/
ran short too, is kept and handed back later (:mod:`handoffd.service.shortclaims`); when that
never works (the shortage outlasts the claim's lease, or the daemon stops), it is given up,
leased in in-progress/. Its handler never ran, but nothing in its document says so: its
``claimed`` event and lease are those of any claim. The process that gives it up remembers it
(its own sweep hands it back uncounted), and this mark says it to every other: the process
that recovers the claim with that lease hands it back uncounted too (it was charged an attempt
as a crash, here the last allowed one for a handoff with no retries).

The mark is an empty folder made with ``mkdir``, which takes no descriptor: it is made while
the shortage that refused the hand-back's write (no descriptor to open its file) still lasts.
Its name carries the lease token, so a mark never speaks for a later claim; the recovery that
takes the claim over removes it.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from ...core.ownfiles import plain_folder
from ...core.workspace import Workspace

NAME = "unrun"


def _path(ws: Workspace, handoff_id: str, token: str) -> Path:
    return ws.meta / NAME / f"{handoff_id}.{token}"


def mark(ws: Workspace, handoff_id: str, token: str) -> bool:
    """Mark the claim of ``handoff_id`` with lease ``token`` as given up unrun; False when the
    mark cannot be made (the claim is then recovered as before, as an interrupted attempt)."""
    top = ws.meta / NAME
    try:
        try:
            os.mkdir(top)
        except FileExistsError:
            pass
        if not plain_folder(top):  # (a symlink planted there: nothing is made through it)
            raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?)", str(top))
        os.mkdir(_path(ws, handoff_id, token))
    except FileExistsError:
        return True
    except OSError:
        return False
    return True


def marked(ws: Workspace, handoff_id: str, token: str) -> bool:
    """True when the claim of ``handoff_id`` with lease ``token`` was given up unrun."""
    return plain_folder(ws.meta / NAME) and plain_folder(_path(ws, handoff_id, token))


def clear(ws: Workspace, handoff_id: str, token: str) -> None:
    """Remove the mark of the claim with lease ``token`` (it was taken over); a mark that
    cannot be removed now is left (it names a lease no claim holds any more)."""
    try:
        os.rmdir(_path(ws, handoff_id, token))
    except OSError:
        pass
