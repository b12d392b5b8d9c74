"""No first_success loser starts once its winner is in (F1, session 20).

Once a first_success child succeeded, its parent's gate let the parent go and it was aggregated
(claimed, its children read, the open ones cancelled, filed): some 30 ms, in which another worker
still claimed and started a sibling (its specialist ran for nothing; one that ended in time was
filed as a success beside the winner). Seen in the histories of session 19 (c3 claimed 26.546
and c2 26.554 while the parent, claimed at 26.542, was aggregated at 26.571), reproduced with
`serve --workers 3`: every loser handed to a worker freed during the aggregation was claimed
after the winner was filed. Now the win is noted as the winner's success is decided, before it
is filed: its pending siblings are held in the scheduler (a gate) and one a worker was handed
just before is given back unrun (a resumer) until the parent's aggregation cancels it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Clock, Workspace, memory_engine
from test_orchestration import HANDLERS, fan_out, ows, score  # noqa: F401

from handoffd import Daemon, State, new_native_request
from handoffd.core.engine import Engine
from handoffd.features import first_success

RUNS: list[str] = []  # the @leaf handoffs whose handler ran


def boss(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Delegates four children to @leaf, first_success."""
    return {"status": "delegated", "aggregation": "first_success",
            "delegate": [{"to": "@leaf", "data": {"n": n}} for n in range(4)]}


def leaf(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Succeeds at once (and says it ran)."""
    RUNS.append(ctx.handoff_id)
    return {"status": "completed", "output": {"n": (ctx.data or {}).get("n")}}


class Family:
    """A parked first_success parent and its four children on the memory store, with a daemon
    whose loop does not run: the test asks its scheduler for the next handoffs, as a worker
    does, and records what it would start."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        RUNS.clear()
        self.clock = Clock()
        self.engine: Engine
        self.engine, _ = memory_engine(tmp_path, self.clock, {"@boss": boss, "@leaf": leaf})
        self.daemon = Daemon(self.engine, workers=3, watch=False)
        self.started: list[str] = []

        def record(agent: str, func: Any, handoff_id: str, *args: Any) -> int:
            token = self.daemon.scheduler.start(agent)
            self.started.append(handoff_id)
            self.daemon.scheduler.finished(token)
            return token

        monkeypatch.setattr(self.daemon.dispatcher, "submit", record)
        self.parent = self.engine.submit(new_native_request(
            source="@test", target="@boss", data={}, now=self.clock(), handoff_id="fs"))
        assert self.process(self.parent) is State.PENDING  # parked with its children
        self.children = [f"fs.c{n}" for n in range(1, 5)]

    def process(self, handoff_id: str) -> State:
        """Claim, run and file one handoff, as a worker does."""
        job = self.engine.take(handoff_id)
        assert job is not None, handoff_id
        return self.engine.file(job.claim, job.dialect, job.specialist, self.engine.run(job))

    def next_ones(self) -> list[str]:
        """What the scheduler hands out now (a worker asking for its next handoff)."""
        self.started.clear()
        self.daemon.scan()
        books = self.daemon.scheduler
        with books.cv:
            while (ready := books.next_ready(time.monotonic())) is not None:
                self.daemon.dispatcher.dispatch_safely(*ready)
        return list(self.started)

    def history(self, handoff_id: str) -> list[str]:
        return [e["event"] for e in self.engine.get(handoff_id)[1]["handoffd"]["history"]]

    def close(self) -> None:
        self.daemon.pool.shutdown()


@pytest.fixture
def family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Family]:
    made = Family(tmp_path, monkeypatch)
    yield made
    made.close()


def test_a_worker_asking_after_the_winner_is_filed_gets_no_sibling(family: Family) -> None:
    winner, *losers = family.children
    assert family.process(winner) is State.COMPLETED
    # the parent is not aggregated yet: a worker asks for its next handoff
    handed = family.next_ones()
    assert not set(handed) & set(losers), handed  # before: two siblings (the leaf's concurrency)
    assert all(family.daemon.scheduler.waiting.get(c, "").startswith("first_success: its sibling "
                                                                     f"{winner} succeeded")
               for c in losers), family.daemon.scheduler.waiting
    assert family.process(family.parent) is State.COMPLETED  # the aggregation
    outcome = family.engine.get(family.parent)[1]["aggregated_outcome"]
    assert [c["status"] for c in outcome["child_outcomes"]] == ["success"] + ["cancelled"] * 3
    assert RUNS == [winner]
    assert family.next_ones() == [] and len(winner_book(family.engine)) == 0  # forgotten


def test_a_sibling_handed_out_before_the_win_and_claimed_after_it_is_given_back_unrun(
        family: Family) -> None:
    winner, loser = family.children[:2]
    assert family.process(winner) is State.COMPLETED
    job = family.engine.take(loser)  # its worker claims it only now
    assert job is not None
    where = family.engine.file(job.claim, job.dialect, job.specialist, family.engine.run(job))
    assert where is State.PENDING and RUNS == [winner]  # before: completed, its handler ran
    assert family.history(loser)[-2:] == ["claimed", "handed_back"]
    assert family.engine.get(loser)[1]["handoffd"]["history"][-1]["detail"]["reason"] == \
        f"first_success: its sibling {winner} succeeded (fs)"
    assert family.engine.get(loser)[1]["handoffd"]["attempt"] == 0  # its attempt given back
    assert loser not in family.next_ones()  # held, as its siblings are
    assert family.process(family.parent) is State.COMPLETED
    assert family.engine.get(loser)[0] is State.FAILED and RUNS == [winner]


