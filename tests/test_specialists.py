"""The example specialists, run the way the daemon runs them: a child process, the handoff document
on stdin, HANDOFF_ID / HANDOFFD_ROOT / HANDOFF_ATTEMPT in the environment, one JSON object on stdout.

Also checks the repository's sample workspace files (handoffd.toml, schemas/, examples/requests/).
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

REPO = Path(__file__).resolve().parent.parent
SPECIALISTS = REPO / "specialists"
EXAMPLES = REPO / "examples" / "requests"
WORKSPACE_SCHEMAS = REPO / "schemas"

GOOD_BINARY_SEARCH = """\
def binary_search(nums, target):
    lo, hi = 0, len(nums) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if nums[mid] == target:
            return mid
        if nums[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
"""

# Off by one: never looks at the last element.
WRONG_BINARY_SEARCH = GOOD_BINARY_SEARCH.replace("hi = 0, len(nums) - 1", "hi = 0, len(nums) - 2")

CASES = [
    {"args": [[1, 3, 5, 7, 9], 7], "expected": 3},
    {"args": [[1, 3, 5, 7, 9], 1], "expected": 0},
    {"args": [[1, 3, 5, 7, 9], 9], "expected": 4},
    {"args": [[1, 3, 5, 7, 9], 4], "expected": -1},
    {"args": [[], 1], "expected": -1},
]


# --- helpers ---------------------------------------------------------------------------------

class Run:
    """What one specialist run produced."""

    def __init__(self, proc: subprocess.CompletedProcess[bytes], seconds: float) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr.decode("utf-8", "replace")
        self.seconds = seconds

    @property
    def result(self) -> dict[str, Any]:
        text = self.stdout.decode("utf-8").strip()
        assert text.count("\n") == 0, f"expected ONE JSON line on stdout, got {text[:300]!r}"
        value = json.loads(text)
        assert isinstance(value, dict)
        return value


def run_specialist(script: str, doc: Any, root: Path, *, attempt: int = 1,
                   timeout: float = 60) -> Run:
    """Run ``specialists/<script>`` as the daemon would, in workspace ``root``."""
    env = dict(os.environ)
    env.update(HANDOFFD_ROOT=str(root), HANDOFF_ATTEMPT=str(attempt),
               HANDOFF_ID=doc.get("handoff_id", "hoff-test") if isinstance(doc, dict) else "hoff-test")
    payload = doc if isinstance(doc, bytes) else json.dumps(doc).encode("utf-8")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(SPECIALISTS / script)], input=payload,
                          capture_output=True, env=env, cwd=root, timeout=timeout, check=False)
    return Run(proc, time.monotonic() - started)


def code_doc(source: str, cases: list[dict[str, Any]] | None = None, **data: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"language": "python", "source": source, "entrypoint": "binary_search",
                            "test_cases": CASES if cases is None else cases}
    body.update(data)
    return {"handoff_id": "hoff-code-test", "target": {"agent_id": "@code-runner"},
            "input": {"schema": "code-runner.input.schema.json", "data": body}}


def load_example(name: str) -> dict[str, Any]:
    return json.loads((EXAMPLES / name).read_text(encoding="utf-8"))


def react_doc(**changes: Any) -> dict[str, Any]:
    doc = load_example("react-userprofile.json")
    doc.update(changes)
    return doc


def workspace_validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((WORKSPACE_SCHEMAS / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty workspace."""
    (tmp_path / "artifacts").mkdir()
    return tmp_path


# --- @code-runner ----------------------------------------------------------------------------

def test_code_runner_binary_search_passes(root: Path) -> None:
    run = run_specialist("code_runner.py", code_doc(GOOD_BINARY_SEARCH), root)
    assert run.returncode == 0, run.stderr
    result = run.result
    assert result["status"] == "completed"
    assert "error" not in result
    assert result["output"]["passed"] == 5 and result["output"]["failed"] == 0
    assert [c["passed"] for c in result["output"]["cases"]] == [True] * 5
    assert result["output"]["cases"][4]["actual"] == -1  # the empty array
    assert result["artifacts"] == [{"artifact_type": "test_result", "content_ref": None,
                                    "inline_content": "5/5 tests passed",
                                    "metadata": {"passed": 5, "failed": 0}}]
    assert result["validation"]["status"] == "passed"


def test_code_runner_example_request_passes(root: Path) -> None:
    run = run_specialist("code_runner.py", load_example("code-binary-search.json"), root)
    result = run.result
    assert result["status"] == "completed", result
    assert result["artifacts"][0]["inline_content"] == "5/5 tests passed"


def test_code_runner_wrong_implementation_lists_failing_case(root: Path) -> None:
    run = run_specialist("code_runner.py", code_doc(WRONG_BINARY_SEARCH), root)
    result = run.result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "VALIDATION_FAILED"
    assert result["error"]["retryable"] is False
    assert "binary_search([1, 3, 5, 7, 9], 9)" in result["error"]["message"]
    assert "expected 4, got -1" in result["error"]["message"]
    failing = [c for c in result["output"]["cases"] if not c["passed"]]
    assert [c["index"] for c in failing] == [2]
    assert failing[0]["expected"] == 4 and failing[0]["actual"] == -1
    assert result["output"]["passed"] == 4 and result["output"]["failed"] == 1
    assert result["artifacts"][0]["inline_content"] == "4/5 tests passed"


def test_code_runner_stops_an_infinite_loop(root: Path) -> None:
    source = "def binary_search(nums, target):\n    while True:\n        pass\n"
    run = run_specialist("code_runner.py", code_doc(source, time_limit_seconds=1), root, timeout=30)
    result = run.result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "TIMEOUT"
    assert "time limit" in result["error"]["message"]
    assert run.seconds < 15
    assert result["output"]["cases"][0]["passed"] is False
    assert "time limit" in result["output"]["cases"][0]["error"]


def test_code_runner_timeout_keeps_results_of_finished_cases(root: Path) -> None:
    source = ("import time\n"
              "def binary_search(nums, target):\n"
              "    if not nums:\n        time.sleep(60)\n"
              "    return nums.index(target) if target in nums else -1\n")
    run = run_specialist("code_runner.py", code_doc(source, time_limit_seconds=1.5), root)
    result = run.result
    assert result["error"]["code"] == "TIMEOUT"
    assert [c["passed"] for c in result["output"]["cases"]] == [True, True, True, True, False]


def test_code_runner_syntax_error(root: Path) -> None:
    run = run_specialist("code_runner.py", code_doc("def binary_search(nums, target)\n    return 1\n"),
                         root)
    result = run.result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "PROCESSING_ERROR"
    assert "SyntaxError" in result["error"]["message"]


def test_code_runner_missing_entrypoint(root: Path) -> None:
    run = run_specialist("code_runner.py", code_doc("def other():\n    return 1\n"), root)
    result = run.result
    assert result["error"]["code"] == "PROCESSING_ERROR"
    assert "binary_search" in result["error"]["message"]


def test_code_runner_exceptions_and_prints_are_contained(root: Path) -> None:
    source = ("def binary_search(nums, target):\n"
              "    print('noise on stdout')\n"
              "    if target == 1:\n        raise ZeroDivisionError('boom')\n"
              "    if target == 4:\n        raise SystemExit(0)\n"
              "    return nums.index(target) if target in nums else -1\n")
    result = run_specialist("code_runner.py", code_doc(source), root).result
    cases = result["output"]["cases"]
    assert "ZeroDivisionError: boom" in cases[1]["error"]
    assert "SystemExit" in cases[3]["error"]
    assert [c["passed"] for c in cases] == [True, False, True, False, False]
    assert result["error"]["code"] == "VALIDATION_FAILED"


def test_code_runner_never_executes_test_data(root: Path) -> None:
    """Case values are data: a string that looks like code is passed, not run."""
    marker = root / "pwned"
    evil = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    source = "def binary_search(nums, target):\n    return target\n"
    cases = [{"args": [[], evil], "expected": evil},
             {"args": [[], "\"); import os; os.system('touch pwned'); (\""],
              "expected": "\"); import os; os.system('touch pwned'); (\""}]
    result = run_specialist("code_runner.py", code_doc(source, cases), root).result
    assert result["status"] == "completed", result
    assert not marker.exists()
    assert not (root / "pwned").exists()


@pytest.mark.parametrize("data_change, field", [
    ({"source": None}, "input.data.source"),
    ({"source": ""}, "input.data.source"),
    ({"entrypoint": "not a name"}, "input.data.entrypoint"),
    ({"entrypoint": "import"}, "input.data.entrypoint"),
    ({"test_cases": "all of them"}, "input.data.test_cases"),
    ({"test_cases": []}, "input.data.test_cases"),
    ({"test_cases": [{"args": [[], 1]}]}, "input.data.test_cases[0].expected"),
    ({"test_cases": [{"args": "x", "expected": 1}]}, "input.data.test_cases[0].args"),
    ({"time_limit_seconds": -1}, "input.data.time_limit_seconds"),
    ({"time_limit_seconds": "5"}, "input.data.time_limit_seconds"),
    ({"language": "ruby"}, "input.data.language"),
])
def test_code_runner_rejects_bad_input(root: Path, data_change: dict[str, Any], field: str) -> None:
    doc = code_doc(GOOD_BINARY_SEARCH)
    doc["input"]["data"].update(data_change)
    result = run_specialist("code_runner.py", doc, root).result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert result["error"]["retryable"] is False
    assert field in result["error"]["message"]
    assert result["error"]["errors"][0]["field"] == field


def test_code_runner_rejects_missing_data_and_non_json(root: Path) -> None:
    result = run_specialist("code_runner.py", {"handoff_id": "h", "input": {}}, root).result
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    run = run_specialist("code_runner.py", b"{not json", root)
    assert run.returncode == 0
    assert run.result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"


# --- @react-specialist -----------------------------------------------------------------------

def test_react_generator_writes_artifact(root: Path) -> None:
    run = run_specialist("react_generator.py", react_doc(), root)
    assert run.returncode == 0, run.stderr
    result = run.result
    assert result["status"] == "completed", result
    output = result["output"]
    assert re.fullmatch(r"artifacts/phase-13-react/artifact-react-comp-\d{13}\.json",
                        output["artifact_path"])
    assert output["artifact_id"] == Path(output["artifact_path"]).stem
    assert output["artifact_type"] == "react-components"
    assert output["schema_compliance"] == "valid"
    assert list(workspace_validator("react-specialist.output.schema.json").iter_errors(output)) == []

    path = root / output["artifact_path"]
    assert path.is_file()
    artifact = json.loads(path.read_text(encoding="utf-8"))
    assert artifact["artifact_id"] == output["artifact_id"]
    assert artifact["artifact_type"] == "react-components"
    assert artifact["generated_at"].endswith("Z")
    [component] = artifact["components"]
    assert component["name"] == "UserProfile"
    assert component["file"] == "src/components/UserProfile.tsx"
    source = component["source"]
    assert "interface UserProfileProps" in source
    assert "userId: string;" in source and "onUpdate?:" in source
    for state in ("userData", "isEditing", "isSaving"):
        assert f"const [{state}, set{state[0].upper()}{state[1:]}] = useState" in source
    assert "axios.get(`/api/users/${encodeURIComponent(String(userId))}`)" in source
    assert "axios.put(" in source
    assert "export function UserProfile(" in source

    assert result["validation"]["status"] == "passed"
    assert result["metadata"]["components_generated"] == 1
    assert result["metadata"]["total_lines_generated"] == source.count("\n")
    assert any("UserProfile" in step for step in result["next_steps"])
    # atomic write: no temp file left behind, nothing else written
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_react_generator_honours_destination(root: Path) -> None:
    doc = react_doc()
    doc["expected_output"]["destination"] = "artifacts/custom/react-{timestamp}.json"
    result = run_specialist("react_generator.py", doc, root).result
    assert result["status"] == "completed"
    assert re.fullmatch(r"artifacts/custom/react-\d{13}\.json", result["output"]["artifact_path"])
    assert (root / result["output"]["artifact_path"]).is_file()


def test_react_generator_accepts_absolute_destination_inside_root(root: Path) -> None:
    doc = react_doc()
    doc["expected_output"]["destination"] = str(root / "artifacts" / "abs.json")
    result = run_specialist("react_generator.py", doc, root).result
    assert result["status"] == "completed"
    assert result["output"]["artifact_path"] == "artifacts/abs.json"


@pytest.mark.parametrize("destination", ["../../etc/x", "../outside-{timestamp}.json",
                                         "artifacts/../../escape.json", "/etc/handoffd-x.json", "."])
def test_react_generator_refuses_destination_outside_root(root: Path, destination: str) -> None:
    workspace = root / "ws"
    workspace.mkdir()
    doc = react_doc()
    doc["expected_output"]["destination"] = destination
    result = run_specialist("react_generator.py", doc, workspace).result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "VALIDATION_FAILED"
    assert result["error"]["retryable"] is False
    assert list(workspace.iterdir()) == []
    assert sorted(p.name for p in root.iterdir()) == ["artifacts", "ws"]
    assert not Path("/etc/handoffd-x.json").exists()


def test_react_generator_refuses_symlink_escape(root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (root / "artifacts" / "link").symlink_to(outside, target_is_directory=True)
    doc = react_doc()
    doc["expected_output"]["destination"] = "artifacts/link/x.json"
    result = run_specialist("react_generator.py", doc, root).result
    assert result["error"]["code"] == "VALIDATION_FAILED"
    assert list(outside.iterdir()) == []


def test_react_generator_invalid_props_like_seed_failure(root: Path) -> None:
    result = run_specialist("react_generator.py", load_example("react-invalid.json"), root).result
    assert result["status"] == "failed"
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert result["error"]["retryable"] is False
    assert result["error"]["errors"][0]["field"] == "component_requirements[0].props.userId"
    assert result["error"]["errors"][0]["error"] == "Missing required field 'type'"
    assert list((root / "artifacts").iterdir()) == []


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(name="User Profile; alert(1)"), "component_requirements[0].name"),
    (lambda c: c.update(type="hook"), "component_requirements[0].type"),
    (lambda c: c["props"].update({"bad-name": {"type": "string"}}), "component_requirements[0].props.bad-name"),
    (lambda c: c["props"]["userId"].update(type="string; drop()"), "component_requirements[0].props.userId.type"),
    (lambda c: c.update(state_needs=["ok", "no way"]), "component_requirements[0].state_needs[1]"),
    (lambda c: c["api_integration"].append({"endpoint": "/x`${evil}`", "method": "GET"}),
     "component_requirements[0].api_integration[2].endpoint"),
    (lambda c: c["api_integration"].append({"endpoint": "/x", "method": "TRACE"}),
     "component_requirements[0].api_integration[2].method"),
])
def test_react_generator_rejects_unsafe_names(root: Path, change: Any, field: str) -> None:
    doc = react_doc()
    change(doc["input"]["data"]["component_requirements"][0])
    result = run_specialist("react_generator.py", doc, root).result
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert field in [e["field"] for e in result["error"]["errors"]]


