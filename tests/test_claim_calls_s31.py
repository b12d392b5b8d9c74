"""The claim's cost (session 31, helper A): what was made cheaper keeps its behaviour.

- a claim, its look for other copies and its filing's retirement of the in-progress copy hand
  ``os`` str paths (``Workspace.doc_file``): no pathlib Path is built for pending/,
  in-progress/ or failed/ (each was a pathlib join, then a conversion back at every system
  call); the str is the Path's text, and a spare named by a str is taken again as any other;
- a raw document's trusted revision is 0 without a seal check;
- an event's time is a history entry's own text when that is in ``iso``'s form (no parse and
  format back), and a queue wait reads such a time without ``parse_iso``: a text of that
  shape that is no date is still refused (the event's time is now, the wait unknown);
- ``workspace.unlinked`` refuses empty, ``.`` and ``..`` components without a generator.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoffd.backends.files import spares
from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.files.store import Store
from handoffd.core.documents import BOOK, book
from handoffd.core.events import RecordingBackend, queue_wait
from handoffd.core.states import State
from handoffd.core.storage import describe_native
from handoffd.core.timeutil import iso
from handoffd.core.workspace import Workspace, unlinked

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[FilesBackend]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    made = FilesBackend(Store(ws, durable=False), watch=False)
    yield made
    made.store.close()


def produce(ws: Workspace, hid: str) -> dict[str, Any]:
    """A request written into pending/ as a foreign producer does."""
    doc = {"handoff_id": hid, "target": {"agent_id": "@x"}, "input": {"data": {"n": 1}}}
    ws.doc_path(State.PENDING, hid).write_text(json.dumps(doc))
    return doc


def test_a_claim_and_its_filing_build_no_path_but_the_answers(
        backend: FilesBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the claim built pending/ and in-progress/ Paths, its look for other copies
    completed/ and failed/ ones, and the filing retired the in-progress copy by its Path."""
    ws = backend.store.ws
    doc = produce(ws, "h1")
    built: list[State] = []
    real = Workspace.doc_path

    def recording(self: Workspace, state: State, handoff_id: str) -> Path:
        built.append(state)
        return real(self, state, handoff_id)
    monkeypatch.setattr(Workspace, "doc_path", recording)
    claim = backend.claim("h1", NOW, 30.0)
    assert claim is not None and claim.raw
    assert built == []
    assert backend.finish(claim, State.COMPLETED, dict(claim.doc, status="completed"))
    assert built == []  # (the answer's too: its filing names it as text, helper B)
    monkeypatch.setattr(Workspace, "doc_path", real)
    assert backend.store.locate("h1") == [State.COMPLETED]
    filed = json.loads(ws.doc_path(State.COMPLETED, "h1").read_text())
    assert filed["input"] == doc["input"] and filed["status"] == "completed"


def test_a_doc_file_is_its_paths_text(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "a b" / "ws")
    for state in State:
        assert ws.doc_file(state, "job.1") == str(ws.doc_path(state, "job.1"))


def test_a_spare_named_by_a_str_is_written_again(backend: FilesBackend) -> None:
    """The in-progress copy a filing retires is kept under a str name; the next temp file is
    that inode, rewritten (and a claim's lease write then keeps the producer's)."""
    store = backend.store
    for hid in ("s1", "s2"):
        produce(store.ws, hid)
        claim = backend.claim(hid, NOW, 30.0)
        assert claim is not None
        assert backend.finish(claim, State.COMPLETED, dict(claim.doc, status="completed"))
    pool = spares._pools.get(os.fspath(store.tmp), [])
    assert pool and all(os.path.dirname(spare) == str(store.tmp) for spare in pool)
    kept = {os.stat(spare).st_ino for spare in pool}
    produce(store.ws, "s3")
    claim = backend.claim("s3", NOW, 30.0)
    assert claim is not None
    assert os.stat(store.file(State.IN_PROGRESS, "s3")).st_ino in kept  # a spare, rewritten
    assert json.loads(Path(store.file(State.IN_PROGRESS, "s3")).read_text())["handoff_id"] == "s3"


