"""``ls`` holds one running document at a time (R19, session 19).

Placing running handoffs by their claim (``reading.by_claim``) first kept the row of every
in-progress document, documents included, until the listing ended: 1,500 running documents
of 200 KB made `handoff ls --limit 5` take 313 MB (19 MB before). Only the claim times are kept.
"""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from handoffd.backends.files.backend import FilesBackend
from handoffd.core.states import State
from handoffd.core.workspace import Workspace

RUNNING = 120
PAD = 100_000  # characters of each running document


def test_a_short_listing_holds_one_running_document_at_a_time(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    folder = ws.state_dir(State.IN_PROGRESS)
    for i in range(RUNNING):  # (running documents someone else put there: read as rows)
        doc = {"handoff_id": f"r{i:03d}", "target": {"agent_id": "@x"}, "pad": "x" * PAD}
        (folder / f"r{i:03d}.json").write_text(json.dumps(doc))
    backend = FilesBackend.open(ws, durable=False, watch=False)
    tracemalloc.start()
    try:
        shown = backend.list(limit=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(shown) == 5 and {r.state for r in shown} == {State.IN_PROGRESS}
    # holding them all: about RUNNING x PAD = 12 MB at least; five shown and one read: < 2 MB
    assert peak < 3 * 1024 * 1024, f"peak {peak / 1e6:.1f} MB"
