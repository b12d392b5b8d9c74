"""What the resource-exhaustion fixes of review R21 left (helper F13, session 20).

* An isolated Python handler (core/isolation.py) whose child cannot be started for a passing
  shortage (EMFILE, ENFILE, EAGAIN, ENOMEM; a thread that cannot start) is marked not started,
  as a command handler is, so its claim is handed back uncounted; nothing leaks (descriptors,
  the process record, a zombie).
* A warning that cannot be logged for want of descriptors (``import logging`` or the handler's
  own work failing) is one plain line on stderr, not a "--- Logging error ---" traceback; the
  daemon's text formatter imports nothing at its first line.
* ``handoff create`` whose seen-ids record runs out of memory after the document is placed
  warns and succeeds (the handoff exists).
* The violations log and the context history check what a write stored (a full disk's short
  write is ENOSPC, and the next line starts on its own).
* ``--log-format json`` lines stay JSON on a stderr that is not UTF-8.
* A stop signal that comes while ``serve`` or ``run`` starts is held, and the daemon stops as
  on any first signal: nothing claimed, exit 0.
"""
from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import Clock, exe, new_workspace, wait_until
from test_start_shortage_s20 import FailFirst, _children, _fds, _settled_fds  # (the same probes)

from handoffd import Registry, Workspace, build_engine
from handoffd.backends.files.context import FileContext
from handoffd.backends.files.violations import FileViolationLog
from handoffd.cli import daemon_commands
from handoffd.core import isolation, logs, starts
from handoffd.core.config import Config, RetryPolicy, specialist_from_table
from handoffd.core.errors import HandlerError
from handoffd.core.native_format import new_native_request
from handoffd.core.specialists import HandlerContext, Specialist
from handoffd.core.states import State

# ---------------------------------------------------------------- 1. isolated handlers

PLUG = '''
def answer(handoff, ctx):
    return {"status": "completed", "output": {"ok": True}}
'''


@pytest.fixture
def plug(tmp_path: Path) -> Iterator[Path]:
    """The handler module ``leftplug`` on sys.path (the isolated child imports it from there)."""
    folder = tmp_path / "plug"
    folder.mkdir()
    (folder / "leftplug.py").write_text(PLUG)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("leftplug", None)


def _isolated_spec() -> Specialist:
    return Specialist(specialist_from_table("@py", {"handler": "leftplug:answer",
                                                    "isolate": "always"}, RetryPolicy()))


def _context(root: Path) -> HandlerContext:
    Workspace(root).ensure()
    return HandlerContext(handoff_id="i1", attempt=1, root=root, data={}, target="@py")


def _records(root: Path) -> list[Path]:
    return list((root / "handoffs" / ".meta" / "procs").glob("*.json"))


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM])
def test_an_isolated_handler_short_of_a_process_is_not_started(
        plug: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", FailFirst(
        subprocess.Popen, 1, lambda: OSError(code, os.strerror(code))))
    before = _fds()
    with pytest.raises(HandlerError) as raised:
        isolation.run_isolated(_isolated_spec(), {}, ctx, 10, max_output_bytes=1 << 20)
    assert raised.value.retryable is True
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == errno.errorcode[code]
    assert ctx.handback and "@py" in shortage.message
    _settled_fds(before)
    assert not _records(tmp_path)


