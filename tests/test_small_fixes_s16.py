"""Three small fixes (session 16).

1. Schema errors were sorted by their path as text: ``items[10]`` came before ``items[2]``.
2. A rate bucket record with a negative token count (which handoffd never writes) was clamped
   to ``-count``: a forged ``rates.json`` held a specialist back about two periods.
3. ``handoff validate`` outside a workspace said "valid" for a request naming schemas that it
   could not find (they live in a workspace's ``schemas/``), so never checked."""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from conftest import Clock, exe
from jsonschema.exceptions import ValidationError

from handoffd.backends.memory import MemoryBackend
from handoffd.core.config import Rate
from handoffd.core.errors import InvalidDocument
from handoffd.core.jsonschema_re2 import check_inline, errors_of
from handoffd.core.validation import builtin_schemas, check_document
from handoffd.core.workspace import Workspace
from handoffd.dialects import by_name
from handoffd.features import rates

LISTED = 100  # jsonschema_re2.MAX_ERRORS


# ------------------------------------------------------------------ 1. errors in path order
def test_errors_are_listed_with_indexes_in_numeric_order() -> None:
    validator = check_inline({"type": "object", "properties": {"data": {"type": "object",
                              "properties": {"items": {"type": "array",
                                                       "items": {"type": "string"}}}}}})
    fields = [e["field"] for e in errors_of(validator, {"data": {"items": [1] * 12}})]
    assert fields == [f"data.items[{i}]" for i in range(12)]


def test_indexes_come_before_names_and_names_compare_as_text() -> None:
    # found in schema order (b first); listed in path order: a's items by number, then b
    validator = check_inline({"properties": {"b": {"type": "string"},
                                             "a": {"type": "array", "items": {"type": "string"}}}})
    fields = [e["field"] for e in errors_of(validator, {"b": 1, "a": [1] * 11})]
    assert fields == [f"a[{i}]" for i in range(11)] + ["b"]


def test_a_path_mixing_indexes_and_names_sorts_without_a_type_error() -> None:
    paths: list[list[Any]] = [["x", "k"], ["x", 10], [3], ["x", 2], ["2"], [], ["x", "10"]]

    class Mixed:
        """A validator reporting errors at index and name paths under one key."""

        def iter_errors(self, instance: Any) -> Iterator[ValidationError]:
            for path in paths:
                yield ValidationError(f"wrong at {path}", path=path, validator="type")

    fields = [e["field"] for e in errors_of(Mixed(), {})]  # type: ignore[arg-type]
    assert fields == ["$", "[3]", "2", "x[2]", "x[10]", "x.10", "x.k"]


def test_a_cut_list_keeps_the_first_hundred_in_path_order_and_ends_with_its_marker() -> None:
    validator = check_inline({"type": "array", "items": {"type": "string"}})
    entries = errors_of(validator, [1] * 250)
    assert [e["field"] for e in entries[:LISTED]] == [f"[{i}]" for i in range(LISTED)]
    assert entries[-1]["field"] == "$" and entries[-1]["error"].startswith("... and more")
    assert len(entries) == LISTED + 1


def test_a_native_documents_errors_name_the_lowest_index_first() -> None:
    doc = {"handoff_id": "order-1", "status": "pending", "source": {"agent_id": "@o"},
           "target": {"agent_id": "@echo"}, "input": {"data": {}}, "depends_on": [1] * 12}
    with pytest.raises(InvalidDocument) as caught:
        check_document(builtin_schemas(), by_name("native"), doc)
    fields = [e["field"] for e in caught.value.errors]
    assert fields == [f"depends_on[{i}]" for i in range(12)], fields
    assert "depends_on[0]:" in str(caught.value)


# ------------------------------------------------------------------ 2. negative rate buckets
def _spec(rate: Rate) -> Any:
    return SimpleNamespace(agent="@e", config=SimpleNamespace(rate=rate))


@pytest.mark.parametrize("tokens", [-5.0, -1, -0.5, -1e-9, -1e300])
def test_a_bucket_with_a_negative_count_is_forged_and_read_as_full(tokens: float) -> None:
    """-5.0 under 1/h read as -1: `next start in 2h`, two periods held back by a forged record."""
    clock = Clock()
    stamp = clock().timestamp()
    records = MemoryBackend().records()
    records.update("rates", "@e", lambda old: {"tokens": tokens, "at": stamp, "rate": "1/h"})
    limits = rates.RateLimits(records)
    spec = _spec(Rate(1, 3600.0))
    assert limits.note(spec, clock()) is None  # a full bucket: a token is there
    assert limits.limit(spec, clock()) == 0.0  # ... and the start takes it
    assert records.read("rates")["@e"]["tokens"] == 0.0  # the record is sane again
    assert limits.limit(spec, clock()) == 3600.0  # and the rate holds from there


