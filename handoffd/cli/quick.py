"""The quick path of ``handoff create --to``: no typer, no click, no rich.

Agents create handoffs in loops, so ``handoff create`` is the start-up users feel (the issue's
goal: within 4x ``python -c pass``). Importing typer and click alone took longer than the whole
create. :func:`try_create` serves the plain form (the options in :data:`OPTIONS`, each once)
through the same engine calls as the full command (:func:`submit_request`), and answers None for
anything else (``--help``, ``--file``, ``--wait``, ``--depends-on``, a store URL...), which the
full command line then handles with its own parsing and messages.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..core.errors import HandoffdError, NotFound, UsageError
from ..core.workspace import Workspace, resolve_root

if TYPE_CHECKING:
    from ..core.engine import Engine

PROG = "handoff"
# option -> parameter of submit_request; values are strings as typed (converted there)
OPTIONS = {"--to": "to", "--from": "source", "--data": "data", "--id": "handoff_id",
           "--priority": "priority", "--timeout-seconds": "timeout_seconds", "--root": "root"}


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


def json_arg(text: str, what: str) -> Any:
    """``text`` parsed as JSON; UsageError naming ``what`` when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


def submit_request(eng: "Engine", *, to: str, source: str = "@cli", payload: Any = None,
                   handoff_id: str | None = None, timeout_seconds: float | None = None,
                   priority: str | None = None, depends_on: list[str] | None = None,
                   expires_at: str | None = None, if_absent: bool = False,
                   due_at: Any = None) -> str:
    """Submit a native (seed 001) request built from ``handoff create``'s options; its id."""
    from ..core.documents import new_native_request
    prio: Any = int(priority) if priority is not None and priority.isdigit() else priority
    doc = new_native_request(source=source, target=to, data=payload, now=eng.clock(),
                             handoff_id=handoff_id, timeout_seconds=timeout_seconds,
                             priority=prio, depends_on=depends_on)
    if expires_at is not None:
        doc["expires_at"] = expires_at
    # new_native_request refuses what the schema would (e.g. --priority urgent): no validator
    return eng.submit(doc, forced="native", prechecked=True, if_absent=if_absent, due_at=due_at)


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


def parse(argv: Sequence[str]) -> dict[str, str] | None:
    """``handoff create``'s options as {parameter: text}, or None unless ``argv`` is the plain
    form (``create``, then only :data:`OPTIONS`, each once, ``--to`` among them)."""
    if not argv or argv[0] != "create":
        return None
    found: dict[str, str] = {}
    rest = list(argv[1:])
    while rest:
        name = rest.pop(0)
        if name.startswith("--") and "=" in name:
            name, value = name.split("=", 1)
        elif rest and not rest[0].startswith("--"):
            value = rest.pop(0)
        else:
            return None  # a flag, a missing value or a value that looks like an option
        key = OPTIONS.get(name)
        if key is None or key in found:
            return None
        found[key] = value
    return found if found.get("to") else None


def try_create(argv: Sequence[str]) -> int | None:
    """Run ``handoff create`` quickly when ``argv`` is its plain form; its exit code, or None
    when the full command line must handle ``argv``."""
    opts = parse(argv)
    if opts is None or os.environ.get("HANDOFFD_STORE"):
        return None
    try:
        timeout = float(opts["timeout_seconds"]) if "timeout_seconds" in opts else None
    except ValueError:
        return None  # the full command line words the error
    try:
        ws = open_workspace(opts.get("root"), create=True)
        config = ws.load_config()
        if config.store_url(None) is not None:
            return None  # a database store: the full path opens it
        from ..features.build import build_engine
        eng = build_engine(ws, config, features=("dependencies",))  # what create installs
        payload = json_arg(opts["data"], "--data") if "data" in opts else None
        new_id = submit_request(eng, to=opts["to"], source=opts.get("source", "@cli"),
                                payload=payload, handoff_id=opts.get("handoff_id"),
                                timeout_seconds=timeout, priority=opts.get("priority"))
        print(new_id)
        sys.stdout.flush()
        return 0
    except BrokenPipeError:  # the reader of stdout left: nothing more to say
        quiet_stdout()
        return 0
    except (Exception, KeyboardInterrupt) as exc:  # one line, as in the full command line
        if os.environ.get("HANDOFFD_DEBUG") and not isinstance(exc, (HandoffdError, OSError,
                                                                      KeyboardInterrupt)):
            raise
        return exit_code(PROG, exc)


def quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
