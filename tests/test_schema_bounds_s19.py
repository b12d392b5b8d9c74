"""Schema validation a small input made slow or unbounded (review r17, fix F1 of session 19).

- ``uniqueItems`` compared every pair of items that do not sort (objects): a 218 KB request held a
  worker for 104 s. Now each item is hashed once (fastschema.json_key), with JSON equality.
- A file of ``schemas/`` was read whole and through symlinks: a 1 GB file took 2.1 GB of memory
  (and every handoff naming it read it again), a symlink to /etc/passwd was read. Now only a
  regular file of at most MAX_SCHEMA_BYTES, and a refusal is remembered under its stat stamp.
- A ``$ref`` to another file read and parsed it at every lookup of every validation: 100
  references to a 2.3 MB schema took 18 s per handoff. Now each file is read once per build
  (and again only when it changes), and a large ``enum`` is hashed too.

No test here times anything: they count reads and comparisons, or bound a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoffd.core import fastschema, jsonschema_re2, schema_keywords, schemachecks, validation
from handoffd.core.documents import MAX_DEPTH
from handoffd.core.errors import ConfigError, InvalidDocument
from handoffd.core.fastschema import BIG_ENUM, compile_schema, is_valid, member_test, unique_items
from handoffd.core.jsonschema_re2 import MAX_SCHEMA_FILES, errors_of, for_inline
from handoffd.core.validation import MAX_SCHEMA_BYTES, SchemaCache

QUICK = dict(derandomize=True, deadline=None, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# small values that collide under Python's == but not JSON's (1 == True), and that JSON equates
# while they differ in Python (1 and 1.0), nested in arrays and objects
SCALARS = st.sampled_from([0, 1, 2, 0.0, 1.0, -0.0, 2.5, True, False, None, "", "a", "1"])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
                      max_leaves=6)


def stock_equal(one: Any, two: Any) -> bool:
    """jsonschema's own JSON equality (what its uniqueItems and enum compare with)."""
    from jsonschema import _utils  # type: ignore[attr-defined]
    return bool(_utils.equal(one, two))


def all_pairs_unique(items: list[Any]) -> bool:
    return not any(stock_equal(items[i], items[j])
                   for i in range(len(items)) for j in range(i + 1, len(items)))


def nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# ---------------------------------------------------------------- uniqueItems
@settings(max_examples=400, **QUICK)
@given(items=st.lists(VALUES, max_size=6))
def test_unique_items_answers_as_jsonschema(items: list[Any]) -> None:
    """Against jsonschema's verdict on drawn arrays (the RE2 validator, the quick check, the
    stock validator). Where jsonschema's sorting shortcut contradicts its own equality
    ([[1], [true], [1]]: it compares neighbours only, and Python sorts [true] between the two
    [1]s), the answer is its equality's."""
    import jsonschema
    from jsonschema import _utils  # type: ignore[attr-defined]
    truth = all_pairs_unique(items)
    assert unique_items(items) is truth
    stock = jsonschema.Draft202012Validator({"uniqueItems": True}).is_valid(items)
    if stock != truth:
        assert _utils.uniq(items) != truth  # only its shortcut's slip, never ours
    schema = {"uniqueItems": True}
    assert (not errors_of(for_inline(schema), items)) is truth
    quick = compile_schema(schema)
    assert quick is not None and is_valid(quick, items) is truth


@pytest.mark.parametrize("items, unique", [
    ([1, 1.0], False), ([1, True], True), ([0, False], True), ([None, None], False),
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1.0}], False), ([[1, 2], [2, 1]], True),
    (["1", 1], True), ([{"a": [1]}, {"a": [1.0]}], False), ([{"a": [True]}, {"a": [1]}], True),
    ([[1], [True], [1]], False), ([{}, []], True), ([2 ** 60, float(2 ** 60)], False),
    ([2 ** 53 + 1, float(2 ** 53)], True),
])
def test_unique_items_uses_json_equality(items: list[Any], unique: bool) -> None:
    assert unique_items(items) is unique
    errors = errors_of(for_inline({"uniqueItems": True}), items)
    assert (not errors) is unique
    if errors:
        assert errors[0]["error"] == f"{items!r} has non-unique elements"  # jsonschema's words


