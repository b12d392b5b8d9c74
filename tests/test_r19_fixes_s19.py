"""Review 19's findings, fixed in session 19 (helper f6).

- Schemas: a ``$ref`` under a property or a ``$defs`` entry *named* ``default``, ``enum``,
  ``const`` or ``examples`` was not followed (the walk that finds the files a named schema
  refers to skipped the value under any key spelled like a data keyword): valid data was
  refused as "Unresolvable: b.json", or the schema "cannot be used". The walk reads a schema
  by meaning now, and so does the count that bounds a schema's expansion (a property called
  ``default`` or ``title`` hid its subschemas from the bound; one called ``$id`` crashed it).
- Quarantine: the entry was renamed in before its reason was published, and a listing
  between the two showed it as "reason unreadable: no .reason.json beside it".
- MCP over HTTP refused (400) a JSON-RPC *response* whose id is null (a client reporting a
  parse error): only a request's id is judged now, as on stdio.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, new_workspace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_r17_fixes_s19 import Stdio, _post, http_port, http_session  # noqa: F401  (a fixture used below)

from handoffd.backends.files import quarantine
from handoffd.backends.files.quarantine import move_to_quarantine, publish_reason
from handoffd.backends.files.reading import quarantined
from handoffd.core.errors import InvalidDocument
from handoffd.core.fastschema import compile_schema, is_valid
from handoffd.core.jsonschema_re2 import (MAX_EXPANSION, errors_of, for_inline, for_named,
                                          referenced_names)
from handoffd.core.validation import SchemaCache
from handoffd.core.workspace import Workspace as HandoffdWorkspace

B = {"type": "string"}
A2 = {"type": "object", "properties": {"default": {"$ref": "b.json"}}}
A3 = {"type": "object", "$defs": {"enum": {"$ref": "b.json"}},
      "properties": {"x": {"$ref": "#/$defs/enum"}}}
DATA_NAMES = ["default", "enum", "const", "examples"]


# ---------------------------------------------------------------- $ref under a data-like name
def cache_of(folder: Path, **files: Any) -> SchemaCache:
    folder.mkdir()
    for name, schema in files.items():
        (folder / f"{name}.json").write_text(json.dumps(schema))
    return SchemaCache(folder)


def test_the_reviewers_two_schemas_validate(tmp_path: Path) -> None:
    cache = cache_of(tmp_path / "schemas", a2=A2, a3=A3, b=B)
    assert cache.errors("a2.json", {"default": "s"}) == []
    assert [e["error"] for e in cache.errors("a2.json", {"default": 5})] \
        == ["5 is not of type 'string'"]
    assert cache.errors("a3.json", {"x": "s"}) == []
    assert [e["error"] for e in cache.errors("a3.json", {"x": 5})] == ["5 is not of type 'string'"]


@pytest.mark.parametrize("name", DATA_NAMES)
def test_every_name_map_is_read_by_meaning(name: str) -> None:
    """Under each keyword whose value maps names to schemas, an entry called like a data
    keyword is a schema; the data keywords themselves still name no file."""
    for schema in ({"properties": {name: {"$ref": "p.json"}}},
                   {"patternProperties": {name: {"$ref": "p.json"}}},
                   {"$defs": {name: {"$ref": "p.json"}}},
                   {"definitions": {name: {"$ref": "p.json"}}},
                   {"dependentSchemas": {name: {"$ref": "p.json"}}},
                   {"dependencies": {name: {"$ref": "p.json"}}},
                   {"properties": {"a": {"properties": {name: {"items": {"$ref": "p.json"}}}}}},
                   {"x-unknown": {"properties": {name: {"$ref": "p.json"}}}}):
        assert referenced_names(schema) == ["p.json"], schema
    data = {name: {"$ref": "not-loaded.json"}, "properties": {"p": {
        name: [{"$ref": "not-loaded.json"}], "$ref": "p.json"}}}
    assert referenced_names(data) == ["p.json"]


def test_the_quick_check_reads_names_as_names() -> None:
    """fastschema compiles a property or definition called "default" or "enum" as a schema
    (it walks keywords, never the names under them): it was right, and stays so."""
    schema = {"$defs": {"enum": {"type": "string"}}, "default": {"$ref": "missing.json"},
              "properties": {"default": {"type": "integer"}, "enum": {"$ref": "#/$defs/enum"}}}
    quick = compile_schema(schema)
    assert quick is not None
    for value, valid in (({"default": 1, "enum": "s"}, True), ({"default": "s"}, False),
                         ({"enum": 1}, False)):
        assert is_valid(quick, value) is valid
        assert (not errors_of(for_inline(schema), value)) is valid


def test_the_expansion_bound_counts_a_property_whatever_its_name() -> None:
    """Each level refers twice to the next (2**20 subschemas once followed): refused whatever
    the name of the property that uses it. Named "default" or "title", it went uncounted."""
    levels: dict[str, Any] = {f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}] * 2}
                              for i in range(20)}
    levels["l20"] = {"type": "string"}
    for name in ("x", "default", "title", "enum", "$defs", "description"):
        schema = {"$defs": levels, "properties": {name: {"$ref": "#/$defs/l0"}}}
        with pytest.raises(InvalidDocument, match=f"more than {MAX_EXPANSION} subschemas"):
            for_inline(schema)


@pytest.mark.parametrize("schema, good, bad", [
    ({"properties": {"$id": {"type": "string"}}}, {"$id": "s"}, {"$id": 5}),
    ({"properties": {"$id": {"$ref": "#/$defs/s"}}, "$defs": {"s": {"type": "string"}}},
     {"$id": "s"}, {"$id": 5}),
    ({"x-unknown": {"$id": 5, "type": "string"}, "properties": {"a": {"$ref": "#/x-unknown"}}},
     {"a": "s"}, {"a": 5}),
])
def test_a_property_called_id_is_no_base_uri(schema: Any, good: Any, bad: Any) -> None:
    """The count entered the properties map itself as a schema: a property called "$id" (or an
    unknown keyword's "$id" of 5) ended it with an AttributeError."""
    validator = for_inline(schema)
    assert errors_of(validator, good) == []
    assert [e["error"] for e in errors_of(validator, bad)] == ["5 is not of type 'string'"]


# a schema drawn with names from the data keywords (and a few others) in every place a name
# goes, referring to the files of FILES and to its own definitions
NAMES = st.sampled_from([*DATA_NAMES, "title", "x"])
FILES = {"b.json": B, "c.json": {"properties": {"default": {"$ref": "b.json"}},
                                 "default": {"$ref": "missing.json"}},
         "n.json": {"type": "integer", "enum": [1, 2, {"$ref": "missing.json"}]}}
LEAVES = st.sampled_from([{"$ref": "b.json"}, {"$ref": "c.json"}, {"$ref": "n.json"},
                          {"type": "integer"}, {"type": "string"}, True])


@st.composite
def schemas(draw: Any) -> dict[str, Any]:
    defs = draw(st.dictionaries(NAMES, LEAVES, max_size=3))
    refs = st.sampled_from([f"#/$defs/{name}" for name in defs]).map(lambda r: {"$ref": r}) \
        if defs else LEAVES
    sub = LEAVES | refs | st.builds(lambda p: {"type": "object", "properties": p},
                                    st.dictionaries(NAMES, LEAVES | refs, max_size=2))
    schema: dict[str, Any] = {"type": "object",
                              "properties": draw(st.dictionaries(NAMES, sub, max_size=4))}
    if defs:
        schema["$defs"] = defs
    if draw(st.booleans()):  # data keywords of the schema itself: a "$ref" there is data
        schema["default"] = {"$ref": "missing.json"}
        schema["examples"] = [{"$ref": "missing.json"}]
    return schema


VALUES = st.sampled_from([1, 2, "s", None, {"default": "s"}, {"default": 1}, {}])


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas(), instance=st.dictionaries(NAMES, VALUES, max_size=4))
def test_named_schemas_validate_as_jsonschema_does(schema: dict[str, Any],
                                                   instance: dict[str, Any]) -> None:
    """Against jsonschema's own validator with a registry of the files: the same verdict, and
    no file is read but those the schema's $refs name (missing.json is only ever data)."""
    import jsonschema
    import referencing
    import referencing.jsonschema
    registry = referencing.Registry().with_resources(
        (name, referencing.jsonschema.DRAFT202012.create_resource(contents))
        for name, contents in FILES.items())
    truth = jsonschema.Draft202012Validator(schema, registry=registry).is_valid(instance)
    loaded: list[str] = []

    def load(name: str) -> Any:
        loaded.append(name)
        return FILES[name]
    assert (not errors_of(for_named(schema, load), instance)) is truth
    assert "missing.json" not in loaded
    quick = compile_schema(schema)  # (None when it refers to another file: jsonschema alone)
    if quick is not None and is_valid(quick, instance):
        assert truth


