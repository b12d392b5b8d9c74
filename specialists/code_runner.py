#!/usr/bin/env python3
"""@code-runner: run a Python function against test cases and report per-case results.

A handoffd command specialist (docs/specialists.md). It reads the handoff document as JSON on
stdin and prints one result object on stdout. ``input.data`` looks like::

    {"language": "python", "source": "def binary_search(nums, target): ...",
     "entrypoint": "binary_search", "time_limit_seconds": 5,
     "test_cases": [{"args": [[1, 3, 5], 3], "expected": 1}, ...]}

The source and a fixed harness are written into a temporary directory and run with
``sys.executable -I`` (isolated mode) in a child process. Test case values reach the child only as
JSON on its stdin, never as code. The child's wall time is bounded by ``subprocess.run(timeout=...)``,
its CPU time, file sizes and address space by resource limits, and what it prints by reading at most
a fixed number of bytes back from its output files.

Outcomes: every case passes → ``completed``; some case fails → ``failed`` / ``VALIDATION_FAILED``;
the source does not load or the entry point is missing → ``failed`` / ``PROCESSING_ERROR``; the time
limit is hit → ``failed`` / ``TIMEOUT``; bad input → ``failed`` / ``SCHEMA_VALIDATION_FAILED``.
None of these are retryable: running the same code again gives the same answer.
Standard library only.
"""
from __future__ import annotations

import json
import keyword
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_TIME_LIMIT = 5.0
MAX_TIME_LIMIT = 600.0
MAX_SOURCE_BYTES = 1024 * 1024
MAX_CASES = 1000
MAX_RESULT_BYTES = 4 * 1024 * 1024     # read back at most this much of the child's results
MAX_STDERR_BYTES = 8 * 1024            # ... and this much of what it printed
FILE_SIZE_LIMIT = 16 * 1024 * 1024     # RLIMIT_FSIZE for the child: bounds its output files
MEMORY_LIMIT = 2 * 1024 * 1024 * 1024  # RLIMIT_AS for the child
SHOWN_FAILURES = 5

# The harness is fixed text: it never contains anything taken from the handoff.
HARNESS = r'''
import importlib.util, json, os, sys, traceback

def emit(fd, record):
    os.write(fd, (json.dumps(record) + "\n").encode("utf-8"))

def main():
    results_fd = os.dup(1)        # results go to the original stdout ...
    os.dup2(2, 1)                 # ... anything the code under test prints goes to stderr
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    try:
        spec = importlib.util.spec_from_file_location("solution", job["solution_path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as exc:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        emit(results_fd, {"kind": "load_error", "error": last})
        return
    func = getattr(module, job["entrypoint"], None)
    if not callable(func):
        emit(results_fd, {"kind": "load_error",
                          "error": "the source defines no callable named %r" % job["entrypoint"]})
        return
    emit(results_fd, {"kind": "loaded"})
    for index, case in enumerate(job["cases"]):
        emit(results_fd, {"kind": "start", "index": index})
        try:
            value = func(*case.get("args", []), **case.get("kwargs", {}))
        except BaseException as exc:  # SystemExit from the code under test is a failure too
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            emit(results_fd, {"kind": "case", "index": index, "raised": last})
            continue
        try:
            actual = json.loads(json.dumps(value, allow_nan=False))
            emit(results_fd, {"kind": "case", "index": index, "actual": actual})
        except (TypeError, ValueError):
            emit(results_fd, {"kind": "case", "index": index, "unserializable": repr(value)[:200]})
    emit(results_fd, {"kind": "done"})

main()
'''