def test_another_copy_is_still_found(backend: FilesBackend) -> None:
    """The look for other copies by str path: a raw document reusing a filed id is set aside."""
    ws = backend.store.ws
    produce(ws, "d1")
    first = backend.claim("d1", NOW, 30.0)
    assert first is not None
    assert backend.finish(first, State.COMPLETED, dict(first.doc, status="completed"))
    produce(ws, "d1")
    assert backend.claim("d1", NOW, 30.0) is None
    assert backend.store.locate("d1") == [State.COMPLETED]
    assert [r.get("code") for r in backend.quarantined()] == ["DUPLICATE_HANDOFF_ID"]


def test_a_raw_documents_revision_is_untrusted(backend: FilesBackend) -> None:
    store = backend.store
    sealed: dict[str, Any] = {"handoff_id": "r1", BOOK: {"revision": 3}}
    store.encode(sealed, State.PENDING, "r1")  # (a valid seal for revision 3)
    assert store.trusted_revision(sealed, State.PENDING, "r1") == 3
    assert store.trusted_revision(sealed, State.IN_PROGRESS, "r1") == 0
    assert store.trusted_revision(sealed, State.IN_PROGRESS, "r1", State.PENDING) == 3
    for revision in (0, None, "3"):
        raw = {"handoff_id": "r1", BOOK: dict(book(sealed), revision=revision)}
        assert store.trusted_revision(raw, State.PENDING, "r1") == 0


class _Log:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append(self, event: dict[str, Any]) -> None:
        self.events.append(event)


def _recorder() -> tuple[RecordingBackend, _Log]:
    log = _Log()
    return RecordingBackend(object(), log, describe_native, lambda: NOW), log  # type: ignore[arg-type]


@pytest.mark.parametrize("at, logged", [
    ("2029-05-06T07:08:09.123Z", "2029-05-06T07:08:09.123Z"),  # our form: as it stands
    ("2029-05-06T09:08:09.123+02:00", "2029-05-06T07:08:09.123Z"),  # parsed, in UTC
    ("2029-05-06T07:08:09Z", "2029-05-06T07:08:09.000Z"),
    ("2029-13-06T07:08:09.123Z", iso(NOW)),  # our shape, no date: now, as before
    ("2029-02-30T07:08:09.123Z", iso(NOW)),
    ("2029-05-06T25:08:09.123Z", iso(NOW)),
    ("yesterday", iso(NOW)),
    (None, iso(NOW)),
    (12, iso(NOW)),
])
def test_an_events_time_is_its_entrys(at: Any, logged: str) -> None:
    recorder, log = _recorder()
    doc = {BOOK: {"history": [{"event": "completed", "at": at, "detail": {"seconds": 1.5}}]}}
    recorder.emit_entry("e1", State.COMPLETED, doc)
    assert [(e["at"], e["event"], e["state"], e.get("seconds")) for e in log.events] == \
        [(logged, "completed", "completed", 1.5)]


@pytest.mark.parametrize("at, wait, later", [
    ("2029-12-31T23:59:58.500Z", 1.5, 11.5),
    ("2029-12-31T23:59:58.5Z", 1.5, 11.5),
    ("2030-01-01T01:59:58.500+02:00", 1.5, 11.5),
    ("2030-01-01T00:00:05.000Z", 0.0, 5.0),  # (never negative)
    ("2029-12-32T23:59:58.500Z", None, None),  # our shape, no date: unknown, as before
    ("2029-12-31T23:60:58.500Z", None, None),
    (None, None, None),
])
def test_a_queue_wait_reads_the_entry_before_the_claim(at: Any, wait: float | None,
                                                       later: float | None) -> None:
    doc = {BOOK: {"history": [{"event": "created", "at": at},
                              {"event": "claimed", "at": iso(NOW)}]}}
    assert queue_wait(doc, NOW) == wait
    assert queue_wait(doc, NOW + timedelta(seconds=10)) == later


@pytest.mark.parametrize("path, expected", [
    ("/a/b/c.json", "/a/b/c.json"),
    ("/", None),  # (as before: its one component is empty)
    ("/a//b", None),
    ("/a/./b", None),
    ("/a/../b", None),
    ("/a/b/", None),
    ("a/b", None),
    ("/a/.b/..c", "/a/.b/..c"),
])
def test_unlinked_refuses_what_needs_realpath(path: str, expected: str | None) -> None:
    assert unlinked(path) == expected
