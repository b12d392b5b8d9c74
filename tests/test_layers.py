"""The package's layers: imports point down only, and the core imports no feature.

Every import counts: at module level, inside ``if TYPE_CHECKING:`` and inside functions.
Also: every feature can be left out (a bare engine runs a plain handoff end to end)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from handoffd import (
    Daemon,
    Registry,
    State,
    Workspace,
    build_engine,
    new_native_request,
)
from handoffd.core.config import Config
from handoffd.features.build import FEATURES

PACKAGE = Path(__file__).resolve().parent.parent / "handoffd"

# The layers, lowest first: a module may import its own layer and the layers below it only.
LAYERS = {"core": 0, "backends": 1, "dialects": 1, "features": 2, "service": 3, "cli": 4}
# Modules of the files backend: the only place that knows the file protocol's mechanics.
FILE_SYSTEM = "handoffd.backends.files"

# Edges the layers forbid that are still there, each as (importer, imported) with a comment
# saying why. Keep it empty.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool,
             known: dict[str, Path]) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        for alias in node.names:  # `from . import x` imports the submodule x when there is one
            candidate = f"{prefix}.{alias.name}"
            names.append(candidate if candidate in known else prefix)
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != "handoffd" and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(module, node, path.name == "__init__.py", known)
        graph[module] = {t for t in edges if (module, t) not in ALLOWED}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_point_down_only() -> None:
    """core <- backends, dialects <- features <- service <- cli (TYPE_CHECKING imports count)."""
    graph = import_graph()
    bad = sorted(f"{module} -> {target}" for module, targets in graph.items()
                 for target in targets
                 if (low := _layer(module)) is not None and (high := _layer(target)) is not None
                 and high > low)
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_backends_and_dialects_do_not_import_each_other() -> None:
    graph = import_graph()
    bad = sorted(f"{module} -> {target}" for module, targets in graph.items()
                 for target in targets if {_part(module), _part(target)} == {"backends", "dialects"})
    assert not bad, "\n".join(bad)


def test_the_core_imports_no_file_system_module() -> None:
    graph = import_graph()
    bad = sorted(f"{module} -> {target}" for module, targets in graph.items()
                 if module.startswith("handoffd.core") for target in targets
                 if target.startswith(FILE_SYSTEM))
    assert not bad, "the core imports the files backend:\n" + "\n".join(bad)


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "handoffd.core.engine" in graph["handoffd.features.dependencies"]  # module level
    assert "handoffd.core.engine" in graph["handoffd.features.aggregation"]  # under TYPE_CHECKING
    assert "handoffd.dialects" in graph["handoffd.features.contracts.feature"]  # inside a function
    assert "handoffd.dialects.base" in graph["handoffd.dialects"]  # from .base import ...
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _echo(handoff: dict, ctx: Any) -> dict:
    return {"status": "completed", "output": {"echo": ctx.data}}


def _plain_run(root: Path, features: tuple) -> dict:
    ws = Workspace(root)
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@echo", _echo, config=config)
    engine = build_engine(ws, config, registry, features=features)
    doc = new_native_request(source="@test", target="@echo", data={"n": 1}, now=engine.clock(),
                             handoff_id="plain-1")
    engine.backend.store.create(doc, "plain-1", now=engine.clock())
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert report.completed == 1, report.line()
    state, answer = engine.backend.store.get("plain-1")
    assert state is State.COMPLETED
    return answer


def test_a_bare_engine_runs_a_plain_handoff(tmp_path: Path) -> None:
    engine = build_engine(Workspace(tmp_path), Config(), Registry(), features=())
    assert not engine.gates and not engine.resumers and not engine.filers
    assert not engine.on_sweep and not engine.daemon_plugins
    answer = _plain_run(tmp_path, ())
    assert answer["output"] == {"echo": {"n": 1}}


def test_each_feature_can_be_left_out(tmp_path: Path) -> None:
    for name in FEATURES:
        rest = tuple(f for key, f in FEATURES.items() if key != name)
        answer = _plain_run(tmp_path / name, rest)
        assert answer["output"] == {"echo": {"n": 1}}, name


def test_a_feature_can_plug_into_the_daemon(tmp_path: Path) -> None:
    """The daemon's plugin API, used by a feature the package does not know: a scan hook, a
    message handler that files a document itself, and a filed hook."""
    ws = Workspace(tmp_path)
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@echo", _echo, config=config)
    scans: list[int] = []
    filed: list[tuple[str, State]] = []

    def is_ping(doc: dict[str, Any] | None) -> bool:
        return isinstance(doc, dict) and doc.get("input") == {"data": {"ping": True}}

    def answer_ping(engine: Any, handoff_id: str) -> State | None:
        claimed = engine.claim(handoff_id)
        if claimed is None:
            return None
        claim, dialect = claimed
        outcome = engine.failure(engine.clock(), "CANCELLED", "pings are never run",
                                 retryable=False)
        return engine.file(claim, dialect, None, outcome)

    def plugin(daemon: Any) -> None:
        daemon.add_scan_hook(lambda: scans.append(1))
        daemon.add_message_handler(is_ping, answer_ping)
        daemon.add_filed_hook(lambda handoff_id, where: filed.append((handoff_id, where)))

    def feature(engine: Any) -> None:
        engine.daemon_plugins.append(plugin)

    engine = build_engine(ws, config, registry, features=(feature,))
    for handoff_id, data in (("ping-1", {"ping": True}), ("plain-2", {"n": 2})):
        doc = new_native_request(source="@test", target="@echo", data=data, now=engine.clock(),
                                 handoff_id=handoff_id)
        engine.backend.store.create(doc, handoff_id, now=engine.clock())
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert (report.completed, report.failed) == (1, 1), report.line()
    assert scans
    assert sorted(filed) == [("ping-1", State.FAILED), ("plain-2", State.COMPLETED)]
    assert engine.backend.store.get("ping-1")[1]["error"]["code"] == "CANCELLED"


def test_without_the_context_feature_ctx_context_says_so(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@ctx", lambda handoff, ctx: {"status": "completed",
                                                         "output": {"v": ctx.context.get("a/b")}},
                          config=config)
    engine = build_engine(ws, config, registry, features=())
    doc = new_native_request(source="@test", target="@ctx", data={}, now=engine.clock(),
                             handoff_id="ctx-1")
    engine.backend.store.create(doc, "ctx-1", now=engine.clock())
    Daemon(engine, workers=1, watch=False).run_batch()
    state, answer = engine.backend.store.get("ctx-1")
    assert state is State.FAILED
    assert "context" in answer["error"]["message"]


def test_the_front_door_is_small_and_lazy() -> None:
    """`import handoffd` exports about a dozen names and loads none of the engine (a CLI start or
    a library user pays only for what it uses); every exported and legacy name still resolves."""
    import subprocess
    import sys

    import handoffd
    assert len(handoffd.__all__) <= 14
    for name in [*handoffd.__all__, *handoffd._HOME]:
        assert getattr(handoffd, name) is not None, name
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, handoffd; print(sorted(m for m in sys.modules "
         "if m.startswith(('handoffd.', 'jsonschema', 'watchdog', 'typer', 'rich'))))"],
        capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
