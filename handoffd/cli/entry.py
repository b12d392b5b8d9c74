"""The ``handoff`` console script: the quick path (:mod:`handoffd.cli.quick`) when it serves the
command line, else the full one (typer is imported only then)."""
from __future__ import annotations

import sys

from .quick import try_quick


def handoff() -> None:
    """Entry point of ``handoff``."""
    code = try_quick(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from .handoff_cmd import main
    main()
