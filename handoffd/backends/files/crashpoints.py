"""The files store's crash points: the steps of a claim and of a filing where a crash must be
repairable, and the test seam that stops a process at one of them (``$HANDOFFD_CRASH_AT``, or a
hook a test installs in :data:`crash_hook`)."""
from __future__ import annotations

import os
from typing import Callable

__all__ = ["CRASH_POINTS", "crash_hook", "crash_point", "inject_crash_at"]

CRASH_POINTS = ("after-claim-rename", "after-claim-lease", "after-move-write", "after-move-unlink")
# A test seam for fault injection: called with the name of each crash point as it is passed. None
# (the default) costs one comparison; recovery tests install a hook with inject_crash_at().
crash_hook: Callable[[str], None] | None = None


def crash_point(name: str) -> None:
    """Mark a step of claim or finish where a crash must be repairable (see CRASH_POINTS)."""
    if crash_hook is not None:
        crash_hook(name)


def inject_crash_at(point: str) -> None:
    """Make this process die on the spot (exit 99, no cleanup, like kill -9) when it reaches
    ``point``; an empty ``point`` removes the injection. The ``handoffd`` command calls this for
    ``$HANDOFFD_CRASH_AT`` so that tests can crash a real daemon at each step."""
    global crash_hook

    def die_there(name: str) -> None:
        if name == point:
            os._exit(99)

    crash_hook = die_there if point else None
