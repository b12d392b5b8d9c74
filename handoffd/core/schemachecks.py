"""The checks that compiled schemas call, without jsonschema: patterns on RE2, the ``format``
values handoffd's own schemas use, and JSON equality.

:mod:`handoffd.core.fastschema` answers "valid" for most documents with these alone, so a
process that only ever meets valid documents never imports jsonschema (about 50 ms, and 15 ms
more to check each built-in schema against its metaschema). :mod:`handoffd.core.jsonschema_re2`
registers the same format checks with jsonschema, so the two can never disagree on them; any
other format is asked of jsonschema's checker.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Protocol
from uuid import UUID

import re2
from rfc3339_validator import validate_rfc3339  # type: ignore[import-untyped]

from .timeutil import fraction_too_long

PATTERN_CACHE_SIZE = 1024
RE2_SYNTAX_HINT = "schemas use RE2 syntax: no lookaround, no backreferences"


class PatternError(ValueError):
    """A regular expression that cannot be used (RE2 cannot compile it)."""


class Searcher(Protocol):
    """A compiled pattern (RE2's)."""

    def search(self, string: str) -> Any: ...


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # RE2 would otherwise print every bad pattern on our stderr
    return options


_RE2_OPTIONS = _re2_options()


@lru_cache(maxsize=PATTERN_CACHE_SIZE)
def _compile_re2(pattern: str) -> tuple[Searcher | None, str]:
    """RE2-compile ``pattern`` once; (compiled, "") or (None, why not). Failures are cached too."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS), ""
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "invalid"
        return None, reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    except (TypeError, ValueError) as exc:  # e.g. a NUL byte or a surrogate the encoder refuses
        return None, str(exc)


def compile_pattern(pattern: str) -> Searcher:
    """A compiled regex for ``pattern`` on RE2, whatever schema it comes from; PatternError saying
    why when RE2 cannot compile it. (Operators' schemas once fell back to Python's ``re``: a
    workspace schema with ``^(a|a)*\\1b`` then froze the daemon, GIL held, on one string.)"""
    compiled, reason = _compile_re2(pattern)
    if compiled is not None:
        return compiled
    raise PatternError(f"pattern {pattern!r} is not supported: {reason} ({RE2_SYNTAX_HINT})")


def is_re2_regex(instance: Any) -> bool:
    """The ``regex`` format: a string RE2 can compile (the value is data, so no fallback).
    Raises PatternError saying why not (jsonschema keeps the reason as the error's cause)."""
    if isinstance(instance, str):
        compile_pattern(instance)
    return True


def is_datetime(instance: Any) -> bool:
    """The ``date-time`` format: RFC 3339 (what jsonschema checks with rfc3339-validator, a
    dependency of ours for that reason), with at most :data:`~.timeutil.MAX_FRACTION_DIGITS`
    digits of fractional seconds (its check takes any number). A value that is not a string
    passes, as in JSON Schema."""
    if not isinstance(instance, str):
        return True
    return not fraction_too_long(instance) and bool(validate_rfc3339(instance.upper()))


def is_uuid(instance: Any) -> bool:
    """The ``uuid`` format: what UUID() reads, written in the 8-4-4-4-12 form with hyphens."""
    if not isinstance(instance, str):
        return True
    try:
        UUID(instance)
    except ValueError:
        return False
    return all(instance[position] == "-" for position in (8, 13, 18, 23))


def _is_regex(instance: Any) -> bool:
    try:
        return is_re2_regex(instance)
    except PatternError:
        return False


# the formats answered here; any other is asked of jsonschema (imported then)
FORMATS: dict[str, Callable[[Any], bool]] = {"date-time": is_datetime, "uuid": is_uuid,
                                              "regex": _is_regex}


@lru_cache(maxsize=1)
def format_checker() -> Any:
    """The format checker every validator uses: jsonschema's, with the checks of :data:`FORMATS`
    put in place of its own for those names, so that a quick check and jsonschema never disagree
    on them. Built on first need (it imports jsonschema)."""
    import jsonschema
    checker = jsonschema.FormatChecker()
    checker.checks("regex", raises=PatternError)(is_re2_regex)  # the error says why
    checker.checks("date-time")(is_datetime)
    checker.checks("uuid")(is_uuid)
    return checker


def conforms(instance: Any, format_name: str) -> bool:
    """True when ``instance`` passes the ``format`` check every validator here makes."""
    check = FORMATS.get(format_name)
    if check is not None:
        return check(instance)
    return bool(format_checker().conforms(instance, format_name))


def equal(one: Any, two: Any) -> bool:
    """JSON Schema equality, as ``enum`` and ``const`` compare: ``1`` is ``1.0`` but not
    ``true``; arrays and objects are equal member by member."""
    if one is two:
        return True
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, (list, tuple)) and isinstance(two, (list, tuple)):
        return len(one) == len(two) and all(equal(a, b) for a, b in zip(one, two))
    if isinstance(one, dict) and isinstance(two, dict):
        return one.keys() == two.keys() and all(equal(value, two[key]) for key, value in one.items())
    if isinstance(one, bool) or isinstance(two, bool):
        return False  # (two booleans that are equal are the same object: caught above)
    return bool(one == two)