def _echo_workspace(root: Path) -> Workspace:
    """A workspace whose @a2 and @a3 echo specialists take input under schemas a2 and a3."""
    ws = new_workspace(root, "")
    schemas = ws.root / "schemas"
    schemas.mkdir(exist_ok=True)
    for name, schema in (("a2", A2), ("a3", A3), ("b", B)):
        (schemas / f"{name}.json").write_text(json.dumps(schema))
    echo = ws.root / "echo.py"
    echo.write_text("import json, sys\njson.load(sys.stdin)\n"
                    "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))\n")
    ws.write_config("".join(f'[specialists."@{name}"]\ncommand = ["{sys.executable}", "{echo}"]\n'
                            f'input_schema = "{name}.json"\n\n' for name in ("a2", "a3")))
    return ws


def test_a_daemon_runs_handoffs_under_the_reviewers_schemas(tmp_path: Path) -> None:
    ws = _echo_workspace(tmp_path / "ws")
    try:
        for handoff_id, to, data in (("h-a2", "@a2", {"default": "s"}), ("h-a3", "@a3", {"x": "s"}),
                                     ("h-a2-bad", "@a2", {"default": 5}),
                                     ("h-a3-bad", "@a3", {"x": 5})):
            ws.create("--to", to, "--id", handoff_id, "--data", json.dumps(data))
        done = ws.handoffd("run", timeout=120)
        assert "Traceback" not in done.stderr, done.stderr
        assert ws.state_of("h-a2") == ["completed"] and ws.state_of("h-a3") == ["completed"]
        for handoff_id in ("h-a2-bad", "h-a3-bad"):
            assert ws.state_of(handoff_id) == ["failed"]
            error = ws.doc(handoff_id)["error"]
            assert error["code"] == "SCHEMA_VALIDATION_FAILED", error
            assert "5 is not of type 'string'" in json.dumps(error), error
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- quarantine: reason first
@pytest.fixture
def hws(tmp_path: Path) -> HandoffdWorkspace:
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    return ws


