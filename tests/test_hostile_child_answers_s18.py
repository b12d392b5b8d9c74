"""A child's filed answer is read without trusting its shape (found while fixing R13, s18).

``hi_moe.read_outcome`` iterated ``payload.artifacts`` as given: a completed child whose file was
replaced by one with ``"artifacts": 5`` raised a TypeError in the children gate at every look
(a traceback every rescan), and its parent stayed pending for ever.
"""
from __future__ import annotations

from typing import Any

import pytest

from handoffd.dialects.hi_moe import read_outcome


@pytest.mark.parametrize("artifacts", [5, "text", {"artifact_type": "output"}, True, None, [7, "x"]])
def test_a_hi_moe_answer_with_artifacts_of_any_shape_is_read(artifacts: Any) -> None:
    facts = read_outcome({"payload": {"status": "success", "artifacts": artifacts}})
    assert facts is not None and facts["status"] == "success"
    assert facts["artifacts"] == [] and facts["output"] is None
