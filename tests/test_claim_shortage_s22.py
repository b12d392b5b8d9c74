"""A passing shortage while claiming costs no attempt (helper P4, session 22, note 20).

Descriptors (EMFILE, ENFILE) or memory (ENOMEM, a MemoryError) running short between the
claim's lock and its lease write (opening the lock descriptor, reading and parsing the renamed
document, the lease write's temp file) once left the document in in-progress/ without a lease:
an "unexpected error" with a traceback (or an error line) counted against the batch, the
handoff stuck until the sweep's claim grace. Now the claim is put back in pending/ at once, as
it came, uncounted, with one warning line and a back-off (the memory back-off for a
MemoryError, counted as a strike: set aside only after the strikes' bound), and the handoff
runs normally once the shortage has passed.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import Clock
from test_start_shortage_s20 import _engine as shortage_engine
from test_start_shortage_s20 import FailFirst, _submit

from handoffd import Daemon
from handoffd.backends.files import fsio, leases
from handoffd.core import jsontext, memorystrikes
from handoffd.core.documents import book
from handoffd.core.engine import Engine
from handoffd.core.errors import ClaimShortage, ErrorCode
from handoffd.core.memorystrikes import memory_strikes
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State

ANSWER = "import json; print(json.dumps({'status': 'completed', 'output': {'ok': True}}))"
COMMAND = [sys.executable, "-S", "-c", ANSWER]


def command_workspace(root: Path) -> tuple[Path, str]:
    """A workspace at ``root`` (durability fast) whose @cmd specialist runs COMMAND, with one
    handoff for it made by a real ``handoff create``: (root, its id)."""
    import subprocess

    from conftest import exe
    root.mkdir()
    (root / "handoffd.toml").write_text('[daemon]\ndurability = "fast"\n'
                                        f'[specialists."@cmd"]\ncommand = {json.dumps(COMMAND)}\n')
    hid = subprocess.run([exe("handoff"), "create", "--root", str(root), "--to", "@cmd",
                          "--data", "{}"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    return root, hid


def FailIn(real: Callable[..., Any], caller: str, times: int,  # noqa: N802 (a FailFirst)
           error: Callable[[], BaseException]) -> FailFirst:
    """:class:`FailFirst` for the first ``times`` calls made from a function named ``caller``
    (frame 2: this ``when``'s caller is FailFirst.__call__, whose caller is the code tested)."""
    return FailFirst(real, times, error,
                     when=lambda *_a, **_k: sys._getframe(2).f_code.co_name == caller)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(autouse=True)
def short_memory_backoff(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A 0.2 s memory back-off (a batch waits it out); strikes forgotten after the test."""
    monkeypatch.setattr(memorystrikes, "MEMORY_BACKOFF_SECONDS", 0.2)
    yield
    memory_strikes.clock = __import__("time").monotonic
    memory_strikes._rows.clear()


def _engine(root: Path, clock: Clock) -> Engine:
    """An engine whose @cmd specialist answers completed (the start-shortage tests' engine)."""
    return shortage_engine(root, COMMAND, clock)


def _ran_once_uncounted(engine: Engine, hid: str, report: Any) -> None:
    """The batch ran ``hid`` once, as its first attempt, and counted no error."""
    assert report.errors == 0 and report.completed == 1 and report.failed == 0, report
    state, doc = engine.get(hid)
    assert state is State.COMPLETED and doc["output"] == {"ok": True}
    assert doc["handoffd"]["attempt"] == 1
    assert [e["event"] for e in book(doc)["history"]] == ["created", "claimed", "completed"]
    assert not list((engine.ws.handoffs / "in-progress").iterdir())


def _said(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cannot be claimed for now" in
            r.getMessage()]


# ---------------------------------------------------------------- item 1: a MemoryError


def test_a_memory_error_parsing_a_claim_puts_it_back_uncounted(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """It went to Attempts.unexpected (a traceback, the batch's error), the document left in
    in-progress/ unleased for the sweep."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    parse = FailIn(jsontext.parse_document, "_read_claimed", 1, MemoryError)
    monkeypatch.setattr(jsontext, "parse_document", parse)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert parse.raised == 1
    _ran_once_uncounted(engine, hid, report)
    said = _said(caplog)
    assert len(said) == 1 and "MemoryError" in said[0] and "uncounted" in said[0], said
    assert not any(r.exc_info for r in caplog.records)  # no traceback
    assert memory_strikes.backoff(hid) == 0.0  # the claim that worked ended the row


def test_memory_errors_claiming_set_it_aside_only_after_the_strikes_bound(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    parse = FailIn(jsontext.parse_document, "_read_claimed", 99, MemoryError)
    monkeypatch.setattr(jsontext, "parse_document", parse)
    now = [1000.0]
    memory_strikes.clock = lambda: now[0]
    for strike in range(1, memorystrikes.MEMORY_STRIKES):
        with pytest.raises(ClaimShortage) as caught:
            engine.claim(hid)
        assert caught.value.reason == "MemoryError" and caught.value.delay > 0
        assert engine.get(hid)[0] is State.PENDING  # back as it came, uncounted
        assert book(engine.get(hid)[1]).get("attempt", 0) == 0
        assert memory_strikes.backoff(hid) > 0  # the scheduler skips it meanwhile
        now[0] += memorystrikes.MEMORY_PATIENCE_SECONDS / 3
    assert engine.claim(hid) is None  # the 5th, over 5 minutes: set aside for good
    state, doc = engine.get(hid)
    assert state is State.FAILED and doc["error"]["code"] == ErrorCode.UNPROCESSABLE_DOCUMENT
    assert "ran out of memory" in doc["error"]["message"]
    assert parse.raised == memorystrikes.MEMORY_STRIKES


# ---------------------------------------------------------------- item 2: EMFILE and co.


def _fail_at(step: str, code: int, monkeypatch: pytest.MonkeyPatch) -> FailIn:
    """Make the claim's ``step`` fail once with OSError ``code``."""
    def error() -> OSError:
        return OSError(code, os.strerror(code))
    if step == "lock":  # opening the lock descriptor (before the rename)
        fail = FailIn(os.open, "lock_document", 1, error)
        monkeypatch.setattr(leases.os, "open", fail)
    elif step == "read":  # reading the renamed document through its lock
        fail = FailIn(fsio.read_open, "_read_claimed", 1, error)
        monkeypatch.setattr(fsio, "read_open", fail)
    else:  # the lease write's temp file
        fail = FailIn(fsio.replace_exact, "claim_held", 1, error)
        monkeypatch.setattr(fsio, "replace_exact", fail)
    return fail


@pytest.mark.parametrize("step", ["lock", "read", "lease"])
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_a_descriptor_shortage_at_each_claim_step_puts_it_back_uncounted(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any,
        step: str, code: int) -> None:
    """It stayed in in-progress/ for the sweep (lock, read: an error counted against the
    batch), or was put back as a full disk is, counted an error and held off 5 s (lease)."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    fail = _fail_at(step, code, monkeypatch)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert fail.raised == 1
    _ran_once_uncounted(engine, hid, report)
    said = _said(caplog)
    assert len(said) == 1, said
    assert errno.errorcode[code] in said[0] and "claimed again in 1s" in said[0], said
    assert "uncounted" in said[0]
    if code == errno.EMFILE:
        assert "ulimit -n" in said[0]
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


@pytest.mark.parametrize("step", ["lock", "read", "lease"])
def test_the_store_leaves_the_document_in_pending(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Right after the failed claim: pending/ holds the document as it came, in-progress/
    nothing, and no lock is left held (the next claim takes it)."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    before = (engine.ws.handoffs / "pending" / f"{hid}.json").read_bytes()
    _fail_at(step, errno.EMFILE, monkeypatch)
    with pytest.raises(ClaimShortage) as caught:
        engine.claim(hid)
    assert caught.value.reason == "EMFILE" and caught.value.delay == 0.0
    assert (engine.ws.handoffs / "pending" / f"{hid}.json").read_bytes() == before
    assert not list((engine.ws.handoffs / "in-progress").iterdir())
    claimed = engine.claim(hid)
    assert claimed is not None and claimed[0].attempt == 1


def test_a_shortage_that_lasts_backs_off_doubling(
        tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Two shortages in a row: 1 s, then 2 s; the batch waits both out and runs it."""
    engine = _engine(tmp_path / "ws", clock)
    hid = _submit(engine)
    fail = FailIn(fsio.read_open, "_read_claimed", 2,
                  lambda: OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    monkeypatch.setattr(fsio, "read_open", fail)
    caplog.set_level(logging.INFO, "handoffd")
    report = Daemon(engine, workers=2, watch=False).run_batch()
    assert fail.raised == 2
    _ran_once_uncounted(engine, hid, report)
    said = _said(caplog)
    assert [s.rsplit("claimed again in ", 1)[1] for s in said] == ["1s", "2s"], said


# ---------------------------------------------------------------- a real daemon

# run in the daemon's process before `handoffd serve`: the claim of s-lock fails once opening
# its lock descriptor (EMFILE), s-read's once reading it (ENFILE), s-lease's once at its lease
# write's temp file (EMFILE), s-mem's once parsing it (MemoryError), each at that exact step
PATCH = """
import errno, os, sys
from handoffd.backends.files import fsio
from handoffd.core import jsontext, memorystrikes
memorystrikes.MEMORY_BACKOFF_SECONDS = 0.5

def once(real, caller, mine, error):
    failed = []
    def call(*args, **kwargs):
        frame = sys._getframe(1)
        if not failed and frame.f_code.co_name == caller and mine(frame):
            failed.append(1)
            raise error()
        return real(*args, **kwargs)
    return call

def emfile():
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE))

os.open = once(os.open, "lock_document",
               lambda f: "s-lock" in str(f.f_locals.get("path", "")), emfile)
fsio.read_open = once(fsio.read_open, "_read_claimed",
                      lambda f: f.f_locals.get("handoff_id") == "s-read",
                      lambda: OSError(errno.ENFILE, os.strerror(errno.ENFILE)))
fsio.replace_exact = once(fsio.replace_exact, "claim_held",
                          lambda f: f.f_locals.get("handoff_id") == "s-lease", emfile)
jsontext.parse_document = once(jsontext.parse_document, "_read_claimed",
                               lambda f: f.f_locals.get("handoff_id") == "s-mem", MemoryError)
from handoffd.cli.handoffd_cmd import main
sys.argv[0] = "handoffd"
sys.exit(main())
"""
DAEMON_TOML = f"""
[daemon]
workers = 2
settle_seconds = 0.2
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5

[specialists."@cmd"]
command = {json.dumps(COMMAND)}
"""


@pytest.mark.heavy
def test_a_daemon_puts_each_short_claim_back_and_runs_it_once(tmp_path: Path) -> None:
    import subprocess

    from conftest import new_workspace
    ws = new_workspace(tmp_path / "ws", DAEMON_TOML)
    proc = subprocess.Popen([sys.executable, "-c", PATCH, "serve", "--root", str(ws.root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ws.daemons.append(proc)
    ids = ["s-lock", "s-read", "s-lease", "s-mem"]
    try:
        for hid in ids:
            ws.drop(f"{hid}.json", new_native_request(source="@test", target="@cmd", data={},
                                                      handoff_id=hid, now=Clock()()))
        for hid in ids:
            ws.wait_state(hid, ("completed", "failed"), timeout=60)
    finally:
        ws.stop(proc)
        ws.cleanup()
    assert proc.stderr is not None
    said = proc.stderr.read()
    assert [hid for hid in ids if ws.state_of(hid) != ["completed"]] == [], said
    for hid in ids:
        block = ws.doc(hid)["handoffd"]
        assert block["attempt"] == 1, (hid, said)
        assert [e["event"] for e in block["history"]] == ["claimed", "completed"], (hid, said)
    lines = [line for line in said.splitlines() if "cannot be claimed for now" in line]
    assert sorted(line.split("handoff ", 1)[1].split(":", 1)[0] for line in lines) == \
        sorted(ids), said
    assert "ERROR" not in said and "Traceback" not in said and "recovered" not in said, said
    assert "ulimit -n" in said and "ENFILE" in said and "MemoryError" in said
