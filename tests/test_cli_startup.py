"""``handoffd run`` and ``handoffd serve`` start without typer: the console script parses their
plain forms itself (handoffd.cli.handoffd_cmd) and runs the same functions as the full command
line (handoffd.cli.daemon_commands). Every command line here runs the installed ``handoffd``
both ways (``$HANDOFFD_FULL_CLI`` forces the full one) and must give the same exit code, stdout
and stderr (once workspace paths, clock times and durations are set aside)."""
from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAKY_TOML, QUICK_TOML, exe, run_python

from handoffd.core.workspace import Workspace

FULL = {**os.environ, "HANDOFFD_FULL_CLI": "1"}
QUICK = {k: v for k, v in os.environ.items() if k != "HANDOFFD_FULL_CLI"}
DURATION = re.compile(r"\b\d+(\.\d+)?s\b")


def workspace(root: Path, *, pending: bool = False) -> Path:
    """A workspace registering @flaky; with ``pending``, one handoff that completes and one
    that fails for good (a foreign producer's drops)."""
    root.mkdir(parents=True)
    (root / "handoffd.toml").write_text(FLAKY_TOML)
    Workspace(root).ensure()
    if pending:
        for hid, mode in (("s-ok", "ok"), ("s-bad", "permanent")):
            doc = {"handoff_id": hid, "target": {"agent_id": "@flaky"},
                   "input": {"data": {"mode": mode}}}
            (root / "handoffs" / "pending" / f"{hid}.json").write_text(json.dumps(doc))
    return root


def normal(text: str, root: Path) -> list[str]:
    """``text``'s lines with the workspace path, log times and durations set aside, sorted
    (with several workers, handoffs finish in either order)."""
    lines = []
    for line in text.replace(str(root), "<root>").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            for key in ("time", "seconds", "duration"):
                entry.pop(key, None)
            line = json.dumps(entry, sort_keys=True)
        lines.append(DURATION.sub("<s>", line))
    return sorted(lines)


def handoffd(root: Path, *args: str, full: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe("handoffd"), *args, "--root", str(root)], capture_output=True,
                          text=True, timeout=60, env=FULL if full else QUICK)


def outcome(proc: subprocess.CompletedProcess[str], root: Path) -> tuple[Any, ...]:
    return proc.returncode, normal(proc.stdout, root), normal(proc.stderr, root)


def test_the_quick_path_takes_only_plain_forms() -> None:
    from handoffd.cli.handoffd_cmd import FORMS, plain_form, try_quick
    from handoffd.cli.quick import parse
    assert parse(["run", "-q", "--workers", "2", "--max-seconds=5", "--log-format", "json",
                  "--store", "x", "--root", "r"], FORMS) == ("run", [], {
                      "quiet": True, "workers": "2", "max_seconds": "5", "log_format": "json",
                      "store": "x", "root": "r"})
    assert parse(["serve", "-v", "--metrics", ":9464", "--metrics-textfile", "m.prom"],
                 FORMS) == ("serve", [], {"verbose": True, "metrics": ":9464",
                                          "metrics_textfile": "m.prom"})
    for argv in (["run", "--help"], ["run", "-h"], ["run", "-vq"], ["run", "-v", "--verbose"],
                 ["run", "--root", "a", "--root", "b"], ["run", "extra"], ["run", "--bogus"],
                 ["run", "--workers"], ["run", "--max-seconds", "-1"], ["serve", "-q"],
                 ["serve", "--max-seconds", "3"], ["run", "--metrics", ":1"], ["sweep"],
                 ["metrics"], ["db", "init"], ["--version"], []):
        assert parse(argv, FORMS) is None, argv
    for argv in (["run", "--workers", "0"], ["run", "--workers", "two"],
                 ["run", "--max-seconds", "soon"], ["run", "--max-seconds", "nan"],
                 ["run", "--root="], ["serve", "--workers=-1"], ["serve", "--metrics="]):
        assert plain_form(argv) is None, argv  # values that do not convert: typer words it
        assert try_quick(argv) is None, argv
    assert plain_form(["run", "--workers=3", "--max-seconds", "1.5", "--root", "r"]) == (
        "run", {"workers": 3, "max_seconds": 1.5, "root": Path("r")})


