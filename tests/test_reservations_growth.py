"""Contract reservations stay usable however long one contract handoff runs (review s12, R7).

Released reservations are kept so that a scope check can excuse a neighbour's writes; while one
handoff ran for long, every release since it started was kept, the records reached their 4 MiB
bound, and from then on releases, prunes and takes were refused for good. Here: the released
records are trimmed to half the bound (the newest kept), an ended handoff's records never pin
what is kept, a release whose record cannot be kept still ends the live one, and the contracts
feature turns every refusal of the records into one line (never a traceback, never an error
escaping a claim)."""
from __future__ import annotations

import errno
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from conftest import Clock, memory_engine

from handoffd import Daemon
from handoffd.backends.files.records import FileRecords, UnusableRecords, limit_of
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.errors import ErrorCode
from handoffd.core.states import State
from handoffd.features.contracts import feature, reservations
from handoffd.features.contracts.reservations import Reservations

LIMIT = limit_of("reservations")


@dataclass
class Bench:
    """Reservations over a real records folder, beside a fake store whose in-progress claims
    are ``running`` (handoff id -> lease token), on a clock moved by hand."""

    meta: Path
    res: Reservations
    running: dict[str, str] = field(default_factory=dict)
    now: list[float] = field(default_factory=lambda: [1_800_000_000.0])

    def file(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads((self.meta / "reservations.json").read_bytes())
        return loaded

    def run(self, handoff_id: str, owned: list[str], then: float = 1.0) -> None:
        """One contract handoff from start to end, ``then`` seconds long."""
        self.running[handoff_id] = "t"
        assert self.res.take(handoff_id, "t", owned, agent="@w") is None
        self.now[0] += then
        del self.running[handoff_id]
        self.res.release(handoff_id, "t")


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bench:
    meta = tmp_path / "handoffs" / ".meta"
    meta.mkdir(parents=True)
    records = FileRecords(meta)
    running: dict[str, str] = {}

    def get(handoff_id: str) -> Any:
        token = running.get(handoff_id)
        return None if token is None else (State.IN_PROGRESS,
                                           {"handoffd": {"lease": {"token": token}}})

    engine = SimpleNamespace(backend=SimpleNamespace(records=lambda: records, get=get))
    made = Bench(meta, Reservations(engine), running)  # type: ignore[arg-type]
    monkeypatch.setattr(reservations, "time", SimpleNamespace(time=lambda: made.now[0]))
    return made


def widest(tag: str) -> list[str]:
    """The most a contract may own: 256 patterns of about 500 characters (~130 KB a record)."""
    return [f"src/{tag}/{i:03d}/" + "x" * 480 + "/**" for i in range(256)]


def test_a_long_run_beside_many_wide_short_ones_never_wedges_the_records(bench: Bench) -> None:
    """60 of the widest contracts end while one runs on: before, the 32nd release was refused
    (over 4 MiB) and every release, prune and take after it too, for good."""
    bench.running["long"] = "t-long"
    assert bench.res.take("long", "t-long", ["src/long/**"], agent="@w") is None
    started = bench.now[0]
    for n in range(60):
        bench.run(f"short-{n}", widest(f"short-{n}"))
        assert (bench.meta / "reservations.json").stat().st_size <= LIMIT
    released = bench.file()["released"]
    assert len(json.dumps({"released": released}, indent=1)) <= LIMIT // 2
    # the newest are kept, an unbroken run of them: the long run's scope check still excuses
    # the writes of every neighbour released since the oldest one kept
    kept = {r["handoff_id"] for r in bench.res.neighbours("long", started)}
    oldest = 60 - len(kept)
    assert 0 < oldest < 50 and kept == {f"short-{n}" for n in range(oldest, 60)}
    assert [r["handoff_id"] for r in bench.res.records()] == ["long"]  # every short one ended

    del bench.running["long"]
    bench.res.release("long", "t-long")
    assert bench.res.prune() == 0 and bench.res.records() == []
    bench.now[0] += 3 * 3600.0
    bench.run("later", ["src/later/**"])  # nothing live: only what was released just now stays
    assert list(bench.file()["released"]) == ["later.t"]
    assert "live" not in bench.file()


def test_the_records_being_retired_never_pin_what_is_kept(bench: Bench) -> None:
    """A dead owner's live record, taken three hours ago, set the cutoff of its own retiring:
    everything released since stayed (and, once at the bound, nothing could shrink it)."""
    now = bench.now[0]
    (bench.meta / "reservations.json").write_text(json.dumps({
        "live": {"ghost": {"handoff_id": "ghost", "token": "t0", "patterns": ["src/**"],
                           "taken_at": now - 3 * 3600}},
        "released": {"old.t": {"handoff_id": "old", "token": "t", "patterns": ["lib/**"],
                               "taken_at": now - 7300, "released_at": now - 7200}}}))
    assert bench.res.prune() == 1  # ghost's handoff is not in progress: retired
    assert list(bench.file()["released"]) == ["ghost.t0"]
    assert "live" not in bench.file()


def test_forged_release_times_never_break_a_release(bench: Bench) -> None:
    """Released records whose time is no number, NaN or past any float are trimmed as the
    oldest (or kept), never an error of the release sorting them."""
    forged = {f"f{n}.t": {"handoff_id": f"f{n}", "patterns": ["x/**"], "released_at": at}
              for n, at in enumerate(["soon", None, float("nan"), 10 ** 400, True])}
    (bench.meta / "reservations.json").write_text(json.dumps({"released": forged}))
    bench.run("h", ["src/h/**"])
    assert "h.t" in bench.file()["released"] and bench.res.records() == []


class RefusingReleased:
    """Records whose ``released`` record cannot be written (as at the bound)."""

    def __init__(self, inner: FileRecords) -> None:
        self.inner = inner

    def read(self, kind: str) -> dict[str, Any]:
        return self.inner.read(kind)

    def update(self, kind: str, key: str, change: Callable[[Any], Any]) -> Any:
        if key == reservations.RELEASED:
            raise UnusableRecords(f"{kind} records would be over their limit: not written",
                                  code=ErrorCode.DOCUMENT_TOO_LARGE)
        return self.inner.update(kind, key, change)


def test_a_release_that_cannot_be_kept_as_released_still_ends_the_live_record(
        bench: Bench, caplog: pytest.LogCaptureFixture) -> None:
    """Before, the live record of an ended handoff stayed whenever its release was refused."""
    bench.running["h"] = "t"
    assert bench.res.take("h", "t", ["src/h/**"], agent="@w") is None
    del bench.running["h"]
    bench.res.shared = RefusingReleased(bench.res.shared)  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="handoffd.contracts"):
        bench.res.release("h", "t")
    assert bench.res.records() == [] and "released" not in bench.file()
    [line] = [r for r in caplog.records if r.name == "handoffd.contracts"]
    assert line.exc_info is None and "reservation of h: cannot keep it as released" in \
        line.getMessage() and "over their limit" in line.getMessage()


