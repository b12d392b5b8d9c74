"""Path patterns of contracts (``files_owned``, ``files_readonly``, ``scope_ignore``).

Paths and patterns are relative, ``/``-separated. A pattern is a glob: ``*`` and ``?`` match within
one path segment, ``[abc]`` is a character class, and a ``**`` segment matches any number of
segments (zero included). A pattern also covers everything *below* what it matches, so owning
``src/auth`` (or ``src/auth/``) owns the whole directory, and ``.`` (or ``**``) owns everything.

Globs come from request documents, so matching them must never backtrack: each glob is translated
into an RE2 expression (every literal character escaped, character classes rebuilt from their
parsed members) and RE2 matches in time linear in the path, whatever the glob. A glob is at most
:data:`MAX_PATTERN_CHARS` characters, and a contract list holds at most :data:`MAX_PATTERNS`.

Two patterns *overlap* when some path could be covered by both. The test is conservative: it says
"overlap" whenever it cannot prove the opposite (a ``**`` segment, or two wildcard segments whose
literal prefixes and suffixes agree), so exclusive ownership may serialise more than strictly
needed but never less.
"""
from __future__ import annotations

import functools
import re
from typing import Any

MAGIC = re.compile(r"[*?\[]")
SCOPE_MODES = ("auto", "hash", "git")  # contract.scope_check: how the tree is compared
MAX_PATTERN_CHARS = 512  # one glob; real ones are a path or two long
MAX_PATTERNS = 256  # globs in one contract list (the overlap check compares lists pairwise)
SLASH = ord("/")
NOTHING = r"[^\x{0}-\x{10ffff}]"  # an empty character class: matches no character
# RE2 takes UTF-8, which has no lone surrogates; Python has them in file names it could not
# decode (os.fsdecode) and in JSON "\udc80" escapes. They are moved to the last 2048 code points
# of plane 16 (private use), the same way in patterns and paths, so they still match each other.
SURROGATE_SHIFT = 0x10F800 - 0xD800


@functools.cache
def _surrogates() -> re.Pattern[str]:
    """The lone surrogates, one character class (Python's re cannot backtrack here): compiled
    at the first non-ASCII path, not by every process that loads the contracts feature (about
    0.6 ms of a daemon's or `handoff ls`'s start)."""
    return re.compile("[\ud800-\udfff]")


class PatternError(ValueError):
    """A pattern that cannot be used: absolute, climbing out with ``..``, too long, or malformed."""


# the union of a full list (MAX_PATTERNS globs of MAX_PATTERN_CHARS) needs more than RE2's 8 MiB;
# a cap, not an allocation: RE2 grows its automaton only as far as the paths take it
UNION_MAX_MEM = 64 << 20


@functools.cache
def _re2_options(max_mem: int | None = None) -> Any:
    """RE2's options (made on first use: RE2 is loaded only when a pattern is compiled, not by
    every command that loads the contracts feature, such as `handoff ls`)."""
    import re2
    options = re2.Options()
    options.log_errors = False  # RE2 would otherwise print every refused pattern on our stderr
    if max_mem is not None:
        options.max_mem = max_mem
    return options


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


def validate(pattern: str) -> str:
    """``pattern`` normalised, after checking it is short enough and compiles. Raises PatternError."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"{pattern[:40]!r}... is {len(pattern)} characters long; a glob may have "
                           f"at most {MAX_PATTERN_CHARS}")
    normal = normalise(pattern)
    compile_pattern(normal)
    return normal


def join(prefix: str, pattern: str) -> str:
    """``pattern`` (relative to directory ``prefix``) made relative to the prefix's parent root."""
    parts = split(prefix) + split(pattern)
    return "/".join(parts) or "."


def has_magic(segment: str) -> bool:
    """True when the segment holds a wildcard or a character class."""
    return bool(MAGIC.search(segment))


def _text(text: str) -> str:
    """``text`` as RE2 can take it (lone surrogates moved to private use, see _surrogates)."""
    if text.isascii():
        return text
    return _surrogates().sub(lambda found: chr(ord(found.group()) + SURROGATE_SHIFT), text)


def _char(code: int) -> str:
    """One character in RE2 syntax: ASCII letters and digits as they are, anything else escaped."""
    char = chr(code)
    return char if char.isascii() and char.isalnum() else f"\\x{{{code:x}}}"


def _class_end(segment: str, start: int) -> int | None:
    """Index of the ``]`` closing the class opened at ``start`` (None: a literal ``[``)."""
    j, n = start + 1, len(segment)
    if j < n and segment[j] in "!^":
        j += 1
    if j < n and segment[j] == "]":  # a ']' right after the opening is a member
        j += 1
    while j < n and segment[j] != "]":
        j += 1
    return j if j < n else None


