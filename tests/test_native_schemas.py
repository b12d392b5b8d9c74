"""The built-in JSON Schemas for seed 001's request, response and failure documents.

Seed 001's three examples must validate; mutated copies must fail at a precise JSON path; and the
documents handoffd itself writes (with its ``handoffd`` bookkeeping block) must validate too.
"""
from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from importlib import resources
from typing import Any, Callable

import jsonschema
import pytest

SCHEMA_NAMES = ("native.request.schema.json", "native.response.schema.json",
                "native.failure.schema.json")

# --- seed 001's examples, as data ------------------------------------------------------------

SEED_REQUEST: dict[str, Any] = {
    "handoff_id": "hoff-001-1705147200000",
    "timestamp": "2026-01-13T10:00:00Z",
    "status": "pending",
    "source": {"agent_id": "@frontend-specialist", "phase": 11, "agent_type": "orchestrator"},
    "target": {"agent_id": "@react-specialist", "phase": 13, "agent_type": "specialist"},
    "context": {
        "project_id": "proj-001",
        "tech_stack_artifact_id": "artifact-tech-stack-001",
        "tech_stack": {"framework": "React", "version": "18.2", "state_management": "Redux Toolkit",
                       "styling": "Tailwind CSS", "testing": "Jest"},
    },
    "input": {
        "schema": "react-specialist.input.schema.json",
        "data": {
            "component_requirements": [{
                "name": "UserProfile",
                "type": "functional",
                "responsibility": "Display user profile with edit capability",
                "props": {"userId": {"type": "string", "required": True},
                          "onUpdate": {"type": "callback", "required": False}},
                "state_needs": ["userData", "isEditing", "isSaving"],
                "api_integration": [{"endpoint": "/api/users/{id}", "method": "GET"},
                                    {"endpoint": "/api/users/{id}", "method": "PUT"}],
            }],
            "dependency_context": {"state_management": "Redux Toolkit", "styling": "Tailwind CSS",
                                   "ui_library": "none", "testing_framework": "Jest",
                                   "routing_library": "React Router v6", "http_client": "axios"},
            "code_quality": {"typescript_enabled": True, "testing_coverage_target": 80,
                             "accessibility_level": "WCAG 2.1 AA"},
        },
    },
    "expected_output": {"artifact_type": "react-components",
                        "schema": "react-specialist.output.schema.json",
                        "destination": "artifacts/phase-13-react/artifact-react-comp-{timestamp}.json"},
    "timeout_seconds": 300,
    "priority": "normal",
    "retry_policy": {"max_retries": 3, "retry_delay_seconds": 30},
}

SEED_RESPONSE: dict[str, Any] = {
    "handoff_id": "hoff-001-1705147200000",
    "timestamp_completed": "2026-01-13T10:05:32Z",
    "status": "completed",
    "execution_time_seconds": 332,
    "source": {"agent_id": "@frontend-specialist", "phase": 11},
    "target": {"agent_id": "@react-specialist", "phase": 13},
    "output": {"artifact_id": "artifact-react-comp-1705147532000",
               "artifact_path": "artifacts/phase-13-react/artifact-react-comp-1705147532000.json",
               "artifact_type": "react-components", "schema_compliance": "valid"},
    "validation": {"status": "passed", "typescript_errors": 0, "eslint_warnings": 0,
                   "tests_passing": True, "coverage_percentage": 87, "accessibility_violations": 0},
    "metadata": {"components_generated": 1, "custom_hooks_generated": 1, "test_files_generated": 1,
                 "total_lines_generated": 290},
    "next_steps": ["Integrate UserProfile component into application",
                   "Configure Redux store with userSlice", "Set up React Router routes"],
    "warnings": [],
    "errors": [],
}

SEED_FAILURE: dict[str, Any] = {
    "handoff_id": "hoff-002-1705147300000",
    "timestamp_failed": "2026-01-13T10:10:00Z",
    "status": "failed",
    "execution_time_seconds": 120,
    "source": {"agent_id": "@frontend-specialist", "phase": 11},
    "target": {"agent_id": "@react-specialist", "phase": 13},
    "error": {"code": "SCHEMA_VALIDATION_FAILED",
              "message": "Input validation failed: component_requirements[0].props is missing "
                         "required field 'type'",
              "severity": "error", "timestamp": "2026-01-13T10:08:45Z"},
    "validation": {"status": "failed", "errors": [{
        "field": "component_requirements[0].props.userId",
        "error": "Missing required field 'type'",
        "schema_path": "$.component_requirements[*].props.*"}]},
    "retry_available": True,
    "retry_count": 0,
    "max_retries": 3,
    "recovery_actions": ["Fix input schema validation errors",
                         "Ensure all props have 'type' field defined",
                         "Retry handoff with corrected input"],
}

