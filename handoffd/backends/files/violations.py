"""The contract violations log on disk: ``handoffs/.meta/violations.jsonl``, one JSON object per
line, each appended with a single ``O_APPEND`` write (several daemons may append at once)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import fsio

LOG_NAME = "violations.jsonl"


class FileViolationLog:
    """:class:`~handoffd.core.storage.ViolationLog` in the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, entry: dict[str, Any]) -> None:
        """One line, one ``write`` (a line is never interleaved with another appender's)."""
        line = json.dumps(entry, ensure_ascii=False, sort_keys=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = fsio.open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (line + "\n").encode("utf-8"))
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        """Every line that is a JSON object (a torn or foreign line is skipped)."""
        try:
            with fsio.open_reading(self.path) as fh:  # never a FIFO's wait or /dev/zero's
                raw = fh.read()
        except FileNotFoundError:
            return []
        out = []
        for line in raw.decode("utf-8", "replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out