# the command lines the quick path runs (the others go to typer both ways)
TAKEN = [(), ("-q",), ("-v",), ("-v", "--log-format", "json"), ("--workers", "2", "--verbose"),
         ("--max-seconds", "30"), ("--max-seconds", "0", "-v"), ("--log-format", "xml"),
         ("-q", "--store", "mysql://nowhere")]
LEFT = [("--workers", "0"), ("--workers", "two"), ("--max-seconds", "-1"), ("--bogus",),
        ("-q", "-q"), ("--help",)]


@pytest.mark.parametrize("args", TAKEN + LEFT)
def test_run_on_an_empty_workspace_says_the_same_both_ways(tmp_path: Path,
                                                           args: tuple[str, ...]) -> None:
    from handoffd.cli.handoffd_cmd import plain_form
    assert (plain_form(["run", *args]) is not None) == (args in TAKEN)
    root = workspace(tmp_path / "ws")
    quick, full = handoffd(root, "run", *args, full=False), handoffd(root, "run", *args, full=True)
    assert outcome(quick, root) == outcome(full, root), args


@pytest.mark.parametrize("args", [
    (), ("-q",), ("-v", "--workers", "1"), ("-v", "--log-format", "json"),
    ("--max-seconds", "30", "--log-format", "json"),
])
def test_run_with_pending_handoffs_says_the_same_both_ways(tmp_path: Path,
                                                           args: tuple[str, ...]) -> None:
    """Two identical workspaces, one per path: one handoff completes, one fails (exit 1)."""
    from handoffd.cli.handoffd_cmd import plain_form
    assert plain_form(["run", *args]) is not None
    results = []
    for full in (False, True):
        root = workspace(tmp_path / ("full" if full else "quick"), pending=True)
        proc = handoffd(root, "run", *args, full=full)
        assert sorted(p.name for p in (root / "handoffs" / "completed").iterdir()) == ["s-ok.json"]
        assert sorted(p.name for p in (root / "handoffs" / "failed").iterdir()) == ["s-bad.json"]
        results.append(outcome(proc, root))
    assert results[0] == results[1], args
    assert results[0][0] == 1


def read_until(proc: subprocess.Popen[str], needle: str, timeout: float = 30) -> str:
    """What ``proc`` wrote on stderr up to and including the first line holding ``needle``
    (or up to its end); fails after ``timeout`` seconds."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while needle.encode() not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} within {timeout}s: {seen.decode()!r}"
            if sel.select(left):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                seen += chunk
    os.set_blocking(fd, True)
    return seen.decode()


def serve(root: Path, *args: str, full: bool, until: Path | None = None) -> tuple[Any, ...]:
    """Start ``handoffd serve``, wait until it says it is serving (and, with ``until``, until
    that file exists), stop it with SIGTERM; its exit code, stdout and stderr."""
    proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(root), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=FULL if full else QUICK)
    try:
        said = read_until(proc, "serving")
        deadline = time.monotonic() + 30
        while until is not None and not until.exists():
            assert time.monotonic() < deadline, f"{until} never appeared"
            time.sleep(0.02)  # polling for the filed document, bounded by the deadline
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, normal(out.decode(), root), normal(said + err.decode(), root)


@pytest.mark.parametrize("args", [(), ("-v", "--workers", "2"), ("-v", "--log-format", "json")])
def test_serve_says_the_same_both_ways(tmp_path: Path, args: tuple[str, ...]) -> None:
    """Start, serve two handoffs (one fails), stop on SIGTERM: the same lines and exit 0."""
    from handoffd.cli.handoffd_cmd import plain_form
    assert plain_form(["serve", *args]) is not None
    results = []
    for full in (False, True):
        root = workspace(tmp_path / ("full" if full else "quick"), pending=True)
        results.append(serve(root, *args, full=full,
                             until=root / "handoffs" / "failed" / "s-bad.json"))
    assert results[0] == results[1], args
    assert results[0][0] == 0 and any("serving <root>" in line for line in results[0][2])


@pytest.mark.parametrize("args", [("--workers", "0"), ("--log-format", "xml"),
                                  ("--metrics", "nowhere:port"), ("--quiet",)])
def test_serve_refuses_the_same_both_ways(tmp_path: Path, args: tuple[str, ...]) -> None:
    root = workspace(tmp_path / "ws")
    quick, full = [subprocess.run([exe("handoffd"), "serve", "--root", str(root), *args],
                                  capture_output=True, text=True, timeout=60,
                                  env=FULL if full else QUICK) for full in (False, True)]
    assert outcome(quick, root) == outcome(full, root), args
    assert quick.returncode == 2 and quick.stderr.count("\n") == 1


def modules_of_a_run(root: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`handoffd run -q` on ``root`` in a Python process that then prints the modules it
    loaded: (the process, those modules)."""
    code = ("import sys\n"
            "from handoffd.cli.handoffd_cmd import main\n"
            "sys.argv = ['handoffd', 'run', '-q', '--root', sys.argv[1]]\n"
            "try:\n"
            "    main()\n"
            "finally:\n"
            "    print('MODULES', ' '.join(sorted(sys.modules)))\n")
    proc = run_python(code, str(root), env=QUICK)
    return proc, set(proc.stdout.partition("MODULES")[2].split())


