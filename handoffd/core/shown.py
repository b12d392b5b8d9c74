"""Untrusted text shown on one line: what a document, an agent name or an error message carries
is printed (the CLI) or exported (metrics labels) with its control characters escaped, so that
no escape sequence, newline or bidi override reaches a terminal or splits a row."""
from __future__ import annotations

__all__ = ["clean"]


def clean(text: str) -> str:
    """``text`` on one line: control characters (newlines, escapes) shown as ``\\n``, ``\\x1b``."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in text)


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}  # (as JSON writes them; json not imported)


def _escaped(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    return f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"
