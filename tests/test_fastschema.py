"""The quick schema checks (handoffd.core.fastschema) against jsonschema, the judge.

A quick "valid" is final, so it must never accept what jsonschema refuses; it should also accept
everything jsonschema accepts (else every valid document pays for jsonschema again). Checked on
the seeds' examples with one value replaced or one key dropped, and for the schema no seed gives
an example of, on documents hypothesis-jsonschema draws from it.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import test_fuzz  # noqa: F401  (its hypothesis-jsonschema shim and memoisation)
from dialect_examples import ALL
from test_native_schemas import SEED_FAILURE, SEED_REQUEST, SEED_RESPONSE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from handoffd.core.fastschema import compile_schema, is_valid
from handoffd.core.jsonschema_re2 import errors_of, for_named
from handoffd.core.validation import builtin_schema_names, load_builtin

SCHEMAS = builtin_schema_names()
NATIVE = [(SEED_REQUEST, "native", "native.request.schema.json"),
          (SEED_RESPONSE, "native", "native.response.schema.json"),
          (SEED_FAILURE, "native", "native.failure.schema.json")]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@functools.lru_cache(maxsize=None)
def checks(name: str) -> tuple[Any, Any]:
    """(quick check, jsonschema validator) of built-in schema ``name``."""
    schema = load_builtin(name)
    quick = compile_schema(schema, draft7="draft-07" in schema.get("$schema", ""))
    assert quick is not None, f"{name} is not compiled: every document pays for jsonschema"
    return quick, for_named(schema)


def verdicts(name: str, doc: Any) -> tuple[bool, bool]:
    """(the quick check's verdict, jsonschema's) for ``doc`` under built-in schema ``name``."""
    quick, judge = checks(name)
    return is_valid(quick, doc), not errors_of(judge, doc)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``value`` (keys and indexes)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, prefix + (index,))
    return found


def mutate(doc: Any, data: st.DataObject) -> Any:
    """``doc`` with one value replaced by arbitrary JSON, or one key dropped."""
    doc = copy.deepcopy(doc)
    where = [p for p in paths(doc) if p]
    if not where:
        return doc
    path = data.draw(st.sampled_from(where))
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(JSON)
    return doc


@pytest.mark.parametrize("doc, schema", [(doc, name) for doc, _, name in [*ALL.values(), *NATIVE]])
def test_the_seed_examples_get_the_same_verdict(doc: dict[str, Any], schema: str) -> None:
    assert verdicts(schema, doc) == (True, True)


def bases(schema: str) -> list[Any]:
    """Valid documents of ``schema``: the seeds' examples of it."""
    return [doc for doc, _, name in [*ALL.values(), *NATIVE] if name == schema]


QUICK = dict(derandomize=True, deadline=None, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                    HealthCheck.filter_too_much])


@pytest.mark.parametrize("schema", [s for s in SCHEMAS if bases(s)])
@settings(max_examples=200, **QUICK)
@given(data=st.data())
def test_mutated_examples_get_the_same_verdict(schema: str, data: st.DataObject) -> None:
    changed = mutate(data.draw(st.sampled_from(bases(schema))), data)
    quick, judge = verdicts(schema, changed)
    assert quick == judge, f"quick says {quick}, jsonschema says {judge} for {changed!r}"


@pytest.mark.parametrize("schema", [s for s in SCHEMAS if not bases(s)])
@settings(max_examples=6, **QUICK)
@given(data=st.data())
def test_drawn_documents_get_the_same_verdict(schema: str, data: st.DataObject) -> None:
    """Schemas no seed gives an example of: documents drawn from the schema (slow to draw)."""
    doc = data.draw(from_schema(load_builtin(schema)))
    assert verdicts(schema, doc) == (True, True)
    changed = mutate(doc, data)
    quick, judge = verdicts(schema, changed)
    assert quick == judge, f"quick says {quick}, jsonschema says {judge} for {changed!r}"


def test_each_keyword_against_jsonschema() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object", "required": ["id"], "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10},
            "kind": {"enum": ["a", 1, None]}, "flag": {"const": True},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                     "contains": {"const": "x"}},
            "when": {"type": "string", "format": "date-time"},
            "either": {"oneOf": [{"type": "string"}, {"type": "number", "minimum": 5}]},
            "tree": {"$ref": "#/$defs/node"},
        },
        "if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
        "then": {"required": ["n"]},
        "$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    }
    quick = compile_schema(schema)
    assert quick is not None
    judge = for_named(schema)
    cases = [{"id": "ab"}, {"id": "a"}, {"id": "AB"}, {"n": 1}, {"id": "ab", "n": 1.0},
             {"id": "ab", "n": 10}, {"id": "ab", "n": True}, {"id": "ab", "kind": 1.0},
             {"id": "ab", "kind": True}, {"id": "ab", "kind": "a"}, {"id": "ab", "kind": "a", "n": 3},
             {"id": "ab", "flag": 1}, {"id": "ab", "flag": True}, {"id": "ab", "tags": []},
             {"id": "ab", "tags": ["y"]}, {"id": "ab", "tags": ["y", "x"]},
             {"id": "ab", "when": "2026-01-01T00:00:00Z"}, {"id": "ab", "when": "yesterday"},
             {"id": "ab", "either": 3}, {"id": "ab", "either": 7}, {"id": "ab", "either": "s"},
             {"id": "ab", "tree": {"children": [{"children": []}]}},
             {"id": "ab", "tree": {"children": [{"children": 1}]}}, {"id": "ab", "extra": 1}, []]
    for case in cases:
        assert is_valid(quick, case) == (not errors_of(judge, case)), case


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False},
    {"items": [{"type": "string"}]}, {"dependentRequired": {"a": ["b"]}},
    {"$ref": "https://example.com/other.json"}, {"minimum": True}, {"ref": "#"},
])
def test_what_it_does_not_know_is_left_to_jsonschema(schema: dict[str, Any]) -> None:
    assert compile_schema(schema) is None
