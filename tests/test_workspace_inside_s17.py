"""Workspace.inside's quick path (session 17): a path with no symlink, ``.``, ``..`` or empty
component is its own real path, found with one ``lstat`` per component instead of
:func:`os.path.realpath`. It must answer exactly as realpath does, for every path."""
from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from handoffd.core.workspace import Workspace, unlinked

NAMES = ["a", "b", "file", "missing", "up", "loop", "abs", ".", "..", ""]


def tree(root: Path) -> Path:
    """A workspace with folders, a file, and links inside, up, to elsewhere and in a loop."""
    ws = root / "ws"
    (ws / "a" / "b").mkdir(parents=True)
    (ws / "a" / "file").write_text("x")
    (root / "elsewhere").mkdir()
    (ws / "a" / "up").symlink_to("..")
    (ws / "a" / "abs").symlink_to(root / "elsewhere")
    (ws / "b").symlink_to("a/b")
    (ws / "loop").symlink_to("loop")
    return ws


def test_every_path_resolves_as_realpath_resolves_it(tmp_path: Path) -> None:
    ws = tree(tmp_path)
    workspace = Workspace(ws)

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.sampled_from(NAMES), min_size=0, max_size=6))
    def check(parts: list[str]) -> None:
        text = "/".join(parts)
        joined = os.path.join(str(ws), text)
        assert (unlinked(joined) or os.path.realpath(joined)) == os.path.realpath(joined)
        real = os.path.realpath(joined)
        inside = real == str(ws) or real.startswith(str(ws) + os.sep)
        assert workspace.inside(text) == (Path(real) if inside else None)

    check()


def test_a_plain_path_needs_no_realpath_and_a_link_does(tmp_path: Path) -> None:
    ws = tree(tmp_path)
    plain = f"{ws}/a/b/new/deeper.json"
    assert unlinked(plain) == plain  # missing from "new" on: kept as written
    assert unlinked(f"{ws}/a/abs/x") is None  # a link: realpath decides
    assert unlinked(f"{ws}/a/../a") is None and unlinked(f"{ws}//a") is None
    assert Workspace(ws).inside("a/abs/x") is None  # it leads elsewhere
    assert Workspace(ws).inside("a/up/a/file") == ws / "a" / "file"
    assert Workspace(ws).inside("bad\0name") is None
