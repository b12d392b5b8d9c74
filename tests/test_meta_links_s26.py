"""No record goes through ``handoffs/.meta`` swapped for a symlink (session 26, after R47).

The folders of the process records (``.meta/procs``) and of the cancel requests
(``.meta/cancel``) were opened with ``O_NOFOLLOW`` on their last part only, and made with
``mkdir(parents=True)``, which follows a symlinked parent: a ``.meta`` swapped for a link to a
folder outside the workspace took the records (and their removals) there. Each part is now
opened (and made) relative to the one before without following a link
(:func:`handoffd.core.ownfiles.open_beneath`): nothing is written outside, and the caller says
the folder is refused, as for a symlinked last part.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.files.store import Store
from handoffd.core import procrecords
from handoffd.core.workspace import Workspace


def _swapped(tmp_path: Path) -> tuple[Workspace, Path]:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    outside = tmp_path / "outside"
    outside.mkdir()
    ws.meta.rename(tmp_path / "meta-aside")
    ws.meta.symlink_to(outside)
    return ws, outside


def test_process_records_are_never_made_through_a_symlinked_meta(tmp_path: Path) -> None:
    ws, outside = _swapped(tmp_path)
    with procrecords.records_folder(ws.root, create=True) as fd:
        assert fd is None  # refused (one line), nothing opened through the link
    with procrecords.records_folder(ws.root) as fd:
        assert fd is None
    assert list(outside.iterdir()) == []  # no procs/ made outside


def test_a_cancel_request_is_never_written_through_a_symlinked_meta(tmp_path: Path) -> None:
    ws, outside = _swapped(tmp_path)
    backend = FilesBackend(Store(ws, durable=False), watch=False)
    with pytest.raises(OSError) as refused:
        backend.request_cancel("h-1", {"reason": "test"})
    assert "not a folder of the workspace" in str(refused.value)
    assert list(outside.iterdir()) == []  # no cancel/ made outside, no request written
    (outside / "cancel").mkdir()  # one there already: never read through the link either
    (outside / "cancel" / "h-2.json").write_text('{"reason": "planted"}')
    assert backend.cancel_requests() == {}
    assert (outside / "cancel" / "h-2.json").exists()
