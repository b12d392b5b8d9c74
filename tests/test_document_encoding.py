"""How documents are encoded (core.jsontext.encode_document): with orjson once a process has
written a few, with json before and for whatever orjson would write differently; either way the
same JSON values, and the same refusals."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handoffd.core import jsontext

STDLIB = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


@pytest.fixture
def fast() -> Iterator[None]:
    """orjson loaded, as in a process that has written FAST_AFTER documents."""
    saved = (jsontext._fast, jsontext._fast_option, jsontext._encoded)
    jsontext._encoded = jsontext.FAST_AFTER - 1
    jsontext._count_encoded()
    assert jsontext._fast is not None, "orjson is a dependency: it must load"
    yield
    jsontext._fast, jsontext._fast_option, jsontext._encoded = saved


def stdlib(value: Any) -> bytes:
    return (STDLIB(value) + "\n").encode("utf-8")


# JSON data as documents hold it: every code point but the surrogates, integers of any size
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(text, json_values, max_size=6))
def test_both_encoders_write_the_same_values(value: dict[str, Any]) -> None:
    saved = (jsontext._fast, jsontext._fast_option, jsontext._encoded)
    try:
        jsontext._encoded = jsontext.FAST_AFTER - 1
        jsontext._count_encoded()
        data = jsontext.encode_document(value)
        # before the switch (a process that has written fewer than FAST_AFTER): json's bytes
        # (set here: this worker may have written more in the tests before)
        jsontext._fast, jsontext._encoded = None, 0
        before = jsontext.encode_document(value)
    finally:
        jsontext._fast, jsontext._fast_option, jsontext._encoded = saved
    assert data.endswith(b"\n") and data.count(b"\n") == 1  # one line, as every file holds it
    assert json.loads(data) == json.loads(stdlib(value)) == value
    assert before == stdlib(value)


def test_a_handoffs_document_is_written_as_json_writes_it(fast: None) -> None:
    doc = json.loads((Path(__file__).parent.parent / "benchmarks" / "seed001-request.json")
                     .read_text())
    doc["handoffd"] = {"revision": 2, "history": [{"event": "claimed",
                                                  "at": "2026-11-27T21:00:00.000Z"}]}
    doc["note"] = "é\u2028\x00\x7f/\"\\\t"
    assert jsontext.encode_document(doc) == stdlib(doc)


@pytest.mark.parametrize("value", [{"n": 2 ** 64}, {"n": -(2 ** 63) - 1}, {1: "a", "b": None},
                                   {"a": None}, {"a": [1.5, None]}])
def test_what_orjson_writes_otherwise_is_written_by_json(fast: None, value: Any) -> None:
    # integers past 64 bits and keys that are not strings orjson refuses; output with a null
    # might hold a NaN that orjson wrote as null: json writes all three, as before
    assert jsontext.encode_document(value) == stdlib(value)


@pytest.mark.parametrize("value,error", [
    ({"x": math.nan}, ValueError), ({"x": [math.inf]}, ValueError), ({"x": -math.inf}, ValueError),
    ({"x": datetime(2026, 1, 1, tzinfo=timezone.utc)}, TypeError), ({"x": {1, 2}}, TypeError),
    ({"x": b"bytes"}, TypeError), ({"x": "\ud800"}, UnicodeEncodeError)])
def test_what_is_not_json_is_refused_as_json_refuses_it(fast: None, value: Any,
                                                        error: type[Exception]) -> None:
    # orjson would write NaN as null and a datetime as a string: a bug must fail loudly,
    # not file a document that says something else
    with pytest.raises(error):
        jsontext.encode_document(value)


def test_a_one_shot_command_never_loads_orjson(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from handoffd.core import jsontext\n"
            "for n in range(jsontext.FAST_AFTER - 1):\n"
            "    jsontext.encode_document({'n': n})\n"
            "print('orjson' in sys.modules)\n"
            "jsontext.encode_document({'n': -1})\n"
            "print('orjson' in sys.modules, jsontext.encode_document({'n': 1}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "True b'{\"n\":1}\\n'"]
