"""Path patterns of contracts (``files_owned``, ``files_readonly``, ``scope_ignore``).

Paths and patterns are relative, ``/``-separated. A pattern is a glob: ``*`` and ``?`` match within
one path segment, ``[abc]`` is a character class, and a ``**`` segment matches any number of
segments (zero included). A pattern also covers everything *below* what it matches, so owning
``src/auth`` (or ``src/auth/``) owns the whole directory, and ``.`` (or ``**``) owns everything.

Two patterns *overlap* when some path could be covered by both. The test is conservative: it says
"overlap" whenever it cannot prove the opposite (a ``**`` segment, or two wildcard segments whose
literal prefixes and suffixes agree), so exclusive ownership may serialise more than strictly
needed but never less.
"""
from __future__ import annotations

import functools
import re

MAGIC = re.compile(r"[*?\[]")
SCOPE_MODES = ("auto", "hash", "git")  # contract.scope_check: how the tree is compared


class PatternError(ValueError):
    """A pattern that cannot be used: absolute, or climbing out with ``..``."""


def split(pattern: str) -> list[str]:
    """Normalise ``pattern`` into segments (``[]`` = the whole directory). Raises PatternError."""
    text = pattern.strip()
    if text.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", text):
        raise PatternError(f"{pattern!r} is absolute; patterns are relative to the contract directory")
    segments: list[str] = []
    for segment in text.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            raise PatternError(f"{pattern!r} climbs out of the contract directory with '..'")
        segments.append(segment)
    if segments == ["**"]:
        return []
    return segments


def normalise(pattern: str) -> str:
    """The canonical spelling of ``pattern`` (``.`` for the whole directory)."""
    return "/".join(split(pattern)) or "."


def join(prefix: str, pattern: str) -> str:
    """``pattern`` (relative to directory ``prefix``) made relative to the prefix's parent root."""
    parts = split(prefix) + split(pattern)
    return "/".join(parts) or "."


def has_magic(segment: str) -> bool:
    """True when the segment holds a wildcard or a character class."""
    return bool(MAGIC.search(segment))


def _segment_regex(segment: str) -> str:
    out: list[str] = []
    i, n = 0, len(segment)
    while i < n:
        char = segment[i]
        if char == "*":
            while i + 1 < n and segment[i + 1] == "*":
                i += 1
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            j = i + 1
            if j < n and segment[j] in "!^":
                j += 1
            if j < n and segment[j] == "]":
                j += 1
            while j < n and segment[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal '['
                out.append(re.escape(char))
            else:
                body = segment[i + 1:j]
                negate = body[:1] in ("!", "^")
                if negate:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("[", "\\[")
                out.append(f"[^/{body}]" if negate else f"(?:(?!/)[{body}])")
                i = j
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A regex matching every path the pattern covers (the match itself and everything below)."""
    segments = split(pattern)
    body, need_sep = "", False
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            if last:
                body += "(?:/.*)?" if need_sep else ".*"
            else:
                body += "/(?:.*/)?" if need_sep else "(?:.*/)?"
                need_sep = False
            continue
        if need_sep:
            body += "/"
        body += _segment_regex(segment)
        need_sep = True
    if not segments:
        return re.compile(r"(?s:.*)")
    return re.compile(f"(?s:{body})(?:/.*)?")


def matches(pattern: str, path: str) -> bool:
    """True when ``pattern`` covers ``path`` (both relative to the same directory)."""
    return compile_pattern(pattern).fullmatch(path.strip("/")) is not None


def first_match(patterns: list[str] | tuple[str, ...], path: str) -> str | None:
    """The first pattern covering ``path``, or None."""
    for pattern in patterns:
        if matches(pattern, path):
            return pattern
    return None


def _literal_ends(segment: str) -> tuple[str, str]:
    found = MAGIC.search(segment)
    prefix = segment[:found.start()] if found else segment
    last = max(segment.rfind("*"), segment.rfind("?"), segment.rfind("]"))
    suffix = segment[last + 1:] if last >= 0 else segment
    return prefix, suffix


def _segments_compatible(a: str, b: str) -> bool:
    magic_a, magic_b = has_magic(a), has_magic(b)
    if not magic_a and not magic_b:
        return a == b
    if not magic_a:
        return re.fullmatch(_segment_regex(b), a) is not None
    if not magic_b:
        return re.fullmatch(_segment_regex(a), b) is not None
    prefix_a, suffix_a = _literal_ends(a)
    prefix_b, suffix_b = _literal_ends(b)
    if not (prefix_a.startswith(prefix_b) or prefix_b.startswith(prefix_a)):
        return False
    if not (suffix_a.endswith(suffix_b) or suffix_b.endswith(suffix_a)):
        return False
    return True  # both wildcards and nothing rules it out: assume they can meet


def overlap(a: str, b: str) -> bool:
    """True when some path could be covered by both patterns (conservative: True when unsure)."""
    left, right = split(a), split(b)
    for x, y in zip(left, right):
        if x == "**" or y == "**":
            return True
        if not _segments_compatible(x, y):
            return False
    return True  # one covers an ancestor of the other (or they are equal)
