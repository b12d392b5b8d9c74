"""The Python client against a real daemon (`handoffd serve` as a subprocess): create, wait,
read the result or the error, idempotent create, asyncio, cancel, retry, list."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace

from handoffd import Client, State
from handoffd.core.errors import Conflict, NotFound, UsageError, WaitTimeout


def test_create_wait_and_read_the_result(ws: Workspace) -> None:
    daemon = ws.serve()
    try:
        client = Client(ws.root)
        result = client.create(to="@flaky", data={"mode": "ok", "n": 1}).wait(timeout=30)
        assert result.ok and result.finished and result.state is State.COMPLETED
        assert result.output == {"echo": {"mode": "ok", "n": 1}} and result.error is None
        failed = client.run("@flaky", {"mode": "permanent", "message": "out of coffee"}, timeout=30)
        assert not failed.ok and failed.state is State.FAILED
        assert failed.error is not None and failed.error.code == "PROCESSING_ERROR"
        assert "out of coffee" in failed.error.message
        rows = client.list(state="completed")
        assert [r["id"] for r in rows] == [result.id]
    finally:
        assert ws.stop(daemon) == 0


def test_idempotent_create_and_errors(ws: Workspace) -> None:
    client = Client(ws.root)
    first = client.create(to="@flaky", data={"mode": "ok"}, handoff_id="idem-c", if_absent=True)
    again = client.create(to="@flaky", data={"mode": "ok"}, handoff_id="idem-c", if_absent=True)
    assert first.id == again.id == "idem-c"
    with pytest.raises(Conflict):
        client.create(to="@flaky", data={"mode": "fail"}, handoff_id="idem-c", if_absent=True)
    with pytest.raises(NotFound):
        client.get("nope")
    with pytest.raises(WaitTimeout):
        first.wait(timeout=0.2)  # no daemon is running
    assert first.result().state is State.PENDING
    with pytest.raises(UsageError):  # (a handoffd error, as docs/agents.md promises)
        client.create()
    doc = {"handoff_id": "whole-1", "target": {"agent_id": "@flaky"}, "input": {"data": {}}}
    assert client.create(document=doc).id == "whole-1"


def test_asyncio_cancel_and_retry(ws: Workspace) -> None:
    client = Client(ws.root)
    daemon = ws.serve()
    try:
        async def scenario() -> tuple[str, str]:
            slow = await client.create_async("@flaky", {"mode": "sleep", "seconds": 60})
            ws.wait_started(slow.id)
            action = slow.cancel(reason="no longer needed")
            done = await slow.wait_async(timeout=30)
            return action, json.dumps(done.document)

        action, text = asyncio.run(scenario())
        assert action == "requested" and "no longer needed" in text
        failed = client.run("@flaky", {"mode": "permanent"}, timeout=30)
        client.retry(failed.id, force=True)
        again = client.handle(failed.id).wait(timeout=30)  # it ran again, and failed again
        events = [e["event"] for e in again.document["handoffd"]["history"]]
        assert "retried" in events and events.count("claimed") == 2
    finally:
        assert ws.stop(daemon) == 0


@pytest.mark.parametrize("call, kind", [
    (lambda c, h: c.cancel(h.id, reason=None), "UsageError"),
    (lambda c, h: c.create("@echo", data=b"abc"), "UsageError"),
    (lambda c, h: c.create("@echo", data={"x": float("nan")}), "UsageError"),
    (lambda c, h: c.create("@echo", depends_on=5), "InvalidDocument"),
    (lambda c, h: c.list(limit=None), "UsageError"),
    (lambda c, h: c.list(limit="5"), "UsageError"),
    (lambda c, h: h.wait(timeout=float("nan")), "UsageError"),
    (lambda c, h: h.wait(timeout="5"), "UsageError"),
    (lambda c, h: c.handle("../../etc/passwd").wait(), "InvalidDocument"),
    (lambda c, h: c.handle("").wait(timeout=None), "InvalidDocument"),
])
def test_hostile_arguments_are_handoffd_errors_at_once(tmp_path: Path, call: Any, kind: str) -> None:
    """Found by the fourth session's hunt: wrong-typed arguments escaped as raw TypeErrors from
    deep inside (the JSON encoder, list slicing), and `wait()` on an unsafe id or with a NaN
    timeout waited for ever. Each is now a handoffd error, at once."""
    from handoffd.core.errors import HandoffdError
    (tmp_path / "ws").mkdir()  # (a root that does not exist is NotFound, as for --root)
    client = Client(tmp_path / "ws")
    handle = client.create("@echo", {"n": 1})
    started = time.monotonic()
    with pytest.raises(HandoffdError) as caught:
        call(client, handle)
    assert type(caught.value).__name__ == kind and time.monotonic() - started < 30
    assert "\n" not in str(caught.value)