# ---------------------------------------------------------------- the contracts feature
def worker(doc: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"summary": "done"}}


def contract_run(tmp_path: Path) -> Engine:
    """An engine (memory store) with one pending contract handoff, ``c1``, owning src/c1/**."""
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": worker})
    (tmp_path / "src" / "c1").mkdir(parents=True)
    engine.submit({"handoff_id": "c1", "source": {"agent_id": "@coordinator"},
                   "target": {"agent_id": "@w"}, "input": {"data": {}},
                   "contract": {"files_owned": ["src/c1/**"]}})
    return engine


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.exc_info]


def test_a_reservation_the_records_cannot_take_fails_the_attempt_retryably_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before, an OSError of the records (a planted lock folder) escaped the before hook: the
    claim was left in progress, unfiled, with a traceback."""
    def broken(*args: Any, **kwargs: Any) -> None:
        raise IsADirectoryError(errno.EISDIR, "Is a directory", ".reservations.lock")

    monkeypatch.setattr(Reservations, "take", broken)
    engine = contract_run(tmp_path)
    assert Daemon(engine, workers=1, watch=False).run_batch().error is None
    state, doc = engine.get("c1")
    assert state is State.PENDING and book(doc)["retries"] == 1
    assert book(doc)["last_error"] == {
        "code": "PROCESSING_ERROR", "retryable": True,
        "message": "handoff c1: cannot reserve its files_owned: Is a directory (.reservations.lock)"}
    assert tracebacks(caplog) == []


def test_a_refused_release_is_one_line_and_the_handoff_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(*args: Any) -> None:
        raise UnusableRecords("reservations records would be 4300439 bytes with 'released', "
                              "over their 4194304-byte limit: not written",
                              code=ErrorCode.DOCUMENT_TOO_LARGE)

    monkeypatch.setattr(Reservations, "release", refused)
    engine = contract_run(tmp_path)
    with caplog.at_level(logging.INFO):
        assert Daemon(engine, workers=1, watch=False).run_batch().error is None
    assert engine.get("c1")[0] is State.COMPLETED
    assert tracebacks(caplog) == []
    [line] = [r.getMessage() for r in caplog.records if "cannot release" in r.getMessage()]
    assert line.startswith("handoff c1: cannot release its reservation: reservations records")
    assert line.endswith("[DOCUMENT_TOO_LARGE]")


@pytest.mark.parametrize("error", [
    UnusableRecords("reservations records would be over their limit: not written",
                    code=ErrorCode.DOCUMENT_TOO_LARGE),
    PermissionError(errno.EACCES, "Permission denied", "reservations.json")])
def test_a_refused_prune_is_one_line_for_every_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Exception) -> None:
    """Before, an UnusableRecords (no OSError) left the sweeper's step guard to log a traceback
    in every sweep."""
    def refused(self: Reservations) -> int:
        raise error

    monkeypatch.setattr(Reservations, "prune", refused)
    engine, _ = memory_engine(tmp_path, Clock(), {"@w": worker})
    with caplog.at_level(logging.INFO):
        assert feature.prune(engine) == 0
    assert tracebacks(caplog) == []
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("cannot prune file reservations: ")
    assert line.endswith("; the next sweep tries again")


def test_the_released_budget_is_half_the_files_stores_bound() -> None:
    from handoffd.backends.files.records import limit_of
    from handoffd.features.contracts.reservations import KIND, RELEASED_BUDGET
    assert RELEASED_BUDGET * 2 == limit_of(KIND)
