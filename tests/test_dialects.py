"""The seed formats (000 hi_moe, 002 AgentHandoff, 003 HAIOS, 004 Swarm): schemas, detection,
validation with JSON paths, versions, routing envelopes, answers and the typed models.

Every example document of the seeds must validate, through the installed ``handoff validate`` and
through the library; mutated copies must fail at the right JSON path.
"""
from __future__ import annotations

import json
import subprocess
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
from conftest import exe
from dialect_examples import (
    AGENT_BLOCKED,
    AGENT_PARTIAL,
    AGENT_SUCCESS,
    ALL,
    HAIOS_HANDOFF,
    HAIOS_RESULT,
    HI_MOE_AGGREGATED,
    HI_MOE_ARCHITECT_TO_DISPATCHER,
    HI_MOE_CANCELLATION,
    HI_MOE_CLARIFICATION_PAYLOAD,
    HI_MOE_DISPATCHER_TO_FLEET,
    HI_MOE_FLEET_TO_DISPATCHER,
    SWARM_HANDOFF,
    fresh,
)

from handoffd import dialects
from handoffd.core.documents import Outcome
from handoffd.core.errors import InvalidDocument
from handoffd.core.validation import SchemaCache, builtin_schema_names, load_builtin
from handoffd.core.workspace import Workspace
from handoffd.dialects import FiledState, models
from handoffd.features.artifacts import text_sink
from handoffd.service.queries import validate_document, validate_files

DIALECT_SCHEMAS = ("hi_moe.message.schema.json", "agent_handoff.schema.json",
                   "haios.collaboration_handoff.schema.json",
                   "haios.collaboration_result.schema.json", "swarm.worker_handoff.schema.json",
                   "swarm.completion_report.schema.json")
SCHEMAS = SchemaCache(None)


def write_docs(folder: Path, docs: dict[str, Any]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, doc in docs.items():
        path = folder / (name.replace("/", "__") + ".json")
        path.write_text(json.dumps(doc))
        paths[name] = path
    return paths


def cli_validate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoff"), "validate", *args], capture_output=True, text=True,
                          timeout=60)


