"""The worked example in examples/two_agents runs end to end (a daemon and the planner agent),
and again idempotently."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import Workspace

EXAMPLE = Path(__file__).parent.parent / "examples" / "two_agents"


def test_two_agents_example(tmp_path: Path) -> None:
    root = tmp_path / "two_agents"
    shutil.copytree(EXAMPLE, root)
    ws = Workspace(root)
    daemon = ws.serve()
    try:
        for _ in range(2):  # the second run finds its handoffs done: same answers, nothing new
            proc = subprocess.run([sys.executable, "planner.py"], cwd=root, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "double-py: python: def double(x):" in proc.stdout
            assert "triple-any: python: def triple(x):" in proc.stdout
    finally:
        assert ws.stop(daemon) == 0
    assert sorted(p.stem for p in (root / "handoffs" / "completed").glob("*.json")) == [
        "double-py", "triple-any"]
