"""Two shortage gaps left in session 22 (helper S2, session 23).

1. A claim whose admission ran short (EMFILE loading a schema) is handed back; when that
   hand-back's own write ran short too, the claim was given up: left leased in in-progress/,
   the batch ended with an error (exit 1), and the next process's recovery took it for a crash
   (an attempt charged, the specialist a suspect). Now the claim is kept, still leased, and
   handed back after the back-off; a batch waits for it and runs the handoff, uncounted.
2. An isolated Python handler (``isolate = "always"``) whose module import ran short of
   descriptors or memory in its process failed the handoff for good (a ConfigError). Now its
   process says ``not_started`` and the attempt is handed back uncounted, as an in-process
   handler's is; any other import failure still fails it.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Clock, exe
from test_claim_shortage_s22 import _engine, _submit, command_workspace
from test_start_shortage_s20 import FailFirst

from handoffd import Daemon
from handoffd.backends.files import store as store_module
from handoffd.core import validation
from handoffd.core.documents import book
from handoffd.core.specialists import HandlerContext
from handoffd.core.starts import not_started
from handoffd.core.states import State


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _emfile() -> OSError:
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def _short_twice(monkeypatch: pytest.MonkeyPatch, hand_backs: int) -> tuple[FailFirst, FailFirst]:
    """The first schema load fails with EMFILE, and so do the first ``hand_backs`` writes into
    pending/ (the hand-back's)."""
    load = FailFirst(validation.load_builtin, 1, _emfile)
    monkeypatch.setattr(validation, "load_builtin", load)  # (the engine's schema cache is new)
    write = FailFirst(store_module.fsio.create_exclusive, hand_backs, _emfile,
                      when=lambda path, *a, **k: Path(path).parent.name == "pending")
    monkeypatch.setattr(store_module.fsio, "create_exclusive", write)
    return load, write


def _names(engine: Any, hid: str) -> list[str]:
    return [e["event"] for e in book(engine.get(hid)[1])["history"]]


# ---------------------------------------------------------------- 1. admission's double fault


def test_a_hand_back_that_runs_short_too_keeps_the_claim_and_the_batch_runs_it(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """It was given up: the batch ended with it leased in in-progress/ and an error."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    load, write = _short_twice(monkeypatch, 1)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=1, watch=False).run_batch()
    assert load.raised == 1 and write.raised == 1
    assert report.errors == 0 and report.completed == 1 and report.handed_back == 0, report
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and book(doc)["attempt"] == 1  # uncounted
    assert _names(engine, hid) == ["created", "claimed", "handed_back", "claimed", "completed"]
    assert book(doc)["history"][2]["detail"]["not_started"] == "EMFILE"
    said = [r.getMessage() for r in caplog.records if "nor handed back" in r.getMessage()]
    assert len(said) == 1 and "kept, uncounted" in said[0], said
    assert not any(r.exc_info for r in caplog.records)  # no traceback
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)
    assert not list((engine.ws.handoffs / "in-progress").iterdir())


def test_a_claim_kept_too_long_is_given_up_and_handed_back_uncounted(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shortage that outlasts most of the lease: the kept claim (its lease not renewed) is
    given up before it lapses; this process's sweep hands it back uncounted, no crash."""
    engine = _engine(tmp_path / "ws", clock)
    from handoffd.service import shortclaims  # (new in session 23)
    engine.settings.lease_seconds = 1.5  # (given up after 0.8 * 1.5 s)
    hid = _submit(engine)
    _short_twice(monkeypatch, 99)
    monkeypatch.setattr(shortclaims, "shortage_backoff", lambda streak: 0.2)
    daemon = Daemon(engine, workers=1, watch=False)
    report = daemon.run_batch()
    assert report.completed == 0 and report.failed == 0 and report.errors == 1  # (said)
    state, doc = engine.get(hid)
    assert state is State.IN_PROGRESS and book(doc)["attempt"] == 1  # given up, still leased
    monkeypatch.undo()  # the shortage passes
    report = Daemon(engine, workers=1, watch=False).run_batch()  # its sweep recovers it
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and book(doc)["attempt"] == 1, _names(engine, hid)
    assert "retry_scheduled" not in _names(engine, hid) and "failed" not in _names(engine, hid)
    assert "@cmd" not in engine.suspects  # no crash: nothing runs isolated for it


def test_a_stop_hands_a_kept_claim_back(tmp_path: Path, clock: Clock,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that ends while a claim is kept (--max-seconds) hands it back, one last try."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    _, write = _short_twice(monkeypatch, 1)
    from handoffd.service import shortclaims  # (new in session 23)
    monkeypatch.setattr(shortclaims, "shortage_backoff", lambda streak: 60.0)
    monkeypatch.setattr("handoffd.service.attempts.handbacks.shortage_backoff",
                        lambda streak: 60.0)
    began = time.monotonic()
    report = Daemon(engine, workers=1, watch=False).run_batch(max_seconds=1.0)
    assert time.monotonic() - began < 30
    assert write.raised == 1 and report.errors == 0
    state, doc = engine.get(hid)
    assert state is State.PENDING and book(doc).get("attempt", 0) == 0, _names(engine, hid)
    assert _names(engine, hid) == ["created", "claimed", "handed_back"]


DOUBLE_FAULT = """
import errno, os, sys
from pathlib import Path
from handoffd.core import validation
from handoffd.backends.files import store
from handoffd.cli.handoffd_cmd import main

def once(real, when):
    state = {"left": 1}
    def call(*args, **kwargs):
        if state["left"] and when(*args):
            state["left"] -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(*args, **kwargs)
    return call

validation.load_builtin = once(validation.load_builtin, lambda *a: True)
store.fsio.create_exclusive = once(store.fsio.create_exclusive,
                                   lambda path, *a: Path(path).parent.name == "pending")
sys.argv = ["handoffd", "run", "--root", sys.argv[1]]
main()
"""


def test_a_real_batch_runs_a_claim_whose_admission_and_hand_back_ran_short(
        tmp_path: Path) -> None:
    ws, hid = command_workspace(tmp_path / "ws")
    done = subprocess.run([sys.executable, "-c", DOUBLE_FAULT, str(ws)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("nor handed back to pending/") == 1, done.stderr
    filed = (ws / "handoffs" / "completed" / f"{hid}.json")
    assert filed.exists() and not list((ws / "handoffs" / "in-progress").iterdir())
    doc = json.loads(filed.read_text())
    assert doc["handoffd"]["attempt"] == 1
    assert [e["event"] for e in doc["handoffd"]["history"]] == [
        "created", "claimed", "handed_back", "claimed", "completed"]


# ---------------------------------------------------------------- 2. isolated import shortages

SHORT_MODULE = """
import errno, os
_MARK = os.path.join(os.path.dirname(__file__), {mark!r})
if not os.path.exists(_MARK):
    open(_MARK, "w").close()
    {raise_it}

def handle(handoff, ctx):
    return {{"status": "completed", "output": {{"ok": True}}}}
"""
RAISES = {
    "emfile": 'raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "m.py")',
    "enfile": 'raise OSError(errno.ENFILE, os.strerror(errno.ENFILE), "m.py")',
    "nomem": "raise MemoryError()",
    "dlopen": 'raise ImportError("libx.so: cannot open shared object file: Too many open files")',
    "broken": 'raise ValueError("a real bug")',
}


def test_an_isolated_handler_whose_import_runs_short_is_handed_back_uncounted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the shortages runs the handoff after one uncounted hand-back; a bug in the
    module (any other import failure) still fails it, once, as a configuration error."""
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    config = '[daemon]\ndurability = "fast"\nworkers = 2\n'
    for name, raise_it in RAISES.items():
        (handlers / f"s23{name}.py").write_text(
            SHORT_MODULE.format(mark=f"{name}.raised", raise_it=raise_it))
        config += f'[specialists."@{name}"]\nhandler = "s23{name}:handle"\nisolate = "always"\n'
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "handoffd.toml").write_text(config)
    env = {**os.environ, "PYTHONPATH": str(handlers)}
    env.pop("HANDOFF_TARGET", None)
    env.pop("HANDOFFD_ROOT", None)
    ids = {}
    for name in RAISES:
        ids[name] = subprocess.run([exe("handoff"), "create", "--root", str(ws), "--to",
                                    f"@{name}", "--data", "{}"], capture_output=True, text=True,
                                   timeout=60, check=True, env=env).stdout.strip()
    done = subprocess.run([exe("handoffd"), "run", "--root", str(ws)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert "Traceback" not in done.stderr
    assert done.returncode == 1 and "completed 4, failed 1" in done.stderr, done.stderr
    for name, hid in ids.items():
        folder = "failed" if name == "broken" else "completed"
        doc = json.loads((ws / "handoffs" / folder / f"{hid}.json").read_text())
        events = [e for e in doc["handoffd"]["history"]]
        names = [e["event"] for e in events]
        assert doc["handoffd"]["attempt"] == 1, (name, names)
        if name == "broken":
            assert names == ["created", "claimed", "failed"]
            assert "cannot import handler" in doc["error"]["message"]
            assert "a real bug" in doc["error"]["message"]
            continue
        assert names == ["created", "claimed", "handed_back", "claimed", "completed"], name
        reason = events[2]["detail"]["not_started"]
        assert reason == {"emfile": "EMFILE", "enfile": "ENFILE", "nomem": "ENOMEM",
                          "dlopen": "EMFILE"}[name]
    # one line per shortage while it lasts (session 25): the two EMFILEs are one problem, the
    # second held back; each is said cleared once handlers start again
    assert done.stderr.count("handed back uncounted") == 3, done.stderr
    assert done.stderr.count("starting a handler works again") == 3, done.stderr


def test_a_not_started_message_must_name_a_shortage(tmp_path: Path) -> None:
    """What the child says is checked: a forged or garbled ``not_started`` breaks the protocol
    (a failure the retry policy counts), never an uncounted hand-back."""
    from handoffd.core.config import RetryPolicy, specialist_from_table
    from handoffd.core.isolation import _import_shortage  # (new in session 23)
    from handoffd.core.specialists import Specialist
    spec = Specialist(specialist_from_table("@py", {"handler": "m:f"}, RetryPolicy()))
    for given in ({"reason": "ENOENT", "why": "x"}, {"reason": "EMFILE"}, "EMFILE", None):
        ctx = HandlerContext(handoff_id="h", attempt=1, root=tmp_path, data={}, target="@py")
        error = _import_shortage(given, spec, ctx)
        assert "broke the protocol" in str(error) and not_started(ctx) is None
        assert not ctx.handback
    ctx = HandlerContext(handoff_id="h", attempt=1, root=tmp_path, data={}, target="@py")
    error = _import_shortage({"reason": "ENOMEM", "why": "out of memory importing it"}, spec, ctx)
    found = not_started(ctx)
    assert found is not None and found.reason == "ENOMEM" and ctx.handback
    assert "cannot start the handler of @py for now" in str(error)