def _class_regex(body: str) -> str:
    """An RE2 class for a glob class body (``!``/``^`` negates, ``a-z`` ranges; never ``/``)."""
    negate = body[:1] in ("!", "^")
    if negate:
        body = body[1:]
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(body):
        low = high = body[i]
        if i + 2 < len(body) and body[i + 1] == "-":
            high = body[i + 2]
            if high < low:
                raise PatternError(f"character range {low}-{high} is reversed")
            i += 2
        ranges.append((ord(low), ord(high)))
        i += 1
    if negate:
        ranges.append((SLASH, SLASH))
    else:  # '/' separates segments, so no class may match it: cut it out of a range spanning it
        ranges = [part for low, high in ranges
                  for part in ((low, min(high, SLASH - 1)), (max(low, SLASH + 1), high))
                  if part[0] <= part[1]]
        if not ranges:
            return NOTHING
    members = "".join(_char(low) if low == high else f"{_char(low)}-{_char(high)}"
                      for low, high in ranges)
    return f"[^{members}]" if negate else f"[{members}]"


def _segment_regex(segment: str) -> str:
    """RE2 syntax for one glob segment: ``*`` → ``[^/]*``, ``?`` → ``[^/]``, classes, literals."""
    out: list[str] = []
    i, n = 0, len(segment)
    while i < n:
        char = segment[i]
        end = _class_end(segment, i) if char == "[" else None
        if char == "*":
            while i + 1 < n and segment[i + 1] == "*":
                i += 1
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif end is not None:
            out.append(_class_regex(segment[i + 1:end]))
            i = end
        else:
            out.append(_char(ord(char)))
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def _regex(pattern: str) -> str:
    """RE2 syntax matching every path the pattern covers (the match itself and everything below)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"{pattern[:40]!r}... is longer than {MAX_PATTERN_CHARS} characters")
    segments = split(_text(pattern))
    if not segments:
        return "(?s:.*)"
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
        try:
            body += _segment_regex(segment)
        except PatternError as exc:
            raise PatternError(f"{pattern[:80]!r}: {exc}") from None
        need_sep = True
    return f"(?s:{body}(?:/.*)?)"


def _compile(regex: str, pattern: str, options: Any = None) -> Any:
    import re2
    try:
        return re2.compile(regex, options or _re2_options())
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "invalid"
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        raise PatternError(f"{pattern[:80]!r} cannot be compiled: {text}") from None


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> Any:
    """An RE2 regex matching every path the pattern covers (use ``fullmatch`` on a path made
    ready by :func:`_text`; :func:`matches` does both). Raises PatternError."""
    return _compile(_regex(pattern), pattern)


def matches(pattern: str, path: str) -> bool:
    """True when ``pattern`` covers ``path`` (both relative to the same directory)."""
    return compile_pattern(pattern).fullmatch(_text(path.strip("/"))) is not None


def first_match(patterns: list[str] | tuple[str, ...], path: str) -> str | None:
    """The first pattern covering ``path``, or None (one RE2 pass when none does)."""
    if not any_match(tuple(patterns), path):
        return None
    return next((pattern for pattern in patterns if matches(pattern, path)), None)


@functools.lru_cache(maxsize=8)  # few lists are in use at once, and a big one weighs megabytes
def _union(patterns: tuple[str, ...]) -> Any:
    """One RE2 regex for all ``patterns`` (None when UNION_MAX_MEM is too little for it)."""
    try:
        return _compile("|".join(f"(?:{_regex(p)})" for p in patterns) or NOTHING, "union",
                        _re2_options(UNION_MAX_MEM))
    except PatternError:
        return None


def any_match(patterns: tuple[str, ...], path: str) -> bool:
    """True when one of ``patterns`` covers ``path``: a single RE2 pass over the path however
    many patterns there are (what a snapshot asks of every file)."""
    union = _union(patterns)
    if union is None:
        return any(matches(pattern, path) for pattern in patterns)
    return union.fullmatch(_text(path.strip("/"))) is not None


def _literal_ends(segment: str) -> tuple[str, str]:
    found = MAGIC.search(segment)
    prefix = segment[:found.start()] if found else segment
    last = max(segment.rfind("*"), segment.rfind("?"), segment.rfind("]"))
    suffix = segment[last + 1:] if last >= 0 else segment
    return prefix, suffix


@functools.lru_cache(maxsize=4096)
def _segment_compiled(segment: str) -> Any:
    return _compile(f"(?s:{_segment_regex(segment)})", segment)


def _segments_compatible(a: str, b: str) -> bool:
    magic_a, magic_b = has_magic(a), has_magic(b)
    if not magic_a and not magic_b:
        return a == b
    if not magic_a:
        return _segment_compiled(b).fullmatch(a) is not None
    if not magic_b:
        return _segment_compiled(a).fullmatch(b) is not None
    prefix_a, suffix_a = _literal_ends(a)
    prefix_b, suffix_b = _literal_ends(b)
    if not (prefix_a.startswith(prefix_b) or prefix_b.startswith(prefix_a)):
        return False
    if not (suffix_a.endswith(suffix_b) or suffix_b.endswith(suffix_a)):
        return False
    return True  # both wildcards and nothing rules it out: assume they can meet


def overlap(a: str, b: str) -> bool:
    """True when some path could be covered by both patterns (conservative: True when unsure)."""
    left, right = split(_text(a)), split(_text(b))
    for x, y in zip(left, right):
        if x == "**" or y == "**":
            return True
        if not _segments_compatible(x, y):
            return False
    return True  # one covers an ancestor of the other (or they are equal)
