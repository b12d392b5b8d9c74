"""Two `handoff answer`s at once: one is taken, the other refused (session 20, review R20 #1).

Both were accepted (exit 0) when the second one's claim came after the first had answered and
requeued the handoff: it had checked the question on the document it read before claiming,
then wrote its answer into a document that waited for nothing, and the handler ran once with
both answers (the second with no question). Now the claimed document is checked again: the
second is handed back as it was and refused with one line."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine

from handoffd import State
from handoffd.core.errors import InvalidTransition
from handoffd.features import clarification


def asker(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Asks until it has an answer; then says which answers it got."""
    answers = (doc.get("input") or {}).get("clarifications")
    if isinstance(answers, list) and answers:
        return {"status": "completed", "output": {"answers": [a["answer"] for a in answers]}}
    return {"status": "needs_clarification", "questions": ["which?"]}


def test_an_answer_that_comes_second_is_refused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@ask": asker})
    engine.submit({"handoff_id": "q1", "source": {"agent_id": "@t"},
                   "target": {"agent_id": "@ask"}, "input": {"data": {}}})
    job = engine.take("q1")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    real_claim = backend.claim
    raced: list[bool] = []

    def claim(*args: Any, **kwargs: Any) -> Any:
        if not raced:  # the other answer is taken between this one's read and its claim
            raced.append(True)
            clarification.answer(engine, "q1", "A")
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(backend, "claim", claim)
    with pytest.raises(InvalidTransition, match="not waiting for an answer"):
        clarification.answer(engine, "q1", "B")
    state, doc = backend.get("q1")
    assert state is State.PENDING
    assert [a["answer"] for a in doc["input"]["clarifications"]] == ["A"]
    assert doc["handoffd"]["attempt"] == 1  # (the refused claim spent no attempt)
    job = engine.take("q1")
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) \
        is State.COMPLETED
    assert backend.get("q1")[1]["output"] == {"answers": ["A"]}
