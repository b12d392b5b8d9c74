"""The files backend: the file protocol's mechanics (atomic non-overwriting writes, claims by
rename, a flock per claim, seals, the seen-ids record, folder watching) live here only."""
from __future__ import annotations

from .backend import FilesBackend

__all__ = ["FilesBackend"]
