"""The shortage leftovers of session 22 (helper S1, session 23).

1. A MemoryError claiming on the memory and PostgreSQL stores (copying, marking or parsing the
   document) went to ``Attempts.unexpected`` (a traceback, the batch's error), or on PostgreSQL
   (the row's JSON loader swallowed it) set the handoff aside at once as unprocessable. Now it
   is a memory strike in the "claim" stage, as on the file store: the claim undone, handed back
   uncounted with the memory back-off, set aside only at the strikes' bound.
2. A cancellation message claimed during a shortage logged a traceback; now one warning line,
   the message stays in pending/ and is looked at again after the back-off.
3. A shortage while reading a pending document to schedule it said "will look again in 5s"
   (with a traceback when it came out of the dispatch); now one line naming the limit and the
   real back-off.
4. A folder that could not be opened for want of descriptors was called "not a folder of the
   workspace (a symlink?)"; now "cannot open <folder>: ... (EMFILE: ...)".
"""
from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, memory_engine
from test_claim_shortage_s22 import short_memory_backoff  # noqa: F401 (autouse)
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon
from handoffd.backends import memory as memory_backend
from handoffd.core import memorystrikes
from handoffd.core.documents import book
from handoffd.core.errors import ClaimShortage, ErrorCode
from handoffd.core.memorystrikes import memory_strikes
from handoffd.core.states import State




def ok(_doc: Any, _ctx: Any) -> dict[str, Any]:
    return {"status": "completed", "output": {"ok": True}}


def _request(hid: str, target: str = "@ok") -> dict[str, Any]:
    return {"handoff_id": hid, "source": {"agent_id": "@t"}, "target": {"agent_id": target},
            "input": {"data": {}}}


