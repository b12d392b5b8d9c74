"""Session 30: a request naming schemas nobody wrote looks at schemas/ once before its run, not
three times (``SchemaCache.absent``); and a schema added while the daemon runs is still seen by
the next look (between handoffs, and while a handler runs), as before."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import Clock, memory_engine
from handoffd.core.validation import SchemaCache

SEED_EXAMPLE = Path(__file__).parent.parent / "examples" / "requests" / "react-userprofile.json"
AGENT = "@react-specialist"
IN_NAME = "react-specialist.input.schema.json"
OUT_NAME = "react-specialist.output.schema.json"


def _request(hid: str) -> dict[str, Any]:
    """The seed-001 example (naming IN_NAME and OUT_NAME) as ``hid``, with no destination."""
    doc = json.loads(SEED_EXAMPLE.read_text())
    doc.update(handoff_id=hid)
    assert doc["input"]["schema"] == IN_NAME and doc["expected_output"]["schema"] == OUT_NAME
    doc["expected_output"].pop("destination", None)
    return dict(doc)


def _advisory(tmp_path: Path, clock: Clock, handler: Any) -> Any:
    """An in-process engine (memory store) running ``handler`` for AGENT, expectations advisory."""
    engine, _ = memory_engine(tmp_path, clock, {AGENT: handler})
    engine.settings = dataclasses.replace(engine.settings, expectations="advisory")
    return engine


def _run(engine: Any, hid: str) -> Any:
    """Submit, take and run ``hid``; its outcome."""
    engine.submit(_request(hid))
    job = engine.take(hid)
    assert job is not None
    return engine.run(job)


@pytest.fixture
def folder_stats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each ``os.stat`` of a folder called schemas, as it is made."""
    seen: list[str] = []
    real = os.stat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if isinstance(path, (str, Path)) and Path(path).name == "schemas":
            seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting)
    return seen


def test_missing_schemas_are_looked_up_with_one_stat_before_the_run(
        tmp_path: Path, folder_stats: list[str]) -> None:
    """Both schemas the request names are missing: schemas/ is stat'ed once for them before the
    handler runs (was three times: each name at admission, the output's again to load it) and
    once after it (check_output looks again); both unmet expectations are still warned. (And
    once by each check of the document against its format's built-in schema, at its submission
    and at its admission: since session 31 a built-in stands only while schemas/ holds no file
    of its name, which its mtime says.)"""
    at_run: list[int] = []

    def handler(doc: Any, ctx: Any) -> dict[str, Any]:
        at_run.append(len(folder_stats))
        return {"status": "completed", "output": {}}

    engine = _advisory(tmp_path, Clock(), handler)
    _run(engine, "warm-1")  # (the first handoff loads what every later one shares)
    folder_stats.clear()
    at_run.clear()
    outcome = _run(engine, "lookups-1")
    assert at_run == [1 + 2], folder_stats
    assert len(folder_stats) == 2 + 2, folder_stats
    warnings = "\n".join(outcome.warnings)
    assert f"input.schema names {IN_NAME!r}" in warnings
    assert f"expected_output.schema names {OUT_NAME!r}" in warnings


def test_a_schema_added_between_handoffs_checks_the_next_input(tmp_path: Path) -> None:
    """A schema missing for one handoff and written before the next is used for the next."""
    engine = _advisory(tmp_path, Clock(), lambda doc, ctx: {"status": "completed", "output": {}})
    first = _run(engine, "late-1")
    assert f"input.schema names {IN_NAME!r}" in "\n".join(first.warnings)
    (engine.ws.schemas / IN_NAME).write_text(json.dumps({"type": "object",
                                                         "required": ["not-there"]}))
    second = _run(engine, "late-2")
    assert second.status == "failed", second
    assert second.error is not None and second.error["code"] == "SCHEMA_VALIDATION_FAILED"
    assert "not-there" in second.error["message"]


def test_a_schema_added_while_the_handler_runs_checks_its_output(tmp_path: Path) -> None:
    """The expected output schema is missing when the handoff is admitted (warned), written by
    the handler as it runs: its output is checked against it after the run (warned too)."""
    def handler(doc: Any, ctx: Any) -> dict[str, Any]:
        folder = Path(ctx.root) / "schemas"
        folder.joinpath(OUT_NAME).write_text(json.dumps({"type": "object",
                                                         "required": ["summary"]}))
        return {"status": "completed", "output": {}}

    engine = _advisory(tmp_path, Clock(), handler)
    warnings = "\n".join(_run(engine, "during-1").warnings)
    assert f"expected_output.schema names {OUT_NAME!r}" in warnings
    assert f"output fails expected_output.schema {OUT_NAME}" in warnings and "summary" in warnings


def test_absent_looks_at_the_folder_once_and_sees_a_file_added_since(
        tmp_path: Path, folder_stats: list[str]) -> None:
    """``absent`` answers for several names with one stat of schemas/, and a file written in it
    after a miss is found at the next look (its mtime moved)."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "here.json").write_text("{}")
    cache = SchemaCache(folder)
    names = ["a.json", "b.json", "here.json", "../x.json"]
    assert cache.absent(names) == {"a.json", "b.json", "../x.json"}
    assert len(folder_stats) == 1
    assert cache.absent(names) == {"a.json", "b.json", "../x.json"}
    (folder / "b.json").write_text("{}")
    assert cache.absent(names) == {"a.json", "../x.json"}
    assert not cache.has("a.json") and cache.has("b.json") and cache.has("here.json")


@pytest.mark.parametrize("hostile", ["o" * 300, "a\0b.json", "é" * 128])
@pytest.mark.parametrize("expectations", ["enforce", "advisory"])
def test_a_schema_name_no_file_can_have_is_a_missing_schema(
        tmp_path: Path, hostile: str, expectations: str) -> None:
    """A request's schema name is the sender's: one over NAME_MAX bytes, or with a NUL, made
    the look-up raise (ENAMETOOLONG, "embedded null byte") out of admission, and the claim
    stayed in in-progress/, charged as a crash at each recovery (review RF). It is a schema
    that does not exist: refused (enforce) or warned of (advisory) as any other."""
    clock = Clock()
    engine = _advisory(tmp_path, clock, lambda doc, ctx: {"status": "completed"})
    engine.settings = dataclasses.replace(engine.settings, expectations=expectations)
    doc = _request("hostile-1")
    doc["input"]["schema"] = "nope.json"
    doc["expected_output"]["schema"] = hostile
    engine.submit(doc)
    job = engine.take("hostile-1")
    assert job is not None
    outcome = engine.run(job)
    if expectations == "enforce":
        assert outcome.status == "failed", outcome
        assert outcome.error["code"] == "SCHEMA_VALIDATION_FAILED", outcome.error
    else:
        assert outcome.status == "completed", outcome


def test_a_schema_removed_between_handoffs_is_a_missing_schema(tmp_path: Path) -> None:
    """A schema used by one handoff (its validator cached) and removed before the next is a
    missing schema for the next: warned of in advisory mode, the handoff run. Its rebuild's
    "not found" failed that handoff for good (PROCESSING_ERROR, review RF)."""
    engine = _advisory(tmp_path, Clock(), lambda doc, ctx: {"status": "completed", "output": {}})
    (engine.ws.schemas / IN_NAME).write_text(json.dumps({"type": "object"}))
    first = _run(engine, "gone-1")
    assert first.status == "completed", first
    (engine.ws.schemas / IN_NAME).unlink()
    second = _run(engine, "gone-2")
    assert second.status == "completed", second
    assert f"input.schema names {IN_NAME!r}" in "\n".join(second.warnings)
