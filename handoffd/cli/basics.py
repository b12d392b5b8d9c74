"""What every ``handoff`` command needs, without typer: the workspace, an Engine, JSON
arguments, and errors as one line with their exit code. The quick path
(:mod:`handoffd.cli.quick`), the shared read commands (:mod:`handoffd.cli.reads`) and the full
command line (:mod:`handoffd.cli.common`) all build on it."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..core.errors import HandoffdError, InvalidDocument, NotFound, UsageError
# loaded with the command, not when its error is printed: with no descriptor or memory left,
# that import failed and the error became a traceback (core.shown only imports json)
from ..core.shown import clean
from ..core.workspace import Workspace, resolve_root

if TYPE_CHECKING:
    from ..core.config import Config
    from ..core.engine import Engine
    from ..core.storage import Backend
    from ..core.submission import Submitter

PROG = "handoff"
FEW_DESCRIPTORS = 64  # a descriptor limit below this loads logging at the start (see below)


def prepare_streams(program: str, *, stdout_needed: bool = True) -> int | None:
    """Set stdout and stderr up for a command, first thing: a character their encoding cannot
    carry (a document's ``ë`` on ``PYTHONIOENCODING=ascii`` or ``LC_ALL=C``) is written as a
    ``\\xeb`` escape instead of failing the command halfway through its output. None when the
    command can run; else the exit code it ends with (2, after one stderr line): a closed
    stdout (``handoff ls >&-``, ``sys.stdout`` is None) when ``stdout_needed``, where a command
    printed nothing, or created a handoff whose id reached no one, and exited 0."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:  # (a stream replaced by one that is no TextIOWrapper)
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # (closed meanwhile, or its flush failed)
                pass
    if sys.stdout is None and stdout_needed:
        # (a closed stderr too: print then writes nowhere, and the exit code says it alone)
        print(f"{program}: error: stdout is closed (descriptor 1); the command's output "
              "would reach no one: run it with stdout open (e.g. >/dev/null)", file=sys.stderr)
        return 2
    return None


def load_if_few_descriptors() -> None:
    """With few descriptors allowed (``ulimit -n`` under :data:`FEW_DESCRIPTORS`), import
    ``logging`` now: a command's warnings import it at their first line (:mod:`..core.logs`),
    and they come when a descriptor is what was missing (the seen-ids record or the event log
    could not be opened after the document was written), so the import failed too and the
    create that had placed its document exited 1. Otherwise nothing (3 ms of every start)."""
    try:
        allowed = os.sysconf("SC_OPEN_MAX")  # (the soft limit; -1: none)
    except (ValueError, OSError):
        return
    if 0 < allowed < FEW_DESCRIPTORS:
        import logging  # noqa: F401


def open_workspace(root: str | Path | None, *, create: bool = False) -> Workspace:
    """The workspace chosen by --root / $HANDOFFD_ROOT / cwd; it must exist unless ``create``."""
    try:
        ws = Workspace(resolve_root(root))
    except FileNotFoundError:  # the current directory was deleted under the shell (getcwd)
        where = os.environ.get("PWD") or "(unknown)"
        raise NotFound(f"the current directory {where} no longer exists; cd to the workspace or "
                       f"{root_remedy(root) if root else 'pass --root'}") from None
    except UsageError as exc:  # a symlink loop (resolve_root)
        raise UsageError(f"{exc}; {root_remedy(root)}") from None
    check_root(ws.root, root)
    if create:
        ws.ensure()  # (which refuses state folders as below)
        return ws
    # a state folder that is a symlink, no folder, or another's: ConfigError, one line, exit 2
    # (results were filed through it; a dangling one would read as "not a workspace")
    ws.check_state_folders()
    if not ws.exists():  # (exit 3, not found: exit 1 says to `wait` that the handoff failed)
        raise NotFound(f"{ws.root} is not a handoffd workspace (no handoffs/ folders); pass "
                       "--root, or run `handoffd serve` there once to create it")
    return ws


def check_root(path: Path, root: str | Path | None) -> None:
    """Refuse a workspace directory ``path`` that is missing (NotFound, exit 3: a mistyped
    --root must not silently start a new workspace), not a directory (UsageError, exit 2) or
    cannot be looked at (exit 1: not "does not exist", which sends one to create it)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(f"workspace directory {path} does not exist; create it or "
                       f"{root_remedy(root)}") from None
    except OSError as exc:  # EACCES on a folder above it, EIO...
        raise HandoffdError(f"cannot look at workspace directory {path}: "
                            f"{exc.strerror or exc}") from None
    if not stat.S_ISDIR(mode):
        raise UsageError(f"workspace directory {path} is not a directory; {root_remedy(root)}")


def root_remedy(root: str | Path | None) -> str:
    """What to fix when the workspace's directory is missing, by where :func:`resolve_root` took
    it from: the option, ``$HANDOFFD_ROOT`` (a message saying "--root" to someone who never gave
    one sends them looking in the wrong place), or the current directory."""
    if root:
        return "fix --root"
    return "fix $HANDOFFD_ROOT" if os.environ.get("HANDOFFD_ROOT") else "pass --root"


def engine(root: str | Path | None, *, create: bool = False,
           features: Iterable[str] | None = None, store: str | None = None,
           bridge: bool = True) -> Engine:
    """An Engine over the chosen workspace with ``features`` installed (by name; None: every
    feature). A command that only reads, or only creates, names what it needs: importing and
    installing every feature is a daemon's start-up cost, not a one-shot command's. On a
    shared store the files dropped into the workspace's pending/ are ingested first
    (:func:`bridged`), unless ``bridge`` is False (a daemon: its own bridge ingests them, and
    counts what it sets aside)."""
    from ..features.build import DEFAULT_FEATURES, build_engine
    eng = build_engine(open_workspace(root, create=create), store=store,
                       features=DEFAULT_FEATURES if features is None else features)
    if bridge:
        bridged(eng)
    return eng


def bridged(opened: Engine | Submitter) -> None:
    """On a shared store (PostgreSQL), ingest the documents dropped into the workspace's
    pending/ before the command reads or writes anything, and guard its creates against the
    id of a dropped file (see :func:`handoffd.features.filebridge.ingest_dropped`): a dropped
    file is a handoff for every command, as on a files store. ``opened``: an Engine or a
    Submitter. A files store costs nothing here (its folders are the store)."""
    if getattr(opened.backend, "shared", False):
        from ..features.filebridge import ingest_dropped
        try:
            ingest_dropped(opened)
        except Exception as exc:  # e.g. a pending/ this user may not remove files from
            warn(f"cannot ingest the files dropped into pending/: {exc} (a daemon of this "
                 "workspace ingests them at its scans)")


def warn(message: str) -> None:
    """One ``handoff: warning:`` line on stderr (its control characters shown escaped); the
    command goes on."""
    print(f"{PROG}: warning: {clean(message)}", file=sys.stderr)


def backend(root: str | Path | None) -> Backend:
    """The store of the chosen workspace alone, without an Engine: for commands that only read
    documents (``handoff wait``). On a shared store, the files dropped into pending/ are
    ingested first, as :func:`engine` does (an Engine is built only then)."""
    return opened_store(root)[2]


def opened_store(root: str | Path | None) -> tuple[Workspace, Config, Backend]:
    """:func:`backend`, with the workspace and the configuration it was opened with (``handoff
    show`` builds an Engine on them only for a pending handoff's note)."""
    from ..features.build import open_backend
    ws = open_workspace(root)
    config = ws.load_config()
    store = open_backend(ws, config)
    if getattr(store, "shared", False):
        from ..features.filebridge import has_drops
        if has_drops(ws):
            from ..features.build import build_engine
            bridged(build_engine(ws, config, backend=store, features=()))
    return ws, config, store


def json_arg(text: str, what: str, *, depth_below: int | None = None) -> Any:
    """``text`` parsed as JSON that a document can hold, by the daemon's own reader
    (:func:`~handoffd.core.jsontext.load_json`: no NaN, Infinity or overflowing numbers,
    no lone surrogate, no nesting past the recursion limit); UsageError naming ``what``
    otherwise, or when it is not UTF-8 (argv's undecodable bytes). ``depth_below``: the value
    will sit that many levels inside a document (``input.data``: 2), whose nesting the daemon
    limits to :data:`~handoffd.core.documents.MAX_DEPTH`."""
    from ..core.documents import MAX_DEPTH
    from ..core.jsontext import load_json
    text_arg(text, what)  # an argument's bytes that were not UTF-8
    limit = None if depth_below is None else MAX_DEPTH - depth_below
    try:
        return load_json(text, what, max_depth=limit)
    except InvalidDocument as exc:
        raise UsageError(str(exc)) from None


def text_arg(text: str, what: str) -> str:
    """``text`` when it is UTF-8 text; UsageError naming ``what`` when it holds argv's
    undecodable bytes (an agent id written into a document would fail its write as an
    "internal error", exit 1, where a bad argument is a usage error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} is not UTF-8 text (character {exc.start + 1})") from None
    return text


def read_limited(source: str, max_bytes: int, what: str) -> bytes:
    """The bytes of the file ``source`` names, or of stdin for ``-`` (``what``: the option, for
    messages). At most ``max_bytes`` (the workspace's ``daemon.max_document_bytes``) are
    accepted, and no more than one byte beyond is ever read: an endless source (``/dev/zero``,
    a pipe or FIFO whose writer never stops) is refused at once instead of filling memory.
    UsageError when it is larger or cannot be read."""
    name = "stdin" if source == "-" else source
    chunks: list[bytes] = []
    left = max_bytes + 1
    try:
        fd = 0 if source == "-" else os.open(source, os.O_RDONLY)  # (fd 0: stdin may be closed)
        try:
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            if fd != 0:
                os.close(fd)
    except OSError as exc:
        raise UsageError(f"{what}: cannot read {name}: {exc.strerror or exc}") from None
    if left <= 0:
        raise UsageError(f"{what}: {name} is over the {max_bytes}-byte limit (raise "
                         "daemon.max_document_bytes in handoffd.toml if this is intended)")
    return b"".join(chunks)


def read_json_arg(source: str, max_bytes: int, what: str, *,
                  depth_below: int | None = None) -> Any:
    """The JSON of ``--input FILE|-``: :func:`read_limited`, then :func:`json_arg`."""
    raw = read_limited(source, max_bytes, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what}: {'stdin' if source == '-' else source} is not UTF-8 "
                         f"(byte {exc.start})") from None
    return json_arg(text, what, depth_below=depth_below)


def exit_code(program: str, exc: BaseException) -> int:
    """One stderr line for ``exc`` and the exit code it stands for (never a traceback)."""
    if isinstance(exc, HandoffdError):
        message, code = str(exc), exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        message, code = "interrupted", 130
    elif isinstance(exc, OSError):
        message, code = f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), 1
    elif isinstance(exc, MemoryError):  # (the command's memory is given back by now)
        message, code = "out of memory (raise the memory limit, e.g. `ulimit -v`)", 1
    else:  # a bug: still one line (HANDOFFD_DEBUG=1 re-raises it for a traceback)
        message, code = (f"internal error: {type(exc).__name__}: {exc} "
                         "(set HANDOFFD_DEBUG=1 for a traceback)"), 1
    # one line, whatever a message quotes from a document (clean: imported with this module)
    print(f"{program}: error: {clean(message)}", file=sys.stderr)
    return code


def failure_code(program: str, exc: BaseException) -> int:
    """What a command that raised ``exc`` exits with (one stderr line, never a traceback): 0
    when stdout's reader left (a broken pipe); a bug is re-raised when HANDOFFD_DEBUG is set."""
    if isinstance(exc, BrokenPipeError):  # e.g. `handoff trace X --json | head`
        quiet_stdout()
        return 0
    if os.environ.get("HANDOFFD_DEBUG") and not isinstance(exc, (HandoffdError, OSError,
                                                                  MemoryError, KeyboardInterrupt)):
        raise exc
    return exit_code(program, exc)


def quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


ID_PARAMETERS = ("handoff_id", "handoff_ids", "depends_on")  # parameters that hold handoff ids


def check_id_arguments(kwargs: dict[str, Any]) -> None:
    """A handoff id given on the command line that no handoff can have is a usage error (exit
    2), said before the command opens anything (a document's bad id stays exit 1)."""
    given = [one for name in ID_PARAMETERS if (value := kwargs.get(name)) is not None
             for one in (value if isinstance(value, list) else [value])]
    if not given:
        return
    from ..core.documents import check_id
    from ..core.errors import InvalidDocument, UsageError
    for one in given:
        try:
            check_id(one)
        except InvalidDocument as exc:
            raise UsageError(str(exc)) from None
