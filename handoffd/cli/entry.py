"""The ``handoff`` console script: the quick path (:mod:`handoffd.cli.quick`) when it serves the
command line, else the full one (typer is imported only then). ``$HANDOFFD_FULL_CLI`` (any
value) always takes the full one, as for ``handoffd``."""
from __future__ import annotations

import os
import sys

from ..core.logs import speak_as
from .basics import PROG, failure_code, load_if_few_descriptors, prepare_streams
from .quick import try_quick


def handoff() -> None:
    """Entry point of ``handoff``."""
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
