"""Session 31: schemas/ as a request sees it.

- A file added to schemas/ under a built-in schema's name (an edited copy of it, as `handoff
  schemas --copy` makes) is used from the next handoff on: a cached resolution to a built-in
  stands only while schemas/'s mtime does (it stood until a restart).
- A specialist's own input schema is used even when the request names it too: in advisory
  mode, such a request ran unchecked where its specialist's missing schema fails every other.
- One request looks at a cached schema's file once (absent, then errors: one lstat each), and
  a file replaced between two requests is still seen by the second.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, Workspace
from test_daemon import native_request
from test_schema_lookups_s30 import AGENT, IN_NAME, OUT_NAME, _advisory, _request, _run

from handoffd.core import validation
from handoffd.core.validation import SchemaCache

BUILT_IN = "native.request.schema.json"
REFUSING = {"type": "object", "required": ["never_there"]}


def test_a_built_in_overridden_while_the_daemon_serves_judges_the_next_handoff(
        ws: Workspace) -> None:
    """`handoffd serve` validates a request against the built-in native.request schema; a file
    of that name then written into schemas/ refuses every request: the next one fails by it
    (fails before: the built-in went on judging until a restart)."""
    daemon = ws.serve()
    ws.drop("before-1.json", native_request("before-1", {"mode": "ok"}))
    assert ws.wait_state("before-1") == "completed"
    (ws.root / "schemas" / BUILT_IN).write_text(json.dumps(REFUSING))
    ws.drop("after-1.json", native_request("after-1", {"mode": "ok"}))
    assert ws.wait_state("after-1") == "failed"
    error = ws.doc("after-1")["error"]
    assert error["code"] == "SCHEMA_VALIDATION_FAILED" and "never_there" in error["message"], error
    assert ws.stop(daemon) == 0


def _aged(folder: Path) -> None:
    """``folder``'s mtime set a minute back: settled, as a workspace's schemas/ usually is."""
    back = folder.stat().st_mtime_ns - 60 * 10**9
    os.utime(folder, ns=(back, back))


@pytest.mark.parametrize("ask", ["errors", "validator"])
def test_a_cached_built_in_gives_way_to_a_file_added_later(tmp_path: Path, ask: str) -> None:
    """Both caches (the quick check a valid document is judged by, the validator that says why
    one is not) resolve the name again once a file of that name comes into schemas/."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    _aged(folder)
    cache = SchemaCache(folder)
    doc = native_request("h-1", {})
    if ask == "errors":
        assert cache.errors(BUILT_IN, doc) == []
        assert cache.errors(BUILT_IN, doc) == []  # (cached)
    else:
        assert cache.validator(BUILT_IN).schema == validation.load_builtin(BUILT_IN)
    (folder / BUILT_IN).write_text(json.dumps(REFUSING))
    if ask == "errors":
        assert [e["error"] for e in cache.errors(BUILT_IN, doc)] \
            == ["Missing required field 'never_there'"]
    else:
        assert cache.validator(BUILT_IN).schema == REFUSING


def test_a_ref_to_a_built_in_follows_a_file_added_later(tmp_path: Path) -> None:
    """A schema of schemas/ whose $ref names a built-in is built again when a file of that
    name comes into schemas/ (the built-in was kept)."""
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "outer.json").write_text(json.dumps({"$ref": BUILT_IN}))
    _aged(folder)
    cache = SchemaCache(folder)
    doc = native_request("h-1", {})
    assert cache.errors("outer.json", doc) == []
    (folder / BUILT_IN).write_text(json.dumps(REFUSING))
    assert len(cache.errors("outer.json", doc)) == 1


def test_a_file_added_within_the_folders_tick_is_still_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """schemas/'s mtime is trusted only once settled: a file added in the same tick of the
    kernel's clock as the change last seen leaves the mtime as it was (here: set back to it),
    and is found by its own look-up, not missed for good. The clock is held a millisecond after
    the folder's making (a loaded machine took over a second between the two: RE)."""
    folder = tmp_path / "schemas"
    folder.mkdir()  # (just made: not settled)
    made = folder.stat().st_mtime_ns
    monkeypatch.setattr(validation.time, "time_ns", lambda: made + 1_000_000)
    cache = SchemaCache(folder)
    doc = native_request("h-1", {})
    assert cache.errors(BUILT_IN, doc) == []
    was = folder.stat().st_mtime_ns
    (folder / BUILT_IN).write_text(json.dumps(REFUSING))
    os.utime(folder, ns=(was, was))
    assert len(cache.errors(BUILT_IN, doc)) == 1


