"""Hostile schemas: the workspace's schemas/ and the inline schemas documents carry.

Found by the fourth bug hunt: a named schema's ``$ref`` was fetched by jsonschema (a file outside
the workspace was read, a local server was called, a FIFO hung a worker past SIGTERM); a schema
that was JSON but no JSON Schema left its handoff in in-progress/ with a traceback; a backtracking
pattern in schemas/ fell back to Python's ``re`` and froze the daemon; a 2.8 KB inline schema
whose ``$ref``s doubled at each level kept every worker busy for ever."""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace

from handoffd.core.errors import ConfigError, InvalidDocument
from handoffd.core.jsonschema_re2 import MAX_EXPANSION, check_inline
from handoffd.core.validation import SchemaCache


def doubling(levels: int) -> dict[str, Any]:
    """Each level refers twice to the next: 2**levels subschemas once followed."""
    defs: dict[str, Any] = {f"a{levels}": {"type": "string"}}
    for i in range(levels - 1, -1, -1):
        defs[f"a{i}"] = {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def cache_with(tmp_path: Path, **schemas: Any) -> SchemaCache:
    for name, schema in schemas.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(schema))
    return SchemaCache(tmp_path)


def test_a_named_schema_refers_to_another_by_name_and_to_nothing_else(tmp_path: Path) -> None:
    secret = tmp_path.parent / "secret.json"
    secret.write_text(json.dumps({"const": "SECRET"}))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        cache = cache_with(tmp_path, outer={"properties": {"x": {"$ref": "inner.json"}}},
                           inner={"type": "string"}, file={"$ref": f"file://{secret}"},
                           web={"$ref": f"http://127.0.0.1:{port}/s.json"},
                           up={"$ref": "../secret.json"})
        assert cache.errors("outer.json", {"x": "a"}) == []
        assert cache.errors("outer.json", {"x": 5})[0]["field"] == "x"
        for name in ("file", "web", "up"):
            with pytest.raises(ConfigError, match=f"schemas/{name}.json cannot be used: .*cannot "
                                                  "be followed"):
                cache.errors(f"{name}.json", "anything")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


@pytest.mark.parametrize("schema, why", [
    ({"type": 5}, "not a valid JSON Schema"), ([], "not a valid JSON Schema"),
    ("str", "not a valid JSON Schema"),
    ({"properties": {"x": {"pattern": "^(a|a)*\\1b"}}}, "is not supported"),
    ({"patternProperties": {"(?=x)": {}}}, "is not supported"),
    (doubling(40), f"more than {MAX_EXPANSION} subschemas"),
])
def test_an_unusable_named_schema_is_one_configuration_error(tmp_path: Path, schema: Any,
                                                             why: str) -> None:
    cache = cache_with(tmp_path, bad=schema)
    with pytest.raises(ConfigError, match=f"schemas/bad.json cannot be used: .*{why}"):
        cache.errors("bad.json", {"x": "a" * 40 + "!"})


def test_a_named_schema_nested_past_the_recursion_limit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text('{"items":' * 5000 + "{}" + "}" * 5000)
    with pytest.raises(ConfigError, match="schemas/deep.json"):
        SchemaCache(tmp_path).errors("deep.json", [])


def test_an_inline_schema_that_doubles_at_each_level_is_refused() -> None:
    check_inline(doubling(10))  # 2,047 subschemas: fine
    with pytest.raises(InvalidDocument, match="more than 20000 subschemas") as caught:
        check_inline(doubling(40))
    assert caught.value.code == "SCHEMA_VALIDATION_FAILED"


def test_a_daemon_fails_what_names_a_hostile_schema_and_serves_the_rest(ws: Workspace) -> None:
    """Through `handoffd run`: each handoff naming a hostile schema fails with one line, the
    batch exits, and an unrelated handoff completes."""
    schemas = ws.root / "schemas"
    schemas.mkdir(exist_ok=True)
    (schemas / "backref.json").write_text(json.dumps({"properties": {"x": {"pattern": "^(a|a)*\\1b"}}}))
    (schemas / "remote.json").write_text(json.dumps({"$ref": "http://192.0.2.1/s.json"}))
    (schemas / "notschema.json").write_text(json.dumps({"type": 5}))
    echo = ws.root / "echo.py"
    echo.write_text("import json, sys\njson.load(sys.stdin)\n"
                    "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))\n")
    config = ""
    for name in ("backref", "remote", "notschema", "plain"):
        config += f'[specialists."@{name}"]\ncommand = ["{sys.executable}", "{echo}"]\n'
        config += f'input_schema = "{name}.json"\n\n' if name != "plain" else "\n"
    ws.write_config(config)
    for name in ("backref", "remote", "notschema", "plain"):
        ws.create("--to", f"@{name}", "--id", f"h-{name}", "--data", json.dumps({"x": "a" * 40 + "!"}))
    done = ws.handoffd("run", timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    assert ws.state_of("h-plain") == ["completed"]
    for name in ("backref", "remote", "notschema"):
        assert ws.state_of(f"h-{name}") == ["failed"], name
        error = ws.doc(f"h-{name}")["error"]
        assert f"schemas/{name}.json cannot be used" in error["message"], error


def test_every_schema_the_project_ships_is_usable() -> None:
    """The built-in schemas and the repository's own workspace schemas (`make demo`) pass the
    checks every schema now gets: RE2 patterns (the demo's artifact_path pattern used lookahead
    and had to be rewritten), $refs inside, a bounded expansion."""
    from handoffd.core.jsonschema_re2 import check_schema
    from handoffd.core.validation import builtin_schema_names, load_builtin
    for name in builtin_schema_names():
        check_schema(load_builtin(name))
    shipped = sorted((Path(__file__).resolve().parent.parent / "schemas").glob("*.json"))
    assert shipped, "the repository's schemas/ folder"
    cache = SchemaCache(shipped[0].parent)
    for path in shipped:
        cache.validator(path.name)  # ConfigError naming the file if unusable