def test_a_listing_during_a_set_aside_never_shows_it_without_its_reason(
        hws: HandoffdWorkspace) -> None:
    """What `handoff ls --state quarantined` sees at each step of a set-aside: before the
    reason is published, after, and once the entry is in (r19's race.py)."""
    bad = hws.root / "handoffs" / "pending" / "bad.json"
    bad.write_text("{")
    seen = []

    def publish(dst: Path, data: bytes) -> None:
        seen.append(quarantined(hws))
        publish_reason(dst, data)
        seen.append(quarantined(hws))
    target = move_to_quarantine(hws.quarantine, bad, "MALFORMED_JSON", "not JSON", publish)
    assert seen == [[], []]
    listed = quarantined(hws)
    assert [(e["stored_as"], e["code"], e["file"]) for e in listed] \
        == [(target.name, "MALFORMED_JSON", "bad.json")]


def test_a_failed_move_leaves_no_reason_and_a_failed_publish_no_empty_one(
        hws: HandoffdWorkspace) -> None:
    gone = hws.root / "handoffs" / "pending" / "gone.json"
    with pytest.raises(FileNotFoundError):
        move_to_quarantine(hws.quarantine, gone, "MALFORMED_JSON", "x", publish_reason)
    assert os.listdir(hws.quarantine) == [] and quarantined(hws) == []

    def failing(dst: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")
    full = hws.root / "handoffs" / "pending" / "full.json"
    full.write_text("{")
    with pytest.raises(OSError, match="No space"):  # raised, the entry moved (as it always was)
        move_to_quarantine(hws.quarantine, full, "MALFORMED_JSON", "x", failing)
    [entry] = os.listdir(hws.quarantine)
    assert entry.endswith("-full.json") and not full.exists()
    assert quarantined(hws)[0]["message"] == "reason unreadable: no .reason.json beside it"


def test_an_orphan_reason_is_no_entry(hws: HandoffdWorkspace) -> None:
    """A crash between publishing the reason and renaming the entry in leaves a reason alone."""
    folder = hws.quarantine
    folder.mkdir(exist_ok=True)
    (folder / "20260101T000000-0a0b0c0d-x.json.reason.json").write_text(
        json.dumps({"code": "MALFORMED_JSON", "message": "m"}))
    assert quarantined(hws) == []


SECOND = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_two_set_asides_drawing_the_same_name_never_share_it(
        hws: HandoffdWorkspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The random part drawn alike for two set-asides of the same name at the same second: the
    second takes another name, and each reason stays with its own entry. A name whose entry is
    there without its reason is not taken either."""
    draws = iter([b"\0\0\0\1", b"\0\0\0\1", b"\0\0\0\2", b"\0\0\0\2", b"\0\0\0\3"])
    real = os.urandom  # (the 4 random bytes of a name drawn from ``draws``, all else real)
    monkeypatch.setattr(quarantine.os, "urandom", lambda n: next(draws) if n == 4 else real(n))
    pending = hws.root / "handoffs" / "pending"
    moved = []
    for n, code in enumerate(("MALFORMED_JSON", "UNSAFE_ID")):
        (pending / "same.json").write_text(str(n))
        moved.append(move_to_quarantine(hws.quarantine, pending / "same.json", code, f"n{n}",
                                        publish_reason, now=SECOND))
    assert [p.name for p in moved] == ["20260101T000000-00000001-same.json",
                                       "20260101T000000-00000002-same.json"]
    os.unlink(hws.quarantine / f"{moved[1].name}.reason.json")  # its entry alone, no reason
    (pending / "same.json").write_text("2")
    third = move_to_quarantine(hws.quarantine, pending / "same.json", "MALFORMED_JSON", "n2",
                               publish_reason, now=SECOND)
    assert third.name == "20260101T000000-00000003-same.json"
    for path, n in ((moved[0], 0), (third, 2)):
        reason = json.loads((hws.quarantine / f"{path.name}.reason.json").read_text())
        assert reason["message"] == f"n{n}" and path.read_text() == str(n)
    assert moved[1].read_text() == "1"


# ---------------------------------------------------------------- MCP: a response's null id
RESPONSES = [b'{"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": "Parse error"}}',
             b'{"jsonrpc": "2.0", "id": null, "error": {"code": -32600, "message": "x"}}']


def test_http_passes_a_response_with_a_null_id_on_to_the_sdk() -> None:
    pytest.importorskip("mcp")
    from handoffd.service.mcp_http import AnswerUnusableIds
    from handoffd.service.mcp_stdio import id_problem, refuse

    def through(inner: Any, scope: Any, receive: Any, send: Any) -> Any:
        return AnswerUnusableIds(inner, 20_000)(scope, receive, send)
    for body in RESPONSES:
        assert id_problem(body) is None and refuse(body.decode()) is None
        sent, reached = _post(through, body, chunk=9)
        assert reached == body and sent[0]["status"] == 202, sent
    request = b'{"jsonrpc": "2.0", "id": null, "method": "ping"}'  # a request's: judged
    sent, reached = _post(through, request)
    assert reached is None and sent[0]["status"] == 400


def test_stdio_takes_a_response_with_a_null_id_and_answers_on(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    (tmp_path / "ws" / "handoffs" / "pending").mkdir(parents=True)
    server = Stdio(tmp_path / "ws")
    try:
        hello = server.ask(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                                       "params": {"protocolVersion": "2025-06-18",
                                                  "capabilities": {},
                                                  "clientInfo": {"name": "t", "version": "1"}}
                                       }).encode())
        assert hello["id"] == 0 and "result" in hello
        assert server.proc.stdin is not None
        server.proc.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        for body in RESPONSES:
            server.proc.stdin.write(body + b"\n")  # a response: nothing answers it
        answer = server.ask(b'{"jsonrpc": "2.0", "id": 12, "method": "ping"}')
        assert answer == {"jsonrpc": "2.0", "id": 12, "result": {}}, answer  # the next line
    finally:
        server.close()


def test_http_sessions_take_a_response_with_a_null_id(http_port: int) -> None:  # noqa: F811
    conn, heads = http_session(http_port)
    conn.request("POST", "/mcp", RESPONSES[0], heads)
    taken = conn.getresponse()
    taken.read()
    assert taken.status == 202
    conn.close()
