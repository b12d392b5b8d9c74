"""The quick path of the ``handoffd`` console script (:mod:`handoffd.cli.handoffd_cmd`): the plain
forms of ``run`` and ``serve`` parsed without typer.

cron starts ``handoffd run`` every minute and a supervisor restarts ``handoffd serve``; importing
typer and click cost them more than an empty batch's own work. :func:`try_quick` parses the plain
forms of both (:data:`FORMS`: only their known options, each once, values that convert) and runs
the very functions the full commands run (:mod:`handoffd.cli.daemon_commands`); anything else
(``--help``, ``--version``, another command, an unknown option, a value that does not convert)
goes to the full command line, which words its own errors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..core.bounds import MAX_WORKERS
from ..core.config import processes_value
from .basics import failure_code
from .daemon_commands import PROG, run_batch, serve
from .quick import Form, number, parse

_COMMON = {"--root": "root", "--workers": "workers", "--log-format": "log_format",
           "--store": "store"}
_VERBOSE = {"--verbose": "verbose", "-v": "verbose"}

FORMS = {
    "run": Form({**_COMMON, "--max-seconds": "max_seconds", "--processes": "processes"},
                {**_VERBOSE, "--quiet": "quiet", "-q": "quiet"}),
    "serve": Form({**_COMMON, "--metrics": "metrics", "--metrics-textfile": "metrics_textfile",
                   "--processes": "processes"},
                  _VERBOSE),
}


def plain_form(argv: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """``(command, {parameter: value})`` with the values converted as the full command line
    converts them, or None unless ``argv`` is the plain form of ``run`` or ``serve`` (see
    :data:`FORMS`) with values that convert."""
    parsed = parse(argv, FORMS)
    if parsed is None:
        return None
    command, _, opts = parsed
    if any(value == "" for value in opts.values()):
        return None  # --root= and the like: the full parser's business
    try:
        if "workers" in opts:
            opts["workers"] = int(opts["workers"])
            if not 1 <= opts["workers"] <= MAX_WORKERS:  # (the full parser says why)
                return None
        if "processes" in opts:
            opts["processes"] = processes_value(opts["processes"])
        if "max_seconds" in opts:
            opts["max_seconds"] = number(opts["max_seconds"], float)
    except ValueError:
        return None
    for key in ("root", "metrics_textfile"):  # the full command line gives these as paths
        if key in opts:
            opts[key] = Path(opts[key])
    return command, opts


def try_quick(argv: Sequence[str]) -> int | None:
    """Run ``argv`` when it is a plain form (:func:`plain_form`); its exit code, or None when
    the full command line must handle it."""
    form = plain_form(argv)
    if form is None:
        return None
    command, opts = form
    try:
        code: int = run_batch(**opts) if command == "run" else serve(**opts)
        return code
    except (Exception, KeyboardInterrupt) as exc:  # one line, as in the full command line
        return failure_code(PROG, exc)
