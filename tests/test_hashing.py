"""The seals' HMAC-SHA-256 on the interpreter's own SHA-256 (core/hashing.py): the same values as
the standard library's OpenSSL-backed ``hmac``, seals that any string compares against, and
commands that seal or check seals without loading OpenSSL."""
from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_startup import LOADED, QUICK, workspace

from handoffd.backends.files import seals
from handoffd.core import hashing


@settings(max_examples=300, deadline=None, derandomize=True)
@given(key=st.binary(min_size=0, max_size=200), message=st.binary(max_size=300))
def test_the_hmac_is_the_standard_one(key: bytes, message: bytes) -> None:
    """Keys shorter than, equal to and longer than the 64-byte block (hashed first), any message."""
    assert hashing.hmac_sha256_hex(key, message) == hmac.new(key, message, hashlib.sha256).hexdigest()


def test_the_hmac_keeps_its_pads_per_key_and_bounded() -> None:
    keys = [bytes([i]) * 40 for i in range(40)]
    for key in keys:
        assert hashing.hmac_sha256_hex(key, b"m") == hmac.new(key, b"m", hashlib.sha256).hexdigest()
    assert 0 < len(hashing._pads) <= 16
    again = hashing.hmac_sha256_hex(keys[0], b"m")  # a key dropped from the pads is rebuilt alike
    assert again == hmac.new(keys[0], b"m", hashlib.sha256).hexdigest()


def test_same_text_compares_any_string() -> None:
    """hmac.compare_digest raises TypeError for non-ASCII str: a hostile seal once crashed the
    claim with it (tests/poison/seal-non-ascii)."""
    assert hashing.same_text("abc", "abc")
    assert not hashing.same_text("abc", "abd")
    assert not hashing.same_text("\u00e9" * 32, "a" * 32)
    assert not hashing.same_text("\ud800", "a")  # a lone surrogate (json.loads makes them)


def test_a_hostile_seal_is_simply_untrusted() -> None:
    key = b"k" * 64
    good = seals.seal_for(key, "h-1", 3, "pending")
    assert seals.sealed(key, {"handoffd": {"seal": good}}, "h-1", 3, ("pending",))
    for forged in ("\u00e9" * 32, "\ud800", good.upper(), "", good + "0"):
        assert not seals.sealed(key, {"handoffd": {"seal": forged}}, "h-1", 3, ("pending",))
    assert not seals.sealed(None, {"handoffd": {"seal": good}}, "h-1", 3, ("pending",))


def test_create_and_show_do_not_load_openssl(tmp_path: Path) -> None:
    """The quick create seals the new document and show checks seals; neither loads OpenSSL's
    hashes (3 ms warm, ~20 ms cold), and the document is sealed as the daemon seals."""
    root = workspace(tmp_path / "ws")
    code = LOADED  # (a command run in one interpreter, its modules printed)
    made = run_python(code, str(root), "create", "--to", "@x", "--id", "sealed-1", env=QUICK)
    assert made.stdout.startswith("sealed-1"), made.stderr
    shown = run_python(code, str(root), "show", "sealed-1", env=QUICK)
    assert "sealed-1" in shown.stdout, shown.stderr
    for proc in (made, shown):
        loaded = set(proc.stdout.partition("MODULES")[2].split())
        assert "handoffd.core.hashing" in loaded
        assert not loaded & {"_hashlib", "hmac", "hashlib"}, loaded & {"_hashlib", "hmac", "hashlib"}
    doc = json.loads((root / "handoffs" / "pending" / "sealed-1.json").read_text())
    key = (root / "handoffs" / ".meta" / "seal.key").read_bytes().strip()
    block = doc["handoffd"]
    expected = hmac.new(key, f"sealed-1\0{block['revision']}\0pending".encode(),
                        hashlib.sha256).hexdigest()[:32]
    assert block["seal"] == expected
