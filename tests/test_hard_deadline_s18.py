"""A hard deadline is kept when a throttle or a retry puts the handoff off past it (R13, s18).

Seed 000: "timeout_ms: Hard timeout; receiver MUST respond before this". A message whose
specialist answered ``throttled`` with ``retry_after_seconds: 15`` (or failed, retryable, with a
retry delay past the deadline) went back to pending/ due at that later time, and the daemon did
not look at it before: the TIMEOUT answer came 15 s (up to an hour) after the deadline. Now the
daemon looks at it again by its deadline, and admission answers it TIMEOUT, unrun.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from conftest import Workspace
from test_hi_moe_seed import CONFIG, HANDLERS, events, message, mws, wait_filed  # noqa: F401


def at(entry: dict[str, str]) -> datetime:
    return datetime.fromisoformat(entry["at"].replace("Z", "+00:00"))


def history(ws: Workspace, hid: str) -> dict[str, datetime]:
    """The time of each event's last entry in ``hid``'s history."""
    return {e["event"]: at(e) for e in ws.doc(hid)["handoffd"]["history"]}


def serve_until_filed(ws: Workspace, handler: str, hid: str, config: str = CONFIG) -> str:
    """Serve until ``hid``, a message to ROUTING_DISPATCHER (``handler``) with a 2 s hard
    timeout, is filed; where it went."""
    ws.write_config(config + f'''
[specialists."ROUTING_DISPATCHER"]
handler = "moe_handlers:{handler}"
''')
    ws.drop(f"{hid}.json", message(hid, target="ROUTING_DISPATCHER", timeout_ms=2000))
    daemon = ws.serve()
    try:
        return wait_filed(ws, hid, timeout=60)
    finally:
        assert ws.stop(daemon) == 0


def test_a_throttle_past_the_deadline_is_answered_timeout_by_the_deadline(mws: Workspace) -> None:
    (mws.root.parent / "moe_handlers.py").write_text(HANDLERS + '''

def slow_down(doc, ctx):
    with open(ctx.root / "artifacts" / "runs", "a") as runs:
        runs.write("x")
    return {"status": "throttled", "retry_after_seconds": 30}
''')
    assert serve_until_filed(mws, "slow_down", "m-thr") == "failed"
    answer = mws.doc("m-thr")["payload"]
    assert answer["status"] == "timeout", answer
    seen = history(mws, "m-thr")
    # answered before the throttle's retry was due, not when it came due
    assert seen["failed"] < seen["throttled"] + timedelta(seconds=30), seen
    assert events(mws, "m-thr")[-2:] == ["claimed", "failed"]  # claimed to be answered
    assert (mws.root / "artifacts" / "runs").read_text() == "x"  # the handler ran once


def test_a_retry_past_the_deadline_is_answered_timeout_by_the_deadline(mws: Workspace) -> None:
    (mws.root.parent / "moe_handlers.py").write_text(HANDLERS + '''

def flaky(doc, ctx):
    with open(ctx.root / "artifacts" / "runs", "a") as runs:
        runs.write("x")
    return {"status": "failed", "error": {"code": "PROCESSING_ERROR", "message": "try later",
                                          "retryable": True}}
''')
    slow_retries = CONFIG.replace("retry_delay_seconds = 0.1", "retry_delay_seconds = 30")
    assert serve_until_filed(mws, "flaky", "m-retry", slow_retries) == "failed"
    answer = mws.doc("m-retry")["payload"]
    assert answer["status"] == "timeout", answer
    seen = history(mws, "m-retry")
    assert seen["failed"] < seen["retry_scheduled"] + timedelta(seconds=30), seen
    assert (mws.root / "artifacts" / "runs").read_text() == "x"
