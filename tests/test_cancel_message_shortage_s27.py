"""A seed 000 cancellation message whose seen-ids lookup runs short (session 27).

The daemon carries a cancellation message out itself (``features.cancellation.handle_message``)
and searches, then records, a foreign message's id in the seen-ids record as admission does.
A descriptor or memory shortage there reached the worker's catch-all: a logged traceback, the
claim left leased in in-progress/, and its recovery charged an attempt. It is now handed back
uncounted with one warning line, and carried out at its next claim, as a request is.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import Workspace, exe, new_workspace
from test_cancel_message_recovery_s26 import _cancellation, _victim
from test_seen_shortage_s24 import SITE

# the seen-ids record's first search (or add) fails once: EMFILE as in SITE, or a MemoryError
MEMORY_SITE = SITE.replace("raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))",
                           "raise MemoryError()")


def _batch_with(tmp_path: Path, site: str, **env: str) -> tuple[Workspace, str]:
    """A victim and a cancellation message of it, one `handoffd run` with ``site`` as its
    sitecustomize (the fault); (the workspace, what the batch said). No traceback, ever."""
    ws = new_workspace(tmp_path / "ws", """
[daemon]
settle_seconds = 0.1
sweep_seconds = 0.5
rescan_seconds = 0.5
""")
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(site)
    ws.drop("victim-1.json", _victim("victim-1"))
    ws.drop("msg-s1.json", _cancellation("msg-s1", "victim-1"))
    batch = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(folder), **env})
    assert "Traceback" not in batch.stderr, batch.stderr
    return ws, batch.stderr



@pytest.mark.parametrize("fault,site", [("contains:before", SITE), ("add:after", SITE),
                                        ("contains:before", MEMORY_SITE)],
                         ids=["emfile-search", "emfile-half-add", "memory-search"])
def test_a_cancellation_message_short_at_its_id_lookup_is_handed_back_and_carried_out(
        tmp_path: Path, fault: str, site: str) -> None:
    ws, said = _batch_with(tmp_path, site, SEEN_FAULT=fault)
    try:
        assert ws.state_of("msg-s1") == ["completed"], said
        assert ws.state_of("victim-1") == ["failed"], said  # cancelled, once
        events = [e["event"] for e in ws.doc("msg-s1")["handoffd"]["history"]]
        assert events == ["claimed", "handed_back", "claimed", "completed"], said
        assert ws.doc("msg-s1")["handoffd"]["attempt"] == 1, said  # the hand-back uncounted
        assert "could not be handled" not in said, said
    finally:
        ws.cleanup()


# the seen-ids search fails once (EMFILE), then the hand-back's write to pending/ fails once
# too, before anything is written (as the store's own write does: keep() first) (R51)
DOUBLE_SITE = """
import errno, os
from handoffd.backends.files import seen
from handoffd.backends.files import store as st
real_contains, left = seen.SeenIds.contains, {"c": 1, "r": 1}
Store = next(c for c in vars(st).values() if isinstance(c, type) and hasattr(c, "_move_ours"))
real_move = Store._move_ours
def contains(self, *a, **k):
    if left["c"]:
        left["c"] = 0
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    return real_contains(self, *a, **k)
def move(self, handoff_id, src, dst, data, keep):
    if left["r"] and not left["c"] and dst.value == "pending":
        left["r"] = 0
        exc = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        keep(exc)
        raise exc
    return real_move(self, handoff_id, src, dst, data, keep)
seen.SeenIds.contains = contains
Store._move_ours = move
"""


def test_a_cancellation_message_whose_hand_back_runs_short_too_is_kept_and_handed_back(
        tmp_path: Path) -> None:
    """R51: the message's own hand-back write ran short as well: it was written outside the
    daemon's kept claims, a traceback, the message stranded in in-progress/ and charged an
    attempt at its recovery. The claim is now kept, uncounted, and handed back after the
    back-off, as a request's is."""
    ws, said = _batch_with(tmp_path, DOUBLE_SITE)
    try:
        assert "its claim is kept, uncounted" in said, said
        assert ws.state_of("msg-s1") == ["completed"], said
        assert ws.state_of("victim-1") == ["failed"], said
        assert ws.doc("msg-s1")["handoffd"]["attempt"] == 1, said
    finally:
        ws.cleanup()
