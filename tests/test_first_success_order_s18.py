"""A first_success parent is looked at as soon as its winner is filed (R13, session 18).

Seed 000: "first_success: Return first SUCCESS, cancel others". With one worker (or a
specialist's ``concurrency = 1``), the winner's filing woke the parent, but the wake-up was
queued behind its other children, due earlier: the worker that filed the winner took the next
child, and every loser ran to completion before the parent's gate was checked. A woken waiter
is now looked at before other due work of its priority (its gate's check takes no worker).
"""
from __future__ import annotations

import pytest
from conftest import Workspace
from test_orchestration import HANDLERS, fan_out, ows, score  # noqa: F401


def slow(value: int) -> dict:
    """A child that scores after 0.5 s unless cancelled first. (``score(..., sleep=0.5)`` put
    the sleep beside the child's data, where the scorer never saw it: the children ended at
    once, and a loser another worker started while the parent was being aggregated, 30 ms
    later, could end before it: the test failed 2 runs in about 10.)"""
    child = score(True, 0.9, value=value)
    child["data"]["sleep"] = 0.5
    return child


@pytest.mark.parametrize("how", [("--workers", "1"), ()])
def test_first_success_runs_one_child_when_they_run_one_at_a_time(ows: Workspace,
                                                                  how: tuple[str, ...]) -> None:
    if not how:  # four workers, but the children's specialist runs one at a time
        config = (ows.root / "handoffd.toml").read_text()
        ows.write_config(config.replace('handler = "orch_handlers:scorer"\nconcurrency = 6',
                                        'handler = "orch_handlers:scorer"\nconcurrency = 1'))
    fan_out(ows, "pf", "first_success", [slow(i) for i in range(3)])
    proc = ows.handoffd("run", *how, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    parent = ows.doc("pf")
    assert parent["status"] == "completed", parent
    statuses = sorted(c["status"] for c in parent["aggregated_outcome"]["child_outcomes"])
    assert statuses == ["cancelled", "cancelled", "success"], parent["aggregated_outcome"]


def test_first_success_under_serve_with_one_worker(ows: Workspace) -> None:
    """The same under `handoffd serve` (R16): the parked parent sat in the ready window behind
    its children, never held, so its winner's filing woke nothing."""
    daemon = ows.serve("--workers", "1")
    try:
        fan_out(ows, "ps", "first_success",
                [slow(i) for i in range(3)])
        assert ows.wait_state("ps", ("completed", "failed"), timeout=60) == "completed"
    finally:
        assert ows.stop(daemon) == 0
    statuses = sorted(c["status"] for c in ows.doc("ps")["aggregated_outcome"]["child_outcomes"])
    assert statuses == ["cancelled", "cancelled", "success"], ows.doc("ps")["aggregated_outcome"]
