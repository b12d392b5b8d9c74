"""Session 20 (F2): the PostgreSQL store's stamps, and waits on a file still being written.

1. ``Backend.stamp_of`` / ``live_stamps`` returned None on PostgreSQL, so a serving daemon's rescan
   read and gated every dependency waiter again at every rescan (5,000 waiters of one unfinished
   handoff: 25 s of the daemon's CPU a minute, idle), and retention's live references and the
   children gate read documents again each time. Now each row is stamped by its state, ``xmin``
   and ``updated_at`` (one query, no document fetched): the stamp semantics, then a daemon's
   rescans over a PostgreSQL store counted as tests/test_rescan_waiters_s19.py counts them.
2. The Python client's wait and MCP's ``wait_handoff`` ended at once with "not found" on a
   handoff whose file was still being written into the workspace's pending/ (``handoff wait``
   waited): now all three wait, and end when the daemon ingests the finished file and runs it.

Every test takes a fresh database of the session's throw-away cluster (tests/pgserver.py).
"""
from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Collection, Iterator

import pytest
from conftest import Clock
from test_postgres import pg_workspace, request
from test_postgres_polish_s19 import slow_settling
from test_rescan_waiters_s19 import Books

from handoffd.core.errors import NotFound, WaitTimeout
from handoffd.core.states import State
from handoffd.core.storage import LiveStamp


def stamped_store(url: str) -> Any:
    """A PostgreSQL store whose ``stamped`` counts the stamps asked of each id, and
    ``queries`` the stamp queries (``stamp_of``, ``stamps_of``)."""
    from handoffd.backends.postgres import PostgresBackend

    class Counted(PostgresBackend):
        def __init__(self) -> None:
            super().__init__(url)
            self.stamped: Counter[str] = Counter()
            self.queries: Counter[str] = Counter()

        def stamp_of(self, handoff_id: str) -> LiveStamp | None:
            self.stamped[handoff_id] += 1
            self.queries["stamp_of"] += 1
            return super().stamp_of(handoff_id)

        def stamps_of(self, handoff_ids: Collection[str]) -> dict[str, LiveStamp | None]:
            self.stamped.update(handoff_ids)
            self.queries["stamps_of"] += 1
            return super().stamps_of(handoff_ids)

    return Counted()


def sql(store: Any, statement: str, *args: Any) -> None:
    """Another program writes the table directly (psql)."""
    store.db.run(lambda conn, _: conn.execute(statement, args))


# ---------------------------------------------------------------- 1: the stamps
def test_a_stamp_changes_with_every_change_and_only_then(pg_url: str) -> None:
    store = stamped_store(pg_url)
    clock = Clock()
    try:
        store.create(request("a"), "a", clock())
        seen = [store.stamp_of("a")]
        assert seen[0] is not None and store.stamp_of("a") == seen[0]  # nothing changed
        assert store.live_stamps() == {"a": seen[0]}
        claim = store.claim("a", clock(), 60)
        seen.append(store.stamp_of("a"))
        assert store.renew(claim, clock(), 60)  # (the lease is in the document get returns)
        seen.append(store.stamp_of("a"))
        assert store.live_stamps() == {"a": seen[-1]}
        assert store.requeue(claim, claim.doc, None, count_attempt=True)
        seen.append(store.stamp_of("a"))
        again = store.claim("a", clock(), 60)
        seen.append(store.stamp_of("a"))
        assert store.finish(again, State.FAILED, {**again.doc, "status": "failed"})
        seen.append(store.stamp_of("a"))
        assert store.live_stamps() == {}  # finished: not live, still stamped
        assert store.stamp_of("a") == seen[-1] and store.get("a")[0] is State.FAILED
        assert store.reopen("a", request("a"))  # `handoff retry`
        seen.append(store.stamp_of("a"))
        # another program rewrites it twice within the same instant (the same updated_at)
        sql(store, "UPDATE handoffd.handoffs SET doc = %s::json WHERE id = 'a'",
            json.dumps(request("a", data={"n": 1})))
        seen.append(store.stamp_of("a"))
        sql(store, "UPDATE handoffd.handoffs SET doc = %s::json WHERE id = 'a'",
            json.dumps(request("a", data={"n": 2})))
        seen.append(store.stamp_of("a"))
        assert None not in seen and len(set(seen)) == len(seen), seen
        assert store.live_stamps() == {"a": seen[-1]}
        # none for what names no row, and for ids no handoff can have (no database error)
        assert store.stamp_of("nope") is None
        assert store.stamp_of("bad\x00id") is None and store.stamp_of("../a") is None
        assert store.set_aside("a", State.PENDING, "INVALID_DOCUMENT", "test")
        assert store.stamp_of("a") is None and store.live_stamps() == {}
    finally:
        store.close()