def counted_equal(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every call of ``equal`` (JSON equality, one pair of values)
    in every module that may compare items or enum options one pair at a time."""
    import jsonschema._keywords
    import jsonschema._utils
    calls: list[int] = []
    for module in (jsonschema._utils, jsonschema._keywords, fastschema, jsonschema_re2,
                   schema_keywords, schemachecks):
        real = getattr(module, "equal", None)
        if real is not None:
            monkeypatch.setattr(module, "equal",
                                lambda a, b, real=real: calls.append(1) or real(a, b))
    return calls


def test_unique_items_compares_no_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """300 distinct objects: jsonschema compared 44,850 pairs; now none (each hashed once)."""
    calls = counted_equal(monkeypatch)
    items = [{"k": i, "tags": ["x", i]} for i in range(300)]
    validator = for_inline({"type": "array", "uniqueItems": True})
    assert errors_of(validator, items) == []
    assert errors_of(validator, [*items, {"tags": ["x", 7], "k": 7.0}])[0]["error"].endswith(
        "has non-unique elements")
    assert len(calls) < 10, len(calls)


def test_a_key_stops_at_the_documents_depth() -> None:
    """No document nests past MAX_DEPTH levels; past them the key says "something" (no deeper
    recursion) and only items with the same key are compared."""
    assert fastschema.KEY_DEPTH == MAX_DEPTH
    deep = nested(100_000, 1)
    loose = [False]
    fastschema.json_key(deep, loose)  # no RecursionError: it stops at MAX_DEPTH
    assert loose[0]
    assert unique_items([deep, 1, "x"])
    assert unique_items([nested(MAX_DEPTH + 5, 1), nested(MAX_DEPTH + 5, 2)])
    assert not unique_items([nested(MAX_DEPTH + 5, 1), nested(MAX_DEPTH + 5, 1.0)])
    assert not unique_items([nested(MAX_DEPTH - 1, 1), nested(MAX_DEPTH - 1, 1.0)])


def test_a_large_array_of_objects_is_checked_in_a_bounded_time(tmp_path: Path) -> None:
    """50,000 distinct objects (jsonschema: hours), in a subprocess bounded by its timeout."""
    code = ("from handoffd.core.jsonschema_re2 import for_inline, errors_of\n"
            "items = [{'k': i, 's': str(i)} for i in range(50000)]\n"
            "v = for_inline({'uniqueItems': True})\n"
            "assert errors_of(v, items) == []\n"
            "assert errors_of(v, items + [{'s': '9', 'k': 9.0}])\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_daemon_checks_a_long_unique_list_of_a_request(ws: Workspace) -> None:
    """Through `handoffd run`: a workspace input schema with uniqueItems and a request whose
    list holds 30,000 objects (it held a worker for minutes), and one with a repeat."""
    schemas = ws.root / "schemas"
    schemas.mkdir(exist_ok=True)
    (schemas / "list.json").write_text(json.dumps(
        {"type": "object", "properties": {"items": {"type": "array", "uniqueItems": True}}}))
    echo = ws.root / "echo.py"
    echo.write_text("import json, sys\njson.load(sys.stdin)\n"
                    "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))\n")
    ws.write_config(f'[specialists."@list"]\ncommand = ["{sys.executable}", "{echo}"]\n'
                    'input_schema = "list.json"\n')
    items = [{"k": i, "v": [i, str(i)]} for i in range(30_000)]
    for name, data in (("h-unique", {"items": items}),
                       ("h-repeat", {"items": [*items, {"v": [5, "5"], "k": 5.0}]})):
        (ws.root / f"{name}.json").write_text(json.dumps(data))
        ws.create("--to", "@list", "--id", name, "--input", str(ws.root / f"{name}.json"))
    done = ws.handoffd("run", timeout=240)
    assert "Traceback" not in done.stderr, done.stderr
    assert ws.state_of("h-unique") == ["completed"]
    assert ws.state_of("h-repeat") == ["failed"]
    error = ws.doc("h-repeat")["error"]
    assert error["code"] == "SCHEMA_VALIDATION_FAILED"
    assert "has non-unique elements" in error["message"]


# ---------------------------------------------------------------- enum, hashed when large
@settings(max_examples=300, **QUICK)
@given(options=st.lists(VALUES, min_size=BIG_ENUM, max_size=BIG_ENUM + 4), value=VALUES)
def test_a_large_enum_answers_as_jsonschema(options: list[Any], value: Any) -> None:
    import jsonschema
    truth = any(stock_equal(option, value) for option in options)
    assert member_test(options)(value) is truth
    schema = {"enum": options}
    assert jsonschema.Draft202012Validator(schema).is_valid(value) is truth
    assert (not errors_of(for_inline(schema), value)) is truth
    quick = compile_schema(schema)
    assert quick is not None and is_valid(quick, value) is truth


def test_a_large_enum_says_what_jsonschema_says_cut() -> None:
    options = list(range(1000))
    errors = errors_of(for_inline({"enum": options}), -1)
    assert errors[0]["error"].startswith("-1 is not one of [0, 1, 2, 3")
    assert len(errors[0]["error"]) <= jsonschema_re2.MAX_MESSAGE
    small = errors_of(for_inline({"enum": ["pending", "in_progress"]}), "x")
    assert small[0]["error"] == "'x' is not one of ['pending', 'in_progress']"


# ---------------------------------------------------------------- files of schemas/
def schemas_with(folder: Path, **files: Any) -> SchemaCache:
    folder.mkdir(exist_ok=True)
    for name, schema in files.items():
        (folder / f"{name}.json").write_text(json.dumps(schema))
    return SchemaCache(folder)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The schema files parsed from now on (their text through validation's json.loads)."""
    parsed: list[str] = []

    def loads(text: Any, **kwargs: Any) -> Any:
        parsed.append(text if isinstance(text, str) else text.decode())
        return json.loads(text, **kwargs)
    monkeypatch.setattr(validation, "json", types.SimpleNamespace(loads=loads, dumps=json.dumps))
    return parsed


def test_a_schema_file_is_never_read_through_a_link_nor_past_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"const": "SECRET"}))
    folder = tmp_path / "schemas"
    cache = schemas_with(folder, uses_link={"$ref": "link.json"}, fine={"type": "integer"})
    (folder / "link.json").symlink_to(outside)
    (folder / "passwd.json").symlink_to("/etc/passwd")
    os.mkfifo(folder / "fifo.json")
    (folder / "dir.json").mkdir()
    with open(folder / "huge.json", "wb") as huge:
        huge.truncate(MAX_SCHEMA_BYTES + 1)
    sizes: list[int] = []
    real = validation.read_regular
    monkeypatch.setattr(validation, "read_regular",
                        lambda *a, **k: sizes.append(a[1]) or real(*a, **k))
    why = {"link": "is a symlink", "passwd": "is a symlink", "fifo": "is not a regular file",
           "dir": "is not a regular file", "huge": "is larger than 4 MiB",
           "uses_link": "refers to a schema that cannot be used: schemas/link.json is a symlink"}
    for name, message in why.items():
        assert cache.has(f"{name}.json")  # there: using it says why it is refused
        with pytest.raises(ConfigError, match=f"schemas/{name}.json {message}") as caught:
            cache.errors(f"{name}.json", "SECRET")
        assert "\n" not in str(caught.value)
    assert set(sizes) == {MAX_SCHEMA_BYTES}  # every read bounded
    assert cache.errors("fine.json", 1) == []


