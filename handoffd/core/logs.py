"""Loggers for modules that one-shot commands load, imported at the first message.

``logging`` brings ``traceback``, ``string`` and ``textwrap`` with it: about 3 ms of a command
that starts in 70, and ``handoff create``, ``show``, ``ls`` and ``wait`` log nothing unless
something goes wrong. :data:`log` (the ``handoffd`` logger) and :func:`deferred` stand for a
logger until first used; the daemon, which logs from its start, imports ``logging`` itself."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from logging import Logger


class _Deferred:
    """Stands for ``logging.getLogger(name)``, imported when first used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        import logging
        value = getattr(logging.getLogger(self._name), attribute)
        if callable(value):  # a method (the logger never changes) is found directly from now on;
            self.__dict__[attribute] = value  # a plain attribute (level, handlers) is read anew
        return value


def deferred(name: str) -> Logger:
    """The logger ``name``, imported at its first use."""
    return cast("Logger", _Deferred(name))


log = deferred("handoffd")
