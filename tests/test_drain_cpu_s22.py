"""The drain's CPU (session 22): what was made cheaper keeps its behaviour.

- a claim reads its document through the descriptor it locked (no second open), and by path
  only when it could take no lock;
- a drain with durability ``fsync`` starts another worker only once a task is SPIN_UP_SECONDS
  old, as ``fast`` does (tests/test_daemon_inprocess.py checks the books);
- ``iso``, ``Workspace.doc_path`` and ``RetryPolicy.from_dict`` give what they gave before.
"""
from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoffd.backends.files import fsio
from handoffd.backends.files import store as store_module
from handoffd.backends.files.store import Store
from handoffd.core.documents import book
from handoffd.core.errors import ConfigError, ErrorCode, InvalidDocument
from handoffd.core.settings import RetryPolicy
from handoffd.core.states import State
from handoffd.core.timeutil import iso
from handoffd.core.workspace import Workspace

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    made = Store(ws, durable=False)
    yield made
    made.close()


def produce(store: Store, hid: str, **extra: Any) -> dict[str, Any]:
    """A request written into pending/ as a foreign producer does."""
    doc = {"handoff_id": hid, "target": {"agent_id": "@x"}, "input": {"data": {"n": 1}}, **extra}
    store.path(State.PENDING, hid).write_text(json.dumps(doc))
    return doc


def reads_by_path(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths fsio.read_bytes_safely is asked to open from now on."""
    opened: list[Path] = []
    real = fsio.read_bytes_safely

    def recording(path: Path, max_bytes: int) -> Any:
        opened.append(Path(path))
        return real(path, max_bytes)
    monkeypatch.setattr(fsio, "read_bytes_safely", recording)
    return opened


def test_a_locked_claim_reads_through_its_lock_not_by_path_again(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the claim opened in-progress/<id>.json again after its rename (open, fstat,
    read, close), though it held the same file open under its lock."""
    doc = produce(store, "h1", priority="high")
    opened = reads_by_path(monkeypatch)
    claim = store.claim("h1", lease_seconds=30, now=NOW)
    assert claim is not None and store.owns(claim)
    assert opened == []
    assert {k: v for k, v in claim.doc.items() if k != "handoffd"} == doc
    stored = store.read(State.IN_PROGRESS, "h1")
    assert book(stored)["lease"]["token"] == claim.token and stored["priority"] == "high"


def test_a_claim_without_a_lock_reads_by_path_as_before(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that cannot be locked here (NFS's flock...) is read after the rename by path."""
    produce(store, "h2")
    monkeypatch.setattr(store_module, "lock_document", lambda path: None)
    opened = reads_by_path(monkeypatch)
    claim = store.claim("h2", lease_seconds=30, now=NOW)
    assert claim is not None and store.owns(claim)
    assert opened == [store.path(State.IN_PROGRESS, "h2")]


@pytest.mark.parametrize("content, code", [
    (b"", ErrorCode.EMPTY_DOCUMENT),
    (b"[1, 2]", ErrorCode.NOT_AN_OBJECT),
    (b'{"handoff_id": "h3", "n": NaN}', ErrorCode.MALFORMED_JSON),
    (b"\xff\xfe{}", ErrorCode.NOT_UTF8),
])
def test_a_bad_document_read_through_the_lock_is_refused_as_before(
        store: Store, content: bytes, code: str) -> None:
    path = store.path(State.PENDING, "h3")
    path.write_bytes(content)
    old = NOW.timestamp() - 3600  # not young: refused, not put back as still being written
    import os
    os.utime(path, (old, old))
    with pytest.raises(InvalidDocument) as raised:
        store.claim("h3", lease_seconds=30, now=NOW)
    assert raised.value.code == code


def test_a_document_over_the_limit_read_through_the_lock_is_refused(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    small = Store(ws, durable=False, max_document_bytes=64)
    try:
        path = small.path(State.PENDING, "h4")
        path.write_text(json.dumps({"handoff_id": "h4", "pad": "x" * (small.max_open_bytes + 10)}))
        with pytest.raises(InvalidDocument) as raised:
            small.claim("h4", lease_seconds=30, now=NOW)
        assert raised.value.code == ErrorCode.DOCUMENT_TOO_LARGE
    finally:
        small.close()


def _iso_by_hand(moment: datetime) -> str:
    """What iso() formatted by hand before."""
    m = moment.astimezone(timezone.utc)
    return (f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}"
            f".{m.microsecond // 1000:03d}Z")


def test_iso_is_what_it_was() -> None:
    rng = random.Random(22)
    for _ in range(20_000):
        moment = datetime(rng.randint(2, 9998), rng.randint(1, 12), rng.randint(1, 28),
                          rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59),
                          rng.choice([0, 999, 999_999, rng.randint(0, 999_999)]),
                          tzinfo=rng.choice([timezone.utc, timezone(timedelta(0)),
                                             timezone(timedelta(hours=rng.randint(-12, 14),
                                                                minutes=rng.choice([0, 30])))]))
        assert iso(moment) == _iso_by_hand(moment)
    assert iso(datetime(1, 1, 1, tzinfo=timezone.utc)) == "0001-01-01T00:00:00.000Z"
    for outside in (datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))),
                    datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))):
        with pytest.raises(OverflowError):  # (`--at` relies on it)
            iso(outside)


@pytest.mark.parametrize("hid", ["h-000001", "a.b_c-d", "job@1", "x:y+z", "é", "..a", "a..b"])
def test_doc_path_is_the_folder_joined_with_the_name(tmp_path: Path, hid: str) -> None:
    ws = Workspace(tmp_path / "ws")
    for state in State:
        path = ws.doc_path(state, hid)
        joined = ws.state_dir(state) / f"{hid}.json"
        assert path == joined and path.parts == joined.parts and str(path) == str(joined)
        assert path.name == f"{hid}.json" and path.parent == ws.state_dir(state)
        assert ws.doc_path(state, hid) is path  # (kept)


def test_retry_policies_read_as_before() -> None:
    assert RetryPolicy.from_dict({}) == RetryPolicy()
    assert RetryPolicy.from_dict({"retry_delay_seconds": 5, "max_retries": 1}) == RetryPolicy(
        max_retries=1, retry_delay_seconds=5.0)
    base = RetryPolicy(max_retries=7)
    assert RetryPolicy.from_dict({"backoff_multiplier": 3}, base) == RetryPolicy(
        max_retries=7, backoff_multiplier=3.0)
    for bad in ({"max_retries": True}, {"max_retries": 1.5}, {"retry_delay_seconds": -1},
                {"backoff_multiplier": 0.5}, [1]):
        with pytest.raises(ConfigError):
            RetryPolicy.from_dict(bad)  # type: ignore[arg-type]

    class Mine(RetryPolicy):
        pass
    made = Mine.from_dict({"max_retries": 2})
    assert type(made) is Mine and made.max_retries == 2
