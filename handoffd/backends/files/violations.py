"""The contract violations log on disk: ``handoffs/.meta/violations.jsonl``, one JSON object per
line, each appended with a single ``O_APPEND`` write (several daemons may append at once)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from ...core import jsontext, ownfiles
from . import logfiles

LOG_NAME = "violations.jsonl"
# no entry of ours is near this long (the contracts feature cuts an entry's details to keep it
# under 64 KiB): a longer line is skipped as it is read, never held whole
MAX_LINE = 256 * 1024


class FileViolationLog:
    """:class:`~handoffd.core.storage.ViolationLog` in the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, entry: dict[str, Any]) -> None:
        """One line, one ``write`` (a line is never interleaved with another appender's),
        checked (:func:`.logfiles.append_line`): a write cut short by a full disk is an OSError
        (ENOSPC), and the next line starts on a line of its own (it was glued to the torn one
        and lost with it)."""
        line = json.dumps(entry, ensure_ascii=False, sort_keys=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # (read too: whether the file ends a line)
        fd = ownfiles.open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            logfiles.append_line(fd, (line + "\n").encode("utf-8"), os.fstat(fd).st_size,
                                 self.path)
        finally:
            os.close(fd)

    def read(self) -> Iterator[dict[str, Any]]:
        """Every line that is a JSON object of ours (a torn, foreign, overlong or deeply nested
        line is skipped), oldest first, streamed: the file is read a block at a time
        (:class:`.logfiles.LineReader`) and each entry handed on as it is parsed, so a block and a
        line are the most held at once (every entry was kept in one list, however long the log)."""
        try:
            fh = ownfiles.open_reading(self.path)  # never a FIFO's wait or /dev/zero's
        except FileNotFoundError:
            return
        with fh:
            for line in logfiles.LineReader(fh, MAX_LINE, partial=True):
                entry = jsontext.parse_line(line.decode("utf-8", "replace"))
                if isinstance(entry, dict):
                    yield entry
