"""The ``handoff`` console script: the quick path (:mod:`handoffd.cli.quick`) when it serves the
command line, else the full one (typer is imported only then). ``$HANDOFFD_FULL_CLI`` (any
value) always takes the full one, as for ``handoffd``."""
from __future__ import annotations

import os
import sys

from .quick import try_quick


def handoff() -> None:
    """Entry point of ``handoff``."""
    code = None if os.environ.get("HANDOFFD_FULL_CLI") else try_quick(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from .handoff_cmd import main
    main()