def test_the_siblings_are_held_from_the_moment_the_success_is_decided(family: Family) -> None:
    winner, *losers = family.children
    job = family.engine.take(winner)
    assert job is not None
    outcome = family.engine.run(job)  # decided, not filed yet
    assert not set(family.next_ones()) & set(losers)
    family.engine.file(job.claim, job.dialect, job.specialist, outcome)
    assert family.process(family.parent) is State.COMPLETED and RUNS == [winner]


def test_a_success_filed_as_a_failure_lets_the_siblings_run(family: Family) -> None:
    """A later check may fail what the handler answered: the win is forgotten at that filing
    (its siblings, waiting on it, are looked at again) and they run."""
    winner, *losers = family.children
    job = family.engine.take(winner)
    assert job is not None
    family.engine.run(job)
    failure = family.engine.failure(family.clock(), "PROCESSING_ERROR", "a later check failed it",
                                    retryable=False)
    assert family.engine.file(job.claim, job.dialect, job.specialist, failure) is State.FAILED
    assert len(winner_book(family.engine)) == 0
    assert set(losers) & set(family.next_ones())


def test_a_success_never_filed_holds_the_siblings_for_a_bounded_time(family: Family) -> None:
    """A winner whose claim was lost is filed by no one here: after WIN_FILING_SECONDS its win
    is void (the injected clock moves), and its siblings may run."""
    winner, *losers = family.children
    job = family.engine.take(winner)
    assert job is not None
    family.engine.run(job)  # decided; its filing never comes
    assert not set(family.next_ones()) & set(losers)
    family.clock.advance(first_success.WIN_FILING_SECONDS + 1)
    family.daemon.queue(losers[0])  # (the scheduler's rescan recheck, done by hand)
    assert losers[0] in family.next_ones()


def test_a_parent_another_process_files_lets_the_siblings_go(
        family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """R25 #1: the parent filed by another process (a plain `handoff cancel`, which leaves the
    children made so far to run) is heard by no filing hook here: its siblings were held in
    this daemon for ever. A filed win's parent is looked at again after WIN_RECHECK_SECONDS."""
    from handoffd.features import cancel_family
    winner, *losers = family.children
    assert family.process(winner) is State.COMPLETED
    book = winner_book(family.engine)
    hooks = family.engine.on_filed
    with monkeypatch.context() as elsewhere:  # (this process's hook does not hear it)
        elsewhere.setattr(family.engine, "on_filed", [h for h in hooks
                                                      if getattr(h, "__self__", None) is not book])
        cancel_family.cancel(family.engine, family.parent, reason="stop", cascade=False)
    assert family.engine.get(family.parent)[0] is State.FAILED
    assert book.held_back(losers[0], family.engine.get(losers[0])[1]) is not None  # (at once)
    family.clock.advance(first_success.WIN_RECHECK_SECONDS + 1)
    assert book.held_back(losers[0], family.engine.get(losers[0])[1]) is None
    assert len(book) == 0
    assert set(family.next_ones()) == set(losers)  # they run, as after any plain cancel


def winner_book(engine: Engine) -> first_success.Winners:
    """The engine's Winners (its gate's owner)."""
    for gate in engine.gates:
        owner = getattr(gate, "__self__", None)
        if isinstance(owner, first_success.Winners):
            return owner
    raise AssertionError("no Winners installed")


# ---------------------------------------------------------------- a real daemon
def child(ok: bool, sleep: float, value: int) -> dict[str, Any]:
    """A @scorer child that answers after ``sleep`` seconds unless cancelled first."""
    made = score(ok, 0.9, value=value)
    made["data"]["sleep"] = sleep
    return made


def test_under_serve_no_loser_starts_after_the_winner_is_filed(ows: Workspace) -> None:
    """Six children on three workers: the winner (c1) ends first, c2 and c3 fail just after,
    during the parent's aggregation, and their workers ask for more; c4-c6 would succeed.
    Before, those workers claimed c4-c6 after the winner was filed (3 of 3 runs)."""
    kids = [child(True, 0.3, 1), child(False, 0.32, 2), child(False, 0.34, 3)] + \
        [child(True, 3.0, value) for value in (4, 5, 6)]
    daemon = ows.serve("--workers", "3")
    try:
        fan_out(ows, "pw", "first_success", kids)
        assert ows.wait_state("pw", ("completed", "failed"), timeout=60) == "completed"
    finally:
        assert ows.stop(daemon) == 0
    parent = ows.doc("pw")
    assert parent["output"]["winner"] == "pw.c1", parent["aggregated_outcome"]
    filed = ows.doc("pw.c1")["handoffd"]["history"][-1]["at"]
    late = []
    for n in range(2, 7):
        history = ows.doc(f"pw.c{n}")["handoffd"]["history"]
        for at, event in enumerate(history):
            given_back = at + 1 < len(history) and history[at + 1]["event"] == "handed_back"
            if event["event"] == "claimed" and event["at"] > filed and not given_back:
                late.append((f"pw.c{n}", event["at"], [e["event"] for e in history]))
    assert not late, (filed, late)
    statuses = [c["status"] for c in parent["aggregated_outcome"]["child_outcomes"]]
    # (c2 and c3 may end before the aggregation cancels them: failed then)
    assert statuses[0] == "success" and set(statuses[1:3]) <= {"cancelled", "failed"} \
        and statuses[3:] == ["cancelled"] * 3, statuses
