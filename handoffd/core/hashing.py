"""SHA-256 digests for names and checksums, loading OpenSSL's hashes on first use: that load
costs a cold one-shot command about 20 ms, and commands that only read documents never hash."""
from __future__ import annotations


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex."""
    import hashlib  # a dict lookup once loaded
    return hashlib.sha256(data).hexdigest()


def load() -> None:
    """Load OpenSSL's hashes and HMAC now: a command about to write a document (which the files
    store seals) pays for them before it stamps the document's creation time, not between that
    stamp and the moment the document appears."""
    import hashlib  # noqa: F401
    import hmac  # noqa: F401
