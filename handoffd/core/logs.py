"""The ``handoffd`` logger, for modules that one-shot commands load.

``logging`` brings ``traceback``, ``string`` and ``textwrap`` with it: about 3 ms of a command
that starts in 70, and ``handoff create``, ``show``, ``ls`` and ``wait`` log nothing unless
something goes wrong. :data:`log` imports it at the first message; the daemon, which logs from
its start, imports ``logging`` itself."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from logging import Logger


class _Deferred:
    """Stands for ``logging.getLogger("handoffd")``, imported when first used."""

    def __getattr__(self, name: str) -> Any:
        import logging
        value = getattr(logging.getLogger("handoffd"), name)
        self.__dict__[name] = value  # found directly from now on (the logger never changes)
        return value


log = cast("Logger", _Deferred())
