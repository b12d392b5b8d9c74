"""Schema errors stay few and short (review 15).

An invalid document with many errors took quadratic time and unbounded memory: the entries were
de-duplicated by scanning the list so far, and every error jsonschema could find was listed (a
90 KB native document with 30,000 wrong ``depends_on`` items took 41 s in ``handoff validate``; a
2 MB hi_moe message with a million wrong constraints kept ``handoffd run`` busy for 6+ minutes at
3.5 GB, deaf to SIGTERM). And each entry quoted the whole offending value: a 3 MB ``status`` made a
9.4 MB failure document (the value three times) and a 3 MB line in ``handoff show``."""
from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, exe, new_workspace, run_python
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET

from handoffd.core.errors import InvalidDocument
from handoffd.core.jsonschema_re2 import check_inline, errors_of
from handoffd.core.validation import builtin_schemas, check_document

LISTED = 100  # jsonschema_re2.MAX_ERRORS: entries listed before the "... and more" one
LONG = 300  # jsonschema_re2.MAX_MESSAGE: characters of one entry's text


def native(handoff_id: str, **fields: Any) -> dict[str, Any]:
    doc = {"handoff_id": handoff_id, "status": "pending", "source": {"agent_id": "@o"},
           "target": {"agent_id": "@echo"}, "input": {"data": {}}}
    doc.update(fields)
    return doc


