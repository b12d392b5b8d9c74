"""The CLI in a hostile environment (helper F9, review R21): a stdout that takes no UTF-8, a state
folder that cannot be looked into, a --root that loops or is a file, a closed stdout, few
descriptors, no memory. Each is one stderr line and a documented exit code, never a traceback;
what was done is said (a created handoff's id is printed)."""
from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, exe

from handoffd.cli import basics, quick
from handoffd.core.errors import UsageError
from handoffd.core.workspace import resolve_root

QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}
FULL = {**QUICK, "HANDOFFD_FULL_CLI": "1"}
NOTE = "h\u00e9llo \u2713 \u00e5"  # latin-1 cannot carry the check mark; ASCII none of them


def run(ws: Workspace, *args: str, env: dict[str, str] | None = None,
        **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """``handoff ARGS --root WS``, its output kept as bytes (the encoding is under test)."""
    return subprocess.run([exe("handoff"), *args, "--root", str(ws.root)], capture_output=True,
                          timeout=60, env=env or QUICK, **kwargs)


def clean_exit(proc: subprocess.CompletedProcess[bytes], code: int = 0) -> None:
    """``proc`` exited ``code`` with no traceback nor internal error."""
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "internal error" not in err, err
    assert proc.returncode == code, (proc.returncode, err)


@pytest.fixture
def accented(ws: Workspace) -> Workspace:
    """``ws`` holding the handoff ``n1`` from the agent ``@zo\u00eb`` with non-ASCII data."""
    ws.create("--to", "@x", "--from", "@zo\u00eb", "--id", "n1", "--data",
              json.dumps({"m": NOTE}))
    return ws


# ---------------------------------------------------------------- 1: stdout's encoding
ENCODINGS = {  # name -> (the environment's changes, the encoding stdout then has)
    "ascii": ({"PYTHONIOENCODING": "ascii"}, "ascii"),
    "latin-1": ({"PYTHONIOENCODING": "latin-1"}, "latin-1"),
    "C-locale": ({"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}, "ascii"),
}


def environment(name: str, *, full: bool = False) -> tuple[dict[str, str], str]:
    changes, encoding = ENCODINGS[name]
    env = {k: v for k, v in (FULL if full else QUICK).items()
           if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LANG", "LANGUAGE")
           and not k.startswith("LC_")}
    return {**env, **changes}, encoding


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("command", [("ls",), ("show", "n1")], ids=["ls", "show"])
def test_human_output_on_a_stdout_that_takes_no_utf8(accented: Workspace, name: str,
                                                     command: tuple[str, ...]) -> None:
    env, encoding = environment(name)
    proc = run(accented, *command, env=env)
    clean_exit(proc)
    out = proc.stdout.decode(encoding)  # (what the stream could carry, whole)
    assert "n1" in out and "@zo" in out
    if encoding == "ascii":
        # the character shown as an escape (the table's \\xeb, the document's JSON \\u00eb),
        # and the output goes on
        assert "@zo\\xeb" in out or "@zo\\u00eb" in out


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("command", [("ls", "--json"), ("show", "n1", "--json")],
                         ids=["ls", "show"])
def test_json_on_a_stdout_that_takes_no_utf8_is_the_same_json(
        accented: Workspace, name: str, command: tuple[str, ...]) -> None:
    env, encoding = environment(name)
    proc = run(accented, *command, env=env)
    clean_exit(proc)
    assert proc.stdout.isascii()  # every non-ASCII character a \\u escape
    wanted = run(accented, *command)  # (on UTF-8)
    clean_exit(wanted)
    assert json.loads(proc.stdout.decode(encoding)) == json.loads(wanted.stdout.decode("utf-8"))
    assert "@zo\u00eb" in json.dumps(json.loads(proc.stdout), ensure_ascii=False)


def test_the_full_command_line_takes_no_utf8_too(accented: Workspace) -> None:
    env, _ = environment("ascii", full=True)
    proc = run(accented, "show", "n1", "--json", env=env)
    clean_exit(proc)
    assert json.loads(proc.stdout)["document"]["input"]["data"]["m"] == NOTE


# ---------------------------------------------------------------- 2: a folder not looked into
def test_a_folder_that_cannot_be_looked_into_is_no_missing_handoff(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ws.create("--to", "@x", "--id", "p4")
    eng = basics.engine(ws.root, features=())
    real = os.lstat
    pending = str(ws.root / "handoffs" / "pending")
    failing = {"code": errno.EACCES}

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith(pending + os.sep):  # (pending/ chmod 0000, as any user but root)
            raise OSError(failing["code"], os.strerror(failing["code"]), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", lstat)
    for code in (errno.EACCES, errno.EPERM, errno.EIO):
        failing["code"] = code
        with pytest.raises(OSError) as raised:
            eng.backend.get("p4")
        assert raised.value.errno == code
        assert basics.exit_code("handoff", raised.value) == 1  # never 3: "it is gone"
        line = capsys.readouterr().err.strip()
        assert line.startswith("handoff: error: cannot look into pending/ for handoff p4 (")
        assert "\n" not in line
    failing["code"] = errno.ENOENT  # what is absent stays absent: NotFound, exit 3 (get: None)
    assert eng.backend.get("p4") is None
    failing["code"] = errno.ENOTDIR  # (a state folder replaced by a file)
    assert eng.backend.get("p4") is None


# ---------------------------------------------------------------- 3: bad --root values
@pytest.mark.parametrize("program,args,env", [
    ("handoff", ("ls",), QUICK), ("handoff", ("show", "x"), QUICK),
    ("handoff", ("create", "--to", "@a"), QUICK), ("handoff", ("ls",), FULL),
    ("handoffd", ("run",), QUICK), ("handoffd", ("run",), FULL)],
    ids=["ls", "show", "create", "ls-full", "run", "run-full"])
def test_a_root_that_loops_or_is_a_file_is_one_line(tmp_path: Path, program: str,
                                                    args: tuple[str, ...],
                                                    env: dict[str, str]) -> None:
    loop_a, loop_b, a_file = tmp_path / "loopA", tmp_path / "loopB", tmp_path / "afile"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    a_file.write_text("x\n")
    for root, said, code in ((loop_a, "is a symlink loop; fix --root", 2),
                             (a_file, "is not a directory; fix --root", 2),
                             (tmp_path / "none", "does not exist; create it or fix --root", 3)):
        proc = subprocess.run([exe(program), *args, "--root", str(root)],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == code, (root, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"{program}: error: workspace directory {root} {said}"], proc.stderr
    assert not (tmp_path / "none").exists()


def test_resolve_root_says_a_loop(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UsageError, match="is a symlink loop"):
        resolve_root(tmp_path / "a" / "sub")


def test_a_root_from_the_environment_names_it(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x\n")
    proc = subprocess.run([exe("handoff"), "ls"], capture_output=True, text=True, timeout=60,
                          env={**QUICK, "HANDOFFD_ROOT": str(tmp_path / "afile")})
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("is not a directory; fix $HANDOFFD_ROOT")


# ---------------------------------------------------------------- 4: a closed stdout
def close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("env", [QUICK, FULL], ids=["quick", "full"])
@pytest.mark.parametrize("command", [("ls",), ("show", "n1"), ("create", "--to", "@x")],
                         ids=["ls", "show", "create"])
def test_a_closed_stdout_is_refused_before_anything(accented: Workspace, env: dict[str, str],
                                                    command: tuple[str, ...]) -> None:
    before = sorted((accented.root / "handoffs" / "pending").iterdir())
    proc = subprocess.run([exe("handoff"), *command, "--root", str(accented.root)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=60, env=env, preexec_fn=close_stdout)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "handoff: error: stdout is closed (descriptor 1); the command's output would reach no "
        "one: run it with stdout open (e.g. >/dev/null)"]
    assert sorted((accented.root / "handoffs" / "pending").iterdir()) == before  # no create


def test_handoffd_run_needs_no_stdout(ws: Workspace) -> None:
    ws.create("--to", "@x", "--id", "r1")
    proc = subprocess.run([exe("handoffd"), "run", "--max-seconds", "5", "--root", str(ws.root)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=60, env=QUICK, preexec_fn=close_stdout)
    assert proc.returncode in (0, 1), proc.stderr  # (its batch's own exit code)
    assert "stdout is closed" not in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- 5: few descriptors, no memory
def few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (5, 5))


@pytest.mark.parametrize("args", [(), ("--depends-on", "n1")], ids=["quick", "full"])
def test_a_create_with_few_descriptors_says_its_id(accented: Workspace,
                                                   args: tuple[str, ...]) -> None:
    proc = run(accented, "create", "--to", "@x", "--id", "fd6", *args,
               preexec_fn=few_descriptors)
    clean_exit(proc)
    assert proc.stdout == b"fd6\n"
    assert (accented.root / "handoffs" / "pending" / "fd6.json").exists()
    again = run(accented, "create", "--to", "@x", "--id", "fd6", *args,
                preexec_fn=few_descriptors)
    clean_exit(again, 1)
    assert again.stderr.decode().startswith("handoff: error: handoff fd6 already exists")


def test_out_of_memory_is_one_line(ws: Workspace, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> str:
        raise MemoryError()

    monkeypatch.setattr(quick, "submit_request", no_memory)
    monkeypatch.delenv("HANDOFFD_DEBUG", raising=False)
    assert quick.try_quick(["create", "--to", "@x", "--root", str(ws.root)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "handoff: error: out of memory (raise the memory limit, e.g. `ulimit -v`)"]


def test_the_error_printer_imports_nothing() -> None:
    """What prints the last error line was imported with the command (an import at the error
    failed with no descriptor or memory left, and the error became a traceback)."""
    code = ("import builtins\n"
            "from handoffd.cli import basics\n"
            "def refuse(name, *args, **kwargs):\n"
            "    raise OSError(24, 'Too many open files', name)\n"
            "builtins.__import__ = refuse  # (any import statement from here on)\n"
            "for exc in (MemoryError(), ValueError('bug'), OSError(5, 'I/O error', 'f')):\n"
            "    assert basics.exit_code('handoff', exc) == 1\n"
            "basics.warn('careful')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=QUICK)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "handoff: error: out of memory (raise the memory limit, e.g. `ulimit -v`)",
        "handoff: error: internal error: ValueError: bug (set HANDOFFD_DEBUG=1 for a traceback)",
        "handoff: error: I/O error: f", "handoff: warning: careful"]
