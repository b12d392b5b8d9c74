"""The quick path of ``handoff``: the plain forms of ``create``, ``show``, ``ls``, ``wait``,
``context get`` and ``context set`` without typer, click or rich.

Agents create handoffs and poll them in loops, so these commands' start-up is what users feel
(the issue's goal: within 4x ``python -c pass``); importing typer and click alone took longer
than a whole create. :func:`try_quick` serves a command line made only of the options in
:data:`COMMANDS` (each once, values that convert), through the same functions as the full
command (:func:`submit_request`, :mod:`handoffd.cli.reads`), and answers None for anything else
(``--help``, ``--file``, ``--wait``, ``--watch``, a bad value...), which the full command line
then handles with its own parsing and messages.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .basics import (
    PROG,
    bridged,
    check_id_arguments,
    engine,
    failure_code,
    json_arg,
    open_workspace,
    text_arg,
)

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.submission import Submitter


# how deep ``handoff create``'s --data/--input value sits in the request (document, input,
# data: 2), plus the levels a request keeps free for what is filed for it (8: core.documents'
# REQUEST_DEPTH_MARGIN, not imported here: the quick path loads no more than it needs)
INPUT_DATA_DEPTH = 2 + 8


@dataclass(frozen=True)
class Form:
    """The plain form of one command: options taking a value (option -> parameter), flags
    (option -> parameter), how many positional arguments, and which parameters are required."""

    values: dict[str, str]
    flags: dict[str, str]
    positional: int = 0
    required: tuple[str, ...] = ()
    optional: int = 0  # positional arguments that may follow the ``positional`` ones


COMMANDS = {
    "create": Form({"--to": "to", "--from": "source", "--data": "data", "--id": "handoff_id",
                    "--priority": "priority", "--timeout-seconds": "timeout_seconds",
                    "--root": "root"}, {}, required=("to",)),
    "show": Form({"--root": "root"}, {"--json": "as_json"}, positional=1),
    "ls": Form({"--state": "state", "--to": "to", "--from": "source", "--limit": "limit",
                "--conversation": "conversation", "--root": "root"}, {"--json": "as_json"}),
    "wait": Form({"--timeout": "timeout", "--root": "root"}, {"--json": "as_json"},
                 positional=1),
    # a subcommand is looked up as "context get": see try_quick
    "context get": Form({"--root": "root"}, {"--with-revision": "with_revision"}, positional=1),
    "context set": Form({"--data": "data", "--input": "input_file", "--if-revision": "if_revision",
                         "--as": "as_agent", "--root": "root"}, {}, positional=1, optional=1),
}


def submit_request(eng: "Engine | Submitter", *, to: str, source: str = "@cli", payload: Any = None,
                   handoff_id: str | None = None, timeout_seconds: float | None = None,
                   priority: str | None = None, depends_on: list[str] | None = None,
                   expires_at: str | None = None, if_absent: bool = False,
                   due_at: Any = None) -> str:
    """Submit a native (seed 001) request built from ``handoff create``'s options; its id.
    A value no request may hold is the caller's usage error (exit 2), said before anything is
    written; what the store then refuses (a taken id, a missing dependency) stays exit 1."""
    from ..core import hashing
    hashing.load()  # before the stamps below: the created time is when the document appears
    eng.backend.prepare()
    doc = request_from_options(eng, to=to, source=source, payload=payload,
                               handoff_id=handoff_id, timeout_seconds=timeout_seconds,
                               priority=priority, depends_on=depends_on)
    if expires_at is not None:
        doc["expires_at"] = expires_at
    # new_native_request refuses what the schema would (e.g. --priority urgent): no validator
    return eng.submit(doc, forced="native", prechecked=True, if_absent=if_absent, due_at=due_at)


def request_from_options(eng: "Engine | Submitter", *, to: str, source: str, payload: Any,
                         handoff_id: str | None, timeout_seconds: float | None,
                         priority: str | None, depends_on: list[str] | None) -> dict[str, Any]:
    """The request :func:`submit_request` submits; UsageError for an option's value that no
    request may hold (a --priority or --timeout-seconds the schema refuses, agent ids that
    are not UTF-8 text, more dependencies or a longer time limit than any handoff may have)."""
    from ..core.documents import MAX_DEPENDENCIES, MAX_TIMEOUT_SECONDS
    from ..core.errors import InvalidDocument, UsageError
    from ..core.native_format import new_native_request
    text_arg(to, "--to")
    text_arg(source, "--from")
    # (NaN fails the comparison; infinity and 1e400 would pass new_native_request's check)
    if timeout_seconds is not None and not 0 < timeout_seconds <= MAX_TIMEOUT_SECONDS:
        raise UsageError(f"--timeout-seconds must be above 0 and at most {MAX_TIMEOUT_SECONDS:g} "
                         f"(one week), not {timeout_seconds:g}")
    if depends_on and len(depends_on) > MAX_DEPENDENCIES:
        raise UsageError(f"--depends-on given {len(depends_on)} times; at most {MAX_DEPENDENCIES}")
    # ASCII digits only: str.isdigit() is true for "²" too, which int() refuses (an "internal
    # error"); any other text goes on as a name, which new_native_request refuses by name
    prio: Any = (int(priority) if priority is not None and priority.isascii()
                 and priority.isdigit() else priority)
    try:
        return new_native_request(source=source, target=to, data=payload, now=eng.clock(),
                                  handoff_id=handoff_id, timeout_seconds=timeout_seconds,
                                  priority=prio, depends_on=depends_on)
    except InvalidDocument as exc:  # each field it checks is an option's value (or a bad --id)
        raise UsageError(str(exc)) from None


def parse(argv: Sequence[str], commands: Mapping[str, Form] = COMMANDS,
          ) -> tuple[str, list[str], dict[str, Any]] | None:
    """``(command, positional arguments, {parameter: text or True})``, or None unless ``argv``
    is the plain form of a command in ``commands`` (``handoff``'s: :data:`COMMANDS`; those of
    ``handoffd``: :data:`handoffd.cli.handoffd_cmd.FORMS`)."""
    if not argv or argv[0] not in commands:
        return None
    form = commands[argv[0]]
    found: dict[str, Any] = {}
    args: list[str] = []
    rest = list(argv[1:])
    while rest:
        name = rest.pop(0)
        value: str | bool
        if not name.startswith("-"):
            args.append(name)
            continue
        if name.startswith("--") and "=" in name:
            name, value = name.split("=", 1)
        elif name in form.flags:
            value = True
        elif rest and not rest[0].startswith("-"):
            value = rest.pop(0)
        else:
            return None  # an unknown flag, a missing value or a value that looks like an option
        key = form.flags.get(name) if value is True else form.values.get(name)
        if key is None or key in found or value == "":
            return None  # (an empty value, e.g. --root "": the full command line's reading)
        found[key] = value
    if not form.positional <= len(args) <= form.positional + form.optional \
            or any(not found.get(key) for key in form.required):
        return None
    return argv[0], args, found


def number(text: Any, kind: Callable[[str], Any]) -> Any:
    """``text`` converted by ``kind`` (int, float) when given; ValueError when it does not
    convert or is negative (the full command line words that error)."""
    if text is None:
        return None
    value = kind(text)
    if value < 0 or value != value:  # negative or NaN
        raise ValueError(text)
    return value


def try_quick(argv: Sequence[str]) -> int | None:
    """Run ``argv`` quickly when it is a plain form (see :data:`COMMANDS`); its exit code, or
    None when the full command line must handle it."""
    if argv and " " in argv[0]:  # one word naming a form of two ("context get"): not a command
        return None
    if len(argv) > 1 and argv[0] == "context":  # `context get KEY`: the form "context get"
        argv = [f"context {argv[1]}", *argv[2:]]
    parsed = parse(argv)
    if parsed is None:
        return None
    command, args, opts = parsed
    try:
        if command == "create":
            opts["timeout_seconds"] = number(opts.get("timeout_seconds"), float)
        elif command == "ls":
            opts["limit"] = number(opts.get("limit"), int)
        elif command == "wait":
            opts["timeout"] = number(opts.get("timeout"), float)
        elif command == "context set":
            opts["if_revision"] = number(opts.get("if_revision"), int)
    except ValueError:
        return None
    try:
        return run(command, args, opts)
    except (Exception, KeyboardInterrupt) as exc:  # one line, as in the full command line
        return failure_code(PROG, exc)


def flush() -> None:
    """Flush stdout, if there is one (started with it closed, ``sys.stdout`` is None: what was
    done stays done, and the exit code says so, as on the full command line)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def run(command: str, args: list[str], opts: dict[str, Any]) -> int:
    """Run a parsed plain form; its exit code."""
    if command.startswith("context "):
        return run_context(command, args, opts)
    as_json = bool(opts.pop("as_json", False))
    check_id_arguments({"handoff_id": args[0] if args else opts.get("handoff_id")})
    if command == "create":
        return quick_create(opts)
    from . import reads  # (what create never needs: the readers and the table renderer)
    if command == "show":
        reads.show(opts.get("root"), args[0], as_json=as_json)
    elif command == "ls":
        if opts.get("limit") is None:
            opts["limit"] = reads.DEFAULT_LIMIT
        # the features' gates say why a pending handoff waits: installed (and imported) only
        # when a pending row is listed, and only the gates (build.GATES)
        eng = engine(opts.pop("root", None), features=())
        from ..features.build import install_gates
        rows, note = reads.list_rows(eng, before_pending=lambda: install_gates(eng), **opts)
        reads.print_rows(rows, as_json=as_json, note=note, ws=eng.ws)
    else:
        code = reads.wait(opts.get("root"), args[0], opts.get("timeout"), as_json=as_json)
        flush()
        return code
    flush()
    return 0


