"""Shared fixtures: temporary workspaces, the installed CLIs as subprocesses, daemons to kill."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pgserver
import pytest

from handoffd.core.workspace import Workspace as HandoffdWorkspace

REPO = Path(__file__).resolve().parent.parent
SPECIALISTS = REPO / "specialists"
BIN = Path(sys.executable).parent



class Clock:
    """A wall clock moved by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

def run_python(code: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``sys.argv[1:]`` = ``args``), text output captured,
    bounded to a minute; ``kwargs`` go to subprocess.run (env, cwd)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


def exe(name: str) -> str:
    """The installed console script next to the running interpreter (fallback: PATH)."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


# the quick timings of the tests' daemons (a settle, a sweep and a retry in fractions of a second)
QUICK_TOML = """
[daemon]
settle_seconds = 0.2
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 1.0
lease_seconds = 30.0
grace_seconds = 5.0

[retry]
max_retries = 2
retry_delay_seconds = 0.2
backoff_multiplier = 1.0
"""

FLAKY_TOML = QUICK_TOML + f"""
[specialists."@flaky"]
command = ["{sys.executable}", "-S", "{SPECIALISTS / 'flaky.py'}"]
timeout_seconds = 20
concurrency = 4
"""


# A suite started in the background of a shell without job control (`make test &` in a
# script, cron) inherits SIGINT ignored, and so does every process it starts: the tests that
# stop `ls --watch` or a daemon with SIGINT then waited for ever (both of session 26's first
# fresh clones). The tests' processes get the default disposition again, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupted(proc: subprocess.Popen[Any], timeout: float = 30) -> int:
    """Send ``proc`` (a process the test started) SIGINT and return its exit status once it
    exits; if it has not within ``timeout``, what /proc says of it (its signal masks, state and
    each thread's kernel wait) in the AssertionError, after killing it: a watcher once stayed
    deaf to SIGINT in the full suite alone."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        facts = []
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            facts += [line for line in status.splitlines()
                      if line.split(":")[0] in ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk",
                                                "SigIgn", "SigCgt", "Threads")]
            for task in sorted(Path(f"/proc/{proc.pid}/task").iterdir()):
                wchan = (task / "wchan").read_text()
                try:
                    stack = (task / "stack").read_text().replace("\n", " | ")[:600]
                except OSError:
                    stack = "?"
                facts.append(f"task {task.name}: wchan {wchan} stack {stack}")
        except OSError as exc:
            facts.append(f"/proc unreadable: {exc}")
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"pid {proc.pid} ignored SIGINT for {timeout}s: " + "; ".join(facts))


