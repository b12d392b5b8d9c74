"""What a new user hit in their first hour (review R38, session 24), fixed in the lead's files.

1. Specialists declared under DESIGN.md's entry-point group, ``handoffd.specialists``, were
   silently ignored: a refactor had renamed the group the code reads to
   ``handoffd.core.specialists`` (and the docs with it). Both are read now, the contract's last.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import exe, new_workspace
from test_core import _fake_distribution

from handoffd.core.config import Config
from handoffd.core.specialists import Registry

HANDLERS = '''
def echo(handoff, ctx):
    return {"status": "completed", "output": {"by": "contract"}}

def legacy(handoff, ctx):
    return {"status": "completed", "output": {"by": "legacy"}}
'''


@pytest.mark.parametrize("group,by", [("handoffd.specialists", "contract"),
                                      ("handoffd.core.specialists", "legacy")])
def test_a_specialist_declared_as_an_entry_point_runs(tmp_path: Path, group: str,
                                                       by: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "epdemo.py").write_text(HANDLERS)
    _fake_distribution(site, f"[{group}]\n@ep = epdemo:{'echo' if by == 'contract' else by}\n")
    ws = new_workspace(tmp_path / "ws", "[daemon]\nsettle_seconds = 0.0\n")
    try:
        hid = ws.create("--to", "@ep", "--data", "{}")
        env = {**os.environ, "PYTHONPATH": str(site)}
        done = subprocess.run([exe("handoffd"), "run", "--root", str(ws.root)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert ws.state_of(hid) == ["completed"], done.stderr
        assert ws.doc(hid)["output"] == {"by": by}
    finally:
        ws.cleanup()


def test_the_contract_group_wins_over_the_old_name(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_distribution(tmp_path, "[handoffd.core.specialists]\n@ep = epdemo:legacy\n", "old")
    _fake_distribution(tmp_path, "[handoffd.specialists]\n@ep = epdemo:echo\n", "new")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    registry = Registry.load(Config())
    assert registry.specialists["@ep"].config.handler == "epdemo:echo"


@pytest.mark.parametrize("args", [["wait", "x", "--timeout", "1"], ["show", "x"], ["ls"]])
def test_a_command_run_outside_a_workspace_is_not_found(tmp_path: Path, args: list[str]) -> None:
    """Review R38: outside a workspace every command exited 1, which `wait` uses for "the
    handoff failed": a script run from the wrong directory took the handoff for failed."""
    done = subprocess.run([exe("handoff"), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k != "HANDOFFD_ROOT"})
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "is not a handoffd workspace" in done.stderr and "Traceback" not in done.stderr


def test_workers_on_the_command_line_are_bounded_as_in_the_config(tmp_path: Path) -> None:
    """Review R38: `--workers 99999999999999999999` started a daemon; the config caps 1024."""
    ws = new_workspace(tmp_path / "ws", "")
    for value in ("99999999999999999999", "1025"):
        done = ws.handoffd("run", "--workers", value, timeout=60)
        assert done.returncode == 2 and "1<=x<=1024" in done.stderr, done.stderr


def test_retry_of_an_id_also_among_all_failed_retries_it_once(tmp_path: Path) -> None:
    """Review R38: `handoff retry s1 --all-failed` retried s1 twice and exited 1."""
    ws = new_workspace(tmp_path / "ws", f"""
[daemon]
settle_seconds = 0.0
[retry]
max_retries = 0
[specialists."@no"]
command = ["{sys.executable}", "-S", "-c", "import sys; sys.exit(3)"]
""")
    hid = ws.create("--to", "@no", "--data", "{}")
    ws.handoffd("run", timeout=60)
    assert ws.state_of(hid) == ["failed"]
    done = ws.handoff("retry", hid, hid, "--all-failed")
    assert done.returncode == 0, done.stderr
    assert ws.state_of(hid) == ["pending"]


def test_resuming_an_agent_that_is_not_paused_says_so(tmp_path: Path) -> None:
    """Review R38: `handoff resume @codr` (misspelt) listed @coder's pause, exit 0, silent."""
    ws = new_workspace(tmp_path / "ws", "")
    ws.handoff("pause", "@coder", check=True)
    done = ws.handoff("resume", "@codr", check=True)
    assert "@codr was not paused" in done.stderr and "@coder" in done.stdout
    done = ws.handoff("resume", "@coder", check=True)
    assert "not paused" not in done.stderr and done.stdout.strip() == "nothing is paused"


def test_validate_a_file_that_does_not_exist_is_not_found_not_invalid(tmp_path: Path) -> None:
    """Review R38: a missing file was "invalid (unknown format)", exit 1, as if the document
    were at fault; and every error line with no schema path ended in `  []`."""
    ws = new_workspace(tmp_path / "ws", "")
    done = ws.handoff("validate", str(tmp_path / "nope.json"))
    assert done.returncode == 3 and "invalid" not in done.stdout, done.stdout
    (tmp_path / "bad.json").write_text('{"x": 1}')
    done = ws.handoff("validate", str(tmp_path / "bad.json"))
    assert done.returncode == 1 and "[]" not in done.stdout, done.stdout


def test_a_long_note_keeps_what_to_do_about_it() -> None:
    """Review R38: `handoff ls` cut notes at 120 characters: "...; answer with `hando..."."""
    from handoffd.cli.render import short_note
    note = "waiting for an answer: " + "which store? " * 30 + "; `handoff answer h1 --input F`"
    cut = short_note(note)
    assert len(cut) <= 160 and cut.endswith("; `handoff answer h1 --input F`"), cut
    assert short_note("x" * 300).endswith("...") and len(short_note("x" * 300)) == 160


def test_validate_a_folder_or_a_fifo_is_a_usage_error_not_an_invalid_document(
        tmp_path: Path) -> None:
    """Review R40: a folder, a FIFO or /dev/null was "invalid (unknown format)", exit 1."""
    ws = new_workspace(tmp_path / "ws", "")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (str(fifo), "/dev/null", str(tmp_path)):
        done = ws.handoff("validate", target, timeout=30)
        assert done.returncode == 2 and "not a regular file" in done.stdout, done.stdout
        assert "invalid" not in done.stdout
