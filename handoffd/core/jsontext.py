"""JSON text a document or a line of handoffd's bookkeeping can hold, read with bounds.

Every reader of outside text goes through here: a document (:func:`parse_document`: an object,
UTF-8, finite numbers, nesting at most MAX_DEPTH), a command-line or stored value
(:func:`load_json`), or one line of a log or record (:func:`parse_line`, which never raises).
Nothing here touches a file; the stores read the bytes and hand them over.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .documents import MAX_DEPTH, nesting_depth
from .errors import ErrorCode, InvalidDocument


def parse_document(data: bytes, name: str) -> dict[str, Any]:
    """Decode UTF-8 JSON that must be an object; raise InvalidDocument saying what is wrong."""
    if not data.strip():
        raise InvalidDocument(f"{name} is empty", code=ErrorCode.EMPTY_DOCUMENT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidDocument(f"{name} is not UTF-8 (byte {exc.start})", code=ErrorCode.NOT_UTF8) from None
    doc = load_json(text, name, max_depth=None)
    if not isinstance(doc, dict):
        raise InvalidDocument(f"{name} holds a JSON {type(doc).__name__}, not an object",
                              code=ErrorCode.NOT_AN_OBJECT)
    check_depth(text, doc, name, MAX_DEPTH)
    return doc


def load_json(text: str, name: str, *, max_depth: int | None = None) -> Any:
    """JSON ``text`` that a document can hold (what the daemon reads and what the command line
    takes as ``--data``): InvalidDocument, naming ``name``, for NaN, Infinity and numbers that
    overflow a float, invalid JSON, an integer past Python's digit limit, nesting that exhausts
    the recursion limit or passes ``max_depth``, and a ``\\u`` escape of a lone surrogate."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise InvalidDocument(f"{name} holds the number {exc.args[0]}, which is not finite JSON "
                              "(NaN, Infinity and overflowing numbers are refused)",
                              code=ErrorCode.MALFORMED_JSON) from None
    except json.JSONDecodeError as exc:
        raise InvalidDocument(f"{name} is not valid JSON: {exc.msg} (line {exc.lineno}, "
                              f"column {exc.colno})", code=ErrorCode.MALFORMED_JSON) from None
    except RecursionError:
        raise InvalidDocument(f"{name} nests too deeply", code=ErrorCode.MALFORMED_JSON) from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise InvalidDocument(f"{name} is not valid JSON: {str(exc)[:120]}",
                              code=ErrorCode.MALFORMED_JSON) from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise InvalidDocument(f"{name} holds a \\u escape of a lone UTF-16 surrogate, which is not "
                              "Unicode and cannot be written back as UTF-8", code=ErrorCode.NOT_UTF8)
    if max_depth is not None:
        check_depth(text, value, name, max_depth)
    return value


def parse_line(line: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of one line of handoffd's own bookkeeping (a line of a ``.jsonl`` log, a
    small record file), or None when it cannot be one of ours: not UTF-8, not JSON (a torn
    line), an integer past Python's digit limit, or nesting deeper than ``max_depth``. Never
    raises: a line of ``[`` thirty thousand deep, whose parse exhausts the recursion limit, is
    one more line that is not ours, not a RecursionError out of a command or the daemon loop."""
    try:
        value = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError: ValueErrors)
        return None
    if isinstance(value, (dict, list)):
        # no line of ours nests deep: what its readers do with it must not recurse past the
        # limit either (a value cannot nest deeper than it has brackets: most need no walk)
        brackets = (line.count(b"[") + line.count(b"{") if isinstance(line, bytes)
                    else line.count("[") + line.count("{"))
        if brackets > max_depth and nesting_depth(value, max_depth) > max_depth:
            return None
    return value


def check_depth(text: str, value: Any, name: str, limit: int) -> None:
    """InvalidDocument (DOCUMENT_TOO_DEEP) when ``value``, parsed from ``text``, nests deeper than
    ``limit``."""
    # a value cannot nest deeper than it has brackets: most need no walk at all
    if text.count("{") + text.count("[") > limit and nesting_depth(value, limit) > limit:
        raise InvalidDocument(f"{name} nests more than {limit} levels deep; flatten it",
                              code=ErrorCode.DOCUMENT_TOO_DEEP)


class _NotFinite(ValueError):
    pass


def _refuse_constant(token: str) -> Any:
    raise _NotFinite(token)


def _finite_float(token: str) -> float:
    value = float(token)
    if value != value or value in (float("inf"), float("-inf")):
        raise _NotFinite(token[:40])
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a surrogate gets into decoded text


def _has_lone_surrogate(value: Any) -> bool:
    """True if a string (key or value) anywhere in ``value`` holds a surrogate code point: json
    decodes ``"\\ud800"`` to one, and no UTF-8 encoder will write it back (iterative)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:  # (no regex: compiling a class of surrogates cost each command 0.5 ms)
                item.encode("utf-8")
            except UnicodeEncodeError:  # UTF-8 refuses exactly the surrogate code points
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
