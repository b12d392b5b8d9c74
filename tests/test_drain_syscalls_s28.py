"""Fewer system calls a handoff (session 28), the same guarantees.

- a filed handoff without a cancel request is looked up once after its run, not twice;
- a workspace path is resolved from the workspace's root down, not from ``/``.
Counts only (system calls), never times.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from test_daemon_inprocess import engine_with, submit

from handoffd.core.workspace import Workspace
from handoffd.features import cancel_family


def stat_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.lstat`` is asked about from now on (``os.path.lexists`` asks it too)."""
    asked: list[str] = []
    real_lstat = os.lstat

    def lstat(path: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(path))
        return real_lstat(path, *args, **kwargs)
    monkeypatch.setattr(os, "lstat", lstat)
    return asked


def test_a_workspace_path_is_looked_up_below_the_root_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The root was resolved when the Workspace was made; its ancestors were each looked up
    again for every artifact destination (three to six calls a handoff)."""
    ws = Workspace(tmp_path / "deep" / "er" / "ws")
    (ws.root / "artifacts" / "shared").mkdir(parents=True)
    asked = stat_calls(monkeypatch)
    assert ws.inside("artifacts/shared/x.json") == ws.root / "artifacts/shared/x.json"
    assert asked == [str(ws.root / "artifacts"), str(ws.root / "artifacts/shared"),
                     str(ws.root / "artifacts/shared/x.json")]
    (ws.root / "artifacts" / "out").symlink_to(tmp_path)  # a link below the root: still refused
    assert ws.inside("artifacts/out/x.json") is None


def test_a_filed_handoff_without_a_cancel_request_is_looked_up_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """settle() read the request (none), then the drop looked for it again."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    folder = str(engine.ws.handoffs / ".meta" / "cancel")
    asked = stat_calls(monkeypatch)
    cancel_family.settle(engine, hid)
    assert [p for p in asked if p.startswith(folder)] == [os.path.join(folder, f"{hid}.json")]


def test_a_request_found_at_the_filing_is_still_dropped(tmp_path: Path) -> None:
    """The one look that finds a request still drops it (as before)."""
    engine = engine_with(tmp_path, lambda h, c: {"status": "completed"})
    hid = submit(engine)
    engine.backend.request_cancel(hid, {"handoff_id": hid, "reason": "stop", "cascade": False})
    assert engine.backend.cancel_request(hid) is not None
    cancel_family.settle(engine, hid)
    assert engine.backend.cancel_request(hid) is None