# ------------------------------------------------------------------ the schemas themselves
@pytest.mark.parametrize("name", DIALECT_SCHEMAS)
def test_builtin_schema_is_a_valid_schema_and_listed(name: str) -> None:
    schema = load_builtin(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    assert name in builtin_schema_names()
    expected = jsonschema.Draft7Validator if name == "agent_handoff.schema.json" \
        else jsonschema.Draft202012Validator
    assert cls is expected


def test_hi_moe_schema_defines_every_seed_000_type() -> None:
    defs = load_builtin("hi_moe.message.schema.json")["$defs"]
    for name in ("DelegationPayload", "OutcomePayload", "CancellationPayload", "Artifact",
                 "ParallelDelegation", "AggregatedOutcome", "ChildOutcomeSummary", "OutcomeStatus",
                 "TierLevel"):
        assert name in defs, name


def test_formats_are_really_checked() -> None:
    """The engine's FormatChecker enforces date-time and uuid (not silently ignored)."""
    checker = jsonschema.FormatChecker()
    assert not checker.conforms("2026-02-30T10:30:00Z", "date-time")
    assert not checker.conforms("yesterday", "date-time")
    assert checker.conforms("2026-01-15T10:30:00Z", "date-time")
    assert not checker.conforms("a1b2c3d4-e5f6-7890-abcd", "uuid")
    doc = fresh(AGENT_SUCCESS)
    doc["timestamp"] = "2026-02-30T10:30:00Z"  # matches a naive pattern, but is no real date
    errors = SCHEMAS.errors("agent_handoff.schema.json", doc)
    assert [e["field"] for e in errors] == ["timestamp"]
    assert "date-time" in errors[0]["error"]


def test_schemas_copy_into_workspace_without_overwriting(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "schemas").mkdir(parents=True)
    (root / "schemas" / "hi_moe.message.schema.json").write_text('{"mine": true}')
    proc = subprocess.run([exe("handoff"), "schemas", "--copy", "--root", str(root)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    copied = {Path(line).name for line in proc.stdout.split()}
    assert copied == set(builtin_schema_names()) - {"hi_moe.message.schema.json"}
    assert json.loads((root / "schemas" / "hi_moe.message.schema.json").read_text()) == {"mine": True}
    for name in copied:
        assert json.loads((root / "schemas" / name).read_text()) == load_builtin(name)
    again = subprocess.run([exe("handoff"), "schemas", "--copy", "--root", str(root)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == ""


# ------------------------------------------------------------------ seed examples validate
def test_every_seed_example_validates_with_the_cli(tmp_path: Path) -> None:
    paths = write_docs(tmp_path / "docs", {name: doc for name, (doc, _, _) in ALL.items()})
    proc = cli_validate(*map(str, paths.values()), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {Path(item["file"]).name: item for item in json.loads(proc.stdout)}
    for name, (_, dialect, _) in ALL.items():
        item = results[paths[name].name]
        assert item["valid"], (name, item)
        assert item["dialect"] == dialect, name
    text = cli_validate(*map(str, paths.values()))
    assert text.returncode == 0
    assert text.stdout.count(": valid (") == len(ALL)


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_seed_example_validates_with_the_library(name: str) -> None:
    doc, dialect_name, schema = ALL[name]
    dialect = dialects.detect(doc)
    assert dialect.name == dialect_name
    assert dialect.schema_names(doc) == [schema]
    assert SCHEMAS.errors(schema, doc) == []
    validate_document(None, doc, dialect)  # raises when invalid


def test_forced_dialect(tmp_path: Path) -> None:
    paths = write_docs(tmp_path, {"agent": AGENT_SUCCESS})
    ok = cli_validate(str(paths["agent"]), "--dialect", "agent_handoff")
    assert ok.returncode == 0, ok.stdout
    forced = cli_validate(str(paths["agent"]), "--dialect", "hi_moe", "--json")
    assert forced.returncode == 1
    (item,) = json.loads(forced.stdout)
    assert item["dialect"] == "hi_moe" and not item["valid"]
    assert {"$"} <= {e["field"] for e in item["errors"]}
    assert any("version" in e["error"] for e in item["errors"])
    unknown = cli_validate(str(paths["agent"]), "--dialect", "klingon")
    assert unknown.returncode == 2  # a bad flag value is a usage error
    assert "klingon" in unknown.stderr and "hi_moe" in unknown.stderr


def test_unknown_format_names_the_formats_tried(tmp_path: Path) -> None:
    paths = write_docs(tmp_path, {"odd": {"hello": "world", "id": 3}})
    proc = cli_validate(str(paths["odd"]))
    assert proc.returncode == 1
    assert "unknown format" in proc.stdout
    for name in ("hi_moe", "haios", "agent_handoff", "swarm", "native"):
        assert name in proc.stdout
    with pytest.raises(InvalidDocument) as info:
        dialects.detect({"hello": "world"})
    assert info.value.code == "UNKNOWN_FORMAT"


def test_native_stays_what_create_builds() -> None:
    doc = {"handoff_id": "hoff-1", "target": {"agent_id": "@x"}, "input": {"data": {}}}
    assert dialects.detect(doc).name == "native"
    assert dialects.DIALECTS[-1].name == "native"


# ------------------------------------------------------------------ mutations fail at the right path
def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return apply


_DELETE = object()

# name: (base document, mutation, expected error field, text the error must contain)
MUTATIONS: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], None], str, str]] = {
    # missing required fields
    "agent-missing-to_agent": (AGENT_SUCCESS, _set("to_agent", _DELETE), "$", "to_agent"),
    "agent-missing-action-task": (AGENT_SUCCESS, _set("action_required.task", _DELETE),
                                  "action_required", "task"),
    "hi_moe-missing-objective": (HI_MOE_ARCHITECT_TO_DISPATCHER, _set("payload.objective", _DELETE),
                                 "payload", "objective"),
    "hi_moe-missing-correlation": (HI_MOE_DISPATCHER_TO_FLEET, _set("correlation_id", _DELETE),
                                   "$", "correlation_id"),
    "hi_moe-cancel-missing-cascade": (HI_MOE_CANCELLATION, _set("payload.cascade", _DELETE),
                                      "payload", "cascade"),
    "haios-missing-directive": (HAIOS_HANDOFF, _set("payload.directive", _DELETE), "payload",
                                "directive"),
    "haios-result-missing-executed_by": (HAIOS_RESULT, _set("executed_at", _DELETE), "$",
                                         "executed_at"),
    "swarm-missing-files_owned": (SWARM_HANDOFF, _set("contract.files_owned", _DELETE), "contract",
                                  "files_owned"),
    "swarm-missing-escalation": (SWARM_HANDOFF, _set("escalation", _DELETE), "$", "escalation"),
    # wrong enums
    "agent-status-enum": (AGENT_SUCCESS, _set("status", "done"), "status", "is not one of"),
    "agent-priority-enum": (AGENT_SUCCESS, _set("action_required.priority", "urgent"),
                            "action_required.priority", "is not one of"),
    "agent-blocker-type-enum": (AGENT_PARTIAL, _set("blockers.0.type", "gremlins"),
                                "blockers[0].type", "is not one of"),
    "agent-artifact-type-enum": (AGENT_SUCCESS, _set("results.artifacts.1.type", "binary"),
                                 "results.artifacts[1].type", "is not one of"),
    "hi_moe-outcome-status-enum": (HI_MOE_FLEET_TO_DISPATCHER, _set("payload.status", "great"),
                                   "payload.status", "is not one of"),
    "hi_moe-tier-enum": (HI_MOE_ARCHITECT_TO_DISPATCHER, _set("target_tier", "CEO"), "target_tier",
                         ""),
    "hi_moe-priority-range": (HI_MOE_ARCHITECT_TO_DISPATCHER, _set("payload.priority", 7),
                              "payload.priority", "maximum"),
    "haios-status-enum": (HAIOS_HANDOFF, _set("status", "running"), "status", "is not one of"),
    "haios-error-type-enum": (HAIOS_RESULT, _set("error", {"message": "x", "error_type": "fatal"}),
                              "error.error_type", "is not one of"),
    # seed 002 status rules
    "agent-partial-without-blockers": (AGENT_PARTIAL, _set("blockers", _DELETE), "$", "blockers"),
    "agent-partial-empty-blockers": (AGENT_PARTIAL, _set("blockers", []), "blockers", "non-empty"),
    "agent-partial-without-results": (AGENT_PARTIAL, _set("results", _DELETE), "$", "results"),
    "agent-blocked-without-resolution": (AGENT_BLOCKED, _set("blockers.0.resolution_options", []),
                                         "blockers", ""),
    "agent-blocked-without-blockers": (AGENT_BLOCKED, _set("blockers", _DELETE), "$", "blockers"),
    "agent-success-without-summary": (AGENT_SUCCESS, _set("results.summary", _DELETE), "results",
                                      "summary"),
    "agent-error-without-blockers": (AGENT_SUCCESS, _set("status", "error"), "$", "blockers"),
    # identifiers and timestamps
    "agent-bad-uuid": (AGENT_SUCCESS, _set("handoff_id", "hoff-not-a-uuid"), "handoff_id", "uuid"),
    "haios-bad-uuid": (HAIOS_HANDOFF, _set("handoff_id", "6f1c2a9e-3b4d-4c5e-9f7a"), "handoff_id",
                       "uuid"),
    "agent-bad-date-time": (AGENT_SUCCESS, _set("timestamp", "2026-01-15 10:30"), "timestamp",
                            "date-time"),
    "agent-impossible-date": (AGENT_SUCCESS, _set("timestamp", "2026-02-30T10:30:00Z"), "timestamp",
                              "date-time"),
    "hi_moe-bad-date-time": (HI_MOE_FLEET_TO_DISPATCHER, _set("timestamp", "yesterday"), "timestamp",
                             "date-time"),
    "haios-bad-created_at": (HAIOS_HANDOFF, _set("created_at", "2025-12-02T25:00:00Z"), "created_at",
                             "date-time"),
    # seed 000 artifacts: exactly one of content_ref / inline_content
    "hi_moe-artifact-both": (HI_MOE_FLEET_TO_DISPATCHER,
                             _set("payload.artifacts.0.inline_content", "def f(): ..."),
                             "payload.artifacts[0].inline_content", "null"),
    "hi_moe-artifact-neither": (HI_MOE_FLEET_TO_DISPATCHER,
                                _set("payload.artifacts.1.inline_content", None),
                                "payload.artifacts[1].inline_content", "string"),
    # seed 000 versions
    "hi_moe-major-2": (HI_MOE_ARCHITECT_TO_DISPATCHER, _set("version", "2.0.0"), "version",
                       "UNKNOWN_VERSION"),
    "hi_moe-version-not-semver": (HI_MOE_ARCHITECT_TO_DISPATCHER, _set("version", "one"), "version",
                                  "does not match"),
}


def mutated(name: str) -> dict[str, Any]:
    base, mutate, _, _ = MUTATIONS[name]
    doc = fresh(base)
    mutate(doc)
    return doc


def test_mutations_fail_with_their_json_path_in_the_cli(tmp_path: Path) -> None:
    docs = {name: mutated(name) for name in MUTATIONS}
    paths = write_docs(tmp_path / "bad", docs)
    proc = cli_validate(*map(str, paths.values()), "--json")
    assert proc.returncode == 1
    results = {Path(item["file"]).name: item for item in json.loads(proc.stdout)}
    for name, (_, _, field, text) in MUTATIONS.items():
        item = results[paths[name].name]
        assert not item["valid"], name
        assert item["headline"], name
        hits = [e for e in item["errors"] if e["field"] == field]
        assert hits, (name, item["errors"])
        assert any(text in e["error"] or text in item["headline"] for e in hits), (name, hits)
    # the human-readable form prints every error with its path, after a one-line headline
    human = cli_validate(str(paths["agent-bad-uuid"]), str(paths["hi_moe-artifact-both"]),
                         str(paths["hi_moe-major-2"]))
    assert human.returncode == 1
    assert "invalid (agent_handoff)" in human.stdout
    assert "  handoff_id: " in human.stdout
    assert "  payload.artifacts[0].inline_content: " in human.stdout
    assert "UNKNOWN_VERSION" in human.stdout


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutations_fail_with_their_json_path_in_the_library(name: str) -> None:
    _, _, field, text = MUTATIONS[name]
    doc = mutated(name)
    with pytest.raises(InvalidDocument) as info:
        validate_document(None, doc, dialects.detect(doc))
    hits = [e for e in info.value.errors if e["field"] == field]
    assert hits, info.value.errors
    assert any(text in e["error"] for e in hits) or text in str(info.value)


def test_every_error_is_reported_not_only_the_first(tmp_path: Path) -> None:
    doc = fresh(AGENT_PARTIAL)
    doc["handoff_id"] = "nope"
    doc["timestamp"] = "soon"
    del doc["blockers"]
    (item,) = validate_files(write_docs(tmp_path, {"many": doc}).values(), None)
    fields = {e["field"] for e in item["errors"]}
    assert {"handoff_id", "timestamp", "$"} <= fields
    assert "more)" in item["headline"]


def test_known_major_with_unknown_fields_is_accepted() -> None:
    doc = fresh(HI_MOE_ARCHITECT_TO_DISPATCHER)
    doc["version"] = "1.7.3"
    doc["trace_parent"] = "00-abc-01"
    doc["payload"]["budget_tokens"] = 5000
    validate_document(None, doc, dialects.detect(doc))
    assert dialects.detect(doc).envelope(doc).target == "ROUTING_DISPATCHER"


def test_unknown_major_version_code() -> None:
    doc = fresh(HI_MOE_FLEET_TO_DISPATCHER)
    doc["version"] = "2.1.0"
    dialect = dialects.detect(doc)
    for call in (lambda: dialect.schema_names(doc), lambda: dialect.envelope(doc)):
        with pytest.raises(InvalidDocument) as info:
            call()
        assert info.value.code == "UNKNOWN_VERSION"
        assert info.value.errors[0]["field"] == "version"


# ------------------------------------------------------------------ detection and routing
def test_envelopes_route_each_format() -> None:
    env = dialects.detect(HI_MOE_ARCHITECT_TO_DISPATCHER).envelope(HI_MOE_ARCHITECT_TO_DISPATCHER)
    assert (env.handoff_id, env.dialect, env.target, env.source) == \
        ("msg-001", "hi_moe", "ROUTING_DISPATCHER", "ABSTRACT_ARCHITECT")
    assert env.timeout_seconds == 60.0 and env.priority == 1
    assert env.data["task_data"] == {"problem_id": "leetcode-704", "language": "python"}

    env = dialects.detect(HI_MOE_DISPATCHER_TO_FLEET).envelope(HI_MOE_DISPATCHER_TO_FLEET)
    assert (env.target, env.timeout_seconds, env.correlation_id) == ("python-lora", 30.0, "msg-001")

    numeric = fresh(HI_MOE_CANCELLATION)
    numeric["target_tier"] = 1
    assert dialects.detect(numeric).envelope(numeric).target == "SPECIALIZED_FLEET"

    env = dialects.detect(AGENT_BLOCKED).envelope(AGENT_BLOCKED)
    assert (env.handoff_id, env.target, env.source, env.conversation_id, env.priority) == \
        (AGENT_BLOCKED["handoff_id"], "orchestrator", "slurm-manager", "conv-2026-01-15-003", 0)
    assert set(env.data) == {"context", "results", "action_required", "blockers"}

    schema_doc = fresh(HAIOS_HANDOFF)
    schema_doc["expected_output_schema"] = {"type": "object", "required": ["entities_created"]}
    env = dialects.detect(schema_doc).envelope(schema_doc)
    assert (env.target, env.source, env.timeout_seconds) == ("ingester-v1", "interpreter-v1", 30.0)
    assert env.data["directive"] == {"action": "ingest", "type": "episteme"}
    assert env.expected_output_schema == {"type": "object", "required": ["entities_created"]}

    env = dialects.detect(SWARM_HANDOFF).envelope(SWARM_HANDOFF)
    assert (env.handoff_id, env.target) == ("bd-123.2", "@swarm-worker")
    assert env.depends_on == ["bd-123.1"]
    assert env.contract == SWARM_HANDOFF["contract"]
    assert env.data["context"]["your_role"].startswith("Implement AuthService")
    routed = fresh(SWARM_HANDOFF)
    routed["to_agent"] = "@ts-worker"
    assert dialects.detect(routed).envelope(routed).target == "@ts-worker"


def test_bad_expected_output_schema_is_rejected_at_admission() -> None:
    doc = fresh(HAIOS_HANDOFF)
    doc["expected_output_schema"] = {"type": "objekt"}
    with pytest.raises(InvalidDocument) as info:
        dialects.detect(doc).envelope(doc)
    assert info.value.errors[0]["field"] == "expected_output_schema"


def test_haios_claim_marks_status() -> None:
    doc = fresh(HAIOS_HANDOFF)
    dialect = dialects.by_name("haios")
    dialect.mark_claimed(doc, datetime.now(timezone.utc))
    assert doc["status"] == "accepted"
    assert SCHEMAS.errors("haios.collaboration_handoff.schema.json", doc) == []
    dialect.mark_pending(doc)
    assert doc["status"] == "pending"


# ------------------------------------------------------------------ answers (in-process)
T0 = datetime(2026, 1, 15, 10, 0, tzinfo=timezone.utc)


def outcome(status: str, **kw: Any) -> Outcome:
    return Outcome(status=status, started_at=T0, finished_at=T0 + timedelta(seconds=1.5),
                   executed_by=kw.pop("executed_by", "@worker"), **kw)


OUTCOMES = {
    "completed": lambda: outcome("completed", output={"summary": "all done", "n": 1},
                                 metadata={"confidence": 0.8}),
    "partial": lambda: outcome("partial", output={"done": 2, "of": 3}),
    "failed": lambda: outcome("failed", error={"code": "PROCESSING_ERROR", "message": "boom",
                                               "retryable": True}),
    "timeout": lambda: outcome("timeout", error={"code": "TIMEOUT", "message": "too slow"}),
    "cancelled": lambda: outcome("cancelled", error={"code": "CANCELLED", "message": "stop"}),
    "blocked": lambda: outcome("failed", error={"code": "BLOCKED", "message": "no GPUs"}),
    "clarify": lambda: outcome("failed", error={"code": "NEEDS_CLARIFICATION",
                                                "message": "empty array: -1 or raise?"}),
    "violation": lambda: outcome("failed", error={"code": "CONTRACT_VIOLATION", "message": "scope",
                                                  "violations": ["Touched unauthorized files: x"]}),
}
ANSWER_SCHEMA = {"hi_moe": "hi_moe.message.schema.json", "agent_handoff": "agent_handoff.schema.json",
                 "haios": "haios.collaboration_result.schema.json",
                 "swarm": "swarm.completion_report.schema.json"}
REQUESTS = {"hi_moe": HI_MOE_ARCHITECT_TO_DISPATCHER, "agent_handoff": AGENT_SUCCESS,
            "haios": HAIOS_HANDOFF, "swarm": SWARM_HANDOFF}


@pytest.mark.parametrize("kind", sorted(OUTCOMES))
@pytest.mark.parametrize("dialect_name", sorted(REQUESTS))
def test_every_answer_validates_against_its_schema(dialect_name: str, kind: str,
                                                   tmp_path: Path) -> None:
    request = fresh(REQUESTS[dialect_name])
    request["handoffd"] = {"dialect": dialect_name, "revision": 3,
                           "request_snapshot": fresh(REQUESTS[dialect_name])}
    dialect = dialects.by_name(dialect_name)
    answer = dialect.render(request, OUTCOMES[kind](), FiledState(1, 3, kind == "failed"),
                            artifacts=text_sink(Workspace(tmp_path)))
    assert answer["handoffd"]["revision"] == 3
    assert SCHEMAS.errors(ANSWER_SCHEMA[dialect_name], answer) == []
    # the filed answer is still recognised as this format, validated against its answer schema,
    # and still carries the request's id and routing
    assert dialects.detect(answer).name == dialect_name
    assert dialect.schema_names(answer) == [ANSWER_SCHEMA[dialect_name]]
    assert dialect.id_of(answer) == dialect.id_of(request)
    validate_document(None, answer, dialect)


@pytest.mark.parametrize("name", sorted(n for n in MUTATIONS if "result" not in n))
def test_rejected_requests_still_get_valid_answers(name: str, tmp_path: Path) -> None:
    """A request that fails validation is answered (in failed/) with a document that is itself
    valid in its format, whatever was wrong with the request."""
    doc = mutated(name)
    dialect = dialects.detect(doc)
    rejected = outcome("failed", error={"code": "SCHEMA_VALIDATION_FAILED", "message": "bad input",
                                        "errors": [{"field": "x", "error": "y", "schema_path": ""}]})
    answer = dialect.render(doc, rejected, FiledState(0, 0, False), artifacts=text_sink(Workspace(tmp_path)))
    assert SCHEMAS.errors(ANSWER_SCHEMA[dialect.name], answer) == []


def test_hi_moe_answer_shape_and_status_mapping(tmp_path: Path) -> None:
    dialect = dialects.by_name("hi_moe")
    request = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    expected = {"completed": "success", "partial": "partial", "failed": "failed",
                "timeout": "timeout", "cancelled": "cancelled", "blocked": "blocked",
                "clarify": "needs_clarification", "violation": "failed"}
    for kind, status in expected.items():
        answer = dialect.render(request, OUTCOMES[kind](), FiledState(0, 3, True), artifacts=text_sink(Workspace(tmp_path)))
        payload = answer["payload"]
        assert payload["status"] == status, kind
        assert answer["correlation_id"] == "msg-002"
        assert answer["source_tier"] == "SPECIALIZED_FLEET"
        assert answer["target_tier"] == "ROUTING_DISPATCHER"
        assert answer["version"] == "1.0.0"
        assert str(uuid.UUID(answer["id"])) == answer["id"]
        assert payload["execution_time_ms"] == 1500
        if status in ("success", "partial", "cancelled"):  # seed 000: error fields only on
            # FAILED, BLOCKED, NEEDS_CLARIFICATION (and TIMEOUT, see docs/formats.md)
            assert payload["error_type"] is None and payload["recoverable"] is None
            assert payload["error_detail"] is None
        else:
            assert payload["error_type"] and payload["error_detail"]
            assert payload["recoverable"] is True
    clarify = dialect.render(request, OUTCOMES["clarify"](), FiledState(0, 3, False), artifacts=text_sink(Workspace(tmp_path)))
    assert clarify["payload"]["error_detail"] == "empty array: -1 or raise?"
    assert clarify["payload"]["recoverable"] is True  # the sender can clarify and resend
    done = dialect.render(request, OUTCOMES["completed"](), FiledState(0, 3, False), artifacts=text_sink(Workspace(tmp_path)))
    assert done["payload"]["confidence"] == 0.8
    assert done["payload"]["summary"] == "all done"
    assert done["payload"]["resources_used"]["specialist"] == "@worker"


def test_hi_moe_one_kilobyte_rule(tmp_path: Path) -> None:
    dialect = dialects.by_name("hi_moe")
    small, edge, big = "a" * 1023, "b" * 1024, "é" * 600  # 1200 bytes of UTF-8 in 600 chars
    result = outcome("completed", artifacts=[
        {"artifact_type": "code", "content": small},
        {"artifact_type": "code", "content": edge},
        {"artifact_type": "analysis", "content": big, "metadata": {"lang": "fr"}},
        {"artifact_type": "code", "inline_content": "x" * 2000},
        {"name": "out.json", "path": "artifacts/out.json", "type": "data"},
    ])
    answer = dialect.render(fresh(HI_MOE_DISPATCHER_TO_FLEET), result, FiledState(0, 3, False),
                            artifacts=text_sink(Workspace(tmp_path)))
    arts = answer["payload"]["artifacts"]
    assert [a["inline_content"] is not None for a in arts] == [True, False, False, False, False]
    for art in arts:
        assert (art["content_ref"] is None) != (art["inline_content"] is None)
    assert arts[0]["inline_content"] == small
    assert arts[1]["content_ref"] == "artifacts/msg-002/2.txt"
    assert (tmp_path / "artifacts/msg-002/2.txt").read_text() == edge
    assert (tmp_path / arts[2]["content_ref"]).read_text(encoding="utf-8") == big
    assert arts[2]["metadata"]["lang"] == "fr"
    assert (tmp_path / arts[3]["content_ref"]).read_text() == "x" * 2000
    assert arts[4]["content_ref"] == "artifacts/out.json"
    assert set(answer["payload"]["result_refs"]) == {a["content_ref"] for a in arts[1:]}
    assert SCHEMAS.errors("hi_moe.message.schema.json", answer) == []
    assert not list((tmp_path / "handoffs" / ".tmp").iterdir())  # atomic writes left no temp files


def test_hi_moe_answer_keeps_unknown_envelope_fields_and_answers_known_major() -> None:
    request = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    request["version"] = "1.4.0"
    request["trace_parent"] = "00-abc-01"
    answer = dialects.by_name("hi_moe").render(request, OUTCOMES["completed"](),
                                               FiledState(0, 3, False))
    assert answer["trace_parent"] == "00-abc-01"
    assert answer["version"] == "1.4.0"
    v2 = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    v2["version"] = "2.0.0"
    rejected = dialects.by_name("hi_moe").render(v2, outcome(
        "failed", error={"code": "UNKNOWN_VERSION", "message": "major 2"}), FiledState(0, 0, False))
    assert rejected["version"] == "1.0.0"
    assert rejected["payload"]["error_type"] == "unknown_version"
    assert rejected["payload"]["recoverable"] is False


def test_agent_handoff_answer_goes_back_along_the_chain(tmp_path: Path) -> None:
    dialect = dialects.by_name("agent_handoff")
    answer = dialect.render(fresh(AGENT_SUCCESS), OUTCOMES["completed"](), FiledState(0, 3, False))
    assert answer["from_agent"] == "code-quality-reviewer" and answer["to_agent"] == "code-generator"
    assert answer["conversation_id"] == "conv-2026-01-15-001"
    assert answer["status"] == "success" and "blockers" not in answer
    assert answer["results"]["summary"] == "all done"
    assert answer["metadata"]["chain_position"] == {"step": 3, "total_steps": 4}
    assert answer["metadata"]["execution_time_ms"] == 1500
    assert uuid.UUID(answer["handoff_id"]).version == 4
    assert answer["in_reply_to"] == AGENT_SUCCESS["handoff_id"]
    blocked = dialect.render(fresh(AGENT_PARTIAL), OUTCOMES["blocked"](), FiledState(0, 3, False))
    assert blocked["status"] == "blocked"
    assert blocked["blockers"][0]["resolution_options"]
    partial = dialect.render(fresh(AGENT_PARTIAL), OUTCOMES["partial"](), FiledState(0, 3, False))
    assert partial["status"] == "partial" and partial["blockers"] and partial["results"]


def test_agent_handoff_review_requires_existing_artifacts(tmp_path: Path) -> None:
    dialect = dialects.by_name("agent_handoff")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "auth.py").write_text("x = 1\n")
    good = outcome("completed", artifacts=[{"name": "auth.py", "path": "src/auth.py",
                                            "type": "code"}])
    assert dialect.review(fresh(AGENT_SUCCESS), good, tmp_path) is good
    bad = outcome("completed", output={"artifacts": [{"name": "here.py",
                                                      "path": "src/maybe/here.py", "type": "code"}]})
    reviewed = dialect.review(fresh(AGENT_SUCCESS), bad, tmp_path)
    assert reviewed.status == "failed" and not reviewed.succeeded
    assert reviewed.error["code"] == "VALIDATION_FAILED"
    assert "src/maybe/here.py" in reviewed.error["message"]
    escape = outcome("completed", artifacts=[{"name": "p", "path": "../../etc/passwd", "type": "data"}])
    assert dialect.review(fresh(AGENT_SUCCESS), escape, tmp_path).error["code"] == "VALIDATION_FAILED"
    answer = dialect.render(fresh(AGENT_SUCCESS), reviewed, FiledState(0, 3, False), artifacts=text_sink(Workspace(tmp_path)))
    assert answer["status"] == "error"
    assert answer["blockers"][0]["type"] == "validation_failed"
    assert SCHEMAS.errors("agent_handoff.schema.json", answer) == []


def test_haios_result_fields() -> None:
    dialect = dialects.by_name("haios")
    ok = dialect.render(fresh(HAIOS_HANDOFF), outcome("completed", output={"entities_created": 1},
                                                      executed_by="ingester-v1"),
                        FiledState(0, 3, False))
    assert ok["status"] == "success" and ok["result"] == {"entities_created": 1}
    assert ok["executed_by"] == "ingester-v1" and ok["error"] is None
    assert ok["handoff_id"] == HAIOS_HANDOFF["handoff_id"]
    retry = dialect.render(fresh(HAIOS_HANDOFF), OUTCOMES["failed"](), FiledState(3, 3, True))
    assert retry["error"]["error_type"] == "retryable" and retry["error"]["code"] == "PROCESSING_ERROR"
    perm = dialect.render(fresh(HAIOS_HANDOFF), outcome(
        "failed", error={"code": "VALIDATION_FAILED", "message": "bad output"}), FiledState(0, 3, False))
    assert perm["status"] == "error" and perm["error"]["error_type"] == "permanent"


def test_swarm_report_fields() -> None:
    dialect = dialects.by_name("swarm")
    done = dialect.render(fresh(SWARM_HANDOFF), outcome(
        "completed", output={"files_touched": ["src/auth/service.ts"], "summary": "AuthService done",
                             "success_criteria": [{"criterion": "Tests pass: bun test src/auth/service.test.ts",
                                                   "passed": True}]}), FiledState(0, 3, False))
    assert done["task_id"] == "bd-123.2" and done["status"] == "completed"
    assert done["files_touched"] == ["src/auth/service.ts"] and done["summary"] == "AuthService done"
    states = {c["criterion"]: c["status"] for c in done["success_criteria"]}
    assert states == {"AuthService.login() returns JWT token": "unchecked",
                      "Tests pass: bun test src/auth/service.test.ts": "passed",
                      "Type check passes: tsc --noEmit": "unchecked"}
    assert done["valid"] is True and done["violations"] == []
    bad = dialect.render(fresh(SWARM_HANDOFF), OUTCOMES["violation"](), FiledState(0, 3, False))
    assert bad["valid"] is False and bad["violations"] == ["Touched unauthorized files: x"]
    assert bad["error"]["code"] == "CONTRACT_VIOLATION"


# ------------------------------------------------------------------ typed models
@pytest.mark.parametrize("name", sorted(ALL))
def test_models_round_trip_every_seed_example(name: str) -> None:
    doc = ALL[name][0]
    model = models.load(doc)
    assert model.to_dict() == doc
    assert json.dumps(model.to_dict()) == json.dumps(doc)  # key order too
    assert model.validate() == []
    again = type(model).from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model


def test_models_types() -> None:
    msg = models.Message.from_dict(HI_MOE_FLEET_TO_DISPATCHER)
    assert isinstance(msg.payload, models.OutcomePayload)
    assert isinstance(msg.payload.artifacts[0], models.Artifact)
    assert msg.payload.artifacts[1].inline_content == "5/5 tests passed"
    assert isinstance(models.Message.from_dict(HI_MOE_CANCELLATION).payload, models.CancellationPayload)
    assert isinstance(models.Message.from_dict(HI_MOE_AGGREGATED).payload, models.OutcomePayload)
    delegation = models.Message.from_dict(HI_MOE_DISPATCHER_TO_FLEET).payload
    assert isinstance(delegation, models.DelegationPayload)
    assert delegation.specialist_hint == "python-lora"
    assert models.OutcomePayload.from_dict(HI_MOE_CLARIFICATION_PAYLOAD).to_dict() == \
        HI_MOE_CLARIFICATION_PAYLOAD
    swarm = models.WorkerHandoff.from_dict(SWARM_HANDOFF)
    assert swarm.contract.dependencies_completed == ["bd-123.1"]
    haios = models.CollaborationHandoff.from_dict(HAIOS_HANDOFF)
    assert haios.payload.directive == {"action": "ingest", "type": "episteme"}
    agg = models.AggregatedOutcome(strategy_used="all_success", aggregated_status="partial",
                                   aggregated_confidence=0.7, child_outcomes=[
                                       models.ChildOutcomeSummary(message_id="m1", status="success",
                                                                  confidence=0.9, specialist="a")])
    assert models.AggregatedOutcome.from_dict(agg.to_dict()) == agg
    with pytest.raises(ValueError, match="task_id"):
        models.WorkerContract.from_dict({"files_owned": []})


def test_models_unknown_fields_are_preserved() -> None:
    doc = fresh(HI_MOE_ARCHITECT_TO_DISPATCHER)
    doc["version"] = "1.2.0"
    doc["trace_parent"] = "00-abc"
    doc["payload"]["budget_tokens"] = 10
    msg = models.Message.from_dict(doc)
    assert msg.extra == {"trace_parent": "00-abc"}
    assert msg.payload.extra == {"budget_tokens": 10}
    assert msg.to_dict() == doc


def test_models_built_in_code_are_valid_documents(tmp_path: Path) -> None:
    built = [
        models.Message.delegation(models.TierLevel.ABSTRACT_ARCHITECT, "ROUTING_DISPATCHER",
                                  models.DelegationPayload(task_type="solve", objective="search",
                                                           timeout_ms=1000)),
        models.Message.create(1, 2, models.OutcomePayload(
            status="success", summary="ok",
            artifacts=[models.Artifact.of("code", "print(1)"),
                       models.Artifact.of("log", "z" * 5000, ref="beads:execution/logs/1")])),
        models.Message.create("ABSTRACT_ARCHITECT", "ROUTING_DISPATCHER", models.CancellationPayload(
            target_message_id="msg-001", reason="new plan", cascade=True)),
        models.AgentHandoff(from_agent="a", to_agent="b", status="blocked", blockers=[
            {"type": "missing_input", "description": "need key", "resolution_options": ["ask"]}]),
        models.CollaborationHandoff(from_agent="interpreter-v1", to_agent="ingester-v1",
                                    payload=models.HandoffPayload(directive={"action": "ingest"})),
        models.CollaborationResult(handoff_id=str(uuid.uuid4()), executed_by="x", status="success"),
        models.WorkerHandoff(contract=models.WorkerContract(task_id="bd-9", files_owned=["a.py"])),
        models.NativeRequest(target=models.AgentRef(agent_id="@react-specialist"),
                             input=models.HandoffInput(data={"k": 1})),
    ]
    for model in built:
        doc = model.to_dict()
        assert model.validate() == [], (type(model).__name__, model.validate())
        assert type(model).from_dict(doc).to_dict() == doc
        validate_document(None, doc, dialects.detect(doc))
    # and the CLI agrees, including `handoff create --file` of each request format
    root = tmp_path / "ws"
    root.mkdir()
    for model in built:
        if isinstance(model, models.CollaborationResult) or (  # answers: refused, see below
                isinstance(model, models.Message) and isinstance(model.payload, models.OutcomePayload)):
            continue
        path = tmp_path / "doc.json"
        path.write_text(json.dumps(model.to_dict()))
        proc = subprocess.run([exe("handoff"), "create", "--file", str(path), "--root", str(root)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert (root / "handoffs" / "pending" / f"{proc.stdout.strip()}.json").exists()


def test_create_file_rejects_answers_and_unknown_formats(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    for doc, text in ((HAIOS_RESULT, "not a request"), ({"what": 1}, "formats tried"),
                      (HI_MOE_FLEET_TO_DISPATCHER, "is an Outcome")):
        path = tmp_path / "doc.json"
        path.write_text(json.dumps(doc))
        proc = subprocess.run([exe("handoff"), "create", "--file", str(path), "--root", str(root)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and text in proc.stderr, proc.stderr


@pytest.mark.parametrize("version", ["1.0", "1.0.0.0", "01.0.0", "1.0.0 ", "1" * 300])
def test_a_hi_moe_answer_never_copies_a_malformed_version(version: str, tmp_path: Path) -> None:
    """Found by the seed review: a Message with version "1.0" is refused, but its failure
    answer carried "1.0" and failed the message schema itself. A version the schema would
    refuse is answered with the current one."""
    dialect = dialects.by_name("hi_moe")
    request = dict(fresh(HI_MOE_DISPATCHER_TO_FLEET), version=version)
    rejected = outcome("failed", error={"code": "SCHEMA_VALIDATION_FAILED", "message": "bad"})
    answer = dialect.render(request, rejected, FiledState(0, 0, False),
                            artifacts=text_sink(Workspace(tmp_path)))
    assert answer["version"] == "1.0.0"
    assert SCHEMAS.errors(ANSWER_SCHEMA["hi_moe"], answer) == []
