"""What both command-line programs share: --root, error reporting, exit codes."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, TypeVar

import typer

from ..errors import HandoffdError
from ..lifecycle import Engine
from ..workspace import Workspace, resolve_root

F = TypeVar("F", bound=Callable[..., Any])

RootOption = Annotated[
    Path | None,
    typer.Option("--root", help="Workspace directory (default: $HANDOFFD_ROOT, else the current directory).",
                 show_default=False),
]


def fail(program: str, message: str, code: int) -> None:
    """Print one line on stderr and exit with ``code``."""
    print(f"{program}: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def guarded(program: str) -> Callable[[F], F]:
    """Turn every error into one stderr line and its exit code, never a traceback."""
    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except HandoffdError as exc:
                fail(program, str(exc), exc.exit_code)
            except KeyboardInterrupt:
                fail(program, "interrupted", 130)
            except OSError as exc:
                fail(program, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 1)
            except Exception as exc:  # a bug: still one line (HANDOFFD_DEBUG=1 shows the traceback)
                if os.environ.get("HANDOFFD_DEBUG"):
                    raise
                fail(program, f"internal error: {type(exc).__name__}: {exc} "
                              "(set HANDOFFD_DEBUG=1 for a traceback)", 1)
        return wrapper  # type: ignore[return-value]
    return decorate


def workspace(root: Path | None, *, create: bool = False) -> Workspace:
    """The workspace chosen by --root / $HANDOFFD_ROOT / cwd; it must exist unless ``create``."""
    ws = Workspace(resolve_root(root))
    if create:
        ws.ensure()
    elif not ws.exists():
        raise HandoffdError(f"{ws.root} is not a handoffd workspace (no handoffs/ folders); pass "
                            "--root, or run `handoffd serve` there once to create it")
    return ws


def engine(root: Path | None, *, create: bool = False) -> Engine:
    """An Engine over the chosen workspace."""
    return Engine(workspace(root, create=create))
