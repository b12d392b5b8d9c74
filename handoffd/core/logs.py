"""Loggers for modules that one-shot commands load, imported at the first message.

``logging`` brings ``traceback``, ``string`` and ``textwrap`` with it: about 3 ms of a command
that starts in 70, and ``handoff create``, ``show``, ``ls`` and ``wait`` log nothing unless
something goes wrong. :data:`log` (the ``handoffd`` logger) and :func:`deferred` stand for a
logger until first used; the daemon, which logs from its start, imports ``logging`` itself.

A message that cannot be logged for want of descriptors or memory (``import logging`` itself
failing at the first message, or a handler failing as it formats or writes) is written as one
plain line to stderr instead (:func:`write_plainly`): it came, as often as not, to say that a
descriptor was missing, and was lost in a "--- Logging error ---" traceback (or, from a command,
the import's OSError ended a create that had placed its document)."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, cast

from .shown import clean

if TYPE_CHECKING:
    from logging import Logger, LogRecord

# the logger methods a plain line stands in for, and each one's level; a message under
# SHOWN_FROM is dropped, as logging's last resort (no handler configured) drops it
LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40,
          "critical": 50, "fatal": 50}
SHOWN_FROM = 30
NAMES = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}
# what keeps a message from being logged for now rather than a bug: no descriptor or memory to
# import a module, format the message or write it with
SHORTAGES = (OSError, ImportError, MemoryError)


def write_plainly(name: str, level: int, msg: object, args: Any = ()) -> None:
    """``name: LEVEL: message`` (the daemon's text format, the message on one line: its control
    characters shown) written to stderr with nothing to import; never raises (a stderr that
    cannot be written loses it)."""
    try:
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):  # arguments that do not fit: both shown
            text = f"{msg} {args!r}"
        sys.stderr.write(f"{name}: {NAMES.get(level, level)}: {clean(text)}\n")
        sys.stderr.flush()
    except Exception:  # (stderr closed, or memory short again: nowhere left to say it)
        pass


def unlogged(record: LogRecord) -> bool:
    """For a handler's ``handleError``: write ``record`` plainly (:func:`write_plainly`) when
    what failed was a shortage (:data:`SHORTAGES`), True then; False for any other error (a
    bug: logging's own report, with its traceback, says more)."""
    if not isinstance(sys.exc_info()[1], SHORTAGES):
        return False
    write_plainly(record.name, record.levelno, record.msg, record.args)
    return True


def _plain_method(name: str, level: int) -> Callable[..., None]:
    """A logger method that writes its message plainly (``import logging`` failed)."""
    def method(msg: object, *args: Any, **kwargs: Any) -> None:
        if level >= SHOWN_FROM:
            write_plainly(name, level, msg, args)
    return method


class _Deferred:
    """Stands for ``logging.getLogger(name)``, imported when first used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        try:
            import logging
        except SHORTAGES:  # (an OSError: EMFILE opening its source) not cached: tried again
            if attribute == "log":
                return lambda level, msg, *args, **kwargs: _plain_method(
                    self._name, level)(msg, *args)
            if attribute in LEVELS:
                return _plain_method(self._name, LEVELS[attribute])
            raise
        value = getattr(logging.getLogger(self._name), attribute)
        if callable(value):  # a method (the logger never changes) is found directly from now on;
            self.__dict__[attribute] = value  # a plain attribute (level, handlers) is read anew
        return value


def deferred(name: str) -> Logger:
    """The logger ``name``, imported at its first use."""
    return cast("Logger", _Deferred(name))


log = deferred("handoffd")


# the command whose own lines the handoffd logger's are to look like (speak_as): None in a
# daemon, whose log is configured by its command line, and in a library user's program
_PROGRAM: list[str] = []


def speak_as(program: str) -> None:
    """A one-shot command (``handoff``) says its name: the lines the ``handoffd`` logger writes
    while it runs (a PostgreSQL store lost and regained) then read ``program: message``, as
    the command's own lines do, once :func:`prefix_lines` installs that handler."""
    _PROGRAM[:] = [program]


def prefix_lines() -> None:
    """After :func:`speak_as`: give the ``handoffd`` logger a stderr handler writing warnings
    and worse as ``program: message`` on one line (without it, logging's last resort wrote the
    bare message). Imports ``logging``: called where a store that logs is opened. Once only;
    nothing without :func:`speak_as`."""
    if not _PROGRAM:
        return
    import logging
    logger = logging.getLogger("handoffd")
    if any(getattr(handler, "handoffd_program", False) for handler in logger.handlers):
        return
    program = _PROGRAM[0]

    class Prefixed(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{program}: {clean(record.getMessage())}"

    handler = logging.StreamHandler(sys.stderr)
    handler.handoffd_program = True  # type: ignore[attr-defined]
    handler.setLevel(logging.WARNING)
    handler.setFormatter(Prefixed())
    logger.addHandler(handler)
