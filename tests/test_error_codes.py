"""ErrorCode: the error codes handoffd records are defined once, and stay plain strings on the wire."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handoffd.core.errors import ErrorCode, HandlerError, InvalidDocument
from handoffd.core.jsontext import parse_document

PACKAGE = Path(__file__).resolve().parent.parent / "handoffd"


def test_members_are_their_own_names() -> None:
    for member in ErrorCode:
        assert member.value == member.name
        assert isinstance(member, str)


def test_json_output_is_the_plain_string() -> None:
    doc = {"error": {"code": ErrorCode.SCHEMA_VALIDATION_FAILED, "retryable": False},
           "codes": [ErrorCode.TIMEOUT], ErrorCode.CANCELLED: 1}
    text = json.dumps(doc, sort_keys=True)
    assert text == '{"CANCELLED": 1, "codes": ["TIMEOUT"], ' \
                   '"error": {"code": "SCHEMA_VALIDATION_FAILED", "retryable": false}}'
    assert json.loads(text)["error"]["code"] == "SCHEMA_VALIDATION_FAILED"


def test_members_compare_format_and_hash_as_strings() -> None:
    assert ErrorCode.TIMEOUT == "TIMEOUT"
    assert f"{ErrorCode.TIMEOUT}" == str(ErrorCode.TIMEOUT) == "TIMEOUT"
    assert {"TIMEOUT": 1}[ErrorCode.TIMEOUT] == 1
    assert {ErrorCode.TIMEOUT: 1}["TIMEOUT"] == 1
    assert ErrorCode.TIMEOUT.lower() == "timeout"


def test_exceptions_carry_error_codes() -> None:
    assert InvalidDocument("x").code == "INVALID_DOCUMENT"
    assert HandlerError("x").code == "PROCESSING_ERROR"
    with pytest.raises(InvalidDocument) as caught:
        parse_document(b"{not json", "pending/x.json")
    assert caught.value.code is ErrorCode.MALFORMED_JSON
    assert json.dumps({"code": caught.value.code}) == '{"code": "MALFORMED_JSON"}'


def test_every_literal_code_in_the_package_is_a_member() -> None:
    """Codes still typed out as literals (``code="X"``, ``"code": "X"``) must be known members."""
    pattern = re.compile(r'''(?:\bcode\s*=\s*|"code":\s*)"([A-Z][A-Z0-9_]+)"''')
    unknown = {(path.name, code) for path in PACKAGE.rglob("*.py")
               for code in pattern.findall(path.read_text(encoding="utf-8"))
               if code not in ErrorCode.__members__}
    assert not unknown
