"""JSON text a document or a line of handoffd's bookkeeping can hold, read with bounds.

Every reader of outside text goes through here: a document (:func:`parse_document`: an object,
UTF-8, finite numbers, nesting at most MAX_DEPTH), a command-line or stored value
(:func:`load_json`), or one line of a log or record (:func:`parse_line`, which never raises).
Nothing here touches a file; the stores read the bytes and hand them over.

Nesting is measured on the text, before any parser sees it (:func:`nests_deeper`): json's parser
recurses, and refuses a value some 990 to 1,023 levels deep by its recursion limit, where that
limit falls depending on the caller's stack (a worker thread's, the command line's).

Documents are written by :func:`encode_document`, with orjson once a process has written a few.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any, Callable

from .documents import MAX_DEPTH
from .errors import ErrorCode, InvalidDocument


def parse_document(data: bytes, name: str) -> dict[str, Any]:
    """Decode UTF-8 JSON that must be an object nesting at most MAX_DEPTH levels; raise
    InvalidDocument saying what is wrong."""
    # the depth first, from the text: json's recursion limit refused a document some 990
    # levels deep as MALFORMED_JSON, which a store waits on as possibly half-written; a
    # document cut short nests no deeper than the whole one will, so one nested too deep is
    # refused at once, with its own code, whether or not its writer is done
    refuse_deep(data, name, MAX_DEPTH)
    loads = _fast_loads
    if loads is not None and type(data) is bytes and len(data) <= FAST_PARSE_BYTES:
        doc = _read_fast(loads, data)
        if doc is not None:
            return doc
    if not data.strip():
        raise InvalidDocument(f"{name} is empty", code=ErrorCode.EMPTY_DOCUMENT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidDocument(f"{name} is not UTF-8 (byte {exc.start})", code=ErrorCode.NOT_UTF8) from None
    doc = load_json(text, name, max_depth=None)  # (its depth is known to be within bounds)
    if not isinstance(doc, dict):
        raise InvalidDocument(f"{name} holds a JSON {type(doc).__name__}, not an object",
                              code=ErrorCode.NOT_AN_OBJECT)
    return doc


def load_json(text: str, name: str, *, max_depth: int | None = None) -> Any:
    """JSON ``text`` that a document can hold (what the daemon reads and what the command line
    takes as ``--data``): InvalidDocument, naming ``name``, for NaN, Infinity and numbers that
    overflow a float, invalid JSON, an integer past Python's digit limit, nesting past
    ``max_depth`` (DOCUMENT_TOO_DEEP, found before parsing) or, without one, nesting that
    exhausts the recursion limit, and a ``\\u`` escape of a lone surrogate."""
    if max_depth is not None:
        refuse_deep(text, name, max_depth)
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
    return value


def parse_line(line: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of one line of handoffd's own bookkeeping (a line of a ``.jsonl`` log, a
    small record file), or None when it cannot be one of ours: not UTF-8, not JSON (a torn
    line), an integer past Python's digit limit, or nesting deeper than ``max_depth``. Never
    raises: a line of ``[`` thirty thousand deep is one more line that is not ours, found so on
    its text (no line of ours nests deep: what its readers do with it must not recurse past the
    limit either), not a RecursionError out of a command or the daemon loop."""
    if nests_deeper(line, max_depth):
        return None
    try:
        return json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError: ValueErrors;
        return None  # RecursionError: a max_depth past what the stack holds)


def refuse_deep(text: str | bytes, name: str, limit: int) -> None:
    """InvalidDocument (DOCUMENT_TOO_DEEP) naming ``name`` when JSON ``text`` (or its UTF-8
    bytes) nests deeper than ``limit``, found on the text alone (:func:`nests_deeper`)."""
    if nests_deeper(text, limit):
        raise InvalidDocument(f"{name} nests more than {limit} levels deep; flatten it",
                              code=ErrorCode.DOCUMENT_TOO_DEEP)


# a JSON string, escapes and all, to its closing quote or to the end of a text cut short
# within it ((?s): a backslash before a line break, no JSON, still does not end it)
_STRING = re.compile(r'(?s)"[^"\\]*(?:\\.[^"\\]*)*"?')
_NOT_BRACKET = re.compile(r"[^][{}]+")
# what each bracket does to the depth
_STEP = {"{": 1, "[": 1, "}": -1, "]": -1}


