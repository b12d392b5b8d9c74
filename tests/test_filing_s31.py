"""The filing of an answer does no work twice and none for nothing (session 31, helper B).

A no-op handler's completed answer cost about 165 Python calls from the handler's return to the
attempt forgotten. What went: pathlib on the filing's system calls (its paths are text, the
spares' pool keyed by text), ``contextlib`` around every filing (``refiling`` is a small class),
the retry policy of a success (never retried, no format writes its retry facts), the parse and
format again of the filing event's time (taken as its history entry wrote it), and a wake-up
built for nobody. Each test below fails on the code before; the guards next to them hold the
cases a shortcut could get wrong (a failure still retried by its policy, a time not written by
``iso`` still read, a Path and a text temp folder sharing one pool of spares)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import Clock
from test_refile import engine_with, submit

from handoffd.backends.base import Subscribers, refiled_copy, refiling
from handoffd.backends.files import spares
from handoffd.core import events as events_module
from handoffd.core.engine import Engine
from handoffd.core.events import ISO_TIME, RecordingBackend
from handoffd.core.states import FOLDER_NAMES, TERMINAL, State
from handoffd.core.timeutil import iso


def _python_calls(run: Callable[[], Any], skip: str | None = None) -> tuple[Any, list[str]]:
    """``run()``'s result and the Python functions it called (``file:name``), in order; those
    called beneath a function named ``skip`` are left out."""
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        caller = frame.f_back
        while skip is not None and caller is not None:
            if caller.f_code.co_name == skip:
                return
            caller = caller.f_back
        called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return result, called


def _ran(engine: Engine, hid: str) -> Any:
    """``hid`` claimed and run on ``engine`` (not filed yet): its job and its outcome."""
    job = engine.take(hid)
    assert job is not None
    return job, engine.run(job)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    built = engine_with(tmp_path, lambda handoff, ctx: {"status": "completed"})
    yield built
    built.backend.close()


def test_a_completed_filing_runs_no_pathlib_contextlib_nor_retry_policy(engine: Engine) -> None:
    """Before: 20-odd pathlib calls (a spare's name joined, each Path asked for its text at each
    system call), the generator of ``contextlib.contextmanager`` around the filing, and the
    retry policy read (and looked up in its cache) for an answer that is never retried."""
    for _ in range(3):  # (the first filings bind renameat2, switch the encoder, make spares)
        job, outcome = _ran(engine, submit(engine))
        with refiling(job.claim):
            assert engine.file(job.claim, job.dialect, job.specialist, outcome) is State.COMPLETED
    job, outcome = _ran(engine, submit(engine))

    def file() -> State:
        with refiling(job.claim):
            return engine.file(job.claim, job.dialect, job.specialist, outcome)

    # (the folder guard looks at every folder in the second after handoffs/ changed, as this
    # workspace just did: its own cost, not the filing's)
    where, called = _python_calls(file, skip="_look")
    assert where is State.COMPLETED
    assert not [c for c in called if c.endswith(("pathlib.py:__fspath__", "pathlib.py:__str__",
                                                 "pathlib.py:__truediv__", "pathlib.py:__hash__"))]
    assert not [c for c in called if "contextlib" in c]
    assert not [c for c in called if c.endswith((":retry_policy", ":from_dict", ":policy"))]
    assert not [c for c in called if c.endswith(":parse_iso")]  # (the event's time: as written)


def test_a_failed_answer_still_reads_its_documents_retry_policy(engine: Engine,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Guard: only a success skips the policy; a failure is retried as the document asks."""
    hid = submit(engine)
    doc = engine.backend.store.read(State.PENDING, hid)
    doc["retry_policy"] = {"max_retries": 1, "retry_delay_seconds": 0}
    engine.backend.store.path(State.PENDING, hid).write_text(json.dumps(doc))
    job, _ = _ran(engine, hid)
    failure = engine.failure(engine.clock(), "PROCESSING_ERROR", "boom", retryable=True)
    read: list[Any] = []
    real = engine.policy
    monkeypatch.setattr(engine, "policy", lambda d, s: read.append(d) or real(d, s))
    assert engine.file(job.claim, job.dialect, job.specialist, failure) is State.PENDING
    assert read, "a failure's filing must read the retry policy"
    job, _ = _ran(engine, hid)  # its one retry, failing again: filed failed, with its facts
    assert engine.file(job.claim, job.dialect, job.specialist, failure) is State.FAILED
    filed = engine.backend.store.read(State.FAILED, hid)
    assert (filed["retry_count"], filed["max_retries"]) == (1, 1), filed


def _recording() -> tuple[list[dict[str, Any]], RecordingBackend, Clock]:
    """The events a RecordingBackend (over no store, on a test clock) logs, it, and its clock."""
    logged: list[dict[str, Any]] = []

    class Log:
        def append(self, event: dict[str, Any]) -> None:
            logged.append(event)

    clock = Clock()
    backend = RecordingBackend(object(), Log(), lambda doc: None, clock)  # type: ignore[arg-type]
    return logged, backend, clock


