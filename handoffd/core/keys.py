"""Safe relative key names (shared-context keys, ``[namespaces]`` entries, artifact references).

In the core so that config can check ``[namespaces]`` without importing the context store."""
from __future__ import annotations

import re

from .errors import ErrorCode, InvalidDocument

SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=-]{0,127}", re.ASCII)  # used with fullmatch
MAX_KEY = 512


def normalise_key(key: object) -> str:
    """``key`` as a safe relative name (``beads:`` and one ``.json`` dropped); InvalidDocument if
    it is empty, absolute, has ``..`` or unsafe characters, would otherwise leave ``context/``,
    or its last segment still ends in ``.json`` once one is dropped.

    The last rule makes key <-> file a bijection: the key ``k`` is the file ``context/k.json``,
    and ``k.json`` is another spelling of ``k``, so no key may be ``a.json`` (its file
    ``a.json.json`` would be listed as ``a.json``, which reads back ``a``)."""
    if not isinstance(key, str):
        raise InvalidDocument(f"context key {key!r} must be a string", code=ErrorCode.INVALID_CONTEXT_KEY)
    text = key.strip()
    if text.startswith("beads:"):
        text = text[len("beads:"):]
    if text.endswith(".json"):
        text = text[:-5]
    parts = text.split("/")
    if (not text or len(text) > MAX_KEY or text.startswith("/") or "\\" in text
            or any(p in ("", ".", "..") or not SEGMENT.fullmatch(p) or p.endswith(".tmp")
                   for p in parts)):
        raise InvalidDocument(
            f"context key {key!r} is not a safe relative name: use segments of letters, digits and "
            "._@+=- separated by '/', e.g. task/current-objective (no '..', no leading '/')",
            code=ErrorCode.INVALID_CONTEXT_KEY)
    if parts[-1].endswith(".json"):
        raise InvalidDocument(
            f"context key {key!r} is refused: a key's last segment may not end in '.json' (the "
            "file of key K is context/K.json, and 'K.json' is another spelling of K)",
            code=ErrorCode.INVALID_CONTEXT_KEY)
    return text


def names_itself(key: str) -> bool:
    """True when ``key`` (a file's path under ``context/`` without ``.json``) is a key whose
    file that is: what a listing shows reads back that file."""
    try:
        return normalise_key(key) == key
    except InvalidDocument:
        return False
