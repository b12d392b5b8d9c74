"""Fewer Python calls a handoff on the peek and scheduling path (session 31, helper D), the
same answers.

Each test counts the Python functions a step calls (``sys.setprofile``: a count, never a
time) and checks, with the count, what the shortcut could get wrong:

- a cancel request is looked for with one ``lstat`` of a joined string (no posixpath join
  and lexists): one written after a first look, or in a folder made after it, is still seen;
- a handoff no gate ever held is let go (``Scheduler.unhold``) without the waiter's books
  being touched; a waiter woken by a filing still has them dropped when it is let go; the
  youngest running task is found without a generator; a worker takes the condition's own
  lock (``Scheduler.lock``), under which a notify still wakes a waiter;
- the native Envelope reads each field once (no comprehension for an empty ``depends_on``),
  with the same dependencies for every shape of ``depends_on`` and ``contract``;
- a routable document's event facts (``dialects.describe``) read the native links alone, and
  are the ones the native reader and the envelope gave before;
- the claimed line a worker logs at INFO still names the agent;
- format detection passes over a dialect none of whose ``match_keys`` the document has, and
  only then (any document: the same format as every dialect's matches() in turn said).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import dialect_examples
import pytest
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from test_daemon_inprocess import Serving, engine_with, submit

from handoffd import dialects
from handoffd.core.documents import BOOK
from handoffd.core.errors import InvalidDocument
from handoffd.core.native_format import native_envelope
from handoffd.core.storage import Meta, describe_native
from handoffd.dialects import describe, detect
from handoffd.service.report import BatchReport
from handoffd.service.scheduler import Scheduler


def python_calls(step: Callable[[], Any]) -> Counter[str]:
    """The Python functions ``step()`` calls (by name, with their file's base name), counted."""
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename != __file__:  # (not step itself)
            calls[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


# ---------------------------------------------------------------- cancel requests
def test_a_cancel_lookup_is_one_lstat_and_sees_a_request_written_after_it(
        tmp_path: Path) -> None:
    """posixpath's join and lexists were three Python calls a look, three looks a handoff."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    backend: Any = getattr(engine.backend, "inner", engine.backend)  # (the files store's own)
    hid = submit(engine)
    folder = engine.ws.handoffs / ".meta" / "cancel"
    if folder.exists():  # (made on demand: a first look before it exists is looked at too)
        folder.rmdir()
    assert backend.cancel_request(hid) is None
    calls = python_calls(lambda: backend.cancel_request(hid))
    assert not [name for name in calls if "posixpath" in name], calls
    assert sum(calls.values()) <= 2, calls  # cancel_request and its one look
    # the joined folder is kept; what is in it is looked at anew every time
    backend.request_cancel(hid, {"handoff_id": hid, "reason": "stop", "cascade": False})
    assert backend.cancel_request(hid) == {"handoff_id": hid, "reason": "stop",
                                           "cascade": False}
    backend.clear_cancel(hid)
    assert backend.cancel_request(hid) is None and not (folder / f"{hid}.json").exists()
    # a dangling link is a request there, as os.path.lexists said (read as none: no body)
    (folder / f"{hid}.json").symlink_to(tmp_path / "nowhere")
    assert backend._cancel_file_exists(f"{hid}.json")
    backend.clear_cancel(hid)
    assert not os.path.lexists(folder / f"{hid}.json")
    assert not backend._cancel_file_exists("a\0b.json")  # (lexists: False, never raised)


# ---------------------------------------------------------------- the scheduler's books
def scheduler() -> Scheduler:
    return Scheduler(None, BatchReport(), workers=1)  # type: ignore[arg-type]


def test_a_handoff_never_held_is_let_go_without_touching_the_waiters_books() -> None:
    books = scheduler()
    calls = python_calls(lambda: books.unhold("h1"))
    assert sum(calls.values()) == 1, calls  # unhold alone: no _forget_waiter


def test_a_waiter_woken_by_a_filing_is_still_forgotten_when_let_go() -> None:
    """A wake drops its wait but keeps when it was read and its full re-check's time (a
    rescan's tidying, or the dispatch that lets it go, drops those): the early return of
    ``unhold`` must not keep them."""
    books = scheduler()
    books.hold("w", "waits for d", frozenset({"d"}))
    books.quiet_stamps["w"] = ((b"", 0), 1)
    assert "w" in books.looked and "w" in books.full_due and books.waits_on["w"] == {"d"}
    books.wake("d")  # d filed: w is looked at first, its wait gone
    assert "w" not in books.waiting and "w" not in books.waits_on
    assert "w" not in books.quiet_stamps and "w" in books.looked and "w" in books.full_due
    books.unhold("w")  # its dispatch found it may go on
    assert "w" not in books.looked and "w" not in books.full_due
    # held with any filing ending it (on=None) and fails_on: all of it goes at once
    books.hold("v", "waits", None, fails_on=("x",))
    books.unhold("v")
    assert not (books.waiting or books.waits_on or books.fails_on or books.looked
                or books.full_due)


def test_the_youngest_task_is_found_without_a_generator() -> None:
    books = scheduler()
    assert books.spin_up_at() == -math.inf  # none running: another may start at once
    first, second = books.start("@a"), books.start("@b")
    started = [at for _, at in books.inflight.values()]
    assert books.spin_up_at() == max(started) + books.spin_up
    calls = python_calls(books.spin_up_at)
    assert sum(calls.values()) == 1, calls
    books.finished(second)
    assert books.spin_up_at() == started[0] + books.spin_up
    books.finished(first)


def test_a_worker_takes_the_conditions_own_lock() -> None:
    """``with lock`` where ``with cv`` was: the same lock, so a notify under it is allowed,
    and a thread waiting on ``cv`` is woken by it."""
    books = scheduler()
    assert sum(python_calls(lambda: books.lock.acquire() and books.lock.release()).values()) == 0
    woken = threading.Event()

    def waiter() -> None:
        with books.cv:
            ready.set()
            if books.cv.wait(timeout=10):
                woken.set()
    ready = threading.Event()
    thread = threading.Thread(target=waiter)
    thread.start()
    assert ready.wait(10)
    with books.lock:  # (the waiter released it in wait(): taken here once it waits)
        books.cv.notify_all()
    thread.join(10)
    assert woken.is_set()


# ---------------------------------------------------------------- the native Envelope
def request(**fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": "h1", "source": {"agent_id": "@a"},
                           "target": {"agent_id": "@b"}, "input": {"data": {"k": 1}}}
    doc.update(fields)
    return doc


@pytest.mark.parametrize(("depends", "contract", "expected"), [
    (None, None, []),
    ([], None, []),
    ("h0", None, []),
    (["a", 1, "b", "a"], None, ["a", "b", "a"]),
    ([], {"dependencies_completed": ["c", 2, "c"]}, ["c", "c"]),
    (["a"], {"dependencies_completed": ["a", "c"]}, ["a", "c"]),
    (["a"], {"dependencies_completed": "c"}, ["a"]),
    (["a"], ["not", "a", "dict"], ["a"]),
])
def test_the_native_envelope_reads_dependencies_as_before(
        depends: Any, contract: Any, expected: list[str]) -> None:
    fields: dict[str, Any] = {}
    if depends is not None:
        fields["depends_on"] = depends
    if contract is not None:
        fields["contract"] = contract
    env = native_envelope(request(**fields))
    assert env.depends_on == expected
    assert env.contract == (contract if isinstance(contract, dict) else None)
    assert env.depends_on is not depends  # (a list of its own, always)


def test_the_native_envelope_keeps_the_documents_own_objects() -> None:
    """A handler may change its data in place: what it changes is the claimed document's."""
    doc = request(retry_policy={"max_retries": 1}, contract={"holder": "x"},
                  expected_output={"schema": "s.json"}, correlation_id=3,
                  conversation_id="c1")
    doc["input"]["schema"] = "in.json"
    env = native_envelope(doc)
    assert env.data is doc["input"]["data"] and env.retry_policy is doc["retry_policy"]
    assert env.contract is doc["contract"]
    assert (env.input_schema, env.output_schema, env.correlation_id, env.conversation_id) \
        == ("in.json", "s.json", None, "c1")
    calls = python_calls(lambda: native_envelope(request()))
    assert not [name for name in calls if "listcomp" in name], calls


# ---------------------------------------------------------------- event facts
def old_describe(doc: dict[str, Any]) -> Meta:
    """dialects.describe as it was (the native reader's Meta read in full first)."""
    native = describe_native(doc)
    try:
        env = detect(doc).envelope(doc)
    except Exception:
        return Meta(None, native.priority, native.conversation, native.parent)
    return Meta(env.target, env.priority, env.conversation_id or native.conversation,
                native.parent)


@pytest.mark.parametrize("doc", [
    request(),
    request(priority="high", conversation_id="c1", parent_id="p1"),
    request(conversation_id=5, parent_id="", **{BOOK: {"parent_id": "p2",
                                                       "conversation_id": "c2"}}),
    request(**{BOOK: {"request_snapshot": {"parent_id": "p3", "conversation_id": "c3"}}}),
    request(timeout_seconds=-1, parent_id="p4"),
    request(timeout_seconds=10 ** 9, parent_id="p5", priority="low"),
    {"handoff_id": "h1", "target": "not an object", "parent_id": "p6"},
    {"nothing": "routable", "conversation_id": "c7"},
])
def test_the_event_facts_are_those_of_the_native_reader_and_the_envelope(
        doc: dict[str, Any]) -> None:
    assert describe(doc) == old_describe(doc)


def test_a_routable_documents_event_facts_skip_the_native_readers_target() -> None:
    calls = python_calls(lambda: describe(request(parent_id="p1")))
    assert "storage.py:describe_native" not in calls, calls


# ---------------------------------------------------------------- the claimed line
def test_the_claimed_line_still_names_the_agent_at_info(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The worker builds the line only when INFO is on (its arguments cost more than the
    check); when it is, it says what it said."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    caplog.set_level(logging.INFO, logger="handoffd")
    words = f"{hid} -> in-progress (attempt 1, @t)"

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == words]
    with Serving(engine):
        wait_until(lambda: bool(said()), what="the claimed line")
    line = said()[0]
    assert (getattr(line, "agent", None), getattr(line, "event", None)) == ("@t", "claimed")


# ---------------------------------------------------------------- format detection
def full_detect(doc: dict[str, Any]) -> str | None:
    """What detection said before ``match_keys``: every dialect's matches(), in order."""
    return next((d.name for d in dialects.DIALECTS if d.matches(doc)), None)


# every key a built-in dialect's matches() reads, and a few it does not
KEYS = ["$schema", "payload", "executed_by", "from_agent", "to_agent", "contract", "task_id",
        "files_touched", "escalation", "handoff_id", "target", "version", "source_tier",
        "target_tier", "status", "id", "source", "input"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(
    ["x", "hi_moe", "haios", "agent-handoff", "swarm", "success", "blocked", "pending"]),
    st.fixed_dictionaries({}, optional={"task_id": st.just("t"), "directive": st.just("d"),
                                        "agent_id": st.just("@a"), "escalation": st.just(1)}))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8))
