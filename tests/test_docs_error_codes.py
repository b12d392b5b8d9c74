"""docs/protocol.md's error-code table explains every code handoffd records (ErrorCode)."""
from __future__ import annotations

from pathlib import Path

from handoffd.core.errors import ErrorCode

PROTOCOL = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def _error_code_table() -> str:
    """The text of the *Error codes* section (up to the next heading)."""
    text = PROTOCOL.read_text(encoding="utf-8")
    start = text.index("### Error codes")
    end = text.index("\n#", start + 1)
    return text[start:end]


def test_every_error_code_has_a_row() -> None:
    rows = [line for line in _error_code_table().splitlines() if line.startswith("| `")]
    missing = [code.value for code in ErrorCode
               if not any(f"`{code.value}`" in row.split("|")[1] for row in rows)]
    assert not missing, f"docs/protocol.md's error-code table lacks rows for {missing}"
