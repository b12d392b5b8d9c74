"""The garbage collector of a command-line process (:mod:`handoffd.cli.collector`): ``handoff``
makes its young passes rare from its first instruction, and both console scripts freeze what is
alive as they end, whichever way they end; collection stays on for a long command, and the
daemon's (``handoffd``) young passes keep CPython's threshold. Checked in a fresh interpreter:
what the collector was set to, and what it did, while each command ran."""
from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

from handoffd.cli import collector
from handoffd.core.workspace import Workspace

PROBE = """
import gc, json, sys
kind, *argv = sys.argv[1:]
passes = []
gc.callbacks.append(lambda phase, info: phase == 'start' and passes.append(info['generation']))
if kind == 'handoff':
    from handoffd.cli.entry import handoff as main
else:
    from handoffd.cli.handoffd_cmd import main
sys.argv = [kind, *argv]
code = 0
try:
    main()
except SystemExit as exc:
    code = exc.code
print('REPORT', json.dumps({'code': code, 'threshold': gc.get_threshold(),
                            'frozen': gc.get_freeze_count(), 'enabled': gc.isenabled(),
                            'passes': passes}))
"""


def probe(*argv: str) -> dict[str, Any]:
    """Run a console script's entry in a fresh interpreter; its exit code and its collector."""
    proc = run_python(PROBE, *argv)
    said, _, report = proc.stdout.partition("REPORT")
    assert report, proc.stderr
    found: dict[str, Any] = json.loads(report)
    found["stdout"] = said
    return found


@pytest.mark.parametrize("code, argv", [
    (0, ("handoff", "create", "--to", "@echo", "--data", "{}")),
    (0, ("handoff", "ls", "--state", "pending")),
    (3, ("handoff", "show", "hoff-20261128000000-aaaaaaaaaaaa")),  # refused: not found
    (0, ("handoff", "--version")),  # the full command line
    (0, ("handoffd", "run", "-q")),
    (0, ("handoffd", "sweep")),  # the full command line
])
def test_each_command_runs_with_rare_young_passes_and_freezes_as_it_ends(
        tmp_path: Path, code: int, argv: tuple[str, ...]) -> None:
    """Whatever the command and its end (done, refused, the full command line), the young
    threshold is the command's and what was alive at its end is frozen; the collector is on."""
    root = tmp_path / "ws"
    Workspace(root).ensure()
    kind, *rest = argv
    report = probe(kind, *rest, *(["--root", str(root)] if rest[0] != "--version" else []))
    assert report["code"] == code, report
    assert report["frozen"] > 1000  # (the modules' objects: thousands)
    assert report["enabled"] is True
    if kind == "handoff":
        assert report["threshold"][0] == collector.YOUNG_THRESHOLD
        # a start makes a handful of young passes, not the dozens of the default threshold
        assert len(report["passes"]) < 15, report["passes"]
    else:  # (a daemon's failed attempts leave cycles: collected at CPython's pace, R-RB)
        assert report["threshold"][0] == 700  # (CPython's own)
    if argv[1] == "create":
        assert report["stdout"].strip().startswith("hoff-")
        assert len(list((root / "handoffs" / "pending").iterdir())) == 1


def test_a_long_command_still_collects_its_cycles() -> None:
    """Collection stays on: cyclic garbage made after the start is collected, in rounds of
    :data:`~handoffd.cli.collector.YOUNG_THRESHOLD` allocations."""
    before = gc.get_threshold()
    try:
        collector.for_a_command()
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, *before[1:])

        class Node:
            def __init__(self) -> None:
                self.me = self

        import weakref
        probes = [weakref.ref(Node()) for _ in range(collector.YOUNG_THRESHOLD * 3)]
        # (three thresholds' worth of cycles: the young passes took most of them already)
        assert sum(ref() is None for ref in probes) > collector.YOUNG_THRESHOLD
    finally:
        gc.set_threshold(*before)
