"""Two user-facing defects (session 25, helper A).

1. ``handoff ls`` (and ``handoff show``, which prints the same NOTE) gave an empty note for a
   pending handoff held back because its specialist's ``concurrency`` slots were all taken by
   handoffs in progress. The note now says so: ``waits: @slow runs its concurrency limit (1 of
   1 in progress)``, from one read of in-progress/ per listing (not one per row).
2. ``handoff wait`` on junk in in-progress/ that nobody settles ended with its read error only
   after the claim grace plus 10 s (the default sweep period): the waiter did not use the
   workspace's ``sweep_seconds``. It now waits the claim grace plus the configured period.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine, new_workspace

from handoffd import Client, new_native_request
from handoffd.backends.base import UnreadableCopy
from handoffd.core.config import DaemonSettings
from handoffd.core.states import State
from handoffd.service.queries import list_handoffs

# a command specialist that holds its slot until the workspace has a file named ``release``
# (bounded: it completes after a minute whatever happens)
BLOCKS = json.dumps([sys.executable, "-c",
                     "import json, os, sys, time\n"
                     "json.load(sys.stdin)\n"
                     "gate = os.path.join(os.environ['HANDOFFD_ROOT'], 'release')\n"
                     "end = time.monotonic() + 60\n"
                     "while not os.path.exists(gate) and time.monotonic() < end:\n"
                     "    time.sleep(0.05)\n"
                     "print(json.dumps({'status': 'completed'}))\n"])
CAPPED = f"""
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 0.5
durability = "fast"

[specialists."@slow"]
command = {BLOCKS}
concurrency = 1
timeout_seconds = 90
"""
NOTE = "waits: @slow runs its concurrency limit (1 of 1 in progress)"


# ------------------------------------------------------------------ 1: the concurrency note
def test_ls_and_show_say_a_handoff_waits_for_its_specialists_concurrency(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", CAPPED)
    release = ws.root / "release"
    try:
        ws.serve()
        first = ws.create("--to", "@slow", "--data", "{}")
        ws.wait_state(first, ("in-progress",))  # its handler holds @slow's one slot
        second = ws.create("--to", "@slow", "--data", "{}")
        notes = {row["id"]: row["note"]
                 for row in json.loads(ws.handoff("ls", "--json", check=True).stdout)}
        assert notes[second] == NOTE, notes  # (it was "")
        assert notes[first].startswith("owner "), notes
        listed = ws.handoff("ls", "--to", "@slow", check=True).stdout
        assert NOTE in listed, listed
        shown = ws.handoff("show", second, check=True).stdout
        assert f"note: {NOTE}" in shown, shown
        assert json.loads(ws.handoff("show", second, "--json", check=True).stdout)["note"] == NOTE
        release.touch()
        assert ws.wait_state(first) == "completed"
        assert ws.wait_state(second) == "completed"
    finally:
        release.touch()  # (a handler still waiting ends at once)
        ws.cleanup()


def test_a_listing_reads_in_progress_once_and_only_with_a_slot_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    engine, backend = memory_engine(tmp_path, clock, {"@m": lambda ctx, data: {}})
    ids = [engine.submit(new_native_request(source="@t", target="@m", data={}, now=clock()))
           for _ in range(5)]
    reads: list[Any] = []
    listed = backend.list

    def counted(**kwargs: Any) -> Any:
        reads.append(kwargs.get("state"))
        return listed(**kwargs)

    monkeypatch.setattr(backend, "list", counted)
    notes = {row["id"]: row["note"] for row in list_handoffs(engine)}
    assert set(notes.values()) == {""}, notes  # concurrency 2, nothing running: no wait
    jobs = [engine.take(ids[0]), engine.take(ids[1])]
    assert all(jobs), jobs
    reads.clear()
    notes = {row["id"]: row["note"] for row in list_handoffs(engine)}
    for hid in ids[2:]:
        assert notes[hid] == "waits: @m runs its concurrency limit (2 of 2 in progress)", notes
    assert reads.count(State.IN_PROGRESS) == 1, reads  # three pending rows, one read


# ------------------------------------------------------------------ 2: the wait on junk
GRACE, SWEEP = 1.0, 1.0
SHORT_SWEEP = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = {GRACE}
sweep_seconds = {SWEEP}
durability = "fast"
"""
TRUNCATED = '{"handoff_id": "%s", "target": {"agent_id": "@x"}, "input": {"data": {}}'


def test_wait_on_junk_nobody_settles_ends_after_the_configured_sweep(tmp_path: Path) -> None:
    ws = new_workspace(tmp_path / "ws", SHORT_SWEEP)
    (ws.root / "handoffs" / "in-progress" / "jk-s25.json").write_text(TRUNCATED % "jk-s25")
    started = time.monotonic()
    wait = ws.handoff("wait", "jk-s25", "--timeout", "60", timeout=90)  # (no daemon runs)
    took = time.monotonic() - started
    assert wait.returncode == 1, (wait.returncode, wait.stderr)  # its read error, not 124
    assert "in-progress/jk-s25.json" in wait.stderr and "Traceback" not in wait.stderr, \
        wait.stderr
    # the old code waited the grace plus the default 10 s sweep, at least 11 s
    assert took < GRACE + SWEEP + 5 < GRACE + DaemonSettings.sweep_seconds, took
    started = time.monotonic()
    with pytest.raises(UnreadableCopy, match="in-progress/jk-s25.json"):
        Client(ws.root).handle("jk-s25").wait(timeout=60)  # the Python client's wait too
    assert time.monotonic() - started < GRACE + SWEEP + 5
