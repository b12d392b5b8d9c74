"""Follow-ups of helper O's session 26 fix (a foreign document whose claim is recovered before
its admission has its id recorded at its next one), helper R, session 26.

* A seed 000 cancellation message is carried out by the daemon itself
  (:func:`handoffd.features.cancellation.handle_message`), not admitted: it searched and recorded
  its id in the seen-ids record only when its claim was raw. A foreign message whose claimer
  died after the claim, before that, was recovered (our bookkeeping written into it) and handled
  at its next claim with its id never recorded: a second message reusing the id (the first's
  result collected) was carried out again. It now follows admission's rule
  (:func:`handoffd.core.admission.first_use`).
* A foreign claim's ``started_at`` with more than 9 digits of fractional seconds (nanoseconds and
  beyond, which :func:`~handoffd.core.timeutil.parse_iso` refuses since session 26) made the
  claim look like none of a foreign consumer's: the recovery held it only for the claim grace,
  not its ``timeout_seconds``. Its start is now read to the microsecond whatever the fraction's
  length (:func:`~handoffd.core.timeutil.parse_iso_truncated`); the lease stays bounded as before.
"""
from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import exe, new_workspace
from dialect_examples import HI_MOE_CANCELLATION, fresh
from test_seen_shortage_s24 import _quarantined

from handoffd.backends.files.repair import (FOREIGN_LEASE_SECONDS, MAX_FOREIGN_LEASE_SECONDS,
                                            foreign_lease_end, marked_here)


# ---------------------------------------------------------------- a cancellation message

