"""Dialects: the document formats handoffd speaks, detected per document.

A dialect knows how to find a document's id, turn it into an :class:`~handoffd.documents.Envelope`
(routing, timeout, priority...), mark it claimed or pending again, and render the final answer in
its own format from an :class:`~handoffd.documents.Outcome`. The daemon runs one lifecycle for all.
"""
from __future__ import annotations

from .base import Dialect, FiledState
from .native import NativeDialect

DIALECTS: list[Dialect] = [NativeDialect()]


def register(dialect: Dialect) -> None:
    """Add a dialect; it is tried before the native one, which is the fallback."""
    DIALECTS.insert(len(DIALECTS) - 1, dialect)


def by_name(name: str) -> Dialect:
    """The dialect called ``name``; KeyError lists the known names."""
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise KeyError(f"unknown dialect {name!r}; known: {', '.join(d.name for d in DIALECTS)}")


def detect(doc: dict, forced: str | None = None) -> Dialect:
    """The dialect a document is written in (``forced`` overrides detection).

    A document the daemon has handled records its dialect in ``handoffd.dialect``.
    """
    if forced:
        return by_name(forced)
    block = doc.get("handoffd")
    if isinstance(block, dict) and isinstance(block.get("dialect"), str):
        try:
            return by_name(block["dialect"])
        except KeyError:
            pass
    for dialect in DIALECTS:
        if dialect.matches(doc):
            return dialect
    return DIALECTS[-1]


__all__ = ["DIALECTS", "Dialect", "FiledState", "by_name", "detect", "register"]