def test_a_bucket_handoffd_writes_never_holds_a_negative_count() -> None:
    """What makes a negative count forged: every take leaves the bucket at 0 or more."""
    clock = Clock()
    records = MemoryBackend().records()
    limits = rates.RateLimits(records, monotonic=lambda: clock().timestamp())
    spec = _spec(Rate(3, 2.0))
    steps = random.Random(16)
    for _ in range(2_000):
        wait = limits.limit(spec, clock())
        assert records.read("rates")["@e"]["tokens"] >= 0.0
        # sometimes early (a start that must wait), sometimes exactly on time or late
        clock.advance(steps.choice([0.0, wait, wait * steps.random(), steps.random() * 3]))


def test_a_sane_empty_bucket_still_holds_starts_back() -> None:
    clock = Clock()
    stamp = clock().timestamp()
    records = MemoryBackend().records()
    records.update("rates", "@e", lambda old: {"tokens": 0.0, "at": stamp, "rate": "1/h"})
    assert rates.RateLimits(records).limit(_spec(Rate(1, 3600.0)), clock()) == 3600.0


# ------------------------------------------------------------------ 3. validate outside a workspace
NAMED = "react-specialist.input.schema.json"
OUTPUT = "react-specialist.output.schema.json"


def _request(hid: str, **named: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "status": "pending", "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@react"}, "input": {"data": {"x": 1}}}
    if "input" in named:
        doc["input"]["schema"] = named["input"]
    if "output" in named:
        doc["expected_output"] = {"schema": named["output"]}
    return doc


def _validate(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HANDOFFD_ROOT"}
    return subprocess.run([exe("handoff"), "validate", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env=env)


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    """A folder (no workspace) of requests: one naming two schemas, one naming none, one bad."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "named.json").write_text(json.dumps(_request("n1", input=NAMED, output=OUTPUT)))
    (folder / "plain.json").write_text(json.dumps(_request("p1")))
    (folder / "bad.json").write_text(json.dumps({**_request("b1"), "priority": "urgent!"}))
    return folder


def test_outside_a_workspace_a_named_schema_is_said_unchecked_and_exits_3(docs: Path) -> None:
    proc = _validate(docs, "named.json")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"named.json: not checked (native): input.schema names '{NAMED}'")
    assert f"no workspace at {docs.resolve()}" in lines[0] and "--root DIR" in lines[0]
    assert lines[1].startswith(f"  input.schema: {NAMED} not checked")
    assert lines[2].startswith(f"  expected_output.schema: {OUTPUT} not checked")
    assert "valid (" not in proc.stdout and proc.stderr == ""
    item = json.loads(_validate(docs, "--json", "named.json").stdout)[0]
    assert item["valid"] is False and item["unchecked"] == [NAMED, OUTPUT]
    assert [e["field"] for e in item["errors"]] == ["input.schema", "expected_output.schema"]


def test_outside_a_workspace_a_request_naming_no_schema_is_still_valid(docs: Path) -> None:
    proc = _validate(docs, "plain.json")
    assert proc.returncode == 0 and proc.stdout == "plain.json: valid (native)\n", proc.stdout


def test_an_invalid_file_outranks_an_unchecked_one(docs: Path) -> None:
    proc = _validate(docs, "named.json", "plain.json", "bad.json")
    assert proc.returncode == 1, proc.stdout
    assert "named.json: not checked" in proc.stdout and "bad.json: invalid" in proc.stdout
    assert "plain.json: valid (native)" in proc.stdout


def test_with_root_the_named_schemas_are_checked_as_before(docs: Path, tmp_path: Path) -> None:
    root = tmp_path / "ws"
    Workspace(root).ensure()
    (root / "schemas").mkdir(exist_ok=True)
    (root / "schemas" / NAMED).write_text(json.dumps({"type": "object", "required": ["y"]}))
    (root / "schemas" / OUTPUT).write_text("{}")
    proc = _validate(docs, "--root", str(root), "named.json")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert proc.stdout.startswith("named.json: invalid (native): Input validation failed: $: "
                                  "Missing required field 'y'"), proc.stdout
    (root / "schemas" / NAMED).write_text(json.dumps({"type": "object", "required": ["x"]}))
    done = _validate(docs, "--root", str(root), "named.json")
    assert done.returncode == 0 and done.stdout == "named.json: valid (native)\n", done.stdout
    inside = _validate(root, str(docs / "named.json"))  # in the workspace itself: the same
    assert inside.returncode == 0 and "valid (native)" in inside.stdout, inside.stdout
