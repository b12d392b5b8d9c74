"""Seals: how handoffd tells its own bookkeeping from bookkeeping that arrived from outside.

Every document handoffd writes carries ``handoffd.seal``, an HMAC over (id, revision, state folder)
keyed by a secret of the workspace (``handoffs/.meta/seal.key``, created on first use, mode 0600).
A revision is trusted only when the seal matches the folder the document was read from, so:

* a document dropped into ``pending/`` with a forged ``handoffd.revision: 99`` is an ordinary new
  (raw) document: its ``handoffd`` block is discarded and, if the id exists, it is a duplicate;
* a copy of a finished document moved back into ``pending/`` by hand does not outrank the result;
* a document in ``completed/`` or ``failed/`` that handoffd did not file there (seed 001's own
  consumer may write those folders itself) is a foreign filing: :func:`own_block` gives None for
  it, and every reader takes its state from the folder, never its history, attempts or errors
  from the block (see ``FilesBackend.trusted_book``).

The seal defends against documents, not against a process that reads the workspace's key: anyone
who can read ``handoffs/.meta/`` can forge seals, as they could edit ``completed/`` directly.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from ...core import ownfiles
from ...core.documents import BOOK, revision
from ...core.errors import ConfigError
from ...core.hashing import hmac_sha256_hex, same_text

KEY_NAME = "seal.key"
MAX_KEY_BYTES = 4096


def load_or_create_key(meta: Path, tmp: Path) -> bytes | None:
    """The workspace's seal key, creating it atomically if absent. None when it is absent and
    cannot be made (a read-only workspace: readers work, and every revision is untrusted).

    ConfigError when a ``seal.key`` is there but unusable (a directory, a FIFO, a symlink, empty,
    too short, unreadable). It is never replaced behind the operator's back: two processes
    replacing it at once would seal with two keys. Without it handoffd cannot tell its own
    documents from foreign ones: every handoff it created would be taken for a foreign copy of
    an id already used and set aside unrun."""
    path = meta / KEY_NAME
    for _ in range(2):
        try:
            data = ownfiles.read_regular(path, MAX_KEY_BYTES).strip()
        except FileNotFoundError:
            data = None
        except OSError as exc:  # opened as fsio opens its own files: never blocks on a FIFO
            why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            raise unusable_key(path, why) from None
        if data is not None:
            if len(data) >= 32:
                return data
            raise unusable_key(path, f"it holds {len(data)} bytes, not a key" if data else "it is empty")
        try:
            meta.mkdir(parents=True, exist_ok=True)
            tmp.mkdir(parents=True, exist_ok=True)
            # os.urandom is what secrets.token_hex reads (secrets would load OpenSSL via hmac)
            staged = tmp / f"seal-{os.urandom(8).hex()}.tmp"
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(32).hex().encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(staged, path)  # first creator wins; a loser reads the winner's key
            except FileExistsError:
                pass
            finally:
                os.unlink(staged)
        except OSError:
            return None
    return None


def unusable_key(path: Path, why: str) -> ConfigError:
    """The one line that says the workspace's seal key cannot be used, and what to do."""
    return ConfigError(f"{path} cannot be used as the workspace's seal key ({why}); move it "
                       "away and handoffd makes a new one (documents sealed with a lost key are "
                       "then read as foreign: their handoffd bookkeeping is not trusted)")


def seal_for(key: bytes, handoff_id: str, revision: int, folder: str) -> str:
    """The seal of a document with this id and revision written into ``folder``."""
    # surrogatepass: an id from a file name that is not UTF-8 must not make sealing raise
    message = f"{handoff_id}\0{revision}\0{folder}".encode("utf-8", "surrogatepass")
    return hmac_sha256_hex(key, message)[:32]


def sealed(key: bytes | None, doc: dict[str, Any], handoff_id: str, revision: int,
           folders: tuple[str, ...]) -> bool:
    """True when ``doc`` carries a valid seal for one of ``folders``."""
    block = doc.get("handoffd")
    seal = block.get("seal") if isinstance(block, dict) else None
    if key is None or not isinstance(seal, str):
        return False
    return any(same_text(seal, seal_for(key, handoff_id, revision, f)) for f in folders)


def own_block(key: bytes | None, doc: dict[str, Any], handoff_id: str,
              folders: tuple[str, ...]) -> dict[str, Any] | None:
    """``doc``'s ``handoffd`` block when handoffd wrote it into one of ``folders`` (its seal
    matches its id, its revision and that folder), else None: no block, no revision, no key (no
    document here was ever sealed), or a seal that does not match."""
    block = doc.get(BOOK)
    if not isinstance(block, dict):
        return None
    claimed = revision(doc)
    return block if claimed and sealed(key, doc, handoff_id, claimed, folders) else None
