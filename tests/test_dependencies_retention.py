"""Dependencies and retention (reviews 14f and 14g). A create that names dependencies and a
retention pass take turns: a completed dependency was purged between a create's check ("it
exists") and its write, the purge's look at live work having come before the new pending
document, and the dependent failed DEPENDENCY_MISSING though what it depended on had completed.
A dependency that retention removed is named so: it read "which does not exist; create it
first", though it had existed and completed (the seen-ids record knows such an id; one never
created still reads "create it first"). The removal lock is flock only: no marker file a kill -9
leaves behind."""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from conftest import Workspace, exe
from filelock import FileLock, Timeout

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace as HandoffdWorkspace


REMOVED = "which existed but was removed by retention (archived or purged)"


def _engine(root: Path) -> Any:
    """An engine over ``root`` holding the completed handoff ``dep``."""
    from handoffd import build_engine
    ws = HandoffdWorkspace(root)
    ws.ensure()
    engine = build_engine(ws, ws.load_config())
    engine.backend.create({"handoff_id": "dep", "source": {"agent_id": "@o"},
                           "target": {"agent_id": "@a"}, "input": {"data": {}}}, "dep", utc_now())
    held = engine.backend.claim("dep", utc_now(), 60)
    assert held is not None and engine.backend.finish(held, State.COMPLETED, held.doc)
    return engine


def test_a_purge_never_lands_between_a_dependents_check_and_its_write(tmp_path: Path) -> None:
    from handoffd.features import retention
    engine = _engine(tmp_path)
    at_write, go = threading.Event(), threading.Event()
    real_create = getattr(engine.backend, "inner", engine.backend).create  # (the store's own)

    def slow_create(*args: Any, **kwargs: Any) -> Any:
        at_write.set()  # checked: `dep` exists; the write waits until the purge had its chance
        assert go.wait(30)
        return real_create(*args, **kwargs)
    engine.backend.create = slow_create
    made: list[str] = []
    creating = threading.Thread(target=lambda: made.append(engine.submit(
        {"handoff_id": "after", "source": {"agent_id": "@o"}, "target": {"agent_id": "@a"},
         "input": {"data": {}}, "depends_on": ["dep"]})))
    creating.start()
    assert at_write.wait(30)
    later = utc_now().replace(year=utc_now().year + 1)
    during = retention.expire(engine, older_than={State.COMPLETED: 0}, now=later, wait=0)
    assert during.busy and during.removed == []  # the create holds the turn: nothing purged
    go.set()
    creating.join(30)
    assert made == ["after"]
    after = retention.expire(engine, older_than={State.COMPLETED: 0}, now=later, wait=5)
    assert after.kept == {"dep": "pending after depends on it"}
    assert engine.backend.get("dep")[0] is State.COMPLETED
    engine.backend.close()


def test_a_create_with_dependencies_waits_for_a_pass_and_a_plain_one_does_not(
        ws: Workspace) -> None:
    done = ws.create("--to", "@flaky", "--data", '{"mode": "ok"}')
    assert ws.handoffd("run").returncode == 0
    lock = FileLock(str(ws.root / "handoffs/.meta/retention.lock"))
    turn = FileLock(str(ws.root / "handoffs/.meta/retention.turn"))
    with lock:  # a retention pass under way
        assert ws.handoff("create", "--to", "@flaky", "--data", "{}").returncode == 0
        waiter = subprocess.Popen([exe("handoff"), "create", "--to", "@flaky", "--depends-on",
                                   done, "--root", str(ws.root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while True:  # until the create holds the turn: it waits for the pass
            assert waiter.poll() is None and time.monotonic() < deadline
            try:
                turn.acquire(timeout=0)
            except Timeout:
                break
            turn.release()
            time.sleep(0.02)
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
    assert ws.state_of(out.strip()) == ["pending"]


def test_a_create_on_an_archived_completed_dependency_is_taken(ws: Workspace) -> None:
    """An archived dependency that completed counts as completed (session 16: it was refused
    as removed); one that never existed is still refused."""
    _engine(ws.root).backend.close()
    ws.handoff("archive", "--older-than", "0s", check=True)
    made = ws.handoff("create", "--to", "@a", "--data", "1", "--depends-on", "dep")
    assert made.returncode == 0 and REMOVED not in made.stderr, made
    never = ws.handoff("create", "--to", "@a", "--data", "1", "--depends-on", "nosuch")
    assert never.returncode != 0 and "nosuch, which does not exist; create it first" in \
        never.stderr, never.stderr


def test_the_gate_says_a_purged_dependency_was_removed(tmp_path: Path) -> None:
    """A document arriving from outside that names a purged dependency fails as removed."""
    from handoffd.core.errors import ErrorCode
    from handoffd.features import retention
    from handoffd.features.dependencies import Graph, dependencies_gate
    engine = _engine(tmp_path)
    later = utc_now().replace(year=utc_now().year + 1)
    assert retention.expire(engine, older_than={State.COMPLETED: 0}, now=later).removed
    doc = {"handoff_id": "after", "source": {"agent_id": "@o"}, "target": {"agent_id": "@a"},
           "input": {"data": {}}, "depends_on": ["dep", "nosuch"]}
    verdict = dependencies_gate(Graph(engine), engine.formats.detect(doc).envelope(doc))
    assert verdict is not None and verdict.code == ErrorCode.DEPENDENCY_MISSING
    assert f"after depends on dep, {REMOVED}" in str(verdict.reason), verdict
    engine.backend.close()


def test_the_removal_lock_never_falls_back_to_a_marker_file(tmp_path: Path,
                                                            monkeypatch: Any) -> None:
    """A soft lock (a marker file) that a kill -9 leaves behind, written from another host, is
    never judged stale: every create with dependencies would wait a minute and fail, for ever.
    The removal lock is flock only."""
    import filelock

    from handoffd.features.removal import removal_lock
    made: list[Any] = []
    real = filelock.FileLock

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("fallback_to_soft", True))
        return real(*args, **kwargs)
    monkeypatch.setattr(filelock, "FileLock", recorded)
    with removal_lock(tmp_path, 5) as mine:
        assert mine
    assert made == [False, False]
