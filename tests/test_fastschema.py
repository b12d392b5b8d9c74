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

from handoffd.core.fastschema import _source, compile_schema, is_valid
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


# ---------------------------------------------------------------- the generated code
HOSTILE_NAMES = ['"]); import os; ("', "']); import os; ('", "\\", "\n", "'''", '"""', "\\N{",
                 "{v}", "%s", "v", "_c2", "x1", "return True", "#", "\x00", "\u2028", "é"]


def hostile_schema(name: str) -> dict[str, Any]:
    """Every place a schema string can go, filled with ``name``."""
    return {"type": "object", "required": [name], "additionalProperties": False,
            "properties": {name: {"$ref": "#/$defs/d", "format": name, "enum": [name, 1],
                                  "const": name},
                           "p": {"pattern": "^" + re2_escape(name) + "$"}},
            "$defs": {"d": {"type": "string", "minLength": 1}, name: {"type": "integer"}}}


def re2_escape(text: str) -> str:
    return "".join(ch if ch.isalnum() or ord(ch) > 127 else "\\x%02x" % ord(ch) for ch in text)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_schema_strings_never_reach_the_source(name: str) -> None:
    schema = hostile_schema(name)
    source, namespace = _source(schema, False)
    # no string literal at all: every schema value is passed in the namespace
    assert "'" not in source and '"' not in source and "\\" not in source
    assert all(line.isascii() and line.isprintable() for line in source.splitlines())
    quick = compile_schema(schema)
    assert quick is not None
    judge = for_named(schema)
    for doc in [{name: name}, {name: name, "p": name}, {name: name, "p": "x"}, {name: 1},
                {}, {"p": name}, {name: name, "other": 1}, {name: ""}, name]:
        assert is_valid(quick, doc) == (not errors_of(judge, doc)), doc


def test_a_property_name_that_closes_the_code_runs_nothing(tmp_path: Any) -> None:
    flag = tmp_path / "ran"
    name = f'"]); open({str(flag)!r}, "w"); ("'
    for schema in [{"properties": {name: {"type": "string"}}, "required": [name]},
                   {"enum": [name]}, {"const": name}, {"pattern": name.replace("(", r"\(")
                                                       .replace(")", r"\)")}]:
        quick = compile_schema(schema)
        assert quick is not None
        assert is_valid(quick, {name: "s"}) and not is_valid(quick, {name: 1}) \
            if "properties" in schema else is_valid(quick, name)
    assert not flag.exists()


@settings(max_examples=150, **QUICK)
@given(names=st.lists(st.text(max_size=8), min_size=1, max_size=4), data=st.data())
def test_any_property_names_and_values_stay_data(names: list[str], data: st.DataObject) -> None:
    schema = {"type": "object", "required": names[:1], "additionalProperties": {"enum": names},
              "properties": {n: {"const": n} for n in names[1:]}}
    source, _ = _source(schema, False)
    assert "'" not in source and '"' not in source
    quick = compile_schema(schema)
    assert quick is not None
    doc = data.draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=3),
                                    st.sampled_from(names) | JSON, max_size=4))
    assert is_valid(quick, doc) == (not errors_of(for_named(schema), doc)), doc


