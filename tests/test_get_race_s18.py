"""A handoff moved back out of the aside folder while it is read is found (R12, session 18).

``handoff retry`` moves a failed handoff into ``.meta/aside/`` and from there into pending/. A
read that listed the folders while it was aside, then looked aside after it had left, raised
NotFound: `handoff show` exited 3 for a handoff that existed (4 of 214 shows in a retry loop), and
the dependency gate could fail a waiter "which does not exist". The read now looks in the folders
again before it says so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from handoffd.backends.files import FilesBackend, reading
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace


def test_a_handoff_back_from_aside_between_two_looks_is_read(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    backend = FilesBackend.open(ws, watch=False, durable=False)
    now = utc_now()
    backend.create(new_native_request(source="@t", target="@x", data={}, now=now, handoff_id="b"),
                   "b", now)
    real = reading.locate
    looks = []

    def locate(store: Any, handoff_id: str) -> list[State]:  # aside for the first two looks
        looks.append(handoff_id)
        return [] if len(looks) <= 2 else real(store, handoff_id)
    monkeypatch.setattr(reading, "locate", locate)
    monkeypatch.setattr(reading, "aside_copy", lambda store, handoff_id: None)  # gone from aside
    state, doc = backend.get("b")
    assert state is State.PENDING and doc["handoff_id"] == "b"


def test_a_handoff_in_no_folder_on_two_looks_is_not_found(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    backend = FilesBackend.open(ws, watch=False, durable=False)
    assert backend.get("nosuch") is None