def test_detection_passes_over_a_dialect_only_when_it_could_not_match(doc: dict[str, Any]) -> None:
    for dialect in dialects.DIALECTS:
        keys = getattr(dialect, "match_keys", None)
        if keys is not None and keys.isdisjoint(doc):
            assert not dialect.matches(doc), (dialect.name, doc)
    try:
        found: str | None = detect(doc).name
    except InvalidDocument:
        found = None
    assert found == full_detect(doc)


def test_every_example_is_detected_as_before() -> None:
    examples = [*examples_of(dialect_examples.HI_MOE), *examples_of(dialect_examples.AGENT),
                *examples_of(dialect_examples.HAIOS), *examples_of(dialect_examples.SWARM),
                request(), request(contract={"task_id": "t"})]
    for doc in examples:
        assert detect(doc).name == full_detect(doc)


def examples_of(group: dict[str, Any]) -> list[dict[str, Any]]:
    return [dialect_examples.fresh(doc) for doc in group.values() if isinstance(doc, dict)]


def test_a_native_request_is_detected_with_one_matches_call() -> None:
    calls = python_calls(lambda: detect(request()))
    assert [name for name in calls if name.endswith(":matches")] == ["native.py:matches"], calls


def test_a_plugins_subclass_of_a_built_in_is_asked_whatever_its_parents_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin dialect that subclasses a built-in and matches on other keys is asked: only a
    class's own ``match_keys`` pass a document over (a subclass inherited native's and its
    documents were refused UNKNOWN_FORMAT: RD); keys that are no frozenset are not used (a
    plugin's list made every detection raise)."""
    from handoffd.dialects.native import NativeDialect

    class JobDialect(NativeDialect):
        name = "jobplug"

        def matches(self, doc: dict[str, Any]) -> bool:
            return "job_id" in doc and isinstance(doc.get("target"), dict)

    class ListKeys(NativeDialect):
        name = "listkeys"
        match_keys = ["nothing-here"]  # type: ignore[assignment]

        def matches(self, doc: dict[str, Any]) -> bool:
            return False

    monkeypatch.setattr(dialects, "DIALECTS", [ListKeys(), *dialects.DIALECTS, JobDialect()])
    assert detect({"job_id": "a", "target": {"agent_id": "@x"}}).name == "jobplug"
    assert detect({"handoff_id": "n", "target": {"agent_id": "@x"}}).name == "native"
