"""What every ``handoff`` and ``handoffd`` start loads before its own work.

Almost all of a one-shot command's CPU, and of an empty ``handoffd run``'s, is importing: the
modules it loads and what their bodies do once loaded. Code that only some configurations or
inputs need is kept off that path: the retention and file-bridge features when nothing asks for
them, the shared context until a handler asks for it, the board of a batch spread over
processes, and the regexes of artifact references and of contract paths. These tests are guards
against those coming back, each checked in a fresh interpreter through ``sys.modules``; none
measures time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

from handoffd.core.workspace import Workspace

QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}  # (the quick path)
# runs a command line in this interpreter, then reports what it loaded and defined
PROBE = """
import json, sys
kind, root, *argv = sys.argv[1:]
if kind == 'handoff':
    from handoffd.cli.entry import handoff as main
else:
    from handoffd.cli.handoffd_cmd import main
sys.argv = [kind, *argv, '--root', root]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
caches = {}
for name, attr in (('handoffd.features.contracts.patterns', '_surrogates'),
                   ('handoffd.features.artifact_paths', 'patterns')):
    if name in sys.modules:  # (patterns compiled on first use: how many so far)
        cached = getattr(sys.modules[name], attr, None)
        caches[name] = cached.cache_info().currsize if cached else 'compiled at import'
print('REPORT', json.dumps({'code': code, 'modules': sorted(sys.modules),
                            'caches': caches}))
"""


def probe(kind: str, root: Path, *argv: str) -> dict[str, Any]:
    """Run ``kind`` (``handoff`` or ``handoffd``) with ``argv`` on the workspace ``root`` in a
    fresh interpreter; what it loaded (see PROBE), and its exit code."""
    proc = run_python(PROBE, kind, str(root), *argv, env=QUICK)
    said, _, report = proc.stdout.partition("REPORT")
    assert report, proc.stderr
    found: dict[str, Any] = json.loads(report)
    found["stdout"] = said
    return found


def test_an_empty_batch_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    """Without ``[retention]`` and on the files store, an empty `handoffd run` loads neither
    retention (nor the archive it writes) nor the PostgreSQL file bridge, nor the shared
    context (no handler asked for ``ctx.context``), nor the board of a batch spread over
    processes (it ran on one), and compiles none of the regexes of artifact references and
    contract paths (no artifact, no path was looked at)."""
    root = tmp_path / "ws"
    root.mkdir()
    report = probe("handoffd", root, "run", "-q")
    assert report["code"] == 0
    loaded = set(report["modules"])
    assert not loaded & {"handoffd.features.retention", "handoffd.features.archive",
                         "handoffd.features.liverefs", "handoffd.features.filebridge",
                         "handoffd.features.context", "handoffd.backends.files.context",
                         "handoffd.service.board"}
    assert {"handoffd.features.contracts.feature", "handoffd.features.artifacts"} <= loaded
    assert report["caches"] == {"handoffd.features.contracts.patterns": 0,
                                "handoffd.features.artifact_paths": 0}


def test_retention_loads_when_configured(tmp_path: Path) -> None:
    """With ``[retention]``, the same batch loads it, and its sweep hook is installed."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "handoffd.toml").write_text('[retention]\ncompleted = "7d"\n')
    report = probe("handoffd", root, "run", "-q")
    assert report["code"] == 0
    assert "handoffd.features.retention" in report["modules"]

    from handoffd.features.build import build_engine
    hooks = [hook.__qualname__ for hook in build_engine(Workspace(root)).on_sweep]
    assert "install.<locals>.apply" in hooks, hooks
    (root / "handoffd.toml").write_text("")
    hooks = [hook.__qualname__ for hook in build_engine(Workspace(root)).on_sweep]
    assert "install.<locals>.apply" not in hooks, hooks


def test_a_handler_asking_for_the_context_loads_it(tmp_path: Path) -> None:
    """The context store is made at a handler's first ``ctx.context``, once per engine, with
    the configuration's permissions: what the handler reads and writes is the workspace's."""
    from handoffd.core.errors import HandlerError
    from handoffd.features.build import build_engine

    root = tmp_path / "ws"
    root.mkdir()
    (root / "handoffd.toml").write_text('[namespaces."notes"]\nwriters = ["@w"]\n')
    engine = build_engine(Workspace(root))
    assert len(engine.before_run) >= 1
    views = []

    class Job:  # (what give_view touches of a job)
        class context:
            context_factory: Any = None

    for hook in engine.before_run:
        if hook.__qualname__ == "install_context.<locals>.give_view":
            hook(Job)  # type: ignore[arg-type]
            views.append(Job.context.context_factory(root, "@w", "h1"))
            views.append(Job.context.context_factory(root, "@other", "h2"))
    writer, other = views
    writer.set("notes/a", {"n": 1})
    assert json.loads((root / "context" / "notes" / "a.json").read_text()) == {"n": 1}
    assert other.get("notes/a") == {"n": 1}
    with pytest.raises(HandlerError):
        other.set("notes/b", 1)  # (not a writer of notes/)


def test_the_file_bridge_is_installed_on_a_store_that_ingests(tmp_path: Path) -> None:
    """The file bridge is installed exactly where its own install would act: on a store that
    ingests dropped files (PostgreSQL's), not on the others."""
    from handoffd.backends.memory import MemoryBackend
    from handoffd.core.config import Config
    from handoffd.core.specialists import Registry
    from handoffd.features.build import build_engine

    class Ingesting(MemoryBackend):
        def ingest(self, *args: Any, **kwargs: Any) -> None:
            """Stands for the PostgreSQL store's ingest (never called here)."""

    ws = Workspace(tmp_path)
    ws.ensure()
    for backend, plugins in ((MemoryBackend(), 0), (Ingesting(), 1)):
        eng = build_engine(ws, Config(), Registry(), backend=backend, features=["filebridge"])
        assert len(eng.daemon_plugins) == plugins