def alive(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie has finished)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_until(predicate: Any, timeout: float = 15, what: str = "condition") -> None:
    """Poll ``predicate`` every 20 ms; fail the test if it is still false after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what}: not met within {timeout}s")


def wait_for_words(path: Path, words: list[str], timeout: float = 30) -> str:
    """What a daemon said (its stderr, written to ``path``), once every one of ``words`` is in
    it, or when ``timeout`` seconds have passed (the caller's assertions say what is missing)."""
    deadline = time.monotonic() + timeout
    while True:
        said = path.read_text(errors="replace")
        if all(w in said for w in words) or time.monotonic() > deadline:
            return said
        time.sleep(0.05)


def whole_json_lines(path: Path) -> list[Any]:
    """The JSON values of the complete lines of ``path`` ([] when it is absent): a daemon may be
    appending a line as it is read, and a torn last line is not one yet (a JSONDecodeError
    failed a fresh clone's run)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def reason_codes(root: Path) -> dict[str, str]:
    """Quarantined file name -> recorded code."""
    out = {}
    for path in (root / "handoffs" / ".quarantine").glob("*.reason.json"):
        try:
            text = path.read_text()
        except FileNotFoundError:  # (an empty reason given up since)
            continue
        if not text:  # a set-aside's reason is created empty to hold its name, then replaced
            continue  # by the written one (backends/files/quarantine.py `_reserve`): not yet
        item = json.loads(text)
        out[item["file"]] = item["code"]
    return out


class Workspace:
    """A temporary handoffd workspace with helpers to drive it through the real commands."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[subprocess.Popen[str]] = []

    def write_config(self, text: str) -> None:
        (self.root / "handoffd.toml").write_text(text)

    def handoff(self, *args: str, input: str | None = None, timeout: float = 60,
                check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``handoff ARGS --root WS``."""
        proc = subprocess.run([exe("handoff"), *args, "--root", str(self.root)], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"handoff {args} exited {proc.returncode}: {proc.stderr}")
        return proc

    def handoffd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``handoffd ARGS --root WS`` to completion (run, sweep)."""
        return subprocess.run([exe("handoffd"), *args, "--root", str(self.root)],
                              capture_output=True, text=True, timeout=timeout)

    def serve(self, *extra: str) -> subprocess.Popen[str]:
        """Start ``handoffd serve`` and wait until it says it is serving."""
        proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(self.root), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.daemons.append(proc)
        assert proc.stderr is not None
        seen = []
        for _ in range(50):  # the start-up sweep may log before the "serving" line
            line = proc.stderr.readline()
            seen.append(line)
            if "serving" in line or not line:
                break
        assert "serving" in seen[-1], "".join(seen)
        proc.ready_line = seen[-1]  # type: ignore[attr-defined]  # what it said it serves
        return proc

    def stop(self, proc: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        proc.send_signal(sig)
        return proc.wait(timeout=timeout)

    def create(self, *args: str) -> str:
        proc = self.handoff("create", *args, check=True)
        return proc.stdout.strip()

    def drop(self, name: str, doc: Any | bytes | str) -> Path:
        """Write a file straight into pending/ as a foreign producer would (atomically)."""
        pending = self.root / "handoffs" / "pending"
        pending.mkdir(parents=True, exist_ok=True)
        data = doc if isinstance(doc, (bytes, str)) else json.dumps(doc)
        # the temp file sits under handoffs/ (not a state folder): a contract's snapshot of the
        # workspace skips handoffd's own folder, so a drop never reads as a contracted run's edit
        tmp = self.root / "handoffs" / f".{name}.part"
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, pending / name)
        return pending / name

    def state_of(self, handoff_id: str) -> list[str]:
        return [s for s in ("pending", "in-progress", "completed", "failed")
                if (self.root / "handoffs" / s / f"{handoff_id}.json").exists()]

    def doc(self, handoff_id: str) -> dict[str, Any]:
        """The current document. Mid-move a handoff is briefly in two folders (the new copy is
        written before the old one is removed): the copy further along the lifecycle is current."""
        for state in ("completed", "failed", "in-progress", "pending"):
            path = self.root / "handoffs" / state / f"{handoff_id}.json"
            try:
                return json.loads(path.read_text())
            except FileNotFoundError:
                continue
        raise AssertionError(f"no document for {handoff_id}")

    def wait_state(self, handoff_id: str, states: tuple[str, ...] = ("completed", "failed"),
                   timeout: float = 30) -> str:
        """Wait (bounded) until the handoff is in one of ``states``; returns it. For finished
        states it also waits (up to 10 s more) until no copy is left in pending/ or
        in-progress/: filing writes the finished document before it removes the old copy, and
        a test asserting ``state_of(...) == ["completed"]`` at once could see both. A copy that
        stays is left for the caller's own assertions to find."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.state_of(handoff_id) if s in states]
            if found:
                if set(states) <= {"completed", "failed"}:
                    settled = time.monotonic() + 10
                    while time.monotonic() < settled and {"pending", "in-progress"} & set(
                            self.state_of(handoff_id)):
                        time.sleep(0.02)
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"{handoff_id} not in {states} after {timeout}s: {self.state_of(handoff_id)}")

    def wait_started(self, handoff_id: str, timeout: float = 30) -> None:
        """Wait (bounded) until the flaky specialist has started on ``handoff_id``: in-progress/
        alone is not enough, the claim rename comes before admission and the handler's start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["id"] == handoff_id for r in self.runs()):
                return
            time.sleep(0.02)
        raise AssertionError(f"the specialist never started on {handoff_id}")

    def runs(self) -> list[dict[str, Any]]:
        """Executions recorded by the flaky specialist."""
        path = self.root / "artifacts" / "flaky-runs.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def cleanup(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def no_death_watch_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test process is no daemon: attempts run in it (in-process daemons, runner tests)
    start no death watch (core/deathwatch.py), which would be one more child process, Popen call
    and descriptor for the tests that count or stand in for those. The daemons a test starts as
    processes have theirs; tests/test_deathwatch_s26.py tests it."""
    from handoffd.core import deathwatch
    monkeypatch.setattr(deathwatch, "_next_start", float("inf"))


@pytest.fixture(autouse=True)
def dev_null_kept() -> Iterator[None]:
    """/dev/null is still the null device after the test. In session 27 something running as
    root replaced it with a regular file (a rename or an unlink over it), and every later
    initdb failed ("cannot create /dev/null: Permission denied"): the PostgreSQL tests were
    skipped. The test that did it fails here, naming itself, and the node is made again (as
    root) so the rest of the run is not poisoned."""
    import stat as stat_module
    yield
    try:
        mode = os.stat(os.devnull).st_mode
    except OSError:
        mode = 0
    if stat_module.S_ISCHR(mode):
        return
    if os.geteuid() == 0:
        try:
            os.unlink(os.devnull)
        except OSError:
            pass
        os.mknod(os.devnull, 0o666 | stat_module.S_IFCHR, os.makedev(1, 3))
        os.chmod(os.devnull, 0o666)
    pytest.fail(f"{os.devnull} is no longer the null device after this test (mode {mode:o})")


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace whose handoffd.toml registers the flaky test specialist as @flaky."""
    workspace = new_workspace(tmp_path / "ws", FLAKY_TOML)
    yield workspace
    workspace.cleanup()


def new_workspace(root: Path, config: str) -> Workspace:
    """A fresh workspace at ``root`` with ``config`` as its handoffd.toml and its folders made
    (in-process: a sweep process costs ~0.4 s). The caller calls ``cleanup()``."""
    root.mkdir()
    workspace = Workspace(root)
    workspace.write_config(config)
    HandoffdWorkspace(root).ensure()
    return workspace


# the head of a Python handlers module whose serving daemon counts something (a test patches a
# method to add to COUNTS), and the @probe handler that reports the counts: see probe_count
PROBE_HANDLERS = '''
from collections import Counter

COUNTS = Counter()


def probe(handoff, ctx):
    return {"status": "completed", "output": dict(COUNTS)}
'''
# added to PROBE_HANDLERS: the daemon counts each pending document it reads, as "read"
COUNT_READS = '''
import handoffd.core.engine as _engine

_peek = _engine.Engine.peek


def peek(self, handoff_id):
    COUNTS["read"] += 1
    return _peek(self, handoff_id)


_engine.Engine.peek = peek
'''
_probes = iter(range(10**6))


def probe_count(ws: Workspace, key: str) -> int:
    """What the serving daemon of ``ws`` counted under ``key`` so far (its handlers begin with
    :data:`PROBE_HANDLERS` and its @probe specialist runs their ``probe``): a @probe handoff
    dropped and waited for answers it."""
    hid = f"probe-{next(_probes)}"
    ws.drop(f"{hid}.json", {"handoff_id": hid, "source": {"agent_id": "@tests"},
                            "target": {"agent_id": "@probe"}, "input": {"data": {}}})
    assert ws.wait_state(hid, timeout=30) == "completed"
    return int(ws.doc(hid)["output"].get(key, 0))


def handlers_workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str,
                       config: str) -> Workspace:
    """:func:`new_workspace` at ``tmp_path/ws`` whose daemons can import the Python handlers
    ``source`` as ``module`` (on ``$PYTHONPATH``), with no ``$HANDOFF_TARGET`` or
    ``$HANDOFFD_ROOT`` from the caller's environment. The caller calls ``cleanup()``."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / f"{module}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(handlers))
    monkeypatch.delenv("HANDOFF_TARGET", raising=False)
    monkeypatch.delenv("HANDOFFD_ROOT", raising=False)
    return new_workspace(tmp_path / "ws", config)


@pytest.fixture
def dead_owner_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases written by this test carry a process mark no live process bears, as a dead
    owner's do. Tests that stand for an owner's death by closing its store (its lock goes as the
    kernel drops it) need it: this process lives on, and a free lock whose owner still lives is
    no death (core/liveness.py)."""
    from handoffd.core import liveness
    namespaces = liveness._namespaces()
    monkeypatch.setattr(liveness, "own_mark", lambda: ("d" * 16, namespaces))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pgserver.PgServer]:
    """A throw-away PostgreSQL cluster for this test session (per xdist worker), started on
    first use; tests that need it are skipped, with the reason, where none can be started."""
    server = pgserver.start()
    if isinstance(server, str):
        pytest.skip(server)
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server: pgserver.PgServer) -> str:
    """The URL of a fresh, empty database on the session's cluster."""
    return pg_server.new_database()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say once, at the end of every run, why the PostgreSQL tests were skipped (if they were):
    a missing server must never pass silently."""
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "PostgreSQL tests skipped" in reason:
            count = sum(1 for r in terminalreporter.stats.get("skipped", [])
                        if "PostgreSQL tests skipped" in str(r.longrepr))
            terminalreporter.write_line(f"{reason.removeprefix('Skipped: ')} ({count} tests)",
                                        yellow=True)
            return


def memory_engine(tmp_path: Path, clock: Clock,
                  handlers: dict[str, Any]) -> tuple[Any, Any]:
    """(engine, its MemoryBackend) with ``handlers`` (agent -> Python handler, concurrency 2),
    a 30 s lease and two retries 10 s apart, on ``clock``."""
    from handoffd import Registry, build_engine
    from handoffd.backends.memory import MemoryBackend
    from handoffd.core.config import Config, DaemonSettings, RetryPolicy
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    config = Config(daemon=DaemonSettings(lease_seconds=30),
                    retry=RetryPolicy(max_retries=2, retry_delay_seconds=10))
    registry = Registry()
    for agent, func in handlers.items():
        registry.add_function(agent, func, config=config, concurrency=2)
    backend = MemoryBackend()
    return build_engine(ws, config, registry, clock=clock, backend=backend), backend


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the tests marked ``heavy`` first (a stable sort: the rest keep their order). The
    suite's workers take tests in collection order, and one 20-second test left for the end
    kept every other worker idle meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