def test_live_stamps_is_one_query_for_every_live_row(pg_url: str) -> None:
    store = stamped_store(pg_url)
    clock = Clock()
    try:
        for i in range(300):
            store.create(request(f"p{i:03d}"), f"p{i:03d}", clock())
        for i in range(3):
            store.claim(f"p{i:03d}", clock(), 60)
        done = store.claim("p299", clock(), 60)
        store.finish(done, State.FAILED, {**done.doc, "status": "failed"})
        runs = Counter[str]()
        real = store.db.run

        def counted(operation: Any) -> Any:
            runs["run"] += 1
            return real(operation)

        store.db.run = counted
        stamps = store.live_stamps()
        assert runs["run"] == 1
        assert sorted(stamps) == [f"p{i:03d}" for i in range(299)]
        assert all(stamp is not None for stamp in stamps.values())
        assert stamps["p001"] == store.stamp_of("p001")
    finally:
        store.close()


def test_stamps_of_is_stamp_of_for_many_ids_at_once(pg_url: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd.backends.postgres import reading
    monkeypatch.setattr(reading, "STAMP_BATCH", 2)  # (several batches)
    store = stamped_store(pg_url)
    clock = Clock()
    try:
        for i in range(5):
            store.create(request(f"s{i}"), f"s{i}", clock())
        store.claim("s1", clock(), 60)
        asked = [f"s{i}" for i in range(5)] + ["nope", "bad\x00id", "../s1"]
        many = store.stamps_of(asked)
        assert many == {hid: store.stamp_of(hid) for hid in asked}
        assert [hid for hid, stamp in many.items() if stamp is None] == asked[5:]
        assert store.stamps_of([]) == {}
    finally:
        store.close()


def test_retention_reads_again_only_the_live_rows_that_changed(tmp_path: Path,
                                                              pg_url: str) -> None:
    """Retention's memory of what live handoffs reference (features/liverefs.py) now holds on
    PostgreSQL: a pass reads only the rows whose stamp changed (before: all 30 each pass)."""
    from handoffd import build_engine
    from handoffd.core.native_format import new_native_request
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    from handoffd.features.liverefs import LiveRefs
    from handoffd.features.retention import protected
    store = stamped_store(pg_url)
    ws = HandoffdWorkspace(tmp_path / "ws")
    ws.ensure()
    engine = build_engine(ws, backend=store, features=())
    clock = Clock()
    try:
        for i in range(30):
            doc = new_native_request(source="@t", target="@a", data={}, now=clock(),
                                     handoff_id=f"r{i:02d}", depends_on=["base"])
            store.create(doc, f"r{i:02d}", clock())
        reads = Counter[str]()
        real = store.get

        def get(handoff_id: str) -> Any:
            reads[handoff_id] += 1
            return real(handoff_id)

        store.get = get
        refs = LiveRefs()
        keep, live = protected(engine, refs)
        assert len(live) == 30 and set(keep) == {"base"} and sum(reads.values()) == 30
        reads.clear()
        assert protected(engine, refs)[0] == keep and not reads
        changed = real("r07")[1]
        changed["depends_on"] = ["other"]
        sql(store, "UPDATE handoffd.handoffs SET doc = %s::json WHERE id = 'r07'",
            json.dumps(changed))
        keep, live = protected(engine, refs)
        assert reads == Counter({"r07": 1}) and set(keep) == {"base", "other"}
    finally:
        store.close()


# ---------------------------------------------------------------- 1: a daemon's rescans
@pytest.fixture
def books(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> Iterator[Books]:
    """A daemon stepped by hand on a fake clock (tests/test_rescan_waiters_s19.py's) over a
    PostgreSQL store, with 60 handoffs waiting for ``dep`` (whose specialist is elsewhere)."""
    store = stamped_store(pg_url)
    made = Books(tmp_path, monkeypatch, store)
    try:
        made.drop("dep", "@far")
        for i in range(60):
            made.drop(f"w{i:02d}", depends_on=["dep"])
        made.settle()
        assert len(made.books.waiting) == 60
        yield made
    finally:
        made.close()
        for halt in made.daemon.stop_hooks:  # (its context mirror's thread, on this store)
            halt()
        store.close()


def test_rescans_on_postgres_leave_unchanged_waiters_alone(books: Books) -> None:
    """Before: each rescan read and gated all 60 (and looked ``dep`` up 60 times)."""
    store: Any = books.backend
    store.stamped.clear()
    store.queries.clear()
    assert [books.rescan() for _ in range(3)] == [(0, 0)] * 3
    assert store.stamped == Counter({"dep": 3})
    assert store.queries == Counter({"stamps_of": 3})  # one query a rescan, whatever awaited
    assert books.started == []


def test_rescans_on_postgres_gate_only_the_waiters_of_what_changed(books: Books) -> None:
    """Another process claims ``dep``: its 60 waiters are gated once; another program rewrites
    one waiter's row: that one alone; ``dep`` completed elsewhere: all 60 start."""
    store: Any = books.backend
    claim = store.claim("dep", books.clock(), 60)  # another process's claim (no wake-up here)
    assert claim is not None
    assert books.rescan() == (60, 60)
    assert books.rescan() == (0, 0)
    sql(store, "UPDATE handoffd.handoffs SET doc = %s::json WHERE id = 'w07'",
        json.dumps(store.get("w07")[1] | {"note": "rewritten"}))
    books.peeks.clear()
    assert books.rescan() == (1, 1) and set(books.peeks) == {"w07"}
    assert books.started == []
    assert store.finish(claim, State.COMPLETED, {**claim.doc, "status": "completed"})
    assert books.rescan() == (60, 60)
    assert sorted(books.started) == [(f"w{i:02d}", "work") for i in range(60)]


def test_a_chain_of_waiters_is_stamped_in_one_query_a_rescan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """40 handoffs each waiting for the one before (40 distinct ids awaited): a rescan stamps
    them in one query (one each: 5,000 queries a rescan for a chain of 5,000)."""
    store = stamped_store(pg_url)
    chain = Books(tmp_path, monkeypatch, store)
    try:
        chain.drop("c00", "@far")
        for i in range(1, 41):
            chain.drop(f"c{i:02d}", depends_on=[f"c{i - 1:02d}"])
        chain.settle()
        assert len(chain.books.waiting) == 40
        store.queries.clear()
        store.stamped.clear()
        assert [chain.rescan() for _ in range(2)] == [(0, 0)] * 2
        assert store.queries == Counter({"stamps_of": 2})
        assert store.stamped == Counter({f"c{i:02d}": 2 for i in range(40)})
    finally:
        chain.close()
        for halt in chain.daemon.stop_hooks:
            halt()
        store.close()


# ---------------------------------------------------------------- 2: waits on a half-written file
def halves(handoff_id: str) -> tuple[str, str]:
    """A request for @flaky as JSON text, cut in two (the first half no JSON document)."""
    text = json.dumps(request(handoff_id, "@flaky", {"mode": "ok"}))
    return text[:30], text[30:]


def test_the_client_waits_for_a_file_still_being_written(tmp_path: Path, pg_url: str) -> None:
    from handoffd import Client
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space)  # (a half-written file stays in pending/ for 30 s)
    half = space.root / "handoffs" / "pending" / "half1.json"
    first, rest = halves("half1")
    client = Client(space.root)
    try:
        half.write_text(first)
        handle = client.handle("half1")
        with pytest.raises(WaitTimeout):  # before: NotFound at once
            handle.wait(timeout=0.5)
        assert handle.look().state is State.PENDING and handle.look().document == {}
        with pytest.raises(NotFound):  # (the store itself does not hold it)
            handle.result()
        space.serve()
        ended: dict[str, Any] = {}

        def wait() -> None:
            try:
                ended["result"] = handle.wait(timeout=60)
            except Exception as exc:  # (reported by the assertion below)
                ended["error"] = exc

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        waiting.join(1.5)
        assert waiting.is_alive(), ended
        with half.open("a") as out:  # the producer writes the rest
            out.write(rest)
        waiting.join(60)
        assert not waiting.is_alive() and "error" not in ended, ended
        assert ended["result"].state is State.COMPLETED
        assert ended["result"].output == {"echo": {"mode": "ok"}}
        gone = space.root / "handoffs" / "pending" / "half2.json"
        gone.write_text(halves("half2")[0])
        gone.unlink()  # the producer gave up: nothing to wait for
        with pytest.raises(NotFound):
            client.handle("half2").wait(timeout=5)
    finally:
        client.engine.backend.close()
        space.cleanup()


def test_mcp_waits_for_a_file_still_being_written(tmp_path: Path, pg_url: str) -> None:
    pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'handoffd[mcp]')")
    from test_mcp_hostile import Server
    space = pg_workspace(tmp_path / "ws", pg_url)
    slow_settling(space)
    half = space.root / "handoffs" / "pending" / "half1.json"
    first, rest = halves("half1")
    half.write_text(first)
    server = Server(space.root)
    try:
        server.tool(1, "wait_handoff", {"handoff_id": "half1", "timeout": 0.5})
        said = server.reply(1, 30)
        assert said is not None and not said["result"].get("isError"), said  # before: NOT_FOUND
        view = json.loads(server.text(1))
        assert (view["state"], view["document"], view["finished"]) == ("pending", {}, False)
        space.serve()
        server.tool(2, "wait_handoff", {"handoff_id": "half1", "timeout": 60})
        assert server.reply(2, 1.5) is None  # still waiting
        with half.open("a") as out:
            out.write(rest)
        view = json.loads(server.text(2, 60))
        assert (view["state"], view["ok"]) == ("completed", True), view
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.proc.wait(10)
        space.cleanup()