BOOKKEEPING: dict[str, Any] = {
    "id": "hoff-001-1705147200000",
    "revision": 3,
    "attempt": 1,
    "history": [
        {"at": "2026-01-13T10:00:00.000Z", "event": "created",
         "actor": {"host": "build-1", "pid": 4242}},
        {"at": "2026-01-13T10:00:01.250Z", "event": "claimed",
         "actor": {"host": "build-1", "pid": 4243}, "detail": {"attempt": 1}},
    ],
    "lease": {"owner": {"host": "build-1", "pid": 4243}, "expires_at": "2026-01-13T10:01:01Z"},
    "next_attempt_at": "2026-01-13T10:00:30Z",
}


# --- helpers ---------------------------------------------------------------------------------

def load(name: str) -> dict[str, Any]:
    """A built-in schema, read the way the package reads it."""
    text = (resources.files("handoffd") / "schemas" / name).read_text(encoding="utf-8")
    return json.loads(text)


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load(name), format_checker=jsonschema.FormatChecker())


def errors(name: str, doc: Any) -> list[jsonschema.ValidationError]:
    return list(validator(name).iter_errors(doc))


def mutate(doc: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    copied = copy.deepcopy(doc)
    change(copied)
    return copied


def setter(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def deleter(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


# --- the schemas themselves ------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    schema = load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://handoffd.dev/schemas/{name}"
    assert schema.get("additionalProperties", True) is True


@pytest.mark.parametrize("name, doc", [
    ("native.request.schema.json", SEED_REQUEST),
    ("native.response.schema.json", SEED_RESPONSE),
    ("native.failure.schema.json", SEED_FAILURE),
])
def test_seed_examples_validate(name: str, doc: dict[str, Any]) -> None:
    assert [e.message for e in errors(name, doc)] == []


@pytest.mark.parametrize("name, doc", [
    ("native.request.schema.json", SEED_REQUEST),
    ("native.response.schema.json", SEED_RESPONSE),
    ("native.failure.schema.json", SEED_FAILURE),
])
def test_bookkeeping_block_and_unknown_fields_are_allowed(name: str, doc: dict[str, Any]) -> None:
    extended = mutate(doc, setter(("handoffd",), BOOKKEEPING))
    extended["x_custom_field"] = {"anything": [1, 2, 3]}
    assert [e.message for e in errors(name, extended)] == []


def test_minimal_request_validates() -> None:
    doc = {"handoff_id": "hoff-1", "target": {"agent_id": "@echo"}}
    assert errors("native.request.schema.json", doc) == []


@pytest.mark.parametrize("priority", ["critical", "high", "normal", "medium", "low", "backlog",
                                      0, 2, 4])
def test_request_priorities(priority: Any) -> None:
    doc = mutate(SEED_REQUEST, setter(("priority",), priority))
    assert errors("native.request.schema.json", doc) == []


@pytest.mark.parametrize("output", [None, "plain text", 42, [1, 2], {"echo": {"a": 1}}])
def test_response_output_may_be_any_json(output: Any) -> None:
    doc = mutate(SEED_RESPONSE, setter(("output",), output))
    assert errors("native.response.schema.json", doc) == []


def test_response_with_completed_at_and_partial_status() -> None:
    doc = mutate(SEED_RESPONSE, deleter(("timestamp_completed",)))
    doc["completed_at"] = "2026-01-13T10:05:32.120Z"
    doc["status"] = "partial"
    assert errors("native.response.schema.json", doc) == []


def test_cancelled_failure_validates() -> None:
    doc = mutate(SEED_FAILURE, setter(("status",), "cancelled"))
    doc["error"].update(code="CANCELLED", retryable=False)
    assert errors("native.failure.schema.json", doc) == []


# --- wrong documents fail, at the right place ------------------------------------------------

REQUEST_MUTATIONS = [
    ("no id", deleter(("handoff_id",)), [], "required"),
    ("path id", setter(("handoff_id",), "../../etc/passwd"), ["handoff_id"], "pattern"),
    ("long id", setter(("handoff_id",), "h" * 129), ["handoff_id"], "pattern"),
    ("no target", deleter(("target",)), [], "required"),
    ("target agent missing", deleter(("target", "agent_id")), ["target"], "required"),
    ("target agent empty", setter(("target", "agent_id"), ""), ["target", "agent_id"], "minLength"),
    ("target not object", setter(("target",), "@react-specialist"), ["target"], "type"),
    ("bad status", setter(("status",), "completed"), ["status"], "enum"),
    ("bad timestamp", setter(("timestamp",), "yesterday at noon"), ["timestamp"], None),
    ("naive timestamp", setter(("timestamp",), "2026-01-13T10:00:00"), ["timestamp"], None),
    ("phase not int", setter(("source", "phase"), "eleven"), ["source", "phase"], "type"),
    ("context not object", setter(("context",), []), ["context"], "type"),
    ("input schema not str", setter(("input", "schema"), 7), ["input", "schema"], "type"),
    ("destination not str", setter(("expected_output", "destination"), ["a"]),
     ["expected_output", "destination"], "type"),
    ("zero timeout", setter(("timeout_seconds",), 0), ["timeout_seconds"], "exclusiveMinimum"),
    ("string timeout", setter(("timeout_seconds",), "300"), ["timeout_seconds"], "type"),
    ("unknown priority", setter(("priority",), "urgent"), ["priority"], "oneOf"),
    ("priority too big", setter(("priority",), 7), ["priority"], "oneOf"),
    ("negative retries", setter(("retry_policy", "max_retries"), -1),
     ["retry_policy", "max_retries"], "minimum"),
    ("shrinking backoff", setter(("retry_policy", "backoff_multiplier"), 0.5),
     ["retry_policy", "backoff_multiplier"], "minimum"),
    ("depends_on string", setter(("depends_on",), "hoff-0"), ["depends_on"], "type"),
    ("depends_on number", setter(("depends_on",), ["hoff-0", 5]), ["depends_on", 1], "type"),
    ("bad started_at", setter(("started_at",), "soon"), ["started_at"], None),
    ("history entry without at", setter(("handoffd",), {"history": [{"event": "created"}]}),
     ["handoffd", "history", 0], "required"),
    ("revision not int", setter(("handoffd",), {"revision": "3"}),
     ["handoffd", "revision"], "type"),
]

RESPONSE_MUTATIONS = [
    ("failed status", setter(("status",), "failed"), ["status"], "enum"),
    ("no status", deleter(("status",)), [], "required"),
    ("no completion time", deleter(("timestamp_completed",)), [], "anyOf"),
    ("bad completion time", setter(("timestamp_completed",), "10:05"), ["timestamp_completed"], None),
    ("negative time", setter(("execution_time_seconds",), -1), ["execution_time_seconds"], "minimum"),
    ("no execution time", deleter(("execution_time_seconds",)), [], "required"),
    ("bad compliance", setter(("output", "schema_compliance"), "maybe"),
     ["output", "schema_compliance"], "enum"),
    ("artifact path not str", setter(("output", "artifact_path"), 12),
     ["output", "artifact_path"], "type"),
    ("bad validation status", setter(("validation", "status"), "ok"), ["validation", "status"], "enum"),
    ("metadata list", setter(("metadata",), [1]), ["metadata"], "type"),
    ("next_steps string", setter(("next_steps",), "do it"), ["next_steps"], "type"),
    ("bad id", setter(("handoff_id",), "/abs/path"), ["handoff_id"], "pattern"),
]

FAILURE_MUTATIONS = [
    ("completed status", setter(("status",), "completed"), ["status"], "enum"),
    ("no failure time", deleter(("timestamp_failed",)), [], "anyOf"),
    ("no error", deleter(("error",)), [], "required"),
    ("lowercase code", setter(("error", "code"), "schema validation failed"), ["error", "code"],
     "pattern"),
    ("bad severity", setter(("error", "severity"), "fatal"), ["error", "severity"], "enum"),
    ("no error timestamp", deleter(("error", "timestamp")), ["error"], "required"),
    ("retryable string", setter(("error", "retryable"), "yes"), ["error", "retryable"], "type"),
    ("retry_available string", setter(("retry_available",), "true"), ["retry_available"], "type"),
    ("negative retry count", setter(("retry_count",), -1), ["retry_count"], "minimum"),
    ("no max_retries", deleter(("max_retries",)), [], "required"),
    ("recovery action number", setter(("recovery_actions",), ["ok", 3]),
     ["recovery_actions", 1], "type"),
    ("validation error field", setter(("validation", "errors"), [{"field": 1}]),
     ["validation", "errors", 0, "field"], "type"),
]


def _check_mutation(name: str, base: dict[str, Any], change: Callable[[dict[str, Any]], None],
                    path: list[Any], keyword: str | None) -> None:
    found = errors(name, mutate(base, change))
    assert found, "the mutated document should not validate"
    located = [e for e in found if list(e.absolute_path) == path]
    assert located, f"expected an error at {path}, got {[list(e.absolute_path) for e in found]}"
    if keyword is not None:
        assert keyword in {e.validator for e in located}


@pytest.mark.parametrize("label, change, path, keyword", REQUEST_MUTATIONS,
                         ids=[m[0] for m in REQUEST_MUTATIONS])
def test_request_mutations_fail(label: str, change: Callable[[dict[str, Any]], None],
                                path: list[Any], keyword: str | None) -> None:
    _check_mutation("native.request.schema.json", SEED_REQUEST, change, path, keyword)


@pytest.mark.parametrize("label, change, path, keyword", RESPONSE_MUTATIONS,
                         ids=[m[0] for m in RESPONSE_MUTATIONS])
def test_response_mutations_fail(label: str, change: Callable[[dict[str, Any]], None],
                                 path: list[Any], keyword: str | None) -> None:
    _check_mutation("native.response.schema.json", SEED_RESPONSE, change, path, keyword)


@pytest.mark.parametrize("label, change, path, keyword", FAILURE_MUTATIONS,
                         ids=[m[0] for m in FAILURE_MUTATIONS])
def test_failure_mutations_fail(label: str, change: Callable[[dict[str, Any]], None],
                                path: list[Any], keyword: str | None) -> None:
    _check_mutation("native.failure.schema.json", SEED_FAILURE, change, path, keyword)


def test_request_is_not_a_response() -> None:
    assert errors("native.response.schema.json", SEED_REQUEST)
    assert errors("native.failure.schema.json", SEED_REQUEST)


# --- documents handoffd writes ---------------------------------------------------------------

def test_documents_written_by_handoffd_validate() -> None:
    """What the daemon files for a completed and a failed seed-001 handoff matches the schemas."""
    documents = pytest.importorskip("handoffd.core.documents")
    native_format = pytest.importorskip("handoffd.core.native_format")
    start = datetime(2026, 1, 13, 10, 0, 0, tzinfo=timezone.utc)
    request = native_format.new_native_request(source="@frontend-specialist", target="@react-specialist",
                                               data={"component_requirements": []}, now=start,
                                               handoff_id="hoff-roundtrip-1", timeout_seconds=60,
                                               priority="high", depends_on=["hoff-0"])
    documents.record(request, "created", start)
    assert errors("native.request.schema.json", request) == []

    done = copy.deepcopy(request)
    native_format.apply_native_outcome(done, documents.Outcome(
        status="completed", started_at=start, finished_at=start + timedelta(seconds=3),
        output={"artifact_id": "a-1", "artifact_path": "artifacts/a-1.json",
                "artifact_type": "react-components", "schema_compliance": "valid"},
        validation={"status": "passed"}, metadata={"components_generated": 1},
        next_steps=["Integrate"]), retry_count=0, max_retries=3, retry_available=False)
    assert [e.message for e in errors("native.response.schema.json", done)] == []

    failed = copy.deepcopy(request)
    native_format.apply_native_outcome(failed, documents.Outcome(
        status="failed", started_at=start, finished_at=start + timedelta(seconds=1),
        error={"code": "SCHEMA_VALIDATION_FAILED", "message": "props.userId lacks type",
               "retryable": False,
               "errors": [{"field": "component_requirements[0].props.userId",
                           "error": "'type' is a required property",
                           "schema_path": "#/properties/component_requirements"}]}),
        retry_count=0, max_retries=3, retry_available=False)
    assert [e.message for e in errors("native.failure.schema.json", failed)] == []
