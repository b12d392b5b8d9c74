"""A delegation entry's request fields are checked before any child is made (R14, session 18).

``retry_policy`` and ``expected_output`` went into the child's request as the entry gave them:
``{"max_retries": "x"}`` or ``-1`` made a child that failed SCHEMA_VALIDATION_FAILED once made,
and its parent CHILDREN_FAILED, where a bad ``priority`` already failed the delegation as
malformed (VALIDATION_FAILED, no child made).
"""
from __future__ import annotations

from conftest import Workspace
from test_orchestration import HANDLERS, fan_out, ows, run, score  # noqa: F401


def test_bad_request_fields_of_an_entry_fail_the_delegation(ows: Workspace) -> None:
    cases = {"prp": ({"retry_policy": {"max_retries": "x"}}, "delegate[1].retry_policy"),
             "pneg": ({"retry_policy": {"max_retries": -1}}, "delegate[1].retry_policy"),
             "pexp": ({"expected_output": "nope"}, "delegate[1].expected_output must be an object"),
             "psch": ({"expected_output": {"schema": None}}, "expected_output.schema must be a string"),
             "pin": ({"input_schema": ["x"]}, "delegate[1].input_schema must be a string")}
    for hid, (extra, _) in cases.items():
        fan_out(ows, hid, "all_success", [score(True), score(True, **extra)])
    fan_out(ows, "pgood", "all_success",
            [score(True, retry_policy={"max_retries": 1}, expected_output={})])
    stderr = run(ows)
    assert "Traceback" not in stderr, stderr
    for hid, (_, needle) in cases.items():
        doc = ows.doc(hid)
        assert ows.state_of(hid) == ["failed"] and doc["error"]["code"] == "VALIDATION_FAILED", doc
        assert needle in doc["error"]["message"], doc["error"]["message"]
        assert not ows.state_of(f"{hid}.c1"), hid  # no child made
    assert ows.state_of("pgood") == ["completed"]