class InputError(Exception):
    """The handoff's input does not have the shape this specialist needs."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def parse_input(doc: Any) -> dict[str, Any]:
    """Check ``input.data`` and return the normalised job; raise InputError on the first problem."""
    if not isinstance(doc, dict):
        raise InputError("$", "the handoff document must be a JSON object")
    inp = doc.get("input")
    if not isinstance(inp, dict):
        raise InputError("input", "must be an object holding 'data'")
    data = inp.get("data")
    if not isinstance(data, dict):
        raise InputError("input.data", "must be an object with source, entrypoint and test_cases")
    language = data.get("language", "python")
    if not isinstance(language, str) or language.lower() != "python":
        raise InputError("input.data.language", f"only 'python' is supported, not {language!r}")
    source = data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise InputError("input.data.source", "is required: a non-empty string of Python source")
    if len(source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
        raise InputError("input.data.source", f"is larger than {MAX_SOURCE_BYTES} bytes")
    if "\x00" in source:
        raise InputError("input.data.source", "must not contain NUL characters")
    entrypoint = data.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.isidentifier() or keyword.iskeyword(entrypoint):
        raise InputError("input.data.entrypoint", "is required: the name of the function to call "
                         "(a Python identifier)")
    cases = data.get("test_cases")
    if not isinstance(cases, list) or not cases:
        raise InputError("input.data.test_cases", "is required: a non-empty array of "
                         "{\"args\": [...], \"expected\": ...}")
    if len(cases) > MAX_CASES:
        raise InputError("input.data.test_cases", f"has more than {MAX_CASES} cases")
    normalised: list[dict[str, Any]] = []
    for index, case in enumerate(cases):
        where = f"input.data.test_cases[{index}]"
        if not isinstance(case, dict):
            raise InputError(where, "must be an object with 'args' and 'expected'")
        args = case.get("args", [])
        if not isinstance(args, list):
            raise InputError(f"{where}.args", "must be an array of positional arguments")
        kwargs = case.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise InputError(f"{where}.kwargs", "must be an object of keyword arguments")
        if "expected" not in case:
            raise InputError(f"{where}.expected", "is required: the value the call must return")
        normalised.append({"args": args, "kwargs": kwargs, "expected": case["expected"]})
    limit = data.get("time_limit_seconds", DEFAULT_TIME_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= MAX_TIME_LIMIT:
        raise InputError("input.data.time_limit_seconds",
                         f"must be a number of seconds above 0 and at most {MAX_TIME_LIMIT:g}")
    return {"source": source, "entrypoint": entrypoint, "cases": normalised,
            "time_limit": float(limit)}


def same(expected: Any, actual: Any) -> bool:
    """JSON equality, with floats compared by closeness and bools never equal to numbers."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if isinstance(expected, float) or isinstance(actual, float):
            return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12)
        return expected == actual
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(map(same, expected, actual))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(same(v, actual[k]) for k, v in expected.items())
    return type(expected) is type(actual) and expected == actual


def _limit_child(time_limit: float) -> None:
    """Resource limits for the child (runs between fork and exec): CPU, file size, memory."""
    try:
        import resource
    except ImportError:  # not POSIX: the wall-clock timeout still applies
        return
    cpu = int(math.ceil(time_limit)) + 1
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT),
                         (resource.RLIMIT_AS, MEMORY_LIMIT)):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass


def _read_head(path: Path, limit: int) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(limit)


def _read_tail(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(size - limit, 0))
        return handle.read().decode("utf-8", "replace").strip()