def test_a_request_naming_its_specialists_missing_schema_is_still_checked(
        tmp_path: Path) -> None:
    """Advisory mode: the specialist's own input_schema does not exist, and the request names
    it too. The request's expectation is warned of; the specialist's schema is still its own,
    always used: the handoff fails as it does when the request names no schema, before its
    handler runs (fails before: the handler ran on unchecked input, the handoff completed)."""
    ran: list[str] = []

    def handler(doc: Any, ctx: Any) -> dict[str, Any]:
        ran.append(doc["handoff_id"])
        return {"status": "completed", "output": {}}

    engine = _advisory(tmp_path, Clock(), handler)
    engine.registry.with_overrides(AGENT, input_schema="own.schema.json")
    outcomes = {}
    for hid, named in (("names-it", "own.schema.json"), ("names-none", None)):
        doc = _request(hid)
        doc["expected_output"].pop("schema")
        if named:
            doc["input"]["schema"] = named
        else:
            doc["input"].pop("schema")
        engine.submit(doc)
        job = engine.take(hid)
        assert job is not None
        outcomes[hid] = engine.run(job)
    assert ran == []
    for hid, outcome in outcomes.items():
        assert outcome.status == "failed", (hid, outcome)
        assert outcome.error["code"] == "PROCESSING_ERROR", outcome.error
        assert "own.schema.json not found" in outcome.error["message"], outcome.error
    assert "input.schema names 'own.schema.json'" in "\n".join(outcomes["names-it"].warnings)


@pytest.fixture
def schema_lstats(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times ``os.lstat`` looked at each file called IN_NAME or OUT_NAME."""
    seen = {IN_NAME: 0, OUT_NAME: 0}
    real = os.lstat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        name = os.path.basename(os.fsdecode(path)) if isinstance(path, (str, bytes, Path)) else ""
        if name in seen:
            seen[name] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", counting)
    return seen


def test_a_request_looks_at_its_input_schema_once(tmp_path: Path,
                                                  schema_lstats: dict[str, int]) -> None:
    """Before its handler runs, a request's input schema (validator cached) is lstat'ed once:
    absent() and then errors() each did (fails before: 2)."""
    at_run: list[int] = []

    def handler(doc: Any, ctx: Any) -> dict[str, Any]:
        at_run.append(schema_lstats[IN_NAME])
        return {"status": "completed", "output": {}}

    engine = _advisory(tmp_path, Clock(), handler)
    for name in (IN_NAME, OUT_NAME):
        (engine.ws.schemas / name).write_text(json.dumps({"type": "object"}))
    assert _run(engine, "warm-1").status == "completed"  # (builds what later ones share)
    schema_lstats[IN_NAME] = 0
    at_run.clear()
    assert _run(engine, "once-1").status == "completed"
    assert at_run == [1]


def test_a_schema_replaced_between_two_requests_judges_the_second(tmp_path: Path) -> None:
    """The look shared within a request is no cache across them: a schema replaced (a new file
    renamed over it) after one handoff judges the next."""
    engine = _advisory(tmp_path, Clock(), lambda doc, ctx: {"status": "completed", "output": {}})
    path = engine.ws.schemas / IN_NAME
    path.write_text(json.dumps({"type": "object"}))
    assert _run(engine, "first-1").status == "completed"
    assert _run(engine, "first-2").status == "completed"
    new = path.with_name(".new")
    new.write_text(json.dumps({"type": "object", "required": ["never_there"]}))
    os.replace(new, path)
    second = _run(engine, "second-1")
    assert second.status == "failed", second
    assert second.error["code"] == "SCHEMA_VALIDATION_FAILED" and \
        "never_there" in second.error["message"], second.error
