"""Review R30's findings on the claim path's changes (session 22).

1. A shortage of descriptors while importing a Python handler failed the handoff for good
   (a ConfigError, not retryable): it is a start shortage, handed back uncounted.
2. A valid document renamed over the locked one before the claim's rename was failed for the
   locked file's bytes (the claim read through its lock): what was renamed is judged on its own.
3. A shortage of descriptors loading a schema while admitting a claim left it leased in
   in-progress/ as an error (its recovery then counted an attempt): handed back uncounted.
4. Claims given up for a shortage all backed off together, doubling, and stayed idle long after
   the handler holding the descriptors ended: a task's end looks at them again.
5. A MemoryError in the claim's lease write left it in in-progress/ with a traceback.
6. A run's "handed back" counted what another process, or a cancel, took since.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock
from test_claim_shortage_s22 import FailIn, _engine, _ran_once_uncounted, _submit

from handoffd import Daemon, Registry, Workspace, build_engine
from handoffd.backends.files import claiming, fsio
from handoffd.backends.files import store as store_module
from handoffd.core import specialists, validation
from handoffd.core.config import Config, RetryPolicy, specialist_from_table
from handoffd.core.documents import book
from handoffd.core.errors import ClaimShortage
from handoffd.core.memorystrikes import memory_strikes
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import Specialist
from handoffd.core.states import State


def _python_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An engine whose @py specialist is a Python handler imported by reference."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "r30mod.py").write_text(
        "def done(handoff, ctx=None):\n    return {'status': 'completed', 'output': {}}\n")
    monkeypatch.syspath_prepend(str(plug))
    monkeypatch.delitem(sys.modules, "r30mod", raising=False)
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config(retry=RetryPolicy(max_retries=2))
    registry = Registry()
    registry.add(Specialist(specialist_from_table("@py", {"handler": "r30mod:done"},
                                                  config.retry)))
    return build_engine(ws, config, registry)


def _emfile_importing_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first import of r30mod fails with EMFILE; the list counts how many did."""
    real, raised = specialists.importlib.import_module, [0]

    def import_module(name: str, *args: Any) -> Any:
        if name == "r30mod" and not raised[0]:
            raised[0] += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "r30mod.py")
        return real(name, *args)

    monkeypatch.setattr(specialists.importlib, "import_module", import_module)
    return raised


def test_a_descriptor_shortage_importing_a_handler_hands_it_back_uncounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _python_engine(tmp_path, monkeypatch)
    hid = engine.submit(new_native_request(source="@t", target="@py", data={},
                                           now=engine.clock()))
    raised = _emfile_importing_once(monkeypatch)
    report = Daemon(engine, workers=1, watch=False).run_batch()
    state, doc = engine.get(hid)
    assert raised[0] == 1 and state is State.COMPLETED and report.failed == 0, doc
    assert doc["handoffd"]["attempt"] == 1  # (the hand-back gave the attempt back)
    events = [e["event"] for e in book(doc)["history"]]
    assert events == ["created", "claimed", "handed_back", "claimed", "completed"], events


def test_a_real_import_error_still_fails_the_handoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _python_engine(tmp_path, monkeypatch)
    (tmp_path / "plug" / "r30mod.py").write_text("raise OSError(2, 'gone', 'x')\n")
    hid = engine.submit(new_native_request(source="@t", target="@py", data={},
                                           now=engine.clock()))
    Daemon(engine, workers=1, watch=False).run_batch()
    state, doc = engine.get(hid)
    assert state is State.FAILED and "cannot import handler" in doc["error"]["message"]


def test_a_file_renamed_over_the_locked_one_is_judged_on_its_own_bytes(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    pending = engine.ws.handoffs / "pending" / f"{hid}.json"
    doc = json.loads(pending.read_text())
    replacement = dict(doc, input={"data": {"b": "the producer's fixed copy"}})
    pending.write_text("{" * 10 + "not JSON")  # the locked file: malformed
    real = store_module.lock_document

    def lock_then_swap(path: Path) -> Any:
        held = real(path)
        tmp = Path(path).with_name(".b")  # (the claim locks it by a str path)
        tmp.write_text(json.dumps(replacement))
        os.rename(tmp, path)  # a producer's rename over it, after our lock, before our rename
        return held

    monkeypatch.setattr(store_module, "lock_document", lock_then_swap)
    assert engine.take(hid) is None  # not the locked file: the lease write gave the claim up
    monkeypatch.setattr(store_module, "lock_document", real)
    found = engine.get(hid)
    assert found is not None and found[0] is not State.FAILED
    assert json.loads((engine.ws.handoffs / "in-progress" / f"{hid}.json").read_text()) \
        == replacement  # as it came, left for the sweep to hand back
    assert not list((engine.ws.handoffs / "failed").iterdir())


def test_a_descriptor_shortage_loading_a_schema_hands_the_claim_back(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    real, raised = validation.load_builtin, [0]

    def read(*args: Any, **kwargs: Any) -> Any:
        if not raised[0]:
            raised[0] += 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "x.schema.json")
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "load_builtin", read)  # (the engine's cache is new)
    with pytest.raises(ClaimShortage):
        engine.take(hid)
    assert raised[0] == 1
    state, doc = engine.get(hid)
    assert state is State.PENDING and doc["handoffd"]["attempt"] == 0
    job = engine.take(hid)
    assert job is not None and job.claim.attempt == 1


