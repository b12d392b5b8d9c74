"""``Handle.look`` on a files store: a file still being written into pending/ stands pending
(session 20). It is what MCP's ``wait_handoff`` answers at its timeout: on a files store it
answered MALFORMED_JSON (the half-written copy's read error) where the wait itself went on, as
``handoff wait`` does; an unreadable copy where nothing will ever mend it is still its error."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from handoffd import Client, State
from handoffd.core.errors import InvalidDocument, WaitTimeout


def test_a_half_written_pending_file_stands_pending(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    client = Client(tmp_path / "ws")
    pending = tmp_path / "ws" / "handoffs" / "pending"
    (pending / "half.json").write_text('{"handoff_id": "ha')
    handle = client.handle("half")
    with pytest.raises(InvalidDocument):
        handle.result()  # (where it stands as read: the copy's read error)
    looked = handle.look()
    assert (looked.state, looked.document) == (State.PENDING, {})
    with pytest.raises(WaitTimeout):
        handle.wait(0.2)  # the wait goes on, as it always did


def test_a_truncated_filed_copy_is_still_its_error(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    client = Client(tmp_path / "ws")
    completed = tmp_path / "ws" / "handoffs" / "completed"
    (completed / "cut.json").write_text('{"handoff_id": "cu')
    os.utime(completed / "cut.json", (0, 0))  # (long settled: nothing will mend it)
    with pytest.raises(InvalidDocument):
        client.handle("cut").look()