def test_react_generator_requires_components(root: Path) -> None:
    doc = react_doc()
    doc["input"]["data"]["component_requirements"] = []
    result = run_specialist("react_generator.py", doc, root).result
    assert result["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    del doc["input"]
    assert run_specialist("react_generator.py", doc, root).result["error"]["code"] == \
        "SCHEMA_VALIDATION_FAILED"


def test_react_generator_javascript_and_class_components(root: Path) -> None:
    doc = react_doc()
    data = doc["input"]["data"]
    data["code_quality"]["typescript_enabled"] = False
    extra = copy.deepcopy(data["component_requirements"][0])
    extra.update(name="UserCard", type="class")
    data["component_requirements"].append(extra)
    result = run_specialist("react_generator.py", doc, root).result
    assert result["status"] == "completed"
    assert result["metadata"]["components_generated"] == 2
    artifact = json.loads((root / result["output"]["artifact_path"]).read_text())
    first, second = artifact["components"]
    assert first["file"] == "src/components/UserProfile.jsx"
    assert "interface" not in first["source"] and "useState(false)" in first["source"]
    assert "class UserCard extends React.Component" in second["source"]
    assert "this.props.userId" in second["source"]


def test_react_generator_two_components_share_one_artifact(root: Path) -> None:
    doc = react_doc()
    doc["input"]["data"]["component_requirements"].append(
        {"name": "OrderList", "type": "functional", "props": {}, "state_needs": ["orders"],
         "api_integration": [{"endpoint": "/api/orders", "method": "GET"}]})
    result = run_specialist("react_generator.py", doc, root).result
    files = list((root / "artifacts" / "phase-13-react").iterdir())
    assert len(files) == 1
    names = [c["name"] for c in json.loads(files[0].read_text())["components"]]
    assert names == ["UserProfile", "OrderList"]
    assert result["metadata"]["components_generated"] == 2


# --- @flaky ----------------------------------------------------------------------------------

def flaky_doc(handoff_id: str = "hoff-flaky", **data: Any) -> dict[str, Any]:
    return {"handoff_id": handoff_id, "target": {"agent_id": "@flaky"}, "input": {"data": data}}


def runs_logged(root: Path) -> list[dict[str, Any]]:
    path = root / "artifacts" / "flaky-runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_flaky_ok_echoes(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="ok", extra=[1, 2]), root)
    assert run.returncode == 0
    assert run.result["status"] == "completed"
    assert run.result["output"] == {"echo": {"mode": "ok", "extra": [1, 2]}}


def test_flaky_default_mode_is_ok(root: Path) -> None:
    assert run_specialist("flaky.py", flaky_doc(), root).result["status"] == "completed"


@pytest.mark.parametrize("mode, retryable", [("fail", True), ("permanent", False)])
def test_flaky_failures(root: Path, mode: str, retryable: bool) -> None:
    result = run_specialist("flaky.py", flaky_doc(mode=mode, message="it broke"), root).result
    assert result["status"] == "failed"
    assert result["error"] == {"code": "PROCESSING_ERROR", "message": "it broke",
                               "retryable": retryable}


def test_flaky_garbage(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="garbage"), root)
    assert run.returncode == 0
    with pytest.raises(ValueError):
        json.loads(run.stdout)


