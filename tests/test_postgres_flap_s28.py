"""A PostgreSQL claim never runs twice at once when its owner's presence session flaps (helper
A, session 28; review R56).

A sweep took an owner's claims over once it had seen the owner's presence key unheld at every
look for ``claim_grace_seconds``. An owner whose presence session was cut every few hundredths
of a second took its key again each time, so it kept proving alive and kept its claims, while a
sweep whose looks all landed in the gaps took them over: two handlers at once (4.4 s in R56's
run) until the owner's next renewal failed. Now the sweep takes the key itself on first seeing
it unheld and takes the claims over only after holding it for the whole grace: the owner cannot
take it again, proves nothing, and is fenced at half the grace, however its session flaps.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import exe, wait_until
from test_postgres import T0, at, backend, key_held, request, sql

from handoffd.backends.postgres import connection
from handoffd.core.documents import record
from handoffd.core.states import State
from handoffd.core.workspace import Workspace as HandoffdWorkspace

GRACE = 1.0
# pg_locks rows of presence key %s in this database, of any session but the one given
KEY_SESSIONS = ("SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.objsubid = 1 "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = "
                "current_database()) AND ((l.classid::bigint << 32) | l.objid::bigint) = %s "
                "AND l.pid <> %s")


def holder_pid(store: Any) -> int:
    """The backend pid of ``store``'s session that holds watched owners' keys (0: none; before
    the fix there was none)."""
    holds = getattr(store, "_holds", None)
    return int(holds.pid) if holds is not None else 0


def dead_owner(pg_url: str, lease: float = 600.0) -> int:
    """An owner that claims h1 (a ``lease``-second lease) and dies, as kill -9 would: its
    session, and its presence key, end; returns that key."""
    owner = backend(pg_url, owner_grace_seconds=GRACE)
    try:
        owner.create(request("h1"), "h1", T0)
        assert owner.claim("h1", at(1), lease) is not None
        return int(owner.owner_key)
    finally:
        owner.close()


def watching(pg_url: str, clock: list[float]) -> Any:
    """A watcher whose monotonic clock is ``clock[0]``."""
    return backend(pg_url, owner_grace_seconds=GRACE, monotonic=lambda: clock[0])


def cut_owner(url: str, key: int, spare: int) -> None:
    """End every session holding or waiting for presence key ``key`` but ``spare`` (the
    watcher's), as R56's pg_terminate_backend loop did: each call waits (bounded) until its
    session ended. (The owner's presence reconnects about 0.1 s later.)"""
    for (pid,) in sql(url, KEY_SESSIONS, key, spare):
        assert sql(url, "SELECT pg_terminate_backend(%s, 5000)", pid) == [(True,)]


def test_a_flapping_owner_is_fenced_before_a_watcher_takes_its_claim_over(pg_url: str) -> None:
    """The owner's presence session is cut again and again, each look of the watcher's sweep
    landing in a gap (the owner reconnects in about 0.1 s and is cut before the next look).
    The owner's "handler" runs from its claim until its lease keeper would fence it
    (``broken_claims``, polled as the keeper does); the watcher's starts when its sweep takes
    the claim over. They never overlap, the claim is filed once (the owner's filing is fenced
    out), the owner claims nothing new while fenced, and closing it never hangs. Before the
    fix the owner kept proving alive: still running when the watcher took its claim over."""
    owner = backend(pg_url, owner_grace_seconds=GRACE)
    watcher = backend(pg_url, owner_grace_seconds=GRACE)
    marks: list[tuple[str, str, float]] = []  # (start/end, who, monotonic time)
    stop = threading.Event()
    try:
        for hid in ("h1", "h2"):
            owner.create(request(hid), hid, T0)
        claim = owner.claim("h1", at(1), 600)
        assert claim is not None
        marks.append(("start", "owner", time.monotonic()))

        def keeper() -> None:  # the owner's lease keeper: stops its handler once fenced
            while not stop.is_set():
                if owner.broken_claims([claim]):
                    marks.append(("end", "owner", time.monotonic()))
                    return
                time.sleep(0.005)
        keeping = threading.Thread(target=keeper, daemon=True)
        keeping.start()

        def flap() -> None:  # R56's loop: the owner's sessions cut as soon as they have its key
            while not stop.is_set():  # or wait for it (a watcher's holds are spared)
                try:
                    for (pid,) in sql(pg_url, KEY_SESSIONS, owner.owner_key,
                                      holder_pid(watcher)):
                        sql(pg_url, "SELECT pg_terminate_backend(%s)", pid)
                except Exception:  # (a busy server: cut again)
                    pass
                time.sleep(0.005)
        cutting = threading.Thread(target=flap, daemon=True)
        cutting.start()
        taken: list[Any] = []
        refused_while_fenced: list[bool] = []
        deadline = time.monotonic() + 30 * GRACE
        while not taken and time.monotonic() < deadline:
            if not refused_while_fenced and any(kind == "end" for kind, _, _ in marks):
                # fenced, the watcher holding its key: the owner claims nothing new (R61: asked
                # after the flapping stopped, this raced the owner's reconnect back-off)
                refused_while_fenced.append(owner.claim("h2", at(3), 600) is None)
            taken = watcher.expired_claims(at(2), 600)
            time.sleep(0.05)
        assert [c.id for c in taken] == ["h1"], "the watcher never took the claim over"
        marks.append(("start", "watcher", time.monotonic()))
        stop.set()
        keeping.join(timeout=5)
        cutting.join(timeout=10)
        ends = [t for kind, who, t in marks if (kind, who) == ("end", "owner")]
        started = [t for kind, who, t in marks if (kind, who) == ("start", "watcher")][0]
        assert ends and ends[0] <= started, (
            "the owner's handler was still running when the watcher took its claim over "
            f"(it was {'never fenced' if not ends else 'fenced later'})")
        assert all(refused_while_fenced), "the fenced owner claimed h2"
        record(taken[0].doc, "completed", at(4))
        assert watcher.finish(taken[0], State.COMPLETED, taken[0].doc)
        record(claim.doc, "completed", at(5))
        assert not owner.finish(claim, State.COMPLETED, claim.doc)  # filed once
        completed = sql(pg_url, "SELECT count(*) FROM handoffd.events WHERE handoff_id = 'h1' "
                                "AND state = 'completed'")
        assert completed == [(1,)]
        # the watcher let go of the key once the claim was taken over: the owner has it again
        wait_until(lambda: owner.present_for_sure(), timeout=10, what="the owner is back")
        assert not watcher._holds.since
    finally:
        stop.set()
        closing = threading.Thread(target=owner.close, daemon=True)
        closing.start()
        closing.join(timeout=4)
        watcher.close()
    assert not closing.is_alive(), "closing the owner hung in its presence session"


def test_a_watched_key_is_held_by_one_watcher_let_go_on_its_death_and_after_takeover(
        pg_url: str) -> None:
    """Two watchers of a dead owner: the first to look takes the key, the other sees it held
    and watches nothing. The first one's holding session dies: its hold goes with it, the other
    takes the key and starts afresh, and the first, back, sees it held. After the whole grace
    of holding, the claim is taken over and the key let go."""
    clock = [0.0]
    key = dead_owner(pg_url)
    first = backend(pg_url, owner_grace_seconds=GRACE)
    second = watching(pg_url, clock)
    try:
        wait_until(lambda: not key_held(pg_url, key))
        assert first.expired_claims(at(2), 600) == []
        assert key_held(pg_url, key) and key in first._holds.since  # the first's now
        assert first.takeover_watch(600)
        clock[0] = 100.0  # however long the second watches, the key is the first's
        assert second.expired_claims(at(3), 600) == []
        assert second.expired_claims(at(3), 600) == []
        assert not second._holds.since and second.takeover_watch(600) == []
        # the first watcher's holding session dies (its process would): the hold goes
        sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", holder_pid(first))
        wait_until(lambda: not key_held(pg_url, key))
        assert second.expired_claims(at(4), 600) == []  # taken now: watched afresh
        assert second._holds.since == {key: 100.0}
        assert first.expired_claims(at(4), 600) == []  # back: held by the second
        assert not first._holds.since and first.takeover_watch(600) == []
        clock[0] = 100.0 + GRACE / 2
        assert second.expired_claims(at(5), 600) == []  # held for half the grace only
        clock[0] = 100.0 + GRACE
        taken = second.expired_claims(at(6), 600)
        assert [c.id for c in taken] == ["h1"] and "session" in (taken[0].recovered or "")
        assert not second._holds.since and not key_held(pg_url, key)  # let go
    finally:
        first.close()
        second.close()


def test_a_live_owner_cut_once_gets_its_key_back_from_a_watcher(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watcher that looked while a live owner's presence session was cut holds its key; the
    owner, back, waits for it, and the watcher sees it wait (within a beat, not at its next
    sweep: sweeps come every 10 s by default) and lets go: the owner holds its key again, proves
    alive and keeps its claim."""
    # the owner's presence reconnects half a second after a cut: the watcher's look, made at
    # once, lands in the gap however loaded the machine
    monkeypatch.setattr(connection, "BACKOFF_FIRST", 0.5)
    clock = [0.0]
    owner = backend(pg_url, owner_grace_seconds=GRACE)
    watcher = watching(pg_url, clock)
    try:
        owner.create(request("h1"), "h1", T0)
        claim = owner.claim("h1", at(1), 600)
        assert claim is not None
        assert watcher.expired_claims(at(2), 600) == []  # (its sessions open: it looks at once)
        cut_owner(pg_url, owner.owner_key, holder_pid(watcher))
        assert watcher.expired_claims(at(2), 600) == []
        # it looked in the gap: it holds the key (before the owner is back)
        assert key_held(pg_url, owner.owner_key) and owner.owner_key in watcher._holds.since
        # the owner's presence reconnects and waits for its key: the watcher lets go of it
        # between its sweeps, and the owner has it again
        wait_until(lambda: sql(pg_url, KEY_SESSIONS + " AND l.granted", owner.owner_key,
                               holder_pid(watcher)), timeout=10, what="the owner's key back")
        assert not watcher._holds.since
        wait_until(owner.present_for_sure, timeout=10, what="the owner proves alive")
        clock[0] = 0.5
        assert watcher.expired_claims(at(3), 600) == []
        assert watcher.takeover_watch(600) == []
        clock[0] = 10.0
        assert watcher.expired_claims(at(4), 600) == []
        assert owner.renew(claim, at(5), 600)
    finally:
        owner.close()
        watcher.close()


# two hosts' daemons, each its own workspace on one database; @slow notes its start and end
FLAP_CONFIG = """
[daemon]
workers = 1
sweep_seconds = 0.5
settle_seconds = 0.1
claim_grace_seconds = 2.0
lease_seconds = 60.0
grace_seconds = 3.0

[retry]
max_retries = 3
retry_delay_seconds = 0.1
backoff_multiplier = 1.0

[specialists."@slow"]
handler = "fdplug:slow"

[store]
url = "{url}"
"""
# R56's loop: every presence session of the claim's owner, as soon as it (re)takes or waits for
# its key (a session that only watches, taking keys with pg_try_advisory_lock, is spared)
CUT_PRESENCE = ("SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a JOIN pg_locks l "
                "ON l.pid = a.pid WHERE l.locktype = 'advisory' AND l.objsubid = 1 "
                "AND a.datname = current_database() AND a.query LIKE 'SELECT pg_advisory_lock%%' "
                "AND ((l.classid::bigint << 32) | l.objid::bigint) = (SELECT lease_owner FROM "
                "handoffd.handoffs WHERE id = %s)")


@pytest.mark.heavy
def test_two_daemons_never_run_a_claim_at_once_while_its_owners_presence_flaps(
        tmp_path: Path, pg_url: str) -> None:
    """R56 end to end: daemon a runs @slow (8 s) while its presence session is cut every few
    milliseconds; daemon b sweeps. b takes the claim over (a was fenced: its handler ended
    first) and completes it; the two runs never overlap and the handoff is completed once.
    Before the fix a kept proving alive between the cuts and ran on beside b."""
    from test_owner_lock import PLUGIN, overlaps
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "fdplug.py").write_text(PLUGIN.replace("RUN_SECONDS", "8.0"))
    env = {**os.environ, "PYTHONPATH": str(plug)}
    roots = [tmp_path / name for name in "ab"]
    for root in roots:
        root.mkdir()
        (root / "handoffd.toml").write_text(FLAP_CONFIG.replace("{url}", pg_url))
        HandoffdWorkspace(root).ensure()
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()

    def start(root: Path) -> None:
        with open(root / "serve.log", "wb") as err:
            procs.append(subprocess.Popen([exe("handoffd"), "serve", "--root", str(root)],
                                          stdout=subprocess.DEVNULL, stderr=err, env=env))
        wait_until(lambda: "serving" in (root / "serve.log").read_text(errors="replace"), 20,
                   f"{root.name} serving")

    def runs() -> list[dict[str, Any]]:
        return [json.loads(line) for root in roots if (root / "runs.jsonl").exists()
                for line in (root / "runs.jsonl").read_text().splitlines()]

    try:
        start(roots[0])
        made = subprocess.run([exe("handoff"), "create", "--root", str(roots[0]), "--to", "@slow",
                               "--data", "{}"], capture_output=True, text=True, timeout=30,
                              env=env)
        assert made.returncode == 0, made.stderr
        hid = made.stdout.strip()
        wait_until(lambda: any(r["what"] == "start" for r in runs()), 20, "@slow started on a")
        start(roots[1])  # (after a claimed: b only sweeps)

        # the first cut: a's presence session, up for long (its last query a round trip)
        owner = sql(pg_url, "SELECT lease_owner FROM handoffd.handoffs WHERE id = %s", hid)[0][0]
        cut_owner(pg_url, int(owner), 0)

        def flap() -> None:
            while not stop.is_set():
                try:
                    sql(pg_url, CUT_PRESENCE, hid)
                except Exception:  # (a row filed meanwhile, a busy server: cut again)
                    pass
                time.sleep(0.005)
        cutting = threading.Thread(target=flap, daemon=True)
        cutting.start()
        wait_until(lambda: any(r["what"] == "start" and r["pid"] != runs()[0]["pid"]
                               for r in runs()), 30, "b took the claim over")
        stop.set()
        cutting.join(timeout=10)
        wait_until(lambda: sql(pg_url, "SELECT state FROM handoffd.handoffs WHERE id = %s",
                               hid) == [("completed",)], 40, "completed")
        both = overlaps(runs())
        assert not both, f"the handler ran on both hosts at once: {both}"
        assert sql(pg_url, "SELECT count(*) FROM handoffd.events WHERE handoff_id = %s AND "
                           "state = 'completed'", hid) == [(1,)]
    finally:
        stop.set()
        for proc in procs:  # only the daemons this test started, by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


# ---------------------------------------------------------------- R61's mends
def test_a_dead_owners_claim_is_taken_over_when_no_key_can_be_held(
        pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """R61 #1: with no session to hold keys on (a role at its connection limit, a server at
    max_connections), a dead owner's claim was skipped at every sweep, even its lease long
    expired, said at DEBUG only: stranded. Its owner is watched as before keys were held (seen
    unheld at every look for the grace), listed by takeover_watch so a batch waits for it (R63:
    judged by its lease alone, cron batches never took it over), and the missing session is
    said once as a warning."""
    import logging
    clock = [0.0]
    dead_owner(pg_url, lease=5)
    watcher = watching(pg_url, clock)
    try:
        watcher._holds.url = "postgresql://nobody@127.0.0.1:1/nowhere"  # no session to be had
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert watcher.expired_claims(at(100), 5) == []  # watched from now
            assert watcher.takeover_watch(5) == [GRACE]  # (a batch waits for it)
            clock[0] = 6.0
            taken = watcher.expired_claims(at(106), 5)
        assert [c.id for c in taken] == ["h1"], "a dead owner's expired claim stays stranded"
        said = [r.getMessage() for r in caplog.records
                if "no session to hold dead-looking owners' keys" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        watcher.close()


def test_a_stalled_holders_keys_go_with_its_idle_session(pg_url: str) -> None:
    """R61 #2: a holder that stalls (SIGSTOP, a paused VM) kept a live owner from its key, and
    its claims, for the whole stall. The server ends the holding session once it is idle for
    0.3 of the grace (its thread's look each beat keeps it busy while the holder runs)."""
    watcher = backend(pg_url, owner_grace_seconds=GRACE)
    try:
        holds = watcher._holds
        assert holds.session() and holds.take(424242) is not None
        assert key_held(pg_url, 424242)
        holds._closed.set()  # the thread stops looking: as a stalled process's would
        wait_until(lambda: not key_held(pg_url, 424242), timeout=30,
                   what="the stalled holder's key to go")
    finally:
        watcher.close()


def test_closing_the_holds_is_bounded_while_a_round_trip_hangs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """R61 #3: a round trip under way on a cut network holds the holds' lock; close waited for
    it for ever. It waits CLOSE_WAIT_SECONDS, then closes the connection from its own thread."""
    from handoffd.backends.postgres import holds as holds_module
    monkeypatch.setattr(holds_module, "CLOSE_WAIT_SECONDS", 0.2)
    holds = holds_module.KeyHolds("postgresql://unused", time.monotonic)
    closed: list[bool] = []

    class Hung:
        def close(self) -> None:
            closed.append(True)

    holds._conn = Hung()  # type: ignore[assignment]
    holds._lock.acquire()  # (a round trip under way, never answered)
    try:
        holds.close()
    finally:
        holds._lock.release()
    assert closed == [True]
    assert holds.session() == 0  # closed: never a new session (R61: a racing sweep opened one)


def test_at_its_key_bound_a_watcher_never_takes_an_unheld_owner_over(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """R65 #1: a watcher holding MAX_HELD keys (its session had) fell back to the watch without
    a key, and took a flapping owner's claim over beside it. At the bound such a claim is
    judged by its lease (which a live owner renews)."""
    from handoffd.backends.postgres import holds as holds_module
    clock = [0.0]
    key = dead_owner(pg_url)
    watcher = watching(pg_url, clock)
    try:
        monkeypatch.setattr(holds_module, "MAX_HELD", 0)  # (as with 1,000 other keys held)
        assert watcher.expired_claims(at(2), 600) == []
        assert not watcher._holds.sessionless()  # (a session is had)
        clock[0] = 1.5
        sql(pg_url, "SELECT pg_advisory_lock(%s)", key)  # the owner, back a moment
        assert watcher.expired_claims(at(3), 600) == []
    finally:
        watcher.close()


def test_a_watch_whose_hold_was_lost_starts_afresh(pg_url: str) -> None:
    """R65 #2: a hold lost with its session (and no new one to be had) left its since for the
    watch without a key: the claim was taken over at the first look after the loss."""
    clock = [0.0]
    key = dead_owner(pg_url)
    watcher = watching(pg_url, clock)
    try:
        assert watcher.expired_claims(at(2), 600) == []  # the key taken at 0
        pid = watcher._holds.pid
        assert pid and key_held(pg_url, key)
        sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", pid)
        watcher._holds.url = "postgresql://nobody@127.0.0.1:1/nowhere"  # no new session
        clock[0] = 1.2  # the first look since the hold was lost
        assert watcher.expired_claims(at(3), 600) == []
        clock[0] = 1.2 + GRACE  # a whole grace of looks without the key: taken over
        assert [c.id for c in watcher.expired_claims(at(4), 600)] == ["h1"]
    finally:
        watcher.close()
