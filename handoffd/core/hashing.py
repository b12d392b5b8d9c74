"""SHA-256 digests for names and checksums, and the HMAC-SHA-256 that seals documents.

Loading OpenSSL's hashes (``hashlib``, ``hmac``) costs a one-shot command 3 ms warm and about
20 ms cold, and every command that writes or trusts a document seals or checks a seal. Seals hash
a few dozen bytes, which the interpreter's own SHA-256 (no OpenSSL, 0.3 ms to load) does as fast,
so :func:`hmac_sha256_hex` uses that one; :func:`sha256_hex` (artifacts, files of any size) keeps
OpenSSL's, loaded on first use.
"""
from __future__ import annotations

from typing import Any, Callable

BLOCK = 64  # SHA-256's block size: HMAC pads its key to it (RFC 2104)
_INNER = bytes(x ^ 0x36 for x in range(256))
_OUTER = bytes(x ^ 0x5C for x in range(256))
_pads: dict[bytes, tuple[Any, Any]] = {}  # key -> its inner and outer hash states
_sha256: Callable[..., Any] | None = None  # the constructor, once loaded
_blake2b: Callable[..., Any] | None = None  # digest64's, once loaded


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex."""
    import hashlib  # a dict lookup once loaded
    return hashlib.sha256(data).hexdigest()


def digest64(data: bytes, *, key: bytes = b"") -> bytes:
    """An 8-byte BLAKE2b of ``data`` (keyed with ``key``) for hash tables of ids: the
    interpreter's own BLAKE2 (what hashlib serves too), so no command loads OpenSSL for it."""
    blake2b = _blake2b or _load_blake2b()
    return blake2b(data, digest_size=8, key=key).digest()  # type: ignore[no-any-return]


def _load_blake2b() -> Callable[..., Any]:
    """BLAKE2b's constructor, loaded once (the interpreter's own, or hashlib's where a build
    lacks it)."""
    global _blake2b
    if _blake2b is None:
        try:
            from _blake2 import blake2b
        except ImportError:  # a build without it
            from hashlib import blake2b
        _blake2b = blake2b
    return _blake2b


def _builtin_sha256() -> Callable[..., Any]:
    """The interpreter's own SHA-256 constructor (``_sha2`` from 3.12, ``_sha256`` before), or
    hashlib's where a build lacks both."""
    global _sha256
    if _sha256 is None:
        try:
            from _sha2 import sha256  # type: ignore[import-not-found]  # Python >= 3.12
        except ImportError:
            try:
                from _sha256 import sha256  # type: ignore[import-not-found,no-redef]  # 3.11
            except ImportError:
                from hashlib import sha256  # type: ignore[assignment]
        _sha256 = sha256
    return _sha256


def hmac_sha256_hex(key: bytes, message: bytes) -> str:
    """HMAC-SHA-256 of ``message`` under ``key``, in hex: the same value as
    ``hmac.new(key, message, hashlib.sha256).hexdigest()`` (a test holds them equal)."""
    pads = _pads.get(key)
    if pads is None:
        pads = _pads_of(key)
    inner, outer = pads[0].copy(), pads[1].copy()
    inner.update(message)
    outer.update(inner.digest())
    return outer.hexdigest()  # type: ignore[no-any-return]


def _pads_of(key: bytes) -> tuple[Any, Any]:
    """The hash states after the padded key's inner and outer blocks, kept per key (a workspace
    has one seal key; the cap only bounds a process that met many)."""
    sha256 = _builtin_sha256()
    block = sha256(key).digest() if len(key) > BLOCK else key
    block = block.ljust(BLOCK, b"\0")
    pads = (sha256(block.translate(_INNER)), sha256(block.translate(_OUTER)))
    if len(_pads) >= 16:
        _pads.clear()
    _pads[key] = pads
    return pads


def same_text(a: str, b: str) -> bool:
    """``a == b`` in time that does not depend on where they differ (for seals)."""
    # what hmac.compare_digest is, without loading OpenSSL; on bytes, as it refuses non-ASCII str
    from _operator import _compare_digest
    return bool(_compare_digest(a.encode("utf-8", "surrogatepass"),
                                b.encode("utf-8", "surrogatepass")))


def load() -> None:
    """Load the seals' hash now: a command about to write a document (which the files store
    seals) pays for it before it stamps the document's creation time, not between that stamp and
    the moment the document appears. The seen-ids record's hash too: loaded once the document
    is written, with few descriptors left (``ulimit -n``) its import failed, and the create
    that had placed its document ended in a traceback."""
    _builtin_sha256()
    _load_blake2b()
