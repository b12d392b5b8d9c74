"""The "could not be taken over" line of a batch's end is said once a batch (session 31, task F).

Note 30 listed it as possibly said once per process of a spread batch (``handoffd run
--processes N``). It cannot be: only a store with ``takeovers_left`` says it (PostgreSQL's),
and that store is not ``forkable``, so its batch runs on one process whatever ``--processes``
asks (``spread.processes_for`` warns and runs one). This guard fails if a store ever has both,
for then each forked process would say the line for the same handoff.
"""
from __future__ import annotations

from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.memory import MemoryBackend
from handoffd.backends.postgres.backend import PostgresBackend


def test_no_store_that_says_takeovers_left_is_spread_over_processes() -> None:
    sayers = [cls for cls in (FilesBackend, MemoryBackend, PostgresBackend)
              if callable(getattr(cls, "takeovers_left", None))]
    assert sayers == [PostgresBackend]  # (the line's one source today)
    assert not [cls for cls in sayers if getattr(cls, "forkable", False)], sayers