def test_the_quick_path_loads_no_typer_click_or_rich(tmp_path: Path) -> None:
    """What `handoffd run` on an empty workspace loads (the start-up a cron job pays each
    minute), and what `handoffd serve` loads before it says it is serving."""
    root = workspace(tmp_path / "ws")
    proc, loaded = modules_of_a_run(root)
    assert proc.returncode == 0, proc.stderr
    assert "handoffd.service.daemon" in loaded  # it did run the batch
    unwanted = {name for name in loaded if name.split(".")[0] in ("typer", "click", "rich")}
    unwanted |= loaded & {"importlib.metadata", "handoffd.cli.handoffd_app",
                          "handoffd.cli.common"}
    assert not unwanted

    proc2 = subprocess.Popen([sys.executable, "-X", "importtime", exe("handoffd"), "serve",
                              "--root", str(root)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=QUICK)
    try:
        said = read_until(proc2, "serving")
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.communicate(timeout=30)
    modules = {line.rsplit("|", 1)[1].strip() for line in said.splitlines()
               if line.startswith("import time:") and "|" in line}
    assert "jsonschema" in modules  # warm_up: the schema checks load before it serves
    assert not {name for name in modules if name.split(".")[0] in ("typer", "click", "rich")}


def test_a_command_notice_loads_no_http(tmp_path: Path) -> None:
    """A batch whose only ``[[on_filed]]`` rule is a command delivers its notice without loading
    urllib's HTTP (with ssl and email, about 20 ms): that loads at a webhook's first attempt."""
    root = workspace(tmp_path / "ws", pending=True)
    seen = tmp_path / "notices"
    script = tmp_path / "notice.py"
    script.write_text("import sys\nopen(sys.argv[1], 'a').write(sys.stdin.read()[:1] + '\\n')\n")
    (root / "handoffd.toml").write_text(
        FLAKY_TOML + f"\n[[on_filed]]\ncommand = [{json.dumps(sys.executable)}, "
        f"{json.dumps(str(script))}, {json.dumps(str(seen))}]\n")
    proc, loaded = modules_of_a_run(root)
    assert proc.returncode == 1, proc.stderr  # (one of the two fails for good)
    assert "handoffd.features.notify.delivery" in loaded  # the rule was installed
    assert seen.read_text().splitlines() == ["{", "{"]  # both filings were noticed
    assert not loaded & {"http.client", "urllib.request", "ssl", "email",
                         "handoffd.features.notify.webhook_http"}


def test_quick_create_loads_no_engine_feature_or_logging(tmp_path: Path) -> None:
    """`handoff create --to` writes one document: it builds no Engine (a Submitter), so the
    engine's run-time, the features and ``logging`` stay unloaded; the document is created and
    logged to the event log as the full command does."""
    root = workspace(tmp_path / "ws")
    code = ("import sys\n"
            "from handoffd.cli.entry import handoff\n"
            "sys.argv = ['handoff', 'create', '--to', '@flaky', '--root', sys.argv[1]]\n"
            "try:\n"
            "    handoff()\n"
            "finally:\n"
            "    print('MODULES', ' '.join(sorted(sys.modules)))\n")
    proc = run_python(code, str(root), env=QUICK)
    assert proc.returncode == 0, proc.stderr
    made, _, modules = proc.stdout.partition("MODULES")
    loaded = set(modules.split())
    unwanted = loaded & {"logging", "handoffd.core.engine", "handoffd.core.hooks",
                         "handoffd.core.jobs", "handoffd.core.specialists", "typer", "rich"}
    unwanted |= {m for m in loaded if m.startswith("handoffd.features.")
                 and m not in ("handoffd.features.build",)}
    assert not unwanted, unwanted
    assert (root / "handoffs" / "pending" / f"{made.strip()}.json").is_file()
    events = (root / "handoffs" / ".meta" / "events.jsonl").read_text()
    assert made.strip() in events


def test_quick_context_get_and_set_load_no_typer_click_or_rich(tmp_path: Path) -> None:
    """An agent's `handoff context set KEY VALUE` and `context get KEY` between its steps skip
    typer, click and rich (about 50 ms of imports)."""
    root = workspace(tmp_path / "ws")
    code = ("import sys\n"
            "from handoffd.cli.entry import handoff\n"
            "sys.argv = ['handoff', 'context', *sys.argv[2:], '--root', sys.argv[1]]\n"
            "try:\n"
            "    handoff()\n"
            "finally:\n"
            "    print('MODULES', ' '.join(sorted(sys.modules)))\n")
    for args in (["set", "notes/a", '{"n": 1}'], ["get", "notes/a"]):
        proc = run_python(code, str(root), *args, env=QUICK)
        assert proc.returncode == 0, proc.stderr
        said, _, modules = proc.stdout.partition("MODULES")
        loaded = {m.split(".")[0] for m in modules.split()}
        assert not loaded & {"typer", "click", "rich"}, args
    assert json.loads(said) == {"n": 1}


def test_a_submitter_refuses_dependencies_it_cannot_check(tmp_path: Path) -> None:
    """A Submitter runs no feature, so a request naming dependencies (whose checks are the
    dependencies feature's) is refused, and nothing is stored."""
    from handoffd.cli.quick import submit_request
    from handoffd.core.errors import InvalidDocument
    from handoffd.features.build import open_submitter

    ws = Workspace(tmp_path)
    ws.ensure()
    submitter = open_submitter(ws)
    with pytest.raises(InvalidDocument, match="dependencies"):
        submit_request(submitter, to="@x", handoff_id="needs", depends_on=["other"])
    assert submitter.backend.get("needs") is None
    assert submitter.backend.get(submit_request(submitter, to="@x")) is not None


@pytest.mark.parametrize("maker", ["engine", "submitter"])
def test_create_loads_what_its_write_needs_before_the_created_stamp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maker: str) -> None:
    """The created stamp is where pick-up latency is counted from: what the write loads the
    first time (the seals' hash; renameat2 through ctypes, ~2 ms) is loaded before it."""
    from handoffd.backends.files import fsio
    from handoffd.cli.basics import engine, open_workspace
    from handoffd.cli.quick import submit_request
    from handoffd.core import hashing
    from handoffd.features.build import open_submitter

    monkeypatch.setattr(fsio, "_renameat2", None)
    monkeypatch.setattr(hashing, "_sha256", None)
    eng: Any = (engine(tmp_path, create=True) if maker == "engine"
                else open_submitter(open_workspace(tmp_path, create=True)))
    loaded: list[bool] = []
    clock = eng.clock

    def stamp() -> Any:
        loaded.append(fsio._renameat2 is not None and hashing._sha256 is not None)
        return clock()

    monkeypatch.setattr(eng, "clock", stamp)
    handoff_id = submit_request(eng, to="@x")
    assert loaded and loaded[0], loaded
    assert eng.backend.get(handoff_id) is not None


