"""A dependency that retention removed is named so (review 14g): `handoff create --depends-on`
on a handoff just archived or purged said "which does not exist; create it first", though it
had existed and completed. The seen-ids record knows such an id; one never created still reads
"create it first". The removal lock is flock only: no marker file a kill -9 leaves behind."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import Workspace

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


def test_a_create_on_an_archived_dependency_says_it_was_removed(ws: Workspace) -> None:
    _engine(ws.root).backend.close()
    ws.handoff("archive", "--older-than", "0s", check=True)
    made = ws.handoff("create", "--to", "@a", "--data", "1", "--depends-on", "dep")
    assert made.returncode != 0 and len(made.stderr.strip().splitlines()) == 1, made
    assert REMOVED in made.stderr and "create it first" not in made.stderr, made.stderr
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
