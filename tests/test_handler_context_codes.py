"""A Python handler whose call into ``ctx.context`` is refused keeps the refusal's code.

It was filed ``PROCESSING_ERROR`` ("handler raised InvalidDocument: ...") and retried, though a
bad key, value or revision fails the same way at every attempt; the code the caller would act
on was lost. Now the attempt fails with that code: not retried for a bad key, value or revision,
retried for a compare-and-set conflict (the next attempt reads the key again)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from handoffd import Daemon, Registry, Workspace, build_engine, new_native_request
from handoffd.core.config import Config, DaemonSettings, RetryPolicy
from handoffd.core.documents import book

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


def bad_key(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    ctx.context.set("../outside", 1)
    return {"status": "completed"}


def bad_value(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    ctx.context.set("notes/x", {1, 2})  # a set: not JSON
    return {"status": "completed"}


def bad_revision(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    ctx.context.set("notes/x", 1, if_revision=-1)
    return {"status": "completed"}


def stale_revision(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    ctx.context.set("notes/x", 1, if_revision=5)  # the key is new: revision 0
    return {"status": "completed"}


def file_one(tmp_path: Path, handler: Handler) -> dict[str, Any]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(daemon=DaemonSettings(settle_seconds=0.0),
                    retry=RetryPolicy(max_retries=1, retry_delay_seconds=0.0))
    registry = Registry()
    registry.add_function("@t", handler, config=config)
    engine = build_engine(ws, config, registry)
    try:
        doc = new_native_request(source="@test", target="@t", data=None, now=engine.clock())
        hid = engine.backend.store.create(doc, doc["handoff_id"])
        Daemon(engine, watch=False).run_batch()
        state, filed = engine.get(hid)
        assert state.value == "failed", state
        return filed
    finally:
        engine.backend.close()


@pytest.mark.parametrize("handler, code", [(bad_key, "INVALID_CONTEXT_KEY"),
                                           (bad_value, "INVALID_CONTEXT_VALUE"),
                                           (bad_revision, "INVALID_CONTEXT_REVISION")])
def test_a_refused_context_call_fails_with_its_code_and_is_not_retried(
        tmp_path: Path, handler: Handler, code: str) -> None:
    filed = file_one(tmp_path, handler)
    assert filed["error"]["code"] == code, filed["error"]
    assert filed["error"]["retryable"] is False
    assert book(filed).get("retries", 0) == 0  # one attempt: the next would fail the same way


def test_a_context_conflict_keeps_its_code_and_is_retried(tmp_path: Path) -> None:
    filed = file_one(tmp_path, stale_revision)
    assert filed["error"]["code"] == "CONTEXT_CONFLICT", filed["error"]
    assert book(filed).get("retries", 0) == 1  # retried once (max_retries 1), then failed


def odd_code(handoff: dict[str, Any], ctx: Any) -> dict[str, Any]:
    from handoffd.core.errors import NotFound
    exc = NotFound("boom")
    exc.code = ["X"]  # type: ignore[attr-defined]  # a handler's own exception, any code
    raise exc


def test_a_handlers_exception_with_an_odd_code_is_filed_as_before(tmp_path: Path) -> None:
    """A code that is no string (a list) made the check for context codes raise TypeError: the
    attempt crashed and was recovered as a crash. It is filed PROCESSING_ERROR, as before."""
    filed = file_one(tmp_path, odd_code)
    assert filed["error"]["code"] == "PROCESSING_ERROR", filed["error"]
    assert "handler raised NotFound: boom" in filed["error"]["message"]