def test_a_refused_schema_is_not_read_again_until_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "schemas"
    cache = schemas_with(folder, bad={"type": 5}, refers={"$ref": "missing.json"})
    (folder / "notjson.json").write_text("{")
    opened: list[str] = []
    real = validation.read_regular
    monkeypatch.setattr(validation, "read_regular",
                        lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    for _ in range(5):
        for name in ("bad", "refers", "notjson"):
            with pytest.raises(ConfigError, match=f"schemas/{name}.json"):
                cache.errors(f"{name}.json", {})
    assert sorted(opened) == ["bad.json", "notjson.json", "refers.json"]  # once each
    (folder / "bad.json").write_text(json.dumps({"type": "object"}))  # fixed: used at once
    (folder / "missing.json").write_text(json.dumps({"type": "string"}))  # now there
    assert cache.errors("bad.json", {}) == []
    assert cache.errors("refers.json", "s") == []
    assert cache.errors("refers.json", {})[0]["error"] == "{} is not of type 'string'"


def test_a_schema_folder_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "s.json").write_text(json.dumps({"type": "string"}))
    (tmp_path / "schemas").symlink_to(real)
    with pytest.raises(ConfigError, match="schemas/ is not a plain folder"):
        SchemaCache(tmp_path / "schemas").errors("s.json", 1)


