"""The ``handoffd`` console script: the quick path when it serves the command line
(:mod:`handoffd.cli.handoffd_quick`), else the full one (:mod:`handoffd.cli.handoffd_app`; typer
is imported only then). ``$HANDOFFD_FULL_CLI`` (any value) always takes the full command line.

This module imports next to nothing: ``serve``, ``run`` and ``db`` hold the stop signals first
thing (:func:`~handoffd.core.starting.hold_stop_signals`), before the rest of the program is
imported (a stop during those imports killed ``db init`` with -15). Only a signal that comes
while Python itself starts, before :func:`main` runs, acts as it does on any program.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from ..core.starting import hold_stop_signals, say_at_once
from .collector import freeze_at_exit

# the commands whose stop signals are held from the start: the daemon's, and the store's set-up
HOLDING = (["run"], ["serve"], ["db"])
# what a second stop signal during `handoffd db`'s start says (the store is not opened yet)
DB_AT_ONCE = ("handoffd: stopped: before it began, at a second stop signal, before opening the "
              "store: nothing was done to it")
# and during `serve`'s or `run`'s (before their daemon takes the signals: it claimed nothing)
DAEMON_AT_ONCE = ("stopped: before it began, at a second stop signal: nothing was claimed, "
                  "nothing to hand back")


def __getattr__(name: str) -> Any:
    """The quick path's names (FORMS, plain_form, try_quick), as this module once held them."""
    if name in ("FORMS", "plain_form", "try_quick"):
        from . import handoffd_quick
        return getattr(handoffd_quick, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console-script entry point. ``$HANDOFFD_CRASH_AT`` (a step of claim or finish, for
    recovery tests) makes the daemon die there as if killed."""
    if sys.argv[1:2] == ["db"]:  # a stop during the start is held (it killed it: exit -15)
        hold_stop_signals(DB_AT_ONCE)  # (a second one ends it at once, saying so in a line)
    elif sys.argv[1:2] in HOLDING:
        hold_stop_signals()
        daemon_at_once(sys.argv[1:])
    # (the collector's young passes stay as they are: a daemon lives long, and fewer passes
    # kept what failed attempts left in reference cycles, their documents with them, for
    # hundreds of MB: R-RB; handoffd's own attempts leave none since session 30, a handler's
    # own code still may)
    try:
        _main()
    finally:  # (sys.exit's SystemExit too)
        freeze_at_exit()


def daemon_at_once(argv: list[str]) -> None:
    """What a second stop signal during ``serve``'s or ``run``'s start says as it ends it
    (:func:`~handoffd.core.starting.say_at_once`), in the format its line would have once the
    daemon runs (a JSON record with ``--log-format json``; nothing from ``run -q``, whose
    "stopped" line is not said either). Read from ``argv`` (the command and its options) before
    they are parsed: the start it ends is mostly their parsing's imports. It ended with exit 0
    and no word, where a second signal once the daemon runs hands back at once and says
    "stopped"."""
    log_format, quiet = "text", False
    for index, arg in enumerate(argv):
        if arg == "--log-format" and index + 1 < len(argv):
            log_format = argv[index + 1]
        elif arg.startswith("--log-format="):
            log_format = arg.partition("=")[2]
        elif argv[0] == "run" and arg in ("-q", "--quiet"):
            quiet = True
    if quiet:
        return
    if log_format == "json":
        say_at_once(DAEMON_AT_ONCE, event="stopped")
    else:
        say_at_once(f"handoffd: {DAEMON_AT_ONCE}")


def _main() -> None:
    from .basics import prepare_streams
    from .daemon_commands import PROG
    daemon = sys.argv[1:2] in (["run"], ["serve"])
    # serve and run log to stderr and never need stdout: they run with it closed (cron, a
    # supervisor); any other command's output would reach no one
    refused = prepare_streams(PROG, stdout_needed=not daemon)
    if refused is not None:
        sys.exit(refused)
    point = os.environ.get("HANDOFFD_CRASH_AT", "")
    if point:
        from ..backends.files.crashpoints import inject_crash_at
        inject_crash_at(point)
    if not os.environ.get("HANDOFFD_FULL_CLI") and not os.environ.get("_HANDOFFD_COMPLETE"):
        from .handoffd_quick import try_quick
        code = try_quick(sys.argv[1:])
        if code is not None:
            sys.exit(code)
    from .handoffd_app import main as full
    full()
