"""The ``handoff`` console script: the quick path (:mod:`handoffd.cli.quick`) when it serves the
command line, else the full one (typer is imported only then). ``$HANDOFFD_FULL_CLI`` (any
value) always takes the full one, as for ``handoffd``.

This module imports next to nothing: the collector is set for a short run
(:mod:`handoffd.cli.collector`) before the rest of the program is imported."""
from __future__ import annotations

import os
import sys

from .collector import for_a_command, freeze_at_exit


def handoff() -> None:
    """Entry point of ``handoff``."""
    for_a_command()
    try:
        _handoff()
    finally:  # (sys.exit's SystemExit too)
        freeze_at_exit()


def _handoff() -> None:
    from ..core.logs import speak_as
    from .basics import PROG, failure_code, load_if_few_descriptors, prepare_streams
    from .quick import try_quick
    code = prepare_streams(PROG)  # (a closed stdout: refused before anything is done)
    if code is not None:
        sys.exit(code)
    load_if_few_descriptors()
    speak_as(PROG)  # a store's log lines (the database lost, waited for) read "handoff: ..."
    try:
        code = None if os.environ.get("HANDOFFD_FULL_CLI") else try_quick(sys.argv[1:])
        if code is None:
            from .handoff_cmd import main
            main()  # (exits itself)
    except (Exception, KeyboardInterrupt) as exc:
        # what fails outside a command's own guard, e.g. importing the full command line with
        # no descriptor or memory left: one line too, never a traceback
        code = failure_code(PROG, exc)
    sys.exit(code)