def nests_deeper(text: str | bytes, limit: int) -> bool:
    """True when the objects and arrays of JSON ``text`` (or of its UTF-8 bytes: every
    character looked at here is ASCII, and no byte of a multi-byte one is) nest more than
    ``limit`` levels deep: for valid JSON, as its value does; for a text cut short (a
    document still being written), as far as it goes, which the whole text goes too. Before
    any parser recurses into it, the same whatever the caller's stack; strings are passed over
    whole; linear time, each step a pass in C, stopping at the first level past ``limit``."""
    if isinstance(text, bytes):
        if text.count(b"{") + text.count(b"[") <= limit:  # (most texts: no closer look)
            return False
        # read as Latin-1 (each byte one character, at the same place; no error): a bytes
        # regex's sub joined its pieces at about 80 bytes of bookkeeping each, some 85 times
        # the document for a hostile one (4 MiB of "1]" took 348 MiB: RE), a str's at 8
        text = text.decode("latin-1")
    elif text.count("{") + text.count("[") <= limit:
        return False
    bare = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return any(map(limit.__lt__, accumulate(map(_STEP.__getitem__, bare))))


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


# A process that writes many documents (a daemon, a batch) encodes them with orjson: about 1.5 µs
# for a handoff's 1.9 KB document against 26 µs in json's C encoder, which was the largest single
# cost of a drain (a handoff is written two or three times). A one-shot command writes one or two
# and never imports it (orjson with uuid: 3-5 ms of its start).
FAST_AFTER = 16  # documents a process encodes with json before it loads orjson
_stdlib_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_fast: Callable[..., bytes] | None = None
_fast_option = 0
# ... and, from then on, parses them with orjson too (:func:`_read_fast`)
_fast_loads: Callable[[bytes], Any] | None = None
_encoded = 0  # documents encoded before the switch (a race between threads only delays it)


def encode_document(doc: Any) -> bytes:
    """``doc`` as every handoffd file holds it: compact JSON on one line, UTF-8 (not ASCII
    escapes), ending in a newline.

    ValueError for a float that is not finite, TypeError for a value that is not JSON, and
    UnicodeEncodeError for a lone surrogate, as ``json`` raises them: such values only come from
    a bug (what a handler returns is checked first), and failing loudly beats filing a document
    nobody can read. orjson differs from json in what it accepts (it writes NaN as ``null``; it
    refuses integers past 64 bits and keys that are not strings; it writes UUIDs and enums,
    which json refuses): whatever it refuses, and any output holding ``null``, is encoded by
    json instead. On JSON data the two differ only in how some floats are spelt (``1e-7``
    against ``1e-07``), never in a value."""
    fast = _fast
    if fast is not None:
        try:
            data = fast(doc, option=_fast_option)
        except TypeError:  # (orjson.JSONEncodeError is one)
            pass
        else:
            if b"null" not in data:
                return data
    elif _encoded < FAST_AFTER:
        _count_encoded()
    return (_stdlib_encode(doc) + "\n").encode("utf-8")


def _count_encoded() -> None:
    """Count one json-encoded document; past FAST_AFTER, load orjson (where it is installed)."""
    global _encoded, _fast, _fast_option, _fast_loads
    _encoded += 1
    if _encoded < FAST_AFTER:
        return
    try:
        import orjson
    except ImportError:  # (a dependency, but nothing breaks without it: json does it all)
        return
    _fast_option = (orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATETIME
                    | orjson.OPT_PASSTHROUGH_DATACLASS)
    _fast_loads = orjson.loads
    _fast = orjson.dumps


# Parsing: orjson reads a document in about a third of the time json takes (with the checks
# json's result needs: a walk for lone surrogates, the text decoded first), and a daemon parses
# each handoff twice (the peek that routes it, the claim). Where the two could differ, json
# decides: orjson refuses NaN, Infinity, numbers that overflow a float, lone surrogates,
# invalid UTF-8 and nesting past 1,024 (all refused by :func:`parse_document` too, with its
# own words, which the json path gives), and reads an integer past 64 bits as a float (json:
# an int), so a document with a run of 19 digits anywhere is left to json.
# orjson's parser takes a working buffer of about 13 times the document (traced: a 512 KiB
# document peaked at 6.8 MB, against 1 MB with json), so only a small document is read with
# it: the seed requests are a few KiB, and a large answer's memory stays as json's (the
# aggregation of 16 children's 512 KiB answers doubled its peak otherwise)
FAST_PARSE_BYTES = 64 * 1024
_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19  # (the shortest integer orjson reads otherwise: -9223372036854775809)


def _read_fast(loads: Callable[[bytes], Any], data: bytes) -> dict[str, Any] | None:
    """The JSON object ``data`` holds as orjson reads it, when json would read it the same;
    None when it is not sure to (json then reads it, and says what is wrong, if anything)."""
    if _LONG_RUN in data.translate(_DIGITS):
        return None
    try:
        value = loads(data)
    except Exception:  # orjson.JSONDecodeError (a ValueError), or anything it cannot read
        return None
    return value if type(value) is dict else None