def _batch(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def _victim(handoff_id: str) -> dict[str, Any]:
    """A pending request nobody here serves: it waits until a cancellation reaches it."""
    return {"handoff_id": handoff_id, "source": {"agent_id": "@test"},
            "target": {"agent_id": "@nobody"}, "input": {"data": {}}}


def _cancellation(message_id: str, target: str) -> dict[str, Any]:
    """Seed 000's cancellation example as ``message_id``, cancelling ``target``."""
    doc = fresh(HI_MOE_CANCELLATION)
    doc["id"] = message_id
    doc["timestamp"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc["payload"]["target_message_id"] = target
    doc["payload"]["cascade"] = False
    return doc


def test_a_reused_message_id_is_set_aside_after_a_crash_before_it_was_handled(
        tmp_path: Path) -> None:
    """``handoffd run`` dies (as kill -9) right after its claim of a foreign cancellation
    message wrote the lease: the next batch recovers the claim and carries the message out,
    recording its id then, so a second message reusing the id (the first's result collected)
    is set aside DUPLICATE_HANDOFF_ID and cancels nothing. It once cancelled its target."""
    ws = new_workspace(tmp_path / "ws", """
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 0.0

[retry]
max_retries = 2
retry_delay_seconds = 0.0
""")
    try:
        ws.drop("victim-1.json", _victim("victim-1"))
        ws.drop("victim-2.json", _victim("victim-2"))
        ws.drop("msg-c1.json", _cancellation("msg-c1", "victim-1"))
        crashed = _batch(ws.root, HANDOFFD_CRASH_AT="after-claim-lease")
        assert crashed.returncode == 99, crashed.stderr  # died at the injected point
        assert ws.state_of("msg-c1") == ["in-progress"]
        said = ""
        for _ in range(5):  # (bounded) recovered, then carried out
            said += _batch(ws.root).stderr
            if ws.state_of("msg-c1") == ["completed"]:
                break
        assert ws.state_of("msg-c1") == ["completed"], said
        events = [e["event"] for e in ws.doc("msg-c1")["handoffd"]["history"]]
        assert events[0] == "claimed" and "recovered" in events, events
        assert ws.state_of("victim-1") == ["failed"], said  # cancelled
        # the sender collects the result; a second message reuses the id
        (ws.root / "handoffs" / "completed" / "msg-c1.json").unlink()
        ws.drop("msg-c1.json", _cancellation("msg-c1", "victim-2"))
        said += _batch(ws.root).stderr
        assert ws.state_of("victim-2") == ["pending"], said  # never cancelled by it
        assert ws.state_of("msg-c1") == [], said
        assert [r["code"] for r in _quarantined(ws.root)] == ["DUPLICATE_HANDOFF_ID"], said
        assert "Traceback" not in said
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- a foreign claim's started_at

def _utc(digits: int, at: float) -> str:
    """The time ``at`` (Unix) in UTC with a fraction of ``digits`` digits (picoseconds: 12)."""
    whole = datetime.fromtimestamp(at, timezone.utc)
    fraction = f"{whole.microsecond:06d}".ljust(digits, "7")
    return whole.strftime("%Y-%m-%dT%H:%M:%S.") + fraction + "Z"


def _marked(started_at: str, timeout: Any = 600) -> dict[str, Any]:
    return {"handoff_id": "fc-1", "status": "in_progress", "started_at": started_at,
            "timeout_seconds": timeout}


@pytest.mark.parametrize("digits", [12, 18, 100])
def test_a_long_fraction_still_starts_a_foreign_claim(digits: int) -> None:
    """A consumer writing more than nanoseconds (RFC 3339 sets no bound) holds its claim for
    its ``timeout_seconds`` from its start (read to the microsecond), as one writing 9 digits
    does; it was taken for no foreign claim (0: the claim grace alone)."""
    started = 1_800_000_000.25
    nine = foreign_lease_end(_marked(_utc(9, started)), started + 1)
    assert nine == pytest.approx(started + 600)
    assert foreign_lease_end(_marked(_utc(digits, started)), started + 1) == nine


def test_a_hostile_start_never_stretches_the_lease() -> None:
    """A fraction of 100,000 digits, a start in the future, a timeout past the bound: the
    claim still ends no later than its rename plus the bounded timeout, as before."""
    claimed = 1_800_000_000.0
    hostile = "2999-01-01T00:00:00." + "9" * 100_000 + "Z"
    assert foreign_lease_end(_marked(hostile), claimed) == claimed + 600
    assert foreign_lease_end(_marked(hostile, 10 ** 9), claimed) == claimed + FOREIGN_LEASE_SECONDS
    assert FOREIGN_LEASE_SECONDS < MAX_FOREIGN_LEASE_SECONDS
    for junk in ("not a time", "2026-11-27T12:00:00." + "1" * 12 + "x",
                 "2026-11-27T12:00:00." + "1" * 100_000 + "ZZ"):
        assert foreign_lease_end(_marked(junk), claimed) == 0.0  # no time: no foreign claim


def test_a_long_fraction_is_a_mark_written_in_place(tmp_path: Path) -> None:
    """The mark written into the in-progress file in place, with a start of 12 digits: the
    claim is judged by its own time, not held for the claim grace as well."""
    path = tmp_path / "fc-1.json"
    path.write_text("{}")
    info = path.stat()
    assert marked_here(_marked(_utc(12, info.st_ctime + 0.5)), info)
    assert not marked_here(_marked(_utc(12, info.st_ctime - 60)), info)  # older than its rename


def test_the_sweep_honours_a_foreign_claim_started_in_picoseconds(tmp_path: Path) -> None:
    """Seed 001's Example 2 (rename, then the mark written in place) by a consumer whose
    ``started_at`` has 12 digits of fraction, its ``timeout_seconds`` 600: ``handoffd sweep``
    (claim grace 0) leaves it to its consumer. It was handed back to pending/ at once."""
    ws = new_workspace(tmp_path / "ws", """
[daemon]
settle_seconds = 0.05
claim_grace_seconds = 0.0
""")
    try:
        ws.drop("fc-1.json", {"handoff_id": "fc-1", "source": {"agent_id": "@test"},
                              "target": {"agent_id": "@elsewhere"}, "input": {"data": {}},
                              "timeout_seconds": 600})
        claimed = ws.root / "handoffs" / "in-progress" / "fc-1.json"
        os.rename(ws.root / "handoffs" / "pending" / "fc-1.json", claimed)
        doc = json.loads(claimed.read_text())
        doc["status"], doc["started_at"] = "in_progress", _utc(12, datetime.now().timestamp())
        claimed.write_text(json.dumps(doc))
        swept = subprocess.run([exe("handoffd"), "sweep", "--root", str(ws.root)],
                               capture_output=True, text=True, timeout=60)
        assert swept.returncode == 0, swept.stderr
        assert ws.state_of("fc-1") == ["in-progress"], swept.stderr
        assert "Traceback" not in swept.stderr
    finally:
        ws.cleanup()
