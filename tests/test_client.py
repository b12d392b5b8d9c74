"""The Python client against a real daemon (`handoffd serve` as a subprocess): create, wait,
read the result or the error, idempotent create, asyncio, cancel, retry, list."""
from __future__ import annotations

import asyncio
import json

import pytest
from conftest import Workspace

from handoffd import Client, State
from handoffd.core.errors import Conflict, NotFound, WaitTimeout


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
    with pytest.raises(ValueError):
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
