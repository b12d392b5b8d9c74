"""What both command-line programs share: --root, error reporting, exit codes."""
from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer

from ..core.workspace import Workspace
from .basics import engine as engine  # the commands' one way to an Engine
from .basics import check_id_arguments, failure_code, open_workspace, quiet_stdout

F = TypeVar("F", bound=Callable[..., Any])

JsonOption = Annotated[bool, typer.Option("--json", help="Plain JSON output.")]

RootOption = Annotated[
    Path | None,
    typer.Option("--root", help="Workspace directory (default: $HANDOFFD_ROOT, else the current directory).",
                 show_default=False),
]


def _show_version(ctx: typer.Context, value: bool) -> None:
    if value:
        from .. import __version__
        print(f"{ctx.find_root().info_name} {__version__}")
        raise typer.Exit(0)


VersionOption = Annotated[bool, typer.Option("--version", help="Print the version and exit.",
                                             is_eager=True, callback=_show_version)]


def new_app(help_text: str) -> typer.Typer:
    """A command-line app with shell completion (``--install-completion``) and ``--version``."""
    app = typer.Typer(pretty_exceptions_enable=False, no_args_is_help=True, help=help_text)

    @app.callback()
    def main(version: VersionOption = False) -> None:  # noqa: ARG001 (its callback acts)
        """The program's own options."""

    return app


def fail(program: str, message: str, code: int) -> None:  # (used by commands for their own checks)
    """Print one line on stderr and exit with ``code``."""
    print(f"{program}: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def guarded(program: str) -> Callable[[F], F]:
    """Turn every error into one stderr line and its exit code, never a traceback."""
    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                check_id_arguments(kwargs)
                return func(*args, **kwargs)
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except (Exception, KeyboardInterrupt) as exc:
                raise typer.Exit(failure_code(program, exc)) from None
        return wrapper  # type: ignore[return-value]
    return decorate


def click_command(app: typer.Typer, argv: list[str]) -> Any:
    """The click command that runs ``argv`` for ``app``: a group holding only the command that
    ``argv[0]`` names, when it names one.

    Typer turns every registered command's signature into click parameters on each start, which
    cost a one-shot command more than its own work; the invoked command alone behaves the same
    (its help, its errors). Anything else (no command, ``--help``, a mistyped name) gets the
    whole app, so the listing and click's "No such command" stay as they are."""
    from typer.main import get_command, get_group

    name = argv[0] if argv and not argv[0].startswith("-") else None
    commands = [c for c in app.registered_commands
                if (c.name or getattr(c.callback, "__name__", "")) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return get_command(app)
    narrow = copy.copy(app)
    narrow.registered_commands, narrow.registered_groups = commands, groups
    return get_group(narrow)  # a group even for one command, as the whole app is


def run_app(app: typer.Typer, program: str) -> None:
    """Run a Typer app so that usage errors are one line on stderr (exit 2), like every error."""
    try:
        code = click_command(app, sys.argv[1:])(prog_name=program, standalone_mode=False)
    except typer.Abort:
        print(f"{program}: error: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        quiet_stdout()
        sys.exit(0)
    except Exception as exc:
        # click's UsageError (typer vendors click, so match it by shape rather than by a
        # private import): bad option values, missing arguments, unknown options
        if getattr(exc, "exit_code", None) == 2 and hasattr(exc, "format_message"):
            message = " ".join(str(exc.format_message()).split())
            if message:  # empty when the help was shown because no command was given
                print(f"{program}: error: {message} (see {program} --help)", file=sys.stderr)
            sys.exit(2)
        raise
    sys.exit(code if isinstance(code, int) else 0)


def workspace(root: Path | None, *, create: bool = False) -> Workspace:
    """The workspace chosen by --root / $HANDOFFD_ROOT / cwd; it must exist unless ``create``."""
    return open_workspace(root, create=create)


StoreOption = Annotated[
    Optional[str],
    typer.Option("--store", help="Store URL, e.g. postgresql://user@host/db (default: "
                 "$HANDOFFD_STORE, else \\[store] url, else the workspace's files).",
                 show_default=False),
]
