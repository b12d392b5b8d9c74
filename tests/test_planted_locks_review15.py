"""A folder or a link planted at the name of one of handoffd's own lock files in
``handoffs/.meta`` stops nothing:

- ``seen-ids.jsonl.lock``: every ``handoff create`` (and every claim, which records the id)
  failed with "Is a directory" after the document was written (so a script submitted it again),
  and every sweep's compaction failed;
- ``.events.lock``: the event log never rotated, and grew without bound.

The entry is quarantined (one line), as one planted at a lock name in ``handoffs/.locks`` is. And
a create whose document is written never exits 1 for the record kept beside it."""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Workspace, new_workspace

CONFIG = """
[daemon]
durability = "fast"
events_max_bytes = 4096
events_keep = 2
"""


@pytest.fixture
def lws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def meta(ws: Workspace) -> Path:
    return ws.root / "handoffs" / ".meta"


def quarantined(ws: Workspace) -> list[str]:
    folder = ws.root / "handoffs" / ".quarantine"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("plant", ["folder", "symlink"])
def test_an_entry_at_the_seen_ids_lock_is_set_aside_and_creates_go_on(
        lws: Workspace, tmp_path: Path, plant: str) -> None:
    lock = meta(lws) / "seen-ids.jsonl.lock"
    lock.unlink(missing_ok=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("not handoffd's")
    if plant == "folder":
        lock.mkdir()
    else:
        lock.symlink_to(outside)
    made = lws.handoff("create", "--to", "@x", "--id", "c1")
    assert made.returncode == 0 and made.stdout.strip() == "c1", made.stderr
    assert "NOT_A_REGULAR_FILE" in made.stderr and made.stderr.count("\n") == 1, made.stderr
    assert lock.is_file() and not lock.is_symlink()
    assert any(name.endswith("seen-ids.jsonl.lock") for name in quarantined(lws))
    assert outside.read_text() == "not handoffd's"
    again = lws.handoff("create", "--to", "@x", "--id", "c1")  # the id is recorded: taken
    assert again.returncode != 0 and "already exists" in again.stderr
    swept = lws.handoffd("sweep")
    assert swept.returncode == 0 and "failed" not in swept.stderr, swept.stderr


def test_a_folder_at_the_sweeps_compaction_lock_is_set_aside(lws: Workspace) -> None:
    """The sweep's compaction opens the lock by itself: it sets the entry aside too."""
    record = meta(lws) / "seen-ids.jsonl"
    record.write_text('{"id": "old", "at": "2000-01-01T00:00:00.000Z"}\n')  # due a compaction
    lock = meta(lws) / "seen-ids.jsonl.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    swept = lws.handoffd("sweep")
    assert swept.returncode == 0 and "compacting" not in swept.stderr, swept.stderr
    assert lock.is_file() and '"old"' not in record.read_text()


def test_a_folder_at_the_event_logs_lock_is_set_aside_and_the_log_rotates(
        lws: Workspace) -> None:
    lock = meta(lws) / ".events.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    log = meta(lws) / "events.jsonl"
    log.write_text('{"at": "2026-01-01T00:00:00.000Z", "event": "x", "state": "pending"}\n' * 80)
    for i in range(2):  # past the 4,096-byte bound: the next append rotates
        assert lws.handoff("create", "--to", "@x", "--id", f"e{i}").returncode == 0
    assert (meta(lws) / "events.jsonl.1").exists() and log.stat().st_size < 4096
    assert lock.is_file() and any(n.endswith(".events.lock") for n in quarantined(lws))


def test_a_create_whose_document_is_written_never_fails_for_the_seen_ids_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Any error of the record kept beside the document (after it was written) is a warning:
    an exit 1 there made a script submit the same request again."""
    from handoffd.backends.files.seen import SeenIds
    from handoffd.backends.files.store import Store
    from handoffd.core.native_format import new_native_request
    from handoffd.core.timeutil import utc_now
    from handoffd.core.workspace import Workspace as HandoffdWorkspace

    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    store = Store(ws, durable=False)

    def broken(self: SeenIds, handoff_id: str, now: object) -> None:
        raise PermissionError(13, "Permission denied", os.fspath(self.lock_path))

    monkeypatch.setattr(SeenIds, "add", broken)
    doc = new_native_request(source="@t", target="@x", data={}, now=utc_now(), handoff_id="w1")
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        assert store.create(doc, "w1") == "w1"
    assert (ws.root / "handoffs" / "pending" / "w1.json").exists()
    assert any("created, but the seen-ids record" in r.getMessage() for r in caplog.records)


def test_a_folder_at_a_context_lock_is_set_aside_and_the_write_keeps_its_history(
        lws: Workspace) -> None:
    """`context/.meta/history.lock` as a folder failed every write, said as a clash with another
    key's file, after the value and its revision were written: a value with no history."""
    assert lws.handoff("context", "set", "proj/a", '"1"').returncode == 0
    lock = lws.root / "context" / ".meta" / "history.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    wrote = lws.handoff("context", "set", "proj/a", '"2"')
    assert wrote.returncode == 0 and "revision 2" in wrote.stdout, wrote.stdout + wrote.stderr
    history = lws.handoff("context", "history", "proj/a", "--json")
    assert history.returncode == 0 and history.stdout.count('"revision"') == 2, history.stdout
    assert lock.is_file() and any(n.endswith("history.lock") for n in quarantined(lws))


def test_a_folder_at_the_removal_lock_is_set_aside_and_purge_goes_on(lws: Workspace) -> None:
    lock = meta(lws) / "retention.lock"
    lock.mkdir()
    purged = lws.handoff("purge", "--older-than", "1d")
    assert purged.returncode == 0, purged.stderr
    assert lock.is_file() and any(n.endswith("retention.lock") for n in quarantined(lws))
