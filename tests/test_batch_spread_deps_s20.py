"""`handoffd run --processes N` and dependencies across its processes (fix F4, session 20).

A waiter is woken by a filing in its own process only; what another process of the batch filed
reached it at a rescan, and a batch process made none before it ended: a DAG of 300 over two
processes left 103 pending, rc 0, nothing said. Now the processes tell each other what they
file (a board in shared memory: :class:`handoffd.service.board.Board`), which wakes the
waiters of each as its own filings do, and one with nothing left to run waits while another
is at work on what its waiters may wait for; the batch still ends when nothing of it runs (a
paused dependency), and, with -v, says what it left waiting."""
from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from conftest import Workspace, exe, new_workspace
from handoffd.core.states import State
from handoffd.service import board as board_module

NOOP = '''
import time

def work(handoff, ctx):
    seconds = float((handoff.get("input") or {}).get("data", {}).get("sleep", 0))
    if seconds:
        time.sleep(seconds)
    return {"status": "completed", "output": {"id": ctx.handoff_id}}
'''

CONFIG = '''
[daemon]
settle_seconds = 0.05
grace_seconds = 5.0
durability = "fast"

[specialists."@work"]
handler = "depsplug:work"

[specialists."@held"]
handler = "depsplug:work"
'''


@pytest.fixture
def dws(tmp_path: Path) -> Workspace:
    """A workspace whose @work and @held run a no-op Python handler (``sleep`` in its data)."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "depsplug.py").write_text(NOOP)
    return new_workspace(tmp_path / "ws", CONFIG)


def env(ws: Workspace) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ws.root.parent / "plug"))


def drop(ws: Workspace, hid: str, deps: list[str], target: str = "@work", **data: object) -> None:
    ws.drop(f"{hid}.json", {"handoff_id": hid, "target": {"agent_id": target},
                            "depends_on": deps, "input": {"data": data}})


def run(ws: Workspace, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), "run", "--root", str(ws.root), *args],
                          capture_output=True, text=True, env=env(ws), timeout=timeout)


def names(ws: Workspace, state: str) -> set[str]:
    return {p.stem for p in (ws.root / "handoffs" / state).glob("*.json")}


def test_a_dag_over_two_processes_completes_in_one_batch(dws: Workspace) -> None:
    """r22's reproduction, smaller: each node depends on 1-3 of the 20 before it, so a node's
    dependencies are filed by either process; and a ladder, each rung depending on both ends
    of the one before, its first rung slow so that each process takes one end of it (one
    worker each). Every node runs in this batch, once."""
    rng, count, rungs = random.Random(5), 100, 25
    for i in range(count):
        deps = {f"n{i - 1}"} if i and rng.random() < 0.5 else set()
        for _ in range(rng.randint(0, 2) if i else 0):
            deps.add(f"n{rng.randrange(max(0, i - 20), i)}")
        drop(dws, f"n{i}", sorted(deps))
    for i in range(rungs):
        for side, other in (("a", "b"), ("b", "a")):
            drop(dws, f"{side}{i:03d}", [f"{side}{i - 1:03d}", f"{other}{i - 1:03d}"] if i else [],
                 sleep=0.8 if i == 0 else 0)
    proc = run(dws, "--processes", "2", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    left = names(dws, "pending") | names(dws, "in-progress")
    assert not left, f"left: {sorted(left)[:10]} ({len(left)}); {proc.stderr}"
    assert len(names(dws, "completed")) == count + 2 * rungs and not names(dws, "failed")
    assert "Traceback" not in proc.stderr and "waiting" not in proc.stderr, proc.stderr


def test_a_waiter_on_a_paused_dependency_does_not_hold_the_batch(dws: Workspace) -> None:
    """What a waiter waits for is paused: nobody in this batch runs it. The batch waits only
    while another of its processes is at work (the sleepers), then ends: rc 0 (nothing failed),
    and the summary says what it left waiting (the paused one and its dependant)."""
    assert dws.handoff("pause", "@held").returncode == 0
    drop(dws, "held", [], target="@held")
    drop(dws, "after-held", ["held"])
    for i in range(4):  # work for both processes, one chain of it across them
        drop(dws, f"s{i}", [f"s{i - 1}"] if i else [], sleep=0.3)
    proc = run(dws, "--processes", "2", "-v", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "batch done: completed 4, failed 0, retry scheduled 0, waiting 2\n" \
        in proc.stderr, proc.stderr
    assert names(dws, "pending") == {"held", "after-held"}
    assert names(dws, "completed") == {f"s{i}" for i in range(4)}
    quiet = run(dws, "--processes", "2", "-q", timeout=60)  # -q: only errors
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_a_single_process_batch_leaves_them_waiting_quietly(dws: Workspace) -> None:
    """One process too: what waits for a paused handoff is left for a later run. Nothing
    failed, so cron hears nothing; -v says what was left waiting."""
    assert dws.handoff("pause", "@held").returncode == 0
    drop(dws, "held", [], target="@held")
    drop(dws, "after-held", ["held"])
    drop(dws, "free", [])
    proc = run(dws, "--processes", "1", timeout=60)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    drop(dws, "free2", [])
    proc = run(dws, "--processes", "1", "-v", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "batch done: completed 1, failed 0, retry scheduled 0, waiting 2\n" in proc.stderr, \
        proc.stderr


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_board_tells_each_process_what_the_others_filed() -> None:
    """Each process hears the filings of the others, once each, not its own; one that filed
    more than the board keeps since the last look is reported lost (None: look at every
    waiter again)."""
    board = board_module.Board(3, filings=4)
    first, second, third = board.seat(0), board.seat(1), board.seat(2)
    second.filed("a", State.COMPLETED)
    third.filed("b" * 128, State.FAILED)
    first.filed("c", State.PENDING)
    assert first.news() == [("a", State.COMPLETED), ("b" * 128, State.FAILED)]
    assert first.news() == []
    assert second.news() == [("c", State.PENDING), ("b" * 128, State.FAILED)]  # (by process)
    for i in range(4):  # as many as the board keeps: none lost
        third.filed(f"t{i}", State.COMPLETED)
    assert [hid for hid, _ in first.news()] == ["t0", "t1", "t2", "t3"]
    for i in range(5):  # one more than it keeps
        third.filed(f"u{i}", State.COMPLETED)
    assert first.news() is None
    assert first.news() == []  # (heard up to there: what is lost is looked for by a rescan)


def test_the_board_says_who_is_at_work() -> None:
    """Every process is at work until it says it is idle, or until it was not heard of for
    BEAT_STALE_SECONDS (killed at work)."""
    clock = FakeClock()
    board = board_module.Board(3, clock=clock)
    first, second, third = board.seat(0), board.seat(1), board.seat(2)
    assert first.others_busy()  # one still starting is waited for
    second.idle()
    third.idle()
    assert not first.others_busy() and second.others_busy()  # (the first is still at work)
    third.busy()
    assert first.others_busy()
    clock.now += board_module.BEAT_STALE_SECONDS + 1  # the third died at work: it never said idle
    assert not first.others_busy()
    third.busy()  # alive after all (its loop held up): at work again
    assert first.others_busy()


def test_the_board_is_shared_with_forked_processes() -> None:
    """What a forked process writes on its seat, the parent reads (memory shared before the fork)."""
    board = board_module.Board(2)
    pid = os.fork()
    if pid == 0:  # the child: one filing, then idle
        try:
            seat = board.seat(1)
            seat.filed("from-child", State.COMPLETED)
            seat.idle()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    mine = board.seat(0)
    assert mine.news() == [("from-child", State.COMPLETED)] and not mine.others_busy()
