"""How documents are read (core.jsontext.parse_document): with orjson once a process has written
a few documents (it then reads many: a daemon reads each handoff twice), with json before and for
whatever orjson could read otherwise; either way the same values, and the same refusals in the
same words."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_document_encoding import json_values, text

from handoffd.core import jsontext
from handoffd.core.documents import MAX_DEPTH
from handoffd.core.errors import InvalidDocument

SAVED = ("_fast", "_fast_option", "_encoded", "_fast_loads")


@pytest.fixture
def fast() -> Iterator[None]:
    """orjson loaded, as in a process that has written FAST_AFTER documents."""
    saved = {name: getattr(jsontext, name, None) for name in SAVED}
    jsontext._encoded = jsontext.FAST_AFTER - 1
    jsontext._count_encoded()
    assert jsontext._fast is not None, "orjson is a dependency: it must load"
    yield
    for name, value in saved.items():
        setattr(jsontext, name, value)


def read_by_json(data: bytes) -> Any:
    """``data`` as parse_document reads it before the switch (json alone), or its refusal."""
    saved = {name: getattr(jsontext, name, None) for name in SAVED}
    jsontext._fast = jsontext._fast_loads = None
    try:
        return outcome(data)
    finally:
        for name, value in saved.items():
            setattr(jsontext, name, value)


def outcome(data: bytes) -> Any:
    """What parse_document makes of ``data``: (repr of the value, with every type), or the
    refusal's code and words."""
    try:
        return ("value", typed(jsontext.parse_document(data, "pending/x.json")))
    except InvalidDocument as exc:
        return ("refused", exc.code, str(exc))


def typed(value: Any) -> Any:
    """``value`` with the type of every part kept (1 and 1.0 and True differ; so do key orders)."""
    if isinstance(value, dict):
        return ("dict", [(k, typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [typed(v) for v in value])
    return (type(value).__name__, repr(value))




@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(text, json_values, max_size=6), ascii_only=st.booleans())
def test_a_document_reads_as_json_reads_it(value: dict[str, Any], ascii_only: bool) -> None:
    """Integers of any size (orjson reads one past 64 bits as a float), floats, escapes."""
    data = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")
    saved = {name: getattr(jsontext, name, None) for name in SAVED}
    try:
        jsontext._encoded = jsontext.FAST_AFTER - 1
        jsontext._count_encoded()
        got = outcome(data)
    finally:
        for name, setting in saved.items():
            setattr(jsontext, name, setting)
    assert got == ("value", typed(json.loads(data)))
    assert got == read_by_json(data)


@pytest.mark.parametrize("data", [
    b'{"n": 18446744073709551616}', b'{"n": -9223372036854775809}',
    b'{"n": 100000000000000000000000}', b'{"n": 0.1000000000000000055511151231257827}',
    b'{"n": 1e400}', b'{"n": -1e400}', b'{"n": 1e-400}', b'{"n": NaN}', b'{"n": Infinity}',
    b'{"s": "\\ud800"}', b'{"s": "\\ud83d\\ude00"}', b'{"s": "\xff"}', b'{"s": "\xed\xa0\x80"}',
    b'\xef\xbb\xbf{"a": 1}', b'', b'   \n', b'[1, 2]', b'"text"', b'null', b'{"a": 1}x',
    b'{"a": 1, "b": 2, "a": 3}', b'{"a": 01}', b'{"a": "\x01"}',
    b'{"a": ' + b'[' * (MAX_DEPTH + 1) + b']' * (MAX_DEPTH + 1) + b'}',
    b'{"a": ' + b'[' * 2000 + b']' * 2000 + b'}',
    # json's recursion limit refuses these as MALFORMED_JSON, orjson reads up to 1,024 (RA)
    b'{"a": ' + b'[' * 1000 + b']' * 1000 + b'}',
    b'{"a": ' + b'[' * 1020 + b']' * 1020 + b'}',
    b'{"a": ' + b'[' * (MAX_DEPTH - 2) + b']' * (MAX_DEPTH - 2) + b'}',
])
def test_what_orjson_could_read_otherwise_is_read_as_json_reads_it(fast: None,
                                                                   data: bytes) -> None:
    """Big integers, long mantissas and overflowing numbers, NaN, surrogates, a BOM, bad UTF-8,
    no object, extra data, nesting: each read, or refused, in the words json's path gives."""
    assert outcome(data) == read_by_json(data)


def test_a_daemon_reads_its_documents_with_orjson(fast: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a process writes documents with orjson, it reads them with it: json's parser is
    not called for a plain request (fails before session 30: every document went through
    json.loads)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("json.loads called for a plain document")

    doc = {"handoff_id": "hoff-1", "status": "pending", "target": {"agent_id": "@x"},
           "input": {"data": {"n": [1, 2.5, "é", None, True]}}, "priority": "normal"}
    data = jsontext.encode_document(doc)
    monkeypatch.setattr(jsontext.json, "loads", refuse)
    assert jsontext.parse_document(data, "pending/hoff-1.json") == doc
