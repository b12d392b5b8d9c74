"""A create that names dependencies and a retention pass take turns (review 14f): a completed
dependency was purged between a create's check ("it exists") and its write, the purge's look at
live work having come before the new pending document, and the dependent failed
DEPENDENCY_MISSING though what it depended on had completed."""
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