def test_a_daemon_fails_a_huge_or_linked_schema_with_one_line(ws: Workspace) -> None:
    """Through `handoffd run`: a 1 GiB (sparse) schema file and a symlink to /etc/passwd; each
    handoff naming one fails with one line, an unrelated one completes."""
    schemas = ws.root / "schemas"
    schemas.mkdir(exist_ok=True)
    with open(schemas / "huge.json", "wb") as huge:
        huge.truncate(1 << 30)
    (schemas / "pw.json").symlink_to("/etc/passwd")
    echo = ws.root / "echo.py"
    echo.write_text("import json, sys\njson.load(sys.stdin)\n"
                    "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))\n")
    config = ""
    for name in ("huge", "pw", "plain"):
        config += f'[specialists."@{name}"]\ncommand = ["{sys.executable}", "{echo}"]\n'
        config += f'input_schema = "{name}.json"\n\n' if name != "plain" else "\n"
    ws.write_config(config)
    for name in ("huge", "pw", "plain"):
        ws.create("--to", f"@{name}", "--id", f"h-{name}", "--data", "{}")
    done = ws.handoffd("run", timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert ws.state_of("h-plain") == ["completed"]
    for name, why in (("huge", "is larger than 4 MiB"), ("pw", "is a symlink")):
        assert ws.state_of(f"h-{name}") == ["failed"]
        message = ws.doc(f"h-{name}")["error"]["message"]
        assert f"schemas/{name}.json {why}" in message and "root:" not in message, message


# ---------------------------------------------------------------- $ref to other files
def test_a_referenced_file_is_read_once_not_at_every_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "schemas"
    cache = schemas_with(folder, big={"enum": list(range(5000))},
                         a={"allOf": [{"$ref": "big.json"}] * 100})
    parsed = count_reads(monkeypatch)
    for value in (5, 4999, -1, "x", 7):
        assert bool(cache.errors("a.json", value)) is (value in (-1, "x"))
    assert len(parsed) == 2  # a.json and big.json, once each (it was 100 reads per check)


def test_a_large_enum_behind_many_refs_compares_nothing_one_by_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted_equal(monkeypatch)
    cache = schemas_with(tmp_path / "schemas", big={"enum": list(range(3000))},
                         a={"allOf": [{"$ref": "big.json"}] * 100})
    errors = cache.errors("a.json", -1)
    assert errors[0]["error"].startswith("-1 is not one of [0, 1, 2")
    assert cache.errors("a.json", 2999) == []
    assert len(calls) < 100, len(calls)  # was 100 x 3000 per check


def test_an_edited_schema_or_referenced_file_is_used_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "schemas"
    cache = schemas_with(folder, inner={"type": "string"},
                         outer={"properties": {"x": {"$ref": "inner.json"}}})
    assert cache.errors("outer.json", {"x": "s"}) == []
    assert cache.errors("outer.json", {"x": 1})
    (folder / "inner.json").write_text(json.dumps({"type": "integer"}))
    assert cache.errors("outer.json", {"x": 1}) == []
    assert cache.errors("outer.json", {"x": "s"})
    (folder / "outer.json").write_text(json.dumps({"properties": {"y": {"$ref": "inner.json"}}}))
    assert cache.errors("outer.json", {"x": "s"}) == []
    assert cache.errors("outer.json", {"y": "s"})


def test_the_files_a_schema_reaches_are_bounded_together(tmp_path: Path) -> None:
    folder = tmp_path / "schemas"
    third = MAX_SCHEMA_BYTES // 3 + 10
    cache = schemas_with(folder, a={"allOf": [{"$ref": "b.json"}, {"$ref": "c.json"}]},
                         b={"description": "b" * third}, c={"description": "c" * third},
                         d={"description": "d" * third},
                         two={"allOf": [{"$ref": f"{n}.json"} for n in "bdc"]})
    assert cache.errors("a.json", 1) == []
    with pytest.raises(ConfigError, match="may hold 4 MiB together"):
        cache.errors("two.json", 1)
    chain = {f"f{i}": {"$ref": f"f{i + 1}.json"} for i in range(MAX_SCHEMA_FILES + 1)}
    chain[f"f{MAX_SCHEMA_FILES + 1}"] = {"type": "string"}
    cache = schemas_with(tmp_path / "chain", **chain)
    with pytest.raises(ConfigError, match=f"more than {MAX_SCHEMA_FILES} schema files"):
        cache.errors("f0.json", 1)
    assert cache.errors("f1.json", "s") == []  # 100 others: fine


@pytest.mark.parametrize("inner, why", [
    ({"type": 5}, "not a valid JSON Schema"), ({"minimum": "x"}, "not a valid JSON Schema"),
    ({"pattern": "(?=x)"}, "is not supported"), ({"$schema": 5}, "not a valid JSON Schema"),
])
def test_a_referenced_file_is_checked_as_the_schema_is(tmp_path: Path, inner: Any,
                                                       why: str) -> None:
    """It used to reach validation unchecked and end it with a TypeError (a traceback)."""
    cache = schemas_with(tmp_path / "schemas", inner=inner, outer={"$ref": "inner.json"})
    with pytest.raises(ConfigError, match=f"schemas/outer.json cannot be used: .*{why}"):
        cache.errors("outer.json", 5)


@pytest.mark.parametrize("dialect", [5, None, ["a"]])
def test_an_inline_schema_whose_dialect_is_no_string_is_refused(dialect: Any) -> None:
    """{"$schema": 5} made jsonschema fail with an AttributeError."""
    with pytest.raises(InvalidDocument, match="not a valid JSON Schema") as caught:
        for_inline({"$schema": dialect})
    assert caught.value.code == "SCHEMA_VALIDATION_FAILED"


def test_the_reproduction_of_r17_completes(tmp_path: Path) -> None:
    """r17's schemas: a process checks 20 values against a schema with 100 references to a
    300,000-option enum, bounded by its timeout (each wrong value took 14 to 50 s)."""
    folder = tmp_path / "schemas"
    schemas_with(folder, big={"enum": list(range(300_000))},
                 a={"allOf": [{"$ref": "big.json"}] * 100})
    code = ("import sys\nfrom pathlib import Path\n"
            "from handoffd.core.validation import SchemaCache\n"
            "cache = SchemaCache(Path(sys.argv[1]))\n"
            "values = [5, -1, 'x', 299999, {}, *range(-15, 0)]\n"
            "print(sum(bool(cache.errors('a.json', v)) for v in values))\n")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "18"  # all but 5 and 299999