SCHEMA_LEAVES = st.sampled_from([
    True, False, {}, {"type": "string"}, {"type": "integer"}, {"type": "number"},
    {"type": "boolean"}, {"type": "null"}, {"type": ["object", "null"]},
    {"type": "array", "maxItems": 2}, {"minLength": 1, "maxLength": 3}, {"pattern": "^a"},
    {"pattern": "[ab]c"}, {"minimum": 0}, {"exclusiveMaximum": 1.5}, {"maximum": 10 ** 30},
    {"enum": ["a", "b"]}, {"enum": [1, "a", None, [1], {"a": 1}]}, {"enum": []},
    {"const": "a"}, {"const": True}, {"const": False}, {"const": None}, {"const": 1},
    {"const": [1, True]}, {"format": "date-time"}, {"required": ["a"]},
    {"uniqueItems": True}, {"uniqueItems": False},  # hashed (session 19)
    {"enum": [*range(-3, 33), 1.5, "a", None, [1], {"a": 1}]},  # a large enum: hashed too
])
SCHEMAS_DRAWN = st.recursive(SCHEMA_LEAVES, lambda inner: st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["object", "array", "string", "number", "integer"]),
    "properties": st.dictionaries(st.sampled_from(["a", "b", ""]), inner, max_size=2),
    "required": st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True),
    "additionalProperties": inner, "items": inner, "contains": inner,
    "minItems": st.integers(0, 2), "allOf": st.lists(inner, min_size=1, max_size=2),
    "anyOf": st.lists(inner, min_size=1, max_size=2),
    "oneOf": st.lists(inner, min_size=1, max_size=3), "not": inner, "if": inner,
    "then": inner, "else": inner, "minimum": st.integers(-2, 2) | st.floats(-2, 2),
}), max_leaves=8)
INSTANCES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, 1.0, 1.5, -2.0, 10 ** 40])
    | st.sampled_from(["", "a", "b", "ab", "2026-01-13T10:00:00Z", "nope"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b", "c", ""]), inner, max_size=3), max_leaves=8)


@settings(max_examples=400, **QUICK)
@given(schema=SCHEMAS_DRAWN, instances=st.lists(INSTANCES, min_size=1, max_size=6))
def test_drawn_schemas_get_the_same_verdict(schema: Any, instances: list[Any]) -> None:
    """Every keyword, nested in any other, against jsonschema."""
    quick = compile_schema(schema)
    assert quick is not None, schema
    judge = for_named(schema) if isinstance(schema, dict) else None
    for instance in instances:
        expected = schema is True if judge is None else not errors_of(judge, instance)
        assert is_valid(quick, instance) == expected, (schema, instance)


def test_types_as_json_schema_sees_them() -> None:
    """bool is no number, 1.0 is an integer (draft 6 on), huge ints are ints, NaN fails."""
    cases = {"integer": [(1, True), (1.0, True), (1.5, False), (True, False), (10 ** 400, True),
                         (float("nan"), False), (float("inf"), False), ("1", False)],
             "number": [(1, True), (1.5, True), (False, False), (10 ** 400, True), (None, False)],
             "boolean": [(True, True), (0, False), (None, False)],
             "null": [(None, True), (0, False), (False, False)],
             "object": [({}, True), ([], False)], "array": [([], True), ({}, False)]}
    for name, pairs in cases.items():
        quick = compile_schema({"type": name})
        assert quick is not None
        for value, verdict in pairs:
            assert is_valid(quick, value) is verdict, (name, value)
    quick = compile_schema({"minimum": 1})
    assert quick is not None
    assert not is_valid(quick, float("nan")) and is_valid(quick, True) and is_valid(quick, "x")
    assert is_valid(quick, 10 ** 400) and not is_valid(quick, -(10 ** 400))


@pytest.mark.parametrize("pattern", [
    load_builtin("native.request.schema.json")["$defs"]["date_time"]["pattern"],
    load_builtin("native.request.schema.json")["$defs"]["handoff_id"]["pattern"],
    "", "^$", "a", "^a", "a$", "(a|b)+c", "[^x]", "\\d{2,}", "é", "^.$", "(?i)ab", "\\bx\\b",
    "a|b|c"])
@settings(max_examples=60, **QUICK)
@given(text=st.text(alphabet="ab cxé09-:TZ\n.+", max_size=24))
def test_a_pattern_answers_as_search_does(pattern: str, text: str) -> None:
    from handoffd.core.fastschema import _pattern_test
    from handoffd.core.jsonschema_re2 import compile_pattern
    expected = compile_pattern(pattern).search(text) is not None
    assert bool(_pattern_test(pattern)(text)) is expected


def test_a_string_re2_cannot_encode_is_left_to_jsonschema() -> None:
    quick = compile_schema({"pattern": "a"})
    assert quick is not None and is_valid(quick, "a") and not is_valid(quick, "\ud800")


def nested(depth: int, leaf: Any, wrap: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = wrap(value)
    return value


def test_a_document_nested_absurdly_deep_is_refused_not_crashed() -> None:
    tree = {"$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "$ref": "#/$defs/node"}
    quick = compile_schema(tree)
    assert quick is not None
    assert is_valid(quick, nested(50, [], lambda v: [v]))
    assert not is_valid(quick, nested(100_000, [], lambda v: [v]))  # RecursionError: jsonschema's
    assert not is_valid(quick, nested(100_000, [], lambda v: [v, 1]))
    either = {"$defs": {"n": {"anyOf": [{"type": "string"}, {"items": {"$ref": "#/$defs/n"}}],
                              "not": {"const": 1}}}, "$ref": "#/$defs/n"}
    quick = compile_schema(either)
    assert quick is not None
    assert not is_valid(quick, nested(100_000, "s", lambda v: [v]))
    request, _ = checks("native.request.schema.json")  # "context" is any object: not walked
    assert is_valid(request, {"handoff_id": "h", "target": {"agent_id": "a"},
                              "context": nested(100_000, {}, lambda v: {"a": v})})


def test_a_schema_nested_deeper_than_the_code_nests_still_agrees() -> None:
    """Past _MAX_INDENT levels a subschema becomes a function of its own (CPython allows 20
    nested loops and 100 indentation levels in one function)."""
    for wrap in (lambda s: {"type": "array", "items": s},
                 lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]},
                 lambda s: {"additionalProperties": s},
                 lambda s: {"if": {"type": "array"}, "then": {"items": s}, "else": {"const": 1}}):
        schema = nested(25, {"type": "integer"}, wrap)
        quick = compile_schema(schema)
        assert quick is not None
        judge = for_named(schema)
        for doc in (nested(25, 1, lambda v: [v]), nested(25, "x", lambda v: [v]),
                    nested(25, 1, lambda v: {"a": v}), nested(24, 1, lambda v: {"a": v}), 1):
            assert is_valid(quick, doc) == (not errors_of(judge, doc))


def test_a_schema_nested_absurdly_deep_is_left_to_jsonschema() -> None:
    assert compile_schema(nested(100_000, {}, lambda s: {"items": s})) is None
    assert compile_schema(nested(100_000, True, lambda s: [s])) is None


@pytest.mark.parametrize("schema, doc", [
    ({"$defs": {"a": {"$id": "https://example.com/a", "properties": {"p": {"$ref": "#/$defs/b"}},
                      "$defs": {"b": {"type": "string"}}}, "b": {"type": "integer"}},
      "$ref": "#/$defs/a"}, {"p": 1}),  # a $ref below an $id resolves against that $id
    ({"$defs": {"a b": {"type": "string"}, "a%20b": {"type": "integer"}},
      "$ref": "#/$defs/a%20b"}, 1),  # a $ref is a URI: percent-decoded
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer"}, 1.0),
])
def test_where_jsonschema_reads_a_schema_otherwise_it_alone_decides(schema: dict[str, Any],
                                                                     doc: Any) -> None:
    """Schemas the quick check used to read differently from jsonschema (and said yes)."""
    assert errors_of(for_named(schema), doc)
    assert compile_schema(schema) is None


# ---------------------------------------------------------------- the checks without jsonschema
@settings(max_examples=300, deadline=None)
@given(JSON, JSON)
def test_json_equality_is_jsonschemas(one: Any, two: Any) -> None:
    """schemachecks.equal (what enum and const use in the quick checks) answers as jsonschema's
    own equality: 1 is 1.0, true is not 1, members compare one by one."""
    from jsonschema import _utils  # type: ignore[attr-defined]

    from handoffd.core.schemachecks import equal
    assert equal(one, two) == _utils.equal(one, two)
    assert equal(one, one) and equal(copy.deepcopy(one), one)


@pytest.mark.parametrize("one, two, same", [(1, 1.0, True), (True, 1, False), (0, False, False),
                                            (None, 0, False), ([1, True], [1.0, True], True),
                                            ({"a": [1]}, {"a": [1.0]}, True), ("1", 1, False),
                                            ({"a": 1}, {"a": 1, "b": 2}, False)])
def test_json_equality_cases(one: Any, two: Any, same: bool) -> None:
    from handoffd.core.schemachecks import equal
    assert equal(one, two) is same


FORMAT_CASES = ["2026-11-25T21:26:17Z", "2026-11-25t21:26:17.5+01:00", "2026-02-30T00:00:00Z",
                "0000-01-01T00:00:00Z", "2026-11-25 21:26:17Z", "2026-11-25T24:00:00Z",
                "2026-11-25T21:26:17", "12345678-1234-5678-1234-567812345678",
                "12345678123456781234567812345678", "{12345678-1234-5678-1234-567812345678}",
                "urn:uuid:12345678-1234-5678-1234-567812345678", "1234567-81234-5678-1234-567812345678",
                "", "x", 7, None, ["2026-11-25T21:26:17Z"]]


@pytest.mark.parametrize("name", ["date-time", "uuid"])
@pytest.mark.parametrize("value", FORMAT_CASES)
def test_own_formats_answer_as_jsonschemas(name: str, value: Any) -> None:
    """The formats the quick checks answer without jsonschema agree with jsonschema's stock
    checker (with rfc3339-validator installed, as our dependencies ask)."""
    import jsonschema

    from handoffd.core.schemachecks import conforms
    assert conforms(value, name) == jsonschema.FormatChecker().conforms(value, name)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789abcdefABCDEF-:TZtz.+{}urn", max_size=45))
def test_own_formats_agree_on_drawn_strings(value: str) -> None:
    import jsonschema

    from handoffd.core.schemachecks import conforms
    from handoffd.core.timeutil import fraction_too_long
    for name in ("date-time", "uuid"):
        stock = jsonschema.FormatChecker().conforms(value, name)
        if name == "date-time" and fraction_too_long(value):  # our bound: at most 9 digits
            stock = False
        assert conforms(value, name) == stock


def test_valid_documents_never_load_jsonschema() -> None:
    """A process that checks only valid documents against the built-in schemas never imports
    jsonschema (~50 ms, and ~15 ms more per schema to check it against its metaschema); the first
    document that fails the quick check loads it, and jsonschema says why."""
    import json
    import subprocess
    import sys
    code = ("import json, sys\n"
            "from handoffd.core.validation import builtin_schemas\n"
            "schemas = builtin_schemas()\n"
            "doc = json.loads(sys.argv[1])\n"
            "assert schemas.errors('native.request.schema.json', doc) == []\n"
            "before = 'jsonschema' in sys.modules\n"
            "doc['priority'] = 'whenever'\n"
            "errors = schemas.errors('native.request.schema.json', doc)\n"
            "print(json.dumps([before, 'jsonschema' in sys.modules, [e['field'] for e in errors]]))\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(SEED_REQUEST)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after, fields = json.loads(done.stdout)
    assert before is False and after is True
    assert fields == ["priority"]


def test_a_workspace_override_of_a_built_in_schema_is_used_and_checked(tmp_path: Any) -> None:
    """Only a built-in schema as shipped skips the metaschema check: a file of the same name in
    the workspace's schemas/ wins, and is checked before it is used."""
    import json

    from handoffd.core.errors import ConfigError
    from handoffd.core.validation import SchemaCache
    name = "native.request.schema.json"
    stricter = dict(load_builtin(name))
    stricter["required"] = [*stricter.get("required", []), "ticket"]
    (tmp_path / name).write_text(json.dumps(stricter))
    cache = SchemaCache(tmp_path)
    assert ["ticket" in e["error"] for e in cache.errors(name, SEED_REQUEST)] == [True]
    assert cache.errors(name, dict(SEED_REQUEST, ticket=1)) == []
    (tmp_path / name).write_text(json.dumps({"type": 12}))
    with pytest.raises(ConfigError, match="schemas/native.request.schema.json cannot be used: "
                                          "not a valid JSON Schema"):  # checked, one line
        SchemaCache(tmp_path).errors(name, SEED_REQUEST)
