"""The run path's shortcuts (session 31, helper C) give what the full way gives.

* A request's artifact destination whose folder is there and whose path is free is resolved by
  its own ``lstat`` calls (``artifact_paths._fresh_path``), skipping ``Workspace.inside`` and
  the two looks ``prepare`` made after it: every other layout (a symlink anywhere, a file in
  the way, a folder at the path, a missing folder) goes the full way, and no destination
  leads out of the workspace or out of ``artifacts/``.
* A document's retry policy is remembered by its plain values and the policy it overlays
  (``settings._overlaid``): never by equal values of another type, nor for another base.
* A specialist's agent id follows its settings (``Registry.with_overrides``); a job's id is its
  claim's.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from handoffd.core.errors import ConfigError, InvalidDocument
from handoffd.core.workspace import Workspace
from handoffd.features import artifact_paths

TEMPLATE = "artifacts/phase-13-react/artifact-react-comp-{timestamp}.json"


def _full_way(ws: Workspace, template: str) -> tuple[str, str, bool] | str:
    """What the destination resolves to without the shortcut: ``Workspace.inside`` and the
    looks `prepare` makes (its folder a folder, nothing but a file at the path), or the code
    of the refusal."""
    text = template.replace("{timestamp}", "1700000000000")
    if not text.startswith("artifacts/"):
        text = "artifacts/" + text.lstrip("/")
    if text.endswith("/"):  # a folder, no file: refused (tests/test_destinations_s31.py)
        return "SCHEMA_VALIDATION_FAILED"
    found = ws.inside(text)
    real_artifacts = os.path.realpath(ws.artifacts)
    if found is None or not str(found).startswith(real_artifacts.rstrip("/") + "/"):
        return "SCHEMA_VALIDATION_FAILED"
    where = str(found)
    ready = os.path.isdir(os.path.dirname(where)) and not os.path.lexists(where)
    return text, where, ready


def _layouts(tmp_path: Path) -> list[tuple[str, Workspace, str]]:
    """(name, workspace, template): each a layout the shortcut must leave to the full way, or
    get right itself."""
    made = []

    def new(name: str) -> Workspace:
        ws = Workspace(tmp_path / name / "ws")
        ws.ensure()
        return ws

    ws = new("plain")  # the usual: the folder there, nothing at the path
    (ws.artifacts / "phase-13-react").mkdir()
    made.append(("plain", ws, TEMPLATE))
    made.append(("no folder yet", new("missing"), TEMPLATE))
    ws = new("written")  # an earlier attempt wrote it
    (ws.artifacts / "phase-13-react").mkdir()
    (ws.artifacts / "phase-13-react" / "artifact-react-comp-1700000000000.json").write_text("{}")
    made.append(("written", ws, TEMPLATE))
    ws = new("outside")  # the folder a symlink out of the workspace
    (tmp_path / "outside" / "elsewhere").mkdir()
    (ws.artifacts / "phase-13-react").symlink_to(tmp_path / "outside" / "elsewhere")
    made.append(("folder linked out", ws, TEMPLATE))
    ws = new("inside")  # the folder a symlink to another folder of artifacts/
    (ws.artifacts / "real").mkdir()
    (ws.artifacts / "phase-13-react").symlink_to(ws.artifacts / "real")
    made.append(("folder linked within", ws, TEMPLATE))
    ws = new("artlink")  # artifacts/ itself a symlink out
    (tmp_path / "artlink" / "away").mkdir()
    (tmp_path / "artlink" / "away" / "phase-13-react").mkdir()
    os.rmdir(ws.artifacts)
    ws.artifacts.symlink_to(tmp_path / "artlink" / "away")
    made.append(("artifacts linked out", ws, TEMPLATE))
    ws = new("filelink")  # the path itself a symlink out
    (ws.artifacts / "phase-13-react").mkdir()
    (ws.artifacts / "phase-13-react" / "artifact-react-comp-1700000000000.json").symlink_to(
        tmp_path / "filelink" / "stolen.json")
    made.append(("path linked out", ws, TEMPLATE))
    ws = new("file")  # a file where the folder should be
    (ws.artifacts / "phase-13-react").write_text("x")
    made.append(("file in the way", ws, TEMPLATE))
    ws = new("folder")  # a folder at the path
    (ws.artifacts / "phase-13-react" / "artifact-react-comp-1700000000000.json").mkdir(
        parents=True)
    made.append(("folder at the path", ws, TEMPLATE))
    ws = new("dots")
    (ws.artifacts / "phase-13-react").mkdir()
    for template in ("artifacts/phase-13-react/../../../x-{timestamp}.json",
                     "artifacts/./phase-13-react/x-{timestamp}.json",
                     "artifacts/phase-13-react//x-{timestamp}.json",
                     "artifacts/phase-13-react/x-{timestamp}.json/",
                     "phase-13-react/x-{timestamp}.json"):
        made.append((template, ws, template))
    return made


def test_a_destination_resolves_as_the_full_way_resolves_it(tmp_path: Path) -> None:
    for name, ws, template in _layouts(tmp_path):
        expected = _full_way(ws, template)
        try:
            rel, where, ready = artifact_paths.destination(
                ws, template, handoff_id="h1", attempt=1, agent="@react-specialist",
                now_ms=1700000000000)
        except InvalidDocument as exc:
            assert expected == exc.code, name
            continue
        assert expected != "SCHEMA_VALIDATION_FAILED", name
        assert isinstance(expected, tuple)
        assert (rel, where) == expected[:2], name
        assert where.startswith(os.path.realpath(ws.artifacts) + "/"), name
        # ready only where the full way's looks say so (never through a symlink)
        if ready:
            assert expected[2], name
    # the usual layout takes the shortcut; a symlinked folder never does
    ws = next(w for n, w, _ in _layouts(tmp_path / "again") if n == "folder linked within")
    assert artifact_paths._fresh_path(str(ws.root), "artifacts/phase-13-react/x.json") is None
    ws = next(w for n, w, _ in _layouts(tmp_path / "third") if n == "plain")
    assert artifact_paths._fresh_path(str(ws.root), "artifacts/phase-13-react/x.json") == \
        f"{ws.root}/artifacts/phase-13-react/x.json"


def test_prepare_refuses_what_is_in_the_way_and_makes_a_missing_folder(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from handoffd.features.artifacts import prepare
    layouts = {name: ws for name, ws, _ in _layouts(tmp_path)}

    def job_in(ws: Workspace) -> SimpleNamespace:
        context = SimpleNamespace(root=ws.root, attempt=1, env={}, artifact_path=None,
                                  artifact_rel=None)
        return SimpleNamespace(claim=SimpleNamespace(doc={"expected_output": {
            "destination": "artifacts/phase-13-react/out.json"}}), handoff_id="h1",
            context=context, specialist=SimpleNamespace(agent="@w"))

    job = job_in(layouts["no folder yet"])
    prepare(job)  # type: ignore[arg-type]
    assert (layouts["no folder yet"].artifacts / "phase-13-react").is_dir()
    assert job.context.env["HANDOFF_ARTIFACT_PATH"] == str(job.context.artifact_path)
    job = job_in(layouts["plain"])
    prepare(job)  # type: ignore[arg-type]
    assert job.context.artifact_path == layouts["plain"].artifacts / "phase-13-react" / "out.json"
    assert job.context.artifact_rel == "artifacts/phase-13-react/out.json"
    with pytest.raises(InvalidDocument, match="is not a folder"):
        prepare(job_in(layouts["file in the way"]))  # type: ignore[arg-type]
    with pytest.raises(InvalidDocument, match="points outside artifacts/"):
        prepare(job_in(layouts["folder linked out"]))  # type: ignore[arg-type]
    folder = layouts["folder at the path"]
    (folder.artifacts / "phase-13-react" / "out.json").mkdir()
    with pytest.raises(InvalidDocument, match="is a folder"):
        prepare(job_in(folder))  # type: ignore[arg-type]


def test_a_remembered_retry_policy_is_never_one_of_another_type_or_base() -> None:
    from handoffd.core.settings import RetryPolicy
    one = RetryPolicy.from_dict({"max_retries": 1, "retry_delay_seconds": 30})
    assert one == RetryPolicy(1, 30.0, 2.0)
    assert RetryPolicy.from_dict({"max_retries": 1, "retry_delay_seconds": 30}) is one
    for bad in ({"max_retries": True, "retry_delay_seconds": 30},  # equal to 1, not a number
                {"max_retries": 1, "retry_delay_seconds": float("nan")},
                {"max_retries": "x", "retry_delay_seconds": 30}):
        for _ in range(2):  # (an error is never remembered)
            with pytest.raises(ConfigError):
                RetryPolicy.from_dict(bad)
    assert RetryPolicy.from_dict({"max_retries": 1.0, "retry_delay_seconds": "30"}) == one
    # the same values over other bases: each base's own defaults
    slow = RetryPolicy(5, 60.0, 3.0)
    assert RetryPolicy.from_dict({"max_retries": 1}, slow) == RetryPolicy(1, 60.0, 3.0)
    assert RetryPolicy.from_dict({"max_retries": 1}) == RetryPolicy(1, 30.0, 2.0)
    for delay in range(100):  # more bases than are kept, each made and dropped
        assert RetryPolicy.from_dict({"max_retries": 1}, RetryPolicy(9, float(delay), 1.0)) \
            == RetryPolicy(1, float(delay), 1.0)


def test_a_specialists_agent_follows_its_config_and_a_jobs_id_its_claim() -> None:
    import dataclasses

    from handoffd.core.config import specialist_from_table
    from handoffd.core.settings import RetryPolicy
    from handoffd.core.specialists import Registry, Specialist
    spec = Specialist(specialist_from_table("@a", {"handler": "m:f"}, RetryPolicy()))
    assert spec.agent == "@a"
    registry = Registry({"@a": spec})
    registry.with_overrides("@a", timeout_seconds=5)
    assert (spec.agent, spec.config.timeout_seconds) == ("@a", 5)
    spec.config = dataclasses.replace(spec.config, agent="@b")
    assert spec.agent == "@b"
    assert dataclasses.replace(spec).agent == "@b"
    assert "agent=" not in repr(spec).replace("SpecialistConfig(agent=", "")
    from types import SimpleNamespace

    from handoffd.core.jobs import Job
    job = Job(SimpleNamespace(id="h-7"), None, None, spec, None)  # type: ignore[arg-type]
    assert job.handoff_id == "h-7" and "h-7" not in repr(job).replace("id='h-7'", "")