def test_a_memory_error_in_the_lease_write_puts_the_claim_back(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    write = FailIn(fsio.replace_exact, "claim_held", 1, MemoryError)
    monkeypatch.setattr(claiming.fsio, "replace_exact", write)
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert write.raised == 1
    _ran_once_uncounted(engine, hid, report)
    memory_strikes._rows.clear()


def test_a_task_ending_looks_again_at_claims_given_up_for_a_shortage(
        tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    scheduler, attempts = daemon.scheduler, daemon.attempts
    short, ran = _submit(engine), _submit(engine)
    attempts.claim_shortages[short] = 6  # its sixth shortage in a row: a minute's back-off
    scheduler.hold_off(short, 60.0)
    assert scheduler.queued[short] > time.monotonic() + 50
    attempts.work(ran)  # another handoff ran (what held the descriptors is free)
    assert scheduler.queued[short] <= time.monotonic()
    assert engine.get(ran)[0] is State.COMPLETED


def test_a_run_counts_no_hand_back_that_another_took_since(
        tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    taken, left = _submit(engine), _submit(engine)
    for hid in (taken, left):
        daemon.attempts.backed_off.add(hid)
        daemon.report.backed_off.append(hid)
    daemon.report.handed_back = 2
    assert engine.take(taken) is not None  # another process (or a cancel) took it since
    daemon.attempts.settle_handed_back()
    assert daemon.report.handed_back == 1 and daemon.report.backed_off == [left]


@pytest.fixture
def clock() -> Clock:
    return Clock()


# ------------------------------------------------------- review R31's findings on the above


def test_an_extension_module_that_cannot_be_opened_for_descriptors_is_a_shortage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dlopen says EMFILE in an ImportError's words alone: that too is a passing shortage."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "r31ext.py").write_text(
        "raise ImportError('/x/_lzma.so: cannot open shared object file: Too many open files')\n")
    (plug / "r31bad.py").write_text("raise ImportError('No module named nothing_here')\n")
    monkeypatch.syspath_prepend(str(plug))
    with pytest.raises(OSError) as short:
        specialists.import_handler("r31ext:done", "@ext")
    assert short.value.errno == errno.EMFILE
    with pytest.raises(specialists.ConfigError):
        specialists.import_handler("r31bad:done", "@bad")


def test_an_import_shortage_logs_no_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _python_engine(tmp_path, monkeypatch)
    hid = engine.submit(new_native_request(source="@t", target="@py", data={},
                                           now=engine.clock()))
    assert _emfile_importing_once(monkeypatch) == [0]
    Daemon(engine, workers=1, watch=False).run_batch()
    events = [json.loads(line) for line in (engine.ws.handoffs / ".meta" / "events.jsonl")
              .read_text().splitlines()]
    mine = [e["event"] for e in events if e.get("id") == hid]
    assert mine.count("claimed") == 1 and mine[-1] == "completed", mine


def test_a_claim_shortage_row_ends_when_its_handoff_is_not_ours_to_claim(
        tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    attempts = daemon.attempts
    gone = _submit(engine)
    job = engine.take(gone)  # another process took it meanwhile
    assert job is not None
    attempts.claim_shortages[gone] = 3
    attempts.work(gone)
    assert gone not in attempts.claim_shortages


def test_claims_short_of_descriptors_are_looked_at_in_turn(tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    attempts, scheduler = daemon.attempts, daemon.scheduler
    short = [_submit(engine) for _ in range(6)]
    for hid in short:
        attempts.claim_shortages[hid] = 6
        scheduler.hold_off(hid, 60.0)
    attempts.work(_submit(engine))
    attempts.work(_submit(engine))
    assert all(scheduler.queued[hid] <= time.monotonic() for hid in short)  # 4, then the 2


def test_a_held_off_claim_is_no_stall(tmp_path: Path, clock: Clock) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    hid = _submit(engine)
    assert daemon.progress.due_with_free_slot() == hid  # due, a slot free, nothing dispatched
    daemon.scheduler.hold_off(hid, 60.0)  # (put back for a shortage, as it came)
    assert daemon.progress.due_with_free_slot() is None


def test_a_run_end_does_not_wait_on_a_store_that_does_not_answer(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    daemon = Daemon(engine, workers=1, watch=False)
    ids = [_submit(engine) for _ in range(3)]
    for hid in ids:
        daemon.attempts.backed_off.add(hid)
        daemon.report.backed_off.append(hid)
    daemon.report.handed_back = 3
    asked: list[str] = []

    def away(handoff_id: str) -> Any:
        asked.append(handoff_id)
        raise OSError(errno.ECONNREFUSED, "the store is away")

    monkeypatch.setattr(engine.backend.inner, "get", away)  # (under the event log)
    daemon.attempts.settle_handed_back()
    assert len(asked) == 1 and daemon.report.handed_back == 3