def execute(job: dict[str, Any]) -> dict[str, Any]:
    """Run the job in a child process; return what it reported and how it ended."""
    with tempfile.TemporaryDirectory(prefix="handoffd-code-runner-") as tmp:
        folder = Path(tmp)
        solution = folder / "solution.py"
        harness = folder / "harness.py"
        solution.write_text(job["source"], encoding="utf-8", errors="surrogatepass")
        harness.write_text(HARNESS, encoding="utf-8")
        payload = json.dumps({"solution_path": str(solution), "entrypoint": job["entrypoint"],
                              "cases": [{"args": c["args"], "kwargs": c["kwargs"]}
                                        for c in job["cases"]]}).encode("utf-8")
        stdin_path, out_path, err_path = folder / "job.json", folder / "results.jsonl", folder / "stderr.txt"
        stdin_path.write_bytes(payload)
        env = {"PATH": os.defpath, "LC_ALL": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        timed_out = False
        with open(stdin_path, "rb") as stdin, open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.run(
                    [sys.executable, "-I", "-X", "utf8", str(harness)],
                    stdin=stdin, stdout=out, stderr=err, cwd=tmp, env=env,
                    timeout=job["time_limit"], check=False,
                    preexec_fn=(lambda: _limit_child(job["time_limit"])) if os.name == "posix" else None,
                )
                returncode: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
        raw = _read_head(out_path, MAX_RESULT_BYTES)
        stderr_tail = _read_tail(err_path, MAX_STDERR_BYTES)
    records: list[dict[str, Any]] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a truncated last line
        if isinstance(record, dict):
            records.append(record)
    return {"records": records, "timed_out": timed_out, "returncode": returncode,
            "stderr": stderr_tail}


def describe_call(entrypoint: str, case: dict[str, Any]) -> str:
    """``binary_search([1, 3, 5], 3)`` for messages (shortened)."""
    parts = [json.dumps(a) for a in case["args"]]
    parts += [f"{k}={json.dumps(v)}" for k, v in case["kwargs"].items()]
    text = f"{entrypoint}({', '.join(parts)})"
    return text if len(text) <= 120 else text[:117] + "..."


def summarise(job: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Turn the child's records into the specialist result object."""
    cases = job["cases"]
    records = run["records"]
    load_error = next((r["error"] for r in records if r.get("kind") == "load_error"), None)
    loaded = any(r.get("kind") == "loaded" for r in records)
    finished = any(r.get("kind") == "done" for r in records)
    by_index = {r["index"]: r for r in records if r.get("kind") == "case" and isinstance(r.get("index"), int)}
    started = {r["index"] for r in records if r.get("kind") == "start" and isinstance(r.get("index"), int)}

    results: list[dict[str, Any]] = []
    for index, case in enumerate(cases):
        entry: dict[str, Any] = {"index": index, "call": describe_call(job["entrypoint"], case),
                                 "args": case["args"], "expected": case["expected"]}
        record = by_index.get(index)
        if record is None:
            entry["passed"] = False
            if index in started and run["timed_out"]:
                entry["error"] = f"time limit of {job['time_limit']:g}s reached during this case"
            elif index in started:
                entry["error"] = "the process ended during this case"
            else:
                entry["error"] = "not run"
        elif "raised" in record:
            entry.update(passed=False, error=f"raised {record['raised']}")
        elif "unserializable" in record:
            entry.update(passed=False, actual=record["unserializable"],
                         error="returned a value that is not JSON-serialisable")
        else:
            entry["actual"] = record.get("actual")
            entry["passed"] = same(case["expected"], entry["actual"])
            if not entry["passed"]:
                entry["error"] = f"expected {json.dumps(case['expected'])}, got {json.dumps(entry['actual'])}"
        results.append(entry)

    passed = sum(1 for r in results if r["passed"])
    failed = len(results) - passed
    output = {"passed": passed, "failed": failed, "total": len(results),
              "entrypoint": job["entrypoint"], "time_limit_seconds": job["time_limit"],
              "cases": results}
    artifacts = [{"artifact_type": "test_result", "content_ref": None,
                  "inline_content": f"{passed}/{len(results)} tests passed",
                  "metadata": {"passed": passed, "failed": failed}}]
    result: dict[str, Any] = {"output": output, "artifacts": artifacts,
                              "metadata": {"language": "python", "cases_total": len(results)}}
    if run["stderr"]:
        result["warnings"] = [f"the code printed (tail): {run['stderr'][-500:]}"]

    if load_error is not None:
        return _failed(result, "PROCESSING_ERROR", f"the source could not be loaded: {load_error}")
    if run["timed_out"]:
        done = len(by_index)
        return _failed(result, "TIMEOUT",
                       f"time limit of {job['time_limit']:g}s exceeded after {done} of "
                       f"{len(results)} test cases; the process was stopped")
    if not loaded or not finished:
        detail = f"; stderr: {run['stderr'][-500:]}" if run["stderr"] else ""
        return _failed(result, "PROCESSING_ERROR",
                       f"the test process ended abnormally (exit status {run['returncode']}){detail}")
    if failed:
        shown = [f"case {r['index']} {r['call']}: {r['error']}" for r in results if not r["passed"]]
        more = f" (and {len(shown) - SHOWN_FAILURES} more)" if len(shown) > SHOWN_FAILURES else ""
        result["validation"] = {"status": "failed", "passed": passed, "failed": failed}
        result["next_steps"] = ["Fix the implementation so every test case passes",
                                "Retry the handoff with the corrected source"]
        return _failed(result, "VALIDATION_FAILED",
                       f"{failed} of {len(results)} test cases failed: "
                       + "; ".join(shown[:SHOWN_FAILURES]) + more)
    result["status"] = "completed"
    result["validation"] = {"status": "passed", "passed": passed, "failed": 0}
    result["next_steps"] = [f"Use {job['entrypoint']} — all {passed} test cases pass"]
    return result


def _failed(result: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    result["status"] = "failed"
    result["error"] = {"code": code, "message": message, "retryable": False}
    return result


def handle(doc: Any) -> dict[str, Any]:
    """The whole specialist: a handoff document in, a result object out."""
    try:
        job = parse_input(doc)
    except InputError as exc:
        return {"status": "failed",
                "error": {"code": "SCHEMA_VALIDATION_FAILED",
                          "message": f"Input validation failed: {exc.field} {exc.problem}",
                          "retryable": False,
                          "errors": [{"field": exc.field, "error": exc.problem,
                                      "schema_path": "code-runner.input.schema.json"}]}}
    return summarise(job, execute(job))


def main() -> int:
    """Read the handoff from stdin, print the result; exit 0 whenever a result was printed."""
    raw = sys.stdin.buffer.read()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        result: dict[str, Any] = {"status": "failed", "error": {
            "code": "SCHEMA_VALIDATION_FAILED",
            "message": f"the handoff on stdin is not JSON: {exc}", "retryable": False}}
    else:
        result = handle(doc)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