def quick_create(opts: dict[str, Any]) -> int:
    """``handoff create --to ...`` in its plain form."""
    # no Engine: this form names no dependencies, the only feature a create needs (see Submitter)
    from ..features.build import open_submitter
    eng = open_submitter(open_workspace(opts.get("root"), create=True))
    bridged(eng)  # a shared store: the files dropped into pending/ first (their ids are taken)
    payload = (json_arg(opts["data"], "--data", depth_below=INPUT_DATA_DEPTH)
               if "data" in opts else None)
    new_id = submit_request(eng, to=opts["to"], source=opts.get("source", "@cli"),
                            payload=payload, handoff_id=opts.get("handoff_id"),
                            timeout_seconds=opts.get("timeout_seconds"),
                            priority=opts.get("priority"))
    print(new_id)
    flush()
    return 0




def run_context(command: str, args: list[str], opts: dict[str, Any]) -> int:
    """``handoff context get KEY`` or ``context set KEY [VALUE]`` in its plain form."""
    from . import context_ops
    if command == "context get":
        context_ops.get(opts.get("root"), args[0], with_revision=bool(opts.get("with_revision")))
    else:
        context_ops.put(opts.pop("root", None), args[0], args[1] if len(args) > 1 else None, **opts)
    flush()
    return 0