def _said(caplog: Any, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


# ---------------------------------------------------------------- item 1: memory store


def test_memory_store_a_memory_error_claiming_hands_it_back_uncounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """It went to Attempts.unexpected: a traceback, the batch's error, a 1 s hold-off."""
    engine, backend = memory_engine(tmp_path, Clock(), {"@ok": ok})
    engine.submit(_request("m1"))
    stamp = FailFirst(memory_backend.stamp_claimed, 1, MemoryError)
    monkeypatch.setattr(memory_backend, "stamp_claimed", stamp)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert stamp.raised == 1
    assert report.errors == 0 and report.completed == 1, report
    state, doc = backend.get("m1")
    assert state is State.COMPLETED and book(doc)["attempt"] == 1
    said = _said(caplog, "cannot be claimed for now")
    assert len(said) == 1 and "MemoryError" in said[0] and "uncounted" in said[0], said
    assert not any(r.exc_info for r in caplog.records)  # no traceback
    assert memory_strikes.backoff("m1") == 0.0  # the claim that worked ended the row


def test_memory_store_memory_errors_set_it_aside_only_at_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, backend = memory_engine(tmp_path, Clock(), {"@ok": ok})
    engine.submit(_request("m2"))
    stamp = FailFirst(memory_backend.stamp_claimed, 99, MemoryError)
    monkeypatch.setattr(memory_backend, "stamp_claimed", stamp)
    now = [1000.0]
    memory_strikes.clock = lambda: now[0]
    for _ in range(1, memorystrikes.MEMORY_STRIKES):
        with pytest.raises(ClaimShortage) as caught:
            engine.claim("m2")
        assert caught.value.reason == "MemoryError" and caught.value.delay > 0
        state, doc = backend.get("m2")
        assert state is State.PENDING and book(doc).get("attempt", 0) == 0
        now[0] += memorystrikes.MEMORY_PATIENCE_SECONDS / 3
    assert engine.claim("m2") is None  # the 5th, over 5 minutes: set aside for good
    state, doc = backend.get("m2")
    assert state is State.FAILED and doc["error"]["code"] == ErrorCode.UNPROCESSABLE_DOCUMENT
    assert "ran out of memory" in doc["error"]["message"]


# ---------------------------------------------------------------- item 1: PostgreSQL store


def test_postgres_a_memory_error_loading_a_claimed_row_hands_it_back_uncounted(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row's JSON loader swallowed the MemoryError (an Unloadable): the claim set the
    handoff aside at once as unprocessable, failed for good for a passing shortage."""
    from test_postgres_s22 import _engine as pg_engine

    from handoffd.backends.postgres import values
    from handoffd.core.native_format import new_native_request
    engine = pg_engine(tmp_path / "ws", pg_url)
    try:
        doc = new_native_request(source="@o", target="@flaky", data={"mode": "ok"},
                                 now=engine.clock(), handoff_id="pg-mem")
        engine.submit(doc)
        load = FailFirst(values.load_json, 2, MemoryError,
                         when=lambda text, *_a, **_k: '"pg-mem"' in text)
        monkeypatch.setattr(values, "load_json", load)
        peek = engine.peek("pg-mem")  # routing it: a "read" strike, looked at again
        assert peek is not None and not peek.readable and peek.problem is not None
        assert peek.problem.transient and "MemoryError" in str(peek.problem)
        memory_strikes._rows.clear()
        with pytest.raises(ClaimShortage) as caught:
            engine.claim("pg-mem")
        assert caught.value.reason == "MemoryError" and caught.value.delay > 0
        assert "uncounted" in str(caught.value)
        state, stored = engine.get("pg-mem")
        assert state is State.PENDING and book(stored).get("attempt", 0) == 0
        assert load.raised == 2
        claimed = None
        for _ in range(50):  # (None while this process's presence is not yet proved alive)
            claimed = engine.claim("pg-mem")
            if claimed is not None or engine.backend.present_for_sure():
                break
            time.sleep(0.1)
        assert claimed is not None and claimed[0].attempt == 1
        assert memory_strikes.backoff("pg-mem") == 0.0
    finally:
        engine.backend.close()


# ---------------------------------------------------------------- item 2: a cancel message


def test_a_cancel_message_claimed_in_a_shortage_is_one_warning_and_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Its claim's ClaimShortage reached Attempts.aside's log.exception: a traceback, and
    nothing looked at it again before the next rescan."""
    import copy

    from dialect_examples import HI_MOE_CANCELLATION
    from test_claim_shortage_s22 import _engine as files_engine
    from test_claim_shortage_s22 import _fail_at
    engine = files_engine(tmp_path / "ws", Clock())
    message = copy.deepcopy(HI_MOE_CANCELLATION)
    hid = engine.submit(message)
    fail = _fail_at("read", errno.EMFILE, monkeypatch)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert fail.raised == 1
    said = _said(caplog, "cannot be claimed for now")
    assert len(said) == 1 and "EMFILE" in said[0] and "ulimit -n" in said[0], said
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    state, doc = engine.get(hid)
    # carried out once the shortage passed (msg-001 is unknown here: filed failed, once)
    assert state is State.FAILED, (state, doc)
    assert book(doc)["attempt"] == 1
    assert report.failed == 1 and report.errors == 0 and report.handed_back == 0, report


def test_a_gate_failure_claimed_in_a_shortage_is_one_warning_and_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """A gate that fails a handoff files it through a claim (Attempts.reject): that claim's
    ClaimShortage reached a log.exception, a traceback, and nothing looked at it again
    before the next rescan (a batch ended with it pending)."""
    from test_claim_shortage_s22 import _engine as files_engine
    from test_claim_shortage_s22 import _fail_at
    from test_start_shortage_s20 import _submit

    from handoffd.core.hooks import Verdict
    engine = files_engine(tmp_path / "ws", Clock())
    engine.gates.append(lambda _engine, _env, _doc: Verdict("fail", "refused by a test gate",
                                                            code="REJECTED"))
    hid = _submit(engine)
    fail = _fail_at("read", errno.EMFILE, monkeypatch)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert fail.raised == 1
    said = _said(caplog, "cannot be claimed for now")
    assert len(said) == 1 and "EMFILE" in said[0], said
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    state, doc = engine.get(hid)
    assert state is State.FAILED and doc["error"]["code"] == "REJECTED", (state, doc)
    assert report.failed == 1 and report.errors == 0 and report.handed_back == 0, report


# ---------------------------------------------------------------- item 3: reading, scheduling


def _look_again(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "will look again" in r.getMessage()]


def test_a_descriptor_shortage_reading_to_schedule_names_the_limit_and_backs_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """It said "pending/x.json cannot be read: Too many open files (EMFILE); will look again
    in 5s": no limit named, the outage's wait."""
    from test_claim_shortage_s22 import FailIn
    from test_claim_shortage_s22 import _engine as files_engine
    from test_start_shortage_s20 import _submit

    from handoffd.backends.files import fsio
    engine = files_engine(tmp_path / "ws", Clock())
    hid = _submit(engine)
    fail = FailIn(fsio.read_bytes_safely, "read", 1,
                  lambda: OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    monkeypatch.setattr(fsio, "read_bytes_safely", fail)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert fail.raised == 1
    said = _look_again(caplog)
    assert len(said) == 1, said
    assert "cannot be read for now" in said[0] and "(EMFILE: the daemon's limit on open " \
        "files, ulimit -n)" in said[0] and "will look again in 1s" in said[0], said
    assert not any(r.exc_info for r in caplog.records)
    assert report.completed == 1 and report.errors == 0, report
    assert book(engine.get(hid)[1])["attempt"] == 1


@pytest.mark.parametrize("error", ["EMFILE", "MemoryError", "bug"])
def test_a_shortage_scheduling_is_one_line_with_its_back_off(
        tmp_path: Path, error: str, caplog: Any) -> None:
    """A gate that runs short of descriptors (reading another file) or memory: the dispatch's
    log.exception, a traceback and "will look again in 5s". A bug keeps its traceback."""
    engine, backend = memory_engine(tmp_path, Clock(), {"@ok": ok})
    engine.submit(_request("g1"))
    raised: list[str] = []

    def gate(_engine: Any, _env: Any, _doc: Any) -> None:
        if not raised:
            raised.append(error)
            if error == "EMFILE":
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            raise MemoryError() if error == "MemoryError" else ValueError("a bug")
        return None

    engine.hooks.gates.append(gate)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert raised == [error]
    tracebacks = [r for r in caplog.records if r.exc_info]
    if error == "bug":
        assert len(tracebacks) == 1 and "could not be scheduled" in tracebacks[0].getMessage()
        return  # (looked at again in 5 s: after the batch's end)
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    said = _look_again(caplog)
    assert len(said) == 1 and "g1: cannot be scheduled for now" in said[0], said
    if error == "EMFILE":
        assert "(EMFILE: the daemon's limit on open files, ulimit -n)" in said[0]
        assert "will look again in 1s" in said[0]
    else:
        assert "out of memory (MemoryError)" in said[0] and "will look again in 0.2s" in said[0]
    assert report.completed == 1 and report.errors == 0, report


def test_no_worker_thread_to_start_is_one_line_and_the_handoff_runs_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Under a process or thread limit (ulimit -u, pids.max) a worker thread cannot start:
    the pool's RuntimeError reached the dispatch's log.exception (a traceback, "will look
    again in 5s"), and its task stayed queued to run, slotless, beside later ones."""
    import threading

    from handoffd.service import workers
    engine, _backend = memory_engine(tmp_path, Clock(), {"@ok": ok})
    engine.submit(_request("t1"))
    real_start = threading.Thread.start
    refused: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("handoffd-worker") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(workers.threading.Thread, "start", start)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert refused, "no worker thread was refused"
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    said = _look_again(caplog)
    assert len(said) == 1 and "t1: cannot be scheduled for now" in said[0], said
    assert "EAGAIN" in said[0] and "ulimit -u" in said[0], said
    assert report.completed == 1 and report.errors == 0, report
    assert engine.get("t1")[1]["handoffd"]["attempt"] == 1


# ---------------------------------------------------------------- item 4: folders, descriptors


def _emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def _no_symlink_said(caplog: Any, folder: Path) -> str:
    """The one line said about ``folder``: the shortage named, no symlink blamed."""
    said = [r.getMessage() for r in caplog.records if str(folder) in r.getMessage()]
    assert len(said) == 1, said
    assert f"cannot open {folder}: Too many open files (EMFILE: the daemon's limit on open " \
        "files, ulimit -n)" in said[0] and "symlink" not in said[0], said
    return said[0]


def test_the_sweep_names_a_descriptor_shortage_opening_a_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from test_claim_shortage_s22 import FailIn

    from handoffd.backends.files import orphans
    folder = tmp_path / "locks"
    folder.mkdir()
    monkeypatch.setattr(orphans.os, "open", FailIn(os.open, "_opened", 1, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    with orphans._opened(folder) as fd:
        assert fd is None
    assert "nothing in it is removed for now" in _no_symlink_said(caplog, folder)
    link = tmp_path / "link"
    link.symlink_to(folder)
    caplog.clear()
    with orphans._opened(link) as fd:  # a real symlink keeps its words
        assert fd is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "is not a folder of the workspace (a symlink?)" in said[0], said


def test_process_records_name_a_descriptor_shortage_opening_their_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from test_claim_shortage_s22 import FailIn

    from handoffd.core import procrecords
    folder = procrecords.record_dir(tmp_path)
    folder.mkdir(parents=True)
    monkeypatch.setattr(procrecords, "open_beneath",
                        FailIn(procrecords.open_beneath, "records_folder", 1, _emfile))
    monkeypatch.setattr(procrecords, "_refusals_said", set())
    caplog.set_level(logging.INFO, "handoffd")
    with procrecords.records_folder(tmp_path) as fd:
        assert fd is None
    assert "no process record is read, written or removed there for now" in \
        _no_symlink_said(caplog, folder)


def test_cancel_requests_name_a_descriptor_shortage_opening_their_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from test_claim_shortage_s22 import FailIn
    from test_claim_shortage_s22 import _engine as files_engine

    from handoffd.backends.files import backend as files_backend
    engine = files_engine(tmp_path / "ws", Clock())
    store = engine.backend.inner
    store.request_cancel("x1", {"reason": "r"})
    monkeypatch.setattr(files_backend, "open_beneath",
                        FailIn(files_backend.open_beneath, "_open_cancel_folder", 1, _emfile))
    caplog.set_level(logging.INFO, "handoffd")
    assert store.cancel_requests() == {}
    _no_symlink_said(caplog, store._cancel_folder)
    assert list(store.cancel_requests()) == ["x1"]  # the shortage passed
    monkeypatch.setattr(files_backend, "open_beneath",
                        FailIn(files_backend.open_beneath, "request_cancel", 1, _emfile))
    with pytest.raises(OSError) as caught:
        store.request_cancel("x2", {"reason": "r"})
    assert caught.value.errno == errno.EMFILE and "symlink" not in str(caught.value)
    assert "ulimit -n" in str(caught.value)


def test_a_descriptor_shortage_reading_a_schema_is_no_configuration_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a ConfigError "schemas/ is not a plain folder of the workspace (a symlink?)",
    kept as the schema's refusal until a file of schemas/ changed: a valid schema refused."""
    import json

    from test_claim_shortage_s22 import FailIn

    from handoffd.core import validation
    folder = tmp_path / "schemas"
    folder.mkdir()
    (folder / "mine.schema.json").write_text(json.dumps({"type": "object"}))
    cache = validation.SchemaCache(folder)
    monkeypatch.setattr(validation, "open_folder",
                        FailIn(validation.open_folder, "_read", 1, _emfile))
    with pytest.raises(OSError) as caught:
        cache.validator("mine.schema.json")
    assert caught.value.errno == errno.EMFILE
    assert cache.validator("mine.schema.json") is not None  # the shortage passed


def test_a_store_away_scheduling_or_checking_progress_is_one_line(tmp_path: Path,
                                                                    caplog: Any) -> None:
    """R-RC (session 29): a StoreUnavailable (an OSError: the PostgreSQL store away) met by a
    gate while scheduling, or by the progress check looking for due work, was logged with a
    full traceback, as a bug is. It is one ERROR line, the handoff looked at again later."""
    from handoffd.core.errors import StoreUnavailable
    from handoffd.service import progress

    engine, backend = memory_engine(tmp_path, Clock(), {"@ok": ok})
    engine.submit(_request("g2"))
    raised: list[str] = []

    def gate(_engine: Any, _env: Any, _doc: Any) -> None:
        if not raised:
            raised.append("away")
            raise StoreUnavailable("the PostgreSQL store postgresql://db is unreachable: gone")
        return None

    engine.hooks.gates.append(gate)
    caplog.set_level(logging.INFO, "handoffd")
    daemon = Daemon(engine, workers=2, watch=False)
    daemon.run_batch()
    assert raised == ["away"]
    said = [r for r in caplog.records if "could not be scheduled" in r.getMessage()]
    assert len(said) == 1 and not said[0].exc_info, said
    assert "is unreachable" in said[0].getMessage()
    caplog.clear()
    check = progress.ProgressWatch.__new__(progress.ProgressWatch)
    check.shortages = progress.recurring.Recurring(quiet=progress.recurring.QUIET_SECONDS)
    check._failed(StoreUnavailable("the PostgreSQL store is unreachable: gone"), 1.0)
    lines = [r for r in caplog.records if "progress check" in r.getMessage()]
    assert len(lines) == 1 and not lines[0].exc_info and lines[0].levelno == logging.ERROR, lines