def test_an_isolated_handler_whose_pipe_cannot_be_made_leaves_nothing(
        plug: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE at the second pipe: the first is closed, the record removed, the attempt marked."""
    ctx = _context(tmp_path)
    calls = {"n": 0}
    real = os.pipe

    def pipe() -> tuple[int, int]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        return real()
    monkeypatch.setattr(os, "pipe", pipe)
    before = _fds()
    with pytest.raises(HandlerError):
        isolation.run_isolated(_isolated_spec(), {}, ctx, 10, max_output_bytes=1 << 20)
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "EMFILE" and "ulimit -n" in shortage.message
    _settled_fds(before)
    assert not _records(tmp_path)


def test_a_missing_interpreter_is_still_a_counted_failure(
        plug: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", FailFirst(
        subprocess.Popen, 1, lambda: OSError(errno.ENOENT, "No such file or directory")))
    with pytest.raises(HandlerError) as raised:
        isolation.run_isolated(_isolated_spec(), {}, ctx, 10, max_output_bytes=1 << 20)
    assert starts.not_started(ctx) is None and "cannot start a process" in str(raised.value)


@pytest.mark.parametrize("which", ["isolated-", "handler-output", "wait-"])
def test_an_isolated_attempt_whose_thread_cannot_start_leaks_nothing(
        plug: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    ctx = _context(tmp_path)
    isolation.run_isolated(_isolated_spec(), {}, ctx, 30, max_output_bytes=1 << 20)  # (warm)
    ctx = _context(tmp_path)
    start = FailFirst(threading.Thread.start, 1, lambda: RuntimeError("can't start new thread"),
                      lambda thread: thread.name.startswith(which))
    monkeypatch.setattr(threading.Thread, "start", lambda self: start(self))
    before, children = _fds(), _children()
    with pytest.raises(HandlerError):
        isolation.run_isolated(_isolated_spec(), {}, ctx, 30, max_output_bytes=1 << 20)
    assert start.raised == 1
    shortage = starts.not_started(ctx)
    assert shortage is not None and shortage.reason == "THREADS"
    assert _children() == children  # killed and reaped: no zombie
    _settled_fds(before)  # its pipes closed
    assert not _records(tmp_path)


def test_a_daemon_hands_an_isolated_attempt_short_of_descriptors_back_uncounted(
        plug: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from handoffd import Daemon
    from handoffd.core.documents import book
    clock = Clock()
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    registry = Registry()
    registry.add(_isolated_spec())
    engine = build_engine(ws, Config(), registry, clock=clock)
    doc = new_native_request(source="@test", target="@py", data={}, now=clock())
    hid = engine.submit(doc)
    popen = FailFirst(subprocess.Popen, 1, lambda: OSError(errno.EMFILE, "Too many open files"))
    monkeypatch.setattr(subprocess, "Popen", popen)
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert popen.raised == 1 and report.handed_back == 1 and report.failed == 0
    assert report.retrying == 0
    state, found = engine.get(hid)
    assert state is State.PENDING and found["handoffd"].get("attempt", 0) == 0
    last = book(found)["history"][-1]
    assert last["event"] == "handed_back" and last["detail"]["not_started"] == "EMFILE"


# ---------------------------------------------------------------- 2. logging short of descriptors

def _failing_import(monkeypatch: pytest.MonkeyPatch, names: Callable[[str], bool]) -> None:
    real = builtins.__import__

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        if names(name):
            raise OSError(errno.EMFILE, "Too many open files", f"/usr/lib/{name}.py")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", fake)


def test_a_warning_whose_logging_cannot_be_imported_is_one_plain_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.deferred("handoffd")
    _failing_import(monkeypatch, lambda name: name == "logging")
    log.warning("handoff %s: created, but %s", "h1", "the record\nis short")
    log.info("not shown (%s)", "info")  # (below what logging's last resort shows)
    log.log(logging.ERROR, "an error of %d", 7)
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.splitlines() == ["handoffd: WARNING: handoff h1: created, but the record\\nis short",
                                "handoffd: ERROR: an error of 7"]
    assert "Traceback" not in err


def test_the_daemons_text_format_imports_nothing_at_its_first_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    formatter = daemon_commands.OneLine("handoffd: %(levelname)s: %(message)s")
    record = logging.LogRecord("handoffd", logging.WARNING, __file__, 1,
                               "cannot start %s", ("a\nb",), None)
    _failing_import(monkeypatch, lambda name: True)  # EMFILE: no module can be loaded now
    try:
        line = formatter.format(record)
    finally:
        monkeypatch.undo()
    assert line == "handoffd: WARNING: cannot start a\\nb"


def test_a_record_the_handler_cannot_format_for_want_of_memory_is_one_plain_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []  # (pytest's own: basicConfig adds none beside them)
    try:
        daemon_commands.configure_logging(False)
        handler, = root.handlers

        def short(record: logging.LogRecord) -> str:
            raise MemoryError()
        monkeypatch.setattr(handler, "format", short)
        logging.getLogger("handoffd").warning("handoff %s: cannot start it for now", "h2")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "--- Logging error ---" not in err and "Traceback" not in err
    assert "handoffd: WARNING: handoff h2: cannot start it for now" in err


# ---------------------------------------------------------------- 3. create, out of memory

def test_a_create_whose_seen_ids_record_runs_out_of_memory_succeeds(tmp_path: Path) -> None:
    """In a real ``handoff create`` (a sitecustomize makes the record's add run out of memory):
    the document is placed, so the create succeeds (exit 0, its id) with one warning line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from handoffd.backends.files import seen\n"
        "def add(self, *args, **kwargs):\n"
        "    raise MemoryError()\n"
        "seen.SeenIds.add = add\n")
    ws = new_workspace(tmp_path / "ws", "")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([exe("handoff"), "create", "--root", str(ws.root), "--from", "@a",
                           "--to", "@b", "--id", "mem-1"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "mem-1" and ws.state_of("mem-1") == ["pending"]
    assert "created, but the seen-ids record could not take it now (out of memory)" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- 4. checked appends

def _short_writes(monkeypatch: pytest.MonkeyPatch, times: int = 1) -> list[int]:
    """os.write stores only half of its first ``times`` writes (a full disk)."""
    real = os.write
    cut: list[int] = []

    def write(fd: int, data: Any) -> int:
        if len(cut) < times and len(data) > 4:
            cut.append(fd)
            return real(fd, bytes(data[:len(data) // 2]))
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)
    return cut


def test_a_violation_line_cut_short_is_enospc_and_the_next_starts_its_own_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = FileViolationLog(tmp_path / "violations.jsonl")
    log.append({"n": 1})
    cut = _short_writes(monkeypatch)
    with pytest.raises(OSError) as raised:
        log.append({"n": 2, "text": "x" * 40})
    assert cut and raised.value.errno == errno.ENOSPC
    log.append({"n": 3})
    assert [entry["n"] for entry in log.read()] == [1, 3]
    lines = (tmp_path / "violations.jsonl").read_bytes().split(b"\n")
    assert json.loads(lines[-2]) == {"n": 3}  # on a line of its own, whole


def test_a_context_history_entry_cut_short_is_enospc_and_the_next_starts_its_own_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = FileContext(tmp_path / "context")

    def setter(value: Any) -> Any:
        return lambda old, revision: (json.dumps(value).encode(), {"key": "k", "value": value})

    context.write("k", setter(1))
    history = tmp_path / "context" / ".history.jsonl"
    real = os.write
    cut: list[int] = []

    def write(fd: int, data: Any) -> int:  # the history's entry of value 2 is cut short
        if b'"value": 2' in bytes(data) and not cut:
            cut.append(fd)
            return real(fd, bytes(data[:len(data) // 2]))
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError) as raised:
        context.write("k", setter(2))
    assert cut and raised.value.errno == errno.ENOSPC and str(history) in str(raised.value)
    monkeypatch.undo()
    context.write("k", setter(3))
    lines = history.read_bytes().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[-2])["value"] == 3
    assert [e.get("value") for e in context._entries()] == [1, 3]


# ---------------------------------------------------------------- 5. JSON log lines, ASCII stderr

@pytest.mark.parametrize("ascii_env", [
    {"PYTHONIOENCODING": "ascii"},
    {"LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}])
def test_json_log_lines_stay_json_on_an_ascii_stderr(tmp_path: Path,
                                                   ascii_env: dict[str, str]) -> None:
    ws = new_workspace(tmp_path / "wsé", "")  # the root is in the "serving" line
    env = {**os.environ, **ascii_env}
    proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root),
                             "--log-format", "json"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    ws.daemons.append(proc)  # type: ignore[arg-type]
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    finally:
        ws.cleanup()
    lines = [line for line in (first + rest).split(b"\n") if line]
    assert lines and all(json.loads(line) for line in lines), lines  # each line is JSON
    serving = json.loads(lines[0])
    assert serving["event"] == "serving"  # (under C, the root's bytes as surrogate escapes)
    assert serving["root"].encode("utf-8", "surrogateescape") == os.fsencode(ws.root)


def test_json_log_lines_keep_their_text_on_a_utf8_stderr() -> None:
    record = logging.LogRecord("handoffd", logging.WARNING, __file__, 1, "agent @zé", None, None)

    class Utf8:
        encoding = "utf-8"
    saved = sys.stderr
    try:
        sys.stderr = Utf8()  # type: ignore[assignment]
        line = daemon_commands.JsonLines().format(record)
    finally:
        sys.stderr = saved
    assert '"agent @zé"' in line


# ---------------------------------------------------------------- 6. a stop during the start

SLOW_START = '''
import importlib.abc, os, sys, time

class SlowDaemon(importlib.abc.MetaPathFinder):
    """handoffd.service.daemon is slow to import: the window before serve takes its signals."""
    def find_spec(self, name, path=None, target=None):
        if name == "handoffd.service.daemon":
            sys.meta_path.remove(self)
            open(os.environ["START_MARK"], "w").close()
            time.sleep(float(os.environ.get("START_PAUSE", "1")))
        return None

sys.meta_path.insert(0, SlowDaemon())
'''

ANSWER = "import json; print(json.dumps(dict(status='completed')))"
SLEEPER_TOML = f"""
[daemon]
settle_seconds = 0.0

[specialists."@s"]
command = {json.dumps([sys.executable, "-S", "-c", ANSWER])}
"""


def _start_slowly(tmp_path: Path, *args: str, pause: float = 1.0) -> tuple[Any, Path, Any]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_START)
    ws = new_workspace(tmp_path / "ws", SLEEPER_TOML)
    ws.create("--from", "@t", "--to", "@s", "--id", "early-1")
    mark = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(site), "START_MARK": str(mark),
           "START_PAUSE": str(pause)}
    proc = subprocess.Popen([exe("handoffd"), *args, "--root", str(ws.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    ws.daemons.append(proc)
    return ws, mark, proc


@pytest.mark.parametrize("command", [["serve"], ["run"], ["serve", "--processes", "2"]])
def test_a_stop_signal_during_the_start_stops_the_daemon_with_nothing_claimed(
        tmp_path: Path, command: list[str]) -> None:
    ws, mark, proc = _start_slowly(tmp_path, *command)
    try:
        wait_until(lambda: mark.exists() or proc.poll() is not None, 60, "the start")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        ws.cleanup()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err
    assert ws.state_of("early-1") == ["pending"]  # nothing claimed
    assert "claimed" not in [e["event"] for e in ws.doc("early-1")["handoffd"]["history"]]


def test_a_second_signal_during_the_start_ends_it_at_once(tmp_path: Path) -> None:
    ws, mark, proc = _start_slowly(tmp_path, "serve", pause=30)
    try:
        wait_until(lambda: mark.exists() or proc.poll() is not None, 60, "the start")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)  # (not the 30 s the start still had to go)
    finally:
        ws.cleanup()
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err and ws.state_of("early-1") == ["pending"]
