"""The interface every dialect implements (defined in the core, which is written against it)."""
from __future__ import annotations

from ..core.formats import Dialect, FiledState

__all__ = ["Dialect", "FiledState"]
