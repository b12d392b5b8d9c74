"""What every ``handoff`` command needs, without typer: the workspace, an Engine, JSON
arguments, and errors as one line with their exit code. The quick path
(:mod:`handoffd.cli.quick`), the shared read commands (:mod:`handoffd.cli.reads`) and the full
command line (:mod:`handoffd.cli.common`) all build on it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..core.errors import HandoffdError, NotFound, UsageError
from ..core.workspace import Workspace, resolve_root

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.storage import Backend

PROG = "handoff"


def open_workspace(root: str | Path | None, *, create: bool = False) -> Workspace:
    """The workspace chosen by --root / $HANDOFFD_ROOT / cwd; it must exist unless ``create``."""
    ws = Workspace(resolve_root(root))
    if not ws.root.is_dir():  # a mistyped --root must not silently start a new workspace
        raise NotFound(f"workspace directory {ws.root} does not exist; create it or fix --root")
    if create:
        ws.ensure()
    elif not ws.exists():
        raise HandoffdError(f"{ws.root} is not a handoffd workspace (no handoffs/ folders); pass "
                            "--root, or run `handoffd serve` there once to create it")
    return ws


def engine(root: str | Path | None, *, create: bool = False,
           features: Iterable[str] | None = None, store: str | None = None) -> Engine:
    """An Engine over the chosen workspace with ``features`` installed (by name; None: every
    feature). A command that only reads, or only creates, names what it needs: importing and
    installing every feature is a daemon's start-up cost, not a one-shot command's."""
    from ..features.build import DEFAULT_FEATURES, build_engine
    return build_engine(open_workspace(root, create=create), store=store,
                        features=DEFAULT_FEATURES if features is None else features)


def backend(root: str | Path | None) -> Backend:
    """The store of the chosen workspace alone, without an Engine: for commands that only read
    documents (``handoff wait``)."""
    from ..features.build import open_backend
    ws = open_workspace(root)
    return open_backend(ws, ws.load_config())


def json_arg(text: str, what: str) -> Any:
    """``text`` parsed as JSON; UsageError naming ``what`` when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


def exit_code(program: str, exc: BaseException) -> int:
    """One stderr line for ``exc`` and the exit code it stands for (never a traceback)."""
    if isinstance(exc, HandoffdError):
        message, code = str(exc), exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        message, code = "interrupted", 130
    elif isinstance(exc, OSError):
        message, code = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 1
    else:  # a bug: still one line (HANDOFFD_DEBUG=1 re-raises it for a traceback)
        message, code = (f"internal error: {type(exc).__name__}: {exc} "
                         "(set HANDOFFD_DEBUG=1 for a traceback)"), 1
    print(f"{program}: error: {message}", file=sys.stderr)
    return code


def failure_code(program: str, exc: BaseException) -> int:
    """What a command that raised ``exc`` exits with (one stderr line, never a traceback): 0
    when stdout's reader left (a broken pipe); a bug is re-raised when HANDOFFD_DEBUG is set."""
    if isinstance(exc, BrokenPipeError):  # e.g. `handoff trace X --json | head`
        quiet_stdout()
        return 0
    if os.environ.get("HANDOFFD_DEBUG") and not isinstance(exc, (HandoffdError, OSError,
                                                                  KeyboardInterrupt)):
        raise exc
    return exit_code(program, exc)


def quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