def test_the_filing_event_takes_its_time_as_the_history_wrote_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the entry's time was parsed, then formatted again (with a clock whose time is not
    the entry's, the event below took the clock's once the parse is refused)."""
    logged, backend, _ = _recording()
    written = "2026-11-28T12:34:56.789Z"
    doc = {"handoffd": {"history": [{"at": written, "event": "completed",
                                     "detail": {"seconds": 0.5, "code": None}}]}}
    monkeypatch.setattr(events_module, "parse_iso", lambda text: (_ for _ in ()).throw(
        ValueError("not parsed again")))
    backend.emit_entry("h1", State.COMPLETED, doc)
    assert logged[-1]["at"] == written and logged[-1]["state"] == "completed"
    assert logged[-1]["seconds"] == 0.5 and "code" not in logged[-1]


@pytest.mark.parametrize("written, shown", [
    ("2026-11-28T14:34:56.789+02:00", "2026-11-28T12:34:56.789Z"),  # another offset: to UTC
    ("2026-11-28T12:34:56Z", "2026-11-28T12:34:56.000Z"),  # no milliseconds
    ("2026-02-30T12:00:00.000Z", None),  # no such day: not a time (the clock's)
    ("soon", None),
])
def test_an_entry_time_not_as_iso_writes_it_is_read_as_before(written: str,
                                                               shown: str | None) -> None:
    """Guard: only the exact form ``iso`` writes (a real date) is taken as it is."""
    logged, backend, clock = _recording()
    backend.emit_entry("h1", State.FAILED, {"handoffd": {"history": [
        {"at": written, "event": "failed"}]}})
    assert logged[-1]["at"] == (shown or iso(clock()))
    if written.endswith("Z") and shown == written:
        assert ISO_TIME.fullmatch(written)


def test_iso_times_are_all_taken_as_written() -> None:
    """Guard: every time ``iso`` writes is of the form taken as it is, and reads back the same."""
    from datetime import datetime, timedelta, timezone

    from handoffd.core.timeutil import parse_iso
    start = datetime(1, 1, 1, tzinfo=timezone.utc)
    for step in range(0, 3_155_000_000 * 100, 7_919_777_777):  # (years 1 to 9999, odd steps)
        text = iso(start + timedelta(seconds=step, microseconds=step % 999_999))
        assert ISO_TIME.fullmatch(text) and iso(parse_iso(text)) == text, text


def test_a_wakeup_is_built_only_for_someone_listening() -> None:
    """Before: each filing built a Wakeup for a store nobody subscribed to."""
    subscribers = Subscribers()
    _, called = _python_calls(lambda: subscribers.fire("h1", "completed"))
    assert not [c for c in called if c.endswith(":__init__")]
    heard: list[Any] = []
    subscribers.add(heard.append)
    subscribers.fire("h1", "completed")
    assert [(w.handoff_id, w.kind) for w in heard] == [("h1", "completed")]


def test_refiling_keeps_the_document_while_the_filing_runs_and_lets_go_after() -> None:
    """Guard of ``refiling`` as a class: registered at the start, dropped at the end (an
    exception included), and no Python generator machinery around it."""
    from handoffd.core.storage import Claim
    claim = Claim("h1", {"handoffd": {"history": [{"event": "claimed"}]}, "x": 1}, "tok-1", 1)
    err = OSError(28, "No space left on device")
    assert refiled_copy("tok-1", err) is None
    with pytest.raises(RuntimeError):
        with refiling(claim):
            claim.doc["handoffd"]["history"].append({"event": "completed"})
            saved = refiled_copy("tok-1", err)
            assert saved is not None and len(saved["handoffd"]["history"]) == 1
            raise RuntimeError("the filing failed")
    assert refiled_copy("tok-1", err) is None


def test_a_text_and_a_path_temp_folder_share_one_pool(tmp_path: Path) -> None:
    """The filing keeps its spares under the temp folder's text; a claim passes the Path.
    Before, the pool was keyed by what was passed: a spare retired under the text was never
    taken under the Path (an inode freed and another created at every handoff)."""
    spares.forget()
    try:
        folder = tmp_path / ".tmp"
        folder.mkdir()
        doc = tmp_path / "in-progress.json"
        doc.write_text("{}")
        inode = doc.stat().st_ino
        assert spares.retire(str(doc), str(folder))
        taken = spares.take(folder)
        assert taken is not None
        os.close(taken[1])
        assert os.stat(taken[0]).st_ino == inode
    finally:
        spares.release()
        spares.forget()


def test_the_state_lookups_agree_with_the_enum() -> None:
    """Guard of the lookups the filing uses instead of Enum's properties."""
    assert FOLDER_NAMES == {state: state.value for state in State}
    assert TERMINAL == {state for state in State if state.terminal}


def test_a_cancel_request_looked_up_under_a_name_no_file_can_have_is_none(
        engine: Engine) -> None:
    """Guard: the one lstat that replaced ``os.path.lexists`` answers as it did for a name
    with a NUL (ValueError there, False from lexists) or no folder at all."""
    assert engine.backend.cancel_request("h\x00x") is None
    assert engine.backend.cancel_request("nothing-here") is None
    engine.backend.request_cancel("h2", {"reason": "not needed"})
    assert engine.backend.cancel_request("h2") == {"reason": "not needed"}