def hi_moe_many(msg_id: str, count: int) -> dict[str, Any]:
    doc = copy.deepcopy(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"] = msg_id
    doc["payload"]["constraints"] = [1] * count  # each one "is not of type 'string'"
    return doc


@pytest.fixture
def echo_ws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose specialists (native @echo, hi_moe's fleet) answer at once."""
    echo = tmp_path / "echo.py"
    echo.write_text("import json, sys\njson.load(sys.stdin)\n"
                    "print(json.dumps({'status': 'completed', 'output': {'ok': True}}))\n")
    config = "[daemon]\nsettle_seconds = 0\n\n"
    for agent in ("@echo", "SPECIALIZED_FLEET", "python-lora"):
        config += f'[specialists."{agent}"]\ncommand = ["{sys.executable}", "{echo}"]\n\n'
    workspace = new_workspace(tmp_path / "ws", config)
    yield workspace
    workspace.cleanup()


class Counting:
    """A validator that counts the errors taken from it."""

    def __init__(self, validator: Any) -> None:
        self.validator = validator
        self.taken = 0

    def iter_errors(self, instance: Any) -> Iterator[Any]:
        for error in self.validator.iter_errors(instance):
            self.taken += 1
            yield error


# ------------------------------------------------------------------ 1. many errors


def test_errors_stop_after_a_hundred_and_one_entry_says_there_are_more() -> None:
    validator = Counting(check_inline({"type": "array", "items": {"type": "string"}}))
    entries = errors_of(validator, [1] * 3_000)  # type: ignore[arg-type]
    assert validator.taken <= LISTED + 1, "the errors past the list are not looked for"
    assert len(entries) == LISTED + 1
    assert {e["field"] for e in entries[:LISTED]} == {f"[{i}]" for i in range(LISTED)}  # the first
    assert all(e["error"] == "1 is not of type 'string'" for e in entries[:LISTED])
    assert entries[-1]["field"] == "$" and entries[-1]["error"].startswith("... and more")
    assert set(entries[-1]) == {"field", "error", "schema_path"}  # the entries' one format


def test_a_hundred_errors_are_all_listed_with_no_marker() -> None:
    validator = check_inline({"type": "array", "items": {"type": "string"}})
    entries = errors_of(validator, [1] * LISTED)
    assert len(entries) == LISTED and not any(e["error"].startswith("...") for e in entries)
    assert len(errors_of(validator, [1] * (LISTED + 1))) == LISTED + 1  # the marker


def test_repeated_errors_are_listed_once_and_read_a_bounded_number_of_times() -> None:
    # every branch of allOf reports the same missing field: one entry
    twice = check_inline({"allOf": [{"required": ["x"]}, {"required": ["x"]}]})
    assert errors_of(twice, {}) == [{"field": "$", "error": "Missing required field 'x'",
                                     "schema_path": "#/allOf/0/required"}]
    # 12,000 branches saying the same thing: reading stops, one marker
    same = Counting(check_inline({"allOf": [False] * 12_000}))
    entries = errors_of(same, 5)  # type: ignore[arg-type]
    assert same.taken < 12_000
    assert (entries[0]["field"], entries[0]["error"]) == ("$", "False schema does not allow 5")
    assert len(entries) == 2 and entries[1]["error"].startswith("... and more")


def test_a_native_document_with_thousands_of_errors_is_one_quick_check() -> None:
    """In-process: a native document whose depends_on holds 5,000 numbers lists 100 errors and
    says there are more (16,000 took 18 s before, all listed)."""
    with pytest.raises(InvalidDocument) as caught:
        check_document(builtin_schemas(), _dialect("native"),
                       native("nmany", depends_on=[1] * 5_000))
    errors = caught.value.errors
    assert len(errors) == LISTED + 1 and errors[-1]["error"].startswith("... and more")
    assert str(caught.value).endswith(f"(and {LISTED}+ more)"), str(caught.value)


def test_handoff_validate_lists_a_bounded_number_of_errors(tmp_path: Path) -> None:
    """`handoff validate` on 60,000 wrong depends_on items (41 s for 30,000 before, quadratic):
    a bounded wait, 100 entries and one line saying there are more."""
    path = tmp_path / "nmany.json"
    path.write_text(json.dumps(native("nmany", depends_on=[1] * 60_000)))
    done = subprocess.run([exe("handoff"), "validate", str(path)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"(and {LISTED}+ more)"), lines[0]
    assert len(lines) == 1 + LISTED + 1, len(lines)
    assert lines[-1].startswith("  $: ... and more"), lines[-1]
    assert "Traceback" not in done.stderr


def _daemon_peak(workspace: Workspace) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run `handoffd run` under a fresh interpreter that reports its peak RSS (KB)."""
    code = ("import resource, subprocess, sys\n"
            "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=50)\n"
            "sys.stderr.write(done.stderr)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "sys.exit(done.returncode)\n")
    done = run_python(code, exe("handoffd"), "run", "--root", str(workspace.root))
    return done, int(done.stdout.strip().splitlines()[-1])


def test_the_daemon_fails_a_message_with_a_million_errors_quickly(echo_ws: Workspace) -> None:
    """A 2 MB hi_moe message whose payload.constraints holds a million numbers: `handoffd run`
    files it as failed in seconds with bounded memory (6+ minutes and 3.5 GB before), and a
    plain handoff beside it completes."""
    echo_ws.drop("hm-many.json", hi_moe_many("hm-many", 1_000_000))
    echo_ws.create("--to", "@echo", "--id", "plain", "--data", "{}")
    done, peak_kb = _daemon_peak(echo_ws)  # bounded: 50 s, then a TimeoutExpired
    assert "Traceback" not in done.stderr, done.stderr
    assert echo_ws.state_of("hm-many") == ["failed"]
    assert echo_ws.state_of("plain") == ["completed"]
    detail = echo_ws.doc("hm-many")["payload"]["error_detail"]
    assert "payload.constraints[0]" in detail and detail.endswith(f"(and {LISTED}+ more)"), detail
    assert peak_kb < 1024 * 1024, f"peak RSS {peak_kb} KB"  # the document itself is ~2 MB


def test_sigterm_stops_the_daemon_while_it_checks_a_message_with_a_million_errors(
        echo_ws: Workspace) -> None:
    """Before, validation held the daemon for minutes and SIGTERM went unheard."""
    echo_ws.drop("hm-term.json", hi_moe_many("hm-term", 1_000_000))
    proc = subprocess.Popen([exe("handoffd"), "run", "--root", str(echo_ws.root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    echo_ws.daemons.append(proc)  # killed by cleanup if the test fails
    deadline = time.monotonic() + 30
    while echo_ws.state_of("hm-term") in ([], ["pending"]) and proc.poll() is None:
        assert time.monotonic() < deadline, "never claimed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err
    assert echo_ws.state_of("hm-term") in (["failed"], ["pending"], ["in-progress"])


# ------------------------------------------------------------------ 3. long values


def test_an_entry_quotes_a_long_value_shortened_and_keeps_what_is_wrong() -> None:
    validator = builtin_schemas().validator("native.request.schema.json")
    entries = errors_of(validator, native("long", status="x" * 3 * 1024 * 1024))
    assert len(entries) == 1
    error = entries[0]["error"]
    assert len(error) <= LONG, len(error)
    assert error.startswith("'xxx") and "...x'" in error
    assert error.endswith("is not one of ['pending', 'in_progress']"), error


def test_every_text_of_an_entry_is_bounded() -> None:
    """A long property name (the field), a long const in an inline schema (the message), a long
    $ref (the trouble entry)."""
    key = "k" * 100_000
    schema = {"properties": {key: {"const": "c" * 100_000}}}
    entries = errors_of(check_inline(schema), {key: "v"})
    assert len(entries) == 1
    assert all(len(text) <= LONG for text in entries[0].values()), \
        {k: len(v) for k, v in entries[0].items()}


def test_check_document_says_one_short_line_whatever_the_errors_hold() -> None:
    class Huge:
        def errors(self, name: str, instance: Any) -> list[dict[str, str]]:
            return [{"field": "f" * 50_000, "error": "e" * 50_000, "schema_path": "#"}] * 2

    with pytest.raises(InvalidDocument) as caught:
        check_document(Huge(), _dialect("native"), {}, subject="s" * 50_000)
    message = str(caught.value)
    assert len(message) < 1_000 and message.endswith("(and 1 more)"), message[-80:]


def test_handoff_validate_prints_short_lines_for_a_4000_digit_priority(tmp_path: Path) -> None:
    path = tmp_path / "bigprio.json"
    doc = json.dumps(native("bigprio", priority=0))
    path.write_text(doc.replace('"priority": 0', '"priority": ' + "9" * 4000))
    done = subprocess.run([exe("handoff"), "validate", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert "priority: 9999" in done.stdout
    assert max(map(len, done.stdout.splitlines())) < 700, done.stdout[:300]


def test_a_3_mb_status_makes_a_small_failure_document(echo_ws: Workspace) -> None:
    """Through `handoffd run` and `handoff show`: the failure document was 9.4 MB (the value in
    error.message, errors[0] and validation.errors[0]); `handoff show` printed a 3 MB line."""
    echo_ws.drop("bigstat.json", native("bigstat", status="x" * 3 * 1024 * 1024))
    done = echo_ws.handoffd("run", timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    assert echo_ws.state_of("bigstat") == ["failed"]
    path = echo_ws.root / "handoffs" / "failed" / "bigstat.json"
    assert path.stat().st_size < 50_000, path.stat().st_size
    doc = json.loads(path.read_text())
    assert doc["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
    assert "is not one of ['pending', 'in_progress']" in doc["error"]["message"]
    assert len(doc["error"]["message"]) < 1_000
    assert [e["field"] for e in doc["validation"]["errors"]] == ["status"]
    shown = echo_ws.handoff("show", "bigstat", timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert max(map(len, shown.stdout.splitlines())) < 1_000


def _dialect(name: str) -> Any:
    from handoffd import dialects
    return dialects.by_name(name)