def test_flaky_sleep(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="sleep", seconds=0.5), root)
    assert run.result["status"] == "completed"
    assert run.seconds >= 0.5


def test_flaky_crash(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="crash", message="segfault-ish"), root)
    assert run.returncode == 3
    assert run.stdout == b""
    assert "segfault-ish" in run.stderr


def test_flaky_empty(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="empty"), root)
    assert run.returncode == 0 and run.stdout == b""


def test_flaky_huge(root: Path) -> None:
    run = run_specialist("flaky.py", flaky_doc(mode="huge", seconds=2), root)
    assert run.returncode == 0
    assert len(run.stdout) == 2 * 1024 * 1024 and set(run.stdout) == {ord("x")}


def test_flaky_huge_survives_a_closed_pipe(root: Path) -> None:
    env = dict(os.environ, HANDOFFD_ROOT=str(root), HANDOFF_ID="h", HANDOFF_ATTEMPT="1")
    proc = subprocess.Popen([sys.executable, str(SPECIALISTS / "flaky.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=root)
    assert proc.stdin and proc.stdout
    proc.stdin.write(json.dumps(flaky_doc(mode="huge")).encode())
    proc.stdin.close()
    assert proc.stdout.read(1024) == b"x" * 1024
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0
    assert b"Traceback" not in (proc.stderr.read() if proc.stderr else b"")


def test_flaky_fail_then_ok(root: Path) -> None:
    first = run_specialist("flaky.py", flaky_doc(mode="fail_then_ok"), root, attempt=1).result
    assert first["status"] == "failed" and first["error"]["retryable"] is True
    second = run_specialist("flaky.py", flaky_doc(mode="fail_then_ok"), root, attempt=2).result
    assert second["status"] == "completed"
    third = run_specialist("flaky.py", flaky_doc(mode="fail_then_ok"), root, attempt=3).result
    assert third["status"] == "completed"


def test_flaky_logs_every_run(root: Path) -> None:
    for attempt, mode in enumerate(["ok", "fail", "crash", "empty", "garbage"], start=1):
        run_specialist("flaky.py", flaky_doc("hoff-count", mode=mode), root, attempt=attempt)
    run_specialist("flaky.py", flaky_doc("hoff-other"), root)
    runs = runs_logged(root)
    assert [(r["id"], r["attempt"]) for r in runs] == [
        ("hoff-count", 1), ("hoff-count", 2), ("hoff-count", 3), ("hoff-count", 4),
        ("hoff-count", 5), ("hoff-other", 1)]
    assert all(isinstance(r["pid"], int) for r in runs)


def test_flaky_log_is_created_without_artifacts_dir(tmp_path: Path) -> None:
    run_specialist("flaky.py", flaky_doc(), tmp_path)
    assert len(runs_logged(tmp_path)) == 1


def test_flaky_concurrent_runs_each_log_one_line(root: Path) -> None:
    env = dict(os.environ, HANDOFFD_ROOT=str(root), HANDOFF_ATTEMPT="1")
    procs = []
    for i in range(8):
        proc = subprocess.Popen([sys.executable, str(SPECIALISTS / "flaky.py")],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                env=dict(env, HANDOFF_ID=f"hoff-par-{i}"), cwd=root)
        assert proc.stdin
        proc.stdin.write(json.dumps(flaky_doc(f"hoff-par-{i}")).encode())
        proc.stdin.close()
        procs.append(proc)
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert sorted(r["id"] for r in runs_logged(root)) == sorted(f"hoff-par-{i}" for i in range(8))


# --- the repository's sample workspace -------------------------------------------------------

def test_handoffd_toml_registers_the_examples() -> None:
    config = tomllib.loads((REPO / "handoffd.toml").read_text(encoding="utf-8"))
    assert "daemon" not in config  # documented but commented out: defaults apply
    react = config["specialists"]["@react-specialist"]
    assert react["command"] == ["python3", "specialists/react_generator.py"]
    assert react["retry"] == {"max_retries": 2, "retry_delay_seconds": 1, "backoff_multiplier": 2.0}
    code = config["specialists"]["@code-runner"]
    assert code["command"] == ["python3", "specialists/code_runner.py"]
    for table in (react, code):
        for key in ("input_schema", "output_schema"):
            if key in table:
                assert (WORKSPACE_SCHEMAS / table[key]).is_file()
        assert (REPO / table["command"][1]).is_file()


@pytest.mark.parametrize("name, schema", [
    ("react-userprofile.json", "react-specialist.input.schema.json"),
    ("code-binary-search.json", "code-runner.input.schema.json"),
])
def test_example_requests_are_valid(name: str, schema: str) -> None:
    doc = load_example(name)
    assert list(workspace_validator(schema).iter_errors(doc["input"]["data"])) == []
    request = resources.files("handoffd") / "schemas" / "native.request.schema.json"
    native = jsonschema.Draft202012Validator(json.loads(request.read_text(encoding="utf-8")),
                                             format_checker=jsonschema.FormatChecker())
    assert list(native.iter_errors(doc)) == []


def test_invalid_example_fails_where_seed_001_says() -> None:
    doc = load_example("react-invalid.json")
    found = list(workspace_validator("react-specialist.input.schema.json")
                 .iter_errors(doc["input"]["data"]))
    assert [list(e.absolute_path) for e in found] == [["component_requirements", 0, "props", "userId"]]
    assert found[0].validator == "required" and "'type'" in found[0].message


def test_context_files_are_json() -> None:
    for name in ("project-context.json", "tech-stack.json", "phase-status.json"):
        data = json.loads((REPO / "context" / name).read_text(encoding="utf-8"))
        assert data["project_id"] == "proj-001"
    phases = json.loads((REPO / "context" / "phase-status.json").read_text())["phases"]
    assert [p["phase"] for p in phases] == list(range(6, 17))
