"""Untrusted text shown on one line: what a document, an agent name or an error message carries
is printed (the CLI) or exported (metrics labels) with its control characters escaped, so that
no escape sequence, newline or bidi override reaches a terminal or splits a row."""
from __future__ import annotations

import json

__all__ = ["clean"]


def clean(text: str) -> str:
    """``text`` on one line: control characters (newlines, escapes) shown as ``\\n``, ``\\x1b``."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in text)


def _escaped(ch: str) -> str:
    if ch in "\n\r\t":
        return json.dumps(ch)[1:-1]
    return f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}"