def test_ls_loads_the_features_only_for_a_pending_row(tmp_path: Path) -> None:
    """`handoff ls` over finished handoffs imports no feature (only a pending row's note asks
    their gates); with a pending row it installs them and the note is theirs."""
    root = workspace(tmp_path / "ws", pending=True)
    assert subprocess.run([exe("handoffd"), "run", "-q", "--root", str(root)],
                          capture_output=True, timeout=60).returncode in (0, 1)
    code = ("import sys\n"
            "from handoffd.cli.entry import handoff\n"
            "sys.argv = ['handoff', 'ls', '--root', sys.argv[1]]\n"
            "try:\n"
            "    handoff()\n"
            "finally:\n"
            "    print('MODULES', ' '.join(sorted(sys.modules)))\n")

    def features_loaded() -> tuple[set[str], str]:
        proc = run_python(code, str(root), env=QUICK)
        listing, _, modules = proc.stdout.partition("MODULES")
        # a listing starts no handler and logs nothing: the machinery that starts handlers, and
        # logging, stay unloaded (the engine's shortage words need neither)
        assert not {"handoffd.core.childproc", "subprocess", "logging"} & set(modules.split())
        return {m for m in modules.split() if m.startswith("handoffd.features.")  # (lineage:
                and m not in ("handoffd.features.build", "handoffd.features.lineage")}, listing
        # the PARENT and conversation columns' readers, not an installed feature)

    loaded, listing = features_loaded()
    assert not loaded and "completed" in listing and "pending" not in listing
    for argv in (["--to", "@nobody", "--id", "first"],
                 ["--to", "@flaky", "--id", "later", "--depends-on", "first"]):
        made = subprocess.run([exe("handoff"), "create", "--root", str(root), *argv],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
    loaded, listing = features_loaded()
    assert "handoffd.features.dependencies" in loaded, loaded
    full = subprocess.run([exe("handoff"), "ls", "--json", "--root", str(root)], capture_output=True,
                          text=True, timeout=60, env=FULL)
    note = {row["id"]: row["note"] for row in json.loads(full.stdout)}["later"]
    assert "first" in note and note in listing, (note, listing)  # the gate's, as the full path says


def test_gate_features_are_exactly_the_features_with_gates(tmp_path: Path) -> None:
    """`handoff ls` installs GATE_FEATURES for a pending row's note: every feature that adds a
    gate must be among them (else the note would miss its verdict), and no other."""
    from handoffd.features.build import (
        FEATURES,
        GATE_FEATURES,
        GATES,
        build_engine,
        install_features,
        install_gates,
    )
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    with_gates = []
    for name in FEATURES:
        eng = build_engine(ws, features=())
        install_features(eng, [name])
        if eng.gates:
            with_gates.append(name)
    assert tuple(with_gates) == GATE_FEATURES
    everything, gated = build_engine(ws), build_engine(ws, features=GATE_FEATURES)
    assert [g.__qualname__ for g in gated.gates] == [g.__qualname__ for g in everything.gates]
    # ls installs each feature's gates alone (GATES): the same gates, in the same order
    alone = build_engine(ws, features=())
    install_gates(alone)
    assert tuple(GATES) == GATE_FEATURES
    assert [g.__qualname__ for g in alone.gates] == [g.__qualname__ for g in everything.gates]


def test_a_deferred_logger_is_the_logger_itself() -> None:
    """core.logs: the stand-in logs through logging.getLogger(name) once used, and reads its
    plain attributes afresh (a level set later is seen)."""
    import logging

    from handoffd.core.logs import deferred
    log = deferred("handoffd.test-deferred")
    real = logging.getLogger("handoffd.test-deferred")
    real.setLevel(logging.WARNING)
    assert log.level == logging.WARNING and not log.isEnabledFor(logging.INFO)
    real.setLevel(logging.DEBUG)
    assert log.level == logging.DEBUG and log.isEnabledFor(logging.INFO)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    real.addHandler(handler)
    try:
        log.warning("hello %s", "there")
    finally:
        real.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["hello there"]


# ---------------------------------------------------------------- session 30: show, wait, ls
# runs `handoff ARGS --root ROOT` in this interpreter, then prints the modules it loaded
LOADED = ("import sys\n"
          "from handoffd.cli.entry import handoff\n"
          "sys.argv = ['handoff', *sys.argv[2:], '--root', sys.argv[1]]\n"
          "try:\n"
          "    handoff()\n"
          "finally:\n"
          "    print('MODULES', ' '.join(sorted(sys.modules)))\n")


def loaded_by(root: Path, *args: str) -> tuple[int, str, set[str]]:
    """`handoff ARGS` (the quick path) on ``root``: its exit code, what it printed before the
    module list, and the modules it loaded."""
    proc = run_python(LOADED, str(root), *args, env=QUICK)
    said, _, modules = proc.stdout.partition("MODULES")
    return proc.returncode, said, set(modules.split())


@pytest.fixture
def finished(tmp_path: Path) -> Path:
    """A workspace where s-ok completed and s-bad failed (one `handoffd run`)."""
    root = workspace(tmp_path / "ws", pending=True)
    assert subprocess.run([exe("handoffd"), "run", "-q", "--root", str(root)],
                          capture_output=True, timeout=60).returncode == 1
    return root


# what a read of one document never needs: the engine's run-time and hooks, the process
# machinery, logging (nothing is logged unless something goes wrong)
ENGINE = {"handoffd.core.engine", "handoffd.core.hooks", "handoffd.core.jobs",
          "handoffd.core.admission", "handoffd.core.starts", "handoffd.core.specialists"}


def test_show_of_a_finished_handoff_builds_no_engine(finished: Path) -> None:
    """`handoff show` reads the document from the store; an Engine (registry, hooks, the
    run-time's modules) is built only for a pending handoff, whose note its gates give. The
    note show prints is the one `ls` gives the row, either way."""
    rows = json.loads(subprocess.run([exe("handoff"), "ls", "--json", "--root", str(finished)],
                                     capture_output=True, text=True, timeout=60).stdout)
    notes = {row["id"]: row["note"] for row in rows}
    assert notes["s-bad"] and not notes["s-ok"]
    for hid in ("s-ok", "s-bad"):
        code, said, loaded = loaded_by(finished, "show", hid, "--json")
        assert code == 0, said
        shown = json.loads(said)
        assert shown["state"] == ("completed" if hid == "s-ok" else "failed")
        assert shown["note"] == notes[hid]
        assert not loaded & (ENGINE | {"logging"}), loaded & (ENGINE | {"logging"})
    for argv in (["--to", "@nobody", "--id", "first"],
                 ["--to", "@flaky", "--id", "later", "--depends-on", "first"]):
        assert subprocess.run([exe("handoff"), "create", "--root", str(finished), *argv],
                              capture_output=True, timeout=60).returncode == 0
    code, said, loaded = loaded_by(finished, "show", "later")
    assert code == 0 and "note: waiting for dependency first" in said, said
    assert "handoffd.core.engine" in loaded and "handoffd.features.dependencies" in loaded
    code, said, loaded = loaded_by(finished, "show", "nowhere")
    assert code == 3 and "handoffd.core.engine" not in loaded


def test_wait_on_a_finished_handoff_loads_no_logging(finished: Path) -> None:
    """`handoff wait` on a finished handoff logs nothing: the waiting module's logger is the
    deferred one, so ``logging`` (with ``traceback`` and ``textwrap``) stays unloaded."""
    code, said, loaded = loaded_by(finished, "wait", "s-ok")
    assert code == 0 and said.split() == ["s-ok", "completed"]
    assert "handoffd.service.waiting" in loaded
    assert not loaded & ({"logging", "traceback", "textwrap"} | ENGINE)


def test_ls_with_a_serving_daemon_and_a_claim_loads_no_process_machinery(finished: Path) -> None:
    """`handoff ls` with a daemon's record in the workspace asks whether that daemon lives
    (core.liveness), which reads /proc/<pid>/stat (core.procstat) without the machinery that
    finds and kills an attempt's processes (core.procs) or logging; a pending row asks the
    contracts gate, which loads a contract's code only for a handoff that carries one."""
    from handoffd.features.build import build_engine
    from handoffd.service.daemon_records import ServingRecord, config_stamp

    ws = Workspace(finished)
    for argv in (["--to", "@nobody", "--id", "first"],
                 ["--to", "@flaky", "--id", "later", "--depends-on", "first"],
                 ["--to", "@flaky", "--id", "held"]):
        assert subprocess.run([exe("handoff"), "create", "--root", str(finished), *argv],
                              capture_output=True, timeout=60).returncode == 0
    eng = build_engine(ws, features=())
    claimed = eng.claim("held")  # in progress, this process its owner
    assert claimed is not None
    record = ServingRecord(ws, config_stamp(ws.config_path))  # as `handoffd serve` writes it
    record.write()
    try:
        code, said, loaded = loaded_by(finished, "ls")
    finally:
        record.remove()
    assert code == 0, said
    states = {line.split()[0]: line.split()[2] for line in said.splitlines()[1:]}
    assert states == {"held": "in-progress", "later": "pending", "first": "pending",
                      "s-ok": "completed", "s-bad": "failed"}, said
    assert not loaded & {"logging", "handoffd.core.procs", "handoffd.features.contracts.contract",
                         "handoffd.features.contracts.reservations"}
    assert {"handoffd.core.liveness", "handoffd.core.procstat",
            "handoffd.features.contracts.feature", "handoffd.features.dependencies"} <= loaded


def test_the_contracts_gate_loads_a_contract_when_one_is_carried(tmp_path: Path) -> None:
    """The contracts gate loads :mod:`.contract` and makes its reservations only once a handoff
    carries a contract (here one that cannot be used), and its verdict is the one it always was.
    In a fresh interpreter: this test process has loaded every module already (review RB)."""
    script = f"""
import sys
from handoffd.core.documents import Envelope
from handoffd.core.workspace import Workspace
from handoffd.features.build import build_engine
from handoffd.features.contracts.feature import Enforcer, parse

CONTRACT = "handoffd.features.contracts.contract"
ws = Workspace({str(tmp_path / "ws")!r})
ws.ensure()
eng = build_engine(ws, features=())
enforcer = Enforcer(eng)
plain = Envelope(handoff_id="h1", dialect="native", target="@b")
assert parse(plain) is None and enforcer.gate(eng, plain, {{}}) is None
assert CONTRACT not in sys.modules and "reservations" not in vars(enforcer), "loaded early"
carrying = Envelope(handoff_id="h2", dialect="native", target="@b", contract="not an object")
verdict = enforcer.gate(eng, carrying, {{}})
assert verdict is not None and "contract must be an object" in str(verdict), verdict
assert CONTRACT in sys.modules
first = enforcer.reservations
assert enforcer.reservations is first and vars(enforcer)["reservations"] is first
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---------------------------------------------------------------- session 30 (E): ls's gates alone
# what a pending row's note never needs unless a parked parent is listed: orchestration's making
# of children and aggregation, cancellation's family walk, the contracts' violations log, the
# process records (a serving daemon's)
NOT_FOR_NOTES = {f"handoffd.features.{name}" for name in (
    "orchestration", "aggregation", "answer_copies", "childfacts", "children", "delegation",
    "clarification", "cancellation", "cancel_family", "artifacts", "artifact_paths", "stores")}
NOT_FOR_NOTES |= {"handoffd.core.procrecords"}
DELEGATING = '''
def delegate(handoff, ctx):
    return {"status": "delegated", "aggregation": "all_success",
            "delegate": [{"to": "@held", "data": {"n": 1}}, {"to": "@held", "data": {"n": 2}}]}


def ask(handoff, ctx):
    return {"status": "needs_clarification", "questions": ["which one?"]}


def done(handoff, ctx):
    return {"status": "completed"}
'''


def notes_of(root: Path, env: dict[str, str]) -> dict[str, str]:
    """Each row's note as `handoff ls --json` gives it (``env``: which command line)."""
    proc = subprocess.run([exe("handoff"), "ls", "--json", "--root", str(root)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return {row["id"]: row["note"] for row in json.loads(proc.stdout)}


def test_ls_with_pending_rows_installs_the_features_gates_alone(tmp_path: Path) -> None:
    """`handoff ls` with pending rows installs the features' gates alone (build.GATES): the
    same gates, in the same order, as an engine with every feature, without orchestration's
    aggregation and making of children (about 15 modules), cancellation's family walk or the
    process records. A parked parent's row loads what reads its children, and only then. The
    notes are the full command line's (every feature installed) either way."""
    root = tmp_path / "ws"
    root.mkdir()
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "e30.py").write_text(DELEGATING)
    (root / "handoffd.toml").write_text(QUICK_TOML + "".join(
        f'\n[specialists."{agent}"]\nhandler = "e30:{handler}"\n'
        for agent, handler in (("@deleg", "delegate"), ("@ask", "ask"), ("@held", "done"),
                               ("@plain", "done"))))
    Workspace(root).ensure()
    env = {**QUICK, "PYTHONPATH": str(tmp_path / "handlers")}

    def handoff(*argv: str) -> None:
        made = subprocess.run([exe("handoff"), *argv, "--root", str(root)], capture_output=True,
                              text=True, timeout=60, env=env)
        assert made.returncode == 0, made.stderr

    handoff("pause", "@held", "--reason", "not yet")
    for argv in (["--to", "@plain", "--id", "first"], ["--to", "@nobody", "--id", "none"],
                 ["--to", "@plain", "--id", "later", "--depends-on", "first"],
                 ["--to", "@held", "--id", "held"]):
        handoff("create", *argv)
    code, said, loaded = loaded_by(root, "ls")
    assert code == 0 and "later" in said, said
    assert not loaded & NOT_FOR_NOTES, loaded & NOT_FOR_NOTES
    assert {"handoffd.features.dependencies", "handoffd.features.parked_gates",
            "handoffd.features.cancel_requests"} <= loaded
    notes = notes_of(root, env)
    assert notes == notes_of(root, {**env, "HANDOFFD_FULL_CLI": "1"})
    assert notes["later"] == "waiting for dependency first (pending)", notes
    assert notes["held"].startswith("paused: @held") and "registered" in notes["none"], notes

    # a parent parked for its children (which wait for @held's pause), a handoff parked for
    # its requester's answer: their gates read what they wait for
    handoff("create", "--to", "@deleg", "--id", "parent")
    handoff("create", "--to", "@ask", "--id", "asking")
    assert subprocess.run([exe("handoffd"), "run", "-q", "--max-seconds", "20", "--root",
                           str(root)], capture_output=True, timeout=60, env=env).returncode == 0
    code, said, loaded = loaded_by(root, "ls", "--json")
    assert code == 0, said
    notes = {row["id"]: row["note"] for row in json.loads(said)}
    assert notes == notes_of(root, {**env, "HANDOFFD_FULL_CLI": "1"})
    assert notes["parent"].startswith("waiting for 2 of 2 children (all_success)"), notes
    assert notes["asking"].startswith("waiting on the requester"), notes
    assert "handoffd.features.aggregation" in loaded  # (the children gate's ready)
    assert not loaded & {"handoffd.features.orchestration", "handoffd.features.children",
                         "handoffd.features.cancellation"}
