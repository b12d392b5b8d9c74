"""A document's time with a fractional-seconds part longer than nanoseconds (9 digits) is no
date-time (helper O, session 26): the schemas' ``date_time`` pattern, the ``date-time`` format
and the parser of times each took a fraction of any length, so a hostile document with a
100,000-digit fraction passed ``handoff validate`` and ran. Now each refuses it the same way:
one clear line, SCHEMA_VALIDATION_FAILED, never a traceback."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import re2
from conftest import Workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh

from handoffd.core.schemachecks import conforms
from handoffd.core.timeutil import parse_iso, parse_utc

SCHEMAS = Path(__file__).resolve().parent.parent / "handoffd" / "schemas"
NINE = "2026-11-27T12:00:00.123456789Z"
TEN = "2026-11-27T12:00:00.1234567891Z"
HOSTILE = "2026-11-27T12:00:00." + "1" * 100_000 + "Z"


def native(hid: str, **extra: Any) -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@x"}, "target": {"agent_id": "@flaky"},
            "input": {"data": {"mode": "ok"}}, **extra}


def hi_moe(hid: str, timestamp: str) -> dict[str, Any]:
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"], doc["timestamp"] = hid, timestamp
    doc["payload"]["specialist_hint"] = "@flaky"
    return doc


@pytest.mark.parametrize("text", [TEN, HOSTILE, TEN.replace("Z", "+01:00"), TEN[:-1]])
def test_the_parser_refuses_a_fraction_over_nine_digits(text: str) -> None:
    for parse in (parse_iso, parse_utc):
        with pytest.raises(ValueError) as caught:
            parse(text)
        assert len(str(caught.value)) < 200  # one short line, never the 100,000 digits


def test_nine_digits_still_parse() -> None:
    assert parse_utc(NINE).microsecond == 123456  # (a datetime keeps microseconds)
    assert parse_utc("2026-11-27T12:00:00.5Z").microsecond == 500000


@pytest.mark.parametrize("text, ok", [(NINE, True), (TEN, False), (HOSTILE, False),
                                      ("2026-11-27t12:00:00.1234567891+00:00", False)])
def test_the_date_time_format_bounds_the_fraction(text: str, ok: bool) -> None:
    assert conforms(text, "date-time") is ok


def _date_time_patterns() -> list[tuple[str, str]]:
    """(schema file, pattern) of every shipped schema's date-time pattern."""
    found = []
    for path in sorted(SCHEMAS.glob("*.json")):
        for pattern in re.findall(r'"pattern": "(\^\[0-9\]\{4\}-[^"]*)"', path.read_text()):
            found.append((path.name, json.loads(f'"{pattern}"')))
    return found


def test_every_shipped_date_time_pattern_bounds_the_fraction() -> None:
    patterns = _date_time_patterns()
    assert len(patterns) >= 8, patterns  # (each dialect's schemas carry one)
    for name, pattern in patterns:
        compiled = re2.compile(pattern)
        assert compiled.search(NINE), name
        assert not compiled.search(TEN), name
        assert not compiled.search(HOSTILE), name


def test_validate_and_create_refuse_a_hostile_fraction(ws: Workspace, tmp_path: Path) -> None:
    for hid, doc in (("frac-native", native("frac-native", expires_at=HOSTILE)),
                     ("frac-moe", hi_moe("frac-moe", HOSTILE))):
        path = tmp_path / f"{hid}.json"
        path.write_text(json.dumps(doc))
        checked = ws.handoff("validate", str(path), timeout=30)
        said = checked.stdout + checked.stderr
        assert checked.returncode == 1, said
        assert "Traceback" not in said and len(said) < 2000, said[:2000]
        made = ws.handoff("create", "--file", str(path), timeout=30)
        assert made.returncode == 1 and not made.stdout, made.stderr[:2000]
        assert made.stderr.count("\n") == 1 and "Traceback" not in made.stderr, made.stderr[:2000]
        assert ws.state_of(hid) == []


def test_a_dropped_hostile_fraction_is_filed_with_its_code(ws: Workspace) -> None:
    ws.drop("frac-1.json", native("frac-1", expires_at=HOSTILE))
    ws.drop("frac-ok.json", native("frac-ok", expires_at="9999-12-31T23:59:59.123456789Z"))
    proc = ws.handoffd("run")
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr, proc.stderr
    assert ws.state_of("frac-ok") == ["completed"]
    assert ws.state_of("frac-1") == ["failed"]
    error = ws.doc("frac-1")["error"]
    assert error["code"] == "SCHEMA_VALIDATION_FAILED", error
    assert "expires_at" in error["message"] and len(error["message"]) < 1000, error
    assert ws.runs() == [r for r in ws.runs() if r["id"] == "frac-ok"]  # never ran
