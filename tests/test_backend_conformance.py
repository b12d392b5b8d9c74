"""One behaviour suite for every storage backend (as huey's StorageTests): each test runs on
every backend of the ``backend`` fixture. Time is injected (``now`` arguments), never slept on.

A PostgreSQL backend joins by adding its name to BACKENDS and a branch to ``make_backend``."""
from __future__ import annotations

import itertools
import json
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoffd.backends import Backend, Claim, Wakeup
from handoffd.backends.files.backend import FilesBackend
from handoffd.backends.memory import MemoryBackend
from handoffd.core.documents import book, record
from handoffd.core.errors import (
    DuplicateHandoff,
    InvalidTransition,
    NotFound,
    WaitTimeout,
)
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State
from handoffd.core.timeutil import iso
from handoffd.core.workspace import Workspace

BACKENDS = ["memory", "files", "postgres"]
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
LEASE = 30.0
TARGETS = ("@a", "@b")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_backend(name: str, tmp_path: Path, pg_url: str = "") -> Backend:
    # a monotonic clock that leaps on every reading: leases are judged by the injected ``now``
    # alone (the guards against wall-clock steps are tested with each backend's own tests)
    ticks = itertools.count(step=10**6)
    if name == "postgres":
        from handoffd.backends.postgres import PostgresBackend
        return PostgresBackend(pg_url, pool_size=10, monotonic=lambda: float(next(ticks)))
    if name == "memory":
        return MemoryBackend()
    if name == "files":
        return FilesBackend.open(Workspace(tmp_path), monotonic=lambda: float(next(ticks)),
                                 durable=False)
    raise ValueError(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    # PostgreSQL: a fresh database on the session's server (skipped, saying why, without one)
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else ""
    made = make_backend(request.param, tmp_path, url)
    yield made
    made.close()


def request_doc(handoff_id: str, target: str = "@a", *, priority: str | None = None,
                conversation: str | None = None, parent: str | None = None) -> dict[str, Any]:
    doc = new_native_request(source="@test", target=target, data={"id": handoff_id}, now=T0,
                             handoff_id=handoff_id, priority=priority)
    if conversation:
        doc["conversation_id"] = conversation
    if parent:
        doc["parent_id"] = parent
    return doc


def add(backend: Backend, handoff_id: str, when: float = 0.0, target: str = "@a",
        **fields: Any) -> None:
    backend.create(request_doc(handoff_id, target, **fields), handoff_id, at(when))


def claim(backend: Backend, handoff_id: str, when: float = 0.0) -> Claim:
    got = backend.claim(handoff_id, at(when), LEASE)
    assert got is not None, f"{handoff_id} could not be claimed"
    return got


def done(backend: Backend, held: Claim, when: float = 1.0, state: State = State.COMPLETED) -> bool:
    """File a claim the way the engine does: record the transition, then finish."""
    record(held.doc, "completed" if state is State.COMPLETED else "failed", at(when))
    held.doc["status"] = state.status
    return backend.finish(held, state, held.doc)


def drain(backend: Backend, when: float = 0.0, targets: tuple[str, ...] = TARGETS) -> list[str]:
    out = []
    while (got := backend.claim_next(targets, at(when), LEASE)) is not None:
        out.append(got.id)
    return out


def state_of(backend: Backend, handoff_id: str) -> State | None:
    found = backend.get(handoff_id)
    return None if found is None else found[0]


# ---------------------------------------------------------------- create, get, list
def test_implements_the_interface(backend: Backend) -> None:
    assert isinstance(backend, Backend)


def test_create_stores_a_pending_copy_with_bookkeeping(backend: Backend) -> None:
    doc = request_doc("h1")
    backend.create(doc, "h1", T0)
    assert "handoffd" not in doc  # the caller's dict is left alone
    state, stored = backend.get("h1")  # type: ignore[misc]
    assert state is State.PENDING
    assert stored["input"] == {"data": {"id": "h1"}}
    assert book(stored)["id"] == "h1"
    assert [e["event"] for e in book(stored)["history"]] == ["created"]
    assert book(stored)["history"][0]["at"] == iso(T0)


def test_create_never_overwrites_an_existing_id(backend: Backend) -> None:
    add(backend, "h1")
    with pytest.raises(DuplicateHandoff):
        backend.create(request_doc("h1", "@b"), "h1", at(1))
    assert done(backend, claim(backend, "h1"))
    with pytest.raises(DuplicateHandoff):
        add(backend, "h1", 2)
    state, stored = backend.get("h1")  # type: ignore[misc]
    assert state is State.COMPLETED and stored["target"] == {"agent_id": "@a"}


def test_create_refuses_an_id_seen_within_the_ttl(backend: Backend) -> None:
    backend.seen_add("used", T0)
    with pytest.raises(DuplicateHandoff):
        add(backend, "used", 60)
    assert backend.get("used") is None
    add(backend, "used", 2 * 3600)  # the TTL (one hour by default) has passed


def test_get_unknown_is_none(backend: Backend) -> None:
    assert backend.get("nope") is None


def _populate(backend: Backend) -> None:
    add(backend, "p1", 1, "@a", conversation="c1")
    add(backend, "p2", 2, "@b", conversation="c1", parent="p1")
    add(backend, "p3", 3, "@a", parent="p1", priority="critical")
    add(backend, "p4", 4, "@b")
    assert done(backend, claim(backend, "p4", 5), 6)


def test_list_filters(backend: Backend) -> None:
    _populate(backend)
    ids = lambda **kw: sorted(r.id for r in backend.list(**kw))  # noqa: E731
    assert ids() == ["p1", "p2", "p3", "p4"]
    assert ids(state=State.PENDING) == ["p1", "p2", "p3"]
    assert ids(state=State.COMPLETED) == ["p4"]
    assert ids(state=State.FAILED) == []
    assert ids(target="@b") == ["p2", "p4"]
    assert ids(conversation="c1") == ["p1", "p2"]
    assert ids(parent="p1") == ["p2", "p3"]
    assert ids(parent="p1", target="@a") == ["p3"]
    assert ids(since=at(3)) == ["p3", "p4"]  # p4 was updated at 6
    row = next(r for r in backend.list() if r.id == "p3")
    assert (row.state, row.meta.target, row.meta.priority, row.due_at) == (State.PENDING, "@a", 0,
                                                                           at(3))


def test_list_orders_and_limits(backend: Backend) -> None:
    _populate(backend)
    assert [r.id for r in backend.list(order="newest")] == ["p4", "p3", "p2", "p1"]
    assert [r.id for r in backend.list(order="oldest")] == ["p1", "p2", "p3", "p4"]
    assert [r.id for r in backend.list(order="newest", limit=2)] == ["p4", "p3"]
    assert [r.id for r in backend.list(state=State.PENDING, order="due")] == ["p3", "p1", "p2"]
    assert backend.list(limit=0) == []


# ---------------------------------------------------------------- claiming
def test_list_places_a_running_handoff_by_its_claim(backend: Backend) -> None:
    # claimed r3, r2, r1 in that order (ids the other way round: no tie is ordered right by
    # id), then r3 renews its lease: no change of state, so no new place in a listing (the
    # files store placed it by its file's mtime, which each renewal sets)
    for i, handoff_id in enumerate(["r3", "r2", "r1"]):
        add(backend, handoff_id, when=i)
    held = [claim(backend, h, when=10 + i) for i, h in enumerate(["r3", "r2", "r1"])]
    assert backend.renew(held[0], at(20), LEASE)
    assert [r.id for r in backend.list(order="newest")] == ["r1", "r2", "r3"]
    assert [r.id for r in backend.list(state=State.IN_PROGRESS, limit=2)] == ["r1", "r2"]
    assert [r.id for r in backend.list(order="oldest", limit=2)] == ["r3", "r2"]
    assert [r.updated_at for r in backend.list(order="oldest")] == [at(10), at(11), at(12)]


def test_claim_next_by_priority_then_due_time(backend: Backend) -> None:
    add(backend, "low", 0, priority="low")
    add(backend, "normal-late", 2)
    add(backend, "critical", 3, priority="critical")
    add(backend, "normal-early", 1, "@b")
    assert drain(backend, 10) == ["critical", "normal-early", "normal-late", "low"]


def test_claim_next_serves_only_the_given_targets(backend: Backend) -> None:
    add(backend, "for-a", 0, "@a")
    add(backend, "for-b", 1, "@b")
    assert backend.claim_next(["@c"], at(5), LEASE) is None
    assert drain(backend, 5, ("@b",)) == ["for-b"]
    assert drain(backend, 5, ("@a", "@c")) == ["for-a"]


def test_claim_next_skips_not_yet_due_and_excluded(backend: Backend) -> None:
    add(backend, "h1")
    add(backend, "h2", 1)
    first = claim(backend, "h1")
    assert backend.requeue(first, first.doc, at(60), count_attempt=True)
    assert backend.claim_next(TARGETS, at(10), LEASE, exclude={"h2"}) is None
    assert drain(backend, 10) == ["h2"]
    assert backend.claim_next(TARGETS, at(59), LEASE) is None
    again = backend.claim_next(TARGETS, at(60), LEASE)
    assert again is not None and (again.id, again.attempt) == ("h1", 2)
    assert "next_attempt_at" not in book(again.doc)


def test_claim_by_id_holds_a_lease(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1", 5)
    assert (held.id, held.attempt) == ("h1", 1)
    state, stored = backend.get("h1")  # type: ignore[misc]
    assert state is State.IN_PROGRESS
    lease = book(stored)["lease"]
    assert lease["token"] == held.token and lease["expires_at"] == iso(at(5 + LEASE))
    assert [e["event"] for e in book(stored)["history"]] == ["created", "claimed"]
    assert backend.claim("h1", at(6), LEASE) is None
    assert backend.claim("nope", at(6), LEASE) is None
    assert backend.claim_next(TARGETS, at(6), LEASE) is None


def test_claim_by_id_ignores_the_due_time(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    assert backend.requeue(held, held.doc, at(3600), count_attempt=True)
    assert claim(backend, "h1", 1).attempt == 2


def test_prepare_marks_the_claimed_document(backend: Backend) -> None:
    add(backend, "h1")

    def mark(doc: dict[str, Any]) -> None:
        doc["status"] = "in_progress"

    held = backend.claim_next(TARGETS, at(1), LEASE, prepare=mark)
    assert held is not None and held.doc["status"] == "in_progress"
    assert backend.get("h1")[1]["status"] == "in_progress"  # type: ignore[index]


def test_concurrent_claim_next_never_hands_out_an_id_twice(backend: Backend) -> None:
    for n in range(40):
        add(backend, f"c{n:02d}", n % 5, TARGETS[n % 2])
    start = threading.Barrier(8)
    got: list[list[str]] = [[] for _ in range(8)]

    def worker(mine: list[str]) -> None:
        start.wait()
        mine.extend(drain(backend, 10))

    threads = [threading.Thread(target=worker, args=(got[i],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    claimed = [i for mine in got for i in mine]
    assert len(claimed) == 40 and len(set(claimed)) == 40
    assert all(state_of(backend, f"c{n:02d}") is State.IN_PROGRESS for n in range(40))


# ---------------------------------------------------------------- leases and fencing
def test_renew_extends_the_lease(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    assert backend.renew(held, at(20), LEASE)
    assert book(backend.get("h1")[1])["lease"]["expires_at"] == iso(at(50))  # type: ignore[index]
    assert backend.expired_claims(at(40), LEASE) == []
    assert [c.id for c in backend.expired_claims(at(51), LEASE)] == ["h1"]


def test_finish_files_once(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    assert done(backend, held, 2)
    state, stored = backend.get("h1")  # type: ignore[misc]
    assert state is State.COMPLETED and stored["status"] == "completed"
    assert "lease" not in book(stored)
    assert not done(backend, held, 3, State.FAILED)  # a claim finishes at most once
    assert not backend.renew(held, at(3), LEASE)
    assert state_of(backend, "h1") is State.COMPLETED


def test_finish_only_files_terminal_states(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    with pytest.raises(InvalidTransition):
        backend.finish(held, State.PENDING, held.doc)
    assert state_of(backend, "h1") is State.IN_PROGRESS


def test_a_claim_lost_to_a_requeue_files_nothing(backend: Backend) -> None:
    add(backend, "h1")
    stale = claim(backend, "h1")
    assert backend.requeue(stale, stale.doc, None, count_attempt=False)
    assert not done(backend, stale, 2)
    assert not backend.requeue(stale, stale.doc, None, count_attempt=True)
    assert state_of(backend, "h1") is State.PENDING
    fresh = claim(backend, "h1", 3)
    assert not done(backend, stale, 4)
    assert not backend.renew(stale, at(4), LEASE)
    assert state_of(backend, "h1") is State.IN_PROGRESS
    assert done(backend, fresh, 5, State.FAILED)
    assert state_of(backend, "h1") is State.FAILED


def test_a_claim_lost_to_recovery_files_nothing(backend: Backend) -> None:
    add(backend, "h1")
    stale = claim(backend, "h1")
    assert backend.expired_claims(at(LEASE - 1), LEASE) == []
    taken = backend.expired_claims(at(LEASE + 1), LEASE)
    assert len(taken) == 1
    recovered = taken[0]
    assert recovered.id == "h1" and recovered.token != stale.token
    assert recovered.attempt == stale.attempt == 1 and recovered.recovered
    assert backend.expired_claims(at(LEASE + 2), LEASE) == []  # held by the new lease now
    assert not backend.renew(stale, at(LEASE + 2), LEASE)
    assert not done(backend, stale, LEASE + 2)
    assert state_of(backend, "h1") is State.IN_PROGRESS
    record(recovered.doc, "retry_scheduled", at(LEASE + 3))
    assert backend.requeue(recovered, recovered.doc, at(LEASE + 10), count_attempt=True)
    assert not done(backend, stale, LEASE + 4)
    assert claim(backend, "h1", LEASE + 11).attempt == 2


def test_requeue_counts_the_attempt_or_gives_it_back(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    assert backend.requeue(held, held.doc, None, count_attempt=False)  # a graceful hand-back
    stored = backend.get("h1")[1]  # type: ignore[index]
    assert book(stored)["attempt"] == 0 and "lease" not in book(stored)
    assert "next_attempt_at" not in book(stored)
    held = claim(backend, "h1", 1)
    assert held.attempt == 1
    assert backend.requeue(held, held.doc, at(5), count_attempt=True)
    assert book(backend.get("h1")[1])["next_attempt_at"] == iso(at(5))  # type: ignore[index]
    assert claim(backend, "h1", 6).attempt == 2


def test_a_requeue_without_due_time_keeps_its_place_in_line(backend: Backend) -> None:
    add(backend, "first", 0)
    add(backend, "second", 1)
    held = backend.claim_next(TARGETS, at(2), LEASE)
    assert held is not None and held.id == "first"
    assert backend.requeue(held, held.doc, None, count_attempt=False)
    assert drain(backend, 3) == ["first", "second"]


def test_expired_claims_leaves_live_leases_alone(backend: Backend) -> None:
    add(backend, "h1")
    add(backend, "h2")
    claim(backend, "h1", 0)
    late = claim(backend, "h2", 20)
    taken = backend.expired_claims(at(LEASE + 5), LEASE)
    assert [c.id for c in taken] == ["h1"]
    assert backend.renew(late, at(LEASE + 5), LEASE)


# ---------------------------------------------------------------- side records
def test_cancel_requests(backend: Backend) -> None:
    assert backend.cancel_requests() == {} and backend.cancel_request("h1") is None
    backend.request_cancel("h1", {"reason": "not needed", "cascade": False})
    backend.request_cancel("h2", {"reason": "first"})
    backend.request_cancel("h2", {"reason": "second"})
    assert backend.cancel_request("h1") == {"reason": "not needed", "cascade": False}
    assert backend.cancel_requests() == {"h1": {"reason": "not needed", "cascade": False},
                                         "h2": {"reason": "second"}}
    backend.clear_cancel("h1")
    backend.clear_cancel("h1")
    assert backend.cancel_request("h1") is None and list(backend.cancel_requests()) == ["h2"]


def test_seen_ids_expire_after_the_ttl(backend: Backend) -> None:
    assert not backend.seen_contains("x", T0)
    backend.seen_add("x", T0)
    assert backend.seen_contains("x", at(10))
    assert not backend.seen_contains("x", at(2 * 3600))
    add(backend, "y", 5)  # creating records the id too
    assert backend.seen_contains("y", at(6))


def test_seen_ids_keep_the_mark_of_the_claim_that_recorded_them(backend: Backend) -> None:
    """A foreign document's admission records its id with its claim's mark; a recovered one
    tells its own record from another's by it (core.admission). A create's has none."""
    assert backend.seen_marks("m", T0) == frozenset()
    backend.seen_add("m", T0, "c0ffee")
    assert backend.seen_contains("m", at(1)) and backend.seen_marks("m", at(1)) == {"c0ffee"}
    assert backend.seen_marks("m", at(2 * 3600)) == frozenset()  # past the TTL
    add(backend, "y", 5)
    assert backend.seen_marks("y", at(6)) == {None}


# ---------------------------------------------------------------- waiting and wake-ups
def test_wait_terminal(backend: Backend) -> None:
    with pytest.raises(NotFound):
        backend.wait_terminal("nope", 0.01)
    add(backend, "h1")
    with pytest.raises(WaitTimeout):
        backend.wait_terminal("h1", 0.05)
    held = claim(backend, "h1")
    result: list[tuple[State, dict[str, Any]]] = []
    waiter = threading.Thread(target=lambda: result.append(backend.wait_terminal("h1", 10)))
    waiter.start()
    assert done(backend, held, 2, State.FAILED)
    waiter.join(timeout=10)
    assert result and result[0][0] is State.FAILED
    assert backend.wait_terminal("h1", 0)[0] is State.FAILED


def test_wakeups_fire_on_create_finish_requeue_and_cancel(backend: Backend) -> None:
    seen: list[Wakeup] = []
    lock = threading.Lock()

    def hear(wakeup: Wakeup) -> None:
        with lock:
            seen.append(wakeup)

    stop = backend.subscribe(hear)
    add(backend, "h1")
    held = claim(backend, "h1")
    assert backend.requeue(held, held.doc, None, count_attempt=False)
    assert done(backend, claim(backend, "h1", 1), 2)
    backend.request_cancel("h2", {"reason": "x"})
    with lock:
        kinds = {(w.handoff_id, w.kind) for w in seen}
    assert {("h1", "pending"), ("h1", "completed"), ("h2", "cancel")} <= kinds
    stop()
    with lock:
        before = len(seen)
    add(backend, "h3")
    with lock:
        assert not any(w.handoff_id == "h3" for w in seen[before:])


# ---------------------------------------------------------------- what the engine and sweeper use
def test_ids_per_state(backend: Backend) -> None:
    _populate(backend)
    assert sorted(backend.ids(State.PENDING)) == ["p1", "p2", "p3"]
    assert backend.ids(State.COMPLETED) == ["p4"]
    assert backend.ids(State.IN_PROGRESS) == [] and backend.ids(State.FAILED) == []


def test_peek_reads_only_pending_documents(backend: Backend) -> None:
    _populate(backend)
    doc = backend.peek("p1")
    assert doc is not None and doc["handoff_id"] == "p1"
    doc["input"] = "changed"  # a copy: the stored document is untouched
    assert backend.peek("p1")["input"] != "changed"  # type: ignore[index]
    assert backend.peek("p4") is None and backend.peek("nope") is None


def test_set_aside_removes_a_document_and_records_why(backend: Backend) -> None:
    add(backend, "h1")
    add(backend, "h2")
    assert backend.set_aside("h1", State.PENDING, "UNSAFE_ID", "bad name")
    assert state_of(backend, "h1") is None and backend.ids(State.PENDING) == ["h2"]
    assert not backend.set_aside("h1", State.PENDING, "UNSAFE_ID", "again")  # gone already
    assert not backend.set_aside("h2", State.IN_PROGRESS, "X", "not there")  # wrong state
    reasons = backend.quarantined()
    assert [(r["code"], r["message"]) for r in reasons] == [("UNSAFE_ID", "bad name")]


def test_set_aside_a_claim_ends_it(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    assert backend.set_aside("h1", State.IN_PROGRESS, "ID_MISMATCH", "names differ", claim=held)
    assert state_of(backend, "h1") is None
    assert not done(backend, held)  # nothing left to file


def test_create_failed_only_under_a_free_id(backend: Backend) -> None:
    add(backend, "h1")
    stub = {"handoff_id": "h2", "status": "failed", "handoffd": {"id": "h2"}}
    assert backend.create_failed("h2", stub)
    assert state_of(backend, "h2") is State.FAILED
    assert not backend.create_failed("h1", {"handoff_id": "h1"})  # taken: pending
    assert not backend.create_failed("h2", stub)  # taken: failed
    assert state_of(backend, "h1") is State.PENDING


def test_reopen_puts_a_failed_handoff_back(backend: Backend) -> None:
    add(backend, "h1")
    assert done(backend, claim(backend, "h1"), 1, State.FAILED)
    state, doc = backend.get("h1")  # type: ignore[misc]
    record(doc, "retried", at(2))
    assert backend.reopen("h1", doc)
    assert state_of(backend, "h1") is State.PENDING
    assert not backend.reopen("h1", doc)  # no longer failed
    assert drain(backend, 3) == ["h1"]


def test_abandon_leaves_the_claim_to_recovery(backend: Backend) -> None:
    add(backend, "h1")
    held = claim(backend, "h1")
    backend.abandon(held)
    assert state_of(backend, "h1") is State.IN_PROGRESS
    taken = backend.expired_claims(at(LEASE + 1), LEASE)
    assert [c.id for c in taken] == ["h1"]
    assert not done(backend, held, LEASE + 2) and done(backend, taken[0], LEASE + 3)


def test_claims_of_documents_we_created_are_not_raw(backend: Backend) -> None:
    add(backend, "h1")
    assert claim(backend, "h1").raw is False


def test_maintain_is_safe_to_run_any_time(backend: Backend) -> None:
    _populate(backend)
    held = claim(backend, "p1")
    done_before = backend.maintain(at(10))
    assert isinstance(done_before, dict)
    assert state_of(backend, "p1") is State.IN_PROGRESS  # a live claim is never touched
    assert done(backend, held, 11)
    assert sorted(backend.ids(State.PENDING)) == ["p2", "p3"]


def test_list_where_applies_before_the_limit(backend: Backend) -> None:
    _populate(backend)
    rows = backend.list(order="oldest", where=lambda r: r.meta.target == "@b", limit=1)
    assert [r.id for r in rows] == ["p2"]


# ---------------------------------------------------------------- files only
def test_files_wakeups_include_other_processes_writes(tmp_path: Path) -> None:
    mine = FilesBackend.open(Workspace(tmp_path), durable=False)
    other = FilesBackend.open(Workspace(tmp_path), durable=False, watch=False)
    heard = threading.Event()
    stop = mine.subscribe(lambda w: heard.set() if (w.handoff_id, w.kind) == ("x1", "pending")
                          else None)
    try:
        add(other, "x1")
        assert heard.wait(5), "no wake-up for a document another writer created"
    finally:
        stop()
        mine.close()


def test_files_a_dead_owners_claim_is_taken_over_at_once(tmp_path: Path, dead_owner_marks: None) -> None:
    """On this host a free claim lock proves the owner died: no need to wait for the lease."""
    backend = FilesBackend.open(Workspace(tmp_path), durable=False, watch=False)
    add(backend, "h1")
    held = claim(backend, "h1")
    backend.store.close()  # its owner lock goes, as the kernel drops it when the owner dies
    taken = backend.expired_claims(at(1), LEASE)
    assert [c.id for c in taken] == ["h1"] and "gone" in (taken[0].recovered or "")
    assert not done(backend, held, 2)
    assert done(backend, taken[0], 3, State.FAILED)


def test_files_another_owners_expired_lease_needs_a_watched_lease_period(tmp_path: Path) -> None:
    """A lease this process did not write counts as expired only after it watched it unrenewed
    for a whole lease period on its monotonic clock (a stepped wall clock cannot end it)."""
    ticks = itertools.chain([0.0, 10.0], itertools.repeat(LEASE + 1))
    owner = FilesBackend.open(Workspace(tmp_path), durable=False, watch=False)
    sweeper = FilesBackend.open(Workspace(tmp_path), durable=False, watch=False,
                                monotonic=lambda: next(ticks))
    add(owner, "h1")
    held = claim(owner, "h1")  # kept: its claim lock says the owner is alive
    assert sweeper.expired_claims(at(3600), LEASE) == []  # first sight: starts the watch
    assert sweeper.expired_claims(at(3600), LEASE) == []  # 10 s watched: not yet
    assert [c.id for c in sweeper.expired_claims(at(3600), LEASE)] == ["h1"]
    assert not owner.renew(held, at(3600), LEASE)


def test_files_raw_documents_are_claimed_raw_and_unreadable_ones_listed_on_request(
        tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    backend = FilesBackend.open(ws, durable=False, watch=False)
    (ws.state_dir(State.PENDING) / "junk.json").write_text("{not json")
    (ws.state_dir(State.PENDING) / "raw-1.json").write_text(json.dumps(request_doc("raw-1")))
    assert [r.id for r in backend.list()] == ["raw-1"]
    rows = {r.id: r for r in backend.list(unreadable=True)}
    assert rows["junk"].problem is not None and rows["junk"].doc == {}
    assert getattr(rows["junk"].problem, "code") == "MALFORMED_JSON"
    with pytest.raises(Exception) as caught:
        backend.peek("junk")
    assert getattr(caught.value, "code") == "MALFORMED_JSON"
    got = backend.claim("raw-1", datetime.now(timezone.utc) + timedelta(seconds=5), LEASE)
    assert got is not None and got.raw is True


def test_files_claim_next_takes_raw_documents_and_skips_unreadable_ones(tmp_path: Path) -> None:
    """Agents that only write files drop raw documents into pending/ (no bookkeeping, any
    time); a file that is not a document never stops the others from being claimed."""
    ws = Workspace(tmp_path)
    backend = FilesBackend.open(ws, durable=False, watch=False)
    (ws.state_dir(State.PENDING) / "junk.json").write_text("{not json")
    (ws.state_dir(State.PENDING) / "notes.txt").write_text("hello")
    raw = request_doc("raw-1", priority="high")
    (ws.state_dir(State.PENDING) / "raw-1.json").write_text(json.dumps(raw))
    add(backend, "made-1", 0)
    now = datetime.now(timezone.utc) + timedelta(seconds=5)  # a raw file is due from its mtime
    assert drain(backend, (now - T0).total_seconds()) == ["raw-1", "made-1"]
    assert state_of(backend, "raw-1") is State.IN_PROGRESS
    assert (ws.state_dir(State.PENDING) / "junk.json").exists()


def test_create_with_a_later_due_time_waits_for_it(backend: Backend) -> None:
    backend.create(request_doc("later"), "later", T0, due_at=at(60))
    add(backend, "now", 1)
    assert drain(backend, 10) == ["now"]
    assert backend.claim_next(TARGETS, at(59), LEASE) is None
    got = backend.claim_next(TARGETS, at(60), LEASE)
    assert got is not None and got.id == "later"


def test_purge_deletes_a_finished_handoff_and_remembers_its_id(backend: Backend) -> None:
    add(backend, "h1")
    add(backend, "h2")
    assert done(backend, claim(backend, "h1"), 1)
    with pytest.raises(InvalidTransition):
        backend.purge("h2", State.PENDING, at(2))
    assert not backend.purge("h1", State.FAILED, at(2))  # not there
    assert backend.purge("h1", State.COMPLETED, at(2))
    assert backend.get("h1") is None and backend.ids(State.COMPLETED) == []
    assert not backend.purge("h1", State.COMPLETED, at(3))
    with pytest.raises(DuplicateHandoff):  # the id was used: dedup still says so
        add(backend, "h1", 4)


def test_purge_with_expect_deletes_only_that_document(backend: Backend) -> None:
    """Retention purges what it archived: compared and deleted in one step, so a document filed
    in its place meanwhile (a retry that failed again) is never the one removed."""
    add(backend, "h1")
    assert done(backend, claim(backend, "h1"), 1)
    found = backend.get("h1")
    assert found is not None
    filed = found[1]
    assert not backend.purge("h1", State.COMPLETED, at(2), expect=dict(filed, note="other"))
    assert backend.get("h1") == (State.COMPLETED, filed)  # not what was expected: kept as it was
    assert backend.ids(State.COMPLETED) == ["h1"]
    assert not backend.purge("h1", State.FAILED, at(2), expect=filed)  # not in that state
    assert backend.purge("h1", State.COMPLETED, at(2), expect=filed)
    assert backend.get("h1") is None


# ---------------------------------------------------------------- shared records
def test_records_update_read_and_delete(backend: Backend) -> None:
    records = backend.records()
    assert records.read("paused") == {}
    assert records.update("paused", "@a", lambda old: {"by": "@ops", "was": old}) == \
        {"by": "@ops", "was": None}
    assert records.update("paused", "@b", lambda old: {"n": 1}) == {"n": 1}
    assert records.read("paused") == {"@a": {"by": "@ops", "was": None}, "@b": {"n": 1}}
    assert records.read("rates") == {}  # kinds are separate
    assert records.update("paused", "@a", lambda old: None) is None  # None deletes
    assert records.read("paused") == {"@b": {"n": 1}}


def test_concurrent_record_updates_are_serialised(backend: Backend) -> None:
    records = backend.records()

    def bump() -> None:
        for _ in range(25):
            records.update("counters", "n", lambda old: (old or 0) + 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert records.read("counters") == {"n": 100}


# ---------------------------------------------------------------- shared context and violations
# the seams the features keep beside the handoffs (core.storage.ContextBackend, ViolationLog),
# on every store: files (context/, .meta/violations.jsonl), memory, PostgreSQL (tables)
@pytest.fixture(params=BACKENDS)
def side(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """(a ContextBackend, a ViolationLog) of one store."""
    if request.param == "postgres":
        from handoffd.backends.postgres import PostgresBackend
        made = PostgresBackend(request.getfixturevalue("pg_url"), pool_size=10)
        yield made.shared_context(), made.violation_log()
        made.close()
    elif request.param == "memory":
        from handoffd.backends.memory import MemoryContext, MemoryViolationLog
        yield MemoryContext(), MemoryViolationLog()
    else:
        from handoffd.backends.files.context import FileContext
        from handoffd.backends.files.violations import FileViolationLog
        yield (FileContext(tmp_path / "context", durable=False),
               FileViolationLog(tmp_path / "violations.jsonl"))


def put(context: Any, key: str, data: bytes, by: str = "@a") -> dict[str, Any]:
    """Write ``data`` whatever the current value; the entry says what it replaced."""
    def change(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
        return data, {"key": key, "by": by, "revision": revision + 1, "had": old is not None}
    return context.write(key, change)  # type: ignore[no-any-return]


def test_context_values_revisions_and_history(side: tuple[Any, Any]) -> None:
    from handoffd.core.storage import ContextBackend
    context, _ = side
    assert isinstance(context, ContextBackend)
    assert context.read("task/goal") == (None, 0) and context.keys() == []
    text = b'{\n  "zeta": 1,\n  "a": [true, null]\n}\n'  # kept byte for byte, keys in order
    assert put(context, "task/goal", text) == {"key": "task/goal", "by": "@a", "revision": 1,
                                                "had": False}
    assert context.read("task/goal") == (text, 1)
    seen: list[tuple[bytes | None, int]] = []

    def again(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
        seen.append((old, revision))
        return b"2\n", {"key": "task/goal", "revision": revision + 1}

    context.write("task/goal", again)
    assert seen == [(text, 1)] and context.read("task/goal") == (b"2\n", 2)
    put(context, "task/other", b"3\n", by="@b")
    put(context, "notes", b'"n"\n')
    assert context.keys() == ["notes", "task/goal", "task/other"]
    assert context.keys("task/") == ["task/goal", "task/other"]
    assert [(h["key"], h["revision"]) for h in context.history()] == \
        [("task/goal", 1), ("task/goal", 2), ("task/other", 1), ("notes", 1)]
    assert [h["revision"] for h in context.history("task/goal")] == [1, 2]


def test_context_history_keeps_the_newest_entries_and_the_latest_of_each_key(
        side: tuple[Any, Any]) -> None:
    """``history(limit=N)``: the newest N (only ``key``'s when given), oldest first, on every
    store (no store hands out, or holds, more); ``latest``: each key's newest entry."""
    context, _ = side
    for n in range(1, 8):
        put(context, "a" if n % 2 else "b", f"{n}\n".encode(), by=f"@{n}")
    assert [h["by"] for h in context.history(limit=3)] == ["@5", "@6", "@7"]
    assert [h["by"] for h in context.history("a", limit=2)] == ["@5", "@7"]
    assert [h["by"] for h in context.history("b", limit=100)] == ["@2", "@4", "@6"]
    assert context.history(limit=0) == [] and len(context.history()) == 7
    assert context.history("missing", limit=5) == []
    assert {k: e["by"] for k, e in context.latest(["a", "b", "missing"]).items()} == \
        {"a": "@7", "b": "@6"}
    assert context.latest([]) == {}


def test_violation_log_is_read_as_a_stream(side: tuple[Any, Any]) -> None:
    """``read()`` hands entries out one at a time (an iterator, not one list of them all), the
    oldest first, past any page size a store reads by."""
    _, log = side
    for i in range(1203):
        log.append({"kind": "scope_creep", "i": i})
    stream = log.read()
    assert not isinstance(stream, list)
    assert next(iter(stream))["i"] == 0
    assert [e["i"] for e in log.read()] == list(range(1203))


def test_a_context_change_that_raises_writes_nothing(side: tuple[Any, Any]) -> None:
    context, _ = side
    put(context, "k", b"1\n")

    def refuse(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
        raise ValueError("conflict")

    with pytest.raises(ValueError):
        context.write("k", refuse)
    assert context.read("k") == (b"1\n", 1) and len(context.history("k")) == 1


def test_concurrent_context_writes_are_serialised(side: tuple[Any, Any]) -> None:
    context, _ = side

    def bump(old: bytes | None, revision: int) -> tuple[bytes, dict[str, Any]]:
        value = int(old or b"0") + 1
        return f"{value}\n".encode(), {"key": "n", "revision": revision + 1}

    def worker() -> None:
        for _ in range(25):
            context.write("n", bump)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert context.read("n") == (b"100\n", 100)
    assert [h["revision"] for h in context.history("n")] == list(range(1, 101))


def test_compare_and_set_holds_between_two_context_stores(side: tuple[Any, Any],
                                                          tmp_path: Path) -> None:
    """Two ContextStores on one store (two hosts of a shared one): a stale revision conflicts."""
    from handoffd.features.context import ContextConflict, ContextStore, Permissions
    context, _ = side
    stores = []
    for name in ("a", "b"):
        ws = Workspace(tmp_path / name)
        stores.append(ContextStore(ws, Permissions({}, {}), durable=False, backend=context))
    host_a, host_b = stores
    assert host_a.set("plan", {"step": 1}, agent="@x", if_revision=0)["revision"] == 1
    assert host_b.get_with_revision("plan") == ({"step": 1}, 1)
    host_b.set("plan", {"step": 2}, agent="@y", if_revision=1)
    with pytest.raises(ContextConflict) as caught:
        host_a.set("plan", {"step": 3}, agent="@x", if_revision=1)
    assert (caught.value.expected, caught.value.actual) == (1, 2)
    assert host_a.update("plan", lambda v: dict(v, step=v["step"] + 1), agent="@x")["revision"] == 3
    assert [h["by"] for h in host_b.history("plan")] == ["@x", "@y", "@x"]
    assert [r["key"] for r in host_a.listing()] == ["plan"]


def test_a_shared_context_reports_revisions_and_reads_many(side: tuple[Any, Any]) -> None:
    from handoffd.core.storage import SharedContext
    context, _ = side
    if not isinstance(context, SharedContext):
        pytest.skip("the files store's context is the folder itself (nothing to mirror)")
    put(context, "a", b"1\n")
    put(context, "b", b"2\n")
    put(context, "b", b"3\n")
    assert context.revisions() == {"a": 1, "b": 2}
    assert context.read_many(["b", "missing"]) == {"b": (b"3\n", 2)}
    assert context.read_many([]) == {}


def test_violation_log_appends_in_order(side: tuple[Any, Any]) -> None:
    from handoffd.core.storage import ViolationLog
    _, log = side
    assert isinstance(log, ViolationLog) and list(log.read()) == []
    entries = [{"time": f"2026-03-01T12:00:0{i}Z", "kind": "scope_creep", "agent": "@w",
                "details": {"zeta": i, "a": [i]}} for i in range(3)]
    for entry in entries:
        log.append(entry)
    assert list(log.read()) == entries

    def worker(n: int) -> None:
        for i in range(20):
            log.append({"kind": "criteria_failed", "n": n, "i": i})

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    later = list(log.read())[3:]
    assert len(later) == 80
    for n in range(4):  # one writer's entries keep their order
        assert [e["i"] for e in later if e["n"] == n] == list(range(20))
