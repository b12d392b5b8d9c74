"""The scheduler's books of waiting handoffs empty as the handoffs go (R12, session 18).

``Daemon.queue`` (a resume, a cancel poll) dropped a waiter from ``waiting`` but kept what may
end its wait (``waits_on``, ``fails_on``); a handoff cancelled while paused then left its entries
for good (132 of 300 after a pause, a cancel of all and a resume, growing each round). And a
queued id found gone when read was only unparked.
"""
from __future__ import annotations

import time

from test_dependencies_s16 import engine  # noqa: F401

from handoffd import Daemon, Engine


def test_queue_forgets_the_whole_wait(engine: Engine) -> None:
    daemon = Daemon(engine, workers=1, watch=False)
    books = daemon.scheduler
    books.hold("w", "waiting for dependency a (pending)", frozenset({"a"}), ("b",))
    daemon.queue("w")
    assert "w" not in books.waiting and "w" not in books.waits_on and "w" not in books.fails_on
    assert "w" in books.queued


def test_a_queued_id_found_gone_is_forgotten_whole(engine: Engine) -> None:
    books = Daemon(engine, workers=1, watch=False).scheduler
    books.hold("gone", "paused", frozenset(), ("x",))
    books.notify("gone")
    with books.cv:
        assert books.next_ready(time.monotonic() + 1) is None  # nothing stored under that id
    assert "gone" not in books.waits_on and "gone" not in books.fails_on
